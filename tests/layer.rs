//! The tower layer end to end: real inner services that count their
//! executions, called through `IdempotencyLayer` (in process with
//! `ServiceExt::oneshot`, and once over a real socket).
//!
//! Every assertion is about what a user notices: the status and body each
//! caller gets, whether it is a replay, and how often the inner service ran.
//! Principal and scope-header isolation, hostile keys and bodies are in
//! `tests/security.rs` and `tests/hostile.rs`.

#[path = "../examples/contact_form.rs"]
#[allow(dead_code)]
mod contact_form;
mod support;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures::StreamExt;
use http::{header, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::engine::{Coverage, Decision, RequestHead};
use tower_idempotency::store::{Fault, FaultyStore};
use tower_idempotency::{
    Engine, EngineConfig, Event, FailMode, IdempotencyLayer, InFlightPolicy, KeySource,
    MemoryStore, Policy, Routes,
};

use contact_form::Contacts;
use support::{layered, Inbound, Reply, Upstream};

// ---------------------------------------------------------------------------
// Harness

/// An engine over a fresh memory store with `policy` on every path.
fn memory_engine(policy: Policy) -> (Engine, MemoryStore) {
    let store = MemoryStore::new();
    let routes = Routes::all(policy).expect("valid test policy");
    (Engine::new(store.clone(), routes), store)
}

/// An upstream answering every call with `201 order {n}`.
fn orders(engine: &Engine) -> Upstream {
    layered(engine, |n, _| async move {
        reply(StatusCode::CREATED, format!("order {n}"))
    })
}

/// An upstream whose calls wait at the returned [`Gate`], then answer
/// `status` with `order {n}`.
fn gated(engine: &Engine, status: StatusCode) -> (Upstream, Gate) {
    let gate = Gate::default();
    let held = gate.clone();
    let upstream = layered(engine, move |n, _| {
        let held = held.clone();
        async move {
            held.pass().await;
            reply(status, format!("order {n}"))
        }
    });
    (upstream, gate)
}

fn reply(status: StatusCode, body: impl Into<Body>) -> Response<Body> {
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    response
}

/// The inner service's view of a request body, collected.
async fn read(request: Inbound) -> Bytes {
    request
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
}

/// A JSON `POST /orders` with `Idempotency-Key: key`.
fn order(key: &str, json: &str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json.to_owned()))
        .expect("valid request")
}

/// Fails instead of hanging when a request that must be answered without
/// waiting on anything is not.
async fn promptly<T>(future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), future)
        .await
        .expect("answered without waiting for anything")
}

/// A one-way latch: the inner service signals `started`, then waits for
/// the test to `open` it.
#[derive(Clone, Default)]
struct Gate {
    started: Arc<Notify>,
    open: Arc<Notify>,
}

impl Gate {
    /// Called by the inner service.
    async fn pass(&self) {
        self.started.notify_one();
        self.open.notified().await;
    }

    /// Sends `request` and returns once the inner service is held here.
    async fn hold(
        &self,
        upstream: &Upstream,
        request: Request<Body>,
    ) -> tokio::task::JoinHandle<Reply> {
        let answer = tokio::spawn(upstream.send(request));
        self.started.notified().await;
        answer
    }
}

// ---------------------------------------------------------------------------
// The Laravel seed's contact form (examples/contact_form.rs)

fn contact_app() -> (axum::Router, Arc<Contacts>, MemoryStore) {
    let contacts = Arc::new(Contacts::default());
    let store = MemoryStore::new();
    let engine = Engine::new(store.clone(), contact_form::routes());
    (contact_form::app(engine, contacts.clone()), contacts, store)
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            b' ' => "+".to_owned(),
            b => format!("%{b:02X}"),
        })
        .collect()
}

fn form_body(token: &str, email: &str, message: &str) -> String {
    format!(
        "submission_token={}&email={}&message={}",
        urlencode(token),
        urlencode(email),
        urlencode(message)
    )
}

fn contact(token: &str, email: &str, message: &str) -> Request<Body> {
    Request::post("/contact")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(form_body(token, email, message)))
        .expect("valid request")
}

async fn submit(app: &axum::Router, request: Request<Body>) -> Reply {
    Reply::read(
        app.clone()
            .oneshot(request)
            .await
            .unwrap_or_else(|e| match e {}),
    )
    .await
}

fn assert_thanks(answer: &Reply) {
    assert_eq!(answer.status, StatusCode::SEE_OTHER, "{answer:?}");
    assert_eq!(answer.headers[header::LOCATION], "/thanks");
}

/// The token of a rendered form.
fn token_in(html: &str) -> String {
    let marker = "name=\"submission_token\" value=\"";
    let start = html.find(marker).expect("a token field") + marker.len();
    html[start..start + 36].to_owned()
}

const EMAIL: &str = "kontakt@example.test";
const MESSAGE: &str = "Bitte um Rückruf.";

#[tokio::test]
async fn the_same_submission_twice_is_stored_and_notified_once() {
    let (app, contacts, _) = contact_app();
    let token = uuid::Uuid::new_v4().to_string();

    let first = submit(&app, contact(&token, EMAIL, MESSAGE)).await;
    let second = submit(&app, contact(&token, EMAIL, MESSAGE)).await;

    assert_thanks(&first);
    assert_thanks(&second);
    assert!(!first.replayed());
    assert!(second.replayed());
    assert_eq!(first.body, second.body);
    assert_eq!(contacts.requests().len(), 1);
    assert_eq!(contacts.requests()[0].message, MESSAGE);
    assert_eq!(contacts.notifications(), 1);
}

#[tokio::test]
async fn two_tokens_with_the_same_data_are_two_submissions() {
    let (app, contacts, _) = contact_app();
    for _ in 0..2 {
        let token = uuid::Uuid::new_v4().to_string();
        let answer = submit(&app, contact(&token, EMAIL, MESSAGE)).await;
        assert_thanks(&answer);
        assert!(!answer.replayed());
    }
    assert_eq!(contacts.requests().len(), 2);
    assert_eq!(contacts.notifications(), 2);
}

#[tokio::test]
async fn an_invalid_or_missing_token_is_refused_and_nothing_is_stored() {
    let (app, contacts, store) = contact_app();

    let invalid = submit(&app, contact("not-a-uuid", EMAIL, MESSAGE)).await;
    invalid.assert_problem(StatusCode::BAD_REQUEST, "key-invalid");
    assert!(invalid.text().contains("UUID"), "{}", invalid.text());

    let missing = Request::post("/contact")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(format!("email={EMAIL}&message=hello")))
        .unwrap();
    submit(&app, missing)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-missing");

    assert!(contacts.requests().is_empty());
    assert_eq!(contacts.notifications(), 0);
    assert!(store.is_empty());
}

