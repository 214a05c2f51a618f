//! The files under a qcow2 overlay: a confined QEMU sees only the files bound into its
//! mount namespace, so every image of the chain must be known before it starts. The
//! qcow2 header names the backing file (bytes 8-19: offset and length of its name);
//! hutch writes these images itself, so a chain longer than `MAX_DEPTH` is an error.
//!
//! A QEMU that escaped can rewrite its overlay's header, and hutch reads chains as
//! root: each name is checked against hutch's image directories before anything opens
//! it, and only a regular file reached without a final symlink is read (a FIFO would
//! block the open, a device could act on it).

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

const MAX_DEPTH: usize = 64;
/// Linux's PATH_MAX: QEMU refuses longer backing names too.
const MAX_NAME: u32 = 4096;

/// The directories of a hutch home that hold images a disk may stack on: template
/// builds, snapshots (each kind on its own, as any may be a link to a shared cache)
/// and template-build layers.
const HOME_DIRS: [&str; 5] = ["templates", "snapshots", "snapshots/templates", "snapshots/sandboxes", "cache/build/layers"];

#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    #[error("reading the disk image {}", .0.display())]
    Io(PathBuf, #[source] std::io::Error),
    #[error("the disk image {} names a backing file QEMU could not use (length {len})", image.display())]
    BadName { image: PathBuf, len: u32 },
    #[error("the disk image {} stacks more than {MAX_DEPTH} layers", .0.display())]
    TooDeep(PathBuf),
    #[error("the disk image {} names the backing file {}, which is outside hutch's templates, snapshots and build layers; it was not opened, and the disk cannot be used (its header was changed): remove the sandbox or snapshot it belongs to", image.display(), name.display())]
    Outside { image: PathBuf, name: PathBuf },
    #[error("the disk image {} names the backing file {}, which is a symbolic link; hutch does not follow one in a disk's chain, so the disk cannot be used (its header was changed): remove the sandbox or snapshot it belongs to", image.display(), name.display())]
    Link { image: PathBuf, name: PathBuf },
    #[error("the disk image {} names the backing file {}, which is not a regular file (a FIFO, socket, device or directory); it was not read, and the disk cannot be used (its header was changed): remove the sandbox or snapshot it belongs to", image.display(), name.display())]
    NotFile { image: PathBuf, name: PathBuf },
}

impl BackingError {
    /// Whether the header names something hutch never stacks a disk on: the VM's doing.
    pub fn is_tampered(&self) -> bool {
        // hutch never writes a bad name length or a chain deeper than the limit either.
        matches!(self, BackingError::Outside { .. } | BackingError::Link { .. } | BackingError::NotFile { .. } | BackingError::BadName { .. } | BackingError::TooDeep(_))
    }
}

/// Where the images of a chain may be: each directory as named and as resolved
/// through symlinks (a backing name may use either form).
#[derive(Debug, Clone)]
pub struct Roots {
    named: Vec<PathBuf>,
    resolved: Vec<PathBuf>,
}

impl Roots {
    /// `dirs`; those that do not exist hold nothing.
    pub fn new(dirs: impl IntoIterator<Item = PathBuf>) -> Roots {
        let named: Vec<PathBuf> = dirs.into_iter().collect();
        let resolved = named.iter().filter_map(|d| std::fs::canonicalize(d).ok()).collect();
        Roots { named, resolved }
    }

    /// hutch's image directories in `home`, and `own`, the directory of the VM (or
    /// stored snapshot) whose disk the chain starts from.
    pub fn of_home(home: &Path, own: &Path) -> Roots {
        Roots::new(HOME_DIRS.iter().map(|d| home.join(d)).chain([own.to_path_buf()]))
    }

    /// Whether `path`, as written, is in one of the directories: no file is touched.
    fn names(&self, path: &Path) -> bool {
        !path.components().any(|c| c == Component::ParentDir) && self.named.iter().chain(&self.resolved).any(|root| path.starts_with(root))
    }

    /// Whether `real`, a path resolved through symlinks, is in one of the directories.
    pub fn holds(&self, real: &Path) -> bool {
        self.resolved.iter().any(|root| real.starts_with(root))
    }
}

