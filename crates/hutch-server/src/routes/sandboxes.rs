//! Sandbox lifecycle routes.

use super::body::JsonBody;
use crate::auth::KeyId;
use crate::dto::{ConnectBody, ForkBody, NetworkUpdate, NetworkView, NewSandbox, PauseBody, Sandbox, SandboxDetail, SandboxMetric, SnapshotBody, SnapshotInfo, TimeoutBody};
use crate::error::ApiError;
use crate::query::pairs;
use crate::app::AppState;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hutch_core::manager::{Connected, CreateSpec, OnResume, PauseMode};
use std::collections::BTreeMap;

/// Longest timeout a request may ask for (E2B's int32 seconds).
const MAX_TIMEOUT: i64 = i32::MAX as i64;

fn timeout_secs(t: i64) -> Result<u64, ApiError> {
    if (0..=MAX_TIMEOUT).contains(&t) {
        Ok(t as u64)
    } else {
        Err(ApiError::bad_request(format!("timeout must be between 0 and {MAX_TIMEOUT} seconds, got {t}")))
    }
}

async fn create(state: AppState, key: KeyId, body: NewSandbox, default_timeout: u64) -> Result<Response, ApiError> {
    if body.template_id.trim().is_empty() {
        return Err(ApiError::bad_request("templateID must not be empty"));
    }
    // E2B's API opens the internet unless told otherwise, and its newest SDKs rely on
    // that (they send allow_internet_access only when set); `hutch serve
    // --egress-default none` makes silence mean no egress.
    let internet = match (body.allow_internet_access, &body.egress) {
        (None, None) => Some(state.manager.config().internet_by_default),
        (given, _) => given,
    };
    let mut network = network_settings(internet, body.network.clone(), body.egress.clone())?;
    let mut env_vars = body.env_vars.unwrap_or_default();
    if let Some(secrets) = &body.secrets {
        for (var, placeholder) in network.transforms.bind_all("secrets", secrets).map_err(|e| ApiError::bad_request(e.to_string()))? {
            if env_vars.insert(var.clone(), placeholder).is_some() {
                return Err(ApiError::bad_request(format!("secrets.{var}: envVars sets {var} too; a secret's variable holds its placeholder, so set it in one place")));
            }
        }
    }
    if body.auto_resume.as_ref().is_some_and(|a| a.enabled) && body.auto_pause != Some(true) {
        return Err(ApiError::bad_request("autoResume needs autoPause: a sandbox that is killed at its timeout has nothing to resume"));
    }
    // E2B's own words for both.
    let auto_pause_memory = body.auto_pause_memory.unwrap_or(true);
    if !auto_pause_memory && body.auto_pause != Some(true) {
        return Err(ApiError::bad_request("autoPauseMemory=false only applies when autoPause is true."));
    }
    if !auto_pause_memory && body.auto_resume.as_ref().is_some_and(|a| a.enabled) {
        return Err(ApiError::bad_request("autoPauseMemory=false (filesystem-only auto-pause) cannot be combined with autoResume: a filesystem-only snapshot cannot be auto-resumed by traffic and must be resumed explicitly."));
    }
    let spec = CreateSpec {
        template: body.template_id,
        timeout: Some(body.timeout.map(timeout_secs).transpose()?.unwrap_or(default_timeout)),
        metadata: body.metadata.unwrap_or_default(),
        env_vars,
        // E2B secures every sandbox now (its SDKs stopped sending the field): only an
        // explicit `false` makes the envd API tokenless.
        secure: body.secure.unwrap_or(true),
        auto_pause: body.auto_pause.unwrap_or(false),
        auto_resume: body.auto_resume.is_some_and(|a| a.enabled),
        auto_pause_mode: if auto_pause_memory { PauseMode::Full } else { PauseMode::Filesystem },
        cold: body.cold.unwrap_or(false),
        private_ports: body.network.as_ref().and_then(|n| n.allow_public_traffic) == Some(false),
        network: Some(network),
    };
    let row = state.manager.create(&key.0, spec).await?;
    Ok((StatusCode::CREATED, Json(Sandbox::from(&row))).into_response())
}

