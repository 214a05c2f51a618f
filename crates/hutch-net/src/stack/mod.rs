//! One sandbox's network: a userspace stack on the host end of the guest's NIC. The
//! guest talks to a fixed gateway; every TCP connection it opens ends here (smoltcp in
//! "any IP" mode answers for every address) and is re-made from the host after the
//! policy allows it and before the guest sees a SYN-ACK, so a denial or a failed dial
//! is an RST. UDP is relayed per flow, DNS is answered by `dns.rs`, pings get
//! "administratively prohibited". One task per sandbox runs it; dropping the handle
//! ends it and every flow.

mod device;
mod event;
mod icmp;
mod link;
/// Public for the `guest_frames` fuzz target: how the stack reads a guest's frame first.
pub mod packets;
mod tcp;
mod udp;
#[cfg(test)]
mod tests;

pub use link::{LinkError, MAX_FRAME};

use event::{Event, FlowKey};
use crate::dns::{self, DnsContext, Pins};
use crate::inspect::{self, Inspector};
use crate::socks5::{self, EgressProxy};
use crate::log::{LogView, NetLog};
use crate::rules::{DenyReason, Dest, Policy, Proto, Reach};
use crate::seam::Seam;
use packets::Inbound;
use parking_lot::{Mutex, RwLock};
use smoltcp::iface::{Config, Interface, SocketSet};
use smoltcp::wire::{EthernetAddress, HardwareAddress, Icmpv4DstUnreachable, IpAddress, IpCidr, IpListenEndpoint};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

pub use hutch_proto::net::{GATEWAY_IP, GATEWAY_MAC, GUEST_IP, GUEST_MAC, MTU, PREFIX_LEN};

/// Helper results waiting for the stack's loop.
const EVENTS_QUEUED: usize = 1024;
/// DNS questions a sandbox may have in flight at once, over UDP and TCP together.
const DNS_IN_FLIGHT: usize = 32;
/// DNS-over-TCP connections a sandbox may have open at once (inside its flow cap): a
/// resolver uses one for a truncated answer, so a handful is plenty, and each costs
/// a socket's buffers, a pipe and a task.
const DNS_TCP_FLOWS: usize = 8;
/// A DNS-over-TCP connection that sends no whole question for this long is closed
/// (RFC 7766 suggests seconds; BIND and Unbound use about this).
const DNS_TCP_IDLE: Duration = Duration::from_secs(10);
/// Echo requests waiting for their replies at once.
const ECHOES_IN_FLIGHT: usize = 32;

/// The operator's limits for one sandbox's stack.
#[derive(Debug, Clone)]
pub struct Limits {
    /// TCP connections and UDP flows open at once. With 2 × 256 KiB of socket buffer
    /// per connection, 256 bounds a sandbox's stack at about 128 MiB.
    pub max_flows: usize,
    pub dial_timeout: Duration,
    pub udp_idle: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_flows: 256, dial_timeout: Duration::from_secs(10), udp_idle: Duration::from_secs(60) }
    }
}

/// What a stack applies besides its policy.
#[derive(Default)]
pub struct Extras {
    pub inspector: Option<Arc<Inspector>>,
    pub proxy: Option<EgressProxy>,
}

/// What the stack and its reporters share.
pub struct Shared {
    policy: RwLock<Arc<Policy>>,
    /// TLS inspection for the hosts with header rules (none without rules).
    inspector: inspect::flow::Current,
    /// The SOCKS5 proxy allowed TCP goes through (none: dialed directly).
    proxy: RwLock<Option<Arc<EgressProxy>>>,
    proxy_at: ProxyAt,
    pub reach: Reach,
    pub seam: Arc<dyn Seam>,
    pins: Mutex<Pins>,
    pub log: NetLog,
    link: tokio::sync::watch::Sender<LinkState>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkState {
    Up,
    /// The link to QEMU ended; the sentence says why.
    Lost(String),
}

impl Shared {
    pub fn policy(&self) -> Arc<Policy> {
        self.policy.read().clone()
    }

