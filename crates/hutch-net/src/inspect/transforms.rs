//! E2B's `network.rules`: per host, headers set on every HTTPS request the sandbox
//! sends there (overriding the guest's own), whose values may name the API key's
//! secrets as `${e2b.secrets.NAME}`. The host side fills those in; the guest never
//! holds the value. Checked on create and update with E2B's limits, kept in the
//! sandbox's record as the client wrote them.

use crate::rules::normalize_name;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use zeroize::Zeroizing;

/// E2B's limits (infra `sandbox_create.go`).
pub const MAX_HOSTS: usize = 10;
pub const MAX_HEADERS: usize = 20;
pub const MAX_HEADER_NAME: usize = 64;
pub const MAX_HEADER_VALUE: usize = 2048;
pub const MAX_SECRETS_PER_HOST: usize = 32;

pub const SECRET_PREFIX: &str = "${e2b.secrets.";
const IDENTITY_PREFIX: &str = "${e2b.identity.tokens.";

/// The headers to set, by host as E2B writes it: `api.x.com`, or `*.x.com` for any
/// name below x.com (not x.com itself).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transforms {
    /// The API key whose secrets the placeholders name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_of: Option<String>,
    pub hosts: BTreeMap<String, BTreeMap<String, String>>,
    /// Secrets the guest itself may send as placeholders (hutch's `secrets` on create,
    /// `hutch run --secret`): by exact host, each secret and the headers it is filled in.
    /// A bound host is inspected as a host with a rule is. A rule's own secrets are not
    /// bound: the rule sets its headers, whatever the guest sent.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub bound: BTreeMap<String, BTreeMap<String, Fill>>,
}

/// Where a bound secret's placeholder is filled in on its host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fill {
    /// Header names, lower-cased.
    pub headers: BTreeSet<String>,
    /// Query parameters, by name (opt-in: servers log and reflect URLs more than
    /// headers).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub query: BTreeSet<String>,
}

/// Where a bound secret's placeholder is filled in when its binding names no headers:
/// where APIs take keys. Never a header a server may echo back (`Origin`, `Accept`…).
pub const CREDENTIAL_HEADERS: &[&str] = &["authorization", "x-api-key", "api-key", "x-goog-api-key", "x-auth-token", "private-token"];

/// hutch's own binding of a secret to an environment variable (`secrets` on create,
/// `hutch run --secret`): the guest's variable holds the placeholder, and the value is
/// filled in on HTTPS requests to `hosts` only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretBinding {
    /// The secret's name; the variable's, lower-cased, when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Exact names: a wildcard could cover names anyone can register (`*.github.io`).
    pub hosts: Vec<String>,
    /// The headers the placeholder is filled in (`CREDENTIAL_HEADERS` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<Vec<String>>,
    /// Query parameters whose values it is filled in too (`?key=${e2b.secrets.NAME}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<Vec<String>>,
}

/// The placeholder the guest holds for secret `name`.
pub fn placeholder(name: &str) -> String {
    format!("{SECRET_PREFIX}{name}}}")
}

/// A rule E2B would refuse, or one hutch does not do. `field` names where, in the
/// request's JSON; the message never quotes a header's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct TransformError {
    pub field: String,
    pub message: String,
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> TransformError {
    TransformError { field: field.into(), message: message.into() }
}

/// One piece of a header's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part<'a> {
    Text(&'a str),
    Secret(String),
}

/// A header value cut into text and `${e2b.secrets.NAME}` placeholders (the name
/// trimmed and lower-cased, as E2B normalizes it). `Err` says what is malformed.
pub fn parse_value(value: &str) -> Result<Vec<Part<'_>>, &'static str> {
    let mut parts = Vec::new();
    let mut rest = value;
    while let Some(at) = rest.find("${") {
        if at > 0 {
            parts.push(Part::Text(&rest[..at]));
        }
        let tail = &rest[at..];
        if tail.starts_with(IDENTITY_PREFIX) {
            return Err("names a workload identity token; hutch has no workload identity, so only ${e2b.secrets.NAME} placeholders work");
        }
        let Some(inner) = tail.strip_prefix(SECRET_PREFIX) else {
            // Text of the guest's own that happens to hold `${`: E2B keeps it as is.
            parts.push(Part::Text("${"));
            rest = &tail[2..];
            continue;
        };
        let Some(end) = inner.find('}') else { return Err("contains a malformed E2B placeholder (no closing `}`)") };
        let name = inner[..end].trim();
        if name.is_empty() || name.contains("${") || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err("contains a malformed E2B placeholder (a secret's name is letters, digits, `_` and `-`)");
        }
        parts.push(Part::Secret(name.to_ascii_lowercase()));
        rest = &inner[end + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest));
    }
    Ok(parts)
}