/// `POST /sandboxes` (older SDKs): timeout defaults to 15 s, as E2B's v1.
pub async fn create_v1(State(state): State<AppState>, key: KeyId, JsonBody(body): JsonBody<NewSandbox>) -> Result<Response, ApiError> {
    create(state, key, body, 15).await
}

/// `POST /v2/sandboxes`: timeout defaults to the server's (300 s unless configured).
pub async fn create_v2(State(state): State<AppState>, key: KeyId, JsonBody(body): JsonBody<NewSandbox>) -> Result<Response, ApiError> {
    let default = state.manager.config().default_timeout.as_secs();
    create(state, key, body, default).await
}

pub async fn get_one(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Json<SandboxDetail>, ApiError> {
    let row = state.manager.get(&key.0, &id)?;
    let settings = state.manager.network(&key.0, &id)?;
    Ok(Json(SandboxDetail::from(&row).with_network(&settings)))
}

/// The settings for E2B's fields or hutch's own `egress` rules (not both); a bad
/// entry is a 400 naming its field.
fn network_settings(
    allow_internet_access: Option<bool>,
    network: Option<hutch_net::e2b::E2bNetwork>,
    egress: Option<Vec<String>>,
) -> Result<hutch_net::Settings, ApiError> {
    match egress {
        Some(rules) => {
            let e2b_too = allow_internet_access.is_some() || network.as_ref().is_some_and(|n| n.allow_out.is_some() || n.deny_out.is_some());
            if e2b_too {
                return Err(ApiError::bad_request("egress: give hutch's egress rules or E2B's allow_internet_access/allowOut/denyOut, not both"));
            }
            let parsed = rules.iter().map(|r| hutch_net::Rule::parse(r)).collect::<Result<Vec<_>, _>>().map_err(|e| ApiError::bad_request(format!("egress: {e}")))?;
            let policy = hutch_net::Policy::new(parsed).map_err(|e| ApiError::bad_request(format!("egress: {}", e.reason)))?;
            hutch_net::Settings::with_e2b_extras(policy, network.as_ref()).map_err(|e| ApiError::bad_request(e.to_string()))
        }
        None => hutch_net::Settings::from_e2b(allow_internet_access, network).map_err(|e| ApiError::bad_request(e.to_string())),
    }
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's whole network configuration
/// (E2B's `update_network`); the stack follows it at once, open connections stay.
pub async fn update_network(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, JsonBody(body): JsonBody<NetworkUpdate>) -> Result<StatusCode, ApiError> {
    // E2B's update replaces every rule, and what no rule denies is allowed there: an
    // update that leaves allow_internet_access out opens the internet (its SDKs never
    // send it), as a create with it true does.
    let internet = body.allow_internet_access.or(Some(true)).filter(|_| body.egress.is_none());
    let settings = network_settings(internet, Some(body.network), body.egress)?;
    state.manager.set_network(&key.0, &id, settings).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /sandboxes/{id}/network` (hutch's own): the rules in force, E2B's settings as
/// given, and the stack's denials.
pub async fn network(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Json<NetworkView>, ApiError> {
    let settings = state.manager.network(&key.0, &id)?;
    let log = state.manager.network_log(&key.0, &id).await?;
    Ok(Json(NetworkView::new(&settings, log)))
}

pub async fn kill(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.manager.kill(&key.0, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn set_timeout(
    State(state): State<AppState>,
    key: KeyId,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<TimeoutBody>,
) -> Result<StatusCode, ApiError> {
    state.manager.set_timeout(&key.0, &id, timeout_secs(body.timeout)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// E2B's connect: 200 when it was running, 201 when it was paused and is resumed.
pub async fn connect(
    State(state): State<AppState>,
    key: KeyId,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ConnectBody>,
) -> Result<Response, ApiError> {
    let secs = body.timeout.map(timeout_secs).transpose()?;
    let (row, how) = state.manager.connect(&key.0, &id, secs, on_resume(&body)).await?;
    let status = if how == Connected::Resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(Sandbox::from(&row))).into_response())
}

/// E2B's `start` and `end` (Unix seconds, each optional, both ends inclusive): the
/// sandbox's points in that range. hutch keeps no history yet (issue 34), so its one
/// point is the sample taken now, listed only when now is in the range.
pub async fn metrics(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, uri: axum::http::Uri) -> Result<Json<Vec<SandboxMetric>>, ApiError> {
    let range = MetricsRange::from_query(uri.query())?;
    // The host's clock dates the point (both fields), as it judges the range.
    let now = std::time::SystemTime::now();
    let now_secs = now.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    if !range.holds(now_secs) {
        // No sample is asked of the guest (it takes 100 ms there) for a range that
        // cannot hold it; an unknown sandbox is still a 404.
        state.manager.get(&key.0, &id)?;
        return Ok(Json(Vec::new()));
    }
    let m = state.manager.metrics(&key.0, &id).await?;
    Ok(Json(vec![SandboxMetric {
        timestamp: hutch_core::store::rfc3339(now),
        timestamp_unix: now_secs,
        cpu_count: m.cpu_count,
        cpu_used_pct: m.cpu_used_pct,
        mem_used: m.mem_used,
        mem_total: m.mem_total,
        mem_cache: m.mem_cache,
        disk_used: m.disk_used,
        disk_total: m.disk_total,
    }]))
}

/// A metrics request's time range, in Unix seconds.
#[derive(Debug, Default, PartialEq)]
struct MetricsRange {
    start: Option<i64>,
    end: Option<i64>,
}

impl MetricsRange {
    fn from_query(query: Option<&str>) -> Result<MetricsRange, ApiError> {
        let mut range = MetricsRange::default();
        for (name, value) in crate::query::pairs(query) {
            let slot = match name.as_str() {
                "start" => &mut range.start,
                "end" => &mut range.end,
                _ => continue,
            };
            let secs = value.parse::<i64>().ok().filter(|s| *s >= 0).ok_or_else(|| {
                ApiError::bad_request(format!("'{name}' must be a Unix time in whole seconds (0 or more), not {value:?}"))
            })?;
            *slot = Some(secs);
        }
        if let (Some(start), Some(end)) = (range.start, range.end) {
            if start > end {
                // E2B's words, then the cause.
                return Err(ApiError::bad_request(format!("Invalid time range for metrics: start ({start}) is after end ({end})")));
            }
        }
        Ok(range)
    }

    fn holds(&self, secs: i64) -> bool {
        self.start.is_none_or(|s| secs >= s) && self.end.is_none_or(|e| secs <= e)
    }
}

/// The console as E2B's `SandboxLogs`: `{"logs": [{"timestamp", "line"}]}`.
pub async fn logs(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, uri: axum::http::Uri) -> Result<Json<serde_json::Value>, ApiError> {
    let page = LogPage::from_query(uri.query())?;
    let started = state.manager.get(&key.0, &id)?.started_at;
    let (text, dropped) = state.manager.console(&key.0, &id)?;
    let all: Vec<&str> = text.lines().collect();
    let lines: Vec<serde_json::Value> =
        all.iter().skip(page.offset).take(page.limit).map(|l| serde_json::json!({ "timestamp": started, "line": l })).collect();
    let next = page.offset + lines.len();
    let mut body = serde_json::json!({ "logs": lines, "droppedBytes": dropped });
    if next < all.len() {
        body["nextOffset"] = next.into();
    }
    Ok(Json(body))
}

/// `?offset=N&limit=M` over the console's retained lines (E2B's default page is 1000).
struct LogPage {
    offset: usize,
    limit: usize,
}

const MAX_LOG_LINES: usize = 10_000;

impl LogPage {
    fn from_query(query: Option<&str>) -> Result<LogPage, ApiError> {
        let mut page = LogPage { offset: 0, limit: 1000 };
        for (k, v) in crate::query::pairs(query) {
            let number = || v.parse::<usize>().map_err(|_| ApiError::bad_request(format!("{k} must be a whole number, not '{v}'")));
            match k.as_str() {
                "offset" => page.offset = number()?,
                "limit" => page.limit = number()?,
                _ => {}
            }
        }
        if page.limit == 0 || page.limit > MAX_LOG_LINES {
            return Err(ApiError::bad_request(format!("limit must be between 1 and {MAX_LOG_LINES}")));
        }
        Ok(page)
    }
}

fn on_resume(body: &ConnectBody) -> OnResume {
    if body.memory == Some(false) {
        OnResume::Reboot
    } else {
        OnResume::Restore
    }
}

/// E2B's pause: 204, or 409 when it is already paused. `{"memory": false}` keeps only
/// the disk.
pub async fn pause(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, JsonBody(body): JsonBody<PauseBody>) -> Result<StatusCode, ApiError> {
    let mode = if body.memory == Some(false) { PauseMode::Filesystem } else { PauseMode::Full };
    state.manager.pause(&key.0, &id, mode).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The deprecated `POST /sandboxes/{id}/resume`: 201, or 409 when it is running.
pub async fn resume(
    State(state): State<AppState>,
    key: KeyId,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ConnectBody>,
) -> Result<Response, ApiError> {
    let secs = body.timeout.map(timeout_secs).transpose()?;
    if state.manager.get(&key.0, &id)?.state == "running" {
        return Err(ApiError::new(StatusCode::CONFLICT, format!("sandbox '{id}' is already running")));
    }
    let (row, _) = state.manager.connect(&key.0, &id, secs, on_resume(&body)).await?;
    Ok((StatusCode::CREATED, Json(Sandbox::from(&row))).into_response())
}

/// E2B's fork: 201 with one `{sandbox}` or `{error}` per requested fork.
pub async fn fork(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, JsonBody(body): JsonBody<ForkBody>) -> Result<Response, ApiError> {
    let count = body.count.unwrap_or(1);
    let count = u32::try_from(count).map_err(|_| ApiError::bad_request(format!("count must be between 1 and 20, got {count}")))?;
    let timeout = body.timeout.map(timeout_secs).transpose()?;
    let results = state.manager.fork(&key.0, &id, count, timeout).await?;
    let items: Vec<serde_json::Value> = results
        .into_iter()
        .map(|r| match r {
            Ok(row) => serde_json::json!({ "sandbox": Sandbox::from(&row) }),
            Err(e) => {
                let e = ApiError::from(e);
                serde_json::json!({ "error": { "code": e.status.as_u16(), "message": e.message } })
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(items)).into_response())
}

/// E2B's `create_snapshot`: the sandbox's memory and disk, usable as a template.
pub async fn create_snapshot(
    State(state): State<AppState>,
    key: KeyId,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<SnapshotBody>,
) -> Result<Response, ApiError> {
    let row = state.manager.create_snapshot(&key.0, &id, body.name.filter(|n| !n.is_empty()), body.memory != Some(false)).await?;
    Ok((StatusCode::CREATED, Json(SnapshotInfo::from(&row))).into_response())
}

pub async fn list_snapshots(State(state): State<AppState>, key: KeyId, uri: Uri) -> Result<Json<Vec<SnapshotInfo>>, ApiError> {
    let params: BTreeMap<String, String> = pairs(uri.query()).into_iter().collect();
    let rows = state.manager.list_snapshots(&key.0).await?;
    let wanted = |r: &&hutch_core::store::SnapshotRow| {
        params.get("sandboxID").is_none_or(|s| r.source_sandbox.as_deref() == Some(s.as_str()))
            && params.get("name").is_none_or(|n| r.name.as_deref() == Some(n.as_str()))
    };
    Ok(Json(rows.iter().filter(wanted).map(SnapshotInfo::from).collect()))
}


#[cfg(test)]
mod tests {
    use super::MetricsRange;

    #[test]
    fn a_metrics_range_is_inclusive_open_ended_and_checked() {
        let range = MetricsRange::from_query(Some("start=10&end=20")).expect("a range");
        assert!(range.holds(10) && range.holds(20) && !range.holds(9) && !range.holds(21));
        assert!(MetricsRange::from_query(Some("start=10")).expect("a range").holds(i64::MAX));
        assert!(MetricsRange::from_query(None).expect("no range").holds(0));
        let reversed = MetricsRange::from_query(Some("start=20&end=10")).expect_err("refused");
        assert!(reversed.message.starts_with("Invalid time range for metrics"), "{}", reversed.message);
        for bad in ["start=-1", "end=soon", "start=1.5"] {
            assert_eq!(MetricsRange::from_query(Some(bad)).expect_err(bad).status, axum::http::StatusCode::BAD_REQUEST);
        }
    }
}
