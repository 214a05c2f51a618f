//! Sandbox networking: the rules that decide where a sandbox may connect (`rules`,
//! `ranges`, E2B's settings in `e2b`), the DNS server guests use (`dns`), the seam
//! through which the stack reaches the world (`seam`), and the userspace stack on the
//! host end of each guest's NIC (`stack`).

pub mod dns;
pub mod e2b;
pub mod inspect;
pub mod log;
pub mod public_proxy;
pub mod ranges;
pub mod rules;
pub mod scan;
pub mod seam;
pub mod socks5;
pub mod stack;

pub use log::{LogView, NetLog};
pub use ipnet::IpNet;
pub use ranges::{Group, HostAddrs};
pub use rules::{Policy, Reach, Rule, RuleError};
pub use seam::Seam;
pub use stack::{Limits, LinkState, NetHandle};
pub mod settings;
pub use settings::{E2bSettings, Environment, Settings};
