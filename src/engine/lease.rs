//! Lease renewal for every live reservation of one engine: one task per
//! runtime instead of one per reservation.
//!
//! A reservation registers its key here when it is created and leaves when
//! it settles. The renewer of the runtime that made the reservation renews
//! each of its leases a third of the lease after it was taken or last
//! renewed — and again soon after a renewal failed — and otherwise sleeps: a
//! request that finishes in microseconds costs a map insert and remove, not
//! a task and a timer of its own.
//!
//! Leases are kept per runtime because a renewer can only run while its
//! runtime is driven: a reservation is renewed by the runtime its own
//! request runs on, exactly as a heartbeat task spawned next to it would
//! be. A renewer starts with its runtime's first reservation, starts again
//! if its task ended, and is stopped when the engine is dropped (it holds
//! the engine weakly).
//!
//! Renewal never depends on the worker thread of the request that asked
//! for it. A request never wakes the renewer: the renewer wakes by its own
//! timer, at the earliest renewal due and at least every sixth of the
//! shortest lease of the engine's routes (so a new lease is seen within a
//! sixth of it, and first renewed by half of it). Waking it from a request
//! would schedule it in that worker's LIFO slot, which other workers
//! cannot steal: a handler that then blocked its thread (CPU work, a
//! blocking call before its first `.await`) would freeze every other
//! request's renewal on that runtime, and a duplicate would take a live
//! lease over. On a multi-thread runtime, the renewer's task is also
//! spawned from a thread of its own, so it starts in the runtime's shared
//! queue, where any worker picks it up. What no task can escape: a
//! current-thread runtime whose one thread a handler blocks, or a
//! multi-thread one with every worker blocked, stops the renewer too
//! (README's limit). Timer wake-ups happen on a worker
//! between tasks, and renewal tasks it spawns end right after.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::runtime::{Handle, Id as RuntimeId};
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::{Engine, Inner};
use crate::store::{OwnerToken, ScopeKey};

/// The leases one engine keeps alive, one renewer per runtime.
#[derive(Debug, Default)]
pub(super) struct Leases {
    runtimes: Mutex<Vec<Arc<Renewer>>>,
    /// Set by [`Leases::close`]: no lease acts from then on.
    closed: Arc<AtomicBool>,
}

/// One runtime's leases and the task that renews them.
#[derive(Debug)]
struct Renewer {
    runtime: RuntimeId,
    /// How often it looks at least: a sixth of the shortest lease.
    tick: Duration,
    state: Mutex<State>,
    wake: Notify,
    /// The engine's [`Leases::closed`].
    closed: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    held: HashMap<u64, Held>,
    /// When the renewer looks next.
    wake_at: Option<Instant>,
    task: Option<AbortHandle>,
    /// Its task is being spawned from another thread.
    starting: bool,
}

#[derive(Debug)]
struct Held {
    key: ScopeKey,
    owner: OwnerToken,
    lease: Duration,
    /// The route's `ttl`: how long an outcome stored for it is kept.
    ttl: Duration,
    /// When the next renewal is sent: a third of the lease after the
    /// last one that succeeded was sent, or sooner while none has.
    renew_at: Instant,
    /// Renewals sent and not answered yet. A renewal that hangs (a
    /// blackholed connection) is not waited for: the next is sent a
    /// tenth of the lease later beside it ([`retry_after`]), up to
    /// [`MAX_ATTEMPTS`].
    attempts: u32,
    /// Its outcome, of this status, is being stored: the store may
    /// already say "not in flight", which is then no lost lease.
    settling: Option<http::StatusCode>,
    /// Its request reached (or is reaching) the upstream: it may act.
    acting: bool,
    /// Until when the store holds the lease for certain: the lease's
    /// length after the last renewal that succeeded was sent (or after the
    /// reservation was sent).
    certain_until: Instant,
}

