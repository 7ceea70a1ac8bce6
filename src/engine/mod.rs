//! The one state machine every front end drives.
//!
//! A front end (the tower layer, the proxy) does four things and decides
//! none of them:
//!
//! 1. asks [`Engine::classify`] whether a request is covered — if not
//!    ([`Coverage::PassThrough`]), it forwards the request untouched,
//!    without buffering;
//! 2. takes a [`BodyPermit`] from [`Engine::body_permit`] (refused: the
//!    engine's 503, the body unread) and buffers a covered request's body up
//!    to [`Covered::max_body_bytes`] (over it: [`Engine::body_too_large`]);
//! 3. calls [`Engine::begin`] and obeys the [`Decision`];
//! 4. after [`Decision::Proceed`], hands the upstream's answer to the
//!    [`Recorder`] that [`Reservation::record`] returns — chunk by chunk,
//!    then [`Recorder::end`] or [`Recorder::fail`] — or calls
//!    [`Reservation::release`] when the upstream gave no answer.
//!
//! No tower or Pingora type appears here. The files, by concern:
//!
//! * `classify.rs` — covered or pass-through ([`Engine::classify`]);
//! * `decide.rs` — the key, the fingerprint, and the decision loop
//!   ([`Engine::begin`]);
//! * `scope.rs` — the scope identity a key is stored under;
//! * `secrets.rs` — the optional server secret every stored identity hash
//!   is keyed with ([`IdentityHasher`]);
//! * `seal.rs` — stored outcomes encrypted at rest ([`Keyring`]);
//! * `principal.rs` — the caller a key is scoped by, verified;
//! * `responses.rs` — the answers the engine makes itself (replays,
//!   problems);
//! * `reservation.rs` — a held key: recording its outcome, releasing it,
//!   retrying a failed store in the background, release on drop;
//! * `recorder.rs` — the upstream's answer as it streams ([`Recorder`]);
//! * `headers.rs` — header hygiene shared with the proxy;
//! * `lease.rs` — the lease renewer;
//! * `maintenance.rs` — health, sweeping, metrics rendering, and
//!   [`Engine::drain`] (waiting for background work on shutdown);
//! * `admin.rs` — the operator's lookups, purges and force releases
//!   ([`Engine::lookup`], [`Engine::purge_principal`], …), scoped exactly
//!   as live requests are.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

mod admin;
mod budget;
mod classify;
mod decide;
pub(crate) mod detached;
mod execution;
pub mod headers;
mod lease;
#[cfg(feature = "outbox")]
pub(crate) use lease::retry_after as renewal_retry_after;
mod maintenance;
mod principal;
mod recorder;
mod reservation;
mod responses;
mod scope;
mod seal;
mod secrets;
#[cfg(test)]
mod tests;

pub use self::admin::{AdminError, Lookup};
pub use self::budget::BodyPermit;
pub use self::classify::{Coverage, Covered, RequestHead};
pub use self::decide::Decision;
pub use self::detached::Execution;
pub use self::maintenance::DrainReport;
pub use self::recorder::{Ended, Flow, Recorder};
#[cfg(feature = "layer")]
pub(crate) use self::reservation::execution_scope_id;
pub use self::reservation::Reservation;
pub use self::responses::REPLAYED_HEADER;
pub use self::seal::{sealed_key_id, EncryptionKey, Keyring, MAX_KEY_ID_LEN};
pub use self::secrets::{
    decode_key_material, IdentityDigest, IdentityHasher, KeySecret, SecretError, MIN_SECRET_BYTES,
};

use self::lease::Leases;
use crate::metrics::Metrics;
use crate::policy::Routes;
use crate::store::{Store, StoreError};

