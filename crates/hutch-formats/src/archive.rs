//! Portable snapshot archives: a tar with `manifest.json` first and `disk.qcow2`, the
//! sandbox's filesystem flattened into one standalone image (no backing file, so it
//! means the same on any host). Memory is not exported: a memory state only fits the
//! exact kernel, agent and QEMU that saved it, and a disk is what survives a move.
//!
//! The manifest carries the disk's SHA-256; import recomputes it while unpacking and
//! rejects an archive whose disk does not match, has a backing file (which could name
//! any file on the importing host), or holds anything besides those two entries.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub const FORMAT: &str = "hutch-snapshot-archive/1";
/// Largest archive upload and largest disk (logical bytes) an archive may declare.
pub const MAX_ARCHIVE_BYTES: u64 = 32 << 30;
const MANIFEST: &str = "manifest.json";
const DISK: &str = "disk.qcow2";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ArchiveManifest {
    pub format: String,
    pub name: Option<String>,
    /// The template whose kernel and agent boot the disk.
    pub template: String,
    pub created_at: String,
    pub disk_sha256: String,
    pub disk_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("{what} {path}")]
    Io { what: &'static str, path: PathBuf, #[source] source: std::io::Error },
    #[error("qemu-img failed on {path}: {stderr}")]
    QemuImg { path: PathBuf, stderr: String },
    #[error("not a hutch snapshot archive: {0}")]
    NotAnArchive(String),
    #[error("the archive was modified or is corrupt: disk.qcow2 has SHA-256 {actual}, the manifest says {expected}")]
    HashMismatch { expected: String, actual: String },
    #[error("the archive is {0}, written by a newer hutch (this one reads {FORMAT}); import it with that hutch or a newer one")]
    Newer(String),
    #[error("the archive's disk is unsafe to use: {0}")]
    UnsafeDisk(String),
    #[error("{0}")]
    NoSpace(String),
    #[error("the archive's disk holds more than {limit} bytes (the manifest says {declared}); nothing larger is imported")]
    TooLarge { declared: u64, limit: u64 },
}

/// What import verified about the disk.
pub struct Imported {
    pub manifest: ArchiveManifest,
    /// The size the guest sees, which its writes can grow the file to.
    pub virtual_size: u64,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ArchiveError + 'a {
    move |source| ArchiveError::Io { what, path: path.to_path_buf(), source }
}

fn qemu_img(args: &[&std::ffi::OsStr], path: &Path) -> Result<Vec<u8>, ArchiveError> {
    // A flattening convert copies the whole disk; the rest read a header.
    let limit = if args.first().is_some_and(|a| a.to_str() == Some("convert")) { Duration::from_secs(1800) } else { Duration::from_secs(60) };
    let out = hutch_vmm::process::output_within(Command::new("qemu-img").args(args), limit).map_err(io("running qemu-img on", path))?;
    if !out.status.success() {
        return Err(ArchiveError::QemuImg { path: path.to_path_buf(), stderr: String::from_utf8_lossy(&out.stderr).trim().to_string() });
    }
    Ok(out.stdout)
}

