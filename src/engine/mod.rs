//! The one state machine every front end drives.
//!
//! A front end (the tower layer, the proxy) does four things and decides
//! none of them:
//!
//! 1. asks [`Engine::route`] whether a request is covered — if not, it
//!    forwards the request untouched, without buffering;
//! 2. unless [`Engine::passes_without_key`] says to forward it untouched,
//!    buffers the body up to [`RoutePolicy::max_body_bytes`] (over it:
//!    [`Engine::body_too_large`]);
//! 3. calls [`Engine::begin`] and obeys the [`Decision`];
//! 4. after [`Decision::Proceed`], feeds the upstream's answer into a
//!    [`Capture`] and hands it to [`Reservation::finish`] — or calls
//!    [`Reservation::release`] when the upstream failed.
//!
//! No tower or Pingora type appears here.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Uri};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tracing::Instrument;

mod lease;

use self::lease::{Lease, Leases};
use crate::fingerprint::{fingerprint, Exclusions};
use crate::key::{self, KeyError};
use crate::metrics::{Event, Metrics};
use crate::policy::{FailMode, InFlightPolicy, KeySource, RoutePolicy, Routes};
use crate::problem::{Problem, ProblemKind};
use crate::store::{
    Claim, Fingerprint, Outcome, OwnerToken, RecordState, ScopeKey, Store, StoreError,
    StoredResponse,
};

/// The header added to every replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Engine-wide settings (per-route settings live in [`Policy`](crate::Policy)).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The longest any single store call may take before it counts as a
    /// store failure (503, or forward where fail-open). Default 5 s.
    pub store_timeout: Duration,
    /// The `Retry-After` seconds sent with 503 when the store fails.
    /// Default 1.
    pub store_retry_after: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            store_timeout: Duration::from_secs(5),
            store_retry_after: 1,
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
    config: EngineConfig,
    metrics: Metrics,
    leases: Arc<Leases>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.leases.stop();
    }
}

/// What a front end needs to know of a request, borrowed from its own
/// request type.
#[derive(Clone, Copy, Debug)]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI (path and query are used).
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// An authenticated principal set by the application (the tower layer
    /// reads it from a [`Principal`](crate::Principal) request extension).
    /// Hashed into the scope, never stored.
    pub principal: Option<&'a [u8]>,
}

/// The engine's answer to [`Engine::begin`].
#[derive(Debug)]
#[must_use = "a decision must be obeyed"]
pub enum Decision {
    /// Forward the request as it is; nothing was reserved (no key on an
    /// optional route, or the store failed on a fail-open route).
    Forward,
    /// This request owns the key: call the upstream, then
    /// [`Reservation::finish`] or [`Reservation::release`].
    Proceed(Reservation),
    /// Answer with this response and do not call the upstream: a replay
    /// (with `Idempotent-Replayed: true`) or a problem.
    Respond(Response<Bytes>),
}

impl Engine {
    /// An engine over `store` covering `routes`, with default settings.
    pub fn new(store: impl Store, routes: Routes) -> Self {
        Self::with_config(Arc::new(store), routes, EngineConfig::default())
    }

    /// An engine over a shared store with explicit settings.
    pub fn with_config(store: Arc<dyn Store>, routes: Routes, config: EngineConfig) -> Self {
        Engine {
            inner: Arc::new(Inner {
                store,
                routes,
                config,
                metrics: Metrics::default(),
                leases: Arc::default(),
            }),
        }
    }

    /// The policy that covers `method` on `path`, or `None`: forward
    /// untouched, without reading the body.
    pub fn route(&self, method: &Method, path: &str) -> Option<Arc<RoutePolicy>> {
        let found = self.inner.routes.find(method, path).cloned();
        if found.is_none() {
            self.inner.metrics.record(Event::Passthrough);
        }
        found
    }

