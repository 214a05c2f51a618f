//! `filesystem.Filesystem` unary RPCs.

use super::entry::entry_info;
use super::path::{chown, create_dirs, create_parents, resolve};
use crate::http::connect::{parse, ConnectError, UnaryResult};
use crate::state::AgentState;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use hutch_proto::connect::Code;
use hutch_proto::filesystem::*;
use serde_json::{json, Value};
use std::io::ErrorKind;
use std::path::Path;

pub fn io_error(path: &Path, e: std::io::Error) -> ConnectError {
    let p = path.display();
    match e.kind() {
        ErrorKind::NotFound => ConnectError::new(Code::NotFound, format!("path '{p}' does not exist")),
        ErrorKind::PermissionDenied => ConnectError::new(Code::PermissionDenied, format!("permission denied: '{p}'")),
        ErrorKind::AlreadyExists => ConnectError::new(Code::AlreadyExists, format!("path '{p}' already exists")),
        _ if e.raw_os_error() == Some(libc::ENOTDIR) => {
            ConnectError::new(Code::InvalidArgument, format!("a component of '{p}' is not a directory"))
        }
        _ if e.raw_os_error() == Some(libc::ENOSPC) => {
            ConnectError::new(Code::ResourceExhausted, format!("not enough disk space for '{p}'"))
        }
        _ => ConnectError::new(Code::Internal, format!("'{p}': {e}")),
    }
}

fn entry(path: &Path) -> Result<EntryInfo, ConnectError> {
    entry_info(path).map_err(|e| io_error(path, e))
}

pub async fn stat(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<EntryResponse> {
    let req: PathRequest = parse(&body)?;
    let path = resolve(&req.path, &st.rpc_user(&headers)?);
    Ok(Json(EntryResponse { entry: entry(&path)? }))
}

pub async fn make_dir(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<EntryResponse> {
    let req: PathRequest = parse(&body)?;
    let user = st.rpc_user(&headers)?;
    let path = resolve(&req.path, &user);
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
    create_dirs(&path, &user).map_err(|e| io_error(&path, e))?;
    Ok(Json(EntryResponse { entry: entry(&path)? }))
}

pub async fn move_entry(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<EntryResponse> {
    let req: MoveRequest = parse(&body)?;
    let user = st.rpc_user(&headers)?;
    let (src, dst) = (resolve(&req.source, &user), resolve(&req.destination, &user));
    std::fs::symlink_metadata(&src).map_err(|e| io_error(&src, e))?;
    create_parents(&dst, &user).map_err(|e| io_error(&dst, e))?;
    std::fs::rename(&src, &dst).map_err(|e| io_error(&dst, e))?;
    Ok(Json(EntryResponse { entry: entry(&dst)? }))
}

pub async fn list_dir(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<ListDirResponse> {
    let req: ListDirRequest = parse(&body)?;
    let path = resolve(&req.path, &st.rpc_user(&headers)?);
    let meta = std::fs::metadata(&path).map_err(|e| io_error(&path, e))?;
    if !meta.is_dir() {
        return Err(ConnectError::new(Code::InvalidArgument, format!("path '{}' is not a directory", path.display())));
    }
    let mut entries = Vec::new();
    walk(&path, req.depth.max(1), &mut entries)?;
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
        let is_dir = info.file_type == FileType::Directory;
        out.push(info);
        if is_dir && depth > 1 {
            walk(&p, depth - 1, out)?;
        }
    }
    Ok(())
}

pub async fn remove(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<Value> {
    let req: PathRequest = parse(&body)?;
    let path = resolve(&req.path, &st.rpc_user(&headers)?);
    let result = match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
        Ok(_) => std::fs::remove_file(&path),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    result.map_err(|e| io_error(&path, e))?;
    Ok(Json(json!({})))
}

/// Gives a new file to the user it was written for.
pub fn own(path: &Path, user: &crate::process::user::GuestUser) -> Result<(), ConnectError> {
    chown(path, user).map_err(|e| io_error(path, e))
}