/// Opens a file of the chain for reading its header, refusing anything but a regular
/// file: never blocks on a FIFO and never follows a final symlink (`no_follow`).
fn open_image(path: &Path, no_follow: bool) -> std::io::Result<Option<std::fs::File>> {
    let flags = libc::O_NONBLOCK | libc::O_NOCTTY | if no_follow { libc::O_NOFOLLOW } else { 0 };
    let file = std::fs::OpenOptions::new().read(true).custom_flags(flags).open(path)?;
    Ok(file.metadata()?.is_file().then_some(file))
}

/// Opens `name`, the backing file `image` names, once it is known to be in `roots`.
fn open_backing(image: &Path, name: &Path, roots: &Roots) -> Result<std::fs::File, BackingError> {
    let outside = || BackingError::Outside { image: image.to_path_buf(), name: name.to_path_buf() };
    if !roots.names(name) {
        return Err(outside());
    }
    // A directory on the way may be a link (to a shared cache): where it leads counts.
    let dir = name.parent().unwrap_or(Path::new("/"));
    let real_dir = std::fs::canonicalize(dir).map_err(|e| BackingError::Io(name.to_path_buf(), e))?;
    if !roots.holds(&real_dir) {
        return Err(outside());
    }
    // Told apart before opening, so a FIFO or a device is not opened at all; the open
    // below refuses what changed in between.
    let meta = std::fs::symlink_metadata(name).map_err(|e| BackingError::Io(name.to_path_buf(), e))?;
    if meta.file_type().is_symlink() {
        return Err(BackingError::Link { image: image.to_path_buf(), name: name.to_path_buf() });
    }
    if !meta.is_file() {
        return Err(BackingError::NotFile { image: image.to_path_buf(), name: name.to_path_buf() });
    }
    match open_image(name, true) {
        Ok(Some(file)) => Ok(file),
        Ok(None) => Err(BackingError::NotFile { image: image.to_path_buf(), name: name.to_path_buf() }),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(BackingError::Link { image: image.to_path_buf(), name: name.to_path_buf() }),
        Err(e) => Err(BackingError::Io(name.to_path_buf(), e)),
    }
}

/// The backing file `image` (open as `f`) names, if it is a qcow2 image with one.
fn backing_of(image: &Path, f: &mut std::fs::File) -> Result<Option<PathBuf>, BackingError> {
    let io = |e| BackingError::Io(image.to_path_buf(), e);
    let mut header = [0u8; 20];
    if f.read_exact(&mut header).is_err() || &header[..4] != b"QFI\xfb" {
        return Ok(None); // raw (or shorter than a header): nothing under it
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(header[16..20].try_into().expect("4 bytes"));
    if offset == 0 || len == 0 {
        return Ok(None);
    }
    if len > MAX_NAME {
        return Err(BackingError::BadName { image: image.to_path_buf(), len });
    }
    let mut name = vec![0u8; len as usize];
    f.seek(SeekFrom::Start(offset)).and_then(|_| f.read_exact(&mut name)).map_err(io)?;
    let name = PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(name));
    // QEMU resolves a relative name against the directory of the image naming it.
    Ok(Some(if name.is_absolute() { name } else { image.parent().unwrap_or(Path::new("/")).join(name) }))
}

/// The backing file `image` names, if it is a qcow2 image with one; `image` itself
/// must be a regular file (a final symlink is not followed).
pub fn backing_name(image: &Path) -> Result<Option<PathBuf>, BackingError> {
    let not_file = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "it is not a regular file");
    let mut file = open_image(image, true).and_then(|f| f.ok_or_else(not_file)).map_err(|e| BackingError::Io(image.to_path_buf(), e))?;
    backing_of(image, &mut file)
}

