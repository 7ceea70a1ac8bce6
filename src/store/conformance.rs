//! The conformance suite every [`Store`] must pass, exported so a store
//! written outside this crate runs it in one line (only with the
//! `test-util` feature):
//!
//! ```ignore
//! // tests/conformance.rs of your crate
//! tower_idempotency::store_conformance!(my_store, async { MyStore::connect().await });
//! ```
//!
//! This expands to a module `my_store` with one `#[test]` per property; the
//! second argument is an async expression (evaluated once per test, names
//! resolved in the calling module) that yields a fresh, empty store. The
//! tests are written inside the macro, so none exists without running. A
//! test takes a few hundred milliseconds of real time (leases that run out).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use super::{
    Claim, Fingerprint, Outcome, OwnerToken, Record, RecordState, ScopeKey, Store, StoreError,
    StoredResponse,
};

/// Runs one test: builds a store with `make` and hands it to `test`, on a
/// fresh two-worker Tokio runtime.
pub fn run<S, F, T>(make: impl Future<Output = S>, test: F)
where
    S: Store,
    F: FnOnce(Arc<dyn Store>) -> T,
    T: Future<Output = ()>,
{
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
        .block_on(async {
            let store: Arc<dyn Store> = Arc::new(make.await);
            test(store).await;
        });
}

/// What the tests of [`store_conformance!`](crate::store_conformance) use.
pub mod prelude {
    pub use super::{
        acquire, acquire_for, fingerprint, in_flight, random_key, reserve_at_once, response, sweep,
        LONG, PAST_SHORT, SHORT,
    };
    pub use crate::store::{
        Admin, Claim, Fingerprint, Holder, KeyState, Outcome, OwnerToken, PrincipalHash, Record,
        RecordInfo, RecordState, ScopeKey, SealedOutcome, StateCounts, Store, StoredResponse,
    };
    pub use bytes::Bytes;
    pub use http::StatusCode;
    pub use std::sync::Arc;
    pub use std::time::Duration;
    pub use tokio::time::sleep;
}

/// A lease or retention that does not run out during a test.
pub const LONG: Duration = Duration::from_secs(600);
/// A lease or retention that has run out after [`PAST_SHORT`].
pub const SHORT: Duration = Duration::from_millis(100);
/// Longer than [`SHORT`], with room for a loaded machine's clock skew
/// between the test and a database.
pub const PAST_SHORT: Duration = Duration::from_millis(250);

/// A key no other test uses (random).
pub fn random_key() -> ScopeKey {
    ScopeKey(rand::random())
}

/// A fingerprint made of one repeated byte.
pub fn fingerprint(byte: u8) -> Fingerprint {
    Fingerprint([byte; 32])
}

/// Reserves a fresh `key` (fingerprint `fp`) and returns the token that
/// owns it; panics unless the store answers a fresh reservation.
pub async fn acquire(
    store: &Arc<dyn Store>,
    key: &ScopeKey,
    fp: u8,
    lease: Duration,
    ttl: Duration,
) -> OwnerToken {
    let owner = OwnerToken::random();
    match store
        .reserve(key, &fingerprint(fp), &owner, lease, ttl)
        .await
        .unwrap()
    {
        Claim::Acquired { takeover: false } => owner,
        other => panic!("expected a fresh reservation, got {other:?}"),
    }
}

/// Reserves a fresh `key` through the store's [`Admin`](super::Admin) side, keeping
/// `principal`; panics unless the store has one and acquires the key.
pub async fn acquire_for(
    store: &Arc<dyn Store>,
    key: &ScopeKey,
    lease: Duration,
    ttl: Duration,
    principal: Option<&super::PrincipalHash>,
) -> OwnerToken {
    let owner = OwnerToken::random();
    let admin = store.admin().expect("an admin side");
    match admin
        .reserve_for(key, &fingerprint(1), &owner, lease, ttl, principal)
        .await
        .unwrap()
    {
        Claim::Acquired { takeover: false } => owner,
        other => panic!("expected a fresh reservation, got {other:?}"),
    }
}

