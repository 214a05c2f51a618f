//! E2B's network settings (`allow_internet_access` and `network` on create, `PUT
//! /sandboxes/{id}/network`) as hutch rules. E2B's order is: allowed names, allowed
//! addresses, denied addresses, then the internet if it is allowed, so allow beats deny.
//! Its `*.x` means names below x, not x itself; `*` means every name.

use crate::inspect::{TransformError, Transforms};
use crate::socks5::EgressProxy;
use crate::rules::{normalize_name, parse_cidr, Action, NamePattern, Policy, Rule, Target};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// What an E2B client sent, kept to show it back (`GET /sandboxes/{id}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct E2bNetwork {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    /// Ingress: whether the sandbox's ports answer without the traffic token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_public_traffic: Option<bool>,
    /// Ingress: the Host header the proxy sends, `${PORT}` replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// Ingress: ports whose own server speaks HTTPS; the proxy's hop to them is TLS
    /// (the guest's certificate unchecked, as on E2B, so a self-signed one works).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub https_ports: Option<Vec<i64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
}

/// A setting E2B's API would refuse, or one hutch does not do: `field` is the JSON
/// field, `message` the sentence for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct E2bNetworkError {
    pub field: String,
    pub message: String,
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> E2bNetworkError {
    E2bNetworkError { field: field.into(), message: message.into() }
}

impl From<TransformError> for E2bNetworkError {
    fn from(e: TransformError) -> Self {
        E2bNetworkError { field: e.field, message: e.message }
    }
}

/// E2B's name for 0.0.0.0/0 in `denyOut`.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

fn parse_net(field: &'static str, entry: &str) -> Option<Result<IpNet, E2bNetworkError>> {
    parse_cidr(entry).map(|r| r.map_err(|reason| bad(field, reason)))
}

fn name_rule(entry: &str) -> Result<Rule, E2bNetworkError> {
    let pattern = if entry == "*" {
        NamePattern::AnyName
    } else if let Some(apex) = entry.strip_prefix("*.") {
        NamePattern::SubdomainsOnly(normalize_name(entry, apex).map_err(|e| bad("network.allowOut", e.reason))?)
    } else {
        if entry.contains(':') {
            return Err(bad("network.allowOut", format!("`{entry}` has a port; allowOut takes addresses, CIDR blocks and domains without ports")));
        }
        NamePattern::Exact(normalize_name(entry, entry).map_err(|e| bad("network.allowOut", e.reason))?)
    };
    Ok(Rule { action: Action::Allow, target: Target::Name(pattern), proto: None, ports: None })
}

/// `maskRequestHost` must make a Host header: a host name or address with an optional
/// port, where `${PORT}` stands for the sandbox port the request is for.
fn check_request_host(mask: &str) -> Result<(), E2bNetworkError> {
    let host = mask.replace(PORT_PLACEHOLDER, "1");
    let fits = !host.is_empty() && host.len() <= 261 && host.chars().all(|c| c.is_ascii_alphanumeric() || ".-_:[]".contains(c));
    if fits {
        Ok(())
    } else {
        let shown: String = mask.escape_debug().take(64).collect();
        Err(bad("network.maskRequestHost", format!("`{shown}` is not a host with an optional port (letters, digits, `.-_:[]` and `${{PORT}}`, at most 261 bytes), e.g. `localhost:${{PORT}}`")))
    }
}

/// What E2B's `maskRequestHost` replaces with the port a proxied request is for.
pub const PORT_PLACEHOLDER: &str = "${PORT}";

impl E2bNetwork {
    /// The Host header the proxy sends to `port`, when `maskRequestHost` is set.
    pub fn request_host(&self, port: u16) -> Option<String> {
        self.mask_request_host.as_ref().map(|m| m.replace(PORT_PLACEHOLDER, &port.to_string()))
    }

    /// Whether the proxy reaches `port` over TLS (`httpsPorts`).
    pub fn serves_https(&self, port: u16) -> bool {
        self.https_ports.iter().flatten().any(|p| *p == i64::from(port))
    }

    /// How the data proxy reaches `port`.
    pub fn route(&self, port: u16) -> PortRoute {
        PortRoute { host: self.request_host(port), tls: self.serves_https(port) }
    }
}

