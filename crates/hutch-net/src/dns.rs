//! The gateway's DNS server: every query the guest sends to port 53, whatever address
//! it asks. A name resolves only if the sandbox's policy lets it; answers are looked up
//! with the host's resolver, and addresses in groups the sandbox may never reach are
//! dropped (DNS rebinding: a public name pointing at 127.0.0.1 or the metadata
//! service). Every answer is pinned, name to address, for as long as domain rules may
//! need it.

use crate::log::NetLog;
use crate::rules::{normalize_name, DenyReason, Policy, Reach};
use crate::seam::{LookupError, Seam};
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::{rdata::A, RData, Record, RecordType};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

/// The TTL of hutch's answers: short, so a policy change reaches names soon.
pub const ANSWER_TTL: u32 = 30;
/// How long a name stays tied to an address after the answer: guests and libraries
/// keep addresses longer than TTLs say (connection pools, long downloads).
pub const PIN_LIFETIME: Duration = Duration::from_secs(600);
/// Pins kept per sandbox; the oldest go first.
pub const MAX_PINS: usize = 4096;

/// Name ↔ address pairs the guest was given, for domain rules.
#[derive(Debug, Default)]
pub struct Pins {
    by_ip: HashMap<Ipv4Addr, Vec<(String, Instant)>>,
    count: usize,
}

impl Pins {
    pub fn pin(&mut self, name: &str, ip: Ipv4Addr, now: Instant) {
        let until = now + PIN_LIFETIME;
        let entry = self.by_ip.entry(ip).or_default();
        match entry.iter_mut().find(|(n, _)| n == name) {
            Some(e) => e.1 = until,
            None => {
                entry.push((name.to_string(), until));
                self.count += 1;
            }
        }
        if self.count > MAX_PINS {
            self.expire(now, true);
        }
    }

    /// Drops expired pins; with `shrink`, also the oldest half when still too many.
    fn expire(&mut self, now: Instant, shrink: bool) {
        for list in self.by_ip.values_mut() {
            list.retain(|(_, until)| *until > now);
        }
        self.by_ip.retain(|_, l| !l.is_empty());
        self.count = self.by_ip.values().map(Vec::len).sum();
        if shrink && self.count > MAX_PINS {
            let mut all: Vec<Instant> = self.by_ip.values().flatten().map(|(_, u)| *u).collect();
            all.sort();
            let cut = all[all.len() / 2];
            for list in self.by_ip.values_mut() {
                list.retain(|(_, until)| *until > cut);
            }
            self.by_ip.retain(|_, l| !l.is_empty());
            self.count = self.by_ip.values().map(Vec::len).sum();
        }
    }

    /// The live names pinned to `ip`.
    pub fn names(&self, ip: Ipv4Addr, now: Instant) -> Vec<String> {
        self.by_ip.get(&ip).map(|l| l.iter().filter(|(_, u)| *u > now).map(|(n, _)| n.clone()).collect()).unwrap_or_default()
    }
}

/// Everything one DNS answer needs.
pub struct DnsContext<'a> {
    pub policy: &'a Policy,
    pub reach: &'a Reach,
    pub seam: &'a dyn Seam,
    pub pins: &'a Mutex<Pins>,
    pub log: &'a NetLog,
}

fn reply(query: &Message, code: ResponseCode) -> Message {
    let mut m = Message::new();
    m.set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code);
    m.add_queries(query.queries().to_vec());
    m
}

