//! Free space on the filesystem holding `$HUTCH_HOME`. Every tenant's VM writes there
//! (QEMU pauses a VM whose disk write fails with ENOSPC), so large writes that clients
//! cause (uploads, imports, pauses, snapshots) are refused while less than `FLOOR`
//! would remain, instead of filling the disk for everyone.

use std::path::Path;

/// Bytes that must stay free after a large write.
pub const FLOOR: u64 = 1 << 30;

/// Free bytes after which a VM paused on a full disk is resumed (it pauses again, at
/// no harm, if its writes fill that too).
pub const RESUME_FREE: u64 = 32 << 20;

/// Bytes available to hutch on the filesystem of `path`.
pub fn available(path: &Path) -> std::io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// Whether `needed` more bytes fit above the floor; the message says why not.
pub fn check_room(path: &Path, needed: u64) -> Result<(), String> {
    match available(path) {
        Ok(free) if free >= needed.saturating_add(FLOOR) => Ok(()),
        Ok(free) => Err(format!(
            "the server's disk has {} MiB free and keeps {} MiB in reserve, too little for {} MiB more; free space or try later",
            free >> 20,
            FLOOR >> 20,
            needed.div_ceil(1 << 20)
        )),
        // Cannot tell: do not refuse on a failed statvfs.
        Err(_) => Ok(()),
    }
}
