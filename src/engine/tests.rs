//! The engine's unit tests, against the memory store (and the fault
//! injector in front of it for outages).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};

use super::scope::scope_key;
use super::*;
use crate::policy::FailMode;
use crate::policy::{InFlightPolicy, Policy, Routes};
use crate::store::{Fault, Faults, FaultyStore, MemoryStore, Op, Store};

/// The route covering `POST path` on `engine` (for a request with a key).
fn covered(engine: &Engine, path: &'static str) -> Covered {
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", HeaderValue::from_static("k"));
    let uri = Uri::from_static(path);
    let head = RequestHead {
        method: &Method::POST,
        uri: &uri,
        headers: &headers,
        principal: None,
        routed: None,
    };
    match engine.classify(&head) {
        Coverage::Covered(covered) => covered,
        Coverage::PassThrough => panic!("{path} is not covered"),
    }
}

fn engine(policy: Policy) -> (Engine, MemoryStore, Covered) {
    let store = MemoryStore::new();
    let routes = Routes::all(policy).unwrap();
    let engine = Engine::new(store.clone(), routes);
    let policy = covered(&engine, "/orders");
    (engine, store, policy)
}

/// `POST /orders` with `Idempotency-Key: key` and a JSON body.
async fn begin(engine: &Engine, policy: &Covered, key: &str) -> Decision {
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", key.parse().unwrap());
    headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    let head = RequestHead {
        method: &Method::POST,
        uri: &Uri::from_static("/orders"),
        headers: &headers,
        principal: None,
        routed: None,
    };
    engine.begin(policy, head, br#"{"amount":10}"#).await
}

fn proceed(decision: Decision) -> Reservation {
    match decision {
        Decision::Proceed(reservation) => reservation,
        other => panic!("expected Proceed, got {other:?}"),
    }
}

fn problem_type(decision: Decision) -> (StatusCode, String) {
    let Decision::Respond(response) = decision else {
        panic!("expected a response, got {decision:?}");
    };
    let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
    (response.status(), body["type"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn the_recorder_drops_connection_listed_headers_and_stops_at_the_cap() {
    let (engine, _, policy) = engine(Policy {
        max_response_bytes: 8,
        ..Policy::default()
    });
    let reservation = proceed(begin(&engine, &policy, "k").await);
    let mut headers = HeaderMap::new();
    headers.insert(header::CONNECTION, "x-hop".parse().unwrap());
    headers.insert("x-hop", "1".parse().unwrap());
    headers.append("x-keep", "1".parse().unwrap());
    headers.append("x-keep", "2".parse().unwrap());
    let mut recorder = reservation.record(StatusCode::CREATED, &headers).await;
    let names: Vec<_> = recorder
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
        .collect();
    assert_eq!(names, [("x-keep", "1"), ("x-keep", "2")]);
    assert_eq!(
        recorder.chunk(&Bytes::from_static(b"12345")).await,
        Flow::Record
    );
    assert!(recorder.is_recording());
    assert_eq!(
        recorder.chunk(&Bytes::from_static(b"6789")).await,
        Flow::Pass {
            recorded: Bytes::from_static(b"12345")
        }
    );
    assert!(!recorder.is_recording());
    assert_eq!(
        recorder.end().await,
        Ended::Whole(Bytes::new()),
        "nothing more was recorded"
    );
    assert_eq!(
        problem_type(begin(&engine, &policy, "k").await),
        (
            StatusCode::CONFLICT,
            "urn:tower-idempotency:response-not-stored".to_owned()
        )
    );
}

#[tokio::test]
async fn the_recorder_keeps_one_chunk_uncopied_and_joins_several_in_order() {
    let (engine, _, policy) = engine(Policy {
        max_response_bytes: 10,
        ..Policy::default()
    });
    let one = proceed(begin(&engine, &policy, "one").await);
    let mut recorder = one.record(StatusCode::OK, &HeaderMap::new()).await;
    let chunk = Bytes::from_static(b"hello");
    assert_eq!(recorder.chunk(&chunk).await, Flow::Record);
    let Ended::Whole(stored) = recorder.end().await else {
        panic!("no length was declared")
    };
    assert_eq!(stored.as_ptr(), chunk.as_ptr(), "stored as it came");

    let several = proceed(begin(&engine, &policy, "several").await);
    let mut recorder = several.record(StatusCode::OK, &HeaderMap::new()).await;
    for part in ["hello", " ", "you"] {
        let part = Bytes::from_static(part.as_bytes());
        assert_eq!(recorder.chunk(&part).await, Flow::Record);
    }
    assert_eq!(
        recorder.chunk(&Bytes::from_static(b"!!")).await,
        Flow::Pass {
            recorded: Bytes::from_static(b"hello you")
        },
        "past the cap"
    );
    assert!(
        recorder.fail().await.is_empty(),
        "nothing held past the cap"
    );

    let broken = proceed(begin(&engine, &policy, "broken").await);
    let mut recorder = broken.record(StatusCode::OK, &HeaderMap::new()).await;
    for part in ["hel", "lo"] {
        let part = Bytes::from_static(part.as_bytes());
        assert_eq!(recorder.chunk(&part).await, Flow::Record);
    }
    assert_eq!(recorder.fail().await, "hello", "what came before the break");
    assert_eq!(
        problem_type(begin(&engine, &policy, "broken").await),
        (
            StatusCode::CONFLICT,
            "urn:tower-idempotency:response-incomplete".to_owned()
        ),
        "a body broken after the head keeps the key: the upstream acted"
    );
}

/// A body that ends cleanly short of, or past, the length its head
/// declared comes back as `Ended::Cut` (so no front end frames those bytes
/// as the whole answer) and keeps the key as "executed, response
/// incomplete"; one at its declared length comes back whole.
#[tokio::test]
async fn a_body_off_its_declared_length_ends_cut_and_keeps_the_key() {
    let (engine, _, policy) = engine(Policy::default());
    for (key, declared, sent) in [("short", "10", "12345"), ("long", "2", "12345")] {
        let reservation = proceed(begin(&engine, &policy, key).await);
        let head =
            HeaderMap::from_iter([(header::CONTENT_LENGTH, HeaderValue::from_static(declared))]);
        let mut recorder = reservation.record(StatusCode::CREATED, &head).await;
        assert_eq!(recorder.chunk(&Bytes::from(sent)).await, Flow::Record);
        assert_eq!(recorder.end().await, Ended::Cut(Bytes::from(sent)), "{key}");
        assert_eq!(
            problem_type(begin(&engine, &policy, key).await),
            (
                StatusCode::CONFLICT,
                "urn:tower-idempotency:response-incomplete".to_owned()
            ),
            "{key}"
        );
    }
    let reservation = proceed(begin(&engine, &policy, "whole").await);
    let head = HeaderMap::from_iter([(header::CONTENT_LENGTH, HeaderValue::from_static("5"))]);
    let mut recorder = reservation.record(StatusCode::CREATED, &head).await;
    assert_eq!(recorder.chunk(&Bytes::from("12345")).await, Flow::Record);
    assert_eq!(recorder.end().await, Ended::Whole(Bytes::from("12345")));

    // Past the storage cap nothing is held, so nothing is measured: the
    // end of a body at its declared length is no cut.
    let (capped, _, policy) = self::engine(Policy {
        max_response_bytes: 3,
        ..Policy::default()
    });
    let reservation = proceed(begin(&capped, &policy, "large").await);
    let mut recorder = reservation.record(StatusCode::CREATED, &head).await;
    let passed = recorder.chunk(&Bytes::from("12345")).await;
    assert_eq!(
        passed,
        Flow::Pass {
            recorded: Bytes::new()
        }
    );
    assert_eq!(recorder.end().await, Ended::Whole(Bytes::new()));
}

#[tokio::test]
async fn unstored_statuses_and_abandoned_reservations_release_the_key() {
    let (engine, store, policy) = engine(Policy::default());
    let reservation = proceed(begin(&engine, &policy, "k").await);
    let recorder = reservation
        .record(StatusCode::UNPROCESSABLE_ENTITY, &HeaderMap::new())
        .await;
    assert!(!recorder.is_recording());
    assert_eq!(recorder.end().await, Ended::Whole(Bytes::new()));
    assert!(store.is_empty());

    // Dropped without being recorded or released (a panic, a cancelled task).
    drop(proceed(begin(&engine, &policy, "k").await));
    let mut next = begin(&engine, &policy, "k").await;
    for _ in 0..100 {
        if matches!(next, Decision::Proceed(_)) {
            break;
        }
        tokio::task::yield_now().await;
        next = begin(&engine, &policy, "k").await;
    }
    proceed(next).release().await;
    assert!(store.is_empty());
    assert_eq!(engine.metrics().in_flight(), 0);
}

/// The heartbeat keeps a long call's lease alive: a duplicate arriving
/// long after the first lease would have run out still sees it in flight.
#[tokio::test(start_paused = true)]
async fn the_heartbeat_keeps_a_long_call_from_being_taken_over() {
    let (engine, _, policy) = engine(Policy {
        lease: Duration::from_millis(300),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    let first = proceed(begin(&engine, &policy, "k").await);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        problem_type(begin(&engine, &policy, "k").await),
        (
            StatusCode::CONFLICT,
            "urn:tower-idempotency:in-flight".to_owned()
        )
    );
    let _ = first
        .record(StatusCode::OK, &HeaderMap::new())
        .await
        .end()
        .await;
    assert!(matches!(
        begin(&engine, &policy, "k").await,
        Decision::Respond(response) if response.headers().contains_key(REPLAYED_HEADER)
    ));
}

/// A call may outlive the record's retention (`ttl`) when the heartbeat
/// keeps renewing its lease; the record must not expire under it.
#[tokio::test(start_paused = true)]
async fn a_renewed_reservation_outlives_its_retention() {
    let (engine, store, policy) = engine(Policy {
        lease: Duration::from_secs(1),
        ttl: Duration::from_secs(1),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    let first = proceed(begin(&engine, &policy, "k").await);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(store.maintenance().unwrap().sweep(10).await.unwrap(), 0);
    assert_eq!(
        problem_type(begin(&engine, &policy, "k").await).1,
        "urn:tower-idempotency:in-flight"
    );
    first.release().await;
}

/// One renewer serves every lease: a short lease taken after a long
/// one (the renewer asleep until the long one is due) is still renewed
/// in time, and settled or abandoned reservations leave it.
#[tokio::test(start_paused = true)]
async fn one_renewer_keeps_short_and_long_leases_alive() {
    let policy = |lease| Policy {
        lease,
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    };
    let routes = Routes::new()
        .route("/long", policy(Duration::from_secs(60)))
        .unwrap()
        .route("/short", policy(Duration::from_millis(300)))
        .unwrap();
    let engine = Engine::new(MemoryStore::new(), routes);
    let long = covered(&engine, "/long");
    let short = covered(&engine, "/short");
    let first = proceed(begin(&engine, &long, "long").await);
    // Let the renewer start and go to sleep until the long lease is due.
    tokio::task::yield_now().await;
    let second = proceed(begin(&engine, &short, "short").await);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        problem_type(begin(&engine, &short, "short").await).1,
        "urn:tower-idempotency:in-flight"
    );
    let third = proceed(begin(&engine, &short, "dropped").await);
    assert_eq!(engine.inner.leases.len(), 3);

    let _ = first
        .record(StatusCode::OK, &HeaderMap::new())
        .await
        .end()
        .await;
    second.release().await;
    drop(third);
    assert_eq!(engine.inner.leases.len(), 0);
}

/// The renewer holds the engine only weakly and ends with it.
#[tokio::test(start_paused = true)]
async fn the_renewer_ends_with_the_engine() {
    let (engine, _, policy) = engine(Policy::default());
    proceed(begin(&engine, &policy, "k").await).release().await;
    let leases = engine.inner.leases.clone();
    assert_eq!(leases.renewer_refs(), [2], "one renewer, running");
    drop(engine);
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    assert_eq!(leases.renewer_refs(), [1], "the renewer has ended");
}

/// Each runtime renews the leases of its own requests: a runtime that
/// stopped (or is no longer driven) takes no one else's leases with it.
#[test]
fn a_runtime_no_longer_driven_takes_no_other_runtimes_leases_with_it() {
    let (engine, _, policy) = engine(Policy {
        lease: Duration::from_millis(300),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
    };
    // The first reservation starts a renewer on a runtime that is then
    // no longer driven (and later stops).
    let first = runtime();
    let idle = first.block_on(async { proceed(begin(&engine, &policy, "a").await) });
    let second = runtime();
    second.block_on(async {
        let held = proceed(begin(&engine, &policy, "b").await);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            problem_type(begin(&engine, &policy, "b").await).1,
            "urn:tower-idempotency:in-flight",
            "the lease was renewed, not taken over"
        );
        held.release().await;
    });
    drop(idle);
    drop(first);
}

#[test]
fn every_part_of_the_scope_changes_the_key() {
    let policy = Policy {
        scope_headers: vec!["authorization".into()],
        ..Policy::default()
    }
    .validate()
    .unwrap();
    let plain = IdentityHasher::default();
    let key_with = |hasher: &IdentityHasher,
                    principal: Option<&[u8]>,
                    auth: &str,
                    method: Method,
                    path: &str,
                    raw: &[u8]| {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, auth.parse().unwrap());
        let uri: Uri = path.parse().unwrap();
        let head = RequestHead {
            method: &method,
            uri: &uri,
            headers: &headers,
            principal,
            routed: None,
        };
        scope_key(hasher, &policy, &head, raw, (&[], false))
    };
    let key = |principal: Option<&[u8]>, auth: &str, method: Method, path: &str, raw: &[u8]| {
        key_with(&plain, principal, auth, method, path, raw)
    };
    let base = key(None, "a", Method::POST, "/o", b"k");
    // Under a key secret the same scope has another key, and each secret
    // its own.
    let keyed = |byte: u8| {
        let hasher = IdentityHasher::new(Some(KeySecret::new(vec![byte; 32]).unwrap()));
        key_with(&hasher, None, "a", Method::POST, "/o", b"k")
    };
    assert_ne!(base, keyed(1));
    assert_ne!(keyed(1), keyed(2));
    assert_eq!(keyed(1), keyed(1));
    assert_eq!(base, key(None, "a", Method::POST, "/o?q=1", b"k"));
    for other in [
        key(Some(b"alice"), "a", Method::POST, "/o", b"k"),
        key(None, "b", Method::POST, "/o", b"k"),
        key(None, "a", Method::PATCH, "/o", b"k"),
        key(None, "a", Method::POST, "/p", b"k"),
        key(None, "a", Method::POST, "/o", b"k2"),
    ] {
        assert_ne!(base, other);
    }
    // Length prefixes: moving bytes between parts changes the key.
    assert_ne!(
        key(Some(b"ab"), "a", Method::POST, "/o", b"c"),
        key(Some(b"a"), "a", Method::POST, "/o", b"bc")
    );
}

/// The scope key is a stored format: a change to its bytes would make
/// every retry after an upgrade a new key, and run it again. Built here by
/// hand from its documented parts (each length-prefixed, big-endian u64),
/// with SHA-256 directly, not by the code under test; and under a key
/// secret as HMAC-SHA-256 of the same bytes.
#[test]
fn the_scope_key_is_the_documented_hash_of_its_parts() {
    use hmac::{Hmac, Mac};
    use sha2::{Digest, Sha256};

    let preimage = |parts: &[&[u8]]| {
        let mut bytes = Vec::new();
        for part in parts {
            bytes.extend_from_slice(&(part.len() as u64).to_be_bytes());
            bytes.extend_from_slice(part);
        }
        bytes
    };
    let mut headers = HeaderMap::new();
    headers.insert(header::HOST, HeaderValue::from_static("Shop.Example:8080"));
    headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
    let uri = Uri::from_static("/orders/?draft=1");
    let head = RequestHead {
        method: &Method::POST,
        uri: &uri,
        headers: &headers,
        principal: Some(b"alice"),
        routed: None,
    };
    let policy = Policy {
        scope_headers: vec!["authorization".into()],
        ..Policy::default()
    }
    .validate()
    .unwrap();
    let plain = scope_key(
        &IdentityHasher::default(),
        &policy,
        &head,
        b"order-1",
        (&[], false),
    );
    let bytes = preimage(&[
        b"+",
        b"alice",
        b"authorization",
        b"Bearer t",
        b"POST",
        b"shop.example",
        b"/orders",
        b"order-1",
    ]);
    let expected: [u8; 32] = Sha256::digest(&bytes).into();
    assert_eq!(plain.as_bytes(), &expected);
    let secret = vec![7u8; 32];
    let hasher = IdentityHasher::new(Some(KeySecret::new(secret.clone()).unwrap()));
    let keyed = scope_key(&hasher, &policy, &head, b"order-1", (&[], false));
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret).unwrap();
    mac.update(&bytes);
    let expected: [u8; 32] = mac.finalize().into_bytes().into();
    assert_eq!(keyed.as_bytes(), &expected);
}

/// The memory store behind the fault injector, and its handle.
fn faulty() -> (Arc<FaultyStore<MemoryStore>>, Faults) {
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    (Arc::new(store), faults)
}

/// An engine over [`faulty`]'s store with `policy` on every route; its
/// faults, and the route covering `POST /orders`.
fn faulty_engine(policy: Policy) -> (Engine, Faults, Covered) {
    let (store, faults) = faulty();
    let engine = Engine::with_config(store, Routes::all(policy).unwrap(), EngineConfig::default());
    let covered = covered(&engine, "/orders");
    (engine, faults, covered)
}

/// A waiter polls (this store has no wake-ups) with reads only: it
/// tried to reserve once, on arrival, and replays the first answer.
#[tokio::test(start_paused = true)]
async fn a_waiter_polls_with_reads_not_reservations() {
    let (engine, faults, policy) = faulty_engine(Policy::default());
    let first = proceed(begin(&engine, &policy, "k").await);
    let waiter = tokio::spawn({
        let (engine, policy) = (engine.clone(), policy.clone());
        async move { begin(&engine, &policy, "k").await }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!waiter.is_finished(), "the waiter is still waiting");
    created(first).await;
    let Decision::Respond(replay) = waiter.await.unwrap() else {
        panic!("the waiter replays");
    };
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert!(replay.headers().contains_key(REPLAYED_HEADER));
    assert_eq!(faults.calls(Op::Reserve), 2);
}

/// A duplicate of `key` every 10 ms for `span` (on an `in_flight =
/// "reject"` route): each finds it in flight, none takes it over.
async fn duplicates_find_it_in_flight(
    engine: &Engine,
    policy: &Covered,
    key: &str,
    span: Duration,
) {
    for _ in 0..span.as_millis() / 10 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            problem_type(begin(engine, policy, key).await).1,
            "urn:tower-idempotency:in-flight",
            "the lease was renewed, not taken over"
        );
    }
}

/// Renewals that fail (a store restarting, broken pooled connections)
/// are tried again soon, not a third of the lease later: three failed
/// renewals in a row do not let a live request's lease run out.
#[tokio::test(start_paused = true)]
async fn a_failed_renewal_is_retried_before_the_lease_runs_out() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_millis(300),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    faults.set_next(Op::Renew, Fault::Down, 3);
    let held = proceed(begin(&engine, &policy, "k").await);
    duplicates_find_it_in_flight(&engine, &policy, "k", Duration::from_secs(2)).await;
    assert_eq!(faults.remaining(Op::Renew), 0, "all failed");
    held.release().await;
}

/// A store that hangs (a blackholed connection, a commit waiting for a
/// synchronous standby) rather than failing fast: each renewal attempt is
/// abandoned only after `store_timeout`. The next attempt must not wait
/// for the hanging one: with `lease = 3 × store_timeout` (the ratio
/// docs/stores.md recommends), a hang from just before the first renewal
/// until well inside the lease must not lose it. Before, the attempts came
/// `store_timeout` + a tenth of the lease apart while the store hung, and
/// the one that would have succeeded was sent after the lease ended.
#[tokio::test(start_paused = true)]
async fn renewals_do_not_wait_for_a_hanging_one() {
    let (store, faults) = faulty();
    let policy = Policy {
        lease: Duration::from_secs(3),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    };
    let config = EngineConfig {
        store_timeout: Duration::from_secs(1),
        ..EngineConfig::default()
    };
    let engine = Engine::with_config(store, Routes::all(policy).unwrap(), config);
    let policy = covered(&engine, "/orders");
    let held = proceed(begin(&engine, &policy, "k").await);
    tokio::time::sleep(Duration::from_millis(990)).await;
    faults.set(Op::Renew, Fault::Stall(Duration::from_secs(60)));
    tokio::time::sleep(Duration::from_millis(1_060)).await;
    // Sent a tenth of the lease apart while the store hung, not one per
    // `store_timeout`; and not without bound either (at most
    // `store_timeout` ÷ that, plus one, unanswered at once).
    let hung = faults.calls(Op::Renew);
    assert!((3..=5).contains(&hung), "{hung} renewals during the hang");
    faults.clear(Op::Renew);
    // The store answers again from 2.05 s; the lease taken at 0 ends at
    // 3 s unless a renewal reaches it in between.
    duplicates_find_it_in_flight(&engine, &policy, "k", Duration::from_secs(3)).await;
    held.release().await;
}

/// A task cancelled while the answer is being stored (a client gone
/// while the layer awaits the store, the too-large marker's write): the
/// head came, so the upstream acted, and the reservation dropped mid-store
/// stores "executed, response incomplete" instead of freeing the key: the
/// retry never runs the request again.
#[tokio::test(start_paused = true)]
async fn a_task_cancelled_while_storing_never_frees_the_key() {
    let (engine, faults, policy) = faulty_engine(Policy::default());
    let reservation = proceed(begin(&engine, &policy, "k").await);
    let mut recorder = reservation
        .record(StatusCode::CREATED, &HeaderMap::new())
        .await;
    assert_eq!(
        recorder.chunk(&Bytes::from_static(b"order 1")).await,
        Flow::Record
    );
    faults.set_next(Op::Complete, Fault::Stall(Duration::from_secs(1)), 1);
    let storing = tokio::time::timeout(Duration::from_millis(10), recorder.end());
    assert!(storing.await.is_err(), "cancelled while storing");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        problem_type(begin(&engine, &policy, "k").await),
        (
            StatusCode::CONFLICT,
            "urn:tower-idempotency:response-incomplete".to_owned()
        )
    );
    assert_eq!(engine.metrics().in_flight(), 0, "the heir settled");
}

/// The same for "outcome unknown" (an execution that timed out, whose
/// 504 is the key's outcome): cancelled while that is stored, the key is
/// still never freed for a second run.
#[tokio::test(start_paused = true)]
async fn a_task_cancelled_while_storing_an_unknown_outcome_never_frees_the_key() {
    let (engine, faults, policy) = faulty_engine(Policy::default());
    let reservation = proceed(begin(&engine, &policy, "k").await);
    faults.set_next(Op::Complete, Fault::Stall(Duration::from_secs(1)), 1);
    let headers = HeaderMap::new();
    let storing = tokio::time::timeout(
        Duration::from_millis(10),
        reservation.execution_timed_out(&headers),
    );
    assert!(storing.await.is_err(), "cancelled while storing");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let decision = begin(&engine, &policy, "k").await;
    assert!(
        !matches!(decision, Decision::Proceed(_)),
        "the request ran again: {decision:?}"
    );
    assert_eq!(engine.metrics().in_flight(), 0, "the heir settled");
}

/// The store starts a lease when it runs the reservation, which may be
/// well before its answer arrives (a slow commit, a lock wait): renewals
/// are timed from when the call was sent, so a slow answer does not let
/// the lease run out under a live owner.
#[tokio::test(start_paused = true)]
async fn a_slow_reservation_answer_does_not_let_its_lease_run_out() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_millis(300),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    // Committed at once, answered 250 ms later: the lease has 50 ms left.
    faults.set_next(
        Op::Reserve,
        Fault::CommitThenStall(Duration::from_millis(250)),
        1,
    );
    let held = proceed(begin(&engine, &policy, "k").await);
    duplicates_find_it_in_flight(&engine, &policy, "k", Duration::from_secs(1)).await;
    held.release().await;
}

