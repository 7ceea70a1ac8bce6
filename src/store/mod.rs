//! Where idempotency records live: one [`Store`] trait, several backends.
//!
//! A store decides exactly one thing on its own: **who owns a key**. Every
//! backend reserves atomically (a unique constraint or `SET NX` semantics,
//! never check-then-insert), checks the owner token on every write, and
//! lets exactly one caller take over a lease that expired. Everything else —
//! fingerprints, replays, waiting, HTTP — is the [engine](crate::Engine)'s.
//!
//! The same conformance suite (`store_conformance!`, exported with the
//! `test-util` feature) runs against every backend, so a
//! store that passes it can be swapped for any other. `FaultyStore` (also
//! `test-util`) wraps any store to inject outages, slowness and lost
//! answers.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

mod admin;
pub use admin::{
    Admin, Holder, HolderError, KeyState, PrincipalHash, RecordInfo, ScopeKeyError, StateCounts,
};
#[cfg(feature = "test-util")]
pub mod conformance;
#[cfg(any(test, feature = "test-util"))]
mod faulty;
#[cfg(any(test, feature = "test-util"))]
pub use faulty::{Fault, Faults, FaultyStore, Op};
mod memory;
pub use memory::MemoryStore;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "sqlite")]
mod sqlite_writer;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
pub use self::redis::{RedisCache, RedisCacheConfig};

/// The boxed error type carried by [`StoreError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The stored identity of one idempotent operation: SHA-256 of
/// (principal, method, route, key).
///
/// The raw key is never stored anywhere; only this hash is. Two principals
/// using the same raw key get different scope keys.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeKey(pub [u8; 32]);

impl ScopeKey {
    /// The 32 raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex of all 32 bytes (64 characters), for text columns and
    /// Redis keys.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first 8 hex characters: enough to correlate log lines, too short
    /// to identify anything. This is what logs and spans carry.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..4])
    }

    /// Rebuilds a key from 32 stored bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, StoreError> {
        bytes
            .try_into()
            .map(ScopeKey)
            .map_err(|_| StoreError::Corrupt(format!("scope key of {} bytes", bytes.len())))
    }
}

impl fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeKey({})", self.short())
    }
}

/// SHA-256 of the canonical request (method, path and query, selected
/// headers, canonical body). Equal fingerprints mean "the same request".
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The 32 raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// This fingerprint under a route's `fingerprint_version` (SHA-256 of
    /// both, each length-framed): another request for every other version.
    pub fn versioned(&self, version: &str) -> Self {
        use sha2::Digest;
        let mut hasher = sha2::Sha256::new();
        hasher.update(b"fingerprint-version");
        hasher.update((version.len() as u64).to_be_bytes());
        hasher.update(version.as_bytes());
        hasher.update(self.0);
        Fingerprint(hasher.finalize().into())
    }

    /// Rebuilds a fingerprint from 32 stored bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, StoreError> {
        bytes
            .try_into()
            .map(Fingerprint)
            .map_err(|_| StoreError::Corrupt(format!("fingerprint of {} bytes", bytes.len())))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..4]))
    }
}

/// A random token naming the one worker that holds a reservation.
///
/// The caller draws it and passes it to [`Store::reserve`]; every later
/// write carries it, and a store refuses a write
/// whose token no longer owns the record (the lease was taken over), so a
/// slow worker can never overwrite its successor.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(pub [u8; 16]);

impl OwnerToken {
    /// A fresh random token: 128 bits from the thread-local CSPRNG
    /// (`rand::rng()`), so two reservations never share one.
    pub fn random() -> Self {
        OwnerToken(rand::random())
    }

    /// The 16 raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Rebuilds a token from 16 stored bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, StoreError> {
        bytes
            .try_into()
            .map(OwnerToken)
            .map_err(|_| StoreError::Corrupt(format!("owner token of {} bytes", bytes.len())))
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({})", hex::encode(&self.0[..4]))
    }
}

/// A response as it is stored and replayed: status, filtered headers, body.
///
/// Hop-by-hop headers, `Date` and (unless a route allows it) `Set-Cookie`
/// were removed before it was stored; see [`crate::engine::headers::stored`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code the first execution answered with.
    pub status: StatusCode,
    /// Headers in their original order, repeated names kept.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The complete body.
    pub body: Bytes,
}

