//! The guarantee under attack, through the real proxy binary: request
//! spellings and framings that once slipped past the engine (issue
//! "Guarantee holes"), sent as raw HTTP/1.1 so nothing on the client side
//! tidies them up.

mod common;

use common::{temp_dir, Backend, Proxy, ProxyArgs};

const CONFIG: &str = r#"
[[route]]
path = "/api/payments"

[[route]]
path = "/api/**"
methods = ["PUT", "DELETE"]
required = true

[[route]]
path = "/pay"
required = true
"#;

async fn start(name: &str) -> (Backend, Proxy) {
    let backend = Backend::start().await;
    let dir = temp_dir(name);
    let proxy = Proxy::start(ProxyArgs::new(backend.url(), CONFIG, &dir))
        .await
        .owning(dir);
    (backend, proxy)
}

/// Sends `head` (request line and headers, without the blank line) and
/// `body` on a connection of its own; the whole answer as text.
async fn raw(proxy: &Proxy, head: &str, body: &str) -> String {
    let request = format!("{head}\r\nHost: shop.example\r\nConnection: close\r\n\r\n{body}");
    common::send_raw(proxy.addr, &request).await.0
}

fn status(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {answer:?}"))
}

/// `Transfer-Encoding: gzip, chunked` is answered 501 by the proxy itself,
/// not 502 as if the backend had failed, and nothing is reserved: the same
/// key then executes.
#[tokio::test(flavor = "multi_thread")]
async fn a_transfer_coding_other_than_chunked_is_501_and_reserves_nothing() {
    let (backend, proxy) = start("attacks-te").await;
    let answer = raw(
        &proxy,
        "POST /pay HTTP/1.1\r\nIdempotency-Key: k\r\nContent-Type: text/plain\r\nTransfer-Encoding: gzip, chunked",
        "5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(status(&answer), 501, "{answer}");
    assert!(answer.contains("urn:tower-idempotency:transfer-coding-unsupported"));
    assert_eq!(backend.total(), 0);
    let plain = proxy
        .send("POST", "/pay", &[("idempotency-key", "k")], "hello")
        .await;
    assert_eq!(plain.status, 200, "{}", plain.text());
    assert!(!plain.replayed());
    assert_eq!(backend.hits("/pay"), 1);
}

/// Routes are decided on the normalised path and by path and method
/// together: no spelling of a required route, and no method a later route
/// covers, passes unprotected.
#[tokio::test(flavor = "multi_thread")]
async fn spellings_and_route_order_do_not_bypass_a_required_route() {
    let (backend, proxy) = start("attacks-routes").await;
    for head in [
        "PUT /api/payments/7 HTTP/1.1",
        "POST /./pay HTTP/1.1",
        "POST /%70ay HTTP/1.1",
        "POST /pay/ HTTP/1.1",
    ] {
        let answer = raw(&proxy, &format!("{head}\r\nContent-Length: 0"), "").await;
        assert_eq!(status(&answer), 400, "{head}: {answer}");
        assert!(
            answer.contains("urn:tower-idempotency:key-missing"),
            "{head}"
        );
    }
    assert_eq!(
        backend.total(),
        0,
        "an unprotected request reached the backend"
    );
    // Two spellings, one scope: the second is a replay.
    let first = raw(
        &proxy,
        "POST /./pay/ HTTP/1.1\r\nIdempotency-Key: one\r\nContent-Length: 0",
        "",
    )
    .await;
    assert_eq!(status(&first), 200, "{first}");
    let second = raw(
        &proxy,
        "POST /pay HTTP/1.1\r\nIdempotency-Key: one\r\nContent-Length: 0",
        "",
    )
    .await;
    assert!(
        second
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{second}"
    );
    assert_eq!(backend.total(), 1);
}
