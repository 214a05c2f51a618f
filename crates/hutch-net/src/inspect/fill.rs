//! The guest's own placeholders in an inspected request's head: filled in where the
//! secret is bound to the request's host for that place (a header's value, either half
//! of a Basic credential, or a query parameter's value when the binding opts in),
//! refused anywhere else (the path, a secret not bound there, a place it is not bound
//! for, a placeholder escaped or encoded so hutch would not fill it in).

use super::flow::shown;
use super::inspector::Inspector;
use super::transforms::{self, Fill, Part, MAX_SECRETS_PER_HOST};
use crate::scan;
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use http::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION};
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use std::collections::BTreeMap;
use zeroize::Zeroizing;

/// The secrets bound to a host, each with where it is filled in.
type Bound = BTreeMap<String, Fill>;

/// The values filled into a request's query: an answer that repeats one is refused.
pub type InQuery = Vec<Zeroizing<String>>;

/// Where in a request a placeholder was.
#[derive(Clone, Copy)]
enum Place<'a> {
    Header(&'a HeaderName),
    Query(&'a str),
}

impl std::fmt::Display for Place<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Header(name) => write!(f, "header {name}"),
            Place::Query(name) => write!(f, "query parameter {}", shown(name)),
        }
    }
}

/// What a filled-in query value is encoded with: all but RFC 3986's unreserved characters.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// The answer headers a server reflects a request's URL into.
const REFLECTING: [&str; 4] = ["location", "content-location", "link", "refresh"];

/// Fills in the placeholders in `target` (origin form) and `headers` of a request to
/// `host`; the values it put in the query. `Err` says, for the network log, why the
/// request is refused instead.
pub async fn fill(target: &mut http::Uri, headers: &mut HeaderMap, host: &str, inspector: &Inspector) -> Result<InQuery, String> {
    let none = Bound::new();
    let bound = inspector.transforms.bound_to(host).unwrap_or(&none);
    if let Some(form) = scan::find(target.path().as_bytes()) {
        return Err(format!("the request's path holds a secret's placeholder ({}); hutch fills placeholders in headers and in query parameters a binding names", form.name()));
    }
    // Bounds the values a request can make hutch copy (a head is at most 64 KiB).
    let mut places_left = MAX_SECRETS_PER_HOST;
    let mut in_query = InQuery::new();
    if let Some(query) = target.query().filter(|q| scan::find(q.as_bytes()).is_some()) {
        let query = filled_query(query, host, bound, inspector, &mut places_left, &mut in_query).await?;
        let uri = Zeroizing::new(format!("{}?{}", target.path(), query.as_str()));
        *target = uri.parse().map_err(|_| "the request's target is not a URI once its query is filled in".to_string())?;
    }
    if !headers.values().any(|v| scan::find(v.as_bytes()).is_some()) {
        return Ok(in_query);
    }
    let given = std::mem::take(headers);
    let mut name: Option<HeaderName> = None;
    for (next, value) in given {
        // The map yields each name once, before the first of its values.
        if let Some(next) = next {
            name = Some(next);
        }
        let Some(name) = &name else { continue };
        let value = if scan::find(value.as_bytes()).is_some() {
            take_place(&mut places_left)?;
            filled(name, &value, host, bound, inspector).await?
        } else {
            value
        };
        headers.append(name.clone(), value);
    }
    Ok(in_query)
}

/// The header of `headers` (an answer's) that repeats a value of `in_query`, as sent or
/// percent-encoded: a server reflecting the URL (a redirect) would hand it to the guest.
pub fn reflected(headers: &HeaderMap, in_query: &InQuery) -> Option<&'static str> {
    if in_query.is_empty() {
        return None;
    }
    let encoded: Vec<Zeroizing<String>> = in_query.iter().map(|v| Zeroizing::new(utf8_percent_encode(v, QUERY_VALUE).to_string())).collect();
    REFLECTING.into_iter().find(|name| {
        headers.get_all(*name).iter().any(|h| in_query.iter().chain(&encoded).any(|v| memchr::memmem::find(h.as_bytes(), v.as_bytes()).is_some()))
    })
}

