//! QEMU's RAM blocks as QMP `x-query-ramblock` lists them (the text of HMP's `info
//! ramblock`): a pause that saves guest RAM (`mem0`) itself saves the others too
//! (`saved_state.rs` says why), and its resume writes them back where the new QEMU
//! has them.

use crate::saved_state::{MAX_BLOCKS, MAX_BLOCK_BYTES, MAX_BLOCK_NAME};

/// The memory backend's block: guest RAM, which the pause saves by pages.
pub const GUEST_RAM: &str = "mem0";

/// One RAM block: where QEMU maps it and how much of it is in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamBlock {
    pub name: String,
    pub used: u64,
    pub host_addr: u64,
}

/// The blocks other than guest RAM in `text`, refused beyond the state file's bounds.
/// Each line reads `name  psize unit  offset  used  total  hva  ro|rw` (hex numbers).
pub fn others(text: &str) -> Result<Vec<RamBlock>, String> {
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let mut blocks = Vec::new();
    for line in text.lines().skip(1) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() < 8 {
            continue;
        }
        let n = words.len();
        let name = words[..n - 7].join(" ");
        let (Some(used), Some(host_addr)) = (hex(words[n - 4]), hex(words[n - 2])) else {
            return Err(format!("a line QEMU lists its RAM blocks with does not read as one: {line:?}"));
        };
        if name != GUEST_RAM {
            blocks.push(RamBlock { name, used, host_addr });
        }
    }
    let total: u64 = blocks.iter().map(|b| b.used).fold(0, u64::saturating_add);
    if blocks.len() > MAX_BLOCKS || total > MAX_BLOCK_BYTES || blocks.iter().any(|b| b.name.len() > MAX_BLOCK_NAME) {
        return Err(format!("QEMU lists {} RAM blocks of {total} bytes besides guest RAM, more than a state holds", blocks.len()));
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_blocks_besides_guest_ram() {
        let text = "              Block Name    PSize              Offset               Used              Total                HVA  RO\r\n                    mem0    4 KiB  0x0000000000000000 0x0000000010000000 0x0000000010000000 0x00007f396ffff000  rw\r\n    /rom@etc/acpi/tables    4 KiB  0x0000000010040000 0x0000000000001000 0x0000000000200000 0x00007f396ea00000  ro\r\n                 pc.bios    4 KiB  0x0000000010000000 0x0000000000020000 0x0000000000020000 0x00007f39c4400000  rw\r\n";
        assert_eq!(
            others(text).expect("test step"),
            vec![
                RamBlock { name: "/rom@etc/acpi/tables".into(), used: 0x1000, host_addr: 0x7f396ea00000 },
                RamBlock { name: "pc.bios".into(), used: 0x20000, host_addr: 0x7f39c4400000 },
            ]
        );
        let huge = "h\nbig 4 KiB 0x0 0x10000000 0x10000000 0x7f0000000000 rw\n";
        assert!(others(huge).is_err());
    }
}
