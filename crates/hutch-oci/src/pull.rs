//! Pulling an image: its manifest (from a multi-platform index, the linux/amd64 one),
//! its config and its layers, each blob into the shared cache unless it is there
//! already, layers in parallel, every byte checked against its digest.

use crate::config::{defaults_from_config, ConfigError, ImageDefaults};
use crate::store::{BadDigest, BlobStore, Digest, StoreError};
use futures::{StreamExt, TryStreamExt};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::{OciDescriptor, OciManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use std::sync::Arc;
use std::time::Duration;

/// Layers downloaded at once.
const PARALLEL_LAYERS: usize = 4;
/// An image config is a small JSON document; more is refused before it is fetched.
const MAX_CONFIG_BYTES: i64 = 8 << 20;

/// How hutch reaches registries.
#[derive(Clone, Default)]
pub struct RegistryOptions {
    /// `user:password` for basic auth (or a token exchange the registry asks for).
    pub credentials: Option<(String, String)>,
    /// An AWS access key: the pull first asks ECR for a login (`ecr.rs`), which then
    /// stands in for `credentials`.
    pub aws: Option<crate::ecr::AwsLogin>,
    /// Registries (`host:port`) spoken to over plain HTTP: loopback test registries.
    pub insecure: Vec<String>,
    /// Registries on this machine may be used, over plain HTTP, without being listed
    /// (the CLI, run by the machine's own user). Off for the server: a tenant's image
    /// reference must not reach the host's services; only `insecure` ones are allowed.
    pub local: bool,
    /// A forward proxy every connection goes through (`hutch_net::public_proxy`, which
    /// dials public addresses and `insecure` ones only), so neither a registry's name
    /// nor its redirects reach the server's own network. Set for the server's builds.
    pub proxy: Option<String>,
}

/// Shown without the password (a build's spec may be logged): the user name only.
impl std::fmt::Debug for RegistryOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryOptions")
            .field("user", &self.credentials.as_ref().map(|(user, _)| user))
            .field("aws", &self.aws)
            .field("insecure", &self.insecure)
            .field("local", &self.local)
            .field("proxy", &self.proxy)
            .finish()
    }
}

/// What is pulled, and what is only found in the cache.
#[derive(Debug, Clone)]
pub struct PulledImage {
    pub reference: String,
    pub manifest_digest: Digest,
    pub defaults: ImageDefaults,
    /// Layer digests, lowest first.
    pub layers: Vec<Digest>,
    pub bytes_downloaded: u64,
    pub layers_downloaded: usize,
    pub layers_cached: usize,
}

/// How a pull shows progress: one line per layer as it starts and ends, bytes as they come.
pub trait PullProgress: Send + Sync {
    fn layer_started(&self, digest: &Digest, size: u64, cached: bool);
    fn layer_bytes(&self, digest: &Digest, bytes: u64);
    fn layer_done(&self, digest: &Digest);
}

/// No progress shown.
pub struct Quiet;

