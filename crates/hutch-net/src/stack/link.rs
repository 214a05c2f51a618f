//! QEMU's stream netdev framing: each frame is a 4-byte big-endian length and one
//! Ethernet frame, both ways, with no virtio header. QEMU reads at most
//! `MAX_FRAME` bytes per frame and drops the link on a longer length, so a bad length
//! from it means the link is broken: the stack ends rather than resynchronise.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;

/// QEMU's `NET_BUFSIZE` (4096 + 65536).
pub const MAX_FRAME: usize = 69_632;
/// An Ethernet header.
const MIN_FRAME: usize = 14;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("QEMU closed the network link")]
    Closed,
    #[error("QEMU sent a frame of {0} bytes, which no Ethernet frame on this link can be")]
    BadLength(usize),
    #[error("the network link failed")]
    Io(#[source] std::io::Error),
}

/// Reads frames until the link ends; the reason it ended.
pub async fn read_frames(mut rd: OwnedReadHalf, out: mpsc::Sender<Vec<u8>>) -> LinkError {
    loop {
        let len = match rd.read_u32().await {
            Ok(n) => n as usize,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return LinkError::Closed,
            Err(e) => return LinkError::Io(e),
        };
        if !(MIN_FRAME..=MAX_FRAME).contains(&len) {
            return LinkError::BadLength(len);
        }
        let mut frame = vec![0; len];
        if let Err(e) = rd.read_exact(&mut frame).await {
            return if e.kind() == std::io::ErrorKind::UnexpectedEof { LinkError::Closed } else { LinkError::Io(e) };
        }
        if out.send(frame).await.is_err() {
            return LinkError::Closed;
        }
    }
}

/// Writes `frames` as one batch.
pub async fn write_frames(wr: &mut OwnedWriteHalf, frames: impl Iterator<Item = Vec<u8>>) -> Result<(), LinkError> {
    let mut batch = Vec::new();
    for f in frames {
        debug_assert!(f.len() <= MAX_FRAME);
        batch.extend_from_slice(&(f.len() as u32).to_be_bytes());
        batch.extend_from_slice(&f);
    }
    if batch.is_empty() {
        return Ok(());
    }
    wr.write_all(&batch).await.map_err(|e| if e.kind() == std::io::ErrorKind::BrokenPipe { LinkError::Closed } else { LinkError::Io(e) })
}