    async fn answer_dns(&self, query: &[u8]) -> Option<Vec<u8>> {
        let policy = self.policy();
        let cx = DnsContext { policy: &policy, reach: &self.reach, seam: self.seam.as_ref(), pins: &self.pins, log: &self.log };
        dns::answer(query, &cx).await
    }
}

/// A running stack. Dropping it ends the stack and all its flows.
pub struct NetHandle {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for NetHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl NetHandle {
    /// Starts the stack on `link` (a connection to QEMU's stream netdev).
    pub fn start(link: UnixStream, policy: Policy, reach: Reach, seam: Arc<dyn Seam>, limits: Limits) -> NetHandle {
        Self::start_with(link, policy, Extras::default(), reach, seam, limits)
    }

    /// `start`, with the inspection and egress proxy in force from the first frame.
    pub fn start_with(link: UnixStream, policy: Policy, extras: Extras, reach: Reach, seam: Arc<dyn Seam>, limits: Limits) -> NetHandle {
        let shared = Arc::new(Shared {
            policy: RwLock::new(Arc::new(policy)),
            inspector: Arc::new(RwLock::new(extras.inspector)),
            proxy: RwLock::new(extras.proxy.map(Arc::new)),
            proxy_at: Default::default(),
            reach,
            seam,
            pins: Mutex::new(Pins::default()),
            log: NetLog::default(),
            link: tokio::sync::watch::Sender::new(LinkState::Up),
        });
        let task = tokio::spawn({
            let shared = shared.clone();
            async move {
                let why = run(link, shared.clone(), limits).await;
                // QEMU closes the link when its VM ends; anything else is a fault.
                match why {
                    LinkError::Closed => tracing::debug!("sandbox network link ended: {why}"),
                    _ => tracing::warn!("sandbox network link failed: {why}"),
                }
                shared.link.send_replace(LinkState::Lost(why.to_string()));
            }
        });
        NetHandle { shared, task }
    }

    /// Replaces the policy: new flows and names follow it; open flows stay.
    pub fn set_policy(&self, policy: Policy) {
        *self.shared.policy.write() = Arc::new(policy);
    }

    pub fn policy(&self) -> Arc<Policy> {
        self.shared.policy()
    }

    /// Replaces the egress proxy: new connections go through it; open ones stay.
    pub fn set_egress_proxy(&self, proxy: Option<EgressProxy>) {
        *self.shared.proxy.write() = proxy.map(Arc::new);
    }

    /// Replaces the inspection of hosts with rules: new flows follow it; open ones stay.
    pub fn set_inspector(&self, inspector: Option<Arc<Inspector>>) {
        *self.shared.inspector.write() = inspector;
    }

    pub fn log(&self) -> LogView {
        let mut view = self.shared.log.view();
        if let LinkState::Lost(why) = self.link() {
            view.link_lost = Some(why);
        }
        view
    }

    pub fn link(&self) -> LinkState {
        self.shared.link.borrow().clone()
    }

