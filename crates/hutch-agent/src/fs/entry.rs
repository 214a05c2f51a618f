//! `EntryInfo` from file metadata.

use hutch_proto::filesystem::{EntryInfo, FileType};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

pub fn entry_info(path: &Path) -> std::io::Result<EntryInfo> {
    let meta = std::fs::symlink_metadata(path)?;
    let is_link = meta.file_type().is_symlink();
    // A symlink is described as envd does: the type and mode of what it resolves to,
    // and that absolute path as its target (itself when it resolves to nothing).
    let (file_type, symlink_target, mode) = if is_link {
        let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let (kind, mode) = match std::fs::metadata(&target) {
            Ok(t) => (kind_of(&t), t.permissions().mode() & 0o7777),
            Err(_) => (FileType::Unspecified, 0),
        };
        (kind, Some(target.display().to_string()), mode)
    } else {
        (kind_of(&meta), None, meta.permissions().mode() & 0o7777)
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "/".into());
    let modified = meta.modified().ok().map(|t| humantime::format_rfc3339_nanos(t).to_string());
    Ok(EntryInfo {
        name,
        file_type,
        path: path.display().to_string(),
        size: meta.len() as i64,
        mode,
        permissions: permissions_string(meta.permissions().mode(), if is_link { None } else { Some(file_type) }),
        owner: user_name(meta.uid()),
        group: group_name(meta.gid()),
        modified_time: modified,
        symlink_target,
        metadata: super::metadata::read(path),
    })
}

fn kind_of(meta: &std::fs::Metadata) -> FileType {
    if meta.is_dir() {
        FileType::Directory
    } else if meta.is_file() {
        FileType::File
    } else {
        FileType::Unspecified
    }
}

/// Go's `FileMode.String()`, as envd reports it: `L` for a symlink (`None`).
fn permissions_string(mode: u32, file_type: Option<FileType>) -> String {
    let kind = match file_type {
        Some(FileType::Directory) => 'd',
        None => 'L',
        _ => '-',
    };
    let mut s = String::with_capacity(10);
    s.push(kind);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn lookup_name(file: &str, id: u32) -> String {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                let mut f = l.split(':');
                let name = f.next()?;
                let _ = f.next();
                (f.next()?.parse::<u32>().ok()? == id).then(|| name.to_string())
            })
        })
        .unwrap_or_else(|| id.to_string())
}

fn user_name(uid: u32) -> String {
    lookup_name("/etc/passwd", uid)
}

fn group_name(gid: u32) -> String {
    lookup_name("/etc/group", gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_strings() {
        assert_eq!(permissions_string(0o755, Some(FileType::Directory)), "drwxr-xr-x");
        assert_eq!(permissions_string(0o640, Some(FileType::File)), "-rw-r-----");
        assert_eq!(permissions_string(0o777, None), "Lrwxrwxrwx");
    }

    #[test]
    fn a_symlink_is_described_by_what_it_resolves_to() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(tmp.path()).expect("canonical");
        std::fs::write(root.join("file.txt"), "x").expect("file");
        std::os::unix::fs::symlink("file.txt", root.join("link")).expect("link");
        std::os::unix::fs::symlink("missing", root.join("dangling")).expect("dangling");
        let link = entry_info(&root.join("link")).expect("entry");
        assert_eq!(link.file_type, FileType::File);
        assert_eq!(link.symlink_target.as_deref(), Some(root.join("file.txt").to_str().expect("utf8")));
        assert!(link.permissions.starts_with('L'), "{}", link.permissions);
        let dangling = entry_info(&root.join("dangling")).expect("entry");
        assert_eq!(dangling.file_type, FileType::Unspecified);
        assert_eq!(dangling.symlink_target.as_deref(), Some(root.join("dangling").to_str().expect("utf8")));
    }
}
