//! The PostgreSQL store beyond the conformance suite: separate connections,
//! several instances on one database, an outage, the sweeper.
#![cfg(feature = "postgres")]

mod fixtures;
mod support;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tower_idempotency::store::{Claim, Outcome, OwnerToken, StoredResponse};
use tower_idempotency::{Engine, Policy, PostgresStore, Routes, Store, StoreError};

use fixtures::{
    fingerprint, fresh_schema, pool, postgres_store, random_key, reserve_at_once, Switch,
};
use support::{post_json, Harness};

const LONG: Duration = Duration::from_secs(600);

fn routes(policy: &Policy) -> Routes {
    Routes::all(policy.clone()).unwrap()
}

fn shared(stores: &[PostgresStore]) -> Vec<Arc<dyn Store>> {
    stores
        .iter()
        .map(|store| Arc::new(store.clone()) as Arc<dyn Store>)
        .collect()
}

fn outcome() -> Outcome {
    Outcome::Stored(StoredResponse {
        status: http::StatusCode::CREATED,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"done"),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_connections_reserving_one_key_let_exactly_one_proceed() {
    let options = fresh_schema().await;
    let stores = join_all(
        (0..50).map(|_| async { PostgresStore::from_pool(pool(options.clone(), 1).await) }),
    )
    .await;
    stores[0].migrate().await.unwrap();

    let claims = reserve_at_once(shared(&stores), random_key(), LONG).await;
    // Exactly one owner, by a fresh reservation: no second one by a
    // "takeover" of a lease that cannot have run out.
    let acquired: Vec<_> = claims
        .iter()
        .filter(|(_, claim)| matches!(claim, Claim::Acquired { .. }))
        .collect();
    assert_eq!(acquired.len(), 1, "{claims:?}");
    assert!(
        matches!(acquired[0].1, Claim::Acquired { takeover: false }),
        "{claims:?}"
    );
    join_all(stores.iter().map(PostgresStore::close)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_database_execute_a_request_once() {
    let options = fresh_schema().await;
    let first = PostgresStore::from_pool(pool(options.clone(), 10).await);
    first.migrate().await.unwrap();
    let second = PostgresStore::from_pool(pool(options, 10).await);
    let policy = Policy::default();
    // Each execution lasts long enough for the duplicates to overlap it.
    let base = Harness::new(policy.clone()).slow(Duration::from_millis(20));
    let instances = [
        base.with_engine(Engine::new(first, routes(&policy))),
        base.with_engine(Engine::new(second, routes(&policy))),
    ];

    let replies = join_all((0..40).map(|i| {
        let instance = instances[i % 2].clone();
        tokio::spawn(async move {
            instance
                .send(post_json(b"order-7", r#"{"amount": 5}"#))
                .await
        })
    }))
    .await;

    assert_eq!(base.calls(), 1);
    let replies: Vec<_> = replies.into_iter().map(Result::unwrap).collect();
    for reply in &replies {
        assert_eq!(reply.status, http::StatusCode::CREATED);
        assert_eq!(reply.text(), "order 1");
    }
    assert_eq!(replies.iter().filter(|reply| !reply.replayed()).count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_taken_over_by_exactly_one_of_twenty_retries() {
    let options = fresh_schema().await;
    let stores = join_all(
        (0..20).map(|_| async { PostgresStore::from_pool(pool(options.clone(), 1).await) }),
    )
    .await;
    stores[0].migrate().await.unwrap();
    let key = random_key();
    let crashed = OwnerToken::random();
    match stores[0]
        .reserve(
            &key,
            &fingerprint(1),
            &crashed,
            Duration::from_millis(100),
            LONG,
        )
        .await
        .unwrap()
    {
        Claim::Acquired { .. } => {}
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(250)).await;

    let claims = reserve_at_once(shared(&stores), key, LONG).await;
    let successors: Vec<_> = claims
        .iter()
        .filter_map(|(owner, claim)| match claim {
            Claim::Acquired { takeover } => {
                assert!(takeover);
                Some(*owner)
            }
            Claim::Existing(_) => None,
        })
        .collect();
    assert_eq!(successors.len(), 1, "{claims:?}");

    let store = &stores[0];
    assert!(!store
        .complete(&key, &crashed, &outcome(), LONG)
        .await
        .unwrap());
    assert!(store
        .complete(&key, &successors[0], &outcome(), LONG)
        .await
        .unwrap());
    assert_eq!(
        store.get(&key).await.unwrap().unwrap().state,
        tower_idempotency::store::RecordState::Completed(outcome())
    );
    join_all(stores.iter().map(PostgresStore::close)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_fails_closed_and_recovers_without_restart() {
    let options = fresh_schema().await;
    let switch = Switch::start(&options).await;
    let store = PostgresStore::from_pool(pool(switch.route(&options), 5).await);
    store.migrate().await.unwrap();
    let policy = Policy::default();
    let harness = Harness::new(policy.clone()).with_engine(Engine::new(store, routes(&policy)));

    let first = harness.send(post_json(b"before", "{}")).await;
    assert_eq!(first.status, http::StatusCode::CREATED);
    assert_eq!(harness.calls(), 1);

    switch.set(false).await;
    for key in [&b"before"[..], b"during"] {
        let reply = harness.send(post_json(key, "{}")).await;
        assert_eq!(reply.status, http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(reply.headers.contains_key(http::header::RETRY_AFTER));
        assert_eq!(
            reply.problem_type(),
            "urn:tower-idempotency:store-unavailable"
        );
    }
    assert!(harness.engine.health().await.is_err());
    assert_eq!(
        harness.calls(),
        1,
        "the inner service ran during the outage"
    );

    switch.set(true).await;
    let during = harness.send(post_json(b"during", "{}")).await;
    assert_eq!(during.status, http::StatusCode::CREATED);
    assert_eq!(during.text(), "order 2");
    let before = harness.send(post_json(b"before", "{}")).await;
    assert!(before.replayed());
    assert_eq!(before.text(), "order 1");
    assert_eq!(harness.calls(), 2);
    assert!(harness.engine.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_removes_only_expired_records() {
    let store = postgres_store().await;
    let short = Duration::from_millis(100);
    let mut live = Vec::new();
    for i in 0..8 {
        let key = random_key();
        let ttl = if i < 5 { short } else { LONG };
        let owner = OwnerToken::random();
        let Claim::Acquired { .. } = store
            .reserve(&key, &fingerprint(1), &owner, LONG, ttl)
            .await
            .unwrap()
        else {
            panic!("a fresh key was not acquired");
        };
        if i % 2 == 0 {
            assert!(store.complete(&key, &owner, &outcome(), ttl).await.unwrap());
        }
        if i >= 5 {
            live.push(key);
        }
    }
    tokio::time::sleep(Duration::from_millis(250)).await;

    let engine = Engine::new(store.clone(), routes(&Policy::default()));
    let sweeper = engine.spawn_sweeper(Duration::from_millis(20), 2);
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idempotency_records")
            .fetch_one(store.pool())
            .await
            .unwrap()
    };
    for _ in 0..500 {
        if count().await == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sweeper.abort();
    assert_eq!(count().await, 3);
    for key in &live {
        assert!(
            store.get(key).await.unwrap().is_some(),
            "a live record was swept"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_record_is_an_error_not_a_panic_or_a_replay() {
    let store = postgres_store().await;
    let key = random_key();
    // Completed, with headers that are not what `encode_headers` writes.
    sqlx::query(
        "INSERT INTO idempotency_records (key, fingerprint, state, expires_at, status, headers, body)
         VALUES ($1, $2, 'completed', now() + interval '1 hour', 200, '\\x00000009'::bytea, '')",
    )
    .bind(key.as_bytes().as_slice())
    .bind(fingerprint(1).as_bytes().as_slice())
    .execute(store.pool())
    .await
    .unwrap();

    assert!(matches!(store.get(&key).await, Err(StoreError::Corrupt(_))));
    assert!(matches!(
        store
            .reserve(&key, &fingerprint(1), &OwnerToken::random(), LONG, LONG)
            .await,
        Err(StoreError::Corrupt(_))
    ));
}

/// Two deployments with separate databases (staging and production) that
/// share one Redis under the same key prefix: neither ever replays the
/// other's response, because the cache's namespace carries the id kept in
/// each database. (Before, the second deployment's request was answered
/// from the first one's cached response and never executed.)
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_databases_sharing_one_redis_never_replay_each_others_responses() {
    use tower_idempotency::{RedisCache, RedisCacheConfig};

    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    // One prefix for both, as two deployments left at the default would.
    let prefix = format!("test:shared:{}:", uuid::Uuid::new_v4().simple());
    let cache = |store: PostgresStore| {
        RedisCache::new(
            store,
            RedisCacheConfig::new(url.clone()).prefix(prefix.clone()),
        )
        .unwrap()
    };
    let (staging, production) = (cache(postgres_store().await), cache(postgres_store().await));
    let policy = Policy::default();
    let base = Harness::new(policy.clone());
    let deployments = [
        base.with_engine(Engine::new(staging.clone(), routes(&policy))),
        base.with_engine(Engine::new(production.clone(), routes(&policy))),
    ];

    for (i, deployment) in deployments.iter().enumerate() {
        let first = deployment
            .send(post_json(b"order-1001", r#"{"amount": 5}"#))
            .await;
        assert_eq!(first.status, http::StatusCode::CREATED);
        assert!(
            !first.replayed(),
            "deployment {i} replayed another's response"
        );
        assert_eq!(first.text(), format!("order {}", i + 1));
        staging.settled().await;
        production.settled().await;
    }
    assert_eq!(base.calls(), 2);
    // Each replays its own, from Redis.
    for (i, deployment) in deployments.iter().enumerate() {
        let again = deployment
            .send(post_json(b"order-1001", r#"{"amount": 5}"#))
            .await;
        assert!(again.replayed());
        assert_eq!(again.text(), format!("order {}", i + 1));
    }
    assert_eq!(base.calls(), 2);
    assert_ne!(staging.namespace(), production.namespace());
    assert!(staging.namespace().unwrap().starts_with(&prefix));
}

// ---------------------------------------------------------------------------
// Conflicts: what PostgreSQL-compatible engines with optimistic concurrency
// answer under contention (SQLSTATE 40001), and deadlocks (40P01). A trigger
// on this test's own table raises them; a sequence (which no rollback
// undoes) counts every attempt that reached the table.

/// Makes every write to the records table of `store` fail with SQLSTATE
/// `code`: the first `failures` attempts, or all of them with `None`.
async fn inject_conflicts(store: &PostgresStore, code: &str, failures: Option<i64>) {
    let limit = failures.map_or("true".to_owned(), |n| format!("n <= {n}"));
    for statement in [
        "CREATE SEQUENCE IF NOT EXISTS injected".to_owned(),
        "SELECT setval('injected', 1, false)".to_owned(),
        format!(
            "CREATE OR REPLACE FUNCTION inject_conflict() RETURNS trigger LANGUAGE plpgsql AS $$
             DECLARE n bigint := nextval('injected');
             BEGIN
               IF {limit} THEN
                 RAISE EXCEPTION 'injected conflict %', n USING ERRCODE = '{code}';
               END IF;
               RETURN COALESCE(NEW, OLD);
             END $$"
        ),
        "DROP TRIGGER IF EXISTS inject_conflict ON idempotency_records".to_owned(),
        "CREATE TRIGGER inject_conflict BEFORE INSERT OR UPDATE OR DELETE
         ON idempotency_records FOR EACH ROW EXECUTE FUNCTION inject_conflict()"
            .to_owned(),
    ] {
        sqlx::query(&statement).execute(store.pool()).await.unwrap();
    }
}

/// How many writes reached the table since [`inject_conflicts`].
async fn attempts(store: &PostgresStore) -> i64 {
    sqlx::query_scalar("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM injected")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn serialization_failures_and_deadlocks_are_retried_until_the_statement_goes_through() {
    for code in ["40001", "40P01"] {
        let store = postgres_store().await;
        let (key, owner) = (random_key(), OwnerToken::random());

        inject_conflicts(&store, code, Some(3)).await;
        let claim = store
            .reserve(&key, &fingerprint(1), &owner, LONG, LONG)
            .await
            .unwrap_or_else(|e| panic!("{code}: reserve gave up: {e}"));
        assert!(
            matches!(claim, Claim::Acquired { takeover: false }),
            "{claim:?}"
        );
        assert_eq!(
            attempts(&store).await,
            4,
            "{code}: three conflicts, then the insert"
        );

        inject_conflicts(&store, code, Some(2)).await;
        assert!(store.renew(&key, &owner, LONG).await.unwrap(), "{code}");
        assert_eq!(attempts(&store).await, 3, "{code}");

        inject_conflicts(&store, code, Some(2)).await;
        assert!(store
            .complete(&key, &owner, &outcome(), LONG)
            .await
            .unwrap());
        assert_eq!(attempts(&store).await, 3, "{code}");
        let record = store
            .get(&key)
            .await
            .unwrap()
            .expect("the completed record");
        assert_eq!(
            record.state,
            tower_idempotency::store::RecordState::Completed(outcome())
        );

        // A release that conflicted still releases (once).
        let (other, holder) = (random_key(), OwnerToken::random());
        inject_conflicts(&store, code, Some(0)).await;
        store
            .reserve(&other, &fingerprint(2), &holder, LONG, LONG)
            .await
            .unwrap();
        inject_conflicts(&store, code, Some(2)).await;
        assert!(store.release(&other, &holder).await.unwrap(), "{code}");
        assert_eq!(store.get(&other).await.unwrap(), None);
        store.close().await;
    }
}

/// Twenty concurrent duplicates through the engine, while the database
/// answers the first ten writes with serialization failures: retried, they
/// still execute the request exactly once, and every duplicate gets its
/// answer (none a 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_duplicates_still_execute_once() {
    let store = postgres_store().await;
    inject_conflicts(&store, "40001", Some(10)).await;
    let policy = Policy::default();
    let base = Harness::new(policy.clone()).slow(Duration::from_millis(20));
    let instance = base.with_engine(Engine::new(store.clone(), routes(&policy)));
    let replies = join_all((0..20).map(|_| {
        let instance = instance.clone();
        tokio::spawn(async move { instance.send(post_json(b"order-40001", "{}")).await })
    }))
    .await;
    assert_eq!(base.calls(), 1);
    for reply in replies {
        let reply = reply.unwrap();
        assert_eq!(reply.status, http::StatusCode::CREATED);
        assert_eq!(reply.text(), "order 1");
    }
    assert!(attempts(&store).await > 10, "the conflicts were not raised");
}

/// A conflict that never ends: the store gives up at its retry budget with
/// a store error that carries the database's code, and through the engine
/// the request is refused with 503 and never executed — whether the
/// store's budget or the engine's `store_timeout` ends it first.
#[tokio::test]
async fn a_conflict_that_never_ends_fails_closed() {
    let store = postgres_store()
        .await
        .retry_budget(Duration::from_millis(300));
    inject_conflicts(&store, "40001", None).await;
    let error = store
        .reserve(
            &random_key(),
            &fingerprint(1),
            &OwnerToken::random(),
            LONG,
            LONG,
        )
        .await
        .unwrap_err();
    let StoreError::Unavailable(source) = &error else {
        panic!("expected Unavailable, got {error:?}");
    };
    let code = source
        .downcast_ref::<sqlx::Error>()
        .and_then(|e| e.as_database_error())
        .and_then(|e| e.code())
        .map(|code| code.into_owned());
    assert_eq!(code.as_deref(), Some("40001"), "{error}");
    assert!(attempts(&store).await > 1, "it was not retried");

    let policy = Policy::default();
    for (budget, store_timeout) in [
        (Duration::from_millis(200), Duration::from_secs(5)),
        (PostgresStore::RETRY_BUDGET, Duration::from_millis(300)),
    ] {
        let store = store.clone().retry_budget(budget);
        let engine = Engine::with_config(
            Arc::new(store),
            routes(&policy),
            tower_idempotency::EngineConfig {
                store_timeout,
                ..Default::default()
            },
        );
        let harness = Harness::new(policy.clone()).with_engine(engine);
        let reply = harness.send(post_json(b"order-stuck", "{}")).await;
        reply.assert_problem(http::StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
        assert_eq!(harness.calls(), 0, "executed although the store failed");
    }
}

/// A migrated store on a fresh schema whose connections carry the
/// application name `store_{name}_{pid}` (so `pg_stat_activity` tells its
/// sessions), at most `connections` of them, with `options` adjusted by
/// `adjust`; and an admin connection on the schema. Returns the schema's
/// options, the name, the store and the admin connection.
async fn named_store(
    name: &str,
    connections: u32,
    adjust: impl FnOnce(sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions,
) -> (
    sqlx::postgres::PgConnectOptions,
    String,
    PostgresStore,
    sqlx::PgConnection,
) {
    use sqlx::Connection;
    let options = fresh_schema().await;
    let application = format!("store_{name}_{}", std::process::id());
    let connect = adjust(options.clone().application_name(&application));
    let store = PostgresStore::from_pool(pool(connect, connections).await);
    store.migrate().await.unwrap();
    let admin = sqlx::PgConnection::connect_with(&options).await.unwrap();
    (options, application, store, admin)
}

/// `key`'s row locked (`SELECT … FOR UPDATE`) by a transaction on a
/// connection of its own, until the transaction ends.
async fn locked_row(
    options: &sqlx::postgres::PgConnectOptions,
    key: &tower_idempotency::store::ScopeKey,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_records WHERE key = $1 FOR UPDATE")
        .bind(key.as_bytes().as_slice())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// How many server backends run for `application`, read through `admin`.
async fn backends(admin: &mut sqlx::PgConnection, application: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(application)
        .fetch_one(admin)
        .await
        .unwrap()
}

/// The store opens its connections itself (no ping round trip on release):
/// under fifty callers at once, each reserving, completing and reading
/// back its own key, it never has more open than the pool's
/// `max_connections`, every caller is served (waiting, not failing), and
/// every answer is the caller's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_callers_share_at_most_the_pools_size_of_connections() {
    use sqlx::Connection;
    let (options, application, store, mut admin) = named_store("cap", 3, |o| o).await;

    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (done, application, options) = (done.clone(), application.clone(), options.clone());
        tokio::spawn(async move {
            let mut admin = sqlx::PgConnection::connect_with(&options).await.unwrap();
            let mut most = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                most = most.max(backends(&mut admin, &application).await);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            most
        })
    };
    let callers = (0..50u8).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let key = random_key();
            let owner = OwnerToken::random();
            let claim = store
                .reserve(&key, &fingerprint(i), &owner, LONG, LONG)
                .await
                .unwrap();
            assert_eq!(claim, Claim::Acquired { takeover: false });
            let body = bytes::Bytes::from(vec![i; 64]);
            let outcome = Outcome::Stored(StoredResponse {
                status: http::StatusCode::CREATED,
                headers: Vec::new(),
                body: body.clone(),
            });
            assert!(store.complete(&key, &owner, &outcome, LONG).await.unwrap());
            let record = store.get(&key).await.unwrap().expect("its record");
            assert_eq!(record.fingerprint, fingerprint(i));
            match record.state {
                tower_idempotency::store::RecordState::Completed(outcome) => {
                    let Outcome::Stored(response) = outcome else {
                        panic!("not a stored response: {outcome:?}")
                    };
                    assert_eq!(response.body, body, "another caller's response");
                }
                other => panic!("not completed: {other:?}"),
            }
        })
    });
    for caller in join_all(callers).await {
        caller.unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let most = sampler.await.unwrap();
    assert!(most >= 1, "the sampler never saw the store's connections");
    assert!(most <= 3, "{most} connections open for a pool of 3");
    assert!(backends(&mut admin, &application).await <= 3);
    store.close().await;
}

/// A statement abandoned halfway (its caller gave up while the database
/// waited on a row lock) does not leave its connection to the next
/// statement: with one connection allowed, the store goes on answering
/// every later call correctly, and the abandoned one is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_abandoned_halfway_leaves_the_next_ones_correct() {
    let (options, application, store, mut admin) = named_store("abandon", 1, |o| o).await;

    let locked = random_key();
    let owner = OwnerToken::random();
    let claim = store
        .reserve(&locked, &fingerprint(1), &owner, LONG, LONG)
        .await;
    assert_eq!(claim.unwrap(), Claim::Acquired { takeover: false });
    let tx = locked_row(&options, &locked).await;
    let completing = {
        let store = store.clone();
        tokio::spawn(async move { store.complete(&locked, &owner, &outcome(), LONG).await })
    };
    for _ in 0.. {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = $1 AND wait_event_type = 'Lock'",
        )
        .bind(&application)
        .fetch_one(&mut admin)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    completing.abort();
    assert!(completing.await.unwrap_err().is_cancelled());
    // The abandoned statement still waits on the server: the store's next
    // call must not open a second session beside it (the pool allows one).
    let reading = {
        let store = store.clone();
        tokio::spawn(async move { store.get(&random_key()).await })
    };
    for _ in 0..30 {
        let open = backends(&mut admin, &application).await;
        assert!(open <= 1, "{open} sessions for a pool of 1");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.rollback().await.unwrap();
    assert!(reading.await.unwrap().unwrap().is_none());

    for i in 0..20u8 {
        let key = random_key();
        let mine = OwnerToken::random();
        let claim = store
            .reserve(&key, &fingerprint(i), &mine, LONG, LONG)
            .await;
        assert_eq!(claim.unwrap(), Claim::Acquired { takeover: false });
        assert!(store.complete(&key, &mine, &outcome(), LONG).await.unwrap());
        let again = store
            .reserve(&key, &fingerprint(i), &OwnerToken::random(), LONG, LONG)
            .await
            .unwrap();
        let Claim::Existing(record) = again else {
            panic!("a completed key acquired again: {again:?}")
        };
        assert_eq!(record.fingerprint, fingerprint(i));
        assert!(matches!(
            record.state,
            tower_idempotency::store::RecordState::Completed(_)
        ));
    }
    assert!(backends(&mut admin, &application).await <= 1);
    store.close().await;
}

/// A connection whose session the server ended (`pg_terminate_backend`,
/// as a restart or a failover does) fails the one call that drew it, and
/// is not drawn again: the next call succeeds on a new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_session_ended_fails_one_call_only() {
    let (_, application, store, mut admin) = named_store("fatal", 1, |o| o).await;
    for round in 0..3 {
        let key = random_key();
        let owner = OwnerToken::random();
        let claim = store
            .reserve(&key, &fingerprint(1), &owner, LONG, LONG)
            .await;
        assert_eq!(claim.unwrap(), Claim::Acquired { takeover: false });
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(&application)
        .fetch_all(&mut admin)
        .await
        .unwrap();
        assert_eq!(ended, [true], "round {round}: one idle session to end");
        assert!(
            store
                .complete(&key, &owner, &outcome(), LONG)
                .await
                .is_err(),
            "round {round}: a statement on an ended session succeeded"
        );
        assert!(
            store
                .complete(&key, &owner, &outcome(), LONG)
                .await
                .unwrap(),
            "round {round}: the call after the ended session failed too"
        );
    }
    store.close().await;
}

/// A pool whose `after_connect` hook sets the schema (rather than its
/// connect options): the store's own connections are the pool's, so its
/// migration, records and reads all land in that schema, never in
/// another one where a second deployment would not see them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_set_by_the_pools_hook_is_the_stores_schema() {
    use sqlx::Connection;
    let options = fresh_schema().await;
    let schema = options
        .get_options()
        .and_then(|o| o.split('=').nth(1).map(|s| s.trim().to_owned()))
        .expect("the fixture's search_path");
    // The same database, the schema only in the hook.
    let bare = sqlx::postgres::PgConnectOptions::from_str(&fixtures::database_url()).unwrap();
    let hooked = {
        let schema = schema.clone();
        PostgresStore::pool_options()
            .max_connections(2)
            .after_connect(move |connection, _| {
                let set = format!("SET search_path TO {schema}");
                Box::pin(async move {
                    sqlx::query(&set).execute(connection).await?;
                    Ok(())
                })
            })
            .connect_lazy_with(bare)
    };
    let store = PostgresStore::from_pool(hooked);
    store.migrate().await.unwrap();
    let key = random_key();
    let owner = OwnerToken::random();
    let claim = store
        .reserve(&key, &fingerprint(1), &owner, LONG, LONG)
        .await;
    assert_eq!(claim.unwrap(), Claim::Acquired { takeover: false });
    assert!(store
        .complete(&key, &owner, &outcome(), LONG)
        .await
        .unwrap());

    let mut admin = sqlx::PgConnection::connect_with(&options).await.unwrap();
    let rows: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.idempotency_records WHERE key = $1"
    ))
    .bind(key.as_bytes().as_slice())
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(rows, 1, "the record is not in the hook's schema");
    admin.close().await.unwrap();
    store.close().await;
}

/// A statement the server cancels (`statement_timeout`, SQLSTATE 57014)
/// fails its call, and its connection goes on serving: the next call runs
/// on the same server session, not a new one (a reconnect per timeout
/// would deepen an overload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_the_server_cancelled_keeps_its_connection() {
    let (options, application, store, mut admin) =
        named_store("cancel", 1, |o| o.options([("statement_timeout", "200")])).await;
    let session = || {
        sqlx::query_scalar::<_, i32>("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(&application)
    };
    let key = random_key();
    let owner = OwnerToken::random();
    let claim = store
        .reserve(&key, &fingerprint(1), &owner, LONG, LONG)
        .await;
    assert_eq!(claim.unwrap(), Claim::Acquired { takeover: false });
    let before = session().fetch_one(&mut admin).await.unwrap();

    let tx = locked_row(&options, &key).await;
    let cancelled = store.complete(&key, &owner, &outcome(), LONG).await;
    assert!(cancelled.is_err(), "the lock outlasted statement_timeout");
    tx.rollback().await.unwrap();

    assert!(store
        .complete(&key, &owner, &outcome(), LONG)
        .await
        .unwrap());
    let after = session().fetch_one(&mut admin).await.unwrap();
    assert_eq!(
        before, after,
        "the cancelled statement's session was closed"
    );
    store.close().await;
}

/// The health check (`Store::ping`, the proxy's `/healthz`) says whether
/// the store can write its records, not only whether the database
/// answers: a database that answers but cannot take a reservation (a hot
/// standby or read-only endpoint, or a schema the migrations never
/// reached because the role may not create tables) used to report
/// healthy while every covered request got 503 (from a review of
/// operations).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_cannot_take_a_reservation_is_not_healthy() {
    let options = fixtures::fresh_schema().await;
    // The schema exists, the migrations were not applied.
    let unmigrated = PostgresStore::from_pool(fixtures::pool(options.clone(), 2).await);
    let error = unmigrated
        .ping()
        .await
        .expect_err("an unmigrated schema is healthy");
    assert!(error.to_string().contains("migrations"), "{error}");

    let migrated = PostgresStore::from_pool(fixtures::pool(options.clone(), 2).await);
    migrated.migrate().await.unwrap();
    migrated.ping().await.expect("a migrated, writable store");

    // A role that may insert but not update: one privilege of several
    // passed a check that listed them in one call.
    let admin = fixtures::pool(options.clone(), 1).await;
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&admin)
        .await
        .unwrap();
    let role = format!("{schema}_insert_only");
    for statement in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        format!("GRANT SELECT, INSERT ON {schema}.idempotency_records TO {role}"),
    ] {
        sqlx::query(&statement).execute(&admin).await.unwrap();
    }
    let limited =
        PostgresStore::from_pool(fixtures::pool(options.clone().username(&role), 2).await);
    let error = limited
        .ping()
        .await
        .expect_err("a role that may not update is healthy");
    assert!(error.to_string().contains("may not"), "{error}");
    sqlx::query(&format!("DROP OWNED BY {role}"))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&admin)
        .await
        .unwrap();

    // The same schema, read-only (as a standby answers).
    let read_only = options.options([("default_transaction_read_only", "on")]);
    let standby = PostgresStore::from_pool(fixtures::pool(read_only, 2).await);
    let error = standby
        .ping()
        .await
        .expect_err("a read-only database is healthy");
    assert!(error.to_string().contains("read-only"), "{error}");
    let reserve = standby
        .reserve(
            &fixtures::random_key(),
            &fixtures::fingerprint(1),
            &OwnerToken::random(),
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await;
    assert!(reserve.is_err(), "the check agrees with a reservation");
}

/// A health check that found the database read-only closes the connection
/// it asked on, as a reservation's `25006` does: after a failover, the
/// store's idle connections to the old primary (now a standby) answered
/// every `/healthz` with "read-only" and went back to the pool, so a
/// proxy taken out of rotation by that answer (no traffic, so no write to
/// close them) stayed unhealthy. Here a role's sessions start read-only
/// (the standby), then no longer do (the failover done): the next check
/// passes on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_check_that_found_a_standby_asks_a_new_connection_next() {
    let options = fixtures::fresh_schema().await;
    let admin = fixtures::pool(options.clone(), 1).await;
    PostgresStore::from_pool(admin.clone())
        .migrate()
        .await
        .unwrap();
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(&admin)
        .await
        .unwrap();
    let role = format!("{schema}_failover");
    for statement in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.idempotency_records TO {role}"),
        format!("ALTER ROLE {role} SET default_transaction_read_only = on"),
    ] {
        sqlx::query(&statement).execute(&admin).await.unwrap();
    }
    let store = PostgresStore::from_pool(fixtures::pool(options.clone().username(&role), 1).await);
    let error = store.ping().await.expect_err("a standby is healthy");
    assert!(error.to_string().contains("read-only"), "{error}");
    sqlx::query(&format!(
        "ALTER ROLE {role} RESET default_transaction_read_only"
    ))
    .execute(&admin)
    .await
    .unwrap();
    store
        .ping()
        .await
        .expect("the failover is done: a new connection is writable");
    store.close().await;
    for statement in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::query(&statement).execute(&admin).await.unwrap();
    }
}

/// Scenario (from a review of the stores): a burst of arrivals whose
/// statements wait on the database (here, takeovers of a record whose
/// row another transaction holds locked) takes every connection of the
/// store. A request holding another key renews its lease over the same
/// connections: its renewal waited for one until the acquire timeout and
/// failed, and renewals failing for two thirds of the lease let a retry
/// take the key over and run it a second time while it still ran. Impact
/// ("once"), from client traffic alone, across tenants. Connections are
/// kept for the writes of a key's holder: its renewal and its completion
/// get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_stuck_on_the_database_never_starve_a_holders_renewal() {
    let (options, _application, store, _admin) = named_store("kept", 4, |o| o).await;
    let store = Arc::new(store);
    let held = random_key();
    let holder = OwnerToken::random();
    let claim = store
        .reserve(&held, &fingerprint(1), &holder, LONG, LONG)
        .await;
    assert_eq!(claim.unwrap(), Claim::Acquired { takeover: false });
    // A record whose lease ran out, its row locked elsewhere: each arrival
    // for it waits in its takeover, holding a connection.
    let stuck = random_key();
    let short = Duration::from_millis(1);
    let owner = OwnerToken::random();
    store
        .reserve(&stuck, &fingerprint(2), &owner, short, LONG)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lock = locked_row(&options, &stuck).await;
    let arrivals: Vec<_> = (0..6)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let owner = OwnerToken::random();
                let _ = store
                    .reserve(&stuck, &fingerprint(2), &owner, LONG, LONG)
                    .await;
            })
        })
        .collect();
    // And (from a review of the kept connections) the releases the
    // arrivals' abandoned reservations send, stuck on the same row: they
    // took the kept connections first, and the renewal waited behind them.
    let releases: Vec<_> = (0..2)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let _ = store.release(&stuck, &owner).await;
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let renewed = store.renew(&held, &holder, LONG).await;
    assert!(
        matches!(renewed, Ok(true)),
        "the holder's renewal did not get through: {renewed:?}"
    );
    let completed = store.complete(&held, &holder, &outcome(), LONG).await;
    assert!(matches!(completed, Ok(true)), "{completed:?}");
    lock.rollback().await.unwrap();
    join_all(arrivals).await;
    join_all(releases).await;
    store.close().await;
}