    /// Waits until the link is lost; why it was.
    pub async fn link_lost(&self) -> String {
        let mut rx = self.shared.link.subscribe();
        match rx.wait_for(|s| *s != LinkState::Up).await.map(|s| s.clone()) {
            Ok(LinkState::Lost(why)) => why,
            _ => "the stack ended".into(),
        }
    }
}


struct Stack {
    shared: Arc<Shared>,
    limits: Limits,
    iface: Interface,
    dev: device::Queues,
    sockets: SocketSet<'static>,
    tcp: HashMap<FlowKey, tcp::TcpFlow>,
    /// SYNs waiting for their dial, by connection, with what the gate needs when
    /// the flow is to a host with a rule.
    dialing: HashMap<FlowKey, (Vec<u8>, Option<inspect::flow::Flow>)>,
    udp: udp::UdpFlows,
    tasks: JoinSet<()>,
    events: mpsc::Sender<Event>,
    /// DNS questions being answered: a guest cannot queue unbounded host lookups.
    dns_slots: Arc<tokio::sync::Semaphore>,
    /// Echo requests waiting for replies, bounded like DNS questions.
    echo_slots: Arc<tokio::sync::Semaphore>,
    wake: Arc<Notify>,
    epoch: Instant,
}

fn smol_now(epoch: Instant) -> smoltcp::time::Instant {
    smoltcp::time::Instant::from_micros(epoch.elapsed().as_micros() as i64)
}

async fn run(link: UnixStream, shared: Arc<Shared>, limits: Limits) -> LinkError {
    let (rd, mut wr) = link.into_split();
    let (frames_tx, mut frames) = mpsc::channel(256);
    // Bounded: a dial's result waits for room, a datagram finding none is dropped
    // (UDP's own rules), so an upstream flooding a flow costs the host no memory.
    let (events_tx, mut events) = mpsc::channel(EVENTS_QUEUED);
    let mut reader = tokio::spawn(link::read_frames(rd, frames_tx));
    let epoch = Instant::now();
    let mut dev = device::Queues { rx: Default::default(), tx: Default::default(), frame_mtu: MTU + 14 };
    let mut config = Config::new(HardwareAddress::Ethernet(EthernetAddress(GATEWAY_MAC)));
    config.random_seed = rand::random();
    let mut iface = Interface::new(config, &mut dev, smol_now(epoch));
    iface.update_ip_addrs(|a| {
        let _ = a.push(IpCidr::new(IpAddress::Ipv4(GATEWAY_IP), PREFIX_LEN));
    });
    // "Any IP": smoltcp accepts packets for every address it routes via itself.
    iface.set_any_ip(true);
    let _ = iface.routes_mut().add_default_ipv4_route(GATEWAY_IP);
    let mut stack = Stack {
        shared,
        limits: limits.clone(),
        iface,
        dev,
        sockets: SocketSet::new(Vec::new()),
        tcp: HashMap::new(),
        dialing: HashMap::new(),
        udp: udp::UdpFlows::new(limits.udp_idle),
        tasks: JoinSet::new(),
        events: events_tx,
        dns_slots: Arc::new(tokio::sync::Semaphore::new(DNS_IN_FLIGHT)),
        echo_slots: Arc::new(tokio::sync::Semaphore::new(ECHOES_IN_FLIGHT)),
        wake: Arc::new(Notify::new()),
        epoch,
    };
    loop {
        let delay = stack.iface.poll_delay(smol_now(epoch), &stack.sockets).map(|d| Duration::from_micros(d.total_micros())).unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(1));
        let wake = stack.wake.clone();
        tokio::select! {
            frame = frames.recv() => match frame {
                Some(f) => stack.inbound(f),
                None => return reader.await.unwrap_or(LinkError::Closed),
            },
            Some(ev) = events.recv() => stack.event(ev),
            _ = wake.notified() => {}
            _ = tokio::time::sleep(delay) => {}
            ended = &mut reader => return ended.unwrap_or(LinkError::Closed),
        }
        // Take everything that is already here before polling once.
        while let Ok(f) = frames.try_recv() {
            stack.inbound(f);
        }
        while let Ok(ev) = events.try_recv() {
            stack.event(ev);
        }
        stack.poll();
        if let Err(e) = link::write_frames(&mut wr, stack.dev.tx.drain(..)).await {
            return e;
        }
        while stack.tasks.try_join_next().is_some() {}
    }
}

impl Stack {
    fn flows(&self) -> usize {
        self.tcp.len() + self.dialing.len() + self.udp.len()
    }

    fn names_for(&self, ip: Ipv4Addr) -> Vec<String> {
        self.shared.pins.lock().names(ip, Instant::now())
    }

    /// The inspector and the guest's names for `dst`, when a flow there goes through
    /// the gate.
    fn inspected(&self, dst: SocketAddrV4) -> Option<(Arc<Inspector>, Vec<String>)> {
        let inspector = self.shared.inspector.read().clone()?;
        let names = self.names_for(*dst.ip());
        inspector.wants(dst.port(), &names).then_some((inspector, names))
    }

