//! Where the stack reaches the world: resolving names and choosing the address a
//! guest's flow is dialed at. `Direct` uses this host's resolver and the guest's own
//! destination. `TestMap` sends chosen destinations to loopback listeners and refuses
//! (and records) anything else, so tests prove the stack never dials an address they
//! did not give it.

use crate::rules::Proto;
use serde::Deserialize;
use std::collections::HashMap;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// How long the host's resolver gets for one name.
pub const LOOKUP_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("no such name")]
    NotFound,
    #[error("the host's resolver did not answer within {} s", LOOKUP_DEADLINE.as_secs())]
    Timeout,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RouteError(pub String);

pub type Lookup<'a> = Pin<Box<dyn Future<Output = Result<Vec<Ipv4Addr>, LookupError>> + Send + 'a>>;

pub trait Seam: Send + Sync + 'static {
    /// The IPv4 addresses of `name`.
    fn lookup<'a>(&'a self, name: &'a str) -> Lookup<'a>;
    /// The address to dial for a guest flow to `dst`.
    fn route(&self, dst: SocketAddr, proto: Proto) -> Result<SocketAddr, RouteError>;
}

/// This host's resolver (getaddrinfo: /etc/hosts, then DNS) and the real destination.
#[derive(Debug, Default)]
pub struct Direct;

impl Seam for Direct {
    fn lookup<'a>(&'a self, name: &'a str) -> Lookup<'a> {
        Box::pin(async move {
            match tokio::time::timeout(LOOKUP_DEADLINE, tokio::net::lookup_host((name, 0))).await {
                Err(_) => Err(LookupError::Timeout),
                Ok(Err(_)) => Err(LookupError::NotFound),
                Ok(Ok(addrs)) => {
                    let mut v4: Vec<Ipv4Addr> = Vec::new();
                    for a in addrs {
                        if let SocketAddr::V4(a) = a {
                            if !v4.contains(a.ip()) {
                                v4.push(*a.ip());
                            }
                        }
                    }
                    Ok(v4)
                }
            }
        })
    }

    fn route(&self, dst: SocketAddr, _proto: Proto) -> Result<SocketAddr, RouteError> {
        Ok(dst)
    }
}

/// The test seam's map, read from the JSON file `HUTCH_NET_TEST_MAP` names:
/// `{"tcp": {"203.0.113.5:80": "127.0.0.1:4000"}, "udp": {…},
///   "names": {"example.test": ["203.0.113.5"]}, "icmp": {"203.0.113.5": "127.0.0.1"},
///   "violations": "/tmp/x"}`.
#[derive(Debug, Default, Deserialize)]
pub struct TestMapFile {
    #[serde(default)]
    pub tcp: HashMap<SocketAddr, SocketAddr>,
    #[serde(default)]
    pub udp: HashMap<SocketAddr, SocketAddr>,
    #[serde(default)]
    pub names: HashMap<String, Vec<Ipv4Addr>>,
    /// Where echo requests to an address go (ICMP has no ports).
    #[serde(default)]
    pub icmp: HashMap<Ipv4Addr, Ipv4Addr>,
    /// Every refused dial or lookup is appended here, one line each.
    pub violations: Option<PathBuf>,
}

#[derive(Debug, Default)]
pub struct TestMap {
    map: TestMapFile,
}

impl TestMap {
    pub fn new(map: TestMapFile) -> TestMap {
        TestMap { map }
    }

    pub fn from_file(path: &Path) -> Result<TestMap, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading the network test map {}: {e}", path.display()))?;
        let map = serde_json::from_str(&text).map_err(|e| format!("the network test map {} is not valid: {e}", path.display()))?;
        Ok(TestMap { map })
    }

    fn violation(&self, what: String) {
        tracing::error!("network test seam: {what}");
        if let Some(path) = &self.map.violations {
            use std::io::Write;
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                let _ = writeln!(f, "{what}");
            }
        }
    }
}

impl Seam for TestMap {
    fn lookup<'a>(&'a self, name: &'a str) -> Lookup<'a> {
        Box::pin(async move {
            match self.map.names.get(name) {
                Some(addrs) => Ok(addrs.clone()),
                None => {
                    self.violation(format!("lookup of unmapped name {name}"));
                    Err(LookupError::NotFound)
                }
            }
        })
    }

    fn route(&self, dst: SocketAddr, proto: Proto) -> Result<SocketAddr, RouteError> {
        let table = match proto {
            Proto::Tcp => &self.map.tcp,
            Proto::Udp => &self.map.udp,
            Proto::Icmp => {
                let to = match dst.ip() {
                    std::net::IpAddr::V4(ip) => self.map.icmp.get(&ip).copied(),
                    std::net::IpAddr::V6(_) => None,
                };
                return to.map(|ip| SocketAddr::from((ip, 0))).ok_or_else(|| {
                    self.violation(format!("echo to unmapped {}", dst.ip()));
                    RouteError(format!("{} is not in the test map", dst.ip()))
                });
            }
        };
        table.get(&dst).copied().ok_or_else(|| {
            self.violation(format!("dial of unmapped {} {dst}", proto.name()));
            RouteError(format!("{dst} is not in the test map"))
        })
    }
}

/// The seam a server or `hutch run` uses: the test map when `HUTCH_NET_TEST_MAP`
/// names one, else the real world.
pub fn from_env() -> Result<Arc<dyn Seam>, String> {
    match std::env::var_os("HUTCH_NET_TEST_MAP") {
        Some(path) => Ok(Arc::new(TestMap::from_file(Path::new(&path))?)),
        None => Ok(Arc::new(Direct)),
    }
}
