//! REST routes: E2B's control plane (v1 and v2 paths) plus health and the OpenAPI file.

mod archives;
mod body;
mod build_request;
mod listing;
mod sandboxes;
mod secrets;
mod template_tags;
mod templates;

use crate::error::ApiError;
use crate::app::AppState;
use axum::http::StatusCode;
use axum::routing::{get, post, put};
use axum::Router;

pub fn rest() -> Router<AppState> {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/status", get(status))
        .route("/openapi.json", get(|| async { ([(axum::http::header::CONTENT_TYPE, "application/json")], crate::app::OPENAPI) }))
        .route("/sandboxes", post(sandboxes::create_v1).get(listing::list_all))
        .route("/v2/sandboxes", post(sandboxes::create_v2).get(listing::list_v2))
        .route("/sandboxes/{id}", get(sandboxes::get_one).delete(sandboxes::kill))
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/{id}/network", put(sandboxes::update_network).get(sandboxes::network))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/sandboxes/{id}/metrics", get(sandboxes::metrics))
        .route("/sandboxes/{id}/logs", get(sandboxes::logs))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/sandboxes/{id}/snapshots", post(sandboxes::create_snapshot))
        .route("/snapshots", get(sandboxes::list_snapshots))
        .route("/snapshots/archive", post(archives::import))
        .route("/snapshots/{id}/archive", get(archives::export))
        .route("/templates", get(templates::list))
        .route("/templates/{id}", get(templates::get_one).delete(templates::delete))
        .route("/templates/tags", post(template_tags::assign).delete(template_tags::remove))
        .route("/templates/{id}/tags", get(template_tags::list))
        .route("/templates/{id}/tags/count", get(template_tags::count))
        .route("/templates/{id}/tags/exists", get(template_tags::exists))
        .route("/templates/{id}/tags/groups", get(template_tags::groups))
        .route("/templates/{id}/tags/{tag}/assignments", get(template_tags::assignments))
        .route("/v3/templates", post(templates::create))
        .route("/templates/aliases/{alias}", get(templates::alias))
        .route("/templates/{id}/files/{hash}", get(templates::files))
        .route("/templates/{id}/files/{hash}/upload", put(templates::upload))
        .route("/v2/templates/{id}/builds/{build}", post(templates::start))
        .route("/templates/{id}/builds/{build}/status", get(templates::status))
        .route("/templates/{id}/builds/{build}/logs", get(templates::logs))
        .merge(secrets::routes())
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
}

/// hutch's own: what the server holds, all keys together (counts only, no ids).
/// Pools are listed for the templates the key may use; `size` is what the pool keeps
/// now, pinned by the operator (`pinned`) or sized by demand.
async fn status(axum::extract::State(state): axum::extract::State<AppState>, key: crate::auth::KeyId) -> axum::Json<serde_json::Value> {
    let pools: serde_json::Map<String, serde_json::Value> = state
        .manager
        .pools(&key.0)
        .into_iter()
        .map(|p| (p.template, serde_json::json!({ "ready": p.ready, "size": p.target, "pinned": p.pinned })))
        .collect();
    let (running, paused) = state.manager.counts();
    axum::Json(serde_json::json!({ "running": running, "paused": paused, "maxSandboxes": state.manager.config().max_sandboxes, "pools": pools }))
}
