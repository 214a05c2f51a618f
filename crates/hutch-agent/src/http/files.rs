//! envd's plain-HTTP `/files`: streaming upload (multipart or octet-stream) and download.

use crate::fs::creds::as_user;
use crate::fs::path::{ensure_parents_owned, resolve};
use crate::process::user::GuestUser;
use crate::state::AgentState;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt};
use hutch_proto::agent::HttpError;
use hutch_proto::filesystem::WrittenFile;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use parking_lot::Mutex;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

#[derive(Debug, Deserialize)]
pub struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

pub fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(HttpError { code: status.as_u16(), message: message.into() })).into_response()
}

#[allow(clippy::result_large_err)] // the Err is the HTTP reply itself
fn user_for(st: &AgentState, q: &FileQuery) -> Result<GuestUser, Response> {
    st.user(q.username.as_deref()).map_err(|e| http_error(StatusCode::UNAUTHORIZED, e.message))
}

fn io_response(path: &Path, e: std::io::Error) -> Response {
    let p = path.display();
    match e.kind() {
        std::io::ErrorKind::NotFound => http_error(StatusCode::NOT_FOUND, format!("path '{p}' does not exist")),
        std::io::ErrorKind::PermissionDenied => http_error(StatusCode::FORBIDDEN, format!("permission denied: '{p}'")),
        _ if e.raw_os_error() == Some(libc::ENOSPC) => {
            http_error(StatusCode::INSUFFICIENT_STORAGE, format!("not enough disk space to write '{p}'"))
        }
        _ if e.raw_os_error() == Some(libc::EISDIR) => {
            http_error(StatusCode::BAD_REQUEST, format!("path '{p}' is a directory"))
        }
        _ if e.raw_os_error() == Some(libc::ENOTDIR) => {
            http_error(StatusCode::BAD_REQUEST, format!("a component of '{p}' is not a directory"))
        }
        _ => http_error(StatusCode::INTERNAL_SERVER_ERROR, format!("'{p}': {e}")),
    }
}

pub async fn download(State(st): State<AgentState>, Query(q): Query<FileQuery>, headers: HeaderMap) -> Response {
    let user = match user_for(&st, &q) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let Some(raw) = q.path.as_deref().filter(|p| !p.is_empty()) else {
        return http_error(StatusCode::BAD_REQUEST, "the 'path' query parameter is required");
    };
    let path = resolve(raw, &user);
    let opened = {
        let path = path.clone();
        as_user(&user, move || std::fs::File::open(path)).await.and_then(|r| r)
    };
    let file = match opened {
        Ok(f) => tokio::fs::File::from_std(f),
        Err(e) => return io_response(&path, e),
    };
    let meta = match file.metadata().await {
        Ok(m) => m,
        Err(e) => return io_response(&path, e),
    };
    if meta.is_dir() {
        return http_error(StatusCode::BAD_REQUEST, format!("path '{}' is a directory", path.display()));
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stream = tokio_util_like::reader_stream(file);
    let reply = Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_DISPOSITION, format!("inline; filename=\"{}\"", name.replace('"', "")))
        .header(header::VARY, "Accept-Encoding");
    let gzipped = super::gzip::accepts_gzip(headers.get(header::ACCEPT_ENCODING).and_then(|v| v.to_str().ok())) && !headers.contains_key(header::RANGE);
    let reply = if gzipped {
        // Its length is known only once sent: chunked.
        reply.header(header::CONTENT_ENCODING, "gzip").body(Body::from_stream(super::gzip::deflate(Box::pin(stream))))
    } else {
        reply.header(header::CONTENT_LENGTH, meta.len()).body(Body::from_stream(stream))
    };
    reply.unwrap_or_else(|e| http_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

mod tokio_util_like {
    use bytes::Bytes;
    use futures::Stream;
    use tokio::io::AsyncReadExt;

    pub fn reader_stream(file: tokio::fs::File) -> impl Stream<Item = std::io::Result<Bytes>> {
        futures::stream::unfold(Some(file), |file| async move {
            let mut file = file?;
            let mut buf = vec![0u8; 256 * 1024];
            match file.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    Some((Ok(Bytes::from(buf)), Some(file)))
                }
                Err(e) => Some((Err(e), None)),
            }
        })
    }
}

/// Writes a body stream to `path` as `user`, creating parent directories, and gives
/// the file exactly `metadata`.
async fn write_file<S, E>(path: &Path, user: &GuestUser, mut data: S, metadata: &BTreeMap<String, String>) -> Result<WrittenFile, Response>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    ensure_parents_owned(path, user).map_err(|e| io_response(path, e))?;
    let target = path.to_path_buf();
    let created = as_user(user, move || {
        if target.is_dir() {
            return Err(std::io::Error::from_raw_os_error(libc::EISDIR));
        }
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&target) {
            Ok(file) => Ok((file, true)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => std::fs::File::create(&target).map(|f| (f, false)),
            Err(e) => Err(e),
        }
    })
    .await
    .and_then(|r| r);
    let (file, created) = created.map_err(|e| io_response(path, e))?;
    if created {
        // Already the user's; the chown is envd's order of events for a new file (it
        // creates as root, then chowns), which watchers and E2B's tests count: CREATE,
        // CHMOD, then WRITE.
        std::os::unix::fs::fchown(&file, Some(user.uid), Some(user.gid)).map_err(|e| io_response(path, e))?;
    }
    let mut file = tokio::fs::File::from_std(file);
    while let Some(chunk) = data.next().await {
        let chunk = chunk.map_err(|e| http_error(StatusCode::BAD_REQUEST, format!("reading upload: {e}")))?;
        file.write_all(&chunk).await.map_err(|e| io_response(path, e))?;
    }
    file.flush().await.map_err(|e| io_response(path, e))?;
    // Always rewritten (emptied too): an overwrite keeps the old file's attributes.
    let file = file.into_std().await;
    match crate::fs::metadata::replace(&file, metadata) {
        Ok(()) => {}
        // A filesystem without xattrs (/proc, /sys): the body is written, the metadata not.
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => tracing::warn!("'{}' keeps no metadata: {e}", path.display()),
        Err(e) => return Err(io_response(path, e)),
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Read back, as envd does: what the file keeps (nothing where xattrs are not kept).
    let metadata = crate::fs::metadata::of_file(&file);
    Ok(WrittenFile { path: path.display().to_string(), name, kind: "file".into(), metadata })
}