    /// The counters.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Renders the engine's and the store's metrics in Prometheus text.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        let extra = self
            .inner
            .store
            .maintenance()
            .map(|store| store.counters())
            .unwrap_or_default();
        self.inner.metrics.render_prometheus(&extra, &mut out);
        out
    }

    /// Whether the store answers (for health checks).
    pub async fn health(&self) -> Result<(), StoreError> {
        self.store_call(self.inner.store.ping()).await
    }

    /// Deletes expired records every `every`, at most `batch` per call,
    /// until the returned handle is aborted. A store without a
    /// [`Maintenance`](crate::store::Maintenance) side has nothing to sweep:
    /// the task ends at once.
    pub fn spawn_sweeper(&self, every: Duration, batch: usize) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                // Keep sweeping while full batches come back.
                loop {
                    let Some(store) = engine.inner.store.maintenance() else {
                        return;
                    };
                    match engine.store_call(store.sweep(batch)).await {
                        Ok(n) if n as usize >= batch => continue,
                        Ok(n) => {
                            tracing::debug!(swept = n, "idempotency sweep");
                            break;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "idempotency sweep failed");
                            break;
                        }
                    }
                }
            }
        })
    }

    /// Whether a covered request goes to the upstream untouched before its
    /// body is read: its route takes an optional key from a header or the
    /// query, and the request carries none. Such a request is not
    /// protected, so its body is neither buffered nor limited (a large
    /// upload without a key is not refused with 413).
    pub fn passes_without_key(&self, policy: &RoutePolicy, head: &RequestHead<'_>) -> bool {
        let settings = policy.policy();
        let passes = !settings.required
            && matches!(settings.key, KeySource::Header(_) | KeySource::Query(_))
            && matches!(
                key::extract(&settings.key, head.uri, head.headers, &[]),
                Ok(None)
            );
        if passes {
            self.inner.metrics.record(Event::Passthrough);
        }
        passes
    }

    /// The 413 answer for a body over `policy`'s limit. Nothing is reserved.
    pub fn body_too_large(&self, policy: &RoutePolicy) -> Response<Bytes> {
        self.reject(
            Event::TooLarge,
            Problem::new(
                ProblemKind::BodyTooLarge,
                format!(
                    "The request body exceeds the limit of {} bytes.",
                    policy.max_body_bytes()
                ),
            ),
        )
    }

    /// The answer for a body that could not be read (client gone or too
    /// slow: `timed_out`). Nothing is reserved.
    pub fn body_unreadable(&self, timed_out: bool) -> Response<Bytes> {
        let problem = Problem::new(
            ProblemKind::BodyUnreadable,
            "The request body could not be read completely.",
        );
        let problem = if timed_out {
            problem.with_status(StatusCode::REQUEST_TIMEOUT)
        } else {
            problem
        };
        problem.into_response()
    }

    fn reject(&self, event: Event, problem: Problem) -> Response<Bytes> {
        self.inner.metrics.record(event);
        tracing::info!(outcome = %event, status = problem.status().as_u16(), "idempotency");
        problem.into_response()
    }

    async fn store_call<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = std::time::Instant::now();
        let mut call = std::pin::pin!(call);
        // A store that answers at once (the memory store) needs no timer.
        let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        let result = match first {
            Poll::Ready(result) => result,
            Poll::Pending => tokio::time::timeout(self.inner.config.store_timeout, call)
                .await
                .unwrap_or(Err(StoreError::Timeout)),
        };
        self.inner.metrics.observe_store(started.elapsed());
        result
    }

    /// Reserves `key` for an owner token drawn here, bounded by
    /// `store_timeout` like every store call.
    ///
    /// A reservation whose answer is lost (the call failed, or outlived
    /// `store_timeout`) may have been written all the same. The engine
    /// knows its token, so it releases it in the background, independently
    /// of what the request does next (503, or forwarding on a fail-open
    /// route): once at once, and — when the call was abandoned still
    /// running — again after that call ends (waited for at most the lease).
    /// Each release is bounded by `store_timeout` and owner-checked, so it
    /// never touches anyone else's record. A retry therefore finds the key
    /// free instead of in flight for a whole lease.
    async fn reserve(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(OwnerToken, Claim), StoreError> {
        let owner = OwnerToken::random();
        let store = self.inner.store.clone();
        let mut call =
            Box::pin(async move { store.reserve(&key, &fingerprint, &owner, lease, ttl).await });
        let started = std::time::Instant::now();
        let limit = self.inner.config.store_timeout;
        // A store that answers at once (the memory store) needs no timer.
        let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
        let (result, abandoned) = match first {
            Poll::Ready(result) => (result, None),
            Poll::Pending => match tokio::time::timeout(limit, &mut call).await {
                Ok(result) => (result, None),
                Err(_) => (Err(StoreError::Timeout), Some(call)),
            },
        };
        self.inner.metrics.observe_store(started.elapsed());
        let error = match result {
            Ok(claim) => return Ok((owner, claim)),
            Err(error) => error,
        };
        let store = self.inner.store.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let release = || tokio::time::timeout(limit, store.release(&key, &owner));
                let _ = release().await;
                if let Some(call) = abandoned {
                    let _ = tokio::time::timeout(lease, call).await;
                    let _ = release().await;
                }
            });
        }
        Err(error)
    }

    /// Decides what to do with a covered request whose whole body is
    /// `body` (at most the policy's limit).
    pub async fn begin(
        &self,
        policy: &Arc<RoutePolicy>,
        head: RequestHead<'_>,
        body: &[u8],
    ) -> Decision {
        let started = Instant::now();
        let settings = policy.policy();
        let raw_key =
            match key::extract(&settings.key, head.uri, head.headers, body).and_then(|key| {
                if let Some(key) = &key {
                    key::validate(key, settings.uuid_only)?;
                }
                Ok(key)
            }) {
                Ok(Some(key)) => key,
                Ok(None) if !settings.required => {
                    self.inner.metrics.record(Event::Passthrough);
                    return Decision::Forward;
                }
                Ok(None) => {
                    return Decision::Respond(self.reject(
                        Event::InvalidKey,
                        Problem::new(
                            ProblemKind::KeyMissing,
                            "This endpoint requires an idempotency key.",
                        ),
                    ))
                }
                Err(error) => return Decision::Respond(self.invalid_key(error)),
            };
        let key = scope_key(policy, &head, &raw_key);
        let fingerprint = fingerprint(
            head.method,
            head.uri,
            head.headers,
            &policy.fingerprint_headers,
            body,
            Exclusions {
                json: &policy.json_exclude,
                form: &policy.form_exclude,
            },
        );
        let span = tracing::info_span!("idempotency", key = %key.short(), path = head.uri.path());
        self.decide(policy, key, fingerprint, started)
            .instrument(span)
            .await
    }

    fn invalid_key(&self, error: KeyError) -> Response<Bytes> {
        self.reject(
            Event::InvalidKey,
            Problem::new(ProblemKind::KeyInvalid, error.to_string()),
        )
    }

    async fn decide(
        &self,
        policy: &Arc<RoutePolicy>,
        key: ScopeKey,
        fingerprint: Fingerprint,
        started: Instant,
    ) -> Decision {
        let settings = policy.policy();
        let store = &self.inner.store;
        let deadline = started + settings.wait_timeout;
        let mut waited = false;
        let mut attempt = 0;
        loop {
            // After a wait, only read: a waiter re-tries the reservation when
            // the record is gone or its lease ran out, so waiters never
            // compete with the owner's renewals for the store with writes.
            let live = if waited {
                match self.store_call(store.get(&key)).await {
                    Err(error) => return self.store_failed(policy, &error),
                    Ok(found) => found.filter(|record| !record.lease_expired()),
                }
            } else {
                None
            };
            let record = match live {
                Some(record) => record,
                None => match self
                    .reserve(key, fingerprint, settings.lease, settings.ttl)
                    .await
                {
                    Err(error) => return self.store_failed(policy, &error),
                    Ok((owner, Claim::Acquired { takeover })) => {
                        self.inner.metrics.record(Event::Executed);
                        tracing::debug!(takeover, "idempotency key reserved");
                        return Decision::Proceed(Reservation::new(
                            self.clone(),
                            policy.clone(),
                            key,
                            owner,
                        ));
                    }
                    Ok((_, Claim::Existing(record))) => record,
                },
            };
            if record.fingerprint != fingerprint {
                return Decision::Respond(
                    self.reject(
                        Event::Mismatch,
                        Problem::new(
                            ProblemKind::KeyMismatch,
                            "This idempotency key was already used for a different request.",
                        )
                        .with_status(policy.mismatch_status),
                    ),
                );
            }
            match record.state {
                RecordState::Completed(Outcome::Stored(response)) => {
                    let event = if waited {
                        Event::Waited
                    } else {
                        Event::Replayed
                    };
                    self.inner.metrics.record(event);
                    tracing::info!(
                        outcome = %event,
                        status = response.status.as_u16(),
                        duration_us = started.elapsed().as_micros() as u64,
                        "idempotency"
                    );
                    return Decision::Respond(replay(response));
                }
                RecordState::Completed(Outcome::TooLarge { status }) => {
                    return Decision::Respond(self.reject(
                        Event::Replayed,
                        Problem::new(
                            ProblemKind::ResponseNotStored,
                            format!(
                                "The request was executed once (status {}), but its response \
                                 was too large to store; it will not be executed again.",
                                status.as_u16()
                            ),
                        ),
                    ));
                }
                RecordState::InFlight { lease_remaining } => {
                    let now = Instant::now();
                    if settings.in_flight == InFlightPolicy::Reject || now >= deadline {
                        let retry = lease_remaining.min(settings.wait_timeout).as_secs() + 1;
                        return Decision::Respond(
                            self.reject(
                                Event::InFlightConflict,
                                Problem::new(
                                    ProblemKind::InFlight,
                                    "A request with this idempotency key is still being \
                                     processed; retry later.",
                                )
                                .retry_after(retry),
                            ),
                        );
                    }
                    waited = true;
                    // Wake at the latest when the lease could be taken over.
                    let max = (deadline - now).min(lease_remaining + Duration::from_millis(1));
                    if let Err(error) = store.wait(&key, max, attempt).await {
                        return self.store_failed(policy, &error);
                    }
                    attempt += 1;
                }
            }
        }
    }

    fn store_failed(&self, policy: &RoutePolicy, error: &StoreError) -> Decision {
        self.inner.metrics.record(Event::StoreError);
        tracing::warn!(%error, "idempotency store failed");
        match policy.policy().fail_mode {
            FailMode::Open => Decision::Forward,
            FailMode::Closed => Decision::Respond(
                Problem::new(
                    ProblemKind::StoreUnavailable,
                    "The idempotency store is unavailable; the request was not executed.",
                )
                .retry_after(self.inner.config.store_retry_after)
                .into_response(),
            ),
        }
    }

    /// The 502 (or 504 when `timed_out`) answer for an upstream transport
    /// failure, after [`Reservation::release`].
    pub fn upstream_failed(&self, timed_out: bool) -> Response<Bytes> {
        let problem = if timed_out {
            Problem::new(
                ProblemKind::UpstreamTimeout,
                "The upstream did not answer in time; the request may be retried.",
            )
        } else {
            Problem::new(
                ProblemKind::UpstreamUnavailable,
                "The upstream could not be reached; the request may be retried.",
            )
        };
        problem.into_response()
    }
}