/// A reservation committed at once but answered only after its lease ran
/// out (a stalled connection, a slow network): meanwhile a retry took the
/// expired lease over and runs. The late answer must not run beside it.
#[tokio::test(start_paused = true)]
async fn a_reservation_answered_after_its_lease_ran_out_never_runs_beside_its_taker() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_millis(300),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    faults.set_next(
        Op::Reserve,
        Fault::CommitThenStall(Duration::from_millis(500)),
        1,
    );
    late_request_meets_its_taker(&engine, &policy, Duration::from_millis(350)).await;
}

/// Sends a request for key `k` whose reservation is answered late (the
/// faults set by the caller), and another `after` later that takes the
/// key over: the late one must find it in flight, never run beside it.
async fn late_request_meets_its_taker(engine: &Engine, policy: &Covered, after: Duration) {
    let late = tokio::spawn({
        let (engine, policy) = (engine.clone(), policy.clone());
        async move { begin(&engine, &policy, "k").await }
    });
    tokio::time::sleep(after).await;
    let taker = proceed(begin(engine, policy, "k").await);
    assert_eq!(
        problem_type(late.await.unwrap()).1,
        "urn:tower-idempotency:in-flight",
        "the late request ran beside the request that took the key over"
    );
    assert_eq!(engine.metrics().in_flight(), 1, "one execution");
    taker.release().await;
}

