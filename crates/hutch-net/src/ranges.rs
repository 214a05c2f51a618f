//! Named address groups: the ranges policy rules can name (`public`, `private`, …),
//! built from IANA's special-purpose registries. `public` is what is left: any address
//! in no special-purpose range and not one of this host's own.

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Group {
    Public,
    Private,
    Loopback,
    LinkLocal,
    Metadata,
    Multicast,
    /// This machine's own addresses (every interface's).
    Host,
}

impl Group {
    pub const ALL: [Group; 7] = [Group::Public, Group::Private, Group::Loopback, Group::LinkLocal, Group::Metadata, Group::Multicast, Group::Host];
    /// The groups no rule reaches unless the operator opens them: the sandbox host's
    /// own networks and the cloud metadata services.
    pub const PROTECTED: [Group; 5] = [Group::Private, Group::Loopback, Group::LinkLocal, Group::Metadata, Group::Host];

    pub fn name(self) -> &'static str {
        match self {
            Group::Public => "public",
            Group::Private => "private",
            Group::Loopback => "loopback",
            Group::LinkLocal => "link-local",
            Group::Metadata => "metadata",
            Group::Multicast => "multicast",
            Group::Host => "host",
        }
    }

    pub fn from_name(name: &str) -> Option<Group> {
        Group::ALL.into_iter().find(|g| g.name() == name)
    }

    /// Whether `ip` is in this group; `host` lists this machine's addresses.
    pub fn contains(self, ip: IpAddr, host: &HostAddrs) -> bool {
        let ip = canonical(ip);
        match self {
            Group::Public => !special_purpose(ip) && !host.contains(ip),
            Group::Host => host.contains(ip),
            Group::Metadata => in_any(ip, METADATA),
            Group::Private => in_any(ip, PRIVATE),
            Group::Loopback => in_any(ip, LOOPBACK),
            Group::LinkLocal => in_any(ip, LINK_LOCAL),
            Group::Multicast => in_any(ip, MULTICAST),
        }
    }
}

/// An IPv4-mapped IPv6 address is the IPv4 address it carries.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// 127/8 and ::1, and also "this network" (0.0.0.0/8) and the unspecified `::`: Linux
/// delivers a connection or datagram sent to 0.0.0.0 (or `::`) to this host's own
/// loopback, so those addresses reach exactly what 127.0.0.1 reaches.
const LOOPBACK: &[&str] = &["127.0.0.0/8", "0.0.0.0/8", "::1/128", "::/128"];
/// RFC 1918, shared address space (carrier NAT, also where some clouds put internal
/// services) and IPv6 unique-local.
const PRIVATE: &[&str] = &["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"];
const LINK_LOCAL: &[&str] = &["169.254.0.0/16", "fe80::/10"];
/// AWS/GCP/Azure/OpenStack (169.254.169.254), AWS ECS task metadata, AWS's IPv6
/// endpoint, Alibaba Cloud.
const METADATA: &[&str] = &["169.254.169.254/32", "169.254.170.2/32", "fd00:ec2::254/128", "100.100.100.200/32"];
const MULTICAST: &[&str] = &["224.0.0.0/4", "ff00::/8"];
/// IANA's IPv4 and IPv6 special-purpose address registries (2024), whole.
const SPECIAL_PURPOSE: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.31.196.0/24",
    "192.52.193.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "192.175.48.0/24",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "255.255.255.255/32",
    "::/128",
    "::1/128",
    // Deprecated IPv4-compatible addresses (::a.b.c.d) and SIIT's IPv4-translated
    // ones: IPv4 in IPv6 clothes, never public.
    "::/96",
    "::ffff:0:0:0/96",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "2001::/23",
    "2001:db8::/32",
    "2002::/16",
    "3fff::/20",
    "5f00::/16",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
];

/// Destinations no flow from a sandbox may have, whatever the rules and the operator
/// say: one host relays each guest flow as a unicast connection of its own, so a
/// multicast group, the broadcast address or the reserved 240/4 would send the guest's
/// packets to every machine on the host's link, or nowhere defined.
const UNROUTABLE: &[(&str, &str)] = &[
    ("224.0.0.0/4", "a multicast"),
    ("ff00::/8", "a multicast"),
    ("255.255.255.255/32", "the broadcast"),
    ("240.0.0.0/4", "a reserved (240/4)"),
];

/// Why `ip` can never be a sandbox flow's destination ("a multicast", …), or None.
pub fn unroutable(ip: IpAddr) -> Option<&'static str> {
    let ip = canonical(ip);
    UNROUTABLE.iter().find(|(net, _)| in_any(ip, &[net])).map(|(_, what)| *what)
}

fn in_any(ip: IpAddr, nets: &[&str]) -> bool {
    nets.iter().any(|n| n.parse::<IpNet>().is_ok_and(|net| net.contains(&ip)))
}

fn special_purpose(ip: IpAddr) -> bool {
    in_any(ip, SPECIAL_PURPOSE)
}

