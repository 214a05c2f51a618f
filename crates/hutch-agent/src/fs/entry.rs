//! `EntryInfo` from file metadata.

use hutch_proto::filesystem::{EntryInfo, FileType};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

pub fn entry_info(path: &Path) -> std::io::Result<EntryInfo> {
    let meta = std::fs::symlink_metadata(path)?;
    let (file_type, symlink_target) = if meta.file_type().is_symlink() {
        let target = std::fs::read_link(path).ok().map(|t| t.display().to_string());
        (FileType::Symlink, target)
    } else if meta.is_dir() {
        (FileType::Directory, None)
    } else if meta.is_file() {
        (FileType::File, None)
    } else {
        (FileType::Unspecified, None)
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "/".into());
    let modified = meta.modified().ok().map(|t| humantime::format_rfc3339_nanos(t).to_string());
    Ok(EntryInfo {
        name,
        file_type,
        path: path.display().to_string(),
        size: meta.len() as i64,
        mode: meta.permissions().mode() & 0o7777,
        permissions: permissions_string(meta.permissions().mode(), file_type),
        owner: user_name(meta.uid()),
        group: group_name(meta.gid()),
        modified_time: modified,
        symlink_target,
        metadata: Default::default(),
    })
}

fn permissions_string(mode: u32, file_type: FileType) -> String {
    let kind = match file_type {
        FileType::Directory => 'd',
        FileType::Symlink => 'l',
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
        assert_eq!(permissions_string(0o755, FileType::Directory), "drwxr-xr-x");
        assert_eq!(permissions_string(0o640, FileType::File), "-rw-r-----");
    }
}
