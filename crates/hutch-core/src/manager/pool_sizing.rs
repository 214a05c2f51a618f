//! How many sandboxes each template's warm pool keeps: a size the operator pinned
//! (`--pool TEMPLATE=N`), or one read from recent creates. Pure bookkeeping, kept under
//! the pools' lock; `pool.rs` acts on what it says.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The pools a server keeps (`hutch serve`'s `--pool`, `--pool-max`, `--no-pool`).
#[derive(Debug, Clone)]
pub struct PoolPolicy {
    /// Sizes the operator pinned, by canonical template name: demand never changes them.
    pub pinned: BTreeMap<String, usize>,
    /// Sizing by demand for every other template; `None` keeps only the pinned pools.
    pub demand: Option<DemandPolicy>,
    /// Host memory (MiB) the pools leave free: a fill starts only while more than this
    /// and the sandbox's own memory is available, and below it waiting sandboxes stop,
    /// so a create never finds the host's memory held by the pools.
    pub reserve_mib: u64,
    /// How the host's free memory is read (`host_memory::available_mib`; unit tests
    /// give their own).
    pub free_memory: fn() -> Option<u64>,
    /// How often the upkeep looks at the pools (demand's window, memory, refills).
    pub upkeep_every: Duration,
}

#[derive(Debug, Clone)]
pub struct DemandPolicy {
    /// Kept at one waiting sandbox at least, used or not: what a first create asks for.
    pub default_template: String,
    /// The most sandboxes demand makes one template's pool keep.
    pub cap: usize,
    /// A template not created from for this long gets no pool (its waiting VMs stop).
    pub window: Duration,
}

impl PoolPolicy {
    /// No pools at all (`--no-pool`).
    pub fn off() -> PoolPolicy {
        PoolPolicy { pinned: BTreeMap::new(), demand: None, reserve_mib: default_reserve_mib(), free_memory: crate::host_memory::available_mib, upkeep_every: UPKEEP_EVERY }
    }

    /// `hutch serve`'s default: one waiting sandbox of `base`, and pools sized by demand.
    pub fn by_demand(cap: usize) -> PoolPolicy {
        let demand = DemandPolicy { default_template: "base".into(), cap, window: DEMAND_WINDOW };
        PoolPolicy { demand: Some(demand), ..PoolPolicy::off() }
    }
}

impl Default for PoolPolicy {
    fn default() -> Self {
        PoolPolicy::off()
    }
}

/// One pool as `GET /status` and `hutch ls --pool` show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    pub template: String,
    /// Sandboxes of its current build waiting now.
    pub ready: usize,
    /// How many it keeps now.
    pub target: usize,
    /// Whether the operator pinned that size (else demand set it).
    pub pinned: bool,
}

/// An eighth of the host's memory, 1 GiB at least: room for the page cache and for
/// sandboxes in use to grow into the memory they were given.
fn default_reserve_mib() -> u64 {
    crate::host_memory::total_mib().map_or(1024, |total| (total / 8).max(1024))
}

/// How often the pools' upkeep runs by default.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// How long a template keeps its demand-sized pool after its last create.
pub const DEMAND_WINDOW: Duration = Duration::from_secs(600);

/// Creates that arrive within this span of each other are one burst, and a pool sized
/// for a burst holds that many. About what a refill takes under TCG (a restore and the
/// warm-up, ~0.5 s measured) with margin: creates further apart than that find the pool
/// refilled by the one before.
pub const BURST_SPAN: Duration = Duration::from_secs(2);

/// The most create times remembered per template (a burst larger than this is sized
/// as this; the cap is far below it).
const REMEMBERED: usize = 64;

/// Recent creates by template: what the demand-sized pools are sized from.
#[derive(Default)]
pub(super) struct Demand {
    creates: HashMap<String, VecDeque<Instant>>,
}

impl Demand {
    pub fn record(&mut self, template: &str, now: Instant) {
        let times = self.creates.entry(template.to_string()).or_default();
        times.push_back(now);
        if times.len() > REMEMBERED {
            times.pop_front();
        }
    }

    /// Forgets `template` (its pool cannot be filled: the next create tries again).
    pub fn forget(&mut self, template: &str) {
        self.creates.remove(template);
    }

