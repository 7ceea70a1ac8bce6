//! The store side of the history checker:
//!
//! * [`Mutant`] is the store under test: a real store (memory, SQLite,
//!   PostgreSQL) plus, when asked, one deliberate store bug ([`Mutation`]).
//!   It logs every call it answers — what was asked, what it answered, and
//!   when by both clocks — so the checker can see the store's side of the
//!   history.
//! * [`Faulty`] is one engine instance's connection to it: runtime-switchable
//!   faults (an error, a stall past `store_timeout`, a commit whose answer is
//!   lost, a commit that lands late, an error whose statement commits after
//!   it, an answer that arrives just under `store_timeout`), and a "dead"
//!   switch for a crashed instance (every later call hangs, nothing more
//!   reaches the store).
//!
//! [`Faulty`] is not the library's `FaultyStore` (`test-util`), although
//! that one models an error (`Fault::Down`), a stall (`Fault::Stall`) and a
//! lost answer (`Fault::CommitThenFail`, `Fault::CommitThenStall`): two of
//! the faults here have no counterpart there. A late commit needs the
//! write to reach the store *after* the engine gave up on the call, even
//! when the engine drops it (a `FaultyStore` stall reaches the store only
//! while its caller still polls it, as the engine does only for a reserve),
//! and a crashed instance needs every call of that instance, including one
//! under way or stalled, never to answer and never to reach the store
//! again. Both are what the guarantee must survive, so the checker keeps
//! its own switches rather than model fewer faults.
//!
//! A real SQL store's calls run on a runtime of their own inside
//! `spawn_blocking`: while one is running, the schedule's paused clock does
//! not auto-advance, so a database round trip costs no virtual time and never
//! fires a `store_timeout` by itself.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use tokio::sync::Notify;
use tower_idempotency::store::{
    Claim, Fingerprint, Outcome, OwnerToken, Record, RecordState, ScopeKey,
};
use tower_idempotency::{Store, StoreError};

tokio::task_local! {
    /// The id of the client request whose task makes a store call.
    pub static REQUEST: usize;
}

fn current_request() -> Option<usize> {
    REQUEST.try_with(|r| *r).ok()
}

/// A moment by both clocks, each since the schedule started: the virtual
/// clock (the memory store's) and the real one (the SQL stores').
#[derive(Clone, Copy, Debug)]
pub struct Stamp {
    pub virt: Duration,
    pub real: Duration,
    /// Global order of call starts and ends.
    pub seq: u64,
}

/// The deliberate store bugs (test-only switch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// A reservation that meets a live lease with the same fingerprint
    /// evicts its owner and takes over anyway.
    TakeoverIgnoresLease,
    /// A completion by an owner that lost the key overwrites the current
    /// owner's record.
    UnfencedCompletion,
    /// A release does not wake the requests waiting on the key.
    ReleaseForgetsWaiters,
    /// The engine's scope leaves out the principal (modelled in the harness:
    /// the principal never reaches the engine).
    ScopeWithoutPrincipal,
    /// The engine's scope leaves out the host (modelled in the harness:
    /// `Policy::scope_authority` off), so two tenants share a key space.
    ScopeWithoutHost,
    /// A lookup answers with another key's completed record.
    ReplayOtherRecord,
    /// A wait ignores its `max` and returns only when the key is released
    /// or completed.
    WaitIgnoresMax,
    /// A release by an owner whose reservation the engine never saw
    /// acquired (its answer was lost) changes nothing: the reservation a
    /// refused request committed cannot be released (hole 6 as it was).
    OrphanUnreleasable,
    /// The heartbeat gives up after a renewal fails: every later renewal
    /// of that owner answers "renewed" without reaching the store
    /// (modelled in the instance's wrapper), so its lease runs out under a
    /// live request although the fault was brief.
    HeartbeatGivesUp,
    /// The stored response keeps one value per header name (the last), as
    /// a store that kept headers in a map would.
    HeadersAsMap,
    /// The stored response gains the upstream's cookie back (a store, or
    /// an engine, that keeps `Set-Cookie` although the route does not
    /// replay it).
    CookieKept,
    /// The stored response loses its `Location` (a redirect replayed
    /// without its target).
    LocationDropped,
    /// Every fifth reservation fails as if the store were down, with no
    /// fault switched on: the engine's 503s are no longer earned.
    SpuriousUnavailable,
    /// A reservation of a key its holder released answers, once, that the
    /// key is still in flight (a store that kept a stale row).
    ReleasedKeyInFlight,
    /// A completion stores the marker "executed, response not stored" in
    /// place of a whole response, with no fault in the way (an engine that
    /// gave up on storing too soon, or took a small answer for a large one).
    StoredAsMarker,
    /// The first caller's own `201` reaches it as `200` (modelled in the
    /// harness, past the layer: an engine that relayed the status it
    /// stored in another form, or a default in place of the upstream's).
    FirstAnswerAs200,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Reserve,
    Get,
    Complete,
    Release,
    Renew,
    Wait,
}

