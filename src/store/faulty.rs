//! A store wrapper that injects faults, for tests: [`FaultyStore`].

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::{
    Admin, Claim, Fingerprint, Maintenance, Outcome, OwnerToken, PrincipalHash, Record, RecordInfo,
    ScopeKey, StateCounts, Store, StoreError,
};

/// One operation of [`Store`] or [`Maintenance`], to aim a fault at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Store::reserve`].
    Reserve,
    /// [`Store::complete`].
    Complete,
    /// [`Store::release`].
    Release,
    /// [`Store::renew`].
    Renew,
    /// [`Store::get`].
    Get,
    /// [`Store::wait`].
    Wait,
    /// [`Store::ping`].
    Ping,
    /// [`Maintenance::sweep`].
    Sweep,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 8] = [
        Op::Reserve,
        Op::Complete,
        Op::Release,
        Op::Renew,
        Op::Get,
        Op::Wait,
        Op::Ping,
        Op::Sweep,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// What happens to a call while a fault is switched on for its operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The backend is down: the call fails with
    /// [`StoreError::Unavailable`] without reaching the inner store.
    Down,
    /// The backend is slow: the call sleeps this long (Tokio time, so a
    /// paused clock works), then reaches the inner store. Longer than the
    /// engine's `store_timeout`, it is abandoned before it reaches it.
    Stall(Duration),
    /// The call reaches the inner store (which commits it), and then the
    /// answer is lost: [`StoreError::Timeout`] is returned instead.
    CommitThenFail,
    /// The call reaches the inner store (which commits it), and then
    /// answers only after this long: past the engine's `store_timeout`, the
    /// engine sees a timeout although the write happened.
    CommitThenStall(Duration),
    /// The call panics without reaching the inner store (a store driver's
    /// bug): the task that made it unwinds.
    Panic,
}

/// How long a switched-on fault lasts.
#[derive(Clone, Copy, Debug)]
enum Span {
    /// Every call until cleared.
    Always,
    /// The next n calls.
    Next(usize),
    /// Each call with this probability (0.0..=1.0).
    Chance(f64),
}

/// The shared handle that switches faults on and off and reads the call
/// counts of a [`FaultyStore`]. Clones (and the store's clones) share it,
/// so a test keeps one while the engine owns the store.
#[derive(Clone, Default)]
pub struct Faults {
    inner: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    rules: Mutex<[Option<(Fault, Span)>; 8]>,
    calls: [AtomicUsize; 8],
    inner_calls: [AtomicUsize; 8],
}

impl Faults {
    /// A handle with no fault switched on.
    pub fn new() -> Self {
        Self::default()
    }

    fn rules(&self) -> std::sync::MutexGuard<'_, [Option<(Fault, Span)>; 8]> {
        self.inner.rules.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `op` suffers `fault` on every call until [`clear`](Faults::clear).
    pub fn set(&self, op: Op, fault: Fault) {
        self.rules()[op.index()] = Some((fault, Span::Always));
    }

    /// `op` suffers `fault` on its next `calls` calls, then works again.
    pub fn set_next(&self, op: Op, fault: Fault, calls: usize) {
        self.rules()[op.index()] = (calls > 0).then_some((fault, Span::Next(calls)));
    }

    /// Each call of `op` suffers `fault` with probability `chance`
    /// (clamped to 0.0..=1.0), drawn per call.
    pub fn set_chance(&self, op: Op, fault: Fault, chance: f64) {
        self.rules()[op.index()] = Some((fault, Span::Chance(chance.clamp(0.0, 1.0))));
    }

    /// Every operation suffers `fault` until cleared: a whole outage.
    pub fn set_all(&self, fault: Fault) {
        for op in Op::ALL {
            self.set(op, fault);
        }
    }

    /// Switches `op`'s fault off.
    pub fn clear(&self, op: Op) {
        self.rules()[op.index()] = None;
    }

    /// Switches every fault off.
    pub fn clear_all(&self) {
        *self.rules() = Default::default();
    }

    /// How many of the faulty calls set by [`set_next`](Faults::set_next)
    /// for `op` are still to come (0 for other kinds of fault).
    pub fn remaining(&self, op: Op) -> usize {
        match self.rules()[op.index()] {
            Some((_, Span::Next(n))) => n,
            _ => 0,
        }
    }

    /// How many calls of `op` the wrapper received (faulty or not).
    pub fn calls(&self, op: Op) -> usize {
        self.inner.calls[op.index()].load(SeqCst)
    }

    /// How many calls of `op` reached the inner store.
    pub fn inner_calls(&self, op: Op) -> usize {
        self.inner.inner_calls[op.index()].load(SeqCst)
    }