/// Whether `image` is a qcow2 image whose data lives in another file (incompatible
/// feature bit 2, "external data file"): QEMU and qemu-img open that file by the name
/// in its header.
pub fn has_external_data(image: &Path) -> Result<bool, BackingError> {
    let mut header = [0u8; 80];
    let mut f = std::fs::File::open(image).map_err(|e| BackingError::Io(image.to_path_buf(), e))?;
    if f.read_exact(&mut header).is_err() || &header[..4] != b"QFI\xfb" {
        return Ok(false);
    }
    let version = u32::from_be_bytes(header[4..8].try_into().expect("4 bytes"));
    let incompatible = u64::from_be_bytes(header[72..80].try_into().expect("8 bytes"));
    Ok(version >= 3 && incompatible & 4 != 0)
}

/// Every image below `disk`, nearest first. Each backing name must be in `roots`
/// (`Roots::of_home`), checked before it is opened.
pub fn chain(disk: &Path, roots: &Roots) -> Result<Vec<PathBuf>, BackingError> {
    let mut below = Vec::new();
    let mut current = disk.to_path_buf();
    let not_file = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "it is not a regular file");
    let mut file = open_image(disk, false).and_then(|f| f.ok_or_else(not_file)).map_err(|e| BackingError::Io(disk.to_path_buf(), e))?;
    while let Some(next) = backing_of(&current, &mut file)? {
        if below.len() == MAX_DEPTH {
            return Err(BackingError::TooDeep(disk.to_path_buf()));
        }
        file = open_backing(&current, &next, roots)?;
        below.push(next.clone());
        current = next;
    }
    Ok(below)
}

