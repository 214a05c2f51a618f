//! What a state file holds, and the layout of the one a pause writes when the guest's
//! RAM is a private mapping of a snapshot's memory file: only the pages that differ
//! from that file, then QEMU's device state. Little-endian throughout:
//!
//! ```text
//! "HUTCHMEM"  version u32  page size u32  RAM bytes u64  runs u64  devices at u64
//! runs × (first page u64, pages u64)      ascending, disjoint, inside RAM
//! the runs' pages, in order
//! blocks u32, then each: name length u32, name, length u64, its bytes
//! QEMU's device state (a migration stream with no RAM section), to the end
//! ```
//!
//! The blocks are QEMU's RAM blocks other than guest RAM (`mem0`): its firmware
//! (`pc.bios`, which microvm's guest can write and where the firmware left the SMBIOS
//! tables the guest's `/sys/firmware/dmi` reads) and the ACPI blobs. A device-only
//! save leaves them out, and a QEMU started to load a state does not fill them.
//!
//! Any other state file is a whole QEMU migration stream (magic `QEVM`). QEMU writes
//! the device state into the file after hutch's part (`guest_ram.rs` has why it is
//! hutch, not QEMU, that writes the pages). The file lives in the sandbox's directory,
//! which a compromised QEMU may reach, so `read` trusts nothing in it: every run must
//! lie inside the RAM the VM has and the lengths must add up to the file's.

use std::io::{Read, Seek, SeekFrom, Write};

const MAGIC: &[u8; 8] = b"HUTCHMEM";
const VERSION: u32 = 1;
const HEADER: u64 = 8 + 4 + 4 + 8 + 8 + 8;
const RUN: u64 = 16;
/// Bounds on the other RAM blocks (microvm has four, ~200 KB in all).
pub const MAX_BLOCKS: usize = 64;
pub const MAX_BLOCK_NAME: usize = 256;
pub const MAX_BLOCK_BYTES: u64 = 64 << 20;
/// The most QEMU's device state (or a whole stream's, beyond its pages) may take.
pub const MAX_DEVICE_STREAM: u64 = 64 << 20;
/// QEMU's migration stream: magic, version 3, then the configuration section's tag when
/// the saving QEMU sent one (`migration.send-configuration`, on by default; QEMU's
/// device-state-only save never writes it).
pub const QEMU_MAGIC: &[u8; 4] = b"QEVM";
const QEMU_CONFIGURATION: u8 = 0x07;

#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("reading the state file")]
    Io(#[from] std::io::Error),
    #[error("the state file is neither hutch's nor a QEMU migration stream")]
    Unknown,
    #[error("the state file is version {0} of hutch's layout, which this hutch does not read")]
    Version(u32),
    #[error("the state file is damaged: {0}")]
    Damaged(String),
}

/// Pages `first .. first + pages` of guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub first: u64,
    pub pages: u64,
}

/// One of QEMU's other RAM blocks in a state file: its bytes are at `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub name: String,
    pub at: u64,
    pub len: u64,
}

/// The changed pages of a state file, as its header describes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangedPages {
    pub page_size: u64,
    pub ram_bytes: u64,
    pub runs: Vec<Run>,
    /// Where the first run's pages start.
    pub pages_at: u64,
    pub blocks: Vec<Block>,
    /// Where QEMU's device state starts.
    pub devices_at: u64,
}

impl ChangedPages {
    pub fn pages(&self) -> u64 {
        self.runs.iter().map(|r| r.pages).sum()
    }
}

/// What a state file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Form {
    /// A whole migration stream, RAM included (or RAM left out as shared, for a template).
    Whole,
    /// The pages that differ from the memory file the VM maps, then device state.
    Changes(ChangedPages),
}

/// A state file read: its form and where QEMU's stream begins in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateFile {
    pub form: Form,
    /// Whether QEMU's stream carries a configuration section: the QEMU that loads it
    /// must expect one exactly when it does (`-global migration.send-configuration`).
    pub configuration: bool,
}

impl StateFile {
    pub fn stream_at(&self) -> u64 {
        match &self.form {
            Form::Whole => 0,
            Form::Changes(c) => c.devices_at,
        }
    }
}

