//! E2B's template build API, as the official SDKs' `Template.build` speaks it:
//! `POST /v3/templates` names the template and opens a build, each COPY's files are
//! asked for by hash and uploaded to a URL this server signs, `POST
//! /v2/templates/{id}/builds/{buildID}` starts the steps, and the status endpoint
//! pages through the build's log. The manager owns builds; this only speaks HTTP.

use super::body::{JsonBody, QueryParams};
use crate::auth::KeyId;
use crate::error::ApiError;
use crate::app::AppState;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use futures::StreamExt;
use hutch_core::manager::build_records::BuildStatus;
use super::build_request::BuildRequest;
use hutch_core::manager::builds::{TemplateInfo, MAX_UPLOAD};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewTemplate {
    #[serde(default)]
    name: Option<String>,
    /// The SDK's older name for `name`.
    #[serde(default)]
    alias: Option<String>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    /// The vCPUs and memory (MiB) sandboxes of the template get.
    #[serde(default)]
    cpu_count: Option<u32>,
    #[serde(default, rename = "memoryMB")]
    memory_mb: Option<u32>,
    /// Free space (MiB) the sandboxes' root filesystem has at least; 0 asks for none.
    #[serde(default)]
    min_free_disk_mb: Option<u32>,
}

pub async fn create(State(state): State<AppState>, key: KeyId, JsonBody(body): JsonBody<NewTemplate>) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Some(full) = body.name.or(body.alias).filter(|n| !n.is_empty()) else {
        return Err(ApiError::bad_request("name is required: the template's name, such as my-template or my-template:v1"));
    };
    // `name:tag` and `tags` both tag the build; with neither, it becomes `default`.
    let (name, tag) = match full.split_once(':') {
        Some((name, tag)) => (name, Some(tag.to_string())),
        None => (full.as_str(), None),
    };
    let mut tags: Vec<String> = tag.into_iter().collect();
    tags.extend(body.tags.unwrap_or_default());
    let shape = hutch_core::manager::builds::Shape { cpus: body.cpu_count, memory_mib: body.memory_mb, min_free_disk_mib: body.min_free_disk_mb.filter(|&mib| mib > 0) };
    let (template_id, build_id, tags) = state.manager.new_template_build(&key.0, name, &tags, shape)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "templateID": template_id, "buildID": build_id, "public": false, "names": [full], "tags": tags, "aliases": [name] })),
    ))
}

/// Whether a COPY's files are here; if not, where to upload them.
pub async fn files(State(state): State<AppState>, key: KeyId, Path((template_id, hash)): Path<(String, String)>, headers: HeaderMap) -> Result<(StatusCode, Json<Value>), ApiError> {
    match state.manager.files_upload(&key.0, &template_id, &hash)? {
        None => Ok((StatusCode::CREATED, Json(json!({ "present": true })))),
        Some(token) => {
            // The URL the client reached this server by: it uploads there, without its key.
            let host = headers.get(axum::http::header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("127.0.0.1");
            let scheme = headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).filter(|p| *p == "https").unwrap_or("http");
            let url = format!("{scheme}://{host}/templates/{template_id}/files/{hash}/upload?token={token}");
            Ok((StatusCode::CREATED, Json(json!({ "present": false, "url": url, "headers": {} }))))
        }
    }
}

#[derive(Deserialize)]
pub struct UploadQuery {
    token: String,
}

/// The upload itself (the signed URL `files` handed out): the body is stored as it
/// comes, under a temporary name removed if the upload fails or the client leaves.
pub async fn upload(State(state): State<AppState>, Path((_template_id, hash)): Path<(String, String)>, QueryParams(q): QueryParams<UploadQuery>, body: Body) -> Result<StatusCode, ApiError> {
    let (partial, target) = state.manager.upload_target(&hash, &q.token)?;
    let guard = PartialFile(partial.clone());
    let dir = partial.parent().map(|p| p.to_path_buf()).unwrap_or_default();
    let failed = |e: std::io::Error| ApiError::from(hutch_core::manager::ManagerError::Internal(format!("storing an upload: {e}")));
    let mut file = tokio::fs::File::create(&partial).await.map_err(failed)?;
    let mut stream = body.into_data_stream();
    let mut total = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the upload: {e}")))?;
        total += chunk.len() as u64;
        if total > MAX_UPLOAD {
            return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("a COPY's files may be {} GiB at most", MAX_UPLOAD >> 30)));
        }
        // Every 64 MiB: the upload stops before the server's disk is full.
        if total % (64 << 20) < chunk.len() as u64 {
            hutch_vmm::space::check_room(&dir, 64 << 20).map_err(|m| ApiError::new(StatusCode::INSUFFICIENT_STORAGE, m))?;
        }
        file.write_all(&chunk).await.map_err(failed)?;
    }
    file.flush().await.map_err(failed)?;
    drop(file);
    state.manager.commit_upload(&partial, &target)?;
    drop(guard);
    Ok(StatusCode::CREATED)
}

