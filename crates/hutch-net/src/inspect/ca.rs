//! A sandbox's own certificate authority: the guest trusts it (the agent installs its
//! certificate), and hutch signs with it the certificates it shows the guest for the
//! hosts it inspects. Its key never leaves the host: it lives in the sandbox's
//! directory (0600) so a resumed or adopted sandbox keeps the CA its guest trusts, and
//! no snapshot, export or fork copies that file.

use parking_lot::Mutex;
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;

/// `O_NOFOLLOW`: a partial file is never opened through a link someone left.
fn libc_o_nofollow() -> i32 {
    nix::fcntl::OFlag::O_NOFOLLOW.bits()
}
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The CA's files in a sandbox's directory.
pub const CA_CERT_FILE: &str = "inspect-ca.pem";
pub const CA_KEY_FILE: &str = "inspect-ca.key";

/// Leaf certificates kept per sandbox (one per host name the guest reached), and how
/// long one is used before it is made again. A leaf is valid for a week around its
/// making, so a guest clock a little off still accepts it.
const LEAVES_KEPT: usize = 64;
const LEAF_REUSED_FOR: Duration = Duration::from_secs(24 * 3600);
const LEAF_VALID_BEFORE: time::Duration = time::Duration::hours(24);
const LEAF_VALID_AFTER: time::Duration = time::Duration::days(7);

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("making a certificate failed: {0}")]
    Make(#[from] rcgen::Error),
    #[error("the sandbox's inspection CA in {path} cannot be used: {source}")]
    File { path: String, source: std::io::Error },
    #[error("the sandbox's inspection CA key in {path} does not parse: {source}")]
    Key { path: String, source: rcgen::Error },
    #[error("rustls refused the certificate made for {host}: {source}")]
    Tls { host: String, source: rustls::Error },
}

pub struct SandboxCa {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    /// One key for every leaf of this CA: making an ECDSA key per host buys nothing,
    /// since all of them sit in the same process.
    leaf_key: KeyPair,
    leaves: Mutex<HashMap<String, (Instant, Arc<rustls::sign::CertifiedKey>)>>,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCa").finish_non_exhaustive()
    }
}

/// The CA's name and uses. Made the same way when a CA is loaded again, so the
/// issuer the leaves name is the certificate the guest trusts (rcgen derives the
/// key identifier from the key).
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "hutch");
    name.push(DnType::CommonName, "hutch sandbox inspection CA");
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    // Long enough for a sandbox paused for years; not rcgen's default of 4096.
    let wall = time::OffsetDateTime::now_utc();
    params.not_before = wall - LEAF_VALID_BEFORE;
    params.not_after = wall + time::Duration::days(3650);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params
}

impl SandboxCa {
    /// A new CA, with a fresh P-256 key.
    pub fn generate() -> Result<SandboxCa, CaError> {
        let key = KeyPair::generate()?;
        let params = ca_params();
        let cert = params.self_signed(&key)?;
        Self::from_parts(cert.pem(), cert.der().clone(), key)
    }

    fn from_parts(cert_pem: String, cert_der: CertificateDer<'static>, key: KeyPair) -> Result<SandboxCa, CaError> {
        Ok(SandboxCa { cert_pem, cert_der, issuer: Issuer::new(ca_params(), key), leaf_key: KeyPair::generate()?, leaves: Mutex::new(HashMap::new()) })
    }

    /// The certificate the guest trusts, as PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Writes the CA into `dir`, each file whole (a new file renamed into place), the
    /// key 0600 and first: the certificate, which `load` looks for, comes last.
    pub fn save(&self, dir: &Path) -> Result<(), CaError> {
        let write = |name: &str, data: &[u8], mode: u32| {
            let path = dir.join(name);
            let partial = dir.join(format!(".{name}.partial"));
            let _ = std::fs::remove_file(&partial);
            let written = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .custom_flags(libc_o_nofollow())
                .open(&partial)
                .and_then(|mut f| f.write_all(data).and_then(|()| f.sync_all()))
                .and_then(|()| std::fs::rename(&partial, &path));
            written.map_err(|source| CaError::File { path: path.display().to_string(), source })
        };
        let key = zeroize::Zeroizing::new(self.issuer.key().serialize_pem());
        write(CA_KEY_FILE, key.as_bytes(), 0o600)?;
        write(CA_CERT_FILE, self.cert_pem.as_bytes(), 0o644)?;
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|source| CaError::File { path: dir.display().to_string(), source })
    }

    /// The CA saved in `dir`, or None if there is none.
    pub fn load(dir: &Path) -> Result<Option<SandboxCa>, CaError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| CaError::File { path: path.display().to_string(), source })
        };
        let cert_pem = match read(CA_CERT_FILE) {
            Err(CaError::File { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            other => other?,
        };
        let key_pem = zeroize::Zeroizing::new(read(CA_KEY_FILE)?);
        let key_path = dir.join(CA_KEY_FILE).display().to_string();
        let key = KeyPair::from_pem(&key_pem).map_err(|source| CaError::Key { path: key_path, source })?;
        let cert_der = rustls::pki_types::pem::PemObject::from_pem_slice(cert_pem.as_bytes()).map_err(|e| CaError::File {
            path: dir.join(CA_CERT_FILE).display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
        })?;
        Self::from_parts(cert_pem, cert_der, key).map(Some)
    }

    /// The certificate and key hutch shows the guest for `host`, made on first use and
    /// kept a day.
    pub fn leaf(&self, host: &str) -> Result<Arc<rustls::sign::CertifiedKey>, CaError> {
        let now = Instant::now();
        if let Some((made, leaf)) = self.leaves.lock().get(host) {
            if now.duration_since(*made) < LEAF_REUSED_FOR {
                return Ok(leaf.clone());
            }
        }
        let mut params = CertificateParams::new(vec![host.to_string()])?;
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, host);
        params.distinguished_name = name;
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let wall = time::OffsetDateTime::now_utc();
        params.not_before = wall - LEAF_VALID_BEFORE;
        params.not_after = wall + LEAF_VALID_AFTER;
        let cert = params.signed_by(&self.leaf_key, &self.issuer)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.serialize_der()));
        let provider = rustls::crypto::ring::default_provider();
        let certified = rustls::sign::CertifiedKey::from_der(vec![cert.der().clone(), self.cert_der.clone()], key, &provider)
            .map_err(|source| CaError::Tls { host: host.to_string(), source })?;
        let leaf = Arc::new(certified);
        let mut leaves = self.leaves.lock();
        if leaves.len() >= LEAVES_KEPT {
            // The oldest goes; a guest that reaches more hosts than this pays a signature.
            if let Some(oldest) = leaves.iter().min_by_key(|(_, (made, _))| *made).map(|(h, _)| h.clone()) {
                leaves.remove(&oldest);
            }
        }
        leaves.insert(host.to_string(), (now, leaf.clone()));
        Ok(leaf)
    }
}
