//! The decision for a covered request: read and check its key, fingerprint
//! it, then reserve the key, replay, wait for the first request, or refuse.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tokio::time::Instant;
use tracing::Instrument;

use super::principal::PrincipalRead;
use super::responses::{log_decision, replay_for, Answered};
use super::scope::{principal_hash, scope_key, Short};
use super::{Covered, Engine, RequestHead, Reservation};
use crate::fingerprint::{fingerprint_view, Exclusions};
use crate::formats::{self, View};
use crate::key;
use crate::metrics::Event;
use crate::policy::{FailMode, InFlightPolicy, KeySource, MismatchPolicy, RoutePolicy};
use crate::problem::{Problem, ProblemKind};
use crate::store::{
    Claim, Fingerprint, Outcome, OwnerToken, PrincipalHash, Record, RecordState, ScopeKey,
    StoreError,
};

/// The engine's answer to [`Engine::begin`].
#[derive(Debug)]
#[must_use = "a decision must be obeyed"]
pub enum Decision {
    /// Forward the request as it is; nothing was reserved (no key on an
    /// optional route, or the store failed on a fail-open route).
    Forward,
    /// This request owns the key: call the upstream, then record its answer
    /// ([`Reservation::record`]) or [`Reservation::release`] the key.
    Proceed(Reservation),
    /// Answer with this response and do not call the upstream: a replay
    /// (with `Idempotent-Replayed: true`) or a problem.
    Respond(Response<Bytes>),
}

/// What [`Engine::read_key`] found.
enum KeyRead {
    /// A valid key.
    Found(Vec<u8>),
    /// No key, and the route does not require one: forward unprotected.
    Absent,
    /// The answer for a missing or malformed key.
    Refused(Response<Bytes>),
}

/// What [`Engine::claim`] found: the key is ours now, or its record.
enum Claimed {
    /// Reserved under `owner` (taking an expired lease over: `takeover`)
    /// by a call sent at `sent`: the lease runs from no earlier than that.
    Acquired {
        owner: OwnerToken,
        takeover: bool,
        sent: Instant,
    },
    /// Another request's record.
    Existing(Record),
}

/// Where a duplicate stands while the first request holds the key.
struct Waiting {
    /// The latest it waits until (the route's `wait_timeout`).
    deadline: Instant,
    /// Whether it has waited at least once.
    waited: bool,
    /// How many waits so far (the store's back-off step).
    attempt: u32,
}

impl Engine {
    /// Decides what to do with a covered request whose whole body is
    /// `body` (at most [`Covered::max_body_bytes`]).
    ///
    /// Every answer decided here (replay, refusal, store failure) is logged
    /// as one line with its outcome, the status sent, the duration since
    /// the request arrived ([`Covered::arrived`]) and, once the key was
    /// read, the scope hash's first 8 hex digits. A reservation is logged
    /// when it ends ([`Reservation`]).
    pub async fn begin(&self, covered: &Covered, head: RequestHead<'_>, body: &[u8]) -> Decision {
        self.begin_within(covered, head, body, None).await
    }

    /// [`Engine::begin`] for a request already executing under `held`, a
    /// key an outer front end reserved under its owner token with its
    /// lease (the layer nested in another): a request whose own scope is
    /// that key, and whose store holds it for that owner (an owner-checked
    /// renewal, with that lease, says so: the same records), is forwarded
    /// as that execution, unreserved, where it
    /// would otherwise wait for itself until `wait_timeout` and get 409.
    /// Any other request is decided as usual.
    pub(crate) async fn begin_within(
        &self,
        covered: &Covered,
        head: RequestHead<'_>,
        body: &[u8],
        held: Option<(&ScopeKey, &OwnerToken, Duration)>,
    ) -> Decision {
        let mut key = None;
        let decision = self.begin_inner(covered, head, body, held, &mut key).await;
        match decision {
            Decision::Respond(mut response) => {
                if let Some(Answered(outcome)) = response.extensions_mut().remove::<Answered>() {
                    log_decision(outcome, response.status(), covered.arrived(), key.as_ref());
                }
                Decision::Respond(response)
            }
            other => other,
        }
    }

