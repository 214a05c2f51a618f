//! The console ring on an arbitrary stream in arbitrary chunks: the ring never holds
//! more than its cap, kept plus dropped is everything written, the newest bytes are kept.
#![no_main]
use hutch_vmm::console::{dropped, read, Ring};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, stream)) = data.split_first() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("console.log");
    let cap = 64;
    let mut ring = Ring::open(&path, cap).expect("open");
    for chunk in stream.chunks(usize::from(split % 17).max(1)) {
        ring.append(chunk).expect("append");
    }
    let kept = read(&path);
    assert!(kept.len() as u64 <= cap);
    assert_eq!(kept.len() as u64 + dropped(&path), stream.len() as u64);
    assert!(stream.ends_with(&kept));
});