fn take_place(left: &mut usize) -> Result<(), String> {
    *left = left.checked_sub(1).ok_or_else(|| format!("the request fills in more than {MAX_SECRETS_PER_HOST} places with secrets"))?;
    Ok(())
}

async fn filled(name: &HeaderName, value: &HeaderValue, host: &str, bound: &Bound, inspector: &Inspector) -> Result<HeaderValue, String> {
    let text = value.to_str().map_err(|_| format!("header {name} holds a secret's placeholder among bytes that are not text"))?;
    let place = Place::Header(name);
    let basic = (name == AUTHORIZATION).then(|| text.get(..6).filter(|p| p.eq_ignore_ascii_case("basic ")).map(|_| text[6..].trim())).flatten();
    let value = match basic {
        Some(encoded) => {
            let decoded = STANDARD.decode(encoded).ok().and_then(|d| String::from_utf8(d).ok());
            let decoded = Zeroizing::new(decoded.ok_or_else(|| format!("header {name} holds a Basic credential with a placeholder that is not base64 of text"))?);
            let credential = render_bound(place, &decoded, host, bound, inspector).await?;
            // Room for all of it up front, so no copy of the value is left in freed memory.
            let mut value = Zeroizing::new(String::with_capacity(6 + credential.len().div_ceil(3) * 4));
            value.push_str("Basic ");
            STANDARD.encode_string(credential.as_bytes(), &mut value);
            value
        }
        None => render_bound(place, text, host, bound, inspector).await?,
    };
    let mut value = HeaderValue::from_str(&value).map_err(|_| format!("header {name}: a secret's value holds a byte a header cannot"))?;
    value.set_sensitive(true);
    Ok(value)
}

/// A piece of a filled-in query: the guest's own text as it sent it, or a value.
enum Piece<'a> {
    Sent(&'a str),
    Value(Zeroizing<String>),
}

/// `query` with the placeholders in the values of parameters a binding names filled in:
/// each found in the decoded value and replaced, percent-encoded, in the value as sent
/// (the guest's own text keeps its encoding). Refused when a parameter's name holds
/// one, or the parameter or a secret is not bound for it.
async fn filled_query(query: &str, host: &str, bound: &Bound, inspector: &Inspector, places_left: &mut usize, in_query: &mut InQuery) -> Result<Zeroizing<String>, String> {
    let mut pieces = Vec::new();
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            pieces.push(Piece::Sent("&"));
        }
        if scan::find(pair.as_bytes()).is_none() {
            pieces.push(Piece::Sent(pair));
            continue;
        }
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if scan::find(key.as_bytes()).is_some() {
            return Err("a query parameter's name holds a secret's placeholder; hutch fills in values only".into());
        }
        let name = percent_decode_str(key).decode_utf8().map_err(|_| "a query parameter's name is not text".to_string())?;
        let place = Place::Query(&name);
        let (decoded, origin) = decode_with_origins(value).ok_or_else(|| format!("{place} holds a placeholder in a value that is not text once decoded"))?;
        let spans = placeholder_spans(&decoded).map_err(|why| format!("{place} {why}"))?;
        let mut rest = Vec::new();
        let mut at = 0;
        for (span, _) in &spans {
            rest.extend_from_slice(&decoded.as_bytes()[at..span.start]);
            at = span.end;
        }
        rest.extend_from_slice(&decoded.as_bytes()[at..]);
        if let Some(form) = scan::find(&rest) {
            return Err(format!("{place} holds a secret's placeholder hutch cannot fill in (its marker {}); hutch fills in only `${{e2b.secrets.NAME}}`, percent-encoded or not", form.name()));
        }
        pieces.push(Piece::Sent(key));
        pieces.push(Piece::Sent("="));
        let mut sent_from = 0;
        for (span, secret) in &spans {
            check_bound(place, secret, host, bound)?;
            take_place(places_left)?;
            let value_of = inspector.reveal(secret.clone()).await?;
            pieces.push(Piece::Sent(&value[sent_from..origin[span.start]]));
            pieces.push(Piece::Value(Zeroizing::new(utf8_percent_encode(&value_of, QUERY_VALUE).to_string())));
            in_query.push(value_of);
            sent_from = origin[span.end];
        }
        pieces.push(Piece::Sent(&value[sent_from..]));
    }
    // Exactly the room it needs, so growing leaves no copy of a value in freed memory.
    let len = pieces.iter().map(|p| match p {
        Piece::Sent(s) => s.len(),
        Piece::Value(v) => v.len(),
    });
    let mut out = Zeroizing::new(String::with_capacity(len.sum()));
    for piece in &pieces {
        out.push_str(match piece {
            Piece::Sent(s) => s,
            Piece::Value(v) => v,
        });
    }
    Ok(out)
}

