//! What template builds need from the guest besides commands: a build step's `COPY`
//! (a tar the host prepared, written with Docker's rules, owner and mode) and a frozen
//! root filesystem while the host copies the disk as the step's cache layer.

use crate::http::files::http_error;
use crate::process::user::GuestUser;
use axum::body::Body;
use axum::extract::Query;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;
use serde::Deserialize;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A `COPY` tar is the step's files, as large as the context they came from, and no more.
const MAX_COPY: u64 = 4 << 30;

#[derive(Debug, Deserialize)]
pub struct CopyQuery {
    /// Absolute destination.
    dest: String,
    /// Who owns what is written: a user name, uid, or `user:group`.
    owner: String,
    /// Octal permissions for every file and directory written (their own when absent).
    #[serde(default)]
    mode: Option<String>,
    /// The tar holds one file that becomes `dest` itself (or goes into it when `dest` is
    /// a directory); otherwise its entries are relative to the directory `dest`.
    #[serde(default)]
    single: bool,
}

pub async fn copy(Query(q): Query<CopyQuery>, body: Body) -> Response {
    let owner = match GuestUser::lookup(&q.owner) {
        Ok(u) => u,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let mode = match q.mode.as_deref().filter(|m| !m.is_empty()).map(|m| u32::from_str_radix(m, 8)) {
        None => None,
        Some(Ok(m)) if m <= 0o7777 => Some(m),
        Some(_) => return http_error(StatusCode::BAD_REQUEST, format!("mode '{}' is not octal permissions such as 0755", q.mode.unwrap_or_default())),
    };
    if !q.dest.starts_with('/') {
        return http_error(StatusCode::BAD_REQUEST, format!("the destination '{}' is not absolute", q.dest));
    }
    // The body streams into a blocking reader: tar is read in order, and never whole.
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
    let dest = PathBuf::from(&q.dest);
    let job = tokio::task::spawn_blocking(move || write_tar(reader.take(MAX_COPY), &dest, &owner, mode, q.single));
    match job.await {
        Ok(Ok(count)) => axum::Json(serde_json::json!({ "written": count })).into_response(),
        Ok(Err(e)) => http_error(StatusCode::BAD_REQUEST, e),
        Err(e) => http_error(StatusCode::INTERNAL_SERVER_ERROR, format!("the copy task failed: {e}")),
    }
}

/// Writes the tar's entries; returns how many. Errors are one sentence naming the path.
fn write_tar(reader: impl Read, dest: &Path, owner: &GuestUser, mode: Option<u32>, single: bool) -> Result<usize, String> {
    let mut archive = tar::Archive::new(reader);
    let mut count = 0;
    let entries = archive.entries().map_err(|e| format!("reading the copied files: {e}"))?;
    if !single {
        make_dirs(dest, owner, mode)?;
    }
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("reading the copied files: {e}"))?;
        let relative = entry.path().map_err(|e| format!("a copied file has a bad name: {e}"))?.into_owned();
        if relative.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir)) {
            return Err(format!("the copied file '{}' would leave its destination", relative.display()));
        }
        let target = if single {
            // Docker: a file copied onto an existing directory goes into it.
            if dest.is_dir() { dest.join(relative.file_name().unwrap_or_default()) } else { dest.to_path_buf() }
        } else {
            dest.join(&relative)
        };
        let at = |e: std::io::Error| format!("writing '{}': {e}", target.display());
        if let Some(parent) = target.parent() {
            make_dirs(parent, owner, mode)?;
        }
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            make_dirs(&target, owner, mode)?;
        } else if kind.is_file() || kind.is_symlink() {
            // Docker overwrites files; a directory in the way is an error, as there.
            match std::fs::symlink_metadata(&target) {
                Ok(m) if m.is_dir() => return Err(format!("cannot copy a file onto the directory '{}'", target.display())),
                Ok(_) => std::fs::remove_file(&target).map_err(at)?,
                Err(_) => {}
            }
            entry.unpack(&target).map_err(at)?;
        } else {
            return Err(format!("'{}' is neither a file, a directory nor a symlink", relative.display()));
        }
        std::os::unix::fs::lchown(&target, Some(owner.uid), Some(owner.gid)).map_err(at)?;
        if let (Some(mode), false) = (mode, kind.is_symlink()) {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode)).map_err(at)?;
        }
        count += 1;
    }
    Ok(count)
}

