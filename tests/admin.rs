//! The operator's engine methods against real stores (memory, SQLite,
//! PostgreSQL, the Redis cache): a lookup finds the record a live request
//! made, because the engine computes its scope exactly as for that
//! request; a force release fences the first execution off; a principal's
//! purge removes that caller's records only; a purge through the Redis
//! cache is never answered from Redis afterwards.
#![cfg(all(feature = "test-util", feature = "sqlite", feature = "postgres"))]

mod fixtures;

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use tower_idempotency::engine::{Coverage, Decision, RequestHead};
use tower_idempotency::store::KeyState;
use tower_idempotency::{
    Engine, EngineConfig, MemoryStore, Policy, PrincipalPolicy, Routes, Store,
};

/// `/orders` scoped by a trusted gateway's `x-user-id` and by host;
/// `/open` by nothing but the key.
fn routes() -> Routes {
    Routes::new()
        .route(
            "/orders",
            Policy {
                principal: Some(PrincipalPolicy::header("x-user-id")),
                ..Policy::default()
            },
        )
        .unwrap()
        .route("/open", Policy::default())
        .unwrap()
}

fn engine(store: Arc<dyn Store>) -> Engine {
    Engine::with_config(store, routes(), EngineConfig::default())
}

/// What a client sends: method POST, `path` on host `shop.example`, the key
/// header and, when given, the gateway's user header.
struct Sent {
    uri: Uri,
    headers: HeaderMap,
}

fn sent(path: &str, key: &str, user: Option<&str>) -> Sent {
    let mut headers = HeaderMap::new();
    headers.insert("host", HeaderValue::from_static("shop.example"));
    headers.insert("idempotency-key", HeaderValue::from_str(key).unwrap());
    if let Some(user) = user {
        headers.insert("x-user-id", HeaderValue::from_str(user).unwrap());
    }
    Sent {
        uri: path.parse().unwrap(),
        headers,
    }
}

impl Sent {
    fn head(&self) -> RequestHead<'_> {
        RequestHead {
            method: &Method::POST,
            uri: &self.uri,
            headers: &self.headers,
            principal: None,
            routed: None,
        }
    }
}

/// Runs a live request through the engine up to its decision.
async fn begin(engine: &Engine, sent: &Sent, body: &str) -> Decision {
    let Coverage::Covered(covered) = engine.classify(&sent.head()) else {
        panic!("covered");
    };
    engine.begin(&covered, sent.head(), body.as_bytes()).await
}

/// Answers a reservation with 201 and `body`, stored if it still may be.
async fn answer(decision: Decision, body: &'static str) {
    let Decision::Proceed(reservation) = decision else {
        panic!("expected to run, got {decision:?}");
    };
    let mut recorder = reservation
        .record(StatusCode::CREATED, &HeaderMap::new())
        .await;
    recorder.chunk(&Bytes::from_static(body.as_bytes())).await;
    let _ = recorder.end().await;
}

fn replayed(decision: Decision) -> Bytes {
    match decision {
        Decision::Respond(response) => {
            assert_eq!(response.headers()["idempotent-replayed"], "true");
            response.into_body()
        }
        other => panic!("expected a replay, got {other:?}"),
    }
}

