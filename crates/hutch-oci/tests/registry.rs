//! Pulls from Debian's `docker-registry` on loopback, started here (one open, one behind
//! htpasswd, one behind a token service), with images this test pushes: shared layers fetched once, a tampered blob,
//! a missing tag, a wrong password, an unreachable registry. Nothing leaves the machine.

use hutch_oci::pull::{PullError, Puller, Quiet, RegistryOptions};
use hutch_oci::{BlobStore, Digest};
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::secrets::RegistryAuth;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";

struct Registry {
    child: Child,
    addr: String,
    dir: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback address nothing listens on, never one this process handed out before.
/// The port is free when chosen and released at once for the registry to bind, so two
/// tests running side by side could otherwise be given the same one: one then talked to
/// the other's registry, and was refused when that one stopped (seen in CI).
fn unused_loopback_addr() -> String {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().expect("ports");
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
        if !given.contains(&port) {
            given.push(port);
            return format!("127.0.0.1:{port}");
        }
    }
}

impl Registry {
    /// `docker-registry` on a free loopback port; with `login`, behind htpasswd.
    fn start(login: Option<(&str, &str)>) -> Registry {
        Registry::start_with(|dir| {
            let (user, password) = login?;
            let out = Command::new("htpasswd").args(["-Bbn", user, password]).output().expect("htpasswd (apache2-utils)");
            assert!(out.status.success(), "htpasswd failed");
            std::fs::write(dir.join("htpasswd"), out.stdout).expect("htpasswd file");
            Some(format!("auth:\n  htpasswd:\n    realm: hutch-test\n    path: {}\n", dir.join("htpasswd").display()))
        })
    }