/// SHA-256 over (principal, scope headers, method, path, key), each
/// length-prefixed.
fn scope_key(policy: &RoutePolicy, head: &RequestHead<'_>, raw_key: &[u8]) -> ScopeKey {
    let mut hasher = Sha256::new();
    let mut put = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    put(head.principal.unwrap_or(b""));
    for name in &policy.scope_headers {
        for value in head.headers.get_all(name) {
            put(name.as_str().as_bytes());
            put(value.as_bytes());
        }
    }
    put(head.method.as_str().as_bytes());
    put(head.uri.path().as_bytes());
    put(raw_key);
    ScopeKey(hasher.finalize().into())
}

fn replay(stored: StoredResponse) -> Response<Bytes> {
    let length = stored.body.len();
    let mut response = Response::new(stored.body);
    *response.status_mut() = stored.status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        headers.append(name, value);
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}

/// Ownership of one key while its request runs upstream.
///
/// While it lives, the engine's renewer renews the lease (every third of
/// it), so a long upstream call is not taken over. It must end in
/// [`finish`](Reservation::finish) or [`release`](Reservation::release);
/// if it is dropped instead (a panic, a cancelled task), the key is released
/// in the background, so no key is ever stuck for longer than its lease.
#[derive(Debug)]
pub struct Reservation {
    engine: Engine,
    policy: Arc<RoutePolicy>,
    key: ScopeKey,
    owner: OwnerToken,
    lease: Lease,
    started: Instant,
    settled: bool,
}

impl Reservation {
    fn new(engine: Engine, policy: Arc<RoutePolicy>, key: ScopeKey, owner: OwnerToken) -> Self {
        engine.inner.metrics.in_flight_add(1);
        let lease = engine
            .inner
            .leases
            .hold(&engine.inner, key, owner, policy.policy().lease);
        Reservation {
            engine,
            policy,
            key,
            owner,
            lease,
            started: Instant::now(),
            settled: false,
        }
    }

