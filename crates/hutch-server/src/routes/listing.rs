//! Listing sandboxes the way E2B's API does (`GET /v2/sandboxes`, and the deprecated
//! `GET /sandboxes`): filters by metadata, state, start time and template; newest
//! first unless `order=asc`; keyset paging whose `X-Next-Token` names the last row
//! of the page (start time and id), so a page boundary survives sandboxes coming and
//! going between the requests; `X-Total-Running` when running ones were asked for.

use crate::auth::KeyId;
use crate::dto::SandboxDetail;
use crate::error::ApiError;
use crate::query::{decode, pairs};
use crate::app::AppState;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use hutch_core::manager::{started, ListFilter, ListOrder};
use hutch_core::store::SandboxRow;
use std::time::SystemTime;

/// E2B's page size: 100 by default and at most.
const MAX_LIMIT: usize = 100;

struct ListQuery {
    filter: ListFilter,
    limit: usize,
    /// Where the previous page ended: rows after it in the list's order follow.
    after: Option<(SystemTime, String)>,
}

/// E2B's `metadata` value is itself a query string whose parts are encoded once more
/// (the SDKs send `metadata=k%3Dv%252520w` for `{"k": "v w"}`): decoded whole, split,
/// then each key and value decoded.
fn metadata(value: &str) -> Result<Vec<(String, String)>, ApiError> {
    let inner = decode(value);
    inner
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split('=').collect::<Vec<_>>()[..] {
            [k, v] => Ok((decode(k), decode(v))),
            _ => Err(ApiError::bad_request(format!("Error parsing metadata: '{pair}' is not key=value"))),
        })
        .collect()
}

/// RFC 3339 with any offset (`…Z`, `…+02:00`), as the SDKs send `startedAfter`.
fn parse_instant(text: &str) -> Option<SystemTime> {
    hutch_core::time::Timestamp::parse(text).ok().map(hutch_core::time::Timestamp::system_time)
}

/// The token after `row` in `order`: E2B's form, URL-safe base64 of
/// `<start time>__<id>`, with `__asc` for ascending order.
fn next_token(row: &SandboxRow, order: ListOrder) -> String {
    let suffix = if order == ListOrder::Asc { "__asc" } else { "" };
    base64::engine::general_purpose::URL_SAFE.encode(format!("{}__{}{suffix}", row.started_at, row.id))
}

fn parse_token(token: &str, order: ListOrder) -> Result<(SystemTime, String), ApiError> {
    let invalid = || ApiError::bad_request("Invalid next token: pass the X-Next-Token of the previous page, with the same order");
    let bytes = base64::engine::general_purpose::URL_SAFE.decode(token.trim()).map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let parts: Vec<&str> = text.split("__").collect();
    let (time, id, asc) = match parts[..] {
        [time, id] => (time, id, false),
        [time, id, "asc"] => (time, id, true),
        _ => return Err(invalid()),
    };
    if asc != (order == ListOrder::Asc) || id.is_empty() {
        return Err(invalid());
    }
    Ok((parse_instant(time).ok_or_else(invalid)?, id.to_string()))
}

fn list_query(uri: &Uri) -> Result<ListQuery, ApiError> {
    let mut filter = ListFilter::default();
    let (mut limit, mut token) = (MAX_LIMIT, None);
    for (k, v) in pairs(uri.query()) {
        match k.as_str() {
            "metadata" => filter.metadata.extend(metadata(&v)?),
            "state" => {
                for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    if s != "running" && s != "paused" {
                        return Err(ApiError::bad_request(format!("state must be running or paused, got '{s}'")));
                    }
                    filter.states.push(s.to_string());
                }
            }
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=MAX_LIMIT).contains(l))
                    .ok_or_else(|| ApiError::bad_request(format!("limit must be between 1 and {MAX_LIMIT}, got '{v}'")))?;
            }
            "order" => {
                filter.order = match v.as_str() {
                    "desc" => ListOrder::Desc,
                    "asc" => ListOrder::Asc,
                    _ => return Err(ApiError::bad_request(format!("order must be asc or desc, got '{v}'"))),
                }
            }
            "startedAfter" => {
                let at = parse_instant(&v).ok_or_else(|| ApiError::bad_request(format!("startedAfter must be an RFC 3339 date-time, got '{v}'")))?;
                filter.started_after = Some(at);
            }
            "template" if v.contains(':') => {
                return Err(ApiError::bad_request(format!("Invalid template '{v}': tags are not supported here because sandboxes are not tag-scoped; pass the template's id or name")));
            }
            "template" if !v.is_empty() => filter.template = Some(v),
            "nextToken" if !v.is_empty() => token = Some(v),
            _ => {}
        }
    }
    let after = token.map(|t| parse_token(&t, filter.order)).transpose()?;
    Ok(ListQuery { filter, limit, after })
}