/// What the store answered.
#[derive(Clone, Debug)]
pub enum Answer {
    Acquired(OwnerToken),
    Existing,
    Done(bool),
    Found,
    Missing,
    Waited,
    Failed,
}

/// One store call as the store under test answered it.
#[derive(Clone, Debug)]
pub struct StoreEvent {
    pub op: Op,
    pub key: ScopeKey,
    pub request: Option<usize>,
    pub owner: Option<OwnerToken>,
    pub instance: usize,
    pub start: Stamp,
    pub end: Stamp,
    pub answer: Answer,
    /// The body a completion stored.
    pub body: Option<Bytes>,
}

/// Where the real store runs.
#[derive(Clone)]
pub enum Backend {
    /// Called in place (the memory store, on the virtual clock).
    Direct(Arc<dyn Store>),
    /// Called on `handle`'s runtime from a blocking task (SQL stores).
    Remote(Arc<dyn Store>, tokio::runtime::Handle),
}

impl Backend {
    async fn call<T, F, Fut>(&self, f: F) -> T
    where
        F: FnOnce(Arc<dyn Store>) -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        match self {
            Backend::Direct(store) => f(store.clone()).await,
            Backend::Remote(store, handle) => {
                let (store, handle) = (store.clone(), handle.clone());
                tokio::task::spawn_blocking(move || handle.block_on(f(store)))
                    .await
                    .expect("store call panicked")
            }
        }
    }

    fn is_remote(&self) -> bool {
        matches!(self, Backend::Remote(..))
    }
}

/// The store under test, shared by every engine instance of one schedule.
pub struct Mutant {
    backend: Backend,
    mutation: Option<Mutation>,
    virt0: tokio::time::Instant,
    real0: std::time::Instant,
    seq: AtomicU64,
    log: Mutex<Vec<StoreEvent>>,
    owners: Mutex<HashMap<ScopeKey, OwnerToken>>,
    completed: Mutex<Vec<(ScopeKey, Fingerprint, Outcome)>>,
    fingerprints: Mutex<HashMap<ScopeKey, Fingerprint>>,
    notify: Mutex<HashMap<ScopeKey, Arc<Notify>>>,
    switches: Mutex<Vec<Switch>>,
    reserve_ends: Mutex<HashMap<OwnerToken, Stamp>>,
    /// Owners whose reserve answered `Acquired` to the engine.
    answered: Mutex<std::collections::HashSet<OwnerToken>>,
    /// Owners a renewal failed for ([`Mutation::HeartbeatGivesUp`]).
    gave_up: Mutex<std::collections::HashSet<OwnerToken>>,
    /// Requests to which a reserve or a get answered, as the engine saw it
    /// (through any fault), that the key's record is there.
    saw_held: Mutex<std::collections::HashSet<usize>>,
    /// Owners one of whose completions or releases was sent while a fault
    /// hit that call (a fault that fails it may leave the key to its lease).
    storing_faulted: Mutex<std::collections::HashSet<OwnerToken>>,
    /// Reservations made, for [`Mutation::SpuriousUnavailable`].
    reserves: AtomicU64,
    /// Keys released since their last reservation, for
    /// [`Mutation::ReleasedKeyInFlight`].
    released: Mutex<std::collections::HashSet<ScopeKey>>,
    /// Requests answered with another key's record
    /// ([`Mutation::ReplayOtherRecord`]).
    substituted: Mutex<std::collections::HashSet<usize>>,
}