/// Reads what `file` holds, for a VM of `ram_bytes` of RAM; its position afterwards
/// is unspecified. QEMU wrote part or all of it and decides its length, so nothing is
/// allocated beyond entries read and checked, and the file may be only so much larger
/// than the VM's RAM.
pub fn read(file: &mut std::fs::File, page_size: u64, ram_bytes: u64) -> Result<StateFile, StateFileError> {
    let len = file.metadata()?.len();
    let mut magic = [0u8; 8];
    file.seek(SeekFrom::Start(0))?;
    read_up_to(file, &mut magic)?;
    if magic[..4] == *QEMU_MAGIC {
        // Every page at most once, each with its 8-byte header, then device state.
        let most = ram_bytes + ram_bytes / 256 + MAX_DEVICE_STREAM;
        if len > most {
            return Err(damaged(&format!("it is {} MiB, more than a stream of {} MiB of RAM can be", len >> 20, ram_bytes >> 20)));
        }
        return Ok(StateFile { form: Form::Whole, configuration: configuration_at(file, 0)? });
    }
    if magic != *MAGIC {
        return Err(StateFileError::Unknown);
    }
    let mut rest = [0u8; (HEADER - 8) as usize];
    file.read_exact(&mut rest).map_err(|_| damaged("its header is cut short"))?;
    let u32_at = |i: usize| u32::from_le_bytes(rest[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(rest[i..i + 8].try_into().expect("8 bytes"));
    let version = u32_at(0);
    if version != VERSION {
        return Err(StateFileError::Version(version));
    }
    let (saved_page_size, saved_ram, count, devices_at) = (u64::from(u32_at(4)), u64_at(8), u64_at(16), u64_at(24));
    if saved_page_size != page_size {
        return Err(damaged(&format!("it was saved with {saved_page_size}-byte pages, and this host's are {page_size}")));
    }
    if saved_ram != ram_bytes || !ram_bytes.is_multiple_of(page_size) {
        return Err(damaged(&format!("it was saved from {} MiB of RAM, and this VM has {} MiB", saved_ram >> 20, ram_bytes >> 20)));
    }
    let ram_pages = ram_bytes / page_size;
    let table = count.checked_mul(RUN).filter(|t| count <= ram_pages && HEADER + t <= len).ok_or_else(|| damaged("its table of runs is longer than the file"))?;
    // Read and checked entry by entry: the list grows only with runs that are valid.
    let mut entries = std::io::BufReader::new(std::io::Read::take(&mut *file, table));
    let mut runs = Vec::new();
    let mut end = 0u64;
    let mut entry = [0u8; RUN as usize];
    for _ in 0..count {
        entries.read_exact(&mut entry).map_err(|_| damaged("its table of runs is cut short"))?;
        let run = Run { first: u64::from_le_bytes(entry[..8].try_into().expect("8 bytes")), pages: u64::from_le_bytes(entry[8..].try_into().expect("8 bytes")) };
        let last = run.first.checked_add(run.pages).filter(|&last| run.pages > 0 && run.first >= end && last <= ram_pages);
        end = last.ok_or_else(|| damaged(&format!("a run of {} pages at page {} overlaps another or lies outside {ram_pages} pages of RAM", run.pages, run.first)))?;
        runs.push(run);
    }
    let pages_at = HEADER + table;
    let total: u64 = runs.iter().map(|r| r.pages).sum();
    // Runs are disjoint and inside RAM, so `total` pages fit in `ram_bytes`.
    let blocks_at = (total * page_size).checked_add(pages_at).filter(|&at| at <= devices_at && devices_at <= len);
    let Some(blocks_at) = blocks_at.filter(|_| len - devices_at <= MAX_DEVICE_STREAM) else {
        return Err(damaged("its pages do not end before its device state starts, or that state is too long"));
    };
    file.seek(SeekFrom::Start(blocks_at))?;
    let blocks = read_blocks(&mut std::io::Read::take(&mut *file, devices_at - blocks_at), blocks_at, devices_at)?;
    let configuration = configuration_at(file, devices_at)?;
    Ok(StateFile { form: Form::Changes(ChangedPages { page_size, ram_bytes, runs, pages_at, blocks, devices_at }), configuration })
}

/// The blocks between `at` and `end`, which they must fill exactly.
fn read_blocks(input: &mut impl Read, mut at: u64, end: u64) -> Result<Vec<Block>, StateFileError> {
    let cut = |_| damaged("its RAM blocks are cut short");
    let mut n4 = [0u8; 4];
    input.read_exact(&mut n4).map_err(cut)?;
    at += 4;
    let count = u32::from_le_bytes(n4) as usize;
    if count > MAX_BLOCKS {
        return Err(damaged(&format!("it lists {count} RAM blocks")));
    }
    let mut blocks = Vec::with_capacity(count);
    let mut total = 0u64;
    for _ in 0..count {
        input.read_exact(&mut n4).map_err(cut)?;
        let name_len = u32::from_le_bytes(n4) as usize;
        if name_len > MAX_BLOCK_NAME {
            return Err(damaged("a RAM block's name is too long"));
        }
        let mut name = vec![0u8; name_len];
        input.read_exact(&mut name).map_err(cut)?;
        let name = String::from_utf8(name).map_err(|_| damaged("a RAM block's name is not text"))?;
        let mut n8 = [0u8; 8];
        input.read_exact(&mut n8).map_err(cut)?;
        let len = u64::from_le_bytes(n8);
        total = total.saturating_add(len);
        at += 4 + name_len as u64 + 8;
        if total > MAX_BLOCK_BYTES || at + len > end {
            return Err(damaged("its RAM blocks are larger than the file or the bound"));
        }
        std::io::copy(&mut input.take(len), &mut std::io::sink())?;
        blocks.push(Block { name, at, len });
        at += len;
    }
    if at != end {
        return Err(damaged("its RAM blocks do not end where its device state starts"));
    }
    Ok(blocks)
}

/// Whether the state file at `path` holds only the pages that differ from a memory
/// file, which the VM (of `ram_bytes`) that loads it must then map again; checked
/// whole. Any other file is the backend's own business.
pub fn needs_memory_file(path: &std::path::Path, ram_bytes: u64) -> Result<bool, StateFileError> {
    if !is_changed_pages(path)? {
        return Ok(false);
    }
    read(&mut std::fs::File::open(path)?, page_size(), ram_bytes).map(|_| true)
}

/// Whether the state file at `path` says it holds changed pages (its magic alone).
pub fn is_changed_pages(path: &std::path::Path) -> Result<bool, StateFileError> {
    let mut magic = [0u8; 8];
    Ok(read_up_to(&mut std::fs::File::open(path)?, &mut magic)? == magic.len() && magic == *MAGIC)
}

/// Writes the header and table for `runs` (and `blocks`, written by `write_blocks`
/// after the pages) at the start of `out`, leaving it where the pages go; returns
/// where the device state will start.
pub fn write_header(out: &mut impl Write, page_size: u64, ram_bytes: u64, runs: &[Run], blocks: &[(String, Vec<u8>)]) -> std::io::Result<u64> {
    let pages: u64 = runs.iter().map(|r| r.pages).sum();
    let blocks_len: u64 = 4 + blocks.iter().map(|(name, data)| 4 + name.len() as u64 + 8 + data.len() as u64).sum::<u64>();
    let devices_at = HEADER + RUN * runs.len() as u64 + pages * page_size + blocks_len;
    let mut head = Vec::with_capacity((HEADER + RUN * runs.len() as u64) as usize);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&u32::try_from(page_size).map_err(std::io::Error::other)?.to_le_bytes());
    for n in [ram_bytes, runs.len() as u64, devices_at] {
        head.extend_from_slice(&n.to_le_bytes());
    }
    for run in runs {
        head.extend_from_slice(&run.first.to_le_bytes());
        head.extend_from_slice(&run.pages.to_le_bytes());
    }
    out.write_all(&head)?;
    Ok(devices_at)
}

/// Writes QEMU's other RAM blocks, after the pages.
pub fn write_blocks(out: &mut impl Write, blocks: &[(String, Vec<u8>)]) -> std::io::Result<()> {
    out.write_all(&(blocks.len() as u32).to_le_bytes())?;
    for (name, data) in blocks {
        out.write_all(&(name.len() as u32).to_le_bytes())?;
        out.write_all(name.as_bytes())?;
        out.write_all(&(data.len() as u64).to_le_bytes())?;
        out.write_all(data)?;
    }
    Ok(())
}

/// Whether the QEMU stream at `at` starts with a configuration section.
fn configuration_at(file: &mut std::fs::File, at: u64) -> Result<bool, StateFileError> {
    let mut head = [0u8; 9];
    file.seek(SeekFrom::Start(at))?;
    if read_up_to(file, &mut head)? < head.len() || head[..4] != *QEMU_MAGIC {
        return Err(StateFileError::Damaged("its QEMU stream does not start with QEMU's magic".into()));
    }
    Ok(head[8] == QEMU_CONFIGURATION)
}

/// The host page size: what pagemap counts in, and what a state's pages are.
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().and_then(|n| u64::try_from(n).ok()).unwrap_or(4096)
}

