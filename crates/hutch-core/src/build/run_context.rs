//! The context a build's steps run in (user, workdir, environment, the start command so
//! far), which each metadata step changes and the template keeps at the end.

use std::collections::BTreeMap;

/// The context later steps run in, and what the template ends up with.
#[derive(Clone)]
pub(super) struct Context {
    pub(super) user: String,
    pub(super) workdir: String,
    pub(super) env: BTreeMap<String, String>,
    pub(super) user_set: bool,
    pub(super) workdir_set: bool,
    pub(super) entrypoint: Vec<String>,
    pub(super) cmd: Vec<String>,
    /// A step set ENTRYPOINT or CMD (an image's own, such as Debian's `bash`, starts nothing).
    pub(super) command_set: bool,
}

/// `path` against the directory `cwd` (Docker's WORKDIR and COPY destinations).
pub fn absolute(cwd: &str, path: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{}/{path}", cwd.trim_end_matches('/'))
    }
}
