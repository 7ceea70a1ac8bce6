//! A held key, from its reservation to its outcome: stored, marked too
//! large, or released — and released in the background when abandoned.

use std::sync::Arc;

use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use super::lease::Lease;
use super::scope::Short;
use super::{headers, Engine, Recorder};
use crate::metrics::Event;
use crate::policy::{RequestTarget, RoutePolicy};
use crate::store::{Outcome, OwnerToken, ScopeKey, StoreError};

/// Ownership of one key while its request runs upstream.
///
/// While it lives, the engine's renewer renews the lease (every third of
/// it), so a long upstream call is not taken over. It must end in
/// [`record`](Reservation::record) (and its [`Recorder`]) or
/// [`release`](Reservation::release); if it is dropped instead (a panic, a
/// cancelled task), it settles in the background: before the upstream's
/// answer head was recorded, the key is released, so no key is ever stuck
/// for longer than its lease; after it (a body that panicked, a task
/// cancelled while storing), the upstream acted, so the marker "executed,
/// response incomplete" is stored and the key never runs again. So is
/// "executed, outcome unknown" for an execution whose caller went away
/// (run on detached) that panics once its request reached the upstream.
#[derive(Debug)]
pub struct Reservation {
    engine: Engine,
    policy: Arc<RoutePolicy>,
    key: ScopeKey,
    owner: OwnerToken,
    lease: Lease,
    started: Instant,
    settled: bool,
    /// The status of an answer that consumes the key, once its head came
    /// ([`Reservation::record`]): the upstream acted, so from then on an
    /// abandoned reservation stores "executed, response incomplete"
    /// instead of freeing the key.
    executed: Option<StatusCode>,
    /// Made by a dropped reservation to store its marker: dropped in turn
    /// (its runtime shutting down), it makes no heir of its own.
    heir: bool,
    /// The request as a redirect's `Location` is judged against (see
    /// [`RoutePolicy::consumes`]). `None` for an heir, which records
    /// nothing.
    target: Option<Target>,
}

/// The parts of a [`RequestTarget`], kept for the answer.
#[derive(Debug)]
struct Target {
    host: String,
    /// The path and query the client sent.
    path_and_query: Box<str>,
    /// The prefix a router mounted the layer under (see [`mount_prefix`]);
    /// found only where a `Location` is matched against `success_redirects`.
    mount: Box<str>,
}

impl Target {
    fn read(&self) -> RequestTarget<'_> {
        let (path, query) = match self.path_and_query.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (&*self.path_and_query, None),
        };
        RequestTarget {
            host: &self.host,
            path,
            query,
            mount: &self.mount,
        }
    }
}

/// The prefix a router mounted the layer under: what `original` (the path
/// the request arrived with) holds before `routed` (the path the layer's
/// routes see), as axum's `Router::nest("/shop-a", …)` strips `/shop-a`
/// from `/shop-a/contact`. Empty when the two paths are one, or when
/// `routed` is not the end of `original`.
fn mount_prefix<'a>(original: &'a str, routed: &str) -> &'a str {
    match original.strip_suffix(routed) {
        Some(prefix) if routed.starts_with('/') => prefix,
        _ => "",
    }
}

impl Reservation {
    pub(super) fn new(
        engine: Engine,
        policy: Arc<RoutePolicy>,
        key: ScopeKey,
        owner: OwnerToken,
        sent: Instant,
        head: &super::RequestHead<'_>,
    ) -> Self {
        engine.inner.metrics.in_flight_add(1);
        let lease = engine.inner.leases.hold(
            &engine.inner,
            key,
            owner,
            (policy.policy().lease, policy.policy().ttl),
            sent,
        );
        let path = head.uri.path();
        let mount = match policy.success_redirects.is_empty() {
            true => "".into(),
            false => {
                // Spelled as the `Location` it is matched against is read.
                let original = crate::policy::normalize_path(path, false);
                let routed = crate::policy::normalize_path(head.route_path(), false);
                mount_prefix(&original, &routed).into()
            }
        };
        let path_and_query = match head.uri.path_and_query() {
            Some(target) => target.as_str().into(),
            None => path.into(),
        };
        let target = Some(Target {
            host: crate::policy::scope_host(head.uri, head.headers),
            path_and_query,
            mount,
        });
        Reservation {
            engine,
            policy,
            key,
            owner,
            lease,
            started: Instant::now(),
            settled: false,
            executed: None,
            heir: false,
            target,
        }
    }

