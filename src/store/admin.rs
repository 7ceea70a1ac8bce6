//! The operator's side of a store, apart from the request path: look at a
//! record, delete it, release a stuck key, delete everything a principal
//! left, list and count. The engine reaches it through [`Store::admin`];
//! operators use the [`Engine`](crate::Engine)'s methods (see
//! `engine/admin.rs`), never these directly.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use http::StatusCode;

use super::{Claim, Fingerprint, OwnerToken, ScopeKey, StoreError};
#[allow(unused_imports)] // for the docs
use super::{Outcome, Store};

/// The hash of the principal a record was scoped by, kept with the record
/// so that [`Admin::purge_principal`] finds every record of one caller.
/// The raw principal is never stored; the engine computes this hash in one
/// place (`engine/scope.rs`, `principal_hash`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrincipalHash(pub [u8; 32]);

impl PrincipalHash {
    /// The 32 raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The first 8 hex characters, for logs.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..4])
    }

    /// Rebuilds a hash from 32 stored bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, StoreError> {
        bytes
            .try_into()
            .map(PrincipalHash)
            .map_err(|_| StoreError::Corrupt(format!("principal hash of {} bytes", bytes.len())))
    }
}

impl fmt::Debug for PrincipalHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrincipalHash({})", self.short())
    }
}

/// A scope hash that is not 64 hex characters.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a scope hash is 64 hex characters (as `keys lookup` prints it); got {0}")]
pub struct ScopeKeyError(String);

impl FromStr for ScopeKey {
    type Err = ScopeKeyError;

    /// Parses the 64 hex characters [`ScopeKey::to_hex`] writes (either
    /// case).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let describe = || format!("{} characters", text.chars().count());
        let bytes = hex::decode(text.trim()).map_err(|_| ScopeKeyError(describe()))?;
        bytes
            .try_into()
            .map(ScopeKey)
            .map_err(|_| ScopeKeyError(describe()))
    }
}

/// Where a record stands, as an operator sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyState {
    /// A worker holds the key (its lease may have run out: see
    /// [`RecordInfo::lease_remaining`]).
    InFlight,
    /// Completed, its response stored and replayed.
    Completed,
    /// Completed, its response too large to store (retries get
    /// `response-not-stored`).
    TooLarge,
    /// Executed, its response broke off (retries get
    /// `response-incomplete`).
    Incomplete,
    /// Completed, its outcome sealed (encryption at rest): a store cannot
    /// tell which kind it is, nor its status or sizes;
    /// [`Engine::inspect`](crate::Engine::inspect) opens it with the
    /// engine's keyring and reports the outcome's own state.
    Sealed,
}

impl KeyState {
    /// `in_flight`, `completed`, `too_large`, `incomplete` or `sealed`.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::InFlight => "in_flight",
            KeyState::Completed => "completed",
            KeyState::TooLarge => "too_large",
            KeyState::Incomplete => "incomplete",
            KeyState::Sealed => "sealed",
        }
    }
}

impl fmt::Display for KeyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an operator may see of a live record: never its body or headers
/// (read those with [`Store::get`]). Times are the store's own clock, as
/// durations from the moment it answered.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// The record's scope hash.
    pub key: ScopeKey,
    /// Its state.
    pub state: KeyState,
    /// The fingerprint of the request that created it.
    pub fingerprint: Fingerprint,
    /// How long ago the key was first reserved (kept across a lease
    /// takeover).
    pub age: Duration,
    /// How long until its retention runs out (then it counts as absent).
    pub expires_in: Duration,
    /// In flight: the time left on the holder's lease (zero: the next
    /// request with the same fingerprint takes it over). `None` once
    /// completed.
    pub lease_remaining: Option<Duration>,
    /// The stored status (completed records only).
    pub status: Option<StatusCode>,
    /// The stored body's length in bytes (a stored response only).
    pub body_bytes: Option<u64>,
    /// The stored headers' encoded length in bytes (a stored response only).
    pub header_bytes: Option<u64>,
    /// Whether it was stored with a principal's hash (so
    /// [`Admin::purge_principal`] reaches it).
    pub has_principal: bool,
    /// In flight: the holder's owner token ([`RecordInfo::held_by`]); shown
    /// to operators only as its [`Holder`].
    owner: Option<HeldBy>,
}

/// An owner token that shows as its [`Holder`] (a record's `Debug` never
/// prints the token).
#[derive(Clone, Copy, PartialEq, Eq)]
struct HeldBy(OwnerToken);

impl fmt::Debug for HeldBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Holder::of(&self.0).fmt(f)
    }
}

impl RecordInfo {
    /// A record of `state` with nothing stored yet (the stores fill in the
    /// rest).
    pub fn new(key: ScopeKey, state: KeyState, fingerprint: Fingerprint) -> Self {
        RecordInfo {
            key,
            state,
            fingerprint,
            age: Duration::ZERO,
            expires_in: Duration::ZERO,
            lease_remaining: None,
            status: None,
            body_bytes: None,
            header_bytes: None,
            has_principal: false,
            owner: None,
        }
    }

    /// The record held by `owner` (an in-flight record's current holder):
    /// stores that report it let an operator release the key only while
    /// the holder they saw still holds it
    /// ([`Engine::force_release_held_by`](crate::Engine::force_release_held_by)).
    pub fn held_by(mut self, owner: OwnerToken) -> Self {
        self.owner = Some(HeldBy(owner));
        self
    }

