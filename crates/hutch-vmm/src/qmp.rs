//! A minimal QMP client: greeting, capabilities negotiation, commands; asynchronous
//! events are skipped while waiting for a reply.

use serde_json::{json, Value};
use std::path::Path;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("connecting to the QMP socket")]
    Connect(#[source] std::io::Error),
    #[error("talking to QMP")]
    Io(#[source] std::io::Error),
    #[error("QMP closed the connection")]
    Closed,
    #[error("QMP sent something that is not JSON")]
    Parse(#[source] serde_json::Error),
    #[error("QMP did not answer '{command}' within {secs} s")]
    Timeout { command: String, secs: u64 },
    #[error("QMP command '{command}' failed: {class}: {desc}")]
    Command { command: String, class: String, desc: String },
}

/// How long QEMU may take to answer one command.
pub const QMP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// A QMP line longer than this is not QEMU talking.
const MAX_LINE: u64 = 1 << 20;

pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Qmp {
    pub async fn connect(path: &Path) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(path).await.map_err(QmpError::Connect)?;
        let (r, w) = stream.into_split();
        let mut qmp = Qmp { reader: BufReader::new(r), writer: w };
        let greeting = qmp.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Closed);
        }
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = (&mut self.reader).take(MAX_LINE).read_line(&mut line).await.map_err(QmpError::Io)?;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        serde_json::from_str(&line).map_err(QmpError::Parse)
    }

    /// Runs one command, waiting at most `QMP_DEADLINE` for its reply (migrations
    /// return at once and are polled).
    pub async fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        match tokio::time::timeout(QMP_DEADLINE, self.exchange(command, arguments)).await {
            Ok(r) => r,
            Err(_) => Err(QmpError::Timeout { command: command.into(), secs: QMP_DEADLINE.as_secs() }),
        }
    }

    async fn exchange(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).await.map_err(QmpError::Io)?;
        loop {
            let reply = self.read_message().await?;
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                return Err(QmpError::Command { command: command.into(), class: field("class"), desc: field("desc") });
            }
            // An event ({"event": ...}): not ours to handle here.
        }
    }
}