/// An upload's temporary file, removed when the request ends however it ends.
struct PartialFile(std::path::PathBuf);

impl Drop for PartialFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub async fn start(State(state): State<AppState>, key: KeyId, Path((template_id, build_id)): Path<(String, String)>, JsonBody(req): JsonBody<BuildRequest>) -> Result<StatusCode, ApiError> {
    state.manager.start_template_build(&key.0, &template_id, &build_id, req.into_plan()?)?;
    Ok(StatusCode::ACCEPTED)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusQuery {
    #[serde(default)]
    logs_offset: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    level: Option<String>,
}

/// At most this many log entries per status answer (E2B's own limit).
const MAX_ENTRIES: usize = 100;

fn rank(level: &str) -> u8 {
    match level {
        "debug" => 0,
        "info" => 1,
        "warn" => 2,
        _ => 3,
    }
}

pub async fn status(State(state): State<AppState>, key: KeyId, Path((template_id, build_id)): Path<(String, String)>, QueryParams(q): QueryParams<StatusQuery>) -> Result<Json<Value>, ApiError> {
    if let Some(level) = q.level.as_deref().filter(|l| !["debug", "info", "warn", "error"].contains(l)) {
        return Err(ApiError::bad_request(format!("level '{level}' is not one of debug, info, warn, error")));
    }
    let record = state.manager.template_build(&key.0, &template_id, &build_id)?;
    let floor = q.level.as_deref().map(rank).unwrap_or(0);
    let entries: Vec<_> = record.entries.iter().filter(|e| rank(e.level) >= floor).collect();
    // Offsets count from the build's first entry, also after old ones were let go.
    let offset = q.logs_offset.unwrap_or(0).saturating_sub(record.dropped).min(entries.len());
    let limit = q.limit.unwrap_or(MAX_ENTRIES).min(MAX_ENTRIES);
    let page: Vec<_> = entries.iter().skip(offset).take(limit).collect();
    let status = match record.status {
        BuildStatus::Waiting => "waiting",
        BuildStatus::Building => "building",
        BuildStatus::Ready => "ready",
        BuildStatus::Error => "error",
    };
    let mut body = json!({
        "templateID": record.template_id,
        "buildID": record.build_id,
        "status": status,
        "logs": page.iter().map(|e| e.message.clone()).collect::<Vec<_>>(),
        "logEntries": page,
    });
    if let Some((message, step)) = &record.reason {
        let failed: Vec<_> = record.entries.iter().filter(|e| e.step.as_deref() == Some(step.as_str()) && rank(e.level) >= 2).collect();
        body["reason"] = json!({ "message": message, "step": step, "logEntries": failed });
    }
    Ok(Json(body))
}

#[derive(Deserialize)]
pub struct LogsQuery {
    /// Milliseconds since the epoch: entries from (forward) or up to (backward) it.
    #[serde(default)]
    cursor: Option<u64>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    direction: Option<String>,
    #[serde(default)]
    level: Option<String>,
    /// E2B's `persistent`/`temporary`: a build's log here is one (kept an hour).
    #[serde(default)]
    #[allow(dead_code)]
    source: Option<String>,
}

/// `GET /templates/{id}/builds/{buildID}/logs` (E2B's `TemplateBuildLogsResponse`):
/// the build's entries from a timestamp cursor, forward (oldest first) or backward
/// (newest first), at most `limit` (≤ 100), at `level` or above.
pub async fn logs(State(state): State<AppState>, key: KeyId, Path((template_id, build_id)): Path<(String, String)>, QueryParams(q): QueryParams<LogsQuery>) -> Result<Json<Value>, ApiError> {
    if let Some(level) = q.level.as_deref().filter(|l| !["debug", "info", "warn", "error"].contains(l)) {
        return Err(ApiError::bad_request(format!("level '{level}' is not one of debug, info, warn, error")));
    }
    let backward = match q.direction.as_deref() {
        None | Some("forward") => false,
        Some("backward") => true,
        Some(other) => return Err(ApiError::bad_request(format!("direction '{other}' is not forward or backward"))),
    };
    let record = state.manager.template_build(&key.0, &template_id, &build_id)?;
    let floor = q.level.as_deref().map(rank).unwrap_or(0);
    let millis = |e: &&hutch_core::manager::build_records::LogEntry| {
        humantime::parse_rfc3339(&e.timestamp).ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_millis() as u64)
    };
    let kept = record.entries.iter().filter(|e| rank(e.level) >= floor);
    let limit = q.limit.unwrap_or(MAX_ENTRIES).min(MAX_ENTRIES);
    let page: Vec<&hutch_core::manager::build_records::LogEntry> = match (backward, q.cursor) {
        (false, cursor) => kept.filter(|e| cursor.is_none_or(|c| millis(e) >= c)).take(limit).collect(),
        (true, cursor) => kept.rev().filter(|e| cursor.is_none_or(|c| millis(e) <= c)).take(limit).collect(),
    };
    Ok(Json(json!({ "logs": page })))
}

