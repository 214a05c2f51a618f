//! Egress rules: `ACTION@TARGET[:PROTO[:PORTS]]`, ordered, first match wins, and
//! nothing matched is denied. Targets are `*`, a group (`public`, `private`, …), an
//! IPv4 address or CIDR, an IPv6 one in brackets, a domain (`example.com`) or a
//! domain with everything below it (`*.example.com`). Examples: `allow@public`,
//! `allow@public:tcp:443`, `deny@metadata`, `allow@*.pypi.org:tcp:443`,
//! `allow@198.51.100.0/24:udp:5000-5100`.

use crate::ranges::{unroutable, Group, HostAddrs};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::IpAddr;

/// More rules than this is a mistake (E2B caps its lists too), and every connection
/// walks the list.
pub const MAX_RULES: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
    Icmp,
}

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Icmp => "icmp",
        }
    }
}

/// Which names a domain target matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "name")]
pub enum NamePattern {
    /// `example.com`: that name only.
    Exact(String),
    /// `*.example.com` in hutch's rules: the name and every name below it.
    WithSubdomains(String),
    /// `*.example.com` in E2B's `allowOut`: names below it, not the name itself.
    SubdomainsOnly(String),
    /// `*` in E2B's `allowOut`: every name.
    AnyName,
}

impl NamePattern {
    pub fn matches(&self, name: &str) -> bool {
        let below = |apex: &str| name.len() > apex.len() + 1 && name.ends_with(apex) && name.as_bytes()[name.len() - apex.len() - 1] == b'.';
        match self {
            NamePattern::Exact(n) => name == n,
            NamePattern::WithSubdomains(n) => name == n || below(n),
            NamePattern::SubdomainsOnly(n) => below(n),
            NamePattern::AnyName => true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "value")]
pub enum Target {
    /// `*`: every address.
    Any,
    Group(Group),
    Net(IpNet),
    Name(NamePattern),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    pub action: Action,
    pub target: Target,
    #[serde(default)]
    pub proto: Option<Proto>,
    /// Inclusive port range.
    #[serde(default)]
    pub ports: Option<(u16, u16)>,
}

/// Why a rule does not parse: one sentence, with what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rule `{rule}`: {reason}")]
pub struct RuleError {
    pub rule: String,
    pub reason: String,
}

fn fail(rule: &str, reason: impl Into<String>) -> RuleError {
    RuleError { rule: rule.to_string(), reason: reason.into() }
}

impl Rule {
    pub fn parse(text: &str) -> Result<Rule, RuleError> {
        let text = text.trim();
        let (action, rest) = text.split_once('@').ok_or_else(|| fail(text, "write it as ACTION@TARGET[:PROTO[:PORTS]], e.g. allow@public:tcp:443"))?;
        let action = match action {
            "allow" => Action::Allow,
            "deny" => Action::Deny,
            other => return Err(fail(text, format!("the action `{other}` is neither `allow` nor `deny`"))),
        };
        if !rest.starts_with('[') && (rest.contains("::") || rest.matches(':').count() > 2) {
            return Err(fail(text, "an IPv6 target goes in brackets, e.g. allow@[2001:db8::/32]"));
        }
        let (target, tail) = split_target(rest);
        let target = parse_target(text, target)?;
        let parts: Vec<&str> = if tail.is_empty() { Vec::new() } else { tail.split(':').collect() };
        let proto = match parts.first().copied() {
            None | Some("any") => None,
            Some("tcp") => Some(Proto::Tcp),
            Some("udp") => Some(Proto::Udp),
            Some("icmp") => Some(Proto::Icmp),
            Some(p) if p.chars().all(|c| c.is_ascii_digit() || c == '-') => {
                return Err(fail(text, format!("`{p}` is a port, not a protocol: a port comes after one, e.g. {}:tcp:{p}", text.trim_end_matches(&format!(":{p}")))))
            }
            Some(p) => return Err(fail(text, format!("the protocol `{p}` is not tcp, udp, icmp or any"))),
        };
        let ports = match parts.get(1) {
            None => None,
            Some(p) => {
                if proto == Some(Proto::Icmp) {
                    return Err(fail(text, "ICMP has no ports"));
                }
                Some(parse_ports(text, p)?)
            }
        };
        if let Some(extra) = parts.get(2) {
            return Err(fail(text, format!("unexpected `:{extra}` after the ports")));
        }
        Ok(Rule { action, target, proto, ports })
    }

