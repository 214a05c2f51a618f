//! Stand-ins for the kernel and initramfs of a VM that loads a saved state. Such a VM
//! never boots them: its memory already holds a running kernel, and a guest reset ends
//! the VM (`-no-reboot`). QEMU still reads `-kernel` and `-initrd` whole into its own
//! memory at start, for the firmware to copy at a boot that never comes: 16 MiB of
//! anonymous memory in every restored sandbox (a 14 MiB kernel and a 2 MiB initramfs,
//! found in the QEMU's smaps), and their reads on its start path.
//!
//! So a loading VM gets, in its own directory, the kernel's own boot header (QEMU reads
//! it to choose the boot protocol and lay out the firmware's tables, so it must be the
//! real one) followed by one page in place of the kernel, and one page as the
//! initramfs. Only a bzImage has such a header; any other kernel (an ELF QEMU would
//! load straight into guest RAM) keeps the real files.

use crate::backend::VmSpec;
use std::io::Read;
use std::path::Path;

/// Where the Linux boot protocol's setup header says "HdrS", and its size in sectors.
const MAGIC_AT: usize = 0x202;
const SETUP_SECTS_AT: usize = 0x1f1;
/// The most a boot header can be: 1 + 255 sectors of 512 bytes.
const MAX_SETUP: usize = 256 * 512;
/// What stands in for the kernel's code and for the initramfs.
const PAGE: usize = 4096;

const KERNEL: &str = "kernel.stand-in";
const INITRD: &str = "initrd.stand-in";

/// `spec` with stand-ins for its kernel and initramfs, written into its directory,
/// when it loads a state and its kernel is a bzImage; else `spec` as it is.
pub fn for_loading(spec: &VmSpec) -> std::io::Result<VmSpec> {
    if spec.incoming.is_none() {
        return Ok(spec.clone());
    }
    let Some(header) = boot_header(&spec.kernel)? else { return Ok(spec.clone()) };
    let (kernel, initrd) = (spec.dir.join(KERNEL), spec.dir.join(INITRD));
    let mut stand_in = header;
    stand_in.resize(stand_in.len() + PAGE, 0);
    replace(&kernel, &stand_in)?;
    replace(&initrd, &[0u8; PAGE])?;
    Ok(VmSpec { kernel, initrd, ..spec.clone() })
}

/// Writes `bytes` as a new file at `path`, replacing whatever was there by a rename: a
/// QEMU still mapping the old one (being killed after a failed load) keeps its inode
/// whole, and no link at `path` is followed.
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let partial = path.with_extension("partial");
    let _ = std::fs::remove_file(&partial);
    // create_new: O_EXCL, which also refuses a link left at the partial name.
    let written = std::fs::OpenOptions::new().write(true).create_new(true).open(&partial).and_then(|mut f| f.write_all(bytes));
    let placed = written.and_then(|()| std::fs::rename(&partial, path));
    if placed.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    placed
}

/// The boot header of the bzImage at `kernel` (its setup sectors), or None when it
/// is no bzImage.
fn boot_header(kernel: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(MAX_SETUP);
    std::fs::File::open(kernel)?.take(MAX_SETUP as u64).read_to_end(&mut head)?;
    if head.len() < MAGIC_AT + 4 || &head[MAGIC_AT..MAGIC_AT + 4] != b"HdrS" {
        return Ok(None);
    }
    // The boot protocol: 0 sectors means 4.
    let sectors = match head[SETUP_SECTS_AT] {
        0 => 4,
        n => usize::from(n),
    };
    let setup = (sectors + 1) * 512;
    if head.len() < setup {
        return Ok(None);
    }
    head.truncate(setup);
    Ok(Some(head))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Incoming, Memory};
    use crate::Accel;
    use std::path::PathBuf;

    fn spec(dir: &Path, kernel: PathBuf, incoming: bool) -> VmSpec {
        VmSpec {
            id: "x".into(),
            dir: dir.to_path_buf(),
            kernel,
            initrd: dir.join("real-initrd"),
            disk: dir.join("disk.qcow2"),
            base: None,
            cpus: 1,
            memory_mib: 512,
            accel: Accel::Tcg,
            memory: Memory::Anonymous,
            incoming: incoming.then(|| Incoming { state: dir.join("state"), ignore_shared: false }),
            die_with_parent: true,
            agent_channel: "a".into(),
            nic: None,
        }
    }

    /// A bzImage of 2 setup sectors after the boot sector, and a 10 000-byte kernel.
    fn bzimage(path: &Path) -> Vec<u8> {
        let mut image = vec![0x11u8; 3 * 512 + 10_000];
        image[SETUP_SECTS_AT] = 2;
        image[MAGIC_AT..MAGIC_AT + 4].copy_from_slice(b"HdrS");
        std::fs::write(path, &image).expect("kernel");
        image
    }

    #[test]
    fn a_loading_vm_gets_the_real_boot_header_and_a_page_for_each_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let image = bzimage(&dir.path().join("vmlinuz"));
        let given = spec(dir.path(), dir.path().join("vmlinuz"), true);
        let got = for_loading(&given).expect("stand-ins");
        assert_eq!(got.kernel, dir.path().join(KERNEL));
        assert_eq!(got.initrd, dir.path().join(INITRD));
        let kernel = std::fs::read(&got.kernel).expect("kernel stand-in");
        assert_eq!(kernel.len(), 3 * 512 + PAGE);
        assert_eq!(&kernel[..3 * 512], &image[..3 * 512], "the header is the kernel's own");
        assert!(kernel[3 * 512..].iter().all(|&b| b == 0));
        assert_eq!(std::fs::read(&got.initrd).expect("initrd stand-in").len(), PAGE);
        assert_eq!((got.disk, got.incoming.is_some()), (given.disk, true), "the rest is the spec's");
    }

    #[test]
    fn a_link_at_a_stand_in_is_replaced_not_written_through() {
        let dir = tempfile::tempdir().expect("tmp");
        bzimage(&dir.path().join("vmlinuz"));
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep").expect("target");
        std::os::unix::fs::symlink(&target, dir.path().join(INITRD)).expect("link");
        let got = for_loading(&spec(dir.path(), dir.path().join("vmlinuz"), true)).expect("stand-ins");
        assert_eq!(std::fs::read(&target).expect("target"), b"keep");
        assert!(!std::fs::symlink_metadata(&got.initrd).expect("initrd").file_type().is_symlink());
        // Made again for the next start of the same VM: replaced whole.
        for_loading(&spec(dir.path(), dir.path().join("vmlinuz"), true)).expect("again");
        assert_eq!(std::fs::read(&got.initrd).expect("initrd").len(), PAGE);
    }

    #[test]
    fn a_booting_vm_or_a_kernel_without_a_boot_header_keeps_the_real_files() {
        let dir = tempfile::tempdir().expect("tmp");
        bzimage(&dir.path().join("vmlinuz"));
        let booting = for_loading(&spec(dir.path(), dir.path().join("vmlinuz"), false)).expect("boot");
        assert_eq!(booting.kernel, dir.path().join("vmlinuz"));
        std::fs::write(dir.path().join("elf"), b"\x7fELF and no header").expect("elf");
        let elf = for_loading(&spec(dir.path(), dir.path().join("elf"), true)).expect("elf");
        assert_eq!((elf.kernel, elf.initrd), (dir.path().join("elf"), dir.path().join("real-initrd")));
        assert!(!dir.path().join(KERNEL).exists());
        assert!(for_loading(&spec(dir.path(), dir.path().join("missing"), true)).is_err(), "a kernel that cannot be read is an error");
    }
}
