//! The one rule for an execution whose caller goes away: it runs on.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// An execution that holds its key (the call to the handler or upstream,
/// and the storing of its answer), run in its caller's task for as long as
/// the caller waits for it.
///
/// Dropped before it ends (the caller went away), the rest of it runs to
/// the end on a task of its own: the answer is still stored, and the
/// retry replays it instead of finding the key in flight forever or
/// executing again. Only without a runtime (it is shutting down) is the
/// rest dropped, and a dropped reservation then frees its key in the
/// background or at lease expiry. Both the layer and the proxy follow
/// this rule.
pub struct Execution<T: Send + 'static> {
    /// `None` once it ended (or panicked while polled).
    future: Option<BoxFuture<T>>,
}

impl<T: Send + 'static> Execution<T> {
    /// Wraps `future`; nothing runs until it is polled or dropped.
    pub fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Execution {
            future: Some(Box::pin(future)),
        }
    }
}

impl<T: Send + 'static> Future for Execution<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        // Out of its slot while polled: if it panics, it is dropped here,
        // and a drop of this execution afterwards has nothing to detach
        // (it would only panic again).
        let mut running = self
            .future
            .take()
            .expect("Execution polled after completion");
        match running.as_mut().poll(cx) {
            Poll::Ready(output) => Poll::Ready(output),
            Poll::Pending => {
                self.future = Some(running);
                Poll::Pending
            }
        }
    }
}

impl<T: Send + 'static> Drop for Execution<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            detach(future);
        }
    }
}

impl<T: Send + 'static> std::fmt::Debug for Execution<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("running", &self.future.is_some())
            .finish()
    }
}

tokio::task_local! {
    /// Set while a detached execution runs ([`running_detached`]).
    static DETACHED: ();
}

/// Runs `future` to the end on the current runtime, its output unused.
/// Without a runtime (it is shutting down) the future is dropped, and a
/// dropped reservation frees its key in the background or at lease expiry.
pub(crate) fn detach<T: Send + 'static>(future: BoxFuture<T>) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(DETACHED.scope((), future));
    }
}

/// Whether the code running now is a detached execution's, one whose
/// caller went away. It runs outside whatever wrapped its caller's future
/// (a task-local an outer layer set, a tracing span's context): a handler
/// reading one may fail there although it would not have for its caller.
pub(crate) fn running_detached() -> bool {
    DETACHED.try_with(|_| ()).is_ok()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    /// Dropped while pending, the execution finishes on a task of its own;
    /// polled to its end, nothing is left to run.
    #[tokio::test]
    async fn a_dropped_execution_runs_to_its_end() {
        let (proceed, wait) = tokio::sync::oneshot::channel::<()>();
        let ended = Arc::new(AtomicBool::new(false));
        let mut execution = Execution::new({
            let ended = ended.clone();
            async move {
                let _ = wait.await;
                ended.store(true, Ordering::SeqCst);
            }
        });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut execution).poll(&mut cx).is_pending());
        drop(execution);
        assert!(!ended.load(Ordering::SeqCst));
        proceed.send(()).unwrap();
        for _ in 0..1000 {
            if ended.load(Ordering::SeqCst) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the detached execution never ended");
    }

    /// After a panic while polled there is nothing left to detach.
    #[test]
    fn a_panicked_execution_is_not_detached() {
        let mut execution = Execution::new(async { panic!("handler") });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Pin::new(&mut execution).poll(&mut cx)
        }));
        assert!(unwound.is_err());
        assert!(execution.future.is_none());
        // No runtime here: a detach would be a silent drop either way, but
        // nothing is left to try.
        drop(execution);
    }
}