    /// The policy's answer for a new flow, logged when it is no.
    fn decide(&self, proto: Proto, dst: SocketAddrV4) -> Result<(), DenyReason> {
        let names = self.names_for(*dst.ip());
        let dest = Dest { ip: IpAddr::V4(*dst.ip()), proto, port: dst.port(), names: &names };
        let verdict = self.shared.policy().check(&dest, &self.shared.reach).map(|_| ()).and_then(|()| {
            if self.flows() >= self.limits.max_flows {
                Err(DenyReason::ConnectionLimit)
            } else {
                Ok(())
            }
        });
        match &verdict {
            Ok(()) => self.shared.log.flow_allowed(),
            Err(reason) => self.shared.log.flow_denied(proto, dest.ip, dst.port(), names.first().cloned(), reason.clone()),
        }
        verdict
    }

    fn inbound(&mut self, frame: Vec<u8>) {
        match packets::classify(&frame, GATEWAY_IP) {
            Inbound::TcpSyn { src, dst } => self.syn(frame, src, dst),
            Inbound::Udp { src, dst, payload } => {
                let payload = payload.to_vec();
                self.datagram(&frame, src, dst, payload)
            }
            Inbound::Ping { src, dst, ident, seq, data } => {
                let data = data.to_vec();
                self.ping(&frame, src, dst, ident, seq, data)
            }
            Inbound::Other => self.dev.rx.push_back(frame),
        }
    }

    fn syn(&mut self, frame: Vec<u8>, src: SocketAddrV4, dst: SocketAddrV4) {
        let key = (src, dst);
        if self.tcp.contains_key(&key) {
            // A retransmitted SYN: the connection's socket answers it.
            self.dev.rx.push_back(frame);
            return;
        }
        if self.dialing.contains_key(&key) {
            return;
        }
        if dst.port() == 53 {
            // DNS over TCP, to whatever address: the stack's own server, inside the
            // flow cap and a small cap of its own, checked before anything is made.
            let dns_flows = self.tcp.keys().filter(|(_, d)| d.port() == 53).count();
            if self.flows() >= self.limits.max_flows || dns_flows >= DNS_TCP_FLOWS {
                self.shared.log.flow_denied(Proto::Tcp, IpAddr::V4(*dst.ip()), dst.port(), None, DenyReason::ConnectionLimit);
                self.dev.tx.extend(packets::refuse_syn(&frame));
                return;
            }
            let (ours, theirs) = tokio::io::duplex(4 * 1024);
            self.tasks.spawn(serve_dns_tcp(theirs, self.shared.clone(), self.dns_slots.clone()));
            self.open(key, frame, ours, false);
            return;
        }
        if *dst.ip() == GATEWAY_IP {
            self.dev.tx.extend(packets::refuse_syn(&frame));
            return;
        }
        if self.decide(Proto::Tcp, dst).is_err() {
            self.dev.tx.extend(packets::refuse_syn(&frame));
            return;
        }
        let gate = self.inspected(dst).map(|(inspector, names)| inspect::flow::Flow { dst, names, inspector, current: self.shared.inspector.clone(), log: self.shared.log.clone(), client_certificate: Default::default() });
        let proxy = self.shared.proxy.read().clone();
        // Through a proxy, the proxy reaches the destination; hutch dials only the proxy.
        let dial = match proxy {
            // By the address the policy checked, never by name: a proxy resolving a
            // guest's name itself could be sent into its own network (the name's owner
            // answers the proxy differently), past hutch's rebinding checks.
            Some(proxy) => Dial::Proxy { proxy, target: socks5::Target::Addr(dst), at: self.shared.proxy_at.clone(), seam: self.shared.seam.clone(), reach: self.shared.reach.clone() },
            None => match self.shared.seam.route(SocketAddr::V4(dst), Proto::Tcp) {
                Ok(route) => Dial::Direct(route),
                Err(e) => {
                    self.shared.log.flow_denied(Proto::Tcp, IpAddr::V4(*dst.ip()), dst.port(), None, DenyReason::DialFailed { error: e.0 });
                    self.dev.tx.extend(packets::refuse_syn(&frame));
                    return;
                }
            },
        };
        self.dialing.insert(key, (frame, gate));
        let events = self.events.clone();
        let timeout = self.limits.dial_timeout;
        self.tasks.spawn(async move {
            let result = match tokio::time::timeout(timeout, dial.connect()).await {
                Ok(r) => r,
                Err(_) => Err(format!("no answer within {} s", timeout.as_secs())),
            };
            let _ = events.send(Event::Dialed { key, result }).await;
        });
    }

