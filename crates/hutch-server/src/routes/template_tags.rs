//! E2B's template tags: `POST /templates/tags` points tags at the build a `name:tag`
//! names, `DELETE /templates/tags` removes tags, `GET /templates/{id}/tags` lists them.
//! The manager owns who may change them; this only speaks HTTP.

use super::body::JsonBody;
use crate::auth::KeyId;
use crate::error::ApiError;
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
pub struct AssignTags {
    /// `name` or `name:tag`: the build the tags will name.
    target: String,
    tags: Vec<String>,
}

#[derive(Deserialize)]
pub struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

/// Tag changes wait for the template's file lock and write with fsync: off the async
/// workers, which serve every other request.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, hutch_core::manager::ManagerError> + Send + 'static) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => Ok(result?),
        Err(e) => Err(hutch_core::manager::ManagerError::Internal(format!("a tag change's task failed: {e}")).into()),
    }
}

pub async fn assign(State(state): State<AppState>, key: KeyId, JsonBody(body): JsonBody<AssignTags>) -> Result<(StatusCode, Json<Value>), ApiError> {
    let manager = state.manager.clone();
    let (build_id, tags) = blocking(move || manager.assign_template_tags(&key.0, &body.target, &body.tags)).await?;
    Ok((StatusCode::CREATED, Json(json!({ "tags": tags, "buildID": build_id }))))
}

pub async fn remove(State(state): State<AppState>, key: KeyId, JsonBody(body): JsonBody<RemoveTags>) -> Result<StatusCode, ApiError> {
    let manager = state.manager.clone();
    blocking(move || manager.remove_template_tags(&key.0, &body.name, &body.tags)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn list(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let tags = state.manager.template_tags(&key.0, &id)?;
    Ok(Json(Value::Array(tags.into_iter().map(|t| json!({ "tag": t.tag, "buildID": t.build_id, "createdAt": t.created_at })).collect())))
}
