//! The PostgreSQL store beyond the conformance suite: separate connections,
//! several instances on one database, an outage, the sweeper.
#![cfg(feature = "postgres")]

mod fixtures;
mod support;

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
    let acquired = claims
        .iter()
        .filter(|(_, claim)| matches!(claim, Claim::Acquired { takeover: false }))
        .count();
    assert_eq!(acquired, 1, "{claims:?}");
    assert!(claims
        .iter()
        .all(|(_, claim)| matches!(claim, Claim::Acquired { .. } | Claim::Existing(_))));
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

    switch.set(false);
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

    switch.set(true);
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
