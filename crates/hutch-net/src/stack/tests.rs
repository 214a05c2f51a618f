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

    /// Sends `chunks` on connection `h` once it is open, half-closes it, and reads what
    /// comes back until it is closed; None when it is not closed within the deadline.
    async fn exchange(&mut self, h: smoltcp::iface::SocketHandle, chunks: &[&[u8]]) -> Option<Vec<u8>> {
        let (mut sent, mut got) = (false, Vec::new());
        let finished = self
            .run_until(|sockets| {
                let s = sockets.get_mut::<smol_tcp::Socket>(h);
                if s.may_send() && !sent {
                    for chunk in chunks {
                        s.send_slice(chunk).expect("send");
                    }
                    s.close();
                    sent = true;
                }
                while s.can_recv() {
                    let _ = s.recv(|b| {
                        got.extend_from_slice(b);
                        (b.len(), ())
                    });
                }
                sent && matches!(s.state(), smol_tcp::State::Closed | smol_tcp::State::TimeWait)
            })
            .await;
        finished.then_some(got)
    }

    fn connect(&mut self, to: (Ipv4Addr, u16), local_port: u16) -> smoltcp::iface::SocketHandle {
        let mut socket = tcp::new_socket();
        socket.connect(self.iface.context(), IpEndpoint::new(IpAddress::Ipv4(to.0), to.1), local_port).expect("connect");
        self.sockets.add(socket)
    }
}

fn stack_with(policy: &str, tcp_map: Vec<(SocketAddr, SocketAddr)>) -> (NetHandle, Guest, std::path::PathBuf, tempfile::TempDir) {
    stack_with_map(policy, TestMapFile { tcp: tcp_map.into_iter().collect(), ..Default::default() }, Limits::default())
}

fn stack_with_map(policy: &str, map: TestMapFile, limits: Limits) -> (NetHandle, Guest, std::path::PathBuf, tempfile::TempDir) {
    stack_with_extras(policy, map, limits, Extras::default())
}

fn stack_with_extras(policy: &str, mut map: TestMapFile, limits: Limits, extras: Extras) -> (NetHandle, Guest, std::path::PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let violations = dir.path().join("violations");
    map.violations = Some(violations.clone());
    let (ours, theirs) = UnixStream::pair().expect("socketpair");
    let handle = NetHandle::start_with(ours, Policy::parse(policy).expect("policy"), extras, Reach::default(), Arc::new(TestMap::new(map)), limits);
    (handle, Guest::new(theirs), violations, dir)
}

const WEB: Ipv4Addr = Ipv4Addr::new(93, 184, 216, 34);