/// A response with repeated headers, non-UTF-8 bytes and a binary body.
pub fn response() -> Outcome {
    Outcome::Stored(StoredResponse {
        status: StatusCode::SEE_OTHER,
        headers: vec![
            (http::header::LOCATION, HeaderValue::from_static("/thanks")),
            (
                HeaderName::from_static("x-dup"),
                HeaderValue::from_static("one"),
            ),
            (
                HeaderName::from_static("x-dup"),
                HeaderValue::from_static("two"),
            ),
            (
                HeaderName::from_static("x-bytes"),
                HeaderValue::from_bytes(b"\xfe\xff").unwrap(),
            ),
        ],
        body: Bytes::from_static(b"binary \0 body \xff"),
    })
}

/// The lease left on an in-flight record; panics on any other.
pub fn in_flight(record: &Record) -> Duration {
    match record.state {
        RecordState::InFlight { lease_remaining } => lease_remaining,
        ref other => panic!("expected an in-flight record, got {other:?}"),
    }
}

/// The store's sweep, or 0 when it has no [`Maintenance`](super::Maintenance) side.
pub async fn sweep(store: &Arc<dyn Store>, batch: usize) -> Result<u64, StoreError> {
    match store.maintenance() {
        Some(maintenance) => maintenance.sweep(batch).await,
        None => Ok(0),
    }
}

