//! Commands against a `hutch serve` (`--api-url` / HUTCH_API_URL, key from
//! HUTCH_API_KEY), with Docker's habits: create, ls, exec, cp, kill, logs, timeout.

use super::exec::{exec, parse_env, ExecFlags};
use anyhow::Context;
use clap::{Args, Subcommand};
use futures::StreamExt;
use http_body_util::BodyExt;
use hutch_sdk::{Api, CreateOptions};
use std::collections::BTreeMap;
use tokio::io::AsyncWriteExt;

#[derive(Args, Debug)]
pub struct Server {
    /// The server (`hutch serve`) to talk to.
    #[arg(long, env = "HUTCH_API_URL", default_value = "http://127.0.0.1:3000", global = true)]
    pub api_url: String,
}

#[derive(Subcommand, Debug)]
pub enum RemoteCommand {
    /// Create a sandbox on the server and print its id.
    Create {
        /// The template to start from, or the name or id of one of your snapshots.
        #[arg(long, default_value = "base")]
        template: String,
        /// Seconds until the server kills it.
        #[arg(long)]
        timeout: Option<u64>,
        /// A metadata entry to tag it with (repeatable); `hutch ls --metadata` selects by it.
        #[arg(long = "metadata", value_name = "K=V", value_parser = parse_env)]
        metadata: Vec<(String, String)>,
        /// An environment variable every process in the sandbox gets (repeatable).
        #[arg(short, long = "env", value_name = "K=V", value_parser = parse_env)]
        envs: Vec<(String, String)>,
        /// Pause it instead of killing it when the timeout is reached.
        #[arg(long)]
        auto_pause: bool,
        /// Boot the kernel instead of restoring the template's memory snapshot.
        #[arg(long)]
        cold: bool,
        /// Where it may connect: `none`, `public`, or egress rules separated by commas.
        #[arg(long, default_value = "none", value_parser = super::run::parse_policy)]
        net: hutch_net::Policy,
    },
    /// A sandbox's network: replace its egress rules, or see what it was refused.
    #[command(subcommand)]
    Net(NetCommand),
    /// Pause sandboxes: memory, processes and files are saved and the VM stops.
    Pause {
        /// The sandboxes to pause.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Resume a paused sandbox under its id.
    Resume {
        /// The paused sandbox.
        id: String,
        /// Seconds until the server ends it again.
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Copy a running sandbox into COUNT new ones that continue from its state; prints their ids.
    Fork {
        /// The running sandbox to copy.
        id: String,
        /// How many copies to make (at most 20).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
        count: u32,
        /// Seconds until the server kills each copy [default: the server's --default-timeout].
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Snapshots of sandboxes: create, list, delete, export, import.
    #[command(subcommand)]
    Snapshot(super::snapshot::SnapshotCommand),
    /// List your sandboxes.
    Ls {
        /// Print the server's answer as JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// List only sandboxes whose metadata has this entry (repeatable: all must match).
        #[arg(long = "metadata", value_name = "K=V", value_parser = parse_env)]
        metadata: Vec<(String, String)>,
        /// List the server's warm pools instead: sandboxes restored and waiting, by template.
        #[arg(long, conflicts_with = "metadata")]
        pool: bool,
    },
    /// Run a command in a sandbox (streams output, exits with its code).
    Exec {
        /// The sandbox to run it in.
        id: String,
        #[command(flatten)]
        exec: ExecFlags,
    },
    /// Run code in a sandbox's Jupyter kernel (code-interpreter template); state persists.
    RunCode {
        /// The sandbox whose kernel runs it.
        id: String,
        /// The code; `-` or nothing reads it from stdin.
        code: Option<String>,
        /// Kernel language (default python).
        #[arg(long)]
        language: Option<String>,
        /// Save image results (png, jpeg) into this directory.
        #[arg(long, value_name = "DIR")]
        save_images: Option<std::path::PathBuf>,
    },
    /// Copy a file into or out of a sandbox: `hutch cp ./a ID:/home/user/a`, `hutch cp ID:/etc/os-release -`.
    Cp {
        /// What to copy: a local path, ID:/path in a sandbox, or `-` for stdin.
        src: String,
        /// Where to copy it: a local path, ID:/path in a sandbox, or `-` for stdout.
        dst: String,
    },
    /// Kill sandboxes.
    Kill {
        /// The sandboxes to kill.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Print a sandbox's console (kernel and agent messages).
    Logs {
        /// The sandbox whose console to print.
        id: String,
    },
    /// Set a sandbox to end SECS from now.
    Timeout {
        /// The sandbox.
        id: String,
        /// Seconds from now until the server ends it.
        secs: u64,
    },
}

#[derive(Subcommand, Debug)]
pub enum NetCommand {
    /// Replace the sandbox's egress rules (`none`, `public`, or rules separated by
    /// commas); open connections stay.
    Update {
        /// The sandbox whose rules to replace.
        id: String,
        /// The new rules: `none`, `public`, or egress rules separated by commas.
        #[arg(value_parser = super::run::parse_policy)]
        rules: hutch_net::Policy,
    },
    /// The rules in force, counters, and the latest connections and names refused.
    Log {
        /// The sandbox whose network to show.
        id: String,
        /// Print the server's answer as JSON instead of a summary.
        #[arg(long)]
        json: bool,
    },
}

async fn net(api: &Api, cmd: NetCommand) -> anyhow::Result<()> {
    match cmd {
        NetCommand::Update { id, rules } => api.update_network(&id, &rules.texts()).await?,
        NetCommand::Log { id, json } => {
            let view = api.network(&id).await?;
            if json {
                crate::output::outln!("{}", serde_json::to_string_pretty(&view)?);
                return Ok(());
            }
            let rules: Vec<&str> = view["egress"].as_array().into_iter().flatten().filter_map(|r| r.as_str()).collect();
            crate::output::outln!("rules: {}", if rules.is_empty() { "none (no egress)".to_string() } else { rules.join(",") });
            let c = &view["log"]["counters"];
            if c.is_object() {
                crate::output::outln!("connections: {} allowed, {} refused; names: {} resolved, {} refused", c["flows_allowed"], c["flows_denied"], c["names_resolved"], c["names_denied"]);
                if c["placeholders_refused"].as_u64().is_some_and(|n| n > 0) {
                    crate::output::outln!("flows ended for carrying a secret's placeholder: {}", c["placeholders_refused"]);
                }
            } else {
                crate::output::outln!("(paused: no counters until it runs)");
            }
            if let Some(why) = view["log"]["link_lost"].as_str() {
                crate::output::outln!("link to the VM lost, the sandbox has no network: {why}");
            }
            for d in view["log"]["denials"].as_array().into_iter().flatten() {
                let what = match (d["name"].as_str(), d["ip"].as_str()) {
                    (Some(n), None) => n.to_string(),
                    (n, Some(ip)) => format!("{ip}:{}{}", d["port"], n.map(|n| format!(" ({n})")).unwrap_or_default()),
                    _ => "?".into(),
                };
                crate::output::outln!("{} {:<4} {what}: {}", d["at_ms"], d["proto"].as_str().unwrap_or("?"), d["message"].as_str().unwrap_or(""));
            }
        }
    }
    Ok(())
}

fn api(server: &Server) -> anyhow::Result<Api> {
    Ok(Api::from_env(Some(&server.api_url), None)?)
}

pub async fn run(server: Server, cmd: RemoteCommand) -> anyhow::Result<i32> {
    let api = api(&server)?;
    match cmd {
        RemoteCommand::Net(cmd) => net(&api, cmd).await?,
        RemoteCommand::Create { template, timeout, metadata, envs, auto_pause, cold, net } => {
            let opts = CreateOptions {
                template: Some(template),
                timeout,
                metadata: metadata.into_iter().collect(),
                envs: envs.into_iter().collect(),
                secure: true,
                auto_pause,
                cold,
                egress: net.texts(),
            };
            crate::output::outln!("{}", api.create(&opts).await?.id);
        }
        RemoteCommand::Pause { ids } => return super::snapshot::pause(&api, ids).await,
        RemoteCommand::Resume { id, timeout } => return super::snapshot::resume(&api, &id, timeout).await,
        RemoteCommand::Fork { id, count, timeout } => return super::snapshot::fork(&api, &id, count, timeout).await,
        RemoteCommand::Snapshot(cmd) => return super::snapshot::run(&api, cmd).await,
        RemoteCommand::Ls { json, pool: true, .. } => print_pools(&api.status().await?, json)?,
        RemoteCommand::Ls { json, metadata, pool: false } => {
            let list = api.list(&metadata.into_iter().collect::<BTreeMap<_, _>>()).await?;
            if json {
                crate::output::outln!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                crate::output::outln!("{:<22} {:<10} {:<8} {:<25} {:<25} METADATA", "SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS");
                for s in list {
                    let meta: Vec<String> = s.metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    let state = if s.failure.is_some() { "failed" } else { s.state.as_str() };
                    crate::output::outln!("{:<22} {:<10} {:<8} {:<25} {:<25} {}", s.sandbox_id, s.template_id, state, s.started_at, s.end_at, meta.join(","));
                    if let Some(why) = &s.failure {
                        crate::output::outln!("  {} failed: {why}; kill it with `hutch kill {}`", s.sandbox_id, s.sandbox_id);
                    }
                }
            }
        }
        RemoteCommand::Exec { id, exec: flags } => {
            let sandbox = api.connect(&id, None).await.with_context(|| format!("connecting to sandbox {id}"))?;
            return tokio::select! {
                r = exec(sandbox.envd(), &flags) => r,
                _ = tokio::signal::ctrl_c() => Ok(130),
            };
        }
        RemoteCommand::Cp { src, dst } => copy(&api, &src, &dst).await?,
        RemoteCommand::RunCode { id, code, language, save_images } => return run_code(&api, &id, code, language, save_images).await,
        RemoteCommand::Kill { ids } => {
            let mut missing = 0;
            for id in ids {
                if api.kill(&id).await? {
                    crate::output::outln!("{id}");
                } else {
                    eprintln!("hutch: no sandbox '{id}'");
                    missing += 1;
                }
            }
            return Ok(if missing > 0 { 1 } else { 0 });
        }
        RemoteCommand::Logs { id } => {
            for line in api.logs(&id).await? {
                crate::output::outln!("{line}");
            }
        }
        RemoteCommand::Timeout { id, secs } => api.set_timeout(&id, secs).await?,
    }
    Ok(0)
}

/// `hutch ls --pool`: each warm pool's waiting sandboxes and size.
fn print_pools(status: &hutch_sdk::ServerStatus, json: bool) -> anyhow::Result<()> {
    if json {
        crate::output::outln!("{}", serde_json::to_string_pretty(&status.pools)?);
        return Ok(());
    }
    crate::output::outln!("{:<28} {:>5} {:>5}  SIZED BY", "TEMPLATE", "READY", "SIZE");
    for (template, pool) in &status.pools {
        let by = if pool.pinned { "--pool" } else { "demand" };
        crate::output::outln!("{:<28} {:>5} {:>5}  {by}", template, pool.ready, pool.size);
    }
    if status.pools.is_empty() {
        crate::output::outln!("(no warm pools: the server runs with --no-pool, or none is kept now)");
    }
    Ok(())
}

/// `ID:/path` names a path in a sandbox; anything else is local (`-` is stdin/stdout).
fn split_remote(spec: &str) -> Option<(&str, &str)> {
    let (id, path) = spec.split_once(':')?;
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) && path.starts_with('/')).then_some((id, path))
}

async fn copy(api: &Api, src: &str, dst: &str) -> anyhow::Result<()> {
    match (split_remote(src), split_remote(dst)) {
        (None, Some((id, path))) => {
            let sandbox = api.connect(id, None).await?;
            let body: hutch_sdk::envd::Body = if src == "-" {
                let stream = tokio_util::io::ReaderStream::new(tokio::io::stdin());
                http_body_util::StreamBody::new(stream.map(|r| r.map(hyper::body::Frame::data).map_err(|e| Box::new(e) as hutch_sdk::envd::BoxError))).boxed_unsync()
            } else {
                let file = tokio::fs::File::open(src).await.with_context(|| format!("opening {src}"))?;
                let stream = tokio_util::io::ReaderStream::new(file);
                http_body_util::StreamBody::new(stream.map(|r| r.map(hyper::body::Frame::data).map_err(|e| Box::new(e) as hutch_sdk::envd::BoxError))).boxed_unsync()
            };
            sandbox.envd().upload(path, body).await.with_context(|| format!("writing {path} in {id}"))?;
        }
        (Some((id, path)), None) => {
            let sandbox = api.connect(id, None).await?;
            let mut body = sandbox.envd().download(path).await.with_context(|| format!("reading {path} in {id}"))?;
            let mut out: Box<dyn tokio::io::AsyncWrite + Unpin> = if dst == "-" {
                Box::new(tokio::io::stdout())
            } else {
                Box::new(tokio::fs::File::create(dst).await.with_context(|| format!("creating {dst}"))?)
            };
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.context("reading from the sandbox")?.into_data() {
                    out.write_all(&data).await?;
                }
            }
            out.flush().await?;
        }
        (Some(_), Some(_)) => anyhow::bail!("copying between two sandboxes is not supported; copy through a local file"),
        (None, None) => anyhow::bail!("one side of cp must be a sandbox path, like ID:/home/user/file"),
    }
    Ok(())
}

async fn run_code(api: &Api, id: &str, code: Option<String>, language: Option<String>, save_images: Option<std::path::PathBuf>) -> anyhow::Result<i32> {
    let code = match code.as_deref() {
        None | Some("-") => {
            let mut s = String::new();
            tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::stdin(), &mut s).await?;
            s
        }
        Some(c) => c.to_string(),
    };
    let sandbox = api.connect(id, None).await.with_context(|| format!("connecting to sandbox {id}"))?;
    let exec = sandbox
        .run_code(&code, language.as_deref(), |ev| match ev {
            hutch_sdk::CodeEvent::Stdout(t) => {
                print!("{t}");
                let _ = std::io::Write::flush(&mut std::io::stdout());
            }
            hutch_sdk::CodeEvent::Stderr(t) => eprint!("{t}"),
            _ => {}
        })
        .await?;
    for (i, r) in exec.results.iter().enumerate() {
        if let Some(dir) = &save_images {
            for (key, ext) in [("png", "png"), ("jpeg", "jpg")] {
                if let Some(b64) = r.formats.get(key).and_then(|v| v.as_str()) {
                    std::fs::create_dir_all(dir)?;
                    let path = dir.join(format!("result-{i}.{ext}"));
                    // Jupyter wraps base64 in lines.
                    let compact: String = b64.chars().filter(|c| !c.is_ascii_whitespace()).collect();
                    std::fs::write(&path, hutch_proto::b64::decode(&compact).context("decoding an image result")?)?;
                    eprintln!("hutch: saved {}", path.display());
                }
            }
        }
        if r.is_main_result {
            if let Some(t) = r.text() {
                crate::output::outln!("{t}");
            }
        }
    }
    if let Some(e) = &exec.error {
        eprintln!("{}", if e.traceback.is_empty() { format!("{}: {}", e.name, e.value) } else { e.traceback.clone() });
        return Ok(1);
    }
    Ok(0)
}
