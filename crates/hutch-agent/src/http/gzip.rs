//! envd's gzip on `/files`: an upload with `Content-Encoding: gzip` is inflated as it
//! streams in; a download whose client accepts gzip is deflated as it streams out.
//! flate2's push-style coders work a chunk at a time, so neither side is buffered.

use bytes::Bytes;
use flate2::write::{GzEncoder, MultiGzDecoder};
use futures::{Stream, StreamExt};
use std::io::Write;

/// How an upload's body is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Identity,
    Gzip,
}

/// The upload's `Content-Encoding`: none or `identity` is raw; anything but gzip is
/// refused, in envd's words.
pub fn upload_encoding(header: Option<&str>) -> Result<Encoding, String> {
    match header.map(|h| h.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("identity") => Ok(Encoding::Identity),
        Some("gzip") | Some("x-gzip") => Ok(Encoding::Gzip),
        Some(other) => Err(format!("unsupported Content-Encoding: {other}, supported: [gzip]")),
    }
}

/// Whether a download should be gzipped: the client accepts gzip (with a non-zero q).
pub fn accepts_gzip(header: Option<&str>) -> bool {
    header.is_some_and(|h| {
        h.split(',').any(|part| {
            let mut fields = part.split(';').map(str::trim);
            let name = fields.next().unwrap_or("").to_ascii_lowercase();
            let q = fields.find_map(|f| f.strip_prefix("q=")).and_then(|q| q.parse::<f32>().ok()).unwrap_or(1.0);
            (name == "gzip" || name == "x-gzip") && q > 0.0
        })
    })
}

/// `data` inflated (several gzip members one after another too, as Go's reader in
/// envd takes them): a corrupt or truncated gzip stream ends it with an error.
pub fn inflate<S, E>(data: S) -> impl Stream<Item = std::io::Result<Bytes>> + Unpin + Send
where
    S: Stream<Item = Result<Bytes, E>> + Unpin + Send + 'static,
    E: std::fmt::Display,
{
    code(data, MultiGzDecoder::new(Vec::new()), |d| d.get_mut(), |d| {
        // Ends the last member; one cut short is an error.
        d.try_finish()?;
        Ok(std::mem::take(d.get_mut()))
    })
}

/// `data` deflated at gzip's fastest level: the guest may be emulated, and the link is
/// local or the server's.
pub fn deflate<S, E>(data: S) -> impl Stream<Item = std::io::Result<Bytes>> + Unpin + Send
where
    S: Stream<Item = Result<Bytes, E>> + Unpin + Send + 'static,
    E: std::fmt::Display,
{
    code(data, GzEncoder::new(Vec::new(), flate2::Compression::fast()), |e| e.get_mut(), |e| e.try_finish().map(|()| std::mem::take(e.get_mut())))
}

/// Runs each chunk of `data` through `coder` (a writer into a Vec), yielding what it
/// produced; `finish` flushes the coder's tail at the end.
fn code<S, E, C>(
    data: S,
    coder: C,
    output: fn(&mut C) -> &mut Vec<u8>,
    finish: fn(&mut C) -> std::io::Result<Vec<u8>>,
) -> impl Stream<Item = std::io::Result<Bytes>> + Unpin + Send
where
    S: Stream<Item = Result<Bytes, E>> + Unpin + Send + 'static,
    E: std::fmt::Display,
    C: Write + Unpin + Send + 'static,
{
    Box::pin(futures::stream::unfold(Some((data, coder)), move |state| async move {
        let (mut data, mut coder) = state?;
        loop {
            match data.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = coder.write_all(&chunk) {
                        return Some((Err(e), None));
                    }
                    let out = std::mem::take(output(&mut coder));
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), Some((data, coder))));
                    }
                }
                Some(Err(e)) => return Some((Err(std::io::Error::other(e.to_string())), None)),
                None => {
                    return match finish(&mut coder) {
                        Ok(tail) if tail.is_empty() => None,
                        Ok(tail) => Some((Ok(Bytes::from(tail)), None)),
                        Err(e) => Some((Err(e), None)),
                    };
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(data: &[u8], size: usize) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Unpin + Send + 'static {
        futures::stream::iter(data.chunks(size).map(|c| Ok(Bytes::copy_from_slice(c))).collect::<Vec<_>>())
    }

    async fn collect(s: impl Stream<Item = std::io::Result<Bytes>> + Unpin) -> std::io::Result<Vec<u8>> {
        let parts: Vec<Bytes> = futures::TryStreamExt::try_collect(s).await?;
        Ok(parts.concat())
    }

    #[tokio::test]
    async fn a_round_trip_in_small_chunks_gives_the_bytes_back() {
        let original: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let packed = collect(deflate(chunks(&original, 1000))).await.expect("deflate");
        assert!(packed.starts_with(&[0x1f, 0x8b]), "a gzip stream");
        let mut plain = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&packed[..]), &mut plain).expect("gunzip");
        assert_eq!(plain, original, "standard gunzip reads it");
        let back = collect(inflate(chunks(&packed, 7))).await.expect("inflate");
        assert_eq!(back, original);
    }

    #[tokio::test]
    async fn concatenated_members_inflate_to_their_concatenation() {
        let mut both = collect(deflate(chunks(b"first ", 3))).await.expect("deflate");
        both.extend(collect(deflate(chunks(b"second", 3))).await.expect("deflate"));
        assert_eq!(collect(inflate(chunks(&both, 5))).await.expect("inflate"), b"first second");
    }

    #[tokio::test]
    async fn a_truncated_or_foreign_upload_is_an_error() {
        let packed = collect(deflate(chunks(b"hello hello hello", 4))).await.expect("deflate");
        assert!(collect(inflate(chunks(&packed[..packed.len() - 6], 3))).await.is_err(), "truncated");
        assert!(collect(inflate(chunks(b"not gzip at all", 5))).await.is_err(), "not gzip");
    }

    #[test]
    fn encodings_are_read_like_envd() {
        assert_eq!(upload_encoding(None), Ok(Encoding::Identity));
        assert_eq!(upload_encoding(Some("GZIP")), Ok(Encoding::Gzip));
        assert!(upload_encoding(Some("br")).expect_err("refused").contains("supported: [gzip]"));
        assert!(accepts_gzip(Some("gzip, deflate, br")));
        assert!(accepts_gzip(Some("deflate;q=0.5, gzip;q=0.8")));
        assert!(!accepts_gzip(Some("gzip;q=0")));
        assert!(!accepts_gzip(Some("identity")));
        assert!(!accepts_gzip(None));
    }

}
