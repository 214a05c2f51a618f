//! What the CLI's test targets share: a test home whose artifacts come from the shared
//! cache (tests/conftest.py's `link_shared_artifacts` for the Python tests).

use std::path::{Path, PathBuf};

/// The cache `hutch setup` filled: `$HUTCH_HOME`, else hutch's default.
fn shared_home() -> PathBuf {
    std::env::var_os("HUTCH_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".local/share/hutch"))
}

/// Links kernel, initramfs, templates and template snapshots of `home` to the shared
/// cache, and the host facts a template snapshot's name is made of (the TSC rate,
/// QEMU's version): a home that measured them itself could name the shared snapshot
/// differently, make its own and prune the other while a test beside it restores from it.
pub fn link_shared_artifacts(home: &Path) {
    let shared = shared_home();
    std::fs::create_dir_all(home.join("snapshots")).expect("snapshots dir");
    for sub in ["kernel", "initramfs", "templates", "snapshots/templates"] {
        std::fs::create_dir_all(shared.join(sub)).expect("shared dir");
        std::os::unix::fs::symlink(shared.join(sub), home.join(sub)).expect("link");
    }
    for fact in ["host-tsc", "qemu-version"] {
        std::os::unix::fs::symlink(shared.join(fact), home.join(fact)).expect("link");
    }
}