/// `raw` percent-decoded (`+` kept), with where in `raw` each decoded byte began (and,
/// last, `raw`'s length). None when the decoded bytes are not text.
fn decode_with_origins(raw: &str) -> Option<(String, Vec<usize>)> {
    let bytes = raw.as_bytes();
    let (mut decoded, mut origin) = (Vec::with_capacity(bytes.len()), Vec::with_capacity(bytes.len() + 1));
    let mut i = 0;
    while i < bytes.len() {
        origin.push(i);
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok()).and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                decoded.push(byte);
                i += 3;
            }
            (byte, _) => {
                decoded.push(byte);
                i += 1;
            }
        }
    }
    origin.push(bytes.len());
    Some((String::from_utf8(decoded).ok()?, origin))
}

/// Where in `text` each `${e2b.secrets.NAME}` is, with NAME normalized.
fn placeholder_spans(text: &str) -> Result<Vec<(std::ops::Range<usize>, String)>, &'static str> {
    transforms::parse_value(text)?;
    let mut spans = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find(transforms::SECRET_PREFIX) {
        let start = from + at;
        let end = start + text[start..].find('}').ok_or("contains a malformed E2B placeholder (no closing `}`)")? + 1;
        match transforms::parse_value(&text[start..end])?.as_slice() {
            [Part::Secret(name)] => spans.push((start..end, name.clone())),
            _ => return Err("contains a malformed E2B placeholder"),
        }
        from = end;
    }
    Ok(spans)
}

/// Whether `secret` may be filled in at `place` on `host`; `Err` says why not.
fn check_bound(place: Place<'_>, secret: &str, host: &str, bound: &Bound) -> Result<(), String> {
    let Some(fill) = bound.get(secret) else {
        return Err(format!("{place} holds the placeholder of secret {}, which is not bound to {host}", shown(secret)));
    };
    let allowed = match place {
        Place::Header(name) => fill.headers.contains(name.as_str()),
        Place::Query(name) => fill.query.contains(name),
    };
    if allowed {
        return Ok(());
    }
    let mut places: Vec<String> = fill.headers.iter().map(|h| format!("header {h}")).collect();
    places.extend(fill.query.iter().map(|q| format!("query parameter {q}")));
    Err(format!("{place} holds the placeholder of secret {}, which is filled in on {host} only in {}", shown(secret), places.join(", ")))
}

/// `text` with the placeholders of secrets bound to `host` for `place` filled in;
/// refused when one is not bound there, or when a placeholder is left in another form.
async fn render_bound(place: Place<'_>, text: &str, host: &str, bound: &Bound, inspector: &Inspector) -> Result<Zeroizing<String>, String> {
    let parts = transforms::parse_value(text).map_err(|why| format!("{place} {why}"))?;
    let mut rest = Vec::new();
    for part in &parts {
        match part {
            Part::Secret(secret) => check_bound(place, secret, host, bound)?,
            Part::Text(t) => rest.extend_from_slice(t.as_bytes()),
        }
    }
    if let Some(form) = scan::find(&rest) {
        return Err(format!("{place} holds a secret's placeholder hutch cannot fill in (its marker {}); hutch fills in only `${{e2b.secrets.NAME}}` as written", form.name()));
    }
    transforms::render(text, |secret| inspector.reveal(secret)).await
}
