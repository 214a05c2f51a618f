//! Egress rules from untrusted API bodies and command lines: parsing never panics, and
//! a rule that parses prints as text that parses back to the same rule.
#![no_main]
use hutch_net::{Policy, Rule};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(rule) = Rule::parse(text) {
        let printed = rule.to_string();
        assert_eq!(Rule::parse(&printed).as_ref(), Ok(&rule), "{text:?} printed as {printed:?}");
    }
    if let Ok(policy) = Policy::parse(text) {
        assert_eq!(Policy::parse(&policy.to_string()).as_ref(), Ok(&policy));
    }
});
