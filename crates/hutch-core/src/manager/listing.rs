//! How `list` filters and orders sandboxes, as E2B's `GET /v2/sandboxes` takes it.

use crate::store::SandboxRow;
use std::collections::BTreeMap;
use std::time::SystemTime;

/// Filter and order of `list`, as E2B's `GET /v2/sandboxes` takes them.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub metadata: BTreeMap<String, String>,
    /// Empty means every state.
    pub states: Vec<String>,
    /// Only sandboxes started at or after this instant.
    pub started_after: Option<SystemTime>,
    /// Only sandboxes of this template (its id or an alias of it).
    pub template: Option<String>,
    pub order: ListOrder,
}

/// E2B's list order by start time: newest first (the default), ties by id ascending;
/// `Asc` is the exact reverse, so a cursor walks either the same way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ListOrder {
    #[default]
    Desc,
    Asc,
}

impl ListOrder {
    /// How `a` and `b` (start time, id) compare in this order.
    pub fn compare(self, a: (SystemTime, &str), b: (SystemTime, &str)) -> std::cmp::Ordering {
        let newest_first = b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1));
        match self {
            ListOrder::Desc => newest_first,
            ListOrder::Asc => newest_first.reverse(),
        }
    }
}

/// A sandbox row's start time.
pub fn started(row: &SandboxRow) -> SystemTime {
    row.started_at.system_time()
}
