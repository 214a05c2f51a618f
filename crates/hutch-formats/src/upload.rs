//! An uploaded COPY context (E2B's file-hash upload: a tar, gzip or plain, of the files
//! a step names, relative to the SDK's context), unpacked into a scratch directory
//! within the build's [`Budget`]. Only what the tar's headers say is written: sparse
//! entries (whose holes would be written as a few seeks, then read whole by `collect`)
//! are refused, devices and FIFOs are left out.

use crate::budget::{Budget, BudgetError};
use std::cell::Cell;
use std::io::Read;
use std::path::Path;
use std::rc::Rc;
use tar::EntryType;

/// Entries are charged their size in the tar (headers, then the data padded to a
/// block): the same measure `context::collect` counts its own tar in.
const BLOCK: u64 = 512;

/// The most one entry's headers (tar-rs reads long names and PAX records whole, into
/// memory, before the entry is seen) may take. A path is at most 4 KiB.
const HEADERS: u64 = 1 << 20;
/// What one file or directory costs on the host's filesystem at least (a block and an
/// inode), whatever its size in the tar: an upload of empty entries is charged so.
const FS_BLOCK: u64 = 4096;
/// Entries in one upload: inodes are a resource of their own (a tar of empty files
/// costs 512 bytes an entry and could use up the host's inodes under the byte cap).
pub const MAX_ENTRIES: u64 = 1_000_000;

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("the uploaded files hold more than {MAX_ENTRIES} entries, the most one COPY may; copy fewer files in each step")]
    TooMany,
    #[error("'{0}' in the uploaded files is a sparse file, which hutch does not unpack; upload it as a regular file")]
    Sparse(String),
    #[error("'{name}' in the uploaded files is a tar entry of type {kind:?}, not a file, a directory or a link; leave it out of the upload")]
    Kind { name: String, kind: EntryType },
    #[error("an entry of the uploaded files has more than {} KiB of tar headers (long names, PAX records); hutch does not unpack such tars", HEADERS >> 10)]
    Header,
    #[error(transparent)]
    Budget(#[from] BudgetError),
    #[error("the uploaded files are not a readable tar: {0}")]
    Tar(std::io::Error),
}

/// Unpacks the uploaded tar `file` into the new directory `dir`, taking every entry's
/// bytes from `budget` before writing them. Names may not leave `dir` (`unpack_in`
/// skips `..` and links that would). On failure `dir` is removed.
pub fn unpack(file: &Path, dir: &Path, budget: &mut Budget) -> Result<(), UnpackError> {
    std::fs::create_dir(dir).map_err(UnpackError::Tar)?;
    let result = unpack_into(file, dir, budget);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(dir);
    }
    result
}

fn unpack_into(file: &Path, dir: &Path, budget: &mut Budget) -> Result<(), UnpackError> {
    let open = || std::fs::File::open(file).map_err(UnpackError::Tar);
    let mut head = [0u8; 2];
    let gzip = open()?.read(&mut head).map_err(UnpackError::Tar)? == 2 && head == [0x1f, 0x8b];
    let reader: Box<dyn Read> = if gzip { Box::new(flate2::read::MultiGzDecoder::new(open()?)) } else { Box::new(open()?) };
    let meter = Rc::new(Meter::default());
    meter.limit.set(HEADERS);
    let mut archive = tar::Archive::new(Metered { inner: reader, meter: meter.clone() });
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(false);
    let tar = |e: std::io::Error| if meter.over.get() { UnpackError::Header } else { UnpackError::Tar(e) };
    // Bytes of the inflated tar charged so far: every byte is, headers included.
    let mut charged = 0;
    for (n, entry) in archive.entries().map_err(tar)?.enumerate() {
        if n as u64 >= MAX_ENTRIES {
            return Err(UnpackError::TooMany);
        }
        let mut entry = entry.map_err(tar)?;
        let kind = entry.header().entry_type();
        if kind.is_gnu_sparse() || pax_sparse(&mut entry).map_err(tar)? {
            return Err(UnpackError::Sparse(entry_name(&entry)));
        }
        // This entry's headers, read already, and its data (padded to a block), to come.
        let data = entry.size().div_ceil(BLOCK).saturating_mul(BLOCK);
        // Charged at least a filesystem block, which the meter does not see.
        budget.take(meter.read.get().saturating_sub(charged).saturating_add(data).max(FS_BLOCK))?;
        charged = meter.read.get().saturating_add(data);
        meter.limit.set(charged.saturating_add(HEADERS));
        match kind {
            EntryType::Regular | EntryType::Continuous | EntryType::Directory | EntryType::Symlink | EntryType::Link => {
                // tar-rs names the host path it wrote to: the caller is told the entry's name.
                entry.unpack_in(dir).map_err(|e| UnpackError::Tar(std::io::Error::new(e.kind(), format!("unpacking '{}': {}", entry_name(&entry), cause(&e)))))?;
            }
            // Not build inputs (`collect` leaves them out too); tar-rs would write them as files.
            EntryType::Char | EntryType::Block | EntryType::Fifo | EntryType::XGlobalHeader => {}
            kind => return Err(UnpackError::Kind { name: entry_name(&entry), kind }),
        }
    }
    Ok(())
}

