//! Unit tests of the manager over a fake backend whose VMs run a stand-in guest
//! (`fake_guest.rs`) and save, load and resume its memory: every state transition,
//! a caller leaving at each step where an operation waits, failures rolled back, and
//! slot and quota accounting. Real-VM tests (`tests/vm`, the Python suites) prove the
//! same paths against QEMU; these prove the manager's own logic, fast and exhaustively.

mod accounting;
mod builds;
mod cancellation;
mod failed;
mod lifecycle;

use super::state::SandboxState;
use super::*;
use crate::fake_guest::FakeAgent;
use hutch_vmm::fake::FakeBackend;
use std::path::{Path, PathBuf};

/// A manager on a fresh home, its store, and the fake backend under it.
pub(super) struct Env {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    pub backend: FakeBackend,
    /// The guests' agents (`wedge` them).
    pub guest: FakeAgent,
    pub manager: Arc<SandboxManager>,
    /// Two API keys' ids.
    pub keys: [String; 2],
    config: ManagerConfig,
    builder: Builder,
}

/// How long a condition the manager reaches on its own (a reaper pass, a pool fill)
/// may take.
const SETTLE: Duration = Duration::from_secs(20);

impl Env {
    pub async fn new(config: ManagerConfig) -> Env {
        Self::building(config, Arc::new(|_: &str| {})).await
    }

    /// A manager whose template builds call `building` first (see `base_builder`).
    pub async fn building(config: ManagerConfig, building: Arc<dyn Fn(&str) + Send + Sync>) -> Env {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().to_path_buf();
        let store = Store::open_file(&root.join("hutch.db")).await.expect("store");
        let a = store.create_key("a").await.expect("key").0.id;
        let b = store.create_key("b").await.expect("key").0.id;
        let guest = FakeAgent::default();
        let backend = FakeBackend::with_guest(Arc::new(guest.clone()));
        let builder = base_builder(&root, building);
        let manager = Self::start(&root, store, &backend, &config, builder.clone()).await;
        Env { _tmp: tmp, root, backend, guest, manager, keys: [a, b], config, builder }
    }

    async fn start(root: &Path, store: Store, backend: &FakeBackend, config: &ManagerConfig, builder: Builder) -> Arc<SandboxManager> {
        let home = HutchHome::at(root.join("home"));
        SandboxManager::start_with(home, store, Arc::new(backend.clone()), config.clone(), builder).await.expect("manager")
    }

    /// Shuts the manager down and starts a new one on the same home and store.
    pub async fn restart(&mut self) {
        self.manager.shutdown(false).await;
        let store = Store::open_file(&self.root.join("hutch.db")).await.expect("store");
        self.manager = Self::start(&self.root, store, &self.backend, &self.config, self.builder.clone()).await;
    }

    pub fn key(&self) -> &str {
        &self.keys[0]
    }

    pub async fn create(&self) -> SandboxRow {
        self.manager.create(self.key(), base()).await.expect("create")
    }

    /// Runs `call` with the manager and the first key as a task of its own: a caller
    /// that waits while the test acts (at a held step, say).
    pub fn spawn<T, F>(&self, call: impl FnOnce(Arc<SandboxManager>, String) -> F) -> tokio::task::JoinHandle<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = T> + Send + 'static,
    {
        tokio::spawn(call(self.manager.clone(), self.key().to_string()))
    }

    pub fn state(&self, id: &str) -> SandboxState {
        self.manager.live.lock().get(id).expect("a live sandbox").owner.state()
    }

    /// Stores `value` under `key` in the running guest's memory.
    pub async fn put(&self, id: &str, key: &str, value: &str) {
        let agent = self.manager.agent(id).expect("a running sandbox");
        agent.post_json("/fake/put", &BTreeMap::from([(key, value)])).await.expect("put");
    }

    /// The running guest's memory.
    pub async fn values(&self, id: &str) -> BTreeMap<String, String> {
        self.manager.agent(id).expect("a running sandbox").get_json("/fake/values").await.expect("values")
    }

    pub fn sandbox_dirs(&self) -> Vec<String> {
        let mut dirs: Vec<String> = std::fs::read_dir(self.manager.home.sandboxes())
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        dirs.sort();
        dirs
    }

