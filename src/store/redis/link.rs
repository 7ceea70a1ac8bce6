//! The connection to Redis shared by clones of a [`RedisCache`](super::RedisCache):
//! settings, counters, and the writes made behind the answer.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Client, Cmd, FromRedisValue, RedisError};
use tokio::sync::Notify;

use super::super::{Fingerprint, OwnerToken, Record, RecordState, ScopeKey};
use super::RedisCacheConfig;
use super::{decode, encode, redact};

/// The value that marks a purged record: a miss, and it keeps a copy made
/// before the purge from being filled in again (fills never replace an
/// entry).
pub(super) const TOMBSTONE: u8 = 0;

/// `SET key <tombstone> PX ms`: a miss that no fill replaces while it
/// lives.
fn tombstone(key: String, ms: u64) -> ::redis::Cmd {
    let mut cmd = ::redis::cmd("SET");
    cmd.arg(key).arg(&[TOMBSTONE][..]).arg("PX").arg(ms);
    cmd
}

/// How long after the inner store was asked for the truth a copy of it
/// may still be applied, beyond the Redis call's timeout: room for the
/// inner call itself, the wait to be sent, and Redis's clock running
/// ahead of this machine's. A write that arrives later (held in a
/// half-dead connection, a stalled network) is dropped by Redis, and one
/// not sent by then is not sent at all; so no copy outlives a purge's
/// tombstone ([`tombstone_ttl`]).
pub(super) const WRITE_SLACK: Duration = Duration::from_secs(5);

/// How much sooner than its record a copy expires: room for Redis's clock
/// running behind this machine's, so a copy never outlives its record
/// (and a late copy never lands after its record expired, over a newer
/// record's entry). A record kept for less than this is not cached.
pub(super) const EXPIRY_MARGIN: Duration = Duration::from_secs(1);

/// One background write (`ARGV[1]`), applied by Redis only while Redis's
/// clock reads no later than the deadline `ARGV[3]`, expiring at `ARGV[2]`
/// (both Unix ms), and then:
///
/// * `ARGV[4] == "nx"` (a fill): only where no entry is;
/// * otherwise (a completion): anywhere but over a purge's tombstone
///   (`ARGV[5]`).
///
/// Returns 1 when written, 0 when an entry kept its place or the copy
/// would already have expired, and `-(ms late)` when the deadline had
/// passed. One key, so one slot: atomic on a cluster too. `TIME` before
/// a write needs the script replicated by its effects: the default since
/// Redis 5, asked for on 5 and 6 (a no-op since 7).
const WRITE: &str = "redis.replicate_commands() \
     local t = redis.call('TIME') \
     local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) \
     local late = now - tonumber(ARGV[3]) \
     if late > 0 then return -late end \
     local px = tonumber(ARGV[2]) - now \
     if px <= 0 then return 0 end \
     local entry = redis.call('GET', KEYS[1]) \
     if entry and (ARGV[4] == 'nx' or entry == ARGV[5]) then return 0 end \
     redis.call('SET', KEYS[1], ARGV[1], 'PX', string.format('%d', px)) return 1";

/// When the inner store was asked for the truth a copy holds: just before
/// the call that gave it (a completion, a lookup). A copy's deadline and
/// expiry count from here, not from its answer, which may come late.
#[derive(Clone, Copy)]
pub(super) struct Asked {
    at: Instant,
    wall: SystemTime,
}

impl Asked {
    pub(super) fn now() -> Self {
        Asked {
            at: Instant::now(),
            wall: SystemTime::now(),
        }
    }
}

/// Whether a write may replace an existing entry.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Write {
    /// A completion: the newest truth, replaces anything but a purge's
    /// tombstone (a completion's copy that ran late must not revive a
    /// record an operator purged meanwhile).
    Overwrite,
    /// A copy from the inner store: never replaces an entry, which may come
    /// from a newer completion.
    IfAbsent,
}

/// Where the cache's Redis is: one server, or a Redis Cluster.
pub(super) enum Target {
    Single(Client),
    Cluster(ClusterClient),
}

/// A connection to the [`Target`]; both reconnect by themselves (the
/// cluster one also follows `MOVED` redirections and slot changes).
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The connection, settings and counters shared by clones of a cache.
pub(super) struct Link {
    pub(super) client: Target,
    /// Set once the first connection succeeded; it reconnects by itself.
    pub(super) manager: OnceLock<Connection>,
    /// A background connect is under way.
    pub(super) connecting: AtomicBool,
    /// Woken when a background connect ends, either way.
    pub(super) connected: Notify,
    pub(super) config: RedisCacheConfig,
    /// The origin of the millisecond clock below.
    pub(super) epoch: Instant,
    pub(super) skip_until_ms: AtomicU64,
    pub(super) last_warn_ms: AtomicU64,
    pub(super) warned_errors: AtomicU64,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) pending: Mutex<Pending>,
    /// Background writes under way, and their end.
    pub(super) writing: AtomicUsize,
    pub(super) written: Notify,
    /// `prefix + store id + ":"`, once the inner store's identity is known.
    pub(super) namespace: OnceLock<String>,
    /// Until when (the clock above) the identity is not asked again after
    /// the inner store failed to give it.
    pub(super) identity_retry_ms: AtomicU64,
}

