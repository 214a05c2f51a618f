//! The OpenAPI document and the server agree: every documented operation is routed,
//! and answers with a status the document lists for it, errors as `{code, message}`.
//! No VM is needed: every request here fails validation or lookup before one would boot.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use hutch_core::manager::{ManagerConfig, SandboxManager};
use hutch_core::store::Store;
use serde_json::Value;
use std::sync::Arc;
use tower::ServiceExt;

const KEY: &str = "e2b_0000000000000000000000000000000000000000";

async fn app() -> (axum::Router, tempfile::TempDir) {
    let tmp = tempfile::tempdir().expect("tmp");
    let home = hutch_image::HutchHome::at(tmp.path());
    let store = Store::open_file(&tmp.path().join("hutch.db")).await.expect("store");
    store.ensure_key("test", KEY).await.expect("key");
    let backend = Arc::new(hutch_vmm::fake::FakeBackend::default());
    let manager = SandboxManager::start(home, store, backend, ManagerConfig::default()).await.expect("manager");
    (hutch_server::router(hutch_server::AppState { manager, domain: None }), tmp)
}

fn operations(doc: &Value) -> Vec<(String, String, Value)> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "delete", "put"] {
            if let Some(op) = item.get(method) {
                ops.push((method.to_uppercase(), path.clone(), op.clone()));
            }
        }
    }
    ops
}

async fn call(app: &axum::Router, method: &str, uri: &str, key: Option<&str>) -> (StatusCode, Vec<u8>) {
    let mut req = Request::builder().method(method).uri(uri).header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("x-api-key", k);
    }
    let body = if method == "POST" { Body::from("{}") } else { Body::empty() };
    let resp = app.clone().oneshot(req.body(body).expect("request")).await.expect("response");
    let status = resp.status();
    (status, resp.into_body().collect().await.expect("body").to_bytes().to_vec())
}

fn check_error_body(status: StatusCode, body: &[u8], what: &str) {
    if status.is_client_error() || status.is_server_error() {
        let v: Value = serde_json::from_slice(body).unwrap_or_else(|_| panic!("{what}: error body is not JSON: {}", String::from_utf8_lossy(body)));
        assert_eq!(v["code"].as_u64(), Some(u64::from(status.as_u16())), "{what}: {v}");
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    }
}

#[tokio::test]
async fn documented_operations_answer_documented_statuses() {
    let doc: Value = serde_json::from_str(hutch_server::OPENAPI).expect("the document is JSON");
    let (app, _tmp) = app().await;
    let ops = operations(&doc);
    assert!(ops.len() >= 14, "only {} operations documented", ops.len());
    for (method, path, op) in ops {
        let uri = path.replace("{sandboxID}", "inothere").replace("{snapshotID}", "nosnapshot").replace("{templateID}", "notemplate").replace("{alias}", "noalias");
        let what = format!("{method} {path}");
        let (status, body) = call(&app, &method, &uri, Some(KEY)).await;
        assert!(status != StatusCode::METHOD_NOT_ALLOWED && !String::from_utf8_lossy(&body).contains("no such route"), "{what} is not routed");
        assert!(op["responses"].get(status.as_str()).is_some(), "{what} answered {status}, which the document does not list");
        check_error_body(status, &body, &what);
        let secured = op.get("security").and_then(Value::as_array).is_none_or(|s| !s.is_empty());
        if secured {
            let (status, body) = call(&app, &method, &uri, None).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{what} without a key");
            assert!(op["responses"].get("401").is_some(), "{what} does not document 401");
            check_error_body(status, &body, &what);
        }
    }
}

#[tokio::test]
async fn the_served_document_is_the_file() {
    let (app, _tmp) = app().await;
    let (status, body) = call(&app, "GET", "/openapi.json", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, hutch_server::OPENAPI.as_bytes());
}

#[tokio::test]
async fn unknown_routes_are_json_404s() {
    let (app, _tmp) = app().await;
    let (status, body) = call(&app, "GET", "/nope", Some(KEY)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    check_error_body(status, &body, "GET /nope");
}