    fn stop_renewing(&self) {
        self.lease.forget();
    }

    /// The request is about to reach the upstream (the proxy writes it,
    /// the layer calls the inner service): from now on it may act, so a
    /// drain that abandons it stores "executed, outcome unknown" for its
    /// key ([`Engine::drain`]) rather than leave the key to its lease.
    ///
    /// Returns false, marking nothing, when the key may no longer be this
    /// request's: the store said so, or no renewal of the lease succeeded
    /// for its whole length (a store outage), so another arrival may have
    /// taken it over and be executing it. The request must then not reach
    /// the upstream: answer [`Reservation::lost`] instead. (An execution
    /// already running when its lease is lost is README's limit.)
    #[must_use = "a request whose lease may be lost must not reach the upstream"]
    pub fn acting(&self) -> bool {
        self.lease.acting()
    }

    /// The answer for a request whose lease was lost before it reached the
    /// upstream, or whose engine was drained ([`Engine::drain`](crate::Engine::drain): for good)
    /// ([`Reservation::acting`] said false): 503 `store-unavailable`
    /// with `Retry-After` (nothing ran; the retry finds the key's record),
    /// and the key released, owner-checked, in case it is still ours.
    pub async fn lost(self, request: &http::HeaderMap) -> http::Response<bytes::Bytes> {
        match self.engine.inner.leases.closed() {
            true => {
                tracing::warn!(key = %Short::of(&self.key), "idempotency engine drained (shutting down): the request was not executed, answered 503")
            }
            false => {
                tracing::warn!(key = %Short::of(&self.key), "idempotency lease may have run out before the request reached its upstream; not executed, answered 503")
            }
        }
        let answer = self.engine.store_unavailable(request);
        self.release_as(answer.status()).await;
        answer
    }

    /// The short hash of the key, for correlating logs.
    pub fn key_hash(&self) -> String {
        self.key.short()
    }

    /// The stable id of the key's scope, for the handler that executes
    /// under it (the layer's `ExecutionScope`): a domain-separated
    /// SHA-256 of the scope key, so it is not the key the store files the
    /// record under.
    pub fn scope_id(&self) -> String {
        execution_scope_id(&self.key)
    }

    /// The scope key itself, for an id computed only when asked
    /// ([`execution_scope_id`]).
    #[cfg(feature = "layer")]
    pub(crate) fn scope_key(&self) -> ScopeKey {
        self.key
    }

    /// The owner token the key is held under (a nested layer proves with
    /// it that the key is held in its own store by this execution).
    #[cfg(feature = "layer")]
    pub(crate) fn owner_token(&self) -> OwnerToken {
        self.owner
    }

    /// The route's policy.
    pub fn policy(&self) -> &RoutePolicy {
        &self.policy
    }

    /// Starts recording the upstream's answer, whose head is `status` and
    /// `headers`. An answer that does not consume the key (a status the
    /// route does not store, or a redirect to no `success_redirects`
    /// target: see [`RoutePolicy::consumes`]) releases the key here, so a
    /// corrected request can go through; the recorder then records nothing
    /// ([`Recorder::is_recording`] is `false`). The headers that are never
    /// stored (see [`headers::stored`]) are dropped here.
    pub async fn record(mut self, status: StatusCode, headers: &HeaderMap) -> Recorder {
        let settings = self.policy.policy();
        let unknown = RequestTarget {
            host: "",
            path: "/",
            query: None,
            mount: "",
        };
        let target = self.target.as_ref().map_or(unknown, Target::read);
        if status.is_informational() {
            // A 1xx as the final answer (a 101 protocol switch): the
            // request ran, and no replay could give it again. Kept as
            // "executed, response not stored": released, as any status not
            // stored is, the retry ran it a second time.
            self.store(Outcome::TooLarge { status }).await;
            return Recorder::settled(status);
        }
        if !self.policy.consumes(status, headers, &target) {
            self.release_as(status).await;
            return Recorder::settled(status);
        }
        self.executed = Some(status);
        let kept = headers::stored(headers, settings.replay_set_cookie);
        // A body under a transfer coding other than chunked (`gzip`) is
        // relayed coded, and a replay could not say how: it is not stored
        // (the marker "executed, response not stored" once a byte comes).
        let coded =
            headers::lists_coding_other_than(headers, &http::header::TRANSFER_ENCODING, b"chunked");
        let limit = if coded {
            0
        } else {
            settings.max_response_bytes
        };
        Recorder::new(self, status, kept, limit, headers::content_length(headers))
    }