    fn matches(&self, dest: &Dest<'_>, reach: &Reach) -> bool {
        if self.proto.is_some_and(|p| p != dest.proto) {
            return false;
        }
        if let Some((lo, hi)) = self.ports {
            if dest.proto == Proto::Icmp || dest.port < lo || dest.port > hi {
                return false;
            }
        }
        match &self.target {
            Target::Any => true,
            Target::Group(Group::Public) => Group::Public.contains(dest.ip, &reach.host) || reach.also_public.iter().any(|n| n.contains(&dest.ip)),
            Target::Group(g) => g.contains(dest.ip, &reach.host),
            Target::Net(n) => n.contains(&dest.ip),
            Target::Name(p) => dest.names.iter().any(|n| p.matches(n)),
        }
    }
}

/// `[v6]:tcp` or `name:tcp`: the target, and what follows its colon.
fn split_target(rest: &str) -> (&str, &str) {
    if rest.starts_with('[') {
        if let Some(end) = rest.find(']') {
            let tail = &rest[end + 1..];
            return (&rest[..=end], tail.strip_prefix(':').unwrap_or(tail));
        }
    }
    match rest.split_once(':') {
        Some((t, tail)) => (t, tail),
        None => (rest, ""),
    }
}

fn parse_ports(rule: &str, p: &str) -> Result<(u16, u16), RuleError> {
    let port = |s: &str| -> Result<u16, RuleError> {
        match s.parse::<u16>() {
            Ok(0) => Err(fail(rule, "port 0 is not a port; ports are 1-65535")),
            Ok(n) => Ok(n),
            Err(_) => Err(fail(rule, format!("`{s}` is not a port (1-65535)"))),
        }
    };
    let (lo, hi) = match p.split_once('-') {
        Some((lo, hi)) => (port(lo)?, port(hi)?),
        None => {
            let n = port(p)?;
            (n, n)
        }
    };
    if lo > hi {
        return Err(fail(rule, format!("the port range {lo}-{hi} runs backwards; write {hi}-{lo}")));
    }
    Ok((lo, hi))
}

fn parse_target(rule: &str, t: &str) -> Result<Target, RuleError> {
    if t == "*" {
        return Ok(Target::Any);
    }
    if t.is_empty() {
        return Err(fail(rule, "the target is empty"));
    }
    if let Some(inner) = t.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        return parse_net(rule, inner, true);
    }
    if t.contains(':') {
        return Err(fail(rule, "an IPv6 target goes in brackets, e.g. allow@[2001:db8::/32]"));
    }
    if t.chars().next().is_some_and(|c| c.is_ascii_digit()) && t.chars().all(|c| c.is_ascii_digit() || c == '.' || c == '/') {
        return parse_net(rule, t, false);
    }
    // A domain has a dot between labels: `a.` (one label, rooted) prints as `a`, which
    // would read back as a group.
    if !t.trim_end_matches('.').contains('.') {
        if let Some(g) = Group::from_name(t) {
            return Ok(Target::Group(g));
        }
        return Err(fail(rule, unknown_group(t)));
    }
    Ok(Target::Name(parse_name_pattern(rule, t)?))
}

