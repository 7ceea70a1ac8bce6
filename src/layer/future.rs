use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use http_body::Body;
use pin_project_lite::pin_project;

use super::ResponseBody;
use crate::engine::detached::detach;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// What the caller finally gets.
pub(crate) type Answer<B, E> = Result<Response<ResponseBody<B, <B as Body>::Error>>, E>;

/// How the engine's first phase (read the body, decide) ends.
pub(crate) enum Step<B: Body, E> {
    /// The answer: a replay, a problem, or an unprotected call's response.
    Done(Answer<B, E>),
    /// The request holds its key: the inner call and the storing of its
    /// answer, which must run to the end even if the caller goes away.
    Execute(BoxFuture<Answer<B, E>>),
}

/// Moves an execution whose caller went away onto a task of its own.
type Detach<B, E> = fn(BoxFuture<Answer<B, E>>);

pin_project! {
    /// The future of [`Idempotency`](super::Idempotency): the inner future
    /// itself for uncovered requests, the engine's work for covered ones.
    ///
    /// Dropping it while the request holds its key does not cancel the
    /// inner call: the rest of the execution (the call, storing its
    /// answer) continues on a task of its own, so the retry replays it.
    /// Dropping it before that (while the body is read or the engine
    /// decides) cancels the request; nothing was executed.
    #[project = ResponseFutureProj]
    pub struct ResponseFuture<F, B: Body, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }

    impl<F, B: Body, E> PinnedDrop for ResponseFuture<F, B, E> {
        fn drop(this: Pin<&mut Self>) {
            if let KindProj::Execute { future, detach } = this.project().kind.project() {
                if let Some(future) = future.take() {
                    detach(future);
                }
            }
        }
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B: Body, E> {
        Passthrough { #[pin] future: F },
        Begin { future: BoxFuture<Step<B, E>>, detach: Detach<B, E> },
        Execute { future: Option<BoxFuture<Answer<B, E>>>, detach: Detach<B, E> },
    }
}

impl<F, B: Body, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough { future },
        }
    }

    pub(crate) fn engine(future: BoxFuture<Step<B, E>>) -> Self
    where
        Answer<B, E>: Send + 'static,
    {
        ResponseFuture {
            kind: Kind::Begin {
                future,
                detach: detach::<Answer<B, E>>,
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body,
{
    type Output = Answer<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        loop {
            match kind.as_mut().project() {
                KindProj::Passthrough { future } => {
                    let response = ready!(future.poll(cx))?;
                    return Poll::Ready(Ok(response.map(|body| ResponseBody::streaming(body))));
                }
                KindProj::Begin { future, detach } => match ready!(future.as_mut().poll(cx)) {
                    Step::Done(answer) => return Poll::Ready(answer),
                    Step::Execute(future) => {
                        let detach = *detach;
                        kind.set(Kind::Execute {
                            future: Some(future),
                            detach,
                        });
                    }
                },
                KindProj::Execute { future, .. } => {
                    // Out of its slot while polled: if it panics, it is
                    // dropped here, and a drop of this future afterwards
                    // has nothing left to detach.
                    let mut running = future
                        .take()
                        .expect("ResponseFuture polled after completion");
                    return match running.as_mut().poll(cx) {
                        Poll::Ready(answer) => Poll::Ready(answer),
                        Poll::Pending => {
                            *future = Some(running);
                            Poll::Pending
                        }
                    };
                }
            }
        }
    }
}

impl<F, B: Body, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use http_body_util::Full;

    use super::*;

    type Body = Full<Bytes>;
    type Test =
        ResponseFuture<std::future::Pending<Result<Response<Body>, Infallible>>, Body, Infallible>;

    static DETACHED: AtomicUsize = AtomicUsize::new(0);

    fn count(_: BoxFuture<Answer<Body, Infallible>>) {
        DETACHED.fetch_add(1, Ordering::SeqCst);
    }

    fn executing(future: BoxFuture<Answer<Body, Infallible>>) -> Test {
        ResponseFuture {
            kind: Kind::Execute {
                future: Some(future),
                detach: count,
            },
        }
    }

    /// Dropped while executing, the execution is detached; after a panic
    /// in it, there is nothing left to detach (it would only panic again).
    #[test]
    fn only_a_live_execution_is_detached() {
        let mut cx = Context::from_waker(std::task::Waker::noop());

        let mut pending = Box::pin(executing(Box::pin(std::future::pending())));
        assert!(pending.as_mut().poll(&mut cx).is_pending());
        drop(pending);
        assert_eq!(DETACHED.load(Ordering::SeqCst), 1);

        let mut panicking = Box::pin(executing(Box::pin(async { panic!("inner service") })));
        let unwound = catch_unwind(AssertUnwindSafe(|| panicking.as_mut().poll(&mut cx)));
        assert!(unwound.is_err());
        drop(panicking);
        assert_eq!(DETACHED.load(Ordering::SeqCst), 1, "not detached again");
    }
}