    async fn begin_inner(
        &self,
        covered: &Covered,
        head: RequestHead<'_>,
        body: &[u8],
        held: Option<(&ScopeKey, &OwnerToken, Duration)>,
        scope: &mut Option<ScopeKey>,
    ) -> Decision {
        let started = Instant::now();
        let length = body.len();
        // Parsed once, read by the key and the fingerprint.
        let body = View::parse(formats::content_type(head.headers), body);
        // A POST covered as the method it names is scoped and
        // fingerprinted as that method.
        let Some(dispatched) = self.dispatched(covered.policy(), &head, &body) else {
            self.inner.metrics.record(Event::Passthrough);
            return Decision::Forward;
        };
        let (method, policy) = (dispatched.method, dispatched.policy);
        let head = RequestHead {
            method: method.as_ref().unwrap_or(head.method),
            ..head
        };
        let raw_key = match self.read_key(policy, &head, &body) {
            KeyRead::Found(key) => key,
            KeyRead::Absent => {
                self.inner.metrics.record(Event::Passthrough);
                return Decision::Forward;
            }
            KeyRead::Refused(response) => return Decision::Respond(response),
        };
        // The body was read under the first candidate route's limit; each
        // route a backend may dispatch it to (a POST naming `PATCH`) keeps
        // its own.
        if length > dispatched.max_body_bytes {
            let limit = dispatched.max_body_bytes;
            return Decision::Respond(self.over_limit(limit, head.headers));
        }
        // Checked before anything is reserved: a credential that fails
        // never picks a scope.
        let principal = match self.resolve_principal(policy, &head) {
            PrincipalRead::Scope(principal) => principal,
            PrincipalRead::Refused(refused) => return Decision::Respond(refused),
        };
        // The layer's `Principal` extension stands for every route.
        let given = head.principal.is_some();
        let head = RequestHead {
            principal: principal.as_deref().or(head.principal),
            ..head
        };
        let also = self.also_reached(
            policy,
            &head,
            (&dispatched.candidates, &dispatched.readings),
        );
        let key = scope_key(&self.inner.hasher, policy, &head, &raw_key, (&also, given));
        // Renewed with the outer route's lease (an early heartbeat of its
        // own): this route's, if shorter, would cut the outer's lease short,
        // and a retry take the key over from the running execution.
        if let Some((_, owner, lease)) = held.filter(|(held, _, _)| **held == key) {
            let renewal = self.inner.store.renew(&key, owner, lease);
            match self.store_call(renewal).await {
                Ok(true) => {
                    self.inner.metrics.record(Event::Passthrough);
                    return Decision::Forward;
                }
                // Not this store's, or no longer the outer's: decided as usual.
                Ok(false) => {}
                // Unknown: deciding would meet the outer's own key in flight
                // and wait for itself; 503 on every route, nothing run.
                Err(error) => return self.store_failed(policy, &head, &error, true),
            }
        }
        *scope = Some(key);
        let fingerprint = fingerprint_view(
            head.method,
            head.uri,
            head.headers,
            &policy.fingerprint_headers,
            &body,
            Exclusions {
                json: &policy.json_exclude,
                form: &policy.form_exclude,
            },
        );
        let fingerprint = match policy.policy().fingerprint_version.as_str() {
            "" => fingerprint,
            version => fingerprint.versioned(version),
        };
        // At `debug`: the decision's own line (logged by `begin`) carries
        // the key, and a span built for every request at `info` costs a
        // replay a tenth of its throughput; its context is for the debug
        // lines. The two lines inside that can fail say so themselves.
        let span =
            tracing::debug_span!("idempotency", key = %Short::of(&key), path = head.uri.path());
        match span.is_disabled() {
            true => self.decide(policy, &head, key, fingerprint, started).await,
            false => {
                self.decide(policy, &head, key, fingerprint, started)
                    .instrument(span)
                    .await
            }
        }
    }

