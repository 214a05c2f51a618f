//! `hutch pause|resume|fork` and `hutch snapshot ...`: saving sandboxes on a `hutch
//! serve` and moving their filesystems between hosts as archives.

use anyhow::Context;
use clap::Subcommand;
use hutch_sdk::Api;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Save a sandbox (running or paused) as a snapshot named NAME; `hutch create
    /// --template NAME` starts new sandboxes from it.
    Create {
        /// The sandbox to save.
        sandbox: String,
        /// The snapshot's name.
        name: String,
    },
    /// List your snapshots.
    Ls {
        /// Print the server's answer as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete snapshots (sandboxes started from them keep working).
    Rm {
        /// The snapshots to delete, by name or id.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Write a snapshot's filesystem to FILE as a portable archive (manifest + hash).
    Export {
        /// The snapshot, by name or id.
        name: String,
        /// The archive to write.
        file: PathBuf,
    },
    /// Import an archive made by export; it is verified before it is accepted.
    Import {
        /// The archive to import.
        file: PathBuf,
        /// Name it this instead of the name in the archive.
        #[arg(long)]
        name: Option<String>,
    },
}

pub async fn pause(api: &Api, ids: Vec<String>) -> anyhow::Result<i32> {
    let mut failed = 0;
    for id in ids {
        match api.pause(&id).await {
            Ok(true) => crate::output::outln!("{id}"),
            Ok(false) => eprintln!("hutch: sandbox '{id}' is already paused"),
            Err(e) => {
                eprintln!("hutch: pausing '{id}': {e}");
                failed += 1;
            }
        }
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

pub async fn resume(api: &Api, id: &str, timeout: Option<u64>) -> anyhow::Result<i32> {
    let sandbox = api.resume(id, timeout).await.with_context(|| format!("resuming sandbox {id}"))?;
    crate::output::outln!("{}", sandbox.id);
    Ok(0)
}

pub async fn fork(api: &Api, id: &str, count: u32, timeout: Option<u64>) -> anyhow::Result<i32> {
    let results = api.fork(id, count, timeout).await.with_context(|| format!("forking sandbox {id}"))?;
    let mut failed = 0;
    for r in results {
        match r {
            Ok(sandbox) => crate::output::outln!("{}", sandbox.id),
            Err(e) => {
                eprintln!("hutch: a fork failed: {e}");
                failed += 1;
            }
        }
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

pub async fn run(api: &Api, cmd: SnapshotCommand) -> anyhow::Result<i32> {
    match cmd {
        SnapshotCommand::Create { sandbox, name } => {
            let snap = api.create_snapshot(&sandbox, Some(&name)).await.with_context(|| format!("snapshotting sandbox {sandbox}"))?;
            crate::output::outln!("{}", snap.snapshot_id);
        }
        SnapshotCommand::Ls { json } => {
            let list = api.list_snapshots().await?;
            if json {
                crate::output::outln!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                crate::output::outln!("{:<22} {:<20} {:<18} {:<7} {:<25} FROM", "SNAPSHOT ID", "NAME", "TEMPLATE", "MEMORY", "CREATED");
                for s in list {
                    let memory = if s.memory { "yes" } else { "no" };
                    let from = s.sandbox_id.unwrap_or_else(|| "(imported)".into());
                    crate::output::outln!("{:<22} {:<20} {:<18} {:<7} {:<25} {from}", s.snapshot_id, s.names.join(","), s.template_id, memory, s.created_at);
                }
            }
        }
        SnapshotCommand::Rm { names } => {
            let mut missing = 0;
            for name in names {
                if api.delete_snapshot(&name).await? {
                    crate::output::outln!("{name}");
                } else {
                    eprintln!("hutch: no snapshot '{name}'");
                    missing += 1;
                }
            }
            return Ok(if missing > 0 { 1 } else { 0 });
        }
        SnapshotCommand::Export { name, file } => {
            eprintln!("hutch: exporting snapshot '{name}' (the server flattens its disk first) ...");
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            let show = |done: u64, total: Option<u64>| {
                if let Some(t) = total {
                    bar.set_length(t);
                }
                bar.set_position(done);
            };
            let written = api.export_snapshot(&name, &file, &show).await;
            bar.finish_and_clear();
            let written = written.with_context(|| format!("exporting snapshot {name}"))?;
            eprintln!("hutch: wrote {} ({} MiB)", file.display(), written >> 20);
        }
        SnapshotCommand::Import { file, name } => {
            eprintln!("hutch: uploading {} for the server to verify and import ...", file.display());
            let snap = api.import_snapshot(&file, name.as_deref()).await.with_context(|| format!("importing {}", file.display()))?;
            crate::output::outln!("{}", snap.names.first().cloned().unwrap_or(snap.snapshot_id));
        }
    }
    Ok(0)
}
