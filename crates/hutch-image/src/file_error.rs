//! An I/O failure on a named file, shared by every build step.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("{action} {}", path.display())]
pub struct FileError {
    pub action: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// `map_err(at("reading", &path))`
pub fn at<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> FileError + 'a {
    move |source| FileError { action, path: path.to_path_buf(), source }
}