    /// Opens the guest's side of an allowed connection and replays its SYN into it.
    fn open<S>(&mut self, key: FlowKey, syn: Vec<u8>, upstream: S, scan: bool)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    {
        let (_, dst) = key;
        let mut socket = tcp::new_socket();
        if socket.listen(IpListenEndpoint { addr: Some(IpAddress::Ipv4(*dst.ip())), port: dst.port() }).is_err() {
            self.dev.tx.extend(packets::refuse_syn(&syn));
            return;
        }
        let handle = self.sockets.add(socket);
        let (flow, pump) = tcp::start(handle, upstream, scan, self.wake.clone());
        self.tasks.spawn(pump);
        self.tcp.insert(key, flow);
        // First in line, so no other SYN to the same address reaches the listener.
        self.dev.rx.push_front(syn);
    }

    fn event(&mut self, ev: Event) {
        match ev {
            Event::Dialed { key, result } => {
                let Some((syn, gate)) = self.dialing.remove(&key) else { return };
                let scan = self.scans();
                match (result, gate) {
                    (Ok(stream), None) => {
                        let _ = stream.set_nodelay(true);
                        self.open(key, syn, stream, scan)
                    }
                    (Ok(stream), Some(flow)) => {
                        let _ = stream.set_nodelay(true);
                        // The smoltcp socket buffers in front of it; this only joins
                        // the two, so it stays small (hyper and TLS buffer too).
                        let (ours, theirs) = tokio::io::duplex(64 * 1024);
                        self.tasks.spawn(inspect::gate(theirs, stream, flow));
                        self.open(key, syn, ours, scan)
                    }
                    (Err(error), _) => {
                        let (_, dst) = key;
                        self.shared.log.flow_denied(Proto::Tcp, IpAddr::V4(*dst.ip()), dst.port(), None, DenyReason::DialFailed { error });
                        self.dev.tx.extend(packets::refuse_syn(&syn));
                    }
                }
            }
            Event::Datagram { from, to, payload } => {
                self.dev.tx.extend(packets::udp_to_guest(from, to, &payload, MTU));
            }
            Event::Frame(frame) => self.dev.tx.push_back(frame),
        }
    }

    /// Whether what the guest sends is scanned for secrets' placeholders: while its
    /// rules name secrets.
    fn scans(&self) -> bool {
        self.shared.inspector.read().as_ref().is_some_and(|i| i.scans())
    }

    fn leaked(&self, proto: Proto, dst: SocketAddrV4, form: crate::scan::Form) {
        self.shared.log.placeholder_sent(proto, IpAddr::V4(*dst.ip()), dst.port(), self.names_for(*dst.ip()).first().cloned(), form);
    }

    fn datagram(&mut self, frame: &[u8], src: SocketAddrV4, dst: SocketAddrV4, payload: Vec<u8>) {
        // DNS questions are not scanned: a name may carry a placeholder's text, never a
        // value.
        if dst.port() != 53 && self.scans() {
            if let Some(form) = crate::scan::find(&payload) {
                self.leaked(Proto::Udp, dst, form);
                return;
            }
        }
        if dst.port() == 53 {
            // More questions than slots are dropped: the guest's resolver asks again.
            let Ok(slot) = self.dns_slots.clone().try_acquire_owned() else { return };
            let shared = self.shared.clone();
            let events = self.events.clone();
            self.tasks.spawn(async move {
                if let Some(answer) = shared.answer_dns(&payload).await {
                    let _ = events.try_send(Event::Datagram { from: dst, to: src, payload: answer });
                }
                drop(slot);
            });
            return;
        }
        if self.udp.send(src, dst, &payload) {
            return;
        }
        if dst.port() == 443 && self.inspected(dst).is_some() {
            // QUIC would carry HTTP past the rule: refused at once, so clients fall
            // back to TCP (browsers, curl and Go's HTTP/3 clients all do).
            let error = "QUIC to a host with a network rule is refused so the client uses TLS over TCP".to_string();
            self.shared.log.flow_denied(Proto::Udp, IpAddr::V4(*dst.ip()), dst.port(), self.names_for(*dst.ip()).first().cloned(), DenyReason::Inspection { error });
            self.dev.tx.extend(packets::unreachable(frame, Icmpv4DstUnreachable::PortUnreachable));
            return;
        }
        if self.decide(Proto::Udp, dst).is_err() {
            self.dev.tx.extend(packets::unreachable(frame, Icmpv4DstUnreachable::PortUnreachable));
            return;
        }
        match self.shared.seam.route(SocketAddr::V4(dst), Proto::Udp) {
            Ok(route) => {
                if let Err(e) = self.udp.open(src, dst, route, &payload, &mut self.tasks, self.events.clone()) {
                    self.shared.log.flow_denied(Proto::Udp, IpAddr::V4(*dst.ip()), dst.port(), None, DenyReason::DialFailed { error: e.to_string() });
                    self.dev.tx.extend(packets::unreachable(frame, Icmpv4DstUnreachable::PortUnreachable));
                }
            }
            Err(e) => {
                self.shared.log.flow_denied(Proto::Udp, IpAddr::V4(*dst.ip()), dst.port(), None, DenyReason::DialFailed { error: e.0 });
                self.dev.tx.extend(packets::unreachable(frame, Icmpv4DstUnreachable::PortUnreachable));
            }
        }
    }

