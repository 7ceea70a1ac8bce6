//! An in-process store: for tests, development and single-process services.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{
    Admin, Claim, Fingerprint, Maintenance, Outcome, OwnerToken, PrincipalHash, Record,
    RecordState, ScopeKey, Store, StoreError,
};

mod admin;

/// Keeps records in a mutex-guarded map inside the process.
///
/// It meets the whole [`Store`] contract within one process, and wakes
/// waiters the moment a key completes or is released (no polling). Records
/// vanish with the process: use the SQLite or PostgreSQL store where a
/// restart or a second instance must not execute a request again.
///
/// * **Expiry needs no sweeper.** An expired record is removed when it is
///   next looked at, and every write also removes up to
///   [`EXPIRE_PER_WRITE`](MemoryStore::EXPIRE_PER_WRITE) records whose
///   retention ran out, oldest first, from an index ordered by expiry: a bounded amount
///   of work under the lock, never a scan of the whole map. An engine
///   sweeper still works ([`Maintenance::sweep`] takes from the same index).
/// * **Bounded memory.** At [`max_records`](MemoryStore::max_records)
///   records, or [`max_bytes`](MemoryStore::max_bytes) bytes of stored
///   responses and bookkeeping, [`Store::reserve`] refuses a new key with
///   [`StoreError::Full`] (the engine answers 503 on every route, fail-open
///   ones too: a full store stays full until records expire, so forwarding
///   would run every retry) instead of growing. A completion is never refused
///   (the request already ran), so the bytes may exceed the ceiling by the
///   responses of reservations granted before it was reached.
///
/// Clones share the same records.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::with_limits(Self::DEFAULT_MAX_RECORDS, Self::DEFAULT_MAX_BYTES)
    }
}

#[derive(Debug)]
struct Inner {
    table: Mutex<Table>,
    waiters: Mutex<HashMap<ScopeKey, Arc<Notify>, KeyHash>>,
    max_records: usize,
    max_bytes: usize,
    id: String,
}

#[derive(Debug, Default)]
struct Table {
    records: HashMap<ScopeKey, Entry, KeyHash>,
    /// `(expires_at, key)` of every record, soonest first: exactly one item
    /// per record, kept in step by [`Table::put`] and [`Table::remove`].
    expiry: BTreeSet<(Instant, ScopeKey)>,
    /// The sum of [`Entry::size`] over `records`.
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    expires_at: Instant,
    state: State,
    /// When the key was first reserved (kept across a takeover).
    created: Instant,
    /// The principal's hash, when reserved with one ([`Admin::reserve_for`]).
    principal: Option<PrincipalHash>,
}

#[derive(Debug)]
enum State {
    InFlight {
        owner: OwnerToken,
        lease_until: Instant,
    },
    Completed(Outcome),
}

/// The hasher of the store's maps. Their keys are scope hashes (SHA-256 or
/// HMAC-SHA-256 digests), so SipHash's mixing buys nothing; but a client
/// can compute a digest of its own key (without a key secret), so the
/// bucket a key lands in must still not be predictable: each map draws
/// two random 64-bit seeds, and every 8 bytes are folded in with a
/// 128-bit multiply by a seeded word (as foldhash does). A few
/// nanoseconds instead of SipHash's ~20 for 32 bytes.
#[derive(Clone, Copy, Debug)]
struct KeyHash {
    seeds: [u64; 2],
}

impl Default for KeyHash {
    fn default() -> Self {
        KeyHash {
            seeds: rand::random(),
        }
    }
}

impl std::hash::BuildHasher for KeyHash {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            hash: self.seeds[0],
            multiplier: self.seeds[1] | 1,
        }
    }
}

/// One [`KeyHash`] hashing: any bytes, 8 at a time.
struct KeyHasher {
    hash: u64,
    multiplier: u64,
}

