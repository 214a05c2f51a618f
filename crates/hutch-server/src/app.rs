//! What every handler is handed (the manager, the data-plane domain) and the REST
//! contract the router serves.

use hutch_core::manager::SandboxManager;
use std::sync::Arc;

/// The REST contract, served at `/openapi.json` and checked against the router in tests.
pub const OPENAPI: &str = include_str!("../openapi.json");

/// Largest JSON body the REST API reads.
pub const MAX_BODY: usize = 1 << 20;

#[derive(Clone)]
pub struct AppState {
    pub manager: Arc<SandboxManager>,
    /// Domain of `<port>-<id>.<domain>` data-plane hosts, when routing by Host.
    pub domain: Option<String>,
}
