//! Finding secrets' placeholders (`${e2b.secrets.NAME}`) in what a guest sends. A
//! placeholder is filled in only on an inspected request to a host its secret is bound
//! to; one seen going anywhere else (another host, plain HTTP, a request's target or
//! body, a non-HTTP flow or a datagram) ends that flow and is logged, so an agent told
//! to post its key somewhere is stopped and seen.
//!
//! What is looked for is the marker `e2b.secrets.`, the part of a placeholder that no
//! encoding of the braces hides: as written, percent-encoded or backslash-escaped (JSON
//! `\u0065`, `\x65`, nested up to three times), and in base64 (standard or URL-safe,
//! at each of the three alignments). A placeholder compressed, encrypted (TLS to a host
//! hutch does not inspect) or split into pieces by the guest's own code is not found;
//! none of those carry a secret's value either, which never enters the guest. Nor is a
//! flow that begins as TLS, whose bytes are ciphertext (an inspected flow's requests
//! are scanned as plaintext by the inspection instead).

use base64::Engine;
use memchr::memmem::Finder;
use serde::Serialize;
use std::sync::OnceLock;

/// The part of every placeholder that survives re-encoding of its braces.
pub const MARKER: &[u8] = b"e2b.secrets.";
/// How much of what came before a chunk a stream keeps: the longest form of the
/// marker (each byte escaped as `\u00XX`) less one.
const TAIL: usize = MARKER.len() * 6 - 1;
/// Rounds of unescaping: `%2565` is `%65` is `e`.
const UNESCAPE_ROUNDS: usize = 3;

/// How the marker was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Form {
    Plain,
    Escaped,
    Base64,
}

impl Form {
    pub fn name(self) -> &'static str {
        match self {
            Form::Plain => "as written",
            Form::Escaped => "percent- or backslash-escaped",
            Form::Base64 => "base64-encoded",
        }
    }
}

struct Patterns {
    plain: Finder<'static>,
    base64: Vec<Finder<'static>>,
}

fn patterns() -> &'static Patterns {
    static PATTERNS: OnceLock<Patterns> = OnceLock::new();
    PATTERNS.get_or_init(|| {
        let mut base64 = Vec::new();
        for engine in [base64::engine::general_purpose::STANDARD_NO_PAD, base64::engine::general_purpose::URL_SAFE_NO_PAD] {
            for skip in 0..3usize {
                // The marker after `skip` other bytes: keep the characters made of the
                // marker's bits alone (character i holds bits 6i..6i+6).
                let mut bytes = vec![0u8; skip];
                bytes.extend_from_slice(MARKER);
                let text = engine.encode(&bytes);
                let (first, end) = ((skip * 8).div_ceil(6), (skip + MARKER.len()) * 8 / 6);
                let pattern = text.as_bytes()[first..end].to_vec();
                if !base64.iter().any(|f: &Finder<'_>| f.needle() == pattern.as_slice()) {
                    base64.push(Finder::new(&pattern).into_owned());
                }
            }
        }
        Patterns { plain: Finder::new(MARKER).into_owned(), base64 }
    })
}

/// The form the marker has in `bytes`, if it is there.
pub fn find(bytes: &[u8]) -> Option<Form> {
    let p = patterns();
    if p.plain.find(bytes).is_some() {
        return Some(Form::Plain);
    }
    if p.base64.iter().any(|f| f.find(bytes).is_some()) {
        return Some(Form::Base64);
    }
    let mut text = std::borrow::Cow::Borrowed(bytes);
    for _ in 0..UNESCAPE_ROUNDS {
        if memchr::memchr2(b'%', b'\\', &text).is_none() {
            break;
        }
        let plain = unescape(&text);
        if p.plain.find(&plain).is_some() {
            return Some(Form::Escaped);
        }
        if plain.len() == text.len() {
            break;
        }
        text = std::borrow::Cow::Owned(plain);
    }
    None
}