/// A fault switched on or off on one instance, or its crash.
#[derive(Clone, Debug)]
pub struct Switch {
    pub instance: usize,
    pub at: Stamp,
    pub fault: Option<Fault>,
    pub crash: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Mutant {
    pub fn new(backend: Backend, mutation: Option<Mutation>) -> Arc<Self> {
        Arc::new(Mutant {
            backend,
            mutation,
            virt0: tokio::time::Instant::now(),
            real0: std::time::Instant::now(),
            seq: AtomicU64::new(0),
            log: Mutex::default(),
            owners: Mutex::default(),
            completed: Mutex::default(),
            fingerprints: Mutex::default(),
            notify: Mutex::default(),
            switches: Mutex::default(),
            reserve_ends: Mutex::default(),
            answered: Mutex::default(),
            gave_up: Mutex::default(),
            saw_held: Mutex::default(),
            storing_faulted: Mutex::default(),
            reserves: AtomicU64::new(0),
            released: Mutex::default(),
            substituted: Mutex::default(),
        })
    }

    pub fn stamp(&self) -> Stamp {
        Stamp {
            virt: self.virt0.elapsed(),
            real: self.real0.elapsed(),
            seq: self.seq.fetch_add(1, Ordering::SeqCst),
        }
    }

    pub fn log(&self) -> Vec<StoreEvent> {
        lock(&self.log).clone()
    }

    /// Every fault switch and crash, in order.
    pub fn switches(&self) -> Vec<Switch> {
        lock(&self.switches).clone()
    }

    /// When each reserve call, as the engine made it (faults included),
    /// returned, by its owner token. A call the engine dropped (it stopped
    /// waiting) or whose instance crashed has none.
    pub fn reserve_ends(&self) -> HashMap<OwnerToken, Stamp> {
        lock(&self.reserve_ends).clone()
    }

    /// The owners whose reservation reached the engine as `Acquired`.
    pub fn answered(&self) -> std::collections::HashSet<OwnerToken> {
        lock(&self.answered).clone()
    }

    /// The requests the engine was told their key's record is there.
    pub fn saw_held(&self) -> std::collections::HashSet<usize> {
        lock(&self.saw_held).clone()
    }

    /// See [`Mutant::storing_faulted`]'s field.
    pub fn storing_faulted(&self) -> std::collections::HashSet<OwnerToken> {
        lock(&self.storing_faulted).clone()
    }

    /// Requests a lying store answered with another key's record.
    pub fn substituted(&self) -> std::collections::HashSet<usize> {
        lock(&self.substituted).clone()
    }

    /// Whether the store keeps time by the real clock.
    pub fn real_clock(&self) -> bool {
        self.backend.is_remote()
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        op: Op,
        key: ScopeKey,
        call: (usize, Option<usize>),
        owner: Option<OwnerToken>,
        start: Stamp,
        answer: Answer,
        body: Option<Bytes>,
    ) {
        let end = self.stamp();
        lock(&self.log).push(StoreEvent {
            op,
            key,
            request: call.1,
            owner,
            instance: call.0,
            start,
            end,
            answer,
            body,
        });
    }

    fn notify(&self, key: &ScopeKey) {
        if let Some(n) = lock(&self.notify).get(key) {
            n.notify_waiters();
        }
    }

    /// Another key's completed record, for [`Mutation::ReplayOtherRecord`].
    fn other_record(&self, key: &ScopeKey) -> Option<Record> {
        lock(&self.completed)
            .iter()
            .rev()
            .find(|(k, _, _)| k != key)
            .map(|(_, fingerprint, outcome)| Record {
                fingerprint: *fingerprint,
                state: RecordState::Completed(outcome.clone()),
            })
    }

    async fn reserve(
        self: Arc<Self>,
        call: (usize, Option<usize>),
        key: ScopeKey,
        fp: Fingerprint,
        owner: OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let start = self.stamp();
        let reserve = |backend: Backend| async move {
            backend
                .call(move |s| async move { s.reserve(&key, &fp, &owner, lease, ttl).await })
                .await
        };
        let spurious = self.mutation == Some(Mutation::SpuriousUnavailable)
            && self.reserves.fetch_add(1, Ordering::SeqCst) % 5 == 4;
        let mut result = if spurious {
            Err(StoreError::Unavailable("spurious (mutation)".into()))
        } else {
            reserve(self.backend.clone()).await
        };
        if self.mutation == Some(Mutation::ReleasedKeyInFlight)
            && matches!(result, Ok(Claim::Acquired { .. }))
            && lock(&self.released).remove(&key)
        {
            self.backend
                .call(move |s| async move { s.release(&key, &owner).await })
                .await
                .ok();
            result = Ok(Claim::Existing(Record {
                fingerprint: fp,
                state: RecordState::InFlight {
                    lease_remaining: lease,
                },
            }));
        }
        if self.mutation == Some(Mutation::TakeoverIgnoresLease) {
            if let Ok(Claim::Existing(record)) = &result {
                let holder = lock(&self.owners).get(&key).copied();
                if let (RecordState::InFlight { .. }, true, Some(holder)) =
                    (&record.state, record.fingerprint == fp, holder)
                {
                    self.backend
                        .call(move |s| async move { s.release(&key, &holder).await })
                        .await
                        .ok();
                    result = reserve(self.backend.clone())
                        .await
                        .map(|claim| match claim {
                            Claim::Acquired { .. } => Claim::Acquired { takeover: true },
                            other => other,
                        });
                }
            }
        }
        if self.mutation == Some(Mutation::ReplayOtherRecord) {
            if let Ok(Claim::Existing(record)) = &mut result {
                if let Some(other) = self.other_record(&key) {
                    *record = other;
                    lock(&self.substituted).extend(call.1);
                }
            }
        }
        let answer = match &result {
            Ok(Claim::Acquired { .. }) => {
                lock(&self.owners).insert(key, owner);
                lock(&self.fingerprints).insert(key, fp);
                Answer::Acquired(owner)
            }
            Ok(Claim::Existing(_)) => Answer::Existing,
            Err(_) => Answer::Failed,
        };
        let owner = match answer {
            Answer::Acquired(owner) => Some(owner),
            _ => None,
        };
        self.record(Op::Reserve, key, call, owner, start, answer, None);
        result
    }

    async fn get(
        self: Arc<Self>,
        call: (usize, Option<usize>),
        key: ScopeKey,
    ) -> Result<Option<Record>, StoreError> {
        let start = self.stamp();
        let mut result = self
            .backend
            .call(move |s| async move { s.get(&key).await })
            .await;
        if self.mutation == Some(Mutation::ReplayOtherRecord) {
            if let Ok(Some(record)) = &mut result {
                if let Some(other) = self.other_record(&key) {
                    *record = other;
                    lock(&self.substituted).extend(call.1);
                }
            }
        }
        let answer = match &result {
            Ok(Some(_)) => Answer::Found,
            Ok(None) => Answer::Missing,
            Err(_) => Answer::Failed,
        };
        self.record(Op::Get, key, call, None, start, answer, None);
        result
    }

    async fn complete(
        self: Arc<Self>,
        call: (usize, Option<usize>),
        key: ScopeKey,
        owner: OwnerToken,
        outcome: Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let start = self.stamp();
        let complete = |backend: Backend, owner: OwnerToken, outcome: Outcome| async move {
            backend
                .call(move |s| async move { s.complete(&key, &owner, &outcome, ttl).await })
                .await
        };
        let mut outcome = outcome;
        if let (Some(Mutation::HeadersAsMap), Outcome::Stored(response)) =
            (self.mutation, &mut outcome)
        {
            let mut kept: Vec<(HeaderName, HeaderValue)> = Vec::new();
            for (name, value) in response.headers.drain(..) {
                kept.retain(|(n, _)| *n != name);
                kept.push((name, value));
            }
            response.headers = kept;
        }
        if let (Some(Mutation::StoredAsMarker), Outcome::Stored(response)) =
            (self.mutation, &outcome)
        {
            outcome = Outcome::TooLarge {
                status: response.status,
            };
        }
        if let Outcome::Stored(response) = &mut outcome {
            match self.mutation {
                Some(Mutation::CookieKept) => response.headers.push((
                    http::header::SET_COOKIE,
                    HeaderValue::from_static("session=kept"),
                )),
                Some(Mutation::LocationDropped) => response
                    .headers
                    .retain(|(name, _)| name != http::header::LOCATION),
                _ => {}
            }
        }
        let mut result = complete(self.backend.clone(), owner, outcome.clone()).await;
        if self.mutation == Some(Mutation::UnfencedCompletion) && matches!(result, Ok(false)) {
            let holder = lock(&self.owners).get(&key).copied();
            if let Some(holder) = holder.filter(|h| *h != owner) {
                result = complete(self.backend.clone(), holder, outcome.clone()).await;
            }
        }
        if let Ok(true) = result {
            let fp = lock(&self.fingerprints).get(&key).copied();
            if let Some(fp) = fp {
                lock(&self.completed).push((key, fp, outcome.clone()));
            }
            self.notify(&key);
        }
        let answer = result.as_ref().map_or(Answer::Failed, |d| Answer::Done(*d));
        let body = match &outcome {
            Outcome::Stored(response) => Some(response.body.clone()),
            _ => None,
        };
        self.record(Op::Complete, key, call, Some(owner), start, answer, body);
        result
    }

    async fn release(
        self: Arc<Self>,
        call: (usize, Option<usize>),
        key: ScopeKey,
        owner: OwnerToken,
    ) -> Result<bool, StoreError> {
        let start = self.stamp();
        let orphan = !lock(&self.answered).contains(&owner);
        let result = if self.mutation == Some(Mutation::OrphanUnreleasable) && orphan {
            Ok(false)
        } else {
            self.backend
                .call(move |s| async move { s.release(&key, &owner).await })
                .await
        };
        if let Ok(true) = result {
            lock(&self.released).insert(key);
            if self.mutation != Some(Mutation::ReleaseForgetsWaiters) {
                self.notify(&key);
            }
        }
        let answer = result.as_ref().map_or(Answer::Failed, |d| Answer::Done(*d));
        self.record(Op::Release, key, call, Some(owner), start, answer, None);
        result
    }

    async fn renew(
        self: Arc<Self>,
        call: (usize, Option<usize>),
        key: ScopeKey,
        owner: OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let start = self.stamp();
        let result = self
            .backend
            .call(move |s| async move { s.renew(&key, &owner, lease).await })
            .await;
        let answer = result.as_ref().map_or(Answer::Failed, |d| Answer::Done(*d));
        self.record(Op::Renew, key, call, Some(owner), start, answer, None);
        result
    }

    async fn wait(
        self: Arc<Self>,
        call: (usize, Option<usize>),
        key: ScopeKey,
        max: Duration,
        attempt: u32,
    ) -> Result<(), StoreError> {
        let start = self.stamp();
        let result = match (&self.backend, self.mutation) {
            // The wake-ups of the store under test are this wrapper's own, so
            // that a release can forget them.
            (_, Some(Mutation::ReleaseForgetsWaiters)) => {
                let notify = lock(&self.notify).entry(key).or_default().clone();
                let notified = notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let in_flight = matches!(
                    self.backend
                        .call(move |s| async move { s.get(&key).await })
                        .await,
                    Ok(Some(Record {
                        state: RecordState::InFlight { .. },
                        ..
                    }))
                );
                if in_flight {
                    let _ = tokio::time::timeout(max, notified).await;
                }
                Ok(())
            }
            (_, Some(Mutation::WaitIgnoresMax)) => {
                let notify = lock(&self.notify).entry(key).or_default().clone();
                let notified = notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let in_flight = matches!(
                    self.backend
                        .call(move |s| async move { s.get(&key).await })
                        .await,
                    Ok(Some(Record {
                        state: RecordState::InFlight { .. },
                        ..
                    }))
                );
                if in_flight {
                    notified.await;
                }
                Ok(())
            }
            (Backend::Direct(store), _) => store.wait(&key, max, attempt).await,
            // The SQL stores poll (the trait's default): sleep here, on the
            // schedule's clock.
            (Backend::Remote(..), _) => {
                tokio::time::sleep(max.min(tower_idempotency::store::backoff(attempt))).await;
                Ok(())
            }
        };
        self.record(Op::Wait, key, call, None, start, Answer::Waited, None);
        result
    }
}

/// A fault on one instance's connection to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The call fails at once; nothing reaches the store.
    Error,
    /// The call hangs past `store_timeout` before it reaches the store.
    Stall,
    /// The store does the work, then the answer is lost (a timeout).
    CommitThenTimeout,
    /// The call times out, and the store does the work later anyway.
    LateCommit,
    /// The call fails at once (a reset connection), and the store does the
    /// work a moment later anyway (the statement ran on at the server).
    ErrorThenCommit,
    /// The store does the work at once; the answer arrives just under
    /// `store_timeout` later, possibly past the lease it started.
    SlowAnswer,
}