    pub fn snapshot_dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(self.manager.snapshots_root()).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        dirs.sort();
        dirs
    }

    /// Waits until no operation runs and no start is counted, then checks that the
    /// owners, the rows, the store, the VMs and the disk all tell the same story.
    pub async fn settled(&self) {
        let quiet = until(SETTLE, || {
            // The manager's lock order: starting before live.
            let starting = self.manager.starting.lock().total();
            let live = self.manager.live.lock();
            self.manager.in_flight.load(std::sync::atomic::Ordering::SeqCst) == 0
                && starting == 0
                && live.values().all(|l| !l.owner.is_busy())
                && !self.manager.pools_filling()
        })
        .await;
        assert!(quiet, "operations still running after {SETTLE:?}");
        let lives: Vec<(String, Arc<Live>)> = self.manager.live.lock().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let stored: HashMap<String, SandboxRow> = self.manager.store.sandboxes().await.expect("rows").into_iter().map(|r| (r.id.clone(), r)).collect();
        let (mut running, mut failed) = (0, 0);
        for (id, live) in &lives {
            let state = live.owner.state();
            assert!(matches!(state, SandboxState::Running | SandboxState::Paused | SandboxState::Failed), "{id} settled in {state:?}");
            let row = live.row();
            assert_eq!(row.failure.is_some(), state == SandboxState::Failed, "{id}: a failure is shown exactly when it failed");
            if state != SandboxState::Failed {
                // What the owner holds is what its row says: the next server adopts by it.
                let kept = stored.get(id).map(|r| (r.state.as_str(), r.qemu_pid, r.end_at));
                assert_eq!(kept, Some((state.api_name(), row.qemu_pid, row.end_at)), "{id}: the store disagrees with the owner");
            }
            assert_eq!(live.owner.agent().is_some(), state == SandboxState::Running, "{id}: a data-plane agent only while running");
            let dir = Path::new(&row.dir);
            assert_eq!(crate::sandbox::layout::paused_mode(dir).is_some(), state == SandboxState::Paused, "{id}: saved state only while paused");
            assert_eq!(row.pause_mode.is_some(), state == SandboxState::Paused, "{id}: a pause mode exactly while paused");
            assert!(!(dir.join(crate::sandbox::layout::PAUSED_STATE).exists() && dir.join(crate::sandbox::layout::PAUSED_DISK).exists()), "{id}: paused two ways");
            running += usize::from(state == SandboxState::Running);
            failed += usize::from(state == SandboxState::Failed);
        }
        assert_eq!(stored.len(), lives.len(), "the store holds sandboxes the manager does not: {:?}", stored.keys());
        let mut ids: Vec<String> = lives.iter().map(|(id, _)| id.clone()).chain(self.manager.pooled_ids()).collect();
        ids.sort();
        assert_eq!(self.sandbox_dirs(), ids, "sandbox directories and sandboxes (pooled too) differ");
        // A failed sandbox may still hold its (wedged) VM until it is killed.
        let vms = self.backend.live();
        let expected = running + self.manager.pooled_count();
        assert!((expected..=expected + failed).contains(&vms), "{vms} VMs run for {expected} running and pooled sandboxes and {failed} failed ones");
        assert!(self.manager.pinned.lock().is_empty(), "pins left: {:?}", self.manager.pinned.lock());
        // Every snapshot directory is a stored snapshot or under a sandbox.
        self.manager.prune_snapshot_files().await;
        let kept: std::collections::HashSet<PathBuf> = self.manager.store.snapshot_dirs().await.expect("dirs").into_iter().map(PathBuf::from).collect();
        for dir in self.snapshot_dirs() {
            let based: bool = crate::sandbox::layout::base_snapshots_in_use(&self.manager.home).iter().any(|b| b == &dir)
                || kept.iter().filter_map(|k| crate::snapshot::MemorySnapshot::open(k)?.manifest.base).any(|b| b == dir);
            assert!(kept.contains(&dir) || based, "snapshot files nothing uses: {}", dir.display());
        }
    }

    /// Kills every sandbox, deletes every snapshot, and checks that nothing but the
    /// pools is left.
    pub async fn kill_all(&self) {
        let ids: Vec<String> = self.manager.live.lock().keys().cloned().collect();
        for id in ids {
            let live = self.manager.live.lock()[&id].clone();
            let key = live.row.key_id.clone();
            self.manager.kill(&key, &id).await.expect("kill");
        }
        for key in &self.keys {
            for snap in self.manager.list_snapshots(key).await.expect("snapshots") {
                self.manager.delete_snapshot(key, &snap.id).await.expect("delete snapshot");
            }
        }
        self.settled().await;
        let mut pooled = self.manager.pooled_ids();
        pooled.sort();
        assert_eq!(self.sandbox_dirs(), pooled, "only pooled sandboxes are left");
        assert_eq!(self.snapshot_dirs(), Vec::<PathBuf>::new());
        assert_eq!(self.backend.live(), self.manager.pooled_count());
    }
}

/// A builder whose every template is the fake "base" (named as asked), calling
/// `building` first with the template's name (a test can block there).
pub(super) fn base_builder(root: &Path, building: Arc<dyn Fn(&str) + Send + Sync>) -> Builder {
    let base = crate::fake_guest::artifacts(root);
    Arc::new(move |_: &HutchHome, template: &str| {
        building(template);
        let mut artifacts = base.clone();
        artifacts.template.name = template.to_string();
        Ok(artifacts)
    })
}

/// A create of the base template.
pub(super) fn base() -> CreateSpec {
    CreateSpec { template: "base".into(), ..CreateSpec::default() }
}

/// Polls `done` every 20 ms until it holds or `limit` passes; whether it held.
pub(super) async fn until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
