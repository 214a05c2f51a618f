//! The control plane of `hutch serve` (E2B's REST API) and the sandboxes it hands out.

use hutch_envd::AgentClient;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("no API key: pass one or set HUTCH_API_KEY (create one with `hutch keys create`)")]
    NoKey,
    #[error("authentication failed: {0}")]
    Authentication(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    #[error("rate limited: {0}")]
    RateLimit(String),
    #[error("the server answered {status}: {message}")]
    Http { status: StatusCode, message: String },
    #[error("cannot reach hutch serve at {url}")]
    Unreachable { url: String, #[source] source: Box<dyn std::error::Error + Send + Sync> },
    #[error("the server sent a malformed reply: {0}")]
    Protocol(String),
}

/// A sandbox as the API lists it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxInfo {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub started_at: String,
    pub end_at: String,
    pub state: String,
    /// Why the sandbox failed, if it has (hutch's own field; `state` stays E2B's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// While paused: `full` (memory and disk) or `filesystem` (the disk; a resume boots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    pub cpu_count: i64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: i64,
}

/// What the server holds now, all keys together (`GET /status`, hutch's own).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServerStatus {
    pub running: usize,
    pub paused: usize,
    pub max_sandboxes: usize,
    /// The warm pools of templates this key may use, by template.
    #[serde(default)]
    pub pools: BTreeMap<String, PoolInfo>,
}

/// One warm pool: sandboxes restored and waiting for a create to take them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolInfo {
    /// Waiting now.
    pub ready: usize,
    /// What the pool keeps now.
    pub size: usize,
    /// Whether the operator pinned that size (`--pool`); else demand set it.
    #[serde(default)]
    pub pinned: bool,
}

#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub template: Option<String>,
    pub timeout: Option<u64>,
    pub metadata: BTreeMap<String, String>,
    pub envs: BTreeMap<String, String>,
    /// The envd API wants the sandbox's access token (the default, as E2B's).
    pub secure: bool,
    /// Pause instead of kill when the timeout is reached.
    pub auto_pause: bool,
    /// Boot the kernel instead of restoring the template's memory snapshot.
    pub cold: bool,
    /// Egress rules (`allow@public`, `allow@*.pypi.org:tcp:443`, …); no egress when
    /// empty.
    pub egress: Vec<String>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions { template: None, timeout: None, metadata: BTreeMap::new(), envs: BTreeMap::new(), secure: true, auto_pause: false, cold: false, egress: Vec::new() }
    }
}

/// A client of one `hutch serve`.
#[derive(Clone)]
pub struct Api {
    base: String,
    key: String,
    http: Client<HttpConnector, Full<Bytes>>,
}

/// A sandbox on the server, with its data plane.
#[derive(Clone)]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    api: Api,
    envd: AgentClient,
    token: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Created {
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "templateID")]
    template_id: String,
    envd_access_token: Option<String>,
}

/// The error of a non-2xx reply, from the REST API (`{code, message}`) or a service in
/// a sandbox (plain text).
pub(crate) fn status_error(status: StatusCode, body: &[u8]) -> ApiError {
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    match status.as_u16() {
        400 | 413 | 422 => ApiError::InvalidArgument(message),
        401 => ApiError::Authentication(message),
        404 => ApiError::NotFound(message),
        429 => ApiError::RateLimit(message),
        _ => ApiError::Http { status, message },
    }
}

pub(crate) fn enc(s: &str) -> String {
    utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
}

impl Api {
    pub fn new(base_url: &str, api_key: &str) -> Api {
        let http = Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
        Api { base: base_url.trim_end_matches('/').to_string(), key: api_key.to_string(), http }
    }

