//! The store layer as a user of the tower layer meets it: the memory
//! store's expiry and ceilings, and reservations whose answer was lost.

mod support;

use std::time::Duration;

use http::StatusCode;
use tower_idempotency::store::{Fault, FaultyStore, Op};
use tower_idempotency::{Engine, EngineConfig, FailMode, MemoryStore, Policy, Routes};

use support::{post_json, Harness};

/// A retention that outlasts sending 20 requests (the test upstream takes
/// 20 ms a call) and has run out after [`PAST_RETENTION`].
const RETENTION: Duration = Duration::from_secs(1);
const PAST_RETENTION: Duration = Duration::from_millis(1300);

fn short_lived() -> Policy {
    Policy {
        ttl: RETENTION,
        lease: RETENTION,
        ..Policy::default()
    }
}

/// Nobody started a sweeper, yet expired records do not pile up: every
/// write removes some of them, and a record looked at after its retention
/// is gone.
#[tokio::test]
async fn expired_records_leave_the_memory_store_without_a_sweeper() {
    let store = MemoryStore::new();
    let policy = short_lived();
    let app = Harness::new(policy.clone())
        .with_engine(Engine::new(store.clone(), Routes::all(policy).unwrap()));
    for i in 0..20 {
        let reply = app
            .send(post_json(format!("old-{i}").as_bytes(), "{}"))
            .await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    assert_eq!(store.len(), 20);
    tokio::time::sleep(PAST_RETENTION).await;

    // Two new requests: four writes, each removing expired records.
    for i in 0..2 {
        let reply = app
            .send(post_json(format!("new-{i}").as_bytes(), "{}"))
            .await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    assert_eq!(store.len(), 2, "the expired records were removed");
    // An expired key is new again.
    let again = app.send(post_json(b"old-0", "{}")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());
    assert_eq!(app.calls(), 23);
}

/// At its record ceiling the memory store refuses new keys with 503 (the
/// upstream is not called) instead of growing; stored keys still replay,
/// and room comes back as records expire.
#[tokio::test]
async fn a_full_memory_store_answers_503_and_does_not_grow() {
    let store = MemoryStore::with_limits(3, usize::MAX);
    let policy = short_lived();
    let app = Harness::new(policy.clone())
        .with_engine(Engine::new(store.clone(), Routes::all(policy).unwrap()));
    for i in 0..3 {
        let reply = app.send(post_json(format!("k{i}").as_bytes(), "{}")).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let refused = app.send(post_json(b"k3", "{}")).await;
    refused.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert_eq!(app.calls(), 3, "the refused request did not run");
    assert_eq!(store.len(), 3);
    assert!(app.send(post_json(b"k0", "{}")).await.replayed());

    tokio::time::sleep(PAST_RETENTION).await;
    let later = app.send(post_json(b"k3", "{}")).await;
    assert_eq!(later.status, StatusCode::CREATED);
    assert_eq!(app.calls(), 4);
}

/// From a review: a full memory store was handled as an outage, so on a
/// fail-open route a request whose key could not be reserved ran
/// unprotected — and so did every retry of it (four sends, four runs), for
/// as long as records took to expire, not the "two executions" of an
/// outage. Full is 503 on every route, until records expire. Its health
/// check still answers (a full store is reachable: a readiness probe
/// failing on it would let any client take every route out of service).
#[tokio::test]
async fn a_full_memory_store_runs_nothing_unprotected_even_on_a_fail_open_route() {
    use tower_idempotency::store::Store;
    let store = MemoryStore::with_limits(1, usize::MAX);
    let policy = Policy {
        fail_mode: FailMode::Open,
        ..short_lived()
    };
    let app = Harness::new(policy.clone())
        .with_engine(Engine::new(store.clone(), Routes::all(policy).unwrap()));
    assert!(store.ping().await.is_ok());
    assert_eq!(
        app.send(post_json(b"k0", "{}")).await.status,
        StatusCode::CREATED
    );
    assert!(
        store.ping().await.is_ok(),
        "a full store is still reachable"
    );
    for _ in 0..4 {
        let refused = app.send(post_json(b"pay", "{}")).await;
        refused.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    }
    assert_eq!(app.calls(), 1, "no retry ran unprotected");
    tokio::time::sleep(PAST_RETENTION).await;
    assert_eq!(
        app.send(post_json(b"pay", "{}")).await.status,
        StatusCode::CREATED
    );
    assert!(app.send(post_json(b"pay", "{}")).await.replayed());
    assert_eq!(app.calls(), 2);
}

/// The byte ceiling: stored responses count, and past it new keys get 503.
#[tokio::test]
async fn the_memory_store_byte_ceiling_holds() {
    let max_bytes = 4096;
    let store = MemoryStore::with_limits(usize::MAX, max_bytes);
    let policy = Policy::default();
    let app = Harness::with_response(policy.clone(), |n, _| {
        http::Response::builder()
            .status(StatusCode::CREATED)
            .body(http_body_util::Full::new(bytes::Bytes::from(
                format!("order {n} ").repeat(50),
            )))
            .unwrap()
    })
    .with_engine(Engine::new(store.clone(), Routes::all(policy).unwrap()));
    let mut refused = 0;
    for i in 0..30 {
        let reply = app.send(post_json(format!("k{i}").as_bytes(), "{}")).await;
        if reply.status == StatusCode::SERVICE_UNAVAILABLE {
            refused += 1;
        } else {
            assert_eq!(reply.status, StatusCode::CREATED);
        }
    }
    assert!(refused > 0, "the ceiling was never reached");
    assert_eq!(app.calls(), 30 - refused);
    // Checked at reservation: at most one response over the ceiling.
    assert!(store.bytes() <= max_bytes + 1024, "{} bytes", store.bytes());
}

fn over_faulty(fail_mode: FailMode) -> (Harness, tower_idempotency::store::Faults) {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let policy = Policy {
        fail_mode,
        ..Policy::default()
    };
    let config = EngineConfig {
        store_timeout: Duration::from_millis(200),
        ..EngineConfig::default()
    };
    let engine = Engine::with_config(
        std::sync::Arc::new(store),
        Routes::all(policy.clone()).unwrap(),
        config,
    );
    (Harness::new(policy).with_engine(engine), faults)
}

/// A reservation the store wrote but answered with a timeout: the client
/// gets 503 (nothing ran), and its immediate retry executes once, instead
/// of meeting 409 `in-flight` until the lease runs out.
#[tokio::test]
async fn a_retry_after_a_lost_reservation_executes_once() {
    for fault in [
        Fault::CommitThenFail,
        Fault::CommitThenStall(Duration::from_secs(2)),
    ] {
        let (app, faults) = over_faulty(FailMode::Closed);
        faults.set_next(Op::Reserve, fault, 1);
        let first = app.send(post_json(b"pay-1", "{}")).await;
        first.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
        assert_eq!(app.calls(), 0);

        let retry = app.send(post_json(b"pay-1", "{}")).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{fault:?}");
        assert!(!retry.replayed());
        let again = app.send(post_json(b"pay-1", "{}")).await;
        assert!(again.replayed());
        assert_eq!(app.calls(), 1, "{fault:?}");
    }
}

/// Fail-open: the request whose reservation was lost runs unprotected, the
/// lost reservation is released independently of it, so the retry runs
/// once more (protected this time) and every later one replays: two
/// executions in all, as documented for fail-open.
#[tokio::test]
async fn fail_open_after_a_lost_reservation_executes_at_most_twice() {
    let (app, faults) = over_faulty(FailMode::Open);
    faults.set_next(Op::Reserve, Fault::CommitThenFail, 1);
    let first = app.send(post_json(b"pay-2", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(app.calls(), 1, "forwarded unprotected");
    for _ in 0..5 {
        let reply = app.send(post_json(b"pay-2", "{}")).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    assert_eq!(app.calls(), 2);
}

/// Scenario (from a review of the engine): a fail-open route, an order
/// that takes a while, and five duplicates of it waiting for it (a retry
/// storm). A store call of each waiter fails while it waits: its wait, or
/// its look at the record once the order is done. Each waiter was then
/// forwarded unprotected, as if its own reservation had been lost, and ran
/// the order again beside (or after) the request holding the key: six
/// executions. Impact ("once"): fail-open trades protection for
/// availability only for a request that never saw its key held. A waiter
/// has seen it held, so it gets 503, and its retry is replayed.
#[tokio::test]
async fn a_waiter_whose_store_fails_never_runs_beside_the_holder() {
    for op in [Op::Wait, Op::Get] {
        let (app, faults) = over_faulty(FailMode::Open);
        let app = app.slow(Duration::from_millis(300));
        let upstream = app.upstream();
        let first = tokio::spawn(upstream.send(post_json(b"order-1", "{}")));
        while app.calls() == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        faults.set(op, Fault::Down);
        let waiters: Vec<_> = (0..5)
            .map(|_| tokio::spawn(upstream.send(post_json(b"order-1", "{}"))))
            .collect();
        for waiter in waiters {
            let reply = waiter.await.unwrap();
            reply.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
        }
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{op:?}");
        assert_eq!(app.calls(), 1, "{op:?}: a waiter ran beside the holder");
        faults.clear_all();
        let retry = app.send(post_json(b"order-1", "{}")).await;
        assert!(retry.replayed(), "{op:?}");
        assert_eq!(app.calls(), 1, "{op:?}");
    }
}
