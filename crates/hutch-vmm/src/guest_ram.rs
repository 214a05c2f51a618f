//! Guest RAM read and written from outside QEMU, for a pause that saves only what
//! changed since the restore.
//!
//! A sandbox restored from a snapshot maps the snapshot's memory file privately: a page
//! the guest (or QEMU for it) never wrote is still the file's page, and one it wrote is
//! an anonymous copy. QEMU cannot tell them apart (its dirty tracking starts with a
//! migration, and `x-ignore-shared` leaves out only *shared* file RAM), but the kernel
//! can: `/proc/<pid>/pagemap` marks every present page of the mapping as file-backed or
//! anonymous, and a page swapped out is anonymous. So hutch, with the guest stopped,
//! reads which pages are anonymous, copies them out of `/proc/<pid>/mem` into the state
//! file (`saved_state.rs`), and has QEMU write only its device state after them. A
//! resume maps the same memory file privately again, writes the saved pages back
//! through `/proc/<pid>/mem` before QEMU loads its devices (virtio reads its rings from
//! guest RAM as it loads), and the guest runs on what it had.
//!
//! Only RAM block `mem0` is treated this way; QEMU's other blocks (its firmware and
//! ACPI tables, which the guest cannot write) are made again identically at start-up.
//! Reading another process's memory needs ptrace access: hutch as root has it, and as
//! an ordinary user it has it over the QEMUs it started in a user namespace it owns.
//! When it has not (an adopted QEMU under Yama's restrictions), the pause saves
//! everything, as before.

use crate::saved_state::{page_size, Run};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

