//! The PostgreSQL reservation under contention: a reservation is one
//! statement (the key's row, or a new record when there is none) unless
//! that statement cannot decide — a row committed after its snapshot, a
//! record to take over — and then the read-first protocol runs. Each test
//! drives one of those paths with many parallel callers on separate
//! connections, so a fast path that answered differently from the protocol
//! would let two callers acquire, or none.
#![cfg(feature = "postgres")]

mod fixtures;

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use tower_idempotency::store::{Claim, Outcome, OwnerToken, RecordState, StoredResponse};
use tower_idempotency::{PostgresStore, Store};

use fixtures::{fingerprint, fresh_schema, pool, random_key};

const LONG: Duration = Duration::from_secs(600);
const SHORT: Duration = Duration::from_millis(100);

fn outcome() -> Outcome {
    Outcome::Stored(StoredResponse {
        status: http::StatusCode::CREATED,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"done"),
    })
}

/// `n` stores on `options`, each with a pool of one connection (so every
/// caller runs on its own server backend), the first one migrated.
async fn stores(options: &PgConnectOptions, n: usize) -> Vec<PostgresStore> {
    let stores = join_all(
        (0..n).map(|_| async { PostgresStore::from_pool(pool(options.clone(), 1).await) }),
    )
    .await;
    stores[0].migrate().await.unwrap();
    stores
}

/// Fifty callers reserve the same new key at the same moment, twenty keys
/// in a row: every time exactly one acquires (not as a takeover) and all
/// others see that caller's record in flight, with its fingerprint; only
/// the winner's token completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_parallel_reservations_of_a_new_key_have_one_winner_and_the_rest_wait() {
    let options = fresh_schema().await;
    let stores = stores(&options, 50).await;
    for _ in 0..20 {
        let key = random_key();
        let start = Arc::new(tokio::sync::Barrier::new(stores.len()));
        let claims = join_all(stores.iter().cloned().map(|store| {
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                let owner = OwnerToken::random();
                let claim = store
                    .reserve(&key, &fingerprint(1), &owner, LONG, LONG)
                    .await
                    .unwrap();
                (owner, claim)
            })
        }))
        .await;
        let mut winners = Vec::new();
        for (owner, claim) in claims.into_iter().map(Result::unwrap) {
            match claim {
                Claim::Acquired { takeover: false } => winners.push(owner),
                Claim::Acquired { takeover: true } => panic!("a new key was taken over"),
                Claim::Existing(record) => {
                    assert_eq!(record.fingerprint, fingerprint(1));
                    assert!(
                        matches!(record.state, RecordState::InFlight { lease_remaining } if !lease_remaining.is_zero()),
                        "{record:?}"
                    );
                }
            }
        }
        assert_eq!(winners.len(), 1, "winners: {winners:?}");
        let store = &stores[0];
        assert!(!store
            .complete(&key, &OwnerToken::random(), &outcome(), LONG)
            .await
            .unwrap());
        assert!(store
            .complete(&key, &winners[0], &outcome(), LONG)
            .await
            .unwrap());
    }
    join_all(stores.iter().map(PostgresStore::close)).await;
}

/// What one caller saw while it reserved a key again and again.
#[derive(Default)]
struct Seen {
    acquired: Vec<(OwnerToken, bool)>,
    /// The fingerprint of each record answered instead.
    existing: Vec<tower_idempotency::store::Fingerprint>,
}