async fn lookup_finds_what_a_live_request_stored(store: Arc<dyn Store>) {
    let engine = engine(store);
    let request = sent("/orders", "order-1", Some("alice"));
    answer(begin(&engine, &request, "{}").await, "created").await;

    let found = engine.lookup(&request.head(), b"order-1").await.unwrap();
    assert_eq!(&*found.route, "/orders");
    let record = found.record.expect("the live request's record");
    assert_eq!(record.state, KeyState::Completed);
    assert_eq!(record.status, Some(StatusCode::CREATED));
    assert_eq!(record.body_bytes, Some("created".len() as u64));
    assert!(record.has_principal);
    // The principal given outright, instead of the gateway's header.
    let bare = sent("/orders", "order-1", None);
    let head = RequestHead {
        principal: Some(b"alice"),
        ..bare.head()
    };
    assert_eq!(
        engine.lookup(&head, b"order-1").await.unwrap().scope,
        found.scope
    );
    // A path spelled otherwise is normalised as for a live request.
    let spelled = sent("/x/../orders", "order-1", Some("alice"));
    assert_eq!(
        engine
            .lookup(&spelled.head(), b"order-1")
            .await
            .unwrap()
            .scope,
        found.scope
    );
    // Another caller, another host, another key: other scopes, absent.
    let bob = sent("/orders", "order-1", Some("bob"));
    let other = engine.lookup(&bob.head(), b"order-1").await.unwrap();
    assert_ne!(other.scope, found.scope);
    assert_eq!(other.record, None);
    let mut elsewhere = sent("/orders", "order-1", Some("alice"));
    elsewhere
        .headers
        .insert("host", HeaderValue::from_static("other.example"));
    assert_eq!(
        engine
            .lookup(&elsewhere.head(), b"order-1")
            .await
            .unwrap()
            .record,
        None
    );
    assert_eq!(
        engine
            .lookup(&request.head(), b"order-2")
            .await
            .unwrap()
            .record,
        None
    );
    let inspected = engine.inspect(&found.scope).await.unwrap().unwrap();
    assert_eq!(
        (inspected.key, inspected.state),
        (found.scope, record.state)
    );
    // The body only when asked.
    let outcome = engine.stored_outcome(&found.scope).await.unwrap().unwrap();
    assert_eq!(outcome.status(), Some(StatusCode::CREATED));

    // What could never have been stored is an error naming the fault.
    let error = engine.lookup(&bare.head(), b"order-1").await.unwrap_err();
    assert!(
        error.is_input() && error.to_string().contains("principal"),
        "{error}"
    );
    let uncovered = sent("/elsewhere", "order-1", Some("alice"));
    let error = engine
        .lookup(&uncovered.head(), b"order-1")
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("no route covers POST /elsewhere"),
        "{error}"
    );
    let error = engine
        .lookup(&request.head(), b"bad key")
        .await
        .unwrap_err();
    assert!(error.to_string().contains("invalid key"), "{error}");
}

async fn force_release_fences_the_first_execution(store: Arc<dyn Store>) {
    let engine = engine(store);
    let request = sent("/open", "stuck-1", None);
    let first = begin(&engine, &request, "{}").await;
    let found = engine.lookup(&request.head(), b"stuck-1").await.unwrap();
    assert_eq!(found.record.unwrap().state, KeyState::InFlight);
    let stuck = engine
        .in_flight_older_than(std::time::Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!(
        stuck.iter().map(|info| info.key).collect::<Vec<_>>(),
        vec![found.scope]
    );

    assert!(engine.force_release(&found.scope).await.unwrap());
    // The retry runs while the first execution is still going.
    let second = begin(&engine, &request, "{}").await;
    // The first execution ends: its answer is not stored.
    answer(first, "first").await;
    let record = engine.inspect(&found.scope).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        KeyState::InFlight,
        "the second still holds the key"
    );
    answer(second, "second").await;
    assert_eq!(replayed(begin(&engine, &request, "{}").await), "second");
    // A completed key is not released; it is purged.
    assert!(!engine.force_release(&found.scope).await.unwrap());
    assert!(engine.purge(&found.scope).await.unwrap());
    assert!(matches!(
        begin(&engine, &request, "{}").await,
        Decision::Proceed(_)
    ));
}

async fn purge_principal_removes_one_callers_records(store: Arc<dyn Store>) {
    let engine = engine(store);
    for user in ["alice", "bob"] {
        for key in ["k-1", "k-2"] {
            let request = sent("/orders", key, Some(user));
            answer(begin(&engine, &request, "{}").await, "stored").await;
        }
    }
    let counts = engine.counts().await.unwrap();
    assert_eq!(counts.completed, 4);
    assert_eq!(engine.purge_principal(b"alice").await.unwrap(), 2);
    assert_eq!(engine.purge_principal(b"alice").await.unwrap(), 0);
    for key in ["k-1", "k-2"] {
        let alice = sent("/orders", key, Some("alice"));
        assert!(matches!(
            begin(&engine, &alice, "{}").await,
            Decision::Proceed(_)
        ));
        let bob = sent("/orders", key, Some("bob"));
        assert_eq!(replayed(begin(&engine, &bob, "{}").await), "stored");
    }
}

