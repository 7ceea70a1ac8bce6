//! The memory store's [`Admin`] side. Listing, counting and purging by
//! principal walk the whole map under its lock: at most
//! [`max_records`](MemoryStore::max_records) entries, an operator's
//! question, not a request's.

use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Entry, MemoryStore, State};
use crate::store::{
    Admin, Claim, Fingerprint, KeyState, Outcome, OwnerToken, PrincipalHash, RecordInfo, ScopeKey,
    StateCounts, StoreError,
};

impl Entry {
    fn info(&self, key: ScopeKey, now: Instant) -> RecordInfo {
        let (state, lease_remaining) = match &self.state {
            State::InFlight { lease_until, .. } => (
                KeyState::InFlight,
                Some(lease_until.saturating_duration_since(now)),
            ),
            State::Completed(Outcome::Stored(_)) => (KeyState::Completed, None),
            State::Completed(Outcome::TooLarge { .. }) => (KeyState::TooLarge, None),
            State::Completed(Outcome::Incomplete { .. }) => (KeyState::Incomplete, None),
            State::Completed(Outcome::Sealed(_)) => (KeyState::Sealed, None),
        };
        let mut info = RecordInfo::new(key, state, self.fingerprint);
        info.age = now.saturating_duration_since(self.created);
        info.expires_in = self.expires_at.saturating_duration_since(now);
        info.lease_remaining = lease_remaining;
        info.has_principal = self.principal.is_some();
        if let State::InFlight { owner, .. } = &self.state {
            info = info.held_by(*owner);
        }
        if let State::Completed(outcome) = &self.state {
            info.status = outcome.status();
            if let Outcome::Stored(response) = outcome {
                info.body_bytes = Some(response.body.len() as u64);
                info.header_bytes = Some(response.encode_headers().len() as u64);
            }
        }
        info
    }
}

#[async_trait]
impl Admin for MemoryStore {
    async fn reserve_for(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
        principal: Option<&PrincipalHash>,
    ) -> Result<Claim, StoreError> {
        self.reserve_with(key, fingerprint, owner, lease, ttl, principal)
    }

    async fn inspect(&self, key: &ScopeKey) -> Result<Option<RecordInfo>, StoreError> {
        let now = Instant::now();
        let table = self.table();
        Ok(table
            .records
            .get(key)
            .filter(|entry| entry.expires_at > now)
            .map(|entry| entry.info(*key, now)))
    }

    async fn purge(&self, key: &ScopeKey) -> Result<bool, StoreError> {
        let done = {
            let mut table = self.table();
            let found = table.records.contains_key(key);
            table.remove(key);
            found
        };
        if done {
            self.notify(key);
        }
        Ok(done)
    }

    async fn principal_keys(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError> {
        let table = self.table();
        Ok(table
            .records
            .iter()
            .filter(|(_, entry)| entry.principal.as_ref() == Some(principal))
            .map(|(key, _)| *key)
            .take(limit)
            .collect())
    }

    async fn purge_principal(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError> {
        let keys: Vec<ScopeKey> = {
            let mut table = self.table();
            let keys: Vec<ScopeKey> = table
                .records
                .iter()
                .filter(|(_, entry)| entry.principal.as_ref() == Some(principal))
                .map(|(key, _)| *key)
                .take(limit)
                .collect();
            for key in &keys {
                table.remove(key);
            }
            keys
        };
        for key in &keys {
            self.notify(key);
        }
        Ok(keys)
    }

    async fn force_release(&self, key: &ScopeKey) -> Result<bool, StoreError> {
        let done = {
            let mut table = self.table();
            let in_flight = matches!(
                table.records.get(key).map(|entry| &entry.state),
                Some(State::InFlight { .. })
            );
            if in_flight {
                table.remove(key);
            }
            in_flight
        };
        if done {
            self.notify(key);
        }
        Ok(done)
    }

    async fn in_flight_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        let now = Instant::now();
        let table = self.table();
        let mut found: Vec<RecordInfo> = table
            .records
            .iter()
            .filter(|(_, entry)| {
                matches!(entry.state, State::InFlight { .. })
                    && entry.expires_at > now
                    && now.saturating_duration_since(entry.created) >= age
            })
            .map(|(key, entry)| entry.info(*key, now))
            .collect();
        found.sort_by_key(|info| std::cmp::Reverse(info.age));
        found.truncate(limit);
        Ok(found)
    }

    async fn counts(&self) -> Result<StateCounts, StoreError> {
        let now = Instant::now();
        let table = self.table();
        let mut counts = StateCounts::default();
        for entry in table.records.values() {
            let slot = if entry.expires_at <= now {
                &mut counts.expired
            } else {
                match &entry.state {
                    State::InFlight { lease_until, .. } if *lease_until <= now => {
                        &mut counts.lease_expired
                    }
                    State::InFlight { .. } => &mut counts.in_flight,
                    // A sealed outcome counts as completed, as in SQL.
                    State::Completed(Outcome::Stored(_) | Outcome::Sealed(_)) => {
                        &mut counts.completed
                    }
                    State::Completed(Outcome::TooLarge { .. }) => &mut counts.too_large,
                    State::Completed(Outcome::Incomplete { .. }) => &mut counts.incomplete,
                }
            };
            *slot += 1;
        }
        Ok(counts)
    }
}