/// The renewal that confirms a late reservation answer is itself answered
/// late: it renewed the lease when it ran, but the lease ran out again on
/// the way back and a retry took the key over. The first request must not
/// run beside it on the strength of that stale "renewed".
#[tokio::test(start_paused = true)]
async fn a_late_confirmation_is_confirmed_again() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_millis(300),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    // Reserved at 0, answered at 200; renewed at 200 (its lease to 500),
    // answered at 600.
    faults.set_next(
        Op::Reserve,
        Fault::CommitThenStall(Duration::from_millis(200)),
        1,
    );
    faults.set_next(
        Op::Renew,
        Fault::CommitThenStall(Duration::from_millis(400)),
        1,
    );
    late_request_meets_its_taker(&engine, &policy, Duration::from_millis(550)).await;
}

/// A caller that goes away while its late reservation is being confirmed
/// (the renewal in flight) leaves nothing held: no `Reservation` exists
/// yet to release it, so the key stayed in flight for the rest of its
/// lease and the retry was refused.
#[tokio::test(start_paused = true)]
async fn a_caller_gone_while_its_reservation_is_confirmed_leaves_nothing_held() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_secs(3),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    // Answered after 2 s (two thirds of the lease), then the renewal that
    // confirms it stalls.
    faults.set_next(
        Op::Reserve,
        Fault::CommitThenStall(Duration::from_secs(2)),
        1,
    );
    faults.set_next(Op::Renew, Fault::Stall(Duration::from_secs(10)), 1);
    let gone = tokio::spawn({
        let (engine, policy) = (engine.clone(), policy.clone());
        async move { begin(&engine, &policy, "k").await }
    });
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(faults.calls(Op::Renew), 1, "the confirmation is in flight");
    gone.abort();
    let _ = gone.await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    proceed(begin(&engine, &policy, "k").await).release().await;
}