    /// Who holds it, in flight (`None` once completed, or from a store that
    /// does not report holders). A takeover changes it.
    pub fn holder(&self) -> Option<Holder> {
        self.owner.as_ref().map(|held| Holder::of(&held.0))
    }

    /// The holder's owner token (the engine's owner-checked release).
    pub(crate) fn owner(&self) -> Option<&OwnerToken> {
        self.owner.as_ref().map(|held| &held.0)
    }
}

/// Who holds an in-flight record, as an operator names it: the first 8
/// bytes of a SHA-256 of the holder's owner token, never the token itself
/// (which fences the holder's writes). Each reservation and each takeover
/// draws a new token, so a holder seen in a listing names that execution
/// only. Printed and parsed as 16 hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holder(pub [u8; 8]);

impl Holder {
    /// The holder of `owner`.
    pub fn of(owner: &OwnerToken) -> Self {
        use sha2::{Digest, Sha256};
        let digest = Sha256::new()
            .chain_update(b"tower-idempotency holder\0")
            .chain_update(owner.as_bytes())
            .finalize();
        let mut holder = [0u8; 8];
        holder.copy_from_slice(&digest[..8]);
        Holder(holder)
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Holder({self})")
    }
}

impl FromStr for Holder {
    type Err = HolderError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut holder = [0u8; 8];
        hex::decode_to_slice(text, &mut holder).map_err(|_| HolderError)?;
        Ok(Holder(holder))
    }
}

/// A holder that is not 16 hex characters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a holder is 16 hex characters, as a lookup or the in-flight list prints it")]
pub struct HolderError;

/// How many records a store holds, by state. Counting reads every record:
/// an operator's question, not a request path's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateCounts {
    /// In flight, lease running.
    pub in_flight: u64,
    /// In flight, lease run out (a crashed or stalled holder: the next
    /// request with the same fingerprint takes it over).
    pub lease_expired: u64,
    /// Completed with a stored response.
    pub completed: u64,
    /// Completed, response too large to store.
    pub too_large: u64,
    /// Executed, response incomplete.
    pub incomplete: u64,
    /// Past their retention, not yet swept (they count as absent).
    pub expired: u64,
}

impl StateCounts {
    /// Every record the store holds, live or awaiting the sweeper.
    pub fn total(&self) -> u64 {
        self.in_flight
            + self.lease_expired
            + self.completed
            + self.too_large
            + self.incomplete
            + self.expired
    }
}

/// The operator's side of a store: what an administrator needs to answer
/// "why do this customer's retries get 409" and "delete this caller's
/// stored responses". A store offers it through [`Store::admin`] (default:
/// none, and the engine's operator methods answer "unsupported").
///
/// # Contract
///
/// The conformance suite (`store_conformance!`) checks every store that has
/// this side. In short:
///
/// * [`reserve_for`](Admin::reserve_for) is [`Store::reserve`] exactly, and
///   keeps `principal` with the record (a takeover writes it again);
/// * [`force_release`](Admin::force_release) and
///   [`purge`](Admin::purge) delete the record, so the former owner's
///   `complete`, `renew` and `release` return `false` (fenced by the owner
///   token, which no longer owns anything), and the next request with the
///   key reserves it afresh;
/// * purges delete records whatever their retention (an expired record
///   still holds a response until swept);
/// * a store that caches records (the Redis front cache) never answers
///   from a copy of a purged or released record afterwards;
/// * [`inspect`](Admin::inspect) and
///   [`in_flight_older_than`](Admin::in_flight_older_than) name an
///   in-flight record's holder ([`RecordInfo::held_by`]), so an operator
///   can release a key only while the holder they saw still holds it.
#[async_trait]
pub trait Admin: Send + Sync {
    /// [`Store::reserve`], keeping `principal` (when given) with the
    /// record.
    async fn reserve_for(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
        principal: Option<&PrincipalHash>,
    ) -> Result<Claim, StoreError>;

    /// What an operator may see of `key`'s live record; `None` when there
    /// is none (never reserved, released, purged, or past its retention).
    async fn inspect(&self, key: &ScopeKey) -> Result<Option<RecordInfo>, StoreError>;

    /// Deletes `key`'s record, in any state, live or expired. Returns
    /// whether there was one. An in-flight record's holder is fenced off
    /// as by [`force_release`](Admin::force_release).
    async fn purge(&self, key: &ScopeKey) -> Result<bool, StoreError>;

    /// The keys of at most `limit` records stored with `principal`, in any
    /// state (what [`purge_principal`](Admin::purge_principal) would
    /// delete now).
    async fn principal_keys(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError>;

    /// Deletes at most `limit` records stored with `principal`, in any
    /// state, and returns their keys (fewer than `limit`: none is left).
    async fn purge_principal(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError>;

    /// Deletes `key`'s record if it is in flight, whoever holds it, and
    /// wakes its waiters: the holder's later `complete`, `renew` and
    /// `release` return `false`, and the next request with the key runs.
    /// Returns whether it was in flight (a completed record is left alone).
    async fn force_release(&self, key: &ScopeKey) -> Result<bool, StoreError>;

    /// Live in-flight records first reserved at least `age` ago, oldest
    /// first, at most `limit`.
    async fn in_flight_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<Vec<RecordInfo>, StoreError>;

    /// How many records the store holds, by state.
    async fn counts(&self) -> Result<StateCounts, StoreError>;
}
