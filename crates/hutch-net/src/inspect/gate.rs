//! One TCP flow to an inspected host's address: read the guest's ClientHello, then
//! relay it untouched or inspect it. Everything that goes wrong ends the flow and
//! leaves a line in the sandbox's network log; nothing falls back to sending the
//! guest's bytes on unchecked.

use super::rewind::Rewind;
use super::upstream::{Http, H2, HTTP1};
use super::flow::Flow;
use rustls::server::Acceptor;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;

/// A ClientHello larger than this is not one hutch inspects (real ones are < 2 KiB;
/// post-quantum key shares bring them near 2.5).
const HELLO_MAX: usize = 16 * 1024;
/// How long the guest has to send its ClientHello, and each side its handshake.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);

struct Hello {
    sni: Option<String>,
    /// The protocols the guest offered (None: it sent no ALPN).
    alpn: Option<Vec<Vec<u8>>>,
}

/// Runs the flow between `guest` (the stack's end of the guest's connection) and
/// `upstream` (already connected to the destination) until either side ends.
pub async fn run<G>(mut guest: G, mut upstream: TcpStream, flow: Flow)
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (bytes, hello) = match tokio::time::timeout(HANDSHAKE_WAIT, read_hello(&mut guest)).await {
        Ok(Ok(read)) => read,
        Ok(Err(_)) => return,
        Err(_) => {
            let host = flow.names.iter().find(|n| flow.inspector.transforms.covers(n)).cloned().unwrap_or_default();
            return flow.refuse(&host, format!("the guest sent no TLS ClientHello within {} s", HANDSHAKE_WAIT.as_secs()));
        }
    };
    let host = hello.as_ref().and_then(|h| h.sni.clone());
    let inspected = host.as_deref().filter(|h| flow.inspector.transforms.covers(h) && flow.names.iter().any(|n| n == h));
    let (Some(host), Some(hello)) = (inspected.map(str::to_string), hello) else {
        // Not TLS, no server name, a host without a rule, or a name the guest did not
        // resolve to this address: no rule applies, so the bytes go on as they came.
        let mut guest = Rewind::new(bytes, guest);
        let _ = tokio::io::copy_bidirectional(&mut guest, &mut upstream).await;
        return;
    };
    let flow = Arc::new(flow);
    if let Err(error) = inspect(Rewind::new(bytes, guest), upstream, &host, hello, &flow).await {
        flow.refuse(&host, error);
    }
}

/// Reads until the ClientHello is whole. `None` when what came is not TLS.
async fn read_hello<G: AsyncRead + Unpin>(guest: &mut G) -> std::io::Result<(Vec<u8>, Option<Hello>)> {
    let mut acceptor = Acceptor::default();
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = guest.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        bytes.extend_from_slice(&chunk[..n]);
        let mut fed = &chunk[..n];
        while !fed.is_empty() {
            if acceptor.read_tls(&mut fed).is_err() {
                return Ok((bytes, None));
            }
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let hello = accepted.client_hello();
                let sni = hello.server_name().map(|s| s.to_ascii_lowercase());
                let alpn = hello.alpn().map(|protocols| protocols.map(<[u8]>::to_vec).collect());
                return Ok((bytes, Some(Hello { sni, alpn })));
            }
            Ok(None) if bytes.len() < HELLO_MAX => continue,
            Ok(None) | Err(_) => return Ok((bytes, None)),
        }
    }
}

