//! Running the engine beside the requests: health checks, the sweeper
//! that deletes expired records, the metrics text, and draining the
//! background work on shutdown.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use super::Engine;
use crate::store::{OwnerToken, ScopeKey, StoreError};

/// How long a drain's end gives the store: first for the answers being
/// stored to land, then for its markers.
const MARK_BUDGET: Duration = Duration::from_millis(500);

/// The engine's work that outlives its request: an outcome whose storing
/// failed and is retried, a release of an abandoned reservation. Each is a
/// promise made to a client (its answer is stored, its key freed), so a
/// graceful shutdown waits for them ([`Engine::drain`]).
#[derive(Debug, Default)]
pub(super) struct Background {
    /// The pending tasks by id, with the scope they work for.
    pending: Mutex<Pending>,
    /// Woken whenever a task ends.
    ended: Notify,
}

#[derive(Debug, Default)]
struct Pending {
    next: u64,
    tasks: HashMap<u64, (ScopeKey, &'static str)>,
}

/// One pending background task; counted until dropped.
#[derive(Debug)]
pub(super) struct BackgroundTask {
    engine: Engine,
    id: u64,
}

impl Engine {
    /// Registers background work for `key` (`what` it does, for the log);
    /// it counts as pending for [`Engine::drain`] until the returned guard
    /// is dropped.
    pub(super) fn background_task(&self, key: ScopeKey, what: &'static str) -> BackgroundTask {
        let mut pending = self.inner.background.pending.lock().unwrap();
        pending.next += 1;
        let id = pending.next;
        pending.tasks.insert(id, (key, what));
        BackgroundTask {
            engine: self.clone(),
            id,
        }
    }

    /// How many background tasks are pending: outcomes whose storing failed
    /// and is being retried, releases of abandoned reservations.
    pub fn pending_background(&self) -> usize {
        self.inner.background.pending.lock().unwrap().tasks.len()
    }

