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
                let _ = released.lock().recv();
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

/// Only the key that built a template sees and changes its tags; names and tags are
/// checked before anything is read.
#[tokio::test]
async fn template_tags_are_the_building_keys_alone() {
    let env = Env::new(ManagerConfig::default()).await;
    let (a, b) = (env.keys[0].clone(), env.keys[1].clone());
    let m = &env.manager;
    let home = m.home().clone();
    for (id, bytes, tag) in [("b1", &b"one"[..], "default"), ("b2", &b"two"[..], "v2")] {
        std::fs::create_dir_all(home.tmp()).expect("tmp");
        let raw = home.tmp().join("raw.ext4");
        std::fs::write(&raw, bytes).expect("image");
        let source = hutch_image::template::ImageSource { reference: "r".into(), manifest_digest: String::new(), defaults: Default::default() };
        hutch_image::tags::install_tagged(&home, &raw, hutch_image::from_image::image_template("app", source), id, &[tag.into()]).expect("store");
    }
    std::fs::write(home.template("app").join("owner"), &a).expect("owner");

    let tags = |key: &str| m.template_tags(key, "app").map(|t| t.into_iter().map(|t| t.tag).collect::<Vec<_>>());
    assert!(matches!(tags(&b), Err(ManagerError::Forbidden(_))), "{:?}", tags(&b));
    assert!(matches!(m.assign_template_tags(&b, "app:v2", &["x".into()]), Err(ManagerError::Forbidden(_))));
    assert!(matches!(m.remove_template_tags(&b, "app", &["v2".into()]), Err(ManagerError::Forbidden(_))));
    // Built-in templates' tags are hutch's.
    assert!(matches!(m.assign_template_tags(&a, "base", &["x".into()]), Err(ManagerError::Forbidden(_))));

    let (build, assigned) = m.assign_template_tags(&a, "app:v2", &[" Prod ".into(), "prod".into()]).expect("assign");
    assert_eq!(assigned, ["prod"]);
    let b2 = hutch_image::tags::build_manifest(&home, "app", "b2").expect("b2");
    assert_eq!(build, crate::manager::build_ids::build_uuid(&b2));
    assert_eq!(tags(&a).expect("tags"), ["default", "prod", "v2"]);

    for bad in [m.assign_template_tags(&a, "app", &["not ok".into()]), m.assign_template_tags(&a, "app", &[])] {
        assert!(matches!(bad, Err(ManagerError::InvalidArgument(_))), "{bad:?}");
    }
    assert!(matches!(m.remove_template_tags(&a, "app:v2", &["prod".into()]), Err(ManagerError::InvalidArgument(_))));
    assert!(matches!(m.remove_template_tags(&a, "app", &["nope".into()]), Err(ManagerError::Missing(_))));
    assert!(matches!(m.template_tags(&a, "../app"), Err(ManagerError::Missing(_))));
    assert!(matches!(m.template_tags(&a, "app:v2"), Err(ManagerError::InvalidArgument(_))));
    // A tag is found in any case, as E2B lowercases tags.
    assert_eq!(m.assign_template_tags(&a, "app:V2", &["stable".into()]).expect("assign").0, build);
    m.remove_template_tags(&a, "app", &["prod".into()]).expect("remove");
    assert_eq!(tags(&a).expect("tags"), ["default", "stable", "v2"]);
    assert!(matches!(m.template_alias(&a, "app:nope"), Err(ManagerError::Missing(_))));
    assert!(matches!(m.template_alias(&a, "app:v2"), Ok(false)));
}

/// A template whose builds all failed is deleted as E2B deletes it: its claim goes (and
/// only its own key's); a built one is left to the whole removal.
#[tokio::test]
async fn a_claim_no_build_finished_is_released_by_its_own_key_only() {
    let env = Env::new(ManagerConfig::default()).await;
    let (a, b) = (env.keys[0].clone(), env.keys[1].clone());
    let m = &env.manager;
    let (name, _build, _) = m.new_template_build(&a, "failed", &[], hutch_image::template::Shape::default()).expect("claim");
    let dir = m.home().template(&name);
    assert!(dir.join("owner").is_file());
    assert!(!m.release_unbuilt_template(&b, &name).expect("another key"), "another key's claim is not released");
    assert!(dir.is_dir());
    assert!(!m.release_unbuilt_template(&a, "../templates/failed").expect("a bad name"));
    assert!(m.release_unbuilt_template(&a, &name).expect("released"));
    assert!(!dir.exists(), "the claim's directory is gone");
    assert!(matches!(m.template_alias(&a, &name), Err(ManagerError::Missing(_))));
    // A built template is not a claim: the whole removal takes it.
    std::fs::create_dir_all(m.home().template("built")).expect("dir");
    std::fs::write(m.home().template("built").join("owner"), &a).expect("owner");
    std::fs::write(m.home().template("built").join("template.json"), "{}").expect("record");
    assert!(!m.release_unbuilt_template(&a, "built").expect("built"));
    assert!(m.home().template("built").join("template.json").is_file());
}
