//! What template builds ask of the guest agent: a step's `COPY`, and a frozen root
//! filesystem while the host copies the disk.

use crate::client::AgentClient;
use crate::error::{error_from, AgentError, Body};
use http::Method;
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
use std::time::Duration;

/// A copy streams a tar as large as the step's files; beyond this the guest is stuck.
const COPY_DEADLINE: Duration = Duration::from_secs(600);
/// A freeze flushes all that the steps wrote to the guest's disk, through QEMU to the
/// host's, which a busy host's own writeback can hold up for minutes (a one-minute
/// deadline failed a test build while another test copied gigabytes).
const FREEZE_DEADLINE: Duration = COPY_DEADLINE;

/// Where a `COPY` writes and as whom.
pub struct CopyTarget<'a> {
    pub dest: &'a str,
    pub owner: &'a str,
    /// Octal, such as `0755` (each file's own mode when None).
    pub mode: Option<&'a str>,
    /// The tar holds one file that becomes `dest` (or goes into it, if a directory).
    pub single: bool,
}

impl AgentClient {
    /// Writes the tar `body` in the guest with Docker's `COPY` rules.
    pub async fn copy_tar(&self, target: &CopyTarget<'_>, body: Body) -> Result<(), AgentError> {
        let enc = |s: &str| utf8_percent_encode(s, NON_ALPHANUMERIC).to_string();
        let mut path = format!("/build/copy?dest={}&owner={}&single={}", enc(target.dest), enc(target.owner), target.single);
        if let Some(mode) = target.mode {
            path.push_str(&format!("&mode={}", enc(mode)));
        }
        let req = self
            .request(Method::POST, &path)
            .header(http::header::CONTENT_TYPE, "application/x-tar")
            .body(body)
            .map_err(|e| AgentError::Protocol(e.to_string()))?;
        let exchange = async {
            let resp = self.send(req).await?;
            let status = resp.status();
            let bytes = crate::error::read_limited(resp.into_body(), crate::error::MAX_ERROR_BODY).await?;
            if status.is_success() {
                Ok(())
            } else {
                Err(error_from(status, &bytes))
            }
        };
        tokio::time::timeout(COPY_DEADLINE, exchange)
            .await
            .map_err(|_| AgentError::Timeout { what: format!("COPY to {}", target.dest), secs: COPY_DEADLINE.as_secs() })?
    }

    /// Flushes the guest's root filesystem and holds its writes until `thaw_root`
    /// (or until the agent gives up waiting, two minutes later).
    pub async fn freeze_root(&self) -> Result<(), AgentError> {
        self.post_json_within("/build/freeze", &serde_json::json!({}), FREEZE_DEADLINE).await
    }

    pub async fn thaw_root(&self) -> Result<(), AgentError> {
        self.post_json("/build/thaw", &serde_json::json!({})).await
    }
}
