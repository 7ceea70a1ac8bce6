//! A Redis front cache in front of another store: [`RedisCache`].
//!
//! The cached records, the connection and the counters live here; the
//! guarantees are documented on [`RedisCache`].

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, Cmd, FromRedisValue, RedisError};
use async_trait::async_trait;
use tokio::sync::Notify;

use super::{
    Claim, Fingerprint, Maintenance, Outcome, OwnerToken, Record, RecordState, ScopeKey, Store,
    StoreError,
};

/// How [`RedisCache`] reaches Redis.
#[derive(Clone)]
pub struct RedisCacheConfig {
    /// The Redis URL, e.g. `redis://127.0.0.1:6379` or
    /// `redis://:password@host:6379/2`.
    pub url: String,
    /// Prepended to every key (default `idem:`), to share a Redis with
    /// other applications. The inner store's
    /// [`identity`](Store::identity) follows it, so deployments with
    /// different stores of record never share entries even under one
    /// prefix.
    pub prefix: String,
    /// The longest a single Redis call may take before the inner store
    /// answers instead (default 100 ms).
    pub timeout: Duration,
    /// The longest an entry copied from the inner store (after a miss) is
    /// kept, because the inner store does not tell how long its record has
    /// left (default 60 s). Entries written at completion keep the record's
    /// own TTL.
    pub fill_ttl: Duration,
    /// How long Redis is skipped after a failed call (default 1 s).
    pub cooldown: Duration,
}

impl RedisCacheConfig {
    /// The defaults for Redis at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisCacheConfig {
            url: url.into(),
            prefix: "idem:".to_owned(),
            timeout: Duration::from_millis(100),
            fill_ttl: Duration::from_secs(60),
            cooldown: Duration::from_secs(1),
        }
    }

    /// Sets [`prefix`](Self::prefix).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl Default for RedisCacheConfig {
    /// The defaults for Redis on `redis://127.0.0.1:6379`.
    fn default() -> Self {
        Self::new("redis://127.0.0.1:6379")
    }
}

impl fmt::Debug for RedisCacheConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCacheConfig")
            .field("url", &redact(&self.url))
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("fill_ttl", &self.fill_ttl)
            .field("cooldown", &self.cooldown)
            .finish()
    }
}

/// The URL without its credentials, for logs and `Debug`.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