    /// Counts a call of `op` and draws the fault it suffers, if any.
    fn draw(&self, op: Op) -> Option<Fault> {
        self.inner.calls[op.index()].fetch_add(1, SeqCst);
        let mut rules = self.rules();
        let slot = &mut rules[op.index()];
        let (fault, span) = (*slot)?;
        match span {
            Span::Always => Some(fault),
            Span::Next(n) => {
                *slot = (n > 1).then_some((fault, Span::Next(n - 1)));
                Some(fault)
            }
            Span::Chance(p) => (rand::random::<f64>() < p).then_some(fault),
        }
    }

    /// Runs `call` (the inner store's operation) under `op`'s fault.
    async fn run<T>(
        &self,
        op: Op,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let fault = self.draw(op);
        match fault {
            Some(Fault::Down) => {
                return Err(StoreError::Unavailable("injected fault: store down".into()))
            }
            Some(Fault::Stall(delay)) => tokio::time::sleep(delay).await,
            Some(Fault::Panic) => panic!("injected fault: the store's call panicked"),
            _ => {}
        }
        self.inner.inner_calls[op.index()].fetch_add(1, SeqCst);
        let result = call.await;
        match fault {
            Some(Fault::CommitThenFail) => Err(StoreError::Timeout),
            Some(Fault::CommitThenStall(delay)) => {
                tokio::time::sleep(delay).await;
                result
            }
            _ => result,
        }
    }
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults")
            .field("rules", &*self.rules())
            .finish_non_exhaustive()
    }
}

/// Wraps a store `S` and, while a fault is switched on through its
/// [`Faults`] handle, makes calls fail, stall, or commit and then report a
/// failure; it counts every call either way. With no fault switched on it
/// is the inner store exactly (every call and answer passed through).
///
/// One wrapper serves every test that needs an outage, a slow store, a
/// lost answer or a call count:
///
/// ```
/// # use tower_idempotency::store::{FaultyStore, Fault, Op};
/// # use tower_idempotency::MemoryStore;
/// let store = FaultyStore::new(MemoryStore::new());
/// let faults = store.faults(); // keep it; give the store to the engine
/// faults.set_next(Op::Complete, Fault::Down, 3);
/// faults.set(Op::Reserve, Fault::CommitThenFail);
/// assert_eq!(faults.calls(Op::Reserve), 0);
/// ```
///
/// Only with the `test-util` feature.
#[derive(Clone, Debug)]
pub struct FaultyStore<S> {
    inner: S,
    faults: Faults,
}

impl<S: Store> FaultyStore<S> {
    /// `inner` with no fault switched on.
    pub fn new(inner: S) -> Self {
        FaultyStore {
            inner,
            faults: Faults::new(),
        }
    }