    /// Forgets template `name` and every tag of it (its builds changed or it is gone).
    pub fn forget_template(&mut self, name: &str) {
        self.creates.retain(|reference, _| hutch_image::tags::split(reference).0 != name);
    }

    /// Drops what fell out of the window; templates left with no create go.
    pub fn expire(&mut self, window: Duration, now: Instant) {
        for times in self.creates.values_mut() {
            while times.front().is_some_and(|t| now.duration_since(*t) > window) {
                times.pop_front();
            }
        }
        self.creates.retain(|_, times| !times.is_empty());
    }

    /// Templates created from within the window (after `expire`).
    pub fn templates(&self) -> impl Iterator<Item = &str> {
        self.creates.keys().map(String::as_str)
    }

    /// The largest burst of creates of `template` still remembered: the most that
    /// arrived within `BURST_SPAN` of each other.
    fn burst(&self, template: &str) -> usize {
        let Some(times) = self.creates.get(template) else { return 0 };
        let times: Vec<Instant> = times.iter().copied().collect();
        let mut start = 0;
        let mut most = 0;
        for end in 0..times.len() {
            while times[end].duration_since(times[start]) > BURST_SPAN {
                start += 1;
            }
            most = most.max(end - start + 1);
        }
        most
    }

    /// How many sandboxes `template`'s pool keeps under `policy`.
    pub fn target(&self, policy: &PoolPolicy, template: &str) -> usize {
        if let Some(n) = policy.pinned.get(template) {
            return *n;
        }
        let Some(demand) = &policy.demand else { return 0 };
        let floor = usize::from(template == demand.default_template);
        self.burst(template).max(floor).min(demand.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> PoolPolicy {
        let mut p = PoolPolicy::by_demand(3);
        p.pinned.insert("pinned".into(), 2);
        p
    }

    #[test]
    fn the_default_template_keeps_one_and_others_none_until_used() {
        let d = Demand::default();
        assert_eq!(d.target(&policy(), "base"), 1);
        assert_eq!(d.target(&policy(), "other"), 0);
        assert_eq!(d.target(&policy(), "pinned"), 2);
        assert_eq!(d.target(&PoolPolicy::off(), "base"), 0);
    }

    #[test]
    fn a_burst_sizes_the_pool_up_to_the_cap_and_sequential_creates_keep_one() {
        let t0 = Instant::now();
        let mut d = Demand::default();
        // One create every 5 s: each finds the pool refilled, one is enough.
        for i in 0..4 {
            d.record("other", t0 + Duration::from_secs(5 * i));
        }
        assert_eq!(d.target(&policy(), "other"), 1);
        // Two within 2 s: two.
        d.record("other", t0 + Duration::from_secs(15) + Duration::from_millis(500));
        assert_eq!(d.target(&policy(), "other"), 2);
        // Ten at once: the cap.
        for _ in 0..10 {
            d.record("burst", t0);
        }
        assert_eq!(d.target(&policy(), "burst"), 3);
        // Demand never changes a pinned size.
        for _ in 0..10 {
            d.record("pinned", t0);
        }
        assert_eq!(d.target(&policy(), "pinned"), 2);
    }

    #[test]
    fn demand_expires_after_the_window() {
        let t0 = Instant::now();
        let mut d = Demand::default();
        d.record("other", t0);
        d.record("base", t0);
        d.expire(DEMAND_WINDOW, t0 + DEMAND_WINDOW);
        assert_eq!(d.templates().count(), 2, "kept through the window");
        d.expire(DEMAND_WINDOW, t0 + DEMAND_WINDOW + Duration::from_secs(1));
        assert_eq!(d.templates().count(), 0);
        assert_eq!(d.target(&policy(), "other"), 0);
        assert_eq!(d.target(&policy(), "base"), 1, "the default template keeps its one");
    }

    #[test]
    fn memory_is_bounded_by_what_is_remembered() {
        let mut d = Demand::default();
        let t0 = Instant::now();
        for _ in 0..1000 {
            d.record("x", t0);
        }
        assert_eq!(d.creates["x"].len(), REMEMBERED);
    }
}