/// Renewals whose tasks end unanswered (here: the store's call panics)
/// still end as attempts: more of them than may be in flight at once do
/// not stop the renewer from sending the one that succeeds before the
/// lease runs out.
#[tokio::test(start_paused = true)]
async fn renewals_that_end_unanswered_do_not_stop_renewal() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_secs(30),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    faults.set_next(Op::Renew, Fault::Panic, 17);
    let held = proceed(begin(&engine, &policy, "k").await);
    // The first renewal at 10 s; seventeen panic, a second apart; the
    // eighteenth, before 30 s, succeeds.
    tokio::time::sleep(Duration::from_secs(29)).await;
    assert_eq!(faults.remaining(Op::Renew), 0);
    duplicates_find_it_in_flight(&engine, &policy, "k", Duration::from_secs(3)).await;
    held.release().await;
}

/// The memory store, whose first reservation fails at once (a connection
/// reset) while the database runs the statement on and commits it 200 ms
/// later.
#[derive(Debug)]
struct CommitsAfterFailing {
    store: Arc<MemoryStore>,
    failed: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl Store for CommitsAfterFailing {
    async fn reserve(
        &self,
        key: &crate::store::ScopeKey,
        fingerprint: &crate::store::Fingerprint,
        owner: &crate::store::OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<crate::store::Claim, crate::store::StoreError> {
        if self.failed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return self
                .store
                .reserve(key, fingerprint, owner, lease, ttl)
                .await;
        }
        let (store, key, fingerprint, owner) = (self.store.clone(), *key, *fingerprint, *owner);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = store.reserve(&key, &fingerprint, &owner, lease, ttl).await;
        });
        Err(crate::store::StoreError::Unavailable(
            "connection reset".into(),
        ))
    }

    async fn complete(
        &self,
        key: &crate::store::ScopeKey,
        owner: &crate::store::OwnerToken,
        outcome: &crate::store::Outcome,
        ttl: Duration,
    ) -> Result<bool, crate::store::StoreError> {
        self.store.complete(key, owner, outcome, ttl).await
    }

    async fn release(
        &self,
        key: &crate::store::ScopeKey,
        owner: &crate::store::OwnerToken,
    ) -> Result<bool, crate::store::StoreError> {
        self.store.release(key, owner).await
    }

    async fn renew(
        &self,
        key: &crate::store::ScopeKey,
        owner: &crate::store::OwnerToken,
        lease: Duration,
    ) -> Result<bool, crate::store::StoreError> {
        self.store.renew(key, owner, lease).await
    }

    async fn get(
        &self,
        key: &crate::store::ScopeKey,
    ) -> Result<Option<crate::store::Record>, crate::store::StoreError> {
        self.store.get(key).await
    }
}

