//! How hutch checks the real server of an inspected flow: the host's roots (read once,
//! on the first inspected flow) and the CAs the operator gives (`hutch serve
//! --upstream-ca FILE`, read at start so a bad file stops the server with its name).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

/// The protocols inspected flows speak, by their ALPN names.
pub const HTTP1: &[u8] = b"http/1.1";
pub const H2: &[u8] = b"h2";

/// An inspected side's HTTP version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Http {
    H1,
    H2,
}

impl Http {
    /// The version ALPN chose (`None`: no ALPN, so HTTP/1.1).
    pub fn negotiated(alpn: Option<&[u8]>) -> Http {
        if alpn == Some(H2) {
            Http::H2
        } else {
            Http::H1
        }
    }

    pub fn alpn(self) -> &'static [u8] {
        match self {
            Http::H1 => HTTP1,
            Http::H2 => H2,
        }
    }
}

/// Whether one flow's server asked for a client certificate (mutual TLS), which hutch,
/// in the middle, cannot present, and whether the flow's failure for it was logged.
/// Servers that only ask (and go on without one) work; one that insists fails the
/// flow, under TLS 1.3 only after hutch's handshake, on the first read.
#[derive(Clone, Debug, Default)]
pub struct ClientCertificate(Arc<AtomicU8>);

const ASKED: u8 = 1;
const LOGGED: u8 = 2;

impl ClientCertificate {
    pub fn asked(&self) -> bool {
        self.0.load(Ordering::Relaxed) != 0
    }

    /// The log's line for a failure of a flow whose server asked for a client
    /// certificate: `Some` the first time only, `None` when it did not ask.
    pub fn failure(&self, host: &str, what: std::fmt::Arguments) -> Option<String> {
        self.0.compare_exchange(ASKED, LOGGED, Ordering::Relaxed, Ordering::Relaxed).ok().map(|_| format!("{host} asked for a client certificate (mutual TLS), which an inspected flow cannot present, and {what}"))
    }
}

/// Presents no certificate, as rustls's default resolver does, and notes the request.
#[derive(Debug)]
struct Asked(ClientCertificate);

impl rustls::client::ResolvesClientCert for Asked {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let _ = self.0 .0.compare_exchange(0, ASKED, Ordering::Relaxed, Ordering::Relaxed);
        None
    }

    fn has_certs(&self) -> bool {
        false
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamCaError {
    #[error("cannot read the upstream CA file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} holds no PEM certificate; give --upstream-ca a PEM file of CA certificates")]
    Empty { path: PathBuf },
    #[error("{path} is not a PEM file of certificates: {message}")]
    Parse { path: PathBuf, message: String },
}

#[derive(Default)]
pub struct Upstream {
    extra: Vec<CertificateDer<'static>>,
    config: OnceLock<Result<Arc<rustls::ClientConfig>, String>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream").field("extra_cas", &self.extra.len()).finish_non_exhaustive()
    }
}

impl Upstream {
    /// The host's roots and the certificates in each of `files`.
    pub fn with_ca_files(files: &[PathBuf]) -> Result<Upstream, UpstreamCaError> {
        let mut extra = Vec::new();
        for path in files {
            extra.extend(read_pem(path)?);
        }
        Ok(Upstream { extra, config: OnceLock::new() })
    }

    /// The client configuration offering `protocols` (ALPN names, the guest's own
    /// list: ALPN is kept), made from one read of the roots. It presents no client
    /// certificate; `asked` learns whether the server wanted one.
    pub fn client_config(&self, protocols: &[Vec<u8>], asked: &ClientCertificate) -> Result<Arc<rustls::ClientConfig>, String> {
        let base = self.config.get_or_init(|| self.make()).clone()?;
        let mut config = (*base).clone();
        config.alpn_protocols = protocols.to_vec();
        config.client_auth_cert_resolver = Arc::new(Asked(asked.clone()));
        Ok(Arc::new(config))
    }

    fn make(&self) -> Result<Arc<rustls::ClientConfig>, String> {
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        for error in &native.errors {
            tracing::warn!("reading the host's CA certificates: {error}");
        }
        let (_, unusable) = roots.add_parsable_certificates(native.certs);
        if unusable > 0 {
            tracing::debug!("{unusable} of the host's CA certificates were not usable");
        }
        for cert in &self.extra {
            roots.add(cert.clone()).map_err(|e| format!("an --upstream-ca certificate is not a usable CA: {e}"))?;
        }
        if roots.is_empty() {
            return Err("this host has no CA certificates (install ca-certificates) and none was given with --upstream-ca".into());
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Arc::new(config))
    }
}

fn read_pem(path: &Path) -> Result<Vec<CertificateDer<'static>>, UpstreamCaError> {
    let bytes = std::fs::read(path).map_err(|source| UpstreamCaError::Read { path: path.to_path_buf(), source })?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes).collect::<Result<_, _>>().map_err(|e| UpstreamCaError::Parse { path: path.to_path_buf(), message: e.to_string() })?;
    if certs.is_empty() {
        return Err(UpstreamCaError::Empty { path: path.to_path_buf() });
    }
    Ok(certs)
}
