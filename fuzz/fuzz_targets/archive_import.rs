//! Snapshot archive import on arbitrary bytes: it never panics, and whatever it
//! refuses or accepts, it writes no more than the input declares it may.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("tempdir");
    let _ = hutch_formats::archive::import(data, dir.path());
    let written: u64 = std::fs::read_dir(dir.path())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .sum();
    // Holes are skipped: a small input cannot allocate much more than its own size.
    assert!(written <= data.len() as u64 + (1 << 20), "{written} bytes allocated from {} bytes of input", data.len());
});