    fn stop_renewing(&self) {
        self.lease.forget();
    }

    /// The short hash of the key, for correlating logs.
    pub fn key_hash(&self) -> String {
        self.key.short()
    }

    /// The route's policy.
    pub fn policy(&self) -> &RoutePolicy {
        &self.policy
    }

    /// Starts capturing the upstream's answer. The headers that are never
    /// stored (hop-by-hop, `Date`, `Content-Length`, and `Set-Cookie` unless
    /// the route allows it) are dropped here.
    pub fn capture(&self, status: StatusCode, headers: &HeaderMap) -> Capture {
        let settings = self.policy.policy();
        let connection_listed: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        let headers = headers
            .iter()
            .filter(|(name, _)| {
                !never_stored(name, settings.replay_set_cookie) && !connection_listed.contains(name)
            })
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        Capture {
            status,
            headers,
            first: None,
            body: BytesMut::new(),
            limit: settings.max_response_bytes,
            store: settings.store_statuses.contains(status),
            overflow: false,
        }
    }

    /// Records the upstream's answer: stores it (replayed from now on), stores
    /// a "too large" marker, or releases the key when its status is not one
    /// the route stores. Never fails and never holds the caller up for long:
    /// when storing fails, it is retried in the background (the heartbeat
    /// still renewing the lease) for up to the route's lease, so a store
    /// outage shorter than the lease never leads to a second execution; after
    /// that it is logged and the key can be taken over.
    pub async fn finish(mut self, mut capture: Capture) {
        let status = capture.status;
        if !capture.store {
            self.stop_renewing();
            self.release_now(status).await;
            return;
        }
        let outcome = if capture.overflow {
            Outcome::TooLarge { status }
        } else {
            let headers = std::mem::take(&mut capture.headers);
            Outcome::Stored(StoredResponse {
                status,
                headers,
                body: capture.into_body(),
            })
        };
        match self.complete(&outcome).await {
            Ok(done) => self.completed(status, Ok(done)),
            Err(_) => {
                // Giving up would leave the key in flight, and the first retry
                // after the lease would execute the request a second time. So
                // keep trying in the background — with the heartbeat still
                // renewing the lease — for as long as the lease may be ours,
                // and let the caller have its response now. The owner check
                // makes a late success harmless.
                tokio::spawn(async move {
                    let deadline = Instant::now() + self.policy.policy().lease;
                    let mut attempt = 0;
                    let result = loop {
                        let now = Instant::now();
                        if now >= deadline {
                            break Err(StoreError::Timeout);
                        }
                        tokio::time::sleep(crate::store::backoff(attempt).min(deadline - now))
                            .await;
                        attempt += 1;
                        let result = self.complete(&outcome).await;
                        if result.is_ok() {
                            break result;
                        }
                    };
                    self.completed(status, result);
                });
            }
        }
    }

    async fn complete(&self, outcome: &Outcome) -> Result<bool, StoreError> {
        self.lease.settling();
        let engine = &self.engine;
        let ttl = self.policy.policy().ttl;
        engine
            .store_call(
                engine
                    .inner
                    .store
                    .complete(&self.key, &self.owner, outcome, ttl),
            )
            .await
    }

    fn completed(&mut self, status: StatusCode, result: Result<bool, StoreError>) {
        self.stop_renewing();
        self.settled = true;
        let engine = &self.engine;
        let duration_us = self.started.elapsed().as_micros() as u64;
        match result {
            Ok(true) => {
                engine.inner.metrics.record(Event::Stored);
                tracing::info!(outcome = "executed", status = status.as_u16(), duration_us, key = %self.key.short(), "idempotency");
            }
            Ok(false) => {
                tracing::warn!(status = status.as_u16(), key = %self.key.short(), "idempotency lease was taken over before completion; response not stored");
            }
            Err(error) => {
                engine.inner.metrics.record(Event::StoreError);
                tracing::error!(%error, status = status.as_u16(), key = %self.key.short(), "idempotency response could not be stored; the key frees when its lease expires");
            }
        }
    }

    /// Releases the key without storing anything (upstream transport
    /// failure, abandoned request): the next request with it executes.
    pub async fn release(mut self) {
        self.stop_renewing();
        self.release_now(StatusCode::BAD_GATEWAY).await;
    }

    async fn release_now(&mut self, status: StatusCode) {
        let engine = self.engine.clone();
        let result = engine
            .store_call(engine.inner.store.release(&self.key, &self.owner))
            .await;
        self.settled = true;
        engine.inner.metrics.record(Event::Released);
        match result {
            Ok(_) => {
                tracing::info!(outcome = "released", status = status.as_u16(), duration_us = self.started.elapsed().as_micros() as u64, key = %self.key.short(), "idempotency")
            }
            Err(error) => {
                tracing::warn!(%error, key = %self.key.short(), "idempotency release failed; the key frees when its lease expires")
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.stop_renewing();
        self.engine.inner.metrics.in_flight_add(-1);
        if self.settled {
            return;
        }
        // Abandoned (panic or cancellation): free the key in the background.
        let engine = self.engine.clone();
        let (key, owner) = (self.key, self.owner);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                engine.inner.metrics.record(Event::Released);
                let _ = engine
                    .store_call(engine.inner.store.release(&key, &owner))
                    .await;
                tracing::info!(outcome = "released", key = %key.short(), "idempotency reservation abandoned");
            });
        }
    }
}