    /// The request's valid key, its absence on a route that does not
    /// require one, or the 400 to answer.
    fn read_key(&self, policy: &RoutePolicy, head: &RequestHead<'_>, body: &View<'_>) -> KeyRead {
        let settings = policy.policy();
        let in_body = matches!(
            settings.key,
            KeySource::FormField(_) | KeySource::JsonPointer(_)
        );
        let encoded = super::headers::lists_coding_other_than(
            head.headers,
            &http::header::CONTENT_ENCODING,
            b"identity",
        );
        if in_body && encoded {
            return KeyRead::Refused(
                Problem::new(
                    ProblemKind::ContentEncodingUnsupported,
                    "This route reads its idempotency key from the request body; send the \
                     body without Content-Encoding.",
                )
                .into_response_for(head.headers),
            );
        }
        let found =
            key::extract_from(&settings.key, head.uri, head.headers, body).and_then(|key| {
                if let Some(key) = &key {
                    key::validate(key, settings.uuid_only)?;
                }
                Ok(key)
            });
        match found {
            Ok(Some(key)) => KeyRead::Found(key),
            Ok(None) if !settings.required => KeyRead::Absent,
            Ok(None) => KeyRead::Refused(self.key_missing(&settings.key, head.headers)),
            Err(error) => KeyRead::Refused(self.invalid_key(error, head.headers)),
        }
    }

    /// Reserves the key, or answers from its record: replay, refuse, or
    /// wait for the request that holds it and look again.
    async fn decide(
        &self,
        policy: &Arc<RoutePolicy>,
        head: &RequestHead<'_>,
        key: ScopeKey,
        fingerprint: Fingerprint,
        started: Instant,
    ) -> Decision {
        let mut waiting = Waiting {
            deadline: started + policy.policy().wait_timeout,
            waited: false,
            attempt: 0,
        };
        loop {
            let claimed = self.claim(policy, head, &key, &fingerprint, waiting.waited);
            let record = match claimed.await {
                Err(error) => return self.store_failed(policy, head, &error, waiting.waited),
                Ok(Claimed::Acquired {
                    owner,
                    takeover,
                    sent,
                }) => {
                    // A caller that goes away while this is confirmed
                    // leaves nothing held (no `Reservation` exists yet).
                    let mut unconfirmed = Unconfirmed {
                        engine: self,
                        key,
                        owner,
                        armed: true,
                    };
                    let held = self.still_held(policy, head, &key, &owner, sent).await;
                    unconfirmed.armed = false;
                    let sent = match held {
                        Ok(Some(since)) => since,
                        // Taken over while the answer was on its way: look
                        // again, as a duplicate of the request holding it.
                        Ok(None) => {
                            waiting.waited = true;
                            continue;
                        }
                        Err(refused) => return refused,
                    };
                    self.inner.metrics.record(Event::Executed);
                    tracing::debug!(takeover, "idempotency key reserved");
                    return Decision::Proceed(Reservation::new(
                        self.clone(),
                        policy.clone(),
                        key,
                        owner,
                        sent,
                        head,
                    ));
                }
                Ok(Claimed::Existing(record)) => record,
            };
            // A form route may answer a changed request under a consumed
            // key with the key's own outcome (`mismatch = "replay"`).
            if record.fingerprint != fingerprint
                && policy.policy().mismatch == MismatchPolicy::Reject
            {
                return Decision::Respond(self.mismatch(policy, head.headers));
            }
            match record.state {
                RecordState::Completed(outcome) => {
                    let outcome = match self.open_outcome(&key, outcome) {
                        Ok(outcome) => outcome,
                        Err(error) => return self.unreadable(head, &error),
                    };
                    return Decision::Respond(self.completed(
                        policy,
                        outcome,
                        waiting.waited,
                        head.headers,
                    ));
                }
                RecordState::InFlight { lease_remaining } => {
                    if let Err(decision) = self
                        .wait(policy, head, &key, lease_remaining, &mut waiting)
                        .await
                    {
                        return decision;
                    }
                }
            }
        }
    }

