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
        acquire, fingerprint, in_flight, random_key, reserve_at_once, response, sweep, LONG,
        PAST_SHORT, SHORT,
    };
    pub use crate::store::{
        Claim, Fingerprint, Outcome, OwnerToken, Record, RecordState, ScopeKey, SealedOutcome,
        Store, StoredResponse,
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
    };
}
