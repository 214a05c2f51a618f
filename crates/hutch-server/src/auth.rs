//! `X-API-Key` authentication: the extractor yields the key's id, or answers 401.

use crate::error::ApiError;
use crate::app::AppState;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::StatusCode;

/// The id of the API key a request carries.
pub struct KeyId(pub String);

impl FromRequestParts<AppState> for KeyId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let Some(key) = parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()) else {
            return Err(ApiError::new(StatusCode::UNAUTHORIZED, "missing X-API-Key header; create a key with `hutch keys create`"));
        };
        match state.manager.store().key_id(key).await.map_err(|e| ApiError::from(hutch_core::manager::ManagerError::from(e)))? {
            Some(id) => Ok(KeyId(id)),
            None => Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key")),
        }
    }
}