/// A [`Store`] that answers replays from Redis and leaves every decision to
/// the inner store `S`.
///
/// Replays are the hot path of an idempotency layer (double clicks, client
/// and proxy retries), and a replay only needs a *completed* record. The
/// cache keeps completed records in Redis, so a replay usually costs one
/// Redis round trip instead of a query to the store of record (PostgreSQL in
/// production). It follows tower-sessions' `CachingSessionStore`: the inner
/// store is the truth, Redis a copy of some of its records.
///
/// # What Redis decides: nothing
///
/// * Reservations, takeovers, completions, releases, renewals and sweeps go
///   to the inner store only, and their answers are the inner store's.
///   Redis never decides who executes.
/// * Only completed records are cached, and only *after* the inner store
///   committed them: [`Store::complete`] writes to Redis once the inner
///   store returned `true` — in the background, so the answer does not
///   wait for Redis ([`RedisCache::settled`] waits for such writes).
/// * A lookup ([`Store::reserve`], [`Store::get`]) asks Redis first. A hit
///   is returned as the record that stands ([`Claim::Existing`]), whatever
///   the request's fingerprint: the engine replays it when the fingerprint
///   matches and answers "mismatch" when it does not — exactly what it does
///   with the same record from the inner store, because the inner store
///   returns a live completed record as `Existing` for every fingerprint
///   (only in-flight records can be taken over). A miss asks the inner
///   store, and a completed record found there is copied into Redis.
///
/// # Why the cache cannot change an outcome
///
/// A cached entry exists only for a record the inner store completed, and a
/// completed record never changes until its retention runs out (owner checks
/// make `complete`, `release` and `renew` fail on it; takeovers apply to
/// in-flight records only). So while the inner record lives, the cached copy
/// is exactly what the inner store would answer. Two things remain:
///
/// * **Expiry.** An entry written by `complete` gets the record's TTL minus
///   the time elapsed since just *before* the inner call, so it expires no
///   later than the inner record (up to the one-way delay to Redis, far
///   below any real TTL). The [`Store`] trait cannot tell the remaining
///   retention of a record found by a lookup, so an entry *filled* from the
///   inner store lives at most [`RedisCacheConfig::fill_ttl`] (and, in
///   `reserve`, at most the route's TTL). This is the one stale window: for
///   at most `fill_ttl` after the inner record expired, a request with that
///   key gets the old replay (or mismatch) instead of a fresh execution. It
///   can never cause a second execution. Keep `fill_ttl` short (default
///   60 s) relative to the retention.
/// * **A new record after expiry.** Completions overwrite (`SET`), fills
///   only write where nothing is cached (`SET NX`), so a slow fill of an old
///   record can never replace the entry of a newer completion.
///
/// # Redis failures change latency, never an outcome
///
/// Every Redis call is bounded by [`RedisCacheConfig::timeout`]. A failure,
/// a timeout or an undecodable entry is counted, logged at most once per
/// 10 s (with the count since the last warning), and the call goes on
/// through the inner store as if Redis had missed. After a failure Redis is
/// skipped for [`RedisCacheConfig::cooldown`], so a dead Redis costs at most
/// one timeout per cooldown, not one per request. Redis may be down when the
/// cache is built: it connects in the background on first use and the
/// `redis` crate's connection manager reconnects after a restart. A flushed
/// or evicted Redis is just a cold cache.
///
/// Redis keys are `prefix + store id + ":" + hex(scope key)`: hashes only,
/// no raw key, principal or body. The store id is the inner store's
/// [`Store::identity`] (kept in the database itself for PostgreSQL and
/// SQLite, random per [`MemoryStore`](crate::MemoryStore)), read once on
/// first use: two deployments with separate databases sharing one Redis
/// (staging and production, two regions) never read each other's entries,
/// whatever their prefixes. Until the id has been read (the inner store is
/// down at start), Redis is not used at all. An inner store without an
/// identity leaves the prefix alone to separate deployments. Values are the fingerprint and [`Outcome::encode`].
/// Run Redis with a `maxmemory` and a `volatile-*` eviction policy: every
/// entry has a TTL, and an evicted entry is a miss.
///
/// Clones share the connection and the counters.
#[derive(Clone)]
pub struct RedisCache<S> {
    inner: S,
    redis: Arc<Link>,
}

impl<S: Store> RedisCache<S> {
    /// A cache for `inner` in the Redis that `config` names.
    ///
    /// Only the URL is checked here (a malformed one is
    /// [`StoreError::Unavailable`]); Redis itself is connected on first use,
    /// in the background, so this succeeds while Redis is down.
    pub fn new(inner: S, config: RedisCacheConfig) -> Result<Self, StoreError> {
        let client =
            Client::open(config.url.as_str()).map_err(|e| StoreError::Unavailable(Box::new(e)))?;
        Ok(RedisCache {
            inner,
            redis: Arc::new(Link {
                client,
                manager: OnceLock::new(),
                connecting: AtomicBool::new(false),
                connected: Notify::new(),
                config,
                epoch: Instant::now(),
                skip_until_ms: AtomicU64::new(0),
                last_warn_ms: AtomicU64::new(0),
                warned_errors: AtomicU64::new(0),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                skipped: AtomicU64::new(0),
                pending: Mutex::default(),
                writing: AtomicUsize::new(0),
                written: Notify::new(),
                namespace: OnceLock::new(),
            }),
        })
    }

