//! Tests across a template's builds, where the files meet: builds stored and found by
//! tag (`template_store.rs`, `tags.rs`, `rootfs.rs`), and pruned (`prune.rs`). Here, so
//! that none of those files needs another above it for its own tests.

use crate::prune::prune_builds;
use crate::record::{self, Kind};
use crate::rootfs::cached;
use crate::tags::*;
use crate::template::{Template, IMAGE};
use crate::template_store::install;
use crate::test_support::{built, manifest};
use crate::HutchHome;
use std::path::PathBuf;

#[test]
fn a_rebuild_is_a_new_image_and_the_old_one_goes_only_when_nothing_stacks_on_it() {
    let root = tempfile::tempdir().expect("tempdir");
    let home = HutchHome::at(root.path());
    let first = install(&home, &built(&home, b"first build"), manifest("t")).expect("install");
    let second = install(&home, &built(&home, b"second build"), manifest("t")).expect("install");
    // Each build is its own content-addressed file; the first was not replaced.
    assert_ne!(first.build_id, second.build_id);
    assert_ne!(first.image(), second.image());
    assert_eq!(std::fs::read(first.image()).expect("first"), b"first build");
    assert_eq!(cached(&home, "t").expect("cached").expect("current").image(), second.image());
    // The same bytes again: the same build, kept.
    let again = install(&home, &built(&home, b"second build"), manifest("t")).expect("install");
    assert_eq!(again.image(), second.image());
    // A build from before builds were kept apart, at the template's top.
    std::fs::write(home.template("t").join(IMAGE), b"legacy").expect("legacy");
    let referenced: std::collections::HashSet<PathBuf> = [first.image()].into();
    assert_eq!(prune_builds(&home, &referenced), vec![home.template("t").join(IMAGE)]);
    assert!(first.image().is_file(), "a build an overlay stacks on was pruned");
    assert!(prune_builds(&home, &Default::default()).contains(&first.image()));
    assert!(!first.image().exists() && second.image().is_file(), "the current build must stay");
}

fn store(home: &HutchHome, bytes: &[u8], id: &str, tags: &[&str]) -> Template {
    std::fs::create_dir_all(home.tmp()).expect("tmp");
    let path = home.tmp().join("rootfs.ext4");
    std::fs::write(&path, bytes).expect("image");
    let mut t = crate::from_image::image_template("app", crate::template::ImageSource { reference: format!("r/{id}"), manifest_digest: String::new(), defaults: Default::default() });
    t.api_build = Some(format!("uuid-{id}"));
    let tags: Vec<String> = tags.iter().map(|t| t.to_string()).collect();
    install_tagged(home, &path, t, id, &tags).expect("store")
}

fn tags_of(home: &HutchHome) -> Vec<(String, String)> {
    list(home, "app").expect("list").into_iter().map(|(t, e)| (t, e.build)).collect()
}

