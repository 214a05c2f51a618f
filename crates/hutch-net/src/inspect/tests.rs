//! The gate between an in-process guest (a rustls client on a pipe, trusting the
//! sandbox's CA as the agent makes guests do) and loopback HTTPS servers with
//! certificates of a test CA, standing in for the hosts a sandbox reaches.

use super::flow::Flow;
use super::*;
use crate::log::NetLog;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(10);
const SECRET: &str = "sk-test-0123456789";

/// A test CA and a certificate it signed for `hosts`.
fn issued(hosts: &[&str]) -> (CertificateDer<'static>, CertificateDer<'static>, PrivateKeyDer<'static>) {
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>()).expect("params").signed_by(&key, &issuer).expect("leaf");
    (ca.der().clone(), leaf.der().clone(), PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// An HTTPS server on loopback that answers each request with the headers it got
/// (`name: value` lines, lower-cased names, in order), its own name, and the body it
/// read whole (no answer when the body ends in an error).
/// It speaks HTTP/2 too when `h2`, as ALPN chooses.
/// With `clients`, it asks for a client certificate those CAs signed (mutual TLS).
async fn https_server(leaf: CertificateDer<'static>, key: PrivateKeyDer<'static>, name: &'static str, h2: bool) -> SocketAddr {
    https_server_with(leaf, key, name, h2, None).await
}

async fn https_server_with(leaf: CertificateDer<'static>, key: PrivateKeyDer<'static>, name: &'static str, h2: bool, clients: Option<CertificateDer<'static>>) -> SocketAddr {
    let builder = rustls::ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions().expect("versions");
    let builder = match clients {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca).expect("root");
            builder.with_client_cert_verifier(rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider()).build().expect("verifier"))
        }
    };
    let mut config = builder.with_single_cert(vec![leaf], key).expect("cert");
    config.alpn_protocols = if h2 { vec![b"h2".to_vec(), b"http/1.1".to_vec()] } else { vec![b"http/1.1".to_vec()] };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(conn).await else { return };
                let service = hyper::service::service_fn(move |mut req: ::http::Request<hyper::body::Incoming>| async move {
                    if req.headers().contains_key(::http::header::UPGRADE) {
                        return Ok(upgraded_echo(&mut req));
                    }
                    // A redirect that adds a trailing slash, keeping the query.
                    if req.uri().path() == "/redirect" {
                        let mut answer = ::http::Response::new(Full::new(Bytes::new()));
                        *answer.status_mut() = ::http::StatusCode::MOVED_PERMANENTLY;
                        let location = format!("/redirect/?{}", req.uri().query().unwrap_or(""));
                        answer.headers_mut().insert(::http::header::LOCATION, location.parse().expect("location"));
                        return Ok(answer);
                    }
                    let mut seen = format!("server: {name}\nversion: {:?}\npath: {}\n", req.version(), req.uri().path_and_query().map(|p| p.as_str()).unwrap_or(""));
                    for (k, v) in req.headers() {
                        seen.push_str(&format!("{k}: {}\n", v.to_str().unwrap_or("?")));
                    }
                    let body = http_body_util::BodyExt::collect(req.into_body()).await?.to_bytes();
                    seen.push_str(&format!("body: {}\n", String::from_utf8_lossy(&body)));
                    Ok::<_, hyper::Error>(::http::Response::new(Full::new(Bytes::from(seen))))
                });
                let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new()).serve_connection_with_upgrades(TokioIo::new(tls), service).await;
            });
        }
    });
    addr
}

