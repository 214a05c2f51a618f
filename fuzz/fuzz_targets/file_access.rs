//! The `/files` access check on arbitrary requests: it never panics, and nothing but
//! the right token or the exact signature gets in.
#![no_main]
use hutch_proto::access::{check_file_access, sign, FileAccess, Operation};
use libfuzzer_sys::fuzz_target;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\u{0}');
    let mut next = || parts.next().filter(|s| !s.is_empty());
    let (header, path, user, signature, expiration) = (next(), next().unwrap_or(""), next(), next(), next());
    let op = if data.first().is_some_and(|b| b & 1 == 1) { Operation::Write } else { Operation::Read };
    let req = FileAccess { header_token: header, path, user, signature, expiration, op, now: 1_000_000 };
    if check_file_access(TOKEN, &req).is_ok() {
        let exp = expiration.and_then(|e| e.parse::<u64>().ok());
        let signed = signature == Some(sign(path, op, user.unwrap_or(""), TOKEN, exp).as_str());
        assert!(header == Some(TOKEN) || (header.is_none() && signed), "let in without the token or its signature");
    }
});
