//! A pause's state file as a compromised QEMU could leave it in the sandbox directory:
//! reading it never panics, never allocates more than the file holds, and whatever it
//! accepts has runs inside RAM, in order, that account for the file up to the device
//! state (which starts with QEMU's magic).
#![no_main]
use hutch_vmm::saved_state::{read, Form};
use libfuzzer_sys::fuzz_target;
use std::io::Write;

const PAGE: u64 = 4096;
/// The VM's RAM, which a state must have been saved from (1 MiB: 256 pages).
const RAM: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut file = tempfile::tempfile().expect("tempfile");
    file.write_all(data).expect("write");
    let Ok(state) = read(&mut file, PAGE, RAM) else { return };
    let len = data.len() as u64;
    assert!(len <= RAM + RAM / 256 + (64 << 20) + 64 * (64 << 20));
    assert!(state.stream_at() + 4 <= len);
    assert_eq!(&data[state.stream_at() as usize..state.stream_at() as usize + 4], b"QEVM");
    if let Form::Changes(c) = state.form {
        let mut end = 0;
        for run in &c.runs {
            assert!(run.pages > 0 && run.first >= end);
            end = run.first + run.pages;
            assert!(end * PAGE <= c.ram_bytes);
        }
        assert_eq!(c.pages_at + c.pages() * PAGE, c.devices_at);
        assert!(c.pages_at >= 40 + 16 * c.runs.len() as u64);
    }
});