pub async fn list_v2(State(state): State<AppState>, key: KeyId, uri: Uri) -> Result<Response, ApiError> {
    let q = list_query(&uri)?;
    let rows = state.manager.list(&key.0, &q.filter);
    let order = q.filter.order;
    let mut headers = HeaderMap::new();
    if q.filter.states.is_empty() || q.filter.states.iter().any(|s| s == "running") {
        let running = rows.iter().filter(|r| r.state == "running").count();
        headers.insert("x-total-running", HeaderValue::from(running));
    }
    let rest: Vec<&SandboxRow> = match &q.after {
        Some((time, id)) => rows.iter().filter(|r| order.compare((started(r), &r.id), (*time, id)).is_gt()).collect(),
        None => rows.iter().collect(),
    };
    let page = &rest[..rest.len().min(q.limit)];
    if rest.len() > page.len() {
        if let Some(last) = page.last() {
            if let Ok(v) = HeaderValue::from_str(&next_token(last, order)) {
                headers.insert("x-next-token", v);
            }
        }
    }
    let page: Vec<SandboxDetail> = page.iter().map(|r| SandboxDetail::from(*r)).collect();
    Ok((headers, Json(page)).into_response())
}

/// The deprecated v1 list: running sandboxes only, newest first, filtered by metadata.
pub async fn list_all(State(state): State<AppState>, key: KeyId, uri: Uri) -> Result<Json<Vec<SandboxDetail>>, ApiError> {
    let mut filter = ListFilter { states: vec!["running".into()], ..ListFilter::default() };
    for (k, v) in pairs(uri.query()) {
        if k == "metadata" {
            filter.metadata.extend(metadata(&v)?);
        }
    }
    Ok(Json(state.manager.list(&key.0, &filter).iter().map(SandboxDetail::from).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_e2bs_and_carry_their_order() {
        let row = SandboxRow {
            id: "iabc123def456ghi789jk".into(),
            key_id: String::new(),
            template: "base".into(),
            state: "running".into(),
            cpu_count: 1,
            memory_mb: 512,
            disk_mb: 1,
            metadata: Default::default(),
            env_vars: Default::default(),
            envd_token: None,
            traffic_token: None,
            started_at: hutch_core::time::Timestamp::parse("2025-06-01T12:00:00.123Z").expect("time"),
            end_at: hutch_core::time::Timestamp::parse("2025-06-01T12:05:00Z").expect("time"),
            qemu_pid: None,
            dir: String::new(),
            auto_pause: false,
            auto_resume: false,
            auto_pause_memory: true,
            pause_mode: None,
            failure: None,
        };
        let token = next_token(&row, ListOrder::Desc);
        assert_eq!(String::from_utf8(base64::engine::general_purpose::URL_SAFE.decode(&token).expect("b64")).expect("utf8"), "2025-06-01T12:00:00.123Z__iabc123def456ghi789jk");
        let (time, id) = parse_token(&token, ListOrder::Desc).expect("parses");
        assert_eq!((time, id.as_str()), (started(&row), "iabc123def456ghi789jk"));
        // A token of one order is refused in the other, and garbage is refused.
        assert!(parse_token(&token, ListOrder::Asc).is_err());
        let asc = next_token(&row, ListOrder::Asc);
        assert!(asc.ends_with("X19hc2M=") || parse_token(&asc, ListOrder::Asc).is_ok());
        assert!(parse_token(&asc, ListOrder::Desc).is_err());
        assert!(parse_token("not a token", ListOrder::Desc).is_err());
        // E2B's own token format (RFC 3339 with nanoseconds) reads too.
        let theirs = base64::engine::general_purpose::URL_SAFE.encode("2025-06-01T12:00:00.123456789Z__i1");
        assert!(parse_token(&theirs, ListOrder::Desc).is_ok());
    }

    #[test]
    fn started_after_takes_any_offset_and_metadata_decodes_like_e2b() {
        let utc = parse_instant("2025-06-01T12:00:00.123Z").expect("utc");
        assert_eq!(parse_instant("2025-06-01T14:00:00.123000+02:00"), Some(utc));
        assert_eq!(parse_instant("2025-06-01T07:30:00.123-04:30"), Some(utc));
        assert_eq!(parse_instant("yesterday"), None);
        // What the SDK's query string holds once the outer layer is decoded.
        assert_eq!(metadata("k%3Dv%2520w%26a%3Db").expect("parses"), vec![("k".into(), "v w".into()), ("a".into(), "b".into())]);
        assert!(metadata("k%3Dv%3Dx").is_err(), "a pair with two '='");
    }
}