impl StoredResponse {
    /// Encodes the headers into a compact, length-prefixed byte string for a
    /// `bytea`/`BLOB` column. [`StoredResponse::decode_headers`] reverses it.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.headers.len() * 32);
        for (name, value) in &self.headers {
            put_chunk(&mut out, name.as_str().as_bytes());
            put_chunk(&mut out, value.as_bytes());
        }
        out
    }

    /// Decodes what [`StoredResponse::encode_headers`] wrote. Anything else is
    /// a [`StoreError::Corrupt`], never a panic.
    pub fn decode_headers(mut bytes: &[u8]) -> Result<Vec<(HeaderName, HeaderValue)>, StoreError> {
        let mut headers = Vec::new();
        while !bytes.is_empty() {
            let name = take_chunk(&mut bytes)?;
            let value = take_chunk(&mut bytes)?;
            let name = HeaderName::from_bytes(name)
                .map_err(|_| StoreError::Corrupt("stored header name".into()))?;
            let value = HeaderValue::from_bytes(value)
                .map_err(|_| StoreError::Corrupt("stored header value".into()))?;
            headers.push((name, value));
        }
        Ok(headers)
    }
}

/// An [`Outcome`] encrypted by the engine's [`Keyring`](crate::engine::Keyring):
/// an opaque byte string a store keeps and returns exactly as given.
///
/// It carries the id of the key that sealed it and is bound to its
/// record's [`ScopeKey`]; only the engine opens it.
#[derive(Clone, PartialEq, Eq)]
pub struct SealedOutcome(Bytes);

impl SealedOutcome {
    /// Wraps bytes a store read back (or the engine sealed).
    pub fn from_bytes(bytes: Bytes) -> Self {
        SealedOutcome(bytes)
    }

    /// The bytes to persist.
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }
}

impl fmt::Debug for SealedOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SealedOutcome({} bytes)", self.0.len())
    }
}

/// How a completed operation ended, as far as replays are concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The response was stored and is replayed to every retry.
    Stored(StoredResponse),
    /// The response was larger than the route's storage cap. The operation
    /// took effect and must not run again, but it cannot be replayed:
    /// retries get a `response-not-stored` problem carrying this status.
    TooLarge {
        /// The status the first execution answered with.
        status: StatusCode,
    },
    /// The response broke off after its head (the upstream acted). The
    /// operation took effect and must not run again, and no complete
    /// response exists to replay: retries get a `response-incomplete`
    /// problem carrying this status.
    Incomplete {
        /// The status the first execution answered with.
        status: StatusCode,
    },
    /// Any of the above, encrypted at rest (the engine seals every outcome
    /// when encryption keys are configured). A store persists its bytes as
    /// they are; its status, headers and body are inside the ciphertext.
    Sealed(SealedOutcome),
}

