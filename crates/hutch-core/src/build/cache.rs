//! The build cache: every build step that changed the disk left a layer, a qcow2 file
//! over its parent's layer, and a key naming it. A key is the hash of the parent's key
//! and of everything the step depends on (its text, user, files), so a step whose
//! inputs and history are unchanged finds the layer it made before, as Docker's layer
//! cache does.
//!
//! Layers are never rewritten: children name them as their backing file. A forced
//! rebuild makes a new layer and points the key at it; the old one stays for the
//! layers above it until `prune` removes the whole cache.
//!
//! ```text
//! $HUTCH_HOME/cache/build/keys/<key>.json     {"layer": "<id>"}
//! $HUTCH_HOME/cache/build/layers/<id>/disk.qcow2  (or disk.raw, for an image's base)
//! ```

use hutch_image::HutchHome;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {source}", path.display())]
pub struct CacheError {
    what: &'static str,
    path: PathBuf,
    source: std::io::Error,
}

fn at(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CacheError {
    let path = path.to_path_buf();
    move |source| CacheError { what, path, source }
}

/// A cache key: hex SHA-256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key(pub String);

impl Key {
    /// The key of a step with `inputs` on top of `parent` (None: the first, the base).
    pub fn of(parent: Option<&Key>, inputs: &[&str]) -> Key {
        let mut hash = Sha256::new();
        hash.update(b"hutch-build-1\0");
        if let Some(p) = parent {
            hash.update(p.0.as_bytes());
        }
        for input in inputs {
            // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
            hash.update((input.len() as u64).to_le_bytes());
            hash.update(input.as_bytes());
        }
        Key(hex::encode(hash.finalize()))
    }

    pub fn short(&self) -> &str {
        &self.0[..12.min(self.0.len())]
    }
}

#[derive(Serialize, Deserialize)]
struct Entry {
    layer: String,
}

/// A hold on the build cache (see [`BuildCache::shared`]), released when dropped.
pub struct CacheLock(#[allow(dead_code)] std::fs::File);

#[derive(Clone)]
pub struct BuildCache {
    root: PathBuf,
}

impl BuildCache {
    pub fn new(home: &HutchHome) -> BuildCache {
        BuildCache { root: home.root().join("cache").join("build") }
    }

    fn keys(&self) -> PathBuf {
        self.root.join("keys")
    }

    pub fn layers(&self) -> PathBuf {
        self.root.join("layers")
    }

    /// The layer file `key` names, if it and its file are there.
    pub fn lookup(&self, key: &Key) -> Option<PathBuf> {
        let text = std::fs::read(self.keys().join(format!("{}.json", key.0))).ok()?;
        let entry: Entry = serde_json::from_slice(&text).ok()?;
        if entry.layer.is_empty() || !entry.layer.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let dir = self.layers().join(&entry.layer);
        ["disk.qcow2", "disk.raw"].iter().map(|f| dir.join(f)).find(|p| p.is_file())
    }

    /// A new, empty layer directory (not yet named by any key).
    pub fn new_layer(&self) -> Result<(String, PathBuf), CacheError> {
        let id = hex::encode(rand::random::<[u8; 12]>());
        let dir = self.layers().join(&id);
        std::fs::create_dir_all(&dir).map_err(at("creating", &dir))?;
        Ok((id, dir))
    }

    /// Points `key` at layer `id`, atomically: a reader sees the old entry or the new.
    pub fn record(&self, key: &Key, id: &str) -> Result<(), CacheError> {
        let keys = self.keys();
        std::fs::create_dir_all(&keys).map_err(at("creating", &keys))?;
        let path = keys.join(format!("{}.json", key.0));
        let tmp = keys.join(format!(".{}.{}.tmp", key.0, std::process::id()));
        let body = serde_json::to_vec(&Entry { layer: id.to_string() }).map_err(|e| at("writing", &path)(e.into()))?;
        std::fs::write(&tmp, body).map_err(at("writing", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(at("writing", &path))
    }

    /// Every layer file, for the reference graph (template builds under them stay).
    pub fn layer_files(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.layers())
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|e| ["disk.qcow2", "disk.raw"].map(|f| e.path().join(f)))
            .filter(|p| p.is_file())
            .collect()
    }

    fn lock_file(&self) -> Result<std::fs::File, CacheError> {
        std::fs::create_dir_all(&self.root).map_err(at("creating", &self.root))?;
        let path = self.root.join(".lock");
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(at("opening", &path))
    }

    /// Held by a build while it runs (shared: builds run side by side), across
    /// processes: layers are removed only under [`BuildCache::exclusive`], so never
    /// from under a build stacking on them. Blocks while a removal runs (briefly).
    pub fn shared(&self) -> Result<CacheLock, CacheError> {
        let file = self.lock_file()?;
        file.lock_shared().map_err(at("locking", &self.root.join(".lock")))?;
        Ok(CacheLock(file))
    }

    /// The cache to remove layers from, if no build holds it within `patience`
    /// (None: a build runs; see `hutch_image::flock` for why a moment's wait).
    pub fn exclusive(&self, patience: std::time::Duration) -> Result<Option<CacheLock>, CacheError> {
        let file = self.lock_file()?;
        let locked = hutch_image::flock::lock_within(&file, patience).map_err(at("locking", &self.root.join(".lock")))?;
        Ok(locked.then_some(CacheLock(file)))
    }

    /// Removes `layers` (layer files, as [`BuildCache::layer_files`] lists them) and
    /// the keys naming them, keys first; the caller holds [`BuildCache::exclusive`].
    pub fn remove_layers(&self, _held: &CacheLock, layers: &[PathBuf]) -> Result<(), CacheError> {
        let ids: std::collections::HashSet<String> = layers.iter().filter_map(|l| l.parent()?.file_name()).map(|n| n.to_string_lossy().into_owned()).collect();
        for key in std::fs::read_dir(self.keys()).into_iter().flatten().flatten() {
            let names_one = std::fs::read(key.path()).ok().and_then(|t| serde_json::from_slice::<Entry>(&t).ok()).is_some_and(|e| ids.contains(&e.layer));
            if names_one {
                std::fs::remove_file(key.path()).map_err(at("removing", &key.path()))?;
            }
        }
        for id in &ids {
            let dir = self.layers().join(id);
            std::fs::remove_dir_all(&dir).map_err(at("removing", &dir))?;
        }
        Ok(())
    }

    /// Removes the whole cache (keys first, so no key outlives its layer), scratch
    /// directories and uploaded COPY files; returns the bytes freed. The caller holds
    /// [`BuildCache::exclusive`].
    pub fn prune(&self, _held: &CacheLock) -> Result<u64, CacheError> {
        let used = disk_usage(&self.root);
        for dir in [self.keys(), self.layers(), self.root.join("tmp"), self.root.join("files")] {
            // Scratch may hold what a killed unprivileged unpack left (`remove_tree`).
            match hutch_image::unprivileged::remove_tree(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(at("removing", &dir)(e)),
            }
        }
        Ok(used)
    }

    /// A scratch directory for one build, removed by the caller.
    pub fn scratch(&self) -> Result<PathBuf, CacheError> {
        let dir = self.root.join("tmp").join(hex::encode(rand::random::<[u8; 8]>()));
        std::fs::create_dir_all(&dir).map_err(at("creating", &dir))?;
        Ok(dir)
    }
}

/// Bytes the files under `dir` take on disk (sparse files count what they hold).
pub fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(dir) else { return 0 };
    if !meta.is_dir() {
        return meta.blocks() * 512;
    }
    std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| disk_usage(&e.path())).sum::<u64>() + meta.blocks() * 512
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_parent_and_every_input() {
        let a = Key::of(None, &["RUN", "make"]);
        assert_eq!(a, Key::of(None, &["RUN", "make"]));
        assert_ne!(a, Key::of(Some(&a), &["RUN", "make"]));
        assert_ne!(Key::of(None, &["ab", "c"]), Key::of(None, &["a", "bc"]));
    }

    #[test]
    fn a_recorded_key_finds_its_layer_and_prune_removes_all() {
        let dir = tempfile::tempdir().expect("dir");
        let home = HutchHome::at(dir.path());
        let cache = BuildCache::new(&home);
        let key = Key::of(None, &["x"]);
        assert!(cache.lookup(&key).is_none());
        let (id, layer) = cache.new_layer().expect("layer");
        std::fs::write(layer.join("disk.qcow2"), b"QFI\xfb").expect("file");
        cache.record(&key, &id).expect("record");
        assert_eq!(cache.lookup(&key), Some(layer.join("disk.qcow2")));
        assert_eq!(cache.layer_files().len(), 1);
        let patience = std::time::Duration::from_millis(50);
        let building = cache.shared().expect("a build's hold");
        assert!(cache.exclusive(patience).expect("lock").is_none(), "a removal got the cache while a build held it");
        drop(building);
        let held = cache.exclusive(patience).expect("lock").expect("no build runs");
        cache.prune(&held).expect("prune");
        assert!(cache.lookup(&key).is_none());
        assert!(cache.layer_files().is_empty());
    }
}
