//! JSON request bodies whose every failure is a JSON 4xx (axum's own rejections are
//! plain text, which the E2B SDKs cannot parse).

use crate::error::ApiError;
use crate::app::{AppState, MAX_BODY};
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use http_body_util::{BodyExt, Limited};
use serde::de::DeserializeOwned;

pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = Limited::new(req.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                    ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body exceeds {MAX_BODY} bytes"))
                } else {
                    ApiError::bad_request(format!("reading the request body: {e}"))
                }
            })?
            .to_bytes();
        let bytes = if bytes.iter().all(u8::is_ascii_whitespace) { bytes::Bytes::from_static(b"{}") } else { bytes };
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// A query string as `T`, whose failure (`limit=-1`) is a JSON 400 like every other.
pub struct QueryParams<T>(pub T);

impl<T: DeserializeOwned> axum::extract::FromRequestParts<AppState> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _state: &AppState) -> Result<Self, Self::Rejection> {
        axum::extract::Query::try_from_uri(&parts.uri).map(|q| QueryParams(q.0)).map_err(|e| ApiError::bad_request(format!("invalid query string: {}", e.body_text())))
    }
}