    /// Releases the key without storing anything (upstream transport
    /// failure, abandoned request): the next request with it executes.
    pub async fn release(self) {
        self.release_as(StatusCode::BAD_GATEWAY).await;
    }

    /// Releases the key after the upstream failed before the whole request
    /// reached it ([`release`](Reservation::release)), and returns the
    /// caller's answer: 504 when it `timed_out`, else 502.
    pub(super) async fn release_upstream_failed(
        self,
        timed_out: bool,
        request: &http::HeaderMap,
    ) -> http::Response<bytes::Bytes> {
        let answer = self.engine.upstream_failed(timed_out, request);
        self.release_as(answer.status()).await;
        answer
    }

    /// Stores `outcome` (replayed from now on). Never fails and never holds
    /// the caller up for long: when storing fails, it is retried in the
    /// background (the renewer still renewing the lease) for up to the
    /// route's lease, so an outage that ends before the lease last renewed
    /// runs out never leads to a second execution; after that it is logged
    /// and the key can be taken over. In the lease's last quarter, an attempt that fails is
    /// followed by one storing the small marker "executed, response not
    /// stored": a response the store keeps refusing (too large for it,
    /// say) while it renews the lease still keeps the key from running the
    /// request again.
    pub(super) async fn store(mut self, outcome: Outcome) {
        let status = outcome.status().unwrap_or(StatusCode::OK);
        // Whatever is being stored (an answer, "outcome unknown"), the key
        // is not to be freed any more: a drop from here on stores a marker.
        self.executed.get_or_insert(status);
        // Only a full response falls back to a marker (a marker is small
        // already).
        let may_fall_back = matches!(outcome, Outcome::Stored(_));
        // Its outcome is on its way: a drain's "outcome unknown" must not
        // race it (sealing a large body takes a while).
        self.lease.settling(status);
        // Sealed once: a retry below stores the very same bytes.
        let outcome = self.engine.seal(&self.key, outcome);
        match self.complete(&outcome).await {
            Ok(done) => self.completed(status, Ok(done)),
            Err(_) => {
                // Giving up would leave the key in flight, and the first retry
                // after the lease would execute the request a second time. So
                // keep trying in the background — with the heartbeat still
                // renewing the lease — for as long as the lease may be ours,
                // and let the caller have its response now. The owner check
                // makes a late success harmless. A graceful shutdown waits
                // for it (`Engine::drain`).
                let task = self.engine.background_task(self.key, "storing an outcome");
                tokio::spawn(async move {
                    let _task = task;
                    let lease = self.policy.policy().lease;
                    let deadline = Instant::now() + lease;
                    let marker_from = Instant::now() + (lease - lease / 4);
                    let marker = may_fall_back
                        .then(|| self.engine.seal(&self.key, Outcome::TooLarge { status }));
                    let mut attempt = 0;
                    let result = loop {
                        let now = Instant::now();
                        if now >= deadline {
                            break Err(StoreError::Timeout);
                        }
                        tokio::time::sleep(crate::store::backoff(attempt).min(deadline - now))
                            .await;
                        attempt += 1;
                        let result = match (self.complete(&outcome).await, &marker) {
                            (Err(_), Some(marker)) if Instant::now() >= marker_from => {
                                self.complete(marker).await
                            }
                            (result, _) => result,
                        };
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
                tracing::info!(outcome = "executed", status = status.as_u16(), duration_us, key = %Short::of(&self.key), "idempotency");
            }
            // The dropped reservation's own write got there first.
            Ok(false) if self.heir => {
                tracing::debug!(key = %Short::of(&self.key), "idempotency outcome already stored");
            }
            Ok(false) => {
                tracing::warn!(status = status.as_u16(), key = %Short::of(&self.key), "idempotency record no longer ours: its lease was taken over, or an earlier attempt that timed out stored it");
            }
            Err(error) => {
                engine.inner.metrics.record(Event::StoreError);
                tracing::error!(%error, status = status.as_u16(), key = %Short::of(&self.key), "idempotency response could not be stored; the key frees when its lease expires");
            }
        }
    }

    /// Releases the key now; `status` is the upstream's (for the log).
    async fn release_as(mut self, status: StatusCode) {
        self.stop_renewing();
        let engine = self.engine.clone();
        let result = engine
            .store_call(engine.inner.store.release(&self.key, &self.owner))
            .await;
        self.settled = true;
        engine.inner.metrics.record(Event::Released);
        match result {
            Ok(_) => {
                tracing::info!(outcome = "released", status = status.as_u16(), duration_us = self.started.elapsed().as_micros() as u64, key = %Short::of(&self.key), "idempotency")
            }
            Err(error) => {
                // The key would stay in flight for the rest of its lease,
                // and a corrected request be refused as a duplicate: tried
                // again in the background (owner-checked, so never anyone
                // else's record), at once and after `store_timeout`.
                tracing::warn!(%error, key = %Short::of(&self.key), "idempotency release failed; retried in the background, else the key frees when its lease expires");
                engine.release_lost(self.key, self.owner, false);
            }
        }
    }
}

/// The detail of the outcome a detached execution that panicked keeps.
const DETACHED_PANIC: &str = "The request failed after its caller went away; it may or may not \
                              have taken effect, and it will not be executed again with this key.";

/// [`Reservation::scope_id`] of the reservation holding `key`.
pub(crate) fn execution_scope_id(key: &ScopeKey) -> String {
    use sha2::{Digest, Sha256};
    let mut id = Sha256::new();
    id.update(b"tower-idempotency execution scope\0");
    id.update(key.as_bytes());
    hex::encode(id.finalize())
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.settled {
            self.stop_renewing();
            self.engine.left_flight();
            return;
        }
        let outcome = match self.executed {
            Some(status) => Some(Outcome::Incomplete { status }),
            // An execution whose caller went away, panicking once its
            // request reached the handler: the handler may have acted, and
            // the panic may come from the detachment itself (a task-local
            // an outer layer set for its caller is gone), where its caller,
            // had it waited, would have had a response. Kept as "executed,
            // outcome unknown": a retry never runs it a second time.
            None if std::thread::panicking()
                && super::detached::running_detached()
                && self.lease.acted() =>
            {
                tracing::warn!(key = %Short::of(&self.key), "idempotency execution panicked after its caller went away; outcome unknown, kept so that no retry executes again");
                Some(super::execution::unknown(
                    crate::problem::ProblemKind::UpstreamUnavailable,
                    DETACHED_PANIC,
                ))
            }
            None => None,
        };
        if let Some(outcome) = outcome {
            let status = outcome.status().unwrap_or(StatusCode::OK);
            let handle = match tokio::runtime::Handle::try_current() {
                Ok(handle) if !self.heir => handle,
                // An heir dropped unsettled (its runtime is shutting
                // down), or no runtime: nothing can store the marker, and
                // the key is never freed for a second run: it stays in
                // flight until its lease ends.
                _ => {
                    self.stop_renewing();
                    self.engine.left_flight();
                    return;
                }
            };
            // An heir takes the key over, still renewed (at once: the last
            // renewal may be a third of the lease old), and stores the
            // marker; it counts as in flight in this one's place.
            let lease = self.policy.policy().lease;
            let now = Instant::now();
            let renewed = now.checked_sub(lease / 3).unwrap_or(now);
            let heir = Reservation {
                engine: self.engine.clone(),
                policy: self.policy.clone(),
                key: self.key,
                owner: self.owner,
                lease: (self.engine.inner.leases).hold(
                    &self.engine.inner,
                    self.key,
                    self.owner,
                    (lease, self.policy.policy().ttl),
                    renewed,
                ),
                started: self.started,
                settled: false,
                executed: Some(status),
                heir: true,
                target: None,
            };
            // Seen by a drain from here on, before its task first runs: it
            // stands for an execution that reached its upstream.
            heir.lease.settling(status);
            // Only now is this one's lease forgotten: at every instant a
            // drain finds the key in its lists, under this lease or the
            // heir's (marking it twice is harmless: the second is refused).
            self.stop_renewing();
            handle.spawn(heir.store(outcome));
            return;
        }
        self.stop_renewing();
        // Abandoned (panic or cancellation): free the key in the background.
        let engine = self.engine.clone();
        let (key, owner) = (self.key, self.owner);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let task = engine.background_task(key, "releasing an abandoned key");
            handle.spawn(async move {
                let _task = task;
                engine.inner.metrics.record(Event::Released);
                let _ = engine
                    .store_call(engine.inner.store.release(&key, &owner))
                    .await;
                tracing::info!(outcome = "released", key = %Short::of(&key), "idempotency reservation abandoned");
            });
        }
        // Only now, the release already pending: `Engine::drain` never sees
        // the key as neither held nor pending.
        self.engine.left_flight();
    }
}
