//! Finding the agent binary and making sure kernel, initramfs and template exist.

use hutch_image::initramfs::InitramfsError;
use hutch_image::kernel::{Kernel, KernelError};
use hutch_image::template::{Template, TemplateError};
use hutch_image::{HutchHome, Progress};
use std::path::{Path, PathBuf};

pub const AGENT_TARGET: &str = "x86_64-unknown-linux-musl";

#[derive(Debug, Clone)]
pub struct Artifacts {
    pub kernel: Kernel,
    pub initramfs: PathBuf,
    pub template: Template,
}

#[derive(Debug, thiserror::Error)]
pub enum ArtifactsError {
    #[error("cannot find the hutch-agent binary (looked in: {looked}); build it with: cargo build --profile agent --target {AGENT_TARGET} -p hutch-agent, or set HUTCH_AGENT")]
    NoAgent { looked: String },
    #[error("preparing the guest kernel")]
    Kernel(#[source] KernelError),
    #[error("preparing the initramfs")]
    Initramfs(#[source] InitramfsError),
    #[error(transparent)]
    Template(TemplateError),
}

/// `$HUTCH_AGENT`, else the cargo build outputs around the running binary
/// (`target/<musl>/{agent,release,debug}`), else `hutch-agent` beside it. Only static
/// binaries qualify: the agent runs as /init before any root filesystem exists.
pub fn locate_agent() -> Result<PathBuf, ArtifactsError> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os("HUTCH_AGENT").filter(|v| !v.is_empty()) {
        candidates.push(PathBuf::from(p));
    }
    if let Ok(exe) = std::env::current_exe() {
        let beside = exe.parent().map(|d| d.join("hutch-agent"));
        // target/{release,debug}/hutch or target/debug/deps/<test> → target/
        let mut dir = exe.parent().map(Path::to_path_buf);
        for _ in 0..3 {
            let Some(d) = dir else { break };
            for profile in ["agent", "release", "debug"] {
                candidates.push(d.join(AGENT_TARGET).join(profile).join("hutch-agent"));
            }
            dir = d.parent().map(Path::to_path_buf);
        }
        candidates.extend(beside);
    }
    candidates
        .iter()
        .find(|p| is_static_elf(p))
        .cloned()
        .ok_or_else(|| ArtifactsError::NoAgent { looked: candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ") })
}

/// An x86-64 ELF executable without a program interpreter (PT_INTERP). Reads the
/// headers only: every `hutch run` checks this, and the binary is megabytes.
fn is_static_elf(path: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else { return false };
    let mut header = [0u8; 64];
    if file.read_exact(&mut header).is_err() || &header[..4] != b"\x7fELF" || header[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| u16::from_le_bytes([header[o], header[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(header[32..40].try_into().unwrap_or([0; 8]));
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    if phentsize < 4 || phnum > 256 {
        return false;
    }
    let mut table = vec![0u8; phentsize * phnum];
    if file.seek(SeekFrom::Start(phoff)).is_err() || file.read_exact(&mut table).is_err() {
        return false;
    }
    table.chunks(phentsize).all(|entry| u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]) != 3)
}

impl Artifacts {
    pub fn prepare(home: &HutchHome, template: &str, progress: &dyn Progress) -> Result<Artifacts, ArtifactsError> {
        locate_agent()?;
        let template = hutch_image::rootfs::ensure(home, template, progress).map_err(ArtifactsError::Template)?;
        Self::with_template(home, template, progress)
    }

    /// The kernel and initramfs, with `template` as the record of what boots (a
    /// template build's VM boots a disk no template names yet).
    pub fn with_template(home: &HutchHome, template: Template, progress: &dyn Progress) -> Result<Artifacts, ArtifactsError> {
        let agent = locate_agent()?;
        let kernel = hutch_image::kernel::ensure(home, progress).map_err(ArtifactsError::Kernel)?;
        let initramfs = hutch_image::initramfs::ensure(home, &kernel, &agent, progress).map_err(ArtifactsError::Initramfs)?;
        Ok(Artifacts { kernel, initramfs, template })
    }
}
