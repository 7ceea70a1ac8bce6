//! The SQLite store beyond the conformance suite: durability.
#![cfg(feature = "sqlite")]

mod fixtures;
mod support;

use tower_idempotency::{Engine, Policy, Routes, SqliteStore};

use support::{post_json, Harness};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_key_still_replays_after_the_store_is_reopened() {
    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let policy = Policy::default();
    let routes = || Routes::all(policy.clone()).unwrap();
    let base = Harness::new(policy.clone());

    let store = SqliteStore::connect(path).await.unwrap();
    let before = base.with_engine(Engine::new(store.clone(), routes()));
    let first = before.send(post_json(b"order-1", r#"{"amount": 5}"#)).await;
    assert_eq!(first.status, http::StatusCode::CREATED);
    store.close().await;
    drop(before);

    let reopened = SqliteStore::connect(&format!("sqlite://{path}"))
        .await
        .unwrap();
    let after = base.with_engine(Engine::new(reopened, routes()));
    let again = after.send(post_json(b"order-1", r#"{"amount": 5}"#)).await;
    assert!(again.replayed());
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    assert_eq!(base.calls(), 1);
}

/// The store's id lives in the file: the same after reopening, another for
/// another file (what keeps two deployments apart in a shared Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_id_is_kept_in_the_file() {
    use tower_idempotency::Store;

    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let store = SqliteStore::connect(path).await.unwrap();
    let id = store.identity().await.unwrap().expect("an id");
    store.close().await;
    let reopened = SqliteStore::connect(path).await.unwrap();
    assert_eq!(reopened.identity().await.unwrap(), Some(id.clone()));
    let other = fixtures::sqlite_store().await;
    assert_ne!(other.identity().await.unwrap(), Some(id));
}

/// Concurrent writes are grouped into shared transactions (group commit):
/// every write answered as done is on disk (still there after the file is
/// reopened), and each keeps its own outcome — exactly one of the callers
/// racing for one key acquires it, a completion fenced on the wrong owner
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_writes_keep_each_outcome_and_are_on_disk_when_answered() {
    use std::sync::Arc;
    use std::time::Duration;
    use tower_idempotency::store::{Claim, Outcome, OwnerToken, RecordState};
    use tower_idempotency::Store;

    const REQUESTS: usize = 64;
    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let store = SqliteStore::connect(path).await.unwrap();
    let contested = fixtures::random_key();
    let lease = Duration::from_secs(30);
    let ttl = Duration::from_secs(3600);
    let start = Arc::new(tokio::sync::Barrier::new(REQUESTS));
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|_| {
            let (store, start) = (store.clone(), start.clone());
            tokio::spawn(async move {
                let own = fixtures::random_key();
                let owner = OwnerToken::random();
                let stranger = OwnerToken::random();
                let fp = fixtures::fingerprint(1);
                start.wait().await;
                let contested_claim = store
                    .reserve(&contested, &fp, &OwnerToken::random(), lease, ttl)
                    .await
                    .unwrap();
                let claim = store.reserve(&own, &fp, &owner, lease, ttl).await.unwrap();
                assert!(matches!(claim, Claim::Acquired { takeover: false }));
                let outcome = Outcome::TooLarge {
                    status: http::StatusCode::CREATED,
                };
                let fenced = store
                    .complete(&own, &stranger, &outcome, ttl)
                    .await
                    .unwrap();
                let done = store.complete(&own, &owner, &outcome, ttl).await.unwrap();
                (own, contested_claim, fenced, done)
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    let acquired = results
        .iter()
        .filter(|(_, claim, _, _)| matches!(claim, Claim::Acquired { .. }))
        .count();
    assert_eq!(acquired, 1, "exactly one caller acquires the contested key");
    assert!(results.iter().all(|(_, _, fenced, _)| !fenced));
    assert!(results.iter().all(|(_, _, _, done)| *done));
    store.close().await;

    let reopened = SqliteStore::connect(path).await.unwrap();
    for (key, _, _, _) in &results {
        let record = reopened
            .get(key)
            .await
            .unwrap()
            .expect("a committed record");
        assert!(matches!(record.state, RecordState::Completed(_)));
    }
}

/// A reservation whose commit fails (here a deferred foreign key, checked
/// at commit; in production a full disk or an I/O error on sync) is a
/// store error, never `Acquired`: SQLite rolled the record back, so
/// acquiring would let every retry execute. Each reservation is the
/// writer's only job, so it commits on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_whose_commit_fails_is_an_error_not_acquired() {
    use sqlx::Connection;
    use tower_idempotency::store::OwnerToken;
    use tower_idempotency::Store;

    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let store = SqliteStore::connect(path).await.unwrap();
    let mut sabotage = sqlx::SqliteConnection::connect(&format!("sqlite://{path}"))
        .await
        .unwrap();
    for statement in [
        "CREATE TABLE sabotage_parent (id INTEGER PRIMARY KEY)",
        "CREATE TABLE sabotage_child (parent INTEGER REFERENCES sabotage_parent (id)
             DEFERRABLE INITIALLY DEFERRED)",
        "CREATE TRIGGER sabotage AFTER INSERT ON idempotency_records
             BEGIN INSERT INTO sabotage_child (parent) VALUES (42); END",
    ] {
        sqlx::query(statement).execute(&mut sabotage).await.unwrap();
    }
    sabotage.close().await.unwrap();

    let key = fixtures::random_key();
    let lease = std::time::Duration::from_secs(60);
    for attempt in 0..3 {
        let claim = store
            .reserve(
                &key,
                &fixtures::fingerprint(1),
                &OwnerToken::random(),
                lease,
                lease,
            )
            .await;
        assert!(
            claim.is_err(),
            "attempt {attempt}: a reservation SQLite rolled back answered {claim:?}"
        );
        assert!(store.get(&key).await.unwrap().is_none());
    }
    store.close().await;
}

/// A store on a fresh file whose reservations with fingerprint 9 a
/// trigger answers with `RAISE(action, …)`.
async fn raising_on_fingerprint_9(action: &str) -> std::sync::Arc<SqliteStore> {
    use sqlx::Connection;

    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let store = std::sync::Arc::new(SqliteStore::connect(path).await.unwrap());
    let mut sabotage = sqlx::SqliteConnection::connect(&format!("sqlite://{path}"))
        .await
        .unwrap();
    let trigger = format!(
        "CREATE TRIGGER sabotage BEFORE INSERT ON idempotency_records
         WHEN NEW.fingerprint = X'{}' BEGIN SELECT RAISE({action}, 'refused'); END",
        "09".repeat(32)
    );
    sqlx::query(&trigger).execute(&mut sabotage).await.unwrap();
    sabotage.close().await.unwrap();
    store
}

/// One write SQLite refuses inside a group commit (here a trigger's
/// `RAISE(ABORT)`; in production a response over the blob limit) undoes
/// only its own statement: it fails alone, and the writes grouped with it
/// commit. It used to roll the whole batch back, failing every request
/// that shared it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_sqlite_refuses_fails_alone_in_its_batch() {
    use tower_idempotency::store::{Claim, OwnerToken};
    use tower_idempotency::Store;

    let store = raising_on_fingerprint_9("ABORT").await;

    let lease = std::time::Duration::from_secs(60);
    for round in 0..5 {
        let tasks: Vec<_> = (0..40)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    let refused = i % 10 == 0;
                    let fingerprint = fixtures::fingerprint(if refused { 9 } else { 1 });
                    let key = fixtures::random_key();
                    let claim = store
                        .reserve(&key, &fingerprint, &OwnerToken::random(), lease, lease)
                        .await;
                    (refused, claim)
                })
            })
            .collect();
        for task in tasks {
            let (refused, claim) = task.await.unwrap();
            if refused {
                assert!(
                    claim.is_err(),
                    "round {round}: a refused write answered {claim:?}"
                );
            } else {
                assert!(
                    matches!(claim, Ok(Claim::Acquired { .. })),
                    "round {round}: a write grouped with a refused one: {claim:?}"
                );
            }
        }
    }
    store.close().await;
}