    /// Waits, at most `timeout` (and up to a second more at its end, see
    /// below), for the engine's work in flight to end:
    /// reservations still held (an execution whose caller went away runs
    /// on in a task of its own), outcomes whose storing failed and is being
    /// retried (their clients already have their answers; if the process
    /// exits first, the key stays in flight until its lease runs out, and
    /// then a retry executes again), and releases of abandoned
    /// reservations. Call it on graceful shutdown, after the server stopped
    /// accepting and its requests ended (they may leave such work behind).
    /// Work started while it waits is waited for too.
    ///
    /// What is still pending at the timeout is abandoned: an answer being
    /// stored is given half a second to land; then each
    /// background task is logged (its scope's short hash only) and listed
    /// in the report; each execution still running whose request reached
    /// the upstream gets "executed, outcome unknown" (504) stored as its
    /// key's outcome, and each answer still being stored "executed,
    /// response not stored", within half a second more, so no retry runs
    /// it again (an answer it finishes at that very moment may lose to
    /// that marker), and every execution still running is logged by its
    /// scope's short hash.
    /// The work itself goes on as long as its runtime does. Call it only
    /// once the process stops serving: what it marks is given up. From its
    /// end on (and from the moment it found nothing left to wait for), no
    /// reservation of this engine reaches its upstream: a request still
    /// running that reserves its key is answered 503 and the key released,
    /// so nothing acts that no drain would mark.
    pub async fn drain(&self, timeout: Duration) -> DrainReport {
        let background = &self.inner.background;
        let deadline = tokio::time::Instant::now() + timeout;
        let held = || self.inner.metrics.in_flight().max(0) as usize;
        let waited_for = self.pending_background() + held();
        loop {
            let ended = background.ended.notified();
            let mut ended = std::pin::pin!(ended);
            // Registered before looking, so an end in between is not missed.
            ended.as_mut().enable();
            if self.pending_background() == 0 && held() == 0 {
                // Nothing acts from here on; what acted before the fence
                // is waited for, as the rest.
                self.inner.leases.close();
                if self.pending_background() == 0 && held() == 0 {
                    return DrainReport {
                        waited_for,
                        ..DrainReport::default()
                    };
                }
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                break;
            }
        }
        // Before the list of executions to mark is taken: a request still
        // running (a body still arriving when the server gave up waiting)
        // that reserved its key now never reaches its upstream (503,
        // released), since it would not be marked.
        self.inner.leases.close();
        let mut held = held();
        if held > 0 {
            // An answer being stored (on its first attempt, or retried
            // after a failure) most often lands within milliseconds, and a
            // marker overtaking it would cost its replay: it is given the
            // markers' budget to land. One still on its way then is marked
            // like the rest, since the process is going away and would
            // leave its key in flight.
            self.await_stored().await;
            held = self.inner.metrics.in_flight().max(0) as usize;
        }
        let mut marked = 0;
        let mut marked_keys = Vec::new();
        if held > 0 {
            tracing::error!(
                reservations = held,
                "idempotency shutdown abandoned executions still running"
            );
            // Running first, then settling: a lease only moves from the
            // one to the other, so each is in one list at least (in both,
            // the second marker is refused).
            let running = self.inner.leases.running();
            let settling = self.inner.leases.settling();
            let settling_keys: Vec<ScopeKey> = settling.iter().map(|s| s.0).collect();
            marked_keys = self.mark_abandoned(running, settling).await;
            marked = marked_keys.len();
            let mut keys: Vec<ScopeKey> = self.inner.leases.keys();
            keys.sort_by_key(ScopeKey::short);
            keys.dedup();
            // An answer whose storing is retried is background work,
            // logged below.
            let retried: Vec<ScopeKey> = {
                let pending = background.pending.lock().unwrap();
                pending.tasks.values().map(|(key, _)| *key).collect()
            };
            keys.retain(|key| !retried.contains(key));
            for key in keys {
                let settling = settling_keys.contains(&key);
                match (marked_keys.contains(&key), settling) {
                    (true, false) => {
                        tracing::error!(key = %key.short(), "idempotency shutdown abandoned an execution still running; stored \"outcome unknown\" (504), so no retry executes it again")
                    }
                    (true, true) => {
                        tracing::error!(key = %key.short(), "idempotency shutdown abandoned an answer still being stored; stored a marker in its place, so no retry executes it again")
                    }
                    (false, false) => {
                        tracing::error!(key = %key.short(), "idempotency shutdown abandoned an execution still running; its key frees when its lease expires")
                    }
                    (false, true) => {
                        tracing::error!(key = %key.short(), "idempotency shutdown abandoned an answer still being stored; unless it lands, its key frees when its lease expires")
                    }
                }
            }
        }
        let mut abandoned: Vec<(u64, String, &'static str)> = {
            let pending = background.pending.lock().unwrap();
            let tasks = pending.tasks.iter();
            tasks
                .map(|(id, (key, what))| (*id, key.short(), *what))
                .collect()
        };
        abandoned.sort();
        for (_, key, what) in &abandoned {
            match marked_keys.iter().any(|marked| marked.short() == *key) {
                true => {
                    tracing::error!(key = %key, work = what, "idempotency shutdown abandoned background work; stored \"response not stored\", so no retry executes it again")
                }
                false => {
                    tracing::error!(key = %key, work = what, "idempotency shutdown abandoned background work; the key frees when its lease expires")
                }
            }
        }
        DrainReport {
            waited_for,
            abandoned: abandoned.into_iter().map(|(_, key, _)| key).collect(),
            held,
            marked,
        }
    }

    /// Stores "executed, outcome unknown" (504 `upstream-timeout`, as past
    /// `execution_timeout`) for each execution still running at the
    /// drain's end whose request reached the upstream (the proxy wrote it,
    /// the layer called the inner service), and "executed, response not
    /// stored" for each whose answer is still being stored, as its owner,
    /// within [`MARK_BUDGET`]: the process is going away, and the upstream
    /// may have acted or may still, so no retry may run it again once the
    /// lease runs out. `running` and `settling` are
    /// [`Leases::running`](super::lease::Leases::running) and
    /// [`Leases::settling`](super::lease::Leases::settling), taken by the
    /// caller in that order. Returns the keys a marker was stored for.
    async fn mark_abandoned(
        &self,
        running: Vec<(ScopeKey, OwnerToken, Duration)>,
        settling: Vec<(ScopeKey, OwnerToken, Duration, http::StatusCode)>,
    ) -> Vec<ScopeKey> {
        let detail = "The server shut down while the request was being executed; it may or may \
                      not have taken effect, and it will not be executed again with this key.";
        let kind = crate::problem::ProblemKind::UpstreamTimeout;
        let mut calls = tokio::task::JoinSet::new();
        let running = running.into_iter().map(|(key, owner, ttl)| {
            let outcome = self.seal(&key, super::execution::unknown(kind, detail));
            (key, owner, ttl, outcome)
        });
        // An answer still being stored (its client has it; the store kept
        // refusing it) gets the small "executed, response not stored"
        // marker instead, which a store that takes fresh calls may still
        // take: retries then get 409, never a second execution.
        let settling = settling.into_iter().map(|(key, owner, ttl, status)| {
            let outcome = self.seal(&key, crate::store::Outcome::TooLarge { status });
            (key, owner, ttl, outcome)
        });
        for (key, owner, ttl, outcome) in running.chain(settling) {
            let engine = self.clone();
            calls.spawn(async move {
                let store = &engine.inner.store;
                let call = store.complete(&key, &owner, &outcome, ttl);
                let stored = tokio::time::timeout(MARK_BUDGET, call).await;
                matches!(stored, Ok(Ok(true))).then_some(key)
            });
        }
        let mut marked = Vec::new();
        while let Some(call) = calls.join_next().await {
            if let Ok(Some(key)) = call {
                marked.push(key);
            }
        }
        marked
    }