#[tokio::test]
async fn a_validation_error_keeps_the_token_and_the_correction_goes_through() {
    let (app, contacts, _) = contact_app();
    let form = submit(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(form.status, StatusCode::OK);
    let token = token_in(&form.text());
    assert!(uuid::Uuid::parse_str(&token).is_ok(), "{token}");

    let invalid = submit(&app, contact(&token, "no address", "<b>hi</b>")).await;
    assert_eq!(invalid.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(!invalid.replayed());
    // Laravel's old(): the same token, the input escaped.
    assert_eq!(token_in(&invalid.text()), token);
    assert!(invalid.text().contains("&lt;b&gt;hi&lt;/b&gt;"));
    assert!(!invalid.text().contains("<b>hi"));
    assert!(contacts.requests().is_empty());

    let corrected = submit(&app, contact(&token, EMAIL, "<b>hi</b>")).await;
    assert_thanks(&corrected);
    assert!(!corrected.replayed());
    let again = submit(&app, contact(&token, EMAIL, "<b>hi</b>")).await;
    assert_thanks(&again);
    assert!(again.replayed());

    assert_eq!(contacts.requests().len(), 1);
    assert_eq!(contacts.requests()[0].token, token);
    assert_eq!(contacts.notifications(), 1);
}

/// The example served by hyper on a real socket; ten "double clicks" of
/// one form arrive at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contact_form_over_http() {
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let (app, contacts, _) = contact_app();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    let page = client
        .get(format!("{base}/").parse().unwrap())
        .await
        .unwrap();
    let token = token_in(&Reply::read(page).await.text());
    let clicks: Vec<_> = (0..10)
        .map(|_| {
            let request = Request::post(format!("{base}/contact"))
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .body(Full::new(Bytes::from(form_body(&token, EMAIL, MESSAGE))))
                .unwrap();
            let client = client.clone();
            tokio::spawn(async move { Reply::read(client.request(request).await.unwrap()).await })
        })
        .collect();
    let mut replays = 0;
    for click in clicks {
        let answer = click.await.unwrap();
        assert_thanks(&answer);
        replays += usize::from(answer.replayed());
    }
    assert_eq!(replays, 9);
    assert_eq!(contacts.requests().len(), 1);
    assert_eq!(contacts.notifications(), 1);
    server.abort();
}

// ---------------------------------------------------------------------------
// Duplicates

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_duplicates_execute_once() {
    let (engine, _) = memory_engine(Policy::default());
    let upstream = layered(&engine, |n, _| async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        reply(StatusCode::CREATED, format!("order {n}"))
    });
    let answers: Vec<_> = (0..50)
        .map(|_| tokio::spawn(upstream.send(order("fifty", r#"{"amount":10}"#))))
        .collect();
    let mut replays = 0;
    for answer in answers {
        let answer = answer.await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED);
        assert_eq!(answer.text(), "order 1");
        replays += usize::from(answer.replayed());
    }
    assert_eq!(upstream.calls(), 1);
    assert_eq!(replays, 49);
    assert_eq!(engine.metrics().count(Event::Executed), 1);
}

/// 200 concurrent duplicates with 1000-byte bodies against a budget of ten
/// such bodies: the first executes while the others wait holding their
/// bodies; those that do not fit are refused with 503 `overloaded` before
/// their body is read, and never more than the budget is held at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn buffered_bodies_never_exceed_the_engine_budget() {
    const BODY: usize = 1000;
    const SENT: usize = 200;
    let budget = 10 * BODY as u64;
    let config = EngineConfig {
        max_buffered_bytes: budget,
        ..EngineConfig::default()
    };
    let routes = Routes::all(Policy::default()).unwrap();
    let engine = Engine::with_config(Arc::new(MemoryStore::new()), routes, config);
    let watched = engine.clone();
    let upstream = layered(&engine, move |n, _| {
        let engine = watched.clone();
        async move {
            // Answer once every other request is either refused or waiting
            // with its body held (readiness, not timing; given up after
            // 10 s so a broken budget fails the assertions, not the run).
            let settled = |m: &tower_idempotency::Metrics| {
                m.overloaded() as usize + (m.buffered_bytes() as usize) / BODY
            };
            for _ in 0..5000 {
                if settled(engine.metrics()) >= SENT - 1 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            reply(StatusCode::CREATED, format!("order {n}"))
        }
    });
    let json = format!(r#"{{"pad":"{}"}}"#, "x".repeat(BODY - 10));
    assert_eq!(json.len(), BODY);
    let request = |json: &str| {
        Request::post("/orders")
            .header("idempotency-key", "budget")
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, json.len())
            .body(Body::from(json.to_owned()))
            .unwrap()
    };
    let answers: Vec<_> = (0..SENT)
        .map(|_| tokio::spawn(upstream.send(request(&json))))
        .collect();
    let (mut created, mut refused) = (0, 0);
    for answer in answers {
        let answer = answer.await.unwrap();
        if answer.status == StatusCode::SERVICE_UNAVAILABLE {
            answer.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "overloaded");
            assert!(answer.headers.contains_key(header::RETRY_AFTER));
            refused += 1;
        } else {
            assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
            assert_eq!(answer.text(), "order 1");
            created += 1;
        }
    }
    let metrics = engine.metrics();
    assert_eq!(upstream.calls(), 1);
    assert!(
        refused >= SENT - 1 - 10,
        "refused {refused}, created {created}"
    );
    assert_eq!(refused as u64, metrics.overloaded());
    assert!(metrics.buffered_bytes_peak() <= budget);
    assert!(
        metrics.buffered_bytes_peak() >= 9 * BODY as u64,
        "the budget was used"
    );
    assert_eq!(metrics.buffered_bytes(), 0, "every permit given back");
    // Nothing was reserved for the refused: the key replays, room is back.
    let again = upstream.send(request(&json)).await;
    assert!(again.replayed());
}

/// An inner service that never answers, one whose body never ends, and
/// one whose body is always ready with empty chunks and never ends (a
/// keep-alive producer): past the route's `execution_timeout` the caller gets 504
/// `upstream-timeout`, and the key is not left in flight for ever nor
/// freed for a second execution while the first may still act: retries
/// replay the 504 and the handler never runs again.
#[tokio::test]
async fn a_hung_execution_ends_at_its_limit_and_never_runs_again() {
    let (engine, _) = memory_engine(Policy {
        execution_timeout: Duration::from_millis(300),
        ..Policy::default()
    });
    let upstream = layered(&engine, |n, request: Inbound| async move {
        if request.uri().path() == "/hangs" {
            std::future::pending::<()>().await;
        }
        if request.uri().path() == "/spins" {
            // Empty chunks, always ready, without end: the execution never
            // awaited anything the timer could interrupt.
            let empty = futures::stream::repeat_with(|| Ok::<_, Infallible>(Bytes::new()));
            return reply(StatusCode::CREATED, Body::from_stream(empty));
        }
        // One chunk, then the body never ends.
        let first =
            futures::stream::once(
                async move { Ok::<_, Infallible>(Bytes::from(format!("order {n}"))) },
            );
        let body = Body::from_stream(futures::StreamExt::chain(first, futures::stream::pending()));
        reply(StatusCode::CREATED, body)
    });
    for path in ["/hangs", "/stalls", "/spins"] {
        let request = || {
            Request::post(path)
                .header("idempotency-key", "hung")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from("{}"))
                .unwrap()
        };
        let calls = upstream.calls();
        let first = promptly(upstream.send(request())).await;
        first.assert_problem(StatusCode::GATEWAY_TIMEOUT, "upstream-timeout");
        for _ in 0..3 {
            let retry = promptly(upstream.send(request())).await;
            assert_eq!(
                retry.status,
                StatusCode::GATEWAY_TIMEOUT,
                "{path}: {retry:?}"
            );
            assert!(retry.replayed(), "{path}: {retry:?}");
            assert_eq!(
                retry.problem_type(),
                "urn:tower-idempotency:upstream-timeout"
            );
        }
        assert_eq!(upstream.calls(), calls + 1, "{path} ran again");
    }
    assert_eq!(engine.metrics().in_flight(), 0);
}

/// A handler whose whole answer is ready only at its `execution_timeout`
/// (it slept that long, or blocked its thread past it: the timer polls
/// the handler before it looks at the clock) keeps that answer: stored
/// and replayed, not turned into a 504 after the work was done.
#[tokio::test(start_paused = true)]
async fn an_answer_ready_at_the_limit_is_kept() {
    let (engine, _) = memory_engine(Policy {
        execution_timeout: Duration::from_millis(300),
        ..Policy::default()
    });
    let upstream = layered(&engine, |n, _| async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        reply(StatusCode::CREATED, format!("order {n}"))
    });
    let request = || {
        Request::post("/orders")
            .header("idempotency-key", "at-the-limit")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{}"))
            .unwrap()
    };
    let first = upstream.send(request()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let again = upstream.send(request()).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.status, StatusCode::CREATED);
}

/// The key is held for at most `execution_timeout` in all: the wait for
/// the inner service to be ready (a concurrency limit's permit) counts in
/// it. The wait and the execution each had the whole limit, so a hung
/// handler behind a slow readiness held its key (and kept its caller)
/// twice as long.
#[tokio::test(start_paused = true)]
async fn readiness_and_execution_share_one_execution_timeout() {
    use std::task::{Context, Poll};
    /// Ready at once as it is; its clones (the layer calls a clone) only
    /// at `ready_at`. Its calls never answer.
    struct SlowThenHung {
        ready_at: tokio::time::Instant,
        clone: bool,
    }
    impl Clone for SlowThenHung {
        fn clone(&self) -> Self {
            SlowThenHung {
                ready_at: self.ready_at,
                clone: true,
            }
        }
    }
    impl tower::Service<Request<tower_idempotency::layer::RequestBody<Body>>> for SlowThenHung {
        type Response = Response<Body>;
        type Error = Infallible;
        type Future = std::future::Pending<Result<Response<Body>, Infallible>>;
        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            if !self.clone || tokio::time::Instant::now() >= self.ready_at {
                return Poll::Ready(Ok(()));
            }
            let (waker, at) = (cx.waker().clone(), self.ready_at);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                waker.wake();
            });
            Poll::Pending
        }
        fn call(
            &mut self,
            _request: Request<tower_idempotency::layer::RequestBody<Body>>,
        ) -> Self::Future {
            std::future::pending()
        }
    }
    let (engine, _) = memory_engine(Policy {
        execution_timeout: Duration::from_millis(300),
        ..Policy::default()
    });
    let service = SlowThenHung {
        ready_at: tokio::time::Instant::now() + Duration::from_millis(200),
        clone: false,
    };
    let service = tower::Layer::layer(&IdempotencyLayer::new(engine.clone()), service);
    let order = Request::post("/orders")
        .header("idempotency-key", "slow-then-hung")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{}"))
        .unwrap();
    let call = tokio::spawn(service.oneshot(order));
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(
        call.is_finished(),
        "the key is still held past its execution_timeout"
    );
    let answer = call.await.unwrap().unwrap();
    assert_eq!(answer.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(engine.metrics().in_flight(), 0);
}

