//! Breaks of the README's guarantees through the real proxy binary, found
//! by an adversarial review. Each test is the attack; the ones that still
//! break are `#[ignore = "BREAK: …"]` (remove the `ignore` with the fix:
//! the test must then pass).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::post;
use axum::Router;

use common::{temp_dir, Proxy, ProxyArgs};

/// An axum backend whose `POST /orders/cancel` acts on the path alone: its
/// handler takes no body extractor, so it answers before the request body
/// has arrived (as any handler that ignores the body does), and hyper then
/// closes the connection with the body unread. Counts its executions.
async fn early_answering_backend() -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let app = Router::new().route(
        "/orders/cancel",
        post(move || {
            let counter = counter.clone();
            async move {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                (axum::http::StatusCode::CREATED, format!("cancelled {n}"))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, calls)
}

/// Scenario: a covered route whose backend answers before reading the
/// request body (an axum handler without a body extractor, an Express
/// handler that never reads `req`), with a body larger than the socket
/// buffers (here 8 MiB, under a route's `max_body_bytes` of 16 MiB). The
/// backend acts and answers 201, then hyper closes the connection with the
/// body unread (a reset); the proxy's write of the rest of the body fails,
/// it takes that as "the request never reached the upstream", answers 502
/// and releases the key. Impact ("at most one execution", "no lost
/// response"): the caller never sees the 201, and its retry with the same
/// key executes the order again.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "BREAK: an upstream that answers before reading a large body: 502 + key released, the retry executes again"]
async fn an_upstream_answering_before_the_body_is_read_executes_once() {
    let (upstream, calls) = early_answering_backend().await;
    let dir = temp_dir("breaks-early-answer");
    let config = r#"
[[route]]
path = "/orders"
required = true
max_body_bytes = 16777216
"#;
    let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir);
    let body = vec![b'x'; 8 << 20];
    let headers = [
        ("idempotency-key", "cancel-1"),
        ("content-type", "application/octet-stream"),
    ];
    let first = proxy
        .send("POST", "/orders/cancel", &headers, body.clone())
        .await;
    let retry = proxy.send("POST", "/orders/cancel", &headers, body).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the order was cancelled more than once; first: {} {}, retry: {} {}",
        first.status,
        first.text(),
        retry.status,
        retry.text()
    );
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(retry.replayed(), "{} {}", retry.status, retry.text());
}
