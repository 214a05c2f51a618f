//! Dockerfiles are a user's text, run through hutch's planner (flag checks, variable
//! expansion, `.dockerignore`, COPY sources): it never panics, and no COPY takes a byte
//! from outside the build context (a file beside it, reachable by `..` or a symlink in
//! the context, never lands in a step's files).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;
use std::io::Read;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let base = std::fs::canonicalize(dir.path()).expect("canonical");
    let (context, scratch) = (base.join("ctx"), base.join("scratch"));
    std::fs::create_dir_all(context.join("d")).expect("context");
    std::fs::create_dir_all(&scratch).expect("scratch");
    std::fs::write(context.join("a"), b"in-context").expect("a");
    std::fs::write(context.join("d/b"), b"in-context too").expect("b");
    std::fs::write(base.join("outside"), b"SECRET-OUTSIDE").expect("outside");
    std::os::unix::fs::symlink("../outside", context.join("link")).expect("link");
    let args = BTreeMap::from([("WHO".to_string(), "fuzz".to_string())]);
    let _ = hutch_formats::dockerfile::plan(text, "Dockerfile", &context, &args, &scratch);
    for entry in std::fs::read_dir(&scratch).into_iter().flatten().flatten() {
        let mut bytes = Vec::new();
        if std::fs::File::open(entry.path()).and_then(|mut f| f.read_to_end(&mut bytes)).is_ok() {
            assert!(!bytes.windows(14).any(|w| w == b"SECRET-OUTSIDE"), "a COPY took the file outside the context: {text:?}");
        }
    }
});