/// This machine's own addresses, read once when a stack starts.
#[derive(Debug, Clone, Default)]
pub struct HostAddrs(Vec<IpAddr>);

impl HostAddrs {
    pub fn new(addrs: Vec<IpAddr>) -> HostAddrs {
        HostAddrs(addrs.into_iter().map(canonical).collect())
    }

    /// Every address on this machine's interfaces.
    pub fn of_this_machine() -> HostAddrs {
        let mut addrs = Vec::new();
        if let Ok(list) = nix::ifaddrs::getifaddrs() {
            for a in list {
                let Some(sa) = a.address else { continue };
                if let Some(v4) = sa.as_sockaddr_in() {
                    addrs.push(IpAddr::V4(v4.ip()));
                } else if let Some(v6) = sa.as_sockaddr_in6() {
                    addrs.push(IpAddr::V6(v6.ip()));
                }
            }
        }
        HostAddrs::new(addrs)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.contains(&canonical(ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups_of(ip: &str, host: &HostAddrs) -> Vec<&'static str> {
        let ip: IpAddr = ip.parse().expect("test address");
        Group::ALL.into_iter().filter(|g| g.contains(ip, host)).map(Group::name).collect()
    }

    #[test]
    fn every_address_lands_in_the_groups_its_registry_says() {
        let host = HostAddrs::new(vec!["203.0.113.7".parse().expect("ip"), "93.184.216.34".parse().expect("ip")]);
        assert_eq!(groups_of("1.1.1.1", &host), ["public"]);
        assert_eq!(groups_of("10.1.2.3", &host), ["private"]);
        assert_eq!(groups_of("172.31.255.255", &host), ["private"]);
        assert_eq!(groups_of("172.32.0.1", &host), ["public"]);
        assert_eq!(groups_of("100.64.0.1", &host), ["private"]);
        assert_eq!(groups_of("127.0.0.53", &host), ["loopback"]);
        assert_eq!(groups_of("169.254.169.254", &host), ["link-local", "metadata"]);
        assert_eq!(groups_of("169.254.1.1", &host), ["link-local"]);
        assert_eq!(groups_of("100.100.100.200", &host), ["private", "metadata"]);
        assert_eq!(groups_of("224.0.0.251", &host), ["multicast"]);
        // Documentation, benchmarking and reserved ranges are in no group but never public.
        assert!(groups_of("192.0.2.1", &host).is_empty());
        assert!(groups_of("198.18.0.1", &host).is_empty());
        assert!(groups_of("240.0.0.1", &host).is_empty());
        // "This network": a host's connect() to 0.0.0.0 reaches its own loopback.
        assert_eq!(groups_of("0.0.0.0", &host), ["loopback"]);
        assert_eq!(groups_of("0.1.2.3", &host), ["loopback"]);
        // The host's own public address is `host`, not `public`.
        assert_eq!(groups_of("93.184.216.34", &host), ["host"]);
        assert_eq!(groups_of("203.0.113.7", &host), ["host"]);
    }

    #[test]
    fn ipv6_and_mapped_addresses_are_classified_like_their_ipv4_form() {
        let host = HostAddrs::default();
        assert_eq!(groups_of("::ffff:10.0.0.1", &host), ["private"]);
        assert_eq!(groups_of("::ffff:169.254.169.254", &host), ["link-local", "metadata"]);
        assert_eq!(groups_of("::1", &host), ["loopback"]);
        assert_eq!(groups_of("fd12::1", &host), ["private"]);
        assert_eq!(groups_of("fe80::1", &host), ["link-local"]);
        assert_eq!(groups_of("2606:4700::1111", &host), ["public"]);
        assert!(groups_of("2001:db8::1", &host).is_empty());
        assert!(groups_of("::7f00:1", &host).is_empty(), "IPv4-compatible 127.0.0.1 is not public");
        assert!(groups_of("::ffff:0:a00:1", &host).is_empty(), "IPv4-translated 10.0.0.1 is not public");
        assert_eq!(groups_of("::", &host), ["loopback"], "the unspecified address reaches this host");
        assert_eq!(groups_of("::ffff:0.0.0.0", &host), ["loopback"]);
    }

    #[test]
    fn multicast_broadcast_and_reserved_destinations_are_unroutable() {
        for (ip, what) in [("224.0.0.251", "a multicast"), ("239.255.255.250", "a multicast"), ("ff02::1", "a multicast"), ("255.255.255.255", "the broadcast"), ("240.0.0.1", "a reserved (240/4)"), ("::ffff:255.255.255.255", "the broadcast")] {
            assert_eq!(unroutable(ip.parse().expect("ip")), Some(what), "{ip}");
        }
        for ip in ["1.1.1.1", "10.0.0.1", "0.0.0.0", "223.255.255.255"] {
            assert_eq!(unroutable(ip.parse().expect("ip")), None, "{ip}");
        }
    }

    #[test]
    fn group_names_round_trip() {
        for g in Group::ALL {
            assert_eq!(Group::from_name(g.name()), Some(g));
        }
        assert_eq!(Group::from_name("privat"), None);
    }
}
