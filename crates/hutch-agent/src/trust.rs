//! The sandbox's TLS inspection CA, which every process in the guest is to trust
//! while the host inspects some of its hosts (the host sends it at `/init`).
//!
//! The CA goes to `/run/hutch` (tmpfs): `ca.pem` alone (Node's NODE_EXTRA_CA_CERTS)
//! and `ca-bundle.crt`, the image's bundle with the CA appended, which is bind-mounted
//! over the image's bundle so programs that read only the system path (apt, wget)
//! trust it too. Nothing is written to the disk, so a filesystem snapshot or export
//! never carries a CA that trusted the host of another sandbox; a memory snapshot
//! carries the mount, and the next `/init` replaces or removes it.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::path::Path;

const DIR: &str = "/run/hutch";
const CA: &str = "/run/hutch/ca.pem";
const BUNDLE: &str = "/run/hutch/ca-bundle.crt";
/// Where Debian, Ubuntu and Alpine keep the system bundle.
const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The CA installed now (None: none), so an `/init` that changes nothing costs
/// nothing (a restore or a pool take repeats the same one).
static INSTALLED: Mutex<Option<String>> = Mutex::new(None);

/// Makes the guest trust `pem` (or no hutch CA), and adds to `env` the variables that
/// point clients at it. A step that fails is logged on the console and the variables
/// still point at the files, so a client fails its handshake, never trusts less.
pub fn apply(pem: Option<&str>, env: &mut BTreeMap<String, String>) {
    let mut installed = INSTALLED.lock();
    if installed.as_deref() != pem {
        let done = match pem {
            Some(pem) => install(pem),
            None => remove(),
        };
        match done {
            Ok(()) => *installed = pem.map(str::to_string),
            Err(e) => eprintln!("hutch-agent: the inspection CA: {e}"),
        }
    }
    if pem.is_some() {
        for var in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"] {
            env.entry(var.into()).or_insert_with(|| BUNDLE.into());
        }
        env.entry("NODE_EXTRA_CA_CERTS".into()).or_insert_with(|| CA.into());
    }
}

fn install(pem: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(DIR)?;
    std::fs::write(CA, pem)?;
    // What the image trusts, without a block an earlier CA left (read through the
    // mount, which shows the bundle this agent wrote).
    let system = std::fs::read_to_string(SYSTEM_BUNDLE).unwrap_or_default();
    let mut bundle = strip(&system);
    if !bundle.is_empty() && !bundle.ends_with('\n') {
        bundle.push('\n');
    }
    bundle.push_str(BEGIN);
    bundle.push_str(pem.trim_end());
    bundle.push('\n');
    bundle.push_str(END);
    // Written in place: a bind mount follows the file, not the name.
    std::fs::write(BUNDLE, bundle)?;
    if Path::new(SYSTEM_BUNDLE).exists() && !mounted() {
        nix::mount::mount(Some(BUNDLE), SYSTEM_BUNDLE, None::<&str>, nix::mount::MsFlags::MS_BIND, None::<&str>).map_err(std::io::Error::from)?;
    }
    Ok(())
}

fn remove() -> std::io::Result<()> {
    if mounted() {
        nix::mount::umount2(SYSTEM_BUNDLE, nix::mount::MntFlags::MNT_DETACH).map_err(std::io::Error::from)?;
    }
    for file in [CA, BUNDLE] {
        match std::fs::remove_file(file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

const BEGIN: &str = "# hutch: this sandbox's TLS inspection CA\n";
const END: &str = "# hutch: end\n";

/// `bundle` without hutch's block.
fn strip(bundle: &str) -> String {
    match (bundle.find(BEGIN), bundle.find(END)) {
        (Some(begin), Some(end)) if end > begin => format!("{}{}", &bundle[..begin], &bundle[end + END.len()..]),
        _ => bundle.to_string(),
    }
}

/// Whether the system bundle is hutch's bind mount (its device and inode are the file in /run).
fn mounted() -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(SYSTEM_BUNDLE), std::fs::metadata(BUNDLE)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_loses_only_hutchs_block() {
        let system = "-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n";
        let with = format!("{system}{BEGIN}-----BEGIN CERTIFICATE-----\nH\n-----END CERTIFICATE-----\n{END}");
        assert_eq!(strip(&with), system);
        assert_eq!(strip(system), system);
    }
}
