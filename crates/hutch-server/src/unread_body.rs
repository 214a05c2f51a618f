//! A request body the handler never reads costs the client its connection. Once the
//! response is out, hyper drains what of the body has arrived; if not all of it has,
//! it closes the connection, after a response that promised to keep it open, and the
//! client's next request on it finds it closed ("server disconnected without sending
//! a response"). The E2B SDKs send small JSON bodies on routes that can answer (a 404,
//! a 401) before reading them, and on a loaded host the body's packet can come after
//! the head's. So an HTTP/1 request's small body is read whole before the handler runs
//! (which then reads it from memory), and an error answering a request with a larger
//! or unsized body, which may be left unread, says `Connection: close`.

use crate::error::ApiError;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use std::time::Duration;

/// Bodies up to this size are read before the handler runs: every JSON body of the
/// REST API is far smaller, file uploads are not held.
const READ_FIRST: u64 = 64 << 10;

/// How long a client may take to send a small body once its head has come.
const BODY_WAIT: Duration = Duration::from_secs(30);

pub async fn read_small_bodies(req: Request, next: Next) -> Response {
    if req.version() >= Version::HTTP_2 {
        // Streams end on their own; the connection is never at stake.
        return next.run(req).await;
    }
    let length = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let chunked = req.headers().contains_key(header::TRANSFER_ENCODING);
    match (length, chunked) {
        (Some(0) | None, false) => next.run(req).await,
        (Some(n), false) if n <= READ_FIRST => {
            let (parts, body) = req.into_parts();
            match tokio::time::timeout(BODY_WAIT, body.collect()).await {
                Ok(Ok(collected)) => next.run(Request::from_parts(parts, Body::from(collected.to_bytes()))).await,
                Ok(Err(e)) => closing(ApiError::bad_request(format!("reading the request body: {e}")).into_response()),
                Err(_) => closing(ApiError::new(StatusCode::REQUEST_TIMEOUT, format!("the request body did not arrive within {} s; send it with the request", BODY_WAIT.as_secs())).into_response()),
            }
        }
        _ => {
            let response = next.run(req).await;
            match response.status().is_client_error() || response.status().is_server_error() {
                true => closing(response),
                false => response,
            }
        }
    }
}

fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}
