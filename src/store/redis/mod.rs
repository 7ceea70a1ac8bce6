//! A Redis front cache in front of another store: [`RedisCache`].
//!
//! The cached records, the connection and the counters live here; the
//! guarantees are documented on [`RedisCache`].

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ::redis::cluster::ClusterClient;
use ::redis::Client;
use async_trait::async_trait;
use tokio::sync::Notify;

use super::{
    Admin, Claim, Fingerprint, Maintenance, Outcome, OwnerToken, PrincipalHash, Record,
    RecordState, ScopeKey, Store, StoreError,
};

mod admin;
mod link;

use link::{cluster_nodes, Asked, Link, Target, Write};

/// How [`RedisCache`] reaches Redis.
#[derive(Clone)]
pub struct RedisCacheConfig {
    /// The Redis URL, e.g. `redis://127.0.0.1:6379` or
    /// `redis://:password@host:6379/2` for one server, or
    /// `redis+cluster://[user:password@]host:port,host:port` for a Redis
    /// Cluster: the listed nodes are seeds, the cluster's other nodes and
    /// its slot map are discovered from them. TLS (`rediss://`) is not
    /// built in: such a URL is refused ([`StoreError::Unavailable`]).
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
pub(super) fn redact(url: &str) -> String {
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
///   wait for Redis ([`RedisCache::settled`] waits for such writes; one
///   that timed out may still land later, within its deadline, below).
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
/// * **Expiry.** An entry written by `complete` expires a second (a
///   margin for Redis's clock running behind ours) before the record's TTL
///   has passed since just *before* the inner call, so it expires before
///   the inner record; a record kept for less than a second is not cached.
///   The [`Store`] trait cannot tell the remaining retention of a record
///   found by a lookup, so an entry *filled* from the inner store lives at
///   most [`RedisCacheConfig::fill_ttl`] from just before the lookup (and,
///   in `reserve`, at most the route's TTL). This is the one stale window:
///   for at most `fill_ttl` after the inner record expired, a request with
///   that key gets the old replay (or mismatch) instead of a fresh
///   execution. It can never cause a second execution. Keep `fill_ttl`
///   short (default 60 s) relative to the retention.
/// * **A new record after expiry.** Completions overwrite (anything but a
///   purge's tombstone), fills only write where nothing is cached (`SET
///   NX`), so a slow fill of an old record can never replace the entry of a
///   newer completion, and no late copy revives a purged record.
/// * **A write held up on its way.** A write the client gave up on (its
///   timeout), or one made from a store answer that came late, may reach
///   Redis long after the truth it copies was read. Every write is a
///   script that applies it only while Redis's clock is within the timeout
///   plus 5 s of the moment the inner store was asked (a write not sent by
///   then is not sent), and only while the copy has not expired. So a late
///   write never lands over a newer record's entry after its own record
///   expired, and never outlives a purge's tombstone, which lives longer
///   than any such write by `fill_ttl` plus a second. This compares clocks:
///   each replica's with Redis's (each node's, on a cluster). Redis's
///   running more than 5 s ahead makes it drop every write (counted and
///   logged as errors: replays then come from the inner store); ours
///   running ahead by more than `fill_ttl` plus a second lets a late write
///   outlive a tombstone, and Redis's running behind by more than a second
///   lets a copy outlive its record by the difference.
///
/// # Purges
///
/// An operator's purge ([`Admin::purge`], [`Admin::purge_principal`])
/// overwrites the cached copies with tombstones (a miss, never replaced by
/// a fill) that outlive any copy made before, first before the inner
/// records are deleted and again, a timeout later, after: Redis never
/// replays a purged record. When Redis cannot be told, the purge fails (on
/// the first pass, nothing was deleted) and can simply be run again.
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
/// Redis keys are `prefix + store id + ":{" + hex(scope key) + "}"`: hashes only,
/// no raw key, principal or body. The store id is the inner store's
/// [`Store::identity`] (kept in the database itself for PostgreSQL and
/// SQLite, random per [`MemoryStore`](crate::MemoryStore)), read once on
/// first use: two deployments with separate databases sharing one Redis
/// (staging and production, two regions) never read each other's entries,
/// whatever their prefixes. Until the id has been read (the inner store is
/// down at start), Redis is not used at all. An inner store without an
/// identity leaves the prefix alone to separate deployments. Values are the fingerprint and [`Outcome::encode`].
/// Run Redis with a `maxmemory` and an LRU or LFU eviction policy: every
/// entry has a TTL, and an evicted copy is a miss. Not `volatile-ttl` nor
/// a random policy, which may evict a purge's tombstone early (see
/// docs/redis.md).
///
/// # Redis Cluster
///
/// With a `redis+cluster://` URL the cache talks to a Redis Cluster. The
/// scope key's hex is the key's hash tag (the part in braces), so every key
/// of one record lands in one slot — any future multi-key command or script
/// on one record stays on one node — while records spread over all slots.
/// A node failing over is one more Redis failure: a miss, never an outcome.
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
    /// Only the URL and prefix are checked here (a malformed URL, or a
    /// prefix with `{` or `}`, which would move the hash tag that keeps a
    /// record's keys in one cluster slot, is [`StoreError::Unavailable`]
    /// naming the problem); Redis itself is connected on first use, in the
    /// background, so this succeeds while Redis is down.
    pub fn new(inner: S, config: RedisCacheConfig) -> Result<Self, StoreError> {
        if config.prefix.contains(['{', '}']) {
            return Err(StoreError::Unavailable(
                format!(
                    "the Redis key prefix `{}` holds `{{` or `}}`, which would change the \
                     Redis Cluster hash tag of every key: use a prefix without braces, \
                     such as `idem:`",
                    config.prefix
                )
                .into(),
            ));
        }
        let client = match cluster_nodes(&config.url) {
            Some(nodes) => {
                let nodes = nodes.map_err(|e| StoreError::Unavailable(e.into()))?;
                ClusterClient::builder(nodes)
                    .connection_timeout(config.timeout.max(Duration::from_secs(1)))
                    .response_timeout(config.timeout)
                    .retries(2)
                    .build()
                    .map(Target::Cluster)
            }
            None => Client::open(config.url.as_str()).map(Target::Single),
        }
        .map_err(|e| StoreError::Unavailable(Box::new(e)))?;
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
                identity_retry_ms: AtomicU64::new(0),
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
    /// store's identity first if needed. A failure is the inner store's,
    /// not Redis's (logged, not counted as a Redis error); the call then
    /// goes to the inner store alone, and the identity is not asked again
    /// for `cooldown`, so while the store is down only the first call of
    /// each cooldown waits for it twice (the identity, then the call).
    async fn named(&self) -> bool {
        if self.redis.namespace.get().is_some() {
            return true;
        }
        if self.redis.now_ms() < self.redis.identity_retry_ms.load(Relaxed) {
            self.redis.skipped.fetch_add(1, Relaxed);
            return false;
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
                let retry = self.redis.now_ms() + self.redis.config.cooldown.as_millis() as u64;
                self.redis.identity_retry_ms.fetch_max(retry, Relaxed);
                tracing::warn!(
                    %error,
                    "the store's identity is unknown; Redis is not used until it is"
                );
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

impl<S: Store> RedisCache<S> {
    /// [`Store::reserve`], keeping `principal` with the record when the
    /// inner store has an [`Admin`] side.
    async fn reserve_with(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
        principal: Option<&PrincipalHash>,
    ) -> Result<Claim, StoreError> {
        let inner = || async {
            match self.inner.admin() {
                Some(admin) => {
                    admin
                        .reserve_for(key, fingerprint, owner, lease, ttl, principal)
                        .await
                }
                None => {
                    self.inner
                        .reserve(key, fingerprint, owner, lease, ttl)
                        .await
                }
            }
        };
        if !self.named().await {
            return inner().await;
        }
        if let Some(record) = self.redis.lookup(key).await {
            return Ok(Claim::Existing(record));
        }
        let asked = Asked::now();
        let claim = inner().await?;
        match &claim {
            Claim::Acquired { .. } => self.redis.remember(*owner, *fingerprint),
            Claim::Existing(record) => {
                let ttl = ttl.min(self.redis.config.fill_ttl);
                self.redis.fill(key, record, asked, ttl);
            }
        }
        Ok(claim)
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
        self.reserve_with(key, fingerprint, owner, lease, ttl, None)
            .await
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
        let asked = Asked::now();
        let fingerprint = self.redis.fingerprint_of(owner);
        // On an error the entry stays, for the engine's retry.
        let done = self.inner.complete(key, owner, outcome, ttl).await?;
        self.redis.forget(owner);
        if let (true, Some(fingerprint)) = (done, fingerprint) {
            let value = encode(&fingerprint, outcome);
            self.redis
                .write_behind(key, value, asked, ttl, Write::Overwrite);
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
        let asked = Asked::now();
        let record = self.inner.get(key).await?;
        if let Some(record) = &record {
            self.redis
                .fill(key, record, asked, self.redis.config.fill_ttl);
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

    fn admin(&self) -> Option<&dyn Admin> {
        self.inner.admin().map(|_| self as &dyn Admin)
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
                "Redis calls that failed, timed out, read an undecodable entry or wrote \
                 past their deadline.",
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
pub(super) fn encode(fingerprint: &Fingerprint, outcome: &Outcome) -> Vec<u8> {
    let outcome = outcome.encode();
    let mut value = Vec::with_capacity(1 + 32 + outcome.len());
    value.push(FORMAT);
    value.extend_from_slice(fingerprint.as_bytes());
    value.extend_from_slice(&outcome);
    value
}

pub(super) fn decode(value: &[u8]) -> Result<Record, StoreError> {
    match value.split_first() {
        Some((&FORMAT, rest)) if rest.len() >= 32 => Ok(Record {
            fingerprint: Fingerprint::from_slice(&rest[..32])?,
            state: RecordState::Completed(Outcome::decode(&rest[32..])?),
        }),
        _ => Err(StoreError::Corrupt("cached record".into())),
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
    fn cluster_urls_name_their_seed_nodes() {
        assert!(cluster_nodes("redis://h:6379").is_none());
        assert_eq!(
            cluster_nodes("redis+cluster://a:7000,b:7001").unwrap(),
            Ok(vec![
                "redis://a:7000".to_owned(),
                "redis://b:7001".to_owned()
            ])
        );
        assert_eq!(
            cluster_nodes("rediss+cluster://u:p@a:7000,b:7001").unwrap(),
            Ok(vec![
                "rediss://u:p@a:7000".to_owned(),
                "rediss://u:p@b:7001".to_owned()
            ])
        );
        for bad in [
            "redis+cluster://a:7000/2",
            "redis+cluster://",
            "redis+cluster://a,,b",
        ] {
            let error = cluster_nodes(bad).unwrap().unwrap_err();
            assert!(error.contains("redis+cluster://"), "{bad}: {error}");
        }
        let error = RedisCache::new(
            crate::MemoryStore::new(),
            RedisCacheConfig::new("redis+cluster://a:7000/1"),
        )
        .unwrap_err();
        assert!(error.to_string().contains("no database"), "{error}");
    }

    #[test]
    fn a_prefix_with_braces_is_refused() {
        let error = RedisCache::new(
            crate::MemoryStore::new(),
            RedisCacheConfig::new("redis://h").prefix("app{1}:"),
        )
        .unwrap_err();
        assert!(error.to_string().contains("app{1}:"), "{error}");
    }

    #[test]
    fn a_record_key_is_its_own_hash_tag() {
        let key = ScopeKey([0xab; 32]);
        assert_eq!(
            link::record_key("idem:id:", &key),
            format!("idem:id:{{{}}}", "ab".repeat(32))
        );
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
