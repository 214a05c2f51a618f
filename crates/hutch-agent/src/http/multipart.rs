//! A multipart body handed to multer with its first boundary already read.
//!
//! multer 3.1 loses a whole valid body in one race: when its first look finds no
//! `--boundary` yet, it polls the body again and, if that poll brings the rest of the
//! body *and its end*, answers "incomplete multipart stream" without looking at what
//! it just read. On a multi-threaded runtime the rest of a small upload can land in
//! that gap (the agent saw it about once per few hundred small E2B uploads). Every
//! later stage reads the buffer only after polling to Pending or the end, so once the
//! first boundary is in multer's first chunk the race is gone.

use futures::{stream, Stream, StreamExt};
use std::pin::Pin;

pub type Body = Pin<Box<dyn Stream<Item = std::io::Result<bytes::Bytes>> + Send>>;

/// How much is read ahead looking for the first boundary: a preamble longer than this
/// (clients send none) goes to multer as it comes.
const LOOKAHEAD: usize = 64 * 1024;

/// `body` with everything up to and including its first `--boundary` (or its first
/// [`LOOKAHEAD`] bytes, or all of it) as the first chunk.
pub async fn first_boundary_read(mut body: Body, boundary: &str) -> Body {
    let marker = format!("--{boundary}");
    let finder = memchr::memmem::Finder::new(marker.as_bytes());
    let mut head = bytes::BytesMut::new();
    while finder.find(&head).is_none() && head.len() < LOOKAHEAD {
        match body.next().await {
            Some(Ok(chunk)) => head.extend_from_slice(&chunk),
            Some(Err(e)) => return Box::pin(stream::iter([Ok(head.freeze()), Err(e)])),
            None => return Box::pin(stream::iter([Ok(head.freeze())])),
        }
    }
    Box::pin(stream::iter([Ok(head.freeze())]).chain(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime")
    }

    const BOUNDARY: &str = "5af99fd917af9b093a65b95a45363267";

    /// The body of the SDK upload that failed in CI (e2b 2.45.1 writing hello.c).
    fn body() -> String {
        let b = BOUNDARY;
        format!(
            "--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/hello.c\"\r\n\
             Content-Type: text/x-csrc\r\n\r\n#include <stdio.h>\nint main(void) {{ puts(\"compiled\"); return 0; }}\n\r\n--{b}--\r\n"
        )
    }

    /// `body` cut at `cuts`, the body stream answering Pending once before each piece
    /// whose bit is set in `pending`: the gap the race needs.
    fn pieces(body: &str, cuts: [usize; 2], pending: u32) -> Body {
        let b = body.as_bytes();
        let parts = vec![&b[..cuts[0]], &b[cuts[0]..cuts[1]], &b[cuts[1]..]];
        let parts: Vec<bytes::Bytes> = parts.into_iter().map(bytes::Bytes::copy_from_slice).collect();
        Box::pin(stream::unfold((0u32, parts.into_iter()), move |(k, mut rest)| async move {
            if pending & (1 << k) != 0 {
                tokio::task::yield_now().await;
            }
            rest.next().map(|piece| (Ok(piece), (k + 1, rest)))
        }))
    }

    async fn file_bytes(body: Body) -> Result<usize, multer::Error> {
        let mut parts = multer::Multipart::new(body, BOUNDARY);
        let mut n = 0;
        while let Some(mut field) = parts.next_field().await? {
            while let Some(chunk) = field.chunk().await? {
                n += chunk.len();
            }
        }
        Ok(n)
    }

    /// Every way of cutting the body in three, with every pattern of pauses: multer
    /// alone fails some of them (the race this module exists for); none fail once the
    /// first boundary is read ahead.
    #[test]
    fn every_cut_and_pause_parses() {
        let body = body();
        let rt = runtime();
        let (mut bare_failures, mut failures) = (0, Vec::new());
        for first in 0..=body.len() {
            for second in first..=body.len() {
                for pending in 0..8 {
                    if rt.block_on(file_bytes(pieces(&body, [first, second], pending))).ok() != Some(66) {
                        bare_failures += 1;
                    }
                    let read_ahead = rt.block_on(async { file_bytes(first_boundary_read(pieces(&body, [first, second], pending), BOUNDARY).await).await });
                    if read_ahead.as_ref().ok() != Some(&66) {
                        failures.push((first, second, pending, read_ahead.map_err(|e| e.to_string())));
                    }
                }
            }
        }
        assert!(bare_failures > 0, "multer alone no longer fails: this module may be unneeded");
        assert!(failures.is_empty(), "{} cuts fail, first: {:?}", failures.len(), &failures[..failures.len().min(5)]);
    }

    #[test]
    fn a_body_without_its_boundary_still_fails_cleanly() {
        let rt = runtime();
        let body = pieces("no boundary here", [3, 7], 0b101);
        let read = rt.block_on(async { file_bytes(first_boundary_read(body, BOUNDARY).await).await });
        assert!(matches!(read, Err(multer::Error::IncompleteStream)), "{read:?}");
    }

    #[test]
    fn an_error_while_reading_ahead_reaches_multer() {
        let rt = runtime();
        let body: Body = Box::pin(stream::iter([Ok(bytes::Bytes::from_static(b"--5af9")), Err(std::io::Error::other("cut"))]));
        let read = rt.block_on(async { file_bytes(first_boundary_read(body, BOUNDARY).await).await });
        assert!(matches!(read, Err(multer::Error::StreamReadFailed(_))), "{read:?}");
    }
}
