//! A registry that redirects a download to the server's own network (a cloud's
//! metadata service, say) gets nothing there: pulls for tenants go through
//! `hutch_net::public_proxy`, which refuses the redirect's destination before
//! connecting. Everything here is on loopback: the "registry" on 127.0.0.1 (listed by
//! the operator), the "private service" on 127.0.0.2 (not listed).

use hutch_oci::pull::{Puller, RegistryOptions};
use hutch_oci::store::BlobStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Answers every request with a redirect to `to`, counting requests.
async fn redirecting_registry(to: String) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the registry");
    let addr = listener.local_addr().expect("addr").to_string();
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            let to = to.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let _ = s.read(&mut buf).await;
                let reply = format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                let _ = s.write_all(reply.as_bytes()).await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn a_redirect_to_a_private_address_is_not_followed_there() {
    let private = TcpListener::bind("127.0.0.2:0").await.expect("bind the private service");
    let private_addr = private.local_addr().expect("addr");
    let (registry, registry_seen) = redirecting_registry(format!("http://{private_addr}/latest/meta-data/")).await;
    let proxy = hutch_net::public_proxy::PublicProxy::start(vec![registry.clone()]).expect("proxy");
    let tmp = tempfile::tempdir().expect("tmp");
    let options = RegistryOptions { credentials: None, insecure: vec![registry.clone()], local: false, proxy: Some(proxy.url()), aws: None };
    let puller = Puller::new(BlobStore::new(tmp.path()), &options);
    let pulled = puller.pull(&format!("{registry}/app:1"), Arc::new(hutch_oci::pull::Quiet)).await;
    assert!(pulled.is_err(), "the pull cannot succeed");
    assert!(registry_seen.load(Ordering::SeqCst) > 0, "the listed registry was reached through the proxy");
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(
        !matches!(private.poll_accept(&mut cx), std::task::Poll::Ready(Ok(_))),
        "nothing connected to the private address the registry redirected to"
    );
}

#[tokio::test]
async fn a_registry_name_resolving_to_this_machine_is_refused_before_any_request() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let proxy = hutch_net::public_proxy::PublicProxy::start(vec![]).expect("proxy");
    let tmp = tempfile::tempdir().expect("tmp");
    let options = RegistryOptions { credentials: None, insecure: vec![], local: false, proxy: Some(proxy.url()), aws: None };
    let puller = Puller::new(BlobStore::new(tmp.path()), &options);
    // `localhost` is caught by its name; this spelling of it only by resolving it.
    let name = format!("LocalHost:{port}");
    let err = puller.pull(&format!("{name}/app:1"), Arc::new(hutch_oci::pull::Quiet)).await.expect_err("refused");
    assert!(matches!(err, hutch_oci::pull::PullError::LocalRegistry { .. }), "{err}");
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(!matches!(listener.poll_accept(&mut cx), std::task::Poll::Ready(Ok(_))), "no connection was made");
}
