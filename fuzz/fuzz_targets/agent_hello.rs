//! The channel hello scanner on arbitrary bytes: it never panics, an index it returns
//! lies inside the buffer, and a hello appended after any garbage is found.
#![no_main]
use hutch_proto::agent::{find_hello, hello_line};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((end, _)) = find_hello(data) {
        assert!(end <= data.len());
    }
    let mut buf = data.to_vec();
    buf.push(b'\n');
    buf.extend_from_slice(&hello_line(0x5eed));
    let (end, _) = find_hello(&buf).expect("a hello after a newline is found");
    assert!(end <= buf.len());
});
