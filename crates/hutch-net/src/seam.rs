//! Where the stack reaches the world: resolving names and choosing the address a
//! guest's flow is dialed at. `Direct` uses this host's resolver configuration and the
//! guest's own destination. `TestMap` sends chosen destinations to loopback listeners
//! and refuses (and records) anything else, so tests prove the stack never dials an
//! address they did not give it.
//!
//! Names are resolved by hickory's async resolver, not getaddrinfo: a guest chooses
//! the names, and a lookup that never answers must cost a future that its deadline
//! drops, not a blocking-pool thread that outlives the deadline (the pool every
//! `spawn_blocking` in the server shares).

use crate::rules::Proto;
use serde::Deserialize;
use std::collections::HashMap;
use std::future::Future;
use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, NameServerConfigGroup, ResolveHosts, ResolverConfig, ResolverOpts};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::system_conf::read_system_conf;
use hickory_resolver::TokioResolver;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// How long the host's resolver gets for one name.
pub const LOOKUP_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("no such name")]
    NotFound,
    #[error("the host's resolver did not answer within {} s", LOOKUP_DEADLINE.as_secs())]
    Timeout,
    #[error("the host's resolver failed: {0}")]
    Failed(String),
}

/// A resolver for `config`, reading `/etc/hosts` first as getaddrinfo would, asking
/// for IPv4 only (the guest's network is IPv4).
fn resolver(config: ResolverConfig, mut opts: ResolverOpts) -> TokioResolver {
    opts.ip_strategy = LookupIpStrategy::Ipv4Only;
    opts.use_hosts_file = ResolveHosts::Always;
    // Inside the deadline: two tries of two seconds each.
    opts.timeout = Duration::from_secs(2);
    opts.attempts = 1;
    opts.cache_size = 1024;
    let mut builder = TokioResolver::builder_with_config(config, TokioConnectionProvider::default());
    *builder.options_mut() = opts;
    builder.build()
}

/// `name`'s IPv4 addresses by `resolver`, within `LOOKUP_DEADLINE`; dropping the
/// future cancels the lookup.
async fn lookup_v4(resolver: &TokioResolver, name: &str) -> Result<Vec<Ipv4Addr>, LookupError> {
    match tokio::time::timeout(LOOKUP_DEADLINE, resolver.lookup_ip(name)).await {
        Err(_) => Err(LookupError::Timeout),
        Ok(Err(e)) if e.is_nx_domain() || e.is_no_records_found() => Err(LookupError::NotFound),
        Ok(Err(e)) => Err(LookupError::Failed(e.to_string())),
        Ok(Ok(found)) => {
            let mut v4: Vec<Ipv4Addr> = Vec::new();
            for ip in found.iter() {
                if let IpAddr::V4(ip) = ip {
                    if !v4.contains(&ip) {
                        v4.push(ip);
                    }
                }
            }
            Ok(v4)
        }
    }
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

/// This host's resolver configuration (/etc/hosts, then the servers in
/// /etc/resolv.conf, read at the first lookup) and the real destination. One per
/// process: every sandbox shares its cache and its connections.
#[derive(Default)]
pub struct Direct {
    resolver: OnceLock<Result<TokioResolver, String>>,
}

impl std::fmt::Debug for Direct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Direct").finish_non_exhaustive()
    }
}