    /// `docker-registry` on a free loopback port, with the `auth:` section `auth` writes
    /// (given the registry's directory), if any.
    fn start_with(auth: impl FnOnce(&Path) -> Option<String>) -> Registry {
        let binary = Path::new("/usr/bin/docker-registry");
        assert!(binary.exists(), "Debian's docker-registry is not installed (scripts/test.sh installs it: apt-get install docker-registry apache2-utils)");
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = unused_loopback_addr();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        if let Some(section) = auth(dir.path()) {
            config.push_str(&section);
        }
        std::fs::write(dir.path().join("config.yml"), config).expect("config");
        let child = Command::new(binary)
            .arg("serve")
            .arg(dir.path().join("config.yml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("registry.log")).expect("log"))
            .spawn()
            .expect("docker-registry");
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut child = child;
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(Instant::now() < deadline, "docker-registry did not listen on {addr} within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Something answered: it must be this registry, not another that took the port.
        assert!(child.try_wait().expect("the registry's status").is_none(), "docker-registry exited at start: {}", std::fs::read_to_string(dir.path().join("registry.log")).unwrap_or_default());
        Registry { child, addr, dir }
    }

    fn options(&self, login: Option<(&str, &str)>) -> RegistryOptions {
        RegistryOptions { credentials: login.map(|(u, p)| (u.to_string(), p.to_string())), insecure: vec![self.addr.clone()], local: false, proxy: None, aws: None }
    }

    /// Where the registry keeps a blob's bytes.
    fn blob_file(&self, digest: &Digest) -> PathBuf {
        self.dir.path().join("data/docker/registry/v2/blobs/sha256").join(&digest.hex()[..2]).join(digest.hex()).join("data")
    }

    fn client(&self) -> oci_client::Client {
        hutch_oci::install_tls_provider();
        oci_client::Client::new(ClientConfig { protocol: ClientProtocol::HttpsExcept(vec![self.addr.clone()]), ..Default::default() })
    }

    async fn push(&self, name: &str, layers: &[Vec<u8>], login: Option<(&str, &str)>) {
        self.push_for(name, "amd64", layers, login).await;
    }

    /// Pushes an image for linux/`arch`; returns its manifest's (digest, size).
    async fn push_for(&self, name: &str, arch: &str, layers: &[Vec<u8>], login: Option<(&str, &str)>) -> (String, usize) {
        let client = self.client();
        let reference: oci_client::Reference = format!("{}/{name}", self.addr).parse().expect("reference");
        let layers: Vec<ImageLayer> = layers.iter().map(|l| ImageLayer::new(l.clone(), LAYER.into(), None)).collect();
        let config = format!(r#"{{"architecture":"{arch}","os":"linux","config":{{"Env":["GREETING=hi"],"WorkingDir":"/srv","User":"1000"}},"rootfs":{{"type":"layers","diff_ids":[]}}}}"#);
        let auth = login.map(|(u, p)| RegistryAuth::Basic(u.into(), p.into())).unwrap_or(RegistryAuth::Anonymous);
        client.push(&reference, &layers, Config::new(config.into_bytes(), CONFIG.into(), None), &auth, None).await.expect("push");
        let (bytes, digest) = client.pull_manifest_raw(&reference, &auth, &[oci_client::manifest::OCI_IMAGE_MEDIA_TYPE]).await.expect("its manifest");
        (digest, bytes.len())
    }

    /// Pushes a multi-platform index naming `(manifest digest, size, arch)` images.
    async fn push_index(&self, name: &str, images: &[(String, usize, &str)]) {
        let manifests: Vec<serde_json::Value> = images
            .iter()
            .map(|(digest, size, arch)| serde_json::json!({"mediaType": oci_client::manifest::OCI_IMAGE_MEDIA_TYPE, "digest": digest, "size": size, "platform": {"architecture": arch, "os": "linux"}}))
            .collect();
        let index: oci_client::manifest::OciImageIndex =
            serde_json::from_value(serde_json::json!({"schemaVersion": 2, "mediaType": oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE, "manifests": manifests})).expect("an index");
        let reference: oci_client::Reference = format!("{}/{name}", self.addr).parse().expect("reference");
        self.client().push_manifest(&reference, &oci_client::manifest::OciManifest::ImageIndex(index)).await.expect("push the index");
    }
}

/// A gzipped tar with the given files.
fn layer(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, path, *data).expect("append");
    }
    let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    g.write_all(&b.into_inner().expect("tar")).expect("gzip");
    g.finish().expect("gzip")
}

/// A budget no test layer reaches.
fn unlimited() -> u64 {
        u64::MAX
    }

fn puller(store: &Path, options: &RegistryOptions) -> Puller {
    Puller::new(BlobStore::new(store), options)
}

#[tokio::test]
async fn a_second_image_downloads_only_the_layers_it_does_not_share() {
    let registry = Registry::start(None);
    let shared = layer(&[("etc/shared", b"both images")]);
    registry.push("app-a:1", &[shared.clone(), layer(&[("a", b"only a")])], None).await;
    registry.push("app-b:1", &[shared.clone(), layer(&[("b", b"only b")])], None).await;
    let cache = tempfile::tempdir().expect("cache");
    let p = puller(cache.path(), &registry.options(None));
    let a = p.pull(&format!("{}/app-a:1", registry.addr), Arc::new(Quiet)).await.expect("pull a");
    assert_eq!((a.layers_downloaded, a.layers_cached), (2, 0));
    assert_eq!(a.defaults.env.get("GREETING").map(String::as_str), Some("hi"));
    assert_eq!((a.defaults.workdir.as_deref(), a.defaults.user.as_deref()), (Some("/srv"), Some("1000")));
    let b = p.pull(&format!("{}/app-b:1", registry.addr), Arc::new(Quiet)).await.expect("pull b");
    assert_eq!((b.layers_downloaded, b.layers_cached), (1, 1), "the shared layer came from the cache");
    assert_eq!(b.layers[0], a.layers[0]);
    // The layers apply to a tree.
    let tree = tempfile::tempdir().expect("tree");
    let root = std::fs::canonicalize(tree.path()).expect("root");
    for d in &b.layers {
        hutch_oci::unpack::apply_layer(&root, std::fs::File::open(p.store().path(d)).expect("blob"), d.short(), &mut unlimited()).expect("apply");
    }
    assert_eq!(std::fs::read(root.join("etc/shared")).expect("shared"), b"both images");
    assert_eq!(std::fs::read(root.join("b")).expect("b"), b"only b");
}

#[tokio::test]
async fn bad_pulls_are_one_clear_error_and_leave_nothing_in_the_cache() {
    let registry = Registry::start(None);
    let cache = tempfile::tempdir().expect("cache");
    let p = puller(cache.path(), &registry.options(None));
    let missing = p.pull(&format!("{}/nothing:here", registry.addr), Arc::new(Quiet)).await.expect_err("missing tag");
    assert!(matches!(missing, PullError::NotFound { .. }), "{missing}");
    assert!(missing.to_string().contains("was not found in its registry"), "{missing}");

    let bad = p.pull("Not A Reference", Arc::new(Quiet)).await.expect_err("bad reference");
    assert!(matches!(bad, PullError::BadReference { .. }), "{bad}");

    // The registry serves other bytes than the manifest names.
    let tampered_layer = layer(&[("x", b"original")]);
    registry.push("tampered:1", std::slice::from_ref(&tampered_layer), None).await;
    let digest = Digest::of(&tampered_layer);
    std::fs::write(registry.blob_file(&digest), layer(&[("x", b"evil")])).expect("tamper");
    let err = p.pull(&format!("{}/tampered:1", registry.addr), Arc::new(Quiet)).await.expect_err("tampered blob");
    assert!(matches!(err, PullError::Tampered { .. }), "{err}");
    assert!(!p.store().has(&digest), "the tampered blob is not cached");
    let partial: Vec<_> = walk(cache.path()).into_iter().filter(|f| f.to_string_lossy().contains("partial")).collect();
    assert!(partial.is_empty(), "no partial files: {partial:?}");

    let closed = unused_loopback_addr();
    let options = RegistryOptions { credentials: None, insecure: vec![closed.clone()], local: false, proxy: None, aws: None };
    let err = puller(cache.path(), &options).pull(&format!("{closed}/app:1"), Arc::new(Quiet)).await.expect_err("nothing listens");
    assert!(matches!(err, PullError::Unreachable { .. }), "{err}");
}

/// A tar (not compressed) of `(path, contents, mode)` files and `(path, target)` hard
/// links, owned by root.
fn tar_of(files: &[(&str, &[u8], u32)], links: &[(&str, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let header = |mode: u32, size: u64| {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_mode(mode);
        h.set_size(size);
        h
    };
    for (path, data, mode) in files {
        b.append_data(&mut header(*mode, data.len() as u64), path, *data).expect("file");
    }
    for (path, target) in links {
        let mut h = header(0o644, 0);
        h.set_entry_type(tar::EntryType::Link);
        b.append_link(&mut h, path, target).expect("link");
    }
    b.into_inner().expect("tar")
}

/// Layers as registries serve them: a Docker v2 image (Docker's manifest, config and
/// gzip layer types), and an OCI image whose layers are gzip, zstd and plain tar, told
/// apart by their bytes. Applied in order, they give one tree: setuid kept, a hard link
/// across layers, a whiteout and an opaque directory honoured.
#[tokio::test]
async fn docker_v2_images_and_zstd_and_plain_layers_pull_and_apply() {
    use oci_client::manifest::{OciImageManifest, IMAGE_DOCKER_CONFIG_MEDIA_TYPE, IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE, IMAGE_LAYER_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE};
    let registry = Registry::start(None);
    let client = registry.client();
    let config = br#"{"architecture":"amd64","os":"linux","config":{"Env":["FROM=docker"]},"rootfs":{"type":"layers","diff_ids":[]}}"#.to_vec();

    let base = layer(&[("bin/tool", b"setuid tool"), ("data/keep", b"whited out above"), ("opt/old", b"hidden by an opaque dir")]);
    // `layer` makes 0644 root files; the setuid bit comes from a second gzip layer.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&tar_of(&[("bin/su", b"setuid", 0o4755)], &[])).expect("gzip");
    let setuid = gz.finish().expect("gzip");
    let docker_layers: Vec<ImageLayer> = [&base, &setuid].iter().map(|l| ImageLayer::new(l.to_vec(), IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE.into(), None)).collect();
    let docker_config = Config::new(config.clone(), IMAGE_DOCKER_CONFIG_MEDIA_TYPE.into(), None);
    let mut manifest = OciImageManifest::build(&docker_layers, &docker_config, None);
    manifest.media_type = Some(IMAGE_MANIFEST_MEDIA_TYPE.into());
    let docker_ref: oci_client::Reference = format!("{}/docker-v2:1", registry.addr).parse().expect("reference");
    client.push(&docker_ref, &docker_layers, docker_config, &RegistryAuth::Anonymous, Some(manifest)).await.expect("push the Docker v2 image");
    let (raw, _) = client.pull_manifest_raw(&docker_ref, &RegistryAuth::Anonymous, &[IMAGE_MANIFEST_MEDIA_TYPE]).await.expect("the manifest");
    assert!(String::from_utf8_lossy(&raw).contains(IMAGE_MANIFEST_MEDIA_TYPE), "the registry holds a Docker v2 manifest");

    // On top, as an OCI image: a zstd layer (a hard link to the lower layer's file, a
    // whiteout) and a plain one (an opaque directory with one new file).
    let zstd = zstd::stream::encode_all(&tar_of(&[("data/.wh.keep", b"", 0o644)], &[("bin/su-link", "bin/su")])[..], 3).expect("zstd");
    let plain = tar_of(&[("opt/.wh..wh..opq", b"", 0o644), ("opt/new", b"above the opaque dir", 0o644)], &[]);
    let oci_layers = vec![
        ImageLayer::new(base.clone(), LAYER.into(), None),
        ImageLayer::new(setuid.clone(), LAYER.into(), None),
        ImageLayer::new(zstd.clone(), "application/vnd.oci.image.layer.v1.tar+zstd".into(), None),
        ImageLayer::new(plain.clone(), IMAGE_LAYER_MEDIA_TYPE.into(), None),
    ];
    let oci_ref: oci_client::Reference = format!("{}/layers:1", registry.addr).parse().expect("reference");
    client.push(&oci_ref, &oci_layers, Config::new(config, CONFIG.into(), None), &RegistryAuth::Anonymous, None).await.expect("push the OCI image");

    let cache = tempfile::tempdir().expect("cache");
    let p = puller(cache.path(), &registry.options(None));
    let docker = p.pull(&format!("{}/docker-v2:1", registry.addr), Arc::new(Quiet)).await.expect("pull the Docker v2 image");
    assert_eq!(docker.layers, [Digest::of(&base), Digest::of(&setuid)]);
    assert_eq!(docker.defaults.env.get("FROM").map(String::as_str), Some("docker"));
    let oci = p.pull(&format!("{}/layers:1", registry.addr), Arc::new(Quiet)).await.expect("pull the OCI image");
    assert_eq!((oci.layers_downloaded, oci.layers_cached), (2, 2), "the Docker image's layers are the same blobs");

    let tree = tempfile::tempdir().expect("tree");
    let root = std::fs::canonicalize(tree.path()).expect("root");
    for d in &oci.layers {
        hutch_oci::unpack::apply_layer(&root, std::fs::File::open(p.store().path(d)).expect("blob"), d.short(), &mut unlimited()).expect("apply");
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let su = std::fs::metadata(root.join("bin/su")).expect("su");
    assert_eq!(su.permissions().mode() & 0o7777, 0o4755, "setuid kept");
    let link = std::fs::metadata(root.join("bin/su-link")).expect("the hard link");
    assert_eq!((link.ino(), su.nlink()), (su.ino(), 2), "a hard link across layers is one file");
    assert!(!root.join("data/keep").exists(), "the whiteout removed the lower file");
    assert!(!root.join("opt/old").exists() && std::fs::read(root.join("opt/new")).expect("new") == b"above the opaque dir", "the opaque directory hides what was below");
    assert_eq!(std::fs::read(root.join("bin/tool")).expect("tool"), b"setuid tool");
}

/// A multi-platform index: linux/amd64 is the one pulled; an index without it is
/// refused with a sentence naming what it has, and nothing is cached.
#[tokio::test]
async fn a_multi_platform_index_gives_linux_amd64_or_says_what_it_has() {
    let registry = Registry::start(None);
    let (amd, arm) = (layer(&[("arch", b"amd64")]), layer(&[("arch", b"arm64")]));
    let amd_image = registry.push_for("plat:amd64", "amd64", std::slice::from_ref(&amd), None).await;
    let arm_image = registry.push_for("plat:arm64", "arm64", std::slice::from_ref(&arm), None).await;
    registry.push_index("plat:both", &[(arm_image.0.clone(), arm_image.1, "arm64"), (amd_image.0.clone(), amd_image.1, "amd64")]).await;
    registry.push_index("plat:armonly", &[(arm_image.0.clone(), arm_image.1, "arm64")]).await;
    let cache = tempfile::tempdir().expect("cache");
    let p = puller(cache.path(), &registry.options(None));

    let both = p.pull(&format!("{}/plat:both", registry.addr), Arc::new(Quiet)).await.expect("the amd64 image of the index");
    assert_eq!(both.layers, [Digest::of(&amd)]);
    let err = p.pull(&format!("{}/plat:armonly", registry.addr), Arc::new(Quiet)).await.expect_err("no amd64 image");
    assert!(matches!(err, PullError::WrongPlatform { .. }), "{err}");
    assert!(err.to_string().contains("linux/arm64"), "{err}");
    assert!(!p.store().has(&Digest::of(&arm)), "nothing of the refused image is cached");
}

#[tokio::test]
async fn a_registry_with_a_login_wants_the_right_password() {
    let registry = Registry::start(Some(("hutch", "s3cret")));
    registry.push("private:1", &[layer(&[("p", b"private")])], Some(("hutch", "s3cret"))).await;
    refuses_all_but(&registry, "private:1", ("hutch", "s3cret")).await;
}

/// Pulling `image` (one layer) from `registry`: without a login, or with a wrong
/// password, `Unauthorized`; with `right`, it comes.
async fn refuses_all_but(registry: &Registry, image: &str, right: (&str, &str)) {
    let cache = tempfile::tempdir().expect("cache");
    let image = format!("{}/{image}", registry.addr);
    for login in [None, Some((right.0, "wrong"))] {
        let err = puller(cache.path(), &registry.options(login)).pull(&image, Arc::new(Quiet)).await.expect_err("refused");
        assert!(matches!(err, PullError::Unauthorized { .. }), "{login:?}: {err}");
    }
    let ok = puller(cache.path(), &registry.options(Some(right))).pull(&image, Arc::new(Quiet)).await.expect("the right password");
    assert_eq!(ok.layers_downloaded, 1);
}

/// E2B's `fromAWSRegistry`: the pull asks ECR's API for a token with the access key,
/// then logs in to the registry as `AWS` with it. ECR's API cannot be reached here, so a
/// stand-in on loopback answers `GetAuthorizationToken` as ECR does, for one key id only;
/// the signature itself is proven in `ecr.rs` (AWS's test suite, and curl's signer).
#[tokio::test]
async fn an_aws_login_trades_the_access_key_for_ecr_s_token() {
    let registry = Registry::start(Some(("AWS", "ecr-token-123")));
    registry.push("ecr:1", &[layer(&[("e", b"from ECR")])], Some(("AWS", "ecr-token-123"))).await;
    let ecr = EcrStandIn::start("AKIAHUTCHTEST0000001", "AWS:ecr-token-123");
    let cache = tempfile::tempdir().expect("cache");
    let image = format!("{}/ecr:1", registry.addr);
    let login = |key: &str| {
        let aws = hutch_oci::ecr::AwsLogin { access_key_id: key.into(), secret_access_key: "s3cret".into(), region: "eu-west-1".into(), endpoint: Some(format!("http://{}/", ecr.addr)) };
        RegistryOptions { aws: Some(aws), ..registry.options(None) }
    };
    let pulled = puller(cache.path(), &login("AKIAHUTCHTEST0000001")).pull(&image, Arc::new(Quiet)).await.expect("the ECR token logs in");
    assert_eq!(pulled.layers_downloaded, 1);
    let seen = ecr.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 1, "one token call: {seen:?}");
    let head = &seen[0];
    assert!(head.starts_with("POST / "), "{head}");
    assert!(head.contains("x-amz-target: AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"), "{head}");
    assert!(head.contains("/eu-west-1/ecr/aws4_request, SignedHeaders=content-type;host;x-amz-date;x-amz-target, Signature="), "{head}");
    assert!(!head.contains("s3cret"), "the secret never travels: {head}");
    // A key AWS does not know: its own words, and nothing is pulled.
    let err = puller(cache.path(), &login("AKIAUNKNOWN000000001")).pull(&image, Arc::new(Quiet)).await.expect_err("refused");
    let text = hutch_proto::error_chain(&err);
    assert!(matches!(err, PullError::AwsLogin { .. }) && text.contains("UnrecognizedClientException: The security token included in the request is invalid"), "{text}");
}

/// ECR's `GetAuthorizationToken` on loopback: for `key` (seen in the SigV4 credential),
/// the base64 of `token`; else AWS's 400 for an unknown key. Keeps each request's head.
struct EcrStandIn {
    addr: String,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
}

impl EcrStandIn {
    fn start(key: &'static str, token: &'static str) -> EcrStandIn {
        use base64::Engine;
        use std::io::BufRead;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let Ok(clone) = conn.try_clone() else { continue };
                let mut reader = std::io::BufReader::new(clone);
                let mut head = String::new();
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                    head.push_str(&line);
                }
                let mut body = vec![0u8; length];
                let _ = std::io::Read::read_exact(&mut reader, &mut body);
                let known = head.contains(&format!("Credential={key}/"));
                kept.lock().expect("lock").push(head);
                let (status, answer) = if known {
                    let encoded = base64::engine::general_purpose::STANDARD.encode(token);
                    ("200 OK", serde_json::json!({"authorizationData": [{"authorizationToken": encoded, "expiresAt": 1.9e9, "proxyEndpoint": "https://123456789012.dkr.ecr.eu-west-1.amazonaws.com"}]}))
                } else {
                    ("400 Bad Request", serde_json::json!({"__type": "UnrecognizedClientException", "message": "The security token included in the request is invalid."}))
                };
                let answer = answer.to_string();
                let mut out = conn;
                let _ = out.write_all(format!("HTTP/1.1 {status}\r\nContent-Type: application/x-amz-json-1.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}", answer.len()).as_bytes());
            }
        });
        EcrStandIn { addr, seen }
    }
}

