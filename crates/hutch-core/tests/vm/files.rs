//! Files and the filesystem API in the shared sandbox.

use crate::check;
use crate::support::{run, Env, Shared};
use bytes::Bytes;
use futures::StreamExt;
use hutch_envd::{full, AgentError, Body};
use hutch_proto::connect::Code;
use hutch_proto::filesystem::*;
use http_body_util::BodyExt;
use libtest_mimic::Trial;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

pub fn trials(env: &Arc<Env>, sb: &Shared) -> Vec<Trial> {
    crate::shared_trials!(
        env,
        sb,
        "files::hundred_mb_upload_and_download_keep_their_hash" => big_transfer,
        "files::write_read_and_ownership" => write_read,
        "files::missing_paths_are_not_found" => missing,
        "files::stat_list_make_move_remove" => fs_rpcs,
        "files::watcher_sees_changes" => watcher,
    )
}

fn code_of<T: std::fmt::Debug>(r: &Result<T, AgentError>) -> Option<Code> {
    r.as_ref().err().and_then(AgentError::code)
}

/// A deterministic 100 MB body, streamed in 1 MiB chunks, and its hash.
fn pattern(size: usize) -> (Body, String) {
    let chunk_of = |i: usize| -> Bytes {
        let mut c = vec![0u8; 1 << 20];
        for (j, b) in c.iter_mut().enumerate() {
            *b = ((i * 31 + j * 7) % 251) as u8;
        }
        Bytes::from(c)
    };
    let chunks = size.div_ceil(1 << 20);
    let mut hasher = Sha256::new();
    for i in 0..chunks {
        let c = chunk_of(i);
        let take = (size - i * (1 << 20)).min(c.len());
        hasher.update(&c[..take]);
    }
    let stream = futures::stream::iter(0..chunks).map(move |i| {
        let c = chunk_of(i);
        let take = (size - i * (1 << 20)).min(c.len());
        Ok::<_, hutch_envd::BoxError>(hyper::body::Frame::data(c.slice(..take)))
    });
    (BodyExt::boxed_unsync(http_body_util::StreamBody::new(stream)), hex::encode(hasher.finalize()))
}

async fn big_transfer(sb: Shared) -> anyhow::Result<()> {
    const SIZE: usize = 100_000_000;
    let (body, expected) = pattern(SIZE);
    let written = sb.agent.upload("/home/user/big.bin", body).await?;
    check!(written.len() == 1 && written[0].path == "/home/user/big.bin", "upload answered {written:?}");
    let out = run(&sb.agent, "sha256sum /home/user/big.bin | cut -d' ' -f1; stat -c %s /home/user/big.bin").await?;
    check!(out.stdout_str() == format!("{expected}\n{SIZE}\n"), "in the guest: {:?} (expected {expected})", out.stdout_str());
    let mut body = sb.agent.download("/home/user/big.bin").await?;
    let mut hasher = Sha256::new();
    let mut total = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            total += data.len();
            hasher.update(&data);
        }
    }
    check!(total == SIZE, "downloaded {total} bytes");
    check!(hex::encode(hasher.finalize()) == expected, "download hash differs");
    run(&sb.agent, "rm /home/user/big.bin").await?;
    Ok(())
}

async fn write_read(sb: Shared) -> anyhow::Result<()> {
    let written = sb.agent.upload("notes/today.txt", full("hello world")).await?;
    check!(written[0].path == "/home/user/notes/today.txt" && written[0].name == "today.txt" && written[0].kind == "file", "{written:?}");
    let out = run(&sb.agent, "stat -c '%U:%G %s' /home/user/notes /home/user/notes/today.txt").await?;
    check!(out.stdout_str() == "user:user 4096\nuser:user 11\n", "ownership: {:?}", out.stdout_str());
    let body = sb.agent.download("/home/user/notes/today.txt").await?.collect().await?.to_bytes();
    check!(body == "hello world", "read back {body:?}");
    let root = sb.agent.as_user(Some("root"));
    root.upload("/root/secret", full("s")).await?;
    let denied = sb.agent.download("/root/secret").await;
    check!(code_of(&denied).is_some(), "user could read /root/secret? {:?}", denied.map(|_| ()));
    Ok(())
}

async fn missing(sb: Shared) -> anyhow::Result<()> {
    let r = sb.agent.download("/no/such/file").await;
    check!(code_of(&r) == Some(Code::NotFound), "download gave {:?}", r.map(|_| ()));
    if let Err(AgentError::Http { status, message }) = &r {
        check!(status.as_u16() == 404 && message.contains("does not exist"), "{status} {message}");
    }
    let r = sb.agent.unary::<_, EntryResponse>("/filesystem.Filesystem/Stat", &json!({"path": "/no/such"})).await;
    check!(code_of(&r) == Some(Code::NotFound), "stat gave {r:?}");
    let r = sb.agent.unary::<_, ListDirResponse>("/filesystem.Filesystem/ListDir", &json!({"path": "/no/such"})).await;
    check!(code_of(&r) == Some(Code::NotFound), "list gave {r:?}");
    let r = sb.agent.unary::<_, Value>("/filesystem.Filesystem/Stat", &json!({"wrong": 1})).await;
    check!(code_of(&r) == Some(Code::InvalidArgument), "malformed request gave {r:?}");
    let r = sb.agent.download("/home/user").await;
    check!(matches!(&r, Err(AgentError::Http { status, .. }) if status.as_u16() == 400), "directory download gave {:?}", r.map(|_| ()));
    Ok(())
}

