//! The server's VM slots (running and pooled sandboxes count, paused ones do not) and
//! each key's quotas: refused at the limit with the right error, and given back by
//! every operation that ends, failed or not.

use super::*;

fn config(max_sandboxes: usize, pool: usize) -> ManagerConfig {
    ManagerConfig {
        max_sandboxes,
        quota: KeyQuota { running: 2, paused: 1, snapshots: 1, ..KeyQuota::default() },
        pool: PoolPolicy { pinned: BTreeMap::from([("base".to_string(), pool)]), ..PoolPolicy::off() },
        ..ManagerConfig::default()
    }
}

/// The host's free memory as the first demand test sets it (MiB).
static FREE_MIB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

fn free_mib() -> Option<u64> {
    Some(FREE_MIB.load(std::sync::atomic::Ordering::SeqCst))
}

/// Pools sized by demand (`hutch serve`'s default), the host's free memory read by `free_memory`.
fn by_demand(max_sandboxes: usize, free_memory: fn() -> Option<u64>) -> ManagerConfig {
    // The upkeep runs when a test calls it.
    let pool = PoolPolicy { reserve_mib: 1024, free_memory, upkeep_every: Duration::from_secs(86_400), ..PoolPolicy::by_demand(2) };
    ManagerConfig { max_sandboxes, pool, ..config(max_sandboxes, 0) }
}

fn of(template: &str) -> CreateSpec {
    CreateSpec { template: template.into(), ..CreateSpec::default() }
}

/// By default one `base` waits; a template created from gets a pool of its own; at the
/// server's limit and when the host is short of memory the pools give way to creates
/// (never more VMs than the limit); demand that ends lets its pool go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demand_sizes_the_pools_and_they_give_way_to_creates() {
    let env = Env::new(by_demand(4, free_mib)).await;
    let [a, b] = env.keys.clone();
    let m = &env.manager;
    assert!(until(SETTLE, || m.pool_size("base") == 1).await, "the default template's pool did not fill");
    assert_eq!(m.pool_size("other"), 0, "a template nobody used has no pool");
    let other = m.create(&a, of("other")).await.expect("other, restored afresh");
    assert!(until(SETTLE, || m.pool_size("other") == 1).await, "a created-from template's pool did not fill");
    env.settled().await;
    let shown: Vec<(String, usize, usize)> = m.pools(&a).into_iter().map(|p| (p.template, p.ready, p.target)).collect();
    assert_eq!(shown, [("base".to_string(), 1, 1), ("other".to_string(), 1, 1)]);
    // 1 running + 2 waiting of 4: the last slot goes to a create of a third template...
    let third = m.create(&b, of("third")).await.expect("the last slot");
    assert_eq!(env.backend.live(), 4);
    // ...and at the limit a create stops a waiting sandbox for its own, never a fifth VM
    // (its template not built yet is prepared first: a made-up name would end there,
    // with its error, stopping nothing).
    let fourth = m.create(&b, of("fourth")).await.expect("room made by a pool");
    assert_eq!((env.backend.live(), m.pooled_count()), (4, 1));
    env.settled().await;
    for id in [&third.id, &fourth.id] {
        m.kill(&b, id).await.expect("kill");
    }
    env.settled().await;

    // Short of memory: a create of a template without a pool stops a waiting sandbox
    // first, and the upkeep stops the rest and fills none.
    assert!(until(SETTLE, || m.pooled_count() == 2).await, "the pools did not refill after the kill");
    env.settled().await;
    m.prepare("fifth").await.expect("prepare");
    FREE_MIB.store(512, std::sync::atomic::Ordering::SeqCst);
    let fifth = m.create(&a, of("fifth")).await.expect("created while short of memory");
    assert_eq!(m.pooled_count(), 1, "the create did not make room");
    m.tend_pools().await;
    assert_eq!(m.pooled_count(), 0, "the upkeep kept sandboxes waiting while the host is short of memory");
    env.settled().await;
    assert_eq!(env.backend.live(), 2, "the pools refilled while the host is short of memory");
    FREE_MIB.store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
    for (key, id) in [(&a, &other.id), (&a, &fifth.id)] {
        m.kill(key, id).await.expect("kill");
    }
    env.settled().await;
    env.kill_all().await;
}

