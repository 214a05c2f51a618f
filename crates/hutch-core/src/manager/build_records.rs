//! The records of template builds started through the API (status, log, reason), their
//! upload tokens, and the gate that runs builds one at a time; `builds.rs` starts and
//! serves them.

use crate::build::{BuildLog, Level};
use hutch_image::template::Shape;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

/// Log entries kept per build; later ones replace the oldest output lines.
const MAX_ENTRIES: usize = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    Waiting,
    Building,
    Ready,
    Error,
}

#[derive(Debug, Clone, Serialize)]
pub struct LogEntry {
    /// RFC 3339.
    pub timestamp: String,
    pub level: &'static str,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

#[derive(Debug, Clone)]
pub struct BuildRecord {
    pub template_id: String,
    pub build_id: String,
    pub key_id: String,
    pub status: BuildStatus,
    /// The newest `MAX_ENTRIES` entries; `dropped` older ones were let go, so an
    /// entry's offset (what `logsOffset` counts) is its index plus `dropped`.
    pub entries: std::collections::VecDeque<LogEntry>,
    pub dropped: usize,
    /// When it ended (records of ended builds are let go an hour later).
    pub ended: Option<SystemTime>,
    /// The tags the build gets when it finishes (checked, normal form).
    pub tags: Vec<String>,
    /// The VM shape (checked) its sandboxes will get.
    pub shape: Shape,
    /// (message, step) of a failed build.
    pub reason: Option<(String, String)>,
}

/// Every API build's record, the upload tokens, and the one-at-a-time gate.
pub struct Builds {
    pub(super) records: Mutex<HashMap<String, Arc<Mutex<BuildRecord>>>>,
    /// Upload tokens: token → (the key's files directory name, hash, valid until).
    pub(super) uploads: Mutex<HashMap<String, (String, String, SystemTime)>>,
    /// One build at a time: each boots a VM and flattens a disk.
    pub(super) gate: Arc<tokio::sync::Semaphore>,
    /// What image pulls connect through (started by the first build that pulls).
    pub(super) proxy: std::sync::OnceLock<hutch_net::public_proxy::PublicProxy>,
}

impl Default for Builds {
    fn default() -> Builds {
        Builds { records: Default::default(), uploads: Default::default(), gate: Arc::new(tokio::sync::Semaphore::new(1)), proxy: Default::default() }
    }
}

pub(super) struct RecordLog(pub(super) Arc<Mutex<BuildRecord>>);

impl BuildLog for RecordLog {
    fn log(&self, level: Level, step: Option<&str>, message: &str) {
        let mut record = self.0.lock();
        if record.entries.len() >= MAX_ENTRIES {
            record.entries.pop_front();
            record.dropped += 1;
        }
        record.entries.push_back(LogEntry { timestamp: crate::store::rfc3339(SystemTime::now()), level: level.as_str(), message: message.to_string(), step: step.map(str::to_string) });
    }
}
