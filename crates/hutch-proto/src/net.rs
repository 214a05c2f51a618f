//! The network every sandbox sees. Each sandbox has a stack of its own on the host, so
//! every guest gets the same addresses, and template snapshots and their clones stay
//! valid: guest 198.18.0.2/30, gateway and DNS server 198.18.0.1, in RFC 2544's
//! benchmarking range, which is never a real destination.

use std::net::Ipv4Addr;

pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const PREFIX_LEN: u8 = 30;
pub const NETMASK: Ipv4Addr = Ipv4Addr::new(255, 255, 255, 252);
pub const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x68, 0x75, 0x02];
pub const GATEWAY_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x68, 0x75, 0x01];
/// The guest's IP MTU (QEMU's `host_mtu`): large frames are the stream netdev's main
/// throughput lever, and 65 520 + 14 stays under QEMU's 69 632-byte frame buffer.
pub const MTU: usize = 65_520;
/// The interface the kernel names the guest's only NIC.
pub const GUEST_IFACE: &str = "eth0";
