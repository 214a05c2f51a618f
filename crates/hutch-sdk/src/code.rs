//! The code interpreter (the `code-interpreter` template): `run_code` with streamed
//! output and rich results, over E2B's `/execute` NDJSON through the server's proxy.

use crate::commands::SdkError;
use crate::remote::{status_error, ApiError, Sandbox};
use http_body_util::BodyExt;
use serde::Deserialize;
use std::collections::BTreeMap;

pub const INTERPRETER_PORT: u16 = 49999;

/// One rich result; `formats` maps MIME-ish keys (`text`, `html`, `png`, …) to values.
#[derive(Debug, Clone, Default)]
pub struct CodeResult {
    pub is_main_result: bool,
    pub formats: BTreeMap<String, serde_json::Value>,
}

impl CodeResult {
    pub fn text(&self) -> Option<&str> {
        self.formats.get("text").and_then(|v| v.as_str())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ExecutionError {
    pub name: String,
    pub value: String,
    pub traceback: String,
}

#[derive(Debug, Clone, Default)]
pub struct Execution {
    pub results: Vec<CodeResult>,
    pub stdout: Vec<String>,
    pub stderr: Vec<String>,
    pub error: Option<ExecutionError>,
    pub execution_count: Option<u64>,
}

impl Execution {
    /// The text of the main result (the value of the last expression).
    pub fn text(&self) -> Option<&str> {
        self.results.iter().find(|r| r.is_main_result).and_then(CodeResult::text)
    }
}

/// Output as it arrives.
pub enum CodeEvent<'a> {
    Stdout(&'a str),
    Stderr(&'a str),
    Result(&'a CodeResult),
    Error(&'a ExecutionError),
}

/// A code context: its own kernel, language and working directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct CodeContext {
    pub id: String,
    pub language: String,
    pub cwd: String,
}

impl Sandbox {
    async fn interpreter_call(&self, method: http::Method, path: &str, body: Option<serde_json::Value>) -> Result<bytes::Bytes, SdkError> {
        let resp = self.api_ref().port_call(&self.id, self.token(), INTERPRETER_PORT, method, path, body).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        if !status.is_success() {
            return Err(SdkError::Api(status_error(status, &bytes)));
        }
        Ok(bytes)
    }

    /// A new context (kernel) for `language` (python when None) in `cwd`.
    pub async fn create_code_context(&self, language: Option<&str>, cwd: Option<&str>) -> Result<CodeContext, SdkError> {
        let body = serde_json::json!({ "language": language.unwrap_or("python"), "cwd": cwd.unwrap_or("/home/user") });
        let bytes = self.interpreter_call(http::Method::POST, "/contexts", Some(body)).await?;
        serde_json::from_slice(&bytes).map_err(|e| SdkError::Api(ApiError::Protocol(e.to_string())))
    }

    pub async fn list_code_contexts(&self) -> Result<Vec<CodeContext>, SdkError> {
        let bytes = self.interpreter_call(http::Method::GET, "/contexts", None).await?;
        serde_json::from_slice(&bytes).map_err(|e| SdkError::Api(ApiError::Protocol(e.to_string())))
    }

    /// Restarts the context's kernel: its state is gone.
    pub async fn restart_code_context(&self, context: &CodeContext) -> Result<(), SdkError> {
        self.interpreter_call(http::Method::POST, &format!("/contexts/{}/restart", context.id), None).await.map(|_| ())
    }

    pub async fn remove_code_context(&self, context: &CodeContext) -> Result<(), SdkError> {
        self.interpreter_call(http::Method::DELETE, &format!("/contexts/{}", context.id), None).await.map(|_| ())
    }

    /// Runs `code` in a given context (see `run_code` for the default one).
    pub async fn run_code_in(&self, context: &CodeContext, code: &str, on_event: impl FnMut(CodeEvent<'_>)) -> Result<Execution, SdkError> {
        self.execute(serde_json::json!({ "code": code, "context_id": context.id }), on_event).await
    }

    /// Runs `code` in the sandbox's default kernel for `language` (python when None),
    /// calling `on_event` for output as it streams.
    pub async fn run_code(&self, code: &str, language: Option<&str>, on_event: impl FnMut(CodeEvent<'_>)) -> Result<Execution, SdkError> {
        self.execute(serde_json::json!({ "code": code, "language": language }), on_event).await
    }

    async fn execute(&self, body: serde_json::Value, mut on_event: impl FnMut(CodeEvent<'_>)) -> Result<Execution, SdkError> {
        let resp = self.api_ref().port_call(&self.id, self.token(), INTERPRETER_PORT, http::Method::POST, "/execute", Some(body)).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
            return Err(SdkError::Api(status_error(status, &bytes)));
        }
        let mut exec = Execution::default();
        let mut pending: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::Protocol(format!("reading the execution: {e}")))?;
            let Ok(data) = frame.into_data() else { continue };
            pending.extend_from_slice(&data);
            while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=nl).collect();
                handle_line(&line, &mut exec, &mut on_event)?;
            }
        }
        Ok(exec)
    }
}

fn handle_line(line: &[u8], exec: &mut Execution, on_event: &mut impl FnMut(CodeEvent<'_>)) -> Result<(), SdkError> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    let mut msg: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(line).map_err(|e| ApiError::Protocol(format!("bad execution line: {e}")))?;
    let kind = msg.remove("type").and_then(|t| t.as_str().map(str::to_string)).unwrap_or_default();
    let text = || msg.get("text").and_then(|t| t.as_str()).unwrap_or("").to_string();
    match kind.as_str() {
        "stdout" => {
            let t = text();
            on_event(CodeEvent::Stdout(&t));
            exec.stdout.push(t);
        }
        "stderr" => {
            let t = text();
            on_event(CodeEvent::Stderr(&t));
            exec.stderr.push(t);
        }
        "result" => {
            let is_main_result = msg.remove("is_main_result").and_then(|v| v.as_bool()).unwrap_or(false);
            let r = CodeResult { is_main_result, formats: msg.into_iter().collect() };
            on_event(CodeEvent::Result(&r));
            exec.results.push(r);
        }
        "error" => {
            let e: ExecutionError = serde_json::from_value(serde_json::Value::Object(msg)).unwrap_or_default();
            on_event(CodeEvent::Error(&e));
            exec.error = Some(e);
        }
        "number_of_executions" => exec.execution_count = msg.get("execution_count").and_then(|v| v.as_u64()),
        _ => {}
    }
    Ok(())
}
