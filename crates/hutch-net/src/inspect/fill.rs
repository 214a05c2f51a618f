//! The guest's own placeholders in an inspected request's head: filled in where the
//! secret is bound to the request's host (a header's value, or either half of a Basic
//! credential), refused anywhere else (the request's target, a secret bound to another
//! host, a placeholder escaped or encoded so hutch would not fill it in).

use super::http::shown;
use super::inspector::Inspector;
use super::transforms::{self, Part};
use crate::scan;
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use http::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION};
use std::collections::BTreeSet;
use zeroize::Zeroizing;

/// Fills in the placeholders in `headers` of a request to `host` for `target`. `Err`
/// says, for the network log, why the request is refused instead.
pub async fn fill(target: &http::Uri, headers: &mut HeaderMap, host: &str, inspector: &Inspector) -> Result<(), String> {
    if let Some(form) = scan::find(target.to_string().as_bytes()) {
        return Err(format!("the request's target holds a secret's placeholder ({}); hutch fills placeholders in headers only", form.name()));
    }
    if !headers.values().any(|v| scan::find(v.as_bytes()).is_some()) {
        return Ok(());
    }
    let bound = inspector.transforms.bound_to(host);
    let given = std::mem::take(headers);
    let mut name: Option<HeaderName> = None;
    for (next, value) in given {
        // The map yields each name once, before the first of its values.
        if let Some(next) = next {
            name = Some(next);
        }
        let Some(name) = &name else { continue };
        let value = if scan::find(value.as_bytes()).is_some() { filled(name, &value, host, &bound, inspector).await? } else { value };
        headers.append(name.clone(), value);
    }
    Ok(())
}

async fn filled(name: &HeaderName, value: &HeaderValue, host: &str, bound: &BTreeSet<String>, inspector: &Inspector) -> Result<HeaderValue, String> {
    let text = value.to_str().map_err(|_| format!("header {name} holds a secret's placeholder among bytes that are not text"))?;
    let basic = (name == AUTHORIZATION).then(|| text.get(..6).filter(|p| p.eq_ignore_ascii_case("basic ")).map(|_| text[6..].trim())).flatten();
    let value = match basic {
        Some(encoded) => {
            let decoded = STANDARD.decode(encoded).ok().and_then(|d| String::from_utf8(d).ok());
            let decoded = Zeroizing::new(decoded.ok_or_else(|| format!("header {name} holds a Basic credential with a placeholder that is not base64 of text"))?);
            let credential = render_bound(name, &decoded, host, bound, inspector).await?;
            Zeroizing::new(format!("Basic {}", STANDARD.encode(credential.as_bytes())))
        }
        None => render_bound(name, text, host, bound, inspector).await?,
    };
    let mut value = HeaderValue::from_str(&value).map_err(|_| format!("header {name}: a secret's value holds a byte a header cannot"))?;
    value.set_sensitive(true);
    Ok(value)
}

/// `text` with the placeholders of secrets bound to `host` filled in; refused when one
/// is not bound, or when a placeholder is left in another form.
async fn render_bound(name: &HeaderName, text: &str, host: &str, bound: &BTreeSet<String>, inspector: &Inspector) -> Result<Zeroizing<String>, String> {
    let parts = transforms::parse_value(text).map_err(|why| format!("header {name} {why}"))?;
    let mut rest = Vec::new();
    for part in &parts {
        match part {
            Part::Secret(secret) if !bound.contains(secret) => {
                return Err(format!("header {name} holds the placeholder of secret {}, which is not bound to {host}", shown(secret)));
            }
            Part::Secret(_) => {}
            Part::Text(t) => rest.extend_from_slice(t.as_bytes()),
        }
    }
    if let Some(form) = scan::find(&rest) {
        return Err(format!("header {name} holds a secret's placeholder hutch cannot fill in (its marker {}); hutch fills in only `${{e2b.secrets.NAME}}` as written", form.name()));
    }
    transforms::render(text, |secret| inspector.reveal(secret)).await
}