fn never_stored(name: &HeaderName, replay_set_cookie: bool) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "authorization"
            | "cookie"
            | "date"
            | "content-length"
            | "idempotent-replayed"
    ) || (!replay_set_cookie && name == header::SET_COOKIE)
}

/// The upstream's answer, collected for storage while it streams to the
/// client.
///
/// Feed every body chunk to [`push`](Capture::push) (cheap once it stops
/// collecting), then pass it to [`Reservation::finish`].
#[derive(Debug)]
pub struct Capture {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The body as it came when it came in one chunk, or after
    /// [`Capture::body`]; `body` is empty whenever this is set.
    first: Option<Bytes>,
    body: BytesMut,
    limit: usize,
    store: bool,
    overflow: bool,
}

impl Capture {
    /// Appends a body chunk (copied); past the storage cap the body is
    /// dropped and only a marker will be stored.
    pub fn push(&mut self, chunk: &[u8]) {
        if self.make_room(chunk.len()) {
            self.spill();
            self.body.extend_from_slice(chunk);
        }
    }

    /// Appends a body chunk like [`push`](Capture::push), without copying
    /// it when it is the first: a body that arrives in one chunk is stored
    /// as it came.
    pub fn push_bytes(&mut self, chunk: &Bytes) {
        if !self.make_room(chunk.len()) {
            return;
        }
        if self.first.is_none() && self.body.is_empty() {
            self.first = Some(chunk.clone());
        } else {
            self.spill();
            self.body.extend_from_slice(chunk);
        }
    }

    /// Whether a chunk of `len` bytes would still be collected (not past
    /// the storage cap, and the status is one the route stores).
    pub fn has_room_for(&self, len: usize) -> bool {
        self.wants_body() && self.len() + len <= self.limit
    }

    /// The body collected so far, in one piece (copied only if it came in
    /// several chunks). Empty once the cap was passed.
    pub fn body(&mut self) -> Bytes {
        if let Some(first) = &self.first {
            return first.clone();
        }
        let body = std::mem::take(&mut self.body).freeze();
        self.first = Some(body.clone());
        body
    }

    /// Whether body chunks are still being collected.
    pub fn wants_body(&self) -> bool {
        self.store && !self.overflow
    }

    /// The status being captured.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.body.len()
    }

    /// Whether `len` more bytes are collected; marks the overflow (and drops
    /// what was collected) when they would pass the cap.
    fn make_room(&mut self, len: usize) -> bool {
        if !self.wants_body() {
            return false;
        }
        if self.len() + len > self.limit {
            self.overflow = true;
            self.first = None;
            self.body = BytesMut::new();
            return false;
        }
        true
    }

    /// Moves an uncopied first chunk into the buffer, ahead of more chunks.
    fn spill(&mut self) {
        if let Some(first) = self.first.take() {
            self.body.extend_from_slice(&first);
        }
    }

    fn into_body(self) -> Bytes {
        // `first` is only ever set while the buffer is empty.
        self.first.unwrap_or_else(|| self.body.freeze())
    }
}