/// A reservation that failed (503) but committed afterwards holds the key
/// under a token nobody acts on: the engine releases it again after
/// `store_timeout`, so the retry is not refused as in flight for the whole
/// lease.
#[tokio::test(start_paused = true)]
async fn a_reservation_that_failed_and_then_committed_is_released() {
    let store = CommitsAfterFailing {
        store: Arc::new(MemoryStore::new()),
        failed: Default::default(),
    };
    let policy = Policy {
        lease: Duration::from_secs(30),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    };
    let config = EngineConfig {
        store_timeout: Duration::from_secs(1),
        ..EngineConfig::default()
    };
    let engine = Engine::with_config(Arc::new(store), Routes::all(policy).unwrap(), config);
    let policy = covered(&engine, "/orders");
    let (status, _) = problem_type(begin(&engine, &policy, "k").await);
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proceed(begin(&engine, &policy, "k").await).release().await;
}

#[tokio::test(start_paused = true)]
async fn a_store_outage_shorter_than_the_lease_never_executes_twice() {
    let (store, faults) = faulty();
    let policy = Policy {
        lease: Duration::from_secs(2),
        ..Policy::default()
    };
    let engine = Engine::with_config(
        store.clone(),
        Routes::all(policy).unwrap(),
        EngineConfig::default(),
    );
    let (method, uri) = (Method::POST, Uri::from_static("/orders"));
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", HeaderValue::from_static("k1"));
    let head = RequestHead {
        method: &method,
        uri: &uri,
        headers: &headers,
        principal: None,
        routed: None,
    };
    let policy = covered(&engine, "/orders");
    let Decision::Proceed(reservation) = engine.begin(&policy, head, b"").await else {
        panic!("the first request proceeds");
    };
    // The store is down for a while (well under the lease) when the
    // upstream's answer arrives.
    faults.set_next(Op::Complete, Fault::Down, 10);
    created(reservation).await;
    // Long after the lease, a retry is a replay, not a second execution.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(faults.remaining(Op::Complete), 0, "storing was retried");
    match engine.begin(&policy, head, b"").await {
        Decision::Respond(response) => {
            assert_eq!(response.status(), StatusCode::CREATED);
            assert_eq!(response.headers()[REPLAYED_HEADER], "true");
        }
        other => panic!("the retry executed again: {other:?}"),
    }
}

/// An engine over `store` with a short `store_timeout`, rejecting
/// duplicates in flight at once (so "in flight" shows as 409).
fn over(store: Arc<dyn Store>, fail_mode: FailMode) -> (Engine, Covered) {
    let policy = Policy {
        in_flight: InFlightPolicy::Reject,
        fail_mode,
        ..Policy::default()
    };
    let config = EngineConfig {
        store_timeout: Duration::from_millis(100),
        ..EngineConfig::default()
    };
    let engine = Engine::with_config(store, Routes::all(policy).unwrap(), config);
    let policy = covered(&engine, "/orders");
    (engine, policy)
}

/// Stores `reservation`'s answer: 201 with an empty body.
async fn created(reservation: Reservation) {
    let _ = reservation
        .record(StatusCode::CREATED, &HeaderMap::new())
        .await
        .end()
        .await;
}

/// A reservation written but answered with an error (or too late): the
/// client gets 503, and the engine releases the reservation with its
/// token, so the retry executes instead of meeting 409 for a lease.
/// (Before the engine drew the token, the retry got 409 `in-flight`.)
#[tokio::test(start_paused = true)]
async fn a_reservation_committed_but_unanswered_is_released() {
    for fault in [
        Fault::CommitThenFail,
        Fault::CommitThenStall(Duration::from_secs(10)),
    ] {
        let (store, faults) = faulty();
        let (engine, policy) = over(store.clone(), FailMode::Closed);
        faults.set_next(Op::Reserve, fault, 1);
        assert_eq!(
            problem_type(begin(&engine, &policy, "k").await),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "urn:tower-idempotency:store-unavailable".to_owned()
            ),
            "{fault:?}"
        );
        assert_eq!(faults.inner_calls(Op::Reserve), 1, "it was written");
        tokio::time::sleep(Duration::from_millis(1)).await;
        let retry = proceed(begin(&engine, &policy, "k").await);
        // The late answer's second release leaves the retry's record be.
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(
            problem_type(begin(&engine, &policy, "k").await).1,
            "urn:tower-idempotency:in-flight",
            "{fault:?}"
        );
        created(retry).await;
        assert!(matches!(
            begin(&engine, &policy, "k").await,
            Decision::Respond(response) if response.headers().contains_key(REPLAYED_HEADER)
        ));
    }
}

