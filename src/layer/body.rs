use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The request body the inner service receives: the original stream for
    /// uncovered requests, or the bytes the layer buffered.
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        inner: RequestInner<B>,
    }
}

pin_project! {
    #[project = RequestBodyProj]
    #[derive(Debug)]
    enum RequestInner<B> {
        /// Buffered by the layer.
        Buffered { bytes: Option<Bytes> },
        /// Passed through untouched.
        Streaming { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        RequestBody {
            inner: RequestInner::Buffered {
                bytes: non_empty(bytes),
            },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        RequestBody {
            inner: RequestInner::Streaming { body },
        }
    }
}

impl<B: Body<Data = Bytes>> Body for RequestBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().inner.project() {
            RequestBodyProj::Buffered { bytes } => {
                Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b))))
            }
            RequestBodyProj::Streaming { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            RequestInner::Buffered { bytes } => bytes.is_none(),
            RequestInner::Streaming { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            RequestInner::Buffered { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            RequestInner::Streaming { body } => body.size_hint(),
        }
    }
}

pin_project! {
    /// The response body the caller receives: the inner body untouched, a
    /// stored or buffered body, or a buffered prefix followed by the rest of
    /// the inner stream (a response over the storage cap).
    #[derive(Debug)]
    pub struct ResponseBody<B, E> {
        #[pin]
        inner: ResponseInner<B, E>,
    }
}

pin_project! {
    #[project = ResponseBodyProj]
    #[derive(Debug)]
    enum ResponseInner<B, E> {
        /// Complete bytes: a replay, a problem, or a captured response.
        Full { bytes: Option<Bytes> },
        /// The inner body, untouched.
        Streaming { #[pin] body: B },
        /// What was buffered, then the rest of the inner body.
        Prefixed { prefix: Option<Bytes>, #[pin] rest: B },
        /// What was buffered, then the error the inner body failed with.
        Failed { prefix: Option<Bytes>, error: Option<E> },
        /// What was received of a body that ended off its declared
        /// `Content-Length`, claiming no length of its own (nor its end,
        /// before it is polled), then [`ResponseBodyError::Cut`]: the
        /// server resets the stream (HTTP/2) or ends the connection
        /// (HTTP/1), which the layer's header, one byte past the bytes,
        /// frames short of it too, so the caller sees the cut.
        Cut { bytes: Option<Bytes>, ended: bool },
    }
}

impl<B, E> ResponseBody<B, E> {
    pub(crate) fn full(bytes: Bytes) -> Self {
        ResponseBody {
            inner: ResponseInner::Full {
                bytes: non_empty(bytes),
            },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        ResponseBody {
            inner: ResponseInner::Streaming { body },
        }
    }
}

fn non_empty(bytes: Bytes) -> Option<Bytes> {
    (!bytes.is_empty()).then_some(bytes)
}

impl<B, E> ResponseBody<B, E> {
    pub(crate) fn prefixed(prefix: Bytes, rest: B) -> Self {
        ResponseBody {
            inner: ResponseInner::Prefixed {
                prefix: non_empty(prefix),
                rest,
            },
        }
    }

    pub(crate) fn cut(bytes: Bytes) -> Self {
        ResponseBody {
            inner: ResponseInner::Cut {
                bytes: non_empty(bytes),
                ended: false,
            },
        }
    }

    pub(crate) fn failed(prefix: Bytes, error: E) -> Self {
        ResponseBody {
            inner: ResponseInner::Failed {
                prefix: non_empty(prefix),
                error: Some(error),
            },
        }
    }
}

/// Why a [`ResponseBody`] failed: its inner body's error, or the cut the
/// layer makes an error of.
#[derive(Debug)]
pub enum ResponseBodyError<E> {
    /// The inner service's body failed with this error.
    Inner(E),
    /// The inner service's body ended off the `Content-Length` its head
    /// declared (a producer that stopped early, or ran long): after the
    /// bytes it did send, the body fails, so a server resets the caller's
    /// stream or closes its connection and no caller takes the bytes for a
    /// whole answer, on HTTP/2 as on HTTP/1. Retries get 409
    /// `response-incomplete`.
    Cut,
}

impl<E> ResponseBodyError<E> {
    /// The inner body's error; `None` for a [`ResponseBodyError::Cut`].
    pub fn into_inner(self) -> Option<E> {
        match self {
            ResponseBodyError::Inner(error) => Some(error),
            ResponseBodyError::Cut => None,
        }
    }
}

impl<E: std::fmt::Display> std::fmt::Display for ResponseBodyError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResponseBodyError::Inner(error) => error.fmt(f),
            ResponseBodyError::Cut => {
                f.write_str("the response body ended off its declared Content-Length")
            }
        }
    }
}

/// An error whatever the inner error is (a boxed error too, which is no
/// `Error` itself), so the body serves where a boxed error is asked for.
impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for ResponseBodyError<E> {}

type Polled<E> = Poll<Option<Result<Frame<Bytes>, ResponseBodyError<E>>>>;

fn inner<E>(polled: Poll<Option<Result<Frame<Bytes>, E>>>) -> Polled<E> {
    polled.map(|frame| frame.map(|frame| frame.map_err(ResponseBodyError::Inner)))
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B, B::Error> {
    type Data = Bytes;
    type Error = ResponseBodyError<B::Error>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled<B::Error> {
        match self.project().inner.project() {
            ResponseBodyProj::Full { bytes } => {
                Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b))))
            }
            ResponseBodyProj::Streaming { body } => inner(body.poll_frame(cx)),
            ResponseBodyProj::Prefixed { prefix, rest } => match prefix.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => inner(rest.poll_frame(cx)),
            },
            ResponseBodyProj::Failed { prefix, error } => match prefix.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => Poll::Ready(error.take().map(|e| Err(ResponseBodyError::Inner(e)))),
            },
            ResponseBodyProj::Cut { bytes, ended } => match (bytes.take(), *ended) {
                (Some(bytes), _) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                (None, false) => {
                    *ended = true;
                    Poll::Ready(Some(Err(ResponseBodyError::Cut)))
                }
                (None, true) => Poll::Ready(None),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            ResponseInner::Full { bytes } => bytes.is_none(),
            ResponseInner::Streaming { body } => body.is_end_stream(),
            ResponseInner::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            ResponseInner::Failed { prefix, error } => prefix.is_none() && error.is_none(),
            ResponseInner::Cut { ended, .. } => *ended,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            ResponseInner::Full { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            ResponseInner::Streaming { body } => body.size_hint(),
            ResponseInner::Prefixed { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let hint = rest.size_hint();
                let mut sum = SizeHint::new();
                sum.set_lower(hint.lower() + extra);
                if let Some(upper) = hint.upper() {
                    sum.set_upper(upper + extra);
                }
                sum
            }
            ResponseInner::Failed { .. } | ResponseInner::Cut { .. } => SizeHint::default(),
        }
    }
}
