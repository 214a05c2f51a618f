//! A VM's serial console, bounded. The guest writes whatever it likes to its console (a
//! guest root can flood it), so QEMU hands the bytes to hutch over a socket and hutch
//! keeps at most `CAP` of them on disk, in two halves: `console.log` (the newest) and
//! `console.log.1` (the half before). When the newest half is full it replaces the
//! older one, whose bytes are counted in `console.dropped`. Nobody holds the console in
//! memory; readers get at most `CAP` bytes.
//!
//! hutch takes no signal from the console: any guest root can write to it. Readiness
//! and idleness come over the agent channel (the agent protocol's idle probe, in hutch-proto).

use std::io::Write;
use std::path::{Path, PathBuf};
use tokio::io::AsyncReadExt;

/// Console bytes kept per VM, both halves together.
pub const CAP: u64 = 1 << 20;

fn older(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

fn dropped_file(path: &Path) -> PathBuf {
    path.with_file_name("console.dropped")
}

/// Bytes of this console that were dropped to keep it under `CAP`.
pub fn dropped(path: &Path) -> u64 {
    std::fs::read_to_string(dropped_file(path)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// The console's retained bytes, oldest first (at most `CAP`).
pub fn read(path: &Path) -> Vec<u8> {
    let mut text = std::fs::read(older(path)).unwrap_or_default();
    text.extend(std::fs::read(path).unwrap_or_default());
    text
}

/// Starts `path`'s console over with `text` (its tail, if longer than `CAP`).
pub fn seed(path: &Path, text: &[u8]) -> std::io::Result<()> {
    let _ = std::fs::remove_file(older(path));
    let keep = &text[text.len().saturating_sub((CAP / 2) as usize)..];
    std::fs::write(path, keep)
}

/// Copies a console's retained bytes to `dest` as one file.
pub fn copy(path: &Path, dest: &Path) -> std::io::Result<()> {
    std::fs::write(dest, read(path))
}

/// Appends to a console, rotating halves to stay under `CAP`.
pub struct Ring {
    path: PathBuf,
    half: u64,
    file: std::fs::File,
    len: u64,
}

impl Ring {
    pub fn open(path: &Path, cap: u64) -> std::io::Result<Ring> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let len = file.metadata()?.len();
        Ok(Ring { path: path.to_path_buf(), half: cap / 2, file, len })
    }

    pub fn append(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            if self.len >= self.half {
                self.rotate()?;
            }
            let room = (self.half - self.len) as usize;
            let (now, rest) = data.split_at(room.min(data.len()));
            self.file.write_all(now)?;
            self.len += now.len() as u64;
            data = rest;
        }
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let old = older(&self.path);
        let lost = std::fs::metadata(&old).map(|m| m.len()).unwrap_or(0);
        if lost > 0 {
            std::fs::write(dropped_file(&self.path), (dropped(&self.path) + lost).to_string())?;
        }
        std::fs::rename(&self.path, &old)?;
        self.file = std::fs::OpenOptions::new().create(true).append(true).open(&self.path)?;
        self.len = 0;
        Ok(())
    }
}

/// Copies the console socket into the ring at `path` until QEMU closes it, or until
/// the returned reader is dropped. The file is opened here, before anything runs in the
/// background: a reader that opened it later could create `console.log` again in a
/// sandbox directory its owner, giving up, is removing at that moment (seen as a
/// directory left after Ctrl-C on a loaded machine).
pub fn spawn_reader(socket: tokio::net::UnixStream, path: PathBuf) -> Reader {
    let mut ring = match Ring::open(&path, CAP) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("opening the console {}: {e}", path.display());
            return Reader(None);
        }
    };
    let task = tokio::spawn(async move {
        let mut socket = socket;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match socket.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Err(e) = ring.append(&buf[..n]) {
                tracing::warn!("writing the console {}: {e}", path.display());
            }
        }
    });
    Reader(Some(task))
}

/// A running console copy. Dropping it stops the copy, so nothing is written to the
/// console files once their VM's handle is gone (a copy mid-write on another thread
/// still finishes that write).
#[derive(Debug, Default)]
pub struct Reader(Option<tokio::task::JoinHandle<()>>);

impl Reader {
    /// Waits (at most `limit`) for the copy to reach the end of the console, which
    /// comes once QEMU has exited: the guest's last lines are then on disk.
    pub async fn finish(&mut self, limit: std::time::Duration) {
        if let Some(task) = self.0.as_mut() {
            if tokio::time::timeout(limit, task).await.is_ok() {
                self.0 = None;
            }
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_bytes_under_its_cap_and_counts_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let mut ring = Ring::open(&path, 100).expect("open");
        for i in 0..100u8 {
            ring.append(&[b'a' + i % 26; 7]).expect("append");
        }
        let kept = read(&path);
        assert!(kept.len() <= 100 && kept.len() > 50, "{}", kept.len());
        assert_eq!(dropped(&path) + kept.len() as u64, 700);
        // The newest bytes are the last ones written.
        assert_eq!(&kept[kept.len() - 7..], &[b'a' + 99 % 26; 7]);
    }
}
