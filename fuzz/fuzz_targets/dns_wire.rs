//! The gateway's DNS server on any bytes a guest sends to port 53 (UDP datagrams and
//! DNS-over-TCP messages alike): it never panics, and whatever it answers is a DNS
//! response to the question's id. Names resolve through the test seam only.
#![no_main]
use hickory_proto::op::{Message, MessageType};
use hutch_net::dns::{answer, DnsContext, Pins};
use hutch_net::seam::{TestMap, TestMapFile};
use hutch_net::{HostAddrs, NetLog, Policy, Reach};
use libfuzzer_sys::fuzz_target;
use parking_lot::Mutex;
use std::sync::OnceLock;

struct World {
    runtime: tokio::runtime::Runtime,
    policy: Policy,
    reach: Reach,
    seam: TestMap,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let mut map = TestMapFile::default();
        map.names.insert("example.test".into(), vec!["93.184.216.34".parse().expect("ip")]);
        map.names.insert("rebind.test".into(), vec!["0.0.0.0".parse().expect("ip"), "127.0.0.1".parse().expect("ip")]);
        World {
            runtime: tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime"),
            policy: Policy::parse("allow@*").expect("policy"),
            reach: Reach { open: vec![], also_public: vec![], host: HostAddrs::default() },
            seam: TestMap::new(map),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let w = world();
    let (pins, log) = (Mutex::new(Pins::default()), NetLog::default());
    let cx = DnsContext { policy: &w.policy, reach: &w.reach, seam: &w.seam, pins: &pins, log: &log };
    let Some(reply) = w.runtime.block_on(answer(data, &cx)) else { return };
    let reply = Message::from_vec(&reply).expect("hutch's answer is a DNS message");
    let query = Message::from_vec(data).expect("only a query is answered");
    assert_eq!((reply.id(), reply.message_type()), (query.id(), MessageType::Response));
});
