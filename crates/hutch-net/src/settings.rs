//! A sandbox's network settings as hutch keeps them (in its VM record), and the
//! process-wide environment every stack of one hutch shares.

use crate::e2b::{self, E2bNetwork, E2bNetworkError};
use crate::inspect::{SecretVault, Transforms, Upstream};
use crate::socks5::EgressProxy;
use crate::ranges::{Group, HostAddrs};
use crate::rules::{Policy, Reach};
use crate::seam::Seam;
use crate::stack::Limits;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What a sandbox may reach, and (for E2B clients) the settings it came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    pub policy: Policy,
    /// Headers set on HTTPS requests to chosen hosts (E2B's `network.rules`), by TLS
    /// inspection.
    #[serde(default, skip_serializing_if = "Transforms::is_empty")]
    pub transforms: Transforms,
    /// The SOCKS5 proxy the sandbox's TCP is opened through (E2B's `egressProxy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<EgressProxy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2b: Option<E2bSettings>,
}

/// E2B's fields as the client sent them, shown back as they were.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct E2bSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_internet_access: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<E2bNetwork>,
}

impl Settings {
    /// An update's settings, keeping the ingress of the ones they replace
    /// (`maskRequestHost`, `httpsPorts`) where the update gives none: E2B's network
    /// update replaces the egress rules, and its SDKs send no ingress with it.
    pub fn keeping_ingress_of(mut self, recorded: &Settings) -> Settings {
        let Some(old) = recorded.e2b.as_ref().and_then(|e| e.network.as_ref()) else { return self };
        if old.mask_request_host.is_none() && old.https_ports.is_none() {
            return self;
        }
        let net = self.e2b.get_or_insert_with(E2bSettings::default).network.get_or_insert_with(E2bNetwork::default);
        if net.mask_request_host.is_none() {
            net.mask_request_host = old.mask_request_host.clone();
        }
        if net.https_ports.is_none() {
            net.https_ports = old.https_ports.clone();
        }
        self
    }

    pub fn native(policy: Policy) -> Settings {
        Settings { policy, transforms: Transforms::default(), egress_proxy: None, e2b: None }
    }

    /// From E2B's `allow_internet_access` and `network` (on create or update).
    pub fn from_e2b(allow_internet_access: Option<bool>, network: Option<E2bNetwork>) -> Result<Settings, E2bNetworkError> {
        let policy = e2b::policy(allow_internet_access, network.as_ref())?;
        let mut settings = Settings::with_e2b_extras(policy, network.as_ref())?;
        settings.e2b = Some(E2bSettings { allow_internet_access, network: network.map(e2b::shown) });
        Ok(settings)
    }

    /// `policy`, with the header rules and egress proxy of E2B's `network` (kept, without
    /// the proxy's password, to show back).
    pub fn with_e2b_extras(policy: Policy, network: Option<&E2bNetwork>) -> Result<Settings, E2bNetworkError> {
        if let Some(net) = network {
            e2b::check_extras(net)?;
        }
        Ok(Settings {
            policy,
            transforms: e2b::transforms(network)?,
            egress_proxy: e2b::egress_proxy(network)?,
            e2b: network.map(|n| E2bSettings { allow_internet_access: None, network: Some(e2b::shown(n.clone())) }),
        })
    }
}

/// The operator's network settings, shared by every sandbox's stack.
#[derive(Clone)]
pub struct Environment {
    pub reach: Reach,
    pub seam: Arc<dyn Seam>,
    pub limits: Limits,
    /// How inspected flows check their servers (`--upstream-ca`).
    pub upstream: Arc<Upstream>,
    /// Where rules' `${e2b.secrets.NAME}` are read from (none: rules cannot name secrets).
    pub vault: Option<Arc<dyn SecretVault>>,
}

impl std::fmt::Debug for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Environment").field("open", &self.reach.open).field("limits", &self.limits).finish_non_exhaustive()
    }
}

impl Default for Environment {
    /// The real world through this host's resolver, nothing protected opened.
    fn default() -> Self {
        Environment {
            reach: Reach { open: Vec::new(), also_public: Vec::new(), host: HostAddrs::of_this_machine() },
            seam: Arc::new(crate::seam::Direct::default()),
            limits: Limits::default(),
            upstream: Arc::new(Upstream::default()),
            vault: None,
        }
    }
}

impl Environment {
    /// The environment for this process: `HUTCH_NET_TEST_MAP` selects the test seam;
    /// `open` lists protected groups the operator lets rules reach, `also_public`
    /// reserved ranges this deployment counts as public.
    pub fn from_env(open: Vec<Group>, also_public: Vec<ipnet::IpNet>) -> Result<Environment, String> {
        Ok(Environment { reach: Reach { open, also_public, host: HostAddrs::of_this_machine() }, seam: crate::seam::from_env()?, ..Environment::default() })
    }
}