/// A WebSocket's server in miniature: switches protocols (saying what Authorization it
/// got), then echoes what comes.
fn upgraded_echo(req: &mut ::http::Request<hyper::body::Incoming>) -> ::http::Response<Full<Bytes>> {
    let authorization = req.headers().get(::http::header::AUTHORIZATION).cloned();
    let upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let Ok(upgraded) = upgrade.await else { return };
        let mut io = TokioIo::new(upgraded);
        let mut buf = [0u8; 1024];
        while let Ok(n) = io.read(&mut buf).await {
            if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    let mut answer = ::http::Response::new(Full::new(Bytes::new()));
    *answer.status_mut() = ::http::StatusCode::SWITCHING_PROTOCOLS;
    answer.headers_mut().insert(::http::header::CONNECTION, "upgrade".parse().expect("value"));
    answer.headers_mut().insert(::http::header::UPGRADE, "websocket".parse().expect("value"));
    if let Some(value) = authorization {
        answer.headers_mut().insert("x-seen-authorization", value);
    }
    answer
}

struct Vault;

#[async_trait::async_trait]
impl SecretVault for Vault {
    async fn reveal(&self, owner: &str, name: &str) -> Result<zeroize::Zeroizing<String>, String> {
        match (owner, name) {
            ("key-1", "token") => Ok(zeroize::Zeroizing::new(SECRET.to_string())),
            _ => Err(format!("secret `{name}` no longer exists")),
        }
    }
}

struct World {
    ca: Arc<SandboxCa>,
    inspector: Arc<Inspector>,
    /// Host name → its loopback server.
    servers: std::collections::HashMap<&'static str, SocketAddr>,
    /// The test CA that signed every server but `untrusted.test`.
    test_ca: CertificateDer<'static>,
    _dir: tempfile::TempDir,
}

async fn world() -> World {
    let (test_ca, inspect_leaf, inspect_key) = issued(&["inspect.test", "gone.test", "bound.test", "mtls.test"]);
    // plain.test's CA is trusted too; untrusted.test's is not.
    let (plain_ca, plain_leaf, plain_key) = issued(&["plain.test"]);
    let (_, untrusted_leaf, untrusted_key) = issued(&["untrusted.test"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let pem = |der: &CertificateDer| format!("-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n", base64_lines(der));
    std::fs::write(dir.path().join("ca.pem"), pem(&test_ca) + &pem(&plain_ca)).expect("write");
    let upstream = Upstream::with_ca_files(&[dir.path().join("ca.pem")]).expect("CA file");
    let rules = serde_json::json!({
        "inspect.test": [{"transform": {"headers": {"X-Hutch-Test": "literal", "Authorization": "Bearer ${e2b.secrets.token}"}}}],
        "gone.test": [{"transform": {"headers": {"Authorization": "${e2b.secrets.missing}"}}}],
        "untrusted.test": [{}],
        "mtls.test": [{}],
    });
    let mut transforms = Transforms::from_e2b(&rules).expect("rules");
    transforms.secrets_of = Some("key-1".into());
    // The guest's own placeholders for `token` are filled in on bound.test, which has no rule.
    let fill = transforms::Fill { headers: transforms::CREDENTIAL_HEADERS.iter().map(|h| h.to_string()).collect(), query: ["k".to_string()].into() };
    transforms.bind("secrets", "token", "bound.test", &fill).expect("binding");
    let ca = Arc::new(SandboxCa::generate().expect("ca"));
    let inspector = Arc::new(Inspector::new(ca.clone(), transforms, Arc::new(upstream), Some(Arc::new(Vault))));
    let mut servers = std::collections::HashMap::new();
    servers.insert("inspect.test", https_server(inspect_leaf.clone(), inspect_key.clone_key(), "inspect", true).await);
    servers.insert("gone.test", https_server(inspect_leaf.clone(), inspect_key.clone_key(), "gone", true).await);
    // HTTP/1.1 only: a guest speaking HTTP/2 to it is relayed across versions.
    servers.insert("bound.test", https_server(inspect_leaf.clone(), inspect_key.clone_key(), "bound", false).await);
    servers.insert("plain.test", https_server(plain_leaf, plain_key, "plain", true).await);
    servers.insert("untrusted.test", https_server(untrusted_leaf, untrusted_key, "untrusted", true).await);
    // Wants a client certificate of a CA of its own, which hutch cannot present.
    let (clients_ca, _, _) = issued(&[]);
    servers.insert("mtls.test", https_server_with(inspect_leaf, inspect_key, "mtls", true, Some(clients_ca)).await);
    World { ca, inspector, servers, test_ca, _dir: dir }
}

fn base64_lines(der: &CertificateDer) -> String {
    use base64::Engine;
    let text = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    text.as_bytes().chunks(64).map(|c| std::str::from_utf8(c).expect("ascii")).collect::<Vec<_>>().join("\n")
}

/// What the guest got for one TLS connection to `sni` (dialed at `server`): the
/// certificate it was shown and the answers to `requests` (raw HTTP/1.1 heads).
struct Seen {
    cert: Option<CertificateDer<'static>>,
    answer: Result<String, String>,
}

/// The guest's end of a flow to `server` through the gate, the guest having resolved
/// `pinned` to its address.
async fn through_gate(w: &World, server: &str, pinned: &[&str], log: &NetLog) -> tokio::io::DuplexStream {
    let upstream = tokio::net::TcpStream::connect(w.servers[server]).await.expect("dial");
    let (guest, ours) = tokio::io::duplex(64 * 1024);
    let current = Arc::new(parking_lot::RwLock::new(Some(w.inspector.clone())));
    let flow = Flow { dst: SocketAddrV4::new([93, 184, 216, 60].into(), 443), names: pinned.iter().map(|s| s.to_string()).collect(), inspector: w.inspector.clone(), current, log: log.clone(), client_certificate: Default::default() };
    tokio::spawn(gate(ours, upstream, flow));
    guest
}

fn guest_tls(trust: &[CertificateDer<'static>], alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for cert in trust {
        roots.add(cert.clone()).expect("root");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider()).with_safe_default_protocol_versions().expect("versions").with_root_certificates(roots).with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One HTTP/1.1 connection (`request` written as it is).
async fn guest_request(w: &World, sni: &str, server: &str, pinned: &[&str], trust: &[CertificateDer<'static>], request: &str, log: &NetLog) -> Seen {
    let guest = through_gate(w, server, pinned, log).await;
    let connector = guest_tls(trust, &[b"http/1.1"]);
    let run = async {
        let mut tls = connector.connect(ServerName::try_from(sni.to_string()).expect("name"), guest).await.map_err(|e| format!("handshake: {e}"))?;
        let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| c.clone().into_owned());
        tls.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut answer = Vec::new();
        let _ = tls.read_to_end(&mut answer).await;
        Ok::<_, String>((cert, String::from_utf8_lossy(&answer).into_owned()))
    };
    match tokio::time::timeout(DEADLINE, run).await.expect("the flow ends within the deadline") {
        Ok((cert, answer)) => Seen { cert, answer: Ok(answer) },
        Err(e) => Seen { cert: None, answer: Err(e) },
    }
}

fn get(host: &str, extra: &str) -> String {
    format!("GET / HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n")
}

fn ca_cert(w: &World) -> CertificateDer<'static> {
    rustls::pki_types::pem::PemObject::from_pem_slice(w.ca.cert_pem().as_bytes()).expect("pem")
}

#[tokio::test]
async fn a_host_with_a_rule_gets_its_headers_set_with_the_secret_filled_in() {
    let w = world().await;
    let log = NetLog::default();
    let seen = guest_request(&w, "inspect.test", "inspect.test", &["inspect.test"], &[ca_cert(&w)], &get("inspect.test", "X-Hutch-Test: guest\r\nAuthorization: Bearer guest\r\n"), &log).await;
    let answer = seen.answer.expect("answered");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("server: inspect\n"), "{answer}");
    assert!(answer.contains("x-hutch-test: literal\n") && !answer.contains("x-hutch-test: guest"), "the rule overrides the guest's header: {answer}");
    assert!(answer.contains(&format!("authorization: Bearer {SECRET}\n")) && !answer.contains("Bearer guest"), "{answer}");
    let leaf = seen.cert.expect("a certificate");
    assert_ne!(leaf, w.test_ca);
    // The guest was shown hutch's leaf, which the sandbox CA signed (its handshake trusted only that CA).
    assert!(log.view().denials.is_empty(), "{:?}", log.view().denials);
}

#[tokio::test]
async fn a_request_for_another_host_is_misdirected_and_not_sent() {
    let w = world().await;
    let log = NetLog::default();
    let seen = guest_request(&w, "inspect.test", "inspect.test", &["inspect.test"], &[ca_cert(&w)], &get("plain.test", ""), &log).await;
    let answer = seen.answer.expect("answered");
    assert!(answer.starts_with("HTTP/1.1 421"), "{answer}");
    assert!(!answer.contains("server: inspect"), "nothing reached the server: {answer}");
    let denials = log.view().denials;
    assert!(denials.iter().any(|d| d.message.contains("`plain.test`")), "{denials:?}");
    // Domain fronting: a URI that names the host with a Host that does not, two Hosts,
    // and methods that would echo the rule's headers back to the guest.
    for request in [
        "GET https://inspect.test/ HTTP/1.1\r\nHost: plain.test\r\nConnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: inspect.test\r\nHost: plain.test\r\nConnection: close\r\n\r\n",
        "GET https://user@inspect.test/ HTTP/1.1\r\nHost: inspect.test\r\nConnection: close\r\n\r\n",
        "TRACE / HTTP/1.1\r\nHost: inspect.test\r\nConnection: close\r\n\r\n",
    ] {
        let seen = guest_request(&w, "inspect.test", "inspect.test", &["inspect.test"], &[ca_cert(&w)], request, &log).await;
        let answer = seen.answer.expect("answered");
        assert!(answer.starts_with("HTTP/1.1 421") || answer.starts_with("HTTP/1.1 405"), "{request:?}: {answer}");
        assert!(!answer.contains("server: inspect"), "{request:?} reached the server: {answer}");
    }
}

#[tokio::test]
async fn a_host_without_a_rule_and_an_unpinned_name_are_relayed_untouched() {
    let w = world().await;
    let log = NetLog::default();
    // No rule for plain.test: the guest sees the server's own certificate (it trusts the test CAs only).
    let mut trust_servers: Vec<CertificateDer<'static>> = Vec::new();
    let pem = std::fs::read(w._dir.path().join("ca.pem")).expect("read");
    for cert in CertificateDer::pem_slice_iter(&pem) {
        trust_servers.push(cert.expect("cert"));
    }
    use rustls::pki_types::pem::PemObject;
    let plain = guest_request(&w, "plain.test", "plain.test", &["plain.test", "inspect.test"], &trust_servers, &get("plain.test", "X-Hutch-Test: guest\r\n"), &log).await;
    let answer = plain.answer.expect("answered");
    assert!(answer.contains("server: plain\n") && answer.contains("x-hutch-test: guest\n"), "{answer}");
    // inspect.test's rule applies only when the guest resolved inspect.test to this address.
    let unpinned = guest_request(&w, "inspect.test", "inspect.test", &["other.test"], &trust_servers, &get("inspect.test", ""), &log).await;
    let answer = unpinned.answer.expect("answered by the server itself");
    assert!(answer.contains("server: inspect\n") && !answer.contains("x-hutch-test"), "{answer}");
    assert!(log.view().denials.is_empty());
}

#[tokio::test]
async fn an_upstream_that_does_not_verify_or_a_missing_secret_fails_closed() {
    let w = world().await;
    let log = NetLog::default();
    let untrusted = guest_request(&w, "untrusted.test", "untrusted.test", &["untrusted.test"], &[ca_cert(&w)], &get("untrusted.test", ""), &log).await;
    assert!(untrusted.answer.is_err() || untrusted.answer.as_ref().is_ok_and(|a| a.is_empty()), "no answer: {:?}", untrusted.answer);
    let denials = log.view().denials;
    assert!(denials.iter().any(|d| d.name.as_deref() == Some("untrusted.test") && d.message.contains("certificate")), "{denials:?}");
    let gone = guest_request(&w, "gone.test", "gone.test", &["gone.test"], &[ca_cert(&w)], &get("gone.test", ""), &log).await;
    let answer = gone.answer.expect("answered by hutch");
    assert!(answer.starts_with("HTTP/1.1 502") && !answer.contains("server: gone"), "{answer}");
    assert!(!answer.contains("missing"), "the reason is the log's, not the guest's: {answer}");
    assert!(log.view().denials.iter().any(|d| d.name.as_deref() == Some("gone.test") && d.message.contains("`missing`")));
}

/// A server that wants a client certificate (mutual TLS): hutch, in the middle, has
/// none to present, so the flow fails closed and the log says why, whichever version
/// the guest speaks. Under TLS 1.3 the server refuses after hutch's handshake has
/// ended, on the first read of the relayed request.
#[tokio::test]
async fn a_server_that_wants_a_client_certificate_fails_closed_and_the_log_says_why() {
    let w = world().await;
    let wants_certificate = |log: &NetLog| log.view().denials.iter().any(|d| d.name.as_deref() == Some("mtls.test") && d.message.contains("client certificate (mutual TLS)"));
    let log = NetLog::default();
    let seen = guest_request(&w, "mtls.test", "mtls.test", &["mtls.test"], &[ca_cert(&w)], &get("mtls.test", ""), &log).await;
    assert!(!seen.answer.as_deref().unwrap_or_default().contains("server: mtls"), "{:?}", seen.answer);
    assert!(wants_certificate(&log), "HTTP/1.1: {:?}", log.view().denials);
    let log = NetLog::default();
    let guest = through_gate(&w, "mtls.test", &["mtls.test"], &log).await;
    let run = async {
        let tls = guest_tls(&[ca_cert(&w)], &[b"h2"]).connect(ServerName::try_from("mtls.test").expect("name"), guest).await.map_err(|e| e.to_string())?;
        let (mut sender, connection) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(tls)).await.map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let req = ::http::Request::get("https://mtls.test/").body(http_body_util::Empty::<Bytes>::new()).expect("request");
        let answer = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let body = http_body_util::BodyExt::collect(answer.into_body()).await.map_err(|e| e.to_string())?.to_bytes();
        Ok::<_, String>(String::from_utf8_lossy(&body).into_owned())
    };
    let answer = tokio::time::timeout(DEADLINE, run).await.expect("the flow ends within the deadline");
    assert!(!answer.as_deref().unwrap_or_default().contains("server: mtls"), "{answer:?}");
    assert!(wants_certificate(&log), "HTTP/2: {:?}", log.view().denials);
}

#[test]
fn a_saved_ca_loads_back_and_signs_leaves_its_certificate_verifies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = SandboxCa::generate().expect("ca");
    ca.save(dir.path()).expect("save");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join(ca::CA_KEY_FILE)).expect("key").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let loaded = SandboxCa::load(dir.path()).expect("load").expect("there");
    assert_eq!(loaded.cert_pem(), ca.cert_pem());
    let leaf = loaded.leaf("inspect.test").expect("leaf");
    let root: CertificateDer = rustls::pki_types::pem::PemObject::from_pem_slice(ca.cert_pem().as_bytes()).expect("pem");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root).expect("root");
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider()).build().expect("verifier");
    let now = rustls::pki_types::UnixTime::now();
    use rustls::client::danger::ServerCertVerifier;
    verifier.verify_server_cert(&leaf.cert[0], &leaf.cert[1..], &ServerName::try_from("inspect.test").expect("name"), &[], now).expect("the loaded CA's leaf verifies against the saved certificate");
    assert!(SandboxCa::load(tempfile::tempdir().expect("t").path()).expect("no error").is_none());
}