/// Every store in `stores` reserves `key` (fingerprint 1) at the same
/// moment, each from its own task and with its own owner token.
pub async fn reserve_at_once(
    stores: Vec<Arc<dyn Store>>,
    key: ScopeKey,
    lease: Duration,
) -> Vec<Claim> {
    let start = Arc::new(tokio::sync::Barrier::new(stores.len()));
    let tasks: Vec<_> = stores
        .into_iter()
        .map(|store| {
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                store
                    .reserve(&key, &fingerprint(1), &OwnerToken::random(), lease, lease)
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut claims = Vec::new();
    for task in tasks {
        claims.push(task.await.unwrap());
    }
    claims
}

/// Instantiates the whole conformance suite for one store: a module `$name`
/// with one `#[test]` per property, each on a fresh store from `$store` (an
/// async expression, evaluated once per test in the calling module's
/// scope). See [the module](crate::store::conformance).
#[macro_export]
macro_rules! store_conformance {
    ($name:ident, $store:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::store_conformance!(@tests $store);
        }
    };
    (@tests $store:expr) => {
        #[test]
        fn fresh_key_is_acquired() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                assert_eq!(store.get(&key).await.unwrap(), None);
                acquire(&store, &key, 1, LONG, LONG).await;
                let record = store.get(&key).await.unwrap().expect("a record in flight");
                assert_eq!(record.fingerprint, fingerprint(1));
                let remaining = in_flight(&record);
                assert!(
                    remaining > Duration::ZERO && remaining <= LONG,
                    "{remaining:?}"
                );
            });
        }
        #[test]
        fn duplicate_sees_the_record_in_flight() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                acquire(&store, &key, 1, LONG, LONG).await;
                for fp in [1, 2] {
                    match store
                        .reserve(&key, &fingerprint(fp), &OwnerToken::random(), LONG, LONG)
                        .await
                        .unwrap()
                    {
                        Claim::Existing(record) => {
                            assert_eq!(record.fingerprint, fingerprint(1));
                            assert!(in_flight(&record) > Duration::ZERO);
                        }
                        other => panic!("a duplicate acquired the key: {other:?}"),
                    }
                }
            });
        }
        #[test]
        fn completed_response_replays_exactly() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                for outcome in [
                    response(),
                    Outcome::Stored(StoredResponse {
                        status: StatusCode::OK,
                        headers: Vec::new(),
                        body: Bytes::new(),
                    }),
                ] {
                    let key = random_key();
                    let owner = acquire(&store, &key, 1, LONG, LONG).await;
                    assert!(store.complete(&key, &owner, &outcome, LONG).await.unwrap());
                    let completed = Record {
                        fingerprint: fingerprint(1),
                        state: RecordState::Completed(outcome.clone()),
                    };
                    assert_eq!(store.get(&key).await.unwrap(), Some(completed.clone()));
                    for fp in [1, 2] {
                        assert_eq!(
                            store
                                .reserve(&key, &fingerprint(fp), &OwnerToken::random(), LONG, LONG)
                                .await
                                .unwrap(),
                            Claim::Existing(completed.clone())
                        );
                    }
                }
            });
        }
        #[test]
        fn too_large_marker_round_trips() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                let owner = acquire(&store, &key, 1, LONG, LONG).await;
                let marker = Outcome::TooLarge {
                    status: StatusCode::CREATED,
                };
                assert!(store.complete(&key, &owner, &marker, LONG).await.unwrap());
                let record = store.get(&key).await.unwrap().unwrap();
                assert_eq!(record.state, RecordState::Completed(marker));
            });
        }
        #[test]
        fn incomplete_marker_round_trips() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                let owner = acquire(&store, &key, 1, LONG, LONG).await;
                let marker = Outcome::Incomplete {
                    status: StatusCode::CREATED,
                };
                assert!(store.complete(&key, &owner, &marker, LONG).await.unwrap());
                let record = store.get(&key).await.unwrap().unwrap();
                assert_eq!(record.state, RecordState::Completed(marker));
                // A plain "too large" marker is still told apart from it.
                let key = random_key();
                let owner = acquire(&store, &key, 1, LONG, LONG).await;
                let too_large = Outcome::TooLarge {
                    status: StatusCode::CREATED,
                };
                assert!(store.complete(&key, &owner, &too_large, LONG).await.unwrap());
                let record = store.get(&key).await.unwrap().unwrap();
                assert_eq!(record.state, RecordState::Completed(too_large));
            });
        }
        #[test]
        fn sealed_outcome_round_trips_byte_for_byte() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                // Every byte value, and bytes that look like a plain outcome.
                let mut bytes: Vec<u8> = (0..=255).collect();
                bytes.extend_from_slice(&Outcome::TooLarge { status: StatusCode::OK }.encode());
                let sealed = Outcome::Sealed(SealedOutcome::from_bytes(Bytes::from(bytes)));
                let key = random_key();
                let owner = acquire(&store, &key, 1, LONG, LONG).await;
                assert!(store.complete(&key, &owner, &sealed, LONG).await.unwrap());
                let record = store.get(&key).await.unwrap().unwrap();
                assert_eq!(record.state, RecordState::Completed(sealed.clone()));
                match store.reserve(&key, &fingerprint(1), &OwnerToken::random(), LONG, LONG).await {
                    Ok(Claim::Existing(record)) => {
                        assert_eq!(record.state, RecordState::Completed(sealed))
                    }
                    other => panic!("expected the sealed record, got {other:?}"),
                }
            });
        }
        #[test]
        fn wrong_owner_is_refused() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                let owner = acquire(&store, &key, 1, LONG, LONG).await;
                let stranger = OwnerToken::random();
                assert!(!store
                    .complete(&key, &stranger, &response(), LONG)
                    .await
                    .unwrap());
                assert!(!store.release(&key, &stranger).await.unwrap());
                assert!(!store.renew(&key, &stranger, LONG).await.unwrap());
                let record = store.get(&key).await.unwrap().expect("untouched");
                in_flight(&record);

                // Once completed, not even the owner can change the record.
                assert!(store
                    .complete(&key, &owner, &response(), LONG)
                    .await
                    .unwrap());
                let other = Outcome::TooLarge {
                    status: StatusCode::OK,
                };
                assert!(!store.complete(&key, &owner, &other, LONG).await.unwrap());
                assert!(!store.release(&key, &owner).await.unwrap());
                assert!(!store.renew(&key, &owner, LONG).await.unwrap());
                let record = store.get(&key).await.unwrap().unwrap();
                assert_eq!(record.state, RecordState::Completed(response()));

                // Unknown keys: nothing to change.
                let missing = random_key();
                assert!(!store
                    .complete(&missing, &owner, &response(), LONG)
                    .await
                    .unwrap());
                assert!(!store.release(&missing, &owner).await.unwrap());
                assert!(!store.renew(&missing, &owner, LONG).await.unwrap());
                assert_eq!(store.get(&missing).await.unwrap(), None);
            });
        }
        #[test]
        fn release_frees_the_key() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                let owner = acquire(&store, &key, 1, LONG, LONG).await;
                assert!(store.release(&key, &owner).await.unwrap());
                assert_eq!(store.get(&key).await.unwrap(), None);
                assert!(!store.release(&key, &owner).await.unwrap());
                // A corrected request (another fingerprint) now goes through.
                acquire(&store, &key, 2, LONG, LONG).await;
            });
        }
        #[test]
        fn renew_keeps_the_lease_and_the_record() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                // Lease and retention both short: the call outlives its ttl.
                let owner = acquire(&store, &key, 1, SHORT, SHORT).await;
                assert!(store.renew(&key, &owner, LONG).await.unwrap());
                sleep(PAST_SHORT).await;
                assert_eq!(sweep(&store, 100).await.unwrap(), 0);
                for fp in [1, 2] {
                    assert!(matches!(
                        store
                            .reserve(&key, &fingerprint(fp), &OwnerToken::random(), LONG, LONG)
                            .await
                            .unwrap(),
                        Claim::Existing(_)
                    ));
                }
                assert!(store
                    .complete(&key, &owner, &response(), LONG)
                    .await
                    .unwrap());
            });
        }
        #[test]
        fn expired_lease_is_taken_over_by_the_same_fingerprint_only() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                let crashed = acquire(&store, &key, 1, SHORT, LONG).await;
                sleep(PAST_SHORT).await;

                match store
                    .reserve(&key, &fingerprint(2), &OwnerToken::random(), LONG, LONG)
                    .await
                    .unwrap()
                {
                    Claim::Existing(record) => {
                        assert_eq!(record.fingerprint, fingerprint(1));
                        assert_eq!(in_flight(&record), Duration::ZERO);
                    }
                    other => panic!("another request took over: {other:?}"),
                }
                let successor = OwnerToken::random();
                match store
                    .reserve(&key, &fingerprint(1), &successor, LONG, LONG)
                    .await
                    .unwrap()
                {
                    Claim::Acquired { takeover: true } => {}
                    other => panic!("expected a takeover, got {other:?}"),
                }
                assert!(!store
                    .complete(&key, &crashed, &response(), LONG)
                    .await
                    .unwrap());
                assert!(!store.release(&key, &crashed).await.unwrap());
                assert!(!store.renew(&key, &crashed, LONG).await.unwrap());
                assert!(store
                    .complete(&key, &successor, &response(), LONG)
                    .await
                    .unwrap());
            });
        }
        #[test]
        fn expired_retention_frees_the_key() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let completed = random_key();
                let owner = acquire(&store, &completed, 1, LONG, LONG).await;
                assert!(store
                    .complete(&completed, &owner, &response(), SHORT)
                    .await
                    .unwrap());
                let in_flight = random_key();
                acquire(&store, &in_flight, 1, LONG, SHORT).await;
                sleep(PAST_SHORT).await;

                for key in [completed, in_flight] {
                    assert_eq!(store.get(&key).await.unwrap(), None);
                    // Reusable by any request, and not a takeover.
                    acquire(&store, &key, 2, LONG, LONG).await;
                }
            });
        }
        #[test]
        fn sweep_deletes_only_expired_records_in_batches() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                if store.maintenance().is_none() {
                    return; // nothing to sweep with
                }
                let mut live = Vec::new();
                for i in 0..5 {
                    let key = random_key();
                    let owner = acquire(&store, &key, 1, LONG, SHORT).await;
                    if i % 2 == 0 {
                        assert!(store
                            .complete(&key, &owner, &response(), SHORT)
                            .await
                            .unwrap());
                    }
                }
                for i in 0..3 {
                    let key = random_key();
                    let owner = acquire(&store, &key, 1, LONG, LONG).await;
                    if i == 0 {
                        assert!(store
                            .complete(&key, &owner, &response(), LONG)
                            .await
                            .unwrap());
                    }
                    live.push(key);
                }
                sleep(PAST_SHORT).await;

                assert_eq!(sweep(&store, 2).await.unwrap(), 2);
                assert_eq!(sweep(&store, 100).await.unwrap(), 3);
                assert_eq!(sweep(&store, 100).await.unwrap(), 0);
                for key in &live {
                    assert!(
                        store.get(key).await.unwrap().is_some(),
                        "a live record was swept"
                    );
                }
            });
        }
        #[test]
        fn concurrent_reservations_have_one_winner() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let claims = reserve_at_once(vec![store; 50], random_key(), LONG).await;
                let mut acquired = 0;
                for claim in &claims {
                    match claim {
                        Claim::Acquired { takeover, .. } => {
                            assert!(!takeover);
                            acquired += 1;
                        }
                        Claim::Existing(record) => {
                            assert_eq!(record.fingerprint, fingerprint(1));
                        }
                    }
                }
                assert_eq!(acquired, 1, "{claims:?}");
            });
        }
        /// The owner token is the caller's: the store keeps the one it was
        /// given, so a caller that lost the answer can still release.
        #[test]
        fn the_callers_owner_token_owns_the_reservation() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let key = random_key();
                let owner = OwnerToken::random();
                let claim = store.reserve(&key, &fingerprint(1), &owner, LONG, LONG).await;
                assert_eq!(claim.unwrap(), Claim::Acquired { takeover: false });
                assert!(store.renew(&key, &owner, LONG).await.unwrap());
                assert!(store.release(&key, &owner).await.unwrap());
                assert_eq!(store.get(&key).await.unwrap(), None);
            });
        }

        /// A store's identity, when it has one, is stable and not empty.
        #[test]
        fn identity_is_stable() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let first = store.identity().await.unwrap();
                assert_eq!(store.identity().await.unwrap(), first);
                if let Some(id) = first {
                    assert!(!id.is_empty());
                }
            });
        }
        /// An operator sees state, times, status, sizes and an in-flight
        /// record's holder, never a body.
        #[test]
        fn admin_inspect_describes_a_record_without_its_body() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let Some(admin) = store.admin() else { return };
                let principal = PrincipalHash([7; 32]);
                let key = random_key();
                assert_eq!(admin.inspect(&key).await.unwrap(), None);
                let owner = acquire_for(&store, &key, LONG, LONG, Some(&principal)).await;
                let info = admin.inspect(&key).await.unwrap().expect("in flight");
                assert_eq!(info.key, key);
                assert_eq!(info.state, KeyState::InFlight);
                assert_eq!(info.fingerprint, fingerprint(1));
                let lease = info.lease_remaining.expect("a lease");
                assert!(lease > Duration::ZERO && lease <= LONG, "{lease:?}");
                assert!(info.expires_in > Duration::ZERO && info.expires_in <= LONG);
                assert!(info.age < LONG, "{:?}", info.age);
                assert!(info.has_principal);
                assert_eq!((info.status, info.body_bytes), (None, None));
                // Named by its holder (`RecordInfo::held_by`): an operator's
                // release fenced by holder needs it.
                assert_eq!(info.holder(), Some(Holder::of(&owner)));

                assert!(store.complete(&key, &owner, &response(), LONG).await.unwrap());
                let info = admin.inspect(&key).await.unwrap().expect("completed");
                assert_eq!(info.state, KeyState::Completed);
                assert_eq!(info.status, Some(StatusCode::SEE_OTHER));
                assert_eq!((info.lease_remaining, info.holder()), (None, None));
                let Outcome::Stored(stored) = response() else { unreachable!() };
                assert_eq!(info.body_bytes, Some(stored.body.len() as u64));
                assert_eq!(info.header_bytes, Some(stored.encode_headers().len() as u64));
                assert!(info.has_principal, "completion keeps the principal");

                for (marker, state) in [
                    (Outcome::TooLarge { status: StatusCode::CREATED }, KeyState::TooLarge),
                    (Outcome::Incomplete { status: StatusCode::CREATED }, KeyState::Incomplete),
                ] {
                    let key = random_key();
                    let owner = acquire(&store, &key, 1, LONG, LONG).await;
                    assert!(store.complete(&key, &owner, &marker, LONG).await.unwrap());
                    let info = admin.inspect(&key).await.unwrap().unwrap();
                    assert_eq!(info.state, state);
                    assert_eq!(info.status, Some(StatusCode::CREATED));
                    assert_eq!(info.body_bytes, None);
                    assert!(!info.has_principal, "reserved without one");
                }
            });
        }
        /// A purge deletes a record in any state (also past its retention,
        /// still unswept) and fences an in-flight holder off.
        #[test]
        fn admin_purge_deletes_any_record_and_fences_its_holder() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let Some(admin) = store.admin() else { return };
                let key = random_key();
                let holder = acquire(&store, &key, 1, LONG, LONG).await;
                assert!(admin.purge(&key).await.unwrap());
                assert!(!store.complete(&key, &holder, &response(), LONG).await.unwrap());
                assert!(!store.renew(&key, &holder, LONG).await.unwrap());
                assert_eq!(store.get(&key).await.unwrap(), None);
                let owner = acquire(&store, &key, 2, LONG, LONG).await;
                assert!(store.complete(&key, &owner, &response(), LONG).await.unwrap());
                assert!(admin.purge(&key).await.unwrap());
                assert_eq!(store.get(&key).await.unwrap(), None);
                assert!(!admin.purge(&key).await.unwrap());
                acquire(&store, &key, 3, LONG, LONG).await;

                let expired = random_key();
                let owner = acquire(&store, &expired, 1, LONG, LONG).await;
                assert!(store.complete(&expired, &owner, &response(), SHORT).await.unwrap());
                sleep(PAST_SHORT).await;
                assert!(admin.purge(&expired).await.unwrap(), "an unswept record is purged");
                assert_eq!(sweep(&store, 100).await.unwrap(), 0);
            });
        }
        /// A force release frees an in-flight key whoever holds it; the
        /// former holder can no longer complete, renew or release it.
        #[test]
        fn admin_force_release_fences_the_former_holder() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let Some(admin) = store.admin() else { return };
                let key = random_key();
                let former = acquire(&store, &key, 1, LONG, LONG).await;
                assert!(admin.force_release(&key).await.unwrap());
                assert_eq!(admin.inspect(&key).await.unwrap(), None);
                let successor = acquire(&store, &key, 1, LONG, LONG).await;
                assert!(!store.complete(&key, &former, &response(), LONG).await.unwrap());
                assert!(!store.renew(&key, &former, LONG).await.unwrap());
                assert!(!store.release(&key, &former).await.unwrap());
                assert!(store.complete(&key, &successor, &response(), LONG).await.unwrap());
                // A completed record is not released.
                assert!(!admin.force_release(&key).await.unwrap());
                let record = store.get(&key).await.unwrap().expect("still stored");
                assert_eq!(record.state, RecordState::Completed(response()));
                assert!(!admin.force_release(&random_key()).await.unwrap());
            });
        }
        /// A principal's records, in any state, are found and deleted in
        /// batches; nobody else's are touched.
        #[test]
        fn admin_purge_principal_deletes_only_that_principals_records() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let Some(admin) = store.admin() else { return };
                let (alice, bob) = (PrincipalHash([1; 32]), PrincipalHash([2; 32]));
                let mut alices = Vec::new();
                for i in 0..3 {
                    let key = random_key();
                    let owner = acquire_for(&store, &key, LONG, LONG, Some(&alice)).await;
                    if i > 0 {
                        assert!(store.complete(&key, &owner, &response(), LONG).await.unwrap());
                    }
                    alices.push(key);
                }
                let bobs = random_key();
                let owner = acquire_for(&store, &bobs, LONG, LONG, Some(&bob)).await;
                assert!(store.complete(&bobs, &owner, &response(), LONG).await.unwrap());
                let anonymous = random_key();
                acquire_for(&store, &anonymous, LONG, LONG, None).await;
                let plain = random_key();
                acquire(&store, &plain, 1, LONG, LONG).await;

                let mut listed = admin.principal_keys(&alice, 10).await.unwrap();
                listed.sort();
                let mut expected = alices.clone();
                expected.sort();
                assert_eq!(listed, expected);
                let first = admin.purge_principal(&alice, 2).await.unwrap();
                assert_eq!(first.len(), 2);
                let rest = admin.purge_principal(&alice, 10).await.unwrap();
                assert_eq!(rest.len(), 1);
                let mut purged: Vec<ScopeKey> = first.into_iter().chain(rest).collect();
                purged.sort();
                assert_eq!(purged, expected);
                assert!(admin.purge_principal(&alice, 10).await.unwrap().is_empty());
                for key in &alices {
                    assert_eq!(store.get(key).await.unwrap(), None);
                }
                for key in [bobs, anonymous, plain] {
                    assert!(store.get(&key).await.unwrap().is_some(), "another's record");
                }
            });
        }
        /// Old in-flight records are listed oldest first; records are
        /// counted by state, including those awaiting the sweeper.
        #[test]
        fn admin_lists_old_in_flight_records_and_counts_by_state() {
            $crate::store::conformance::run(async { $store.await }, |store| async move {
                #[allow(unused_imports)]
                use $crate::store::conformance::prelude::*;
                let Some(admin) = store.admin() else { return };
                let held = random_key();
                acquire(&store, &held, 1, LONG, LONG).await;
                // Reserved at distinct moments of the store's clock.
                sleep(Duration::from_millis(20)).await;
                let stalled = random_key();
                acquire(&store, &stalled, 1, SHORT, LONG).await;
                for marker in [
                    response(),
                    Outcome::TooLarge { status: StatusCode::OK },
                    Outcome::Incomplete { status: StatusCode::OK },
                ] {
                    let key = random_key();
                    let owner = acquire(&store, &key, 1, LONG, LONG).await;
                    assert!(store.complete(&key, &owner, &marker, LONG).await.unwrap());
                }
                let expired = random_key();
                let owner = acquire(&store, &expired, 1, LONG, LONG).await;
                assert!(store.complete(&expired, &owner, &response(), SHORT).await.unwrap());
                sleep(PAST_SHORT).await;
                let fresh = random_key();
                acquire(&store, &fresh, 1, LONG, LONG).await;

                let counts = admin.counts().await.unwrap();
                let by_state = [
                    counts.in_flight,
                    counts.lease_expired,
                    counts.completed,
                    counts.too_large,
                    counts.incomplete,
                ];
                assert_eq!(by_state, [2, 1, 1, 1, 1], "{counts:?}");
                // A store may drop an expired record before any sweep (the
                // memory store does on later writes).
                assert!(counts.expired <= 1, "{counts:?}");
                assert_eq!(counts.total(), 6 + counts.expired);

                let old = admin.in_flight_older_than(SHORT, 10).await.unwrap();
                let keys: Vec<ScopeKey> = old.iter().map(|info| info.key).collect();
                assert_eq!(keys, vec![held, stalled], "oldest first, not the fresh one");
                assert!(old.iter().all(|info| info.state == KeyState::InFlight));
                assert_eq!(old[1].lease_remaining, Some(Duration::ZERO));
                assert_eq!(admin.in_flight_older_than(SHORT, 1).await.unwrap().len(), 1);
                assert!(admin.in_flight_older_than(LONG, 10).await.unwrap().is_empty());
                assert_eq!(admin.in_flight_older_than(Duration::ZERO, 10).await.unwrap().len(), 3);
            });
        }
    };
}