impl Transforms {
    /// From E2B's `network.rules` (`{host: [{"transform": {"headers": {…}}}]}`).
    pub fn from_e2b(rules: &serde_json::Value) -> Result<Transforms, TransformError> {
        let mut hosts = BTreeMap::new();
        let Some(map) = rules.as_object() else {
            return if rules.is_null() { Ok(Transforms::default()) } else { Err(bad("network.rules", "is an object of host → list of rules")) };
        };
        if map.len() > MAX_HOSTS {
            return Err(bad("network.rules", format!("names {} hosts; at most {MAX_HOSTS} may have rules", map.len())));
        }
        for (key, list) in map {
            let field = format!("network.rules.{key}");
            let host = rule_host(key).map_err(|m| bad(&field, m))?;
            let Some(list) = list.as_array() else { return Err(bad(&field, "is a list of rules")) };
            if list.len() > 1 {
                return Err(bad(&field, "has more than one rule; a host takes one rule"));
            }
            let mut headers = BTreeMap::new();
            if let Some(rule) = list.first() {
                let Some(rule) = rule.as_object() else { return Err(bad(&field, "holds a rule that is not an object")) };
                if let Some(other) = rule.keys().find(|k| *k != "transform") {
                    return Err(bad(&field, format!("has `{other}`; a rule takes only `transform`")));
                }
                if let Some(transform) = rule.get("transform").filter(|t| !t.is_null()) {
                    let Some(transform) = transform.as_object() else { return Err(bad(format!("{field}.transform"), "is an object")) };
                    if let Some(other) = transform.keys().find(|k| *k != "headers") {
                        return Err(bad(format!("{field}.transform"), format!("has `{other}`; a transform takes only `headers`")));
                    }
                    if let Some(given) = transform.get("headers").filter(|h| !h.is_null()) {
                        headers = check_headers(&format!("{field}.transform.headers"), given)?;
                    }
                }
            }
            if hosts.insert(host, headers).is_some() {
                return Err(bad(&field, "names a host that another key names too (keys are compared lower-cased)"));
            }
        }
        Ok(Transforms { secrets_of: None, hosts, bound: BTreeMap::new() })
    }

    /// Binds secret `name` to `host` (an exact name) for `fill`'s places: the guest's
    /// own placeholders for it are filled in there on HTTPS requests to that host.
    /// `field` names the binding in errors.
    pub fn bind(&mut self, field: &str, name: &str, host: &str, fill: &Fill) -> Result<(), TransformError> {
        let name = secret_name(name).map_err(|m| bad(field, m))?;
        if host.trim().starts_with("*.") {
            return Err(bad(field, format!("`{}` is a wildcard; a secret is bound to exact hosts (names below a domain may be anyone's)", host.escape_debug())));
        }
        let host = rule_host(host).map_err(|m| bad(field, format!("`{}` {m}", host.escape_debug())))?;
        if !self.bound.contains_key(&host) && self.bound.len() >= MAX_HOSTS {
            return Err(bad(field, format!("binds secrets to more than {MAX_HOSTS} hosts")));
        }
        let names = self.bound.entry(host).or_default();
        let bound = names.entry(name).or_default();
        bound.headers.extend(fill.headers.iter().cloned());
        bound.query.extend(fill.query.iter().cloned());
        if names.len() > MAX_SECRETS_PER_HOST {
            return Err(bad(field, format!("binds more than {MAX_SECRETS_PER_HOST} secrets to one host")));
        }
        Ok(())
    }