/// Every image below `disk`, a disk of the hutch home `home`: its names held to the
/// home's image directories and the disk's own directory.
pub fn chain_in(home: &Path, disk: &Path) -> Result<Vec<PathBuf>, BackingError> {
    chain(disk, &Roots::of_home(home, disk.parent().unwrap_or(Path::new("/"))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn qcow2_naming(path: &Path, backing: &str) {
        let mut bytes = b"QFI\xfb\0\0\0\x03".to_vec();
        bytes.extend_from_slice(&100u64.to_be_bytes());
        bytes.extend_from_slice(&(backing.len() as u32).to_be_bytes());
        bytes.resize(100, 0);
        bytes.extend_from_slice(backing.as_bytes());
        std::fs::write(path, bytes).expect("test image");
    }

    fn fifo(path: &Path) {
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("test fifo");
    }

    /// `chain` on a thread: an open that blocks on `fifo` fails the test instead of
    /// hanging it (the old `chain` opened every name it read, FIFOs included).
    fn chain_unblocked(top: &Path, roots: &Roots, fifo: &Path) -> Result<Vec<PathBuf>, BackingError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (top2, roots2) = (top.to_path_buf(), roots.clone());
        std::thread::spawn(move || tx.send(chain(&top2, &roots2)));
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(result) => result,
            Err(_) => {
                // A writer arriving lets the stuck open return, so the thread ends.
                let _ = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(fifo);
                panic!("chain() blocked opening the FIFO {}", fifo.display());
            }
        }
    }

    #[test]
    fn follows_absolute_and_relative_names_down_to_a_raw_image() {
        let dir = tempfile::tempdir().expect("test image");
        let roots = Roots::new([dir.path().to_path_buf()]);
        let raw = dir.path().join("base.img");
        std::fs::write(&raw, vec![0u8; 4096]).expect("test image");
        let mid = dir.path().join("mid.qcow2");
        qcow2_naming(&mid, raw.to_str().expect("test image"));
        let top = dir.path().join("top.qcow2");
        qcow2_naming(&top, "mid.qcow2");
        assert_eq!(chain(&top, &roots).expect("test image"), vec![mid, raw.clone()]);
        assert_eq!(chain(&raw, &roots).expect("test image"), Vec::<PathBuf>::new());
    }

    /// A home whose templates are a link to a shared cache (as the test homes'): names
    /// written through the link and through its target both stay usable.
    #[test]
    fn a_root_that_is_a_link_holds_names_in_either_form() {
        let tmp = tempfile::tempdir().expect("test image");
        let (home, shared) = (tmp.path().join("home"), tmp.path().join("shared"));
        std::fs::create_dir_all(home.join("sandboxes/sb1")).expect("test image");
        std::fs::create_dir_all(shared.join("t")).expect("test image");
        std::os::unix::fs::symlink(&shared, home.join("templates")).expect("test image");
        std::fs::write(shared.join("t/rootfs.ext4"), vec![0u8; 4096]).expect("test image");
        let own = home.join("sandboxes/sb1");
        let roots = Roots::of_home(&home, &own);
        for named in [home.join("templates/t/rootfs.ext4"), shared.join("t/rootfs.ext4")] {
            qcow2_naming(&own.join("disk.qcow2"), named.to_str().expect("test image"));
            assert_eq!(chain(&own.join("disk.qcow2"), &roots).expect("test image"), vec![named]);
        }
    }

    #[test]
    fn a_fifo_in_hutchs_directories_is_refused_at_once() {
        let dir = tempfile::tempdir().expect("test image");
        let roots = Roots::new([dir.path().to_path_buf()]);
        let pipe = dir.path().join("base.img");
        fifo(&pipe);
        let top = dir.path().join("top.qcow2");
        qcow2_naming(&top, "base.img");
        let refused = chain_unblocked(&top, &roots, &pipe).expect_err("a FIFO is no image");
        assert!(matches!(refused, BackingError::NotFile { .. }) && refused.is_tampered(), "{refused}");
        assert!(refused.to_string().contains("not a regular file"), "{refused}");
    }

    #[test]
    fn a_symlink_is_refused_even_to_an_image_beside_it() {
        let dir = tempfile::tempdir().expect("test image");
        let roots = Roots::new([dir.path().to_path_buf()]);
        let raw = dir.path().join("base.img");
        std::fs::write(&raw, vec![0u8; 4096]).expect("test image");
        std::os::unix::fs::symlink(&raw, dir.path().join("link.img")).expect("test image");
        let top = dir.path().join("top.qcow2");
        qcow2_naming(&top, "link.img");
        let refused = chain(&top, &roots).expect_err("a link is not followed");
        assert!(matches!(refused, BackingError::Link { .. }) && refused.is_tampered(), "{refused}");
    }

    /// The names point at a FIFO outside the roots: had `chain` opened them, it would
    /// block there (and `chain_unblocked` would fail the test).
    #[test]
    fn a_name_outside_the_roots_is_refused_without_being_opened() {
        let tmp = tempfile::tempdir().expect("test image");
        let (inside, outside) = (tmp.path().join("home"), tmp.path().join("elsewhere"));
        std::fs::create_dir_all(&inside).expect("test image");
        std::fs::create_dir_all(&outside).expect("test image");
        let pipe = outside.join("fifo");
        fifo(&pipe);
        let roots = Roots::new([inside.clone()]);
        let top = inside.join("top.qcow2");
        for name in [pipe.to_str().expect("test image"), "../elsewhere/fifo"] {
            qcow2_naming(&top, name);
            let refused = chain_unblocked(&top, &roots, &pipe).expect_err("outside");
            assert!(matches!(refused, BackingError::Outside { .. }) && refused.is_tampered(), "{name}: {refused}");
        }
        // Through a directory link inside the roots that leads out: refused as well.
        std::os::unix::fs::symlink(&outside, inside.join("cache")).expect("test image");
        qcow2_naming(&top, "cache/fifo");
        let refused = chain_unblocked(&top, &roots, &pipe).expect_err("outside");
        assert!(matches!(refused, BackingError::Outside { .. }), "{refused}");
    }

    #[test]
    fn an_external_data_file_is_seen_in_the_header() {
        let dir = tempfile::tempdir().expect("test image");
        let image = dir.path().join("data.qcow2");
        qcow2_naming(&image, "base.img");
        assert!(!has_external_data(&image).expect("test image"));
        let mut bytes = std::fs::read(&image).expect("test image");
        bytes[72..80].copy_from_slice(&4u64.to_be_bytes());
        std::fs::write(&image, bytes).expect("test image");
        assert!(has_external_data(&image).expect("test image"));
    }

    #[test]
    fn a_loop_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().expect("test image");
        let me = dir.path().join("loop.qcow2");
        qcow2_naming(&me, "loop.qcow2");
        assert!(matches!(chain(&me, &Roots::new([dir.path().to_path_buf()])), Err(BackingError::TooDeep(_))));
    }
}