/// One registered lease; [`Lease::forget`] ends it.
#[derive(Debug)]
pub(super) struct Lease {
    renewer: Arc<Renewer>,
    id: u64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every mutation is a single insert, remove or assignment, so a panic
    // elsewhere cannot leave the state half-written.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Leases {
    /// Keeps `key`'s lease alive (renewed every third of `lease`, the
    /// first time a third after `taken`: when the reservation was sent,
    /// since the store's lease may have started that early) until
    /// [`Lease::forget`] or until the store says the lease was lost. Must
    /// be called from inside the Tokio runtime that drives the request.
    pub(super) fn hold(
        &self,
        engine: &Arc<Inner>,
        key: ScopeKey,
        owner: OwnerToken,
        (lease, ttl): (Duration, Duration),
        taken: Instant,
    ) -> Lease {
        let runtime = Handle::current().id();
        let renewer = {
            let mut runtimes = lock(&self.runtimes);
            // Forget runtimes that are gone (their renewer ended) and hold
            // nothing any more.
            runtimes.retain(|r| r.runtime == runtime || !r.is_idle_and_stopped());
            match runtimes.iter().find(|r| r.runtime == runtime) {
                Some(renewer) => renewer.clone(),
                None => {
                    let shortest = engine
                        .routes
                        .iter()
                        .filter_map(|route| route.policy.as_ref())
                        .map(|policy| policy.policy().lease)
                        .fold(lease, Duration::min);
                    let renewer = Arc::new(Renewer {
                        runtime,
                        tick: (shortest / 6).max(Duration::from_millis(1)),
                        state: Mutex::default(),
                        wake: Notify::new(),
                        closed: self.closed.clone(),
                    });
                    runtimes.push(renewer.clone());
                    renewer
                }
            }
        };
        let id = renewer.hold(engine, key, owner, (lease, ttl), taken);
        Lease { renewer, id }
    }

    /// Stops every renewer (the engine is going away).
    pub(super) fn stop(&self) {
        for renewer in lock(&self.runtimes).iter() {
            if let Some(task) = lock(&renewer.state).task.take() {
                task.abort();
            }
        }
    }

    /// Lets no lease act from now on ([`Lease::acting`] is false): the
    /// process is going away. Leases that act already are listed by
    /// [`Leases::running`] called after it, whatever runs meanwhile: a
    /// lease checks the flag under its renewer's lock, the lock `running`
    /// takes after the flag is set.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Whether [`Leases::close`] was called.
    pub(super) fn closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// The leases held now whose request reached the upstream and whose
    /// outcome is not being stored: executions still running, with each
    /// route's `ttl`.
    pub(super) fn running(&self) -> Vec<(ScopeKey, OwnerToken, Duration)> {
        let runtimes = lock(&self.runtimes);
        let mut running = Vec::new();
        for renewer in runtimes.iter() {
            let state = lock(&renewer.state);
            let held = state.held.values();
            let held = held.filter(|held| held.acting && held.settling.is_none());
            running.extend(held.map(|held| (held.key, held.owner, held.ttl)));
        }
        running
    }

    /// The leases held now whose outcome is being stored, with each
    /// route's `ttl` and the outcome's status: a drain at its end replaces
    /// each by a marker, owner-checked (the first of the two to reach the
    /// store wins).
    pub(super) fn settling(&self) -> Vec<(ScopeKey, OwnerToken, Duration, http::StatusCode)> {
        let runtimes = lock(&self.runtimes);
        let mut settling = Vec::new();
        for renewer in runtimes.iter() {
            let state = lock(&renewer.state);
            for held in state.held.values() {
                if let Some(status) = held.settling {
                    settling.push((held.key, held.owner, held.ttl, status));
                }
            }
        }
        settling
    }

    /// How many outcomes held now are being stored (settling): a drain
    /// lets them land before it marks.
    pub(super) fn storing(&self) -> usize {
        self.settling().len()
    }

    /// The keys of the leases held now (the shutdown's log).
    pub(super) fn keys(&self) -> Vec<ScopeKey> {
        let runtimes = lock(&self.runtimes);
        let mut keys = Vec::new();
        for renewer in runtimes.iter() {
            keys.extend(lock(&renewer.state).held.values().map(|held| held.key));
        }
        keys
    }

    /// How many references each renewer has (for tests: its task holds one).
    #[cfg(test)]
    pub(super) fn renewer_refs(&self) -> Vec<usize> {
        lock(&self.runtimes).iter().map(Arc::strong_count).collect()
    }

    /// How many leases are held (for tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        lock(&self.runtimes)
            .iter()
            .map(|r| lock(&r.state).held.len())
            .sum()
    }
}

impl Lease {
    /// Stops renewing the lease.
    pub(super) fn forget(&self) {
        self.renewer.forget(self.id);
    }