/// The answer to one DNS message from the guest; None for bytes that are not a query.
pub async fn answer(packet: &[u8], cx: &DnsContext<'_>) -> Option<Vec<u8>> {
    let query = Message::from_vec(packet).ok()?;
    if query.message_type() != MessageType::Query {
        return None;
    }
    let Some(q) = query.queries().first() else {
        return reply(&query, ResponseCode::FormErr).to_vec().ok();
    };
    let name_text = q.name().to_ascii();
    let Ok(name) = normalize_name("", &name_text) else {
        return reply(&query, ResponseCode::NXDomain).to_vec().ok();
    };
    if let Err(reason) = cx.policy.check_name(&name) {
        cx.log.name_denied(&name, reason);
        return reply(&query, ResponseCode::NXDomain).to_vec().ok();
    }
    // IPv4 only: AAAA and every other type is answered "no data", so resolvers fall
    // back to A at once instead of waiting.
    if q.query_type() != RecordType::A {
        return reply(&query, ResponseCode::NoError).to_vec().ok();
    }
    let addrs = match cx.seam.lookup(&name).await {
        Ok(a) => a,
        Err(LookupError::NotFound) => return reply(&query, ResponseCode::NXDomain).to_vec().ok(),
        Err(LookupError::Timeout | LookupError::Failed(_)) => return reply(&query, ResponseCode::ServFail).to_vec().ok(),
    };
    let mut kept = Vec::new();
    let mut refused = None;
    for ip in addrs {
        match cx.reach.refusal(IpAddr::V4(ip)) {
            Some(reason) => refused = Some(reason),
            None => kept.push(ip),
        }
    }
    if kept.is_empty() {
        match refused {
            Some(DenyReason::Protected { group }) => cx.log.name_denied(&name, DenyReason::Rebinding { group }),
            Some(reason) => cx.log.name_denied(&name, reason),
            None => {}
        }
        return reply(&query, ResponseCode::NXDomain).to_vec().ok();
    }
    cx.log.name_resolved();
    let now = Instant::now();
    let mut m = reply(&query, ResponseCode::NoError);
    {
        let mut pins = cx.pins.lock();
        for ip in &kept {
            pins.pin(&name, *ip, now);
            m.add_answer(Record::from_rdata(q.name().clone(), ANSWER_TTL, RData::A(A(*ip))));
        }
    }
    m.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranges::HostAddrs;
    use crate::seam::{TestMap, TestMapFile};
    use hickory_proto::op::Query;
    use hickory_proto::rr::Name;
    use std::str::FromStr;

    fn seam() -> TestMap {
        let mut file = TestMapFile::default();
        file.names.insert("pypi.org".into(), vec!["151.101.0.223".parse().expect("ip"), "151.101.64.223".parse().expect("ip")]);
        file.names.insert("rebind.example.com".into(), vec!["127.0.0.1".parse().expect("ip"), "169.254.169.254".parse().expect("ip")]);
        file.names.insert("zero.example.com".into(), vec!["0.0.0.0".parse().expect("ip"), "240.1.2.3".parse().expect("ip"), "255.255.255.255".parse().expect("ip"), "239.1.1.1".parse().expect("ip")]);
        file.names.insert("mixed.example.com".into(), vec!["10.0.0.5".parse().expect("ip"), "93.184.216.34".parse().expect("ip")]);
        TestMap::new(file)
    }

    fn query(name: &str, t: RecordType) -> Vec<u8> {
        let mut m = Message::new();
        m.set_id(4242).set_message_type(MessageType::Query).set_recursion_desired(true);
        m.add_query(Query::query(Name::from_str(name).expect("name"), t));
        m.to_vec().expect("encode")
    }

    async fn ask(policy: &str, name: &str, t: RecordType, pins: &Mutex<Pins>, log: &NetLog) -> Message {
        let policy = Policy::parse(policy).expect("policy");
        let reach = Reach { open: vec![], also_public: vec![], host: HostAddrs::default() };
        let seam = seam();
        let cx = DnsContext { policy: &policy, reach: &reach, seam: &seam, pins, log };
        let bytes = answer(&query(name, t), &cx).await.expect("an answer");
        Message::from_vec(&bytes).expect("decode")
    }

    fn addresses(m: &Message) -> Vec<String> {
        m.answers().iter().map(|r| r.data().to_string()).collect()
    }

    #[tokio::test]
    async fn allowed_names_get_their_addresses_and_are_pinned() {
        let (pins, log) = (Mutex::new(Pins::default()), NetLog::default());
        let m = ask("allow@public", "PyPI.org.", RecordType::A, &pins, &log).await;
        assert_eq!((m.id(), m.response_code()), (4242, ResponseCode::NoError));
        assert_eq!(addresses(&m), ["151.101.0.223", "151.101.64.223"]);
        assert_eq!(m.answers()[0].ttl(), ANSWER_TTL);
        let now = Instant::now();
        assert_eq!(pins.lock().names("151.101.64.223".parse().expect("ip"), now), ["pypi.org"]);
        assert!(pins.lock().names("151.101.64.223".parse().expect("ip"), now + PIN_LIFETIME).is_empty());
        let aaaa = ask("allow@public", "pypi.org", RecordType::AAAA, &pins, &log).await;
        assert_eq!((aaaa.response_code(), aaaa.answers().len()), (ResponseCode::NoError, 0));
        assert_eq!(log.view().counters.names_resolved, 1);
    }

    #[tokio::test]
    async fn denied_and_unknown_names_are_nxdomain_and_denials_are_logged() {
        let (pins, log) = (Mutex::new(Pins::default()), NetLog::default());
        assert_eq!(ask("none", "pypi.org", RecordType::A, &pins, &log).await.response_code(), ResponseCode::NXDomain);
        assert_eq!(ask("deny@pypi.org,allow@public", "pypi.org", RecordType::A, &pins, &log).await.response_code(), ResponseCode::NXDomain);
        assert_eq!(ask("allow@public", "nowhere.example.com", RecordType::A, &pins, &log).await.response_code(), ResponseCode::NXDomain);
        let view = log.view();
        assert_eq!(view.counters.names_denied, 2);
        assert_eq!(view.denials[1].message, "denied by rule deny@pypi.org");
    }

    #[tokio::test]
    async fn names_pointing_into_protected_ranges_are_refused_or_filtered() {
        let (pins, log) = (Mutex::new(Pins::default()), NetLog::default());
        let m = ask("allow@public", "rebind.example.com", RecordType::A, &pins, &log).await;
        assert_eq!(m.response_code(), ResponseCode::NXDomain);
        assert!(log.view().denials[0].message.contains("resolves to a"));
        // `allow@*` matches every address, yet 0.0.0.0 is this host's loopback and the
        // rest are never destinations: none of them is handed to the guest.
        let zero = ask("allow@*", "zero.example.com", RecordType::A, &pins, &log).await;
        assert_eq!((zero.response_code(), addresses(&zero).len()), (ResponseCode::NXDomain, 0));
        let mixed = ask("allow@public", "mixed.example.com", RecordType::A, &pins, &log).await;
        assert_eq!(addresses(&mixed), ["93.184.216.34"]);
    }

    #[test]
    fn pins_are_bounded() {
        let mut pins = Pins::default();
        let t0 = Instant::now();
        for i in 0..(MAX_PINS as u32 + 10) {
            pins.pin(&format!("n{i}.test"), Ipv4Addr::from(0x0a00_0000 + i), t0 + Duration::from_millis(i.into()));
        }
        assert!(pins.count <= MAX_PINS, "{}", pins.count);
        assert_eq!(pins.names(Ipv4Addr::from(0x0a00_0000 + MAX_PINS as u32 + 9), t0), ["n4105.test"]);
    }
}
