//! E2B's `network.rules` and header templates as a tenant writes them, on arbitrary
//! input: parsing never panics, a placeholder's name is one a secret can have, and every
//! accepted header value is one a header can carry.
#![no_main]
use hutch_net::inspect::transforms::{parse_value, Part, Transforms};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(parts) = parse_value(text) {
        for part in &parts {
            if let Part::Secret(name) = part {
                assert!(!name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'));
            }
        }
    }
    if let Ok(json) = serde_json::from_str::<serde_json::Value>(text) {
        if let Ok(rules) = Transforms::from_e2b(&json) {
            for value in rules.hosts.values().flat_map(|h| h.values()) {
                assert!(http::HeaderValue::from_str(value).is_ok());
                assert!(parse_value(value).is_ok());
            }
        }
    }
});
