//! An inspected request's body on its way to the server, scanned for secrets'
//! placeholders: hutch never fills one in a body, so one there ends the request before
//! the chunk holding it is sent.

use crate::scan::{Form, Scanner};
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub struct Scanned {
    inner: Incoming,
    /// None when the sandbox's rules name no secret.
    scanner: Option<Scanner>,
    /// Set when a placeholder ended the body, for the request's refusal.
    pub found: Arc<OnceLock<Form>>,
}

impl Scanned {
    pub fn new(inner: Incoming, scan: bool) -> Scanned {
        Scanned { inner, scanner: scan.then(Scanner::default), found: Arc::default() }
    }
}

impl Body for Scanned {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let Some(scanner) = &mut this.scanner {
            let found = match (frame.data_ref(), frame.trailers_ref()) {
                (Some(data), _) => scanner.feed(data),
                (None, Some(trailers)) => trailers.values().find_map(|v| crate::scan::find(v.as_bytes())),
                (None, None) => None,
            };
            if let Some(form) = found {
                let _ = this.found.set(form);
                return Poll::Ready(Some(Err("a secret's placeholder in the request's body".into())));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