pub async fn upload(State(st): State<AgentState>, Query(q): Query<FileQuery>, headers: HeaderMap, body: Body) -> Response {
    let user = match user_for(&st, &q) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let metadata = match crate::fs::metadata::from_headers(&headers) {
        Ok(m) => m,
        Err(message) => return http_error(StatusCode::BAD_REQUEST, message),
    };
    let encoding = match super::gzip::upload_encoding(headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok())) {
        Ok(e) => e,
        Err(message) => return http_error(StatusCode::BAD_REQUEST, message),
    };
    // Inflated before the content type is looked at: a gzipped multipart body works too.
    let data: Upload = match encoding {
        super::gzip::Encoding::Identity => Box::pin(body.into_data_stream().map(|r| r.map_err(std::io::Error::other))),
        super::gzip::Encoding::Gzip => Box::pin(super::gzip::inflate(body.into_data_stream())),
    };
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let result = if content_type.starts_with("multipart/form-data") {
        let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).map(str::to_string);
        let seen = Arc::new(Mutex::new(Seen::default()));
        let seen2 = seen.clone();
        let data: Upload = Box::pin(data.inspect(move |chunk| {
            if let Ok(bytes) = chunk {
                let mut s = seen2.lock();
                s.bytes += bytes.len() as u64;
                s.chunks += 1;
                let room = SEEN_HEAD.saturating_sub(s.head.len());
                s.head.extend_from_slice(&bytes[..room.min(bytes.len())]);
            }
        }));
        upload_multipart(&user, q.path.as_deref(), content_type, data, &metadata).await.map_err(|refusal| {
            let (status, message) = match refusal {
                Refusal::Reply(response) => return response,
                Refusal::Plain(status, message) => (status, message),
            };
            let s = seen.lock();
            // What arrived, so a body cut short says where it was cut (and a whole one
            // that the parser still refuses shows as whole: how multer's first-boundary
            // race, now worked around in `multipart`, was found).
            let detail = format!(
                "{message} (received {} bytes in {} chunks; Content-Length {}; it began {:?})",
                s.bytes,
                s.chunks,
                declared.as_deref().unwrap_or("absent"),
                String::from_utf8_lossy(&s.head)
            );
            tracing::warn!("upload refused: {detail}");
            http_error(status, detail)
        })
    } else {
        let Some(raw) = q.path.as_deref().filter(|p| !p.is_empty()) else {
            return http_error(StatusCode::BAD_REQUEST, "the 'path' query parameter is required for a raw upload");
        };
        let path = resolve(raw, &user);
        write_file(&path, &user, data, &metadata).await.map(|w| vec![w])
    };
    match result {
        Ok(written) => Json(written).into_response(),
        Err(resp) => resp,
    }
}

/// Why a multipart upload was refused: the body itself (its error then says what
/// arrived), or a reply already made.
enum Refusal {
    Plain(StatusCode, String),
    Reply(Response),
}

/// Bytes of a multipart body's start quoted when it cannot be read.
const SEEN_HEAD: usize = 96;

/// What a multipart upload delivered, for its error.
#[derive(Default)]
struct Seen {
    bytes: u64,
    chunks: u64,
    head: Vec<u8>,
}

/// An upload's body, inflated if it came gzipped.
type Upload = super::multipart::Body;

async fn upload_multipart(
    user: &GuestUser,
    query_path: Option<&str>,
    content_type: &str,
    body: Upload,
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<WrittenFile>, Refusal> {
    let boundary = multer::parse_boundary(content_type).map_err(|e| Refusal::Plain(StatusCode::BAD_REQUEST, format!("bad multipart request: {e}")))?;
    let body = super::multipart::first_boundary_read(body, &boundary).await;
    let mut parts = multer::Multipart::new(body, boundary);
    let mut written = Vec::new();
    loop {
        let field = match parts.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return Err(Refusal::Plain(StatusCode::BAD_REQUEST, format!("bad multipart request: {e}"))),
        };
        if field.name() != Some("file") {
            continue;
        }
        let target: PathBuf = match (query_path.filter(|p| !p.is_empty()), field.file_name()) {
            (Some(p), _) => resolve(p, user),
            (None, Some(name)) if !name.is_empty() => resolve(name, user),
            _ => {
                return Err(Refusal::Reply(http_error(
                    StatusCode::BAD_REQUEST,
                    "each 'file' part needs a filename (the destination path) when no 'path' is given",
                )))
            }
        };
        written.push(write_file(&target, user, field, metadata).await.map_err(Refusal::Reply)?);
    }
    Ok(written)
}
