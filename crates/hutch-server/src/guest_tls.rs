//! The data proxy's TLS hop to a sandbox port whose own server speaks HTTPS (E2B's
//! `httpsPorts`). As on E2B, the guest's certificate is not checked, so a self-signed
//! one works: the hop runs over the agent's tunnel into that one sandbox, which
//! already says who is at the other end; TLS here is what the guest's server asks
//! for, not what authenticates it.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// How long a guest's server has to finish its handshake.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);

static CONNECTOR: LazyLock<tokio_rustls::TlsConnector> = LazyLock::new(|| {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = Arc::new(AnyCertificate(provider.clone()));
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports rustls's default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    // No resumption: every hop goes to the same name (no SNI), so a session ticket one
    // sandbox's server issued would be offered to every other sandbox's, a channel
    // between tenants.
    config.resumption = rustls::client::Resumption::disabled();
    tokio_rustls::TlsConnector::from(Arc::new(config))
});

/// TLS over `io` (a tunnel to the guest port), HTTP/1.1 inside. No server name is
/// sent: the proxy addresses the port, not a host.
pub async fn connect<IO>(io: IO) -> Result<tokio_rustls::client::TlsStream<IO>, String>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    match tokio::time::timeout(HANDSHAKE_WAIT, CONNECTOR.connect(name, io)).await {
        Ok(Ok(tls)) => Ok(tls),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no TLS handshake within {} s", HANDSHAKE_WAIT.as_secs())),
    }
}

/// Accepts whatever certificate the guest shows, and checks only that the handshake is
/// signed by its key (so the session is with the holder of that certificate).
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(&self, _: &CertificateDer<'_>, _: &[CertificateDer<'_>], _: &ServerName<'_>, _: &[u8], _: UnixTime) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