/// How the data proxy reaches one port of a sandbox (E2B's ingress settings).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortRoute {
    /// The Host header it sends (`maskRequestHost`); None keeps the client's.
    pub host: Option<String>,
    /// Whether the port's own server speaks HTTPS (`httpsPorts`): the hop is TLS.
    pub tls: bool,
}

/// How many ports `httpsPorts` may list: the data proxy reads them on each request.
const HTTPS_PORTS_MAX: usize = 256;

/// `httpsPorts` names ports (1-65535), at most `HTTPS_PORTS_MAX` of them.
fn check_https_ports(ports: &[i64]) -> Result<(), E2bNetworkError> {
    if ports.len() > HTTPS_PORTS_MAX {
        return Err(bad("network.httpsPorts", format!("lists {} ports; give at most {HTTPS_PORTS_MAX}", ports.len())));
    }
    match ports.iter().find(|p| !(1..=i64::from(u16::MAX)).contains(*p)) {
        Some(p) => Err(bad("network.httpsPorts", format!("`{p}` is not a port; give ports from 1 to 65535"))),
        None => Ok(()),
    }
}

/// E2B's `network.egressProxy` (None without one), checked for form: `address` is
/// `host:port`, a password needs a username, each at most 255 bytes (RFC 1929). Where
/// the address resolves is checked against the operator's ranges by the server.
pub fn egress_proxy(net: Option<&E2bNetwork>) -> Result<Option<EgressProxy>, E2bNetworkError> {
    const FIELD: &str = "network.egressProxy";
    let Some(given) = net.and_then(|n| n.egress_proxy.as_ref()).filter(|v| !v.is_null()) else { return Ok(None) };
    let Some(given) = given.as_object() else { return Err(bad(FIELD, "is an object with address, username and password")) };
    if let Some(other) = given.keys().find(|k| !["address", "username", "password", "tls"].contains(&k.as_str())) {
        return Err(bad(FIELD, format!("has `{other}`; an egress proxy takes address, username, password and tls")));
    }
    if given.get("tls").is_some_and(|t| !t.is_null() && *t != serde_json::Value::Bool(false)) {
        return Err(bad(format!("{FIELD}.tls"), "hutch speaks SOCKS5 to the proxy without TLS for now; leave tls out"));
    }
    let text = |key: &str| match given.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("{FIELD}.{key}"), "is a string")),
    };
    let address = text("address")?.ok_or_else(|| bad(format!("{FIELD}.address"), "is required: the proxy's host:port"))?;
    if address.contains("://") {
        return Err(bad(format!("{FIELD}.address"), "has a scheme; give the egress proxy as host:port (hutch speaks SOCKS5 to it)"));
    }
    let (host, port) = address.trim().rsplit_once(':').ok_or_else(|| bad(format!("{FIELD}.address"), format!("`{address}` is not host:port")))?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(|| bad(format!("{FIELD}.address"), format!("`{address}` has no port of 1-65535")))?;
    let host = match host.parse::<std::net::Ipv4Addr>() {
        Ok(ip) => ip.to_string(),
        Err(_) if host.contains(':') || host.starts_with('[') => return Err(bad(format!("{FIELD}.address"), "is an IPv6 address; sandboxes' traffic is IPv4, so give an IPv4 address or a name")),
        Err(_) => normalize_name(host, host).map_err(|e| bad(format!("{FIELD}.address"), e.reason))?,
    };
    let (username, password) = (text("username")?, text("password")?);
    if password.is_some() && username.is_none() {
        return Err(bad(format!("{FIELD}.password"), "is given without a username; RFC 1929 logs in with both"));
    }
    for (key, value) in [("username", &username), ("password", &password)] {
        if value.as_ref().is_some_and(|v| v.is_empty() || v.len() > 255) {
            return Err(bad(format!("{FIELD}.{key}"), "is 1-255 bytes (RFC 1929)"));
        }
    }
    Ok(Some(EgressProxy { host, port, username, password }))
}

/// `net` as API views show it: without the egress proxy's password or CA certificate.
pub fn shown(mut net: E2bNetwork) -> E2bNetwork {
    if let Some(serde_json::Value::Object(proxy)) = &mut net.egress_proxy {
        proxy.remove("password");
        if let Some(serde_json::Value::Object(tls)) = proxy.get_mut("tls") {
            tls.remove("caCert");
        }
    }
    net
}

/// The header rules of E2B's `network.rules` (none without them).
pub fn transforms(net: Option<&E2bNetwork>) -> Result<Transforms, E2bNetworkError> {
    match net.and_then(|n| n.rules.as_ref()) {
        Some(rules) => Ok(Transforms::from_e2b(rules)?),
        None => Ok(Transforms::default()),
    }
}