    /// Binds each of `secrets` (environment variable → binding) and returns the
    /// variables to set, each to its secret's placeholder. `field` names the map in errors.
    pub fn bind_all(&mut self, field: &str, secrets: &BTreeMap<String, SecretBinding>) -> Result<BTreeMap<String, String>, TransformError> {
        let mut env = BTreeMap::new();
        for (var, binding) in secrets {
            let at = format!("{field}.{var}");
            let valid_var = var.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_') && var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid_var || var.len() > 128 {
                return Err(bad(&at, "is not an environment variable's name (letters, digits and `_`, not starting with a digit)"));
            }
            let name = secret_name(binding.name.as_deref().unwrap_or(var)).map_err(|m| bad(&at, m))?;
            if binding.hosts.is_empty() {
                return Err(bad(format!("{at}.hosts"), "is empty; a secret is filled in only for the hosts it is bound to, so name at least one"));
            }
            let headers = match &binding.headers {
                None => CREDENTIAL_HEADERS.iter().map(|h| h.to_string()).collect(),
                Some(given) => binding_headers(&format!("{at}.headers"), given)?,
            };
            let query = match &binding.query {
                None => BTreeSet::new(),
                Some(given) => query_names(&format!("{at}.query"), given)?,
            };
            let fill = Fill { headers, query };
            for host in &binding.hosts {
                self.bind(&format!("{at}.hosts"), &name, host, &fill)?;
            }
            env.insert(var.clone(), placeholder(&name));
        }
        Ok(env)
    }

    /// Checks the placeholders in a create's environment variables: each well formed,
    /// and for a secret bound to some host (by a rule or a binding), else the guest
    /// would hold a placeholder nothing fills in.
    pub fn check_env(&self, field: &str, env: &BTreeMap<String, String>) -> Result<(), TransformError> {
        let names = self.secret_names();
        for (var, value) in env {
            let at = format!("{field}.{var}");
            for part in parse_value(value).map_err(|m| bad(&at, m))? {
                if let Part::Secret(name) = part {
                    if !names.contains(&name) {
                        return Err(bad(&at, format!("holds the placeholder of secret `{name}`, which is bound to no host: name it in the network rule of the host it is for, or bind it with `secrets`")));
                    }
                }
            }
        }
        Ok(())
    }

    /// This one's rules with the bindings of `old` (a network update replaces rules; the
    /// secrets bound at create stay bound).
    pub fn keeping_bindings_of(mut self, old: &Transforms) -> Transforms {
        self.bound = old.bound.clone();
        self
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty() && self.bound.is_empty()
    }

    /// Every secret the rules name or the guest may send.
    pub fn secret_names(&self) -> BTreeSet<String> {
        let mut names: BTreeSet<String> = self.bound.values().flat_map(|b| b.keys()).cloned().collect();
        for headers in self.hosts.values() {
            names.extend(named_in(headers));
        }
        names
    }

    /// The key whose rule applies to `host` (a lower-case name): an exact key wins
    /// over wildcards, and the longest wildcard over shorter ones; rules are not merged.
    fn key_for(&self, host: &str) -> Option<&str> {
        if let Some((key, _)) = self.hosts.get_key_value(host) {
            return Some(key);
        }
        self.hosts
            .keys()
            .filter_map(|key| key.strip_prefix("*.").filter(|apex| host.len() > apex.len() + 1 && host.ends_with(apex) && host.as_bytes()[host.len() - apex.len() - 1] == b'.').map(|apex| (apex.len(), key)))
            .max_by_key(|(len, _)| *len)
            .map(|(_, key)| key.as_str())
    }

    /// The headers for `host` (a lower-case name), by the rule `key_for` chooses.
    pub fn for_host(&self, host: &str) -> Option<&BTreeMap<String, String>> {
        self.key_for(host).and_then(|key| self.hosts.get(key))
    }

    /// The secrets the guest's placeholders are filled in for on requests to `host`,
    /// each with the headers it is filled in.
    pub fn bound_to(&self, host: &str) -> Option<&BTreeMap<String, Fill>> {
        self.bound.get(host)
    }

    /// Whether requests to `host` are inspected: it has a rule or bound secrets.
    pub fn covers(&self, host: &str) -> bool {
        self.for_host(host).is_some() || self.bound.contains_key(host)
    }

    /// Whether any of `names` is inspected.
    pub fn covers_any(&self, names: &[String]) -> bool {
        names.iter().any(|n| self.covers(n))
    }
}

/// A binding's header names, lower-cased: request headers a server reads a key from,
/// never one about the connection or the host.
fn binding_headers(field: &str, given: &[String]) -> Result<BTreeSet<String>, TransformError> {
    if given.is_empty() || given.len() > MAX_HEADERS {
        return Err(bad(field, format!("names 1 to {MAX_HEADERS} headers")));
    }
    let mut headers = BTreeSet::new();
    for name in given {
        if name.len() > MAX_HEADER_NAME || http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(bad(field, format!("`{}` is not a header name", name.escape_debug().take(64).collect::<String>())));
        }
        if is_hop_by_hop(name) {
            return Err(bad(field, format!("`{name}` is a connection header; a secret goes in request headers only")));
        }
        headers.insert(name.to_ascii_lowercase());
    }
    Ok(headers)
}

