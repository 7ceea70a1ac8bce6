//! Graceful shutdown: on SIGTERM, stop accepting, let every request in
//! flight finish (and its response be stored), then wait for the engine's
//! background work (answers whose storing failed and is being retried,
//! releases) and for the outbox workers (which stop claiming at once,
//! finish their deliveries within `shutdown_grace` and give back the rows
//! of the others), then exit — as soon as all of it is done, not after a fixed
//! grace period, and at the latest after `shutdown_timeout`.
//!
//! Pingora stops its listeners and closes idle keep-alive connections on
//! `GracefulTerminate`, then sleeps a fixed grace period. [`Drain`] counts
//! what is still running (downstream requests and detached upstream
//! exchanges) and [`Engine::drain`] waits for the engine's background work,
//! so the process can exit the moment both are done; Pingora's grace period
//! (a second longer than `shutdown_timeout`) is only a backstop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora_core::server::{ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, SignalKind};
use tower_idempotency::Engine;

use crate::outbox::workers::Workers;

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
/// a thread that exits the process once [`Drain`] is empty and the engine
/// is drained, or `timeout` after the signal), SIGINT a fast shutdown.
pub struct Signals {
    /// The work to wait for.
    pub drain: Drain,
    /// The engine whose background work is waited for.
    pub engine: Engine,
    /// The outbox workers running in this process, if any.
    pub outbox: Option<Workers>,
    /// A runtime to wait for the engine on (its timers).
    pub runtime: tokio::runtime::Handle,
    /// The longest the whole shutdown may take (`shutdown_timeout`).
    pub timeout: Duration,
}

impl Signals {
    /// Waits for the requests in flight, then for the engine's background
    /// work, until `deadline`; logs what it had to abandon.
    fn drain_until(&self, deadline: Instant) -> (usize, usize) {
        // The workers stop claiming at once and finish alongside the
        // requests.
        let workers = self
            .outbox
            .clone()
            .map(|workers| self.runtime.spawn(async move { workers.shutdown().await }));
        while self.drain.active() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let requests = self.drain.active();
        if requests > 0 {
            tracing::error!(
                requests,
                "shutdown_timeout passed with requests in flight; abandoning them"
            );
        }
        // Requests that ended may have left work behind (an answer still
        // being stored): the client has its answer, so this is in flight
        // too. The engine logs each key it abandons.
        let left = deadline.saturating_duration_since(Instant::now());
        let report = self.runtime.block_on(self.engine.drain(left));
        let mut abandoned = report.abandoned.len() + report.held;
        if let Some(workers) = workers {
            let left = deadline.saturating_duration_since(Instant::now());
            let stopped = self
                .runtime
                .block_on(async { tokio::time::timeout(left, workers).await });
            if stopped.is_err() {
                tracing::error!("outbox workers still delivering; their rows go to the rescuer");
                abandoned += 1;
            }
        }
        (requests, abandoned)
    }
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    /// SIGTERM (and SIGQUIT, which process managers also send to stop) is
    /// a graceful stop, SIGINT a fast one; SIGHUP is ignored (its default
    /// action would kill the proxy without a drain, and there is nothing to
    /// reload).
    async fn recv(&self) -> ShutdownSignal {
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut quit = signal(SignalKind::quit()).expect("SIGQUIT handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
        loop {
            tokio::select! {
                _ = term.recv() => return self.drain("SIGTERM"),
                _ = quit.recv() => return self.drain("SIGQUIT"),
                _ = int.recv() => {
                    let engine = (self.engine.clone(), self.runtime.clone());
                    interrupted(engine, self.drain.active(), "SIGINT: exiting at once").await
                }
                _ = hup.recv() => {
                    tracing::info!("SIGHUP ignored: the proxy reloads nothing; SIGTERM drains and stops it");
                }
            }
        }
    }
}

impl Signals {
    /// Starts the graceful stop `name` asked for: a thread that waits for
    /// the work in flight (see [`Signals::drain_until`]) and exits, with
    /// status 0 when nothing was abandoned and 1 otherwise; SIGINT during
    /// it exits at once (130).
    fn drain(&self, name: &str) -> ShutdownSignal {
        tracing::info!(in_flight = self.drain.active(), "{name}: draining");
        let deadline = Instant::now() + self.timeout;
        // SIGINT while draining cuts the drain short, as it would have
        // before (the handler installed above keeps its default action
        // from ever running). Its listener is made here, on the engine's
        // runtime, which runs on through the drain: one made in the task
        // missed a SIGINT sent before the task first ran.
        let drain = self.drain.clone();
        let engine = (self.engine.clone(), self.runtime.clone());
        let int = {
            let _runtime = self.runtime.enter();
            signal(SignalKind::interrupt())
        };
        if let Ok(mut int) = int {
            self.runtime.spawn(async move {
                int.recv().await;
                interrupted(
                    engine,
                    drain.active(),
                    "SIGINT while draining: exiting at once",
                )
                .await;
            });
        }
        let signals = Signals {
            drain: self.drain.clone(),
            engine: self.engine.clone(),
            outbox: self.outbox.clone(),
            runtime: self.runtime.clone(),
            timeout: self.timeout,
        };
        std::thread::spawn(move || {
            // Let Pingora stop its listeners first.
            std::thread::sleep(Duration::from_millis(100));
            let (requests, background) = signals.drain_until(deadline);
            // Status 1 says a key's work was abandoned (an execution, an
            // answer being stored, an outbox delivery). Requests cut with
            // no key in flight (a WebSocket, a slow uncovered GET, a
            // duplicate waiting, an answer still being sent) lose nothing
            // a retry cannot have again: logged, status 0.
            let status = if background == 0 {
                match requests {
                    0 => tracing::info!("drained; exiting"),
                    requests => tracing::warn!(
                        requests,
                        "shutdown_timeout passed; exiting, the requests cut held no key in flight"
                    ),
                }
                0
            } else {
                tracing::error!(
                    requests,
                    background,
                    "shutdown_timeout passed; exiting with work abandoned"
                );
                1
            };
            crate::logs::flush();
            std::process::exit(status);
        });
        ShutdownSignal::GracefulTerminate
    }
}

/// SIGINT, in a drain or not: exits at once with status 130, what is in
/// flight (`in_flight` requests) abandoned, the log written first. The
/// engine's drain is given no time to wait, only its marking: an answer
/// being stored is given half a second to land, then
/// each execution that reached its upstream gets "executed, outcome
/// unknown" (504) and each answer still being stored "executed, response
/// not stored", within half a second more, and no reservation
/// acts after it, so
/// an interrupted proxy never leaves a retry a request to run again (it
/// did: the key stayed in flight, unmarked, until its lease ran out). The
/// drain runs on the engine's runtime (`engine.1`), whose connections the
/// store holds.
async fn interrupted(
    engine: (Engine, tokio::runtime::Handle),
    in_flight: usize,
    message: &str,
) -> ! {
    tracing::warn!(in_flight, "{message}");
    // "At once" holds whatever the engine's runtime is doing: its timers
    // bound the marking, and a blocked worker would stop them.
    // The drain's end takes up to a second (half for answers being stored
    // to land, half for its markers); the log's flush after it, a little.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(2000));
        std::process::exit(130)
    });
    let (engine, runtime) = engine;
    let _ = runtime
        .spawn(async move { engine.drain(Duration::ZERO).await })
        .await;
    crate::logs::flush();
    std::process::exit(130)
}