    /// Whether the reservation `owner` acquired by a call sent at `sent` is
    /// still held, and since when its lease runs. The store started its
    /// lease when it ran the call; an answer that took half the lease or
    /// more to arrive (a slow commit, a stalled connection) may come after
    /// the lease ran out and another request took the key over, so it is
    /// confirmed by an owner-checked renewal first, and that renewal's own
    /// answer is judged the same way (at most three times): `None` when the
    /// key is someone else's now, the 503 when the store cannot say or
    /// keeps answering too late for the lease (released in the background,
    /// since it may be ours still).
    async fn still_held(
        &self,
        policy: &RoutePolicy,
        head: &RequestHead<'_>,
        key: &ScopeKey,
        owner: &OwnerToken,
        sent: Instant,
    ) -> Result<Option<Instant>, Decision> {
        let lease = policy.policy().lease;
        let mut since = sent;
        for _ in 0..3 {
            if since.elapsed() < lease / 2 {
                return Ok(Some(since));
            }
            tracing::debug!("idempotency reservation answered late; confirming it");
            let renewing = Instant::now();
            match self
                .store_call(self.inner.store.renew(key, owner, lease))
                .await
            {
                Ok(true) => since = renewing,
                Ok(false) => return Ok(None),
                Err(error) => {
                    self.release_lost(*key, *owner, false);
                    return Err(self.store_failed(policy, head, &error, true));
                }
            }
        }
        if since.elapsed() < lease / 2 {
            return Ok(Some(since));
        }
        self.release_lost(*key, *owner, false);
        Err(self.store_failed(policy, head, &StoreError::Timeout, true))
    }

    /// Releases, owner-checked and in the background, a reservation whose
    /// answer was lost (or whose release failed): at once and, since a call that failed may still
    /// commit (a reset connection whose statement ran on at the server),
    /// again after `store_timeout`; or, when the call was `abandoned` still
    /// running, once at once (the [`Unanswered`] guard releases again when
    /// it ends). Each release is bounded by `store_timeout` and never
    /// touches anyone else's record; a graceful shutdown waits for each
    /// release under way ([`Engine::drain`]), not for the wait before the
    /// second (a process that exits then leaves the orphan to its lease).
    pub(super) fn release_lost(&self, key: ScopeKey, owner: OwnerToken, abandoned: bool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let engine = self.clone();
        let limit = self.inner.config.store_timeout;
        let task = self.background_task(key, "releasing a lost reservation");
        runtime.spawn(async move {
            let store = &engine.inner.store;
            let _ = tokio::time::timeout(limit, store.release(&key, &owner)).await;
            drop(task);
            if !abandoned {
                // Not waited for by a graceful shutdown while it sleeps:
                // the lease bounds an orphan the process leaves.
                tokio::time::sleep(limit).await;
                let _task = engine.background_task(key, "releasing a lost reservation");
                let _ = tokio::time::timeout(limit, store.release(&key, &owner)).await;
            }
        });
    }

    /// Tries to reserve the key. After a wait, only reads: a waiter tries
    /// the reservation again only when the record is gone or its lease ran
    /// out, so waiters never compete with the owner's renewals for the
    /// store with writes.
    async fn claim(
        &self,
        policy: &RoutePolicy,
        head: &RequestHead<'_>,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        waited: bool,
    ) -> Result<Claimed, StoreError> {
        if waited {
            let live = self
                .store_call(self.inner.store.get(key))
                .await?
                .filter(|record: &Record| !record.lease_expired());
            if let Some(record) = live {
                return Ok(Claimed::Existing(record));
            }
        }
        let settings = policy.policy();
        let principal = head
            .principal
            .map(|principal| principal_hash(&self.inner.hasher, principal));
        // The store starts the lease when it runs the call, which may be
        // well before its answer arrives: renewals are timed from here.
        let sent = Instant::now();
        let (owner, claim) = self
            .reserve(*key, *fingerprint, principal, settings.lease, settings.ttl)
            .await?;
        Ok(match claim {
            Claim::Acquired { takeover } => Claimed::Acquired {
                owner,
                takeover,
                sent,
            },
            Claim::Existing(record) => Claimed::Existing(record),
        })
    }

