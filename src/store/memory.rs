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

    fn notify(&self, key: &ScopeKey) {
        let waiters = self
            .inner
            .waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(notify) = waiters.get(key) {
            notify.notify_waiters();
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
        let owner = OwnerToken::random();
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
        let notify = {
            let mut waiters = self
                .inner
                .waiters
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            waiters.entry(*key).or_default().clone()
        };
        let notified = notify.notified();
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
        let mut waiters = self
            .inner
            .waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Two references: the map's and ours. Nobody else waits: drop it.
        if Arc::strong_count(&notify) <= 2 {
            waiters.remove(key);
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
