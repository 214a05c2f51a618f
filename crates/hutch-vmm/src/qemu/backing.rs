//! The files under a qcow2 overlay: a confined QEMU sees only the files bound into its
//! mount namespace, so every image of the chain must be known before it starts. The
//! qcow2 header names the backing file (bytes 8-19: offset and length of its name);
//! hutch writes these images itself, so a chain longer than `MAX_DEPTH` is an error.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const MAX_DEPTH: usize = 64;
/// Linux's PATH_MAX: QEMU refuses longer backing names too.
const MAX_NAME: u32 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    #[error("reading the disk image {}", .0.display())]
    Io(PathBuf, #[source] std::io::Error),
    #[error("the disk image {} names a backing file QEMU could not use (length {len})", image.display())]
    BadName { image: PathBuf, len: u32 },
    #[error("the disk image {} stacks more than {MAX_DEPTH} layers", .0.display())]
    TooDeep(PathBuf),
}

/// The backing file `image` names, if it is a qcow2 image with one.
fn backing_of(image: &Path) -> Result<Option<PathBuf>, BackingError> {
    let io = |e| BackingError::Io(image.to_path_buf(), e);
    let mut f = std::fs::File::open(image).map_err(io)?;
    let mut header = [0u8; 20];
    if f.read_exact(&mut header).is_err() || &header[..4] != b"QFI\xfb" {
        return Ok(None); // raw (or shorter than a header): nothing under it
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
    if offset == 0 || len == 0 {
        return Ok(None);
    }
    if len > MAX_NAME {
        return Err(BackingError::BadName { image: image.to_path_buf(), len });
    }
    let mut name = vec![0u8; len as usize];
    f.seek(SeekFrom::Start(offset)).and_then(|_| f.read_exact(&mut name)).map_err(io)?;
    let name = PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(name));
    // QEMU resolves a relative name against the directory of the image naming it.
    Ok(Some(if name.is_absolute() { name } else { image.parent().unwrap_or(Path::new("/")).join(name) }))
}

/// Whether `image` is a qcow2 image whose data lives in another file (incompatible
/// feature bit 2, "external data file"): QEMU and qemu-img open that file by the name
/// in its header.
pub fn has_external_data(image: &Path) -> Result<bool, BackingError> {
    let mut header = [0u8; 80];
    let mut f = std::fs::File::open(image).map_err(|e| BackingError::Io(image.to_path_buf(), e))?;
    if f.read_exact(&mut header).is_err() || &header[..4] != b"QFI\xfb" {
        return Ok(false);
    }
    let version = u32::from_be_bytes(header[4..8].try_into().expect("4 bytes"));
    let incompatible = u64::from_be_bytes(header[72..80].try_into().expect("8 bytes"));
    Ok(version >= 3 && incompatible & 4 != 0)
}

/// Every image below `disk`, nearest first.
pub fn chain(disk: &Path) -> Result<Vec<PathBuf>, BackingError> {
    let mut below = Vec::new();
    let mut current = disk.to_path_buf();
    while let Some(next) = backing_of(&current)? {
        if below.len() == MAX_DEPTH {
            return Err(BackingError::TooDeep(disk.to_path_buf()));
        }
        below.push(next.clone());
        current = next;
    }
    Ok(below)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qcow2_naming(path: &Path, backing: &str) {
        let mut bytes = b"QFI\xfb\0\0\0\x03".to_vec();
        bytes.extend_from_slice(&100u64.to_be_bytes());
        bytes.extend_from_slice(&(backing.len() as u32).to_be_bytes());
        bytes.resize(100, 0);
        bytes.extend_from_slice(backing.as_bytes());
        std::fs::write(path, bytes).expect("test image");
    }

    #[test]
    fn follows_absolute_and_relative_names_down_to_a_raw_image() {
        let dir = tempfile::tempdir().expect("test image");
        let raw = dir.path().join("base.img");
        std::fs::write(&raw, vec![0u8; 4096]).expect("test image");
        let mid = dir.path().join("mid.qcow2");
        qcow2_naming(&mid, raw.to_str().expect("test image"));
        let top = dir.path().join("top.qcow2");
        qcow2_naming(&top, "mid.qcow2");
        assert_eq!(chain(&top).expect("test image"), vec![mid, raw.clone()]);
        assert_eq!(chain(&raw).expect("test image"), Vec::<PathBuf>::new());
    }

    #[test]
    fn an_external_data_file_is_seen_in_the_header() {
        let dir = tempfile::tempdir().expect("test image");
        let image = dir.path().join("data.qcow2");
        qcow2_naming(&image, "base.img");
        assert!(!has_external_data(&image).expect("test image"));
        let mut bytes = std::fs::read(&image).expect("test image");
        bytes[72..80].copy_from_slice(&4u64.to_be_bytes());
        std::fs::write(&image, bytes).expect("test image");
        assert!(has_external_data(&image).expect("test image"));
    }

    #[test]
    fn a_loop_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().expect("test image");
        let me = dir.path().join("loop.qcow2");
        qcow2_naming(&me, "loop.qcow2");
        assert!(matches!(chain(&me), Err(BackingError::TooDeep(_))));
    }
}