/// `%XX`, `\xXX` and `\u00XX` replaced by their byte; anything else kept.
fn unescape(text: &[u8]) -> Vec<u8> {
    let hex = |s: &[u8]| -> Option<u8> { u8::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok() };
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let (byte, used) = match rest {
            [b'%', a, b, ..] => (hex(&[*a, *b]), 3),
            [b'\\', b'x' | b'X', a, b, ..] => (hex(&[*a, *b]), 4),
            [b'\\', b'u' | b'U', b'0', b'0', a, b, ..] => (hex(&[*a, *b]), 6),
            _ => (None, 1),
        };
        match byte {
            Some(b) => {
                out.push(b);
                i += used;
            }
            None => {
                out.push(rest[0]);
                i += 1;
            }
        }
    }
    out
}

/// A stream's scan: a marker split across chunks is found.
#[derive(Debug, Default)]
pub struct Scanner {
    tail: Vec<u8>,
}

/// Whether a stream that starts with `first` is TLS (a record holding a ClientHello of
/// a plausible size): encrypted from there on, so there is nothing to find in it and
/// scanning it is only cost.
pub fn starts_tls(first: &[u8]) -> bool {
    match first {
        [0x16, 0x03, 0x00..=0x04, hi, lo, 0x01, ..] => (40..=16 * 1024 + 256).contains(&u16::from_be_bytes([*hi, *lo])),
        _ => false,
    }
}

impl Scanner {
    /// The marker's form if it is in the stream once `chunk` is added to it.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<Form> {
        let head = &chunk[..chunk.len().min(TAIL)];
        let mut seam = std::mem::take(&mut self.tail);
        let kept = seam.len();
        seam.extend_from_slice(head);
        let found = find(&seam).or_else(|| find(chunk));
        // What the next chunk may complete: the last TAIL bytes of all so far.
        if chunk.len() >= TAIL {
            seam.clear();
            seam.extend_from_slice(&chunk[chunk.len() - TAIL..]);
        } else {
            let drop = (kept + chunk.len()).saturating_sub(TAIL);
            seam.drain(..drop);
        }
        self.tail = seam;
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLACEHOLDER: &str = "${e2b.secrets.openai}";

    #[test]
    fn finds_each_form() {
        assert_eq!(find(PLACEHOLDER.as_bytes()), Some(Form::Plain));
        assert_eq!(find(b"GET /?k=%24%7Be2b%2Esecrets%2Eopenai%7D HTTP/1.1"), Some(Form::Escaped));
        assert_eq!(find(b"%2565%2532%2562.secrets.x"), Some(Form::Escaped), "encoded twice");
        assert_eq!(find(br#"{"k":"\u0024{\u0065\u0032b.secrets.x}"}"#), Some(Form::Escaped));
        for engine in [base64::engine::general_purpose::STANDARD, base64::engine::general_purpose::URL_SAFE] {
            for prefix in ["", "u", "us", "user:", "Bearer "] {
                let encoded = engine.encode(format!("{prefix}{PLACEHOLDER}"));
                assert_eq!(find(encoded.as_bytes()), Some(Form::Base64), "{prefix:?} {encoded}");
            }
        }
        assert_eq!(find(b"GET /e2b/secrets HTTP/1.1\r\nHost: e2b.dev\r\n"), None);
        assert_eq!(find(b"100%25 sure \\n"), None);
    }

    #[test]
    fn only_a_plausible_client_hello_counts_as_tls() {
        assert!(starts_tls(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00]));
        assert!(!starts_tls(&[0x16, 0x03, 0x01, 0x00, 0x05, 0x01]), "too short for a ClientHello");
        assert!(!starts_tls(&[0x16, 0x03, 0x01]), "three bytes in front of plain text");
        assert!(!starts_tls(b"GET / HTTP/1.1\r\n"));
    }

    #[test]
    fn a_marker_split_across_chunks_is_found() {
        let text = format!("POST / HTTP/1.1\r\n\r\n{}{PLACEHOLDER}", "x".repeat(1000));
        let escaped: String = text.bytes().map(|b| format!("%{b:02X}")).collect();
        for stream in [text.as_bytes(), escaped.as_bytes()] {
            for size in [1, 2, 7, 13, 64, 71, 200] {
                let mut scanner = Scanner::default();
                let found = stream.chunks(size).filter_map(|c| scanner.feed(c)).next();
                assert!(found.is_some(), "chunks of {size}");
            }
        }
        let mut scanner = Scanner::default();
        assert!(b"ordinary bytes, e2b and secrets and all".chunks(5).all(|c| scanner.feed(c).is_none()));
    }
}
