//! OCI images for hutch templates: pulling an image from any registry into a blob cache
//! shared by every image (each blob verified against its digest), and applying its
//! layers to a root filesystem with the image spec's whiteouts. The registry client
//! is the default feature `registry`; without it (the fuzz targets) only the blob
//! store and the layer unpacking are built.

pub mod config;
#[cfg(feature = "registry")]
pub mod ecr;
#[cfg(feature = "registry")]
pub mod pull;
pub mod store;
pub mod unpack;

pub use config::ImageDefaults;
pub use store::{BlobStore, Digest};

/// Installs the process's TLS provider (ring) for registry clients; later calls, and a
/// provider already installed, are fine. Any `oci_client::Client` needs it first.
#[cfg(feature = "registry")]
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