/// A token service as Docker Hub and GHCR have (the registry says `Bearer realm=…`;
/// the client trades its login there for a signed token): `docker-registry` in token
/// mode, trusting a certificate this test makes, and a token server on loopback that
/// signs with its key (RS256 via `openssl`, so no JWT crate is needed) for
/// `hutch`/`t0ken` only.
#[tokio::test]
async fn a_registry_with_a_token_service_wants_the_right_password() {
    let tokens = TokenServer::start(("hutch", "t0ken"));
    let registry = Registry::start_with(|_| {
        Some(format!(
            "auth:\n  token:\n    realm: http://{}/token\n    service: hutch-test\n    issuer: hutch-test-issuer\n    rootcertbundle: {}\n",
            tokens.addr,
            tokens.dir.path().join("cert.pem").display()
        ))
    });
    registry.push("tokened:1", &[layer(&[("t", b"behind a token")])], Some(("hutch", "t0ken"))).await;
    refuses_all_but(&registry, "tokened:1", ("hutch", "t0ken")).await;
    assert!(tokens.issued.load(std::sync::atomic::Ordering::SeqCst) >= 2, "the pulls did not go through the token service");
}

struct TokenServer {
    addr: String,
    dir: tempfile::TempDir,
    issued: Arc<std::sync::atomic::AtomicUsize>,
}

