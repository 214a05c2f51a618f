//! hutch's HTTP surface. One listener serves both planes: requests that name a sandbox
//! (the `E2b-Sandbox-Id` header, or a `<port>-<id>.<domain>` Host) go to the data proxy,
//! everything else to the E2B-compatible REST API. Handlers extract and validate, call
//! the `SandboxManager`, and map results; errors become HTTP in `error.rs` only.

mod app;
mod auth;
mod dto;
mod error;
mod guest_tls;
mod listener;
mod per_key;
mod proxy;
mod query;
mod routes;
mod unread_body;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;

pub use app::{AppState, MAX_BODY, OPENAPI};
pub use error::ApiError;
pub use listener::{serve, Limits};

pub fn router(state: AppState) -> Router {
    let in_flight = per_key::InFlight::default();
    routes::rest()
        .layer(middleware::from_fn(move |req, next| per_key::limit(in_flight.clone(), req, next)))
        .layer(middleware::from_fn_with_state(state.clone(), data_plane_first))
        .layer(middleware::from_fn(unread_body::read_small_bodies))
        .with_state(state)
}

async fn data_plane_first(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(target) = proxy::target(&req, state.domain.as_deref()) {
        return proxy::forward(&state, target, req).await;
    }
    match proxy::signed_target(&req, &state.manager) {
        Some(Ok(target)) => proxy::forward(&state, target, req).await,
        Some(Err(refused)) => refused,
        None => next.run(req).await,
    }
}
