//! The secrets store on a real SQLite file and key directory.

use super::*;

struct Env {
    _tmp: tempfile::TempDir,
    root: std::path::PathBuf,
    secrets: Secrets,
    keys: [String; 2],
}

async fn env() -> Env {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().to_path_buf();
    let store = Store::open_file(&root.join("hutch.db")).await.expect("store");
    let a = store.create_key("a").await.expect("key a").0.id;
    let b = store.create_key("b").await.expect("key b").0.id;
    Env { secrets: Secrets::new(&root, store), root, _tmp: tmp, keys: [a, b] }
}

fn meta(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[tokio::test]
async fn a_secret_lives_its_life_per_key_and_its_value_never_sits_in_the_database() {
    let e = env().await;
    let [a, b] = &e.keys;
    let made = e.secrets.create(a, " OpenAI ", "sk-live-123", meta(&[("team", "ml")])).await.expect("create");
    assert_eq!((made.name.as_str(), made.version, made.metadata.clone()), ("openai", 1, meta(&[("team", "ml")])));
    assert!(matches!(e.secrets.create(a, "openai", "x", BTreeMap::new()).await, Err(SecretError::NameTaken)));
    // Another key neither sees it nor is kept from the name.
    assert!(matches!(e.secrets.get(b, "openai").await, Err(SecretError::NotFound)));
    assert!(matches!(e.secrets.get(b, &made.id).await, Err(SecretError::NotFound)));
    assert!(matches!(e.secrets.update(b, &made.id, "stolen", None).await, Err(SecretError::NotFound)));
    assert!(matches!(e.secrets.delete(b, &made.id).await, Err(SecretError::NotFound)));
    e.secrets.create(b, "openai", "b's own", BTreeMap::new()).await.expect("b's openai");

    assert_eq!(e.secrets.get(a, &made.id).await.expect("by id"), made);
    assert_eq!(e.secrets.get(a, "OPENAI").await.expect("by name"), made);
    assert_eq!(&*e.secrets.value(a, "openai").await.expect("value"), "sk-live-123");

    // An update adds a version; metadata omitted stays, given replaces.
    let v2 = e.secrets.update(a, "openai", "sk-live-456", None).await.expect("update");
    assert_eq!((v2.version, v2.metadata.clone(), v2.created_at.clone()), (2, meta(&[("team", "ml")]), made.created_at.clone()));
    let v3 = e.secrets.update(a, &made.id, "sk-live-789", Some(BTreeMap::new())).await.expect("update");
    assert_eq!((v3.version, v3.metadata.len()), (3, 0));
    assert_eq!(&*e.secrets.value(a, &made.id).await.expect("value"), "sk-live-789");
    assert_eq!(&*e.secrets.value(b, "openai").await.expect("b's value"), "b's own");

    let db = std::fs::read(e.root.join("hutch.db")).expect("db");
    let wal = std::fs::read(e.root.join("hutch.db-wal")).unwrap_or_default();
    for stored in [&db, &wal] {
        for value in ["sk-live-123", "sk-live-456", "sk-live-789", "b's own"] {
            assert!(!stored.windows(value.len()).any(|w| w == value.as_bytes()), "{value} is in the database file");
        }
    }

    e.secrets.delete(a, "openai").await.expect("delete");
    assert!(matches!(e.secrets.get(a, &made.id).await, Err(SecretError::NotFound)));
    assert!(matches!(e.secrets.delete(a, "openai").await, Err(SecretError::NotFound)));
    assert_eq!(&*e.secrets.value(b, "openai").await.expect("b's value"), "b's own", "a's delete touched b's");
}

#[tokio::test]
async fn listing_pages_in_the_order_secrets_were_made() {
    let e = env().await;
    let a = &e.keys[0];
    let mut made = Vec::new();
    for i in 0..5 {
        made.push(e.secrets.create(a, &format!("s{i}"), "v", BTreeMap::new()).await.expect("create").id);
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = e.secrets.list(a, 2, after.as_deref()).await.expect("page");
        assert!(page.secrets.len() <= 2);
        seen.extend(page.secrets.iter().map(|s| s.id.clone()));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, made);
    assert!(e.secrets.list(&e.keys[1], 100, None).await.expect("b's").secrets.is_empty());
    for (limit, token) in [(0, None), (101, None), (10, Some("not-a-token"))] {
        assert!(matches!(e.secrets.list(a, limit, token).await, Err(SecretError::Invalid(_))), "limit {limit} token {token:?}");
    }
}

#[tokio::test]
async fn a_rotation_seals_every_value_again_and_retires_the_old_key() {
    let e = env().await;
    let [a, b] = &e.keys;
    e.secrets.create(a, "one", "first value", BTreeMap::new()).await.expect("one");
    e.secrets.create(b, "two", "second value", BTreeMap::new()).await.expect("two");
    let key_dir = e.root.join("secrets/keys");
    let old_key = std::fs::read(key_dir.join("1.key")).expect("first key");
    assert_eq!(e.secrets.rotate_key().await.expect("rotate"), 2);
    assert!(!key_dir.join("1.key").exists(), "the old key stayed");
    assert_ne!(std::fs::read(key_dir.join("2.key")).expect("new key"), old_key);
    assert_eq!(&*e.secrets.value(a, "one").await.expect("one"), "first value");
    assert_eq!(&*e.secrets.value(b, "two").await.expect("two"), "second value");
    // New values take the new key too.
    e.secrets.create(a, "three", "third value", BTreeMap::new()).await.expect("three");
    assert_eq!(e.secrets.rotate_key().await.expect("rotate again"), 3);
    assert_eq!(&*e.secrets.value(a, "three").await.expect("three"), "third value");
}

#[tokio::test]
async fn bad_requests_name_the_rule_and_never_the_value() {
    let e = env().await;
    let a = &e.keys[0];
    let value = "sk-do-not-echo";
    let cases = [
        e.secrets.create(a, "bad name!", value, BTreeMap::new()).await,
        e.secrets.create(a, "sec_lookslikeanid", value, BTreeMap::new()).await,
        e.secrets.create(a, "ok", "", BTreeMap::new()).await,
        e.secrets.create(a, "ok", &"x".repeat(rules::MAX_VALUE + 1), BTreeMap::new()).await,
        e.secrets.create(a, "ok", value, meta(&[("", value)])).await,
    ];
    for case in cases {
        let err = case.expect_err("a bad request passed");
        assert!(matches!(err, SecretError::Invalid(_)), "{err:?}");
        assert!(err.to_string().starts_with("Invalid secrets request: ") && !err.to_string().contains(value), "{err}");
    }
}

#[tokio::test]
async fn a_missing_or_foreign_key_directory_is_refused_not_replaced() {
    let e = env().await;
    let a = &e.keys[0];
    e.secrets.create(a, "kept", "kept value", BTreeMap::new()).await.expect("create");
    let keys = e.root.join("secrets/keys");
    let saved = e.root.join("keys-backup");
    std::fs::rename(&keys, &saved).expect("move the keys away");
    for attempt in [e.secrets.create(a, "new", "v", BTreeMap::new()).await.map(|_| ()), e.secrets.value(a, "kept").await.map(|_| ())] {
        let err = attempt.expect_err("worked without the key");
        assert!(matches!(err, SecretError::Keys(KeyringError::NoKeys(_))), "{err:?}");
    }
    assert!(!keys.join("1.key").exists(), "a new first key was made over sealed values");
    assert!(matches!(e.secrets.rotate_key().await, Err(SecretError::Keys(KeyringError::NoKeys(_)))));

    // Another home's key under the same generation number.
    let other = env().await;
    other.secrets.create(&other.keys[0], "theirs", "v", BTreeMap::new()).await.expect("their key");
    std::fs::remove_dir_all(&keys).ok();
    copy_dir(&other.root.join("secrets/keys"), &keys);
    let err = e.secrets.value(a, "kept").await.expect_err("opened with another home's key");
    assert!(matches!(err, SecretError::Keys(KeyringError::Mismatch(1))), "{err:?}");

    std::fs::remove_dir_all(&keys).expect("remove");
    std::fs::rename(&saved, &keys).expect("restore the keys");
    assert_eq!(&*e.secrets.value(a, "kept").await.expect("value"), "kept value");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("dir");
    for entry in std::fs::read_dir(from).expect("read").flatten() {
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

#[tokio::test]
async fn concurrent_updates_each_count_a_version() {
    let e = env().await;
    let a = e.keys[0].clone();
    e.secrets.create(&a, "busy", "v0", BTreeMap::new()).await.expect("create");
    let updates: Vec<_> = (0..8)
        .map(|i| {
            let (secrets, a) = (e.secrets.clone(), a.clone());
            tokio::spawn(async move { secrets.update(&a, "busy", &format!("v{}", i + 1), None).await })
        })
        .collect();
    for u in updates {
        u.await.expect("task").expect("an update failed under contention");
    }
    assert_eq!(e.secrets.get(&a, "busy").await.expect("get").version, 9);
    assert!(e.secrets.value(&a, "busy").await.expect("value").starts_with('v'));
}