impl TokenServer {
    fn start(login: (&'static str, &'static str)) -> TokenServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let made = Command::new("openssl")
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=hutch-test-issuer", "-keyout"])
            .arg(dir.path().join("key.pem"))
            .arg("-out")
            .arg(dir.path().join("cert.pem"))
            .stderr(Stdio::null())
            .status()
            .expect("openssl");
        assert!(made.success(), "openssl could not make the token service's certificate");
        let der = Command::new("openssl").args(["x509", "-outform", "DER", "-in"]).arg(dir.path().join("cert.pem")).output().expect("openssl x509");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let issued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (key, counter) = (dir.path().join("key.pem"), issued.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = answer_token_request(conn, login, &key, &der.stdout, &counter);
            }
        });
        TokenServer { addr, dir, issued }
    }
}

fn b64url(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data)
}

/// One `GET /token?service=…&scope=…` with basic auth: a token granting the scopes
/// asked for, or 401.
fn answer_token_request(conn: std::net::TcpStream, login: (&str, &str), key: &Path, cert_der: &[u8], issued: &std::sync::atomic::AtomicUsize) -> std::io::Result<()> {
    use base64::Engine;
    use std::io::BufRead;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = std::io::BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut authorized = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.trim().split_once(':') {
            if name.eq_ignore_ascii_case("authorization") {
                let basic = value.trim().strip_prefix("Basic ").unwrap_or("");
                let decoded = base64::engine::general_purpose::STANDARD.decode(basic).unwrap_or_default();
                authorized = decoded == format!("{}:{}", login.0, login.1).into_bytes();
            }
        }
    }
    let mut out = conn;
    if !authorized {
        return out.write_all(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}");
    }
    let query = request_line.split_whitespace().nth(1).and_then(|t| t.split_once('?')).map(|(_, q)| q.to_string()).unwrap_or_default();
    let access: Vec<serde_json::Value> = query
        .split('&')
        .filter_map(|kv| kv.strip_prefix("scope="))
        .map(|scope| scope.replace("%3A", ":").replace("%3a", ":").replace("%2C", ",").replace("%2c", ","))
        .filter_map(|scope| {
            let mut parts = scope.splitn(3, ':');
            let (kind, name, actions) = (parts.next()?.to_string(), parts.next()?.to_string(), parts.next()?.to_string());
            Some(serde_json::json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
        })
        .collect();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs();
    let header = serde_json::json!({"alg": "RS256", "typ": "JWT", "x5c": [base64::engine::general_purpose::STANDARD.encode(cert_der)]});
    let claims = serde_json::json!({"iss": "hutch-test-issuer", "sub": login.0, "aud": "hutch-test", "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("t{now}"), "access": access});
    let signing_input = format!("{}.{}", b64url(header.to_string().as_bytes()), b64url(claims.to_string().as_bytes()));
    let mut sign = Command::new("openssl").args(["dgst", "-sha256", "-sign"]).arg(key).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
    sign.stdin.take().expect("stdin").write_all(signing_input.as_bytes())?;
    let signature = sign.wait_with_output()?.stdout;
    let token = format!("{signing_input}.{}", b64url(&signature));
    issued.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let body = serde_json::json!({"token": token, "access_token": token, "expires_in": 300}).to_string();
    out.write_all(format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).as_bytes())
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