impl Seam for Direct {
    fn lookup<'a>(&'a self, name: &'a str) -> Lookup<'a> {
        Box::pin(async move {
            let configured = self.resolver.get_or_init(|| {
                let (config, opts) = read_system_conf().map_err(|e| format!("reading /etc/resolv.conf: {e}"))?;
                Ok(resolver(config, opts))
            });
            match configured {
                Ok(r) => lookup_v4(r, name).await,
                Err(e) => Err(LookupError::Failed(e.clone())),
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
    /// Names under a domain here are asked of the DNS server at its (loopback)
    /// address, with the resolver `Direct` uses: `{"slow.test": "127.0.0.1:5300"}`.
    #[serde(default)]
    pub dns: HashMap<String, SocketAddr>,
    /// Every refused dial or lookup is appended here, one line each.
    pub violations: Option<PathBuf>,
}

#[derive(Default)]
pub struct TestMap {
    map: TestMapFile,
    /// One resolver per `dns` entry, made at first use (inside the runtime).
    resolvers: OnceLock<HashMap<String, TokioResolver>>,
}

impl std::fmt::Debug for TestMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestMap").field("map", &self.map).finish_non_exhaustive()
    }
}

impl TestMap {
    pub fn new(map: TestMapFile) -> TestMap {
        TestMap { map, resolvers: OnceLock::new() }
    }

    /// The resolver for the `dns` domain `name` is under, if any.
    fn resolver_for(&self, name: &str) -> Option<&TokioResolver> {
        let resolvers = self.resolvers.get_or_init(|| {
            self.map
                .dns
                .iter()
                .map(|(domain, server)| {
                    let config = ResolverConfig::from_parts(None, vec![], NameServerConfigGroup::from(vec![NameServerConfig::new(*server, Protocol::Udp)]));
                    (domain.clone(), resolver(config, ResolverOpts::default()))
                })
                .collect()
        });
        resolvers.iter().find(|(domain, _)| name == domain.as_str() || name.ends_with(&format!(".{domain}"))).map(|(_, r)| r)
    }

    pub fn from_file(path: &Path) -> Result<TestMap, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading the network test map {}: {e}", path.display()))?;
        let map: TestMapFile = serde_json::from_str(&text).map_err(|e| format!("the network test map {} is not valid: {e}", path.display()))?;
        if let Some((domain, server)) = map.dns.iter().find(|(_, server)| !server.ip().is_loopback()) {
            return Err(format!("the network test map {} sends {domain} to {server}, which is not a loopback address", path.display()));
        }
        Ok(TestMap::new(map))
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
            if let Some(addrs) = self.map.names.get(name) {
                return Ok(addrs.clone());
            }
            match self.resolver_for(name) {
                Some(r) => lookup_v4(r, name).await,
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
        None => Ok(Arc::new(Direct::default())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lookups a guest controls go to a server that never answers: they wait as
    /// futures, so the blocking pool stays free, and each ends by its deadline.
    #[test]
    fn unanswered_lookups_hold_no_blocking_threads_and_end_by_their_deadline() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).max_blocking_threads(1).enable_all().build().expect("runtime");
        runtime.block_on(async {
            let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.expect("bind");
            let map = TestMap::new(TestMapFile { dns: [("slow.test".to_string(), silent.local_addr().expect("addr"))].into(), ..Default::default() });
            let map = Arc::new(map);
            let lookups: Vec<_> = (0..200)
                .map(|i| {
                    let map = map.clone();
                    tokio::spawn(async move { map.lookup(&format!("n{i}.slow.test")).await })
                })
                .collect();
            // The questions reach the silent server...
            let mut buf = [0; 512];
            tokio::time::timeout(Duration::from_secs(5), silent.recv_from(&mut buf)).await.expect("a question within 5 s").expect("recv");
            // ...while the one blocking thread is free for the rest of the server.
            let blocking = tokio::time::timeout(Duration::from_secs(2), tokio::task::spawn_blocking(|| 42)).await;
            assert_eq!(blocking.expect("spawn_blocking ran while 200 lookups waited").expect("join"), 42);
            let started = std::time::Instant::now();
            let first = lookups.into_iter().next().expect("a lookup").await.expect("join");
            assert!(matches!(first, Err(LookupError::Timeout | LookupError::Failed(_))), "{first:?}");
            assert!(started.elapsed() <= LOOKUP_DEADLINE + Duration::from_secs(1));
        });
    }

    #[test]
    fn a_test_map_sends_names_only_to_loopback_servers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("map.json");
        std::fs::write(&path, r#"{"dns": {"slow.test": "192.0.2.1:53"}}"#).expect("write");
        let err = TestMap::from_file(&path).expect_err("a non-loopback server is refused");
        assert!(err.ends_with("sends slow.test to 192.0.2.1:53, which is not a loopback address"), "{err}");
    }
}
