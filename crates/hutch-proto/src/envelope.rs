//! Connect streaming envelopes: 1 flag byte, 4-byte big-endian length, payload.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Flag of the last envelope of a stream; its payload is the end-of-stream JSON.
pub const END_STREAM: u8 = 0x02;
/// Flag of a compressed message; hutch never negotiates compression.
pub const COMPRESSED: u8 = 0x01;
/// Largest message hutch accepts in one envelope.
pub const MAX_MESSAGE: usize = 16 << 20;

pub fn encode(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.put_u8(flags);
    out.put_u32(payload.len() as u32);
    out.put_slice(payload);
    out.freeze()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

impl Envelope {
    pub fn is_end_stream(&self) -> bool {
        self.flags & END_STREAM != 0
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    TooLarge(usize),
    Compressed,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLarge(n) => write!(f, "envelope of {n} bytes exceeds the {MAX_MESSAGE}-byte limit"),
            Self::Compressed => write!(f, "compressed envelopes are not supported"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Incremental decoder: feed body chunks, take whole envelopes out.
#[derive(Default)]
pub struct Decoder {
    buf: BytesMut,
}

impl Decoder {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, DecodeError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(DecodeError::TooLarge(len));
        }
        if flags & COMPRESSED != 0 {
            return Err(DecodeError::Compressed);
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// Bytes received that do not yet form a whole envelope.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_in_pieces() {
        let a = encode(0, b"{\"a\":1}");
        let b = encode(END_STREAM, b"{}");
        let all: Vec<u8> = [a.as_ref(), b.as_ref()].concat();
        let mut d = Decoder::default();
        let mut got = Vec::new();
        for byte in all {
            d.push(&[byte]);
            while let Some(e) = d.next_envelope().expect("valid") {
                got.push(e);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(&got[0].payload[..], b"{\"a\":1}");
        assert!(!got[0].is_end_stream());
        assert!(got[1].is_end_stream());
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn rejects_oversized_and_compressed() {
        let mut d = Decoder::default();
        d.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next_envelope(), Err(DecodeError::TooLarge(0xffff_ffff)));
        let mut d = Decoder::default();
        d.push(&encode(COMPRESSED, b"x"));
        assert_eq!(d.next_envelope(), Err(DecodeError::Compressed));
    }
}