/// Creates `dir` and its missing parents, the new ones owned by `owner` (Docker gives
/// directories a `COPY --chown` creates to that owner).
fn make_dirs(dir: &Path, owner: &GuestUser, mode: Option<u32>) -> Result<(), String> {
    let mut at = PathBuf::from("/");
    for part in dir.components().filter(|c| matches!(c, Component::Normal(_))) {
        at.push(part);
        match std::fs::metadata(&at) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => return Err(format!("'{}' is in the way of a directory the copy needs", at.display())),
            Err(_) => {}
        }
        std::fs::create_dir(&at).map_err(|e| format!("creating '{}': {e}", at.display()))?;
        std::os::unix::fs::lchown(&at, Some(owner.uid), Some(owner.gid)).map_err(|e| format!("creating '{}': {e}", at.display()))?;
        if let Some(mode) = mode {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&at, std::fs::Permissions::from_mode(mode));
        }
    }
    Ok(())
}

nix::ioctl_readwrite!(fifreeze, b'X', 119, libc::c_int);
nix::ioctl_readwrite!(fithaw, b'X', 120, libc::c_int);

/// Each freeze's number, so a watchdog thaws only the freeze it was started for.
static FREEZES: AtomicU64 = AtomicU64::new(0);

/// A freeze the host never ends (it died mid-copy) ends by itself after this: the
/// guest must not hang on its own disk for good.
const FREEZE_LIMIT: Duration = Duration::from_secs(120);

/// Flushes the root filesystem and stops writes to it until `/build/thaw`, so the
/// host's copy of the disk is exactly what the step left.
pub async fn freeze() -> Response {
    let number = FREEZES.fetch_add(1, Ordering::SeqCst) + 1;
    match tokio::task::spawn_blocking(|| root_ioctl(true)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return http_error(StatusCode::INTERNAL_SERVER_ERROR, format!("freezing the root filesystem: {e}")),
        Err(e) => return http_error(StatusCode::INTERNAL_SERVER_ERROR, format!("freezing the root filesystem: {e}")),
    }
    tokio::spawn(async move {
        tokio::time::sleep(FREEZE_LIMIT).await;
        if FREEZES.load(Ordering::SeqCst) == number && root_ioctl(false).is_ok() {
            eprintln!("hutch-agent: the host never thawed the root filesystem; thawed it after {} s", FREEZE_LIMIT.as_secs());
        }
    });
    StatusCode::NO_CONTENT.into_response()
}

pub async fn thaw() -> Response {
    FREEZES.fetch_add(1, Ordering::SeqCst);
    match tokio::task::spawn_blocking(|| root_ioctl(false)).await {
        // EINVAL: it was not frozen (the watchdog thawed it); the disk is writable either way.
        Ok(Ok(())) | Ok(Err(nix::errno::Errno::EINVAL)) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => http_error(StatusCode::INTERNAL_SERVER_ERROR, format!("thawing the root filesystem: {e}")),
        Err(e) => http_error(StatusCode::INTERNAL_SERVER_ERROR, format!("thawing the root filesystem: {e}")),
    }
}

fn root_ioctl(freeze: bool) -> Result<(), nix::errno::Errno> {
    use std::os::fd::AsRawFd;
    let root = std::fs::File::open("/").map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    let mut unused: libc::c_int = 0;
    // SAFETY: FIFREEZE/FITHAW take an int pointer they do not keep (the kernel ignores
    // its value); `root` is an open descriptor for the whole call.
    unsafe {
        if freeze {
            fifreeze(root.as_raw_fd(), &mut unused)?;
        } else {
            fithaw(root.as_raw_fd(), &mut unused)?;
        }
    }
    Ok(())
}