    /// The handle that switches faults and reads counts (shared).
    pub fn faults(&self) -> Faults {
        self.faults.clone()
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

#[async_trait]
impl<S: Store> Store for FaultyStore<S> {
    async fn reserve(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        let call = self.inner.reserve(key, fingerprint, owner, lease, ttl);
        self.faults.run(Op::Reserve, call).await
    }

    async fn complete(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let call = self.inner.complete(key, owner, outcome, ttl);
        self.faults.run(Op::Complete, call).await
    }

    async fn release(&self, key: &ScopeKey, owner: &OwnerToken) -> Result<bool, StoreError> {
        let call = self.inner.release(key, owner);
        self.faults.run(Op::Release, call).await
    }

    async fn renew(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let call = self.inner.renew(key, owner, lease);
        self.faults.run(Op::Renew, call).await
    }

    async fn get(&self, key: &ScopeKey) -> Result<Option<Record>, StoreError> {
        self.faults.run(Op::Get, self.inner.get(key)).await
    }

    async fn wait(&self, key: &ScopeKey, max: Duration, attempt: u32) -> Result<(), StoreError> {
        let call = self.inner.wait(key, max, attempt);
        self.faults.run(Op::Wait, call).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.faults.run(Op::Ping, self.inner.ping()).await
    }

    async fn identity(&self) -> Result<Option<String>, StoreError> {
        self.inner.identity().await
    }

    fn maintenance(&self) -> Option<&dyn Maintenance> {
        self.inner.maintenance().map(|_| self as &dyn Maintenance)
    }

    fn admin(&self) -> Option<&dyn Admin> {
        self.inner.admin().map(|_| self as &dyn Admin)
    }
}

impl<S: Store> FaultyStore<S> {
    fn inner_admin(&self) -> Result<&dyn Admin, StoreError> {
        self.inner
            .admin()
            .ok_or_else(|| StoreError::Unavailable("the inner store has no admin side".into()))
    }
}

/// The inner store's admin side; [`Admin::reserve_for`] suffers
/// [`Op::Reserve`]'s faults (it is the request path's reservation), the
/// operator's calls none.
#[async_trait]
impl<S: Store> Admin for FaultyStore<S> {
    async fn reserve_for(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
        principal: Option<&PrincipalHash>,
    ) -> Result<Claim, StoreError> {
        let admin = self.inner_admin()?;
        let call = admin.reserve_for(key, fingerprint, owner, lease, ttl, principal);
        self.faults.run(Op::Reserve, call).await
    }

    async fn inspect(&self, key: &ScopeKey) -> Result<Option<RecordInfo>, StoreError> {
        self.inner_admin()?.inspect(key).await
    }

    async fn purge(&self, key: &ScopeKey) -> Result<bool, StoreError> {
        self.inner_admin()?.purge(key).await
    }

    async fn principal_keys(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError> {
        self.inner_admin()?.principal_keys(principal, limit).await
    }

    async fn purge_principal(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError> {
        self.inner_admin()?.purge_principal(principal, limit).await
    }

    async fn force_release(&self, key: &ScopeKey) -> Result<bool, StoreError> {
        self.inner_admin()?.force_release(key).await
    }

    async fn in_flight_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        self.inner_admin()?.in_flight_older_than(age, limit).await
    }

    async fn counts(&self) -> Result<StateCounts, StoreError> {
        self.inner_admin()?.counts().await
    }
}

#[async_trait]
impl<S: Store> Maintenance for FaultyStore<S> {
    async fn sweep(&self, batch: usize) -> Result<u64, StoreError> {
        let call = async {
            match self.inner.maintenance() {
                Some(inner) => inner.sweep(batch).await,
                None => Ok(0),
            }
        };
        self.faults.run(Op::Sweep, call).await
    }

    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        self.inner
            .maintenance()
            .map(|inner| inner.counters())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    #[tokio::test(start_paused = true)]
    async fn faults_are_off_until_switched_on_and_end_when_told() {
        let store = FaultyStore::new(MemoryStore::new());
        let faults = store.faults();
        let (key, fp, owner) = (
            ScopeKey([1; 32]),
            Fingerprint([1; 32]),
            OwnerToken::random(),
        );
        let lease = Duration::from_secs(60);
        assert!(store.ping().await.is_ok());

        faults.set_next(Op::Reserve, Fault::Down, 2);
        for left in [1, 0] {
            let result = store.reserve(&key, &fp, &owner, lease, lease).await;
            assert!(matches!(result, Err(StoreError::Unavailable(_))));
            assert_eq!(faults.remaining(Op::Reserve), left);
        }
        assert_eq!(
            faults.inner_calls(Op::Reserve),
            0,
            "a down store is not reached"
        );

        // Commits, then reports a timeout: the record stands.
        faults.set(Op::Reserve, Fault::CommitThenFail);
        let result = store.reserve(&key, &fp, &owner, lease, lease).await;
        assert!(matches!(result, Err(StoreError::Timeout)));
        assert!(store.get(&key).await.unwrap().is_some());
        faults.clear(Op::Reserve);
        assert!(store.release(&key, &owner).await.unwrap());
        assert_eq!(faults.calls(Op::Reserve), 3);
        assert_eq!(faults.inner_calls(Op::Reserve), 1);

        faults.set_all(Fault::Down);
        assert!(store.ping().await.is_err());
        assert!(store.get(&key).await.is_err());
        faults.clear_all();
        assert!(store.get(&key).await.unwrap().is_none());

        // A chance of 0 never fires, 1 always does.
        faults.set_chance(Op::Get, Fault::Down, 0.0);
        assert!(store.get(&key).await.is_ok());
        faults.set_chance(Op::Get, Fault::Down, 1.0);
        assert!(store.get(&key).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_delays_the_call_and_a_late_answer_follows_the_commit() {
        let store = FaultyStore::new(MemoryStore::new());
        let faults = store.faults();
        let (key, fp, owner) = (
            ScopeKey([2; 32]),
            Fingerprint([1; 32]),
            OwnerToken::random(),
        );
        let lease = Duration::from_secs(60);
        faults.set(Op::Reserve, Fault::CommitThenStall(Duration::from_secs(10)));
        let slow = tokio::time::timeout(
            Duration::from_secs(1),
            store.reserve(&key, &fp, &owner, lease, lease),
        );
        assert!(slow.await.is_err(), "the answer is late");
        assert!(store.get(&key).await.unwrap().is_some(), "but committed");

        faults.set(Op::Get, Fault::Stall(Duration::from_secs(10)));
        let stalled = tokio::time::timeout(Duration::from_secs(1), store.get(&key));
        assert!(stalled.await.is_err());
        assert_eq!(
            faults.inner_calls(Op::Get),
            1,
            "the stalled call never arrived"
        );
    }
}
