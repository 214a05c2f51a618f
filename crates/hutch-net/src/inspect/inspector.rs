//! One sandbox's inspection (its CA, its rules, how it reaches upstreams) and where
//! the values its rules name come from.

use super::ca::SandboxCa;
use super::transforms::Transforms;
use super::upstream::Upstream;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zeroize::Zeroizing;

/// Where the host keeps secrets' values (hutch-core's store). A sandbox's rules name
/// secrets of the API key that made it (`Transforms::secrets_of`).
#[async_trait::async_trait]
pub trait SecretVault: Send + Sync {
    /// The current value of `owner`'s secret `name`. The error is a sentence for the
    /// network log: it never holds a value.
    async fn reveal(&self, owner: &str, name: &str) -> Result<Zeroizing<String>, String>;
}

/// Values given on the command line (`hutch run --secret`), for one sandbox whatever
/// its owner: they live in this process only.
pub struct InlineVault(pub HashMap<String, Zeroizing<String>>);

#[async_trait::async_trait]
impl SecretVault for InlineVault {
    async fn reveal(&self, _owner: &str, name: &str) -> Result<Zeroizing<String>, String> {
        self.0.get(name).cloned().ok_or_else(|| format!("no secret `{name}` was given to this sandbox"))
    }
}

/// How long a secret's value read from the vault serves requests before it is read
/// again (an update or deletion reaches requests within this), and how long a read may take.
const REVEALED_FOR: Duration = Duration::from_secs(10);
const REVEAL_WAIT: Duration = Duration::from_secs(5);

/// Each secret's last read (its value or why not), and when.
type Revealed = HashMap<String, (Instant, Result<Zeroizing<String>, String>)>;

/// One sandbox's inspection: its CA, its rules, and how it reaches upstreams and secrets.
pub struct Inspector {
    pub ca: Arc<SandboxCa>,
    pub transforms: Transforms,
    pub upstream: Arc<Upstream>,
    vault: Option<Arc<dyn SecretVault>>,
    /// Whether the rules name any secret: then what the guest sends is scanned for
    /// placeholders going where they are not filled in (`crate::scan`).
    scans: bool,
    /// Values read lately, so a guest's stream of requests is not a stream of reads of
    /// the store every tenant shares.
    revealed: tokio::sync::Mutex<Revealed>,
}

impl std::fmt::Debug for Inspector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inspector").field("hosts", &self.transforms.hosts.keys().collect::<Vec<_>>()).finish_non_exhaustive()
    }
}

impl Inspector {
    pub fn new(ca: Arc<SandboxCa>, transforms: Transforms, upstream: Arc<Upstream>, vault: Option<Arc<dyn SecretVault>>) -> Inspector {
        let scans = !transforms.secret_names().is_empty();
        Inspector { ca, transforms, upstream, vault, scans, revealed: Default::default() }
    }

    /// Whether the guest's traffic is scanned for placeholders.
    pub fn scans(&self) -> bool {
        self.scans
    }

    /// Whether a flow to an address the guest resolved under `names` goes through the gate.
    pub fn wants(&self, port: u16, names: &[String]) -> bool {
        port == 443 && self.transforms.covers_any(names)
    }

    pub(super) async fn reveal(&self, name: String) -> Result<Zeroizing<String>, String> {
        let (Some(vault), Some(owner)) = (&self.vault, &self.transforms.secrets_of) else {
            return Err(format!("secret `{name}` cannot be read: this hutch has no secrets store"));
        };
        // Held across the read: one sandbox reads one value at a time.
        let mut revealed = self.revealed.lock().await;
        if let Some((at, read)) = revealed.get(&name) {
            if at.elapsed() < REVEALED_FOR {
                return read.clone();
            }
        }
        // A failure is kept as long as a value: a rule naming a deleted secret must not
        // turn each of the guest's requests into a read of the store.
        let read = match tokio::time::timeout(REVEAL_WAIT, vault.reveal(owner, &name)).await {
            Ok(read) => read,
            Err(_) => Err(format!("secret `{name}` could not be read within {} s", REVEAL_WAIT.as_secs())),
        };
        revealed.insert(name, (Instant::now(), read.clone()));
        read
    }
}