async fn fs_rpcs(sb: Shared) -> anyhow::Result<()> {
    let fs = |m: &str| format!("/filesystem.Filesystem/{m}");
    let made: EntryResponse = sb.agent.unary(&fs("MakeDir"), &json!({"path": "tree/a/b"})).await?;
    check!(made.entry.path == "/home/user/tree/a/b" && made.entry.file_type == FileType::Directory, "{made:?}");
    let again = sb.agent.unary::<_, EntryResponse>(&fs("MakeDir"), &json!({"path": "tree/a/b"})).await;
    check!(code_of(&again) == Some(Code::AlreadyExists), "second MakeDir gave {again:?}");
    sb.agent.upload("tree/a/file.txt", full("12345")).await?;
    let st: EntryResponse = sb.agent.unary(&fs("Stat"), &json!({"path": "/home/user/tree/a/file.txt"})).await?;
    let e = st.entry;
    check!(e.file_type == FileType::File && e.size == 5 && e.owner == "user" && e.permissions.starts_with("-rw"), "{e:?}");
    check!(e.modified_time.as_deref().is_some_and(|t| t.starts_with("20")), "mtime {:?}", e.modified_time);
    let one: ListDirResponse = sb.agent.unary(&fs("ListDir"), &json!({"path": "tree", "depth": 1})).await?;
    let names: Vec<_> = one.entries.iter().map(|e| e.path.as_str()).collect();
    check!(names == ["/home/user/tree/a"], "depth 1: {names:?}");
    let deep: ListDirResponse = sb.agent.unary(&fs("ListDir"), &json!({"path": "tree", "depth": 3})).await?;
    let names: Vec<_> = deep.entries.iter().map(|e| e.path.as_str()).collect();
    check!(names == ["/home/user/tree/a", "/home/user/tree/a/b", "/home/user/tree/a/file.txt"], "depth 3: {names:?}");
    let on_file = sb.agent.unary::<_, ListDirResponse>(&fs("ListDir"), &json!({"path": "tree/a/file.txt"})).await;
    check!(code_of(&on_file) == Some(Code::InvalidArgument), "ListDir on a file gave {on_file:?}");
    let moved: EntryResponse = sb.agent.unary(&fs("Move"), &json!({"source": "tree/a/file.txt", "destination": "tree/z/moved.txt"})).await?;
    check!(moved.entry.path == "/home/user/tree/z/moved.txt", "{moved:?}");
    let gone = sb.agent.unary::<_, EntryResponse>(&fs("Move"), &json!({"source": "tree/nope", "destination": "tree/x"})).await;
    check!(code_of(&gone) == Some(Code::NotFound), "moving a missing path gave {gone:?}");
    let _: Value = sb.agent.unary(&fs("Remove"), &json!({"path": "tree"})).await?;
    let _: Value = sb.agent.unary(&fs("Remove"), &json!({"path": "tree"})).await?; // missing is fine
    let after = sb.agent.unary::<_, EntryResponse>(&fs("Stat"), &json!({"path": "tree"})).await;
    check!(code_of(&after) == Some(Code::NotFound), "tree still there: {after:?}");
    Ok(())
}

async fn watcher(sb: Shared) -> anyhow::Result<()> {
    let fs = |m: &str| format!("/filesystem.Filesystem/{m}");
    let _: EntryResponse = sb.agent.unary(&fs("MakeDir"), &json!({"path": "watched"})).await?;
    let w: WatcherId = sb.agent.unary(&fs("CreateWatcher"), &json!({"path": "watched", "recursive": true})).await?;
    // `mkdir -p` then a file at once: they land before the agent can watch the new
    // directories, so only its scan of them can report the file.
    run(&sb.agent, "cd ~/watched && mkdir sub && echo x > sub/f && mkdir -p deep/a/b && echo z > deep/a/b/f && echo y > g && rm g").await?;
    let mut events = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let got: WatcherEvents = sb.agent.unary(&fs("GetWatcherEvents"), &json!({"watcherId": w.watcher_id})).await?;
        events.extend(got.events);
        if events.iter().any(|e| e.name == "g" && e.event_type == EventType::Remove) {
            break;
        }
        // Polling interval of a deadline-bounded wait for the removal event.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let has = |name: &str, t: EventType| events.iter().any(|e| e.name == name && e.event_type == t);
    check!(has("sub", EventType::Create) && has("sub/f", EventType::Create) && has("g", EventType::Write) && has("g", EventType::Remove), "events {events:?}");
    check!(has("deep/a/b", EventType::Create) && has("deep/a/b/f", EventType::Create), "nested new directories' contents missing from {events:?}");
    let _: Value = sb.agent.unary(&fs("RemoveWatcher"), &json!({"watcherId": w.watcher_id})).await?;
    let r = sb.agent.unary::<_, WatcherEvents>(&fs("GetWatcherEvents"), &json!({"watcherId": w.watcher_id})).await;
    check!(code_of(&r) == Some(Code::NotFound), "removed watcher gave {r:?}");
    Ok(())
}
