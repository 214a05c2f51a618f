//! The Rust SDK (hutch-sdk) end to end against a real `hutch serve`.

mod common;

use hutch_proto::process::{DataEvent, ProcessConfig, ProcessEvent, StartRequest};
use hutch_sdk::{Api, ApiError, CreateOptions};
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
    common::link_shared_artifacts(home.path());
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
        tokio::time::sleep(Duration::from_millis(100)).await; // poll interval of the wait
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

    // The E2B-shaped conveniences.
    let mut seen = String::new();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let opts = hutch_sdk::RunOptions { on_stdout: Some(Box::new(move |s| { let _ = tx.send(s.to_string()); })), ..Default::default() };
    let out = sandbox.run_with("for i in 1 2 3; do echo $i; done", opts).await.expect("run");
    while let Ok(chunk) = rx.try_recv() {
        seen.push_str(&chunk);
    }
    assert_eq!((out.stdout.as_str(), seen.as_str()), ("1\n2\n3\n", "1\n2\n3\n"));
    match sandbox.run("echo no >&2; exit 9").await {
        Err(hutch_sdk::SdkError::CommandExit(o)) => assert_eq!((o.exit_code, o.stderr.as_str()), (9, "no\n")),
        other => panic!("expected a command exit error, got {other:?}"),
    }
    let slow = hutch_sdk::RunOptions { timeout: Some(Duration::from_secs(1)), ..Default::default() };
    assert!(matches!(sandbox.run_with("sleep 30", slow).await, Err(hutch_sdk::SdkError::Timeout(_))));
    sandbox.write("/home/user/d/x.bin", vec![0u8, 255]).await.expect("write");
    assert_eq!(sandbox.read("/home/user/d/x.bin").await.expect("read"), vec![0u8, 255]);
    assert!(sandbox.exists("/home/user/d/x.bin").await.expect("exists"));
    assert!(!sandbox.make_dir("/home/user/d").await.expect("make_dir"));
    assert_eq!(sandbox.rename("/home/user/d/x.bin", "/home/user/d/y.bin").await.expect("rename").name, "y.bin");
    assert_eq!(sandbox.list("/home/user/d", 1).await.expect("list").len(), 1);
    sandbox.remove("/home/user/d").await.expect("remove");
    assert!(!sandbox.exists("/home/user/d").await.expect("exists"));
    assert!(sandbox.read("/home/user/nope").await.is_err_and(|e| e.is_not_found()));

    sandbox.set_timeout(900).await.expect("timeout");
    let info = sandbox.info().await.expect("info");
    assert_eq!(info.metadata.get("sdk").map(String::as_str), Some("rust"));
    assert!(api.logs(&sandbox.id).await.expect("logs").iter().any(|l| l.contains("hutch-agent: ready")));

    // Pause modes: without memory (the files stay, the guest boots on resume), and a
    // full pause brought back by a reboot.
    let boot_id = |s: &hutch_sdk::Sandbox| {
        let s = s.clone();
        async move { s.run("cat /proc/sys/kernel/random/boot_id").await.expect("boot id").stdout }
    };
    let before = boot_id(&sandbox).await;
    assert!(sandbox.pause_as(hutch_sdk::PauseMode::Filesystem).await.expect("pause without memory"));
    assert_eq!(sandbox.info().await.expect("info").pause_mode.as_deref(), Some("filesystem"));
    let back = api.connect(&sandbox.id, None).await.expect("connect");
    assert_ne!(boot_id(&back).await, before, "the guest did not boot");
    assert_eq!(back.read("/home/user/r.txt").await.expect("read"), b"from rust");
    let before = boot_id(&back).await;
    assert!(back.pause().await.expect("pause"));
    let rebooted = api.reboot(&sandbox.id, None).await.expect("reboot");
    assert_ne!(boot_id(&rebooted).await, before, "a reboot did not boot");
    let disk_only = api.create_snapshot_as(&sandbox.id, None, hutch_sdk::PauseMode::Filesystem).await.expect("disk-only snapshot");
    assert!(!disk_only.memory);
    assert!(api.delete_snapshot(&disk_only.snapshot_id).await.expect("delete snapshot"));

    assert!(sandbox.kill().await.expect("kill"));

    // The code interpreter from Rust: state, contexts, errors.
    let ci = api.create(&CreateOptions { template: Some("code-interpreter".into()), ..Default::default() }).await.expect("create ci");
    let mut printed = String::new();
    ci.run_code("x = 20", None, |_| {}).await.expect("run_code");
    let exec = ci.run_code("print('hi'); x + 22", None, |ev| if let hutch_sdk::CodeEvent::Stdout(t) = ev { printed.push_str(t) }).await.expect("run_code");
    assert_eq!((exec.text(), printed.as_str()), (Some("42"), "hi\n"));
    let ctx = ci.create_code_context(None, Some("/tmp")).await.expect("context");
    assert_eq!(ci.run_code_in(&ctx, "x", |_| {}).await.expect("run").error.map(|e| e.name), Some("NameError".to_string()));
    assert_eq!(ci.run_code_in(&ctx, "import os; os.getcwd()", |_| {}).await.expect("run").text(), Some("/tmp"));
    assert!(ci.list_code_contexts().await.expect("list").contains(&ctx));
    ci.run_code_in(&ctx, "y = 1", |_| {}).await.expect("run");
    ci.restart_code_context(&ctx).await.expect("restart");
    assert_eq!(ci.run_code_in(&ctx, "y", |_| {}).await.expect("run").error.map(|e| e.name), Some("NameError".to_string()));
    ci.remove_code_context(&ctx).await.expect("remove");
    assert!(ci.run_code_in(&ctx, "1", |_| {}).await.is_err_and(|e| e.is_not_found()));
    assert!(ci.kill().await.expect("kill ci"));
    assert!(!api.kill(&sandbox.id).await.expect("kill again"));
    assert!(matches!(api.connect(&sandbox.id, None).await, Err(ApiError::NotFound(_))));
    assert!(matches!(Api::new(&server.url, "e2b_wrong").list(&Default::default()).await, Err(ApiError::Authentication(_))));
    assert!(matches!(api.create(&CreateOptions { template: Some("nope".into()), ..Default::default() }).await, Err(ApiError::InvalidArgument(_))));
    let _ = &server.home;
}
