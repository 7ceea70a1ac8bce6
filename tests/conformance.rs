//! One conformance suite for every [`Store`]: a store that passes it can be
//! swapped for any other.
//!
//! To check a new backend, add one line at the bottom:
//! `conformance!(name, async { /* a fresh, empty store */ });`

mod fixtures;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use tower_idempotency::store::{Claim, Outcome, OwnerToken, Record, RecordState, StoredResponse};
use tower_idempotency::{MemoryStore, Store};

/// Instantiates every test of [`suite`] for one store; `$store` is an async
/// expression that yields a fresh, empty store (evaluated once per test).
macro_rules! conformance {
    ($name:ident, $store:expr) => {
        mod $name {
            use super::*;
            conformance!(@tests $store;
                fresh_key_is_acquired,
                duplicate_sees_the_record_in_flight,
                completed_response_replays_exactly,
                too_large_marker_round_trips,
                wrong_owner_is_refused,
                release_frees_the_key,
                renew_keeps_the_lease_and_the_record,
                expired_lease_is_taken_over_by_the_same_fingerprint_only,
                expired_retention_frees_the_key,
                sweep_deletes_only_expired_records_in_batches,
                concurrent_reservations_have_one_winner
            );
        }
    };
    (@tests $store:expr; $($test:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let store: Arc<dyn Store> = Arc::new($store.await);
                suite::$test(store).await;
            }
        )*
    };
}

conformance!(memory, async { MemoryStore::new() });
#[cfg(feature = "sqlite")]
conformance!(sqlite, fixtures::sqlite_store());
#[cfg(feature = "postgres")]
conformance!(postgres, fixtures::postgres_store());
#[cfg(feature = "redis")]
conformance!(redis_memory, async {
    fixtures::redis_cache(MemoryStore::new())
});
#[cfg(all(feature = "redis", feature = "postgres"))]
conformance!(redis_postgres, async {
    fixtures::redis_cache(fixtures::postgres_store().await)
});

/// The tests, each against a fresh store.
mod suite {
    use super::*;
    use fixtures::{fingerprint, random_key, reserve_at_once};

    /// A lease or retention that does not run out during a test.
    const LONG: Duration = Duration::from_secs(600);
    /// A lease or retention that has run out after [`PAST_SHORT`].
    const SHORT: Duration = Duration::from_millis(100);
    const PAST_SHORT: Duration = Duration::from_millis(250);

    async fn acquire(
        store: &Arc<dyn Store>,
        key: &tower_idempotency::store::ScopeKey,
        fp: u8,
        lease: Duration,
        ttl: Duration,
    ) -> OwnerToken {
        match store
            .reserve(key, &fingerprint(fp), lease, ttl)
            .await
            .unwrap()
        {
            Claim::Acquired {
                owner,
                takeover: false,
            } => owner,
            other => panic!("expected a fresh reservation, got {other:?}"),
        }
    }

