//! The Connect protocol (JSON codec) on top of axum: unary calls, server streams,
//! client streams, and errors in the shapes connect-go (envd) produces.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use hutch_proto::connect::{Code, EndStream, ErrorBody};
use hutch_proto::envelope::{self, Decoder, END_STREAM};
use serde::de::DeserializeOwned;
use serde::Serialize;

#[derive(Debug, Clone)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl std::fmt::Display) -> Self {
        ConnectError { code, message: message.to_string() }
    }

    fn body(&self) -> ErrorBody {
        ErrorBody { code: self.code, message: self.message.clone() }
    }
}

impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.body())).into_response()
    }
}

pub type UnaryResult<T> = Result<axum::Json<T>, ConnectError>;

/// Parses a unary request body; an empty body is the empty message.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    let body = if body.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { body };
    serde_json::from_slice(body).map_err(|e| ConnectError::new(Code::InvalidArgument, format!("invalid request: {e}")))
}

/// Streams the messages of a client- or server-streaming request body.
pub fn request_messages<T: DeserializeOwned + Send + 'static>(
    body: Body,
) -> impl Stream<Item = Result<T, ConnectError>> + Send {
    let state = (body.into_data_stream(), Decoder::default(), false);
    futures::stream::unfold(state, |(mut data, mut dec, mut done)| async move {
        loop {
            if done {
                return None;
            }
            match dec.next_envelope() {
                Err(e) => {
                    done = true;
                    return Some((Err(ConnectError::new(Code::InvalidArgument, e)), (data, dec, done)));
                }
                Ok(Some(env)) if env.is_end_stream() => return None,
                Ok(Some(env)) => return Some((parse::<T>(&env.payload), (data, dec, done))),
                Ok(None) => match data.next().await {
                    Some(Ok(chunk)) => dec.push(&chunk),
                    Some(Err(e)) => {
                        done = true;
                        let err = ConnectError::new(Code::Canceled, format!("reading request: {e}"));
                        return Some((Err(err), (data, dec, done)));
                    }
                    None if dec.pending() == 0 => return None,
                    None => {
                        done = true;
                        let err = ConnectError::new(Code::InvalidArgument, "request ended inside an envelope");
                        return Some((Err(err), (data, dec, done)));
                    }
                },
            }
        }
    })
}

/// The single request message of a server-streaming call.
pub async fn single_message<T: DeserializeOwned + Send + 'static>(body: Body) -> Result<T, ConnectError> {
    let mut messages = Box::pin(request_messages::<T>(body));
    match messages.next().await {
        Some(m) => m,
        None => Err(ConnectError::new(Code::InvalidArgument, "the stream carried no request message")),
    }
}

fn streaming_response(body: Body) -> Response {
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    resp
}

fn end_envelope(error: Option<ConnectError>) -> Bytes {
    let end = EndStream { error: error.map(|e| e.body()) };
    envelope::encode(END_STREAM, &serde_json::to_vec(&end).unwrap_or_else(|_| b"{}".to_vec()))
}

/// A server-streaming response: each item becomes an envelope; the stream ends with the
/// end-of-stream envelope (carrying the first error, if any).
pub fn stream<T, S>(messages: S) -> Response
where
    T: Serialize + Send + 'static,
    S: Stream<Item = Result<T, ConnectError>> + Send + 'static,
{
    let frames = messages
        .map(Some)
        .chain(futures::stream::once(async { None }))
        .scan(false, |failed, item| {
            let out = match (*failed, item) {
                (true, _) => None,
                (false, Some(Ok(msg))) => match serde_json::to_vec(&msg) {
                    Ok(json) => Some(envelope::encode(0, &json)),
                    Err(e) => {
                        *failed = true;
                        Some(end_envelope(Some(ConnectError::new(Code::Internal, e))))
                    }
                },
                (false, Some(Err(e))) => {
                    *failed = true;
                    Some(end_envelope(Some(e)))
                }
                (false, None) => {
                    *failed = true;
                    Some(end_envelope(None))
                }
            };
            futures::future::ready(out)
        })
        .map(Ok::<_, std::io::Error>);
    streaming_response(Body::from_stream(frames))
}

/// A stream that failed before its first message: HTTP 200 and an end-stream error.
pub fn stream_error(err: ConnectError) -> Response {
    streaming_response(Body::from(end_envelope(Some(err))))
}

/// The reply of a client-streaming call: one message, then end of stream.
pub fn client_stream_reply<T: Serialize>(result: Result<T, ConnectError>) -> Response {
    match result {
        Ok(msg) => {
            let json = serde_json::to_vec(&msg).unwrap_or_else(|_| b"{}".to_vec());
            let mut body = envelope::encode(0, &json).to_vec();
            body.extend_from_slice(&end_envelope(None));
            streaming_response(Body::from(body))
        }
        Err(e) => stream_error(e),
    }
}

/// Seconds between keepalive events, from the SDK's `Keepalive-Ping-Interval` header.
pub fn keepalive_interval(headers: &HeaderMap) -> std::time::Duration {
    let secs = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(90);
    std::time::Duration::from_secs(secs)
}