    /// An echo request: relayed when the policy allows ICMP to `dst`, else refused at once
    /// ("administratively prohibited", so the guest hears why instead of a timeout).
    fn ping(&mut self, frame: &[u8], guest: Ipv4Addr, dst: Ipv4Addr, ident: u16, seq: u16, data: Vec<u8>) {
        let refusal = packets::unreachable(frame, Icmpv4DstUnreachable::CommProhibited);
        if self.decide(Proto::Icmp, SocketAddrV4::new(dst, 0)).is_err() {
            self.dev.tx.extend(refusal);
            return;
        }
        let to = match self.shared.seam.route(SocketAddr::V4(SocketAddrV4::new(dst, 0)), Proto::Icmp) {
            Ok(SocketAddr::V4(to)) => *to.ip(),
            Ok(SocketAddr::V6(_)) => return,
            Err(e) => {
                self.shared.log.flow_denied(Proto::Icmp, IpAddr::V4(dst), 0, None, DenyReason::DialFailed { error: e.0 });
                self.dev.tx.extend(refusal);
                return;
            }
        };
        // More echoes in flight than slots are dropped, as on a congested network.
        let Ok(slot) = self.echo_slots.clone().try_acquire_owned() else { return };
        let Ok(thread) = icmp::ECHO_THREADS.try_acquire() else { return };
        let (shared, events) = (self.shared.clone(), self.events.clone());
        self.tasks.spawn(async move {
            let echo = icmp::Echo { to, ident, seq, data };
            let sent = tokio::task::spawn_blocking(move || icmp::send_and_wait(&echo, icmp::ECHO_WAIT)).await;
            let reply = match sent {
                Ok(Ok(Some(data))) => packets::echo_reply(dst, guest, ident, seq, &data, MTU),
                Ok(Ok(None)) | Err(_) => None,
                Ok(Err(e)) => {
                    shared.log.flow_denied(Proto::Icmp, IpAddr::V4(dst), 0, None, DenyReason::DialFailed { error: e.to_string() });
                    refusal
                }
            };
            if let Some(frame) = reply {
                let _ = events.try_send(Event::Frame(frame));
            }
            drop((slot, thread));
        });
    }