fn unknown_group(t: &str) -> String {
    let names = Group::ALL.map(Group::name);
    let closest = names.iter().min_by_key(|n| edit_distance(n, t)).filter(|n| edit_distance(n, t) <= 3);
    match closest {
        Some(n) => format!("unknown group `{t}`; did you mean `{n}`? (groups: {})", names.join(", ")),
        None => format!("unknown group `{t}` (groups: {}; a domain needs a dot)", names.join(", ")),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// An address or a CIDR block without host bits; None when `t` is neither an address
/// nor has a `/` (a name, say). The error is the sentence for the client.
pub(crate) fn parse_cidr(t: &str) -> Option<Result<IpNet, String>> {
    if let Ok(ip) = t.parse::<IpAddr>() {
        return Some(Ok(IpNet::from(ip)));
    }
    if !t.contains('/') {
        return None;
    }
    Some(match t.parse::<IpNet>() {
        Ok(net) if net.trunc() == net => Ok(net),
        Ok(net) => Err(format!("`{t}` has host bits set; did you mean {}?", net.trunc())),
        Err(_) => Err(format!("`{t}` is not a CIDR block")),
    })
}

fn parse_net(rule: &str, t: &str, v6: bool) -> Result<Target, RuleError> {
    let net = parse_cidr(t).unwrap_or_else(|| Err(format!("`{t}` is not an IP address"))).map_err(|reason| fail(rule, reason))?;
    if v6 != matches!(net, IpNet::V6(_)) {
        return Err(fail(rule, format!("`{t}` is not an IPv6 address; only IPv6 goes in brackets")));
    }
    Ok(Target::Net(net))
}

/// A domain as DNS carries it: lowercase ASCII labels (punycode for the rest).
pub fn normalize_name(rule: &str, name: &str) -> Result<String, RuleError> {
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    if !name.is_ascii() {
        return Err(fail(rule, format!("`{name}` is not ASCII; write internationalized names in punycode (xn--…)")));
    }
    if name.len() > 253 {
        return Err(fail(rule, "a domain is at most 253 characters"));
    }
    for label in name.split('.') {
        if label.contains('*') {
            return Err(fail(rule, format!("`{name}` has a wildcard inside it; a wildcard is only `*.` at the start")));
        }
        let ok = !label.is_empty()
            && label.len() <= 63
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(fail(rule, format!("`{name}` is not a domain name (labels are 1-63 letters, digits and inner hyphens)")));
        }
    }
    Ok(name)
}

fn parse_name_pattern(rule: &str, t: &str) -> Result<NamePattern, RuleError> {
    match t.strip_prefix("*.") {
        Some(apex) => Ok(NamePattern::WithSubdomains(normalize_name(rule, apex)?)),
        None => Ok(NamePattern::Exact(normalize_name(rule, t)?)),
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let action = match self.action {
            Action::Allow => "allow",
            Action::Deny => "deny",
        };
        write!(f, "{action}@")?;
        match &self.target {
            Target::Any => write!(f, "*")?,
            Target::Group(g) => write!(f, "{}", g.name())?,
            Target::Net(n) if n.prefix_len() == n.max_prefix_len() && n.addr().is_ipv6() => write!(f, "[{}]", n.addr())?,
            Target::Net(IpNet::V6(n)) => write!(f, "[{n}]")?,
            Target::Net(n) if n.prefix_len() == n.max_prefix_len() => write!(f, "{}", n.addr())?,
            Target::Net(n) => write!(f, "{n}")?,
            Target::Name(NamePattern::Exact(n)) => write!(f, "{n}")?,
            Target::Name(NamePattern::WithSubdomains(n)) => write!(f, "*.{n}")?,
            // E2B's meaning: only written back in E2B's form (`e2b.rs`).
            Target::Name(NamePattern::SubdomainsOnly(n)) => write!(f, "*.{n} (below it only)")?,
            Target::Name(NamePattern::AnyName) => write!(f, "* (any name)")?,
        }
        match (self.proto, self.ports) {
            (None, None) => {}
            (p, None) => write!(f, ":{}", p.map_or("any", Proto::name))?,
            (p, Some((lo, hi))) => {
                write!(f, ":{}:", p.map_or("any", Proto::name))?;
                if lo == hi {
                    write!(f, "{lo}")?
                } else {
                    write!(f, "{lo}-{hi}")?
                }
            }
        }
        Ok(())
    }
}

/// Where a guest packet goes, and the names the guest looked up for that address.
#[derive(Debug, Clone)]
pub struct Dest<'a> {
    pub ip: IpAddr,
    pub proto: Proto,
    pub port: u16,
    pub names: &'a [String],
}

