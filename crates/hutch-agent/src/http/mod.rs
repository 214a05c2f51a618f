//! The agent's HTTP surface: envd's Connect services and plain endpoints.

pub mod build;
pub mod connect;
pub mod files;
mod gzip;
mod multipart;
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
use hutch_proto::access::{check_file_access, secrets_equal, FileAccess, Operation};

pub fn router(state: AgentState) -> Router {
    Router::new()
        .route("/health", get(misc::health))
        .route("/envs", get(misc::envs))
        .route("/metrics", get(misc::metrics))
        .route("/init", post(misc::init))
        .route("/clock", post(misc::clock))
        .route("/shutdown", post(misc::shutdown))
        .route("/sync", post(misc::sync))
        .route("/build/copy", post(build::copy))
        .route("/build/freeze", post(build::freeze))
        .route("/build/thaw", post(build::thaw))
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

/// envd's rule: with an access token set, everything but `GET /health` and hutch's
/// `/clock` needs `X-Access-Token`; `/files` also takes a URL signed with the token
/// instead. `/init` needs it too, unlike envd's: it replaces the token, and the proxy's
/// refusal of it must not be the only thing keeping a tenant from doing that (the host
/// presents the token the guest holds; before the first `/init` there is none).
async fn require_token(State(st): State<AgentState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let exempt = matches!((req.method(), path), (&Method::GET, "/health") | (&Method::POST, "/clock"));
    let expected = st.config().access_token.clone();
    let Some(token) = expected.filter(|_| !exempt) else { return next.run(req).await };
    let given = req.headers().get("x-access-token").and_then(|v| v.to_str().ok());
    let allowed = if path == "/files" {
        files_access(&req, given, &token)
    } else if given.is_some_and(|g| secrets_equal(g, &token)) {
        Ok(())
    } else if path == "/init" {
        Err("this sandbox's agent already holds an access token, so /init must carry that token in X-Access-Token")
    } else {
        Err("unauthorized access, please provide a valid access token or method signing if supported")
    };
    match allowed {
        Ok(()) => next.run(req).await,
        Err(message) => files::http_error(StatusCode::UNAUTHORIZED, message),
    }
}

#[derive(serde::Deserialize)]
struct SignedQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<String>,
}

fn files_access(req: &Request, header_token: Option<&str>, token: &str) -> Result<(), &'static str> {
    let q = axum::extract::Query::<SignedQuery>::try_from_uri(req.uri()).map_err(|_| "the /files query string is malformed")?.0;
    let op = match *req.method() {
        Method::GET | Method::HEAD => Operation::Read,
        Method::POST => Operation::Write,
        _ => return Err("/files takes GET (download) and POST (upload)"),
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let access = FileAccess {
        header_token,
        path: q.path.as_deref().unwrap_or(""),
        user: q.username.as_deref(),
        signature: q.signature.as_deref(),
        expiration: q.signature_expiration.as_deref(),
        op,
        now,
    };
    check_file_access(token, &access).map_err(|r| r.message())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    /// Sends `method path` with `token` in `X-Access-Token` (none when `None`) and
    /// `body`; returns the status and the body's text.
    async fn send(st: &AgentState, method: Method, path: &str, token: Option<&str>, body: &str) -> (StatusCode, String) {
        let mut req = axum::http::Request::builder().method(method).uri(path);
        if let Some(t) = token {
            req = req.header("x-access-token", t);
        }
        let reply = router(st.clone()).oneshot(req.body(Body::from(body.to_string())).expect("request")).await.expect("infallible");
        let status = reply.status();
        let bytes = reply.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `/init` handing the guest `token` (only that: no clock, hostname or identity, so
    /// nothing on the test host changes), authenticated with `with`.
    async fn init(st: &AgentState, with: Option<&str>, token: &str) -> (StatusCode, String) {
        send(st, Method::POST, "/init", with, &format!(r#"{{"accessToken":"{token}"}}"#)).await
    }

    #[tokio::test]
    async fn the_first_init_needs_no_token() {
        let st = AgentState::default();
        assert_eq!(init(&st, None, "first").await.0, StatusCode::NO_CONTENT);
        assert_eq!(st.config().access_token.as_deref(), Some("first"));
    }

    #[tokio::test]
    async fn once_a_token_is_set_init_needs_it() {
        let st = AgentState::default();
        assert_eq!(init(&st, None, "old").await.0, StatusCode::NO_CONTENT);

        let (status, message) = init(&st, None, "mine").await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "an init without the token: {message}");
        assert!(message.contains("must carry that token in X-Access-Token"), "{message}");
        let (status, message) = init(&st, Some("wrong"), "mine").await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "an init with a wrong token: {message}");
        assert_eq!(st.config().access_token.as_deref(), Some("old"), "a refused init changed the token");
    }

    #[tokio::test]
    async fn an_init_with_the_token_rotates_it() {
        let st = AgentState::default();
        assert_eq!(init(&st, None, "old").await.0, StatusCode::NO_CONTENT);
        assert_eq!(init(&st, Some("old"), "new").await.0, StatusCode::NO_CONTENT);

        assert_eq!(send(&st, Method::GET, "/envs", Some("new"), "").await.0, StatusCode::OK, "the new token opens the API");
        assert_eq!(send(&st, Method::GET, "/envs", Some("old"), "").await.0, StatusCode::UNAUTHORIZED, "the old token still opens the API");
        assert_eq!(init(&st, Some("old"), "again").await.0, StatusCode::UNAUTHORIZED, "the old token still opens /init");
        assert_eq!(init(&st, Some("new"), "again").await.0, StatusCode::NO_CONTENT);
    }
}
