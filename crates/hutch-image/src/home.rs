//! The layout of `$HUTCH_HOME` (default `~/.local/share/hutch`).

use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct HutchHome {
    root: PathBuf,
}

impl HutchHome {
    /// `$HUTCH_HOME`, else `$XDG_DATA_HOME/hutch`, else `~/.local/share/hutch`.
    pub fn from_env() -> Self {
        let root = std::env::var_os("HUTCH_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()).map(|d| PathBuf::from(d).join("hutch")))
            .unwrap_or_else(|| {
                let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
                home.join(".local/share/hutch")
            });
        Self::at(root)
    }

    pub fn at(root: impl Into<PathBuf>) -> Self {
        let root: PathBuf = root.into();
        let root = if root.is_absolute() {
            root
        } else {
            std::env::current_dir().map(|d| d.join(&root)).unwrap_or(root)
        };
        HutchHome { root }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Creates the root if needed and makes it 0700: it holds guest RAM images, disks
    /// and access tokens, and a private root keeps every other user out of all of it.
    /// (A process-wide umask 077 would also reach the template trees hutch assembles,
    /// whose modes must be the guest's, so the root's mode does that job instead.)
    pub fn make_private(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&self.root)?;
        std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))
    }
    pub fn kernels(&self) -> PathBuf {
        self.root.join("kernel")
    }
    pub fn initramfs_dir(&self) -> PathBuf {
        self.root.join("initramfs")
    }
    pub fn templates(&self) -> PathBuf {
        self.root.join("templates")
    }
    pub fn template(&self, name: &str) -> PathBuf {
        self.templates().join(name)
    }
    pub fn sandboxes(&self) -> PathBuf {
        self.root.join("sandboxes")
    }
    /// Template memory snapshots (`snapshots/templates`).
    pub fn template_snapshots(&self) -> PathBuf {
        self.root.join("snapshots").join("templates")
    }
    /// Snapshots of sandboxes: forks and E2B snapshots (`snapshots/sandboxes`).
    pub fn sandbox_snapshots(&self) -> PathBuf {
        self.root.join("snapshots").join("sandboxes")
    }
    pub fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }
}
