//! The blob cache shared by every image: `<dir>/sha256/<hex>`. A blob is written to a
//! temporary file beside its place and hashed as it arrives; only a blob whose SHA-256
//! matches its digest is renamed into place, so the cache never holds a half-written or
//! tampered blob, and a second image sharing a layer downloads nothing.

use sha2::{Digest as _, Sha256};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::AsyncWrite;

/// A `sha256:<64 hex>` digest, checked: it names files, and it comes from a registry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not a sha256 digest (sha256: and 64 lowercase hex digits)")]
pub struct BadDigest(pub String);

impl Digest {
    pub fn parse(text: &str) -> Result<Digest, BadDigest> {
        match text.strip_prefix("sha256:") {
            Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) => Ok(Digest(text.to_string())),
            _ => Err(BadDigest(text.to_string())),
        }
    }

    pub fn of(bytes: &[u8]) -> Digest {
        Digest(format!("sha256:{}", hex::encode(Sha256::digest(bytes))))
    }

    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 12 hex digits, as `docker` shows layers.
    pub fn short(&self) -> &str {
        &self.hex()[..12]
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the blob {expected} arrived with digest {actual}: the registry sent other bytes than the image names (tampered or corrupted); nothing was kept")]
    Mismatch { expected: Digest, actual: Digest },
    #[error("writing the blob cache at {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

#[derive(Debug, Clone)]
pub struct BlobStore {
    dir: PathBuf,
}

impl BlobStore {
    pub fn new(dir: impl Into<PathBuf>) -> BlobStore {
        BlobStore { dir: dir.into() }
    }

    pub fn path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("sha256").join(digest.hex())
    }

    pub fn has(&self, digest: &Digest) -> bool {
        self.path(digest).is_file()
    }

    /// A writer for `digest`'s bytes; `finish` keeps them only if they match.
    pub async fn writer(&self, digest: &Digest) -> Result<BlobWriter, StoreError> {
        let dest = self.path(digest);
        let dir = dest.parent().unwrap_or(&self.dir).to_path_buf();
        let io = |source| StoreError::Io { path: dir.clone(), source };
        tokio::fs::create_dir_all(&dir).await.map_err(io)?;
        // Unique per writer: two writers of one blob never share a file.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".{}.{}-{n}.partial", digest.hex(), std::process::id()));
        let file = tokio::fs::OpenOptions::new().write(true).create_new(true).open(&tmp).await.map_err(io)?;
        Ok(BlobWriter { file, hasher: Sha256::new(), tmp, dest, expected: digest.clone(), written: 0 })
    }
}

/// Bytes on their way into the cache; dropped unfinished, the temporary file goes.
pub struct BlobWriter {
    file: tokio::fs::File,
    hasher: Sha256,
    tmp: PathBuf,
    dest: PathBuf,
    expected: Digest,
    written: u64,
}

impl BlobWriter {
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Checks the digest and moves the blob into place.
    pub async fn finish(mut self) -> Result<PathBuf, StoreError> {
        use tokio::io::AsyncWriteExt;
        let io = |path: &Path, source| StoreError::Io { path: path.to_path_buf(), source };
        self.file.flush().await.map_err(|e| io(&self.tmp, e))?;
        self.file.sync_all().await.map_err(|e| io(&self.tmp, e))?;
        let actual = Digest(format!("sha256:{}", hex::encode(std::mem::take(&mut self.hasher).finalize())));
        if actual != self.expected {
            return Err(StoreError::Mismatch { expected: self.expected.clone(), actual });
        }
        tokio::fs::rename(&self.tmp, &self.dest).await.map_err(|e| io(&self.dest, e))?;
        Ok(self.dest.clone())
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        // After `finish` renamed it, this finds nothing.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

impl AsyncWrite for BlobWriter {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.file).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => {
                this.hasher.update(&buf[..n]);
                this.written += n as u64;
                Poll::Ready(Ok(n))
            }
            other => other,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().file).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().file).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn digests_are_checked_before_they_name_files() {
        assert!(Digest::parse(&format!("sha256:{}", "a".repeat(64))).is_ok());
        for bad in ["sha256:../../etc/passwd", "sha512:abc", &format!("sha256:{}", "A".repeat(64)), "sha256:"] {
            assert!(Digest::parse(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn only_matching_bytes_enter_the_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = BlobStore::new(dir.path());
        let good = Digest::of(b"layer bytes");
        let mut w = store.writer(&good).await.expect("writer");
        w.write_all(b"layer bytes").await.expect("write");
        let path = w.finish().await.expect("kept");
        assert_eq!(std::fs::read(path).expect("read"), b"layer bytes");
        assert!(store.has(&good));

        let claimed = Digest::of(b"what the manifest says");
        let mut w = store.writer(&claimed).await.expect("writer");
        w.write_all(b"what the registry sent").await.expect("write");
        let err = w.finish().await.expect_err("a mismatch is refused");
        assert!(matches!(err, StoreError::Mismatch { .. }), "{err}");
        assert!(!store.has(&claimed));
        let left: Vec<_> = std::fs::read_dir(dir.path().join("sha256")).expect("dir").flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 1, "only the good blob, no partial file: {left:?}");
    }
}