/// Engine-wide settings (per-route settings live in [`Policy`](crate::Policy)).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The longest any single store call may take before it counts as a
    /// store failure (503, or forward where fail-open). Default 5 s.
    pub store_timeout: Duration,
    /// The `Retry-After` seconds sent with 503 when the store fails.
    /// Default 1.
    pub store_retry_after: u64,
    /// The most bytes of covered request bodies buffered at once, across
    /// all requests (each waiting duplicate holds its body until it is
    /// answered). A request is counted, before its body is read, at its
    /// `Content-Length`, or at its route's `max_body_bytes` without one;
    /// one that does not fit is refused with 503 `overloaded` and
    /// `Retry-After`, nothing reserved (see [`Engine::body_permit`]).
    /// Default 64 MiB.
    pub max_buffered_bytes: u64,
    /// A server secret for the scope keys records are stored under: with
    /// it, a scope key is HMAC-SHA-256 under this secret instead of plain
    /// SHA-256, so a copy of the store cannot be used to confirm a guessed
    /// key (see [`IdentityHasher`]). Changing it (or setting it on a
    /// running deployment) gives every key a new scope: a retry of a
    /// request made before the change executes again. Default none.
    pub key_secret: Option<KeySecret>,
    /// The longest a covered request's body may take to arrive through
    /// the layer, in all; then 408 `body-unreadable`, nothing reserved and
    /// its room in `max_buffered_bytes` given back (a client that opens a
    /// body and sends nothing never holds the budget for long). The proxy
    /// has its own `body_timeout`. Default 30 s.
    pub body_timeout: Duration,
    /// Encryption at rest of the stored outcomes (status, headers, body)
    /// with AES-256-GCM: every outcome stored is sealed with the keyring's
    /// current key, and a sealed record opens with the key whose id it
    /// carries. A record that cannot be opened is answered with 503, never
    /// executed again. Records stored without encryption still replay.
    /// Default none (outcomes are stored in the clear).
    pub encryption: Option<Keyring>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            store_timeout: Duration::from_secs(5),
            store_retry_after: 1,
            max_buffered_bytes: 64 * 1024 * 1024,
            key_secret: None,
            body_timeout: Duration::from_secs(30),
            encryption: None,
        }
    }
}

/// The idempotency engine: routes, a store, metrics. Cheap to clone (one
/// `Arc`); clones share everything.
#[derive(Clone, Debug)]
pub struct Engine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Arc<dyn Store>,
    routes: Routes,
    /// Each covered route's label (its path pattern), by policy.
    labels: classify::Labels,
    config: EngineConfig,
    /// Hashes scope keys (and any other stored identity), keyed by
    /// `config.key_secret`.
    hasher: IdentityHasher,
    metrics: Metrics,
    leases: Arc<Leases>,
    /// Work still running after its request ended (see
    /// [`Engine::drain`]).
    background: maintenance::Background,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.leases.stop();
    }
}

impl Engine {
    /// An engine over `store` covering `routes`, with default settings.
    pub fn new(store: impl Store, routes: Routes) -> Self {
        Self::with_config(Arc::new(store), routes, EngineConfig::default())
    }

    /// An engine over a shared store with explicit settings.
    ///
    /// Warns (once, here) for each route whose `lease` is under 3 ×
    /// `store_timeout`: a renewal that takes as long as the store may take
    /// lands after such a lease ran out, and a retry may then take the key
    /// over from a request still running.
    pub fn with_config(store: Arc<dyn Store>, routes: Routes, config: EngineConfig) -> Self {
        for route in routes.iter() {
            let Some(policy) = &route.policy else {
                continue;
            };
            let lease = policy.policy().lease;
            if lease < config.store_timeout * 3 {
                tracing::warn!(
                    route = route.path.as_str(),
                    lease = ?lease,
                    store_timeout = ?config.store_timeout,
                    "lease is under 3 × store_timeout: a renewal as slow as the store may be \
                     lands after the lease ran out, and a retry may take the key over from a \
                     request still running"
                );
            }
        }
        Engine {
            inner: Arc::new(Inner {
                store,
                labels: classify::Labels::new(&routes),
                routes,
                hasher: IdentityHasher::new(config.key_secret.clone()),
                config,
                metrics: Metrics::default(),
                leases: Arc::default(),
                background: maintenance::Background::default(),
            }),
        }
    }

    /// The counters.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// [`EngineConfig::body_timeout`] (the layer's; the proxy has its own).
    #[cfg(feature = "layer")]
    pub(crate) fn body_timeout(&self) -> Duration {
        self.inner.config.body_timeout
    }

    /// The hasher every identity hash a store keeps must come from (scope
    /// keys, and any other hash of a caller or an operation): SHA-256, or
    /// HMAC-SHA-256 under [`EngineConfig::key_secret`].
    pub fn identity_hasher(&self) -> &IdentityHasher {
        &self.inner.hasher
    }

    /// Runs one store call, bounded by the configured store timeout, and
    /// times it.
    async fn store_call<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = std::time::Instant::now();
        let result = within(self.inner.config.store_timeout, call)
            .await
            .unwrap_or(Err(StoreError::Timeout));
        self.inner.metrics.observe_store(started.elapsed());
        result
    }
}

/// `future`'s output, or `None` past `limit`. One that is ready on its
/// first poll (the memory store's calls, a request body already whole)
/// arms no timer.
pub(crate) async fn within<F: Future>(limit: Duration, future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    match std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await {
        Poll::Ready(output) => Some(output),
        Poll::Pending => tokio::time::timeout(limit, future).await.ok(),
    }
}