#[tokio::test]
async fn the_guests_placeholders_are_filled_in_where_bound_and_refused_elsewhere() {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let w = world().await;
    let log = NetLog::default();
    let to = |host: &'static str, request: String| {
        let (w, log) = (&w, &log);
        async move { guest_request(w, host, host, &[host], &[ca_cert(w)], &request, log).await.answer.expect("answered") }
    };
    // A header of the guest's own, and a Basic credential, to the host the secret is bound to.
    let basic = format!("Authorization: Basic {}\r\n", b64("me:${e2b.secrets.token}"));
    let answer = to("bound.test", get("bound.test", &format!("X-Api-Key: k=${{e2b.secrets.token}}\r\n{basic}"))).await;
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("server: bound\n"), "{answer}");
    assert!(answer.contains(&format!("x-api-key: k={SECRET}\n")), "{answer}");
    assert!(answer.contains(&format!("authorization: Basic {}\n", b64(&format!("me:{SECRET}")))), "{answer}");
    // In the query string, where the binding opts in: decoded, filled in, encoded again.
    // The guest's own text keeps the encoding it was sent in.
    let answer = to("bound.test", "GET /q?a=1+2&k=pre%2B%24%7Be2b.secrets.token%7D&b=%ZZ HTTP/1.1\r\nHost: bound.test\r\nConnection: close\r\n\r\n".to_string()).await;
    assert!(answer.contains(&format!("path: /q?a=1+2&k=pre%2B{SECRET}&b=%ZZ\n")), "{answer}");
    // In a header the rule sets, the guest's placeholder is replaced with the rule's value.
    let answer = to("inspect.test", get("inspect.test", "Authorization: Bearer ${e2b.secrets.token}\r\n")).await;
    assert!(answer.starts_with("HTTP/1.1 200") && answer.contains(&format!("authorization: Bearer {SECRET}\n")), "{answer}");
    assert!(log.view().denials.is_empty(), "{:?}", log.view().denials);
    // Anywhere else: refused before anything reaches the server, and logged.
    let post = |host: &str, body: &str| format!("POST / HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    for (host, request, why) in [
        ("gone.test", get("gone.test", "X-Api-Key: ${e2b.secrets.token}\r\n"), "not bound to gone.test"),
        // A rule naming the secret binds it nowhere: the rule sets its own headers.
        ("inspect.test", get("inspect.test", "X-Api-Key: ${e2b.secrets.token}\r\n"), "not bound to inspect.test"),
        // A header a server may echo back is not one the secret is filled in.
        ("bound.test", get("bound.test", "Origin: ${e2b.secrets.token}\r\n"), "only in header api-key, header authorization"),
        ("bound.test", get("bound.test", "X-Api-Key: ${e2b.secrets.other}\r\n"), "`other`"),
        ("bound.test", "GET /${e2b.secrets.token} HTTP/1.1\r\nHost: bound.test\r\nConnection: close\r\n\r\n".to_string(), "path"),
        ("inspect.test", "GET /?k=${e2b.secrets.token} HTTP/1.1\r\nHost: inspect.test\r\nConnection: close\r\n\r\n".to_string(), "not bound to inspect.test"),
        // A parameter the binding does not name.
        ("bound.test", "GET /?x=%24%7Be2b.secrets.token%7D HTTP/1.1\r\nHost: bound.test\r\nConnection: close\r\n\r\n".to_string(), "only in"),
        ("bound.test", get("bound.test", "X-Api-Key: %24%7Be2b.secrets.token%7D\r\n"), "cannot fill in"),
        ("bound.test", post("bound.test", &format!("{{\"key\": \"{}\"}}", b64("${e2b.secrets.token}"))), "body"),
    ] {
        let before = log.view().denials.len();
        let answer = to(host, request.clone()).await;
        assert!(answer.starts_with("HTTP/1.1 403") && !answer.contains("server: "), "{request:?}: {answer}");
        let denials = log.view().denials;
        assert!(denials.len() > before && denials.last().is_some_and(|d| d.message.contains(why)), "{request:?}: {denials:?}");
        assert!(!denials.iter().any(|d| d.message.contains(SECRET)));
    }
}

