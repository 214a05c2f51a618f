//! A stand-in guest for unit tests with `hutch_vmm::fake::FakeBackend`: it serves the
//! agent's channel as the real agent does (the hello echo, idle probes answered only
//! between sessions, HTTP/2 after the hello) with the few endpoints the lifecycle
//! uses, plus a key-value store (`POST /fake/put`, `GET /fake/values`) that is the
//! guest's "memory": saved with the VM and back after a load, so tests can tell a
//! resumed or forked guest from a fresh one. Its access token is saved with it, and
//! `/init` wants that token once one is set, as the real agent's does.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hutch_proto::agent::{find_host_line, hello_line, idle_reply, ClockReply, HostLine, InitRequest, Metrics};
use hutch_vmm::fake::{FakeGuest, RunningGuest};
use hutch_vmm::VmSpec;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

/// What a save keeps of a guest.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Memory {
    values: BTreeMap<String, String>,
    token: Option<String>,
}

/// What the guest holds, shared by its connections.
#[derive(Default)]
struct Guest {
    /// The "memory": what `POST /fake/put` stored.
    values: BTreeMap<String, String>,
    /// The access token the last `/init` gave.
    token: Option<String>,
    /// The environment the last `/init` gave.
    envs: BTreeMap<String, String>,
    /// Open host sessions; idle probes are answered only at zero.
    sessions: usize,
}

struct Shared {
    guest: Mutex<Guest>,
    idle: tokio::sync::Notify,
    wedged: Arc<AtomicBool>,
}

/// Runs a fake agent per fake VM.
#[derive(Clone, Default)]
pub struct FakeAgent {
    wedged: Arc<AtomicBool>,
}

impl FakeAgent {
    /// Makes every guest's agent answer each request with 503 (a wedged guest that
    /// still holds its channel), or serve again.
    pub fn wedge(&self, wedged: bool) {
        self.wedged.store(wedged, Ordering::SeqCst);
    }
}

impl FakeGuest for FakeAgent {
    fn run(&self, spec: &VmSpec, memory: Option<Vec<u8>>) -> Box<dyn RunningGuest> {
        let Memory { values, token } = memory.and_then(|m| serde_json::from_slice(&m).ok()).unwrap_or_default();
        let guest = Mutex::new(Guest { values, token, ..Guest::default() });
        let shared = Arc::new(Shared { guest, idle: tokio::sync::Notify::new(), wedged: self.wedged.clone() });
        let socket = spec.agent_socket();
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).expect("binding the fake agent's socket");
        let serving = shared.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                connections.spawn(serve(stream, serving.clone()));
            }
        });
        Box::new(Running { shared, task })
    }
}

struct Running {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningGuest for Running {
    fn memory(&self) -> Vec<u8> {
        let guest = self.shared.guest.lock();
        serde_json::to_vec(&Memory { values: guest.values.clone(), token: guest.token.clone() }).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Its connections are in the task's set: they end with it.
        self.task.abort();
    }
}

/// One host connection: lines until a hello, then an HTTP/2 session.
async fn serve(mut stream: UnixStream, shared: Arc<Shared>) {
    let mut line = Vec::new();
    loop {
        let Ok(byte) = stream.read_u8().await else { return };
        line.push(byte);
        if byte != b'\n' {
            continue;
        }
        match find_host_line(&line) {
            Some((_, HostLine::Hello(nonce))) => {
                if stream.write_all(&hello_line(nonce)).await.is_err() {
                    return;
                }
                break;
            }
            Some((_, HostLine::IdleProbe(nonce))) => {
                loop {
                    let idle = shared.idle.notified();
                    if shared.guest.lock().sessions == 0 {
                        break;
                    }
                    idle.await;
                }
                if stream.write_all(&idle_reply(nonce)).await.is_err() {
                    return;
                }
            }
            None => {}
        }
        line.clear();
    }
    shared.guest.lock().sessions += 1;
    let handler = shared.clone();
    let service = hyper::service::service_fn(move |req| {
        let shared = handler.clone();
        async move { Ok::<_, std::convert::Infallible>(answer(req, &shared).await) }
    });
    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), service).await;
    shared.guest.lock().sessions -= 1;
    shared.idle.notify_waiters();
}

fn json(value: &impl serde::Serialize) -> http::Response<Full<Bytes>> {
    http::Response::new(Full::new(Bytes::from(serde_json::to_vec(value).unwrap_or_default())))
}

fn status(code: http::StatusCode) -> http::Response<Full<Bytes>> {
    let mut reply = http::Response::new(Full::new(Bytes::new()));
    *reply.status_mut() = code;
    reply
}

