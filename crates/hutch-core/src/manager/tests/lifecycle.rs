//! Every lifecycle operation along the state machine's edges, what each refuses, and
//! failures rolled back to the state the operation started from.

use super::*;
use SandboxState::{Paused, Running};

fn spec(template: &str) -> CreateSpec {
    CreateSpec { template: template.into(), ..CreateSpec::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_goes_through_every_state_and_keeps_its_memory() {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key();
    let id = env.create().await.id;
    assert_eq!(env.state(&id), Running);
    env.put(&id, "x", "1").await;

    env.manager.pause(key, &id, PauseMode::Full).await.expect("pause");
    assert_eq!(env.state(&id), Paused);
    env.settled().await;
    assert!(matches!(env.manager.pause(key, &id, PauseMode::Full).await, Err(ManagerError::AlreadyPaused(_))));
    assert!(matches!(env.manager.agent(&id), Err(ManagerError::Paused(_))));
    assert!(matches!(env.manager.metrics(key, &id).await, Err(ManagerError::Paused(_))));
    assert!(matches!(env.manager.fork(key, &id, 1, None).await, Err(ManagerError::Paused(_))));
    // Snapshotting a paused sandbox copies its saved state; it stays paused.
    let of_paused = env.manager.create_snapshot(key, &id, Some("of-paused".into()), true).await.expect("snapshot of a paused sandbox");
    assert_eq!(env.state(&id), Paused);

    let (_, how) = env.manager.connect(key, &id, None, OnResume::Restore).await.expect("connect");
    assert_eq!(how, Connected::Resumed);
    assert_eq!(env.values(&id).await["x"], "1", "the resumed guest has its memory");
    assert_eq!(env.manager.connect(key, &id, None, OnResume::Restore).await.expect("connect").1, Connected::AlreadyRunning);
    env.put(&id, "x", "2").await;

    // Snapshotting a running sandbox pauses it for the save; it runs on.
    let of_running = env.manager.create_snapshot(key, &id, None, true).await.expect("snapshot of a running sandbox");
    assert_eq!(env.state(&id), Running);
    assert_eq!(env.values(&id).await["x"], "2");
    env.settled().await;

    // Sandboxes started from each snapshot continue from it.
    let a = env.manager.create(key, spec("of-paused")).await.expect("create from a name").id;
    assert_eq!(env.values(&a).await["x"], "1");
    let b = env.manager.create(key, spec(&of_running.id)).await.expect("create from an id").id;
    assert_eq!(env.values(&b).await["x"], "2");
    // One started from a snapshot can itself be snapshotted and forked.
    let again = env.manager.create_snapshot(key, &b, None, true).await.expect("snapshot of a sandbox started from a snapshot");
    assert_eq!(again.template, "base", "it records the template the snapshot descends from");
    let c = env.manager.create(key, spec(&again.id)).await.expect("create from that snapshot").id;
    assert_eq!(env.values(&c).await["x"], "2");

    let forks: Vec<String> = env.manager.fork(key, &b, 2, None).await.expect("fork").into_iter().map(|f| f.expect("a fork").id).collect();
    assert_eq!(forks.len(), 2);
    env.put(&forks[0], "y", "mine").await;
    assert_eq!(env.values(&forks[0]).await.get("y").map(String::as_str), Some("mine"));
    assert_eq!(env.values(&forks[1]).await.get("y"), None, "forks share no memory");
    assert_eq!(env.values(&b).await.get("y"), None, "nor with their source");
    assert_eq!(env.values(&forks[1]).await["x"], "2");
    env.settled().await;

    // Killed from running and from paused; a second kill finds nothing.
    env.manager.pause(key, &a, PauseMode::Full).await.expect("pause");
    env.manager.kill(key, &a).await.expect("kill a paused sandbox");
    env.manager.kill(key, &c).await.expect("kill a running sandbox");
    assert!(matches!(env.manager.kill(key, &c).await, Err(ManagerError::NotFound(_))));
    assert!(matches!(env.manager.pause(key, &c, PauseMode::Full).await, Err(ManagerError::NotFound(_))));
    env.settled().await;
    let _ = of_paused;
    env.kill_all().await;
}

/// A secure sandbox's agent wants the token it holds on every `/init` (the fake guest
/// keeps it in its saved memory, as a real one does): each way a guest comes back —
/// resumed, restored from a snapshot of a paused or running sandbox, forked, rebooted
/// on its disk — is initialized by a host that presents the right one, and gets its
/// own sandbox's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_guest_is_initialized_with_the_token_it_holds() {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key();
    let secure = |template: &str| CreateSpec { secure: true, ..spec(template) };
    // The row's token is the one the host presents from then on.
    let holds_its_token = |row: &SandboxRow| {
        let agent = env.manager.agent(&row.id).expect("a running sandbox");
        assert!(row.envd_token.is_some(), "{}: a secure sandbox without a token", row.id);
        assert_eq!(agent.access_token(), row.envd_token.as_deref(), "{}: the host's client presents another token", row.id);
    };
    let first = env.manager.create(key, secure("base")).await.expect("create");
    holds_its_token(&first);
    env.put(&first.id, "x", "1").await;

    env.manager.pause(key, &first.id, PauseMode::Full).await.expect("pause");
    let of_paused = env.manager.create_snapshot(key, &first.id, Some("of-paused".into()), true).await.expect("snapshot of a paused sandbox");
    env.manager.connect(key, &first.id, None, OnResume::Restore).await.expect("resume");
    holds_its_token(&first);
    let of_running = env.manager.create_snapshot(key, &first.id, None, true).await.expect("snapshot of a running sandbox");
    holds_its_token(&first);

    for template in [of_paused.name.clone().expect("a name"), of_running.id.clone()] {
        let started = env.manager.create(key, secure(&template)).await.expect("create from a secure sandbox's snapshot");
        assert_eq!(env.values(&started.id).await["x"], "1", "{template}: not restored from its memory");
        assert_ne!(started.envd_token, first.envd_token, "a restored sandbox shares its source's token");
        holds_its_token(&started);
    }
    let forks = env.manager.fork(key, &first.id, 2, None).await.expect("fork");
    for fork in forks {
        let fork = fork.expect("a fork of a secure sandbox");
        assert_ne!(fork.envd_token, first.envd_token, "a fork shares its source's token");
        holds_its_token(&fork);
    }

    // A fork of a fork: the guest holds the first fork's token.
    let forked = env.manager.fork(key, &first.id, 1, None).await.expect("fork").remove(0).expect("a fork");
    let again = env.manager.fork(key, &forked.id, 1, None).await.expect("fork").remove(0).expect("a fork of a fork");
    holds_its_token(&again);

    // A pause without memory comes back by booting: that guest holds no token yet.
    env.manager.pause(key, &first.id, PauseMode::Filesystem).await.expect("pause without memory");
    env.manager.connect(key, &first.id, None, OnResume::Restore).await.expect("resume by booting");
    holds_its_token(&first);
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_keys_sandbox_is_not_found() {
    let env = Env::new(ManagerConfig::default()).await;
    let id = env.create().await.id;
    let other = &env.keys[1];
    assert!(matches!(env.manager.get(other, &id), Err(ManagerError::NotFound(_))));
    assert!(matches!(env.manager.pause(other, &id, PauseMode::Full).await, Err(ManagerError::NotFound(_))));
    assert!(matches!(env.manager.kill(other, &id).await, Err(ManagerError::NotFound(_))));
    assert!(matches!(env.manager.create_snapshot(other, &id, None, true).await, Err(ManagerError::NotFound(_))));
    assert!(env.manager.list(other, &ListFilter::default()).is_empty());
    assert_eq!(env.state(&id), Running);
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_saves_and_starts_roll_back_to_where_they_began() {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key();
    let id = env.create().await.id;
    env.put(&id, "x", "1").await;

    // A failed pause leaves it running, with its memory and a working agent.
    *env.backend.fail_save.lock() = Some("the disk is gone".into());
    let failed = env.manager.pause(key, &id, PauseMode::Full).await;
    assert!(matches!(failed, Err(ManagerError::Pause(_))), "{failed:?}");
    assert_eq!(env.state(&id), Running);
    assert_eq!(env.values(&id).await["x"], "1");
    env.settled().await;

    // A failed snapshot leaves it running and no snapshot behind.
    *env.backend.fail_save.lock() = Some("the disk is gone".into());
    assert!(env.manager.create_snapshot(key, &id, Some("broken".into()), true).await.is_err());
    assert_eq!(env.state(&id), Running);
    assert!(env.manager.list_snapshots(key).await.expect("list").is_empty());
    env.settled().await;

    // A failed fork starts nothing.
    *env.backend.fail_save.lock() = Some("the disk is gone".into());
    assert!(env.manager.fork(key, &id, 2, None).await.is_err());
    assert_eq!(env.manager.list(key, &ListFilter::default()).len(), 1);
    env.settled().await;

    // A failed resume leaves it paused with its saved state, and it resumes later.
    env.manager.pause(key, &id, PauseMode::Full).await.expect("pause");
    *env.backend.fail_start.lock() = Some("no QEMU today".into());
    let failed = env.manager.connect(key, &id, None, OnResume::Restore).await;
    assert!(matches!(failed, Err(ManagerError::Resume(_))), "{failed:?}");
    assert_eq!(env.state(&id), Paused);
    env.settled().await;
    // A failed create leaves nothing.
    assert!(matches!(env.manager.create(key, base()).await, Err(ManagerError::Create(_))));
    env.settled().await;
    *env.backend.fail_start.lock() = None;
    env.manager.connect(key, &id, None, OnResume::Restore).await.expect("connect");
    assert_eq!(env.values(&id).await["x"], "1");
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_that_ends_on_its_own_fails_and_its_sandbox_is_removed() {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key().to_string();
    let id = env.create().await.id;
    let other = env.create().await.id;
    env.backend.crash(&id);
    let gone = until(SETTLE, || matches!(env.manager.get(&key, &id), Err(ManagerError::NotFound(_)))).await;
    assert!(gone, "the reaper did not remove the sandbox whose VM ended");
    env.settled().await;
    assert_eq!(env.manager.list(&key, &ListFilter::default()).iter().map(|r| r.id.clone()).collect::<Vec<_>>(), vec![other.clone()]);
    env.put(&other, "still", "here").await;
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_survives_a_restart_and_resumes_with_its_memory() {
    let mut env = Env::new(ManagerConfig::default()).await;
    let key = env.key().to_string();
    let paused = env.create().await.id;
    let running = env.create().await.id;
    env.put(&paused, "x", "kept").await;
    env.manager.pause(&key, &paused, PauseMode::Full).await.expect("pause");
    env.restart().await;
    // The fake backend cannot adopt a running VM (QEMU's can: the Python suite proves
    // it), so that sandbox is cleaned up rather than left half-known.
    let listed: Vec<(String, String)> = env.manager.list(&key, &ListFilter::default()).into_iter().map(|r| (r.id, r.state)).collect();
    assert_eq!(listed, vec![(paused.clone(), "paused".to_string())]);
    assert!(!env.sandbox_dirs().contains(&running));
    env.settled().await;
    env.manager.connect(&key, &paused, None, OnResume::Restore).await.expect("connect after the restart");
    assert_eq!(env.values(&paused).await["x"], "kept");
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_without_memory_resumes_by_booting_and_a_reboot_drops_memory() {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key();
    let id = env.create().await.id;
    env.put(&id, "x", "1").await;

    env.manager.pause(key, &id, PauseMode::Filesystem).await.expect("pause without memory");
    assert_eq!(env.manager.get(key, &id).expect("listed").pause_mode, Some(PauseMode::Filesystem));
    env.settled().await;
    // A snapshot of it has only the disk, and starts by booting.
    let disk_only = env.manager.create_snapshot(key, &id, None, true).await.expect("snapshot of a disk-only pause");
    assert!(!disk_only.memory, "a disk-only pause's snapshot claims memory");
    assert_eq!(env.manager.connect(key, &id, None, OnResume::Restore).await.expect("connect").1, Connected::Resumed);
    assert_eq!(env.values(&id).await.get("x"), None, "the guest booted afresh");
    env.settled().await;

    // A full pause brought back with a reboot forgets its memory, and its saved state is gone.
    env.put(&id, "x", "2").await;
    env.manager.pause(key, &id, PauseMode::Full).await.expect("pause");
    assert_eq!(env.manager.get(key, &id).expect("listed").pause_mode, Some(PauseMode::Full));
    env.manager.connect(key, &id, None, OnResume::Reboot).await.expect("reboot");
    assert_eq!(env.values(&id).await.get("x"), None, "a reboot keeps no memory");
    env.settled().await;

    // A snapshot asked to keep no memory starts sandboxes by booting too.
    env.put(&id, "x", "3").await;
    let snap = env.manager.create_snapshot(key, &id, None, false).await.expect("a disk-only snapshot");
    assert!(!snap.memory);
    assert_eq!(env.values(&id).await["x"], "3", "the source runs on with its memory");
    let started = env.manager.create(key, spec(&snap.id)).await.expect("create from the disk-only snapshot").id;
    assert_eq!(env.values(&started).await.get("x"), None);
    env.settled().await;
    env.kill_all().await;
}

/// The store failing right after a resume (locked by another writer, a full disk) must
/// not cost the sandbox: its VM runs and its saved state is gone, so it stays running
/// with its memory, and the next operation's record puts the store right. (Dropping it
/// there once deleted the sandbox while its row still said paused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_after_a_resume_keeps_the_sandbox_running_with_its_memory() {
    use sqlx::Connection;
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key().to_string();
    let id = env.create().await.id;
    env.put(&id, "x", "kept").await;
    env.manager.pause(&key, &id, PauseMode::Full).await.expect("pause");
    let hold = env.backend.hold(hutch_vmm::fake::Step::Resume);
    let resuming = env.spawn({
        let id = id.clone();
        move |m, key| async move { m.connect(&key, &id, None, OnResume::Restore).await.map(drop) }
    });
    hold.reached().await;
    // Another writer holds the database until after the resume's record is written.
    let mut writer = sqlx::SqliteConnection::connect(&format!("sqlite://{}", env.root.join("hutch.db").display())).await.expect("connect");
    sqlx::query("BEGIN EXCLUSIVE").execute(&mut writer).await.expect("lock the database");
    hold.release();
    resuming.await.expect("join").expect("the resume succeeds though its record could not be written");
    assert_eq!(env.state(&id), Running);
    assert_eq!(env.values(&id).await["x"], "kept");
    assert!(env.sandbox_dirs().contains(&id), "the resumed sandbox's directory was removed");
    sqlx::query("ROLLBACK").execute(&mut writer).await.expect("unlock");
    drop(writer);
    // It goes on as any running sandbox, and the store follows again.
    env.manager.pause(&key, &id, PauseMode::Full).await.expect("pause again");
    env.manager.connect(&key, &id, None, OnResume::Restore).await.expect("resume again");
    assert_eq!(env.values(&id).await["x"], "kept");
    env.settled().await;
    env.kill_all().await;
}

/// Two requests racing for one snapshot name (on two sandboxes, so neither waits for
/// the other): both pass the name check, the store's unique index decides, and the
/// loser gets the same Conflict (409) as a name taken earlier, with its files removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_snapshots_racing_for_one_name_one_is_stored_and_the_other_is_a_conflict() {
    let env = Env::new(ManagerConfig::default()).await;
    let (a, b) = (env.create().await.id, env.create().await.id);
    let hold = env.backend.hold(hutch_vmm::fake::Step::Save);
    let first = env.spawn({
        let a = a.clone();
        move |m, key| async move { m.create_snapshot(&key, &a, Some("same".into()), true).await.map(|r| r.id) }
    });
    hold.reached().await;
    let won = env.manager.create_snapshot(env.key(), &b, Some("same".into()), true).await.expect("the request saved first is stored");
    hold.release();
    let lost = first.await.expect("join");
    assert!(matches!(&lost, Err(ManagerError::Conflict(m)) if m.contains("same")), "{lost:?}");
    let stored: Vec<String> = env.manager.list_snapshots(env.key()).await.expect("snapshots").into_iter().map(|s| s.id).collect();
    assert_eq!(stored, vec![won.id]);
    env.settled().await;
    env.kill_all().await;
}
