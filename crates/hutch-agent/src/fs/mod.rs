//! The guest filesystem API: paths, entry info, `filesystem.Filesystem` RPCs, watchers.

pub mod creds;
pub mod entry;
pub mod io_error;
pub mod metadata;
pub mod path;
pub mod rpc;
pub mod watch;
pub mod watchers;