#[tokio::test]
async fn an_allowed_connection_is_made_from_the_host_with_half_close_both_ways() {
    let echo = echo_server().await;
    let (handle, mut guest, violations, _dir) = stack_with("allow@public:tcp:80", vec![(SocketAddr::from((WEB, 80)), echo)]);
    let h = guest.connect((WEB, 80), 40_000);
    // Half-close: the upstream sees EOF and still answers.
    let got = guest.exchange(h, &[b"ping"]).await.unwrap_or_else(|| panic!("the connection did not finish within {DEADLINE:?}"));
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

/// An echo request from the guest to `dst`, as its kernel would frame it.
fn echo_request(dst: Ipv4Addr, seq: u16) -> Vec<u8> {
    use smoltcp::wire::{EthernetFrame, EthernetProtocol, EthernetRepr, Icmpv4Packet, Icmpv4Repr, IpProtocol, Ipv4Packet, Ipv4Repr};
    let icmp = Icmpv4Repr::EchoRequest { ident: 0x42, seq_no: seq, data: b"hutch ping" };
    let ip = Ipv4Repr { src_addr: GUEST_IP, dst_addr: dst, next_header: IpProtocol::Icmp, payload_len: icmp.buffer_len(), hop_limit: 64 };
    let eth = EthernetRepr { src_addr: EthernetAddress(GUEST_MAC), dst_addr: EthernetAddress(GATEWAY_MAC), ethertype: EthernetProtocol::Ipv4 };
    let mut buf = vec![0; eth.buffer_len() + ip.buffer_len() + icmp.buffer_len()];
    let mut frame = EthernetFrame::new_unchecked(&mut buf[..]);
    eth.emit(&mut frame);
    let mut packet = Ipv4Packet::new_unchecked(frame.payload_mut());
    ip.emit(&mut packet, &smoltcp::phy::ChecksumCapabilities::default());
    icmp.emit(&mut Icmpv4Packet::new_unchecked(packet.payload_mut()), &smoltcp::phy::ChecksumCapabilities::default());
    buf
}

/// The ICMP message the stack sends the guest next: (from, type, seq or 0, data).
async fn next_icmp(guest: &mut Guest) -> (Ipv4Addr, smoltcp::wire::Icmpv4Message, u16, Vec<u8>) {
    use smoltcp::wire::{EthernetFrame, Icmpv4Packet, IpProtocol, Ipv4Packet};
    loop {
        let frame = tokio::time::timeout(DEADLINE, guest.frames.recv()).await.expect("a frame within the deadline").expect("link open");
        let eth = EthernetFrame::new_checked(&frame[..]).expect("ethernet");
        let Ok(ip) = Ipv4Packet::new_checked(eth.payload()) else { continue };
        if ip.next_header() != IpProtocol::Icmp {
            continue;
        }
        let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
        let seq = if icmp.msg_type() == smoltcp::wire::Icmpv4Message::EchoReply { icmp.echo_seq_no() } else { 0 };
        return (ip.src_addr(), icmp.msg_type(), seq, icmp.data().to_vec());
    }
}

#[tokio::test]
async fn echo_is_relayed_where_the_policy_allows_it_and_refused_elsewhere() {
    const PINGED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 9);
    const NOT_ALLOWED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
    let dir = tempfile::tempdir().expect("tempdir");
    let map = TestMapFile { icmp: [(PINGED, Ipv4Addr::LOCALHOST)].into(), violations: Some(dir.path().join("violations")), ..Default::default() };
    let (ours, theirs) = UnixStream::pair().expect("socketpair");
    let handle = NetHandle::start(ours, Policy::parse(&format!("allow@{PINGED}")).expect("policy"), Reach::default(), Arc::new(TestMap::new(map)), Limits::default());
    let mut guest = Guest::new(theirs);
    link::write_frames(&mut guest.wr, [echo_request(PINGED, 1)].into_iter()).await.expect("write");
    // The host's loopback answered; the guest hears it from the address it pinged.
    assert_eq!(next_icmp(&mut guest).await, (PINGED, smoltcp::wire::Icmpv4Message::EchoReply, 1, b"hutch ping".to_vec()));
    link::write_frames(&mut guest.wr, [echo_request(NOT_ALLOWED, 2)].into_iter()).await.expect("write");
    let (from, kind, _, _) = next_icmp(&mut guest).await;
    assert_eq!((from, kind), (NOT_ALLOWED, smoltcp::wire::Icmpv4Message::DstUnreachable));
    let log = handle.log();
    assert_eq!(log.denials.len(), 1);
    assert_eq!(log.denials[0].message, "no rule allows it");
    assert!(!dir.path().join("violations").exists(), "nothing unmapped was pinged");
}

#[tokio::test]
async fn this_network_and_unroutable_destinations_are_refused_before_any_dial() {
    // The host's kernel delivers a datagram for 0.0.0.0:P to its own 127.0.0.1:P; the
    // map does what it would, so a datagram that got past the policy would arrive.
    let listener = tokio::net::UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let forbidden = [Ipv4Addr::UNSPECIFIED, Ipv4Addr::new(0, 9, 9, 9), Ipv4Addr::BROADCAST, Ipv4Addr::new(240, 0, 0, 1), Ipv4Addr::new(224, 0, 0, 1)];
    let to_listener = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut map = TestMapFile::default();
    for ip in forbidden.iter().chain([&WEB]) {
        map.udp.insert(SocketAddr::from((*ip, port)), to_listener);
    }
    let (handle, mut guest, violations, _dir) = stack_with_map("allow@*", map, Limits::default());
    let datagrams = forbidden.iter().map(|ip| packets::udp_to_guest(SocketAddrV4::new(GUEST_IP, 50_000), SocketAddrV4::new(*ip, port), b"leak", MTU).expect("frame"));
    link::write_frames(&mut guest.wr, datagrams).await.expect("write");
    for _ in forbidden {
        assert_eq!(next_icmp(&mut guest).await.1, smoltcp::wire::Icmpv4Message::DstUnreachable);
    }
    // An allowed datagram after them: the first thing the listener hears.
    let marker = packets::udp_to_guest(SocketAddrV4::new(GUEST_IP, 50_000), SocketAddrV4::new(WEB, port), b"marker", MTU).expect("frame");
    link::write_frames(&mut guest.wr, [marker].into_iter()).await.expect("write");
    let mut buf = [0; 64];
    let n = tokio::time::timeout(DEADLINE, listener.recv(&mut buf)).await.expect("the allowed datagram within the deadline").expect("recv");
    assert_eq!(&buf[..n], b"marker", "a refused datagram reached the host's loopback");
    let messages: Vec<String> = handle.log().denials.iter().map(|d| d.message.clone()).collect();
    assert_eq!(
        messages,
        [
            "loopback addresses are never reachable from sandboxes",
            "loopback addresses are never reachable from sandboxes",
            "the broadcast address is never a sandbox's destination",
            "a reserved (240/4) address is never a sandbox's destination",
            "a multicast address is never a sandbox's destination",
        ]
    );
    assert!(!violations.exists());
}

