//! A sandbox an operation cannot bring back (its VM died during a save, its agent no
//! longer answers, a resumed guest that ran and then failed) becomes `Failed`: clients
//! see why, every operation but kill is refused with that reason, and kill cleans up.

use super::*;
use hutch_vmm::fake::Step;

/// Checks what a client sees of the failed sandbox `id`, then kills it.
async fn refused_until_killed(env: &Env, id: &str, why: &str) {
    let key = env.key();
    assert_eq!(env.state(id), SandboxState::Failed);
    let row = env.manager.get(key, id).expect("still listed");
    assert_eq!(row.state, "running", "E2B's state has only running and paused");
    let failure = row.failure.expect("the failure is shown");
    assert!(failure.contains(why), "{failure}");
    let data_plane = env.manager.agent(id).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(data_plane.contains("has failed") && data_plane.contains("kill it"), "{data_plane}");
    assert!(matches!(env.manager.connect(key, id, None, OnResume::Restore).await, Err(ManagerError::Failed { .. })));
    assert!(matches!(env.manager.pause(key, id, PauseMode::Full).await, Err(ManagerError::Transition(_))));
    assert!(matches!(env.manager.create_snapshot(key, id, None, true).await, Err(ManagerError::Transition(_))));
    assert!(matches!(env.manager.fork(key, id, 1, None).await, Err(ManagerError::Transition(_))));
    assert_eq!(env.manager.counts().0, 1, "a failed sandbox may hold a VM: it counts against the limit");
    env.settled().await;
    env.manager.kill(key, id).await.expect("a failed sandbox can be killed");
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_that_dies_during_a_pause_leaves_a_failed_sandbox() {
    let env = Env::new(ManagerConfig::default()).await;
    let id = env.create().await.id;
    let hold = env.backend.hold(Step::Save);
    let pause = env.spawn(|m, key| {
        let id = id.clone();
        async move { m.pause(&key, &id, PauseMode::Full).await }
    });
    hold.reached().await;
    env.backend.crash(&id);
    hold.release();
    assert!(matches!(pause.await.expect("task"), Err(ManagerError::Pause(_))));
    refused_until_killed(&env, &id, "its VM ended").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_whose_agent_stops_answering_after_a_failed_snapshot_fails() {
    let env = Env::new(ManagerConfig::default()).await;
    let id = env.create().await.id;
    let hold = env.backend.hold(Step::Save);
    let snapshot = env.spawn(|m, key| {
        let id = id.clone();
        async move { m.create_snapshot(&key, &id, None, true).await }
    });
    hold.reached().await;
    *env.backend.fail_save.lock() = Some("the disk is gone".into());
    env.guest.wedge(true);
    hold.release();
    assert!(snapshot.await.expect("task").is_err());
    assert!(env.manager.list_snapshots(env.key()).await.expect("list").is_empty());
    refused_until_killed(&env, &id, "agent does not answer").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_guest_that_ran_and_then_failed_cannot_fall_back_to_paused() {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key().to_string();
    // Paused at its timeout, as autoPause does: its end is in the past from then on.
    let id = env.manager.create(&key, CreateSpec { template: "base".into(), timeout: Some(1), auto_pause: true, ..CreateSpec::default() }).await.expect("create").id;
    assert!(until(SETTLE, || env.state(&id) == SandboxState::Paused).await, "autoPause did not pause it");
    env.guest.wedge(true);
    let resumed = env.manager.connect(&key, &id, None, OnResume::Restore).await;
    assert!(matches!(resumed, Err(ManagerError::Resume(crate::sandbox::errors::CreateError::RanThenFailed(_)))), "{resumed:?}");
    env.guest.wedge(false);
    // Its saved state is gone: loading it again over the disk the guest changed since
    // would corrupt the filesystem.
    let dir = PathBuf::from(env.manager.get(&key, &id).expect("row").dir);
    assert!(!dir.join(crate::sandbox::layout::PAUSED_STATE).exists());
    // The reaper leaves it for the user to see (its end was moved on), not gone at once.
    env.manager.kill_expired().await;
    assert_eq!(env.state(&id), SandboxState::Failed);
    refused_until_killed(&env, &id, "cannot be resumed again").await;
}