/// Why a flow was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum DenyReason {
    /// A rule said deny.
    Rule { index: usize, rule: String },
    /// No rule allowed it.
    NoRule,
    /// The address is in a group only the operator can open.
    Protected { group: Group },
    /// Multicast, broadcast or reserved: no rule can allow it.
    Unroutable { what: &'static str },
    /// The sandbox has its connection cap's worth of flows open.
    ConnectionLimit,
    /// A domain answer pointed into a protected group (DNS rebinding).
    Rebinding { group: Group },
    /// The upstream did not answer or refused.
    DialFailed { error: String },
    /// A flow to a host with a network rule that hutch could not inspect, or a
    /// request on it that the rule could not be applied to.
    Inspection { error: String },
    /// The guest sent a secret's placeholder where hutch does not fill it in.
    Placeholder { form: crate::scan::Form },
}

impl fmt::Display for DenyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DenyReason::Rule { rule, .. } => write!(f, "denied by rule {rule}"),
            DenyReason::NoRule => write!(f, "no rule allows it"),
            DenyReason::Protected { group } => write!(f, "{} addresses are never reachable from sandboxes", group.name()),
            DenyReason::Unroutable { what } => write!(f, "{what} address is never a sandbox's destination"),
            DenyReason::ConnectionLimit => write!(f, "the sandbox has too many connections open"),
            DenyReason::Rebinding { group } => write!(f, "the name resolves to a {} address", group.name()),
            DenyReason::DialFailed { error } => write!(f, "the destination did not accept: {error}"),
            DenyReason::Inspection { error } => write!(f, "{error}"),
            DenyReason::Placeholder { form } => write!(
                f,
                "the guest sent a secret's placeholder ({}) where hutch does not fill it in (only headers of HTTPS requests to a host the secret is bound to); the connection was reset, or the datagram dropped",
                form.name()
            ),
        }
    }
}

/// The operator's side: which protected groups rules may reach, ranges this
/// deployment counts as public although IANA reserves them (a package mirror at a
/// documentation address, say), and this host's addresses (the `host` group).
#[derive(Debug, Clone, Default)]
pub struct Reach {
    pub open: Vec<Group>,
    pub also_public: Vec<IpNet>,
    pub host: HostAddrs,
}

impl Reach {
    /// The protected group `ip` is in that the operator has not opened.
    fn closed_group(&self, ip: IpAddr) -> Option<Group> {
        Group::PROTECTED.into_iter().filter(|g| !self.open.contains(g)).find(|g| g.contains(ip, &self.host))
    }

    /// Why no flow may go to `ip` before any rule is read: an unroutable address, or a
    /// protected group the operator has not opened.
    pub fn refusal(&self, ip: IpAddr) -> Option<DenyReason> {
        if let Some(what) = unroutable(ip) {
            return Some(DenyReason::Unroutable { what });
        }
        self.closed_group(ip).map(|group| DenyReason::Protected { group })
    }
}

/// An ordered list of rules; nothing matched is denied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub rules: Vec<Rule>,
}

impl Policy {
    /// No egress at all (and no names resolve).
    pub fn none() -> Policy {
        Policy::default()
    }

    /// The public internet (and DNS), nothing private.
    pub fn public() -> Policy {
        Policy { rules: vec![Rule { action: Action::Allow, target: Target::Group(Group::Public), proto: None, ports: None }] }
    }

    pub fn new(rules: Vec<Rule>) -> Result<Policy, RuleError> {
        if rules.len() > MAX_RULES {
            return Err(RuleError { rule: format!("{} rules", rules.len()), reason: format!("at most {MAX_RULES} rules are allowed") });
        }
        Ok(Policy { rules })
    }