    /// The store of record.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The Redis key prefix in use: the configured prefix, the inner
    /// store's identity and `:`; `None` until the identity has been read.
    pub fn namespace(&self) -> Option<&str> {
        self.redis.namespace.get().map(String::as_str)
    }

    /// Whether Redis may be used: the namespace is known, reading the inner
    /// store's identity first if needed (a failure is logged like a Redis
    /// failure, and the call goes to the inner store alone).
    async fn named(&self) -> bool {
        if self.redis.namespace.get().is_some() {
            return true;
        }
        match self.inner.identity().await {
            Ok(id) => {
                let namespace = match id {
                    Some(id) => format!("{}{id}:", self.redis.config.prefix),
                    None => self.redis.config.prefix.clone(),
                };
                let _ = self.redis.namespace.set(namespace);
                true
            }
            Err(error) => {
                self.redis
                    .failed(&format!("the store's identity is unknown: {error}"));
                false
            }
        }
    }

    /// Waits until every Redis write issued so far has ended (written,
    /// failed or timed out). Writes run behind the answers they copy, so
    /// no request waits for them; this is for tests and orderly shutdowns.
    pub async fn settled(&self) {
        self.redis.settled().await;
    }
}

impl<S: fmt::Debug> fmt::Debug for RedisCache<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCache")
            .field("inner", &self.inner)
            .field("config", &self.redis.config)
            .finish()
    }
}

#[async_trait]
impl<S: Store> Store for RedisCache<S> {
    async fn reserve(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        if !self.named().await {
            return self
                .inner
                .reserve(key, fingerprint, owner, lease, ttl)
                .await;
        }
        if let Some(record) = self.redis.lookup(key).await {
            return Ok(Claim::Existing(record));
        }
        let claim = self
            .inner
            .reserve(key, fingerprint, owner, lease, ttl)
            .await?;
        match &claim {
            Claim::Acquired { .. } => self.redis.remember(*owner, *fingerprint),
            Claim::Existing(record) => {
                let ttl = ttl.min(self.redis.config.fill_ttl);
                self.redis.fill(key, record, ttl);
            }
        }
        Ok(claim)
    }

    async fn complete(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        // Taken before the inner store starts its clock, so the cached entry
        // expires no later than the inner record.
        let started = Instant::now();
        let fingerprint = self.redis.fingerprint_of(owner);
        // On an error the entry stays, for the engine's retry.
        let done = self.inner.complete(key, owner, outcome, ttl).await?;
        self.redis.forget(owner);
        if let (true, Some(fingerprint)) = (done, fingerprint) {
            let value = encode(&fingerprint, outcome);
            self.redis
                .write_behind(key, value, started + ttl, Write::Overwrite);
        }
        Ok(done)
    }

    async fn release(&self, key: &ScopeKey, owner: &OwnerToken) -> Result<bool, StoreError> {
        // Only completed records are cached: nothing to do in Redis.
        self.redis.forget(owner);
        self.inner.release(key, owner).await
    }

    async fn renew(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(key, owner, lease).await
    }

    async fn get(&self, key: &ScopeKey) -> Result<Option<Record>, StoreError> {
        if !self.named().await {
            return self.inner.get(key).await;
        }
        if let Some(record) = self.redis.lookup(key).await {
            return Ok(Some(record));
        }
        let record = self.inner.get(key).await?;
        if let Some(record) = &record {
            self.redis.fill(key, record, self.redis.config.fill_ttl);
        }
        Ok(record)
    }

    async fn wait(&self, key: &ScopeKey, max: Duration, attempt: u32) -> Result<(), StoreError> {
        self.inner.wait(key, max, attempt).await
    }

    /// The inner store's health only: Redis down is not a failure.
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn identity(&self) -> Result<Option<String>, StoreError> {
        self.inner.identity().await
    }

    fn maintenance(&self) -> Option<&dyn Maintenance> {
        Some(self)
    }
}

