//! Graceful shutdown: on SIGTERM, stop accepting, let every request in
//! flight finish (and its response be stored), then exit — as soon as the
//! last one is done, not after a fixed grace period.
//!
//! Pingora stops its listeners and closes idle keep-alive connections on
//! `GracefulTerminate`, then sleeps a fixed grace period. [`Drain`] counts
//! what is still running (downstream requests and detached upstream
//! exchanges) so the process can exit the moment that count reaches zero;
//! Pingora's grace period is only the upper bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::server::{ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, SignalKind};

/// Counts the work that must finish before the process may exit.
#[derive(Clone, Debug, Default)]
pub struct Drain {
    active: Arc<AtomicUsize>,
}

/// One unit of work in progress; counted until dropped.
#[derive(Debug)]
pub struct Active {
    active: Arc<AtomicUsize>,
}

impl Drain {
    /// Registers one unit of work.
    pub fn enter(&self) -> Active {
        self.active.fetch_add(1, Ordering::SeqCst);
        Active {
            active: self.active.clone(),
        }
    }

    /// Units of work in progress.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Pingora's shutdown trigger: SIGTERM is a graceful terminate (and starts
/// a thread that exits the process once [`Drain`] is empty), SIGINT a fast
/// shutdown.
pub struct Signals {
    /// The work to wait for.
    pub drain: Drain,
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        tokio::select! {
            _ = term.recv() => {
                tracing::info!(in_flight = self.drain.active(), "SIGTERM: draining");
                let drain = self.drain.clone();
                std::thread::spawn(move || {
                    // Let Pingora stop its listeners first.
                    std::thread::sleep(Duration::from_millis(100));
                    while drain.active() > 0 {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    tracing::info!("drained; exiting");
                    std::process::exit(0);
                });
                ShutdownSignal::GracefulTerminate
            }
            _ = int.recv() => ShutdownSignal::FastShutdown,
        }
    }
}