/// A binding's query parameter names: what a client writes before `=`.
fn query_names(field: &str, given: &[String]) -> Result<BTreeSet<String>, TransformError> {
    if given.is_empty() || given.len() > MAX_HEADERS {
        return Err(bad(field, format!("names 1 to {MAX_HEADERS} parameters")));
    }
    let mut names = BTreeSet::new();
    for name in given {
        if name.is_empty() || name.len() > MAX_HEADER_NAME || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._~[]".contains(&b)) {
            return Err(bad(field, format!("`{}` is not a parameter's name (letters, digits and `-._~[]`, at most {MAX_HEADER_NAME} bytes)", name.escape_debug().take(64).collect::<String>())));
        }
        names.insert(name.clone());
    }
    Ok(names)
}

fn named_in(headers: &BTreeMap<String, String>) -> BTreeSet<String> {
    headers
        .values()
        .flat_map(|value| parse_value(value).unwrap_or_default())
        .filter_map(|part| match part {
            Part::Secret(name) => Some(name),
            Part::Text(_) => None,
        })
        .collect()
}

/// A secret's name as E2B normalizes it (trimmed, lower-cased), or why it is not one.
pub fn secret_name(name: &str) -> Result<String, String> {
    let name = name.trim();
    if name.is_empty() || name.len() > 128 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(format!("`{}` is not a secret's name (1 to 128 letters, digits, `_` and `-`)", name.escape_debug().take(64).collect::<String>()));
    }
    Ok(name.to_ascii_lowercase())
}

fn rule_host(key: &str) -> Result<String, String> {
    let key = key.trim();
    if key == "*" {
        return Err("`*` is not a host; name one, or `*.domain` for the names below it".into());
    }
    if key.parse::<std::net::IpAddr>().is_ok() || crate::rules::parse_cidr(key).is_some() {
        return Err("is an address; hutch applies rules by the TLS server name, so key them by domain".into());
    }
    match key.strip_prefix("*.") {
        Some(apex) => normalize_name(key, apex).map(|a| format!("*.{a}")).map_err(|e| e.reason),
        None => normalize_name(key, key).map_err(|e| e.reason),
    }
}

fn check_headers(field: &str, given: &serde_json::Value) -> Result<BTreeMap<String, String>, TransformError> {
    let Some(given) = given.as_object() else { return Err(bad(field, "is an object of header name → value")) };
    if given.len() > MAX_HEADERS {
        return Err(bad(field, format!("sets {} headers; at most {MAX_HEADERS}", given.len())));
    }
    let mut headers = BTreeMap::new();
    let mut secrets = BTreeSet::new();
    for (name, value) in given {
        let at = format!("{field}.{name}");
        if name.len() > MAX_HEADER_NAME || http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(bad(&at, format!("is not a header name (a token of at most {MAX_HEADER_NAME} bytes)")));
        }
        if is_hop_by_hop(name) {
            return Err(bad(&at, "is a connection header; a transform sets request headers only"));
        }
        let Some(value) = value.as_str() else { return Err(bad(&at, "is a string")) };
        if value.len() > MAX_HEADER_VALUE {
            return Err(bad(&at, format!("is longer than {MAX_HEADER_VALUE} bytes")));
        }
        if http::HeaderValue::from_str(value).is_err() {
            return Err(bad(&at, "holds a byte a header value cannot (CR, LF, NUL or another control character, or non-ASCII)"));
        }
        for part in parse_value(value).map_err(|m| bad(&at, m))? {
            if let Part::Secret(name) = part {
                secrets.insert(name);
            }
        }
        headers.insert(name.to_ascii_lowercase(), value.to_string());
    }
    if secrets.len() > MAX_SECRETS_PER_HOST {
        return Err(bad(field, format!("names {} secrets; a host's rule names at most {MAX_SECRETS_PER_HOST}", secrets.len())));
    }
    Ok(headers)
}

