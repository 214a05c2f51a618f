//! The guest's own placeholders in an inspected request's head: filled in where the
//! secret is bound to the request's host for that header (a header's value, or either
//! half of a Basic credential), refused anywhere else (the request's target, a secret
//! not bound there, a header it is not bound for, a placeholder escaped or encoded so
//! hutch would not fill it in).

use super::flow::shown;
use super::inspector::Inspector;
use super::transforms::{self, Part, MAX_SECRETS_PER_HOST};
use crate::scan;
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use http::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION};
use std::collections::{BTreeMap, BTreeSet};
use zeroize::Zeroizing;

/// The secrets bound to a host, each with the headers it is filled in.
type Bound = BTreeMap<String, BTreeSet<String>>;

/// Fills in the placeholders in `headers` of a request to `host` for `target`. `Err`
/// says, for the network log, why the request is refused instead.
pub async fn fill(target: &http::Uri, headers: &mut HeaderMap, host: &str, inspector: &Inspector) -> Result<(), String> {
    if let Some(form) = scan::find(target.to_string().as_bytes()) {
        return Err(format!("the request's target holds a secret's placeholder ({}); hutch fills placeholders in headers only", form.name()));
    }
    if !headers.values().any(|v| scan::find(v.as_bytes()).is_some()) {
        return Ok(());
    }
    let none = Bound::new();
    let bound = inspector.transforms.bound_to(host).unwrap_or(&none);
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
    let basic = (name == AUTHORIZATION).then(|| text.get(..6).filter(|p| p.eq_ignore_ascii_case("basic ")).map(|_| text[6..].trim())).flatten();
    let value = match basic {
        Some(encoded) => {
            let decoded = STANDARD.decode(encoded).ok().and_then(|d| String::from_utf8(d).ok());
            let decoded = Zeroizing::new(decoded.ok_or_else(|| format!("header {name} holds a Basic credential with a placeholder that is not base64 of text"))?);
            let credential = render_bound(name, &decoded, host, bound, inspector).await?;
            // Room for all of it up front, so no copy of the value is left in freed memory.
            let mut value = Zeroizing::new(String::with_capacity(6 + credential.len().div_ceil(3) * 4));
            value.push_str("Basic ");
            STANDARD.encode_string(credential.as_bytes(), &mut value);
            value
        }
        None => render_bound(name, text, host, bound, inspector).await?,
    };
    let mut value = HeaderValue::from_str(&value).map_err(|_| format!("header {name}: a secret's value holds a byte a header cannot"))?;
    value.set_sensitive(true);
    Ok(value)
}

/// `text` with the placeholders of secrets bound to `host` for header `name` filled in;
/// refused when one is not bound there, or when a placeholder is left in another form.
async fn render_bound(name: &HeaderName, text: &str, host: &str, bound: &Bound, inspector: &Inspector) -> Result<Zeroizing<String>, String> {
    let parts = transforms::parse_value(text).map_err(|why| format!("header {name} {why}"))?;
    let mut rest = Vec::new();
    for part in &parts {
        match part {
            Part::Secret(secret) => match bound.get(secret) {
                None => return Err(format!("header {name} holds the placeholder of secret {}, which is not bound to {host}", shown(secret))),
                Some(headers) if !headers.contains(name.as_str()) => {
                    let allowed: Vec<&str> = headers.iter().map(String::as_str).collect();
                    return Err(format!("header {name} holds the placeholder of secret {}, which is filled in on {host} only in {}", shown(secret), allowed.join(", ")));
                }
                Some(_) => {}
            },
            Part::Text(t) => rest.extend_from_slice(t.as_bytes()),
        }
    }
    if let Some(form) = scan::find(&rest) {
        return Err(format!("header {name} holds a secret's placeholder hutch cannot fill in (its marker {}); hutch fills in only `${{e2b.secrets.NAME}}` as written", form.name()));
    }
    transforms::render(text, |secret| inspector.reveal(secret)).await
}
