//! Frames from the guest's NIC, as the stack first reads them: classifying one (SYN,
//! datagram, echo or smoltcp's), and making the refusals that quote it (an RST for a
//! SYN, ICMP unreachable), never panics on any bytes.
#![no_main]
use hutch_net::stack::packets::{classify, refuse_syn, unreachable, Inbound};
use hutch_net::stack::GATEWAY_IP;
use libfuzzer_sys::fuzz_target;
use smoltcp::wire::Icmpv4DstUnreachable;

fuzz_target!(|frame: &[u8]| {
    match classify(frame, GATEWAY_IP) {
        Inbound::TcpSyn { .. } => {
            let _ = refuse_syn(frame);
        }
        Inbound::Udp { payload, .. } => {
            assert!(payload.len() <= frame.len());
            let _ = unreachable(frame, Icmpv4DstUnreachable::PortUnreachable);
        }
        Inbound::Ping { data, .. } => {
            assert!(data.len() <= frame.len());
            let _ = unreachable(frame, Icmpv4DstUnreachable::CommProhibited);
        }
        Inbound::Other => {}
    }
});
