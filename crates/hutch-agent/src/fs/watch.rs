//! Directory watching with inotify: the streaming `WatchDir` and the polled
//! CreateWatcher / GetWatcherEvents / RemoveWatcher trio share one watch task.

use super::creds::as_user;
use super::entry::entry_info;
use super::io_error::io_error;
use super::path::resolve;
use super::watchers::Polled;
use crate::http::connect::{self, parse, ConnectError, UnaryResult};
use crate::state::AgentState;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Json;
use futures::StreamExt;
use hutch_proto::connect::Code;
use hutch_proto::filesystem::*;
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use parking_lot::Mutex;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Events a polled watcher keeps until the next GetWatcherEvents.
const MAX_BUFFERED: usize = 10_000;

fn mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::MODIFY
        | WatchMask::DELETE
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::ATTRIB
        | WatchMask::DELETE_SELF
}

fn event_type(m: EventMask) -> Option<EventType> {
    if m.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
        Some(EventType::Create)
    } else if m.contains(EventMask::MODIFY) {
        Some(EventType::Write)
    } else if m.contains(EventMask::DELETE) {
        Some(EventType::Remove)
    } else if m.contains(EventMask::MOVED_FROM) {
        Some(EventType::Rename)
    } else if m.contains(EventMask::ATTRIB) {
        Some(EventType::Chmod)
    } else {
        None
    }
}

/// How many scanned entries are remembered to drop inotify's repeat of their creation.
const MAX_ANNOUNCED: usize = 10_000;

struct Watch {
    inotify: Inotify,
    root: PathBuf,
    dirs: HashMap<WatchDescriptor, PathBuf>,
    recursive: bool,
    include_entry: bool,
}

impl Watch {
    fn start(req: &WatchRequest, root: PathBuf) -> Result<Watch, ConnectError> {
        let meta = std::fs::metadata(&root).map_err(|e| io_error(&root, e))?;
        if !meta.is_dir() {
            return Err(ConnectError::new(Code::InvalidArgument, format!("path '{}' is not a directory", root.display())));
        }
        let inotify = Inotify::init().map_err(|e| ConnectError::new(Code::Internal, format!("inotify: {e}")))?;
        let mut w = Watch { inotify, root: root.clone(), dirs: HashMap::new(), recursive: req.recursive, include_entry: req.include_entry };
        w.add(&root)?;
        Ok(w)
    }

    fn add(&mut self, dir: &Path) -> Result<(), ConnectError> {
        let wd = self.inotify.watches().add(dir, mask()).map_err(|e| io_error(dir, e))?;
        self.dirs.insert(wd, dir.to_path_buf());
        if self.recursive {
            for sub in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if sub.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    let _ = self.add(&sub.path());
                }
            }
        }
        Ok(())
    }

    /// Forwards events until the receiver goes away or the watched directory does.
    async fn run(self, tx: mpsc::Sender<FilesystemEvent>) {
        let Watch { inotify, root, mut dirs, recursive, include_entry } = self;
        let Ok(mut stream) = inotify.into_event_stream(vec![0u8; 64 * 1024]) else { return };
        // Entries a scan of a new directory announced; inotify may report them again.
        let mut announced: HashSet<PathBuf> = HashSet::new();
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                () = tx.closed() => return,
            };
            let Some(Ok(ev)) = ev else { return };
            if ev.mask.contains(EventMask::DELETE_SELF) && dirs.get(&ev.wd) == Some(&root) {
                return;
            }
            let (Some(dir), Some(name)) = (dirs.get(&ev.wd).cloned(), ev.name) else { continue };
            let Some(kind) = event_type(ev.mask) else { continue };
            let full = dir.join(&name);
            // A scanned entry's own creation may follow from inotify: drop that repeat. A
            // removal forgets it, so a later re-creation is reported.
            if announced.remove(&full) && kind == EventType::Create {
                continue;
            }
            let event = |path: &Path, kind: EventType| {
                let rel = path.strip_prefix(&root).unwrap_or(path).display().to_string();
                FilesystemEvent { name: rel, event_type: kind, entry: if include_entry { entry_info(path).ok() } else { None } }
            };
            if tx.send(event(&full, kind)).await.is_err() {
                return;
            }
            if !(recursive && kind == EventType::Create && full.is_dir()) {
                continue;
            }
            // inotify is not recursive: what lands in a new directory before its watch
            // exists (`mkdir d && echo x > d/f`, lost under load) is found by scanning
            // it once the watch is in place.
            let mut pending = vec![full];
            while let Some(new_dir) = pending.pop() {
                let Ok(wd) = stream.watches().add(&new_dir, mask()) else { continue };
                dirs.insert(wd, new_dir.clone());
                for entry in std::fs::read_dir(&new_dir).into_iter().flatten().flatten() {
                    let path = entry.path();
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        pending.push(path.clone());
                    }
                    if tx.send(event(&path, EventType::Create)).await.is_err() {
                        return;
                    }
                    if announced.len() >= MAX_ANNOUNCED {
                        announced.clear();
                    }
                    announced.insert(path);
                }
            }
        }
    }
}

