//! The server's VM slots (running and pooled sandboxes count, paused ones do not) and
//! each key's quotas: refused at the limit with the right error, and given back by
//! every operation that ends, failed or not.

use super::*;

fn config(max_sandboxes: usize, pool: usize) -> ManagerConfig {
    ManagerConfig {
        max_sandboxes,
        quota: KeyQuota { running: 2, paused: 1, snapshots: 1, ..KeyQuota::default() },
        pool: BTreeMap::from([("base".to_string(), pool)]),
        ..ManagerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_and_quotas_are_counted_and_given_back() {
    let env = Env::new(config(3, 0)).await;
    let [a, b] = env.keys.clone();
    let m = &env.manager;
    let a1 = m.create(&a, base()).await.expect("a1").id;
    let a2 = m.create(&a, base()).await.expect("a2").id;
    assert!(matches!(m.create(&a, base()).await, Err(ManagerError::Quota(_))), "a key's running quota");
    m.create(&b, base()).await.expect("another key is not held back");
    assert!(matches!(m.create(&b, base()).await, Err(ManagerError::AtCapacity { max: 3 })), "the server's limit");
    env.settled().await;

    // Paused sandboxes hold no VM: pausing frees a slot.
    m.pause(&a, &a1, PauseMode::Full).await.expect("pause");
    let b2 = m.create(&b, base()).await.expect("the freed slot").id;
    assert!(matches!(m.pause(&a, &a2, PauseMode::Full).await, Err(ManagerError::Quota(_))), "a key's paused quota");
    assert_eq!(env.state(&a2), SandboxState::Running, "a refused pause changes nothing");
    // A resume needs a slot like a create; refused, it stays paused.
    assert!(matches!(m.connect(&a, &a1, None, OnResume::Restore).await, Err(ManagerError::AtCapacity { .. })));
    assert_eq!(env.state(&a1), SandboxState::Paused);
    assert!(matches!(m.fork(&a, &a2, 1, None).await, Err(ManagerError::AtCapacity { .. })), "a fork needs slots for its sandboxes");
    env.settled().await;

    m.kill(&b, &b2).await.expect("kill");
    m.connect(&a, &a1, None, OnResume::Restore).await.expect("resume into the freed slot");
    assert!(matches!(m.fork(&a, &a1, 1, None).await, Err(ManagerError::Quota(_))), "a fork counts against the running quota");
    m.create_snapshot(&a, &a1, None, true).await.expect("a snapshot");
    assert!(matches!(m.create_snapshot(&a, &a1, None, true).await, Err(ManagerError::Quota(_))), "a key's snapshot quota");
    assert_eq!(m.counts(), (3, 0));
    env.settled().await;
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_starts_give_their_slot_back() {
    let env = Env::new(config(1, 0)).await;
    let key = env.key().to_string();
    *env.backend.fail_start.lock() = Some("no QEMU today".into());
    for _ in 0..3 {
        assert!(matches!(env.manager.create(&key, base()).await, Err(ManagerError::Create(_))));
    }
    assert!(env.manager.live.lock().is_empty(), "a failed create leaves nothing admitted");
    *env.backend.fail_start.lock() = None;
    env.settled().await;
    let id = env.create().await.id;
    env.manager.pause(&key, &id, PauseMode::Full).await.expect("pause");
    *env.backend.fail_start.lock() = Some("no QEMU today".into());
    assert!(matches!(env.manager.connect(&key, &id, None, OnResume::Restore).await, Err(ManagerError::Resume(_))));
    *env.backend.fail_start.lock() = None;
    env.manager.connect(&key, &id, None, OnResume::Restore).await.expect("the one slot is free again");
    env.kill_all().await;
}

/// A template's builds changed (a rebuild, a moved `default` tag): the sandbox waiting
/// with the old build is never handed out, its VM stops, and the pool refills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_build_retires_the_pooled_sandboxes_of_the_old_one() {
    let env = Env::new(config(3, 1)).await;
    let key = env.key().to_string();
    assert!(until(SETTLE, || env.manager.pool_size("base") == 1).await, "the pool did not fill");
    env.settled().await;
    let old = env.manager.pooled_ids();
    env.manager.forget_artifacts("base");
    assert_eq!(env.manager.pool_size("base"), 0, "a sandbox of the replaced build still counts as ready");
    assert!(
        until(SETTLE, || env.manager.pool_size("base") == 1 && !env.manager.pooled_ids().iter().any(|id| old.contains(id))).await,
        "the pool did not refill with the new build: {:?}",
        env.manager.pooled_ids()
    );
    env.settled().await;
    assert_eq!(env.backend.live(), 1, "the VM of the replaced build still runs");
    env.manager.create(&key, base()).await.expect("from the pool");
    env.settled().await;
    assert!(!env.sandbox_dirs().iter().any(|d| old.contains(d)), "the replaced build's sandbox is back");
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_sandboxes_count_against_the_limit_and_never_take_its_last_slot() {
    let env = Env::new(config(3, 2)).await;
    let key = env.key().to_string();
    // The pool fills up to its size but leaves the last slot for requests.
    assert!(until(SETTLE, || env.manager.pool_size("base") == 2).await, "the pool did not fill");
    env.settled().await;
    let pooled_vms = env.backend.live();
    assert_eq!(pooled_vms, 2);
    let first = env.manager.create(&key, base()).await.expect("from the pool");
    assert_eq!(env.backend.live(), pooled_vms, "the create took a pooled VM instead of starting one");
    env.put(&first.id, "x", "1").await;
    // One running and one pooled: the refill stops short of the last slot.
    env.settled().await;
    assert_eq!(env.manager.pool_size("base"), 1);
    let second = env.manager.create(&key, base()).await.expect("the pooled one");
    assert_eq!(env.manager.pool_size("base"), 0);
    assert_eq!(env.values(&second.id).await.get("x"), None, "a pooled guest is nobody's until taken");
    // The last slot goes to a request, started afresh.
    env.manager.create(&env.keys[1], base()).await.expect("the last slot");
    assert_eq!(env.backend.live(), 3);
    assert!(matches!(env.manager.create(&env.keys[1], base()).await, Err(ManagerError::AtCapacity { max: 3 })));
    env.settled().await;
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_being_created_is_counted_from_admission_and_hidden_until_it_runs() {
    let env = Env::new(config(1, 0)).await;
    let [a, b] = env.keys.clone();
    let m = &env.manager;
    let hold = env.backend.hold(hutch_vmm::fake::Step::Start);
    let creating = env.spawn(|m, key| async move { m.create(&key, base()).await });
    hold.reached().await;
    let id = m.live.lock().keys().next().cloned().expect("admitted before its VM starts");
    assert_eq!(env.state(&id), SandboxState::Creating);
    assert_eq!(m.counts(), (1, 0), "it holds the server's one slot");
    assert!(matches!(m.create(&b, base()).await, Err(ManagerError::AtCapacity { max: 1 })), "so another create is refused at once");
    assert!(m.list(&a, &ListFilter::default()).is_empty(), "no client has its id yet");
    assert!(matches!(m.get(&a, &id), Err(ManagerError::NotFound(_))));
    assert!(matches!(m.kill(&a, &id).await, Err(ManagerError::NotFound(_))));
    assert!(matches!(m.agent(&id), Err(ManagerError::NotFound(_))));
    hold.release();
    let row = creating.await.expect("task").expect("created");
    assert_eq!(row.id, id, "it runs under the id it was admitted with");
    assert_eq!((env.state(&id), row.state.as_str()), (SandboxState::Running, "running"));
    assert_eq!(m.list(&a, &ListFilter::default()).len(), 1);
    env.settled().await;
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_racing_each_other_never_pass_the_running_quota() {
    let config = ManagerConfig { max_sandboxes: 4, quota: KeyQuota { running: 1, paused: 2, snapshots: 1, ..KeyQuota::default() }, ..ManagerConfig::default() };
    let env = Env::new(config).await;
    let key = env.key().to_string();
    let m = &env.manager;
    let mut paused = Vec::new();
    for _ in 0..2 {
        let id = env.create().await.id;
        m.pause(&key, &id, PauseMode::Full).await.expect("pause");
        paused.push(id);
    }
    env.settled().await;
    let hold = env.backend.hold(hutch_vmm::fake::Step::Start);
    let first = paused[0].clone();
    let resuming = env.spawn(move |m, key| async move { m.connect(&key, &first, None, OnResume::Restore).await });
    hold.reached().await;
    // The first resume holds the key's one running slot while its VM starts.
    assert!(matches!(m.connect(&key, &paused[1], None, OnResume::Restore).await, Err(ManagerError::Quota(_))), "the second is refused");
    assert!(matches!(m.create(&key, base()).await, Err(ManagerError::Quota(_))), "so is a create");
    hold.release();
    resuming.await.expect("task").expect("the first resumes");
    assert_eq!(env.state(&paused[1]), SandboxState::Paused, "a refused resume changes nothing");
    env.settled().await;
    env.kill_all().await;
}