    /// Reserves `key` for an owner token drawn here, bounded by
    /// `store_timeout` like every store call. A store with an
    /// [`Admin`](crate::store::Admin) side keeps the `principal`'s hash
    /// with the record.
    ///
    /// A reservation whose answer is lost (the call failed, or outlived
    /// `store_timeout`) may have been written all the same. The engine
    /// knows its token, so it releases it in the background, independently
    /// of what the request does next (503, or forwarding on a fail-open
    /// route): once at once, and again — after `store_timeout` when the
    /// call failed (a statement may still commit at the server after its
    /// connection broke), or, when the call was abandoned still running,
    /// after that call ends (waited for at most the lease).
    /// Each release is bounded by `store_timeout` and owner-checked, so it
    /// never touches anyone else's record. A retry therefore finds the key
    /// free instead of in flight for a whole lease.
    async fn reserve(
        &self,
        key: ScopeKey,
        fingerprint: Fingerprint,
        principal: Option<PrincipalHash>,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(OwnerToken, Claim), StoreError> {
        let owner = OwnerToken::random();
        let store = self.inner.store.clone();
        let limit = self.inner.config.store_timeout;
        let call: PendingCall = Box::pin(async move {
            match store.admin() {
                Some(admin) => {
                    let principal = principal.as_ref();
                    admin
                        .reserve_for(&key, &fingerprint, &owner, lease, ttl, principal)
                        .await
                }
                None => store.reserve(&key, &fingerprint, &owner, lease, ttl).await,
            }
        });
        // Until the call is answered, dropping this future (the caller went
        // away) hands the call to the guard, which releases what it wrote.
        let mut pending = Unanswered {
            engine: self.clone(),
            key,
            owner,
            lease,
            limit,
            call: Some(call),
        };
        let started = std::time::Instant::now();
        let call = pending.call.as_mut().expect("set above");
        let (result, abandoned) = match super::within(limit, call.as_mut()).await {
            Some(result) => (result, false),
            None => (Err(StoreError::Timeout), true),
        };
        self.inner.metrics.observe_store(started.elapsed());
        let error = match result {
            Ok(claim) => {
                pending.call = None;
                return Ok((owner, claim));
            }
            Err(error) => error,
        };
        // Released at once, and again later: after `store_timeout` for a
        // call that failed, when it ends for an abandoned one.
        self.release_lost(key, owner, abandoned);
        if !abandoned {
            pending.call = None;
        }
        Err(error)
    }

    /// The answer for a key whose request completed: its stored response
    /// replayed, or the "not stored" or "incomplete" problem.
    fn completed(
        &self,
        policy: &RoutePolicy,
        outcome: Outcome,
        waited: bool,
        request: &http::HeaderMap,
    ) -> Response<Bytes> {
        match outcome {
            Outcome::Stored(response) => {
                let event = if waited {
                    Event::Waited
                } else {
                    Event::Replayed
                };
                self.inner.metrics.record(event);
                let mut response = replay_for(response, request);
                response.extensions_mut().insert(Answered(event.as_str()));
                response
            }
            Outcome::TooLarge { status } => self.not_stored(policy, status, request),
            Outcome::Incomplete { status } => self.incomplete(policy, status, request),
            // Opened before it gets here (`Engine::open_outcome`).
            Outcome::Sealed(_) => self.store_unavailable(request),
        }
    }

    /// Waits while another request holds the key, at most until the
    /// deadline and at the latest until its lease could be taken over;
    /// `Err` is the answer instead (409 on a rejecting route or after the
    /// deadline, or the store failure).
    async fn wait(
        &self,
        policy: &RoutePolicy,
        head: &RequestHead<'_>,
        key: &ScopeKey,
        lease_remaining: Duration,
        waiting: &mut Waiting,
    ) -> Result<(), Decision> {
        let settings = policy.policy();
        let now = Instant::now();
        if settings.in_flight == InFlightPolicy::Reject || now >= waiting.deadline {
            // A rejecting route answers at once: the first request may end
            // any moment, so a second later is worth a try. A waiter that
            // waited out `wait_timeout` is told when the lease ends at the
            // latest.
            let retry = if settings.in_flight == InFlightPolicy::Reject {
                1
            } else {
                lease_remaining.min(settings.wait_timeout).as_secs() + 1
            };
            return Err(Decision::Respond(self.in_flight(
                policy,
                retry,
                head.headers,
            )));
        }
        waiting.waited = true;
        // Wake at the latest when the lease could be taken over, but not
        // sooner than a backoff step: a lease that ran out under a record
        // this request cannot take over (another fingerprint, waiting under
        // `mismatch = "replay"`) would otherwise be polled every millisecond.
        let max = (waiting.deadline - now).min(
            (lease_remaining + Duration::from_millis(1))
                .max(crate::store::backoff(waiting.attempt)),
        );
        if let Err(error) = self.inner.store.wait(key, max, waiting.attempt).await {
            return Err(self.store_failed(policy, head, &error, true));
        }
        waiting.attempt += 1;
        Ok(())
    }

    /// A record that cannot be opened (its key is not configured, it fails
    /// authentication, or it cannot be decoded): 503 whatever the route's fail mode,
    /// because the record proves the request ran and forwarding would run
    /// it again.
    fn unreadable(&self, head: &RequestHead<'_>, error: &StoreError) -> Decision {
        self.inner.metrics.record(Event::StoreError);
        tracing::error!(%error, path = head.uri.path(), "idempotency record cannot be opened; answering 503");
        Decision::Respond(self.store_unavailable(head.headers))
    }

    /// The store failed: forward unprotected (fail-open) or 503. A record
    /// the store found but could not decode ([`StoreError::Corrupt`]) is
    /// answered like one that cannot be opened: it proves the key was
    /// used, so forwarding could run the request again. So is a failure
    /// after this request `saw_held` its key in flight under another
    /// request (a waiter's look or wait failing): forwarding would run it
    /// beside the holder, which may be running still, and every waiter
    /// meeting one failed poll would run once more. A full store
    /// ([`StoreError::Full`]) is 503 on every route too: it is no outage
    /// that ends soon, but full until records expire, so each retry of a
    /// forwarded request would find it full again and run once more.
    fn store_failed(
        &self,
        policy: &RoutePolicy,
        head: &RequestHead<'_>,
        error: &StoreError,
        saw_held: bool,
    ) -> Decision {
        if matches!(error, StoreError::Corrupt(_) | StoreError::Unreadable(_)) {
            return self.unreadable(head, error);
        }
        self.inner.metrics.record(Event::StoreError);
        tracing::warn!(%error, path = head.uri.path(), "idempotency store failed");
        let full = matches!(error, StoreError::Full(_));
        match policy.policy().fail_mode {
            FailMode::Open if !saw_held && !full => Decision::Forward,
            _ => Decision::Respond(self.store_unavailable(head.headers)),
        }
    }
}

/// A reservation acquired but not yet confirmed ([`Engine::still_held`]):
/// dropped armed (the caller went away meanwhile), it is released as a
/// lost one.
struct Unconfirmed<'a> {
    engine: &'a Engine,
    key: ScopeKey,
    owner: OwnerToken,
    armed: bool,
}