/// A reservation abandoned before it reached the store, which then
/// writes it late (after the 503): released when the late call ends.
#[tokio::test(start_paused = true)]
async fn a_reservation_written_after_its_timeout_is_released() {
    let (store, faults) = faulty();
    let (engine, policy) = over(store.clone(), FailMode::Closed);
    faults.set_next(Op::Reserve, Fault::Stall(Duration::from_secs(3)), 1);
    assert_eq!(
        problem_type(begin(&engine, &policy, "k").await).0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(faults.inner_calls(Op::Reserve), 0, "not written yet");
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(faults.inner_calls(Op::Reserve), 1, "written late");
    assert!(store.inner().is_empty(), "and released");
    proceed(begin(&engine, &policy, "k").await).release().await;
}

/// The caller goes away (its future dropped: a client that disconnects
/// under the tower layer) while its reservation is on its way to the
/// store, which writes it: nobody owns that record, so the engine releases
/// it when the call ends, and a retry executes at once instead of meeting
/// 409 `in-flight` for a whole lease.
#[tokio::test(start_paused = true)]
async fn a_reservation_whose_caller_went_away_is_released() {
    let (store, faults) = faulty();
    let (engine, policy) = over(store.clone(), FailMode::Closed);
    // Written at once, answered late (a database that committed and has
    // not answered yet).
    faults.set_next(
        Op::Reserve,
        Fault::CommitThenStall(Duration::from_millis(50)),
        1,
    );
    let abandoned = tokio::time::timeout(Duration::from_millis(10), begin(&engine, &policy, "k"));
    assert!(abandoned.await.is_err(), "the caller gave up first");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(faults.inner_calls(Op::Reserve), 1, "it was written");
    assert!(store.inner().is_empty(), "and released");
    proceed(begin(&engine, &policy, "k").await).release().await;
}

/// Fail-open: the request whose reservation was lost runs unprotected
/// (one execution); the reservation is released at once, independently
/// of that request, so the retry is reserved normally (the second
/// execution, as documented for fail-open) and later ones replay it.
#[tokio::test(start_paused = true)]
async fn fail_open_releases_the_lost_reservation_before_the_retry() {
    let (store, faults) = faulty();
    let (engine, policy) = over(store.clone(), FailMode::Open);
    faults.set_next(Op::Reserve, Fault::CommitThenFail, 1);
    assert!(matches!(
        begin(&engine, &policy, "k").await,
        Decision::Forward
    ));
    tokio::time::sleep(Duration::from_millis(1)).await;
    created(proceed(begin(&engine, &policy, "k").await)).await;
    assert!(matches!(
        begin(&engine, &policy, "k").await,
        Decision::Respond(response) if response.headers().contains_key(REPLAYED_HEADER)
    ));
}

/// A shutdown right after a reservation was lost (its call answered
/// late, or its caller went away) waits for the release of what the store
/// wrote: otherwise the process exits with the record in flight, and every
/// retry meets 409 `in-flight` for a whole lease.
#[tokio::test(start_paused = true)]
async fn drain_waits_for_the_release_of_a_lost_reservation() {
    for caller_leaves in [false, true] {
        let (store, faults) = faulty();
        let (engine, policy) = over(store.clone(), FailMode::Closed);
        // Written at once, answered after `store_timeout` (5 s).
        faults.set_next(
            Op::Reserve,
            Fault::CommitThenStall(Duration::from_secs(6)),
            1,
        );
        if caller_leaves {
            let begun =
                tokio::time::timeout(Duration::from_millis(10), begin(&engine, &policy, "k"));
            assert!(begun.await.is_err(), "the caller gave up first");
        } else {
            let (status, _) = problem_type(begin(&engine, &policy, "k").await);
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        }
        assert!(!store.inner().is_empty(), "written, not released yet");
        let report = engine.drain(Duration::from_secs(30)).await;
        assert!(report.is_complete(), "{report:?}");
        assert!(report.waited_for >= 1, "{report:?}");
        assert!(store.inner().is_empty(), "released before the drain ended");
    }
}

/// An execution still running when the drain's time is up (a library
/// user's graceful shutdown, the proxy's SIGTERM past `shutdown_timeout`):
/// its key gets "executed, outcome unknown" (504) as its owner, so once the
/// process is gone and the lease ran out a retry replays that instead of
/// running the request a second time.
#[tokio::test(start_paused = true)]
async fn a_drain_that_abandons_an_execution_leaves_its_key_no_second_run() {
    let (engine, _faults, policy) = faulty_engine(Policy {
        lease: Duration::from_millis(300),
        ..Policy::default()
    });
    let running = proceed(begin(&engine, &policy, "k").await);
    // One that never reached its upstream (still connecting, or waiting
    // for the inner service to be ready) is not marked: nothing can have
    // acted, and its key frees with its lease.
    let waiting = proceed(begin(&engine, &policy, "w").await);
    assert!(running.acting());
    let report = engine.drain(Duration::from_millis(50)).await;
    assert_eq!((report.held, report.marked), (2, 1), "{report:?}");
    std::mem::forget(waiting);
    // The process goes away: nothing renews the lease any more.
    std::mem::forget(running);
    engine.inner.leases.stop();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let Decision::Respond(response) = begin(&engine, &policy, "k").await else {
        panic!("the retry ran the abandoned request again");
    };
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(response.headers()[REPLAYED_HEADER], "true");
    proceed(begin(&engine, &policy, "w").await).release().await;
}

/// From a review of the shutdown: a request still running when the drain
/// gave up waiting (a body still arriving at `shutdown_timeout`) reserved
/// its key after the drain had taken its list of executions to mark, and
/// reached its upstream; the process exited with that key in flight and
/// unmarked, and once its lease ran out a retry ran it a second time. Now
/// no reservation acts once the drain ended, whether it ran out of time or
/// found nothing to wait for: 503, key released, and the retry runs once.
#[tokio::test(start_paused = true)]
async fn no_reservation_acts_once_the_drain_ended() {
    for busy in [true, false] {
        let (engine, _faults, policy) = faulty_engine(Policy {
            lease: Duration::from_millis(300),
            ..Policy::default()
        });
        let running = match busy {
            true => Some(proceed(begin(&engine, &policy, "running").await)),
            false => None,
        };
        assert!(running.as_ref().is_none_or(Reservation::acting));
        let report = engine.drain(Duration::from_millis(50)).await;
        assert_eq!(report.held, usize::from(busy), "{report:?}");
        // A request the server gave up on reserves its key only now.
        let late = proceed(begin(&engine, &policy, "late").await);
        assert!(!late.acting(), "busy {busy}: it would act unmarked");
        let answer = late.lost(&HeaderMap::new()).await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        std::mem::forget(running);
        engine.inner.leases.stop();
    }
}

/// An engine over a fault injector with a long lease (so a failed
/// completion is retried for a long time), and a reservation of key `k`.
async fn reserved_over_faulty() -> (Engine, Faults, Covered, Reservation) {
    let (store, faults) = faulty();
    let policy = Policy {
        lease: Duration::from_secs(60),
        ..Policy::default()
    };
    let engine = Engine::with_config(store, Routes::all(policy).unwrap(), EngineConfig::default());
    let policy = covered(&engine, "/orders");
    let reservation = proceed(begin(&engine, &policy, "k").await);
    (engine, faults, policy, reservation)
}

#[tokio::test(start_paused = true)]
async fn drain_waits_for_a_completion_being_retried() {
    let (engine, faults, policy, reservation) = reserved_over_faulty().await;
    // Storing fails for a while: the client gets its answer, the outcome is
    // retried in the background.
    faults.set_next(Op::Complete, Fault::Down, 20);
    created(reservation).await;
    assert_eq!(engine.pending_background(), 1, "the completion is pending");
    let report = engine.drain(Duration::from_secs(30)).await;
    assert!(report.is_complete(), "{report:?}");
    // The completion, and the reservation it still holds.
    assert_eq!(report.waited_for, 2);
    assert_eq!(engine.pending_background(), 0);
    assert_eq!(faults.remaining(Op::Complete), 0, "storing was retried");
    // The moment drain returns the outcome is stored: a retry replays.
    let decision = begin(&engine, &policy, "k").await;
    let Decision::Respond(response) = decision else {
        panic!("the retry executed again: {decision:?}");
    };
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()[REPLAYED_HEADER], "true");
}

/// From a review of the shutdown: an answer whose storing still failed
/// at the drain's timeout (its client has it) was left in flight, and a
/// retry after its lease executed the request again, although a store
/// that takes fresh calls could take a small marker. Now the drain stores
/// "executed, response not stored" for it, owner-checked: the retry gets
/// 409 with the status, never a second execution.
#[tokio::test(start_paused = true)]
async fn a_drain_marks_an_answer_still_being_stored() {
    let (engine, faults, policy, reservation) = reserved_over_faulty().await;
    faults.set(Op::Complete, Fault::Down);
    created(reservation).await;
    assert_eq!(engine.pending_background(), 1, "the completion is pending");
    // The background attempts go at 10, 30, 70, 150, 310 ms, then every
    // 200 ms (510, 710, 910, 1,110, 1,310, 1,510 ms; `store::backoff`). The drain's deadline is 1 s,
    // and its wait for the answer to land ends at 1.5 s: the store
    // answers again just before, and the drain's marker, sent then, is
    // the first call it takes.
    let healed = faults.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1450)).await;
        healed.clear(Op::Complete);
    });
    let report = engine.drain(Duration::from_secs(1)).await;
    assert_eq!(report.marked, 1, "{report:?}");
    let Decision::Respond(response) = begin(&engine, &policy, "k").await else {
        panic!("the retry executed again");
    };
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let body = String::from_utf8_lossy(response.body()).into_owned();
    assert!(body.contains("response-not-stored"), "{body}");
}

/// From a review of that marker: it was stored for every answer being
/// stored, the first attempt too, so on a slow but working store (or at
/// SIGINT, which drains at once) the small marker overtook the answer and
/// retries got 409 where they should replay. An answer on its first
/// attempt is given half a second to land before it is marked: this one
/// lands, and replays.
#[tokio::test(start_paused = true)]
async fn a_drain_lets_an_answer_on_its_first_attempt_land() {
    let (engine, faults, policy, reservation) = reserved_over_faulty().await;
    faults.set_next(Op::Complete, Fault::Stall(Duration::from_millis(300)), 1);
    let storing = tokio::spawn(async move { created(reservation).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let report = engine.drain(Duration::ZERO).await;
    // Landed within the drain: nothing abandoned (a proxy exits 0).
    assert_eq!((report.held, report.marked), (0, 0), "{report:?}");
    let _ = storing.await;
    let Decision::Respond(response) = begin(&engine, &policy, "k").await else {
        panic!("the retry executed again");
    };
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()[REPLAYED_HEADER], "true");
}

/// From the review of that wait: it covered first attempts only, so an
/// answer whose first attempt failed (the store down a moment) was marked
/// at once, racing the retry about to store it, and retries got 409 where
/// they could replay. Every answer being stored is given the wait.
#[tokio::test(start_paused = true)]
async fn a_drain_gives_an_answer_being_retried_time_to_land() {
    let (engine, faults, policy, reservation) = reserved_over_faulty().await;
    faults.set_next(Op::Complete, Fault::Down, 1);
    created(reservation).await;
    assert_eq!(engine.pending_background(), 1, "the completion is retried");
    let report = engine.drain(Duration::ZERO).await;
    assert_eq!((report.held, report.marked), (0, 0), "{report:?}");
    let Decision::Respond(response) = begin(&engine, &policy, "k").await else {
        panic!("the retry executed again");
    };
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()[REPLAYED_HEADER], "true");
}

