//! Agent-wide state shared by every request.

use crate::fs::watchers::Watchers;
use crate::http::connect::ConnectError;
use crate::process::reaper::Reaper;
use crate::process::user::GuestUser;
use crate::process::ProcessTable;
use headers::{authorization::Basic, Authorization, HeaderMapExt};
use hutch_proto::connect::Code;
use std::collections::BTreeMap;
use parking_lot::RwLock;
use std::sync::Arc;

pub struct Config {
    /// Sandbox-wide environment, visible to every process.
    pub env_vars: BTreeMap<String, String>,
    /// When set, data-plane requests must carry it in `X-Access-Token`.
    pub access_token: Option<String>,
    pub default_user: String,
    /// Where processes start when they name no cwd (the image's `WorkingDir`).
    pub default_workdir: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config { env_vars: BTreeMap::new(), access_token: None, default_user: "user".into(), default_workdir: None }
    }
}

#[derive(Clone, Default)]
pub struct AgentState {
    pub processes: ProcessTable,
    pub reaper: Reaper,
    pub watchers: Watchers,
    pub config: Arc<RwLock<Config>>,
}

impl AgentState {
    pub fn config(&self) -> parking_lot::RwLockReadGuard<'_, Config> {
        self.config.read()
    }

    /// The user a request acts as: the named one, else the default user, else root
    /// (so root filesystems without a `user` account still work).
    pub fn user(&self, name: Option<&str>) -> Result<GuestUser, ConnectError> {
        match name.filter(|n| !n.is_empty()) {
            Some(n) => GuestUser::lookup(n).map_err(|e| ConnectError::new(Code::Unauthenticated, e)),
            None => {
                let default = self.config().default_user.clone();
                Ok(GuestUser::lookup(&default).unwrap_or_else(|_| GuestUser::root()))
            }
        }
    }

    /// The user named by `Authorization: Basic base64("<user>:")`, as envd reads it.
    /// A header that is there but not that is refused, never read as no user (which
    /// would run as the default user).
    pub fn rpc_user(&self, headers: &axum::http::HeaderMap) -> Result<GuestUser, ConnectError> {
        let name = match headers.contains_key(axum::http::header::AUTHORIZATION) {
            false => None,
            true => match headers.typed_get::<Authorization<Basic>>() {
                Some(auth) => Some(auth.username().to_string()),
                None => return Err(ConnectError::new(Code::Unauthenticated, "the Authorization header is not Basic base64(\"<user>:\"); send that, or none for the default user")),
            },
        };
        self.user(name.as_deref())
    }
}