/// Demand that fell out of its window shrinks its pool; the default template keeps one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_nobody_asks_for_any_more_goes() {
    let mut config = by_demand(4, || None);
    if let Some(d) = &mut config.pool.demand {
        // Every create is out of the window by the time the upkeep looks.
        d.window = Duration::ZERO;
    }
    let env = Env::new(config).await;
    let key = env.key().to_string();
    let m = &env.manager;
    let used = m.create(&key, of("other")).await.expect("create");
    m.kill(&key, &used.id).await.expect("kill");
    assert!(until(SETTLE, || m.pool_size("base") == 1 && m.pool_size("other") == 1).await, "the pools did not fill");
    env.settled().await;
    m.tend_pools().await;
    env.settled().await;
    assert_eq!((m.pool_size("other"), m.pool_size("base")), (0, 1), "{:?}", m.pools(&key));
    env.kill_all().await;
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

/// A pool's sandboxes start and warm up in the background (they give way on a busy
/// CPU), and the one a create takes comes to the foreground before its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_sandboxes_warm_up_in_the_background_and_come_forward_when_taken() {
    use hutch_vmm::CpuShare::{Background, Foreground};
    let env = Env::new(config(3, 1)).await;
    let key = env.key().to_string();
    assert!(until(SETTLE, || env.manager.pool_size("base") == 1).await, "the pool did not fill");
    env.settled().await;
    let shares = || env.backend.cpu_shares.lock().clone();
    assert_eq!(shares().values().copied().collect::<Vec<_>>(), [Background], "the pooled VM was not put in the background");
    let taken = env.manager.create(&key, base()).await.expect("from the pool");
    assert!(until(SETTLE, || env.manager.pool_size("base") == 1).await, "the pool did not refill");
    env.settled().await;
    let mut seen: Vec<_> = shares().values().copied().collect();
    seen.sort_by_key(|s| *s == Background);
    assert_eq!(seen, [Foreground, Background], "the taken VM in front, its replacement behind");
    env.manager.kill(&key, &taken.id).await.expect("kill");
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

/// A create that finds the server full while a pool VM is being started waits for it
/// and takes its place, rather than being refused because of the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_at_the_limit_waits_for_a_starting_pool_vm_instead_of_failing() {
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = Arc::new(Mutex::new(released));
    // The pool's first fill prepares `base` and stays there until the test lets it go.
    let building: Arc<dyn Fn(&str) + Send + Sync> = Arc::new(move |template: &str| {
        if template == "base" {
            let _ = released.lock().recv();
        }
    });
    let env = Env::building(config(2, 1), building).await;
    let [a, b] = env.keys.clone();
    let m = &env.manager;
    assert!(until(SETTLE, || m.pools.lock().starting == 1).await, "the pool's fill did not start");
    m.create(&a, of("other")).await.expect("the free slot");
    let waiting = env.spawn(move |m, _| async move { m.create(&b, of("other")).await });
    // Both slots are held (one sandbox, one pool VM starting): the create waits.
    assert!(until(SETTLE, || m.in_flight.load(std::sync::atomic::Ordering::SeqCst) == 1).await);
    assert!(!waiting.is_finished(), "a create at the limit did not wait for the pool VM");
    release.send(()).expect("release the fill");
    let row = waiting.await.expect("task").expect("the create took the pool VM's place");
    assert_eq!(row.template, "other");
    assert_eq!((env.backend.live(), m.pooled_count()), (2, 0));
    env.settled().await;
    env.kill_all().await;
}

/// A resume at the server's limit makes room as a create does: a waiting sandbox stops
/// before the resumed VM starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_at_the_limit_stops_a_waiting_sandbox() {
    let env = Env::new(by_demand(2, || None)).await;
    let key = env.key().to_string();
    let m = &env.manager;
    assert!(until(SETTLE, || m.pool_size("base") == 1).await, "the default pool did not fill");
    let paused = m.create(&key, base()).await.expect("from the pool").id;
    m.pause(&key, &paused, PauseMode::Full).await.expect("pause");
    assert!(until(SETTLE, || m.pool_size("base") == 1).await, "the pool did not refill into the freed slot");
    m.prepare("other").await.expect("prepare");
    m.create(&key, of("other")).await.expect("the last slot");
    env.settled().await;
    assert_eq!((env.backend.live(), m.pooled_count()), (2, 1), "one running, one waiting: at the limit");
    m.connect(&key, &paused, None, OnResume::Restore).await.expect("a resume at the limit");
    assert_eq!((env.backend.live(), m.pooled_count()), (2, 0), "the waiting sandbox made room, never a third VM");
    env.settled().await;
    env.kill_all().await;
}