    /// Lets smoltcp run and moves data until nothing more moves.
    fn poll(&mut self) {
        for _ in 0..64 {
            let now = smol_now(self.epoch);
            let changed = self.iface.poll(now, &mut self.dev, &mut self.sockets);
            let mut moved = false;
            let mut done = Vec::new();
            let mut leaks = Vec::new();
            for (key, flow) in self.tcp.iter_mut() {
                let (m, alive) = flow.service(&mut self.sockets);
                moved |= m;
                if !alive {
                    done.push(*key);
                }
                if let Some(form) = flow.take_leak() {
                    leaks.push((key.1, form));
                }
            }
            for (dst, form) in leaks {
                self.leaked(Proto::Tcp, dst, form);
            }
            for key in done {
                if let Some(flow) = self.tcp.remove(&key) {
                    self.sockets.remove(flow.handle);
                }
            }
            if changed == smoltcp::iface::PollResult::None && !moved && self.dev.rx.is_empty() {
                break;
            }
        }
        self.udp.expire(Instant::now());
    }
}

/// How an allowed TCP flow's upstream is opened.
enum Dial {
    Direct(SocketAddr),
    Proxy { proxy: Arc<EgressProxy>, target: socks5::Target, at: ProxyAt, seam: Arc<dyn Seam>, reach: Reach },
}

/// The proxy's checked address, kept a few seconds: a guest's stream of SYNs is not a
/// stream of lookups on the resolver every sandbox shares.
type ProxyAt = Arc<tokio::sync::Mutex<Option<(Instant, Arc<EgressProxy>, SocketAddr)>>>;
const PROXY_ADDRESS_KEPT: Duration = Duration::from_secs(5);

impl Dial {
    async fn connect(self) -> Result<tokio::net::TcpStream, String> {
        match self {
            Dial::Direct(route) => tokio::net::TcpStream::connect(route).await.map_err(|e| e.to_string()),
            Dial::Proxy { proxy, target, at, seam, reach } => {
                let at = {
                    let mut kept = at.lock().await;
                    match &*kept {
                        Some((when, of, addr)) if Arc::ptr_eq(of, &proxy) && when.elapsed() < PROXY_ADDRESS_KEPT => *addr,
                        _ => {
                            let addr = proxy_address(&proxy, seam.as_ref(), &reach).await.map_err(|e| format!("the egress proxy {}:{}: {e}", proxy.host, proxy.port))?;
                            *kept = Some((Instant::now(), proxy.clone(), addr));
                            addr
                        }
                    }
                };
                let mut stream = tokio::net::TcpStream::connect(at).await.map_err(|e| format!("the egress proxy {}:{} did not accept: {e}", proxy.host, proxy.port))?;
                socks5::connect(&mut stream, &target, proxy.login()).await.map_err(|e| format!("the egress proxy {}:{}: {e}", proxy.host, proxy.port))?;
                Ok(stream)
            }
        }
    }
}

/// Where to dial `proxy`: its name resolved now (as E2B does at every dial), refused
/// when it resolves into a range the operator protects.
pub async fn proxy_address(proxy: &EgressProxy, seam: &dyn Seam, reach: &Reach) -> Result<SocketAddr, String> {
    let ip = match proxy.host.parse::<Ipv4Addr>() {
        Ok(ip) => ip,
        Err(_) => *seam.lookup(&proxy.host).await.map_err(|e| format!("its name does not resolve: {e}"))?.first().ok_or("its name has no IPv4 address")?,
    };
    if let Some(reason) = reach.refusal(IpAddr::V4(ip)) {
        return Err(format!("it resolves to an address sandboxes may not reach ({reason})"));
    }
    seam.route(SocketAddr::V4(SocketAddrV4::new(ip, proxy.port)), Proto::Tcp).map_err(|e| e.0)
}

/// DNS over TCP: two-byte length, message, both ways. Each question takes one of the
/// sandbox's DNS slots, as a UDP one does; a connection idle for `DNS_TCP_IDLE`, or
/// slow to send a whole question, is closed.
async fn serve_dns_tcp(mut conn: tokio::io::DuplexStream, shared: Arc<Shared>, slots: Arc<tokio::sync::Semaphore>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let question = async {
            let len = conn.read_u16().await?;
            let mut query = vec![0; usize::from(len)];
            conn.read_exact(&mut query).await?;
            Ok::<_, std::io::Error>(query)
        };
        let Ok(Ok(query)) = tokio::time::timeout(DNS_TCP_IDLE, question).await else { return };
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let answer = shared.answer_dns(&query).await;
        drop(slot);
        let Some(answer) = answer else { return };
        let Ok(len) = u16::try_from(answer.len()) else { return };
        if conn.write_u16(len).await.is_err() || conn.write_all(&answer).await.is_err() {
            return;
        }
    }
}
