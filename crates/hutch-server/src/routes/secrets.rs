//! E2B's secrets API, as the SDKs' `Secret` class calls it: `POST /secrets` (201),
//! `GET /secrets` (pages, the next one's token in `X-Next-Token`), and
//! `GET`/`POST`/`DELETE /secrets/{secretID}` by id (`sec_…`) or name. A value goes in
//! and never comes out. Every answer is `Cache-Control: no-store`, and no message
//! quotes what a request carried: a JSON error from serde would quote the value.
//! The store and its rules are `hutch_core::secrets`; this only speaks HTTP.

use super::body::QueryParams;
use crate::app::{AppState, MAX_BODY};
use crate::auth::KeyId;
use crate::error::ApiError;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hutch_core::secrets::{SecretInfo, MAX_PAGE};
use http_body_util::{BodyExt, Limited};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use zeroize::Zeroizing;

#[derive(Deserialize)]
struct NewSecret {
    name: String,
    value: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct SecretUpdate {
    value: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
pub struct ListQuery {
    limit: Option<usize>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

fn view(s: &SecretInfo) -> Value {
    json!({ "secretID": s.id, "name": s.name, "currentVersion": s.version, "metadata": s.metadata, "createdAt": s.created_at, "updatedAt": s.updated_at })
}

/// The routes, every answer of which (an extractor's refusal, a 405 too) is marked as
/// not to be kept by a cache.
pub fn routes() -> axum::Router<AppState> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/secrets", post(create).get(list))
        .route("/secrets/{id}", get(get_one).post(update).delete(delete))
        .route_layer(axum::middleware::map_response(no_store))
}

async fn no_store(mut response: Response) -> Response {
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The body as `T`, refused with a message that quotes none of it.
async fn body<T: DeserializeOwned>(req: Request) -> Result<T, ApiError> {
    let bytes = Limited::new(req.into_body(), MAX_BODY).collect().await.map_err(|e| {
        if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body exceeds {MAX_BODY} bytes"))
        } else {
            ApiError::bad_request("Invalid secrets request: the body could not be read")
        }
    })?;
    let bytes = Zeroizing::new(bytes.to_bytes().to_vec());
    serde_json::from_slice(&bytes).map_err(|_| ApiError::bad_request("Invalid secrets request: the body must be a JSON object with a string 'value' (and 'name' to create), and 'metadata' of string values if any"))
}

async fn create(State(state): State<AppState>, key: KeyId, req: Request) -> Result<(StatusCode, Json<Value>), ApiError> {
    let new: NewSecret = body(req).await?;
    let info = state.manager.secrets().create(&key.0, &new.name, &new.value, new.metadata.unwrap_or_default()).await?;
    Ok((StatusCode::CREATED, Json(view(&info))))
}

async fn update(State(state): State<AppState>, key: KeyId, Path(id): Path<String>, req: Request) -> Result<Json<Value>, ApiError> {
    let update: SecretUpdate = body(req).await?;
    let info = state.manager.secrets().update(&key.0, &id, &update.value, update.metadata).await?;
    Ok(Json(view(&info)))
}

async fn get_one(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    Ok(Json(view(&state.manager.secrets().get(&key.0, &id).await?)))
}

async fn list(State(state): State<AppState>, key: KeyId, QueryParams(q): QueryParams<ListQuery>) -> Result<Response, ApiError> {
    let page = state.manager.secrets().list(&key.0, q.limit.unwrap_or(MAX_PAGE), q.next_token.as_deref()).await?;
    let mut response = Json(Value::Array(page.secrets.iter().map(view).collect())).into_response();
    if let Some(next) = page.next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        response.headers_mut().insert("x-next-token", next);
    }
    Ok(response)
}

async fn delete(State(state): State<AppState>, key: KeyId, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.manager.secrets().delete(&key.0, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