impl Outcome {
    /// Encodes the whole outcome into one self-describing byte string (for
    /// key-value caches such as Redis). [`Outcome::decode`] reverses it.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out);
        out
    }

    /// [`Outcome::encode`], appended to `out`.
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Outcome::Stored(response) => {
                out.push(1);
                out.extend_from_slice(&response.status.as_u16().to_be_bytes());
                put_chunk(out, &response.encode_headers());
                put_chunk(out, &response.body);
            }
            Outcome::TooLarge { status } => {
                out.push(2);
                out.extend_from_slice(&status.as_u16().to_be_bytes());
            }
            Outcome::Incomplete { status } => {
                out.push(3);
                out.extend_from_slice(&status.as_u16().to_be_bytes());
            }
            Outcome::Sealed(sealed) => {
                out.push(4);
                out.extend_from_slice(sealed.as_bytes());
            }
        }
    }

    /// Decodes what [`Outcome::encode`] wrote; anything else (including
    /// trailing bytes) is [`StoreError::Corrupt`], never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Self, StoreError> {
        let corrupt = || StoreError::Corrupt("stored outcome".into());
        let (&tag, rest) = bytes.split_first().ok_or_else(corrupt)?;
        if tag == 4 {
            return Ok(Outcome::Sealed(SealedOutcome(Bytes::copy_from_slice(rest))));
        }
        if rest.len() < 2 {
            return Err(corrupt());
        }
        let status =
            StatusCode::from_u16(u16::from_be_bytes([rest[0], rest[1]])).map_err(|_| corrupt())?;
        let mut rest = &rest[2..];
        let outcome = match tag {
            1 => {
                let headers = StoredResponse::decode_headers(take_chunk(&mut rest)?)?;
                let body = Bytes::copy_from_slice(take_chunk(&mut rest)?);
                Outcome::Stored(StoredResponse {
                    status,
                    headers,
                    body,
                })
            }
            2 => Outcome::TooLarge { status },
            3 => Outcome::Incomplete { status },
            _ => return Err(corrupt()),
        };
        // Anything after the outcome means the bytes are not what we wrote.
        if !rest.is_empty() {
            return Err(corrupt());
        }
        Ok(outcome)
    }

    /// The status code of the first execution; `None` for a sealed
    /// outcome (the status is inside its ciphertext).
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Outcome::Stored(response) => Some(response.status),
            Outcome::TooLarge { status } | Outcome::Incomplete { status } => Some(*status),
            Outcome::Sealed(_) => None,
        }
    }
}

fn put_chunk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn take_chunk<'a>(bytes: &mut &'a [u8]) -> Result<&'a [u8], StoreError> {
    let corrupt = || StoreError::Corrupt("truncated record".into());
    if bytes.len() < 4 {
        return Err(corrupt());
    }
    let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let rest = &bytes[4..];
    if rest.len() < len {
        return Err(corrupt());
    }
    let (chunk, rest) = rest.split_at(len);
    *bytes = rest;
    Ok(chunk)
}

/// The state of a live (unexpired) record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordState {
    /// A worker holds the key and its lease has not expired yet.
    InFlight {
        /// Time left on the lease, by the store's clock.
        lease_remaining: Duration,
    },
    /// The operation finished.
    Completed(Outcome),
}

/// A live record, as [`Store::reserve`] or [`Store::get`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The fingerprint of the request that created the record.
    pub fingerprint: Fingerprint,
    /// In flight or completed.
    pub state: RecordState,
}

impl Record {
    /// Whether it is in flight with a lease that ran out: the next
    /// [`Store::reserve`] with the same fingerprint takes it over.
    pub fn lease_expired(&self) -> bool {
        matches!(self.state, RecordState::InFlight { lease_remaining } if lease_remaining.is_zero())
    }
}

/// The answer of [`Store::reserve`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The caller's token now owns the key: it must complete or release it.
    Acquired {
        /// `true` when an expired lease was taken over (a previous worker
        /// crashed or stalled), `false` for a fresh key.
        takeover: bool,
    },
    /// Someone else's live record stands; nothing was written.
    Existing(Record),
}

/// Why a store call failed. The engine answers every one of them the same
/// way (fail closed with 503, or fail open where a route opted in); the
/// variants exist for logs and metrics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend could not be reached or refused the operation.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// The backend did not answer in time.
    #[error("store timed out")]
    Timeout,
    /// A stored record could not be decoded.
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// A sealed record could not be opened: the key id it names is not
    /// configured, or it fails authentication (a different key under that
    /// id, altered bytes, another record's ciphertext). The engine answers
    /// it with 503 on every route, fail-open ones too: the record proves the
    /// request ran, so it must not run again. The message names the key id,
    /// never key material.
    #[error("unreadable record: {0}")]
    Unreadable(String),
    /// The store is at its configured ceiling (records or bytes) and
    /// refuses new reservations rather than grow. The engine answers it
    /// with 503 on every route, fail-open ones too: the store stays full
    /// until records expire, so a forwarded request's every retry would
    /// find it full and run again.
    #[error("store full: {0}")]
    Full(String),
}

