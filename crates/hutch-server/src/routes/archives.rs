//! Snapshot archives over HTTP: export streams a tar, import reads one (of any size:
//! the body goes to a file, not memory) and answers with the new snapshot.

use crate::auth::KeyId;
use crate::dto::SnapshotInfo;
use crate::error::ApiError;
use crate::query::pairs;
use crate::app::AppState;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use hutch_formats::archive::MAX_ARCHIVE_BYTES;
use tokio::io::AsyncWriteExt;

/// Longest pause in an archive upload.
const UPLOAD_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// `GET /snapshots/{id}/archive`: the snapshot's filesystem as a portable archive.
pub async fn export(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Response, ApiError> {
    let (path, manifest) = state.manager.export_snapshot(&key.0, &id).await?;
    let file = tokio::fs::File::open(&path).await.map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("opening the archive: {e}")));
    // Unlinked now: the open file streams on, and nothing is left if the client leaves.
    let _ = std::fs::remove_file(&path);
    let file = file?;
    let len = file.metadata().await.map(|m| m.len()).unwrap_or(0);
    let name = manifest.name.clone().unwrap_or(id);
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-tar".to_string()),
            (header::CONTENT_LENGTH, len.to_string()),
            (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{name}.hutch.tar\"")),
            (header::HeaderName::from_static("x-hutch-disk-sha256"), manifest.disk_sha256),
        ],
        Body::from_stream(tokio_util::io::ReaderStream::new(file)),
    )
        .into_response())
}

/// `POST /snapshots/archive[?name=NAME]`: imports an archive made by export.
pub async fn import(State(state): State<AppState>, key: KeyId, req: Request) -> Result<Response, ApiError> {
    let name = pairs(req.uri().query()).into_iter().find(|(k, _)| k == "name").map(|(_, v)| v).filter(|v| !v.is_empty());
    let tmp = state.manager.home().tmp();
    let internal = |what: &str, e: std::io::Error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}: {e}"));
    let too_large = || ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("an archive may be {} GiB at most", MAX_ARCHIVE_BYTES >> 30));
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_ARCHIVE_BYTES) {
        return Err(too_large());
    }
    std::fs::create_dir_all(&tmp).map_err(|e| internal("creating the upload directory", e))?;
    let no_room = |m: String| ApiError::from(hutch_core::manager::ManagerError::NoSpace(m));
    hutch_vmm::space::check_room(&tmp, declared.unwrap_or(0)).map_err(no_room)?;
    let upload = tempfile::NamedTempFile::new_in(&tmp).map_err(|e| internal("creating the upload file", e))?;
    let mut file = tokio::fs::File::from_std(upload.reopen().map_err(|e| internal("opening the upload file", e))?);
    let mut body = req.into_body().into_data_stream();
    let (mut received, mut checked) = (0u64, 0u64);
    loop {
        // A client that stops sending mid-upload does not hold the request forever.
        let chunk = match tokio::time::timeout(UPLOAD_IDLE, body.next()).await {
            Ok(Some(chunk)) => chunk.map_err(|e| ApiError::bad_request(format!("reading the archive upload: {e}")))?,
            Ok(None) => break,
            Err(_) => return Err(ApiError::new(StatusCode::REQUEST_TIMEOUT, format!("the upload sent nothing for {} s", UPLOAD_IDLE.as_secs()))),
        };
        received += chunk.len() as u64;
        if received > MAX_ARCHIVE_BYTES {
            return Err(too_large());
        }
        if received - checked > 64 << 20 {
            hutch_vmm::space::check_room(&tmp, 64 << 20).map_err(no_room)?;
            checked = received;
        }
        file.write_all(&chunk).await.map_err(|e| internal("writing the upload file", e))?;
    }
    file.flush().await.map_err(|e| internal("writing the upload file", e))?;
    let row = state.manager.import_snapshot(&key.0, upload.path(), name).await?;
    Ok((StatusCode::CREATED, Json(SnapshotInfo::from(&row))).into_response())
}
