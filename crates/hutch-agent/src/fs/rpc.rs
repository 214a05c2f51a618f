//! `filesystem.Filesystem` unary RPCs, each done with the requesting user's permissions.

use super::creds::as_user;
use super::entry::entry_info;
use super::io_error::io_error;
use super::path::{create_parents, resolve};
use crate::http::connect::{parse, ConnectError, UnaryResult};
use crate::process::user::GuestUser;
use crate::state::AgentState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use hutch_proto::connect::Code;
use hutch_proto::filesystem::*;
use serde_json::{json, Value};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

fn entry(path: &Path) -> Result<EntryInfo, ConnectError> {
    entry_info(path).map_err(|e| io_error(path, e))
}

/// Resolves `raw` for the request's user and runs `op` on it as that user.
async fn with_path<T, F>(st: &AgentState, headers: &HeaderMap, raw: &str, op: F) -> Result<T, ConnectError>
where
    T: Send + 'static,
    F: FnOnce(PathBuf, GuestUser) -> Result<T, ConnectError> + Send + 'static,
{
    let user = st.rpc_user(headers)?;
    let path = resolve(raw, &user);
    let u = user.clone();
    as_user(&user, move || op(path, u)).await.map_err(|e| ConnectError::new(Code::Internal, e))?
}

pub async fn stat(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<EntryResponse> {
    let req: PathRequest = parse(&body)?;
    let entry = with_path(&st, &headers, &req.path, |path, _| entry(&path)).await?;
    Ok(Json(EntryResponse { entry }))
}

pub async fn make_dir(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<EntryResponse> {
    let req: PathRequest = parse(&body)?;
    let entry = with_path(&st, &headers, &req.path, |path, _| {
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => {
                return Err(ConnectError::new(Code::AlreadyExists, format!("directory already exists: {}", path.display())))
            }
            Ok(_) => {
                return Err(ConnectError::new(
                    Code::InvalidArgument,
                    format!("path already exists but is not a directory: {}", path.display()),
                ))
            }
            Err(_) => {}
        }
        std::fs::create_dir_all(&path).map_err(|e| io_error(&path, e))?;
        entry(&path)
    })
    .await?;
    Ok(Json(EntryResponse { entry }))
}

pub async fn move_entry(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<EntryResponse> {
    let req: MoveRequest = parse(&body)?;
    let destination = req.destination;
    let entry = with_path(&st, &headers, &req.source, move |src, user| {
        let dst = resolve(&destination, &user);
        std::fs::symlink_metadata(&src).map_err(|e| io_error(&src, e))?;
        create_parents(&dst).map_err(|e| io_error(&dst, e))?;
        std::fs::rename(&src, &dst).map_err(|e| io_error(&dst, e))?;
        entry(&dst)
    })
    .await?;
    Ok(Json(EntryResponse { entry }))
}

pub async fn list_dir(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<ListDirResponse> {
    let req: ListDirRequest = parse(&body)?;
    let depth = req.depth.max(1);
    let entries = with_path(&st, &headers, &req.path, move |path, _| {
        let meta = std::fs::metadata(&path).map_err(|e| io_error(&path, e))?;
        if !meta.is_dir() {
            return Err(ConnectError::new(Code::InvalidArgument, format!("path '{}' is not a directory", path.display())));
        }
        let mut entries = Vec::new();
        walk(&path, depth, &mut entries)?;
        Ok(entries)
    })
    .await?;
    Ok(Json(ListDirResponse { entries }))
}

fn walk(dir: &Path, depth: u32, out: &mut Vec<EntryInfo>) -> Result<(), ConnectError> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| io_error(dir, e))?
        .filter_map(|d| d.ok().map(|d| d.path()))
        .collect();
    names.sort();
    for p in names {
        let Ok(info) = entry_info(&p) else { continue };
        // A symlink is listed as what it points at but never walked into (a link to
        // `.` would make the walk explode), as envd's walk does not follow links.
        let is_dir = info.file_type == FileType::Directory && info.symlink_target.is_none();
        out.push(info);
        if is_dir && depth > 1 {
            // An unreadable subdirectory is listed but not descended into.
            let _ = walk(&p, depth - 1, out);
        }
    }
    Ok(())
}

pub async fn remove(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<Value> {
    let req: PathRequest = parse(&body)?;
    with_path(&st, &headers, &req.path, |path, _| {
        let result = match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
            Ok(_) => std::fs::remove_file(&path),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        };
        result.map_err(|e| io_error(&path, e))
    })
    .await?;
    Ok(Json(json!({})))
}