/// A backend for idempotency records: the operations the engine needs to
/// decide and record one request. Deleting expired records and reporting
/// backend counters are apart, in [`Maintenance`].
///
/// # Contract
///
/// Every implementation must pass the conformance suite (with the
/// `test-util` feature, one line runs it against your store:
/// `tower_idempotency::store_conformance!`). In short:
///
/// * [`reserve`](Store::reserve) is **atomic**: of any number of concurrent
///   callers for one key, exactly one gets [`Claim::Acquired`]. A record
///   whose retention (`ttl`) ran out counts as absent. An in-flight record
///   whose lease ran out is taken over by exactly one caller — and only by a
///   caller with the *same* fingerprint; others see the record as it is.
/// * The caller draws the [`OwnerToken`] and passes it to `reserve`, so it
///   can release a reservation whose answer it never received (a timeout
///   after the row was committed).
/// * [`complete`](Store::complete), [`release`](Store::release) and
///   [`renew`](Store::renew) change the record only while `owner` still owns
///   it, and return whether they did.
/// * Time (leases, retention) is the store's own clock; callers never pass
///   timestamps.
/// * Records are stored under the [`ScopeKey`] hash only; no raw key,
///   principal or request body ever reaches a store (a store with an
///   [`Admin`] side also keeps the principal's hash).
/// * An [`Outcome::Sealed`] (encryption at rest) is kept and returned byte
///   for byte; a store never opens it and never needs a key.
#[async_trait]
pub trait Store: fmt::Debug + Send + Sync + 'static {
    /// Atomically reserves `key` for `owner` with a lease of `lease`, or
    /// takes over an expired lease with the same fingerprint, or returns the
    /// live record that stands in the way (and writes nothing).
    ///
    /// `owner` is a fresh [`OwnerToken::random`] per call; the store keeps
    /// it with the record and checks it on every later write.
    async fn reserve(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError>;

    /// Marks the record completed with `outcome`, kept for `ttl` from now.
    /// Returns `false` (and changes nothing) when `owner` no longer owns it.
    async fn complete(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError>;

    /// Deletes an in-flight record so the key can be used again. Returns
    /// `false` (and changes nothing) when `owner` no longer owns it.
    async fn release(&self, key: &ScopeKey, owner: &OwnerToken) -> Result<bool, StoreError>;

    /// Extends the lease of an in-flight record to `lease` from now, and its
    /// retention to at least that, so a reservation whose owner keeps
    /// renewing never expires (nor is swept) under it, however long the call
    /// outlives its `ttl`. Returns `false` when `owner` no longer owns it.
    async fn renew(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError>;

    /// The live record for `key`, if any. Expired records are `None`.
    async fn get(&self, key: &ScopeKey) -> Result<Option<Record>, StoreError>;

    /// Waits until the record for `key` may have changed, or at most `max`.
    ///
    /// `attempt` counts the waits of this caller so far (0, 1, …). The
    /// default sleeps a backoff step (10 ms doubling to 200 ms), which is
    /// polling; stores that can be told of a change (the memory store, a
    /// database with notifications) return as soon as it happens. A spurious
    /// early return is allowed: the engine looks again.
    async fn wait(&self, key: &ScopeKey, max: Duration, attempt: u32) -> Result<(), StoreError> {
        let _ = key;
        tokio::time::sleep(max.min(backoff(attempt))).await;
        Ok(())
    }

    /// Checks that the backend answers and can take a reservation, for
    /// health checks (the SQL stores check that they can write; PostgreSQL
    /// also that it is not read-only and is migrated). The default reads a
    /// key nobody uses with [`get`](Store::get).
    async fn ping(&self) -> Result<(), StoreError> {
        self.get(&ScopeKey([0; 32])).await.map(drop)
    }

    /// A stable name of the records this store holds: the same for every
    /// connection to the same records (every instance on one database),
    /// different for another database. A cache in front of the store
    /// ([`RedisCache`]) puts it into its key namespace,
    /// so two deployments that share a cache never see each other's
    /// records. `None` (the default) means the store has no such name: the
    /// cache's configured prefix alone must then keep deployments apart.
    ///
    /// The built-in stores keep it in the store itself: a one-row table
    /// created by the migrations (PostgreSQL, SQLite), a random id per
    /// [`MemoryStore`] (shared by its clones).
    async fn identity(&self) -> Result<Option<String>, StoreError> {
        Ok(None)
    }

    /// The store's [`Maintenance`] side, if it has one. A store that
    /// implements [`Maintenance`] returns `Some(self)` here, so the engine's
    /// sweeper and metrics use it; `None` (the default) means expired
    /// records are removed by the store itself (or never) and it has no
    /// counters.
    fn maintenance(&self) -> Option<&dyn Maintenance> {
        None
    }

    /// The store's [`Admin`] side (operator lookups, purges, force
    /// releases), if it has one: `Some(self)` for a store that implements
    /// [`Admin`]. With one, the engine reserves through
    /// [`Admin::reserve_for`], so records keep their principal's hash.
    /// `None` (the default): the engine's operator methods answer
    /// "unsupported".
    fn admin(&self) -> Option<&dyn Admin> {
        None
    }
}

/// The housekeeping side of a store, apart from the core operations (as
/// tower-sessions keeps `ExpiredDeletion` apart from `SessionStore`): the
/// engine's sweeper and its metrics endpoint reach it through
/// [`Store::maintenance`].
#[async_trait]
pub trait Maintenance: Send + Sync {
    /// Deletes at most `batch` records whose retention ran out and returns
    /// how many it deleted. Live records are never touched.
    async fn sweep(&self, batch: usize) -> Result<u64, StoreError>;

    /// Backend-specific counters (name, help, value) for the metrics
    /// endpoint, such as cache hits. Empty by default.
    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        Vec::new()
    }
}

/// The polling backoff used by the default [`Store::wait`]: 10 ms doubling
/// up to 200 ms.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((10u64 << attempt.min(5)).min(200))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_roundtrip() {
        let outcome = Outcome::Stored(StoredResponse {
            status: StatusCode::SEE_OTHER,
            headers: vec![
                (http::header::LOCATION, HeaderValue::from_static("/thanks")),
                (
                    HeaderName::from_static("x-a"),
                    HeaderValue::from_bytes(b"\xff bytes").unwrap(),
                ),
            ],
            body: Bytes::from_static(b"body"),
        });
        assert_eq!(Outcome::decode(&outcome.encode()).unwrap(), outcome);
        let marker = Outcome::TooLarge {
            status: StatusCode::CREATED,
        };
        assert_eq!(Outcome::decode(&marker.encode()).unwrap(), marker);
        let incomplete = Outcome::Incomplete {
            status: StatusCode::CREATED,
        };
        assert_eq!(Outcome::decode(&incomplete.encode()).unwrap(), incomplete);
        let sealed = Outcome::Sealed(SealedOutcome::from_bytes(Bytes::from_static(b"\x01opaque")));
        assert_eq!(Outcome::decode(&sealed.encode()).unwrap(), sealed);
        // What older versions wrote still decodes as it did.
        assert_eq!(Outcome::decode(&[2, 0, 201]).unwrap(), marker);
    }

    #[test]
    fn corrupt_outcome_is_an_error() {
        let bytes = Outcome::TooLarge {
            status: StatusCode::OK,
        }
        .encode();
        assert!(Outcome::decode(&bytes[..1]).is_err());
        assert!(Outcome::decode(&[9, 0, 200]).is_err());
        assert!(Outcome::decode(&[1, 0, 200, 0, 0, 0, 9]).is_err());
        assert!(StoredResponse::decode_headers(&[0, 0, 0, 1, b' ', 0, 0, 0, 0]).is_err());
        // Trailing bytes after either kind of outcome.
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(Outcome::decode(&trailing).is_err());
        let mut trailing = Outcome::Stored(StoredResponse {
            status: StatusCode::OK,
            headers: Vec::new(),
            body: Bytes::from_static(b"x"),
        })
        .encode();
        trailing.extend_from_slice(b"junk");
        assert!(Outcome::decode(&trailing).is_err());
    }

    #[test]
    fn backoff_grows_and_caps() {
        assert_eq!(backoff(0), Duration::from_millis(10));
        assert_eq!(backoff(1), Duration::from_millis(20));
        assert_eq!(backoff(10), Duration::from_millis(200));
    }
}
