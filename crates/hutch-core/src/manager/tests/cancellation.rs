//! A caller that goes away (a client hanging up drops its handler's future) at any
//! step where an operation waits on the VM: the operation still runs to its end, and
//! everything settles as if the caller had stayed.

use super::*;
use futures::future::BoxFuture;
use hutch_vmm::fake::Step;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Create,
    Pause,
    Resume,
    Snapshot,
    Fork,
    Kill,
}

/// Every step each operation waits at on its way.
const STEPS: [(Op, &[Step]); 6] = [
    (Op::Create, &[Step::Start, Step::Load, Step::Resume]),
    (Op::Pause, &[Step::Save, Step::Stop]),
    (Op::Resume, &[Step::Start, Step::Load, Step::Resume]),
    // The save, the sandbox running on, then the snapshot's memory made shareable.
    (Op::Snapshot, &[Step::Save, Step::Resume, Step::Start, Step::Load]),
    (Op::Fork, &[Step::Save, Step::Resume, Step::Start, Step::Load]),
    (Op::Kill, &[Step::Stop]),
];

fn call<'a>(env: &'a Env, op: Op, id: &'a str) -> BoxFuture<'a, Result<(), ManagerError>> {
    let (m, key) = (&env.manager, env.key());
    Box::pin(async move {
        match op {
            Op::Create => m.create(key, base()).await.map(drop),
            Op::Pause => m.pause(key, id, PauseMode::Full).await,
            Op::Resume => m.connect(key, id, None, OnResume::Restore).await.map(drop),
            Op::Snapshot => m.create_snapshot(key, id, Some("left".into()), true).await.map(drop),
            Op::Fork => m.fork(key, id, 1, None).await.map(drop),
            Op::Kill => m.kill(key, id).await,
        }
    })
}

/// Runs `op` until it waits at `step`, drops its caller there, lets it go on, and
/// checks it finished all the same.
async fn leave_at(op: Op, step: Step) {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key().to_string();
    let id = env.create().await.id;
    env.put(&id, "x", "1").await;
    if op == Op::Resume {
        env.manager.pause(&key, &id, PauseMode::Full).await.expect("pause");
    }
    let hold = env.backend.hold(step);
    {
        let caller = call(&env, op, &id);
        tokio::pin!(caller);
        tokio::select! {
            () = hold.reached() => {}
            done = &mut caller => panic!("{op:?} ended ({done:?}) without waiting at {step:?}"),
            () = tokio::time::sleep(SETTLE) => panic!("{op:?} did not reach {step:?} within {SETTLE:?}"),
        }
        // The caller leaves here.
    }
    hold.release();
    env.settled().await;
    let listed = env.manager.list(&key, &ListFilter::default());
    let running: Vec<&SandboxRow> = listed.iter().filter(|r| r.state == "running").collect();
    let context = format!("{op:?} left at {step:?}");
    match op {
        Op::Create => assert_eq!(running.len(), 2, "{context}: the sandbox being created is running"),
        Op::Pause => assert_eq!(env.state(&id), SandboxState::Paused, "{context}"),
        Op::Resume | Op::Snapshot => {
            assert_eq!(env.state(&id), SandboxState::Running, "{context}");
            assert_eq!(env.values(&id).await["x"], "1", "{context}");
        }
        Op::Fork => {
            assert_eq!(running.len(), 2, "{context}: the fork is running");
            for row in running {
                assert_eq!(env.values(&row.id).await["x"], "1", "{context}: {} has the source's memory", row.id);
            }
        }
        Op::Kill => assert!(listed.is_empty(), "{context}: {listed:?}"),
    }
    if op == Op::Snapshot {
        let stored = env.manager.list_snapshots(&key).await.expect("list");
        assert_eq!(stored.len(), 1, "{context}: the snapshot is stored");
        let from = env.manager.create(&key, CreateSpec { template: "left".into(), ..CreateSpec::default() }).await.expect("create from it");
        assert_eq!(env.values(&from.id).await["x"], "1", "{context}");
    }
    env.kill_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_finishes_when_its_caller_leaves_at_any_step() {
    for (op, steps) in STEPS {
        for step in steps {
            leave_at(op, *step).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_asked_during_a_pause_runs_after_it() {
    let env = Env::new(ManagerConfig::default()).await;
    let key = env.key().to_string();
    let id = env.create().await.id;
    let hold = env.backend.hold(Step::Save);
    let pause = env.spawn(|m, key| {
        let id = id.clone();
        async move { m.pause(&key, &id, PauseMode::Full).await }
    });
    hold.reached().await;
    assert_eq!(env.state(&id), SandboxState::Pausing);
    assert!(matches!(env.manager.agent(&id), Err(ManagerError::Paused(_))), "no new data-plane calls while it saves");
    let kill = env.spawn(|m, key| {
        let id = id.clone();
        async move { m.kill(&key, &id).await }
    });
    hold.release();
    pause.await.expect("task").expect("the pause ends first");
    kill.await.expect("task").expect("then the kill");
    env.settled().await;
    assert!(env.manager.list(&key, &ListFilter::default()).is_empty());
    env.kill_all().await;
}