/// Opens `count` guest connections to `to` and runs until each is established or
/// reset; how many were established.
async fn connect_all(guest: &mut Guest, to: (Ipv4Addr, u16), count: u16) -> (usize, Vec<smoltcp::iface::SocketHandle>) {
    let handles: Vec<_> = (0..count).map(|i| guest.connect(to, 42_000 + i)).collect();
    let settled = guest
        .run_until(|sockets| handles.iter().all(|h| matches!(sockets.get_mut::<smol_tcp::Socket>(*h).state(), smol_tcp::State::Established | smol_tcp::State::Closed)))
        .await;
    assert!(settled, "every connection is answered within {DEADLINE:?}");
    let established = handles.iter().filter(|h| guest.sockets.get_mut::<smol_tcp::Socket>(**h).state() == smol_tcp::State::Established).count();
    (established, handles)
}

#[tokio::test]
async fn dns_over_tcp_has_a_small_cap_inside_the_flow_cap_and_still_answers() {
    let map = TestMapFile { names: [("pypi.test".to_string(), vec![WEB])].into(), ..Default::default() };
    let (handle, mut guest, _violations, _dir) = stack_with_map("allow@public", map, Limits::default());
    let (established, handles) = connect_all(&mut guest, (GATEWAY_IP, 53), DNS_TCP_FLOWS as u16 + 4).await;
    assert_eq!(established, DNS_TCP_FLOWS);
    let log = handle.log();
    assert_eq!(log.counters.flows_denied, 4);
    assert!(log.denials.iter().all(|d| d.message == "the sandbox has too many connections open"), "{:?}", log.denials);
    // One of the admitted connections answers a question, length-prefixed.
    let h = handles[0];
    let query = {
        use hickory_proto::op::{Message, Query};
        use hickory_proto::rr::{Name, RecordType};
        let mut m = Message::new();
        m.set_id(7).add_query(Query::query(Name::from_ascii("pypi.test.").expect("name"), RecordType::A));
        m.to_vec().expect("encode")
    };
    let mut framed = (query.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&query);
    guest.sockets.get_mut::<smol_tcp::Socket>(h).send_slice(&framed).expect("send");
    let mut got = Vec::new();
    let answered = guest
        .run_until(|sockets| {
            let s = sockets.get_mut::<smol_tcp::Socket>(h);
            while s.can_recv() {
                let _ = s.recv(|b| {
                    got.extend_from_slice(b);
                    (b.len(), ())
                });
            }
            got.len() >= 2 && got.len() >= 2 + usize::from(u16::from_be_bytes([got[0], got[1]]))
        })
        .await;
    assert!(answered, "no answer within {DEADLINE:?}");
    let answer = hickory_proto::op::Message::from_vec(&got[2..]).expect("decode");
    assert_eq!(answer.answers().iter().map(|r| r.data().to_string()).collect::<Vec<_>>(), [WEB.to_string()]);
}

#[tokio::test]
async fn dns_over_tcp_counts_in_the_flow_cap() {
    let (handle, mut guest, _violations, _dir) = stack_with_map("none", TestMapFile::default(), Limits { max_flows: 3, ..Limits::default() });
    let (established, _) = connect_all(&mut guest, (WEB, 53), 5).await;
    assert_eq!(established, 3);
    assert_eq!(handle.log().counters.flows_denied, 2);
}

#[tokio::test]
async fn a_placeholder_in_a_plain_flow_resets_it_before_it_is_sent() {
    let echo = echo_server().await;
    let map = TestMapFile { tcp: [(SocketAddr::from((WEB, 80)), echo)].into_iter().collect(), ..Default::default() };
    let rules = serde_json::json!({"api.test": [{"transform": {"headers": {"Authorization": "${e2b.secrets.token}"}}}]});
    let transforms = crate::inspect::Transforms::from_e2b(&rules).expect("rules");
    let ca = Arc::new(crate::inspect::SandboxCa::generate().expect("ca"));
    let inspector = Arc::new(Inspector::new(ca, transforms, Arc::new(crate::inspect::Upstream::default()), None));
    let extras = Extras { inspector: Some(inspector), proxy: None };
    let (handle, mut guest, _violations, _dir) = stack_with_extras("allow@public:tcp:80", map, Limits::default(), extras);
    let h = guest.connect((WEB, 80), 40_001);
    // Percent-encoded and split across two writes: still found.
    let got = guest.exchange(h, &[b"GET /?k=%24%7Be2b%2Esec", b"rets%2Etoken%7D HTTP/1.1\r\n\r\n"]).await;
    let got = got.unwrap_or_else(|| panic!("the connection did not end within {DEADLINE:?}"));
    assert!(!got.starts_with(b"echo:GET"), "the upstream got the request: {:?}", String::from_utf8_lossy(&got));
    let denials = handle.log().denials;
    assert!(denials.iter().any(|d| matches!(d.reason, DenyReason::Placeholder { .. }) && d.port == Some(80)), "{denials:?}");
}