/// One HTTP/2 request from a guest that offers only `h2`: the version the answer came
/// in, and its body.
async fn guest_h2(w: &World, host: &'static str, headers: &[(&str, &str)], log: &NetLog) -> (::http::Version, String) {
    let guest = through_gate(w, host, &[host], log).await;
    let run = async {
        let tls = guest_tls(&[ca_cert(w)], &[b"h2"]).connect(ServerName::try_from(host).expect("name"), guest).await.unwrap_or_else(|e| panic!("handshake with {host}: {e}: {:?}", log.view().denials));
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "hutch keeps the guest's ALPN");
        let (mut sender, connection) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), TokioIo::new(tls)).await.expect("h2");
        tokio::spawn(connection);
        let mut req = ::http::Request::get(format!("https://{host}/h2")).body(http_body_util::Empty::<Bytes>::new()).expect("request");
        for (name, value) in headers {
            req.headers_mut().insert(::http::HeaderName::from_bytes(name.as_bytes()).expect("name"), value.parse().expect("value"));
        }
        let answer = sender.send_request(req).await.expect("answered");
        let version = answer.version();
        let body = http_body_util::BodyExt::collect(answer.into_body()).await.expect("body").to_bytes();
        (version, String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(DEADLINE, run).await.expect("within the deadline")
}