/// A write that makes SQLite roll back the whole transaction by itself
/// (here a trigger's `RAISE(ROLLBACK)`) ends the group commit's
/// transaction under it: its commit and its rollback both fail, and the
/// writer replaces its connection (the path a ROLLBACK failing with the
/// transaction still open takes, which needs an I/O fault to produce and
/// has no test of its own). Whatever happened in that batch, no caller is
/// told of a reservation that is not on disk, and the writes after it,
/// on the new connection, work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_sqlite_rolled_back_itself_tells_no_caller_of_a_lost_write() {
    use tower_idempotency::store::{Claim, OwnerToken};
    use tower_idempotency::Store;

    let store = raising_on_fingerprint_9("ROLLBACK").await;

    let lease = std::time::Duration::from_secs(60);
    let mut acquired = 0;
    for round in 0..6 {
        let tasks: Vec<_> = (0..40)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    // The last rounds carry no sabotage: the writer works on.
                    let undone = round < 4 && i % 13 == 5;
                    let fingerprint = fixtures::fingerprint(if undone { 9 } else { 1 });
                    let key = fixtures::random_key();
                    let claim = store
                        .reserve(&key, &fingerprint, &OwnerToken::random(), lease, lease)
                        .await;
                    (key, claim)
                })
            })
            .collect();
        for task in tasks {
            let (key, claim) = task.await.unwrap();
            match claim {
                Ok(Claim::Acquired { .. }) => {
                    acquired += 1;
                    let record = store.get(&key).await.unwrap();
                    assert!(
                        record.is_some(),
                        "round {round}: told acquired, nothing on disk"
                    );
                }
                Ok(other) => panic!("round {round}: a new key answered {other:?}"),
                // Told it failed, it may still be on disk (a write after
                // the rollback ran on its own): the harmless direction, which
                // the engine answers by releasing its reservation.
                Err(error) => assert!(round < 4, "round {round}: {error}"),
            }
        }
    }
    assert!(acquired >= 80, "the writes after the sabotage: {acquired}");
    store.close().await;
}

