//! Pause, resume, fork and snapshots of sandboxes on `hutch serve` (E2B's routes),
//! plus hutch's portable snapshot archives.

use crate::remote::{enc, status_error, Api, ApiError, Created, Sandbox};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde::{Deserialize, Serialize};
use std::path::Path;
use tokio::io::AsyncWriteExt;

/// A snapshot as the API lists it (E2B's `SnapshotInfo` and hutch's additions).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    #[serde(default)]
    pub names: Vec<String>,
    #[serde(rename = "templateID", default)]
    pub template_id: String,
    #[serde(rename = "sandboxID", default)]
    pub sandbox_id: Option<String>,
    #[serde(rename = "createdAt", default)]
    pub created_at: String,
    /// Holds memory (running processes), not only the filesystem.
    #[serde(default)]
    pub memory: bool,
}

#[derive(Deserialize)]
struct ForkItem {
    sandbox: Option<Created>,
    error: Option<ForkError>,
}

#[derive(Deserialize)]
struct ForkError {
    code: u16,
    message: String,
}

/// What a pause keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// Memory and disk: a resume goes on where the sandbox was.
    Full,
    /// The disk only: a resume boots on it, without the processes.
    Filesystem,
}

impl Api {
    /// Pauses a sandbox (memory and disk saved, VM stopped); false if it already was.
    pub async fn pause(&self, id: &str) -> Result<bool, ApiError> {
        self.pause_as(id, PauseMode::Full).await
    }

