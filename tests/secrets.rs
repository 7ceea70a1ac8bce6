//! Secrets at rest, through the tower layer over real stores: what
//! PostgreSQL, SQLite and Redis hold when a key secret and encryption keys
//! are configured (hashes and ciphertext only), key rotation, and records
//! that cannot be opened (a wrong key, a removed key, altered bytes), which
//! are answered with 503 and never executed again.
#![cfg(all(feature = "sqlite", feature = "postgres", feature = "redis"))]

mod fixtures;
mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use http::{Response, StatusCode};
use tower_idempotency::engine::{sealed_key_id, EncryptionKey, KeySecret, Keyring};
use tower_idempotency::store::SealedOutcome;
use tower_idempotency::{Engine, EngineConfig, FailMode, MemoryStore, Policy, Routes, Store};

use support::{layered, post_json, Reply, Upstream};

const BODY_MARKER: &str = "BODY-MARKER-jane@example.com";
const HEADER_MARKER: &str = "HEADER-MARKER-4111";

/// The secret every keyed engine here uses.
fn secret() -> KeySecret {
    KeySecret::new(vec![0x5e; 32]).unwrap()
}

/// A keyring of `(id, key byte)` sealing with `current`.
fn keyring(keys: &[(&str, u8)], current: &str) -> Keyring {
    let keys = keys
        .iter()
        .map(|(id, byte)| EncryptionKey::new(id, &[*byte; 32]).unwrap())
        .collect();
    Keyring::new(keys, current).unwrap()
}

fn engine(store: Arc<dyn Store>, secret: Option<KeySecret>, keys: Option<Keyring>) -> Engine {
    engine_failing(store, secret, keys, FailMode::Closed)
}

fn engine_failing(
    store: Arc<dyn Store>,
    secret: Option<KeySecret>,
    keys: Option<Keyring>,
    fail_mode: FailMode,
) -> Engine {
    let policy = Policy {
        fail_mode,
        ..Policy::default()
    };
    Engine::with_config(
        store,
        Routes::all(policy).unwrap(),
        EngineConfig {
            key_secret: secret,
            encryption: keys,
            ..EngineConfig::default()
        },
    )
}

/// `engine` in front of an upstream counting into `calls`, answering 201
/// with the markers in a header and the body.
fn upstream(engine: &Engine, calls: &Arc<AtomicUsize>) -> Upstream {
    let calls = calls.clone();
    layered(engine, move |_, _| {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            Response::builder()
                .status(StatusCode::CREATED)
                .header("x-card", HEADER_MARKER)
                .body(Body::from(format!("{BODY_MARKER} order {n}")))
                .unwrap()
        }
    })
}