    /// `none`, `public`, or rules separated by commas or whitespace.
    pub fn parse(text: &str) -> Result<Policy, RuleError> {
        match text.trim() {
            "none" | "" => Ok(Policy::none()),
            "public" => Ok(Policy::public()),
            list => Policy::new(list.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()).map(Rule::parse).collect::<Result<_, _>>()?),
        }
    }

    /// Whether a flow to `dest` may go: protected groups first, then the first rule
    /// that matches.
    pub fn check(&self, dest: &Dest<'_>, reach: &Reach) -> Result<usize, DenyReason> {
        if let Some(reason) = reach.refusal(dest.ip) {
            return Err(reason);
        }
        match self.rules.iter().position(|r| r.matches(dest, reach)) {
            Some(i) if self.rules[i].action == Action::Allow => Ok(i),
            Some(i) => Err(DenyReason::Rule { index: i, rule: self.rules[i].to_string() }),
            None => Err(DenyReason::NoRule),
        }
    }

    /// Whether the guest may resolve `name`: the first rule naming it decides; a name
    /// no rule names resolves when some rule allows addresses (the connection is
    /// checked against them), so with no egress nothing resolves.
    pub fn check_name(&self, name: &str) -> Result<(), DenyReason> {
        for (i, r) in self.rules.iter().enumerate() {
            if let Target::Name(p) = &r.target {
                if p.matches(name) {
                    return match r.action {
                        Action::Allow => Ok(()),
                        Action::Deny => Err(DenyReason::Rule { index: i, rule: r.to_string() }),
                    };
                }
            }
        }
        let allows_addresses = self.rules.iter().any(|r| r.action == Action::Allow && !matches!(r.target, Target::Name(_)));
        if allows_addresses {
            Ok(())
        } else {
            Err(DenyReason::NoRule)
        }
    }
}

