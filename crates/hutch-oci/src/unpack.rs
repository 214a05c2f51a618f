//! Applying an image's layers to a directory, lowest first. Each layer is a tar (gzip,
//! zstd or plain, told by its first bytes). The OCI image spec's whiteouts: an entry
//! `DIR/.wh.NAME` deletes NAME from the layers below, and `DIR/.wh..wh..opq` empties DIR
//! of what the layers below put there. Ownership, modes (setuid included), xattrs,
//! hard links (also to files of lower layers), symlinks and device nodes are kept.
//!
//! Every path is checked to stay inside the root: a layer is untrusted input, and a
//! `../` or a symlink planted by a lower layer must not let it write on the host.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Component, Path, PathBuf};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("layer {layer}: the archive cannot be read: {source}")]
    Read { layer: String, source: std::io::Error },
    #[error("layer {layer}: the entry `{path}` is malformed or points outside the image's root (a `..`, a whiteout of `.` or a path through a symlink that leaves it)")]
    Escapes { layer: String, path: String },
    #[error("layer {layer}: writing `{path}`: {source}")]
    Write { layer: String, path: String, source: std::io::Error },
    #[error("layer {layer}: the image's files would not fit the template disk; use a smaller image")]
    TooLarge { layer: String },
}

/// What applying one layer did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub entries: u64,
    pub whiteouts: u64,
    /// Device nodes that could not be made (not root): the guest's /dev is a devtmpfs.
    pub devices_skipped: u64,
}

/// The layer's bytes, decompressed as their magic says.
pub fn decompress<'a>(layer: impl Read + 'a) -> std::io::Result<Box<dyn Read + 'a>> {
    let mut reader = BufReader::with_capacity(1 << 16, layer);
    let head = reader.fill_buf()?;
    Ok(if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(reader))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(zstd::stream::read::Decoder::with_buffer(reader)?)
    } else {
        Box::new(reader)
    })
}

