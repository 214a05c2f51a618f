//! ICMP echo relaying: an echo request the policy allows is sent from the host, and the
//! reply goes back to the guest as if from the address it pinged. The host's side is a
//! ping socket (`SOCK_DGRAM`, `IPPROTO_ICMP`: no privilege, where
//! `net.ipv4.ping_group_range` includes hutch's group) or else a raw socket (root or
//! CAP_NET_RAW). Each echo has its own socket and a deadline, so replies never mix.

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{Icmpv4Message, Icmpv4Packet, Icmpv4Repr, Ipv4Packet};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

/// How long an echo waits for its reply: then it is dropped, as on a network.
pub const ECHO_WAIT: Duration = Duration::from_secs(5);

/// Echoes waiting on blocking threads at once, all sandboxes together: each holds a
/// thread of tokio's blocking pool for up to `ECHO_WAIT`, a pool the whole server
/// shares, so guests pinging addresses that never answer may take this many of its
/// 512 and no more (more echoes are dropped, as on a congested network).
pub static ECHO_THREADS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(64);

/// The host may not send ICMP echo at all.
#[derive(Debug, thiserror::Error)]
#[error("this host lets hutch send no ICMP echo (no ping socket: {ping}; no raw socket: {raw}); widen net.ipv4.ping_group_range or run hutch as root")]
pub struct NoEchoSocket {
    ping: std::io::Error,
    raw: std::io::Error,
}

/// One echo request: what the guest sent, and where the host sends it.
pub struct Echo {
    pub to: Ipv4Addr,
    pub ident: u16,
    pub seq: u16,
    pub data: Vec<u8>,
}

/// Sends `echo` and waits for its reply's data (None: no reply within `wait`). Blocking:
/// run it on a blocking thread.
pub fn send_and_wait(echo: &Echo, wait: Duration) -> Result<Option<Vec<u8>>, NoEchoSocket> {
    let (socket, raw) = match Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::ICMPV4)) {
        Ok(s) => (s, false),
        Err(ping) => match Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4)) {
            Ok(s) => (s, true),
            Err(raw) => return Err(NoEchoSocket { ping, raw }),
        },
    };
    let mut request = vec![0u8; 8 + echo.data.len()];
    let repr = Icmpv4Repr::EchoRequest { ident: echo.ident, seq_no: echo.seq, data: &echo.data };
    // A ping socket replaces the identifier (and checksum) with its own; a raw one sends
    // this as is.
    repr.emit(&mut Icmpv4Packet::new_unchecked(&mut request[..]), &ChecksumCapabilities::default());
    if socket.send_to(&request, &SockAddr::from(SocketAddrV4::new(echo.to, 0))).is_err() {
        return Ok(None);
    }
    let deadline = Instant::now() + wait;
    let mut buf = vec![0u8; 65_536];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || socket.set_read_timeout(Some(left)).is_err() {
            return Ok(None);
        }
        let Ok(n) = (&socket).read(&mut buf) else { return Ok(None) };
        if let Some(data) = reply_data(&buf[..n], echo, raw) {
            return Ok(Some(data));
        }
    }
}

/// The data of `packet` if it is the reply to `echo`. A raw socket sees every ICMP
/// packet to the host, IP header first; a ping socket only its own replies' ICMP.
fn reply_data(packet: &[u8], echo: &Echo, raw: bool) -> Option<Vec<u8>> {
    let icmp = if raw {
        let ip = Ipv4Packet::new_checked(packet).ok()?;
        if ip.src_addr() != echo.to {
            return None;
        }
        &packet[usize::from(ip.header_len())..]
    } else {
        packet
    };
    let icmp = Icmpv4Packet::new_checked(icmp).ok()?;
    let ours = icmp.msg_type() == Icmpv4Message::EchoReply && icmp.echo_seq_no() == echo.seq && (!raw || icmp.echo_ident() == echo.ident);
    (ours && icmp.data() == echo.data.as_slice()).then(|| icmp.data().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loopback answers echo itself. As root (CI) a raw socket is always there; another
    /// user may have neither kind, and then the error must say so.
    #[test]
    fn an_echo_to_loopback_comes_back_with_its_data() {
        let echo = Echo { to: Ipv4Addr::LOCALHOST, ident: 0x6875, seq: 7, data: b"hutch echo".to_vec() };
        match send_and_wait(&echo, ECHO_WAIT) {
            Ok(reply) => assert_eq!(reply.as_deref(), Some(&b"hutch echo"[..])),
            Err(e) => {
                assert!(!nix::unistd::geteuid().is_root(), "root has raw sockets: {e}");
                assert!(e.to_string().contains("ping_group_range"), "{e}");
            }
        }
    }

    #[test]
    fn replies_to_someone_else_are_not_ours() {
        let echo = Echo { to: Ipv4Addr::LOCALHOST, ident: 1, seq: 2, data: b"x".to_vec() };
        let mut reply = vec![0u8; 9];
        let repr = Icmpv4Repr::EchoReply { ident: 1, seq_no: 3, data: b"x" };
        repr.emit(&mut Icmpv4Packet::new_unchecked(&mut reply[..]), &ChecksumCapabilities::default());
        assert_eq!(reply_data(&reply, &echo, false), None, "another sequence number");
        let repr = Icmpv4Repr::EchoReply { ident: 1, seq_no: 2, data: b"x" };
        repr.emit(&mut Icmpv4Packet::new_unchecked(&mut reply[..]), &ChecksumCapabilities::default());
        assert_eq!(reply_data(&reply, &echo, false), Some(b"x".to_vec()));
    }
}
