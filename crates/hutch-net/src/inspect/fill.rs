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

/// Where in a request a placeholder was.
#[derive(Clone, Copy)]
enum Place<'a> {
    Header(&'a HeaderName),
    Query,
}

impl std::fmt::Display for Place<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Header(name) => write!(f, "header {name}"),
            Place::Query => write!(f, "the query string"),
        }
    }
}

/// What a filled-in query value keeps as it is: RFC 3986's unreserved characters.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// Fills in the placeholders in `target` (origin form) and `headers` of a request to
/// `host`. `Err` says, for the network log, why the request is refused instead.
pub async fn fill(target: &mut http::Uri, headers: &mut HeaderMap, host: &str, inspector: &Inspector) -> Result<(), String> {
    let none = Bound::new();
    let bound = inspector.transforms.bound_to(host).unwrap_or(&none);
    if let Some(form) = scan::find(target.path().as_bytes()) {
        return Err(format!("the request's path holds a secret's placeholder ({}); hutch fills placeholders in headers and, where a binding allows, the query string", form.name()));
    }
    if let Some(query) = target.query().filter(|q| scan::find(q.as_bytes()).is_some()) {
        let query = filled_query(query, host, bound, inspector).await?;
        let uri = Zeroizing::new(format!("{}?{}", target.path(), query.as_str()));
        *target = uri.parse().map_err(|_| "the request's target is not a URI once its query is filled in".to_string())?;
    }
    if !headers.values().any(|v| scan::find(v.as_bytes()).is_some()) {
        return Ok(());
    }
    let given = std::mem::take(headers);
    let mut name: Option<HeaderName> = None;
    // Bounds the values a request can make hutch copy (a head is at most 64 KiB).
    let mut filled_in = 0;
    for (next, value) in given {
        // The map yields each name once, before the first of its values.
        if let Some(next) = next {
            name = Some(next);
        }
        let Some(name) = &name else { continue };
        let value = if scan::find(value.as_bytes()).is_some() {
            filled_in += 1;
            if filled_in > MAX_SECRETS_PER_HOST {
                return Err(format!("the request fills in more than {MAX_SECRETS_PER_HOST} headers with secrets"));
            }
            filled(name, &value, host, bound, inspector).await?
        } else {
            value
        };
        headers.append(name.clone(), value);
    }
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

/// `query` with the placeholders in its values filled in (each value percent-decoded,
/// filled in, encoded again); refused when a name holds one or a value's secret is not
/// bound to `host` for the query string.
async fn filled_query(query: &str, host: &str, bound: &Bound, inspector: &Inspector) -> Result<Zeroizing<String>, String> {
    let mut out = Zeroizing::new(String::with_capacity(query.len() + 1024));
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        if scan::find(pair.as_bytes()).is_none() {
            out.push_str(pair);
            continue;
        }
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if scan::find(key.as_bytes()).is_some() {
            return Err("a query parameter's name holds a secret's placeholder; hutch fills in values only".into());
        }
        let decoded = Zeroizing::new(percent_decode_str(value).decode_utf8().map_err(|_| "a query value with a placeholder is not text once decoded".to_string())?.into_owned());
        let filled = render_bound(Place::Query, &decoded, host, bound, inspector).await?;
        out.push_str(key);
        out.push('=');
        out.extend(utf8_percent_encode(&filled, QUERY_VALUE));
    }
    Ok(out)
}

/// `text` with the placeholders of secrets bound to `host` for `place` filled in;
/// refused when one is not bound there, or when a placeholder is left in another form.
async fn render_bound(place: Place<'_>, text: &str, host: &str, bound: &Bound, inspector: &Inspector) -> Result<Zeroizing<String>, String> {
    let parts = transforms::parse_value(text).map_err(|why| format!("{place} {why}"))?;
    let mut rest = Vec::new();
    for part in &parts {
        match part {
            Part::Secret(secret) => {
                let Some(fill) = bound.get(secret) else {
                    return Err(format!("{place} holds the placeholder of secret {}, which is not bound to {host}", shown(secret)));
                };
                let allowed = match place {
                    Place::Header(name) => fill.headers.contains(name.as_str()),
                    Place::Query => fill.query,
                };
                if !allowed {
                    let mut places: Vec<&str> = fill.headers.iter().map(String::as_str).collect();
                    if fill.query {
                        places.push("the query string");
                    }
                    return Err(format!("{place} holds the placeholder of secret {}, which is filled in on {host} only in {}", shown(secret), places.join(", ")));
                }
            }
            Part::Text(t) => rest.extend_from_slice(t.as_bytes()),
        }
    }
    if let Some(form) = scan::find(&rest) {
        return Err(format!("{place} holds a secret's placeholder hutch cannot fill in (its marker {}); hutch fills in only `${{e2b.secrets.NAME}}` as written", form.name()));
    }
    transforms::render(text, |secret| inspector.reveal(secret)).await
}