/// What went wrong under a tar-rs error, without the host paths tar-rs writes into its
/// messages: the system's error at the bottom (whose text names no path), else the kind.
fn cause(e: &std::io::Error) -> String {
    let mut bottom: &(dyn std::error::Error + 'static) = e;
    while let Some(next) = bottom.source() {
        bottom = next;
    }
    match bottom.downcast_ref::<std::io::Error>().and_then(std::io::Error::raw_os_error) {
        Some(code) => std::io::Error::from_raw_os_error(code).to_string(),
        None => e.kind().to_string(),
    }
}

/// Whether PAX records describe `entry` as sparse (`GNU.sparse.*`, formats 0.0 to 1.0).
fn pax_sparse<R: Read>(entry: &mut tar::Entry<'_, R>) -> std::io::Result<bool> {
    let Some(records) = entry.pax_extensions()? else { return Ok(false) };
    Ok(records.flatten().any(|r| r.key().is_ok_and(|k| k.starts_with("GNU.sparse."))))
}

fn entry_name<R: Read>(entry: &tar::Entry<'_, R>) -> String {
    entry.path().map(|p| p.display().to_string()).unwrap_or_else(|_| String::from_utf8_lossy(&entry.path_bytes()).into_owned())
}

/// How much of the inflated tar was read, and how much may be.
#[derive(Default)]
struct Meter {
    read: Cell<u64>,
    limit: Cell<u64>,
    over: Cell<bool>,
}

struct Metered<R> {
    inner: R,
    meter: Rc<Meter>,
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let m = &self.meter;
        let left = m.limit.get().saturating_sub(m.read.get());
        if left == 0 && !buf.is_empty() {
            m.over.set(true);
            return Err(std::io::Error::other("a tar header past its allowance"));
        }
        let max = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..max])?;
        m.read.set(m.read.get() + n as u64);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;
    use tar::Header;

    /// A tar.gz at `dir/upload`, its entries made by `fill`, streamed (never held whole).
    fn upload(dir: &Path, fill: impl FnOnce(&mut tar::Builder<flate2::write::GzEncoder<std::fs::File>>)) -> PathBuf {
        let path = dir.join("upload");
        let gz = flate2::write::GzEncoder::new(std::fs::File::create(&path).expect("create"), flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        fill(&mut tar);
        tar.into_inner().expect("tar").finish().expect("gzip").flush().expect("flush");
        path
    }

    fn file(tar: &mut tar::Builder<impl Write>, name: &str, data: &[u8]) {
        let mut h = Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        tar.append_data(&mut h, name, data).expect("append");
    }

    /// A header written as is: names tar-rs's builder would refuse, types it would not make.
    fn raw(tar: &mut tar::Builder<impl Write>, name: &[u8], kind: EntryType, data: &[u8], edit: impl FnOnce(&mut Header)) {
        let mut h = Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        edit(&mut h);
        h.set_cksum();
        tar.append(&h, data).expect("append");
    }

    fn budget(dir: &Path, limit: u64) -> Budget {
        let mut b = Budget::new(dir, limit, 0);
        b.begin(limit);
        b
    }

    #[test]
    fn a_gnu_sparse_entry_is_refused_before_anything_is_written() {
        let tmp = tempfile::tempdir().expect("dir");
        // 512 bytes of data at the end of a 64 GiB file: tar-rs would seek over the rest.
        let tar = upload(tmp.path(), |t| {
            raw(t, b"holes.img", EntryType::GNUSparse, &[7; 512], |h| {
                let gnu = h.as_gnu_mut().expect("gnu");
                gnu.set_real_size(1 << 36);
                gnu.sparse[0].set_offset((1 << 36) - 512);
                gnu.sparse[0].set_length(512);
            })
        });
        let out = tmp.path().join("ctx");
        let e = unpack(&tar, &out, &mut budget(tmp.path(), u64::MAX)).expect_err("sparse");
        assert!(matches!(e, UnpackError::Sparse(ref n) if n == "holes.img"), "{e}");
        assert!(e.to_string().contains("is a sparse file") && e.to_string().contains("upload it as a regular file"), "{e}");
        assert!(!out.exists(), "the partial directory is removed");
    }

    #[test]
    fn a_pax_sparse_entry_is_refused() {
        let tmp = tempfile::tempdir().expect("dir");
        let tar = upload(tmp.path(), |t| {
            let records: [(&str, &[u8]); 3] = [("GNU.sparse.major", b"1"), ("GNU.sparse.minor", b"0"), ("GNU.sparse.realsize", b"68719476736")];
            t.append_pax_extensions(records).expect("pax");
            file(t, "GNUSparseFile.0/holes.img", &[7; 1024]);
        });
        let e = unpack(&tar, &tmp.path().join("ctx"), &mut budget(tmp.path(), u64::MAX)).expect_err("sparse");
        assert!(matches!(e, UnpackError::Sparse(_)), "{e}");
        assert!(!tmp.path().join("ctx").exists());
    }

    #[test]
    fn a_gzip_bomb_is_cut_off_at_the_allowance_and_its_files_removed() {
        let tmp = tempfile::tempdir().expect("dir");
        // 1 GiB of zeros in 16 files, streamed through the encoder.
        let tar = upload(tmp.path(), |t| {
            for i in 0..16 {
                let mut h = Header::new_gnu();
                h.set_mode(0o644);
                h.set_size(64 << 20);
                t.append_data(&mut h, format!("zeros-{i}"), std::io::repeat(0).take(64 << 20)).expect("append");
            }
        });
        assert!(std::fs::metadata(&tar).expect("upload").len() < 4 << 20, "a bomb: small compressed");
        let out = tmp.path().join("ctx");
        // Room for the first file, not the second.
        let e = unpack(&tar, &out, &mut budget(tmp.path(), 100 << 20)).expect_err("past the allowance");
        assert!(matches!(e, UnpackError::Budget(BudgetError::Write { limit }) if limit == 100 << 20), "{e}");
        assert!(e.to_string().contains("more than 100 MiB"), "{e}");
        assert!(!out.exists(), "what was written before the cap is removed");
    }

    #[test]
    fn an_upload_that_would_eat_into_the_disk_reserve_is_refused() {
        let tmp = tempfile::tempdir().expect("dir");
        let tar = upload(tmp.path(), |t| file(t, "main.py", b"print(1)\n"));
        let free = hutch_vmm::space::available(tmp.path()).expect("statvfs");
        let out = tmp.path().join("ctx");
        let e = unpack(&tar, &out, &mut Budget::new(tmp.path(), u64::MAX, free + (1 << 30))).expect_err("short of disk");
        assert!(matches!(e, UnpackError::Budget(BudgetError::NoSpace { .. })), "{e}");
        assert!(e.to_string().starts_with("the server is short of disk"), "{e}");
        assert!(!out.exists());
    }

    #[test]
    fn headers_larger_than_a_path_needs_are_refused_before_they_are_read_whole() {
        let tmp = tempfile::tempdir().expect("dir");
        let tar = upload(tmp.path(), |t| {
            let comment = vec![b'x'; 2 << 20];
            t.append_pax_extensions([("comment", comment.as_slice())]).expect("pax");
            file(t, "main.py", b"print(1)\n");
        });
        let e = unpack(&tar, &tmp.path().join("ctx"), &mut budget(tmp.path(), u64::MAX)).expect_err("header");
        assert!(matches!(e, UnpackError::Header), "{e}");
    }

    #[test]
    fn an_upload_unpacks_its_files_links_and_directories_but_no_devices() {
        let tmp = tempfile::tempdir().expect("dir");
        let tar = upload(tmp.path(), |t| {
            let mut d = Header::new_gnu();
            d.set_entry_type(EntryType::Directory);
            d.set_mode(0o755);
            d.set_size(0);
            t.append_data(&mut d, "app", std::io::empty()).expect("dir");
            file(t, "app/main.py", b"print(1)\n");
            let mut l = Header::new_gnu();
            l.set_entry_type(EntryType::Symlink);
            l.set_size(0);
            t.append_link(&mut l, "app/link.py", "main.py").expect("symlink");
            raw(t, b"app/pipe", EntryType::Fifo, &[], |_| {});
            raw(t, b"app/tty", EntryType::Char, &[], |h| {
                h.set_device_major(4).expect("major");
                h.set_device_minor(1).expect("minor");
            });
        });
        let out = tmp.path().join("ctx");
        let mut b = budget(tmp.path(), 1 << 20);
        unpack(&tar, &out, &mut b).expect("unpacks");
        assert_eq!(std::fs::read_to_string(out.join("app/main.py")).expect("file"), "print(1)\n");
        assert_eq!(std::fs::read_link(out.join("app/link.py")).expect("link"), Path::new("main.py"));
        for skipped in ["app/pipe", "app/tty"] {
            assert!(std::fs::symlink_metadata(out.join(skipped)).is_err(), "{skipped} is left out");
        }
        let copy = crate::context::collect_within(&out, &["app".into()], "/srv/", &crate::context::Ignore::default(), &tmp.path().join("copy.tar"), &mut b).expect("collect");
        assert_eq!(copy.entries, 2);
    }

    /// tar-rs's `unpack_in` keeps names in the directory (checked here, not rewritten).
    #[test]
    fn names_and_links_do_not_leave_the_directory() {
        let tmp = tempfile::tempdir().expect("dir");
        let out = tmp.path().join("ctx");
        let climbing = upload(tmp.path(), |t| {
            raw(t, b"../climbed", EntryType::Regular, b"x", |_| {});
            raw(t, b"/rooted", EntryType::Regular, b"x", |_| {});
        });
        unpack(&climbing, &out, &mut budget(tmp.path(), 1 << 20)).expect("skipped, not refused");
        assert!(!tmp.path().join("climbed").exists() && out.join("rooted").is_file());
        std::fs::remove_dir_all(&out).expect("clean");
        let through_link = upload(tmp.path(), |t| {
            raw(t, b"up", EntryType::Symlink, &[], |h| h.set_link_name("..").expect("link"));
            raw(t, b"up/escaped", EntryType::Regular, b"x", |_| {});
        });
        unpack(&through_link, &out, &mut budget(tmp.path(), 1 << 20)).expect_err("a write through a link out");
        assert!(!tmp.path().join("escaped").exists() && !out.exists());
    }

    /// tar-rs writes the host path it unpacks to into its errors; the caller (a tenant,
    /// reading its build log) is told the entry's name and the system's error only.
    #[test]
    fn an_entry_that_cannot_be_unpacked_is_named_without_the_host_path() {
        let tmp = tempfile::tempdir().expect("dir");
        let out = tmp.path().join("ctx");
        let host = tmp.path().display().to_string();
        let file_then_under_it = |t: &mut tar::Builder<_>| {
            file(t, "a", b"x");
            raw(t, b"a/b", EntryType::Regular, b"y", |_| {});
        };
        let e = unpack(&upload(tmp.path(), file_then_under_it), &out, &mut budget(tmp.path(), 1 << 20)).expect_err("refused").to_string();
        assert!(e.contains("'a/b'") && !e.contains(&host), "{e}");
        let through_link = |t: &mut tar::Builder<_>| {
            raw(t, b"up", EntryType::Symlink, &[], |h| h.set_link_name("..").expect("link"));
            raw(t, b"up/escaped", EntryType::Regular, b"x", |_| {});
        };
        let e = unpack(&upload(tmp.path(), through_link), &out, &mut budget(tmp.path(), 1 << 20)).expect_err("refused").to_string();
        assert!(e.contains("'up/escaped'") && !e.contains(&host), "{e}");
    }
}