/// Which operations a fault hits, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    /// Bit set over reserve, get, complete, release, renew, wait.
    pub ops: u8,
}

impl Fault {
    pub fn hits(&self, op: Op) -> bool {
        let bit = match op {
            Op::Reserve => 1,
            Op::Get => 2,
            Op::Complete => 4,
            Op::Release => 8,
            Op::Renew => 16,
            Op::Wait => 32,
        };
        self.ops & bit != 0
    }
}

type Call<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send>>;

/// One engine instance's way to the store.
pub struct Faulty {
    pub instance: usize,
    mutant: Arc<Mutant>,
    store_timeout: Duration,
    dead: AtomicBool,
    fault: Mutex<Option<Fault>>,
}

impl std::fmt::Debug for Faulty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Faulty({})", self.instance)
    }
}

impl Faulty {
    pub fn new(instance: usize, mutant: Arc<Mutant>, store_timeout: Duration) -> Arc<Self> {
        Arc::new(Faulty {
            instance,
            mutant,
            store_timeout,
            dead: AtomicBool::new(false),
            fault: Mutex::new(None),
        })
    }

    /// Switches the fault (or `None`: healthy).
    pub fn set_fault(&self, fault: Option<Fault>) {
        *lock(&self.fault) = fault;
        let at = self.mutant.stamp();
        lock(&self.mutant.switches).push(Switch {
            instance: self.instance,
            at,
            fault,
            crash: false,
        });
    }

