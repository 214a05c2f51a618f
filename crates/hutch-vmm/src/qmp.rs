//! A minimal QMP client: greeting, capabilities negotiation, commands; asynchronous
//! events are skipped while waiting for a reply.
//!
//! Every command carries an `id` no other connection uses, and only the reply with that
//! id answers it. A reply can outlive its connection: QEMU reads a command on its monitor
//! thread and runs it on the main thread, which a migration can hold for a while; when
//! the client that sent it has died meanwhile (a server killed mid-save), the reply goes
//! to whoever is connected next. Taken unchecked, a dead server's `query-migrate`
//! (`"status": "completed"`) once answered an adopting server's `query-status`, and the
//! running sandbox was removed as "loaded but never ran".

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

/// Numbers this process's commands.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// This process's part of every id: its pid and the time it first sent a command, so
/// that a dead server with the same pid (recycled, or PID 1 of a container started
/// again) never used it.
fn process_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
        format!("hutch-{}-{nanos:x}", std::process::id())
    })
}

fn command_id() -> String {
    format!("{}-{}", process_tag(), NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

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

    /// Writes `bytes` (one short command line) with `fd` attached.
    async fn send_with_fd(&mut self, bytes: &[u8], fd: std::os::fd::BorrowedFd<'_>) -> Result<(), QmpError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        use std::os::fd::AsRawFd;
        let stream = self.writer.as_ref();
        let fds = [fd.as_raw_fd()];
        let mut sent = 0;
        while sent < bytes.len() {
            stream.writable().await.map_err(QmpError::Io)?;
            // The fd goes with the first byte; the rest (if the socket took only part) follows plainly.
            let cmsgs = if sent == 0 { vec![ControlMessage::ScmRights(&fds)] } else { Vec::new() };
            let iov = [std::io::IoSlice::new(&bytes[sent..])];
            match stream.try_io(tokio::io::Interest::WRITABLE, || {
                sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None).map_err(std::io::Error::from)
            }) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(QmpError::Io(e)),
            }
        }
        Ok(())
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
        match tokio::time::timeout(QMP_DEADLINE, self.exchange(command, arguments, None)).await {
            Ok(r) => r,
            Err(_) => Err(QmpError::Timeout { command: command.into(), secs: QMP_DEADLINE.as_secs() }),
        }
    }

    /// Hands QEMU an open file under `name` (QMP `getfd`, the fd passed with
    /// SCM_RIGHTS), for a `fd:<name>` migration: QEMU then opens no path and runs no
    /// shell, so it can run under `-sandbox spawn=deny`.
    pub async fn send_fd(&mut self, name: &str, fd: std::os::fd::BorrowedFd<'_>) -> Result<(), QmpError> {
        let args = Some(json!({ "fdname": name }));
        match tokio::time::timeout(QMP_DEADLINE, self.exchange("getfd", args, Some(fd))).await {
            Ok(r) => r.map(drop),
            Err(_) => Err(QmpError::Timeout { command: "getfd".into(), secs: QMP_DEADLINE.as_secs() }),
        }
    }

    /// Hands QEMU an open file in a new fd set (QMP `add-fd`), for a command that takes
    /// a file name (`/dev/fdset/<id>`) rather than a `getfd` name; returns the set's id.
    /// QEMU dups the fd for each open, sharing its offset, and the set lives until
    /// `remove-fd`.
    pub async fn add_fd(&mut self, fd: std::os::fd::BorrowedFd<'_>) -> Result<u64, QmpError> {
        let added = match tokio::time::timeout(QMP_DEADLINE, self.exchange("add-fd", None, Some(fd))).await {
            Ok(r) => r?,
            Err(_) => return Err(QmpError::Timeout { command: "add-fd".into(), secs: QMP_DEADLINE.as_secs() }),
        };
        added.get("fdset-id").and_then(Value::as_u64).ok_or_else(|| QmpError::Command { command: "add-fd".into(), class: "reply".into(), desc: format!("no fdset-id in {added}") })
    }

    async fn exchange(&mut self, command: &str, arguments: Option<Value>, fd: Option<std::os::fd::BorrowedFd<'_>>) -> Result<Value, QmpError> {
        let id = command_id();
        let mut msg = json!({ "execute": command, "id": id });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string();
        line.push('\n');
        match fd {
            None => self.writer.write_all(line.as_bytes()).await.map_err(QmpError::Io)?,
            Some(fd) => self.send_with_fd(line.as_bytes(), fd).await?,
        }
        loop {
            let reply = self.read_message().await?;
            if reply.get("event").is_some() {
                continue; // not ours to handle here
            }
            if reply.get("id").and_then(Value::as_str) != Some(id.as_str()) {
                let stale: String = reply.get("id").map(Value::to_string).unwrap_or_default().chars().take(80).collect();
                tracing::debug!(command, stale_id = %stale, "QMP reply to a command this connection did not send; skipped");
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                return Err(QmpError::Command { command: command.into(), class: field("class"), desc: field("desc") });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A QMP server that answers each command with `reply(command_line)`'s lines.
    async fn serve(listener: UnixListener, reply: impl Fn(&Value) -> Vec<Value> + Send + 'static) {
        let (stream, _) = listener.accept().await.expect("test QMP server");
        let (r, mut w) = stream.into_split();
        w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n").await.expect("test QMP server");
        let mut lines = BufReader::new(r).lines();
        while let Some(line) = lines.next_line().await.expect("test QMP server") {
            let cmd: Value = serde_json::from_str(&line).expect("test QMP server");
            for out in reply(&cmd) {
                w.write_all(format!("{out}\n").as_bytes()).await.expect("test QMP server");
            }
        }
    }

    #[tokio::test]
    async fn a_reply_left_by_another_connection_does_not_answer_a_command() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("binding the test socket");
        // Before every reply: a dead client's query-migrate answer (id from another
        // process), one without any id, and an event.
        tokio::spawn(serve(listener, |cmd| {
            let answer = match cmd["execute"].as_str() {
                Some("query-status") => json!({"status": "running", "running": true}),
                _ => json!({}),
            };
            vec![
                json!({"return": {"status": "completed"}, "id": "hutch-1-7"}),
                json!({"return": {"status": "completed"}}),
                json!({"event": "STOP", "timestamp": {"seconds": 0, "microseconds": 0}}),
                json!({"return": answer, "id": cmd["id"]}),
            ]
        }));
        let mut qmp = Qmp::connect(&path).await.expect("connecting and negotiating");
        let status = qmp.execute("query-status", None).await.expect("query-status answered");
        assert_eq!(status["status"], "running");
    }

    #[tokio::test]
    async fn an_error_for_this_command_is_its_answer() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("binding the test socket");
        tokio::spawn(serve(listener, |cmd| match cmd["execute"].as_str() {
            Some("qmp_capabilities") => vec![json!({"return": {}, "id": cmd["id"]})],
            _ => vec![
                json!({"error": {"class": "GenericError", "desc": "not this one"}, "id": "hutch-1-8"}),
                json!({"error": {"class": "CommandNotFound", "desc": "The command nope has not been found"}, "id": cmd["id"]}),
            ],
        }));
        let mut qmp = Qmp::connect(&path).await.expect("connecting and negotiating");
        match qmp.execute("nope", None).await {
            Err(QmpError::Command { class, .. }) => assert_eq!(class, "CommandNotFound"),
            other => panic!("expected the command's own error, got {other:?}"),
        }
    }
}