impl Policy {
    /// Each rule as its text (`allow@public:tcp:443`).
    pub fn texts(&self) -> Vec<String> {
        self.rules.iter().map(Rule::to_string).collect()
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rules.is_empty() {
            return write!(f, "none");
        }
        write!(f, "{}", self.texts().join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        Rule::parse(text).expect_err(text).reason
    }

    #[test]
    fn rules_parse_and_print_back_the_same() {
        for text in [
            "allow@public",
            "deny@metadata",
            "allow@public:tcp:443",
            "allow@*.example.com",
            "allow@example.com:tcp:80-8080",
            "deny@10.0.0.0/8",
            "allow@203.0.113.9:udp",
            "allow@[2001:db8::/32]:tcp:22",
            "allow@*",
            "allow@*:icmp",
        ] {
            let rule = Rule::parse(text).expect(text);
            assert_eq!(rule.to_string(), text);
        }
        assert_eq!(Rule::parse("allow@Example.COM.").expect("parse").to_string(), "allow@example.com");
        assert_eq!(Rule::parse("allow@public:any:53").expect("parse").to_string(), "allow@public:any:53");
    }

    #[test]
    fn bad_rules_say_what_is_wrong_and_what_to_write() {
        assert!(err("allow@10.0.0.1/8").contains("host bits set; did you mean 10.0.0.0/8?"));
        assert!(err("allow@10.0.0.0/33").contains("not a CIDR"));
        assert!(err("allow@public:tcp:0").contains("port 0"));
        assert!(err("allow@public:tcp:90-80").contains("runs backwards"));
        // Found by the egress_rules fuzz target: one label and a dot is not a domain.
        assert!(err("allow@a.").contains("a domain needs a dot"), "{}", err("allow@a."));
        assert!(Policy::parse("allow@a.\x0c,,").is_err());
        assert!(err("allow@publik").contains("did you mean `public`?"));
        assert!(err("allow@example.com:443").contains("is a port, not a protocol"));
        assert!(err("allow@foo.*.com").contains("wildcard"));
        assert!(err("allow@f*o.com").contains("wildcard"));
        assert!(err("allow@bücher.de").contains("punycode"));
        assert!(err("allow@2001:db8::1").contains("brackets"));
        assert!(err("permit@public").contains("neither `allow` nor `deny`"));
        assert!(err("public").contains("ACTION@TARGET"));
        assert!(err("allow@public:icmp:8").contains("no ports"));
        assert!(err("allow@public:sctp").contains("not tcp, udp"));
        assert!(err("allow@[10.0.0.1]").contains("only IPv6"));
        assert!(err("allow@-bad.com").contains("not a domain name"));
        let many = vec!["allow@public"; MAX_RULES + 1].join(",");
        assert!(Policy::parse(&many).expect_err("too many").reason.contains("at most 1024"));
    }

    fn dest<'a>(ip: &str, proto: Proto, port: u16, names: &'a [String]) -> Dest<'a> {
        Dest { ip: ip.parse().expect("ip"), proto, port, names }
    }

    #[test]
    fn the_first_matching_rule_decides_and_nothing_matched_is_denied() {
        let p = Policy::parse("deny@203.0.113.0/24:tcp:22, allow@public:tcp, allow@*.example.com:udp:53").expect("parse");
        let reach = Reach::default();
        assert_eq!(p.check(&dest("93.184.216.34", Proto::Tcp, 443, &[]), &reach), Ok(1));
        assert_eq!(p.check(&dest("93.184.216.34", Proto::Udp, 443, &[]), &reach), Err(DenyReason::NoRule));
        // 203.0.113/24 is documentation space, not public: only the deny rule names it.
        assert!(matches!(p.check(&dest("203.0.113.5", Proto::Tcp, 22, &[]), &reach), Err(DenyReason::Rule { index: 0, .. })));
        assert_eq!(p.check(&dest("203.0.113.5", Proto::Tcp, 80, &[]), &reach), Err(DenyReason::NoRule));
        let mirror = Reach { also_public: vec!["203.0.113.0/24".parse().expect("net")], ..Reach::default() };
        assert_eq!(p.check(&dest("203.0.113.5", Proto::Tcp, 80, &[]), &mirror), Ok(1));
        let names = vec!["dns.example.com".to_string()];
        assert_eq!(p.check(&dest("192.0.2.1", Proto::Udp, 53, &names), &reach), Ok(2));
        assert_eq!(Policy::none().check(&dest("93.184.216.34", Proto::Tcp, 80, &[]), &reach), Err(DenyReason::NoRule));
    }

    #[test]
    fn protected_groups_stay_closed_whatever_the_rules_say_unless_the_operator_opens_them() {
        let p = Policy::parse("allow@*").expect("parse");
        let mut reach = Reach { open: vec![], also_public: vec![], host: HostAddrs::new(vec!["93.184.216.34".parse().expect("ip")]) };
        for (ip, group) in [("10.1.1.1", Group::Private), ("127.0.0.1", Group::Loopback), ("0.0.0.0", Group::Loopback), ("::", Group::Loopback), ("::ffff:0.0.0.0", Group::Loopback), ("169.254.169.254", Group::LinkLocal), ("93.184.216.34", Group::Host)] {
            assert_eq!(p.check(&dest(ip, Proto::Tcp, 80, &[]), &reach), Err(DenyReason::Protected { group }), "{ip}");
        }
        reach.open = vec![Group::Private];
        assert_eq!(p.check(&dest("10.1.1.1", Proto::Tcp, 80, &[]), &reach), Ok(0));
        // Opening private does not open the metadata address inside it.
        assert_eq!(p.check(&dest("100.100.100.200", Proto::Tcp, 80, &[]), &reach), Err(DenyReason::Protected { group: Group::Metadata }));
        // Multicast, broadcast and 240/4 are never destinations, whatever is open.
        reach.open = Group::ALL.to_vec();
        for ip in ["224.0.0.1", "255.255.255.255", "240.0.0.1", "ff02::1"] {
            assert!(matches!(p.check(&dest(ip, Proto::Udp, 5353, &[]), &reach), Err(DenyReason::Unroutable { .. })), "{ip}");
        }
    }

    #[test]
    fn wildcards_differ_between_hutch_and_e2b_on_the_apex() {
        let with = NamePattern::WithSubdomains("example.com".into());
        let only = NamePattern::SubdomainsOnly("example.com".into());
        assert!(with.matches("example.com") && with.matches("a.b.example.com"));
        assert!(!only.matches("example.com") && only.matches("a.example.com"));
        assert!(!with.matches("badexample.com") && !only.matches("badexample.com"));
        assert!(NamePattern::AnyName.matches("anything.test"));
    }

    #[test]
    fn names_resolve_by_the_first_rule_naming_them_else_when_addresses_are_allowed() {
        let p = Policy::parse("deny@*.ads.example.com,allow@example.com").expect("parse");
        assert!(p.check_name("example.com").is_ok());
        assert!(p.check_name("x.ads.example.com").is_err());
        assert_eq!(p.check_name("other.org"), Err(DenyReason::NoRule));
        let open = Policy::parse("deny@*.ads.example.com,allow@public").expect("parse");
        assert!(open.check_name("other.org").is_ok());
        assert!(open.check_name("ads.example.com").is_err());
        assert_eq!(Policy::none().check_name("example.com"), Err(DenyReason::NoRule));
    }
}