    /// The instance crashed: nothing it sends reaches the store any more.
    pub fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let at = self.mutant.stamp();
        lock(&self.mutant.switches).push(Switch {
            instance: self.instance,
            at,
            fault: None,
            crash: true,
        });
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    fn id(&self) -> (usize, Option<usize>) {
        (self.instance, current_request())
    }

    /// Notes `owner`'s completion or release (`op`) sent under a fault
    /// that hits it.
    fn note_storing(&self, op: Op, owner: &OwnerToken) {
        if (*lock(&self.fault)).is_some_and(|f| f.hits(op)) {
            lock(&self.mutant.storing_faulted).insert(*owner);
        }
    }

    async fn run<T: Send + 'static>(&self, op: Op, call: Call<T>) -> Result<T, StoreError> {
        if self.is_dead() {
            return std::future::pending().await;
        }
        let fault = (*lock(&self.fault)).filter(|f| f.hits(op));
        let past = self.store_timeout * 2;
        let result = match fault.map(|f| f.kind) {
            None => call.await,
            Some(FaultKind::Error) => Err(StoreError::Unavailable("injected fault".into())),
            Some(FaultKind::Stall) => {
                tokio::time::sleep(past).await;
                if self.is_dead() {
                    return std::future::pending().await;
                }
                call.await
            }
            Some(FaultKind::CommitThenTimeout) => {
                let _ = call.await;
                tokio::time::sleep(past).await;
                Err(StoreError::Timeout)
            }
            Some(FaultKind::LateCommit) => {
                let later = self.store_timeout * 3 / 2;
                tokio::spawn(async move {
                    tokio::time::sleep(later).await;
                    let _ = call.await;
                });
                tokio::time::sleep(past).await;
                Err(StoreError::Timeout)
            }
            Some(FaultKind::ErrorThenCommit) => {
                let later = self.store_timeout / 2;
                tokio::spawn(async move {
                    tokio::time::sleep(later).await;
                    let _ = call.await;
                });
                Err(StoreError::Unavailable("injected fault: reset".into()))
            }
            Some(FaultKind::SlowAnswer) => {
                let result = call.await;
                tokio::time::sleep(self.store_timeout * 9 / 10).await;
                result
            }
        };
        if self.is_dead() {
            return std::future::pending().await;
        }
        result
    }
}

