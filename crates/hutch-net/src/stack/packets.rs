//! Reading the guest's frames before smoltcp does (new TCP connections, UDP, ICMP are
//! the stack's to decide), and writing the frames the stack answers with itself.

use hutch_proto::net::{GATEWAY_MAC, GUEST_MAC};
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr, Icmpv4DstUnreachable, Icmpv4Packet, Icmpv4Repr, IpProtocol, Ipv4Packet, Ipv4Repr,
    TcpControl, TcpPacket, TcpRepr, TcpSeqNumber, UdpPacket, UdpRepr,
};
use std::net::{Ipv4Addr, SocketAddrV4};

/// What a guest frame is, for the stack.
#[derive(Debug)]
pub enum Inbound<'a> {
    /// A TCP SYN opening a connection.
    TcpSyn { src: SocketAddrV4, dst: SocketAddrV4 },
    Udp { src: SocketAddrV4, dst: SocketAddrV4, payload: &'a [u8] },
    /// An ICMP echo request to `dst`.
    Ping { src: Ipv4Addr, dst: Ipv4Addr, ident: u16, seq: u16, data: &'a [u8] },
    /// Everything else (ARP, segments of open connections, pings to the gateway):
    /// smoltcp's.
    Other,
}

pub fn classify(frame: &[u8], gateway: Ipv4Addr) -> Inbound<'_> {
    let Ok(eth) = EthernetFrame::new_checked(frame) else { return Inbound::Other };
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return Inbound::Other;
    }
    let Ok(ip) = Ipv4Packet::new_checked(&frame[EthernetFrame::<&[u8]>::header_len()..]) else { return Inbound::Other };
    // Fragments are smoltcp's to drop: the guest's MTU is the link's, so it sends none.
    if ip.more_frags() || ip.frag_offset() != 0 {
        return Inbound::Other;
    }
    let (src_ip, dst_ip) = (ip.src_addr(), ip.dst_addr());
    let header_len = usize::from(ip.header_len());
    let total = usize::from(ip.total_len()).min(frame.len() - EthernetFrame::<&[u8]>::header_len());
    let body = &frame[EthernetFrame::<&[u8]>::header_len()..][header_len..total];
    match ip.next_header() {
        IpProtocol::Tcp => match TcpPacket::new_checked(body) {
            Ok(tcp) if tcp.syn() && !tcp.ack() => Inbound::TcpSyn { src: SocketAddrV4::new(src_ip, tcp.src_port()), dst: SocketAddrV4::new(dst_ip, tcp.dst_port()) },
            _ => Inbound::Other,
        },
        IpProtocol::Udp => match UdpPacket::new_checked(body) {
            Ok(udp) => {
                let len = usize::from(udp.len()).min(body.len());
                Inbound::Udp { src: SocketAddrV4::new(src_ip, udp.src_port()), dst: SocketAddrV4::new(dst_ip, udp.dst_port()), payload: &body[8..len.max(8)] }
            }
            Err(_) => Inbound::Other,
        },
        IpProtocol::Icmp if dst_ip != gateway => match Icmpv4Packet::new_checked(body) {
            // An echo's data follows its 8-byte header (new_checked saw that much).
            Ok(icmp) if icmp.msg_type() == smoltcp::wire::Icmpv4Message::EchoRequest => {
                Inbound::Ping { src: src_ip, dst: dst_ip, ident: icmp.echo_ident(), seq: icmp.echo_seq_no(), data: &body[8..] }
            }
            _ => Inbound::Other,
        },
        _ => Inbound::Other,
    }
}

fn ethernet(ip: &Ipv4Repr, emit_body: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let eth = EthernetRepr { src_addr: EthernetAddress(GATEWAY_MAC), dst_addr: EthernetAddress(GUEST_MAC), ethertype: EthernetProtocol::Ipv4 };
    let mut buf = vec![0; eth.buffer_len() + ip.buffer_len() + ip.payload_len];
    let mut frame = EthernetFrame::new_unchecked(&mut buf[..]);
    eth.emit(&mut frame);
    let mut packet = Ipv4Packet::new_unchecked(frame.payload_mut());
    ip.emit(&mut packet, &ChecksumCapabilities::default());
    emit_body(packet.payload_mut());
    buf
}