impl KeyHasher {
    fn fold(&mut self, word: u64) {
        let product = u128::from(self.hash ^ word) * u128::from(self.multiplier);
        self.hash = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            self.fold(u64::from_le_bytes(chunk.try_into().expect("eight bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            // The length tells `[1]` from `[1, 0]`.
            self.fold(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.fold(n as u64);
    }

    fn finish(&self) -> u64 {
        self.hash
    }
}

/// What one record costs besides its response: the map slot, the entry and
/// its expiry items (an estimate).
const ENTRY_OVERHEAD: usize = 192;

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

    /// The bytes it accounts for against [`MemoryStore::max_bytes`].
    fn size(&self) -> usize {
        ENTRY_OVERHEAD
            + match &self.state {
                State::InFlight { .. } => 0,
                State::Completed(Outcome::Stored(response)) => {
                    response.body.len()
                        + response
                            .headers
                            .iter()
                            .map(|(name, value)| name.as_str().len() + value.len() + 16)
                            .sum::<usize>()
                }
                State::Completed(Outcome::Sealed(sealed)) => sealed.as_bytes().len(),
                State::Completed(Outcome::TooLarge { .. } | Outcome::Incomplete { .. }) => 0,
            }
    }
}

impl Table {
    /// Inserts or replaces `key`'s record, keeping the byte count and the
    /// expiry index.
    fn put(&mut self, key: ScopeKey, entry: Entry) {
        // The old item first: the new one may have the same retention.
        self.remove(&key);
        self.bytes += entry.size();
        self.expiry.insert((entry.expires_at, key));
        self.records.insert(key, entry);
    }

    fn remove(&mut self, key: &ScopeKey) {
        if let Some(old) = self.records.remove(key) {
            self.bytes -= old.size();
            self.expiry.remove(&(old.expires_at, *key));
        }
    }

    /// Moves `key`'s retention to `expires_at`.
    fn retain_until(&mut self, key: &ScopeKey, expires_at: Instant) {
        if let Some(entry) = self.records.get_mut(key) {
            self.expiry.remove(&(entry.expires_at, *key));
            entry.expires_at = expires_at;
            self.expiry.insert((expires_at, *key));
        }
    }

    /// Removes up to `limit` records whose retention ran out, soonest
    /// first, through the expiry index (no scan); returns how many.
    fn expire(&mut self, now: Instant, limit: usize) -> usize {
        let mut removed = 0;
        while removed < limit {
            match self.expiry.first() {
                Some(&(at, key)) if at <= now => self.remove(&key),
                _ => break,
            }
            removed += 1;
        }
        removed
    }
}

impl MemoryStore {
    /// Records removed (if expired) on each write, besides the one written.
    pub const EXPIRE_PER_WRITE: usize = 8;
    /// The default [`max_records`](MemoryStore::max_records): 100,000.
    pub const DEFAULT_MAX_RECORDS: usize = 100_000;
    /// The default [`max_bytes`](MemoryStore::max_bytes): 256 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 256 << 20;

    /// An empty store with the default ceilings
    /// ([`DEFAULT_MAX_RECORDS`](MemoryStore::DEFAULT_MAX_RECORDS),
    /// [`DEFAULT_MAX_BYTES`](MemoryStore::DEFAULT_MAX_BYTES)).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that refuses new reservations (with
    /// [`StoreError::Full`]) once it holds `max_records` live records or
    /// `max_bytes` bytes of responses and bookkeeping.
    pub fn with_limits(max_records: usize, max_bytes: usize) -> Self {
        MemoryStore {
            inner: Arc::new(Inner {
                table: Mutex::default(),
                waiters: Mutex::default(),
                max_records,
                max_bytes,
                id: hex::encode(rand::random::<[u8; 16]>()),
            }),
        }
    }

    /// The most records it holds before refusing new keys.
    pub fn max_records(&self) -> usize {
        self.inner.max_records
    }

    /// The most bytes (responses plus about 200 bytes per record) it holds
    /// before refusing new keys.
    pub fn max_bytes(&self) -> usize {
        self.inner.max_bytes
    }

    /// How many records (live, or expired but not yet removed) it holds.
    pub fn len(&self) -> usize {
        self.table().records.len()
    }

    /// Whether it holds no record at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes its records account for (see [`max_bytes`](MemoryStore::max_bytes)).
    pub fn bytes(&self) -> usize {
        self.table().bytes
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave a half-written entry
        // (every mutation completes before anything can panic), so
        // poisoning is safe to ignore.
        self.inner
            .table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn waiters(&self) -> MutexGuard<'_, HashMap<ScopeKey, Arc<Notify>, KeyHash>> {
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

impl MemoryStore {
    /// Whether a new key fits under the ceilings, once expired records
    /// made room (still a bounded amount of work); else
    /// [`StoreError::Full`] saying which ceiling.
    fn room_for_a_key(&self, table: &mut Table, now: Instant) -> Result<(), StoreError> {
        let at_ceiling = |table: &Table| {
            table.records.len() >= self.inner.max_records
                || table.bytes + ENTRY_OVERHEAD > self.inner.max_bytes
        };
        if at_ceiling(table) {
            table.expire(now, 32 * Self::EXPIRE_PER_WRITE);
        }
        if !at_ceiling(table) {
            return Ok(());
        }
        let what = match table.records.len() >= self.inner.max_records {
            true => format!("{} records", table.records.len()),
            false => format!("{} bytes", table.bytes),
        };
        Err(StoreError::Full(format!("the memory store holds {what}")))
    }

    /// [`Store::reserve`], keeping `principal` with the record.
    fn reserve_with(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
        principal: Option<&PrincipalHash>,
    ) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut table = self.table();
        table.expire(now, Self::EXPIRE_PER_WRITE);
        let takeover = match table.records.get(key) {
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
        // A new key must fit under the ceilings (a takeover or an expired
        // record's slot replaces one already counted).
        if !table.records.contains_key(key) {
            self.room_for_a_key(&mut table, now)?;
        }
        let created = match table.records.get(key) {
            Some(entry) if takeover => entry.created,
            _ => now,
        };
        table.put(
            *key,
            Entry {
                fingerprint: *fingerprint,
                expires_at: now + ttl,
                state: State::InFlight {
                    owner: *owner,
                    lease_until: now + lease,
                },
                created,
                principal: principal.copied(),
            },
        );
        Ok(Claim::Acquired { takeover })
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn reserve(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        self.reserve_with(key, fingerprint, owner, lease, ttl, None)
    }

    async fn complete(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let done = {
            let now = Instant::now();
            let mut table = self.table();
            table.expire(now, Self::EXPIRE_PER_WRITE);
            match table.records.get(key) {
                Some(entry) if entry.owned_by(owner) => {
                    let entry = Entry {
                        fingerprint: entry.fingerprint,
                        expires_at: now + ttl,
                        state: State::Completed(outcome.clone()),
                        created: entry.created,
                        principal: entry.principal,
                    };
                    table.put(*key, entry);
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
            let mut table = self.table();
            table.expire(Instant::now(), Self::EXPIRE_PER_WRITE);
            match table.records.get(key) {
                Some(entry) if entry.owned_by(owner) => {
                    table.remove(key);
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
        let mut table = self.table();
        let now = Instant::now();
        let extended = match table.records.get_mut(key) {
            Some(Entry {
                state:
                    State::InFlight {
                        owner: o,
                        lease_until,
                    },
                expires_at,
                ..
            }) if o == owner => {
                *lease_until = now + lease;
                // A live reservation never expires under its owner, however
                // long the call runs past its retention.
                (*lease_until > *expires_at).then_some(*lease_until)
            }
            _ => return Ok(false),
        };
        if let Some(at) = extended {
            table.retain_until(key, at);
        }
        Ok(true)
    }

    async fn get(&self, key: &ScopeKey) -> Result<Option<Record>, StoreError> {
        let now = Instant::now();
        let mut table = self.table();
        match table.records.get(key) {
            Some(entry) if entry.expires_at > now => Ok(Some(entry.record(now))),
            Some(_) => {
                // Expired: removed as it is looked at.
                table.remove(key);
                Ok(None)
            }
            None => Ok(None),
        }
    }

    async fn wait(&self, key: &ScopeKey, max: Duration, _attempt: u32) -> Result<(), StoreError> {
        let waiter = Waiter::register(self, key);
        let notified = waiter.notify.notified();
        tokio::pin!(notified);
        // Register before looking, so a completion between the look and the
        // await still wakes us.
        notified.as_mut().enable();
        let still_in_flight = matches!(
            self.table().records.get(key).map(|entry| &entry.state),
            Some(State::InFlight { .. })
        );
        if still_in_flight {
            let _ = tokio::time::timeout(max, notified).await;
        }
        Ok(())
    }

    /// Always answers: a full store is reachable still (stored keys
    /// replay). A readiness probe on a full store would take every route
    /// out of service, uncovered ones too, for as long as any client cares
    /// to keep it full; new keys get 503 instead, and say why in the log.
    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn identity(&self) -> Result<Option<String>, StoreError> {
        Ok(Some(self.inner.id.clone()))
    }

    fn maintenance(&self) -> Option<&dyn Maintenance> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn Admin> {
        Some(self)
    }
}

#[async_trait]
impl Maintenance for MemoryStore {
    /// Removes up to `batch` expired records through the expiry index (the
    /// store also does this a little on every write).
    async fn sweep(&self, batch: usize) -> Result<u64, StoreError> {
        Ok(self.table().expire(Instant::now(), batch) as u64)
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
        let owner = OwnerToken::random();
        let claim = store.reserve(&key, &Fingerprint([1; 32]), &owner, lease, lease);
        let Claim::Acquired { .. } = claim.await.unwrap() else {
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

    /// The expiry index and the byte count stay in step with the map
    /// through every kind of write, and expiry removes exactly the records
    /// whose retention ran out.
    #[tokio::test(start_paused = true)]
    async fn the_expiry_index_and_byte_count_follow_every_write() {
        let store = MemoryStore::new();
        let check = |store: &MemoryStore| {
            let table = store.table();
            assert_eq!(table.expiry.len(), table.records.len());
            for (key, entry) in &table.records {
                assert!(table.expiry.contains(&(entry.expires_at, *key)));
            }
            let bytes: usize = table.records.values().map(Entry::size).sum();
            assert_eq!(table.bytes, bytes);
        };
        let short = Duration::from_millis(100);
        let long = Duration::from_secs(60);
        let outcome = Outcome::Stored(crate::store::StoredResponse {
            status: http::StatusCode::OK,
            headers: vec![(http::header::ETAG, http::HeaderValue::from_static("x"))],
            body: bytes::Bytes::from_static(b"a response body"),
        });
        let mut owners = Vec::new();
        for i in 0..40u8 {
            let key = ScopeKey([i; 32]);
            let owner = OwnerToken::random();
            let ttl = if i % 2 == 0 { short } else { long };
            let claim = store.reserve(&key, &Fingerprint([1; 32]), &owner, short, ttl);
            assert!(matches!(claim.await.unwrap(), Claim::Acquired { .. }));
            match i % 4 {
                0 | 1 => assert!(store.complete(&key, &owner, &outcome, ttl).await.unwrap()),
                2 => assert!(store.release(&key, &owner).await.unwrap()),
                _ => assert!(store.renew(&key, &owner, long * 2).await.unwrap()),
            }
            owners.push(owner);
            check(&store);
        }
        tokio::time::sleep(short * 2).await;
        // The even keys (short retention, completed or released) are due;
        // every other survives, however many writes and sweeps come.
        store.get(&ScopeKey([0; 32])).await.unwrap();
        check(&store);
        let swept = store.sweep(1000).await.unwrap();
        check(&store);
        assert_eq!(store.len(), 20, "swept {swept}");
        for i in (1..40u8).step_by(2) {
            assert!(store.get(&ScopeKey([i; 32])).await.unwrap().is_some());
        }
        assert_eq!(store.sweep(1000).await.unwrap(), 0);
    }
}

#[cfg(test)]
mod key_hash_tests {
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn key_hash_is_stable_per_map_and_seeded_per_map() {
        let (a, b) = (KeyHash::default(), KeyHash::default());
        let key = ScopeKey([7; 32]);
        assert_eq!(a.hash_one(key), a.hash_one(key));
        assert_ne!(a.hash_one(key), b.hash_one(key), "random seeds");
        assert_ne!(a.hash_one(key), a.hash_one(ScopeKey([8; 32])));
        // Trailing bytes and lengths count.
        assert_ne!(
            a.hash_one([1u8].as_slice()),
            a.hash_one([1u8, 0].as_slice())
        );
        let mut map: HashMap<ScopeKey, usize, KeyHash> = HashMap::default();
        for i in 0..1000u16 {
            let mut bytes = [0; 32];
            bytes[30..].copy_from_slice(&i.to_be_bytes());
            map.insert(ScopeKey(bytes), usize::from(i));
        }
        assert!((0..1000u16).all(|i| {
            let mut bytes = [0; 32];
            bytes[30..].copy_from_slice(&i.to_be_bytes());
            map.get(&ScopeKey(bytes)) == Some(&usize::from(i))
        }));
    }
}