    fn response() -> Outcome {
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

    fn in_flight(record: &Record) -> Duration {
        match record.state {
            RecordState::InFlight { lease_remaining } => lease_remaining,
            ref other => panic!("expected an in-flight record, got {other:?}"),
        }
    }

    pub(super) async fn fresh_key_is_acquired(store: Arc<dyn Store>) {
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
    }

    pub(super) async fn duplicate_sees_the_record_in_flight(store: Arc<dyn Store>) {
        let key = random_key();
        acquire(&store, &key, 1, LONG, LONG).await;
        for fp in [1, 2] {
            match store
                .reserve(&key, &fingerprint(fp), LONG, LONG)
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
    }

    pub(super) async fn completed_response_replays_exactly(store: Arc<dyn Store>) {
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
                        .reserve(&key, &fingerprint(fp), LONG, LONG)
                        .await
                        .unwrap(),
                    Claim::Existing(completed.clone())
                );
            }
        }
    }

    pub(super) async fn too_large_marker_round_trips(store: Arc<dyn Store>) {
        let key = random_key();
        let owner = acquire(&store, &key, 1, LONG, LONG).await;
        let marker = Outcome::TooLarge {
            status: StatusCode::CREATED,
        };
        assert!(store.complete(&key, &owner, &marker, LONG).await.unwrap());
        let record = store.get(&key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(marker));
    }

    pub(super) async fn wrong_owner_is_refused(store: Arc<dyn Store>) {
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
    }

    pub(super) async fn release_frees_the_key(store: Arc<dyn Store>) {
        let key = random_key();
        let owner = acquire(&store, &key, 1, LONG, LONG).await;
        assert!(store.release(&key, &owner).await.unwrap());
        assert_eq!(store.get(&key).await.unwrap(), None);
        assert!(!store.release(&key, &owner).await.unwrap());
        // A corrected request (another fingerprint) now goes through.
        acquire(&store, &key, 2, LONG, LONG).await;
    }

    pub(super) async fn renew_keeps_the_lease_and_the_record(store: Arc<dyn Store>) {
        let key = random_key();
        // Lease and retention both short: the call outlives its ttl.
        let owner = acquire(&store, &key, 1, SHORT, SHORT).await;
        assert!(store.renew(&key, &owner, LONG).await.unwrap());
        tokio::time::sleep(PAST_SHORT).await;
        assert_eq!(store.sweep(100).await.unwrap(), 0);
        for fp in [1, 2] {
            assert!(matches!(
                store
                    .reserve(&key, &fingerprint(fp), LONG, LONG)
                    .await
                    .unwrap(),
                Claim::Existing(_)
            ));
        }
        assert!(store
            .complete(&key, &owner, &response(), LONG)
            .await
            .unwrap());
    }

    pub(super) async fn expired_lease_is_taken_over_by_the_same_fingerprint_only(
        store: Arc<dyn Store>,
    ) {
        let key = random_key();
        let crashed = acquire(&store, &key, 1, SHORT, LONG).await;
        tokio::time::sleep(PAST_SHORT).await;

        match store
            .reserve(&key, &fingerprint(2), LONG, LONG)
            .await
            .unwrap()
        {
            Claim::Existing(record) => {
                assert_eq!(record.fingerprint, fingerprint(1));
                assert_eq!(in_flight(&record), Duration::ZERO);
            }
            other => panic!("another request took over: {other:?}"),
        }
        let successor = match store
            .reserve(&key, &fingerprint(1), LONG, LONG)
            .await
            .unwrap()
        {
            Claim::Acquired {
                owner,
                takeover: true,
            } => owner,
            other => panic!("expected a takeover, got {other:?}"),
        };
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
    }

    pub(super) async fn expired_retention_frees_the_key(store: Arc<dyn Store>) {
        let completed = random_key();
        let owner = acquire(&store, &completed, 1, LONG, LONG).await;
        assert!(store
            .complete(&completed, &owner, &response(), SHORT)
            .await
            .unwrap());
        let in_flight = random_key();
        acquire(&store, &in_flight, 1, LONG, SHORT).await;
        tokio::time::sleep(PAST_SHORT).await;

        for key in [completed, in_flight] {
            assert_eq!(store.get(&key).await.unwrap(), None);
            // Reusable by any request, and not a takeover.
            acquire(&store, &key, 2, LONG, LONG).await;
        }
    }

    pub(super) async fn sweep_deletes_only_expired_records_in_batches(store: Arc<dyn Store>) {
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
        tokio::time::sleep(PAST_SHORT).await;

        assert_eq!(store.sweep(2).await.unwrap(), 2);
        assert_eq!(store.sweep(100).await.unwrap(), 3);
        assert_eq!(store.sweep(100).await.unwrap(), 0);
        for key in &live {
            assert!(
                store.get(key).await.unwrap().is_some(),
                "a live record was swept"
            );
        }
    }

    pub(super) async fn concurrent_reservations_have_one_winner(store: Arc<dyn Store>) {
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
    }
}
