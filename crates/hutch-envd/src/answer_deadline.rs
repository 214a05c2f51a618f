//! A deadline on the agent's answer that starts once the request has been sent whole.
//! A deadline from the start would cut off a slow upload (the agent answers a file
//! write after its body); none at all lets a wedged guest hold the caller forever.

use crate::client::AgentClient;
use crate::error::{AgentError, Body};
use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;

/// A request body that says when it has been read to its end.
struct Watched {
    inner: Body,
    ended: Option<oneshot::Sender<()>>,
}

impl Watched {
    fn signal(&mut self) {
        if let Some(ended) = self.ended.take() {
            let _ = ended.send(());
        }
    }
}

impl hyper::body::Body for Watched {
    type Data = Bytes;
    type Error = crate::error::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        // hyper may stop polling after the last frame once the body says it has ended.
        if matches!(polled, Poll::Ready(None)) || (matches!(polled, Poll::Ready(Some(Ok(_)))) && self.inner.is_end_stream()) {
            self.signal();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl AgentClient {
    /// Sends `req` and waits for the answer's head at most `limit` after the request's
    /// body has been sent whole (the response body, a stream, has no deadline).
    pub async fn send_answered_within(&self, req: Request<Body>, limit: Duration) -> Result<http::Response<Incoming>, AgentError> {
        let (parts, body) = req.into_parts();
        let (ended, sent) = oneshot::channel();
        let mut watched = Watched { inner: body, ended: Some(ended) };
        if hyper::body::Body::is_end_stream(&watched.inner) {
            // An empty body may never be polled.
            watched.signal();
        }
        let answer = self.send(Request::from_parts(parts, watched.boxed_unsync()));
        tokio::pin!(answer);
        tokio::select! {
            answered = &mut answer => return answered,
            // Dropped before its end (the exchange failed or ended): no deadline to start.
            whole = sent => if whole.is_err() { return answer.await },
        }
        match tokio::time::timeout(limit, answer).await {
            Ok(answered) => answered,
            Err(_) => Err(AgentError::Timeout { what: "the request".into(), secs: limit.as_secs() }),
        }
    }
}