async fn begin(st: &AgentState, headers: &HeaderMap, req: &WatchRequest) -> Result<mpsc::Receiver<FilesystemEvent>, ConnectError> {
    let user = st.rpc_user(headers)?;
    let root = resolve(&req.path, &user);
    let req = req.clone();
    let watch = as_user(&user, move || Watch::start(&req, root)).await.map_err(|e| ConnectError::new(Code::Internal, e))??;
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(watch.run(tx));
    Ok(rx)
}

pub async fn watch_dir(State(st): State<AgentState>, headers: HeaderMap, body: Body) -> Response {
    let rx = async {
        let req: WatchRequest = connect::single_message(body).await?;
        begin(&st, &headers, &req).await
    }
    .await;
    let rx = match rx {
        Ok(rx) => rx,
        Err(e) => return connect::stream_error(e),
    };
    let every = connect::keepalive_interval(&headers);
    let start = futures::stream::once(async { Ok(WatchDirResponse::Start {}) });
    let state = (rx, tokio::time::interval_at(tokio::time::Instant::now() + every, every));
    let events = futures::stream::unfold(state, |(mut rx, mut tick)| async move {
        let msg = tokio::select! {
            ev = rx.recv() => WatchDirResponse::Filesystem(ev?),
            _ = tick.tick() => WatchDirResponse::Keepalive {},
        };
        Some((Ok::<_, ConnectError>(msg), (rx, tick)))
    });
    connect::stream(start.chain(events))
}

pub async fn create_watcher(State(st): State<AgentState>, headers: HeaderMap, body: Bytes) -> UnaryResult<WatcherId> {
    let req: WatchRequest = parse(&body)?;
    let mut rx = begin(&st, &headers, &req).await?;
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let task = tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            let mut buf = sink.lock();
            if buf.len() < MAX_BUFFERED {
                buf.push(ev);
            }
        }
    });
    let id = format!("w-{:016x}", rand::random::<u64>());
    st.watchers.add(id.clone(), Polled { events, task });
    Ok(Json(WatcherId { watcher_id: id }))
}

fn unknown(id: &str) -> ConnectError {
    ConnectError::new(Code::NotFound, format!("watcher '{id}' not found"))
}

pub async fn get_watcher_events(State(st): State<AgentState>, body: Bytes) -> UnaryResult<WatcherEvents> {
    let req: WatcherId = parse(&body)?;
    let events = st.watchers.take_events(&req.watcher_id).ok_or_else(|| unknown(&req.watcher_id))?;
    Ok(Json(WatcherEvents { events }))
}

pub async fn remove_watcher(State(st): State<AgentState>, body: Bytes) -> UnaryResult<Value> {
    let req: WatcherId = parse(&body)?;
    if !st.watchers.remove(&req.watcher_id) {
        return Err(unknown(&req.watcher_id));
    }
    Ok(Json(json!({})))
}
