//! The guarantee under attack, through the tower layer: request sequences
//! that once broke "executes once" or isolation (issue "Guarantee holes"),
//! each answered here the way a user of the layer would notice it.

mod support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;
use tower_idempotency::fingerprint::{fingerprint, Exclusions};
use tower_idempotency::layer::RequestBody;
use tower_idempotency::{
    Engine, Idempotency, IdempotencyLayer, InFlightPolicy, MemoryStore, Policy, Principal, Routes,
};

use support::{post_json, Harness, Reply};

fn no_key(method: Method, uri: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn with_key(method: Method, uri: &str, key: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("idempotency-key", key)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// A harness whose inner service answers `201 <path> <n>`, over `routes`.
fn echo_path(routes: Routes) -> Harness {
    Harness::with_response(Policy::default(), |n, parts| {
        Response::builder()
            .status(StatusCode::CREATED)
            .body(Full::new(Bytes::from(format!("{} {n}", parts.uri))))
            .unwrap()
    })
    .with_engine(Engine::new(MemoryStore::new(), routes))
}

// ---------------------------------------------------------------------------
// Hole 1: escaped duplicate JSON keys

/// `{"amount":10,"\u0061mount":1000}` charges 1000 with a last-wins parser,
/// the reordered body 10: the second must never get the first's answer.
#[tokio::test]
async fn escaped_duplicate_keys_are_a_different_request() {
    let h = Harness::new(Policy::default());
    let first = h
        .send(post_json(b"pay-1", r#"{"amount":10,"\u0061mount":1000}"#))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = h
        .send(post_json(b"pay-1", r#"{"\u0061mount":1000,"amount":10}"#))
        .await;
    second.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    assert_eq!(h.calls(), 1);
    // The same body again is still a replay.
    let again = h
        .send(post_json(b"pay-1", r#"{"amount":10,"\u0061mount":1000}"#))
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

/// Go's `encoding/json` matches member names to struct fields whatever
/// their case (and folds `ſ` to `s`, Kelvin's `K` to `k`), the last match
/// winning: `{"amount":1000,"Amount":10}` charges 10, its reordering 1000.
/// Sorted byte-wise, both had one canonical form, and the second got the
/// first's answer.
#[tokio::test]
async fn keys_equal_but_for_case_are_a_different_request() {
    let h = Harness::new(Policy::default());
    for (n, (first, reordered)) in [
        (
            r#"{"amount":1000,"Amount":10}"#,
            r#"{"Amount":10,"amount":1000}"#,
        ),
        (
            r#"{"sku":"X","\u017fku":"Y"}"#,
            r#"{"\u017fku":"Y","sku":"X"}"#,
        ),
        (
            r#"{"kind":"a","\u212aind":"b"}"#,
            r#"{"\u212aind":"b","kind":"a"}"#,
        ),
        (r#"{"ß":1,"ẞ":2}"#, r#"{"ẞ":2,"ß":1}"#),
        (r#"{"id":1,"İd":2}"#, r#"{"İd":2,"id":1}"#),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("case-{n}");
        let answer = h.send(post_json(key.as_bytes(), first)).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        h.send(post_json(key.as_bytes(), reordered))
            .await
            .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    }
    assert_eq!(h.calls(), 5);
    // Keys that differ otherwise are still sorted: a reordered retry of
    // distinct members is the same request.
    let first = h
        .send(post_json(b"order", r#"{"b":1,"A":2,"c":{"Z":1,"y":2}}"#))
        .await;
    let again = h
        .send(post_json(b"order", r#"{"c":{"y":2,"Z":1},"A":2,"b":1}"#))
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

/// A `POST` naming another method in `X-HTTP-Method-Override` runs as
/// that method at the backend (Laravel, Symfony, Express), even where the
/// engine covers it as the `POST` (its own route required, the named one
/// not covered): a retry naming another method, or none, under the same
/// key is another request (422), never the first's answer.
#[tokio::test]
async fn a_named_method_is_part_of_the_request() {
    let h = Harness::new(Policy {
        required: true,
        ..Policy::default()
    });
    let named = |method: Option<&'static str>| {
        let mut request = post_json(b"pay-override", r#"{"amount":10}"#);
        if let Some(method) = method {
            let value = http::HeaderValue::from_static(method);
            request
                .headers_mut()
                .insert("x-http-method-override", value);
        }
        request
    };
    let first = h.send(named(Some("PUT"))).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for other in [None, Some("DELETE")] {
        h.send(named(other))
            .await
            .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    }
    let again = h.send(named(Some("PUT"))).await;
    assert!(again.replayed());
    assert_eq!(h.calls(), 1);
}

mod oracle {
    //! The fingerprint against serde_json, not against another copy of the
    //! canonicaliser: two bodies a last-wins parser reads differently never
    //! share a fingerprint.
    use super::*;
    use proptest::prelude::*;

    /// Keys whose spellings collide once decoded.
    fn key() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "a",
            "\\u0061",
            "\\u0041",
            "A",
            "ab",
            "a\\u0062",
            "\\u0061b",
            "é",
            "\\u00e9",
            "\\u00E9",
            "\\ud83d\\ude00",
            "😀",
            "\\/",
            "/",
            "\\\\",
            "",
        ])
    }

    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            (0..3u8).prop_map(|n| n.to_string()),
            Just("\"x\"".to_owned()),
            Just("null".to_owned()),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop::collection::vec((key(), inner), 0..5).prop_map(|members| {
                let members: Vec<String> = members
                    .iter()
                    .map(|(k, v)| format!("\"{k}\":{v}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            })
        })
    }

    /// An object and a reordering of its members (`order` picks which
    /// member goes next).
    fn object_and_shuffle() -> impl Strategy<Value = (String, String)> {
        (
            prop::collection::vec((key(), value()), 0..6),
            prop::collection::vec(any::<prop::sample::Index>(), 6),
        )
            .prop_map(|(members, order)| {
                let write = |members: &[(&str, String)]| {
                    let members: Vec<String> = members
                        .iter()
                        .map(|(k, v)| format!("\"{k}\":{v}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                };
                let mut rest = members.clone();
                let mut shuffled = Vec::new();
                for index in &order {
                    if rest.is_empty() {
                        break;
                    }
                    shuffled.push(rest.remove(index.index(rest.len())));
                }
                (write(&members), write(&shuffled))
            })
    }

    fn fp(body: &str) -> tower_idempotency::store::Fingerprint {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            "application/json".parse().unwrap(),
        );
        fingerprint(
            &Method::POST,
            &"/pay".parse().unwrap(),
            &headers,
            &[],
            body.as_bytes(),
            Exclusions::default(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        #[test]
        fn bodies_read_differently_never_share_a_fingerprint(
            (a, b) in object_and_shuffle()
        ) {
            let parsed_a: serde_json::Value = serde_json::from_str(&a).unwrap();
            let parsed_b: serde_json::Value = serde_json::from_str(&b).unwrap();
            if parsed_a != parsed_b {
                prop_assert_ne!(fp(&a), fp(&b), "{} / {}", a, b);
            }
        }
    }

    /// Reordering members with different keys keeps the fingerprint (the
    /// canonical form still sorts), escaped or not.
    #[test]
    fn reordering_distinct_keys_keeps_the_fingerprint() {
        assert_eq!(fp(r#"{"b":1,"\u0061":2}"#), fp(r#"{"\u0061":2,"b":1}"#));
        assert_eq!(fp(r#"{"b":1,"a":2}"#), fp(r#"{"a":2,"b":1}"#));
    }
}

// ---------------------------------------------------------------------------
// Hole 13: the first route matching path and method decides

#[tokio::test]
async fn a_later_route_covering_the_method_is_not_skipped() {
    let routes = Routes::new()
        .route("/api/payments", Policy::default())
        .unwrap()
        .route(
            "/api/**",
            Policy {
                methods: vec!["PUT".into(), "DELETE".into()],
                required: true,
                ..Policy::default()
            },
        )
        .unwrap();
    let h = echo_path(routes);
    let reply = h.send(no_key(Method::PUT, "/api/payments/7")).await;
    reply.assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    assert_eq!(
        h.calls(),
        0,
        "the unprotected PUT never reached the service"
    );
    let first = h.send(with_key(Method::PUT, "/api/payments/7", "k")).await;
    let second = h.send(with_key(Method::PUT, "/api/payments/7", "k")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(second.replayed());
    assert_eq!(h.calls(), 1);
}

// ---------------------------------------------------------------------------
// Hole 7: path spellings

#[tokio::test]
async fn path_spellings_neither_bypass_a_route_nor_split_a_scope() {
    let routes = Routes::new()
        .route("/api/pay", Policy::default().required(true))
        .unwrap();
    let h = echo_path(routes);
    for spelling in [
        "//api/pay",
        "/./api/pay",
        "/%61pi/pay",
        "/api/pay/",
        "/x/../api/pay",
    ] {
        let reply = h.send(no_key(Method::POST, spelling)).await;
        reply.assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    }
    assert_eq!(h.calls(), 0);
    // One scope for every spelling; the request is forwarded as it came.
    let first = h.send(with_key(Method::POST, "//api/pay/", "k")).await;
    assert_eq!(first.text(), "//api/pay/ 1");
    for spelling in ["/api/pay", "/api/pay/", "/%61pi/pay", "/./api//pay"] {
        let reply = h.send(with_key(Method::POST, spelling, "k")).await;
        assert!(reply.replayed(), "{spelling}: {reply:?}");
        assert_eq!(reply.text(), "//api/pay/ 1");
    }
    assert_eq!(h.calls(), 1);
}

// ---------------------------------------------------------------------------
// Hole 14: glob backtracking

/// A 40 KB path of near-matches against `/a/**/b/**/c`: answered, and
/// matched right (the backtracking matcher took quadratic time on it).
#[tokio::test]
async fn a_long_path_against_a_double_glob_is_matched_right() {
    let routes = Routes::new()
        .route("/a/**/b/**/c", Policy::default().required(true))
        .unwrap();
    let h = echo_path(routes);
    let near = format!("/a/{}", "b/".repeat(20_000));
    let reply = h.send(no_key(Method::POST, &near)).await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "not covered: passed through"
    );
    let covered = format!("{near}c");
    let reply = h.send(no_key(Method::POST, &covered)).await;
    reply.assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    assert_eq!(h.calls(), 1);
}

// ---------------------------------------------------------------------------
// Hole 4: mount prefix and host

fn shop(engine: &Engine, name: &'static str, calls: Arc<AtomicUsize>) -> Router {
    Router::new()
        .route(
            "/orders",
            post(move || {
                let n = calls.fetch_add(1, SeqCst) + 1;
                async move { (StatusCode::CREATED, format!("{name} order {n}")) }
            }),
        )
        .layer(IdempotencyLayer::new(engine.clone()))
}

async fn call(app: &Router, request: Request<axum::body::Body>) -> Reply {
    Reply::read(app.clone().oneshot(request).await.unwrap()).await
}

fn order(uri: &str, host: &str, key: &str) -> Request<axum::body::Body> {
    Request::post(uri)
        .header("host", host)
        .header("idempotency-key", key)
        .body(axum::body::Body::empty())
        .unwrap()
}

#[tokio::test]
async fn nested_routers_sharing_an_engine_never_share_a_response() {
    let engine = Engine::new(MemoryStore::new(), Routes::all(Policy::default()).unwrap());
    let calls = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .nest("/shop-a", shop(&engine, "shop-a", calls.clone()))
        .nest("/shop-b", shop(&engine, "shop-b", calls.clone()));
    let a = call(&app, order("/shop-a/orders", "shop.example", "order-1001")).await;
    let b = call(&app, order("/shop-b/orders", "shop.example", "order-1001")).await;
    assert_eq!(a.text(), "shop-a order 1");
    assert!(!b.replayed(), "shop B got shop A's response: {b:?}");
    assert_eq!(b.text(), "shop-b order 2");
    let again = call(&app, order("/shop-a/orders", "shop.example", "order-1001")).await;
    assert!(again.replayed());
    assert_eq!(again.text(), "shop-a order 1");
}

#[tokio::test]
async fn two_hosts_never_share_a_response() {
    let engine = Engine::new(MemoryStore::new(), Routes::all(Policy::default()).unwrap());
    let calls = Arc::new(AtomicUsize::new(0));
    let app = shop(&engine, "shop", calls.clone());
    let a = call(&app, order("/orders", "tenant-a.example", "order-1001")).await;
    let b = call(&app, order("/orders", "tenant-b.example", "order-1001")).await;
    assert!(!b.replayed(), "tenant B got tenant A's response: {b:?}");
    assert_eq!(
        (a.text(), b.text()),
        ("shop order 1".into(), "shop order 2".into())
    );
    // Host names are case-insensitive, and the port names no tenant: the
    // same tenant replays.
    for same in [
        "TENANT-A.example",
        "tenant-a.example:443",
        "tenant-a.example.",
    ] {
        let again = call(&app, order("/orders", same, "order-1001")).await;
        assert!(again.replayed(), "{same}: {again:?}");
        assert_eq!(again.text(), "shop order 1");
    }
    // Two `Host` lines, as a server that keeps both hands them on (the
    // tenant's handler may read either): scoped by both, so neither
    // tenant's response comes back, and the pair's own is not theirs.
    let mut two = order("/orders", "tenant-a.example", "order-1001");
    two.headers_mut().append(
        http::header::HOST,
        http::HeaderValue::from_static("tenant-b.example"),
    );
    let both = call(&app, two).await;
    assert!(
        !both.replayed(),
        "two Host lines got a tenant's replay: {both:?}"
    );
    assert_eq!(both.text(), "shop order 3");
    let b = call(&app, order("/orders", "tenant-b.example", "order-1001")).await;
    assert_eq!(b.text(), "shop order 2", "tenant B's own replay");
    // The option turns it off: one key space for every host name.
    let engine = Engine::new(
        MemoryStore::new(),
        Routes::all(Policy {
            scope_authority: false,
            ..Policy::default()
        })
        .unwrap(),
    );
    let app = shop(&engine, "shop", calls.clone());
    call(&app, order("/orders", "a.example", "k")).await;
    assert!(call(&app, order("/orders", "b.example", "k"))
        .await
        .replayed());
}

// ---------------------------------------------------------------------------
// Hole 9: an empty principal is a principal

#[tokio::test]
async fn an_empty_principal_is_not_the_absence_of_one() {
    let h = Harness::new(Policy::default());
    let anonymous = h.send(post_json(b"k", "{}")).await;
    let mut request = post_json(b"k", "{}");
    request.extensions_mut().insert(Principal::new(""));
    let empty = h.send(request).await;
    assert_eq!(anonymous.text(), "order 1");
    assert!(!empty.replayed(), "{empty:?}");
    assert_eq!(h.calls(), 2);
}

#[tokio::test]
async fn a_transfer_coding_the_engine_does_not_implement_is_refused() {
    let h = Harness::new(Policy::default());
    let mut request = post_json(b"k", "{}");
    request
        .headers_mut()
        .insert("transfer-encoding", "gzip, chunked".parse().unwrap());
    let reply = h.send(request).await;
    reply.assert_problem(StatusCode::NOT_IMPLEMENTED, "transfer-coding-unsupported");
    assert_eq!(h.calls(), 0);
    // Nothing was reserved: the same key with a plain body executes.
    let reply = h.send(post_json(b"k", "{}")).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let mut chunked = post_json(b"k2", "{}");
    chunked
        .headers_mut()
        .insert("transfer-encoding", "Chunked".parse().unwrap());
    assert_eq!(h.send(chunked).await.status, StatusCode::CREATED);
}

// ---------------------------------------------------------------------------
// Hole 10: a blocked worker must not stop other requests' lease renewal

/// One request with a 300 ms lease runs (awaiting) for 1.5 s; meanwhile
/// another handler blocks its worker thread for 1 s right after taking its
/// own key. A duplicate of the first, sent while the worker is blocked,
/// must find it in flight: the first one's backend ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_worker_does_not_stop_other_leases_from_being_renewed() {
    let policy = |lease_ms| Policy {
        lease: Duration::from_millis(lease_ms),
        in_flight: InFlightPolicy::Reject,
        ..Policy::default()
    };
    let routes = Routes::new()
        .route("/slow", policy(300))
        .unwrap()
        .route("/block", policy(100))
        .unwrap();
    let engine = Engine::new(MemoryStore::new(), routes);
    let slow_calls = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let inner = tower::service_fn({
        let (slow_calls, started) = (slow_calls.clone(), started.clone());
        move |request: Request<RequestBody<Full<Bytes>>>| {
            let (slow_calls, started) = (slow_calls.clone(), started.clone());
            let blocking = request.uri().path() == "/block";
            if blocking {
                // Blocks its worker before its first await.
                std::thread::sleep(Duration::from_secs(1));
            } else {
                slow_calls.fetch_add(1, SeqCst);
                started.notify_one();
            }
            async move {
                if !blocking {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                }
                let _ = request.into_body().collect().await;
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(StatusCode::CREATED)
                        .body(Full::new(Bytes::from_static(b"done")))
                        .unwrap(),
                )
            }
        }
    });
    let service = Idempotency::new(inner, engine);
    let send = |uri: &str, key: &str| {
        let service = service.clone();
        let request = with_key(Method::POST, uri, key);
        tokio::spawn(async move { Reply::read(service.oneshot(request).await.unwrap()).await })
    };
    let first = send("/slow", "a");
    started.notified().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let blocker = send("/block", "b");
    // Well past the first lease, while the worker is still blocked.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let duplicate = send("/slow", "a").await.unwrap();
    duplicate.assert_problem(StatusCode::CONFLICT, "in-flight");
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(blocker.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(slow_calls.load(SeqCst), 1, "the first request ran twice");
}

/// Attack: a framework that answers another spelling of the path with a
/// redirect before any handler runs: Starlette's `redirect_slashes` (307
/// `/items` → `/items/`), Go's `ServeMux` path cleaning (301 `//items` →
/// `/items`), a servlet container's session URL (308 to
/// `/items;jsessionid=…`). The client follows with the same key, method
/// and body (307 and 308 keep them), and the engine, which reads all these
/// spellings as one scope, replayed the stored redirect: a loop, and the
/// request never reached its handler for the key's whole `ttl`. A 301,
/// 307 or 308 to another spelling of the request's own path, on its host,
/// with its query, asks for the request again there: nothing ran, so the
/// key is released. A 302 or 303 back (Post, Redirect, Get), and a 301 to
/// the same spelling, to another query or to another host (a handler's
/// answer after it ran), are still the request's stored answer.
#[tokio::test]
async fn a_redirect_to_another_spelling_of_the_path_is_not_the_keys_answer() {
    for (status, from, to) in [
        (307, "/items", "/items/"),
        (308, "/items", "http://shop.example/items/"),
        (301, "//items", "/items"),
        (308, "/items", "/items;jsessionid=4711"),
        (301, "/items?page=2", "/items/?page=2"),
    ] {
        let harness = Harness::with_response(Policy::default(), move |n, parts| {
            if parts.uri.path_and_query().map(|p| p.as_str()) == Some(from) && n == 1 {
                return Response::builder()
                    .status(status)
                    .header(http::header::LOCATION, to)
                    .body(Full::default())
                    .unwrap();
            }
            Response::builder()
                .status(StatusCode::CREATED)
                .body(Full::new(Bytes::from(format!("made {n}"))))
                .unwrap()
        });
        let request = |path: &str| {
            support::post(b"k")
                .uri(path)
                .header(http::header::HOST, "shop.example")
                .body(Full::default())
                .unwrap()
        };
        let first = harness.send(request(from)).await;
        assert_eq!(first.status.as_u16(), status, "{status} {from} → {to}");
        assert!(!first.replayed());
        // The client follows where it was sent (the engine's scope is the
        // same for both spellings).
        let followed = location_as_request_path(from, to);
        let second = harness.send(request(&followed)).await;
        assert_eq!(
            (second.status, second.replayed()),
            (StatusCode::CREATED, false),
            "{status} {from} → {to}: the follow-up got {second:?}"
        );
        assert_eq!(harness.calls(), 2, "{status} {from} → {to}");
        // …and that execution is the key's answer from now on.
        let retry = harness.send(request(&followed)).await;
        assert!(retry.replayed(), "{status} {from} → {to}: {retry:?}");
        assert_eq!(harness.calls(), 2);
    }
    // Answers of a request that ran: replayed, never run again.
    for (status, to) in [
        (303, "/items/"),
        (302, "/items/"),
        (301, "/items"),
        (301, "/items?created=1"),
        (308, "https://other.example/items/"),
        (301, "?created=1"),
    ] {
        let harness = Harness::with_response(Policy::default(), move |_, _| {
            Response::builder()
                .status(status)
                .header(http::header::LOCATION, to)
                .body(Full::default())
                .unwrap()
        });
        let request = || {
            support::post(b"k")
                .uri("/items")
                .header(http::header::HOST, "shop.example")
                .body(Full::default())
                .unwrap()
        };
        assert_eq!(harness.send(request()).await.status.as_u16(), status);
        let retry = harness.send(request()).await;
        assert!(retry.replayed(), "{status} → {to}: {retry:?}");
        assert_eq!(harness.calls(), 1, "{status} → {to} ran twice");
    }
}

/// The path a client requests after following `location` from `from`.
fn location_as_request_path(from: &str, location: &str) -> String {
    let location = location
        .strip_prefix("http://shop.example")
        .unwrap_or(location);
    match location.strip_prefix('?') {
        Some(query) => format!("{from}?{query}"),
        None => location.to_owned(),
    }
}

// ---------------------------------------------------------------------------
// A body in another charset

/// [`echo_path`] with `path` covered for `PUT` only, its key required: a
/// `POST` there that names `PUT` must ask for the key.
fn put_only(path: &str) -> Harness {
    let policy = Policy {
        methods: vec!["PUT".into()],
        required: true,
        ..Policy::default()
    };
    echo_path(Routes::new().route(path, policy).unwrap())
}

/// `POST /orders` with `content_type` and `body` under `key`.
fn typed(key: &str, content_type: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header("idempotency-key", key)
        .header(http::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// Django REST framework and Express decode a body by its `charset` before
/// they parse it. Under UTF-7 `+ACY-` is `&` and `+ACI-…` a run of quotes
/// and commas, so two bodies that sort alike as UTF-8 text (fields or
/// members swapped, or one excluded field holding the difference) are two
/// different orders there: the second must get 422, never the first's
/// answer. Under UTF-8 a reordered form is still the same request.
#[tokio::test]
async fn a_body_in_another_charset_is_compared_as_it_was_sent() {
    let h = Harness::new(Policy {
        fingerprint_exclude: vec!["/client_ts".into()],
        ..Policy::default()
    });
    let form = "application/x-www-form-urlencoded; charset=utf-7";
    let json = "application/json; Charset=\"UTF-7\"";
    for (n, (content_type, first, second)) in [
        (
            form,
            "x=+ACY-amount=10&y=+ACY-amount=1000",
            "y=+ACY-amount=1000&x=+ACY-amount=10",
        ),
        (
            json,
            r#"{"x":"+ACIALAAiAGEAbQBvAHUAbgB0ACIAOgAxADAALAAiAHoAIgA6ACI-","y":"+ACIALAAiAGEAbQBvAHUAbgB0ACIAOgAxADAAMAAwACwAIgB3ACIAOgAi-"}"#,
            r#"{"y":"+ACIALAAiAGEAbQBvAHUAbgB0ACIAOgAxADAAMAAwACwAIgB3ACIAOgAi-","x":"+ACIALAAiAGEAbQBvAHUAbgB0ACIAOgAxADAALAAiAHoAIgA6ACI-"}"#,
        ),
        (
            json,
            r#"{"amount":10,"client_ts":"+ACIALAAiAGEAbQBvAHUAbgB0ACIAOgAxADAAMAAwACwAIgBwAGEAZAAiADoAIg-"}"#,
            r#"{"amount":10,"client_ts":"2024-01-01T00:00:00Z"}"#,
        ),
        (
            "application/x-www-form-urlencoded; charset=shift_jis",
            "a=1&b=2",
            "b=2&a=1",
        ),
        (
            "application/x-www-form-urlencoded; charset=utf-8; charset*=utf-7",
            "x=+ACY-amount=10&y=+ACY-amount=1000",
            "y=+ACY-amount=1000&x=+ACY-amount=10",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("charset-{n}");
        let answer = h.send(typed(&key, content_type, first)).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        h.send(typed(&key, content_type, second))
            .await
            .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
        let again = h.send(typed(&key, content_type, first)).await;
        assert!(again.replayed(), "the same bytes are still a replay");
    }
    assert_eq!(h.calls(), 5);
    for (n, content_type) in [
        "application/x-www-form-urlencoded; charset=UTF-8",
        "application/x-www-form-urlencoded; charset=\"us-ascii\"",
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("utf8-{n}");
        let first = h.send(typed(&key, content_type, "a=1&b=2")).await;
        let again = h.send(typed(&key, content_type, "b=2&a=1")).await;
        assert!(again.replayed(), "{content_type}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(h.calls(), 7);
}

/// Express decodes a UTF-7 JSON body before `method-override` reads it, so
/// `{"+AF8-method":"PUT"}` is a `PUT` there: a `POST` path covered only
/// for `PUT` (its key required) must still ask for the key, not pass the
/// request through unprotected.
#[tokio::test]
async fn a_method_named_in_another_charset_does_not_skip_its_route() {
    let h = put_only("/orders");
    // Also behind a byte that is not UTF-8 in a quoted parameter, which
    // Express's parser takes, and spelled `charset*`, which Django takes.
    for content_type in [
        &b"application/json; charset=utf-7"[..],
        b"application/json; x=\"\xe9\"; charset=utf-7",
        b"application/json; charset*=utf-7",
    ] {
        let request = Request::builder()
            .method(Method::POST)
            .uri("/orders")
            .header(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_bytes(content_type).unwrap(),
            )
            .body(Full::new(Bytes::from_static(br#"{"+AF8-method":"PUT"}"#)))
            .unwrap();
        h.send(request)
            .await
            .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    }
    assert_eq!(h.calls(), 0, "the unprotected request reached the service");
    // In UTF-8 the same POST names no method: forwarded as the POST it is.
    let plain = Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header(
            http::header::CONTENT_TYPE,
            "application/json; charset=utf-8",
        )
        .body(Full::new(Bytes::from_static(br#"{"amount":1}"#)))
        .unwrap();
    assert_eq!(h.send(plain).await.status, StatusCode::CREATED);
}

/// Puma hands Rack a header `X_HTTP_Method_Override` as
/// `HTTP_X_HTTP_METHOD_OVERRIDE`, which `Rack::MethodOverride` reads: the
/// spelling with `_` names the method as the usual one does. A path
/// covered only for `PATCH` asks for its key, and where the `POST` is
/// covered a retry naming another method (or none) is another request.
#[tokio::test]
async fn an_override_header_spelled_with_underscores_names_the_method() {
    let routes = Routes::new()
        .route(
            "/orders/*",
            Policy {
                methods: vec!["PATCH".into()],
                required: true,
                ..Policy::default()
            },
        )
        .unwrap();
    let h = echo_path(routes);
    for name in [
        "X_HTTP_Method_Override",
        "x_http_method",
        "X_Method-Override",
    ] {
        let request = Request::builder()
            .method(Method::POST)
            .uri("/orders/7")
            .header(name, "PATCH")
            .body(Full::new(Bytes::new()))
            .unwrap();
        h.send(request)
            .await
            .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    }
    assert_eq!(h.calls(), 0, "the unprotected request reached the service");

    let h = Harness::new(Policy::default());
    let named = |method: Option<&'static str>| {
        let mut request = post_json(b"pay-underscore", r#"{"amount":10}"#);
        if let Some(method) = method {
            let name = http::HeaderName::from_static("x_http_method_override");
            request
                .headers_mut()
                .insert(name, http::HeaderValue::from_static(method));
        }
        request
    };
    assert_eq!(
        h.send(named(Some("DELETE"))).await.status,
        StatusCode::CREATED
    );
    h.send(named(None))
        .await
        .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    assert!(h.send(named(Some("DELETE"))).await.replayed());
    assert_eq!(h.calls(), 1);
}

/// Two readings at once: a servlet's `encodeURL` appends `;jsessionid=…`
/// to a form's action on a path with an escape, a client may send `;/..`
/// (find-my-way before 8 cuts the path at `;`), and under case-insensitive
/// routing a capital beyond ASCII (`%C3%84`): each still needs its key.
#[tokio::test]
async fn paths_read_two_ways_at_once_still_need_their_key() {
    let routes = Routes::new()
        .case_insensitive(true)
        .route("/bestellung/bestätigen", Policy::default().required(true))
        .unwrap()
        .route("/orders", Policy::default().required(true))
        .unwrap();
    let h = echo_path(routes);
    for path in [
        "/bestellung/best%C3%A4tigen;jsessionid=AB12",
        "/bestellung/best%C3%84tigen",
        "/orders;/..",
    ] {
        h.send(no_key(Method::POST, path))
            .await
            .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    }
    assert_eq!(h.calls(), 0, "an unprotected request reached the service");
    let first = h
        .send(with_key(
            Method::POST,
            "/bestellung/best%C3%A4tigen;jsessionid=AB12",
            "k",
        ))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = h
        .send(with_key(
            Method::POST,
            "/bestellung/best%C3%A4tigen;jsessionid=AB12",
            "k",
        ))
        .await;
    assert!(again.replayed());
    assert_eq!(h.calls(), 1);
}

/// Attack: a request holds its key while it waits for the inner service
/// to be ready (a concurrency limit, a full buffer) and the store goes away
/// for longer than the lease, so no renewal keeps it. A retry then takes
/// the expired lease over and waits too. When the service is ready, the
/// first must not run as well: it answers 503, and the key's request runs
/// once, as the retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_lease_ran_out_while_it_waited_does_not_run() {
    use std::sync::atomic::AtomicBool;
    use std::task::{Context, Poll};
    use tower_idempotency::store::{Fault, FaultyStore, Op};
    /// Ready at once as it is; its clones (the layer calls a clone) only
    /// once `open` is set. Records the key of every request it runs.
    struct Gated {
        open: Arc<AtomicBool>,
        clone: bool,
        runs: Arc<std::sync::Mutex<Vec<http::HeaderValue>>>,
    }
    impl Clone for Gated {
        fn clone(&self) -> Self {
            Gated {
                open: self.open.clone(),
                clone: true,
                runs: self.runs.clone(),
            }
        }
    }
    impl tower::Service<Request<RequestBody<Full<Bytes>>>> for Gated {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>;
        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            if !self.clone || self.open.load(SeqCst) {
                return Poll::Ready(Ok(()));
            }
            let waker = cx.waker().clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                waker.wake();
            });
            Poll::Pending
        }
        fn call(&mut self, request: Request<RequestBody<Full<Bytes>>>) -> Self::Future {
            self.runs
                .lock()
                .unwrap()
                .push(request.headers()["idempotency-key"].clone());
            std::future::ready(Ok(Response::builder()
                .status(StatusCode::CREATED)
                .body(Full::new(Bytes::from_static(b"done")))
                .unwrap()))
        }
    }
    let store = FaultyStore::new(MemoryStore::new());
    let faults = store.faults();
    let policy = Policy {
        lease: Duration::from_secs(2),
        wait_timeout: Duration::from_millis(100),
        ..Policy::default()
    };
    let layer = IdempotencyLayer::new(Engine::new(store, Routes::all(policy).unwrap()));
    let gated = Gated {
        open: Arc::default(),
        clone: false,
        runs: Arc::default(),
    };
    let send = |key: &str| {
        let gated = Gated {
            clone: false,
            ..gated.clone()
        };
        let mut service = tower::Layer::layer(&layer, gated);
        let request = with_key(Method::POST, "/orders", key);
        tokio::spawn(async move {
            let ready = tower::ServiceExt::ready(&mut service).await.unwrap();
            Reply::read(tower::Service::call(ready, request).await.unwrap()).await
        })
    };
    let waiting = send("pay");
    // Timed from its reservation, however long a loaded machine took.
    while faults.inner_calls(Op::Reserve) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    faults.set(Op::Renew, Fault::Down);
    // Past the lease: the retry takes the key over; the store comes back
    // while both still wait for the service.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let retry = send("pay");
    tokio::time::sleep(Duration::from_millis(500)).await;
    faults.clear(Op::Renew);
    tokio::time::sleep(Duration::from_millis(200)).await;
    gated.open.store(true, SeqCst);
    let (waiting, retry) = (waiting.await.unwrap(), retry.await.unwrap());
    let runs = gated.runs.lock().unwrap().len();
    assert_eq!(
        runs, 1,
        "the request ran {runs} times: {waiting:?} {retry:?}"
    );
    waiting.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
}

/// Attack: a target of thousands of PHP front-controller segments
/// (`/x.php/x.php/…/pay`, which nginx splits at the last) was read one
/// controller deeper per segment, in recursion, until the stack overflowed
/// and the whole process aborted. It is answered like any request.
#[tokio::test]
async fn a_path_of_many_front_controllers_is_answered_not_a_crash() {
    let routes = Routes::new()
        .route("/pay", Policy::default().required(true))
        .unwrap();
    let h = echo_path(routes);
    let deep = format!("{}/pay", "/x.php".repeat(10_000));
    h.send(no_key(Method::POST, &deep))
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    assert_eq!(h.calls(), 0);
}

/// Attack: a form naming thousands of distinct methods in `_method[]`
/// cost a route lookup per method (and a quadratic dedup): seconds of CPU
/// per request. Only the first and the last value of each array name are
/// read now; the method Express takes (the first element) and the one PHP
/// keeps (the last) are still among them.
#[tokio::test]
async fn a_form_naming_thousands_of_methods_is_read_in_bounded_work() {
    let h = put_only("/orders");
    let many: Vec<String> = (0..5_000).map(|i| format!("_method[]=M{i}")).collect();
    let many = many.join("&");
    for body in [
        format!("_method[]=PUT&{many}"),
        format!("{many}&_method[]=PUT"),
    ] {
        let request = Request::builder()
            .method(Method::POST)
            .uri("/orders")
            .header(
                http::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        h.send(request)
            .await
            .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    }
    assert_eq!(h.calls(), 0);
}

// ---------------------------------------------------------------------------
// Rack's multipart readings, lenient JSON under a form label, `qs`'s `]=`

/// `POST /orders` with `content_type` and `body`, no key.
fn untyped_key(content_type: &str, body: String) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header(http::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// From a review of the fingerprint: Rack names a multipart part by its
/// `Content-ID` when its reading of the disposition finds no name (a
/// `name` after a space only, a disposition over 1536 bytes for Rack 3.1),
/// and Rack 2.2.6–3.0 read the disposition's parameters on into the next
/// header line; Rack parses `multipart/mixed` and `multipart/related` as
/// forms too (as urlencoded without a boundary). Each body below is a
/// `PATCH` to Rails (`Rack::MethodOverride`); the engine read a part named
/// `note`, or no form at all, and forwarded a `POST` to a route covered
/// only for `PUT` unprotected. Each must ask for the key.
#[tokio::test]
async fn a_method_named_where_only_rack_reads_it_does_not_skip_its_route() {
    let h = put_only("/orders");
    let part = |headers: &str| format!("--B\r\n{headers}\r\n\r\nPUT\r\n--B--\r\n");
    let padding = "a".repeat(1600);
    let bodies = [
        (
            "multipart/form-data; boundary=B",
            part("Content-Disposition: form-data; x=\"1\" name=\"note\"\r\nContent-ID: _method"),
        ),
        (
            "multipart/form-data; boundary=B",
            part(&format!(
                "Content-Disposition: form-data; x=\"{padding}\"; name=\"note\"\r\nContent-ID: _method"
            )),
        ),
        (
            "multipart/form-data; boundary=B",
            part("Content-Disposition: form-data; name=\"note\"\r\nX-A;name=_method: 1"),
        ),
        // From a review of the fix: Rack's pattern reads on into the next
        // header's name after a disposition ending in `;`, and finds
        // `Content-Disposition:` inside another header's name.
        (
            "multipart/form-data; boundary=B",
            part("Content-Disposition: form-data; name=\"note\";\r\nname=_method: x"),
        ),
        (
            "multipart/form-data; boundary=B",
            part("X-Content-Disposition: form-data; name=_method\r\nContent-Disposition: form-data; name=\"note\""),
        ),
        ("multipart/mixed", "_method=PUT&amount=1000".to_owned()),
        (
            "multipart/related; boundary=B",
            part("Content-ID: _method"),
        ),
    ];
    for (n, (content_type, body)) in bodies.into_iter().enumerate() {
        let answer = h.send(untyped_key(content_type, body)).await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "body {n}: {answer:?}"
        );
        answer.assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    }
    assert_eq!(h.calls(), 0, "an unprotected PUT reached the service");
}

/// From a review of the fingerprint: bodies a backend reads differently
/// that the fingerprint read alike, so the second, a different order, was
/// replayed the first's answer. A JSON body behind a comment under a form
/// label (`curl -d`; Ruby's `JSON.parse` and Gson read past the comment,
/// and their last member wins) sorted as form fields; `qs` (Express's
/// extended parser) splits `a[b=c]=d` at `]=`, as it does not
/// `a[b=c]%3Dd`, which decodes alike.
#[tokio::test]
async fn bodies_a_backend_reads_apart_never_share_a_fingerprint() {
    let h = Harness::new(Policy::default());
    let form = "application/x-www-form-urlencoded";
    for (n, (first, second)) in [
        (
            r#"/*h=*/{/*&x=*/"amount":10,/*&y=*/"amount":1000,/*&z=*/"c":0}"#,
            r#"/*h=*/{/*&y=*/"amount":1000,/*&x=*/"amount":10,/*&z=*/"c":0}"#,
        ),
        ("a[b=c]=d", "a[b=c]%3Dd"),
        ("x=y]=z", "x=y]%3Dz"),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("read-apart-{n}");
        let answer = h.send(typed(&key, form, first)).await;
        assert_eq!(answer.status, StatusCode::CREATED);
        h.send(typed(&key, form, second))
            .await
            .assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    }
    // A plain form reordered is still the same request.
    let first = h.send(typed("plain", form, "amount=10&item=7")).await;
    let again = h.send(typed("plain", form, "item=7&amount=10")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

/// Apache CXF writes a `Content-ID` on every part, a proper `name` beside
/// it, and a new boundary per message: its retry is the same request (the
/// check for parts Rack names by their `Content-ID` refused every such
/// body, so each retry got 422). A disposition of spaces is read in work
/// linear in its length (it was quadratic: a megabyte of such parts cost
/// a worker most of a second).
#[tokio::test]
async fn a_content_id_beside_a_name_is_the_same_request_under_a_new_boundary() {
    let h = Harness::new(Policy::default());
    let body = |boundary: &str| {
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\
             Content-ID: <root.message@cxf.apache.org>\r\n\r\n10\r\n--{boundary}--\r\n"
        )
    };
    let send = |boundary: &str| {
        Request::builder()
            .method(Method::POST)
            .uri("/orders")
            .header("idempotency-key", "cxf")
            .header(
                http::header::CONTENT_TYPE,
                format!("multipart/form-data; boundary=\"{boundary}\""),
            )
            .body(Full::new(Bytes::from(body(boundary))))
            .unwrap()
    };
    let first = h.send(send("uuid:1b2c")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = h.send(send("uuid:9f8e")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(h.calls(), 1);
    // Hundreds of parts whose dispositions are spaces, answered.
    let spaces = " ".repeat(1500);
    let mut wide = String::new();
    for _ in 0..600 {
        wide.push_str(&format!(
            "--B\r\nContent-Disposition: form-data;{spaces}name=\"a\"\r\n\r\n1\r\n"
        ));
    }
    wide.push_str("--B--\r\n");
    let request = Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header("idempotency-key", "wide")
        .header(
            http::header::CONTENT_TYPE,
            "multipart/form-data; boundary=B",
        )
        .body(Full::new(Bytes::from(wide)))
        .unwrap();
    assert_eq!(h.send(request).await.status, StatusCode::CREATED);
}