/// A completed record the store cannot decode (bytes altered on disk, or
/// written by a newer version in a form this one does not know) proves the
/// request ran: a fail-open route answers 503 for it, as for a record that
/// cannot be opened, instead of forwarding the retry to run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_cannot_be_decoded_is_never_run_again_on_a_fail_open_route() {
    use sqlx::Connection;
    use tower_idempotency::policy::FailMode;

    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let policy = Policy {
        fail_mode: FailMode::Open,
        ..Policy::default()
    };
    let store = SqliteStore::connect(path).await.unwrap();
    let app =
        Harness::new(policy.clone()).with_engine(Engine::new(store, Routes::all(policy).unwrap()));
    let first = app.send(post_json(b"order-9", r#"{"amount": 5}"#)).await;
    assert_eq!(first.status, http::StatusCode::CREATED);

    let mut sabotage = sqlx::SqliteConnection::connect(&format!("sqlite://{path}"))
        .await
        .unwrap();
    let altered = sqlx::query("UPDATE idempotency_records SET headers = X'ffffffff'")
        .execute(&mut sabotage)
        .await
        .unwrap();
    assert_eq!(altered.rows_affected(), 1);
    sabotage.close().await.unwrap();

    for _ in 0..3 {
        let retry = app.send(post_json(b"order-9", r#"{"amount": 5}"#)).await;
        assert_eq!(retry.status, http::StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(
        app.calls(),
        1,
        "a retry of a request that ran was run again"
    );
}

/// Scenario (from a review of operations): the database file can no
/// longer be written (opened read-only here, as after its volume is
/// remounted read-only; a full disk or a lock another process holds fail
/// writes alike). Every reservation fails, while the health check, a
/// `SELECT 1`, still passed: `/healthz` stayed 200 and a load balancer
/// kept sending traffic to a proxy answering every covered request 503.
/// The check now writes, and fails with the reservations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_cannot_be_written_is_not_healthy() {
    use std::str::FromStr;
    use std::time::Duration;
    use tower_idempotency::store::OwnerToken;
    use tower_idempotency::Store;

    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let store = SqliteStore::connect(path).await.unwrap();
    assert!(store.ping().await.is_ok());
    let options =
        sqlx::sqlite::SqliteConnectOptions::from_str(&format!("sqlite://{path}?mode=ro")).unwrap();
    let read_only = SqliteStore::connect_with(options).await.unwrap();
    let long = Duration::from_secs(600);
    let owner = OwnerToken::random();
    let key = fixtures::random_key();
    let claim = read_only
        .reserve(&key, &fixtures::fingerprint(1), &owner, long, long)
        .await;
    assert!(claim.is_err(), "{claim:?}");
    let health = read_only.ping().await;
    assert!(
        health.is_err(),
        "healthy while no reservation can be written"
    );
    read_only.close().await;
    store.close().await;
}