#[async_trait]
impl<S: Store> Maintenance for RedisCache<S> {
    /// The inner store's sweep (nothing when it has no maintenance side):
    /// Redis entries expire by their own TTL.
    async fn sweep(&self, batch: usize) -> Result<u64, StoreError> {
        match self.inner.maintenance() {
            Some(inner) => inner.sweep(batch).await,
            None => Ok(0),
        }
    }

    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        let redis = &self.redis;
        let mut counters = vec![
            (
                "idempotency_redis_hits_total",
                "Lookups answered from the Redis cache.",
                redis.hits.load(Relaxed),
            ),
            (
                "idempotency_redis_misses_total",
                "Lookups Redis had no entry for (the inner store answered).",
                redis.misses.load(Relaxed),
            ),
            (
                "idempotency_redis_errors_total",
                "Redis calls that failed, timed out or read an undecodable entry.",
                redis.errors.load(Relaxed),
            ),
            (
                "idempotency_redis_skipped_total",
                "Redis calls skipped while cooling down after a failure.",
                redis.skipped.load(Relaxed),
            ),
        ];
        if let Some(inner) = self.inner.maintenance() {
            counters.extend(inner.counters());
        }
        counters
    }
}

/// The first byte of every cached value: the layout below.
const FORMAT: u8 = 1;

/// `FORMAT`, the 32-byte fingerprint, then [`Outcome::encode`].
fn encode(fingerprint: &Fingerprint, outcome: &Outcome) -> Vec<u8> {
    let outcome = outcome.encode();
    let mut value = Vec::with_capacity(1 + 32 + outcome.len());
    value.push(FORMAT);
    value.extend_from_slice(fingerprint.as_bytes());
    value.extend_from_slice(&outcome);
    value
}

fn decode(value: &[u8]) -> Result<Record, StoreError> {
    match value.split_first() {
        Some((&FORMAT, rest)) if rest.len() >= 32 => Ok(Record {
            fingerprint: Fingerprint::from_slice(&rest[..32])?,
            state: RecordState::Completed(Outcome::decode(&rest[32..])?),
        }),
        _ => Err(StoreError::Corrupt("cached record".into())),
    }
}

/// Whether a write may replace an existing entry.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    /// A completion: the newest truth, replaces anything.
    Overwrite,
    /// A copy from the inner store: never replaces an entry, which may come
    /// from a newer completion.
    IfAbsent,
}

/// The connection, settings and counters shared by clones of a cache.
struct Link {
    client: Client,
    /// Set once the first connection succeeded; it reconnects by itself.
    manager: OnceLock<ConnectionManager>,
    /// A background connect is under way.
    connecting: AtomicBool,
    /// Woken when a background connect ends, either way.
    connected: Notify,
    config: RedisCacheConfig,
    /// The origin of the millisecond clock below.
    epoch: Instant,
    skip_until_ms: AtomicU64,
    last_warn_ms: AtomicU64,
    warned_errors: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    skipped: AtomicU64,
    pending: Mutex<Pending>,
    /// Background writes under way, and their end.
    writing: AtomicUsize,
    written: Notify,
    /// `prefix + store id + ":"`, once the inner store's identity is known.
    namespace: OnceLock<String>,
}

/// The fingerprint of every reservation this cache granted and that is not
/// settled yet: `complete` needs it for the cached value but is not given
/// it. An entry leaves at `complete` or `release`; one whose reservation
/// was abandoned (its completion failed for good, its task was cancelled)
/// is dropped once older than [`PENDING_MAX_AGE`], when the map has doubled
/// since the last look — a dropped entry only means one completion is not
/// cached.
#[derive(Default)]
struct Pending {
    entries: HashMap<OwnerToken, (Fingerprint, Instant)>,
    prune_at: usize,
}

/// No reservation outlives this without being settled, in practice.
const PENDING_MAX_AGE: Duration = Duration::from_secs(60 * 60);