#[async_trait]
impl Store for Faulty {
    async fn reserve(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let call = self
            .mutant
            .clone()
            .reserve(self.id(), *key, *fingerprint, *owner, lease, ttl);
        let result = self.run(Op::Reserve, Box::pin(call)).await;
        let end = self.mutant.stamp();
        lock(&self.mutant.reserve_ends).insert(*owner, end);
        match (&result, current_request()) {
            (Ok(Claim::Acquired { .. }), _) => {
                lock(&self.mutant.answered).insert(*owner);
            }
            (Ok(Claim::Existing(_)), Some(request)) => {
                lock(&self.mutant.saw_held).insert(request);
            }
            _ => {}
        }
        result
    }

    async fn complete(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let call = self
            .mutant
            .clone()
            .complete(self.id(), *key, *owner, outcome.clone(), ttl);
        self.note_storing(Op::Complete, owner);
        self.run(Op::Complete, Box::pin(call)).await
    }

    async fn release(&self, key: &ScopeKey, owner: &OwnerToken) -> Result<bool, StoreError> {
        let call = self.mutant.clone().release(self.id(), *key, *owner);
        self.note_storing(Op::Release, owner);
        self.run(Op::Release, Box::pin(call)).await
    }

    async fn renew(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let gives_up = self.mutant.mutation == Some(Mutation::HeartbeatGivesUp);
        if gives_up && lock(&self.mutant.gave_up).contains(owner) {
            return Ok(true);
        }
        let call = self.mutant.clone().renew(self.id(), *key, *owner, lease);
        let result = self.run(Op::Renew, Box::pin(call)).await;
        if gives_up && result.is_err() {
            lock(&self.mutant.gave_up).insert(*owner);
        }
        result
    }

    async fn get(&self, key: &ScopeKey) -> Result<Option<Record>, StoreError> {
        let call = self.mutant.clone().get(self.id(), *key);
        let result = self.run(Op::Get, Box::pin(call)).await;
        if let (Ok(Some(_)), Some(request)) = (&result, current_request()) {
            lock(&self.mutant.saw_held).insert(request);
        }
        result
    }

    async fn wait(&self, key: &ScopeKey, max: Duration, attempt: u32) -> Result<(), StoreError> {
        let call = self.mutant.clone().wait(self.id(), *key, max, attempt);
        self.run(Op::Wait, Box::pin(call)).await
    }
}

/// The record of `key` as the real store holds it now (for the end check).
pub async fn peek(mutant: &Mutant, key: ScopeKey) -> Result<Option<Record>, StoreError> {
    mutant
        .backend
        .call(move |s| async move { s.get(&key).await })
        .await
}