#[tokio::test]
async fn http2_is_relayed_in_each_sides_own_version_with_the_rule_applied() {
    let w = world().await;
    let log = NetLog::default();
    // HTTP/2 both ways: the rule's headers replace the guest's, `:authority` is the host.
    let (version, answer) = guest_h2(&w, "inspect.test", &[("x-hutch-test", "guest"), ("authorization", "Bearer ${e2b.secrets.token}")], &log).await;
    assert_eq!(version, ::http::Version::HTTP_2);
    assert!(answer.contains("server: inspect\nversion: HTTP/2.0\n"), "{answer}");
    assert!(answer.contains("x-hutch-test: literal\n") && answer.contains(&format!("authorization: Bearer {SECRET}\n")), "{answer}");
    // A guest speaking only HTTP/2 to a server speaking only HTTP/1.1: each keeps its own.
    let (version, answer) = guest_h2(&w, "bound.test", &[("x-api-key", "${e2b.secrets.token}")], &log).await;
    assert_eq!(version, ::http::Version::HTTP_2);
    assert!(answer.contains("server: bound\nversion: HTTP/1.1\n") && answer.contains("host: bound.test\n"), "{answer}");
    assert!(answer.contains(&format!("x-api-key: {SECRET}\n")), "{answer}");
    assert!(log.view().denials.is_empty(), "{:?}", log.view().denials);
    // The same refusals as over HTTP/1.1.
    let (_, answer) = guest_h2(&w, "gone.test", &[("x-api-key", "${e2b.secrets.token}")], &log).await;
    assert!(!answer.contains("server: gone"), "{answer}");
    assert!(log.view().denials.iter().any(|d| d.message.contains("not bound to gone.test")), "{:?}", log.view().denials);
}

