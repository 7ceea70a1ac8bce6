//! An in-process store: for tests, development and single-process services.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{
    Claim, Fingerprint, Outcome, OwnerToken, Record, RecordState, ScopeKey, Store, StoreError,
};

/// Keeps records in a mutex-guarded map inside the process.
///
/// It meets the whole [`Store`] contract within one process, and wakes
/// waiters the moment a key completes or is released (no polling). Records
/// vanish with the process: use the SQLite or PostgreSQL store where a
/// restart or a second instance must not execute a request again.
///
/// Clones share the same records.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    records: Mutex<HashMap<ScopeKey, Entry>>,
    waiters: Mutex<HashMap<ScopeKey, Arc<Notify>>>,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    expires_at: Instant,
    state: State,
}

#[derive(Debug)]
enum State {
    InFlight {
        owner: OwnerToken,
        lease_until: Instant,
    },
    Completed(Outcome),
}

impl Entry {
    fn record(&self, now: Instant) -> Record {
        let state = match &self.state {
            State::InFlight { lease_until, .. } => RecordState::InFlight {
                lease_remaining: lease_until.saturating_duration_since(now),
            },
            State::Completed(outcome) => RecordState::Completed(outcome.clone()),
        };
        Record {
            fingerprint: self.fingerprint,
            state,
        }
    }

    fn owned_by(&self, owner: &OwnerToken) -> bool {
        matches!(&self.state, State::InFlight { owner: o, .. } if o == owner)
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records (live or expired but not yet swept) it holds.
    pub fn len(&self) -> usize {
        self.records().len()
    }

    /// Whether it holds no record at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn records(&self) -> MutexGuard<'_, HashMap<ScopeKey, Entry>> {
        // A panic while holding the lock cannot leave a half-written entry
        // (every mutation is a single insert/remove/assign), so poisoning is
        // safe to ignore.
        self.inner
            .records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn waiters(&self) -> MutexGuard<'_, HashMap<ScopeKey, Arc<Notify>>> {
        self.inner
            .waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn notify(&self, key: &ScopeKey) {
        if let Some(notify) = self.waiters().get(key) {
            notify.notify_waiters();
        }
    }
}

/// One caller's registration for wake-ups on a key. Dropping it — after the
/// wait, or when the waiting caller is cancelled — removes the key's entry
/// once nobody else waits on it.
struct Waiter<'a> {
    store: &'a MemoryStore,
    key: ScopeKey,
    notify: Arc<Notify>,
}

impl<'a> Waiter<'a> {
    fn register(store: &'a MemoryStore, key: &ScopeKey) -> Self {
        let notify = store.waiters().entry(*key).or_default().clone();
        Waiter {
            store,
            key: *key,
            notify,
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut waiters = self.store.waiters();
        // Two references, the map's and ours: nobody else waits.
        if Arc::strong_count(&self.notify) <= 2
            && waiters
                .get(&self.key)
                .is_some_and(|n| Arc::ptr_eq(n, &self.notify))
        {
            waiters.remove(&self.key);
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn reserve(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        let takeover = match records.get(key) {
            None => false,
            Some(entry) if entry.expires_at <= now => false,
            Some(entry) => match &entry.state {
                State::InFlight { lease_until, .. }
                    if *lease_until <= now && entry.fingerprint == *fingerprint =>
                {
                    true
                }
                _ => return Ok(Claim::Existing(entry.record(now))),
            },
        };
        let owner = OwnerToken::random();
        records.insert(
            *key,
            Entry {
                fingerprint: *fingerprint,
                expires_at: now + ttl,
                state: State::InFlight {
                    owner,
                    lease_until: now + lease,
                },
            },
        );
        Ok(Claim::Acquired { owner, takeover })
    }

    async fn complete(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let done = {
            let mut records = self.records();
            match records.get_mut(key) {
                Some(entry) if entry.owned_by(owner) => {
                    entry.state = State::Completed(outcome.clone());
                    entry.expires_at = Instant::now() + ttl;
                    true
                }
                _ => false,
            }
        };
        if done {
            self.notify(key);
        }
        Ok(done)
    }

    async fn release(&self, key: &ScopeKey, owner: &OwnerToken) -> Result<bool, StoreError> {
        let done = {
            let mut records = self.records();
            match records.get(key) {
                Some(entry) if entry.owned_by(owner) => {
                    records.remove(key);
                    true
                }
                _ => false,
            }
        };
        if done {
            self.notify(key);
        }
        Ok(done)
    }

    async fn renew(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let mut records = self.records();
        match records.get_mut(key) {
            Some(Entry {
                state:
                    State::InFlight {
                        owner: o,
                        lease_until,
                    },
                expires_at,
                ..
            }) if o == owner => {
                let now = Instant::now();
                *lease_until = now + lease;
                // A live reservation never expires under its owner, however
                // long the call runs past its retention.
                *expires_at = (*expires_at).max(*lease_until);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn get(&self, key: &ScopeKey) -> Result<Option<Record>, StoreError> {
        let now = Instant::now();
        Ok(self
            .records()
            .get(key)
            .filter(|entry| entry.expires_at > now)
            .map(|entry| entry.record(now)))
    }

    async fn wait(&self, key: &ScopeKey, max: Duration, _attempt: u32) -> Result<(), StoreError> {
        let waiter = Waiter::register(self, key);
        let notified = waiter.notify.notified();
        tokio::pin!(notified);
        // Register before looking, so a completion between the look and the
        // await still wakes us.
        notified.as_mut().enable();
        let still_in_flight = matches!(
            self.records().get(key).map(|entry| &entry.state),
            Some(State::InFlight { .. })
        );
        if still_in_flight {
            let _ = tokio::time::timeout(max, notified).await;
        }
        Ok(())
    }

    async fn sweep(&self, batch: usize) -> Result<u64, StoreError> {
        let now = Instant::now();
        let mut records = self.records();
        let expired: Vec<ScopeKey> = records
            .iter()
            .filter(|(_, entry)| entry.expires_at <= now)
            .map(|(key, _)| *key)
            .take(batch)
            .collect();
        for key in &expired {
            records.remove(key);
        }
        Ok(expired.len() as u64)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter_entries(store: &MemoryStore) -> usize {
        store.waiters().len()
    }

    /// A caller that gives up while waiting (its client went away) must not
    /// leave its wake-up entry behind: the map would grow with every one.
    #[tokio::test(start_paused = true)]
    async fn a_cancelled_waiter_leaves_nothing_behind() {
        let store = MemoryStore::new();
        let key = ScopeKey([7; 32]);
        let lease = Duration::from_secs(30);
        let claim = store.reserve(&key, &Fingerprint([1; 32]), lease, lease);
        let Claim::Acquired { owner, .. } = claim.await.unwrap() else {
            panic!("a fresh key is acquired");
        };
        let cancelled = tokio::time::timeout(Duration::from_millis(10), store.wait(&key, lease, 0));
        assert!(cancelled.await.is_err(), "the wait was cut short");
        assert_eq!(waiter_entries(&store), 0);

        // A waiter that is woken also cleans up after itself.
        let waiter = tokio::spawn({
            let store = store.clone();
            async move { store.wait(&key, lease, 0).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(waiter_entries(&store), 1);
        assert!(store.release(&key, &owner).await.unwrap());
        waiter.await.unwrap().unwrap();
        assert_eq!(waiter_entries(&store), 0);
    }
}