/// What `network` holds besides egress rules, checked whichever rules come with it
/// (E2B's or hutch's own `egress`): `dnsServers` (refused), and the ingress settings.
pub fn check_extras(net: &E2bNetwork) -> Result<(), E2bNetworkError> {
    if net.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
        return Err(bad("network.dnsServers", "hutch's gateway answers the sandbox's DNS itself (so name rules and rebinding protection hold); leave dnsServers out"));
    }
    if let Some(mask) = &net.mask_request_host {
        check_request_host(mask)?;
    }
    check_https_ports(net.https_ports.as_deref().unwrap_or_default())
}

/// The rules for E2B's settings. `allow_internet_access` absent means no egress: the
/// official SDKs always send it (true unless told otherwise).
pub fn policy(allow_internet_access: Option<bool>, net: Option<&E2bNetwork>) -> Result<Policy, E2bNetworkError> {
    let empty = E2bNetwork::default();
    let net = net.unwrap_or(&empty);
    let mut names = Vec::new();
    let mut allowed = Vec::new();
    for entry in net.allow_out.iter().flatten() {
        match parse_net("network.allowOut", entry.trim()) {
            Some(r) => allowed.push(Rule { action: Action::Allow, target: Target::Net(r?), proto: None, ports: None }),
            None => names.push(name_rule(entry.trim())?),
        }
    }
    let mut denied = Vec::new();
    for entry in net.deny_out.iter().flatten() {
        match parse_net("network.denyOut", entry.trim()) {
            Some(r) => denied.push(Rule { action: Action::Deny, target: Target::Net(r?), proto: None, ports: None }),
            None => return Err(bad("network.denyOut", format!("`{entry}` is not an IP address or CIDR block; denyOut takes only those"))),
        }
    }
    if !names.is_empty() && !net.deny_out.iter().flatten().any(|e| e.trim() == ALL_TRAFFIC) {
        return Err(bad("network.allowOut", "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' in deny out to block all other traffic."));
    }
    let mut rules = names;
    rules.append(&mut allowed);
    rules.append(&mut denied);
    if allow_internet_access == Some(true) {
        rules.extend(Policy::public().rules);
    }
    Policy::new(rules).map_err(|e| bad("network", e.reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Dest, Proto, Reach};

    fn net(allow: &[&str], deny: &[&str]) -> E2bNetwork {
        E2bNetwork {
            allow_out: Some(allow.iter().map(|s| s.to_string()).collect()),
            deny_out: Some(deny.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn https_ports_are_ports_and_an_update_keeps_the_ingress_settings() {
        let ports = |p: &[i64]| E2bNetwork { https_ports: Some(p.to_vec()), mask_request_host: Some("app:${PORT}".into()), ..Default::default() };
        assert!(ports(&[443, 8443]).serves_https(8443) && !ports(&[443]).serves_https(8443));
        assert_eq!(check_extras(&ports(&[0])).expect_err("port 0").field, "network.httpsPorts");
        assert_eq!(check_extras(&ports(&[65536])).expect_err("too big").field, "network.httpsPorts");
        assert_eq!(check_extras(&ports(&[443; 257])).expect_err("too many").field, "network.httpsPorts");
        // With hutch's own egress rules too.
        assert!(crate::Settings::with_e2b_extras(Policy::public(), Some(&ports(&[0]))).is_err());
        let created = crate::Settings::from_e2b(Some(true), Some(ports(&[8443]))).expect("created");
        let update = crate::Settings::from_e2b(Some(true), Some(net(&["192.0.2.1"], &[ALL_TRAFFIC]))).expect("update");
        let kept = update.keeping_ingress_of(&created);
        let shown = kept.e2b.and_then(|e| e.network).expect("network");
        assert_eq!((shown.https_ports, shown.mask_request_host.as_deref()), (Some(vec![8443]), Some("app:${PORT}")));
        assert_eq!(shown.allow_out, Some(vec!["192.0.2.1".to_string()]), "the update's egress");
    }

    #[test]
    fn mask_request_host_becomes_a_host_header_per_port() {
        let mask = |m: &str| E2bNetwork { mask_request_host: Some(m.into()), ..Default::default() };
        assert_eq!(mask("localhost:${PORT}").request_host(8080).as_deref(), Some("localhost:8080"));
        assert!(crate::Settings::from_e2b(Some(true), Some(mask("app.internal"))).is_ok());
        for bad_host in ["", "a b", "x/y", "user@host", "host\r\nX-Injected: 1"] {
            let err = crate::Settings::from_e2b(Some(true), Some(mask(bad_host))).expect_err("a bad maskRequestHost is refused");
            assert_eq!(err.field, "network.maskRequestHost", "{bad_host:?}");
        }
    }

    fn allowed(p: &Policy, ip: &str, names: &[&str]) -> bool {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        p.check(&Dest { ip: ip.parse().expect("ip"), proto: Proto::Tcp, port: 443, names: &names }, &Reach::default()).is_ok()
    }

    #[test]
    fn the_sdk_default_is_the_public_internet_and_false_is_nothing() {
        let open = policy(Some(true), None).expect("valid");
        assert!(allowed(&open, "93.184.216.34", &[]));
        assert!(!allowed(&open, "10.0.0.1", &[]));
        assert!(open.check_name("pypi.org").is_ok());
        for closed in [policy(Some(false), None).expect("valid"), policy(None, None).expect("valid")] {
            assert!(!allowed(&closed, "93.184.216.34", &[]));
            assert!(closed.check_name("pypi.org").is_err());
        }
    }

    #[test]
    fn allow_beats_deny_and_wildcards_exclude_the_apex() {
        let p = policy(Some(true), Some(&net(&["*.example.com", "93.184.216.0/24"], &[ALL_TRAFFIC]))).expect("valid");
        assert!(allowed(&p, "93.184.216.34", &[]));
        assert!(allowed(&p, "8.8.4.4", &["api.example.com"]));
        assert!(!allowed(&p, "8.8.4.4", &["example.com"]));
        assert!(!allowed(&p, "8.8.4.4", &[]));
        let deny_some = policy(Some(true), Some(&net(&["198.51.100.7"], &["198.51.100.0/24", "1.2.3.0/24"]))).expect("valid");
        assert!(!allowed(&deny_some, "1.2.3.4", &[]));
        assert!(allowed(&deny_some, "1.2.4.4", &[]));
    }

    #[test]
    fn e2b_refusals_carry_its_wording_and_name_the_field() {
        let e = policy(Some(true), Some(&net(&["example.com"], &[]))).expect_err("needs ALL_TRAFFIC");
        assert_eq!(e.field, "network.allowOut");
        assert_eq!(e.message, "When specifying allowed domains in allow out, you must include 'ALL_TRAFFIC' in deny out to block all other traffic.");
        assert_eq!(policy(Some(true), Some(&net(&[], &["example.com"]))).expect_err("domain").field, "network.denyOut");
        assert!(policy(Some(true), Some(&net(&["10.0.0.1/8"], &[]))).expect_err("host bits").message.contains("host bits"));
        assert!(policy(Some(true), Some(&net(&["exa*mple.com"], &[ALL_TRAFFIC]))).expect_err("wildcard").message.contains("wildcard"));
        let proxy = |v: serde_json::Value| egress_proxy(Some(&E2bNetwork { egress_proxy: Some(v), ..Default::default() }));
        assert_eq!(proxy(serde_json::json!({"url": "socks5://x"})).expect_err("url").field, "network.egressProxy");
        assert_eq!(proxy(serde_json::json!({"address": "p.example:0"})).expect_err("port").field, "network.egressProxy.address");
        assert_eq!(proxy(serde_json::json!({"address": "p.example:1080", "password": "x"})).expect_err("no user").field, "network.egressProxy.password");
        assert_eq!(proxy(serde_json::json!({"address": "p.example:1080", "tls": true})).expect_err("tls").field, "network.egressProxy.tls");
        let ok = proxy(serde_json::json!({"address": "P.Example:1080", "username": "u", "password": "secret-pw"})).expect("valid").expect("some");
        assert_eq!((ok.host.as_str(), ok.port, ok.login()), ("p.example", 1080, Some(("u", "secret-pw"))));
        assert!(!format!("{ok:?}").contains("secret-pw"));
        let shown = shown(E2bNetwork { egress_proxy: Some(serde_json::json!({"address": "p:1", "username": "u", "password": "secret-pw"})), ..Default::default() });
        assert!(!serde_json::to_string(&shown).expect("json").contains("secret-pw"));
    }
}