fn read_up_to(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

fn damaged(why: &str) -> StateFileError {
    StateFileError::Damaged(why.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;
    /// A device stream as QEMU's device-only save starts it (no configuration section).
    const DEVICES: &[u8] = b"QEVM\0\0\0\x03\x04rest";

    fn file_with(runs: &[Run], ram: u64, tail: &[u8]) -> std::fs::File {
        let blocks = [("pc.bios".to_string(), vec![5u8; 3])];
        let mut f = tempfile::tempfile().expect("test step");
        write_header(&mut f, PAGE, ram, runs, &blocks).expect("test step");
        let pages: u64 = runs.iter().map(|r| r.pages).sum();
        f.write_all(&vec![7u8; (pages * PAGE) as usize]).expect("test step");
        write_blocks(&mut f, &blocks).expect("test step");
        f.write_all(tail).expect("test step");
        f
    }

    #[test]
    fn reads_back_what_it_wrote() {
        let runs = [Run { first: 0, pages: 2 }, Run { first: 5, pages: 1 }];
        let state = read(&mut file_with(&runs, 16 * PAGE, DEVICES), PAGE, 16 * PAGE).expect("test step");
        let Form::Changes(c) = &state.form else { panic!("not changes: {state:?}") };
        assert_eq!(c.runs, runs);
        assert_eq!((c.pages(), c.ram_bytes, c.pages_at), (3, 16 * PAGE, HEADER + 2 * RUN));
        let blocks_at = HEADER + 2 * RUN + 3 * PAGE;
        assert_eq!(c.blocks, vec![Block { name: "pc.bios".into(), at: blocks_at + 4 + 4 + 7 + 8, len: 3 }]);
        assert_eq!(state.stream_at(), blocks_at + 4 + 4 + 7 + 8 + 3);
        assert!(!state.configuration);
    }

    #[test]
    fn tells_a_whole_stream_and_its_configuration_section() {
        let mut f = tempfile::tempfile().expect("test step");
        f.write_all(b"QEVM\0\0\0\x03\x07\0\0\0\x06microvm").expect("test step");
        assert_eq!(read(&mut f, PAGE, 16 * PAGE).expect("test step"), StateFile { form: Form::Whole, configuration: true });
        let mut f = tempfile::tempfile().expect("test step");
        f.write_all(b"not a state").expect("test step");
        assert!(matches!(read(&mut f, PAGE, 16 * PAGE), Err(StateFileError::Unknown)));
    }

    #[test]
    fn refuses_runs_outside_ram_overlapping_or_unaccounted_for() {
        let bad = |runs: &[Run], ram: u64, tail: &[u8]| read(&mut file_with(runs, ram, tail), PAGE, ram).expect_err("refused");
        assert!(matches!(bad(&[Run { first: 15, pages: 2 }], 16 * PAGE, DEVICES), StateFileError::Damaged(_)));
        assert!(matches!(bad(&[Run { first: 0, pages: 2 }, Run { first: 1, pages: 1 }], 16 * PAGE, DEVICES), StateFileError::Damaged(_)));
        assert!(matches!(bad(&[Run { first: 0, pages: 0 }], 16 * PAGE, DEVICES), StateFileError::Damaged(_)));
        assert!(matches!(bad(&[Run { first: u64::MAX, pages: 2 }], 16 * PAGE, DEVICES), StateFileError::Damaged(_)));
        // Device state missing after the pages.
        assert!(matches!(bad(&[Run { first: 0, pages: 1 }], 16 * PAGE, b""), StateFileError::Damaged(_)));
        // A block claiming more bytes than lie before the device state.
        let mut f = file_with(&[Run { first: 0, pages: 1 }], 16 * PAGE, DEVICES);
        let len_at = HEADER + RUN + PAGE + 4 + 4 + 7;
        f.seek(SeekFrom::Start(len_at)).expect("test step");
        f.write_all(&100u64.to_le_bytes()).expect("test step");
        assert!(matches!(read(&mut f, PAGE, 16 * PAGE), Err(StateFileError::Damaged(_))));
        // A table claiming more runs than the file holds is refused before allocating.
        let mut f = file_with(&[Run { first: 0, pages: 1 }], 1 << 40, DEVICES);
        f.seek(SeekFrom::Start(24)).expect("test step");
        f.write_all(&(1u64 << 27).to_le_bytes()).expect("test step");
        assert!(matches!(read(&mut f, PAGE, 1 << 40), Err(StateFileError::Damaged(_))));
        // Saved from another size of RAM than the VM's.
        assert!(matches!(read(&mut file_with(&[Run { first: 0, pages: 1 }], 16 * PAGE, DEVICES), PAGE, 32 * PAGE), Err(StateFileError::Damaged(_))));
        // A whole stream far longer than the VM's RAM could make it.
        let mut f = tempfile::tempfile().expect("test step");
        f.write_all(b"QEVM\0\0\0\x03\x07").expect("test step");
        f.set_len(1 << 30).expect("test step");
        assert!(matches!(read(&mut f, PAGE, 16 * PAGE), Err(StateFileError::Damaged(_))));
    }
}