#[tokio::test]
async fn a_websocket_upgrade_goes_through_with_the_rule_applied_then_carries_bytes() {
    let w = world().await;
    let log = NetLog::default();
    let guest = through_gate(&w, "inspect.test", &["inspect.test"], &log).await;
    let run = async {
        let mut tls = guest_tls(&[ca_cert(&w)], &[b"http/1.1"]).connect(ServerName::try_from("inspect.test").expect("name"), guest).await.expect("handshake");
        tls.write_all(b"GET /ws HTTP/1.1\r\nHost: inspect.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nAuthorization: Bearer guest\r\n\r\n").await.expect("write");
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            head.push(tls.read_u8().await.expect("the answer's head"));
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 101"), "{head}");
        assert!(head.contains(&format!("x-seen-authorization: bearer {}", SECRET.to_ascii_lowercase())), "the rule applied to the upgrade: {head}");
        for message in [&b"ping"[..], b"pong and more"] {
            tls.write_all(message).await.expect("write");
            let mut echo = vec![0u8; message.len()];
            tls.read_exact(&mut echo).await.expect("echo");
            assert_eq!(echo, message);
        }
    };
    tokio::time::timeout(DEADLINE, run).await.expect("within the deadline");
    assert!(log.view().denials.is_empty(), "{:?}", log.view().denials);
}

#[tokio::test]
async fn an_answer_that_reflects_a_query_filled_value_is_not_passed_on() {
    let w = world().await;
    let log = NetLog::default();
    let request = "GET /redirect?k=%24%7Be2b.secrets.token%7D HTTP/1.1\r\nHost: bound.test\r\nConnection: close\r\n\r\n";
    let answer = guest_request(&w, "bound.test", "bound.test", &["bound.test"], &[ca_cert(&w)], request, &log).await.answer.expect("answered");
    assert!(answer.starts_with("HTTP/1.1 502") && !answer.contains(SECRET), "{answer}");
    assert!(log.view().denials.iter().any(|d| d.message.contains("location")), "{:?}", log.view().denials);
}