impl RoutePolicy {
    /// The request body limit in bytes.
    pub fn max_body_bytes(&self) -> usize {
        self.policy().max_body_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;
    use crate::store::{Fault, Faults, FaultyStore, MemoryStore, Op};

    fn engine(policy: Policy) -> (Engine, MemoryStore, Arc<RoutePolicy>) {
        let store = MemoryStore::new();
        let routes = Routes::all(policy).unwrap();
        let engine = Engine::new(store.clone(), routes);
        let policy = engine.route(&Method::POST, "/orders").unwrap();
        (engine, store, policy)
    }

    /// `POST /orders` with `Idempotency-Key: key` and a JSON body.
    async fn begin(engine: &Engine, policy: &Arc<RoutePolicy>, key: &str) -> Decision {
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", key.parse().unwrap());
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        let head = RequestHead {
            method: &Method::POST,
            uri: &Uri::from_static("/orders"),
            headers: &headers,
            principal: None,
        };
        engine.begin(policy, head, br#"{"amount":10}"#).await
    }

    fn proceed(decision: Decision) -> Reservation {
        match decision {
            Decision::Proceed(reservation) => reservation,
            other => panic!("expected Proceed, got {other:?}"),
        }
    }

    fn problem_type(decision: Decision) -> (StatusCode, String) {
        let Decision::Respond(response) = decision else {
            panic!("expected a response, got {decision:?}");
        };
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        (response.status(), body["type"].as_str().unwrap().to_owned())
    }

    #[test]
    fn capture_keeps_only_replayable_headers() {
        for replay_set_cookie in [false, true] {
            let mut headers = HeaderMap::new();
            for (name, value) in [
                ("content-type", "text/plain"),
                ("x-trace", "a"),
                ("connection", "keep-alive, x-hop"),
                ("x-hop", "per connection"),
                ("keep-alive", "timeout=5"),
                ("transfer-encoding", "chunked"),
                ("date", "Tue, 01 Jan 2030 00:00:00 GMT"),
                ("content-length", "5"),
                ("set-cookie", "session=1"),
                ("idempotent-replayed", "true"),
                ("x-trace", "b"),
            ] {
                headers.append(
                    HeaderName::from_static(name),
                    HeaderValue::from_static(value),
                );
            }
            let stored: Vec<_> = headers
                .iter()
                .filter(|(name, _)| !never_stored(name, replay_set_cookie))
                .map(|(name, _)| name.as_str())
                .collect();
            assert!(!stored.contains(&"date") && !stored.contains(&"content-length"));
            assert_eq!(stored.contains(&"set-cookie"), replay_set_cookie);
            assert!(stored.contains(&"content-type") && stored.contains(&"x-trace"));
        }
    }

    #[tokio::test]
    async fn capture_drops_connection_listed_headers_and_stops_at_the_cap() {
        let (engine, _, policy) = engine(Policy {
            max_response_bytes: 8,
            ..Policy::default()
        });
        let reservation = proceed(begin(&engine, &policy, "k").await);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, "x-hop".parse().unwrap());
        headers.insert("x-hop", "1".parse().unwrap());
        headers.append("x-keep", "1".parse().unwrap());
        headers.append("x-keep", "2".parse().unwrap());
        let mut capture = reservation.capture(StatusCode::CREATED, &headers);
        let names: Vec<_> = capture
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
            .collect();
        assert_eq!(names, [("x-keep", "1"), ("x-keep", "2")]);
        capture.push(b"12345");
        assert!(capture.wants_body());
        capture.push(b"6789");
        assert!(!capture.wants_body());
        reservation.finish(capture).await;
        assert_eq!(
            problem_type(begin(&engine, &policy, "k").await),
            (
                StatusCode::CONFLICT,
                "urn:tower-idempotency:response-not-stored".to_owned()
            )
        );
    }

    #[tokio::test]
    async fn capture_keeps_one_chunk_uncopied_and_joins_several_in_order() {
        let (engine, _, policy) = engine(Policy {
            max_response_bytes: 10,
            ..Policy::default()
        });
        let reservation = proceed(begin(&engine, &policy, "k").await);
        let mut capture = reservation.capture(StatusCode::OK, &HeaderMap::new());
        let chunk = Bytes::from_static(b"hello");
        capture.push_bytes(&chunk);
        assert_eq!(capture.body().as_ptr(), chunk.as_ptr(), "stored as it came");
        assert!(capture.has_room_for(5) && !capture.has_room_for(6));
        capture.push(b" ");
        capture.push_bytes(&Bytes::from_static(b"you"));
        assert_eq!(capture.body(), "hello you");
        capture.push_bytes(&Bytes::from_static(b"!!"));
        assert!(!capture.wants_body(), "past the cap");
        assert!(capture.body().is_empty());
        reservation.release().await;
    }

    #[tokio::test]
    async fn unstored_statuses_and_abandoned_reservations_release_the_key() {
        let (engine, store, policy) = engine(Policy::default());
        let reservation = proceed(begin(&engine, &policy, "k").await);
        let capture = reservation.capture(StatusCode::UNPROCESSABLE_ENTITY, &HeaderMap::new());
        assert!(!capture.wants_body());
        reservation.finish(capture).await;
        assert!(store.is_empty());

        // Dropped without finish or release (a panic, a cancelled task).
        drop(proceed(begin(&engine, &policy, "k").await));
        let mut next = begin(&engine, &policy, "k").await;
        for _ in 0..100 {
            if matches!(next, Decision::Proceed(_)) {
                break;
            }
            tokio::task::yield_now().await;
            next = begin(&engine, &policy, "k").await;
        }
        proceed(next).release().await;
        assert!(store.is_empty());
        assert_eq!(engine.metrics().in_flight(), 0);
    }

    /// The heartbeat keeps a long call's lease alive: a duplicate arriving
    /// long after the first lease would have run out still sees it in flight.
    #[tokio::test(start_paused = true)]
    async fn the_heartbeat_keeps_a_long_call_from_being_taken_over() {
        let (engine, _, policy) = engine(Policy {
            lease: Duration::from_millis(300),
            in_flight: InFlightPolicy::Reject,
            ..Policy::default()
        });
        let first = proceed(begin(&engine, &policy, "k").await);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            problem_type(begin(&engine, &policy, "k").await),
            (
                StatusCode::CONFLICT,
                "urn:tower-idempotency:in-flight".to_owned()
            )
        );
        let capture = first.capture(StatusCode::OK, &HeaderMap::new());
        first.finish(capture).await;
        assert!(matches!(
            begin(&engine, &policy, "k").await,
            Decision::Respond(response) if response.headers().contains_key(REPLAYED_HEADER)
        ));
    }

    /// A call may outlive the record's retention (`ttl`) when the heartbeat
    /// keeps renewing its lease; the record must not expire under it.
    #[tokio::test(start_paused = true)]
    async fn a_renewed_reservation_outlives_its_retention() {
        let (engine, store, policy) = engine(Policy {
            lease: Duration::from_millis(300),
            ttl: Duration::from_millis(300),
            in_flight: InFlightPolicy::Reject,
            ..Policy::default()
        });
        let first = proceed(begin(&engine, &policy, "k").await);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(store.maintenance().unwrap().sweep(10).await.unwrap(), 0);
        assert_eq!(
            problem_type(begin(&engine, &policy, "k").await).1,
            "urn:tower-idempotency:in-flight"
        );
        first.release().await;
    }

    /// One renewer serves every lease: a short lease taken after a long
    /// one (the renewer asleep until the long one is due) is still renewed
    /// in time, and settled or abandoned reservations leave it.
    #[tokio::test(start_paused = true)]
    async fn one_renewer_keeps_short_and_long_leases_alive() {
        let policy = |lease| Policy {
            lease,
            in_flight: InFlightPolicy::Reject,
            ..Policy::default()
        };
        let routes = Routes::new()
            .route("/long", policy(Duration::from_secs(60)))
            .unwrap()
            .route("/short", policy(Duration::from_millis(300)))
            .unwrap();
        let engine = Engine::new(MemoryStore::new(), routes);
        let long = engine.route(&Method::POST, "/long").unwrap();
        let short = engine.route(&Method::POST, "/short").unwrap();
        let first = proceed(begin(&engine, &long, "long").await);
        // Let the renewer start and go to sleep until the long lease is due.
        tokio::task::yield_now().await;
        let second = proceed(begin(&engine, &short, "short").await);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            problem_type(begin(&engine, &short, "short").await).1,
            "urn:tower-idempotency:in-flight"
        );
        let third = proceed(begin(&engine, &short, "dropped").await);
        assert_eq!(engine.inner.leases.len(), 3);