    /// Marks the lease's request as acting: it reached the upstream. False,
    /// and nothing marked, when the lease may be lost: the store said the
    /// key is no longer this owner's, or no renewal succeeded within the
    /// lease's length (another arrival may have taken it over); or when
    /// the engine [closed](Leases::close) its leases (its drain ended: the
    /// process is going away, and what acts now would not be marked).
    pub(super) fn acting(&self) -> bool {
        let mut state = lock(&self.renewer.state);
        let closed = self.renewer.closed.load(Ordering::SeqCst);
        match state.held.get_mut(&self.id) {
            Some(held) if !closed && Instant::now() < held.certain_until => {
                held.acting = true;
                true
            }
            _ => false,
        }
    }

    /// Whether [`Lease::acting`] marked its request as reaching the
    /// upstream.
    pub(super) fn acted(&self) -> bool {
        let state = lock(&self.renewer.state);
        state.held.get(&self.id).is_some_and(|held| held.acting)
    }

    /// Marks the lease as settling: its outcome, of `status`, is being
    /// stored. It is still renewed (a store outage may keep it settling
    /// for a while), but a "not in flight" answer is no longer reported as
    /// a lost lease.
    pub(super) fn settling(&self, status: http::StatusCode) {
        if let Some(held) = lock(&self.renewer.state).held.get_mut(&self.id) {
            held.settling = Some(status);
        }
    }
}

impl Renewer {
    fn hold(
        self: &Arc<Self>,
        engine: &Arc<Inner>,
        key: ScopeKey,
        owner: OwnerToken,
        (lease, ttl): (Duration, Duration),
        taken: Instant,
    ) -> u64 {
        let now = Instant::now();
        let renew_at = taken.min(now) + lease / 3;
        let certain_until = taken.min(now) + lease;
        let mut state = lock(&self.state);
        let id = state.next_id;
        state.next_id += 1;
        state.held.insert(
            id,
            Held {
                key,
                owner,
                lease,
                ttl,
                renew_at,
                attempts: 0,
                settling: None,
                acting: false,
                certain_until,
            },
        );
        // A running renewer is not woken (see the module docs): it looks
        // within a tick.
        if !state.starting && state.task.as_ref().is_none_or(AbortHandle::is_finished) {
            // The new renewer looks at once and then computes its own wake-up.
            state.wake_at = Some(now);
            state.task = None;
            let renewer = renew(self.clone(), Arc::downgrade(engine));
            let handle = Handle::current();
            if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
                // One thread: nothing to steal from.
                state.task = Some(tokio::spawn(renewer).abort_handle());
            } else {
                // Spawned from outside the runtime, it goes to the shared
                // queue instead of this worker's LIFO slot.
                state.starting = true;
                let this = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("idempotency-renewer".into())
                    .spawn(move || {
                        let task = handle.spawn(renewer);
                        let mut state = lock(&this.state);
                        state.task = Some(task.abort_handle());
                        state.starting = false;
                    });
                if spawned.is_err() {
                    // No thread to be had: start it here rather than never.
                    state.starting = false;
                    let renewer = renew(self.clone(), Arc::downgrade(engine));
                    state.task = Some(tokio::spawn(renewer).abort_handle());
                }
            }
        }
        id
    }

    /// Makes sure the renewer looks no later than `at`.
    fn wake_by(&self, state: &mut State, at: Instant) {
        if state.wake_at.is_none_or(|wake_at| at < wake_at) {
            state.wake_at = Some(at);
            self.wake.notify_one();
        }
    }

    /// Stops renewing a lease; returns it if it was still held.
    fn forget(&self, id: u64) -> Option<Held> {
        lock(&self.state).held.remove(&id)
    }

    /// A renewal sent at `sent` succeeded: the next is due a third of the
    /// lease after it (unless a later one already pushed it further).
    fn renewed(&self, id: u64, sent: Instant) {
        if let Some(held) = lock(&self.state).held.get_mut(&id) {
            held.renew_at = held.renew_at.max(sent + held.lease / 3);
            held.certain_until = held.certain_until.max(sent + held.lease);
        }
    }

    /// A renewal failed: the lease is tried again at `at` at the latest.
    fn retry(&self, id: u64, at: Instant) {
        let mut state = lock(&self.state);
        if let Some(held) = state.held.get_mut(&id) {
            held.renew_at = held.renew_at.min(at);
            self.wake_by(&mut state, at);
        }
    }

    /// A renewal attempt ended, answered or not (its task dropped, the
    /// store's call panicked): it no longer counts as unanswered.
    fn attempt_ended(&self, id: u64) {
        if let Some(held) = lock(&self.state).held.get_mut(&id) {
            held.attempts = held.attempts.saturating_sub(1);
        }
    }

    fn is_idle_and_stopped(&self) -> bool {
        let state = lock(&self.state);
        state.held.is_empty()
            && !state.starting
            && state.task.as_ref().is_none_or(AbortHandle::is_finished)
    }

    /// Takes the leases due at `now` and records when the renewer must
    /// look next. Each is due again a tenth of its lease later (at most a
    /// second) unless its renewal succeeds meanwhile ([`Self::renewed`]):
    /// a renewal that hangs until `store_timeout` does not hold back the
    /// next, which may find the store answering again.
    fn due(&self, now: Instant) -> Vec<(u64, ScopeKey, OwnerToken, Duration)> {
        let mut state = lock(&self.state);
        let mut due = Vec::new();
        // At the latest a tick from now, to see leases taken meanwhile.
        let mut next = now + self.tick;
        for (id, held) in state.held.iter_mut() {
            if held.renew_at <= now {
                held.renew_at = now + retry_after(held.lease);
                if held.attempts < MAX_ATTEMPTS {
                    held.attempts += 1;
                    due.push((*id, held.key, held.owner, held.lease));
                }
            }
            next = next.min(held.renew_at);
        }
        state.wake_at = Some(next);
        due
    }
}