/// A body of unknown length (chunked, HTTP/2) is counted at its route's
/// limit until it is read; a client that opens one and sends nothing held
/// that room for ever (the layer had no body deadline), so a few idle
/// connections took the whole budget and every covered request got 503.
/// Now the body gets `body_timeout` (then 408, its room given back), and a
/// read body holds only its own bytes while its request waits.
#[tokio::test(start_paused = true)]
async fn bodies_of_unknown_length_do_not_hold_the_budget() {
    const LIMIT: usize = 1024 * 1024;
    // Room for two bodies at the limit and a few small ones.
    let config = EngineConfig {
        max_buffered_bytes: 2 * LIMIT as u64 + 1024,
        body_timeout: Duration::from_secs(10),
        ..EngineConfig::default()
    };
    let routes = Routes::all(Policy {
        wait_timeout: Duration::from_secs(60),
        ..Policy::default()
    })
    .unwrap();
    let engine = Engine::with_config(Arc::new(MemoryStore::new()), routes, config);
    let release = Arc::new(Notify::new());
    let upstream = layered(&engine, {
        let release = release.clone();
        move |_, _request: Inbound| {
            let release = release.clone();
            async move {
                release.notified().await;
                reply(StatusCode::CREATED, "done")
            }
        }
    });
    // No length: a stream of one small chunk, or of none that never ends.
    let unknown = |key: &str, sends: bool| {
        let chunk =
            futures::stream::iter(sends.then(|| Ok::<_, Infallible>(Bytes::from_static(b"{}"))));
        let body = match sends {
            true => Body::from_stream(chunk),
            false => Body::from_stream(chunk.chain(futures::stream::pending())),
        };
        Request::post("/orders")
            .header("idempotency-key", key)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body)
            .unwrap()
    };
    // The first holds its key; two duplicates wait on it, bodies read.
    let mut waiting = Vec::new();
    for _ in 0..3 {
        let upstream = upstream.clone();
        waiting.push(tokio::spawn(async move {
            upstream.send(unknown("held", true)).await
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(engine.metrics().in_flight(), 1);
    // Two idle bodies: each counted at the limit until its deadline.
    let idle: Vec<_> = (0..2)
        .map(|n| {
            let upstream = upstream.clone();
            tokio::spawn(async move { upstream.send(unknown(&format!("idle-{n}"), false)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        engine.metrics().overloaded(),
        0,
        "the waiting bodies held the budget"
    );
    for idle in idle {
        let answer = idle.await.unwrap();
        assert_eq!(answer.status, StatusCode::REQUEST_TIMEOUT, "{answer:?}");
    }
    // Room again for a new order of unknown length.
    let next = tokio::spawn({
        let upstream = upstream.clone();
        async move { upstream.send(unknown("next", true)).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        engine.metrics().in_flight(),
        2,
        "the next order was admitted"
    );
    release.notify_waiters();
    tokio::time::sleep(Duration::from_millis(10)).await;
    release.notify_waiters();
    for answer in waiting {
        assert_eq!(answer.await.unwrap().status, StatusCode::CREATED);
    }
    assert_eq!(next.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(engine.metrics().overloaded(), 0, "nobody was refused");
}

#[tokio::test]
async fn the_same_key_for_a_different_request_is_refused() {
    for (status, mismatch_status) in [
        (StatusCode::UNPROCESSABLE_ENTITY, 422),
        (StatusCode::CONFLICT, 409),
    ] {
        let (engine, _) = memory_engine(Policy {
            mismatch_status,
            ..Policy::default()
        });
        let upstream = orders(&engine);
        let first = upstream.send(order("k", r#"{"amount":10}"#)).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let other = upstream.send(order("k", r#"{"amount":99}"#)).await;
        other.assert_problem(status, "key-mismatch");
        // The query is part of the request too (but not of the key's scope).
        let mut query = order("k", r#"{"amount":10}"#);
        *query.uri_mut() = "/orders?dry_run=1".parse().unwrap();
        let answer = upstream.send(query).await;
        answer.assert_problem(status, "key-mismatch");
        assert_eq!(upstream.calls(), 1);
    }
}

#[tokio::test]
async fn json_key_order_whitespace_and_excluded_fields_do_not_matter() {
    let (engine, _) = memory_engine(Policy {
        fingerprint_exclude: vec!["/sent_at".into()],
        ..Policy::default()
    });
    let upstream = orders(&engine);
    let first = upstream
        .send(order(
            "k",
            r#"{"amount":10,"currency":"EUR","sent_at":"10:00"}"#,
        ))
        .await;
    let reordered = upstream
        .send(order(
            "k",
            "{\n  \"sent_at\": \"10:05\",\n  \"currency\" : \"EUR\",\n  \"amount\": 10\n}",
        ))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(reordered.replayed());
    assert_eq!(reordered.text(), "order 1");
    let changed = upstream
        .send(order(
            "k",
            r#"{"amount":11,"currency":"EUR","sent_at":"10:00"}"#,
        ))
        .await;
    changed.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    assert_eq!(upstream.calls(), 1);
}

// ---------------------------------------------------------------------------
// What is stored, what is released

#[tokio::test]
async fn client_and_server_errors_release_the_key() {
    for failure in [
        StatusCode::UNPROCESSABLE_ENTITY,
        StatusCode::INTERNAL_SERVER_ERROR,
    ] {
        let (engine, store) = memory_engine(Policy::default());
        let upstream = layered(&engine, move |n, request| async move {
            if read(request).await.starts_with(b"{\"bad\"") {
                reply(failure, "try again")
            } else {
                reply(StatusCode::CREATED, format!("order {n}"))
            }
        });

        let failed = upstream.send(order("k", r#"{"bad":true}"#)).await;
        assert_eq!(failed.status, failure);
        assert_eq!(failed.text(), "try again");
        assert!(store.is_empty(), "{failure}: the key was not released");

        let corrected = upstream.send(order("k", r#"{"amount":10}"#)).await;
        assert_eq!(corrected.status, StatusCode::CREATED);
        assert!(!corrected.replayed());
        assert_eq!(corrected.text(), "order 2");
        let retry = upstream.send(order("k", r#"{"amount":10}"#)).await;
        assert!(retry.replayed());
        assert_eq!(retry.text(), "order 2");
        assert_eq!(upstream.calls(), 2);
    }
}

/// A response body that fails midway (the upstream broke off after its
/// head) is not a complete answer, but the inner service has acted: the
/// caller sees the error, and retries — many at once, and over a real
/// socket — get 409 `response-incomplete`, never a second execution.
#[tokio::test]
async fn a_response_body_that_fails_midway_is_not_executed_again() {
    let (engine, _store) = memory_engine(Policy::default());
    let upstream = layered(&engine, |n, _| async move {
        let chunks = vec![
            Ok(Bytes::from(format!("order {n}"))),
            Err(std::io::Error::other("upstream went away")),
        ];
        reply(
            StatusCode::CREATED,
            Body::from_stream(futures::stream::iter(chunks)),
        )
    });
    let response = upstream.call(order("k", "{}")).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(response.into_body().collect().await.is_err());

    let retries: Vec<_> = (0..20)
        .map(|_| tokio::spawn(upstream.send(order("k", "{}"))))
        .collect();
    for retry in retries {
        let retry = retry.await.unwrap();
        retry.assert_problem(StatusCode::CONFLICT, "response-incomplete");
        assert!(
            !retry.text().contains("order"),
            "no part of the broken body is replayed"
        );
    }
    assert_eq!(upstream.calls(), 1, "the inner service ran once");

    // Over a real socket: the first caller's connection is cut mid-body.
    let (addr, server) = upstream.serve().await;
    let raw = |key: &str| {
        format!(
            "POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n\
             content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        )
    };
    let first = promptly(exchange_raw(addr, raw("socket"))).await;
    // hyper cuts the connection, with or without the head sent.
    assert!(
        first.is_empty() || first.starts_with("HTTP/1.1 201"),
        "{first}"
    );
    assert!(
        !first.ends_with("0\r\n\r\n"),
        "the cut body is not presented as complete: {first}"
    );
    let retry = promptly(exchange_raw(addr, raw("socket"))).await;
    assert!(retry.starts_with("HTTP/1.1 409"), "{retry}");
    assert!(retry.contains("response-incomplete"), "{retry}");
    assert_eq!(upstream.calls(), 2, "one execution per key");
    server.abort();
}

/// From a review: an HTTP/1.0 client (nginx's default to its upstreams)
/// reads a body without a length up to the close, so a body that failed
/// after a prefix large enough for the server to send looked complete to
/// it, while the README says the first caller sees the cut (its retries
/// get 409). The head now declares a length the body falls short of. And
/// (from a review of that fix) a handler that copied an upstream's
/// `Transfer-Encoding: chunked` got that length beside it, a head hyper
/// refuses: the length alone frames the cut.
#[tokio::test]
async fn a_failed_body_is_seen_cut_by_an_http_1_0_caller() {
    for (version, copied_coding) in [("HTTP/1.0", false), ("HTTP/1.1", true)] {
        let (engine, _store) = memory_engine(Policy::default());
        let upstream = layered(&engine, move |_, _| async move {
            let chunks = vec![
                Ok(Bytes::from(vec![b'o'; 512 * 1024])),
                Err(std::io::Error::other("upstream went away")),
            ];
            let mut response = reply(
                StatusCode::CREATED,
                Body::from_stream(futures::stream::iter(chunks)),
            );
            if copied_coding {
                response.headers_mut().insert(
                    http::header::TRANSFER_ENCODING,
                    http::HeaderValue::from_static("chunked"),
                );
            }
            response
        });
        let (addr, server) = upstream.serve().await;
        let request = format!(
            "POST /orders {version}\r\nhost: x\r\nidempotency-key: k\r\n\
             content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        );
        let first = promptly(exchange_raw(addr, request.clone())).await;
        let (head, body) = first
            .split_once("\r\n\r\n")
            .expect("the head and part of the body reach the caller");
        assert!(head.starts_with(&format!("{version} 201")), "{head}");
        let head = head.to_ascii_lowercase();
        assert!(!head.contains("transfer-encoding"), "{head}");
        let declared = head.lines().find_map(|line| {
            let value = line.strip_prefix("content-length:")?;
            Some(value.trim().parse::<usize>().unwrap())
        });
        assert!(
            declared.is_some_and(|declared| declared > body.len()),
            "{version}: the caller must see the cut: {head} and {} bytes",
            body.len()
        );
        let retry = promptly(exchange_raw(addr, request)).await;
        assert!(retry.contains("response-incomplete"), "{retry}");
        assert_eq!(upstream.calls(), 1, "the inner service ran once");
        server.abort();
    }
}

/// A response body that ends cleanly but short of the `Content-Length`
/// its head declared (a producer that stopped early): hyper cuts the first
/// caller's connection, so the 40 bytes it got are no complete answer.
/// Retries — many at once, and over a real socket — get 409
/// `response-incomplete`, never those bytes as if complete, and never a
/// second execution. The same for a body longer than declared, and (from
/// a review) for a length declared as a list, `100, 100`, which hyper reads
/// as 100 and the engine read as no length at all (40 bytes stored whole).
#[tokio::test]
async fn a_response_body_short_of_its_declared_length_is_not_replayed_as_complete() {
    for (declared, sent) in [("100", 40usize), ("10", 40), ("100, 100", 40)] {
        let (engine, _store) = memory_engine(Policy::default());
        let upstream = layered(&engine, move |_, _| async move {
            let chunks = vec![Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; sent]))];
            let mut response = reply(
                StatusCode::CREATED,
                Body::from_stream(futures::stream::iter(chunks)),
            );
            response.headers_mut().insert(
                http::header::CONTENT_LENGTH,
                http::HeaderValue::from_static(declared),
            );
            response
        });
        let _ = upstream
            .call(order("k", "{}"))
            .await
            .into_body()
            .collect()
            .await;
        let retries: Vec<_> = (0..20)
            .map(|_| tokio::spawn(upstream.send(order("k", "{}"))))
            .collect();
        for retry in retries {
            let retry = retry.await.unwrap();
            retry.assert_problem(StatusCode::CONFLICT, "response-incomplete");
        }
        assert_eq!(upstream.calls(), 1, "the inner service ran once");

        let (addr, server) = upstream.serve().await;
        let raw = "POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: socket\r\n\
             content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
            .to_owned();
        // hyper cuts the connection, with or without what it had written.
        let first = promptly(exchange_raw(addr, raw.clone())).await;
        if let Some((head, body)) = first.split_once("\r\n\r\n") {
            assert!(head.starts_with("HTTP/1.1 201"), "{first}");
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length: "))
                .expect("a length")
                .parse()
                .unwrap();
            // The connection ends short of the length the head states: the
            // cut shows, and nothing past that length was written.
            assert!(
                body.len() < length,
                "declared {declared}, sent {sent}: framed as whole: {first}"
            );
        }
        let retry = promptly(exchange_raw(addr, raw)).await;
        assert!(retry.starts_with("HTTP/1.1 409"), "{retry}");
        assert!(retry.contains("response-incomplete"), "{retry}");
        assert_eq!(upstream.calls(), 2, "one execution per key");
        server.abort();
    }
}

/// Whatever `Content-Length` the inner service writes beside whatever body
/// it sends, the layer's response never claims a body length other than
/// the one its header states: servers (hyper) trust a body's exact length
/// over the header they write, so a mismatch would put the header's length
/// on the wire and the body's bytes after it — the rest read as the next
/// response on a kept-alive connection — or present a cut answer as whole.
#[tokio::test]
async fn the_first_callers_response_is_framed_by_one_length() {
    let cases: [(&[&str], usize); 5] = [
        (&["100"], 0),
        (&["100"], 40),
        (&["10"], 40),
        (&["10", "40"], 40),
        (&["4O"], 40),
    ];
    for (lines, sent) in cases {
        let (engine, _store) = memory_engine(Policy::default());
        let upstream = layered(&engine, move |_, _| async move {
            let chunks = vec![Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; sent]))];
            let mut response = reply(
                StatusCode::CREATED,
                Body::from_stream(futures::stream::iter(chunks)),
            );
            for line in lines {
                let value = http::HeaderValue::from_static(line);
                response.headers_mut().append(header::CONTENT_LENGTH, value);
            }
            response
        });
        let response = upstream.call(order("k", "{}")).await;
        let stated: Vec<_> = response
            .headers()
            .get_all(header::CONTENT_LENGTH)
            .iter()
            .map(|value| value.to_str().unwrap().to_owned())
            .collect();
        let body = response.into_body();
        if let Some(exact) = http_body::Body::size_hint(&body).exact() {
            assert!(
                stated.iter().all(|value| *value == exact.to_string()),
                "{lines:?} with {sent} bytes: the body claims {exact}, the head {stated:?}"
            );
        }
        if http_body::Body::is_end_stream(&body) {
            assert!(
                stated.iter().all(|value| value == "0"),
                "{lines:?} with {sent} bytes: an empty body under {stated:?}"
            );
        }
        // A server writes at most the stated length; a body the inner
        // service cut (one readable length it missed) must come short of
        // it and then fail, or the caller reads it as whole.
        let mut body = body;
        let mut got = 0;
        let mut failed = false;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => got += frame.data_ref().map_or(0, Bytes::len),
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        let [length] = &stated[..] else {
            panic!("{lines:?} with {sent} bytes: stated {stated:?}")
        };
        let length: usize = length.parse().unwrap();
        let cut = matches!(lines, [one] if one.parse::<usize>().is_ok_and(|n| n != sent));
        match cut {
            true => assert!(
                got < length && failed,
                "{lines:?} with {sent} bytes: {got} of {length} reads as whole"
            ),
            false => assert!(got == length && !failed, "{lines:?} with {sent} bytes"),
        }
        assert_eq!(upstream.calls(), 1);
    }
}

/// A client that sends a covered request over a real socket, reads nothing
/// of the answer and stays connected does not hold the key: the layer
/// records the inner body at its own pace (hyper polls the service's
/// future whatever the client reads), so a retry from another connection
/// gets the replay, and the inner service ran once.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_does_not_hold_the_key() {
    const BIG: usize = 12 << 20;
    let (engine, _store) = memory_engine(Policy {
        max_response_bytes: 16 << 20,
        ..Policy::default()
    });
    let upstream = layered(&engine, |_, _| async move {
        let chunks = (0..BIG / 65536).map(|_| Ok::<_, Infallible>(Bytes::from(vec![b'b'; 65536])));
        reply(
            StatusCode::CREATED,
            Body::from_stream(futures::stream::iter(chunks)),
        )
    });
    let (addr, server) = upstream.serve().await;
    let request = "POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: big\r\n\
                   content-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stalled, request.as_bytes())
        .await
        .unwrap();
    promptly(async {
        while upstream.calls() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Retries meanwhile wait (409 in-flight) until the answer is stored.
    let replay = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let retry = request.replace("HTTP/1.1\r\n", "HTTP/1.1\r\nconnection: close\r\n");
            let reply = exchange_raw(addr, retry).await;
            if !reply.starts_with("HTTP/1.1 409") {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the response was stored while its first client did not read");
    assert!(
        replay.starts_with("HTTP/1.1 201"),
        "{}",
        &replay[..replay.len().min(300)]
    );
    assert!(replay
        .to_ascii_lowercase()
        .contains("idempotent-replayed: true"));
    assert!(replay.ends_with(&"b".repeat(1024)));
    assert_eq!(upstream.calls(), 1);
    drop(stalled);
    server.abort();
}

/// Writes `request` to `addr` and reads until the server closes (or cuts)
/// the connection.
async fn exchange_raw(addr: std::net::SocketAddr, request: String) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    let mut buffer = [0; 4096];
    loop {
        match socket.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => received.extend_from_slice(&buffer[..n]),
        }
    }
    String::from_utf8_lossy(&received).into_owned()
}

/// A panicking inner service leaves no key behind: the reservation is
/// released in the background and the retry executes.
#[tokio::test]
async fn a_panicking_inner_service_leaves_no_key_stuck() {
    let (engine, store) = memory_engine(Policy::default());
    let upstream = layered(&engine, |n, _| async move {
        assert!(n > 1, "the first execution panics");
        reply(StatusCode::CREATED, format!("order {n}"))
    });
    let first = tokio::spawn(upstream.send(order("k", "{}")));
    assert!(first.await.unwrap_err().is_panic());
    promptly(async {
        while !store.is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let retry = upstream.send(order("k", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.text(), "order 2");
    assert_eq!(upstream.calls(), 2);
}

/// A response body that panics after its head (a lazy serializer, a stream
/// that unwraps): the inner service has acted, so the key is not released.
/// A duplicate already waiting and later retries get 409
/// `response-incomplete`, never a second execution.
#[tokio::test]
async fn a_response_body_that_panics_midway_is_not_executed_again() {
    let (engine, _store) = memory_engine(Policy::default());
    let upstream = layered(&engine, |n, _| async move {
        // Only the first execution's body panics.
        let tail = (n > 1).then(String::new);
        let chunks = futures::stream::iter([Some(format!("order {n}")), tail]).map(|chunk| {
            Ok::<_, std::io::Error>(Bytes::from(chunk.expect("the serializer panics")))
        });
        reply(StatusCode::CREATED, Body::from_stream(chunks))
    });
    // Two at once: one executes (and panics), the other waits for it.
    let both = [
        tokio::spawn(upstream.send(order("k", "{}"))),
        tokio::spawn(upstream.send(order("k", "{}"))),
    ];
    let mut panicked = 0;
    for call in both {
        match promptly(call).await {
            Err(error) => {
                assert!(error.is_panic());
                panicked += 1;
            }
            Ok(waiting) => waiting.assert_problem(StatusCode::CONFLICT, "response-incomplete"),
        }
    }
    assert_eq!(panicked, 1);
    let retry = upstream.send(order("k", "{}")).await;
    retry.assert_problem(StatusCode::CONFLICT, "response-incomplete");
    assert_eq!(upstream.calls(), 1, "the inner service ran once");
}

/// A duplicate waiting for a first request whose answer is not stored (a
/// 422 here) is not left hanging or refused: it runs itself.
#[tokio::test]
async fn a_duplicate_waiting_on_a_released_key_executes_itself() {
    let (engine, store) = memory_engine(Policy::default());
    let (upstream, gate) = gated(&engine, StatusCode::UNPROCESSABLE_ENTITY);
    let first = gate.hold(&upstream, order("k", "{}")).await;
    let second = tokio::spawn(upstream.send(order("k", "{}")));
    tokio::time::sleep(Duration::from_millis(20)).await;
    gate.open.notify_one();
    assert_eq!(first.await.unwrap().text(), "order 1");
    // The second runs once the first released the key; let it pass too.
    gate.started.notified().await;
    gate.open.notify_one();
    let second = second.await.unwrap();
    assert_eq!(second.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(second.text(), "order 2");
    assert!(!second.replayed());
    assert_eq!(upstream.calls(), 2);
    assert!(store.is_empty());
}

/// Each key source makes a repeated request take effect once.
#[tokio::test]
async fn every_key_source_makes_a_repeat_a_replay() {
    let multipart = concat!(
        "--XyZ\r\nContent-Disposition: form-data; name=\"token\"\r\n\r\nmp-1\r\n",
        "--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--XyZ--\r\n"
    );
    let cases = [
        (
            KeySource::FormField("token".into()),
            "multipart/form-data; boundary=XyZ",
            "/orders",
            multipart,
        ),
        (
            KeySource::FormField("token".into()),
            "application/x-www-form-urlencoded",
            "/orders",
            "note=hi&token=f-1",
        ),
        (
            KeySource::JsonPointer("/meta/key".into()),
            "application/json",
            "/orders",
            r#"{"meta":{"key":"j-1"},"n":1}"#,
        ),
        (
            KeySource::Query("key".into()),
            "text/plain",
            "/orders?key=q-1",
            "hi",
        ),
    ];
    for (source, content_type, uri, body) in cases {
        let (engine, _) = memory_engine(Policy::default().key(source.clone()).required(true));
        let upstream = orders(&engine);
        let request = || {
            Request::post(uri)
                .header(header::CONTENT_TYPE, content_type)
                .body(Body::from(body))
                .unwrap()
        };
        let first = upstream.send(request()).await;
        let repeat = upstream.send(request()).await;
        assert_eq!(first.status, StatusCode::CREATED, "{source:?}: {first:?}");
        assert!(repeat.replayed(), "{source:?}");
        assert_eq!(upstream.calls(), 1, "{source:?}");
    }
}

/// An inner service error is passed on as the error it is, and frees the
/// key: the retry executes.
#[tokio::test]
async fn an_inner_error_passes_through_and_releases_the_key() {
    use tower::Layer;

    let (engine, store) = memory_engine(Policy::default());
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let svc = IdempotencyLayer::new(engine).layer(tower::service_fn(move |_: Inbound| {
        let first = counter.fetch_add(1, SeqCst) == 0;
        async move {
            if first {
                Err("connection to the database lost")
            } else {
                Ok(reply(StatusCode::CREATED, "saved"))
            }
        }
    }));
    let error = svc.clone().oneshot(order("k", "{}")).await.unwrap_err();
    assert_eq!(error, "connection to the database lost");
    assert!(store.is_empty());
    let retry = svc.oneshot(order("k", "{}")).await.unwrap();
    let retry = Reply::read(retry).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(calls.load(SeqCst), 2);
}

#[tokio::test]
async fn replays_carry_the_marker_and_no_cookie_or_date() {
    for replay_set_cookie in [false, true] {
        let (engine, _) = memory_engine(Policy {
            replay_set_cookie,
            ..Policy::default()
        });
        let upstream = layered(&engine, |n, _| async move {
            let mut response = reply(StatusCode::CREATED, format!("order {n}"));
            let headers = response.headers_mut();
            headers.insert(
                header::SET_COOKIE,
                "session=first; HttpOnly".parse().unwrap(),
            );
            headers.insert(
                header::DATE,
                "Tue, 01 Jan 2030 00:00:00 GMT".parse().unwrap(),
            );
            headers.insert("x-order", n.into());
            headers.append("x-trace", "a".parse().unwrap());
            headers.append("x-trace", "b".parse().unwrap());
            response
        });
        let first = upstream.send(order("k", "{}")).await;
        let replay = upstream.send(order("k", "{}")).await;

        assert!(!first.replayed());
        assert_eq!(first.headers[header::SET_COOKIE], "session=first; HttpOnly");
        assert!(first.headers.contains_key(header::DATE));
        assert!(replay.replayed());
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.headers["x-order"], "1");
        let traces: Vec<_> = replay.headers.get_all("x-trace").iter().collect();
        assert_eq!(traces, ["a", "b"]);
        assert!(!replay.headers.contains_key(header::DATE));
        assert_eq!(
            replay.headers.contains_key(header::SET_COOKIE),
            replay_set_cookie
        );
        assert_eq!(upstream.calls(), 1);
    }
}

#[tokio::test]
async fn a_response_over_the_storage_cap_is_delivered_whole_and_never_repeated() {
    let (engine, _) = memory_engine(Policy {
        max_response_bytes: 1024,
        ..Policy::default()
    });
    let upstream = layered(&engine, |_, _| async move {
        let chunks = [b'x', b'y', b'z'].map(|b| Ok::<_, Infallible>(Bytes::from(vec![b; 1000])));
        reply(
            StatusCode::OK,
            Body::from_stream(futures::stream::iter(chunks)),
        )
    });
    let first = upstream.send(order("big", "{}")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 3000);
    assert!(first.body[..1000].iter().all(|&b| b == b'x'));
    assert!(first.body[2000..].iter().all(|&b| b == b'z'));

    let retry = upstream.send(order("big", "{}")).await;
    retry.assert_problem(StatusCode::CONFLICT, "response-not-stored");
    assert_eq!(upstream.calls(), 1);
}

// ---------------------------------------------------------------------------
// Bodies

#[tokio::test]
async fn a_body_over_the_limit_is_refused_before_anything_is_reserved() {
    let (engine, store) = memory_engine(Policy {
        max_body_bytes: 1024,
        ..Policy::default()
    });
    let upstream = layered(&engine, |n, request| async move {
        let body = read(request).await;
        reply(
            StatusCode::CREATED,
            format!("order {n}: {} bytes", body.len()),
        )
    });
    let big = format!(r#"{{"note":"{}"}}"#, "a".repeat(2000));

    // (Streamed bodies without a size hint: tests/hostile.rs.)
    upstream
        .send(order("k", &big))
        .await
        .assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert_eq!(upstream.calls(), 0);
    assert!(store.is_empty());

    let fits = upstream.send(order("k", r#"{"note":"short"}"#)).await;
    assert_eq!(fits.status, StatusCode::CREATED);
    assert!(!fits.replayed());
    assert_eq!(fits.text(), "order 1: 16 bytes");
}

/// Requests the engine does not protect reach the inner service as they
/// are: a GET, and a POST without a key on a route where the key is an
/// optional header. Their bodies are neither buffered nor limited.
#[tokio::test]
async fn unprotected_requests_pass_through_unbuffered_and_uncounted() {
    let (engine, store) = memory_engine(Policy {
        max_body_bytes: 16,
        ..Policy::default()
    });
    let upstream = layered(&engine, |n, request| async move {
        // Replys after the first chunk: a buffering layer would never
        // call it, because the body never ends.
        let mut body = request.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        reply(StatusCode::OK, format!("call {n}: {} bytes", first.len()))
    });
    let mut senders = Vec::new();
    let requests = [
        Request::get("/orders").header("idempotency-key", "k"),
        Request::get("/orders").header("idempotency-key", "k"),
        Request::post("/uploads"),
        Request::post("/uploads"),
    ];
    for (n, request) in (1..).zip(requests) {
        let (mut sender, receiver) =
            futures::channel::mpsc::channel::<Result<Bytes, Infallible>>(1);
        sender.try_send(Ok(Bytes::from(vec![b'q'; 64]))).unwrap();
        senders.push(sender); // kept open: the body never ends
        let request = request.body(Body::from_stream(receiver)).unwrap();
        let answer = promptly(upstream.send(request)).await;
        assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
        assert_eq!(answer.text(), format!("call {n}: 64 bytes"));
        assert!(!answer.replayed());
    }
    assert_eq!(upstream.calls(), 4);
    assert!(store.is_empty());
    assert_eq!(engine.metrics().count(Event::Executed), 0);
    assert_eq!(engine.metrics().count(Event::Passthrough), 4);
}

// ---------------------------------------------------------------------------
// In flight

#[tokio::test]
async fn in_flight_reject_answers_409_at_once() {
    let (engine, _) = memory_engine(Policy {
        in_flight: InFlightPolicy::Reject,
        wait_timeout: Duration::from_secs(3600),
        ..Policy::default()
    });
    let (upstream, gate) = gated(&engine, StatusCode::CREATED);
    let first = gate.hold(&upstream, order("k", "{}")).await;

    let second = promptly(upstream.send(order("k", "{}"))).await;
    second.assert_problem(StatusCode::CONFLICT, "in-flight");
    assert!(second.headers.contains_key(header::RETRY_AFTER));

    gate.open.notify_one();
    assert_eq!(first.await.unwrap().text(), "order 1");
    let third = upstream.send(order("k", "{}")).await;
    assert!(third.replayed());
    assert_eq!(third.text(), "order 1");
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test]
async fn in_flight_wait_times_out_with_409() {
    let (engine, _) = memory_engine(Policy {
        wait_timeout: Duration::from_millis(50),
        ..Policy::default()
    });
    let (upstream, gate) = gated(&engine, StatusCode::CREATED);
    let first = gate.hold(&upstream, order("k", "{}")).await;

    // The first is held until this one has its answer: it must time out.
    let second = upstream.send(order("k", "{}")).await;
    second.assert_problem(StatusCode::CONFLICT, "in-flight");
    let retry_after: u64 = second.headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1);

    gate.open.notify_one();
    assert_eq!(first.await.unwrap().text(), "order 1");
    assert_eq!(upstream.calls(), 1);
    assert_eq!(engine.metrics().count(Event::InFlightConflict), 1);
}

#[tokio::test]
async fn in_flight_wait_long_enough_replays_the_first_answer() {
    let (engine, _) = memory_engine(Policy::default());
    let (upstream, gate) = gated(&engine, StatusCode::SEE_OTHER);
    let first = gate.hold(&upstream, order("k", "{}")).await;
    let second = tokio::spawn(upstream.send(order("k", "{}")));
    // Let the second arrive while the first is held (if it is late, it
    // replays without waiting: the assertions hold either way).
    tokio::time::sleep(Duration::from_millis(20)).await;
    gate.open.notify_one();

    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(first.status, StatusCode::SEE_OTHER);
    assert_eq!(second.status, StatusCode::SEE_OTHER);
    assert_eq!(second.text(), "order 1");
    assert!(second.replayed());
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test]
async fn a_caller_that_goes_away_does_not_cancel_the_execution() {
    let (engine, store) = memory_engine(Policy::default());
    let (upstream, gate) = gated(&engine, StatusCode::CREATED);
    let first = gate.hold(&upstream, order("k", "{}")).await;
    first.abort(); // the client hangs up mid-flight
    assert!(first.await.unwrap_err().is_cancelled());
    gate.open.notify_one();

    let retry = upstream.send(order("k", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.text(), "order 1");
    assert_eq!(upstream.calls(), 1);
    assert_eq!(store.len(), 1);
}

/// A worker reserved the key and died with its process: no heartbeat, no
/// release. Exactly one of twenty retries takes the lease over once it
/// expires; the others replay that one's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_lease_is_taken_over_by_exactly_one_of_twenty_retries() {
    let policy = Policy {
        lease: Duration::from_millis(300),
        ..Policy::default()
    };
    let routes = Routes::all(policy).unwrap();
    let store = MemoryStore::new();
    let request = || order("crashed", r#"{"amount":10}"#);

    let dead = Engine::new(store.clone(), routes.clone());
    let doomed = request();
    std::thread::spawn(move || {
        let process = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let reservation = process.block_on(async {
            let (parts, body) = doomed.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            let head = RequestHead {
                method: &parts.method,
                uri: &parts.uri,
                headers: &parts.headers,
                principal: None,
                routed: None,
            };
            let Coverage::Covered(covered) = dead.classify(&head) else {
                panic!("the request is covered");
            };
            match dead.begin(&covered, head, &body).await {
                Decision::Proceed(reservation) => reservation,
                other => panic!("expected to reserve, got {other:?}"),
            }
        });
        drop(process); // the heartbeat dies with the process …
        drop(reservation); // … and outside any runtime nothing releases the key
    })
    .join()
    .unwrap();
    assert_eq!(store.len(), 1);

    let engine = Engine::new(store.clone(), routes);
    let upstream = layered(&engine, |n, _| async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        reply(StatusCode::CREATED, format!("order {n}"))
    });
    let retries: Vec<_> = (0..20)
        .map(|_| tokio::spawn(upstream.send(request())))
        .collect();
    let mut replays = 0;
    for retry in retries {
        let answer = retry.await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        assert_eq!(answer.text(), "order 1");
        replays += usize::from(answer.replayed());
    }
    assert_eq!(upstream.calls(), 1);
    assert_eq!(replays, 19);
    assert_eq!(engine.metrics().count(Event::Executed), 1);
}

// ---------------------------------------------------------------------------
// Store failures

/// A store whose backend is down: every call fails.
fn down_store() -> FaultyStore<MemoryStore> {
    let store = FaultyStore::new(MemoryStore::new());
    store.faults().set_all(Fault::Down);
    store
}

#[tokio::test]
async fn a_failing_store_fails_closed_unless_the_route_opts_in() {
    let closed = Engine::new(down_store(), Routes::all(Policy::default()).unwrap());
    let upstream = layered(&closed, |_, _| async { reply(StatusCode::CREATED, "done") });
    let answer = upstream.send(order("k", "{}")).await;
    answer.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert!(answer.headers.contains_key(header::RETRY_AFTER));
    assert_eq!(upstream.calls(), 0);

    let open = Policy {
        fail_mode: FailMode::Open,
        ..Policy::default()
    };
    let open = Engine::new(down_store(), Routes::all(open).unwrap());
    let upstream = layered(&open, |_, _| async { reply(StatusCode::CREATED, "done") });
    for _ in 0..2 {
        let answer = upstream.send(order("k", "{}")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
    }
    assert_eq!(upstream.calls(), 2);
    assert_eq!(open.metrics().count(Event::StoreError), 2);
}

/// A stored 204 is replayed as a 204: no `Content-Length` (RFC 9110 forbids
/// it on 204), the replay marker, and the inner service ran once.
#[tokio::test]
async fn a_replayed_204_carries_no_content_length() {
    let (engine, _) = memory_engine(Policy::default());
    let upstream = layered(&engine, |_, _| async {
        Response::builder()
            .status(StatusCode::NO_CONTENT)
            .header("x-deleted", "7")
            .body(Body::empty())
            .unwrap()
    });
    let first = upstream.send(order("k-204", "{}")).await;
    assert_eq!(first.status, StatusCode::NO_CONTENT);
    let again = upstream.send(order("k-204", "{}")).await;
    assert_eq!(again.status, StatusCode::NO_CONTENT);
    assert!(again.replayed());
    assert_eq!(again.headers["x-deleted"], "7");
    assert!(
        !again.headers.contains_key(header::CONTENT_LENGTH),
        "{:?}",
        again.headers
    );
    assert_eq!(upstream.calls(), 1);
}

/// A concurrency limit inside the layer (`ConcurrencyLimitLayer`, a
/// `Buffer`): a covered request whose client trickles its body must not
/// hold the limit's permit while the layer reads it (nor while the engine
/// decides, nor for a replay that never calls the service). The layer used
/// to carry the service it was polled ready with into the request, so one
/// slow upload stalled every other route behind the limit.
#[tokio::test]
async fn a_slow_upload_does_not_hold_the_inner_services_readiness() {
    use tower::limit::ConcurrencyLimitLayer;
    let (engine, _store) = memory_engine(Policy::default());
    let service = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(engine))
        .layer(ConcurrencyLimitLayer::new(1))
        .service(tower::service_fn(|_request: Request<_>| async {
            Ok::<_, Infallible>(reply(StatusCode::OK, "done"))
        }));
    // A covered order whose body never ends.
    let (_sender, body) = futures::channel::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let slow = Request::post("/orders")
        .header("idempotency-key", "slow-upload")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap();
    let upload = tokio::spawn(service.clone().oneshot(slow));
    tokio::task::yield_now().await;
    // Another request through the same limit is served.
    let other = Request::get("/status").body(Body::empty()).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), service.clone().oneshot(other))
        .await
        .expect("the slow upload holds the concurrency limit")
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    // A replay never calls the service: a finished order, then its retry,
    // while another upload trickles.
    let order = || {
        Request::post("/orders")
            .header("idempotency-key", "k-replay")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{}"))
            .unwrap()
    };
    assert_eq!(
        service.clone().oneshot(order()).await.unwrap().status(),
        StatusCode::OK
    );
    let replay = service.clone().oneshot(order()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    upload.abort();
}

/// From a review: the layer passed its inner service's readiness on, so
/// with the concurrency limit README recommends inside it, a retry of a
/// finished order (a replay), a changed retry (422) and a request with a
/// malformed key (400) all waited behind slow executions holding every
/// permit — when clients retry, under overload — though none of them calls
/// the inner service. The layer is always ready; what calls the inner
/// service waits for it on its own clone, and still runs.
#[tokio::test]
async fn answers_that_never_call_the_inner_service_do_not_wait_for_its_readiness() {
    use tower::limit::ConcurrencyLimitLayer;
    let (engine, _store) = memory_engine(Policy::default());
    let gate = Gate::default();
    let held = gate.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let service = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(engine))
        .layer(ConcurrencyLimitLayer::new(1))
        .service(tower::service_fn(move |request: Request<_>| {
            let (held, counted) = (held.clone(), counted.clone());
            async move {
                counted.fetch_add(1, SeqCst);
                if request
                    .headers()
                    .get("idempotency-key")
                    .is_some_and(|k| k == "slow")
                {
                    held.pass().await;
                }
                Ok::<_, Infallible>(reply(StatusCode::CREATED, "done"))
            }
        }));
    let first = service.clone().oneshot(order("done", "{}")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    // The one permit is held by a slow execution.
    let slow = tokio::spawn(service.clone().oneshot(order("slow", "{}")));
    gate.started.notified().await;
    let replay = promptly(service.clone().oneshot(order("done", "{}")))
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let changed = promptly(service.clone().oneshot(order("done", r#"{"n":2}"#)))
        .await
        .unwrap();
    assert_eq!(changed.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let malformed = promptly(service.clone().oneshot(order(&"x".repeat(300), "{}")))
        .await
        .unwrap();
    assert_eq!(malformed.status(), StatusCode::BAD_REQUEST);
    // What does call the inner service waits for the permit, then runs:
    // a new order and a passthrough (a GET).
    let queued = tokio::spawn(service.clone().oneshot(order("queued", "{}")));
    let status = Request::get("/status").body(Body::empty()).unwrap();
    let passthrough = tokio::spawn(service.clone().oneshot(status));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!queued.is_finished() && !passthrough.is_finished());
    assert_eq!(
        calls.load(SeqCst),
        2,
        "nothing else reached the inner service"
    );
    gate.open.notify_one();
    assert_eq!(slow.await.unwrap().unwrap().status(), StatusCode::CREATED);
    let queued = promptly(queued).await.unwrap().unwrap();
    assert_eq!(queued.status(), StatusCode::CREATED);
    assert!(!queued.headers().contains_key("idempotent-replayed"));
    assert_eq!(
        promptly(passthrough).await.unwrap().unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(calls.load(SeqCst), 4);
}

/// An axum router whose `POST /orders` answers `201 order {n}`, `n`
/// counted in `calls`.
fn counted_orders(calls: &Arc<AtomicUsize>) -> axum::Router {
    let counted = calls.clone();
    axum::Router::new().route(
        "/orders",
        axum::routing::post(move || {
            let counted = counted.clone();
            async move {
                let n = counted.fetch_add(1, SeqCst) + 1;
                (StatusCode::CREATED, format!("order {n}"))
            }
        }),
    )
}

/// From a review: a layer nested in another on the same engine (a
/// sub-router's layer inside an app-wide one) computed the very key the
/// outer layer held, waited for it until `wait_timeout`, and answered
/// 409 `in-flight` — which the outer layer released: the order never ran,
/// on every retry. The inner layer now goes on as the outer execution; a
/// retry is replayed, the handler ran once. So for two engines built apart
/// over the same records (a review of the fix: told apart by their `Arc`,
/// they deadlocked again).
#[tokio::test]
async fn a_layer_nested_in_another_on_the_same_records_runs_the_order_once() {
    let policy = Policy {
        wait_timeout: Duration::from_millis(300),
        ..Policy::default()
    };
    for apart in [false, true] {
        let (engine, store) = memory_engine(policy.clone());
        let inner_engine = match apart {
            false => engine.clone(),
            true => Engine::new(store, Routes::all(policy.clone()).unwrap()),
        };
        let calls = Arc::new(AtomicUsize::new(0));
        let routes = counted_orders(&calls).layer(IdempotencyLayer::new(inner_engine));
        let app = tower::ServiceBuilder::new()
            .layer(IdempotencyLayer::new(engine))
            .service(routes);
        let mut bodies = Vec::new();
        for _ in 0..3 {
            let answer = promptly(app.clone().oneshot(order("nested", "{}")))
                .await
                .unwrap();
            assert_eq!(answer.status(), StatusCode::CREATED, "apart: {apart}");
            bodies.push(answer.into_body().collect().await.unwrap().to_bytes());
        }
        assert!(
            bodies.iter().all(|body| body == "order 1"),
            "{apart}: {bodies:?}"
        );
        assert_eq!(calls.load(SeqCst), 1, "apart: {apart}");
    }
}

/// From a review of the nesting fix: the inner layer's owner-checked
/// renewal used its own route's lease. An inner lease shorter than the
/// outer's (300 ms under the default 30 s, whose next heartbeat is 10 s
/// off) cut the outer's lease short, and a retry a second into the slow
/// handler took the key over and ran it again. The renewal uses the outer's
/// lease: the retry finds the key in flight; the handler runs once.
#[tokio::test]
async fn a_nested_layers_check_never_shortens_the_outer_lease() {
    let (outer, store) = memory_engine(Policy {
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    });
    let short = Policy {
        lease: Duration::from_millis(300),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    };
    let inner = Engine::new(store, Routes::all(short).unwrap());
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let routes = axum::Router::new()
        .route(
            "/orders",
            axum::routing::post(move || {
                let counted = counted.clone();
                async move {
                    counted.fetch_add(1, SeqCst);
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    (StatusCode::CREATED, "done")
                }
            }),
        )
        .layer(IdempotencyLayer::new(inner));
    let app = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(outer))
        .service(routes);
    let first = tokio::spawn(app.clone().oneshot(order("slow", "{}")));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let retry = promptly(app.clone().oneshot(order("slow", "{}")))
        .await
        .unwrap();
    assert_eq!(
        retry.status(),
        StatusCode::CONFLICT,
        "the retry took the key over"
    );
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    assert_eq!(calls.load(SeqCst), 1, "the handler ran twice");
}

/// From a review of the always-ready change: a `Buffer` outside the layer
/// keeps one instance and polls it only when a message comes. Its inner
/// limit, polled while a slow execution held the one permit, queued for
/// it; the layer answered ready and sent the passthrough on a clone, and
/// when the permit came free it went to the instance nobody polled again:
/// the passthrough waited for good. The waiting instance is dropped.
#[tokio::test]
async fn a_buffer_outside_the_layer_never_pins_the_limit_inside_it() {
    use tower::limit::ConcurrencyLimitLayer;
    let (engine, _store) = memory_engine(Policy::default());
    let gate = Gate::default();
    let held = gate.clone();
    let service = tower::ServiceBuilder::new()
        .buffer(8)
        .layer(IdempotencyLayer::new(engine))
        .layer(ConcurrencyLimitLayer::new(1))
        .service(tower::service_fn(move |request: Request<_>| {
            let held = held.clone();
            async move {
                if request.method() == http::Method::POST {
                    held.pass().await;
                }
                Ok::<_, Infallible>(reply(StatusCode::OK, "done"))
            }
        }));
    let slow = tokio::spawn(service.clone().oneshot(order("slow", "{}")));
    gate.started.notified().await;
    let status = Request::get("/status").body(Body::empty()).unwrap();
    let passthrough = tokio::spawn(service.clone().oneshot(status));
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.open.notify_one();
    assert_eq!(slow.await.unwrap().unwrap().status(), StatusCode::OK);
    let answer = promptly(passthrough).await.unwrap().unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
}

/// From a review of the nesting change: an app-wide layer over each
/// replica's memory store around a sub-router's layer over one shared
/// store computed the same scope, and the inner layer passed the request
/// through on the outer's key — so the shared store never saw it, and the
/// retry on the other replica ran the order again. Only a key held in the
/// same store passes; the shared store replays it.
#[tokio::test]
async fn a_nested_layer_over_another_store_still_protects_its_route() {
    let shared = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let replica = || {
        let routes = counted_orders(&calls).layer(IdempotencyLayer::new(Engine::new(
            shared.clone(),
            Routes::all(Policy::default()).unwrap(),
        )));
        let (own, _) = memory_engine(Policy::default());
        tower::ServiceBuilder::new()
            .layer(IdempotencyLayer::new(own))
            .service(routes)
    };
    let (first, second) = (replica(), replica());
    let answer = first.oneshot(order("across", "{}")).await.unwrap();
    assert_eq!(answer.status(), StatusCode::CREATED);
    let retry = second.oneshot(order("across", "{}")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(
        retry.into_body().collect().await.unwrap().to_bytes(),
        "order 1"
    );
    assert_eq!(
        calls.load(SeqCst),
        1,
        "the retry on the other replica ran again"
    );
}

/// Bodies queued behind the inner service's readiness (a clone that must
/// wait for a concurrency limit's permit or a buffer's slot) are buffered
/// bodies too: they stay counted in `max_buffered_bytes` until the inner
/// service is ready, so past the budget new orders get 503 `overloaded`
/// instead of queueing without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_waiting_for_the_inner_service_count_in_the_budget() {
    use std::task::{Context, Poll};
    /// Ready at once as it is; its clones (the layer calls a clone) only
    /// once `open` holds a permit.
    struct Gated {
        open: Arc<tokio::sync::Semaphore>,
        clone: bool,
    }
    impl Clone for Gated {
        fn clone(&self) -> Self {
            Gated {
                open: self.open.clone(),
                clone: true,
            }
        }
    }
    impl tower::Service<Request<tower_idempotency::layer::RequestBody<Body>>> for Gated {
        type Response = Response<Body>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Response<Body>, Infallible>>;
        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            if !self.clone || self.open.available_permits() > 0 {
                return Poll::Ready(Ok(()));
            }
            // Looked at again shortly (a test double: no waker list).
            let waker = cx.waker().clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                waker.wake();
            });
            Poll::Pending
        }
        fn call(
            &mut self,
            _request: Request<tower_idempotency::layer::RequestBody<Body>>,
        ) -> Self::Future {
            std::future::ready(Ok(reply(StatusCode::CREATED, "done")))
        }
    }
    const BODY: usize = 1000;
    let config = EngineConfig {
        max_buffered_bytes: 2 * BODY as u64,
        ..EngineConfig::default()
    };
    let routes = Routes::all(Policy::default()).unwrap();
    let engine = Engine::with_config(Arc::new(MemoryStore::new()), routes, config);
    let open = Arc::new(tokio::sync::Semaphore::new(0));
    let layer = IdempotencyLayer::new(engine.clone());
    let json = format!(r#"{{"pad":"{}"}}"#, "x".repeat(BODY - 10));
    let mut answers = Vec::new();
    for n in 0..4 {
        let order = Request::post("/orders")
            .header("idempotency-key", format!("queued-{n}"))
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, json.len())
            .body(Body::from(json.clone()))
            .unwrap();
        // A service of its own per order (the layer swaps the instance it
        // calls for a clone, which would wait).
        let gated = Gated {
            open: open.clone(),
            clone: false,
        };
        let mut service = tower::Layer::layer(&layer, gated);
        let call = tower::Service::call(service.ready().await.unwrap(), order);
        answers.push(tokio::spawn(call));
        // Each order reads its body and waits for readiness (or is
        // refused) before the next comes.
        promptly(async {
            while engine.metrics().in_flight() as u64 + engine.metrics().overloaded() <= n {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await;
    }
    assert_eq!(
        engine.metrics().overloaded(),
        2,
        "two bodies fit the budget"
    );
    assert_eq!(engine.metrics().buffered_bytes(), 2 * BODY as u64);
    open.add_permits(1);
    let mut statuses = Vec::new();
    for answer in answers {
        statuses.push(promptly(answer).await.unwrap().unwrap().status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::CREATED,
            StatusCode::CREATED,
            StatusCode::SERVICE_UNAVAILABLE,
            StatusCode::SERVICE_UNAVAILABLE
        ]
    );
    assert_eq!(
        engine.metrics().buffered_bytes(),
        0,
        "every permit given back"
    );
}

/// A caller that keeps one instance of the layered service (tower's
/// `ready().await?.call(…)` on the same value, a `Buffer` worker) under a
/// concurrency limit of one: the instance it polled ready must not keep
/// the permit the request's own clone then waits for.
#[tokio::test]
async fn a_caller_keeping_one_service_instance_is_served_under_a_limit_of_one() {
    use tower::limit::ConcurrencyLimitLayer;
    use tower::Service;
    let (engine, _store) = memory_engine(Policy::default());
    let mut service = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(engine))
        .layer(ConcurrencyLimitLayer::new(1))
        .service(tower::service_fn(|_request: Request<_>| async {
            Ok::<_, Infallible>(reply(StatusCode::CREATED, "done"))
        }));
    for key in ["first", "second", "third"] {
        let request = Request::post("/orders")
            .header("idempotency-key", key)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{}"))
            .unwrap();
        let ready = tokio::time::timeout(Duration::from_secs(5), service.ready())
            .await
            .expect("the service never got ready again")
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(5), ready.call(request))
            .await
            .expect("the request waits for a permit its own service holds")
            .unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
    }
}

/// From a review of the layer as users wrap it: tower-http's
/// `RequestBodyLimitLayer` outside the layer wraps bodies in
/// `http_body_util::Limited`, whose error for a body over its limit the
/// layer answered 400 `body-unreadable`. It is the 413 that limit means
/// (here a chunked body of 20 bytes under a limit of 10), and nothing runs.
#[tokio::test]
async fn a_body_cut_by_an_outer_limit_is_413() {
    use tower::Layer;

    let (engine, store) = memory_engine(Policy::default());
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let svc = IdempotencyLayer::new(engine).layer(tower::service_fn(move |_: Request<_>| {
        counter.fetch_add(1, SeqCst);
        async { Ok::<_, Infallible>(reply(StatusCode::CREATED, "saved")) }
    }));
    let chunks = futures::stream::iter(
        ["0123456789", "0123456789"]
            .map(|c| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(c)))),
    );
    let body = http_body_util::Limited::new(http_body_util::StreamBody::new(chunks), 10);
    let request = Request::post("/orders")
        .header("idempotency-key", "k-limited")
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap();
    let answer = Reply::read(svc.oneshot(request).await.unwrap()).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE, "{answer:?}");
    assert_eq!(calls.load(SeqCst), 0);
    assert!(store.is_empty());
}

/// A handler that answers a covered request with a 1xx as its final
/// status (a 101 with no upgrade asked for): the request ran, but no
/// replay can give a protocol switch again. The key was released, as for
/// any status not stored, and the retry ran it a second time; it is kept
/// as "executed, response not stored" now.
#[tokio::test]
async fn a_1xx_as_the_final_answer_runs_once() {
    let (engine, _) = memory_engine(Policy::default());
    let upstream = layered(&engine, |_, _| async move {
        reply(StatusCode::SWITCHING_PROTOCOLS, "")
    });
    let first = upstream.send(support::post_json(b"k-101", "{}")).await;
    assert_eq!(first.status, StatusCode::SWITCHING_PROTOCOLS);
    let retry = upstream.send(support::post_json(b"k-101", "{}")).await;
    assert_eq!(upstream.calls(), 1, "the retry ran again: {retry:?}");
    assert_eq!(retry.status, StatusCode::CONFLICT);
}