impl Drop for Unconfirmed<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.engine.release_lost(self.key, self.owner, false);
        }
    }
}

/// A store's reserve call in progress.
type PendingCall = Pin<Box<dyn Future<Output = Result<Claim, StoreError>> + Send>>;

/// A reserve call whose answer nobody will act on: the caller went away
/// while it was pending, or it outlived `store_timeout`. The store may have
/// written it all the same, under a token only this guard knows; on drop,
/// it lets the call end (waiting at most the lease, after which the record
/// could be taken over anyway) and then releases, owner-checked, so the key
/// is free for the retry instead of in flight for a whole lease, and no one
/// else's record is touched.
struct Unanswered {
    engine: Engine,
    key: ScopeKey,
    owner: OwnerToken,
    lease: Duration,
    limit: Duration,
    /// `None` once the call was answered and its answer is acted on.
    call: Option<PendingCall>,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, key, owner) = (self.engine.inner.store.clone(), self.key, self.owner);
        let (lease, limit) = (self.lease, self.limit);
        let task = self
            .engine
            .background_task(key, "releasing a reservation without a caller");
        runtime.spawn(async move {
            let _task = task;
            let _ = tokio::time::timeout(lease, call).await;
            let _ = tokio::time::timeout(limit, store.release(&key, &owner)).await;
            tracing::debug!(key = %key.short(), "idempotency reservation without a caller released");
        });
    }
}