/// From a review of the shutdown: that rule left an answer whose first
/// attempt was still under way at the drain's end (SIGINT a moment after
/// the upstream answered; a store slow for a second) unmarked, and the
/// process exiting cut the attempt: the key stayed in flight, and the
/// first retry after its lease ran the request again. The attempt gets
/// the markers' budget to land; one still on its way is marked.
#[tokio::test(start_paused = true)]
async fn a_drain_marks_an_answer_whose_first_attempt_outlasts_it() {
    let (engine, faults, policy, reservation) = reserved_over_faulty().await;
    faults.set_next(Op::Complete, Fault::Stall(Duration::from_secs(3)), 1);
    let storing = tokio::spawn(async move { created(reservation).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let report = engine.drain(Duration::ZERO).await;
    assert_eq!(report.marked, 1, "{report:?}");
    // The process exits: the attempt never ends.
    storing.abort();
    let _ = storing.await;
    // Past the lease (60 s), a retry finds the marker, not a key to take.
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(
        problem_type(begin(&engine, &policy, "k").await),
        (
            StatusCode::CONFLICT,
            "urn:tower-idempotency:response-not-stored".to_owned()
        )
    );
}

/// From a review: a recorder dropped mid-body hands its key to an heir
/// that stores "response incomplete" from a task of its own; until that
/// task first ran the heir was neither running nor settling, so a drain
/// then marked nothing, and the process exiting left the key in flight
/// for a retry to run again. The heir is marked at once.
#[tokio::test(start_paused = true)]
async fn a_drain_marks_an_heir_before_its_task_runs() {
    let (engine, faults, policy) = faulty_engine(Policy::default());
    let reservation = proceed(begin(&engine, &policy, "k").await);
    assert!(reservation.acting());
    let mut recorder = reservation
        .record(StatusCode::CREATED, &HeaderMap::new())
        .await;
    assert_eq!(
        recorder.chunk(&Bytes::from_static(b"order 1")).await,
        Flow::Record
    );
    // The heir's own first attempt hangs past the drain's wait (the
    // process is going away), so only the drain's marker can keep the key.
    faults.set_next(Op::Complete, Fault::Stall(Duration::from_secs(10)), 1);
    drop(recorder);
    let report = engine.drain(Duration::ZERO).await;
    assert_eq!(report.marked, 1, "{report:?}");
    assert_eq!(
        problem_type(begin(&engine, &policy, "k").await),
        (
            StatusCode::CONFLICT,
            "urn:tower-idempotency:response-not-stored".to_owned()
        )
    );
}

#[tokio::test(start_paused = true)]
async fn drain_reports_what_it_abandons_at_its_timeout() {
    let (engine, faults, _, reservation) = reserved_over_faulty().await;
    let key = reservation.key_hash();
    // Storing keeps failing, and so does releasing an abandoned key.
    faults.set(Op::Complete, Fault::Down);
    faults.set(Op::Release, Fault::Down);
    created(reservation).await;
    let report = engine.drain(Duration::from_secs(5)).await;
    assert_eq!(report.waited_for, 2);
    assert_eq!(report.abandoned, vec![key.clone()]);
    assert_eq!(report.held, 1, "the reservation the completion holds");
    assert!(!report.is_complete());
    assert!(faults.calls(Op::Complete) > 1, "it was being retried");
    // An abandoned reservation's release is background work too.
    let (other, other_faults, _, held) = reserved_over_faulty().await;
    other_faults.set(Op::Release, Fault::Stall(Duration::from_secs(3)));
    let other_key = held.key_hash();
    drop(held);
    assert_eq!(other.pending_background(), 1);
    let report = other.drain(Duration::from_secs(1)).await;
    assert_eq!(report.abandoned, vec![other_key]);
    let report = other.drain(Duration::from_secs(10)).await;
    assert!(report.is_complete(), "{report:?}");
    assert_eq!(other_faults.inner_calls(Op::Release), 1);
}

#[tokio::test(start_paused = true)]
async fn drain_waits_for_an_execution_still_holding_its_key() {
    let (engine, _, policy) = engine(Policy::default());
    let reservation = proceed(begin(&engine, &policy, "k").await);
    let report = engine.drain(Duration::from_secs(1)).await;
    assert_eq!((report.waited_for, report.held), (1, 1), "{report:?}");
    assert!(!report.is_complete());
    // The execution (e.g. one whose caller went away) ends later.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        created(reservation).await;
    });
    let report = engine.drain(Duration::from_secs(10)).await;
    assert!(report.is_complete(), "{report:?}");
    let decision = begin(&engine, &policy, "k").await;
    let Decision::Respond(response) = decision else {
        panic!("the retry executed again: {decision:?}");
    };
    assert_eq!(response.headers()[REPLAYED_HEADER], "true");
}

#[tokio::test]
async fn a_body_counts_at_its_length_only_where_the_length_frames_it() {
    let store = MemoryStore::new();
    let config = EngineConfig {
        max_buffered_bytes: 1500,
        ..EngineConfig::default()
    };
    let engine = Engine::with_config(
        Arc::new(store),
        Routes::all(Policy::default()).unwrap(),
        config,
    );
    let policy = covered(&engine, "/orders");
    let permit = |pairs: &[(header::HeaderName, &'static str)]| {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(name.clone(), HeaderValue::from_static(value));
        }
        engine
            .body_permit(&policy, &headers)
            .map(|permit| permit.bytes())
            .map_err(|refused| {
                let retry_after = refused.headers().contains_key(header::RETRY_AFTER);
                (refused.status(), retry_after)
            })
    };
    assert_eq!(permit(&[(header::CONTENT_LENGTH, "1000")]).unwrap(), 1000);
    // Unknown, ignored or ambiguous lengths count at the body limit: the
    // route's (1 MiB), bounded by the whole budget (1500), never at a
    // declared 0.
    for unframed in [
        vec![],
        vec![
            (header::CONTENT_LENGTH, "0"),
            (header::TRANSFER_ENCODING, "chunked"),
        ],
        vec![(header::CONTENT_LENGTH, "0"), (header::CONTENT_LENGTH, "0")],
    ] {
        assert_eq!(permit(&unframed).unwrap(), 1500);
    }
    // Two permits that together pass the budget: the second is refused,
    // and room comes back when the first is dropped.
    let first = engine
        .body_permit(&policy, &{
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("1000"));
            h
        })
        .unwrap();
    assert!(permit(&[(header::CONTENT_LENGTH, "1000")]).is_err());
    assert_eq!(engine.metrics().buffered_bytes(), 1000);
    drop(first);
    assert_eq!(engine.metrics().buffered_bytes(), 0);
    assert!(permit(&[(header::CONTENT_LENGTH, "1000")]).is_ok());
    assert_eq!(engine.metrics().overloaded(), 1);
    assert!(engine.metrics().buffered_bytes_peak() <= 1500);
}

/// The memory store, refusing every completion that carries a response
/// (as a database refuses a record too large for it) while it renews
/// leases and stores markers.
#[derive(Debug)]
struct RefusesResponses(MemoryStore);