impl PullProgress for Quiet {
    fn layer_started(&self, _: &Digest, _: u64, _: bool) {}
    fn layer_bytes(&self, _: &Digest, _: u64) {}
    fn layer_done(&self, _: &Digest) {}
}

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("`{reference}` is not an image reference ({reason}); write it as [REGISTRY/]NAME[:TAG][@DIGEST], e.g. debian:bookworm or localhost:5000/app:1")]
    BadReference { reference: String, reason: String },
    #[error("{reference} was not found in its registry (no such repository or tag); check the name and tag")]
    NotFound { reference: String },
    #[error("the registry refused {reference}: the credentials are missing or wrong; pass --registry-user/--registry-password (or HUTCH_REGISTRY_USER/HUTCH_REGISTRY_PASSWORD)")]
    Unauthorized { reference: String },
    #[error("the registry for {reference} could not be reached: {reason}")]
    Unreachable { reference: String, reason: String },
    #[error("{reference} has no linux/amd64 image; it is built for {available}")]
    WrongPlatform { reference: String, available: String },
    #[error("{reference}: {source}")]
    Config { reference: String, #[source] source: ConfigError },
    #[error("{reference}: a blob digest from the registry is not usable: {source}")]
    Digest { reference: String, #[source] source: BadDigest },
    #[error("{reference}: {source}")]
    Store { reference: String, #[source] source: StoreError },
    #[error("{reference} names a registry on the server's own machine or private network, which builds may not reach unless its operator lists it (`hutch serve --insecure-registry HOST:PORT`)")]
    LocalRegistry { reference: String },
    #[error("{reference}: the registry answered: {reason}")]
    Registry { reference: String, reason: String },
    #[error("{reference}: logging in to ECR")]
    AwsLogin { reference: String, #[source] source: crate::ecr::EcrError },
    #[error("the registry refused {reference} with the ECR token of the AWS key for {region}; check that the image is in that key's account and region and that the key may pull it (ecr:BatchGetImage, ecr:GetDownloadUrlForLayer)")]
    AwsUnauthorized { reference: String, region: String },
    #[error("{reference}: the registry sent other bytes than the image names (tampered or corrupted), so nothing was kept: {reason}")]
    Tampered { reference: String, reason: String },
}

pub struct Puller {
    client: Client,
    auth: RegistryAuth,
    store: BlobStore,
    options: RegistryOptions,
}

fn registry_host(registry: &str) -> &str {
    match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.split(':').next().unwrap_or(registry),
    }
}

/// A registry on this machine (`localhost`, `127.0.0.1`, `[::1]`, with any port): spoken
/// to over plain HTTP, as Docker does by default, since nothing crosses a network.
fn is_loopback(registry: &str) -> bool {
    let host = registry_host(registry);
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A registry named by an address on this machine or a private or link-local network
/// (a cloud's metadata service among them). Names are not resolved here.
fn is_local(registry: &str) -> bool {
    use std::net::IpAddr;
    is_loopback(registry)
        || match registry_host(registry).parse::<IpAddr>() {
            Ok(IpAddr::V4(v4)) => v4.is_private() || v4.is_link_local() || v4.is_unspecified() || (v4.octets()[0] == 100 && v4.octets()[1] & 0xc0 == 64),
            Ok(IpAddr::V6(v6)) => v6.is_unspecified() || (v6.segments()[0] & 0xfe00) == 0xfc00 || (v6.segments()[0] & 0xffc0) == 0xfe80,
            Err(_) => false,
        }
}

impl Puller {
    pub fn new(store: BlobStore, options: &RegistryOptions) -> Puller {
        crate::install_tls_provider();
        let config = ClientConfig {
            protocol: if options.insecure.is_empty() { ClientProtocol::Https } else { ClientProtocol::HttpsExcept(options.insecure.clone()) },
            connect_timeout: Some(Duration::from_secs(10)),
            read_timeout: Some(Duration::from_secs(60)),
            https_proxy: options.proxy.clone(),
            http_proxy: options.proxy.clone(),
            ..Default::default()
        };
        let auth = match &options.credentials {
            Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
            None => RegistryAuth::Anonymous,
        };
        Puller { client: Client::new(config), auth, store, options: options.clone() }
    }

    pub fn store(&self) -> &BlobStore {
        &self.store
    }

    pub async fn pull(&self, reference: &str, progress: Arc<dyn PullProgress>) -> Result<PulledImage, PullError> {
        let image: Reference = reference.parse().map_err(|e: oci_client::ParseError| PullError::BadReference { reference: reference.to_string(), reason: e.to_string() })?;
        let aws_login = |source| PullError::AwsLogin { reference: reference.to_string(), source };
        if let Some(aws) = &self.options.aws {
            // Before any name is resolved: a login for another registry sends nothing.
            aws.check().map_err(aws_login)?;
            aws.check_registry(registry_host(image.registry())).map_err(aws_login)?;
        }
        let listed = self.options.insecure.iter().any(|r| r == image.registry());
        if !self.options.local && !listed && is_local(image.registry()) {
            return Err(PullError::LocalRegistry { reference: reference.to_string() });
        }
        if self.options.proxy.is_some() && !listed {
            // The proxy would refuse it anyway; asked first, the answer names the cause.
            let Some((host, port)) = hutch_net::public_proxy::host_and_port(image.registry(), 443) else {
                return Err(PullError::BadReference { reference: reference.to_string(), reason: format!("'{}' is not HOST[:PORT]", image.registry()) });
            };
            if let Err(e) = hutch_net::public_proxy::resolve_public(&host, port, &self.options.insecure).await {
                return Err(match e {
                    hutch_net::public_proxy::Refused::NotPublic { .. } => PullError::LocalRegistry { reference: reference.to_string() },
                    unresolvable => PullError::Unreachable { reference: reference.to_string(), reason: unresolvable.to_string() },
                });
            }
        }
        if is_loopback(image.registry()) && !listed {
            let mut options = self.options.clone();
            options.insecure.push(image.registry().to_string());
            return Box::pin(Puller::new(self.store.clone(), &options).pull(reference, progress)).await;
        }
        let name = image.whole();
        let auth = match &self.options.aws {
            Some(aws) => {
                let (user, password) = aws.login(self.options.proxy.as_deref()).await.map_err(aws_login)?;
                RegistryAuth::Basic(user, password)
            }
            None => self.auth.clone(),
        };
        let fail = |e: OciDistributionError| match (classify(&name, e), &self.options.aws) {
            (PullError::Unauthorized { reference }, Some(aws)) => PullError::AwsUnauthorized { reference, region: aws.region.clone() },
            (other, _) => other,
        };
        let (manifest, digest) = self.client.pull_manifest(&image, &auth).await.map_err(fail)?;
        let (manifest, digest) = match manifest {
            OciManifest::Image(m) => (m, digest),
            OciManifest::ImageIndex(index) => {
                let entry = index.manifests.iter().find(|e| e.platform.as_ref().is_some_and(|p| p.os.to_string() == "linux" && p.architecture.to_string() == "amd64"));
                let Some(entry) = entry else {
                    let available: Vec<String> = index.manifests.iter().filter_map(|e| e.platform.as_ref().map(|p| format!("{}/{}", p.os, p.architecture))).collect();
                    return Err(PullError::WrongPlatform { reference: name, available: if available.is_empty() { "no platform it names".into() } else { available.join(", ") } });
                };
                let pinned = image.clone_with_digest(entry.digest.clone());
                match self.client.pull_manifest(&pinned, &auth).await.map_err(fail)? {
                    (OciManifest::Image(m), d) => (m, d),
                    (OciManifest::ImageIndex(_), _) => return Err(PullError::Registry { reference: name, reason: "an index points to another index".into() }),
                }
            }
        };
        let digest_of = |d: &str| Digest::parse(d).map_err(|source| PullError::Digest { reference: name.clone(), source });
        let manifest_digest = digest_of(&digest)?;
        let config_digest = digest_of(&manifest.config.digest)?;
        if manifest.config.size > MAX_CONFIG_BYTES {
            return Err(PullError::Registry { reference: name, reason: format!("the image config is {} bytes; hutch reads configs up to {MAX_CONFIG_BYTES}", manifest.config.size) });
        }
        // Blobs come from this registry alone: a descriptor's `urls` would have hutch
        // fetch from wherever the manifest says.
        if let Some(foreign) = std::iter::once(&manifest.config).chain(&manifest.layers).find(|d| d.urls.as_ref().is_some_and(|u| !u.is_empty())) {
            return Err(PullError::Registry { reference: name, reason: format!("blob {} is to be fetched from other URLs ({}); hutch pulls blobs from the image's registry only", foreign.digest, foreign.urls.iter().flatten().cloned().collect::<Vec<_>>().join(", ")) });
        }
        self.fetch(&image, &manifest.config, &config_digest, None).await.map_err(|e| self.attach(&name, e))?;
        let config = std::fs::read(self.store.path(&config_digest)).map_err(|source| PullError::Store { reference: name.clone(), source: StoreError::Io { path: self.store.path(&config_digest), source } })?;
        let defaults = defaults_from_config(&config).map_err(|source| PullError::Config { reference: name.clone(), source })?;

        let layers: Vec<(Digest, &OciDescriptor)> = manifest.layers.iter().map(|l| Ok((digest_of(&l.digest)?, l))).collect::<Result<_, PullError>>()?;
        let mut cached = 0;
        let mut wanted = Vec::new();
        for (digest, descriptor) in &layers {
            let have = self.store.has(digest);
            progress.layer_started(digest, descriptor.size.max(0) as u64, have);
            if have {
                cached += 1;
                progress.layer_done(digest);
            } else if !wanted.iter().any(|(d, _)| d == digest) {
                wanted.push((digest.clone(), *descriptor));
            }
        }
        let downloaded: Vec<u64> = futures::stream::iter(wanted.iter().map(|(digest, descriptor)| {
            let progress = progress.clone();
            let image = &image;
            async move {
                let bytes = self.fetch(image, descriptor, digest, Some(progress.as_ref())).await?;
                progress.layer_done(digest);
                Ok::<u64, FetchError>(bytes)
            }
        }))
        .buffer_unordered(PARALLEL_LAYERS)
        .try_collect()
        .await
        .map_err(|e| self.attach(&name, e))?;
        Ok(PulledImage {
            reference: name,
            manifest_digest,
            defaults,
            layers: layers.into_iter().map(|(d, _)| d).collect(),
            bytes_downloaded: downloaded.iter().sum(),
            layers_downloaded: downloaded.len(),
            layers_cached: cached,
        })
    }

    /// One blob into the cache (unless it is there); the bytes downloaded.
    async fn fetch(&self, image: &Reference, descriptor: &OciDescriptor, digest: &Digest, progress: Option<&dyn PullProgress>) -> Result<u64, FetchError> {
        if self.store.has(digest) {
            return Ok(0);
        }
        let mut stream = self.client.pull_blob_stream(image, descriptor).await.map_err(FetchError::Registry)?;
        let mut writer = self.store.writer(digest).await.map_err(FetchError::Store)?;
        // The manifest's size bounds the download: a registry cannot stream without end
        // (the digest is only known at the end).
        let size = u64::try_from(descriptor.size).unwrap_or(0);
        use tokio::io::AsyncWriteExt;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| match e.get_ref().is_some_and(|inner| inner.is::<oci_client::errors::DigestError>()) {
                true => FetchError::Tampered(e.to_string()),
                false => FetchError::Transfer(e.to_string()),
            })?;
            writer.write_all(&chunk).await.map_err(|source| FetchError::Store(StoreError::Io { path: self.store.path(digest), source }))?;
            if writer.written() > size {
                return Err(FetchError::Tampered(format!("blob {digest} is longer than the {size} bytes its manifest names")));
            }
            if let Some(p) = progress {
                p.layer_bytes(digest, chunk.len() as u64);
            }
        }
        let written = writer.written();
        writer.finish().await.map_err(FetchError::Store)?;
        Ok(written)
    }

    fn attach(&self, reference: &str, e: FetchError) -> PullError {
        match e {
            FetchError::Registry(e) => classify(reference, e),
            FetchError::Store(source) => PullError::Store { reference: reference.to_string(), source },
            FetchError::Transfer(reason) => PullError::Unreachable { reference: reference.to_string(), reason: format!("the download broke off: {reason}") },
            FetchError::Tampered(reason) => PullError::Tampered { reference: reference.to_string(), reason },
        }
    }
}

#[derive(Debug)]
enum FetchError {
    Registry(OciDistributionError),
    Store(StoreError),
    /// The download broke off midway.
    Transfer(String),
    /// The registry sent other bytes than the manifest names.
    Tampered(String),
}

/// A registry client's error as the one sentence the user needs.
fn classify(reference: &str, e: OciDistributionError) -> PullError {
    let reference = reference.to_string();
    match e {
        OciDistributionError::ImageManifestNotFoundError(_) => PullError::NotFound { reference },
        OciDistributionError::UnauthorizedError { .. } | OciDistributionError::AuthenticationFailure(_) => PullError::Unauthorized { reference },
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes: Vec<String> = envelope.errors.iter().map(|e| format!("{:?}", e.code)).collect();
            let text = codes.join(" ").to_uppercase();
            if text.contains("UNKNOWN") || text.contains("NOTFOUND") {
                PullError::NotFound { reference }
            } else if text.contains("UNAUTHORIZED") || text.contains("DENIED") {
                PullError::Unauthorized { reference }
            } else {
                PullError::Registry { reference, reason: envelope.errors.iter().map(|e| e.message.clone()).collect::<Vec<_>>().join("; ") }
            }
        }
        OciDistributionError::ServerError { code: 404, .. } => PullError::NotFound { reference },
        OciDistributionError::ServerError { code: 401 | 403, .. } => PullError::Unauthorized { reference },
        OciDistributionError::DigestError(d) => PullError::Tampered { reference, reason: d.to_string() },
        OciDistributionError::RequestError(r) if r.is_connect() || r.is_timeout() => PullError::Unreachable { reference, reason: hutch_proto::error_chain(&r) },
        other => PullError::Registry { reference, reason: other.to_string() },
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn registry_options_never_show_the_password() {
        let options = super::RegistryOptions { credentials: Some(("_json_key".into(), "{\"private_key\":\"s3cret\"}".into())), ..Default::default() };
        let shown = format!("{options:?}");
        assert!(shown.contains("_json_key") && !shown.contains("s3cret"), "{shown}");
    }

    #[test]
    fn only_this_machine_counts_as_loopback() {
        for r in ["127.0.0.1:5000", "localhost:5000", "[::1]:5000", "127.1.2.3"] {
            assert!(super::is_loopback(r), "{r}");
        }
        for r in ["registry-1.docker.io", "10.0.0.1:5000", "ghcr.io", "localhost.example.com"] {
            assert!(!super::is_loopback(r), "{r}");
        }
        for r in ["10.0.0.1:5000", "169.254.169.254", "192.168.1.2:443", "[fd00::1]:5000", "127.0.0.1:5000"] {
            assert!(super::is_local(r), "{r}");
        }
        assert!(!super::is_local("ghcr.io") && !super::is_local("8.8.4.4:443"));
    }
}