    /// Waits, for up to [`MARK_BUDGET`], until no answer is being stored
    /// ([`Leases::storing`](super::lease::Leases::storing)): each that lands
    /// ends its reservation or its background task, which wakes it.
    async fn await_stored(&self) {
        let deadline = tokio::time::Instant::now() + MARK_BUDGET;
        loop {
            let ended = self.inner.background.ended.notified();
            let mut ended = std::pin::pin!(ended);
            // Registered before looking, so an end in between is not missed.
            ended.as_mut().enable();
            if self.inner.leases.storing() == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return;
            }
        }
    }

    /// Wakes [`Engine::drain`]: some work in flight ended.
    fn work_ended(&self) {
        self.inner.background.ended.notify_waiters();
    }

    /// A reservation ended (it no longer counts as in flight).
    pub(super) fn left_flight(&self) {
        self.inner.metrics.in_flight_add(-1);
        self.work_ended();
    }
}

impl Drop for BackgroundTask {
    fn drop(&mut self) {
        let background = &self.engine.inner.background;
        background.pending.lock().unwrap().tasks.remove(&self.id);
        self.engine.work_ended();
    }
}

/// What [`Engine::drain`] waited for and what it had to abandon.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Reservations held and background tasks pending when the drain
    /// started.
    pub waited_for: usize,
    /// The short scope hashes of the background tasks still pending at the
    /// timeout (empty: all ended). Such a key stays in flight until its
    /// lease runs out; a retry after that executes again.
    pub abandoned: Vec<String>,
    /// Reservations still held at the timeout (executions still running,
    /// answers still being stored), once the answers being stored were
    /// given their half second to land.
    pub held: usize,
    /// Of those, how many the drain stored a marker for: "executed, outcome
    /// unknown" (504 `upstream-timeout`) for an execution still running,
    /// "executed, response not stored" for an answer still being stored.
    /// No retry runs them again. The others (the store did not answer in
    /// time) free their keys when their leases run out, and a retry after
    /// that executes again.
    pub marked: usize,
}

impl DrainReport {
    /// Whether all work in flight ended in time (an answer being stored
    /// that landed in the half second after `timeout` counts as ended).
    pub fn is_complete(&self) -> bool {
        self.abandoned.is_empty() && self.held == 0
    }
}

impl Engine {
    /// Renders the engine's and the store's metrics in Prometheus text.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        let extra = self
            .inner
            .store
            .maintenance()
            .map(|store| store.counters())
            .unwrap_or_default();
        self.inner.metrics.render_prometheus(&extra, &mut out);
        out
    }

    /// Whether the store answers (for health checks).
    pub async fn health(&self) -> Result<(), StoreError> {
        self.store_call(self.inner.store.ping()).await
    }

    /// Deletes expired records every `every`, at most `batch` per call,
    /// until the returned handle is aborted. A store without a
    /// [`Maintenance`](crate::store::Maintenance) side has nothing to sweep:
    /// the task ends at once.
    pub fn spawn_sweeper(&self, every: Duration, batch: usize) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                // Keep sweeping while full batches come back.
                loop {
                    let Some(store) = engine.inner.store.maintenance() else {
                        return;
                    };
                    match engine.store_call(store.sweep(batch)).await {
                        Ok(n) if n as usize >= batch => continue,
                        Ok(n) => {
                            tracing::debug!(swept = n, "idempotency sweep");
                            break;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "idempotency sweep failed");
                            break;
                        }
                    }
                }
            }
        })
    }
}
