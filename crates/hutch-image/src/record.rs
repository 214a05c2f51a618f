//! Versioned on-disk records (a sandbox's `vm.json`, a snapshot's `snapshot.json`, a
//! template's `template.json`, the guest kernel's `current.json`), as Firecracker
//! versions its snapshot files. Each record is an envelope naming its kind
//! and format version, with a SHA-256 of its body:
//!
//! ```json
//! { "kind": "hutch-vm-record", "version": 1, "sha256": "…", "body": { … } }
//! ```
//!
//! A record of another kind, from a newer hutch, truncated, or whose body does not
//! match its checksum is refused with a sentence saying which, rather than read as
//! whatever it happens to parse into. A plain body without an envelope is a record
//! from before versioning (version 0) and is read as it is. Records are written to a
//! temporary file and renamed into place, so a crash leaves the old one or the new one.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The format version this hutch writes and the newest it reads.
pub const VERSION: u32 = 1;

/// What a record describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A sandbox's VM (`vm.json`).
    Vm,
    /// A memory snapshot's manifest (`snapshot.json`).
    Snapshot,
    /// A template's manifest, naming its current build (`template.json`).
    Template,
    /// The guest kernel's manifest (`kernels/current.json`).
    Kernel,
    /// A template's tags other than `default` (`tags.json`).
    Tags,
    /// Every assignment of a template's tags, oldest first (`tag-history.json`).
    TagHistory,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Vm => "hutch-vm-record",
            Kind::Snapshot => "hutch-snapshot-manifest",
            Kind::Template => "hutch-template-manifest",
            Kind::Kernel => "hutch-kernel-manifest",
            Kind::Tags => "hutch-template-tags",
            Kind::TagHistory => "hutch-template-tag-history",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("reading {}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("writing {}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
    #[error("{} is not a readable hutch record ({detail}); it was truncated or damaged", path.display())]
    Corrupt { path: PathBuf, detail: String },
    #[error("{} is a {found} record where a {expected} was expected", path.display())]
    WrongKind { path: PathBuf, found: String, expected: &'static str },
    #[error("{} was written by a newer hutch (record version {found}; this one reads up to {VERSION}); use that hutch or a newer one", path.display())]
    Newer { path: PathBuf, found: u32 },
    #[error("{} does not match its checksum; it was changed or damaged, so what it describes is not used", path.display())]
    Checksum { path: PathBuf },
}

impl RecordError {
    /// There is no record at all (as opposed to one that cannot be read as it is).
    pub fn is_missing(&self) -> bool {
        matches!(self, RecordError::Read { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }

    /// A record a cache may replace by making its contents again: damaged, or of
    /// another kind, but not one from a newer hutch (that hutch still uses it).
    pub fn is_replaceable(&self) -> bool {
        matches!(self, RecordError::Corrupt { .. } | RecordError::Checksum { .. } | RecordError::WrongKind { .. })
    }
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    kind: String,
    version: u32,
    sha256: String,
    body: serde_json::Value,
}

fn digest(body: &serde_json::Value) -> String {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    hex::encode(Sha256::digest(&bytes))
}

/// Writes `value` as a record of `kind` at `path`, atomically.
pub fn write<T: Serialize>(path: &Path, kind: Kind, value: &T) -> Result<(), RecordError> {
    let failed = |source| RecordError::Write { path: path.to_path_buf(), source };
    let body = serde_json::to_value(value).map_err(|e| failed(e.into()))?;
    let envelope = Envelope { kind: kind.name().into(), version: VERSION, sha256: digest(&body), body };
    let json = serde_json::to_vec_pretty(&envelope).map_err(|e| failed(e.into()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Unique per write, so two threads writing one record never share a temporary.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let temporary = path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let written = std::fs::File::create(&temporary).and_then(|mut f| {
        use std::io::Write;
        f.write_all(&json)?;
        // On disk before the rename makes it the record: a crash leaves old or new whole.
        f.sync_all()
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(failed(e));
    }
    std::fs::rename(&temporary, path).map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        failed(e)
    })
}

/// Reads the record of `kind` at `path`.
pub fn read<T: DeserializeOwned>(path: &Path, kind: Kind) -> Result<T, RecordError> {
    let text = std::fs::read_to_string(path).map_err(|source| RecordError::Read { path: path.to_path_buf(), source })?;
    parse(path, kind, &text)
}

fn parse<T: DeserializeOwned>(path: &Path, kind: Kind, text: &str) -> Result<T, RecordError> {
    let corrupt = |detail: String| RecordError::Corrupt { path: path.to_path_buf(), detail };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| corrupt(e.to_string()))?;
    let is_envelope = ["kind", "version", "sha256", "body"].iter().all(|k| value.get(k).is_some());
    let body = if is_envelope {
        let envelope: Envelope = serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
        if envelope.kind != kind.name() {
            return Err(RecordError::WrongKind { path: path.to_path_buf(), found: envelope.kind, expected: kind.name() });
        }
        if envelope.version > VERSION {
            return Err(RecordError::Newer { path: path.to_path_buf(), found: envelope.version });
        }
        if envelope.sha256 != digest(&envelope.body) {
            return Err(RecordError::Checksum { path: path.to_path_buf() });
        }
        envelope.body
    } else {
        value // version 0: the body alone
    };
    serde_json::from_value(body).map_err(|e| corrupt(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sample {
        id: String,
        cpus: u32,
    }

    fn sample() -> Sample {
        Sample { id: "sb1".into(), cpus: 2 }
    }

    fn written(dir: &Path) -> (PathBuf, String) {
        let path = dir.join("vm.json");
        write(&path, Kind::Vm, &sample()).expect("write");
        let text = std::fs::read_to_string(&path).expect("read back");
        (path, text)
    }

    #[test]
    fn a_record_reads_back_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().expect("dir");
        let (path, text) = written(dir.path());
        assert!(text.contains("\"version\": 1") && text.contains("hutch-vm-record"), "{text}");
        assert_eq!(read::<Sample>(&path, Kind::Vm).expect("read"), sample());
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 1);
    }

    #[test]
    fn a_truncated_record_is_corrupt() {
        let dir = tempfile::tempdir().expect("dir");
        let (path, text) = written(dir.path());
        std::fs::write(&path, &text[..text.len() / 2]).expect("truncate");
        let e = read::<Sample>(&path, Kind::Vm).expect_err("truncated");
        assert!(matches!(e, RecordError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("truncated or damaged"), "{e}");
    }

    #[test]
    fn a_newer_version_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().expect("dir");
        let (path, text) = written(dir.path());
        std::fs::write(&path, text.replace("\"version\": 1", "\"version\": 7")).expect("edit");
        let e = read::<Sample>(&path, Kind::Vm).expect_err("newer");
        assert!(matches!(e, RecordError::Newer { found: 7, .. }), "{e}");
        assert!(e.to_string().contains("newer hutch"), "{e}");
    }

    #[test]
    fn a_changed_body_fails_its_checksum() {
        let dir = tempfile::tempdir().expect("dir");
        let (path, text) = written(dir.path());
        std::fs::write(&path, text.replace("\"cpus\": 2", "\"cpus\": 64")).expect("edit");
        assert!(matches!(read::<Sample>(&path, Kind::Vm), Err(RecordError::Checksum { .. })));
    }

    #[test]
    fn another_kind_of_record_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let (path, _) = written(dir.path());
        assert!(matches!(read::<Sample>(&path, Kind::Snapshot), Err(RecordError::WrongKind { .. })));
    }

    #[test]
    fn a_record_from_before_versioning_still_reads() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("vm.json");
        std::fs::write(&path, r#"{"id": "sb1", "cpus": 2}"#).expect("legacy");
        assert_eq!(read::<Sample>(&path, Kind::Vm).expect("version 0"), sample());
    }
}
