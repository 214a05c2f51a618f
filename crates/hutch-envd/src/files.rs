//! Files in the guest: streaming upload and download over envd's `/files`.

use crate::client::AgentClient;
use crate::error::{error_from, AgentError, Body};
use http::{Method, StatusCode};
use hutch_proto::filesystem::WrittenFile;
use hyper::body::Incoming;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};

fn files_path(path: &str, user: Option<&str>) -> String {
    let mut q = format!("/files?path={}", utf8_percent_encode(path, NON_ALPHANUMERIC));
    if let Some(u) = user {
        q.push_str(&format!("&username={}", utf8_percent_encode(u, NON_ALPHANUMERIC)));
    }
    q
}

impl AgentClient {
    /// Writes `body` to `path` in the guest (created with parents, owned by the user).
    pub async fn upload(&self, path: &str, body: Body) -> Result<Vec<WrittenFile>, AgentError> {
        let req = self
            .request(Method::POST, &files_path(path, self.user.as_deref()))
            .header(http::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .map_err(|e| AgentError::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let bytes = crate::error::read_limited(resp.into_body(), crate::error::MAX_REPLY).await?;
        if status != StatusCode::OK {
            return Err(error_from(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| AgentError::Protocol(e.to_string()))
    }

    /// Reads `path` from the guest as a body stream.
    pub async fn download(&self, path: &str) -> Result<Incoming, AgentError> {
        let req = self
            .request(Method::GET, &files_path(path, self.user.as_deref()))
            .body(crate::error::full(bytes::Bytes::new()))
            .map_err(|e| AgentError::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        if status != StatusCode::OK {
            return Err(crate::error::error_reply(status, resp.into_body()).await);
        }
        Ok(resp.into_body())
    }
}