    /// From `HUTCH_API_URL` (default `http://127.0.0.1:3000`) and `HUTCH_API_KEY`.
    pub fn from_env(url: Option<&str>, key: Option<&str>) -> Result<Api, ApiError> {
        let url = url.map(str::to_string).or_else(|| std::env::var("HUTCH_API_URL").ok()).unwrap_or_else(|| "http://127.0.0.1:3000".into());
        let key = key.map(str::to_string).or_else(|| std::env::var("HUTCH_API_KEY").ok()).filter(|k| !k.is_empty()).ok_or(ApiError::NoKey)?;
        Ok(Api::new(&url, &key))
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    pub(crate) fn http(&self) -> &Client<HttpConnector, Full<Bytes>> {
        &self.http
    }

    pub(crate) fn unreachable(&self, e: impl std::error::Error + Send + Sync + 'static) -> ApiError {
        ApiError::Unreachable { url: self.base.clone(), source: Box::new(e) }
    }

    pub(crate) async fn call(&self, method: Method, path: &str, body: Option<serde_json::Value>) -> Result<(StatusCode, http::HeaderMap, Bytes), ApiError> {
        let mut req = Request::builder().method(method).uri(format!("{}{path}", self.base)).header("x-api-key", &self.key);
        let payload = match body {
            Some(v) => {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let req = req.body(Full::new(payload)).map_err(|e| ApiError::Protocol(e.to_string()))?;
        let resp = self.http.request(req).await.map_err(|e| ApiError::Unreachable { url: self.base.clone(), source: Box::new(e) })?;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.map_err(|e| ApiError::Unreachable { url: self.base.clone(), source: Box::new(e) })?.to_bytes();
        if parts.status.is_success() {
            return Ok((parts.status, parts.headers, bytes));
        }
        Err(status_error(parts.status, &bytes))
    }

    pub(crate) fn json<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, ApiError> {
        serde_json::from_slice(bytes).map_err(|e| ApiError::Protocol(e.to_string()))
    }

    pub(crate) fn sandbox(&self, created: Created) -> Sandbox {
        let envd = AgentClient::via_proxy(&self.base, &created.sandbox_id, created.envd_access_token.clone());
        Sandbox { id: created.sandbox_id, template: created.template_id, api: self.clone(), envd, token: created.envd_access_token }
    }

    /// A request (JSON body, if any) to a port inside a sandbox, through the data proxy;
    /// the response body streams.
    pub(crate) async fn port_call(
        &self,
        id: &str,
        token: Option<&str>,
        port: u16,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<http::Response<hyper::body::Incoming>, ApiError> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("e2b-sandbox-id", id)
            .header("e2b-sandbox-port", port.to_string())
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(t) = token {
            req = req.header("x-access-token", t);
        }
        let payload = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let req = req.body(Full::new(payload)).map_err(|e| ApiError::Protocol(e.to_string()))?;
        self.http.request(req).await.map_err(|e| ApiError::Unreachable { url: self.base.clone(), source: Box::new(e) })
    }

    pub async fn create(&self, opts: &CreateOptions) -> Result<Sandbox, ApiError> {
        let mut body = serde_json::json!({
            "templateID": opts.template.clone().unwrap_or_else(|| "base".into()),
            "metadata": opts.metadata,
            "envVars": opts.envs,
            "secure": opts.secure,
            "autoPause": opts.auto_pause,
            "cold": opts.cold,
            "egress": opts.egress,
        });
        if let Some(t) = opts.timeout {
            body["timeout"] = t.into();
        }
        let (_, _, bytes) = self.call(Method::POST, "/v2/sandboxes", Some(body)).await?;
        Ok(self.sandbox(Self::json(&bytes)?))
    }

    /// A running sandbox by id; its timeout is extended (never shortened) to `timeout`.
    pub async fn connect(&self, id: &str, timeout: Option<u64>) -> Result<Sandbox, ApiError> {
        let body = match timeout {
            Some(t) => serde_json::json!({ "timeout": t }),
            None => serde_json::json!({}),
        };
        let (_, _, bytes) = self.call(Method::POST, &format!("/v2/sandboxes/{}/connect", enc(id)), Some(body)).await?;
        Ok(self.sandbox(Self::json(&bytes)?))
    }

    /// Every sandbox of this key whose metadata has all of `metadata`.
    pub async fn list(&self, metadata: &BTreeMap<String, String>) -> Result<Vec<SandboxInfo>, ApiError> {
        // The server decodes the value whole, then each key and value (E2B's way): each
        // is encoded twice before the whole value is encoded for the query.
        let filter: Vec<String> = metadata.iter().map(|(k, v)| format!("{}={}", enc(&enc(k)), enc(&enc(v)))).collect();
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut path = format!("/v2/sandboxes?limit=100&metadata={}", enc(&filter.join("&")));
            if let Some(t) = &token {
                path.push_str(&format!("&nextToken={}", enc(t)));
            }
            let (_, headers, bytes) = self.call(Method::GET, &path, None).await?;
            out.extend(Self::json::<Vec<SandboxInfo>>(&bytes)?);
            token = headers.get("x-next-token").and_then(|v| v.to_str().ok()).map(str::to_string);
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    /// Kills a sandbox; false when there was none with that id.
    pub async fn kill(&self, id: &str) -> Result<bool, ApiError> {
        match self.call(Method::DELETE, &format!("/sandboxes/{}", enc(id)), None).await {
            Ok(_) => Ok(true),
            Err(ApiError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub async fn set_timeout(&self, id: &str, secs: u64) -> Result<(), ApiError> {
        self.call(Method::POST, &format!("/sandboxes/{}/timeout", enc(id)), Some(serde_json::json!({ "timeout": secs }))).await?;
        Ok(())
    }

    /// The server's counts and warm pools.
    pub async fn status(&self) -> Result<ServerStatus, ApiError> {
        let (_, _, bytes) = self.call(Method::GET, "/status", None).await?;
        Self::json(&bytes)
    }

    pub async fn info(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        let (_, _, bytes) = self.call(Method::GET, &format!("/sandboxes/{}", enc(id)), None).await?;
        Self::json(&bytes)
    }

    /// Replaces the sandbox's egress rules; open connections stay, new ones follow them.
    pub async fn update_network(&self, id: &str, egress: &[String]) -> Result<(), ApiError> {
        self.call(Method::PUT, &format!("/sandboxes/{}/network", enc(id)), Some(serde_json::json!({ "egress": egress }))).await?;
        Ok(())
    }

    /// The sandbox's rules in force, and what its network refused (`GET
    /// /sandboxes/{id}/network`).
    pub async fn network(&self, id: &str) -> Result<serde_json::Value, ApiError> {
        let (_, _, bytes) = self.call(Method::GET, &format!("/sandboxes/{}/network", enc(id)), None).await?;
        Self::json(&bytes)
    }

    /// The sandbox's console (kernel and agent messages).
    pub async fn logs(&self, id: &str) -> Result<Vec<String>, ApiError> {
        #[derive(Deserialize)]
        struct Logs {
            logs: Vec<Line>,
        }
        #[derive(Deserialize)]
        struct Line {
            line: String,
        }
        let (_, _, bytes) = self.call(Method::GET, &format!("/sandboxes/{}/logs", enc(id)), None).await?;
        Ok(Self::json::<Logs>(&bytes)?.logs.into_iter().map(|l| l.line).collect())
    }
}

impl Sandbox {
    pub(crate) fn api_ref(&self) -> &Api {
        &self.api
    }

    pub(crate) fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The sandbox's processes, files and ports (the envd API, through the server).
    pub fn envd(&self) -> &AgentClient {
        &self.envd
    }

    pub async fn kill(&self) -> Result<bool, ApiError> {
        self.api.kill(&self.id).await
    }

    pub async fn set_timeout(&self, secs: u64) -> Result<(), ApiError> {
        self.api.set_timeout(&self.id, secs).await
    }

    pub async fn info(&self) -> Result<SandboxInfo, ApiError> {
        self.api.info(&self.id).await
    }
}
