//! The Rust SDK (hutch-sdk) end to end against a real `hutch serve`.

use hutch_proto::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest};
use hutch_sdk::{Api, ApiError, CreateOptions};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "e2b_1111111111111111111111111111111111111111";

struct Server {
    child: Child,
    home: tempfile::TempDir,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
    }
}

fn start_server() -> Server {
    let home = tempfile::Builder::new().prefix("hutch-sdk-").tempdir_in("/tmp").expect("home");
    let shared = std::env::var_os("HUTCH_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".local/share/hutch"));
    for sub in ["kernel", "initramfs", "templates"] {
        std::fs::create_dir_all(shared.join(sub)).expect("shared");
        std::os::unix::fs::symlink(shared.join(sub), home.path().join(sub)).expect("link");
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_hutch"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--accel", "tcg"])
        .env("HUTCH_HOME", home.path())
        .env("HUTCH_API_KEY", KEY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("hutch serve");
    Server { child, home, url }
}

async fn ready(api: &Api) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while api.list(&Default::default()).await.is_err() {
        assert!(Instant::now() < deadline, "hutch serve did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn rust_sdk_end_to_end() {
    let server = start_server();
    let api = Api::new(&server.url, KEY);
    ready(&api).await;

    let opts = CreateOptions { metadata: [("sdk".to_string(), "rust".to_string())].into(), envs: [("V".to_string(), "7".to_string())].into(), ..Default::default() };
    let sandbox = api.create(&opts).await.expect("create");
    let listed = api.list(&opts.metadata).await.expect("list");
    assert_eq!(listed.iter().map(|s| s.sandbox_id.as_str()).collect::<Vec<_>>(), [sandbox.id.as_str()]);

    let req = StartRequest {
        process: ProcessConfig { cmd: "/bin/sh".into(), args: vec!["-c".into(), "echo v=$V; echo e >&2; exit 2".into()], ..Default::default() },
        stdin: Some(false),
        ..Default::default()
    };
    let mut stream = sandbox.envd().start(&req).await.expect("start");
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    while let Some(ev) = stream.next().await {
        match ev.expect("event") {
            ProcessEvent::Data(DataEvent::Stdout(b)) => out.extend_from_slice(&b),
            ProcessEvent::Data(DataEvent::Stderr(b)) => err.extend_from_slice(&b),
            ProcessEvent::End(end) => code = Some(end.shell_code()),
            _ => {}
        }
    }
    assert_eq!((out.as_slice(), err.as_slice(), code), (&b"v=7\n"[..], &b"e\n"[..], Some(2)));

    sandbox.envd().upload("/home/user/r.txt", hutch_sdk::envd::full("from rust")).await.expect("upload");
    let body = sandbox.envd().download("/home/user/r.txt").await.expect("download");
    let bytes = http_body_util::BodyExt::collect(body).await.expect("body").to_bytes();
    assert_eq!(&bytes[..], b"from rust");

    sandbox.set_timeout(900).await.expect("timeout");
    let info = sandbox.info().await.expect("info");
    assert_eq!(info.metadata.get("sdk").map(String::as_str), Some("rust"));
    assert!(api.logs(&sandbox.id).await.expect("logs").iter().any(|l| l.contains("hutch-agent: ready")));

    assert!(sandbox.kill().await.expect("kill"));
    assert!(!api.kill(&sandbox.id).await.expect("kill again"));
    assert!(matches!(api.connect(&sandbox.id, None).await, Err(ApiError::NotFound(_))));
    assert!(matches!(Api::new(&server.url, "e2b_wrong").list(&Default::default()).await, Err(ApiError::Authentication(_))));
    assert!(matches!(api.create(&CreateOptions { template: Some("nope".into()), ..Default::default() }).await, Err(ApiError::InvalidArgument(_))));
    let _ = &server.home;
}
