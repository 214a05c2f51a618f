//! The placeholder scanner on arbitrary guest bytes (`hutch_net::scan`): it never
//! panics, and a stream cut into chunks of any size finds a marker the whole holds as
//! written or in base64, wherever the cuts fall.
#![no_main]
use hutch_net::scan::{find, Form, Scanner};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&size, bytes)) = data.split_first() else { return };
    let whole = find(bytes);
    let mut scanner = Scanner::default();
    let mut streamed = None;
    for chunk in bytes.chunks(usize::from(size).max(1)) {
        streamed = streamed.or(scanner.feed(chunk));
    }
    if matches!(whole, Some(Form::Plain | Form::Base64)) {
        assert!(streamed.is_some(), "{whole:?} in the whole, nothing in chunks of {size}");
    }
});
