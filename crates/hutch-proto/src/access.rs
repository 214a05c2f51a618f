//! The envd access token and E2B's signed file URLs.
//!
//! A secure sandbox's agent accepts a request when it carries the sandbox's token in
//! `X-Access-Token`; `/files` also accepts a URL signed with that token, so a browser or
//! `curl` can fetch or upload one file without holding the token. The signature is
//! E2B's v1: `v1_` + unpadded standard base64 of
//! `sha256("{path}:{operation}:{user}:{token}[:{expiration}]")`, where `operation` is
//! `read` or `write`, `user` is the `username` query parameter (empty when absent) and
//! `expiration` a Unix time in seconds after which the URL is refused.

use base64::Engine;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What a signed URL allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// Compares secrets in time independent of where they differ.
pub fn secrets_equal(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// E2B's v1 signature of a file URL.
pub fn sign(path: &str, op: Operation, user: &str, token: &str, expiration: Option<u64>) -> String {
    let raw = match expiration {
        Some(exp) => format!("{path}:{}:{user}:{token}:{exp}", op.as_str()),
        None => format!("{path}:{}:{user}:{token}", op.as_str()),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

/// Why a `/files` request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// An `X-Access-Token` was sent and is not the sandbox's.
    WrongToken,
    /// Neither the token nor a signature was sent.
    Missing,
    /// The signature does not match this path, operation, user and expiry.
    BadSignature,
    /// The signature's expiry is not a Unix time.
    BadExpiration,
    /// The signature's expiry has passed.
    Expired,
}

impl Refusal {
    /// Each opens with envd's own words (what SDK users and E2B's tests match on), then
    /// says what to do.
    pub fn message(&self) -> &'static str {
        match self {
            Refusal::WrongToken => "access token present in header but does not match; send this sandbox's own envd access token in X-Access-Token",
            Refusal::Missing => "missing signature query parameter; this sandbox is secure: send its access token in X-Access-Token or use a signed URL (download_url/upload_url)",
            Refusal::BadSignature => "invalid signature; the URL's signature does not match its path, operation, user and expiration: sign it again with the sandbox's access token",
            Refusal::BadExpiration => "invalid signature expiration; signature_expiration must be a Unix time in seconds",
            Refusal::Expired => "signature is already expired; ask for a new signed URL",
        }
    }
}

/// What a `/files` request presents.
pub struct FileAccess<'a> {
    pub header_token: Option<&'a str>,
    pub path: &'a str,
    pub user: Option<&'a str>,
    pub signature: Option<&'a str>,
    pub expiration: Option<&'a str>,
    pub op: Operation,
    /// Seconds since the Unix epoch.
    pub now: u64,
}

/// envd's rule for `/files`: the header token, when sent, must be right; otherwise
/// a signature over the request, unexpired, must be.
pub fn check_file_access(token: &str, req: &FileAccess<'_>) -> Result<(), Refusal> {
    if let Some(given) = req.header_token {
        return if secrets_equal(given, token) { Ok(()) } else { Err(Refusal::WrongToken) };
    }
    let Some(signature) = req.signature else { return Err(Refusal::Missing) };
    let expiration = match req.expiration.filter(|e| !e.is_empty()) {
        Some(e) => Some(e.parse::<u64>().map_err(|_| Refusal::BadExpiration)?),
        None => None,
    };
    let expected = sign(req.path, req.op, req.user.unwrap_or(""), token, expiration);
    if !secrets_equal(signature, &expected) {
        return Err(Refusal::BadSignature);
    }
    match expiration {
        Some(exp) if exp < req.now => Err(Refusal::Expired),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access<'a>(sig: Option<&'a str>, exp: Option<&'a str>, now: u64) -> FileAccess<'a> {
        FileAccess { header_token: None, path: "a.txt", user: Some("user"), signature: sig, expiration: exp, op: Operation::Read, now }
    }

    #[test]
    fn matches_the_e2b_sdks_signature() {
        // The e2b Python SDK's get_signature("/home/user/a.txt", "read", None, "tok", None),
        // computed with hashlib: base64(sha256(b"/home/user/a.txt:read::tok")) unpadded.
        assert_eq!(sign("/home/user/a.txt", Operation::Read, "", "tok", None), "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY");
    }

    #[test]
    fn a_signature_opens_only_its_own_request() {
        let good = sign("a.txt", Operation::Read, "user", "t", Some(100));
        assert_eq!(check_file_access("t", &access(Some(&good), Some("100"), 50)), Ok(()));
        assert_eq!(check_file_access("t", &access(Some(&good), Some("100"), 101)), Err(Refusal::Expired));
        assert_eq!(check_file_access("t", &access(Some(&good), Some("101"), 50)), Err(Refusal::BadSignature));
        assert_eq!(check_file_access("t", &access(Some(&good), None, 50)), Err(Refusal::BadSignature));
        assert_eq!(check_file_access("other", &access(Some(&good), Some("100"), 50)), Err(Refusal::BadSignature));
        assert_eq!(check_file_access("t", &access(Some(&good), Some("soon"), 50)), Err(Refusal::BadExpiration));
        let write = FileAccess { op: Operation::Write, ..access(Some(&good), Some("100"), 50) };
        assert_eq!(check_file_access("t", &write), Err(Refusal::BadSignature));
        assert_eq!(check_file_access("t", &access(None, None, 50)), Err(Refusal::Missing));
    }

    #[test]
    fn the_header_token_wins_and_must_be_right() {
        let with = |h| FileAccess { header_token: Some(h), ..access(None, None, 0) };
        assert_eq!(check_file_access("t", &with("t")), Ok(()));
        assert_eq!(check_file_access("t", &with("u")), Err(Refusal::WrongToken));
    }
}