async fn answer(req: http::Request<hyper::body::Incoming>, shared: &Shared) -> http::Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let path = parts.uri.path().to_string();
    if shared.wedged.load(Ordering::SeqCst) {
        return status(http::StatusCode::SERVICE_UNAVAILABLE);
    }
    match (parts.method.as_str(), path.as_str()) {
        ("GET", "/health") | ("POST", "/sync") => status(http::StatusCode::NO_CONTENT),
        ("POST", "/init") => match serde_json::from_slice::<InitRequest>(&body) {
            Ok(init) => {
                let mut guest = shared.guest.lock();
                let given = parts.headers.get("x-access-token").and_then(|v| v.to_str().ok());
                if guest.token.as_deref().is_some_and(|held| given.is_none_or(|g| !hutch_proto::access::secrets_equal(g, held))) {
                    return status(http::StatusCode::UNAUTHORIZED);
                }
                guest.envs = init.env_vars;
                guest.token = init.access_token.filter(|t| !t.is_empty());
                status(http::StatusCode::NO_CONTENT)
            }
            Err(_) => status(http::StatusCode::BAD_REQUEST),
        },
        ("POST", "/clock") => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as i128).unwrap_or_default();
            json(&ClockReply { unix_ns: now })
        }
        ("GET", "/metrics") => json(&Metrics::default()),
        // Never answers: a guest stuck on one request.
        ("GET", "/fake/hang") => std::future::pending().await,
        ("GET", "/fake/envs") => json(&shared.guest.lock().envs),
        ("GET", "/fake/values") => json(&shared.guest.lock().values),
        ("POST", "/fake/put") => match serde_json::from_slice::<BTreeMap<String, String>>(&body) {
            Ok(more) => {
                shared.guest.lock().values.extend(more);
                status(http::StatusCode::NO_CONTENT)
            }
            Err(_) => status(http::StatusCode::BAD_REQUEST),
        },
        _ => status(http::StatusCode::NOT_FOUND),
    }
}

/// Artifacts of a template "base" under `root` for fake VMs: nothing boots them, but
/// overlays are real qcow2 files on a raw image.
pub fn artifacts(root: &std::path::Path) -> crate::Artifacts {
    use hutch_image::kernel::Kernel;
    use hutch_image::template::Template;
    let artifacts = crate::Artifacts {
        kernel: Kernel { version: "6.1-test".into(), package: "p".into(), package_version: "1".into(), dir: root.join("k") },
        initramfs: root.join("initrd"),
        template: Template {
            name: "base".into(),
            suite: "bookworm".into(),
            packages: vec![],
            built_at: String::new(),
            disk_size: 1 << 20,
            build_id: "x".into(),
            image: String::new(),
            recipe: String::new(),
            source: None,
            api_build: None,
            shape: Default::default(),
            tagged_at: None,
            dir: root.join("t"),
            tag: None,
        },
    };
    std::fs::create_dir_all(&artifacts.template.dir).expect("template dir");
    std::fs::write(artifacts.template.image(), vec![0u8; 1 << 20]).expect("template image");
    artifacts
}

#[cfg(test)]
mod tests {
    use super::*;
    use hutch_vmm::fake::FakeGuest;
    use std::time::{Duration, Instant};

    fn spec(dir: &std::path::Path) -> VmSpec {
        VmSpec {
            id: "t".into(),
            dir: dir.to_path_buf(),
            kernel: dir.join("k"),
            initrd: dir.join("i"),
            disk: dir.join("d"),
            base: None,
            cpus: 1,
            memory_mib: 256,
            accel: hutch_vmm::Accel::Tcg,
            memory: hutch_vmm::Memory::Anonymous,
            incoming: None,
            die_with_parent: true,
            agent_channel: "t".into(),
            nic: None,
        }
    }

    /// The data proxy's deadline on an agent's answer starts once the request is sent:
    /// a stuck guest's call ends, a slow upload does not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_answer_deadline_starts_after_the_request_body() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let spec = spec(tmp.path());
        let _guest = FakeAgent::default().run(&spec, None);
        let agent = hutch_envd::connect(&spec.agent_socket()).await.expect("connect");
        let limit = Duration::from_millis(300);

        let hang = http::Request::get("http://agent/fake/hang").body(hutch_envd::full(Bytes::new())).expect("request");
        let started = Instant::now();
        let stuck = tokio::time::timeout(Duration::from_secs(10), agent.send_answered_within(hang, limit)).await.expect("the deadline ends the call");
        assert!(matches!(stuck, Err(hutch_envd::AgentError::Timeout { .. })), "{stuck:?}");
        assert!(started.elapsed() >= limit);

        // A body that takes three times the limit to arrive.
        let (chunks, receiver) = tokio::sync::mpsc::channel::<Result<hyper::body::Frame<Bytes>, hutch_envd::BoxError>>(1);
        let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(receiver)).boxed_unsync();
        let upload = http::Request::post("http://agent/fake/put").body(body).expect("request");
        let sending = tokio::spawn(async move {
            for part in [&b"{\"slow\""[..], b":\"up", b"load\"}"] {
                tokio::time::sleep(limit / 3 * 3 / 2).await;
                let _ = chunks.send(Ok(hyper::body::Frame::data(Bytes::from_static(part)))).await;
            }
        });
        let started = Instant::now();
        let answered = agent.send_answered_within(upload, limit).await.expect("a slow upload is answered");
        assert!(started.elapsed() > limit, "the body took longer than the limit");
        assert!(answered.status().is_success(), "{}", answered.status());
        sending.await.expect("sender");
        let values: BTreeMap<String, String> = agent.get_json("/fake/values").await.expect("values");
        assert_eq!(values["slow"], "upload");
    }
}