/// The fingerprint of every reservation this cache granted and that is not
/// settled yet: `complete` needs it for the cached value but is not given
/// it. An entry leaves at `complete` or `release`; one whose reservation
/// was abandoned (its completion failed for good, its task was cancelled)
/// is dropped once older than [`PENDING_MAX_AGE`], when the map has doubled
/// since the last look — a dropped entry only means one completion is not
/// cached.
#[derive(Default)]
pub(super) struct Pending {
    pub(super) entries: HashMap<OwnerToken, (Fingerprint, Instant)>,
    pub(super) prune_at: usize,
}

/// No reservation outlives this without being settled, in practice.
const PENDING_MAX_AGE: Duration = Duration::from_secs(60 * 60);

/// How long after the last warning a Redis failure is logged again.
const WARN_EVERY_MS: u64 = 10_000;

impl Link {
    /// The Redis key of `key`; `None` while the namespace is unknown.
    pub(super) fn key(&self, key: &ScopeKey) -> Option<String> {
        Some(record_key(self.namespace.get()?, key))
    }

    pub(super) fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        // Every mutation leaves the map whole: a poisoned one can be used.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn remember(&self, owner: OwnerToken, fingerprint: Fingerprint) {
        let mut pending = self.pending();
        pending.entries.insert(owner, (fingerprint, Instant::now()));
        if pending.entries.len() >= pending.prune_at {
            pending
                .entries
                .retain(|_, (_, since)| since.elapsed() < PENDING_MAX_AGE);
            pending.prune_at = (pending.entries.len() * 2).max(1024);
        }
    }

    pub(super) fn fingerprint_of(&self, owner: &OwnerToken) -> Option<Fingerprint> {
        self.pending().entries.get(owner).map(|(fp, _)| *fp)
    }

    pub(super) fn forget(&self, owner: &OwnerToken) {
        self.pending().entries.remove(owner);
    }

    /// The cached completed record for `key`, or `None` (miss, failure,
    /// cooling down, undecodable entry) to ask the inner store.
    pub(super) async fn lookup(self: &Arc<Self>, key: &ScopeKey) -> Option<Record> {
        let value: Option<Vec<u8>> = self.call(::redis::cmd("GET").arg(self.key(key)?)).await?;
        let Some(value) = value.filter(|value| value.as_slice() != [TOMBSTONE]) else {
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

    /// Copies a completed `record` found in the inner store (asked at
    /// `asked`) into Redis, to be kept `ttl`.
    pub(super) fn fill(
        self: &Arc<Self>,
        key: &ScopeKey,
        record: &Record,
        asked: Asked,
        ttl: Duration,
    ) {
        if let RecordState::Completed(outcome) = &record.state {
            let value = encode(&record.fingerprint, outcome);
            self.write_behind(key, value, asked, ttl, Write::IfAbsent);
        }
    }

    /// Writes an entry in the background, so the caller's answer never
    /// waits for Redis. Both bounds count from `asked`, when the inner
    /// store was asked for the truth the entry copies: the entry expires
    /// [`EXPIRY_MARGIN`] before `ttl` has passed, and Redis applies it only
    /// until the timeout plus [`WRITE_SLACK`] has, by its own clock (a
    /// write not sent by then is not sent). So a write held up on its way
    /// (a half-dead connection, a stalled network), or one whose store
    /// answer came late, can neither outlive a purge's tombstone, nor land
    /// after the record it copies expired (over the entry of a newer
    /// record), nor live on past it.
    pub(super) fn write_behind(
        self: &Arc<Self>,
        key: &ScopeKey,
        value: Vec<u8>,
        asked: Asked,
        ttl: Duration,
        mode: Write,
    ) {
        if asked.at.elapsed() > WRITE_SLACK {
            self.failed(&format_args!(
                "a copy for Redis came more than {WRITE_SLACK:?} after its store call began: \
                 not cached"
            ));
            return;
        }
        let Some(keep) = ttl.checked_sub(EXPIRY_MARGIN) else {
            return;
        };
        let later = |by: Duration| asked.wall.checked_add(by).map(unix_ms);
        let (Some(expires), Some(deadline)) = (
            later(keep),
            later(self.config.timeout.saturating_add(WRITE_SLACK)),
        ) else {
            return;
        };
        self.writing.fetch_add(1, SeqCst);
        let (link, key) = (self.clone(), *key);
        tokio::spawn(async move {
            link.write(&key, value, expires, deadline, mode).await;
            if link.writing.fetch_sub(1, SeqCst) == 1 {
                link.written.notify_waiters();
            }
        });
    }

    /// Waits until no background write is under way.
    pub(super) async fn settled(&self) {
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

    /// One [`WRITE`]: expiring at `expires`, applied by Redis until
    /// `deadline` (Unix ms, Redis's clock).
    async fn write(
        self: &Arc<Self>,
        key: &ScopeKey,
        value: Vec<u8>,
        expires: u64,
        deadline: u64,
        mode: Write,
    ) {
        let Some(key) = self.key(key) else {
            return;
        };
        let mut cmd = ::redis::cmd("EVAL");
        cmd.arg(WRITE)
            .arg(1)
            .arg(key)
            .arg(value)
            .arg(expires)
            .arg(deadline)
            .arg(match mode {
                Write::IfAbsent => "nx",
                Write::Overwrite => "overwrite",
            })
            .arg(&[TOMBSTONE][..]);
        let answer: Option<i64> = self.call(&cmd).await;
        if let Some(late) = answer.filter(|answer| *answer < 0) {
            // Sent within the timeout, yet past a deadline seconds later:
            // Redis's clock runs ahead of ours.
            self.failed(&format!(
                "Redis refused a write that reached it {} ms after its deadline (Unix ms {deadline} \
                 by this machine's clock): Redis's clock runs ahead of this machine's, or the \
                 write waited to be sent; entries are not cached until the clocks agree",
                -late
            ));
        }
    }

    /// Overwrites the cached copies of `keys`' records with tombstones
    /// that outlive any copy made before ([`tombstone_ttl`]: Redis drops a
    /// write that reaches it after its deadline): a tombstone is a miss,
    /// and no write replaces it. Runs even while cooling down; an
    /// error means some copies may still be answered.
    pub(super) async fn invalidate(self: &Arc<Self>, keys: &[ScopeKey]) -> Result<(), String> {
        let ttl = tombstone_ttl(&self.config);
        let ms = ttl.as_millis().min(u64::MAX as u128) as u64;
        let connection = tokio::time::timeout(self.config.timeout, self.connection())
            .await
            .map_err(|_| "timed out".to_owned())?
            .map_err(|error| error.to_string())?;
        if let Connection::Cluster(mut connection) = connection {
            // A pipeline may not cross slots: one command per key.
            for key in keys {
                let key = self.key(key).ok_or("the store's identity is unknown")?;
                let cmd = tombstone(key, ms);
                let set = cmd.query_async::<()>(&mut connection);
                match tokio::time::timeout(self.config.timeout, set).await {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => return Err(error.to_string()),
                    Err(_) => return Err("timed out".to_owned()),
                }
            }
            return Ok(());
        }
        for chunk in keys.chunks(500) {
            let mut pipe = ::redis::pipe();
            for key in chunk {
                let key = self.key(key).ok_or("the store's identity is unknown")?;
                pipe.add_command(tombstone(key, ms)).ignore();
            }
            let sent = tokio::time::timeout(self.config.timeout, async {
                match self.connection().await? {
                    Connection::Single(mut connection) => {
                        pipe.query_async::<()>(&mut connection).await
                    }
                    Connection::Cluster(mut connection) => {
                        pipe.query_async::<()>(&mut connection).await
                    }
                }
            })
            .await;
            match sent {
                Ok(Ok(())) => {}
                Ok(Err(error)) => return Err(error.to_string()),
                Err(_) => return Err("timed out".to_owned()),
            }
        }
        Ok(())
    }

    /// Runs `cmd` within the timeout; `None` when skipped or failed.
    pub(super) async fn call<T: FromRedisValue>(self: &Arc<Self>, cmd: &Cmd) -> Option<T> {
        if self.now_ms() < self.skip_until_ms.load(Relaxed) {
            self.skipped.fetch_add(1, Relaxed);
            return None;
        }
        let result = tokio::time::timeout(self.config.timeout, async {
            match self.connection().await? {
                Connection::Single(mut connection) => cmd.query_async::<T>(&mut connection).await,
                Connection::Cluster(mut connection) => cmd.query_async::<T>(&mut connection).await,
            }
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
    pub(super) async fn connection(self: &Arc<Self>) -> Result<Connection, RedisError> {
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

    pub(super) async fn connect(&self) {
        let connected = match &self.client {
            Target::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(self.config.timeout.max(Duration::from_secs(1)))
                    .set_response_timeout(self.config.timeout)
                    .set_number_of_retries(2)
                    .set_max_delay(500);
                ConnectionManager::new_with_config(client.clone(), config)
                    .await
                    .map(Connection::Single)
            }
            Target::Cluster(client) => client.get_async_connection().await.map(Connection::Cluster),
        };
        match connected {
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
        // After the waiters went on: they are never held up by it.
        if let Some(manager) = self.manager.get() {
            self.warn_if_persistent(manager.clone()).await;
        }
    }

    /// Warns when Redis keeps its data across a restart (`save` points or
    /// `appendonly`): a restart then loads copies a purge had overwritten
    /// since, and they are replayed again (docs/redis.md). A Redis that
    /// refuses `CONFIG` (a managed one) is not asked further; of a
    /// cluster, the node that answers is asked.
    async fn warn_if_persistent(&self, connection: Connection) {
        let setting = |name: &'static str| {
            let connection = connection.clone();
            async move {
                let mut cmd = ::redis::cmd("CONFIG");
                cmd.arg("GET").arg(name);
                // A flat pair under RESP2, a map under RESP3.
                type Settings = std::collections::HashMap<String, String>;
                let asked = match connection {
                    Connection::Single(mut c) => cmd.query_async::<Settings>(&mut c).await,
                    Connection::Cluster(mut c) => cmd.query_async::<Settings>(&mut c).await,
                };
                asked.ok().and_then(|mut settings| settings.remove(name))
            }
        };
        let asked = async { tokio::join!(setting("save"), setting("appendonly")) };
        let Ok((save, appendonly)) = tokio::time::timeout(self.config.timeout, asked).await else {
            return;
        };
        let snapshots = save.is_some_and(|points| !points.trim().is_empty());
        let log = appendonly.is_some_and(|on| on.eq_ignore_ascii_case("yes"));
        if snapshots || log {
            tracing::warn!(
                url = %redact(&self.config.url),
                snapshots,
                appendonly = log,
                "the redis cache's Redis persists its data: after a restart it loads copies \
                 that a purge had removed since, and replays them until they expire; run it \
                 with save \"\" and appendonly no (docs/redis.md)"
            );
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub(super) fn cool_down(&self) {
        let until = self.now_ms() + self.config.cooldown.as_millis() as u64;
        self.skip_until_ms.fetch_max(until, Relaxed);
    }

    /// Counts a failure and logs it, at most once per [`WARN_EVERY_MS`].
    pub(super) fn failed(&self, error: &dyn fmt::Display) {
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

/// How long a purge's tombstone lives: longer than any copy of a record
/// read before the purge deleted it may still be applied (within the
/// timeout plus [`WRITE_SLACK`] of its read, [`Link::write_behind`]), by
/// `fill_ttl` plus a second — the room left for this machine's clock to
/// run ahead of Redis's.
pub(super) fn tombstone_ttl(config: &RedisCacheConfig) -> Duration {
    config.fill_ttl + config.timeout + WRITE_SLACK + Duration::from_secs(1)
}

/// `time` in milliseconds since the Unix epoch (0 before it).
fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis().min(u64::MAX as u128) as u64)
}

/// The Redis key of a record: `namespace` then the scope key's hex in a
/// hash tag (`{…}`), so everything kept for one record hashes to one Redis
/// Cluster slot (the one the record's hash picks), and different records
/// spread over all slots. The namespace holds no `{` (see
/// [`cluster_nodes`]), so the tag is always the record's hash.
pub(super) fn record_key(namespace: &str, key: &ScopeKey) -> String {
    format!("{namespace}{{{}}}", key.to_hex())
}

/// What a Redis Cluster URL must look like, for error messages.
const CLUSTER_URL: &str = "redis+cluster://[user:password@]host:port,host:port,…";

/// The node URLs of a Redis Cluster URL (`redis+cluster://` or
/// `rediss+cluster://`, then optional credentials and comma-separated
/// `host:port` seed nodes); `None` for any other URL.
///
/// The credentials apply to every node. A cluster has one database, so a
/// path or query is refused, like an empty node.
pub(super) fn cluster_nodes(url: &str) -> Option<Result<Vec<String>, String>> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("redis+cluster://") {
        ("redis", rest)
    } else {
        ("rediss", url.strip_prefix("rediss+cluster://")?)
    };
    let (userinfo, hosts) = match rest.rfind('@') {
        Some(at) => (&rest[..=at], &rest[at + 1..]),
        None => ("", rest),
    };
    if hosts.contains(['/', '?', '#']) {
        return Some(Err(format!(
            "a Redis Cluster URL names no database or options (a cluster has one database): \
             expected {CLUSTER_URL}"
        )));
    }
    let nodes: Vec<String> = hosts
        .split(',')
        .map(|host| format!("{scheme}://{userinfo}{host}"))
        .collect();
    if hosts.split(',').any(|host| host.trim().is_empty()) {
        return Some(Err(format!(
            "a Redis Cluster URL needs at least one `host:port` and no empty one between \
             commas: expected {CLUSTER_URL}"
        )));
    }
    Some(Ok(nodes))
}
