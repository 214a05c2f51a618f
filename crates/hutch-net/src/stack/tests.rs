//! The stack against an in-process guest: a second smoltcp interface on the other end
//! of a socketpair, speaking QEMU's stream framing, with the test seam sending the one
//! allowed destination to a loopback echo server.

use super::device::Queues;
use super::link;
use super::*;
use crate::seam::{TestMap, TestMapFile};
use smoltcp::socket::tcp as smol_tcp;
use smoltcp::wire::IpEndpoint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(10);

/// A loopback server that reads to the guest's FIN, then answers `echo:` + what it got.
async fn echo_server() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let _ = conn.read_to_end(&mut got).await;
                let _ = conn.write_all(&[b"echo:".as_slice(), &got].concat()).await;
            });
        }
    });
    addr
}

struct Guest {
    iface: Interface,
    dev: Queues,
    sockets: SocketSet<'static>,
    frames: mpsc::Receiver<Vec<u8>>,
    wr: tokio::net::unix::OwnedWriteHalf,
    epoch: Instant,
}

impl Guest {
    fn new(link: UnixStream) -> Guest {
        let (rd, wr) = link.into_split();
        let (tx, frames) = mpsc::channel(256);
        tokio::spawn(link::read_frames(rd, tx));
        let epoch = Instant::now();
        let mut dev = Queues { rx: Default::default(), tx: Default::default(), frame_mtu: MTU + 14 };
        let mut iface = Interface::new(Config::new(HardwareAddress::Ethernet(EthernetAddress(GUEST_MAC))), &mut dev, smol_now(epoch));
        iface.update_ip_addrs(|a| {
            let _ = a.push(IpCidr::new(IpAddress::Ipv4(GUEST_IP), PREFIX_LEN));
        });
        let _ = iface.routes_mut().add_default_ipv4_route(GATEWAY_IP);
        Guest { iface, dev, sockets: SocketSet::new(Vec::new()), frames, wr, epoch }
    }

    /// Runs the guest's stack until `done` says so or the deadline passes.
    async fn run_until(&mut self, mut done: impl FnMut(&mut SocketSet<'static>) -> bool) -> bool {
        let deadline = Instant::now() + DEADLINE;
        while Instant::now() < deadline {
            self.iface.poll(smol_now(self.epoch), &mut self.dev, &mut self.sockets);
            link::write_frames(&mut self.wr, self.dev.tx.drain(..)).await.expect("the stack's end is open");
            if done(&mut self.sockets) {
                return true;
            }
            // Bounded wait for the stack's next frame; the loop re-polls either way.
            if let Ok(Some(frame)) = tokio::time::timeout(Duration::from_millis(10), self.frames.recv()).await {
                self.dev.rx.push_back(frame);
            }
        }
        false
    }

    fn connect(&mut self, to: (Ipv4Addr, u16), local_port: u16) -> smoltcp::iface::SocketHandle {
        let mut socket = tcp::new_socket();
        socket.connect(self.iface.context(), IpEndpoint::new(IpAddress::Ipv4(to.0), to.1), local_port).expect("connect");
        self.sockets.add(socket)
    }
}

fn stack_with(policy: &str, tcp_map: Vec<(SocketAddr, SocketAddr)>) -> (NetHandle, Guest, std::path::PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let violations = dir.path().join("violations");
    let map = TestMapFile { tcp: tcp_map.into_iter().collect(), violations: Some(violations.clone()), ..Default::default() };
    let (ours, theirs) = UnixStream::pair().expect("socketpair");
    let handle = NetHandle::start(ours, Policy::parse(policy).expect("policy"), Reach::default(), Arc::new(TestMap::new(map)), Limits::default());
    (handle, Guest::new(theirs), violations, dir)
}

const WEB: Ipv4Addr = Ipv4Addr::new(93, 184, 216, 34);

#[tokio::test]
async fn an_allowed_connection_is_made_from_the_host_with_half_close_both_ways() {
    let echo = echo_server().await;
    let (handle, mut guest, violations, _dir) = stack_with("allow@public:tcp:80", vec![(SocketAddr::from((WEB, 80)), echo)]);
    let h = guest.connect((WEB, 80), 40_000);
    let mut sent = false;
    let mut got = Vec::new();
    let finished = guest
        .run_until(|sockets| {
            let s = sockets.get_mut::<smol_tcp::Socket>(h);
            if s.may_send() && !sent {
                s.send_slice(b"ping").expect("send");
                // Half-close: the upstream sees EOF and still answers.
                s.close();
                sent = true;
            }
            while s.can_recv() {
                let _ = s.recv(|b| {
                    got.extend_from_slice(b);
                    (b.len(), ())
                });
            }
            matches!(s.state(), smol_tcp::State::Closed | smol_tcp::State::TimeWait)
        })
        .await;
    assert!(finished, "the connection did not finish within {DEADLINE:?}");
    assert_eq!(got, b"echo:ping");
    assert_eq!(handle.log().counters.flows_allowed, 1);
    assert_eq!(std::fs::read_to_string(&violations).unwrap_or_default(), "");
}

#[tokio::test]
async fn denials_are_resets_decided_before_any_dial() {
    let (handle, mut guest, violations, _dir) = stack_with("allow@public:tcp:443", vec![]);
    // Protected, not allowed by any rule, allowed but not in the map.
    let targets = [((Ipv4Addr::new(10, 0, 0, 1), 80), 41_000), ((WEB, 80), 41_001), ((WEB, 443), 41_002)];
    let handles: Vec<_> = targets.iter().map(|(to, port)| guest.connect(*to, *port)).collect();
    let mut established = false;
    let all_closed = guest
        .run_until(|sockets| {
            handles.iter().all(|h| {
                let s = sockets.get_mut::<smol_tcp::Socket>(*h);
                established |= s.state() == smol_tcp::State::Established;
                s.state() == smol_tcp::State::Closed
            })
        })
        .await;
    assert!(all_closed && !established, "every connection must be reset without a handshake");
    let log = handle.log();
    assert_eq!(log.counters.flows_denied, 3, "{:?}", log.denials);
    let messages: Vec<&str> = log.denials.iter().map(|d| d.message.as_str()).collect();
    assert_eq!(messages[0], "private addresses are never reachable from sandboxes");
    assert_eq!(messages[1], "no rule allows it");
    assert!(messages[2].starts_with("the destination did not accept"), "{}", messages[2]);
    // Only the allowed, unmapped one reached the seam.
    assert_eq!(std::fs::read_to_string(&violations).expect("violations").trim(), "dial of unmapped tcp 93.184.216.34:443");
}

#[tokio::test]
async fn a_bad_frame_length_from_qemu_ends_the_link() {
    let (ours, mut theirs) = UnixStream::pair().expect("socketpair");
    let handle = NetHandle::start(ours, Policy::none(), Reach::default(), Arc::new(TestMap::default()), Limits::default());
    theirs.write_all(&70_000u32.to_be_bytes()).await.expect("write");
    let why = tokio::time::timeout(DEADLINE, handle.link_lost()).await.expect("the link ended within the deadline");
    assert_eq!(why, "QEMU sent a frame of 70000 bytes, which no Ethernet frame on this link can be");
    // Reported where denials are (GET /sandboxes/{id}/network, `hutch net log`).
    assert_eq!(handle.log().link_lost.as_deref(), Some(why.as_str()));
    assert_eq!(handle.link(), LinkState::Lost(why));
}