    /// A pause that keeps memory and disk, or (`Filesystem`) the disk only: its resume
    /// boots the guest, without its processes. False when it was paused already.
    pub async fn pause_as(&self, id: &str, mode: PauseMode) -> Result<bool, ApiError> {
        let body = serde_json::json!({ "memory": mode == PauseMode::Full });
        match self.call(Method::POST, &format!("/sandboxes/{}/pause", enc(id)), Some(body)).await {
            Ok(_) => Ok(true),
            Err(ApiError::Http { status, .. }) if status == StatusCode::CONFLICT => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Resumes a paused sandbox (a running one is just returned): E2B's connect.
    pub async fn resume(&self, id: &str, timeout: Option<u64>) -> Result<Sandbox, ApiError> {
        self.connect(id, timeout).await
    }

    /// Resumes a paused sandbox by booting it on its disk, whatever memory its pause
    /// kept (E2B's `on_resume="reboot"`): its files stay, its processes are gone.
    pub async fn reboot(&self, id: &str, timeout: Option<u64>) -> Result<Sandbox, ApiError> {
        let mut body = serde_json::json!({ "memory": false });
        if let Some(t) = timeout {
            body["timeout"] = t.into();
        }
        let (_, _, bytes) = self.call(Method::POST, &format!("/v2/sandboxes/{}/connect", enc(id)), Some(body)).await?;
        Ok(self.sandbox(Self::json(&bytes)?))
    }

    /// `count` copies of a running sandbox, each continuing from its state now. One
    /// result per copy: some may fail (capacity) while others start.
    pub async fn fork(&self, id: &str, count: u32, timeout: Option<u64>) -> Result<Vec<Result<Sandbox, ApiError>>, ApiError> {
        let mut body = serde_json::json!({ "count": count });
        if let Some(t) = timeout {
            body["timeout"] = t.into();
        }
        let (_, _, bytes) = self.call(Method::POST, &format!("/sandboxes/{}/fork", enc(id)), Some(body)).await?;
        let items: Vec<ForkItem> = Self::json(&bytes)?;
        Ok(items
            .into_iter()
            .map(|item| match (item.sandbox, item.error) {
                (Some(created), _) => Ok(self.sandbox(created)),
                (None, Some(e)) => Err(status_error(StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), e.message.as_bytes())),
                (None, None) => Err(ApiError::Protocol("a fork result with neither sandbox nor error".into())),
            })
            .collect())
    }

    /// Saves a sandbox's memory and disk as a snapshot; its id (or `name`) works as a
    /// template for new sandboxes.
    pub async fn create_snapshot(&self, id: &str, name: Option<&str>) -> Result<SnapshotInfo, ApiError> {
        self.create_snapshot_as(id, name, PauseMode::Full).await
    }

    /// A snapshot of memory and disk, or (`Filesystem`) of the disk only: sandboxes
    /// started from that one boot on it.
    pub async fn create_snapshot_as(&self, id: &str, name: Option<&str>, mode: PauseMode) -> Result<SnapshotInfo, ApiError> {
        let body = serde_json::json!({ "name": name, "memory": mode == PauseMode::Full });
        let (_, _, bytes) = self.call(Method::POST, &format!("/sandboxes/{}/snapshots", enc(id)), Some(body)).await?;
        Self::json(&bytes)
    }

    pub async fn list_snapshots(&self) -> Result<Vec<SnapshotInfo>, ApiError> {
        let (_, _, bytes) = self.call(Method::GET, "/snapshots", None).await?;
        Self::json(&bytes)
    }

    /// Deletes a snapshot by id or name; false when there was none.
    pub async fn delete_snapshot(&self, id_or_name: &str) -> Result<bool, ApiError> {
        match self.call(Method::DELETE, &format!("/templates/{}", enc(id_or_name)), None).await {
            Ok(_) => Ok(true),
            Err(ApiError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Downloads a snapshot's portable archive into `file`; returns its size. The
    /// `progress` callback sees the bytes written so far and the total (when known).
    pub async fn export_snapshot(&self, id_or_name: &str, file: &Path, progress: &dyn Fn(u64, Option<u64>)) -> Result<u64, ApiError> {
        let req = Request::builder()
            .method(Method::GET)
            .uri(format!("{}/snapshots/{}/archive", self.url(), enc(id_or_name)))
            .header("x-api-key", self.key())
            .body(http_body_util::Full::new(Bytes::new()))
            .map_err(|e| ApiError::Protocol(e.to_string()))?;
        let resp = self.http().request(req).await.map_err(|e| self.unreachable(e))?;
        let (parts, body) = resp.into_parts();
        if !parts.status.is_success() {
            let bytes = body.collect().await.map_err(|e| self.unreachable(e))?.to_bytes();
            return Err(status_error(parts.status, &bytes));
        }
        let total = parts.headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        let io = |e: std::io::Error| ApiError::Protocol(format!("writing {}: {e}", file.display()));
        let mut out = tokio::fs::File::create(file).await.map_err(io)?;
        let mut stream = body.into_data_stream();
        let mut written = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.unreachable(e))?;
            out.write_all(&chunk).await.map_err(io)?;
            written += chunk.len() as u64;
            progress(written, total);
        }
        out.flush().await.map_err(io)?;
        if total.is_some_and(|t| t != written) {
            return Err(ApiError::Protocol(format!("the archive ended after {written} of {total:?} bytes")));
        }
        Ok(written)
    }

    /// Uploads an archive made by `export_snapshot`; the server verifies it.
    pub async fn import_snapshot(&self, file: &Path, name: Option<&str>) -> Result<SnapshotInfo, ApiError> {
        let io = |e: std::io::Error| ApiError::InvalidArgument(format!("reading {}: {e}", file.display()));
        let len = tokio::fs::metadata(file).await.map_err(io)?.len();
        let reader = tokio::fs::File::open(file).await.map_err(io)?;
        let frames = tokio_util::io::ReaderStream::new(reader).map_ok(Frame::data);
        let body = StreamBody::new(frames).boxed_unsync();
        let mut uri = format!("{}/snapshots/archive", self.url());
        if let Some(n) = name {
            uri.push_str(&format!("?name={}", enc(n)));
        }
        let req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header("x-api-key", self.key())
            .header(http::header::CONTENT_TYPE, "application/x-tar")
            .header(http::header::CONTENT_LENGTH, len)
            .body(body)
            .map_err(|e| ApiError::Protocol(e.to_string()))?;
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
        let resp = client.request(req).await.map_err(|e| self.unreachable(e))?;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.map_err(|e| self.unreachable(e))?.to_bytes();
        if !parts.status.is_success() {
            return Err(status_error(parts.status, &bytes));
        }
        Self::json(&bytes)
    }
}

impl Sandbox {
    /// Pauses this sandbox; `Api::resume` (or connect) brings it back.
    pub async fn pause(&self) -> Result<bool, ApiError> {
        self.api_ref().pause(&self.id).await
    }

    pub async fn pause_as(&self, mode: PauseMode) -> Result<bool, ApiError> {
        self.api_ref().pause_as(&self.id, mode).await
    }

    pub async fn fork(&self, count: u32) -> Result<Vec<Result<Sandbox, ApiError>>, ApiError> {
        self.api_ref().fork(&self.id, count, None).await
    }

    pub async fn create_snapshot(&self, name: Option<&str>) -> Result<SnapshotInfo, ApiError> {
        self.api_ref().create_snapshot(&self.id, name).await
    }
}
