//! User metadata on files, as envd keeps it: `user.e2b.<key>` extended attributes, set
//! from an upload's `X-Metadata-<key>` headers (keys lowercased) and read back into
//! every entry. Kept in the file itself, so it follows the file through renames and
//! shows metadata set inside the sandbox with `setfattr -n user.e2b.k -v v`.

use std::collections::BTreeMap;
use std::path::Path;

pub const PREFIX: &str = "user.e2b.";
/// Linux caps an xattr name (prefix included) at 255 bytes.
const MAX_KEY: usize = 255 - PREFIX.len();
/// ext4 keeps a file's xattrs in one 4 KiB block (envd's same budget).
const MAX_TOTAL: usize = 4096;
const HEADER_PREFIX: &str = "x-metadata-";

/// The metadata an upload's headers carry, validated as envd does.
pub fn from_headers(headers: &http::HeaderMap) -> Result<BTreeMap<String, String>, String> {
    let mut metadata = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(HEADER_PREFIX).filter(|k| !k.is_empty()) else { continue };
        let value = value.to_str().map_err(|_| format!("invalid metadata: the value for key {key:?} is not printable ASCII"))?;
        metadata.entry(key.to_ascii_lowercase()).or_insert_with(|| value.to_string());
    }
    validate(&metadata)?;
    Ok(metadata)
}

fn validate(metadata: &BTreeMap<String, String>) -> Result<(), String> {
    let printable = |s: &str| s.bytes().all(|b| (0x20..=0x7e).contains(&b));
    let mut total = 0;
    for (key, value) in metadata {
        if key.len() > MAX_KEY {
            return Err(format!("invalid metadata: key {key:?} exceeds {MAX_KEY} bytes"));
        }
        if !printable(key) || !printable(value) {
            return Err(format!("invalid metadata: key {key:?} or its value is not printable ASCII"));
        }
        total += PREFIX.len() + key.len() + value.len();
    }
    if total > MAX_TOTAL {
        return Err(format!("invalid metadata: {total} bytes in all, more than the {MAX_TOTAL} a file can hold"));
    }
    Ok(())
}

/// Replaces the file's metadata with `metadata` (keys absent from it are removed: an
/// overwrite keeps the old attributes otherwise).
pub fn replace(file: &std::fs::File, metadata: &BTreeMap<String, String>) -> std::io::Result<()> {
    use xattr::FileExt;
    for name in file.list_xattr()? {
        let Some(key) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else { continue };
        if !metadata.contains_key(key) {
            file.remove_xattr(&name)?;
        }
    }
    for (key, value) in metadata {
        file.set_xattr(format!("{PREFIX}{key}"), value.as_bytes())?;
    }
    Ok(())
}

/// The metadata of the file at `path` (through a symlink, as envd), empty when it has
/// none or its filesystem keeps no xattrs; entries that are not UTF-8 are skipped.
pub fn read(path: &Path) -> BTreeMap<String, String> {
    let Ok(names) = xattr::list(path) else { return BTreeMap::new() };
    collect(names, |name| xattr::get(path, name))
}

/// `read`, of a file already open (the one just written, whatever its path names now).
pub fn of_file(file: &std::fs::File) -> BTreeMap<String, String> {
    use xattr::FileExt;
    let Ok(names) = file.list_xattr() else { return BTreeMap::new() };
    collect(names, |name| file.get_xattr(name))
}

fn collect(names: xattr::XAttrs, get: impl Fn(&std::ffi::OsStr) -> std::io::Result<Option<Vec<u8>>>) -> BTreeMap<String, String> {
    names
        .filter_map(|name| {
            let key = name.to_str()?.strip_prefix(PREFIX)?.to_string();
            let value = String::from_utf8(get(&name).ok()??).ok()?;
            Some((key, value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_become_lowercased_keys_and_bad_ones_are_refused() {
        let mut h = http::HeaderMap::new();
        h.insert("X-Metadata-Author", "mish".parse().expect("value"));
        h.insert("x-metadata-", "ignored".parse().expect("value"));
        h.insert("content-type", "text/plain".parse().expect("value"));
        assert_eq!(from_headers(&h).expect("valid"), BTreeMap::from([("author".to_string(), "mish".to_string())]));
        h.insert("x-metadata-big", "x".repeat(5000).parse().expect("value"));
        assert!(from_headers(&h).expect_err("too big").contains("4096"));
    }

    #[test]
    fn a_replace_removes_what_it_does_not_name_and_reads_back() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("f");
        let file = std::fs::File::create(&path).expect("file");
        replace(&file, &BTreeMap::from([("a".into(), "1".into()), ("b".into(), "2".into())])).expect("set (the test's filesystem keeps user xattrs, as the guest's ext4 does)");
        assert_eq!(read(&path).len(), 2);
        replace(&file, &BTreeMap::from([("b".into(), "3".into())])).expect("replace");
        assert_eq!(read(&path), BTreeMap::from([("b".to_string(), "3".to_string())]));
    }
}
