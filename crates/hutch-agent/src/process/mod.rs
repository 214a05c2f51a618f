//! The process table: running processes, their output fan-out and their inputs.
//!
//! Output is pumped by one task per process to every subscriber (the `Start` stream and
//! any `Connect` streams) over bounded channels, awaiting each send: a slow client slows
//! the process down instead of making the agent buffer, so a 1 GB output never sits in
//! memory. With no subscriber left, output is read and dropped so the process never
//! blocks on a full pipe.

pub mod pty;
pub mod reaper;
pub mod rpc;
pub mod spawn;
pub mod user;

use bytes::Bytes;
use hutch_proto::process::{DataEvent, EndEvent, ProcessConfig, ProcessEvent, ProcessInfo, ProcessSelector, PtySize};
use pty::PtyMaster;
use spawn::{ProcessIo, Spawned};
use std::collections::HashMap;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};

const CHUNK: usize = 64 * 1024;
const SUBSCRIBER_QUEUE: usize = 8;
/// After the process exits, output still in the pipes is drained until it has been
/// quiet this long (a background grandchild may hold the pipe open forever).
const DRAIN_QUIET: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("process with {0} not found")]
    NotFound(String),
    #[error("process {0} has no open stdin (start it with stdin enabled)")]
    NoStdin(u32),
    #[error("process {0} has no PTY")]
    NoPty(u32),
    #[error("writing to process {pid}: {source}")]
    Write { pid: u32, source: std::io::Error },
    #[error("signalling process {pid}: {source}")]
    Signal { pid: u32, source: nix::Error },
}

fn describe(sel: &ProcessSelector) -> String {
    match sel {
        ProcessSelector::Pid(p) => format!("pid {p}"),
        ProcessSelector::Tag(t) => format!("tag '{t}'"),
    }
}

struct Entry {
    pid: u32,
    config: ProcessConfig,
    tag: Option<String>,
    stdin: tokio::sync::Mutex<Option<pipe::Sender>>,
    pty: Option<Arc<PtyMaster>>,
    subscribers: Mutex<Vec<mpsc::Sender<ProcessEvent>>>,
}

#[derive(Default, Clone)]
pub struct ProcessTable {
    entries: Arc<Mutex<HashMap<u32, Arc<Entry>>>>,
}

impl ProcessTable {
    fn find(&self, sel: &ProcessSelector) -> Result<Arc<Entry>, ProcessError> {
        let entries = self.entries.lock();
        let found = match sel {
            ProcessSelector::Pid(pid) => entries.get(pid).cloned(),
            ProcessSelector::Tag(tag) => entries.values().find(|e| e.tag.as_deref() == Some(tag)).cloned(),
        };
        found.ok_or_else(|| ProcessError::NotFound(describe(sel)))
    }