async fn inspect<G>(guest: G, upstream: TcpStream, host: &str, hello: Hello, flow: &Arc<Flow>) -> Result<(), String>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // The versions hutch speaks, in the guest's order; no ALPN is HTTP/1.1.
    let protocols: Vec<Vec<u8>> = match &hello.alpn {
        Some(offered) => offered.iter().filter(|p| *p == HTTP1 || *p == H2).cloned().collect(),
        None => vec![HTTP1.to_vec()],
    };
    if protocols.is_empty() {
        let offered = hello.alpn.as_deref().unwrap_or_default();
        let names: Vec<_> = offered.iter().take(4).map(|p| super::flow::shown(&String::from_utf8_lossy(p))).collect();
        return Err(format!("the guest offered only {} over TLS; hutch inspects HTTP/1.1 and HTTP/2", names.join(", ")));
    }
    // The real server first, offered what the guest offered (and HTTP/1.1 after it,
    // which hutch can relay an HTTP/2 guest over): a guest must not be told it reached
    // a host hutch could not.
    let mut offer = protocols.clone();
    if !offer.iter().any(|p| p == HTTP1) {
        offer.push(HTTP1.to_vec());
    }
    let client = flow.inspector.upstream.client_config(&offer, &flow.client_certificate)?;
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| format!("`{host}` is not a server name: {e}"))?;
    let connect = tokio_rustls::TlsConnector::from(client).connect(name, upstream);
    let upstream = match tokio::time::timeout(HANDSHAKE_WAIT, connect).await {
        Ok(Ok(tls)) => tls,
        // A server certificate that does not verify is that, whatever else it asked.
        Ok(Err(e)) if matches!(tls_error(&e), Some(rustls::Error::InvalidCertificate(_))) => return Err(upstream_failure(host, &e)),
        Ok(Err(e)) => return Err(flow.client_certificate.failure(host, format_args!("failed the handshake ({e})")).unwrap_or_else(|| upstream_failure(host, &e))),
        Err(_) => return Err(format!("{host} did not finish its TLS handshake within {} s", HANDSHAKE_WAIT.as_secs())),
    };
    let server_speaks = Http::negotiated(upstream.get_ref().1.alpn_protocol());
    // The guest gets what the server chose when it offered that too, else its own first.
    let guest_speaks = if protocols.iter().any(|p| p == server_speaks.alpn()) { server_speaks } else { Http::negotiated(protocols.first().map(Vec::as_slice)) };
    let leaf = flow.inspector.ca.leaf(host).map_err(|e| e.to_string())?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(Fixed(leaf)));
    if hello.alpn.is_some() {
        config.alpn_protocols = vec![guest_speaks.alpn().to_vec()];
    }
    let accept = async {
        let start = tokio_rustls::LazyConfigAcceptor::new(Acceptor::default(), guest).await?;
        start.into_stream(Arc::new(config)).await
    };
    let guest = match tokio::time::timeout(HANDSHAKE_WAIT, accept).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return Err(guest_failure(host, &e)),
        Err(_) => return Err(format!("the guest did not finish its TLS handshake for {host} within {} s", HANDSHAKE_WAIT.as_secs())),
    };
    super::http::relay((guest, guest_speaks), (upstream, server_speaks), host, flow.clone()).await
}

fn tls_error(e: &std::io::Error) -> Option<&rustls::Error> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

fn upstream_failure(host: &str, e: &std::io::Error) -> String {
    match tls_error(e) {
        Some(rustls::Error::InvalidCertificate(why)) => format!("{host}'s certificate did not verify ({why:?}); hutch trusts the host's CAs and those given with --upstream-ca"),
        Some(rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired)) => format!("{host} wants a client certificate (mutual TLS), which an inspected flow cannot present"),
        Some(other) => format!("TLS with {host} failed: {other}"),
        None => format!("TLS with {host} failed: {e}"),
    }
}

fn guest_failure(host: &str, e: &std::io::Error) -> String {
    match tls_error(e) {
        Some(rustls::Error::AlertReceived(alert)) => format!(
            "the guest refused hutch's certificate for {host} ({alert:?}): the client does not trust the sandbox's CA (it pins certificates or brings its own CA list)"
        ),
        Some(other) => format!("the guest's TLS handshake for {host} failed: {other}"),
        None => format!("the guest's TLS handshake for {host} failed: {e}"),
    }
}

/// Shows the guest one certificate, whatever it asks for (the gate chose it by name).
#[derive(Debug)]
struct Fixed(Arc<rustls::sign::CertifiedKey>);

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}
