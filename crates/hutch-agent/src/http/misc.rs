//! Small envd endpoints (`/health`, `/envs`, `/metrics`) and hutch's `/init`, `/sync`, `/shutdown`.

use crate::http::files::http_error;
use crate::state::AgentState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hutch_proto::agent::{ClockReply, ClockRequest, InitRequest, Metrics};
use std::collections::BTreeMap;

pub async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

pub async fn envs(State(st): State<AgentState>) -> Json<BTreeMap<String, String>> {
    Json(st.config().env_vars.clone())
}

pub async fn init(State(st): State<AgentState>, body: Bytes) -> Response {
    let req: InitRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("invalid init request: {e}")),
    };
    if let Some(ns) = req.timestamp_ns {
        crate::guest::set_clock(ns);
    }
    if let Some(name) = &req.hostname {
        crate::guest::set_hostname(name);
    }
    if let Some(seed) = req.entropy.as_deref().and_then(|s| hutch_proto::b64::decode(s).ok()) {
        crate::guest::reseed_rng(&seed);
    }
    // The image's defaults first; what the host sends wins.
    let image = image_defaults();
    let mut env_vars = image.env.clone();
    env_vars.extend(req.env_vars);
    crate::trust::apply(req.ca_bundle.as_deref(), &mut env_vars);
    if let Some(id) = &req.sandbox_id {
        // The real id, whatever an image's Env said.
        env_vars.insert("E2B_SANDBOX_ID".into(), id.clone());
        env_vars.insert("HUTCH_SANDBOX_ID".into(), id.clone());
        crate::guest::write_identity(id, &req.metadata, &env_vars);
    }
    let mut cfg = st.config.write();
    cfg.env_vars = env_vars;
    cfg.access_token = req.access_token.filter(|t| !t.is_empty());
    if let Some(user) = req.default_user.or(image.user) {
        cfg.default_user = user;
    }
    cfg.default_workdir = image.workdir;
    StatusCode::NO_CONTENT.into_response()
}

/// The defaults of the image the root filesystem was made from (none for hutch's own
/// templates). A file that does not parse is ignored with a line on the console.
fn image_defaults() -> hutch_proto::agent::ImageDefaults {
    match std::fs::read(hutch_proto::agent::IMAGE_DEFAULTS_PATH) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            eprintln!("hutch-agent: ignoring {}: {e}", hutch_proto::agent::IMAGE_DEFAULTS_PATH);
            Default::default()
        }),
        Err(_) => Default::default(),
    }
}

/// Steps the clock by what the host measured, and answers the clock after it.
pub async fn clock(body: Bytes) -> Response {
    let req: ClockRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, format!("invalid clock request: {e}")),
    };
    crate::guest::step_clock(req.step_ns);
    Json(ClockReply { unix_ns: crate::guest::clock_ns() }).into_response()
}

/// Flushes the guest's dirty page cache to its disk, so a copy of the disk taken next
/// (a snapshot, an export) holds every file written so far.
pub async fn sync() -> StatusCode {
    let _ = tokio::task::spawn_blocking(nix::unistd::sync).await;
    StatusCode::NO_CONTENT
}

pub async fn shutdown() -> StatusCode {
    tokio::spawn(async {
        // Let the response reach the host first.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        crate::guest::power_off();
    });
    StatusCode::ACCEPTED
}

pub async fn metrics() -> Json<Metrics> {
    Json(tokio::task::spawn_blocking(crate::guest::metrics).await.unwrap_or_default())
}
