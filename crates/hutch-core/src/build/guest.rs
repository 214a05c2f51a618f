//! The builder VM: a cold-booted sandbox on the last cached layer, whose agent runs
//! the steps, and whose overlay, copied while the guest's root filesystem is frozen,
//! becomes each step's layer.

use super::run_context::{absolute, Context};
use super::spec::{BuildLog, BuildSpec, Level};
use hutch_formats::{Step, StepKind};
use crate::sandbox::Sandbox;
use crate::sandbox::boot::SandboxOptions;
use crate::{Artifacts, MemMib};
use hutch_image::HutchHome;
use hutch_proto::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest};
use hutch_vmm::VmBackend;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A RUN step may install a toolchain; beyond this it is stuck.
const RUN_DEADLINE: Duration = Duration::from_secs(60 * 60);
/// Lines of a failed RUN's output quoted in its error.
const TAIL_LINES: usize = 12;
/// The builder's size: steps such as `pip install` need more than a sandbox's default.
const BUILDER_MEMORY_MIB: u32 = 1024;

pub struct BuildVm {
    sandbox: Sandbox,
    /// The layer the VM booted on: every layer it commits stacks on it.
    booted_on: PathBuf,
}

impl BuildVm {
    pub async fn boot(home: &HutchHome, backend: &dyn VmBackend, spec: &BuildSpec, layer: &Path) -> Result<BuildVm, String> {
        let placeholder = hutch_image::from_image::image_template(&spec.name, hutch_image::template::ImageSource {
            reference: String::new(),
            manifest_digest: String::new(),
            defaults: Default::default(),
        });
        let home2 = home.clone();
        let artifacts = tokio::task::spawn_blocking(move || Artifacts::with_template(&home2, placeholder, &hutch_image::progress::Quiet))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("preparing the builder VM: {}", hutch_proto::error_chain(&e)))?;
        let opts = SandboxOptions {
            cpus: 2,
            memory: MemMib::new(BUILDER_MEMORY_MIB).unwrap_or(MemMib::DEFAULT),
            accel: spec.accel,
            cold: true,
            boot_timeout: Duration::from_secs(180),
            network: spec.network.clone(),
            net_env: spec.net_env.clone(),
            ..SandboxOptions::default()
        };
        let sandbox = Sandbox::boot_on(home, &artifacts, backend, &opts, layer, None)
            .await
            .map_err(|e| format!("starting the builder VM: {}", hutch_proto::error_chain(&e)))?;
        Ok(BuildVm { sandbox, booted_on: layer.to_path_buf() })
    }

    /// Copies the VM's disk as it is now into `to` (a qcow2 over the layer the VM
    /// booted on), with the guest's root filesystem frozen, so the copy is exactly what
    /// the steps so far left, journal flushed.
    pub async fn commit(&self, to: &Path) -> Result<(), String> {
        let agent = self.sandbox.agent();
        agent.freeze_root().await.map_err(|e| format!("freezing the builder's disk: {e}"))?;
        let overlay = self.sandbox.dir().join("disk.qcow2");
        let (from, dest, base) = (overlay.clone(), to.to_path_buf(), self.booted_on.clone());
        let copied = tokio::task::spawn_blocking(move || {
            // The build log is the caller's to read: no host paths in it.
            std::fs::copy(&from, &dest).map_err(|e| format!("copying the builder's disk into the build cache: {e}"))?;
            hutch_vmm::disk::reset_backing(&dest, &base).map_err(|e| {
                tracing::warn!("re-basing the builder's disk copy: {}", hutch_proto::error_chain(&e));
                "re-basing the builder's disk copy in the build cache failed (the server's log says why)".to_string()
            })
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        let thawed = agent.thaw_root().await.map_err(|e| format!("thawing the builder's disk: {e}"));
        copied?;
        thawed
    }

    pub async fn destroy(self) {
        if let Err(e) = self.sandbox.destroy().await {
            tracing::warn!("stopping the builder VM: {e}");
        }
    }
}

/// Runs one step that changes the disk. Err: (the caller's fault, one sentence).
pub async fn execute(vm: &BuildVm, step: &Step, ctx: &mut Context, n: usize, total: usize, log: &Arc<dyn BuildLog>) -> Result<(), (bool, String)> {
    let agent = vm.sandbox.agent();
    match &step.kind {
        StepKind::Run { cmd, user, build_args } => {
            let user = user.clone().unwrap_or_else(|| ctx.user.clone());
            let mut envs = build_args.clone();
            envs.extend(ctx.env.clone());
            let req = StartRequest {
                process: ProcessConfig { cmd: "/bin/sh".into(), args: vec!["-c".into(), cmd.clone()], envs, cwd: Some(ctx.workdir.clone()) },
                pty: None,
                tag: None,
                stdin: Some(false),
            };
            let step_name = n.to_string();
            let run = async {
                let mut stream = agent.as_user(Some(&user)).start(&req).await.map_err(|e| (is_user_error(&e), format!("step {n}/{total} `{}` could not start: {e}", step.text)))?;
                let mut tail: VecDeque<String> = VecDeque::new();
                let mut partial = Vec::new();
                while let Some(event) = stream.next().await {
                    match event.map_err(|e| (false, format!("step {n}/{total} `{}`: the agent connection failed: {e}", step.text)))? {
                        ProcessEvent::Data(DataEvent::Stdout(b) | DataEvent::Stderr(b) | DataEvent::Pty(b)) => {
                            partial.extend_from_slice(&b);
                            while let Some(pos) = partial.iter().position(|c| *c == b'\n') {
                                let line: Vec<u8> = partial.drain(..=pos).collect();
                                emit(log, &step_name, &mut tail, &line);
                            }
                        }
                        ProcessEvent::End(end) => {
                            if !partial.is_empty() {
                                let rest = std::mem::take(&mut partial);
                                emit(log, &step_name, &mut tail, &rest);
                            }
                            if end.exited && end.exit_code == 0 {
                                return Ok(());
                            }
                            let how = if end.exited { format!("exited with {}", end.exit_code) } else { format!("ended ({})", end.status) };
                            let last = Vec::from(tail).join("\n");
                            return Err((true, format!("step {n}/{total} `{}` {how}; its last output:\n{last}", step.text)));
                        }
                        ProcessEvent::Start { .. } | ProcessEvent::Keepalive {} => {}
                    }
                }
                Err((false, format!("step {n}/{total} `{}`: its output ended without an exit status", step.text)))
            };
            tokio::time::timeout(RUN_DEADLINE, run)
                .await
                .unwrap_or_else(|_| Err((true, format!("step {n}/{total} `{}` ran longer than {} min and was stopped", step.text, RUN_DEADLINE.as_secs() / 60))))
        }
        StepKind::Copy { files, dest, owner, mode } => {
            let owner = owner.clone().unwrap_or_else(|| ctx.user.clone());
            let dest = absolute(&ctx.workdir, dest);
            // A trailing '/' says directory; the agent's rule for a lone file keeps it.
            let dest = if files.single { dest } else { dest.trim_end_matches('/').to_string() };
            let dest = if dest.is_empty() { "/".to_string() } else { dest };
            let file = tokio::fs::File::open(&files.tar).await.map_err(|e| (false, format!("step {n}/{total} `{}`: reading its files on the host: {e}", step.text)))?;
            let body = stream_body(file);
            let target = hutch_envd::CopyTarget { dest: &dest, owner: &owner, mode: mode.as_deref().filter(|m| !m.is_empty()), single: files.single };
            agent.copy_tar(&target, body).await.map_err(|e| (is_user_error(&e), format!("step {n}/{total} `{}` failed: {e}", step.text)))
        }
        StepKind::Workdir(dir) => {
            // Docker creates the directory, owned by the current user.
            let dest = absolute(&ctx.workdir, dir);
            let empty = tar::Builder::new(Vec::new()).into_inner().unwrap_or_default();
            let target = hutch_envd::CopyTarget { dest: &dest, owner: &ctx.user, mode: None, single: false };
            agent.copy_tar(&target, hutch_envd::full(empty)).await.map_err(|e| (is_user_error(&e), format!("step {n}/{total} `{}` failed: {e}", step.text)))
        }
        StepKind::Env(_) | StepKind::User(_) | StepKind::Command { .. } => Ok(()),
    }
}

/// Writes the template's defaults where the agent reads them at every start, root's
/// and world-readable.
pub async fn write_defaults(vm: &BuildVm, json: &str) -> Result<(), String> {
    let path = hutch_proto::agent::IMAGE_DEFAULTS_PATH;
    let name = Path::new(path).file_name().and_then(|n| n.to_str()).unwrap_or("image.json");
    let bytes = hutch_formats::context::single_file_tar(name, json.as_bytes(), 0o644).map_err(|e| e.to_string())?;
    let target = hutch_envd::CopyTarget { dest: path, owner: "root", mode: Some("0644"), single: true };
    vm.sandbox.agent().copy_tar(&target, hutch_envd::full(bytes)).await.map_err(|e| format!("writing {path} in the builder VM: {e}"))
}

fn emit(log: &Arc<dyn BuildLog>, step: &str, tail: &mut VecDeque<String>, line: &[u8]) {
    let text = String::from_utf8_lossy(line).trim_end_matches(['\n', '\r']).to_string();
    log.log(Level::Info, Some(step), &text);
    if tail.len() == TAIL_LINES {
        tail.pop_front();
    }
    tail.push_back(text);
}

/// The agent refused the step itself (a user that does not exist, a bad path): 4xx.
fn is_user_error(e: &hutch_envd::AgentError) -> bool {
    use hutch_proto::connect::Code;
    matches!(e.code(), Some(Code::InvalidArgument | Code::NotFound | Code::PermissionDenied | Code::FailedPrecondition | Code::Unauthenticated | Code::AlreadyExists))
}

fn stream_body(file: tokio::fs::File) -> hutch_envd::Body {
    use futures::TryStreamExt;
    use http_body_util::BodyExt;
    let stream = tokio_util::io::ReaderStream::new(file).map_ok(hyper::body::Frame::data).map_err(|e| Box::new(e) as hutch_envd::BoxError);
    http_body_util::StreamBody::new(stream).boxed_unsync()
}
