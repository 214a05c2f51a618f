//! Which QEMU this host has, and whether hutch can use it. 8.2 is the floor: it can map
//! a memory file read-only and private (template snapshots no QEMU can write), and has
//! `file:` migration and `-run-with`; Debian 12 gets 10.0 from bookworm-backports
//! (docs/ARCHITECTURE.md, "QEMU baseline"). Asking QEMU costs ~35 ms per process, so the
//! answer is cached in a file keyed by the binary's path, size and mtime.

use std::path::Path;

/// The oldest QEMU hutch runs on; `scripts/lib.sh` checks the same (`QEMU_MIN`).
pub const MIN_VERSION: (u32, u32) = (8, 2);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
    /// `--version`'s first line, e.g. "QEMU emulator version 10.0.2 (Debian ...)".
    pub line: String,
}

impl QemuVersion {
    /// "10.0.2" from a `--version` line of `qemu-system-*` or `qemu-img`.
    pub fn parse(line: &str) -> Option<QemuVersion> {
        let rest = &line[line.find("version ")? + "version ".len()..];
        let number: String = rest.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
        let mut parts = number.split('.').map(|p| p.parse::<u32>().ok());
        let (major, minor) = (parts.next()??, parts.next()??);
        let micro = parts.next().flatten().unwrap_or(0);
        Some(QemuVersion { major, minor, micro, line: line.trim().to_string() })
    }

    pub fn supported(&self) -> bool {
        (self.major, self.minor) >= MIN_VERSION
    }

    pub fn number(&self) -> String {
        format!("{}.{}.{}", self.major, self.minor, self.micro)
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum QemuVersionError {
    #[error("{binary} is not installed; {}", install_hint())]
    Missing { binary: String },
    #[error("{binary} is QEMU {found}, and hutch needs {}.{} or newer; {}", MIN_VERSION.0, MIN_VERSION.1, install_hint())]
    TooOld { binary: String, found: String },
    #[error("cannot tell which QEMU {binary} is (its --version printed '{output}'); {}", install_hint())]
    Unreadable { binary: String, output: String },
    #[error("cannot run {binary}: {detail}")]
    Run { binary: String, detail: String },
}

/// How to get a QEMU hutch can use on this host, as the end of an error sentence.
pub fn install_hint() -> String {
    let codename = std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME=").map(|v| v.trim_matches('"').to_string()))
        .unwrap_or_default();
    match codename.as_str() {
        "bookworm" => "on Debian 12 install QEMU 10.0 from bookworm-backports: add the bookworm-backports suite to apt's sources, then apt-get install -t bookworm-backports qemu-system-x86 qemu-utils (scripts/demo.sh does both)".into(),
        _ => format!("install QEMU {}.{} or newer: apt-get install qemu-system-x86 qemu-utils", MIN_VERSION.0, MIN_VERSION.1),
    }
}

/// What identifies one build of the binary: a reinstall changes its size or mtime.
fn cache_key(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(format!("{} {} {} {}.{}", path.display(), m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
}

/// The version of `binary`, from `cache_dir/qemu-version` when it describes this very
/// file, else by running `binary --version` (and caching the answer there).
pub fn probe(binary: &str, cache_dir: Option<&Path>) -> Result<QemuVersion, QemuVersionError> {
    let path = crate::process::find_program(binary).ok_or_else(|| QemuVersionError::Missing { binary: binary.into() })?;
    let key = cache_key(&path).ok_or_else(|| QemuVersionError::Missing { binary: binary.into() })?;
    let cache = cache_dir.map(|d| d.join("qemu-version"));
    let cached = cache.as_ref().and_then(|f| std::fs::read_to_string(f).ok()).and_then(|text| {
        let (k, line) = text.split_once('\n')?;
        (k == key).then(|| line.trim().to_string())
    });
    let line = match cached {
        Some(line) => line,
        None => {
            let out = crate::process::output_within(std::process::Command::new(&path).arg("--version"), std::time::Duration::from_secs(30)).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => QemuVersionError::Missing { binary: binary.into() },
                _ => QemuVersionError::Run { binary: binary.into(), detail: e.to_string() },
            })?;
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text.lines().next().unwrap_or("").trim().to_string();
            if QemuVersion::parse(&line).is_some() {
                if let Some(f) = &cache {
                    let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                    if std::fs::write(&tmp, format!("{key}\n{line}\n")).is_ok() {
                        let _ = std::fs::rename(&tmp, f);
                    }
                }
            }
            line
        }
    };
    let version = QemuVersion::parse(&line).ok_or_else(|| QemuVersionError::Unreadable { binary: binary.into(), output: line.clone() })?;
    if !version.supported() {
        return Err(QemuVersionError::TooOld { binary: binary.into(), found: version.number() });
    }
    Ok(version)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use super::*;

    #[test]
    fn parses_system_and_img_lines() {
        let v = QemuVersion::parse("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)").expect("parse");
        assert_eq!((v.major, v.minor, v.micro), (10, 0, 2));
        assert!(v.supported());
        let old = QemuVersion::parse("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)").expect("parse");
        assert!(!old.supported());
        assert_eq!(QemuVersion::parse("qemu-img version 8.2.0").map(|v| v.supported()), Some(true));
        assert_eq!(QemuVersion::parse("qemu-img version 8.1.5").map(|v| v.supported()), Some(false));
        assert!(QemuVersion::parse("no version here").is_none());
    }

    /// A stand-in `qemu-system-x86_64` that prints the version it is given.
    fn fake_qemu(dir: &Path, version: &str) -> PathBuf {
        let bin = dir.join("qemu-fake");
        std::fs::write(&bin, format!("#!/bin/sh\necho 'QEMU emulator version {version} (test)'\n")).expect("write");
        std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        bin
    }

    // One test, not two: a test that writes an executable while another forks can make
    // the exec fail with ETXTBSY (the child briefly holds the written fd).
    #[test]
    fn an_old_qemu_is_refused_and_the_cache_follows_the_binary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = fake_qemu(dir.path(), "7.2.22");
        let err = probe(bin.to_str().expect("utf-8"), None).expect_err("7.2 is too old");
        let msg = err.to_string();
        assert!(msg.contains("QEMU 7.2.22") && msg.contains("8.2 or newer") && msg.contains("qemu-system-x86"), "{msg}");
        let missing = probe("/nonexistent/qemu-system-x86_64", None).expect_err("missing");
        assert!(matches!(missing, QemuVersionError::Missing { .. }), "{missing}");

        std::fs::remove_file(&bin).expect("rm");
        let bin = fake_qemu(dir.path(), "9.1.0");
        let name = bin.to_str().expect("utf-8");
        assert_eq!(probe(name, Some(dir.path())).expect("probe").minor, 1);
        assert!(std::fs::read_to_string(dir.path().join("qemu-version")).expect("cached").contains("9.1.0"));
        // A new build at the same path (another size) is asked again, not read from the cache.
        std::fs::remove_file(&bin).expect("rm");
        std::fs::write(&bin, "#!/bin/sh\necho 'QEMU emulator version 10.0.2 (a longer test line)'\n").expect("write");
        std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        assert_eq!(probe(name, Some(dir.path())).expect("probe").major, 10);
    }
}
