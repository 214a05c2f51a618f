//! Processes in the guest: start with streamed events, input, signals, PTY size.

use crate::client::AgentClient;
use crate::error::{full, AgentError};
use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use hutch_proto::connect::EndStream;
use hutch_proto::envelope::{self, Decoder};
use hutch_proto::process::*;
use hyper::body::Incoming;
use serde_json::Value;

/// The events of one `Start` (or `Connect`) stream.
pub struct ProcessStream {
    pub pid: u32,
    body: Incoming,
    decoder: Decoder,
    finished: bool,
}

impl ProcessStream {
    /// The next event; `None` after the end of the stream.
    pub async fn next(&mut self) -> Option<Result<ProcessEvent, AgentError>> {
        if self.finished {
            return None;
        }
        loop {
            match self.decoder.next_envelope() {
                Err(e) => return Some(Err(self.fail(AgentError::Protocol(e.to_string())))),
                Ok(Some(env)) if env.is_end_stream() => {
                    self.finished = true;
                    let end: EndStream = serde_json::from_slice(&env.payload).unwrap_or_default();
                    return end.error.map(|e| Err(AgentError::Rpc(e)));
                }
                Ok(Some(env)) => {
                    let parsed = serde_json::from_slice::<EventResponse>(&env.payload)
                        .map(|r| r.event)
                        .map_err(|e| AgentError::Protocol(format!("bad process event: {e}")));
                    return Some(parsed);
                }
                Ok(None) => {}
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.decoder.push(&data);
                    }
                }
                Some(Err(e)) => return Some(Err(self.fail(AgentError::Disconnected(e)))),
                None => {
                    self.finished = true;
                    return Some(Err(AgentError::Protocol("the process stream ended without an end-of-stream message".into())));
                }
            }
        }
    }

    fn fail(&mut self, e: AgentError) -> AgentError {
        self.finished = true;
        e
    }
}

impl AgentClient {
    async fn open_stream(&self, path: &str, msg: &impl serde::Serialize) -> Result<ProcessStream, AgentError> {
        let json = serde_json::to_vec(msg).map_err(|e| AgentError::Protocol(e.to_string()))?;
        let req = self
            .request(Method::POST, path)
            .header(http::header::CONTENT_TYPE, "application/connect+json")
            .header("connect-protocol-version", "1")
            .body(full(envelope::encode(0, &json)))
            .map_err(|e| AgentError::Protocol(e.to_string()))?;
        let resp = self.send(req).await?;
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            return Err(crate::error::error_reply(status, resp.into_body()).await);
        }
        let mut stream = ProcessStream { pid: 0, body: resp.into_body(), decoder: Decoder::default(), finished: false };
        match stream.next().await {
            Some(Ok(ProcessEvent::Start { pid })) => {
                stream.pid = pid;
                Ok(stream)
            }
            Some(Err(e)) => Err(e),
            other => Err(AgentError::Protocol(format!("expected a start event, got {other:?}"))),
        }
    }

    /// Starts a process; returns once it runs (its `start` event arrived).
    pub async fn start(&self, req: &StartRequest) -> Result<ProcessStream, AgentError> {
        self.open_stream("/process.Process/Start", req).await
    }

    pub async fn connect_process(&self, selector: ProcessSelector) -> Result<ProcessStream, AgentError> {
        self.open_stream("/process.Process/Connect", &ConnectRequest { process: selector }).await
    }

    pub async fn send_stdin(&self, pid: u32, data: Bytes) -> Result<(), AgentError> {
        let req = SendInputRequest { process: ProcessSelector::Pid(pid), input: ProcessInput::Stdin(data) };
        self.unary::<_, Value>("/process.Process/SendInput", &req).await.map(|_| ())
    }

    pub async fn send_pty(&self, pid: u32, data: Bytes) -> Result<(), AgentError> {
        let req = SendInputRequest { process: ProcessSelector::Pid(pid), input: ProcessInput::Pty(data) };
        self.unary::<_, Value>("/process.Process/SendInput", &req).await.map(|_| ())
    }

    pub async fn close_stdin(&self, pid: u32) -> Result<(), AgentError> {
        let req = CloseStdinRequest { process: ProcessSelector::Pid(pid) };
        self.unary::<_, Value>("/process.Process/CloseStdin", &req).await.map(|_| ())
    }

    pub async fn signal(&self, pid: u32, signal: Signal) -> Result<(), AgentError> {
        let req = SendSignalRequest { process: ProcessSelector::Pid(pid), signal };
        self.unary::<_, Value>("/process.Process/SendSignal", &req).await.map(|_| ())
    }

    pub async fn resize(&self, pid: u32, cols: u32, rows: u32) -> Result<(), AgentError> {
        let req = UpdateRequest { process: ProcessSelector::Pid(pid), pty: Some(Pty { size: PtySize { cols, rows } }) };
        self.unary::<_, Value>("/process.Process/Update", &req).await.map(|_| ())
    }

    pub async fn list_processes(&self) -> Result<Vec<ProcessInfo>, AgentError> {
        Ok(self.unary::<_, ListResponse>("/process.Process/List", &serde_json::json!({})).await?.processes)
    }
}