/// The entry's path made relative and plain (`./a/b` → `a/b`); None if it climbs out.
fn relative(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Where `rel` lands under `root`: its parent resolved (symlinks followed) must be
/// inside `root`, else None. Parents a layer does not list are made (`create`) as plain
/// directories, as image tools do; they did not exist, so no symlink is among them.
/// Without `create`, a missing parent is Some(None): there is nothing there to delete.
fn inside(root: &Path, rel: &Path, create: bool) -> Option<Option<PathBuf>> {
    let target = root.join(rel);
    let (parent, name) = (target.parent()?, target.file_name()?);
    let mut existing = parent;
    while std::fs::symlink_metadata(existing).is_err() {
        existing = existing.parent()?;
    }
    let real = std::fs::canonicalize(existing).ok()?;
    if !real.starts_with(root) {
        return None;
    }
    if existing != parent {
        if !create {
            return Some(None);
        }
        std::fs::create_dir_all(real.join(parent.strip_prefix(existing).ok()?)).ok()?;
    }
    let real_parent = std::fs::canonicalize(parent).ok()?;
    real_parent.starts_with(root).then(|| Some(real_parent.join(name)))
}

fn remove_any(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Applies one layer (`name` is for messages, its digest say) to `root`, which must be
/// canonical (no symlinks in it). `budget` is the bytes (file contents plus 512 per
/// entry) the tree may still grow by; the layer is refused once it would pass it, so a
/// layer that decompresses without end cannot fill the host's disk.
pub fn apply_layer(root: &Path, layer: impl Read, name: &str, budget: &mut u64) -> Result<Applied, UnpackError> {
    use std::os::unix::ffi::OsStrExt;
    let read_err = |source| UnpackError::Read { layer: name.to_string(), source };
    let mut archive = tar::Archive::new(decompress(layer).map_err(read_err)?);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_unpack_xattrs(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    let mut applied = Applied::default();
    // What this layer wrote, so an opaque directory keeps it and loses only the rest.
    let mut written: HashSet<PathBuf> = HashSet::new();
    let mut opaque: Vec<PathBuf> = Vec::new();
    for entry in archive.entries().map_err(read_err)? {
        let mut entry = entry.map_err(read_err)?;
        let kind = entry.header().entry_type();
        // Extension headers carry metadata for other entries; they name no file.
        if kind.is_pax_global_extensions() || kind.is_pax_local_extensions() || kind.is_gnu_longname() || kind.is_gnu_longlink() {
            continue;
        }
        let size = entry.header().entry_size().unwrap_or(0).saturating_add(512);
        *budget = budget.checked_sub(size).ok_or_else(|| UnpackError::TooLarge { layer: name.to_string() })?;
        let raw = entry.path().map_err(read_err)?.into_owned();
        let malformed = || UnpackError::Escapes { layer: name.to_string(), path: raw.display().to_string() };
        let rel = relative(&raw).ok_or_else(malformed)?;
        let Some(file_name) = rel.file_name().map(|n| n.as_bytes().to_vec()) else {
            continue; // the root itself: its owner and mode are the image's `/`, kept as made
        };
        let write_err = |source| UnpackError::Write { layer: name.to_string(), path: rel.display().to_string(), source };
        applied.entries += 1;
        if file_name == OPAQUE.as_bytes() {
            opaque.push(rel.parent().map(Path::to_path_buf).unwrap_or_default());
            continue;
        }
        if let Some(hidden) = file_name.strip_prefix(WHITEOUT.as_bytes()) {
            // `.wh.` and `.wh..` would name the directory itself or its parent.
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(malformed());
            }
            let gone = rel.with_file_name(std::ffi::OsStr::from_bytes(hidden));
            if let Some(target) = inside(root, &gone, false).ok_or_else(malformed)? {
                remove_any(&target).map_err(write_err)?;
            }
            applied.whiteouts += 1;
            continue;
        }
        let target = inside(root, &rel, true).flatten().ok_or_else(malformed)?;
        // What a lower layer had here goes, unless both are directories (then they merge).
        if let Ok(meta) = std::fs::symlink_metadata(&target) {
            if !(meta.is_dir() && kind.is_dir()) {
                remove_any(&target).map_err(write_err)?;
            }
        }
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            if !make_node(&target, entry.header()).map_err(write_err)? {
                applied.devices_skipped += 1;
            }
        } else if !entry.unpack_in(root).map_err(write_err)? {
            return Err(malformed());
        }
        written.insert(rel);
    }
    if !opaque.is_empty() {
        // Kept under an opaque directory: what this layer wrote, and the directories
        // leading to it; everything else there came from below and goes.
        let mut keep: HashSet<&Path> = HashSet::new();
        for path in &written {
            keep.extend(path.ancestors().filter(|a| !a.as_os_str().is_empty()));
        }
        for dir in &opaque {
            let Some(Some(real)) = inside(root, &dir.join("x"), false).map(|p| p.and_then(|p| p.parent().map(Path::to_path_buf))) else { continue };
            clear_below(&real, dir, &keep).map_err(|source| UnpackError::Write { layer: name.to_string(), path: dir.display().to_string(), source })?;
        }
    }
    Ok(applied)
}

/// Removes from `real` (the tree's `rel`) everything not in `keep`, descending into the
/// kept directories (never through a symlink: `symlink_metadata`).
fn clear_below(real: &Path, rel: &Path, keep: &HashSet<&Path>) -> std::io::Result<()> {
    let Ok(children) = std::fs::read_dir(real) else { return Ok(()) };
    for child in children {
        let child = child?;
        let child_rel = rel.join(child.file_name());
        if !keep.contains(child_rel.as_path()) {
            remove_any(&child.path())?;
        } else if std::fs::symlink_metadata(child.path()).is_ok_and(|m| m.is_dir()) {
            clear_below(&child.path(), &child_rel, keep)?;
        }
    }
    Ok(())
}

/// `rel` under `root` with its parent resolved inside `root` (symlinks followed, never
/// out of it): None if it would leave the root, Some(None) if its parent is missing.
pub fn resolve_in_root(root: &Path, rel: &Path) -> Option<Option<PathBuf>> {
    inside(root, &relative(rel)?, false)
}

/// A device node or FIFO with the entry's mode and owner; false when this process may
/// not make device nodes (not root).
fn make_node(target: &Path, header: &tar::Header) -> std::io::Result<bool> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let kind = header.entry_type();
    let flag = if kind.is_character_special() {
        SFlag::S_IFCHR
    } else if kind.is_block_special() {
        SFlag::S_IFBLK
    } else {
        SFlag::S_IFIFO
    };
    // FIFOs often leave the device fields blank.
    let major = header.device_major().ok().flatten().unwrap_or(0);
    let minor = header.device_minor().ok().flatten().unwrap_or(0);
    let dev = makedev(u64::from(major), u64::from(minor));
    let mode = Mode::from_bits_truncate(header.mode()? & 0o7777);
    match mknod(target, flag, mode, dev) {
        Ok(()) => {}
        Err(nix::errno::Errno::EPERM) if flag != SFlag::S_IFIFO => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    let (uid, gid) = (header.uid()? as u32, header.gid()? as u32);
    nix::unistd::fchownat(None, target, Some(uid.into()), Some(gid.into()), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)?;
    // chown clears setuid and mknod applies the umask: the mode goes last.
    std::fs::set_permissions(target, std::os::unix::fs::PermissionsExt::from_mode(header.mode()? & 0o7777))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

/// A budget no test layer reaches.
    fn unlimited() -> u64 {
        u64::MAX
    }

    fn is_root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    /// A tar layer from `(path, kind)` entries, built as image tools do.
    enum E<'a> {
        Dir(&'a str, u32),
        File(&'a str, &'a [u8], u32, u64),
        Link(&'a str, &'a str),
        Sym(&'a str, &'a str),
        Dev(&'a str, u32, u32),
        Fifo(&'a str),
        Xattr(&'a str, &'a [u8], &'a str, &'a [u8]),
        /// A name written raw, past the builder's checks (a hostile layer).
        Raw(&'a [u8]),
    }

    fn layer(entries: &[E]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mtime(1_700_000_000);
            h.set_uid(0);
            h.set_gid(0);
            match e {
                E::Dir(p, mode) => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(*mode);
                    h.set_size(0);
                    b.append_data(&mut h, p, &[][..]).expect("dir");
                }
                E::File(p, data, mode, owner) => {
                    h.set_mode(*mode);
                    h.set_uid(*owner);
                    h.set_gid(*owner);
                    h.set_size(data.len() as u64);
                    b.append_data(&mut h, p, *data).expect("file");
                }
                E::Link(p, target) | E::Sym(p, target) => {
                    h.set_entry_type(if matches!(e, E::Link(..)) { tar::EntryType::Link } else { tar::EntryType::Symlink });
                    h.set_size(0);
                    h.set_mode(0o777);
                    b.append_link(&mut h, p, target).expect("link");
                }
                E::Dev(p, major, minor) => {
                    h.set_entry_type(tar::EntryType::Char);
                    h.set_device_major(*major).expect("major");
                    h.set_device_minor(*minor).expect("minor");
                    h.set_mode(0o666);
                    h.set_size(0);
                    b.append_data(&mut h, p, &[][..]).expect("dev");
                }
                E::Fifo(p) => {
                    h.set_entry_type(tar::EntryType::Fifo);
                    h.set_mode(0o600);
                    h.set_size(0);
                    b.append_data(&mut h, p, &[][..]).expect("fifo");
                }
                E::Xattr(p, data, key, value) => {
                    b.append_pax_extensions([(format!("SCHILY.xattr.{key}").as_str(), *value)]).expect("pax");
                    h.set_mode(0o644);
                    h.set_size(data.len() as u64);
                    b.append_data(&mut h, p, *data).expect("file");
                }
                E::Raw(name) => {
                    h.as_old_mut().name[..name.len()].copy_from_slice(name);
                    h.set_mode(0o644);
                    h.set_size(1);
                    h.set_cksum();
                    b.append(&h, &b"x"[..]).expect("raw");
                }
            }
        }
        b.into_inner().expect("tar")
    }

    fn gzip(data: Vec<u8>) -> Vec<u8> {
        use std::io::Write;
        let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        g.write_all(&data).expect("gzip");
        g.finish().expect("gzip")
    }

    fn root() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonical");
        (dir, root)
    }

    #[test]
    fn layers_merge_with_whiteouts_opaque_dirs_links_and_owners() {
        let (_dir, root) = root();
        let lower = layer(&[
            E::Dir("etc", 0o755),
            E::File("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644, 0),
            E::Dir("bin", 0o755),
            E::File("bin/su", b"#!su", 0o4755, 0),
            E::File("gone", b"deleted above", 0o644, 0),
            E::Dir("cache", 0o755),
            E::File("cache/old", b"from below", 0o644, 0),
            E::Dir("cache/sub", 0o755),
            E::File("cache/sub/old", b"from below too", 0o644, 0),
            E::File("home-file", b"mine", 0o600, 1000),
            E::Sym("lib", "usr/lib"),
            E::File("replaced", b"a file below", 0o644, 0),
            E::Xattr("tagged", b"x", "user.hutch", b"kept"),
        ]);
        let upper = gzip(layer(&[
            E::File(".wh.gone", b"", 0o644, 0),
            E::Dir("cache", 0o755),
            E::File("cache/.wh..wh..opq", b"", 0o644, 0),
            E::File("cache/new", b"from above", 0o644, 0),
            E::Dir("cache/sub", 0o755),
            E::File("cache/sub/new", b"from above", 0o644, 0),
            E::Link("etc/passwd-link", "etc/passwd"),
            E::Dir("replaced", 0o700),
        ]));
        let first = apply_layer(&root, &lower[..], "lower", &mut unlimited()).expect("lower layer");
        assert_eq!(first.entries, 13);
        let second = apply_layer(&root, &upper[..], "upper", &mut unlimited()).expect("upper layer");
        assert_eq!(second.whiteouts, 1);

        assert!(!root.join("gone").exists(), "the whiteout deleted it");
        let cache: Vec<_> = std::fs::read_dir(root.join("cache")).expect("cache").flatten().map(|e| e.file_name()).collect();
        let mut cache = cache;
        cache.sort();
        assert_eq!(cache, vec![std::ffi::OsString::from("new"), "sub".into()], "the opaque directory lost what was below");
        let sub: Vec<_> = std::fs::read_dir(root.join("cache/sub")).expect("sub").flatten().map(|e| e.file_name()).collect();
        assert_eq!(sub, vec![std::ffi::OsString::from("new")], "and so did its subdirectories, which this layer made again");
        let (a, b) = (std::fs::metadata(root.join("etc/passwd")).expect("passwd"), std::fs::metadata(root.join("etc/passwd-link")).expect("link"));
        assert_eq!((a.ino(), a.nlink()), (b.ino(), 2), "a hard link to a lower layer's file");
        assert_eq!(std::fs::read_link(root.join("lib")).expect("symlink"), Path::new("usr/lib"));
        assert!(std::fs::metadata(root.join("replaced")).expect("replaced").is_dir(), "a directory replaced the file");
        assert_eq!(std::fs::metadata(root.join("bin/su")).expect("su").permissions().mode() & 0o7777, 0o4755, "setuid kept");
        assert_eq!(xattr::get(root.join("tagged"), "user.hutch").ok().flatten().as_deref(), Some(&b"kept"[..]));
        if is_root() {
            assert_eq!(std::fs::metadata(root.join("home-file")).expect("owned").uid(), 1000, "ownership kept");
        }
    }

    #[test]
    fn device_nodes_and_fifos_are_made() {
        let (_dir, root) = root();
        let l = layer(&[E::Dir("dev", 0o755), E::Dev("dev/null", 1, 3), E::Fifo("pipe")]);
        let applied = apply_layer(&root, &l[..], "devices", &mut unlimited()).expect("layer");
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(root.join("pipe")).expect("fifo").file_type().is_fifo());
        let null = std::fs::symlink_metadata(root.join("dev/null"));
        if is_root() {
            let null = null.expect("device node");
            assert!(null.file_type().is_char_device());
            assert_eq!(null.rdev(), nix::sys::stat::makedev(1, 3));
        } else {
            assert_eq!(applied.devices_skipped, 1);
        }
    }

    #[test]
    fn a_layer_cannot_write_outside_the_root() {
        let outside = tempfile::tempdir().expect("outside");
        let (_dir, root) = root();
        let climb = layer(&[E::Raw(b"../escaped")]);
        let err = apply_layer(&root, &climb[..], "climb", &mut unlimited()).expect_err("../ is refused");
        assert!(matches!(err, UnpackError::Escapes { .. }), "{err}");
        // A symlink from a lower layer pointing out, then a file through it.
        let plant = layer(&[E::Sym("door", outside.path().to_str().expect("utf-8"))]);
        apply_layer(&root, &plant[..], "plant", &mut unlimited()).expect("the symlink itself is fine");
        let through = layer(&[E::File("door/pwned", b"x", 0o644, 0)]);
        let err = apply_layer(&root, &through[..], "through", &mut unlimited()).expect_err("writing through it is refused");
        assert!(matches!(err, UnpackError::Escapes { .. }), "{err}");
        assert!(!outside.path().join("pwned").exists());
        let whiteout = layer(&[E::File("door/.wh.anything", b"", 0o644, 0)]);
        assert!(apply_layer(&root, &whiteout[..], "whiteout", &mut unlimited()).is_err(), "a whiteout through it is refused too");
    }

    #[test]
    fn a_layer_bigger_than_the_budget_and_odd_whiteouts_are_refused() {
        let (_dir, root) = root();
        let big = layer(&[E::File("a", &[0u8; 4096], 0o644, 0), E::File("b", &[0u8; 4096], 0o644, 0)]);
        let mut budget = 6000;
        let err = apply_layer(&root, &big[..], "big", &mut budget).expect_err("over budget");
        assert!(matches!(err, UnpackError::TooLarge { .. }), "{err}");
        // `.wh.` + "", "." and "..": the directory itself or its parent.
        for name in ["d/.wh.", "d/.wh..", "d/.wh...", "d/.wh.x"] {
            let l = layer(&[E::Dir("d", 0o755), E::File(name, b"", 0o644, 0)]);
            let r = apply_layer(&root, &l[..], "odd", &mut unlimited());
            assert_eq!(r.is_err(), name != "d/.wh.x", "{name}: {r:?}");
        }
        assert!(root.join("d").is_dir(), "a whiteout never removes its own directory");
    }

    #[test]
    fn zstd_and_plain_layers_are_told_by_their_bytes() {
        let (_dir, root) = root();
        let plain = layer(&[E::File("plain", b"p", 0o644, 0)]);
        let z = zstd::encode_all(&layer(&[E::File("zstd", b"z", 0o644, 0)])[..], 3).expect("zstd");
        apply_layer(&root, &plain[..], "plain", &mut unlimited()).expect("plain tar");
        apply_layer(&root, &z[..], "zstd", &mut unlimited()).expect("zstd tar");
        assert_eq!(std::fs::read(root.join("zstd")).expect("read"), b"z");
        assert_eq!(std::fs::read(root.join("plain")).expect("read"), b"p");
    }
}
