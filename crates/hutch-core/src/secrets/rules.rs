//! What a secret's name, metadata and value may be: E2B's rules (its API's `NewSecret`
//! and its server's name normalization), so the same requests pass and fail.
//! Messages name the field and the rule, never the value given.

use std::collections::BTreeMap;

/// Why a request was refused: a fixed sentence, safe to show and to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub &'static str);

pub const MAX_NAME: usize = 128;
pub const MAX_VALUE: usize = 64 * 1024;
pub const MAX_METADATA_ENTRIES: usize = 32;
pub const MAX_METADATA_KEY: usize = 128;
pub const MAX_METADATA_VALUE: usize = 1024;
pub const MAX_METADATA_TOTAL: usize = 8192;
/// Ids are `sec_` and 26 characters; a name may not look like one.
pub const ID_PREFIX: &str = "sec_";

/// A name as stored: trimmed and lower-cased, 1-128 of `[a-z0-9_-]`, not `sec_…`.
pub fn name(given: &str) -> Result<String, Invalid> {
    let name = given.trim().to_ascii_lowercase();
    if name.is_empty() || name.len() > MAX_NAME || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(Invalid("the secret's name must be 1-128 letters, digits, '-' or '_'"));
    }
    if name.starts_with(ID_PREFIX) {
        return Err(Invalid("a secret's name may not start with 'sec_', which ids start with"));
    }
    Ok(name)
}

/// What a path's `{secretID}` names: an id (`sec_…`, never read as a name) or a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    Id(String),
    Name(String),
}

pub fn selector(given: &str) -> Result<Selector, Invalid> {
    let s = given.trim().to_ascii_lowercase();
    if let Some(rest) = s.strip_prefix(ID_PREFIX) {
        let ok = rest.len() == 26 && rest.bytes().all(|b| CROCKFORD.contains(&b));
        return if ok { Ok(Selector::Id(s)) } else { Err(Invalid("a secret id is 'sec_' and 26 letters and digits")) };
    }
    name(&s).map(Selector::Name)
}

pub fn value(given: &str) -> Result<(), Invalid> {
    if given.is_empty() {
        return Err(Invalid("the secret's value must not be empty"));
    }
    if given.len() > MAX_VALUE {
        return Err(Invalid("the secret's value is larger than 64 KiB"));
    }
    Ok(())
}

pub fn metadata(given: &BTreeMap<String, String>) -> Result<(), Invalid> {
    if given.len() > MAX_METADATA_ENTRIES {
        return Err(Invalid("a secret's metadata may have at most 32 entries"));
    }
    if given.keys().any(|k| k.is_empty() || k.len() > MAX_METADATA_KEY) {
        return Err(Invalid("each metadata key must be 1-128 bytes"));
    }
    if given.values().any(|v| v.len() > MAX_METADATA_VALUE) {
        return Err(Invalid("each metadata value must be at most 1024 bytes"));
    }
    if given.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() > MAX_METADATA_TOTAL {
        return Err(Invalid("a secret's metadata must be at most 8192 bytes in all"));
    }
    Ok(())
}

/// Crockford's base32, lower case (what E2B's TypeIDs use).
const CROCKFORD: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";

/// A new id: `sec_` and 26 characters of 128 bits, the first 48 the time in
/// milliseconds (ids sort in the order secrets were made, which listing pages by),
/// the rest random.
pub fn new_id() -> String {
    let millis = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    let random: u128 = rand::random::<u128>() >> 48;
    let bits = ((millis & ((1 << 48) - 1)) << 80) | random;
    // 26 characters carry 130 bits: the first takes the top 3 of the 128 (two zeros).
    let text: String = (0..26).rev().map(|i| CROCKFORD[((bits >> (i * 5)) & 31) as usize] as char).collect();
    format!("{ID_PREFIX}{text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_e2bs_rules() {
        assert_eq!(name("  OpenAI_key-2 "), Ok("openai_key-2".to_string()));
        for bad in ["", " ", "a b", "a.b", "ünï", "sec_x", "SEC_x", &"a".repeat(129)] {
            assert!(name(bad).is_err(), "{bad:?} passed");
        }
        assert_eq!(name(&"a".repeat(128)).map(|n| n.len()), Ok(128));
    }

    #[test]
    fn a_selector_starting_with_sec_is_an_id_or_nothing() {
        let id = new_id();
        assert_eq!(selector(&id.to_uppercase().replace("SEC_", "sec_")), Ok(Selector::Id(id.clone())));
        assert_eq!(selector(" OpenAI "), Ok(Selector::Name("openai".into())));
        assert!(selector("sec_short").is_err(), "an id-like selector fell back to a name");
        assert!(selector("sec_ilou0000000000000000000000").is_err(), "letters outside Crockford's alphabet");
    }

    #[test]
    fn ids_are_distinct_well_formed_and_sort_by_time() {
        let a = new_id();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = new_id();
        assert!(a < b, "{a} !< {b}");
        for id in [&a, &b] {
            assert!(matches!(selector(id), Ok(Selector::Id(_))), "{id}");
        }
    }

    #[test]
    fn values_and_metadata_are_bounded() {
        assert!(value("").is_err());
        assert!(value(&"x".repeat(MAX_VALUE)).is_ok());
        assert!(value(&"x".repeat(MAX_VALUE + 1)).is_err());
        let many: BTreeMap<String, String> = (0..33).map(|i| (format!("k{i}"), "v".into())).collect();
        assert!(metadata(&many).is_err());
        let big: BTreeMap<String, String> = (0..9).map(|i| (format!("k{i}"), "v".repeat(1000))).collect();
        assert!(metadata(&big).is_err(), "more than 8192 bytes in all passed");
        assert!(metadata(&BTreeMap::from([(String::new(), "v".into())])).is_err());
        assert!(metadata(&BTreeMap::from([("team".into(), "ml".into())])).is_ok());
    }
}
