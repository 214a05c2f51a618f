//! How a filesystem error reads to the client: the Connect code E2B's SDKs map to their
//! exceptions, and a sentence naming the path.

use crate::http::connect::ConnectError;
use hutch_proto::connect::Code;
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
