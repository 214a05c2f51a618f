//! `process.Process` RPC handlers.

use super::spawn::{spawn, SpawnError, SpawnRequest};
use super::ProcessError;
use crate::http::connect::{self, parse, ConnectError, UnaryResult};
use crate::state::AgentState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Json;
use futures::StreamExt;
use hutch_proto::connect::Code;
use hutch_proto::process::*;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::sync::mpsc;

impl From<ProcessError> for ConnectError {
    fn from(e: ProcessError) -> Self {
        let code = match e {
            ProcessError::NotFound(_) => Code::NotFound,
            ProcessError::NoStdin(_) | ProcessError::NoPty(_) => Code::FailedPrecondition,
            ProcessError::Write { .. } | ProcessError::Signal { .. } => Code::Internal,
        };
        ConnectError::new(code, e)
    }
}

impl From<SpawnError> for ConnectError {
    fn from(e: SpawnError) -> Self {
        let code = match e {
            SpawnError::CwdMissing(_) => Code::InvalidArgument,
            SpawnError::NotFound(_) => Code::NotFound,
            SpawnError::PermissionDenied(_) => Code::PermissionDenied,
            SpawnError::Io { .. } => Code::Internal,
        };
        ConnectError::new(code, e)
    }
}

/// Turns a subscriber's events into the response stream: `start` first, keepalives while
/// quiet, and nothing after `end`.
fn event_stream(pid: u32, rx: mpsc::Receiver<ProcessEvent>, keepalive: Duration) -> Response {
    let start = futures::stream::once(async move { Ok(EventResponse { event: ProcessEvent::Start { pid } }) });
    let state = (rx, tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive), false);
    let rest = futures::stream::unfold(state, |(mut rx, mut tick, done)| async move {
        if done {
            return None;
        }
        let event = tokio::select! {
            ev = rx.recv() => ev?,
            _ = tick.tick() => ProcessEvent::Keepalive {},
        };
        if matches!(event, ProcessEvent::Data(_)) {
            tick.reset();
        }
        let done = matches!(event, ProcessEvent::End(_));
        Some((Ok::<_, ConnectError>(EventResponse { event }), (rx, tick, done)))
    });
    connect::stream(start.chain(rest))
}

pub async fn start(State(st): State<AgentState>, headers: HeaderMap, body: Body) -> Response {
    match start_inner(&st, &headers, body).await {
        Ok(resp) => resp,
        Err(e) => connect::stream_error(e),
    }
}

async fn start_inner(st: &AgentState, headers: &HeaderMap, body: Body) -> Result<Response, ConnectError> {
    let req: StartRequest = connect::single_message(body).await?;
    if req.process.cmd.is_empty() {
        return Err(ConnectError::new(Code::InvalidArgument, "process.cmd must not be empty"));
    }
    let user = st.rpc_user(headers)?;
    let mut envs = st.config().env_vars.clone();
    envs.extend(req.process.envs.clone());
    let spawned = spawn(
        SpawnRequest {
            cmd: req.process.cmd.clone(),
            args: req.process.args.clone(),
            envs,
            cwd: req.process.cwd.clone(),
            default_cwd: st.config().default_workdir.clone(),
            user,
            pty: req.pty.map(|p| p.size),
            stdin: req.stdin.unwrap_or(true),
        },
        &st.reaper,
    )?;
    let pid = spawned.pid;
    let rx = st.processes.insert(spawned, req.process, req.tag);
    Ok(event_stream(pid, rx, connect::keepalive_interval(headers)))
}

pub async fn connect(State(st): State<AgentState>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let req: ConnectRequest = connect::single_message(body).await?;
        Ok::<_, ConnectError>(st.processes.subscribe(&req.process)?)
    }
    .await;
    match result {
        Ok((pid, rx)) => event_stream(pid, rx, connect::keepalive_interval(&headers)),
        Err(e) => connect::stream_error(e),
    }
}

pub async fn list(State(st): State<AgentState>) -> UnaryResult<ListResponse> {
    Ok(Json(ListResponse { processes: st.processes.list() }))
}

async fn deliver(st: &AgentState, sel: &ProcessSelector, input: ProcessInput) -> Result<(), ConnectError> {
    match input {
        ProcessInput::Stdin(data) => st.processes.write_stdin(sel, &data).await?,
        ProcessInput::Pty(data) => st.processes.write_pty(sel, &data).await?,
    }
    Ok(())
}

pub async fn send_input(State(st): State<AgentState>, body: Bytes) -> UnaryResult<Value> {
    let req: SendInputRequest = parse(&body)?;
    deliver(&st, &req.process, req.input).await?;
    Ok(Json(json!({})))
}

pub async fn stream_input(State(st): State<AgentState>, body: Body) -> Response {
    let result = async {
        let mut messages = Box::pin(connect::request_messages::<StreamInputRequest>(body));
        let selector = match messages.next().await {
            Some(Ok(StreamInputRequest::Start { process })) => process,
            Some(Err(e)) => return Err(e),
            _ => return Err(ConnectError::new(Code::InvalidArgument, "the first message must be 'start'")),
        };
        while let Some(msg) = messages.next().await {
            match msg? {
                StreamInputRequest::Data { input } => deliver(&st, &selector, input).await?,
                StreamInputRequest::Keepalive {} | StreamInputRequest::Start { .. } => {}
            }
        }
        Ok(json!({}))
    }
    .await;
    connect::client_stream_reply(result)
}

pub async fn close_stdin(State(st): State<AgentState>, body: Bytes) -> UnaryResult<Value> {
    let req: CloseStdinRequest = parse(&body)?;
    st.processes.close_stdin(&req.process).await?;
    Ok(Json(json!({})))
}

pub async fn send_signal(State(st): State<AgentState>, body: Bytes) -> UnaryResult<Value> {
    let req: SendSignalRequest = parse(&body)?;
    let Some(sig) = req.signal.number() else {
        return Err(ConnectError::new(Code::InvalidArgument, "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL"));
    };
    st.processes.signal(&req.process, sig)?;
    Ok(Json(json!({})))
}

pub async fn update(State(st): State<AgentState>, body: Bytes) -> UnaryResult<Value> {
    let req: UpdateRequest = parse(&body)?;
    if let Some(pty) = req.pty {
        st.processes.resize(&req.process, pty.size)?;
    }
    Ok(Json(json!({})))
}