/// Writes the archive of the disk `disk` (any qcow2 chain) to `out`. `work` is an
/// empty directory for the flattened image.
pub fn export(disk: &Path, name: Option<&str>, template: &str, work: &Path, out: impl Write) -> Result<ArchiveManifest, ArchiveError> {
    let flat = work.join(DISK);
    qemu_img(&["convert".as_ref(), "-O".as_ref(), "qcow2".as_ref(), disk.as_os_str(), flat.as_os_str()], disk)?;
    let mut hash = Sha256::new();
    let mut file = std::fs::File::open(&flat).map_err(io("reading", &flat))?;
    let disk_bytes = std::io::copy(&mut file, &mut HashWriter(&mut hash)).map_err(io("reading", &flat))?;
    let manifest = ArchiveManifest {
        format: FORMAT.into(),
        name: name.map(str::to_string),
        template: template.to_string(),
        created_at: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        disk_sha256: hex::encode(hash.finalize()),
        disk_bytes,
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| ArchiveError::NotAnArchive(e.to_string()))?;
    let mut tar = tar::Builder::new(out);
    let mut header = tar::Header::new_gnu();
    header.set_size(json.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_cksum();
    tar.append_data(&mut header, MANIFEST, json.as_slice()).map_err(io("writing the archive for", disk))?;
    tar.append_path_with_name(&flat, DISK).map_err(io("writing the archive for", disk))?;
    tar.into_inner().and_then(|mut w| w.flush()).map_err(io("writing the archive for", disk))?;
    let _ = std::fs::remove_file(&flat);
    Ok(manifest)
}

struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A reader that hashes what passes through it.
struct HashReader<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for HashReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// Unpacks and verifies an archive into `dir` (which then holds `disk.qcow2`). The disk
/// may not exceed what the manifest declares, nor `MAX_ARCHIVE_BYTES`; runs of zeros
/// (a sparse entry's holes) are skipped, not written, so a small tar that expands to
/// zeros cannot fill the host's disk.
pub fn import(archive: impl Read, dir: &Path) -> Result<Imported, ArchiveError> {
    let truncated = |e: std::io::Error| ArchiveError::NotAnArchive(format!("it is truncated or not a tar file ({e})"));
    let mut tar = tar::Archive::new(archive);
    let mut entries = tar.entries().map_err(truncated)?;
    let mut next = |want: &str| -> Result<tar::Entry<'_, _>, ArchiveError> {
        let entry = entries.next().ok_or_else(|| ArchiveError::NotAnArchive(format!("it ends before {want}")))?.map_err(truncated)?;
        let path = entry.path().map_err(truncated)?.display().to_string();
        // The disk may be stored sparse (GNU sparse entries read back with their holes).
        let kind = entry.header().entry_type();
        if path != want || !(kind.is_file() || kind.is_gnu_sparse()) {
            return Err(ArchiveError::NotAnArchive(format!("expected the file {want}, found '{path}'")));
        }
        Ok(entry)
    };
    let mut text = String::new();
    next(MANIFEST)?.take(1 << 20).read_to_string(&mut text).map_err(truncated)?;
    let manifest: ArchiveManifest = serde_json::from_str(&text).map_err(|e| ArchiveError::NotAnArchive(format!("bad manifest.json: {e}")))?;
    if manifest.format != FORMAT {
        return Err(match manifest.format.strip_prefix("hutch-snapshot-archive/").and_then(|v| v.parse::<u32>().ok()) {
            Some(version) if version > 1 => ArchiveError::Newer(manifest.format),
            _ => ArchiveError::NotAnArchive(format!("format '{}' is not {FORMAT}", manifest.format)),
        });
    }
    let limit = manifest.disk_bytes.min(MAX_ARCHIVE_BYTES);
    if manifest.disk_bytes > MAX_ARCHIVE_BYTES {
        return Err(ArchiveError::TooLarge { declared: manifest.disk_bytes, limit: MAX_ARCHIVE_BYTES });
    }
    hutch_vmm::space::check_room(dir, manifest.disk_bytes).map_err(ArchiveError::NoSpace)?;
    let disk = dir.join(DISK);
    let mut reader = HashReader { inner: next(DISK)?, hash: Sha256::new() };
    let mut file = std::fs::File::create(&disk).map_err(io("writing", &disk))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut written: u64 = 0;
    loop {
        let n = reader.read(&mut buf).map_err(truncated)?;
        if n == 0 {
            break;
        }
        written += n as u64;
        if written > limit {
            return Err(ArchiveError::TooLarge { declared: manifest.disk_bytes, limit });
        }
        if written % (64 << 20) < n as u64 {
            // Other imports and VMs write to the same disk meanwhile.
            hutch_vmm::space::check_room(dir, 64 << 20).map_err(ArchiveError::NoSpace)?;
        }
        if buf[..n].iter().all(|b| *b == 0) {
            // A hole: leave it unallocated (the length is set at the end).
            std::io::Seek::seek(&mut file, std::io::SeekFrom::Current(n as i64)).map_err(io("writing", &disk))?;
        } else {
            file.write_all(&buf[..n]).map_err(io("writing", &disk))?;
        }
    }
    if written < manifest.disk_bytes {
        // tar ends a cut-off entry quietly: the manifest says how much there should be.
        return Err(ArchiveError::NotAnArchive(format!("it is truncated: disk.qcow2 has {written} of the {} bytes its manifest declares", manifest.disk_bytes)));
    }
    file.set_len(written).map_err(io("writing", &disk))?;
    let actual = hex::encode(reader.hash.finalize());
    if actual != manifest.disk_sha256 {
        return Err(ArchiveError::HashMismatch { expected: manifest.disk_sha256.clone(), actual });
    }
    let virtual_size = check_standalone(&disk)?;
    Ok(Imported { manifest, virtual_size })
}

