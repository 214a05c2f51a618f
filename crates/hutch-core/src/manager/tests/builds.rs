//! Template builds run once per template, off the caller's path: a create waiting for
//! one template's multi-minute build holds back no create of another.

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_build_holds_back_no_other_template_and_runs_once() {
    let builds = Arc::new(AtomicUsize::new(0));
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = Arc::new(Mutex::new(released));
    let building: Arc<dyn Fn(&str) + Send + Sync> = {
        let builds = builds.clone();
        Arc::new(move |template: &str| {
            if template == "slow" {
                builds.fetch_add(1, Ordering::SeqCst);
                // A long build: until the test lets it end.
                let _ = lock(&released).recv();
            }
        })
    };
    let env = Env::building(ManagerConfig::default(), building).await;
    let key = env.key().to_string();
    let slow = || env.spawn(|m, key| async move { m.create(&key, CreateSpec { template: "slow".into(), ..CreateSpec::default() }).await });
    let first = slow();
    assert!(until(SETTLE, || builds.load(Ordering::SeqCst) == 1).await, "the build did not start");
    let second = slow();

    let other = tokio::time::timeout(SETTLE, env.manager.create(&key, base())).await;
    assert!(matches!(other, Ok(Ok(_))), "a create of another template waited for the build: {other:?}");

    release.send(()).expect("release the build");
    for waiting in [first, second] {
        let row = waiting.await.expect("task").expect("a create of the built template");
        assert_eq!(row.template, "slow");
    }
    assert_eq!(builds.load(Ordering::SeqCst), 1, "two creates waiting for one template share its build");
    env.kill_all().await;
}