/// How long after the last warning a Redis failure is logged again.
const WARN_EVERY_MS: u64 = 10_000;

impl Link {
    /// The Redis key of `key`; `None` while the namespace is unknown.
    fn key(&self, key: &ScopeKey) -> Option<String> {
        let namespace = self.namespace.get()?;
        Some(format!("{namespace}{}", key.to_hex()))
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        // Every mutation leaves the map whole: a poisoned one can be used.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn remember(&self, owner: OwnerToken, fingerprint: Fingerprint) {
        let mut pending = self.pending();
        pending.entries.insert(owner, (fingerprint, Instant::now()));
        if pending.entries.len() >= pending.prune_at {
            pending
                .entries
                .retain(|_, (_, since)| since.elapsed() < PENDING_MAX_AGE);
            pending.prune_at = (pending.entries.len() * 2).max(1024);
        }
    }

    fn fingerprint_of(&self, owner: &OwnerToken) -> Option<Fingerprint> {
        self.pending().entries.get(owner).map(|(fp, _)| *fp)
    }

    fn forget(&self, owner: &OwnerToken) {
        self.pending().entries.remove(owner);
    }

    /// The cached completed record for `key`, or `None` (miss, failure,
    /// cooling down, undecodable entry) to ask the inner store.
    async fn lookup(self: &Arc<Self>, key: &ScopeKey) -> Option<Record> {
        let value: Option<Vec<u8>> = self.call(::redis::cmd("GET").arg(self.key(key)?)).await?;
        let Some(value) = value else {
            self.misses.fetch_add(1, Relaxed);
            return None;
        };
        match decode(&value) {
            Ok(record) => {
                self.hits.fetch_add(1, Relaxed);
                Some(record)
            }
            Err(error) => {
                // Redis answered: no cooldown. A completion overwrites it.
                self.failed(&error);
                None
            }
        }
    }

    /// Copies a completed `record` found in the inner store into Redis.
    fn fill(self: &Arc<Self>, key: &ScopeKey, record: &Record, ttl: Duration) {
        if let RecordState::Completed(outcome) = &record.state {
            let value = encode(&record.fingerprint, outcome);
            self.write_behind(key, value, Instant::now() + ttl, Write::IfAbsent);
        }
    }

    /// Writes an entry in the background, so the caller's answer never
    /// waits for Redis. The entry expires at `expires` (its remaining time
    /// is taken when the write is sent, so a write that ran late cannot
    /// outlive the record it copies).
    fn write_behind(
        self: &Arc<Self>,
        key: &ScopeKey,
        value: Vec<u8>,
        expires: Instant,
        mode: Write,
    ) {
        self.writing.fetch_add(1, SeqCst);
        let (link, key) = (self.clone(), *key);
        tokio::spawn(async move {
            let left = expires.saturating_duration_since(Instant::now());
            link.write(&key, value, left, mode).await;
            if link.writing.fetch_sub(1, SeqCst) == 1 {
                link.written.notify_waiters();
            }
        });
    }

    /// Waits until no background write is under way.
    async fn settled(&self) {
        loop {
            let written = self.written.notified();
            tokio::pin!(written);
            // Register before looking, so a last write ending in between
            // still wakes us.
            written.as_mut().enable();
            if self.writing.load(SeqCst) == 0 {
                return;
            }
            written.await;
        }
    }

    async fn write(self: &Arc<Self>, key: &ScopeKey, value: Vec<u8>, ttl: Duration, mode: Write) {
        let ms = ttl.as_millis().min(u64::MAX as u128) as u64;
        let Some(key) = self.key(key).filter(|_| ms > 0) else {
            return;
        };
        let mut cmd = ::redis::cmd("SET");
        cmd.arg(key).arg(value).arg("PX").arg(ms);
        if mode == Write::IfAbsent {
            cmd.arg("NX");
        }
        let _: Option<::redis::Value> = self.call(&cmd).await;
    }