/// From a review of the operator's side: a release named the key alone,
/// so one sent for a holder the operator saw stuck (its lease run out)
/// deleted the record of the retry that had taken the key over since,
/// and the next retry ran beside it. Released by the holder it names, the
/// key stays the taker's.
async fn a_release_for_a_holder_spares_the_one_that_took_over(store: Arc<dyn Store>) {
    use std::time::Duration;
    use tower_idempotency::store::{Claim, Holder, OwnerToken};

    let engine = engine(store.clone());
    let scope = fixtures::random_key();
    let fingerprint = fixtures::fingerprint(1);
    let (stuck, taker) = (OwnerToken::random(), OwnerToken::random());
    let long = Duration::from_secs(60);
    let claim = store
        .reserve(
            &scope,
            &fingerprint,
            &stuck,
            Duration::from_millis(100),
            long,
        )
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    let listed = engine
        .in_flight_older_than(Duration::ZERO, 10)
        .await
        .unwrap();
    let seen = listed
        .iter()
        .find(|info| info.key == scope)
        .and_then(|info| info.holder())
        .expect("the stuck holder listed");
    assert_eq!(seen, Holder::of(&stuck));
    // The stuck holder's lease runs out; a retry takes the key over.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let claim = store
        .reserve(&scope, &fingerprint, &taker, long, long)
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { takeover: true }),
        "{claim:?}"
    );
    assert!(!engine.force_release_held_by(&scope, seen).await.unwrap());
    let record = engine.inspect(&scope).await.unwrap().expect("kept");
    assert_eq!(
        (record.state, record.holder()),
        (KeyState::InFlight, Some(Holder::of(&taker)))
    );
    assert!(engine
        .force_release_held_by(&scope, Holder::of(&taker))
        .await
        .unwrap());
    assert!(engine.inspect(&scope).await.unwrap().is_none());
    // The taker is fenced off: its answer is not stored.
    let outcome = tower_idempotency::store::Outcome::TooLarge {
        status: StatusCode::CREATED,
    };
    assert!(!store
        .complete(&scope, &taker, &outcome, long)
        .await
        .unwrap());
}

macro_rules! on_every_store {
    ($($test:ident),*) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() {
                super::$test(std::sync::Arc::new(super::MemoryStore::new())).await;
            })*
        }
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() {
                super::$test(std::sync::Arc::new(super::fixtures::sqlite_store().await)).await;
            })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() {
                super::$test(std::sync::Arc::new(super::fixtures::postgres_store().await)).await;
            })*
        }
        #[cfg(feature = "redis")]
        mod redis_postgres {
            $(#[tokio::test(flavor = "multi_thread")]
            async fn $test() {
                let store = super::fixtures::postgres_store().await;
                super::$test(std::sync::Arc::new(super::fixtures::redis_cache(store))).await;
            })*
        }
    };
}

on_every_store!(
    lookup_finds_what_a_live_request_stored,
    force_release_fences_the_first_execution,
    a_release_for_a_holder_spares_the_one_that_took_over,
    purge_principal_removes_one_callers_records
);