/// Headers that describe the connection, not the request: a rule setting one could
/// split or smuggle requests between hutch and the server.
fn is_hop_by_hop(name: &str) -> bool {
    ["host", "connection", "content-length", "transfer-encoding", "upgrade", "te", "trailer", "keep-alive", "proxy-connection", "expect"].iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// A header value with its placeholders filled in by `reveal`.
pub async fn render<F, Fut>(value: &str, reveal: F) -> Result<Zeroizing<String>, String>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<Zeroizing<String>, String>>,
{
    let parts = parse_value(value).map_err(str::to_string)?;
    let mut values = Vec::new();
    for part in &parts {
        if let Part::Secret(name) = part {
            values.push(reveal(name.clone()).await?);
        }
    }
    // Exactly the room it needs, so growing leaves no copy of a secret in freed memory.
    let len = parts.iter().map(|p| if let Part::Text(t) = p { t.len() } else { 0 }).sum::<usize>() + values.iter().map(|v| v.len()).sum::<usize>();
    let mut out = Zeroizing::new(String::with_capacity(len));
    let mut values = values.iter();
    for part in &parts {
        match part {
            Part::Text(t) => out.push_str(t),
            Part::Secret(_) => out.push_str(values.next().map(|v| v.as_str()).unwrap_or_default()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules(v: serde_json::Value) -> Result<Transforms, TransformError> {
        Transforms::from_e2b(&v)
    }

    #[test]
    fn exact_beats_wildcards_and_the_longest_wildcard_wins() {
        let t = rules(json!({
            "api.x.com": [{"transform": {"headers": {"A": "exact"}}}],
            "*.x.com": [{"transform": {"headers": {"A": "short"}}}],
            "*.eu.x.com": [{"transform": {"headers": {"A": "long"}}}],
            "Other.COM": [{}],
        }))
        .expect("valid");
        let a = |h: &str| t.for_host(h).and_then(|m| m.get("a")).cloned();
        assert_eq!(a("api.x.com").as_deref(), Some("exact"));
        assert_eq!(a("b.x.com").as_deref(), Some("short"));
        assert_eq!(a("a.eu.x.com").as_deref(), Some("long"));
        assert_eq!(a("x.com"), None, "a wildcard is not its apex");
        assert_eq!(a("evilx.com"), None);
        assert!(t.for_host("other.com").is_some_and(|m| m.is_empty()), "a rule without a transform still inspects");
        assert!(t.covers_any(&["nope.org".into(), "b.x.com".into()]));
        assert!(!t.covers_any(&["x.com".into()]));
    }

    #[test]
    fn placeholders_are_found_and_malformed_ones_refused() {
        assert_eq!(parse_value("Bearer ${e2b.secrets. OpenAI }!").expect("ok"), vec![Part::Text("Bearer "), Part::Secret("openai".into()), Part::Text("!")]);
        assert_eq!(parse_value("a${b}c").expect("ok"), vec![Part::Text("a"), Part::Text("${"), Part::Text("b}c")]);
        assert!(parse_value("${e2b.secrets.x").is_err());
        assert!(parse_value("${e2b.secrets.a b}").is_err());
        assert!(parse_value("${e2b.secrets.${e2b.secrets.a}}").is_err());
        assert!(parse_value("${e2b.identity.tokens.aws}").is_err());
        let t = rules(json!({"a.com": [{"transform": {"headers": {"X": "${e2b.secrets.one}-${e2b.secrets.TWO}"}}}]})).expect("valid");
        assert_eq!(t.secret_names().into_iter().collect::<Vec<_>>(), ["one", "two"]);
    }

    #[test]
    fn bad_rules_name_the_field_and_never_the_value() {
        let field = |v: serde_json::Value| rules(v).expect_err("refused").field;
        assert_eq!(field(json!({"*": [{}]})), "network.rules.*");
        assert_eq!(field(json!({"10.0.0.0/8": [{}]})), "network.rules.10.0.0.0/8");
        assert_eq!(field(json!({"a.com": [{}, {}]})), "network.rules.a.com");
        assert_eq!(field(json!({"a.com": [{"transform": {"headers": {"Bad Name": "v"}}}]})), "network.rules.a.com.transform.headers.Bad Name");
        assert_eq!(field(json!({"a.com": [{"transform": {"headers": {"Host": "v"}}}]})), "network.rules.a.com.transform.headers.Host");
        let secret = "sk-live-do-not-show";
        let err = rules(json!({"a.com": [{"transform": {"headers": {"X": format!("{secret}\r\nEvil: 1")}}}]})).expect_err("CRLF");
        assert_eq!(err.field, "network.rules.a.com.transform.headers.X");
        assert!(!err.to_string().contains(secret));
        let long = "v".repeat(MAX_HEADER_VALUE + 1);
        assert!(rules(json!({"a.com": [{"transform": {"headers": {"X": long}}}]})).is_err());
        let many: serde_json::Map<String, serde_json::Value> = (0..=MAX_HOSTS).map(|i| (format!("h{i}.com"), json!([{}]))).collect();
        assert_eq!(field(serde_json::Value::Object(many)), "network.rules");
        assert!(rules(json!({"A.com": [{}], "a.com": [{}]})).is_err(), "the same host twice");
    }

    #[test]
    fn bindings_set_placeholders_and_bind_exact_hosts_for_credential_headers() {
        let binding = |name: Option<&str>, hosts: &[&str], headers: Option<&[&str]>| SecretBinding {
            name: name.map(str::to_string),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            headers: headers.map(|h| h.iter().map(|s| s.to_string()).collect()),
            query: None,
        };
        let mut t = Transforms::default();
        let secrets: BTreeMap<String, SecretBinding> = [
            ("OPENAI_API_KEY".to_string(), binding(Some("OpenAI"), &["api.openai.com"], None)),
            ("GH_TOKEN".to_string(), binding(None, &["API.github.com"], Some(&["X-GitHub-Token"]))),
        ]
        .into();
        let env = t.bind_all("secrets", &secrets).expect("bound");
        assert_eq!(env["OPENAI_API_KEY"], "${e2b.secrets.openai}");
        assert_eq!(env["GH_TOKEN"], "${e2b.secrets.gh_token}");
        let openai = t.bound_to("api.openai.com").expect("bound");
        assert_eq!(openai["openai"].headers.iter().map(String::as_str).collect::<Vec<_>>(), {
            let mut h = CREDENTIAL_HEADERS.to_vec();
            h.sort();
            h
        });
        assert_eq!(t.bound_to("api.github.com").expect("bound")["gh_token"].headers.iter().collect::<Vec<_>>(), ["x-github-token"]);
        assert!(t.bound_to("github.com").is_none() && t.covers("api.github.com") && !t.covers("github.com"));
        assert!(t.for_host("api.openai.com").is_none(), "a binding is not a rule");
        assert!(t.check_env("envVars", &env).is_ok());
        let stray: BTreeMap<String, String> = [("K".to_string(), "${e2b.secrets.nobody}".to_string())].into();
        assert_eq!(t.check_env("envVars", &stray).expect_err("unbound").field, "envVars.K");
        let refused = |b: SecretBinding| {
            let mut t = Transforms::default();
            t.bind_all("secrets", &[("K".to_string(), b)].into()).expect_err("refused").field
        };
        assert_eq!(refused(binding(None, &[], None)), "secrets.K.hosts");
        assert_eq!(refused(binding(None, &["*.github.io"], None)), "secrets.K.hosts", "a wildcard covers names anyone can register");
        assert_eq!(refused(binding(None, &["a.com"], Some(&["Host"]))), "secrets.K.headers");
        assert_eq!(refused(binding(None, &["a.com"], Some(&[]))), "secrets.K.headers");
        assert!(t.bind_all("secrets", &[("1K".to_string(), binding(None, &["a.com"], None))].into()).is_err());
        // An update replaces the rules and keeps the bindings; a binding does not hide a
        // wildcard rule's headers.
        let kept = Transforms::from_e2b(&json!({"*.openai.com": [{"transform": {"headers": {"X": "1"}}}]})).expect("rules").keeping_bindings_of(&t);
        assert!(kept.bound_to("api.openai.com").is_some_and(|b| b.contains_key("openai")));
        assert!(kept.for_host("api.openai.com").is_some_and(|h| h.contains_key("x")));
    }

    #[tokio::test]
    async fn render_fills_in_each_placeholder() {
        let out = render("Bearer ${e2b.secrets.k}/${e2b.secrets.k}", |name| async move { Ok(Zeroizing::new(format!("<{name}>"))) }).await.expect("rendered");
        assert_eq!(out.as_str(), "Bearer <k>/<k>");
        let gone = render("${e2b.secrets.gone}", |_| async { Err("no such secret".to_string()) }).await;
        assert_eq!(gone.expect_err("missing"), "no such secret");
    }
}
