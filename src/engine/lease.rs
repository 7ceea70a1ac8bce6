//! Lease renewal for every live reservation of one engine, from one task.
//!
//! A reservation registers its key here when it is created and leaves when
//! it settles. One renewer task per engine renews each registered lease a
//! third of the lease after it was taken or last renewed, and otherwise
//! sleeps: a request that finishes in microseconds costs a map insert and
//! remove, not a task and a timer of its own.
//!
//! The renewer is started on the first reservation (on the runtime that
//! makes it), started again if that runtime went away, and stopped when the
//! engine is dropped. It sleeps until the earliest renewal is due and is
//! woken early only when a reservation with an earlier due time arrives;
//! while nothing is held it is parked.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::{Engine, Inner};
use crate::store::{OwnerToken, ScopeKey};

/// The leases one engine keeps alive.
#[derive(Debug, Default)]
pub(super) struct Leases {
    state: Mutex<State>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    held: HashMap<u64, Held>,
    /// When the renewer looks next; `None` while it is parked.
    wake_at: Option<Instant>,
    renewer: Option<AbortHandle>,
}

#[derive(Debug)]
struct Held {
    key: ScopeKey,
    owner: OwnerToken,
    lease: Duration,
    renew_at: Instant,
}

/// One registered lease; pass it back to [`Leases::forget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LeaseId(u64);

impl Leases {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every mutation is a single insert, remove or assignment, so a
        // panic elsewhere cannot leave the state half-written.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps `key`'s lease alive (renewed every third of `lease`) until
    /// [`forget`](Leases::forget) or until the store says the lease was
    /// lost. Must be called from inside a Tokio runtime.
    pub(super) fn hold(
        self: &Arc<Self>,
        engine: &Arc<Inner>,
        key: ScopeKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> LeaseId {
        let renew_at = Instant::now() + lease / 3;
        let mut state = self.state();
        let id = state.next_id;
        state.next_id += 1;
        state.held.insert(
            id,
            Held {
                key,
                owner,
                lease,
                renew_at,
            },
        );
        if state.renewer.as_ref().is_none_or(AbortHandle::is_finished) {
            // The new renewer looks at once and then computes its own wake-up.
            state.wake_at = Some(Instant::now());
            let task = tokio::spawn(renew(self.clone(), Arc::downgrade(engine)));
            state.renewer = Some(task.abort_handle());
        } else if state.wake_at.is_none_or(|at| renew_at < at) {
            state.wake_at = Some(renew_at);
            self.wake.notify_one();
        }
        LeaseId(id)
    }

    /// Stops renewing a lease. Returns whether it was still held.
    pub(super) fn forget(&self, id: LeaseId) -> bool {
        self.state().held.remove(&id.0).is_some()
    }

    /// Stops the renewer (the engine is going away).
    pub(super) fn stop(&self) {
        if let Some(renewer) = self.state().renewer.take() {
            renewer.abort();
        }
    }

    /// How many leases are held (for tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.state().held.len()
    }

    /// Takes the leases due at `now` (rescheduling each a third of its
    /// lease later) and records when the renewer must look next.
    fn due(&self, now: Instant) -> Vec<(LeaseId, ScopeKey, OwnerToken, Duration)> {
        let mut state = self.state();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        for (id, held) in state.held.iter_mut() {
            if held.renew_at <= now {
                held.renew_at = now + held.lease / 3;
                due.push((LeaseId(*id), held.key, held.owner, held.lease));
            }
            next = Some(next.map_or(held.renew_at, |at| at.min(held.renew_at)));
        }
        state.wake_at = next;
        due
    }
}

/// The renewer: one per engine, holding only a weak reference to it.
async fn renew(leases: Arc<Leases>, engine: Weak<Inner>) {
    loop {
        let due = leases.due(Instant::now());
        if !due.is_empty() {
            let Some(inner) = engine.upgrade() else {
                return;
            };
            let engine = Engine { inner };
            for (id, key, owner, lease) in due {
                // Each renewal on its own, so one slow store call never
                // delays the others past their leases.
                let (engine, leases) = (engine.clone(), leases.clone());
                tokio::spawn(async move {
                    let store = &engine.inner.store;
                    match engine.store_call(store.renew(&key, &owner, lease)).await {
                        Ok(true) => {}
                        // Not ours any more; quiet when it just settled.
                        Ok(false) => {
                            if leases.forget(id) {
                                tracing::warn!(key = %key.short(), "idempotency lease lost");
                            }
                        }
                        Err(error) => {
                            tracing::warn!(key = %key.short(), %error, "idempotency lease renewal failed");
                        }
                    }
                });
            }
        }
        let wake_at = leases.state().wake_at;
        match wake_at {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = leases.wake.notified() => {}
                }
            }
            None => leases.wake.notified().await,
        }
        if engine.strong_count() == 0 {
            return;
        }
    }
}