/// A record replayed from Redis, then purged: the next request runs again
/// (Redis does not keep answering), and a copy written back from before
/// the purge cannot come back.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_purged_record_is_not_replayed_from_redis() {
    use tower_idempotency::store::Maintenance;

    let cache = fixtures::redis_cache(MemoryStore::new());
    let engine = engine(Arc::new(cache.clone()));
    let hits = |cache: &tower_idempotency::RedisCache<MemoryStore>| {
        let counters = cache.counters();
        counters
            .iter()
            .find(|(name, _, _)| *name == "idempotency_redis_hits_total")
            .map(|(_, _, n)| *n)
            .unwrap()
    };
    for (i, user) in ["alice", "bob"].into_iter().enumerate() {
        let request = sent("/orders", "cached-1", Some(user));
        answer(begin(&engine, &request, "{}").await, "stored").await;
        cache.settled().await;
        assert_eq!(replayed(begin(&engine, &request, "{}").await), "stored");
        assert_eq!(hits(&cache), i as u64 + 1, "the replay came from Redis");
    }

    let alice = sent("/orders", "cached-1", Some("alice"));
    let scope = engine.scope_of(&alice.head(), b"cached-1").unwrap().0;
    assert!(engine.purge(&scope).await.unwrap());
    assert!(matches!(
        begin(&engine, &alice, "{}").await,
        Decision::Proceed(_)
    ));
    let bob = sent("/orders", "cached-1", Some("bob"));
    assert_eq!(engine.purge_principal(b"bob").await.unwrap(), 1);
    let before = hits(&cache);
    assert!(matches!(
        begin(&engine, &bob, "{}").await,
        Decision::Proceed(_)
    ));
    assert_eq!(hits(&cache), before, "no hit for a purged record");
}

/// A caller with more records than one purge batch (1,000), through the
/// Redis cache: every record goes, batch after batch, and none is answered
/// from Redis afterwards (each batch deletes exactly the records whose
/// copies it overwrote first).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_principal_purge_through_redis_takes_every_batch() {
    let cache = fixtures::redis_cache(MemoryStore::new());
    let engine = engine(Arc::new(cache.clone()));
    const RECORDS: usize = 1_500;
    for n in 0..RECORDS {
        let request = sent("/orders", &format!("batch-{n}"), Some("carol"));
        answer(begin(&engine, &request, "{}").await, "stored").await;
    }
    cache.settled().await;
    let sample = [0, 999, 1_000, RECORDS - 1];
    for n in sample {
        let request = sent("/orders", &format!("batch-{n}"), Some("carol"));
        assert_eq!(replayed(begin(&engine, &request, "{}").await), "stored");
    }
    assert_eq!(
        engine.purge_principal(b"carol").await.unwrap(),
        RECORDS as u64
    );
    assert_eq!(engine.counts().await.unwrap().completed, 0, "all purged");
    for n in sample {
        let request = sent("/orders", &format!("batch-{n}"), Some("carol"));
        assert!(
            matches!(begin(&engine, &request, "{}").await, Decision::Proceed(_)),
            "record {n} was answered after its purge"
        );
    }
}

/// With Redis unreachable, a purge through the cache deletes nothing and
/// says why, so the operator can purge again.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_purge_that_cannot_reach_redis_deletes_nothing_and_says_so() {
    let inner = MemoryStore::new();
    let config = tower_idempotency::RedisCacheConfig::new("redis://127.0.0.1:1")
        .timeout(std::time::Duration::from_millis(200));
    let cache = tower_idempotency::RedisCache::new(inner.clone(), config).unwrap();
    let engine = engine(Arc::new(cache));
    let request = sent("/open", "cached-2", None);
    answer(begin(&engine, &request, "{}").await, "stored").await;
    let scope = engine.scope_of(&request.head(), b"cached-2").unwrap().0;
    let error = engine.purge(&scope).await.unwrap_err();
    assert!(!error.is_input());
    assert!(
        error.to_string().contains("could not be invalidated"),
        "{error}"
    );
    assert!(error.to_string().contains("nothing was deleted"), "{error}");
    assert!(inner.get(&scope).await.unwrap().is_some(), "still stored");
}

