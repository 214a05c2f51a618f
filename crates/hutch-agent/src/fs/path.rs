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