/// How soon a renewal that failed, or has not answered yet, is tried
/// again: often enough that a store outage shorter than a third of the
/// lease loses nothing, and never more than once a second. The outbox's
/// renewer follows the same rule after a failure.
pub(crate) fn retry_after(lease: Duration) -> Duration {
    (lease / 10).min(Duration::from_secs(1))
}

/// How many renewals of one lease may be unanswered at once, so that a
/// store that hangs is not flooded. While each hangs until
/// `store_timeout`, [`retry_after`] apart, this covers a `store_timeout`
/// of 15 of them (15 s at the default lease and more): past that, the
/// attempts pause until the oldest is abandoned.
const MAX_ATTEMPTS: u32 = 16;

/// One renewal attempt in flight: ends when dropped, however its task
/// ended.
struct Attempt<'a> {
    renewer: &'a Renewer,
    id: u64,
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        self.renewer.attempt_ended(self.id);
    }
}

/// A runtime's renewer, holding only a weak reference to the engine.
async fn renew(renewer: Arc<Renewer>, engine: Weak<Inner>) {
    loop {
        let Some(inner) = engine.upgrade() else {
            return;
        };
        let now = Instant::now();
        let due = renewer.due(now);
        // Held strongly only while renewals are sent: the sleep below
        // must not keep a dropped engine alive.
        if due.is_empty() {
            drop(inner);
        } else {
            let engine = Engine { inner };
            for (id, key, owner, lease) in due {
                // Each renewal on its own, so one slow store call never
                // delays the others past their leases.
                let (engine, renewer) = (engine.clone(), renewer.clone());
                tokio::spawn(async move {
                    let _attempt = Attempt {
                        renewer: &renewer,
                        id,
                    };
                    let store = &engine.inner.store;
                    match engine.store_call(store.renew(&key, &owner, lease)).await {
                        Ok(true) => renewer.renewed(id, now),
                        // Not ours any more: stop; quiet when it just settled.
                        Ok(false) => {
                            if renewer
                                .forget(id)
                                .is_some_and(|held| held.settling.is_none())
                            {
                                tracing::warn!(key = %key.short(), "idempotency lease lost");
                            }
                        }
                        Err(error) => {
                            tracing::warn!(key = %key.short(), %error, "idempotency lease renewal failed; retrying");
                            renewer.retry(id, Instant::now() + retry_after(lease));
                        }
                    }
                });
            }
        }
        let wake_at = lock(&renewer.state)
            .wake_at
            .unwrap_or_else(|| Instant::now() + renewer.tick);
        // Woken early only after a failed renewal (by its renewal task).
        tokio::select! {
            () = tokio::time::sleep_until(wake_at) => {}
            () = renewer.wake.notified() => {}
        }
        if engine.strong_count() == 0 {
            return;
        }
    }
}
