//! Identifier and unit newtypes.

use rand::Rng;
use std::fmt;

/// A sandbox id: "i" + 20 of [a-z0-9], as E2B makes them (no '-' or '.', so it can sit
/// in a `<port>-<id>.<domain>` host name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId(String);

impl SandboxId {
    pub fn generate() -> Self {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        let mut rng = rand::thread_rng();
        let tail: String = (0..20).map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char).collect();
        SandboxId(format!("i{tail}"))
    }

    pub fn parse(s: &str) -> Option<Self> {
        let ok = !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        ok.then(|| SandboxId(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Guest memory in MiB, within what a microVM can usefully have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemMib(u32);

impl MemMib {
    pub const MIN: u32 = 128;
    pub const MAX: u32 = 65536;
    pub const DEFAULT: MemMib = MemMib(512);

    pub fn new(mib: u32) -> Result<Self, String> {
        if (Self::MIN..=Self::MAX).contains(&mib) {
            Ok(MemMib(mib))
        } else {
            Err(format!("memory must be between {} and {} MiB, got {mib}", Self::MIN, Self::MAX))
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }

    /// What a sandbox of `template` gets when no size is asked for: the template's
    /// own (E2B's model), else `DEFAULT`.
    pub fn of_template(template: &str) -> MemMib {
        hutch_image::recipes::memory_mib(hutch_image::tags::split(template).0).and_then(|m| MemMib::new(m).ok()).unwrap_or(Self::DEFAULT)
    }
}

/// A size in MiB from `512`, `512M`, `512MiB`, `2G` or `2GiB`; `what` names it in
/// the error ("memory size", "disk size").
pub fn parse_mib(s: &str, what: &str) -> Result<u32, String> {
    let lower = s.trim().to_ascii_lowercase();
    let (num, mult) = if let Some(n) = lower.strip_suffix("gib").or_else(|| lower.strip_suffix('g')) {
        (n, 1024)
    } else if let Some(n) = lower.strip_suffix("mib").or_else(|| lower.strip_suffix('m')) {
        (n, 1)
    } else {
        (lower.as_str(), 1)
    };
    let n: u32 = num.trim().parse().map_err(|_| format!("'{s}' is not a {what}; use MiB like 512, or 512M or 2G"))?;
    n.checked_mul(mult).ok_or_else(|| format!("'{s}' is too large"))
}

/// [`parse_mib`] for a disk size (clap's value parser).
pub fn parse_disk_mib(s: &str) -> Result<u32, String> {
    parse_mib(s, "disk size")
}

impl std::str::FromStr for MemMib {
    type Err = String;
    /// Accepts `512`, `512M`, `512MiB`, `2G`, `2GiB`.
    fn from_str(s: &str) -> Result<Self, String> {
        MemMib::new(parse_mib(s, "memory size")?)
    }
}

/// A new secret token (an envd access token, a port traffic token): 32 random bytes as
/// 64 lowercase hex digits.
pub fn random_token() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_e2b_shaped() {
        let id = SandboxId::generate();
        assert_eq!(id.as_str().len(), 21);
        assert!(SandboxId::parse(id.as_str()).is_some());
        assert!(SandboxId::parse("a-b").is_none());
        assert!(SandboxId::parse("../x").is_none());
    }

    #[test]
    fn memory_sizes() {
        assert_eq!("512".parse::<MemMib>().map(MemMib::get), Ok(512));
        assert_eq!("2G".parse::<MemMib>().map(MemMib::get), Ok(2048));
        assert_eq!("256MiB".parse::<MemMib>().map(MemMib::get), Ok(256));
        assert!("12".parse::<MemMib>().is_err());
        assert!("lots".parse::<MemMib>().is_err());
        assert!("-5".parse::<MemMib>().is_err());
    }
}