/// A template as E2B's `Template` object shows it: its current build's (the `default`
/// tag's), with the builds its tags name counted.
fn template_json(t: &TemplateInfo) -> Value {
    let created = t.builds.iter().map(|b| b.built_at.as_str()).min().unwrap_or(&t.built_at);
    json!({
        "templateID": t.name, "buildID": t.build_id, "cpuCount": t.cpus, "memoryMB": t.memory_mib,
        "diskSizeMB": t.disk_size >> 20, "public": t.public, "aliases": [t.name], "names": [t.name],
        "createdAt": created, "updatedAt": t.built_at, "createdBy": null, "lastSpawnedAt": null,
        "spawnCount": 0, "buildCount": t.builds.len(), "envdVersion": hutch_proto::ENVD_VERSION, "buildStatus": "ready",
    })
}

/// `GET /templates`: the built-in templates and this key's own.
pub async fn list(State(state): State<AppState>, key: KeyId) -> Json<Value> {
    Json(Value::Array(state.manager.templates(&key.0).iter().map(template_json).collect()))
}

/// `GET /templates/{id}`: one template with its builds (E2B's `TemplateWithBuilds`).
pub async fn get_one(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let t = state.manager.template_info(&key.0, &id)?;
    let mut body = template_json(&t);
    let builds: Vec<Value> = t
        .builds
        .iter()
        .map(|b| {
            json!({
                "buildID": b.id, "status": "ready", "createdAt": b.built_at, "updatedAt": b.built_at, "finishedAt": b.built_at,
                "cpuCount": t.cpus, "memoryMB": t.memory_mib, "diskSizeMB": b.disk_size >> 20, "envdVersion": hutch_proto::ENVD_VERSION,
            })
        })
        .collect();
    body["builds"] = Value::Array(builds);
    Ok(Json(body))
}

/// `Template.exists` / alias lookups: a template this key built, or a built-in one.
pub async fn alias(State(state): State<AppState>, key: KeyId, Path(alias): Path<String>) -> Result<Json<Value>, ApiError> {
    let public = state.manager.template_alias(&key.0, &alias)?;
    Ok(Json(json!({ "templateID": alias, "public": public })))
}

/// `DELETE /templates/{id}`: a template this key built, else (E2B deletes snapshots as
/// templates) one of its snapshots.
pub async fn delete(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    if state.manager.release_unbuilt_template(&key.0, &id)? {
        return Ok(StatusCode::NO_CONTENT);
    }
    if state.manager.template_owner(&id).as_deref() == Some(key.0.as_str()) {
        let home = state.manager.home().clone();
        let name = id.clone();
        let removed = tokio::task::spawn_blocking(move || hutch_core::build::remove_template(&home, &name))
            .await
            .map_err(|e| ApiError::from(hutch_core::manager::ManagerError::Internal(e.to_string())))?;
        return match removed {
            Ok(()) => {
                // A create of it now says it is gone instead of booting a removed image.
                state.manager.forget_artifacts(&id);
                Ok(StatusCode::NO_CONTENT)
            }
            Err(e @ hutch_core::build::RemoveError::InUse { .. }) => Err(ApiError::new(StatusCode::CONFLICT, e.to_string())),
            Err(e @ hutch_core::build::RemoveError::Unknown(_)) => Err(ApiError::new(StatusCode::NOT_FOUND, e.to_string())),
            Err(e) => Err(hutch_core::manager::ManagerError::Internal(e.to_string()).into()),
        };
    }
    state.manager.delete_snapshot(&key.0, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
