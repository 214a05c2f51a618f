//! The agent's HTTP surface: envd's Connect services and plain endpoints.

pub mod connect;
pub mod files;
pub mod misc;
pub mod tunnel;

use crate::fs::{rpc as fs_rpc, watch};
use crate::process::rpc as proc_rpc;
use crate::state::AgentState;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

pub fn router(state: AgentState) -> Router {
    Router::new()
        .route("/health", get(misc::health))
        .route("/envs", get(misc::envs))
        .route("/metrics", get(misc::metrics))
        .route("/init", post(misc::init))
        .route("/clock", post(misc::clock))
        .route("/shutdown", post(misc::shutdown))
        .route("/sync", post(misc::sync))
        .route("/files", get(files::download).post(files::upload))
        .route("/tunnel/{port}", post(tunnel::open))
        .route("/process.Process/Start", post(proc_rpc::start))
        .route("/process.Process/Connect", post(proc_rpc::connect))
        .route("/process.Process/List", post(proc_rpc::list))
        .route("/process.Process/SendInput", post(proc_rpc::send_input))
        .route("/process.Process/StreamInput", post(proc_rpc::stream_input))
        .route("/process.Process/CloseStdin", post(proc_rpc::close_stdin))
        .route("/process.Process/SendSignal", post(proc_rpc::send_signal))
        .route("/process.Process/Update", post(proc_rpc::update))
        .route("/filesystem.Filesystem/Stat", post(fs_rpc::stat))
        .route("/filesystem.Filesystem/MakeDir", post(fs_rpc::make_dir))
        .route("/filesystem.Filesystem/Move", post(fs_rpc::move_entry))
        .route("/filesystem.Filesystem/ListDir", post(fs_rpc::list_dir))
        .route("/filesystem.Filesystem/Remove", post(fs_rpc::remove))
        .route("/filesystem.Filesystem/WatchDir", post(watch::watch_dir))
        .route("/filesystem.Filesystem/CreateWatcher", post(watch::create_watcher))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(watch::get_watcher_events))
        .route("/filesystem.Filesystem/RemoveWatcher", post(watch::remove_watcher))
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .with_state(state)
}

/// envd's rule: with an access token set, everything but `/health`, `/files` (which
/// also accepts signed URLs) and hutch's `/init` and `/clock` needs `X-Access-Token`
/// (the proxy refuses those two: only the host reaches them).
async fn require_token(State(st): State<AgentState>, req: Request, next: Next) -> Response {
    let exempt = matches!(
        (req.method(), req.uri().path()),
        (&Method::GET, "/health") | (_, "/files") | (&Method::POST, "/init") | (&Method::POST, "/clock")
    );
    let expected = st.config().access_token.clone();
    if let (false, Some(token)) = (exempt, expected) {
        let given = req.headers().get("x-access-token").and_then(|v| v.to_str().ok());
        if given != Some(token.as_str()) {
            return files::http_error(
                StatusCode::UNAUTHORIZED,
                "unauthorized access, please provide a valid access token or method signing if supported",
            );
        }
    }
    next.run(req).await
}
