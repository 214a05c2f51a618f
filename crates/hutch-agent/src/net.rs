//! The guest's interfaces: `lo`, and the NIC when the VM has one (its host end is the
//! sandbox's own stack, see hutch-net). Addresses are fixed (`hutch_proto::net`), so
//! they are set here at boot and stay right in every clone of a memory snapshot.

use hutch_proto::net::{GATEWAY_IP, GUEST_IFACE, GUEST_IP, NETMASK};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

fn control_socket() -> std::io::Result<std::net::UdpSocket> {
    // With lo down, binding an address fails; any AF_INET socket serves for the ioctls.
    nix::sys::socket::socket(nix::sys::socket::AddressFamily::Inet, nix::sys::socket::SockType::Datagram, nix::sys::socket::SockFlag::SOCK_CLOEXEC, None)
        .map(std::net::UdpSocket::from)
        .map_err(std::io::Error::from)
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().chain(std::iter::once(0))) {
        *dst = src as libc::c_char;
    }
    req
}

fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in { sin_family: libc::AF_INET as libc::sa_family_t, sin_port: 0, sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() }, sin_zero: [0; 8] };
    // SAFETY: sockaddr_in and sockaddr are both 16 bytes; the kernel reads the family
    // and interprets the rest as sockaddr_in.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// The interface ioctls the agent makes: each takes an `ifreq`.
#[derive(Clone, Copy)]
enum IfRequest {
    GetFlags,
    SetFlags,
    SetAddress,
    SetNetmask,
}

fn checked(ret: libc::c_int, what: &str) -> std::io::Result<()> {
    if ret < 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

fn if_ioctl(sock: &std::net::UdpSocket, request: IfRequest, req: &mut libc::ifreq, what: &str) -> std::io::Result<()> {
    let request = match request {
        IfRequest::GetFlags => libc::SIOCGIFFLAGS,
        IfRequest::SetFlags => libc::SIOCSIFFLAGS,
        IfRequest::SetAddress => libc::SIOCSIFADDR,
        IfRequest::SetNetmask => libc::SIOCSIFNETMASK,
    };
    // SAFETY: each of these requests reads or writes one ifreq, and `req` is one we
    // borrow mutably for the call; the socket is open.
    checked(unsafe { libc::ioctl(sock.as_raw_fd(), request as _, req as *mut libc::ifreq) }, what)
}

fn add_route(sock: &std::net::UdpSocket, route: &mut libc::rtentry, what: &str) -> std::io::Result<()> {
    // SAFETY: SIOCADDRT reads one rtentry, borrowed for the call; the socket is open.
    checked(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT as _, route as *mut libc::rtentry) }, what)
}

fn set_up(sock: &std::net::UdpSocket, name: &str) -> std::io::Result<()> {
    let mut req = ifreq(name);
    if_ioctl(sock, IfRequest::GetFlags, &mut req, "reading the flags")?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    if_ioctl(sock, IfRequest::SetFlags, &mut req, "setting it up")
}

pub fn loopback_up() -> std::io::Result<()> {
    set_up(&control_socket()?, "lo")
}

/// Whether the VM has a NIC.
pub fn has_nic() -> bool {
    std::path::Path::new(&format!("/sys/class/net/{GUEST_IFACE}")).exists()
}

/// Address, route and resolver for the NIC; IPv6 off on it (the stack is IPv4 only,
/// and a v6 address would make programs try it first).
pub fn configure_nic() -> std::io::Result<()> {
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{GUEST_IFACE}/disable_ipv6"), "1");
    let sock = control_socket()?;
    let mut req = ifreq(GUEST_IFACE);
    req.ifr_ifru.ifru_addr = sockaddr(GUEST_IP);
    if_ioctl(&sock, IfRequest::SetAddress, &mut req, "setting the address")?;
    let mut req = ifreq(GUEST_IFACE);
    req.ifr_ifru.ifru_netmask = sockaddr(NETMASK);
    if_ioctl(&sock, IfRequest::SetNetmask, &mut req, "setting the netmask")?;
    set_up(&sock, GUEST_IFACE)?;
    // SAFETY: rtentry is plain old data; zeroed is a valid value.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_gateway = sockaddr(GATEWAY_IP);
    route.rt_flags = (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort;
    match add_route(&sock, &mut route, "adding the default route") {
        Err(e) if e.raw_os_error() != Some(libc::EEXIST) && e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    write_resolv_conf()
}

/// Points the resolver at the gateway, replacing whatever the image had (a symlink to
/// systemd-resolved's stub, a build host's servers).
fn write_resolv_conf() -> std::io::Result<()> {
    let path = std::path::Path::new("/etc/resolv.conf");
    let want = format!("# written by hutch: the sandbox's DNS server\nnameserver {GATEWAY_IP}\noptions edns0\n");
    if std::fs::read_to_string(path).is_ok_and(|t| t == want) && !path.is_symlink() {
        return Ok(());
    }
    let _ = std::fs::remove_file(path);
    std::fs::write(path, want)
}