#[test]
fn a_tag_names_one_build_and_keeps_it_from_pruning() {
    let root = tempfile::tempdir().expect("tempdir");
    let home = HutchHome::at(root.path());
    let one = store(&home, b"one", "b1", &[DEFAULT, "v1"]);
    let two = store(&home, b"two", "b2", &["v2"]);
    // No tag, or `default`: the current build; a tag: its own build, with its manifest.
    assert_eq!(crate::rootfs::cached(&home, "app").expect("cached").expect("built").build_id, "b1");
    assert_eq!(crate::rootfs::cached(&home, "app:default").expect("cached").expect("built").build_id, "b1");
    let v2 = crate::rootfs::cached(&home, "app:v2").expect("cached").expect("built");
    assert_eq!((v2.build_id.as_str(), v2.image(), v2.tag.as_deref(), v2.api_build.as_deref()), ("b2", two.image(), Some("v2"), Some("uuid-b2")));
    assert_eq!(tags_of(&home), [("default".into(), "b1".into()), ("v1".into(), "b1".into()), ("v2".into(), "b2".into())]);
    let unknown = crate::rootfs::cached(&home, "app:v3").expect_err("no v3").to_string();
    assert!(unknown.contains("has no tag 'v3'") && unknown.contains("default, v1, v2"), "{unknown}");
    // A build only a tag names is not pruned; untagged, it is.
    assert!(crate::prune::prune_builds(&home, &Default::default()).is_empty());
    // `default` moves: the template's current build is now b2.
    assert_eq!(assign(&home, "app", Some("v2"), &[DEFAULT.into()]).expect("assign default").build_id, "b2");
    assert_eq!(crate::rootfs::cached(&home, "app").expect("cached").expect("built").build_id, "b2");
    assert!(matches!(remove(&home, "app", &[DEFAULT.into()]), Err(TagError::DefaultKept)));
    assert!(matches!(remove(&home, "app", &["v1".into(), "nope".into()]), Err(TagError::UnknownTag { .. })));
    assert_eq!(tags_of(&home).len(), 3, "a failed removal removes nothing");
    remove(&home, "app", &["v1".into()]).expect("remove v1");
    assert_eq!(crate::prune::prune_builds(&home, &Default::default()), vec![one.image()]);
    assert!(two.image().is_file());
    assert_eq!(tags_of(&home), [("default".into(), "b2".into()), ("v2".into(), "b2".into())]);
}

/// Each assignment is remembered, oldest first; tags removed since and builds gone
/// are not listed, and tags from before the history have their current one.
#[test]
fn tag_assignments_are_kept_as_a_history() {
    let root = tempfile::tempdir().expect("tempdir");
    let home = HutchHome::at(root.path());
    store(&home, b"one", "b1", &[DEFAULT, "v1"]);
    store(&home, b"two", "b2", &["v2", "gone"]);
    assign(&home, "app", Some("v2"), &[DEFAULT.into()]).expect("assign default");
    remove(&home, "app", &["gone".into()]).expect("remove");
    let current = crate::rootfs::cached(&home, "app").expect("cached").expect("built");
    let seen = |h: Vec<Assignment>| h.into_iter().map(|a| (a.tag, a.build)).collect::<Vec<_>>();
    let pairs = |v: &[(&str, &str)]| v.iter().map(|(t, b)| (t.to_string(), b.to_string())).collect::<Vec<_>>();
    assert_eq!(seen(history_of(&home, &current).expect("history")), pairs(&[("default", "b1"), ("v1", "b1"), ("v2", "b2"), ("default", "b2")]));
    // Without the history file (a template tagged before it existed), each tag's
    // current assignment.
    std::fs::remove_file(home.template("app").join(HISTORY)).expect("rm");
    let mut legacy = seen(history_of(&home, &current).expect("history"));
    legacy.sort();
    assert_eq!(legacy, pairs(&[("default", "b2"), ("v1", "b1"), ("v2", "b2")]));
}

/// A template from before builds were kept apart (its image at the top, no manifest
/// per build): tagging its build keeps those bytes after the default moves on.
#[test]
fn a_build_from_the_oldest_layout_can_be_tagged_and_outlives_a_new_default() {
    let root = tempfile::tempdir().expect("tempdir");
    let home = HutchHome::at(root.path());
    let dir = home.template("app");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("rootfs.ext4"), b"legacy").expect("image");
    let mut legacy = crate::from_image::image_template("app", crate::template::ImageSource { reference: "r/old".into(), manifest_digest: String::new(), defaults: Default::default() });
    legacy.build_id = "old1".into();
    record::write(&dir.join("template.json"), Kind::Template, &legacy).expect("manifest");

    assert_eq!(assign(&home, "app", None, &["old".into()]).expect("tag").build_id, "old1");
    store(&home, b"new", "b2", &[DEFAULT]);
    assert_eq!(crate::prune::prune_builds(&home, &Default::default()), vec![dir.join("rootfs.ext4")]);
    let old = crate::rootfs::cached(&home, "app:old").expect("cached").expect("built");
    assert_eq!(std::fs::read(old.image()).expect("the tagged build's bytes"), b"legacy");
}
