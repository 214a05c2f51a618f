//! An image layer from a registry, applied to a template's tree on the host (as root):
//! whatever the bytes, applying them never panics, never writes outside the tree (a
//! sentinel beside it stays as it was, and nothing appears next to it), and stops at
//! its byte budget.
#![no_main]
use libfuzzer_sys::fuzz_target;

const BUDGET: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = std::fs::canonicalize(dir.path()).expect("canonical");
    let root = base.join("root");
    std::fs::create_dir(&root).expect("root");
    std::fs::write(base.join("sentinel"), b"untouched").expect("sentinel");
    let mut budget = BUDGET;
    let _ = hutch_oci::unpack::apply_layer(&root, data, "fuzz", &mut budget);
    let beside: Vec<_> = std::fs::read_dir(&base).expect("base").flatten().map(|e| e.file_name()).collect();
    assert_eq!(beside.len(), 2, "the layer wrote beside the tree: {beside:?}");
    assert_eq!(std::fs::read(base.join("sentinel")).expect("sentinel"), b"untouched");
    assert!(std::fs::symlink_metadata(&root).is_ok_and(|m| m.is_dir()), "the tree's root was replaced");
    // File contents count against the budget, each file once (hard links share one).
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let written: u64 = walk(&root)
        .iter()
        .filter_map(|p| std::fs::symlink_metadata(p).ok())
        .filter(|m| m.is_file() && seen.insert((m.dev(), m.ino())))
        .map(|m| m.len().min(m.blocks() * 512))
        .sum();
    assert!(written <= BUDGET, "{written} bytes written past a budget of {BUDGET}");
});

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&path));
        }
        out.push(path);
    }
    out
}
