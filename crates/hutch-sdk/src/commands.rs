//! The E2B-shaped conveniences on a remote `Sandbox`: run a shell command and collect
//! its output, and the file operations, with one error type.

use hutch_envd::{full, AgentError};
use crate::remote::{ApiError, Sandbox};
use hutch_proto::connect::Code;
use hutch_proto::filesystem::{EntryInfo, EntryResponse, ListDirResponse};
use hutch_proto::process::{DataEvent, ProcessConfig, ProcessEvent, Signal, StartRequest};
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("the command exited with code {}: {}", .0.exit_code, .0.stderr.trim())]
    CommandExit(CommandOutput),
    #[error("the command did not finish within {0:?} and was killed")]
    Timeout(Duration),
}

impl SdkError {
    /// Whether the sandbox, process or path does not exist.
    pub fn is_not_found(&self) -> bool {
        match self {
            SdkError::Api(ApiError::NotFound(_)) => true,
            SdkError::Agent(e) => e.code() == Some(Code::NotFound),
            _ => false,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandOutput {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i32,
}

/// Receives output text as it arrives.
pub type OutputCallback = Box<dyn FnMut(&str) + Send>;

/// Options of `Sandbox::run_with`; output callbacks get text as it arrives.
#[derive(Default)]
pub struct RunOptions {
    pub envs: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    pub timeout: Option<Duration>,
    pub on_stdout: Option<OutputCallback>,
    pub on_stderr: Option<OutputCallback>,
}

impl Sandbox {
    /// Runs `cmd` with `bash -l -c` (as the E2B SDKs do); a non-zero exit is an error.
    pub async fn run(&self, cmd: &str) -> Result<CommandOutput, SdkError> {
        self.run_with(cmd, RunOptions::default()).await
    }

    pub async fn run_with(&self, cmd: &str, mut opts: RunOptions) -> Result<CommandOutput, SdkError> {
        let envd = self.envd().as_user(opts.user.as_deref());
        let req = StartRequest {
            process: ProcessConfig { cmd: "/bin/bash".into(), args: vec!["-l".into(), "-c".into(), cmd.into()], envs: opts.envs.clone(), cwd: opts.cwd.clone() },
            stdin: Some(false),
            ..Default::default()
        };
        let mut stream = envd.start(&req).await?;
        let pid = stream.pid;
        let collect = async {
            let mut out = CommandOutput::default();
            while let Some(ev) = stream.next().await {
                match ev? {
                    ProcessEvent::Data(DataEvent::Stdout(b)) | ProcessEvent::Data(DataEvent::Pty(b)) => {
                        let text = String::from_utf8_lossy(&b);
                        if let Some(cb) = opts.on_stdout.as_mut() {
                            cb(&text);
                        }
                        out.stdout.push_str(&text);
                    }
                    ProcessEvent::Data(DataEvent::Stderr(b)) => {
                        let text = String::from_utf8_lossy(&b);
                        if let Some(cb) = opts.on_stderr.as_mut() {
                            cb(&text);
                        }
                        out.stderr.push_str(&text);
                    }
                    ProcessEvent::End(end) => {
                        out.exit_code = end.shell_code();
                        return Ok(out);
                    }
                    _ => {}
                }
            }
            Err(SdkError::Agent(AgentError::Protocol("the command ended without an exit status".into())))
        };
        let out = match opts.timeout {
            Some(limit) => match tokio::time::timeout(limit, collect).await {
                Ok(r) => r?,
                Err(_) => {
                    let _ = envd.signal(pid, Signal::Kill).await;
                    return Err(SdkError::Timeout(limit));
                }
            },
            None => collect.await?,
        };
        if out.exit_code != 0 {
            return Err(SdkError::CommandExit(out));
        }
        Ok(out)
    }

    pub async fn read(&self, path: &str) -> Result<Vec<u8>, SdkError> {
        let body = self.envd().download(path).await?;
        let bytes = http_body_util::BodyExt::collect(body).await.map_err(AgentError::Disconnected)?.to_bytes();
        Ok(bytes.to_vec())
    }

    pub async fn write(&self, path: &str, data: impl Into<bytes::Bytes>) -> Result<(), SdkError> {
        self.envd().upload(path, full(data)).await?;
        Ok(())
    }

    pub async fn list(&self, path: &str, depth: u32) -> Result<Vec<EntryInfo>, SdkError> {
        let r: ListDirResponse = self.envd().unary("/filesystem.Filesystem/ListDir", &serde_json::json!({ "path": path, "depth": depth })).await?;
        Ok(r.entries)
    }

    pub async fn exists(&self, path: &str) -> Result<bool, SdkError> {
        match self.envd().unary::<_, EntryResponse>("/filesystem.Filesystem/Stat", &serde_json::json!({ "path": path })).await {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some(Code::NotFound) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn remove(&self, path: &str) -> Result<(), SdkError> {
        self.envd().unary::<_, serde_json::Value>("/filesystem.Filesystem/Remove", &serde_json::json!({ "path": path })).await?;
        Ok(())
    }

    /// Creates a directory with its parents; false when it already existed.
    pub async fn make_dir(&self, path: &str) -> Result<bool, SdkError> {
        match self.envd().unary::<_, EntryResponse>("/filesystem.Filesystem/MakeDir", &serde_json::json!({ "path": path })).await {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some(Code::AlreadyExists) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<EntryInfo, SdkError> {
        let r: EntryResponse = self.envd().unary("/filesystem.Filesystem/Move", &serde_json::json!({ "source": from, "destination": to })).await?;
        Ok(r.entry)
    }
}