/// The RST that refuses the guest's SYN (`syn` is that SYN's frame): the guest sees
/// ECONNREFUSED at once.
pub fn refuse_syn(syn: &[u8]) -> Option<Vec<u8>> {
    let eth = EthernetFrame::new_checked(syn).ok()?;
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
    let rst = TcpRepr {
        src_port: tcp.dst_port(),
        dst_port: tcp.src_port(),
        control: TcpControl::Rst,
        seq_number: TcpSeqNumber(0),
        ack_number: Some(tcp.seq_number() + 1 + tcp.payload().len()),
        window_len: 0,
        window_scale: None,
        max_seg_size: None,
        sack_permitted: false,
        sack_ranges: [None, None, None],
        timestamp: None,
        payload: &[],
    };
    let (src, dst) = (ip.dst_addr(), ip.src_addr());
    let repr = Ipv4Repr { src_addr: src, dst_addr: dst, next_header: IpProtocol::Tcp, payload_len: rst.buffer_len(), hop_limit: 64 };
    Some(ethernet(&repr, |body| {
        let mut packet = TcpPacket::new_unchecked(body);
        rst.emit(&mut packet, &src.into(), &dst.into(), &ChecksumCapabilities::default());
    }))
}

/// A UDP datagram from `src` to the guest; None when it would not fit the link.
pub fn udp_to_guest(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8], ip_mtu: usize) -> Option<Vec<u8>> {
    let udp = UdpRepr { src_port: src.port(), dst_port: dst.port() };
    let udp_len = udp.header_len() + payload.len();
    if 20 + udp_len > ip_mtu {
        return None;
    }
    let repr = Ipv4Repr { src_addr: *src.ip(), dst_addr: *dst.ip(), next_header: IpProtocol::Udp, payload_len: udp_len, hop_limit: 64 };
    Some(ethernet(&repr, |body| {
        let mut packet = UdpPacket::new_unchecked(body);
        udp.emit(&mut packet, &(*src.ip()).into(), &(*dst.ip()).into(), payload.len(), |p| p.copy_from_slice(payload), &ChecksumCapabilities::default());
    }))
}

/// An echo reply to the guest from the address it pinged; None when it would not fit.
pub fn echo_reply(from: Ipv4Addr, to: Ipv4Addr, ident: u16, seq: u16, data: &[u8], ip_mtu: usize) -> Option<Vec<u8>> {
    let icmp = Icmpv4Repr::EchoReply { ident, seq_no: seq, data };
    if 20 + icmp.buffer_len() > ip_mtu {
        return None;
    }
    let repr = Ipv4Repr { src_addr: from, dst_addr: to, next_header: IpProtocol::Icmp, payload_len: icmp.buffer_len(), hop_limit: 64 };
    Some(ethernet(&repr, |body| {
        let mut packet = Icmpv4Packet::new_unchecked(body);
        icmp.emit(&mut packet, &ChecksumCapabilities::default());
    }))
}

/// ICMP "destination unreachable" for the guest's packet in `frame`: port unreachable
/// (ECONNREFUSED for UDP) or administratively prohibited.
pub fn unreachable(frame: &[u8], reason: Icmpv4DstUnreachable) -> Option<Vec<u8>> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    let header = Ipv4Repr::parse(&ip, &ChecksumCapabilities::ignored()).ok()?;
    let data = &ip.payload()[..ip.payload().len().min(8)];
    let icmp = Icmpv4Repr::DstUnreachable { reason, header, data };
    let repr = Ipv4Repr { src_addr: ip.dst_addr(), dst_addr: ip.src_addr(), next_header: IpProtocol::Icmp, payload_len: icmp.buffer_len(), hop_limit: 64 };
    Some(ethernet(&repr, |body| {
        let mut packet = Icmpv4Packet::new_unchecked(body);
        icmp.emit(&mut packet, &ChecksumCapabilities::default());
    }))
}