    /// Runs `cmd` within the timeout; `None` when skipped or failed.
    async fn call<T: FromRedisValue>(self: &Arc<Self>, cmd: &Cmd) -> Option<T> {
        if self.now_ms() < self.skip_until_ms.load(Relaxed) {
            self.skipped.fetch_add(1, Relaxed);
            return None;
        }
        let result = tokio::time::timeout(self.config.timeout, async {
            let mut connection = self.connection().await?;
            cmd.query_async::<T>(&mut connection).await
        })
        .await;
        let error = match result {
            Ok(Ok(value)) => return Some(value),
            Ok(Err(error)) => error.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        self.cool_down();
        self.failed(&error);
        None
    }

    /// The connection manager, connecting in the background on first use
    /// (so a slow connect outlives the caller's timeout) and after a failed
    /// connect.
    async fn connection(self: &Arc<Self>) -> Result<ConnectionManager, RedisError> {
        // The common case, without registering as a waiter.
        if let Some(manager) = self.manager.get() {
            return Ok(manager.clone());
        }
        let connected = self.connected.notified();
        tokio::pin!(connected);
        // Register before looking, so an end of the connect in between
        // still wakes us.
        connected.as_mut().enable();
        if let Some(manager) = self.manager.get() {
            return Ok(manager.clone());
        }
        if !self.connecting.swap(true, Relaxed) {
            let link = self.clone();
            tokio::spawn(async move { link.connect().await });
        }
        connected.await;
        self.manager.get().cloned().ok_or_else(|| {
            RedisError::from((::redis::ErrorKind::IoError, "Redis is not connected"))
        })
    }

    async fn connect(&self) {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(self.config.timeout.max(Duration::from_secs(1)))
            .set_response_timeout(self.config.timeout)
            .set_number_of_retries(2)
            .set_max_delay(500);
        match ConnectionManager::new_with_config(self.client.clone(), config).await {
            Ok(manager) => {
                let _ = self.manager.set(manager);
                tracing::info!(url = %redact(&self.config.url), "redis cache connected");
            }
            Err(error) => {
                self.cool_down();
                self.failed(&error);
            }
        }
        self.connecting.store(false, Relaxed);
        self.connected.notify_waiters();
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn cool_down(&self) {
        let until = self.now_ms() + self.config.cooldown.as_millis() as u64;
        self.skip_until_ms.fetch_max(until, Relaxed);
    }

    /// Counts a failure and logs it, at most once per [`WARN_EVERY_MS`].
    fn failed(&self, error: &dyn fmt::Display) {
        let total = self.errors.fetch_add(1, Relaxed) + 1;
        // +1: 0 means "never warned".
        let now = self.now_ms() + 1;
        let last = self.last_warn_ms.load(Relaxed);
        if (last == 0 || now >= last + WARN_EVERY_MS)
            && self
                .last_warn_ms
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            let errors = total - self.warned_errors.swap(total, Relaxed);
            tracing::warn!(
                %error,
                errors,
                "redis cache failing; answering from the inner store"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn value_roundtrip_and_corruption() {
        let fingerprint = Fingerprint([7; 32]);
        let outcome = Outcome::TooLarge {
            status: StatusCode::CREATED,
        };
        let record = decode(&encode(&fingerprint, &outcome)).unwrap();
        assert_eq!(record.fingerprint, fingerprint);
        assert_eq!(record.state, RecordState::Completed(outcome));
        assert!(decode(b"").is_err());
        assert!(decode(&[FORMAT, 1, 2]).is_err());
        assert!(decode(&[9; 40]).is_err());
    }

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(
            redact("redis://user:secret@host:6379/1"),
            "redis://***@host:6379/1"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        let config = RedisCacheConfig::new("redis://:pw@h");
        assert!(!format!("{config:?}").contains("pw"));
    }
}