    /// Registers a spawned process and starts pumping its output; returns the first
    /// subscriber's receiver so no byte of output is missed.
    pub fn insert(
        &self,
        spawned: Spawned,
        config: ProcessConfig,
        tag: Option<String>,
    ) -> mpsc::Receiver<ProcessEvent> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        let (stdin, pty, outputs) = match spawned.io {
            ProcessIo::Pipes { stdin, stdout, stderr } => (stdin, None, Outputs::Pipes(stdout, stderr)),
            ProcessIo::Pty { master } => (None, Some(master.clone()), Outputs::Pty(master)),
        };
        let entry = Arc::new(Entry {
            pid: spawned.pid,
            config,
            tag,
            stdin: tokio::sync::Mutex::new(stdin),
            pty,
            subscribers: Mutex::new(vec![tx]),
        });
        self.entries.lock().insert(spawned.pid, entry.clone());
        let table = self.clone();
        tokio::spawn(async move {
            let end = pump(&entry, outputs, spawned.exit).await;
            table.entries.lock().remove(&entry.pid);
            let subs = std::mem::take(&mut *entry.subscribers.lock());
            for s in subs {
                let _ = s.send(ProcessEvent::End(end.clone())).await;
            }
        });
        rx
    }

    pub fn subscribe(&self, sel: &ProcessSelector) -> Result<(u32, mpsc::Receiver<ProcessEvent>), ProcessError> {
        let entry = self.find(sel)?;
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        entry.subscribers.lock().push(tx);
        Ok((entry.pid, rx))
    }

    pub fn list(&self) -> Vec<ProcessInfo> {
        let entries = self.entries.lock();
        let mut list: Vec<ProcessInfo> = entries
            .values()
            .map(|e| ProcessInfo { config: e.config.clone(), pid: e.pid, tag: e.tag.clone() })
            .collect();
        list.sort_by_key(|p| p.pid);
        list
    }

    pub async fn write_stdin(&self, sel: &ProcessSelector, data: &[u8]) -> Result<(), ProcessError> {
        let entry = self.find(sel)?;
        let pid = entry.pid;
        if let Some(pty) = &entry.pty {
            return pty.write_all(data).await.map_err(|source| ProcessError::Write { pid, source });
        }
        let mut stdin = entry.stdin.lock().await;
        let pipe = stdin.as_mut().ok_or(ProcessError::NoStdin(pid))?;
        pipe.write_all(data).await.map_err(|source| ProcessError::Write { pid, source })
    }

    pub async fn write_pty(&self, sel: &ProcessSelector, data: &[u8]) -> Result<(), ProcessError> {
        let entry = self.find(sel)?;
        let pty = entry.pty.as_ref().ok_or(ProcessError::NoPty(entry.pid))?;
        pty.write_all(data).await.map_err(|source| ProcessError::Write { pid: entry.pid, source })
    }

    pub async fn close_stdin(&self, sel: &ProcessSelector) -> Result<(), ProcessError> {
        let entry = self.find(sel)?;
        if let Some(pty) = &entry.pty {
            // A terminal has no separate stdin to close: send EOF (Ctrl-D) as a terminal would.
            return pty.write_all(&[4]).await.map_err(|source| ProcessError::Write { pid: entry.pid, source });
        }
        entry.stdin.lock().await.take();
        Ok(())
    }

    pub fn resize(&self, sel: &ProcessSelector, size: PtySize) -> Result<(), ProcessError> {
        let entry = self.find(sel)?;
        let pty = entry.pty.as_ref().ok_or(ProcessError::NoPty(entry.pid))?;
        pty.resize(size).map_err(|source| ProcessError::Write { pid: entry.pid, source })
    }

    /// Signals the process's whole group (each process leads its own session), so
    /// children of `bash -c` die with it.
    pub fn signal(&self, sel: &ProcessSelector, signal: i32) -> Result<(), ProcessError> {
        let entry = self.find(sel)?;
        let sig = nix::sys::signal::Signal::try_from(signal)
            .map_err(|source| ProcessError::Signal { pid: entry.pid, source })?;
        let pid = nix::unistd::Pid::from_raw(entry.pid as i32);
        nix::sys::signal::killpg(pid, sig)
            .or_else(|_| nix::sys::signal::kill(pid, sig))
            .map_err(|source| ProcessError::Signal { pid: entry.pid, source })
    }
}

enum Outputs {
    Pipes(pipe::Receiver, pipe::Receiver),
    Pty(Arc<PtyMaster>),
}

/// Sends one event to every live subscriber, dropping those that went away.
async fn publish(entry: &Entry, event: ProcessEvent) {
    let subs: Vec<_> = entry.subscribers.lock().clone();
    for s in subs {
        if s.send(event.clone()).await.is_err() {
            entry.subscribers.lock().retain(|x| !x.same_channel(&s));
        }
    }
}

async fn pump(entry: &Entry, outputs: Outputs, exit: tokio::sync::oneshot::Receiver<EndEvent>) -> EndEvent {
    let (exited_tx, exited) = watch::channel(false);
    let waiter = async move {
        let end = exit.await.unwrap_or_else(|_| EndEvent {
            error: Some("the agent lost track of the process".into()),
            ..EndEvent::default()
        });
        let _ = exited_tx.send(true);
        end
    };
    let readers = async {
        match outputs {
            Outputs::Pipes(mut out, mut err) => {
                tokio::join!(
                    pump_output(entry, exited.clone(), Source::Pipe(&mut out), DataEvent::Stdout),
                    pump_output(entry, exited.clone(), Source::Pipe(&mut err), DataEvent::Stderr)
                );
            }
            Outputs::Pty(master) => {
                pump_output(entry, exited.clone(), Source::Pty(&master), DataEvent::Pty).await;
            }
        }
    };
    let (end, ()) = tokio::join!(waiter, readers);
    end
}

enum Source<'a> {
    Pipe(&'a mut pipe::Receiver),
    Pty(&'a PtyMaster),
}

impl Source<'_> {
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Source::Pipe(p) => p.read(buf).await,
            Source::Pty(m) => m.read(buf).await,
        }
    }
}

/// Reads one output until EOF; once the process has exited, only until it is quiet.
async fn pump_output(entry: &Entry, mut exited: watch::Receiver<bool>, mut src: Source<'_>, wrap: fn(Bytes) -> DataEvent) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = if *exited.borrow() {
            match tokio::time::timeout(DRAIN_QUIET, src.read(&mut buf)).await {
                Ok(r) => r,
                Err(_quiet) => return,
            }
        } else {
            tokio::select! {
                r = src.read(&mut buf) => r,
                _ = exited.changed() => continue,
            }
        };
        match n {
            Ok(0) | Err(_) => return,
            Ok(n) => publish(entry, ProcessEvent::Data(wrap(Bytes::copy_from_slice(&buf[..n])))).await,
        }
    }
}