/// Every store in `stores` reserves `key` over and over (fingerprint
/// `fp(i)` for the `i`-th) until `until` passes, a fresh token each time.
async fn hammer(
    stores: &[PostgresStore],
    key: tower_idempotency::store::ScopeKey,
    fp: impl Fn(usize) -> u8,
    until: Duration,
) -> Vec<Seen> {
    let deadline = tokio::time::Instant::now() + until;
    let tasks = stores.iter().cloned().enumerate().map(|(i, store)| {
        let fp = fingerprint(fp(i));
        tokio::spawn(async move {
            let mut seen = Seen::default();
            while tokio::time::Instant::now() < deadline {
                let owner = OwnerToken::random();
                match store.reserve(&key, &fp, &owner, LONG, LONG).await.unwrap() {
                    Claim::Acquired { takeover } => seen.acquired.push((owner, takeover)),
                    Claim::Existing(record) => seen.existing.push(record.fingerprint),
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            seen
        })
    });
    join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// Thirty callers keep reserving a key whose holder's lease runs out while
/// they do: exactly one of those with the holder's fingerprint takes it
/// over, none with another fingerprint ever does, every other call sees the
/// record, and the crashed holder is fenced out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_running_out_under_thirty_reservers_is_taken_over_once() {
    let options = fresh_schema().await;
    let stores = stores(&options, 30).await;
    let key = random_key();
    let crashed = OwnerToken::random();
    assert_eq!(
        stores[0]
            .reserve(&key, &fingerprint(1), &crashed, SHORT, LONG)
            .await
            .unwrap(),
        Claim::Acquired { takeover: false }
    );

    // Callers with an even index send the holder's request, the others a
    // different body under the same key.
    let seen = hammer(&stores, key, |i| if i % 2 == 0 { 1 } else { 2 }, SHORT * 5).await;
    let mut successors = Vec::new();
    for (i, seen) in seen.iter().enumerate() {
        if i % 2 == 1 {
            assert!(seen.acquired.is_empty(), "a different request took over");
        }
        successors.extend(seen.acquired.iter().copied());
        assert!(seen.existing.iter().all(|fp| *fp == fingerprint(1)));
    }
    assert_eq!(successors.len(), 1, "{successors:?}");
    let (successor, takeover) = successors[0];
    assert!(takeover, "the lease was taken over, not the key reused");

    let store = &stores[0];
    assert!(!store
        .complete(&key, &crashed, &outcome(), LONG)
        .await
        .unwrap());
    assert!(store
        .complete(&key, &successor, &outcome(), LONG)
        .await
        .unwrap());
    join_all(stores.iter().map(PostgresStore::close)).await;
}

/// Thirty callers keep reserving a key whose completed record's retention
/// runs out while they do: until then each gets the stored response; then
/// exactly one of them reserves the key afresh (a reused key, not a
/// takeover) and the rest see that reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_expiring_under_thirty_reservers_is_reserved_again_once() {
    let options = fresh_schema().await;
    let stores = stores(&options, 30).await;
    let key = random_key();
    let first = OwnerToken::random();
    let store = &stores[0];
    assert_eq!(
        store
            .reserve(&key, &fingerprint(1), &first, LONG, LONG)
            .await
            .unwrap(),
        Claim::Acquired { takeover: false }
    );
    assert!(store
        .complete(&key, &first, &outcome(), SHORT)
        .await
        .unwrap());

    let seen = hammer(&stores, key, |i| (i % 3) as u8 + 1, SHORT * 5).await;
    let winners: Vec<_> = seen.iter().flat_map(|seen| seen.acquired.clone()).collect();
    assert_eq!(winners.len(), 1, "{winners:?}");
    let (winner, takeover) = winners[0];
    assert!(
        !takeover,
        "an expired record's key is reused, not taken over"
    );
    assert!(seen.iter().any(|seen| !seen.existing.is_empty()));

    match store.get(&key).await.unwrap().unwrap().state {
        RecordState::InFlight { .. } => {}
        other => panic!("expected the new reservation, got {other:?}"),
    }
    assert!(!store
        .complete(&key, &first, &outcome(), LONG)
        .await
        .unwrap());
    assert!(store
        .complete(&key, &winner, &outcome(), LONG)
        .await
        .unwrap());
    join_all(stores.iter().map(PostgresStore::close)).await;
}

/// Waits until a backend of `application` waits for a lock.
async fn until_blocked(admin: &mut PgConnection, application: &str) {
    for _ in 0..1000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = $1 AND wait_event_type = 'Lock'",
        )
        .bind(application)
        .fetch_one(&mut *admin)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the reservation never waited for the other transaction's row");
}

/// A reservation whose statement began before another transaction's
/// record for the same key was committed: its snapshot holds no row, its
/// insert meets one. It must answer with that record (committed), or
/// acquire the key when the other transaction rolls back — never both,
/// never neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committed_after_the_reservations_snapshot_is_read_not_overwritten() {
    let options = fresh_schema().await;
    let application = format!("reserve_snapshot_{}", std::process::id());
    let store =
        PostgresStore::from_pool(pool(options.clone().application_name(&application), 1).await);
    store.migrate().await.unwrap();
    let mut admin = PgConnection::connect_with(&options).await.unwrap();

    for commit in [true, false] {
        let key = random_key();
        let mut other = PgConnection::connect_with(&options).await.unwrap();
        let mut tx = other.begin().await.unwrap();
        let others = OwnerToken::random();
        sqlx::query(
            "INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at)
             VALUES ($1, $2, $3, 'in_flight', now() + interval '10 minutes', now() + interval '10 minutes')",
        )
        .bind(key.as_bytes().as_slice())
        .bind(fingerprint(1).as_bytes().as_slice())
        .bind(others.as_bytes().as_slice())
        .execute(&mut *tx)
        .await
        .unwrap();

        let mine = OwnerToken::random();
        let reserving = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .reserve(&key, &fingerprint(1), &mine, LONG, LONG)
                    .await
            })
        };
        until_blocked(&mut admin, &application).await;
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let claim = reserving.await.unwrap().unwrap();
        let (winner, loser) = if commit {
            match claim {
                Claim::Existing(record) => {
                    assert_eq!(record.fingerprint, fingerprint(1));
                    assert!(matches!(record.state, RecordState::InFlight { .. }));
                }
                other => panic!("acquired a key another transaction holds: {other:?}"),
            }
            (others, mine)
        } else {
            assert_eq!(claim, Claim::Acquired { takeover: false });
            (mine, others)
        };
        assert!(!store
            .complete(&key, &loser, &outcome(), LONG)
            .await
            .unwrap());
        assert!(store
            .complete(&key, &winner, &outcome(), LONG)
            .await
            .unwrap());
        other.close().await.unwrap();
    }
    admin.close().await.unwrap();
    store.close().await;
}
