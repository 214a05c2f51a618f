//! UDP relaying: each guest (source, destination) pair gets a host socket connected to
//! the destination; replies come back as datagrams from that destination. A flow idle
//! for `idle` is closed.

use super::event::Event;
use std::collections::HashMap;
use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};

struct UdpFlow {
    /// Sends go through the std socket: tokio's `try_send` refuses until its reactor
    /// has seen the socket writable, which loses a new flow's first datagram.
    sender: std::net::UdpSocket,
    last: Instant,
    reader: AbortHandle,
}

pub struct UdpFlows {
    flows: HashMap<(SocketAddrV4, SocketAddrV4), UdpFlow>,
    idle: Duration,
    last_sweep: Instant,
}

impl UdpFlows {
    pub fn new(idle: Duration) -> UdpFlows {
        UdpFlows { flows: HashMap::new(), idle, last_sweep: Instant::now() }
    }

    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Sends on an open flow; false when there is none.
    pub fn send(&mut self, src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> bool {
        match self.flows.get_mut(&(src, dst)) {
            Some(flow) => {
                flow.last = Instant::now();
                // A full socket buffer drops the datagram, as a network would.
                let _ = flow.sender.send(payload);
                true
            }
            None => false,
        }
    }

    /// Opens a flow to `route` for the guest's `src` → `dst` and sends `first`.
    pub fn open(
        &mut self,
        src: SocketAddrV4,
        dst: SocketAddrV4,
        route: SocketAddr,
        first: &[u8],
        tasks: &mut JoinSet<()>,
        events: mpsc::Sender<Event>,
    ) -> std::io::Result<()> {
        let bind: SocketAddr = if route.is_ipv4() { "0.0.0.0:0".parse().map_err(std::io::Error::other)? } else { "[::]:0".parse().map_err(std::io::Error::other)? };
        let std_socket = std::net::UdpSocket::bind(bind)?;
        std_socket.connect(route)?;
        std_socket.set_nonblocking(true)?;
        let sender = std_socket.try_clone()?;
        let _ = sender.send(first);
        let socket = Arc::new(UdpSocket::from_std(std_socket)?);
        let reader = tasks.spawn({
            let socket = socket.clone();
            async move {
                let mut buf = vec![0; 65_536];
                while let Ok(n) = socket.recv(&mut buf).await {
                    match events.try_send(Event::Datagram { from: dst, to: src, payload: buf[..n].to_vec() }) {
                        // A full queue drops the datagram, as a congested network would.
                        Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                        Err(mpsc::error::TrySendError::Closed(_)) => return,
                    }
                }
            }
        });
        self.flows.insert((src, dst), UdpFlow { sender, last: Instant::now(), reader });
        Ok(())
    }

    /// Closes flows idle for longer than `idle` (checked once a second at most).
    pub fn expire(&mut self, now: Instant) {
        if now.duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        let idle = self.idle;
        self.flows.retain(|_, f| {
            let keep = now.duration_since(f.last) < idle;
            if !keep {
                f.reader.abort();
            }
            keep
        });
    }
}