/// A qcow2 image with no backing file and no external data file; returns its virtual size.
fn check_standalone(disk: &Path) -> Result<u64, ArchiveError> {
    let out = qemu_img(&["info".as_ref(), "--output=json".as_ref(), "-f".as_ref(), "qcow2".as_ref(), disk.as_os_str()], disk)?;
    let info: serde_json::Value = serde_json::from_slice(&out).map_err(|e| ArchiveError::UnsafeDisk(e.to_string()))?;
    if info.get("backing-filename").is_some() || info.get("full-backing-filename").is_some() {
        return Err(ArchiveError::UnsafeDisk("it names a backing file".into()));
    }
    if info.pointer("/format-specific/data/data-file").is_some() {
        return Err(ArchiveError::UnsafeDisk("it names an external data file".into()));
    }
    if info.get("format").and_then(|f| f.as_str()) != Some("qcow2") {
        return Err(ArchiveError::UnsafeDisk("it is not a qcow2 image".into()));
    }
    info.get("virtual-size").and_then(|v| v.as_u64()).ok_or_else(|| ArchiveError::UnsafeDisk("qemu-img reports no virtual size".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real qcow2 image with `data` written at its start, exported as an archive.
    fn exported(dir: &Path) -> (Vec<u8>, ArchiveManifest) {
        let disk = dir.join("source.qcow2");
        qemu_img(&["create".as_ref(), "-q".as_ref(), "-f".as_ref(), "qcow2".as_ref(), disk.as_os_str(), "4M".as_ref()], &disk).expect("qemu-img create");
        let mut out = Vec::new();
        let manifest = export(&disk, Some("n"), "base", dir, &mut out).expect("export");
        (out, manifest)
    }

    /// An archive of `manifest` and `disk`, written the way export writes one.
    fn archive(manifest: &ArchiveManifest, disk: &[u8]) -> Vec<u8> {
        let mut tar = tar::Builder::new(Vec::new());
        for (name, bytes) in [(MANIFEST, serde_json::to_vec(manifest).expect("json")), (DISK, disk.to_vec())] {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, name, bytes.as_slice()).expect("append");
        }
        tar.into_inner().expect("tar")
    }

    fn import_into(bytes: &[u8]) -> Result<Imported, ArchiveError> {
        let dir = tempfile::tempdir().expect("dir");
        import(bytes, dir.path())
    }

    #[test]
    fn an_exported_disk_imports_whole() {
        let dir = tempfile::tempdir().expect("dir");
        let (bytes, manifest) = exported(dir.path());
        let imported = import_into(&bytes).expect("import");
        assert_eq!(imported.manifest, manifest);
        assert_eq!(imported.virtual_size, 4 << 20);
    }

    #[test]
    fn a_truncated_archive_says_so() {
        let dir = tempfile::tempdir().expect("dir");
        let (bytes, _) = exported(dir.path());
        // In the first header, in the manifest, in the disk.
        for cut in [100, 700, bytes.len() / 2] {
            let e = import_into(&bytes[..cut]).err().expect("a truncated archive imported");
            assert!(matches!(&e, ArchiveError::NotAnArchive(_)), "cut at {cut}: {e}");
        }
        let e = import_into(&bytes[..bytes.len() / 2]).err().expect("a truncated archive imported");
        assert!(e.to_string().contains("it is truncated"), "{e}");
    }

    #[test]
    fn another_or_newer_format_is_refused_with_a_sentence() {
        let dir = tempfile::tempdir().expect("dir");
        let (_, manifest) = exported(dir.path());
        let newer = ArchiveManifest { format: "hutch-snapshot-archive/2".into(), ..manifest.clone() };
        let e = import_into(&archive(&newer, b"")).err().expect("a newer archive imported");
        assert!(matches!(e, ArchiveError::Newer(_)) && e.to_string().contains("newer hutch"), "{e}");
        let other = ArchiveManifest { format: "tarball".into(), ..manifest };
        let e = import_into(&archive(&other, b"")).err().expect("another format imported");
        assert!(matches!(e, ArchiveError::NotAnArchive(_)), "{e}");
    }

    #[test]
    fn a_changed_disk_fails_its_checksum_and_a_raw_one_is_not_qcow2() {
        let dir = tempfile::tempdir().expect("dir");
        let (_, manifest) = exported(dir.path());
        let changed = vec![1u8; usize::try_from(manifest.disk_bytes).expect("size")];
        let e = import_into(&archive(&manifest, &changed)).err().expect("a changed disk imported");
        assert!(matches!(e, ArchiveError::HashMismatch { .. }), "{e}");
        // Well formed, checksum right, but a raw image: qemu-img refuses it as qcow2 (the
        // manager answers 400: tests/e2b/test_trust_boundary.py).
        let raw = vec![7u8; 4096];
        let honest = ArchiveManifest { disk_sha256: hex::encode(Sha256::digest(&raw)), disk_bytes: raw.len() as u64, ..manifest };
        let e = import_into(&archive(&honest, &raw)).err().expect("a raw disk imported");
        assert!(matches!(&e, ArchiveError::QemuImg { stderr, .. } if stderr.contains("not in qcow2 format")), "{e}");
    }
}