/// On a JWT route, the operator names the caller by the token's `sub`
/// and `iss` (`jwt_principal`): the lookup finds what the caller's live
/// request stored, and the principal's purge removes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_jwt_caller_is_named_by_sub_and_iss() {
    use jsonwebtoken::{encode, EncodingKey, Header};
    use tower_idempotency::policy::principal::jwt_principal;
    use tower_idempotency::JwtPolicy;

    const SECRET: &[u8] = b"a shared secret of at least 32 bytes, for HS256";
    let secret = std::env::temp_dir().join(format!("ti-admin-jwt-{}", uuid::Uuid::new_v4()));
    std::fs::write(&secret, SECRET).unwrap();
    let policy = Policy {
        principal: Some(PrincipalPolicy::jwt(JwtPolicy {
            hs256_secret_file: vec![secret.clone()],
            ..JwtPolicy::default()
        })),
        ..Policy::default()
    };
    let routes = Routes::new().route("/pay", policy).unwrap();
    let engine = Engine::with_config(
        Arc::new(fixtures::sqlite_store().await),
        routes,
        EngineConfig::default(),
    );
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let claims = serde_json::json!({ "sub": "user-42", "iss": "https://id.example", "exp": exp });
    let token = encode(
        &Header::default(),
        &claims,
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap();
    let mut request = sent("/pay", "pay-1", None);
    let bearer = format!("Bearer {token}");
    request
        .headers
        .insert("authorization", HeaderValue::from_str(&bearer).unwrap());
    answer(begin(&engine, &request, "{}").await, "paid").await;

    let caller = jwt_principal(Some("https://id.example"), "user-42");
    let bare = sent("/pay", "pay-1", None);
    let head = RequestHead {
        principal: Some(&caller),
        ..bare.head()
    };
    let found = engine.lookup(&head, b"pay-1").await.unwrap();
    assert_eq!(found.record.expect("stored").state, KeyState::Completed);
    let by_token = engine.lookup(&request.head(), b"pay-1").await.unwrap();
    assert_eq!(
        by_token.scope, found.scope,
        "the token itself names the same caller"
    );
    let stranger = jwt_principal(None, "user-42");
    assert_eq!(
        engine.purge_principal(&stranger).await.unwrap(),
        0,
        "no iss: another caller"
    );
    assert_eq!(engine.purge_principal(&caller).await.unwrap(), 1);
    assert_eq!(engine.inspect(&found.scope).await.unwrap(), None);
    std::fs::remove_file(secret).ok();
}

/// Scenario (review): a request whose scope holds other routes' parts — a
/// `POST` naming `PUT` in `X-HTTP-Method-Override` between a per-user
/// `PUT` route and an unscoped `POST` route, and `/orders.json` beside a
/// catch-all — is found by a lookup of what the client sent, as for any
/// other request: the lookup dispatches and reads the path as the live
/// request was.
#[tokio::test]
async fn lookup_finds_a_request_scoped_by_several_routes() {
    let user = || Policy {
        methods: vec!["PUT".into(), "POST".into()],
        principal: Some(PrincipalPolicy::header("x-user-id")),
        ..Policy::default()
    };
    let routes = Routes::new()
        .route(
            "/y",
            Policy {
                methods: vec!["PUT".into()],
                ..user()
            },
        )
        .unwrap()
        .route("/y", Policy::default())
        .unwrap()
        .route("/orders", user())
        .unwrap()
        .route("/", Policy::default())
        .unwrap();
    let engine = Engine::with_config(
        Arc::new(MemoryStore::new()),
        routes,
        EngineConfig::default(),
    );
    let mut overridden = sent("/y", "k-override", Some("alice"));
    overridden
        .headers
        .insert("x-http-method-override", HeaderValue::from_static("PUT"));
    let suffixed = sent("/orders.json", "k-suffix", Some("alice"));
    for (request, key) in [(&overridden, "k-override"), (&suffixed, "k-suffix")] {
        answer(begin(&engine, request, "{}").await, "created").await;
        let found = engine
            .lookup(&request.head(), key.as_bytes())
            .await
            .unwrap();
        let record = found.record.unwrap_or_else(|| panic!("{key}: not found"));
        assert_eq!(record.state, KeyState::Completed, "{key}");
        // Another caller's is another scope.
        let mut other = sent(&request.uri.to_string(), key, Some("bob"));
        if let Some(value) = request.headers.get("x-http-method-override") {
            other
                .headers
                .insert("x-http-method-override", value.clone());
        }
        let theirs = engine.lookup(&other.head(), key.as_bytes()).await.unwrap();
        assert_ne!(theirs.scope, found.scope, "{key}");
    }
}