async fn send(upstream: &Upstream, key: &str) -> Reply {
    upstream
        .send(post_json(key.as_bytes(), r#"{"amount": 5}"#))
        .await
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle.as_bytes())
}

/// One row of a SQL store, as the database holds it.
#[derive(Debug, sqlx::FromRow)]
struct Row {
    key: Vec<u8>,
    status: Option<i32>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
}

impl Row {
    fn bytes(&self) -> Vec<u8> {
        let mut all = self.key.clone();
        all.extend(self.headers.iter().flatten());
        all.extend(self.body.iter().flatten());
        all
    }
}

const SELECT_ROWS: &str =
    "SELECT key, CAST(status AS INTEGER) AS status, headers, body FROM idempotency_records";

/// The same request through an unkeyed, unencrypted engine and through a
/// keyed, encrypting one on one store: the first row shows the markers
/// (the raw read sees plaintext where there is some), the second holds
/// none of them, under another key.
async fn check_ciphertext_only<F, Fut>(store: Arc<dyn Store>, rows: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Vec<Row>>,
{
    let calls = Arc::default();
    let plain = upstream(&engine(store.clone(), None, None), &calls);
    assert_eq!(send(&plain, "order-1001").await.status, StatusCode::CREATED);
    let before = rows().await;
    assert_eq!(before.len(), 1);
    let plain_row = &before[0];
    assert!(contains(&plain_row.bytes(), BODY_MARKER));
    assert!(contains(&plain_row.bytes(), HEADER_MARKER));

    let sealed = upstream(
        &engine(store, Some(secret()), Some(keyring(&[("1", 1)], "1"))),
        &calls,
    );
    let first = send(&sealed, "order-1001").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed(), "another scope key: a new record");
    let replay = send(&sealed, "order-1001").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["x-card"], HEADER_MARKER);
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    let after = rows().await;
    assert_eq!(after.len(), 2);
    let row = after.iter().find(|row| row.key != plain_row.key).unwrap();
    assert_ne!(row.key, plain_row.key);
    assert!(!contains(&row.bytes(), BODY_MARKER), "{row:?}");
    assert!(!contains(&row.bytes(), HEADER_MARKER), "{row:?}");
    assert!(!contains(&row.bytes(), "order-1001"));
    assert_eq!(row.status, None, "the status is inside the ciphertext");
    let sealed = SealedOutcome::from_bytes(row.body.clone().unwrap().into());
    assert_eq!(sealed_key_id(&sealed).unwrap(), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_table_holds_hashes_and_ciphertext_only() {
    let store = fixtures::postgres_store().await;
    let pool = store.pool().clone();
    check_ciphertext_only(Arc::new(store), || async {
        sqlx::query_as(SELECT_ROWS).fetch_all(&pool).await.unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_file_holds_hashes_and_ciphertext_only() {
    let store = fixtures::sqlite_store().await;
    let pool = store.pool().clone();
    check_ciphertext_only(Arc::new(store), || async {
        sqlx::query_as(SELECT_ROWS).fetch_all(&pool).await.unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_hashes_and_ciphertext_only() {
    let cache = fixtures::redis_cache(MemoryStore::new());
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let mut redis = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(cache.clone());
    let calls = Arc::default();
    let entries = |cache: tower_idempotency::RedisCache<MemoryStore>| {
        let mut redis = redis.clone();
        async move {
            cache.settled().await;
            let namespace = cache.namespace().unwrap().to_owned();
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{namespace}*"))
                .query_async(&mut redis)
                .await
                .unwrap();
            let mut entries = Vec::new();
            for key in keys {
                let value: Vec<u8> = redis::cmd("GET")
                    .arg(&key)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                entries.push((key, value));
            }
            entries
        }
    };

    let plain = upstream(&engine(store.clone(), None, None), &calls);
    send(&plain, "order-1001").await;
    let before = entries(cache.clone()).await;
    assert_eq!(before.len(), 1);
    assert!(contains(&before[0].1, BODY_MARKER) && contains(&before[0].1, HEADER_MARKER));

    let sealed = upstream(
        &engine(store, Some(secret()), Some(keyring(&[("1", 1)], "1"))),
        &calls,
    );
    send(&sealed, "order-1001").await;
    let replay = send(&sealed, "order-1001").await;
    assert!(replay.replayed());
    assert!(contains(&replay.body, BODY_MARKER));
    let after = entries(cache.clone()).await;
    assert_eq!(after.len(), 2);
    let (key, value) = after.iter().find(|(key, _)| *key != before[0].0).unwrap();
    assert!(!contains(value, BODY_MARKER), "{value:?}");
    assert!(!contains(value, HEADER_MARKER));
    assert!(!contains(key.as_bytes(), "order-1001"));
    let _: () = redis::cmd("DEL")
        .arg(&before[0].0)
        .arg(key)
        .query_async(&mut redis)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_replays_old_records_until_their_key_is_removed() {
    let sqlite = fixtures::sqlite_store().await;
    let pool = sqlite.pool().clone();
    let store: Arc<dyn Store> = Arc::new(sqlite);
    let calls = Arc::default();
    let key_1 = upstream(
        &engine(
            store.clone(),
            Some(secret()),
            Some(keyring(&[("1", 1)], "1")),
        ),
        &calls,
    );
    let first = send(&key_1, "order-1").await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Rotated: key 2 is current, key 1 still listed.
    let rotated = upstream(
        &engine(
            store.clone(),
            Some(secret()),
            Some(keyring(&[("1", 1), ("2", 2)], "2")),
        ),
        &calls,
    );
    let replay = send(&rotated, "order-1").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let second = send(&rotated, "order-2").await;
    assert!(!second.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Key 1 removed: its record fails closed, key 2's still replays.
    let removed = upstream(
        &engine(
            store.clone(),
            Some(secret()),
            Some(keyring(&[("2", 2)], "2")),
        ),
        &calls,
    );
    send(&removed, "order-1")
        .await
        .assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    let replay = send(&removed, "order-2").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, second.body);
    assert_eq!(calls.load(Ordering::SeqCst), 2, "nothing ran again");

    // New writes carry id 2, the first record id 1.
    let bodies: Vec<Vec<u8>> = sqlx::query_scalar("SELECT body FROM idempotency_records")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut ids: Vec<String> = bodies
        .into_iter()
        .map(|body| {
            sealed_key_id(&SealedOutcome::from_bytes(body.into()))
                .unwrap()
                .to_owned()
        })
        .collect();
    ids.sort();
    assert_eq!(ids, ["1", "2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_fails_closed_even_on_a_fail_open_route() {
    let store: Arc<dyn Store> = Arc::new(fixtures::sqlite_store().await);
    let calls = Arc::default();
    let right = upstream(
        &engine(
            store.clone(),
            Some(secret()),
            Some(keyring(&[("1", 1)], "1")),
        ),
        &calls,
    );
    send(&right, "order-1").await;
    for fail_mode in [FailMode::Closed, FailMode::Open] {
        let wrong = upstream(
            &engine_failing(
                store.clone(),
                Some(secret()),
                Some(keyring(&[("1", 9)], "1")),
                fail_mode,
            ),
            &calls,
        );
        let reply = send(&wrong, "order-1").await;
        reply.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
        assert!(reply.headers.contains_key(http::header::RETRY_AFTER));
    }
    // No keyring at all: a sealed record is not a miss either.
    let none = upstream(&engine(store.clone(), Some(secret()), None), &calls);
    send(&none, "order-1")
        .await
        .assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(send(&right, "order-1").await.replayed());
}

/// Flips one byte of every stored body with `flip`, then asks again: 503,
/// and the upstream is not called.
async fn check_tampering_fails_closed<F, Fut>(store: Arc<dyn Store>, flip: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    let calls = Arc::default();
    let sealed = upstream(
        &engine(store, Some(secret()), Some(keyring(&[("1", 1)], "1"))),
        &calls,
    );
    send(&sealed, "order-1").await;
    assert!(send(&sealed, "order-1").await.replayed());
    assert_eq!(flip().await, 1);
    send(&sealed, "order-1")
        .await
        .assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_ciphertext_in_postgres_fails_closed() {
    let store = fixtures::postgres_store().await;
    let pool = store.pool().clone();
    check_tampering_fails_closed(Arc::new(store), || async move {
        // A byte of the ciphertext.
        sqlx::query(
            "UPDATE idempotency_records SET body = set_byte(body, length(body) - 20, \
             get_byte(body, length(body) - 20) # 1)",
        )
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_ciphertext_in_sqlite_fails_closed() {
    let store = fixtures::sqlite_store().await;
    let pool = store.pool().clone();
    check_tampering_fails_closed(Arc::new(store), || async move {
        let body: Vec<u8> = sqlx::query_scalar("SELECT body FROM idempotency_records")
            .fetch_one(&pool)
            .await
            .unwrap();
        let mut altered = body.clone();
        let at = altered.len() - 20;
        altered[at] ^= 1;
        sqlx::query("UPDATE idempotency_records SET body = ?1")
            .bind(altered)
            .execute(&pool)
            .await
            .unwrap()
            .rows_affected()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_stored_in_the_clear_still_replay_once_encryption_is_on() {
    let store: Arc<dyn Store> = Arc::new(fixtures::sqlite_store().await);
    let calls = Arc::default();
    let clear = upstream(&engine(store.clone(), None, None), &calls);
    let first = send(&clear, "order-1").await;
    let encrypting = upstream(
        &engine(store, None, Some(keyring(&[("1", 1)], "1"))),
        &calls,
    );
    let replay = send(&encrypting, "order-1").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// From a review: anyone who can write to the store can plant a plain
/// record (status, headers, body in the clear) under a scope key while
/// encryption is on, and the engine replayed it, since records stored
/// before encryption stay readable. A keyring refusing plain records
/// answers such a record 503 and never runs the request (its record says
/// it ran); sealed records still replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyring_refusing_plain_records_never_replays_one() {
    let store: Arc<dyn Store> = Arc::new(fixtures::sqlite_store().await);
    let calls = Arc::default();
    // Planted: a record in the clear, as an engine without keys writes it.
    let planted = upstream(&engine(store.clone(), None, None), &calls);
    assert_eq!(send(&planted, "order-planted").await.status, 201);
    let refusing = upstream(
        &engine(
            store,
            None,
            Some(keyring(&[("1", 1)], "1").refusing_plain()),
        ),
        &calls,
    );
    let answer = send(&refusing, "order-planted").await;
    answer.assert_problem(http::StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert!(
        !contains(&answer.body, BODY_MARKER),
        "no plain body replayed"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "never run again");
    // A record it sealed itself replays.
    let first = send(&refusing, "order-sealed").await;
    let replay = send(&refusing, "order-sealed").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