#[async_trait::async_trait]
impl Store for RefusesResponses {
    async fn reserve(
        &self,
        key: &crate::store::ScopeKey,
        fingerprint: &crate::store::Fingerprint,
        owner: &crate::store::OwnerToken,
        lease: Duration,
        ttl: Duration,
    ) -> Result<crate::store::Claim, crate::store::StoreError> {
        self.0.reserve(key, fingerprint, owner, lease, ttl).await
    }

    async fn complete(
        &self,
        key: &crate::store::ScopeKey,
        owner: &crate::store::OwnerToken,
        outcome: &crate::store::Outcome,
        ttl: Duration,
    ) -> Result<bool, crate::store::StoreError> {
        if matches!(outcome, crate::store::Outcome::Stored(_)) {
            return Err(crate::store::StoreError::Unavailable(
                "the record is too large".into(),
            ));
        }
        self.0.complete(key, owner, outcome, ttl).await
    }

    async fn release(
        &self,
        key: &crate::store::ScopeKey,
        owner: &crate::store::OwnerToken,
    ) -> Result<bool, crate::store::StoreError> {
        self.0.release(key, owner).await
    }

    async fn renew(
        &self,
        key: &crate::store::ScopeKey,
        owner: &crate::store::OwnerToken,
        lease: Duration,
    ) -> Result<bool, crate::store::StoreError> {
        self.0.renew(key, owner, lease).await
    }

    async fn get(
        &self,
        key: &crate::store::ScopeKey,
    ) -> Result<Option<crate::store::Record>, crate::store::StoreError> {
        self.0.get(key).await
    }
}

/// A store that keeps refusing the response (while it renews the lease)
/// must not let the key be taken over when the engine stops retrying: a
/// retry long after gets 409 `response-not-stored` (the request ran), never
/// a second execution.
#[tokio::test(start_paused = true)]
async fn a_response_the_store_keeps_refusing_still_keeps_the_key_executed() {
    let routes = Routes::all(Policy {
        lease: Duration::from_millis(300),
        ..Policy::default()
    })
    .unwrap();
    let engine = Engine::new(RefusesResponses(MemoryStore::new()), routes);
    let policy = covered(&engine, "/orders");
    let first = proceed(begin(&engine, &policy, "k").await);
    let mut recorder = first.record(StatusCode::CREATED, &HeaderMap::new()).await;
    assert_eq!(
        recorder.chunk(&Bytes::from_static(b"order 1")).await,
        Flow::Record
    );
    let _ = recorder.end().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    for _ in 0..3 {
        assert_eq!(
            problem_type(begin(&engine, &policy, "k").await),
            (
                StatusCode::CONFLICT,
                "urn:tower-idempotency:response-not-stored".to_owned()
            )
        );
    }
}

/// A changed request (`mismatch = "replay"`) waiting on a record whose
/// owner stopped renewing: the lease ran out, but only a request with the
/// same fingerprint may take it over, so the waiter keeps waiting. It must
/// poll at the store's backoff, not every millisecond (a `get` and a
/// `reserve` each time, for the whole `wait_timeout`).
#[tokio::test(start_paused = true)]
async fn a_waiter_that_cannot_take_over_polls_at_the_backoff() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_millis(300),
        wait_timeout: Duration::from_secs(2),
        mismatch: crate::policy::MismatchPolicy::Replay,
        ..Policy::default()
    });
    let held = proceed(begin(&engine, &policy, "k").await);
    // The owner's heartbeat cannot reach the store from now on.
    faults.set(Op::Renew, Fault::Down);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = faults.calls(Op::Get) + faults.calls(Op::Reserve);
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", "k".parse().unwrap());
    headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    let head = RequestHead {
        method: &Method::POST,
        uri: &Uri::from_static("/orders"),
        headers: &headers,
        principal: None,
        routed: None,
    };
    let changed = engine.begin(&policy, head, br#"{"amount":11}"#).await;
    assert_eq!(problem_type(changed).1, "urn:tower-idempotency:in-flight");
    let polls = faults.calls(Op::Get) + faults.calls(Op::Reserve) - before;
    assert!(polls <= 40, "{polls} store calls in a 2 s wait");
    held.release().await;
}

/// A route whose `max_body_bytes` is larger than the engine's whole buffer
/// budget: a body of unknown length used to be counted at the route's
/// limit, which never fits, so every such request got 503 `overloaded`
/// (with a `Retry-After` no retry could meet) on an idle engine. The
/// budget now bounds the body limit: the body is read, up to the budget.
#[tokio::test]
async fn a_body_limit_over_the_whole_budget_is_bounded_by_it() {
    let routes = Routes::all(Policy {
        max_body_bytes: 1 << 20,
        ..Policy::default()
    })
    .unwrap();
    let engine = Engine::with_config(
        Arc::new(MemoryStore::new()),
        routes,
        EngineConfig {
            max_buffered_bytes: 1000,
            ..EngineConfig::default()
        },
    );
    let policy = covered(&engine, "/orders");
    assert_eq!(policy.max_body_bytes(), 1000);
    let mut chunked = HeaderMap::new();
    chunked.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
    let permit = engine.body_permit(&policy, &chunked);
    assert!(permit.is_ok(), "an idle engine refused a body as overload");
}

/// An answer that does not consume the key (a 422 to fix the form) whose
/// release fails once: the release is tried again, so the corrected
/// request executes at once instead of meeting its own key in flight until
/// the lease (a minute here) ends.
#[tokio::test(start_paused = true)]
async fn a_release_that_fails_is_tried_again() {
    let (engine, faults, policy, reservation) = reserved_over_faulty().await;
    faults.set_next(Op::Release, Fault::Down, 1);
    let recorder = reservation
        .record(StatusCode::UNPROCESSABLE_ENTITY, &HeaderMap::new())
        .await;
    assert!(!recorder.is_recording());
    assert_eq!(faults.calls(Op::Release), 1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(faults.inner_calls(Op::Release), 1, "released again");
    proceed(begin(&engine, &policy, "k").await).release().await;
}

/// A reservation whose lease no renewal kept for its whole length (the
/// store out while the request waited for its upstream, say for the inner
/// service to be ready) may have been taken over: it does not act. One
/// renewed all along does, however long it waited.
#[tokio::test(start_paused = true)]
async fn a_reservation_whose_lease_may_be_lost_does_not_act() {
    let (engine, faults, policy) = faulty_engine(Policy {
        lease: Duration::from_secs(3),
        ..Policy::default()
    });
    let renewed = proceed(begin(&engine, &policy, "renewed").await);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(renewed.acting(), "renewed all along");

    let stranded = proceed(begin(&engine, &policy, "stranded").await);
    faults.set(Op::Renew, Fault::Down);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(faults.calls(Op::Renew) > 0, "renewals were tried");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    faults.clear(Op::Renew);
    // Another arrival takes the expired lease over and runs.
    let successor = proceed(begin(&engine, &policy, "stranded").await);
    assert!(!stranded.acting(), "the lease was lost: it must not run");
    let lost = stranded.lost(&HeaderMap::new()).await;
    assert_eq!(lost.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(lost.headers().contains_key(header::RETRY_AFTER));
    // Its release was owner-checked: the successor still holds the key.
    assert!(successor.acting());
    let recorder = successor
        .record(StatusCode::CREATED, &HeaderMap::new())
        .await;
    let _ = recorder.end().await;
    let Decision::Respond(replay) = begin(&engine, &policy, "stranded").await else {
        panic!("the successor's answer was not kept");
    };
    assert_eq!(replay.headers()[REPLAYED_HEADER], "true");
    renewed.release().await;
}
