//! A writer for the "newc" cpio format the kernel unpacks as its initramfs.
//! Hand-written because it is tiny (a fixed ASCII header per entry) and lets us add
//! device nodes and set owners without root.

use std::io::{self, Write};

pub struct Writer<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
}

pub enum Kind<'a> {
    Dir,
    File(&'a [u8]),
    /// A character device with its major and minor numbers.
    CharDev(u32, u32),
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Self {
        Writer { out, written: 0, next_ino: 1 }
    }

    fn put(&mut self, data: &[u8]) -> io::Result<()> {
        self.out.write_all(data)?;
        self.written += data.len() as u64;
        Ok(())
    }

    fn pad4(&mut self) -> io::Result<()> {
        let pad = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..pad])
    }

    /// Adds one entry, owned by root; `name` has no leading slash.
    pub fn add(&mut self, name: &str, mode: u32, kind: Kind<'_>) -> io::Result<()> {
        let (type_bits, data, (rmaj, rmin)): (u32, &[u8], (u32, u32)) = match kind {
            Kind::Dir => (0o040000, &[], (0, 0)),
            Kind::File(d) => (0o100000, d, (0, 0)),
            Kind::CharDev(maj, min) => (0o020000, &[], (maj, min)),
        };
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if matches!(kind_tag(type_bits), 'd') { 2 } else { 1 };
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}{dmaj:08x}{dmin:08x}{rmaj:08x}{rmin:08x}{namesize:08x}{check:08x}",
            mode = type_bits | (mode & 0o7777),
            uid = 0,
            gid = 0,
            mtime = 0,
            size = data.len(),
            dmaj = 0,
            dmin = 0,
            namesize = name.len() + 1,
            check = 0,
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad4()?;
        self.put(data)?;
        self.pad4()
    }

    pub fn finish(mut self) -> io::Result<W> {
        self.next_ino = 0;
        self.add("TRAILER!!!", 0, Kind::File(&[]))?;
        Ok(self.out)
    }
}

fn kind_tag(type_bits: u32) -> char {
    if type_bits == 0o040000 {
        'd'
    } else {
        '-'
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_terminated() {
        let mut w = Writer::new(Vec::new());
        w.add("init", 0o755, Kind::File(b"abc")).expect("add");
        w.add("dev", 0o755, Kind::Dir).expect("add");
        w.add("dev/console", 0o600, Kind::CharDev(5, 1)).expect("add");
        let out = w.finish().expect("finish");
        assert_eq!(out.len() % 4, 0);
        assert!(out.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("init\0"));
        assert!(text.contains("TRAILER!!!\0"));
        // header (110) + "init\0" (5) padded to 116, then "abc" padded to 4
        assert_eq!(&out[116..119], b"abc");
    }
}