/// Pagemap bits (Documentation/admin-guide/mm/pagemap.rst).
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_OR_SHARED: u64 = 1 << 61;
/// The most of `/proc/<qemu>/maps` read (QEMU's own run to ~100 KB).
const MAX_MAPS: u64 = 16 << 20;
/// How much is copied per read or write.
const CHUNK: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum GuestRamError {
    #[error("reading QEMU's {what}")]
    Proc { what: &'static str, #[source] source: std::io::Error },
    #[error("QEMU exited while its memory was read")]
    Exited,
    #[error("QEMU maps the memory file {file} {found}, not once over its {ram_bytes} bytes of RAM")]
    Mapping { file: String, found: String, ram_bytes: u64 },
    #[error("copying guest pages")]
    Copy(#[source] std::io::Error),
}

/// QEMU's guest RAM: where it maps the memory file, and its `/proc` files, opened
/// while the process was known to be that QEMU.
pub struct GuestRam {
    start: u64,
    bytes: u64,
    page_size: u64,
    pagemap: std::fs::File,
    mem: std::fs::File,
}

impl GuestRam {
    /// Finds process `pid`'s mapping of `memory_file` (all of its `ram_bytes`).
    /// `alive` says whether the process hutch means is still running: checked after
    /// the opens, so a pid reused in between is never read from.
    /// `shared`: QEMU maps it shared (a snapshot's source VM) rather than privately.
    pub fn open(pid: u32, memory_file: &Path, shared: bool, ram_bytes: u64, write: bool, alive: impl Fn() -> bool) -> Result<GuestRam, GuestRamError> {
        let proc = |what: &'static str| move |source| GuestRamError::Proc { what, source };
        // QEMU decides how long its maps are (a mapping per file it maps): read a
        // bounded prefix, and refuse a longer one rather than look for RAM in part.
        let mut maps = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(std::fs::File::open(format!("/proc/{pid}/maps")).map_err(proc("maps"))?, MAX_MAPS + 1), &mut maps).map_err(proc("maps"))?;
        if maps.len() as u64 > MAX_MAPS {
            return Err(GuestRamError::Mapping { file: memory_file.display().to_string(), found: format!("somewhere in more than {} MiB of mappings", MAX_MAPS >> 20), ram_bytes });
        }
        let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap")).map_err(proc("pagemap"))?;
        let mem = std::fs::OpenOptions::new().read(true).write(write).open(format!("/proc/{pid}/mem")).map_err(proc("mem"))?;
        if !alive() {
            return Err(GuestRamError::Exited);
        }
        let meta = std::fs::metadata(memory_file).map_err(proc("memory file"))?;
        let dev = (nix::sys::stat::major(meta.dev()), nix::sys::stat::minor(meta.dev()));
        let found = mappings_of(&maps, dev, meta.ino(), if shared { "rw-s" } else { "rw-p" });
        let whole = match found.as_slice() {
            [(start, end, 0)] if end - start == ram_bytes => Some(*start),
            _ => None,
        };
        let Some(start) = whole else {
            let found = if found.is_empty() { "nowhere".to_string() } else { format!("as {found:x?} (start, end, offset)") };
            return Err(GuestRamError::Mapping { file: memory_file.display().to_string(), found, ram_bytes });
        };
        Ok(GuestRam { start, bytes: ram_bytes, page_size: page_size(), pagemap, mem })
    }

    /// The size of guest RAM.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The runs of pages that are no longer the memory file's.
    pub fn changed(&self) -> Result<Vec<Run>, GuestRamError> {
        let pages = self.bytes / self.page_size;
        let first_entry = self.start / self.page_size * 8;
        // Read in chunks: a 64 GiB guest's whole pagemap would be 128 MiB.
        let mut flags = Vec::with_capacity(pages as usize);
        let mut entries = vec![0u8; CHUNK];
        let mut page = 0u64;
        while page < pages {
            let n = ((pages - page) as usize).min(CHUNK / 8);
            self.pagemap.read_exact_at(&mut entries[..n * 8], first_entry + page * 8).map_err(|source| GuestRamError::Proc { what: "pagemap", source })?;
            flags.extend(entries[..n * 8].chunks_exact(8).map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes"))).map(|e| e & SWAPPED != 0 || (e & PRESENT != 0 && e & FILE_OR_SHARED == 0)));
            page += n as u64;
        }
        Ok(runs_of(flags.into_iter()))
    }

    /// Copies the pages of `runs` into `out`, in order.
    pub fn copy_out(&self, runs: &[Run], out: &mut impl std::io::Write) -> Result<(), GuestRamError> {
        let mut buf = vec![0u8; CHUNK];
        self.each_chunk(runs, |at, len| {
            self.mem.read_exact_at(&mut buf[..len], at)?;
            out.write_all(&buf[..len])
        })
    }

    /// Writes the pages of `runs`, read in order from `input`, into guest RAM.
    pub fn copy_in(&self, runs: &[Run], input: &mut impl std::io::Read) -> Result<(), GuestRamError> {
        let mut buf = vec![0u8; CHUNK];
        self.each_chunk(runs, |at, len| {
            input.read_exact(&mut buf[..len])?;
            self.mem.write_all_at(&buf[..len], at)
        })
    }

    /// `len` bytes of QEMU's memory at `addr` (one of its other RAM blocks, where
    /// QEMU says it is: QEMU's own memory either way).
    pub fn read_raw(&self, addr: u64, len: u64) -> Result<Vec<u8>, GuestRamError> {
        let mut data = vec![0u8; len as usize];
        self.mem.read_exact_at(&mut data, addr).map_err(GuestRamError::Copy)?;
        Ok(data)
    }

    /// Writes `data` into QEMU's memory at `addr` (see `read_raw`).
    pub fn write_raw(&self, addr: u64, data: &[u8]) -> Result<(), GuestRamError> {
        self.mem.write_all_at(data, addr).map_err(GuestRamError::Copy)
    }

    /// Calls `f` with the address and length of each chunk of `runs`, in order.
    fn each_chunk(&self, runs: &[Run], mut f: impl FnMut(u64, usize) -> std::io::Result<()>) -> Result<(), GuestRamError> {
        let pages = self.bytes / self.page_size;
        for run in runs {
            // The runs were checked against this RAM when read; checked again here,
            // where an address outside it would touch QEMU's own memory.
            if run.first.checked_add(run.pages).is_none_or(|end| end > pages) {
                return Err(GuestRamError::Copy(std::io::Error::other(format!("pages {}+{} lie outside {pages} pages of RAM", run.first, run.pages))));
            }
            let (mut at, end) = (self.start + run.first * self.page_size, self.start + (run.first + run.pages) * self.page_size);
            while at < end {
                let len = (end - at).min(CHUNK as u64) as usize;
                f(at, len).map_err(GuestRamError::Copy)?;
                at += len as u64;
            }
        }
        Ok(())
    }
}

/// The (start, end, file offset) of each mapping in `maps` of the file `dev`/`ino`.
/// Any mapping of it but with `perms` has offset `u64::MAX`: guest RAM is mapped
/// read-write, so another one counts as a second mapping (and no single one is trusted).
fn mappings_of(maps: &str, dev: (u64, u64), ino: u64, perms_of_ram: &str) -> Vec<(u64, u64, u64)> {
    let hex = |s: &str| u64::from_str_radix(s, 16).ok();
    maps.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (range, perms, offset, device, inode) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
            let (major, minor) = device.split_once(':')?;
            if (hex(major)?, hex(minor)?) != dev || inode.parse::<u64>().ok()? != ino {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let offset = if perms == perms_of_ram { hex(offset)? } else { u64::MAX };
            Some((hex(start)?, hex(end)?, offset))
        })
        .collect()
}

/// Consecutive true pages as runs.
fn runs_of(changed: impl Iterator<Item = bool>) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (page, changed) in changed.enumerate() {
        if !changed {
            continue;
        }
        match runs.last_mut() {
            Some(run) if run.first + run.pages == page as u64 => run.pages += 1,
            _ => runs.push(Run { first: page as u64, pages: 1 }),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_mappings_of_one_file_by_device_and_inode() {
        let maps = "\
7f7a6ffff000-7f7a8ffff000 rw-p 00000000 fe:00 10175546                   /h/snapshots/t/memory
7f7a8ffff000-7f7a90000000 rw-p 00000000 00:00 0 
7f7b00000000-7f7b00001000 r--p 00002000 fe:00 10175546                   /h/snapshots/t/memory (deleted)
7f7c00000000-7f7c00001000 r--p 00000000 fe:01 10175546                   /other
";
        assert_eq!(mappings_of(maps, (0xfe, 0), 10175546, "rw-p"), vec![(0x7f7a6ffff000, 0x7f7a8ffff000, 0), (0x7f7b00000000, 0x7f7b00001000, u64::MAX)]);
        assert_eq!(mappings_of(maps, (0xfe, 0), 1, "rw-p"), vec![]);
    }

    #[test]
    fn groups_changed_pages_into_runs() {
        let pages = [true, true, false, true, false, false, true, true, true];
        assert_eq!(runs_of(pages.into_iter()), vec![Run { first: 0, pages: 2 }, Run { first: 3, pages: 1 }, Run { first: 6, pages: 3 }]);
        assert_eq!(runs_of([false, false].into_iter()), vec![]);
    }

    #[test]
    fn copies_pages_out_of_and_into_a_processes_memory() {
        // This process's own memory stands in for QEMU's: a buffer of known pages.
        let page = page_size();
        let mut ram: Vec<u8> = (0..4 * page).map(|i| (i / page) as u8 + 1).collect();
        std::hint::black_box(&mut ram);
        let mem = std::fs::OpenOptions::new().read(true).write(true).open("/proc/self/mem").expect("test step");
        let pagemap = std::fs::File::open("/proc/self/pagemap").expect("test step");
        let start = ram.as_ptr() as u64;
        // Not page-aligned in general, which copying does not need.
        let g = GuestRam { start, bytes: 4 * page, page_size: page, pagemap, mem };
        let runs = [Run { first: 1, pages: 1 }, Run { first: 3, pages: 1 }];
        let mut out = Vec::new();
        g.copy_out(&runs, &mut out).expect("test step");
        assert_eq!(out.len() as u64, 2 * page);
        assert!(out[..page as usize].iter().all(|&b| b == 2) && out[page as usize..].iter().all(|&b| b == 4));
        let back: Vec<u8> = std::iter::repeat_n(9u8, 2 * page as usize).collect();
        g.copy_in(&runs, &mut back.as_slice()).expect("test step");
        std::hint::black_box(&mut ram);
        assert_eq!((ram[0], ram[page as usize], ram[2 * page as usize], ram[3 * page as usize]), (1, 9, 3, 9));
        assert!(g.copy_in(&[Run { first: 3, pages: 2 }], &mut back.as_slice()).is_err(), "a run past the end of RAM");
    }
}
