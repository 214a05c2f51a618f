//! Path resolution as envd does it: relative paths and `~` are under the user's home.

use crate::process::user::GuestUser;
use std::path::{Component, Path, PathBuf};

pub fn resolve(path: &str, user: &GuestUser) -> PathBuf {
    let joined = if let Some(rest) = path.strip_prefix("~/") {
        user.home.join(rest)
    } else if path == "~" {
        user.home.clone()
    } else if Path::new(path).is_absolute() {
        PathBuf::from(path)
    } else {
        user.home.join(path)
    };
    normalize(&joined)
}

/// Removes `.` and `..` lexically, so reported paths are clean.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Creates the missing parent directories of `path` as envd does for uploads: as the
/// agent (root), each new one owned by `user`, so a write into `/0/a.txt` works for a
/// user who could not create `/0` (E2B's envd, root too, does the same). Only
/// directories are made so; the file itself is then created as the user.
pub fn ensure_parents_owned(path: &Path, user: &GuestUser) -> std::io::Result<()> {
    let Some(parent) = path.parent() else { return Ok(()) };
    let mut at = PathBuf::from("/");
    for part in parent.components().filter(|c| matches!(c, Component::Normal(_))) {
        at.push(part);
        match std::fs::metadata(&at) {
            Ok(meta) if meta.is_dir() => continue,
            Ok(_) => return Err(std::io::Error::from_raw_os_error(libc::ENOTDIR)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        match std::fs::create_dir(&at) {
            Ok(()) => std::os::unix::fs::lchown(&at, Some(user.uid), Some(user.gid))?,
            // Another request made it meanwhile: it is that one's to own.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Creates missing parent directories of `path` (run it as the user: see `creds`).
pub fn create_parents(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(parent) => std::fs::create_dir_all(parent),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_like_envd() {
        let u = GuestUser { home: "/home/user".into(), ..GuestUser::root() };
        assert_eq!(resolve("a.txt", &u), PathBuf::from("/home/user/a.txt"));
        assert_eq!(resolve("~/x/../y", &u), PathBuf::from("/home/user/y"));
        assert_eq!(resolve("/etc/./hosts", &u), PathBuf::from("/etc/hosts"));
        assert_eq!(resolve("/../..", &u), PathBuf::from("/"));
    }
}