        let capture = first.capture(StatusCode::OK, &HeaderMap::new());
        first.finish(capture).await;
        second.release().await;
        drop(third);
        assert_eq!(engine.inner.leases.len(), 0);
    }

    /// The renewer holds the engine only weakly and ends with it.
    #[tokio::test(start_paused = true)]
    async fn the_renewer_ends_with_the_engine() {
        let (engine, _, policy) = engine(Policy::default());
        proceed(begin(&engine, &policy, "k").await).release().await;
        let leases = engine.inner.leases.clone();
        assert_eq!(leases.renewer_refs(), [2], "one renewer, running");
        drop(engine);
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(leases.renewer_refs(), [1], "the renewer has ended");
    }

    /// Each runtime renews the leases of its own requests: a runtime that
    /// stopped (or is no longer driven) takes no one else's leases with it.
    #[test]
    fn a_runtime_no_longer_driven_takes_no_other_runtimes_leases_with_it() {
        let (engine, _, policy) = engine(Policy {
            lease: Duration::from_millis(300),
            in_flight: InFlightPolicy::Reject,
            ..Policy::default()
        });
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()
                .unwrap()
        };
        // The first reservation starts a renewer on a runtime that is then
        // no longer driven (and later stops).
        let first = runtime();
        let idle = first.block_on(async { proceed(begin(&engine, &policy, "a").await) });
        let second = runtime();
        second.block_on(async {
            let held = proceed(begin(&engine, &policy, "b").await);
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert_eq!(
                problem_type(begin(&engine, &policy, "b").await).1,
                "urn:tower-idempotency:in-flight",
                "the lease was renewed, not taken over"
            );
            held.release().await;
        });
        drop(idle);
        drop(first);
    }

    #[test]
    fn every_part_of_the_scope_changes_the_key() {
        let policy = Policy {
            scope_headers: vec!["authorization".into()],
            ..Policy::default()
        }
        .validate()
        .unwrap();
        let key = |principal: Option<&[u8]>, auth: &str, method: Method, path: &str, raw: &[u8]| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, auth.parse().unwrap());
            let uri: Uri = path.parse().unwrap();
            let head = RequestHead {
                method: &method,
                uri: &uri,
                headers: &headers,
                principal,
            };
            scope_key(&policy, &head, raw)
        };
        let base = key(None, "a", Method::POST, "/o", b"k");
        assert_eq!(base, key(None, "a", Method::POST, "/o?q=1", b"k"));
        for other in [
            key(Some(b"alice"), "a", Method::POST, "/o", b"k"),
            key(None, "b", Method::POST, "/o", b"k"),
            key(None, "a", Method::PATCH, "/o", b"k"),
            key(None, "a", Method::POST, "/p", b"k"),
            key(None, "a", Method::POST, "/o", b"k2"),
        ] {
            assert_ne!(base, other);
        }
        // Length prefixes: moving bytes between parts changes the key.
        assert_ne!(
            key(Some(b"ab"), "a", Method::POST, "/o", b"c"),
            key(Some(b"a"), "a", Method::POST, "/o", b"bc")
        );
    }

    /// The memory store behind the fault injector, and its handle.
    fn faulty() -> (Arc<FaultyStore<MemoryStore>>, Faults) {
        let store = FaultyStore::new(MemoryStore::new());
        let faults = store.faults();
        (Arc::new(store), faults)
    }

    /// A waiter polls (this store has no wake-ups) with reads only: it
    /// tried to reserve once, on arrival, and replays the first answer.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_polls_with_reads_not_reservations() {
        let (store, faults) = faulty();
        let engine = Engine::with_config(
            store.clone(),
            Routes::all(Policy::default()).unwrap(),
            EngineConfig::default(),
        );
        let policy = engine.route(&Method::POST, "/orders").unwrap();
        let first = proceed(begin(&engine, &policy, "k").await);
        let waiter = tokio::spawn({
            let (engine, policy) = (engine.clone(), policy.clone());
            async move { begin(&engine, &policy, "k").await }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!waiter.is_finished(), "the waiter is still waiting");
        let capture = first.capture(StatusCode::CREATED, &HeaderMap::new());
        first.finish(capture).await;
        let Decision::Respond(replay) = waiter.await.unwrap() else {
            panic!("the waiter replays");
        };
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert!(replay.headers().contains_key(REPLAYED_HEADER));
        assert_eq!(faults.calls(Op::Reserve), 2);
    }

    /// Renewals that fail (a store restarting, broken pooled connections)
    /// are tried again soon, not a third of the lease later: three failed
    /// renewals in a row do not let a live request's lease run out.
    #[tokio::test(start_paused = true)]
    async fn a_failed_renewal_is_retried_before_the_lease_runs_out() {
        let (store, faults) = faulty();
        faults.set_next(Op::Renew, Fault::Down, 3);
        let policy = Policy {
            lease: Duration::from_millis(300),
            in_flight: InFlightPolicy::Reject,
            ..Policy::default()
        };
        let engine = Engine::with_config(
            store.clone(),
            Routes::all(policy).unwrap(),
            EngineConfig::default(),
        );
        let policy = engine.route(&Method::POST, "/orders").unwrap();
        let held = proceed(begin(&engine, &policy, "k").await);
        // A duplicate every 10 ms for 2 s: none may take the key over.
        for _ in 0..200 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert_eq!(
                problem_type(begin(&engine, &policy, "k").await).1,
                "urn:tower-idempotency:in-flight",
                "the lease was renewed, not taken over"
            );
        }
        assert_eq!(faults.remaining(Op::Renew), 0, "all failed");
        held.release().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_outage_shorter_than_the_lease_never_executes_twice() {
        let (store, faults) = faulty();
        let policy = Policy {
            lease: Duration::from_secs(2),
            ..Policy::default()
        };
        let engine = Engine::with_config(
            store.clone(),
            Routes::all(policy).unwrap(),
            EngineConfig::default(),
        );
        let (method, uri) = (Method::POST, Uri::from_static("/orders"));
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", HeaderValue::from_static("k1"));
        let head = RequestHead {
            method: &method,
            uri: &uri,
            headers: &headers,
            principal: None,
        };
        let policy = engine.route(&method, "/orders").unwrap();
        let Decision::Proceed(reservation) = engine.begin(&policy, head, b"").await else {
            panic!("the first request proceeds");
        };
        // The store is down for a while (well under the lease) when the
        // upstream's answer arrives.
        faults.set_next(Op::Complete, Fault::Down, 10);
        let capture = reservation.capture(StatusCode::CREATED, &HeaderMap::new());
        reservation.finish(capture).await;
        // Long after the lease, a retry is a replay, not a second execution.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(faults.remaining(Op::Complete), 0, "storing was retried");
        match engine.begin(&policy, head, b"").await {
            Decision::Respond(response) => {
                assert_eq!(response.status(), StatusCode::CREATED);
                assert_eq!(response.headers()[REPLAYED_HEADER], "true");
            }
            other => panic!("the retry executed again: {other:?}"),
        }
    }

    /// An engine over `store` with a short `store_timeout`, rejecting
    /// duplicates in flight at once (so "in flight" shows as 409).
    fn over(store: Arc<dyn Store>, fail_mode: FailMode) -> (Engine, Arc<RoutePolicy>) {
        let policy = Policy {
            in_flight: InFlightPolicy::Reject,
            fail_mode,
            ..Policy::default()
        };
        let config = EngineConfig {
            store_timeout: Duration::from_millis(100),
            ..EngineConfig::default()
        };
        let engine = Engine::with_config(store, Routes::all(policy).unwrap(), config);
        let policy = engine.route(&Method::POST, "/orders").unwrap();
        (engine, policy)
    }

    /// A reservation written but answered with an error (or too late): the
    /// client gets 503, and the engine releases the reservation with its
    /// token, so the retry executes instead of meeting 409 for a lease.
    /// (Before the engine drew the token, the retry got 409 `in-flight`.)
    #[tokio::test(start_paused = true)]
    async fn a_reservation_committed_but_unanswered_is_released() {
        for fault in [
            Fault::CommitThenFail,
            Fault::CommitThenStall(Duration::from_secs(10)),
        ] {
            let (store, faults) = faulty();
            let (engine, policy) = over(store.clone(), FailMode::Closed);
            faults.set_next(Op::Reserve, fault, 1);
            assert_eq!(
                problem_type(begin(&engine, &policy, "k").await),
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "urn:tower-idempotency:store-unavailable".to_owned()
                ),
                "{fault:?}"
            );
            assert_eq!(faults.inner_calls(Op::Reserve), 1, "it was written");
            tokio::time::sleep(Duration::from_millis(1)).await;
            let retry = proceed(begin(&engine, &policy, "k").await);
            // The late answer's second release leaves the retry's record be.
            tokio::time::sleep(Duration::from_secs(11)).await;
            assert_eq!(
                problem_type(begin(&engine, &policy, "k").await).1,
                "urn:tower-idempotency:in-flight",
                "{fault:?}"
            );
            let capture = retry.capture(StatusCode::CREATED, &HeaderMap::new());
            retry.finish(capture).await;
            assert!(matches!(
                begin(&engine, &policy, "k").await,
                Decision::Respond(response) if response.headers().contains_key(REPLAYED_HEADER)
            ));
        }
    }

    /// A reservation abandoned before it reached the store, which then
    /// writes it late (after the 503): released when the late call ends.
    #[tokio::test(start_paused = true)]
    async fn a_reservation_written_after_its_timeout_is_released() {
        let (store, faults) = faulty();
        let (engine, policy) = over(store.clone(), FailMode::Closed);
        faults.set_next(Op::Reserve, Fault::Stall(Duration::from_secs(3)), 1);
        assert_eq!(
            problem_type(begin(&engine, &policy, "k").await).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(faults.inner_calls(Op::Reserve), 0, "not written yet");
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(faults.inner_calls(Op::Reserve), 1, "written late");
        assert!(store.inner().is_empty(), "and released");
        proceed(begin(&engine, &policy, "k").await).release().await;
    }

    /// Fail-open: the request whose reservation was lost runs unprotected
    /// (one execution); the reservation is released at once, independently
    /// of that request, so the retry is reserved normally (the second
    /// execution, as documented for fail-open) and later ones replay it.
    #[tokio::test(start_paused = true)]
    async fn fail_open_releases_the_lost_reservation_before_the_retry() {
        let (store, faults) = faulty();
        let (engine, policy) = over(store.clone(), FailMode::Open);
        faults.set_next(Op::Reserve, Fault::CommitThenFail, 1);
        assert!(matches!(
            begin(&engine, &policy, "k").await,
            Decision::Forward
        ));
        tokio::time::sleep(Duration::from_millis(1)).await;
        let retry = proceed(begin(&engine, &policy, "k").await);
        let capture = retry.capture(StatusCode::CREATED, &HeaderMap::new());
        retry.finish(capture).await;
        assert!(matches!(
            begin(&engine, &policy, "k").await,
            Decision::Respond(response) if response.headers().contains_key(REPLAYED_HEADER)
        ));
    }
}
