use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use http_body::Body;
use pin_project_lite::pin_project;

use super::ResponseBody;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
type EngineFuture<B, E> = BoxFuture<Result<Response<ResponseBody<B, <B as Body>::Error>>, E>>;

pin_project! {
    /// The future of [`Idempotency`](super::Idempotency): the inner future
    /// itself for uncovered requests, the engine's work for covered ones.
    #[project = ResponseFutureProj]
    pub struct ResponseFuture<F, B: Body, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B: Body, E> {
        Passthrough { #[pin] future: F },
        Engine { future: EngineFuture<B, E> },
    }
}

impl<F, B: Body, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough { future },
        }
    }

    pub(crate) fn engine(future: EngineFuture<B, E>) -> Self {
        ResponseFuture {
            kind: Kind::Engine { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body,
{
    type Output = Result<Response<ResponseBody<B, B::Error>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response.map(|body| ResponseBody::streaming(body))))
            }
            KindProj::Engine { future } => future.as_mut().poll(cx),
        }
    }
}

impl<F, B: Body, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
