//! Faults and load against the real `idempotency-proxy` binary: a backend
//! that resets connections, clients that vanish, Redis and PostgreSQL going
//! down, `kill -9`, several instances, and a sustained run. Each test counts
//! the backend's executions: a duplicate is never executed twice.
//!
//! The sustained run lasts `SOAK_SECS` seconds (default 15); `SOAK_SECS=60
//! cargo test -p idempotency-proxy --test reliability sustained` is the
//! longer soak.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use common::services::{rss_kib, PrivatePostgres, PrivateRedis};
use common::{client, temp_dir, try_request, Backend, Proxy, ProxyArgs, Reply};
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Short leases so takeovers happen within the test; principals by header.
fn config(lease: &str) -> String {
    format!(
        r#"
[proxy]
read_timeout = "10s"
body_timeout = "2s"

[defaults]
lease = "{lease}"
wait_timeout = "10s"
scope_headers = ["authorization"]
"#
    )
}

async fn start_proxy(upstream: String, store: &str, redis: Option<String>, lease: &str) -> Proxy {
    let dir = temp_dir("reliability");
    let mut args = ProxyArgs::new(upstream, &config(lease), &dir);
    args.store = store.into();
    args.redis = redis;
    Proxy::start(args).await.owning(dir)
}

/// `POST path` with `Idempotency-Key: key`.
fn post(
    addr: SocketAddr,
    path: &str,
    key: &str,
    body: impl Into<Bytes>,
) -> hyper::Request<Full<Bytes>> {
    hyper::Request::post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .unwrap()
}

fn problem_type(reply: &Reply) -> String {
    reply.json()["type"].as_str().unwrap_or_default().to_owned()
}

/// Polls `done` until it holds (readiness, not a timing assertion: fails
/// after a minute).
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..3000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never happened: {what}");
}

/// Held by the load-heavy tests, so they do not starve each other of the
/// machine's cores (a store call starved past its timeout is, rightly, a
/// 503).
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A prefix no other run of the tests uses (keys live in shared stores).
fn run_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// The shared PostgreSQL database of the test environment.
fn shared_postgres() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Sends `request` on a fresh connection, in the background.
fn spawn_request(
    request: hyper::Request<Full<Bytes>>,
) -> tokio::task::JoinHandle<Result<Reply, String>> {
    tokio::spawn(async move { try_request(&client(), request).await })
}

/// A hand-written HTTP/1.1 upstream for faults a real server never makes.
/// It reads every request whole, counts it per path, then:
///
/// * `/reset`: resets the connection (TCP RST) while `resets` is above 0
///   (counting it down), else answers 201;
/// * `/halves`: sends the head and half of a 64 KiB body, waits for a
///   permit of `release`, then sends the rest;
/// * `/cut-length`: 201 with `content-length: 1000`, 100 bytes of it, then
///   closes;
/// * `/cut-chunked`: 201, chunked, two chunks, then closes without the
///   last chunk;
/// * `/close-reset`: 201 with neither `Content-Length` nor chunking (the
///   body ends where the connection closes), part of the body, then resets
///   the connection (a cut, unlike a clean close);
/// * `/big`: 200 with a [`BIG`]-byte body, sent as fast as it is taken;
/// * `/slow/…`: 201 `done <n>`, chunked, in three chunks 100 ms and then
///   300 ms apart (relayed chunk by chunk, each flushed: writing to a
///   client that left fails in between, while the exchange goes on);
/// * anything else: 201 `done <n>`, keeping the connection alive.
#[derive(Clone)]
struct RawUpstream {
    addr: SocketAddr,
    hits: Arc<std::sync::Mutex<HashMap<String, usize>>>,
    resets: Arc<AtomicUsize>,
    release: Arc<Semaphore>,
    /// `/big` answers written whole (taken by the proxy).
    big_sent: Arc<AtomicUsize>,
}

impl RawUpstream {
    async fn start() -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = RawUpstream {
            addr: listener.local_addr().unwrap(),
            hits: Arc::default(),
            resets: Arc::default(),
            release: Arc::new(Semaphore::new(0)),
            big_sent: Arc::default(),
        };
        let serving = upstream.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serving.clone().connection(stream));
            }
        });
        upstream
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn hits(&self, path: &str) -> usize {
        self.hits.lock().unwrap().get(path).copied().unwrap_or(0)
    }

    async fn connection(self, mut stream: TcpStream) {
        let mut buffer = Vec::new();
        while let Some(path) = read_request(&mut stream, &mut buffer).await {
            let n = {
                let mut hits = self.hits.lock().unwrap();
                let n = hits.entry(path.clone()).or_default();
                *n += 1;
                *n
            };
            match path.as_str() {
                "/reset" if self.take_reset() => {
                    // A zero linger does not block on drop; it resets.
                    #[allow(deprecated)]
                    stream.set_linger(Some(Duration::ZERO)).unwrap();
                    return; // dropped with linger 0: RST
                }
                "/halves" => {
                    let body = vec![b'h'; 64 * 1024];
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(&body[..body.len() / 2]).await;
                    let _ = stream.flush().await;
                    self.release.acquire().await.unwrap().forget();
                    let _ = stream.write_all(&body[body.len() / 2..]).await;
                    return;
                }
                "/cut-length" => {
                    let head = "HTTP/1.1 201 Created\r\ncontent-length: 1000\r\n\r\n";
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(&[b'c'; 100]).await;
                    let _ = stream.flush().await;
                    return;
                }
                "/cut-chunked" => {
                    let head = "HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n";
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(b"5\r\nhello\r\n").await;
                    let _ = stream.flush().await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = stream.write_all(b"6\r\n world\r\n").await;
                    let _ = stream.flush().await;
                    return;
                }
                "/close-reset" => {
                    let head = "HTTP/1.1 201 Created\r\n\r\npart of";
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.flush().await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    #[allow(deprecated)]
                    stream.set_linger(Some(Duration::ZERO)).unwrap();
                    return; // dropped with linger 0: RST
                }
                "/big" => {
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\n\r\n");
                    let _ = stream.write_all(head.as_bytes()).await;
                    if stream.write_all(&vec![b'b'; BIG]).await.is_ok() {
                        self.big_sent.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = stream.flush().await;
                }
                slow if slow.starts_with("/slow/") => {
                    let last = format!(" {n}");
                    let head = "HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n\
                                2\r\ndo\r\n";
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.flush().await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let _ = stream.write_all(b"2\r\nne\r\n").await;
                    let _ = stream.flush().await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let end = format!("{:x}\r\n{last}\r\n0\r\n\r\n", last.len());
                    if stream.write_all(end.as_bytes()).await.is_err() {
                        return;
                    }
                }
                _ => {
                    let body = format!("done {n}");
                    let response = format!(
                        "HTTP/1.1 201 Created\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if stream.write_all(response.as_bytes()).await.is_err() {
                        return;
                    }
                }
            }
        }
    }

    fn take_reset(&self) -> bool {
        self.resets
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Reads one request (head and `Content-Length` body); its path, or `None`
/// at the end of the connection.
async fn read_request(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<String> {
    let head_end = loop {
        if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0; 4096];
        let n = stream.read(&mut chunk).await.ok().filter(|&n| n > 0)?;
        buffer.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buffer.len() < head_end + length {
        let mut chunk = [0; 4096];
        let n = stream.read(&mut chunk).await.ok().filter(|&n| n > 0)?;
        buffer.extend_from_slice(&chunk[..n]);
    }
    buffer.drain(..head_end + length);
    let path = head.split_whitespace().nth(1)?.to_owned();
    Some(path)
}

/// The upstream takes the whole request and resets the connection without
/// answering: it may have acted (committed, then crashed), so the 502 is the
/// key's outcome ("executed, outcome unknown") and no retry with that key
/// reaches the upstream again. The proxy itself never resends a request the
/// upstream may have received.
#[tokio::test(flavor = "multi_thread")]
async fn upstream_reset_after_the_request_is_502_and_never_runs_twice() {
    let upstream = RawUpstream::start().await;
    let proxy = start_proxy(upstream.url(), "memory", None, "30s").await;
    let client = client();
    // A first exchange leaves a pooled keep-alive connection behind, so the
    // reset below hits a reused connection.
    let warm = try_request(&client, post(proxy.addr, "/warm", "w", "{}")).await;
    assert_eq!(warm.unwrap().status, 201);
    upstream.resets.store(2, Ordering::SeqCst);
    let reply = try_request(&client, post(proxy.addr, "/reset", "r", "{}"))
        .await
        .unwrap();
    assert_eq!(
        (reply.status, reply.replayed()),
        (502, false),
        "{}",
        reply.text()
    );
    assert_eq!(
        problem_type(&reply),
        "urn:tower-idempotency:upstream-unavailable"
    );
    assert_eq!(upstream.hits("/reset"), 1);
    for _ in 0..3 {
        let retry = try_request(&client, post(proxy.addr, "/reset", "r", "{}"))
            .await
            .unwrap();
        assert_eq!(
            (retry.status, retry.replayed()),
            (502, true),
            "{}",
            retry.text()
        );
        assert_eq!(retry.body, reply.body);
    }
    assert_eq!(upstream.hits("/reset"), 1, "no retry reaches the upstream");
    // A new key executes (the second reset is still armed).
    let reply = try_request(&client, post(proxy.addr, "/reset", "r2", "{}"))
        .await
        .unwrap();
    assert_eq!(reply.status, 502);
    let reply = try_request(&client, post(proxy.addr, "/reset", "r3", "{}"))
        .await
        .unwrap();
    assert_eq!((reply.status, reply.replayed()), (201, false));
    assert_eq!(upstream.hits("/reset"), 3);
}

/// The upstream is down: nothing reached it, so the key is released and
/// the retry executes once it is back.
#[tokio::test(flavor = "multi_thread")]
async fn upstream_unreachable_releases_the_key() {
    let spare = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = spare.local_addr().unwrap();
    drop(spare);
    let proxy = start_proxy(format!("http://{addr}"), "memory", None, "30s").await;
    let client = client();
    let reply = try_request(&client, post(proxy.addr, "/orders", "k", "{}"))
        .await
        .unwrap();
    assert_eq!(reply.status, 502, "{}", reply.text());
    let backend = Backend::start_on(addr).await;
    let reply = try_request(&client, post(proxy.addr, "/orders", "k", "{}"))
        .await
        .unwrap();
    assert_eq!(
        (reply.status, reply.replayed()),
        (200, false),
        "{}",
        reply.text()
    );
    assert_eq!(backend.hits("/orders"), 1);
}

/// The client sends half its body and goes away: nothing is reserved, the
/// upstream is not called, the key is free at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_mid_request_leaves_nothing_behind() {
    let backend = Backend::start().await;
    let proxy = start_proxy(backend.url(), "memory", None, "30s").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    // The retry's host (the port is not part of the scope).
    stream
        .write_all(
            b"POST /api/cut HTTP/1.1\r\nhost: 127.0.0.1\r\nidempotency-key: cut-1\r\n\
              content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"half\":",
        )
        .await
        .unwrap();
    drop(stream);
    let reply = try_request(&client(), post(proxy.addr, "/api/cut", "cut-1", "{}"))
        .await
        .unwrap();
    assert_eq!((reply.status, reply.replayed()), (201, false));
    assert_eq!(backend.hits("/api/cut"), 1);
}

/// A client trickles its body a byte at a time: after `body_timeout` it
/// gets 408, nothing was reserved, and the key is free at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_trickle_gets_408_and_reserves_nothing() {
    let backend = Backend::start().await;
    let proxy = start_proxy(backend.url(), "memory", None, "30s").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"POST /api/trickle HTTP/1.1\r\nhost: 127.0.0.1\r\nidempotency-key: trickle-1\r\n\
              content-type: application/json\r\ncontent-length: 100000\r\n\r\n",
        )
        .await
        .unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let trickle = tokio::spawn(async move {
        while writer.write_all(b" ").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), reader.read_to_end(&mut answer))
        .await
        .expect("the proxy cut the trickle off")
        .ok();
    trickle.abort();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("urn:tower-idempotency:body-unreadable"),
        "{answer}"
    );
    assert_eq!(backend.hits("/api/trickle"), 0);
    let reply = try_request(
        &client(),
        post(proxy.addr, "/api/trickle", "trickle-1", "{}"),
    )
    .await
    .unwrap();
    assert_eq!((reply.status, reply.replayed()), (201, false));
}

/// The client goes away in the middle of the response body: the exchange
/// goes on, the response is stored, and the retry is a replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_mid_response_still_gets_it_recorded() {
    let upstream = RawUpstream::start().await;
    let proxy = start_proxy(upstream.url(), "memory", None, "30s").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    // The same Host as the retry below: the host is part of the scope.
    let request = format!(
        "POST /halves HTTP/1.1\r\nhost: {}\r\nidempotency-key: halves-1\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}",
        proxy.addr
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    // Read the head and some of the body, then leave.
    let mut seen = Vec::new();
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.len() < 1024 {
        let mut chunk = [0; 4096];
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the proxy closed early");
        seen.extend_from_slice(&chunk[..n]);
    }
    assert!(seen.starts_with(b"HTTP/1.1 200"));
    drop(stream);
    upstream.release.add_permits(1);
    let reply = try_request(&client(), post(proxy.addr, "/halves", "halves-1", "{}"))
        .await
        .unwrap();
    assert_eq!((reply.status, reply.replayed()), (200, true));
    assert_eq!(reply.body.len(), 64 * 1024);
    assert_eq!(upstream.hits("/halves"), 1);
}

/// The upstream answers its head, then breaks off in the middle of the
/// body (a `Content-Length` body closed early; a chunked body that dies
/// before its last chunk). It has acted: the first caller sees a cut
/// response, and every retry — many at once — gets 409
/// `response-incomplete`, never a second execution.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_breaks_off_mid_body_is_not_executed_again() {
    let upstream = RawUpstream::start().await;
    let proxy = start_proxy(upstream.url(), "memory", None, "30s").await;
    for path in ["/cut-length", "/cut-chunked"] {
        let first = try_request(&client(), post(proxy.addr, path, path, "{}")).await;
        let error = first.expect_err("the cut response is not presented as complete");
        assert!(error.contains("body cut off"), "{path}: {error}");
        let retries = (0..10).map(|_| spawn_request(post(proxy.addr, path, path, "{}")));
        for retry in futures_join(retries).await {
            let retry = retry.unwrap();
            assert_eq!(retry.status, 409, "{path}: {}", retry.text());
            assert_eq!(
                problem_type(&retry),
                "urn:tower-idempotency:response-incomplete"
            );
        }
        assert_eq!(upstream.hits(path), 1, "{path}: executed once");
    }
}

/// A body framed by the connection's close (no `Content-Length`, not
/// chunked) whose connection is reset midway: a cut, not an end. It is
/// never stored and replayed as complete (with an exact `Content-Length`):
/// retries get 409 `response-incomplete`, and the upstream runs once.
#[tokio::test(flavor = "multi_thread")]
async fn a_close_framed_body_cut_by_a_reset_is_never_replayed_as_complete() {
    let upstream = RawUpstream::start().await;
    let proxy = start_proxy(upstream.url(), "memory", None, "30s").await;
    let first = try_request(&client(), post(proxy.addr, "/close-reset", "cr", "{}")).await;
    let error = first.expect_err("the cut response is not presented as complete");
    assert!(error.contains("body cut off"), "{error}");
    let retry = try_request(&client(), post(proxy.addr, "/close-reset", "cr", "{}"))
        .await
        .unwrap();
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(
        problem_type(&retry),
        "urn:tower-idempotency:response-incomplete"
    );
    assert_eq!(upstream.hits("/close-reset"), 1);
}

/// The body `/big` answers: more than the socket buffers and the relay's
/// queue hold between the upstream and a client that does not read.
const BIG: usize = 12 << 20;

/// A client sends a covered request, reads nothing of the answer and stays
/// connected (a phone that lost its network without a FIN). Recording
/// follows the upstream, not the client: the response is stored, and a
/// retry from another client gets the replay, with the upstream run once.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_does_not_hold_the_key() {
    let upstream = RawUpstream::start().await;
    let dir = temp_dir("stalled");
    let config = format!("{}max_response_bytes = {}\n", config("30s"), 16 << 20);
    let proxy = Proxy::start(ProxyArgs::new(upstream.url(), &config, &dir))
        .await
        .owning(dir);
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(proxy.addr).await.unwrap();
    // The same Host as the retries below: the host is part of the scope.
    let request = format!(
        "POST /big HTTP/1.1\r\nhost: {}\r\nidempotency-key: big-1\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}",
        proxy.addr
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    eventually("the upstream got the request", || {
        upstream.hits("/big") == 1
    })
    .await;
    // Retries meanwhile wait (409 in-flight) until the answer is stored.
    let replay = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let reply = try_request(&client(), post(proxy.addr, "/big", "big-1", "{}"))
                .await
                .unwrap();
            if reply.status != 409 {
                return reply;
            }
            assert_eq!(problem_type(&reply), "urn:tower-idempotency:in-flight");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the response was stored while its first client did not read");
    assert_eq!((replay.status, replay.replayed()), (200, true));
    assert_eq!(replay.body.len(), BIG);
    assert_eq!(upstream.hits("/big"), 1);
    drop(stalled);
}

/// A client that stops reading an answer over the storage cap (so relayed
/// at the client's pace, not recorded) and stays connected: the proxy
/// waited for it without end, holding the upstream connection (and, on a
/// synchronous backend, its worker). Now a write that waits longer than
/// `body_timeout` cuts the client, and the upstream's answer is taken
/// whole; the marker is stored, so the retry learns it ran.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_never_holds_the_upstream() {
    let upstream = RawUpstream::start().await;
    let dir = temp_dir("stalled-over-cap");
    let config = format!("{}max_response_bytes = {}\n", config("30s"), 1 << 20);
    let proxy = Proxy::start(ProxyArgs::new(upstream.url(), &config, &dir))
        .await
        .owning(dir);
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(proxy.addr).await.unwrap();
    let request = format!(
        "POST /big HTTP/1.1\r\nhost: {}\r\nidempotency-key: big-over-cap\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}",
        proxy.addr
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    eventually("the upstream's answer was taken whole", || {
        upstream.big_sent.load(Ordering::SeqCst) == 1
    })
    .await;
    let retry = try_request(&client(), post(proxy.addr, "/big", "big-over-cap", "{}"))
        .await
        .unwrap();
    assert_eq!(retry.status, 409);
    assert_eq!(
        problem_type(&retry),
        "urn:tower-idempotency:response-not-stored"
    );
    assert_eq!(upstream.hits("/big"), 1);
    drop(stalled);
}

/// Sends one covered `POST` on a connection of its own and closes it
/// right after the request is written, reading nothing.
async fn send_and_leave(addr: SocketAddr, path: &str, key: &str) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    // The same Host as `post`'s requests: the host is part of the scope.
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    drop(stream);
}

/// 50 clients send the same new key at once and half of them go away right
/// after sending, while the upstream is still working: whoever executed it
/// (a client that left, or one that stayed), the upstream runs once, every
/// client that stayed gets its answer, and every later retry replays it.
/// The second key's executing client is one that leaves.
#[tokio::test(flavor = "multi_thread")]
async fn half_of_fifty_clients_leaving_mid_exchange_never_lose_or_repeat_it() {
    let _heavy = HEAVY.lock().await;
    let upstream = RawUpstream::start().await;
    let proxy = start_proxy(upstream.url(), "memory", None, "30s").await;
    let run = run_id();
    for (round, leaver_first) in [(0, false), (1, true)] {
        let path = format!("/slow/{run}-{round}");
        let key = format!("leave-{run}-{round}");
        if leaver_first {
            send_and_leave(proxy.addr, &path, &key).await;
            eventually("the upstream got the first request", || {
                upstream.hits(&path) == 1
            })
            .await;
        }
        let mut stayed = Vec::new();
        let mut left = Vec::new();
        for i in 0..50 - usize::from(leaver_first) {
            let (addr, path, key) = (proxy.addr, path.clone(), key.clone());
            if i % 2 == 0 {
                left.push(tokio::spawn(async move {
                    send_and_leave(addr, &path, &key).await
                }));
            } else {
                stayed.push(spawn_request(post(addr, &path, &key, "{}")));
            }
        }
        for handle in left {
            handle.await.unwrap();
        }
        for reply in futures_join(stayed.into_iter()).await {
            let reply = reply.unwrap();
            assert_eq!(
                (reply.status, reply.text().as_str()),
                (201, "done 1"),
                "{path}"
            );
        }
        for _ in 0..5 {
            let retry = try_request(&client(), post(proxy.addr, &path, &key, "{}"))
                .await
                .unwrap();
            assert_eq!(
                (retry.status, retry.replayed(), retry.text().as_str()),
                (201, true, "done 1"),
                "{path}"
            );
        }
        assert_eq!(upstream.hits(&path), 1, "{path}: executed once");
    }
}

/// Sends `rounds` waves of requests over `keys` keys (each wave hits every
/// key `copies` times at once) and returns every status seen, calling
/// `between(wave)` before each wave.
async fn waves(
    proxy: &Proxy,
    prefix: &str,
    keys: usize,
    copies: usize,
    rounds: usize,
    mut between: impl FnMut(usize),
) -> Vec<u16> {
    let mut statuses = Vec::new();
    for round in 0..rounds {
        between(round);
        let requests = (0..keys * copies).map(|i| {
            let key = format!("{prefix}-{}", i % keys);
            let request = post(proxy.addr, &format!("/api/{key}"), &key, "{}");
            tokio::spawn(async move { try_request(&client(), request).await })
        });
        for reply in futures_join(requests).await {
            statuses.push(reply.map_or(0, |r| r.status));
        }
    }
    statuses
}

async fn futures_join<T: Send + 'static>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    let mut out = Vec::new();
    for handle in handles.collect::<Vec<_>>() {
        out.push(handle.await.unwrap());
    }
    out
}

/// Redis is killed (every cached entry lost) and restarted while duplicates
/// keep coming: every answer is still right, nothing runs twice.
#[tokio::test(flavor = "multi_thread")]
async fn redis_killed_and_restarted_during_load_changes_nothing_but_latency() {
    let mut redis = PrivateRedis::start();
    let backend = Backend::start().await;
    let proxy = start_proxy(backend.url(), "memory", Some(redis.url()), "30s").await;
    let keys = 20;
    let mut statuses = waves(&proxy, "redis", keys, 3, 1, |_| {}).await;
    // The cache connects in the background: replay until it holds entries.
    for round in 0.. {
        statuses.extend(waves(&proxy, "redis", keys, 1, 1, |_| {}).await);
        if redis.key_count() > 0 {
            break;
        }
        assert!(round < 600, "completed records never reached Redis");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    redis.kill();
    statuses.extend(waves(&proxy, "redis", keys, 3, 2, |_| {}).await);
    redis.start_again();
    statuses.extend(waves(&proxy, "redis", keys, 3, 2, |_| {}).await);
    assert!(statuses.iter().all(|&s| s == 201), "{statuses:?}");
    for i in 0..keys {
        assert_eq!(backend.hits(&format!("/api/redis-{i}")), 1);
    }
}

/// `kill -9` with requests in flight, a restart on the same SQLite file and
/// three concurrent retries per key: after its lease, each key executes
/// exactly once more (never twice), and all its retries get that answer.
#[tokio::test(flavor = "multi_thread")]
async fn kill_9_in_flight_then_each_key_executes_exactly_once_more() {
    let backend = Backend::start().await;
    let dir = temp_dir("kill9");
    let start = || {
        let mut args = ProxyArgs::new(backend.url(), &config("300ms"), &dir);
        args.store = "sqlite://idempotency.db".into();
        Proxy::start(args)
    };
    let mut first = start().await;
    let keys: Vec<String> = (0..8).map(|i| format!("kill9-{i}")).collect();
    let orphans: Vec<_> = keys
        .iter()
        .map(|key| spawn_request(post(first.addr, "/slow?ms=gate", key, "{}")))
        .collect();
    eventually("every request reached the backend", || {
        backend.hits("/slow") == keys.len()
    })
    .await;
    first.kill();
    for orphan in orphans {
        assert!(orphan.await.unwrap().is_err(), "the killed proxy answered");
    }

    let second = start().await;
    let retries: Vec<_> = keys
        .iter()
        .flat_map(|key| std::iter::repeat_n(key, 3))
        .map(|key| {
            (
                key.clone(),
                spawn_request(post(second.addr, "/slow?ms=gate", key, "{}")),
            )
        })
        .collect();
    // Keep opening the gate until every retry is answered.
    let opener = {
        let backend = backend.clone();
        tokio::spawn(async move {
            loop {
                backend.open_gate();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut answers: HashMap<String, Vec<Bytes>> = HashMap::new();
    for (key, retry) in retries {
        let reply = retry.await.unwrap().expect("the retry is answered");
        assert_eq!(reply.status, 201, "{}", reply.text());
        answers.entry(key).or_default().push(reply.body);
    }
    opener.abort();
    assert_eq!(
        backend.hits("/slow"),
        2 * keys.len(),
        "exactly once more per key"
    );
    let mut distinct: Vec<&Bytes> = answers.values().map(|bodies| &bodies[0]).collect();
    for bodies in answers.values() {
        assert!(bodies.iter().all(|body| *body == bodies[0]), "{bodies:?}");
    }
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), keys.len(), "one execution per key");
}

/// Counts answers by status.
#[derive(Default)]
struct Tally(std::sync::Mutex<HashMap<u16, usize>>);

impl Tally {
    fn add(&self, status: u16) {
        *self.0.lock().unwrap().entry(status).or_default() += 1;
    }

    fn get(&self, status: u16) -> usize {
        self.0.lock().unwrap().get(&status).copied().unwrap_or(0)
    }

    fn statuses(&self) -> Vec<u16> {
        let mut statuses: Vec<u16> = self.0.lock().unwrap().keys().copied().collect();
        statuses.sort();
        statuses
    }
}

/// PostgreSQL stops (immediate shutdown, connections cut) under a load of
/// duplicates, then starts again: 503 with `Retry-After` while it is down,
/// recovery without restarting the proxy, and no key executes twice.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_stopped_under_load_is_503_then_recovers_without_duplicates() {
    let _heavy = HEAVY.lock().await;
    let pg = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap();
    let backend = Backend::start().await;
    // The lease outlasts the outage: a response finished while PostgreSQL
    // is down is stored once it is back, never executed again.
    let proxy = start_proxy(backend.url(), &pg.url(), None, "20s").await;
    let keys = 24;
    let path = |i: usize| format!("/api/pg-{i}");
    let up = Arc::new(Tally::default());
    let down = Arc::new(Tally::default());
    let back = Arc::new(Tally::default());
    let phase = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (up, down, back) = (up.clone(), down.clone(), back.clone());
            let (phase, stop, addr) = (phase.clone(), stop.clone(), proxy.addr);
            tokio::spawn(async move {
                let client = client();
                let mut i = w;
                while stop.load(Ordering::SeqCst) == 0 {
                    i = (i + 7) % keys;
                    let key = format!("pg-{i}");
                    let request = post(addr, &path(i), &key, "{}");
                    let seen_in = phase.load(Ordering::SeqCst);
                    let reply = try_request(&client, request).await.expect("an answer");
                    let tally = match (seen_in, phase.load(Ordering::SeqCst)) {
                        (0, 0) => &up,
                        (2, 2) => &back,
                        _ => &down,
                    };
                    if reply.status == 503 {
                        assert!(reply.header("retry-after").is_some());
                        assert_eq!(
                            problem_type(&reply),
                            "urn:tower-idempotency:store-unavailable"
                        );
                    }
                    tally.add(reply.status);
                }
            })
        })
        .collect();
    eventually("load while PostgreSQL is up", || up.get(201) >= 50).await;
    phase.store(1, Ordering::SeqCst);
    let pg = tokio::task::spawn_blocking(move || {
        pg.stop();
        pg
    })
    .await
    .unwrap();
    eventually("503s while PostgreSQL is down", || down.get(503) >= 20).await;
    let pg = tokio::task::spawn_blocking(move || {
        pg.start_again();
        pg
    })
    .await
    .unwrap();
    phase.store(2, Ordering::SeqCst);
    eventually("recovery without a restart", || back.get(201) >= 50).await;
    stop.store(1, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }
    eprintln!(
        "postgres outage: up {:?}, down {:?}, back {:?}",
        up.0.lock().unwrap(),
        down.0.lock().unwrap(),
        back.0.lock().unwrap()
    );
    assert_eq!(up.statuses(), vec![201], "before the outage");
    assert!(
        down.statuses().iter().all(|s| [201, 409, 503].contains(s)),
        "{:?}",
        down.statuses()
    );
    assert!(
        back.statuses().iter().all(|s| [201, 409].contains(s)),
        "{:?}",
        back.statuses()
    );
    for i in 0..keys {
        let reply = try_request(
            &client(),
            post(proxy.addr, &path(i), &format!("pg-{i}"), "{}"),
        )
        .await
        .unwrap();
        assert_eq!(reply.status, 201, "{}", reply.text());
        assert_eq!(backend.hits(&path(i)), 1, "key {i} ran twice");
    }
    drop(pg);
}

/// SIGTERM right after the client got its 201, while PostgreSQL is down so
/// the answer is still being stored in the background: the proxy waits for
/// it before exiting, and the proxy started next on the same database
/// replays it instead of executing the retry again.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_waits_for_an_answer_still_being_stored() {
    let _heavy = HEAVY.lock().await;
    let pg = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap();
    let backend = Backend::start().await;
    let mut proxy = start_proxy(backend.url(), &pg.url(), None, "10s").await;
    let client = client();
    let first = try_request(&client, post(proxy.addr, "/slow?ms=gate", "drain-1", "{}"));
    let mut first = std::pin::pin!(first);
    tokio::select! {
        biased;
        _ = backend.held() => {}
        reply = &mut first => panic!("answered before the backend held it: {reply:?}"),
    }
    // The key is reserved; PostgreSQL goes down before the answer is stored.
    let pg = tokio::task::spawn_blocking(move || {
        pg.stop();
        pg
    })
    .await
    .unwrap();
    backend.open_gate();
    let reply = first.await.expect("an answer");
    assert_eq!(
        (reply.status, reply.replayed()),
        (201, false),
        "{}",
        reply.text()
    );
    proxy.terminate();
    let pg = tokio::task::spawn_blocking(move || {
        pg.start_again();
        pg
    })
    .await
    .unwrap();
    assert!(proxy.wait_exit().await, "a clean exit");
    let proxy = start_proxy(backend.url(), &pg.url(), None, "10s").await;
    let retry = try_request(&client, post(proxy.addr, "/slow?ms=gate", "drain-1", "{}"))
        .await
        .expect("an answer");
    assert_eq!(backend.hits("/slow"), 1, "the retry executed again");
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, true),
        "{}",
        retry.text()
    );
    assert_eq!(retry.body, reply.body);
    drop(pg);
}

/// The same, but PostgreSQL stays down past `shutdown_timeout`: the proxy
/// exits at that bound and logs the answer it had to abandon (by its key's
/// hash, never the key).
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_logs_an_answer_it_could_not_store_in_time() {
    let _heavy = HEAVY.lock().await;
    let pg = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap();
    let backend = Backend::start().await;
    let dir = temp_dir("abandon");
    let config = config("30s").replacen("[proxy]\n", "[proxy]\nshutdown_timeout = \"2s\"\n", 1);
    assert!(config.contains("shutdown_timeout"));
    let mut args = ProxyArgs::new(backend.url(), &config, &dir);
    args.store = pg.url();
    let log = dir.join("proxy.log");
    let mut proxy = Proxy::start_logged(args, &log, "info").await;
    let client = client();
    let first = try_request(&client, post(proxy.addr, "/slow?ms=gate", "drain-2", "{}"));
    let mut first = std::pin::pin!(first);
    tokio::select! {
        biased;
        _ = backend.held() => {}
        reply = &mut first => panic!("answered before the backend held it: {reply:?}"),
    }
    let pg = tokio::task::spawn_blocking(move || {
        pg.stop();
        pg
    })
    .await
    .unwrap();
    backend.open_gate();
    let reply = first.await.expect("an answer");
    assert_eq!(reply.status, 201, "{}", reply.text());
    proxy.terminate();
    assert!(
        !proxy.wait_exit().await,
        "work was abandoned: the exit status says so"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let abandoned: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("abandoned background work"))
        .collect();
    assert_eq!(abandoned.len(), 1, "{text}");
    assert!(abandoned[0].contains("key="), "{}", abandoned[0]);
    assert!(!text.contains("drain-2"), "the raw key is logged");
    drop(pg);
}

/// SIGTERM while an execution is still running upstream past
/// `shutdown_timeout`: the proxy exits with status 1 and logs the
/// execution it abandons by its key's hash (docs/proxy.md), so an
/// operator can find the key left in flight; only a count was logged.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_logs_each_execution_it_abandons_by_its_hash() {
    let backend = Backend::start().await;
    let dir = temp_dir("abandon-running");
    let config = config("30s").replacen("[proxy]\n", "[proxy]\nshutdown_timeout = \"1s\"\n", 1);
    let log = dir.join("proxy.log");
    let args = ProxyArgs::new(backend.url(), &config, &dir);
    let mut proxy = Proxy::start_logged(args, &log, "info").await;
    let client = client();
    let running = try_request(
        &client,
        post(proxy.addr, "/slow?ms=gate", "drain-running-7", "{}"),
    );
    let mut running = std::pin::pin!(running);
    tokio::select! {
        biased;
        _ = backend.held() => {}
        reply = &mut running => panic!("answered before the backend held it: {reply:?}"),
    }
    proxy.terminate();
    assert!(
        !proxy.wait_exit().await,
        "an execution was abandoned: the exit status says so"
    );
    backend.open_gate();
    let text = std::fs::read_to_string(&log).unwrap();
    let abandoned: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("abandoned an execution still running"))
        .collect();
    assert_eq!(abandoned.len(), 1, "{text}");
    assert!(abandoned[0].contains("key="), "{}", abandoned[0]);
    assert!(!text.contains("drain-running-7"), "the raw key is logged");
}

/// SIGTERM while only a request that holds no key is running (a slow
/// uncovered `GET`, as a WebSocket or an SSE stream would be) past
/// `shutdown_timeout`: it is cut and logged, and the exit status is 0.
/// It was 1, "work abandoned", on every deploy with such a request open,
/// which made the status useless as the alarm for abandoned keyed work.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_with_only_keyless_requests_cut_exits_cleanly() {
    let backend = Backend::start().await;
    let dir = temp_dir("abandon-keyless");
    let config = config("30s").replacen("[proxy]\n", "[proxy]\nshutdown_timeout = \"1s\"\n", 1);
    let log = dir.join("proxy.log");
    let args = ProxyArgs::new(backend.url(), &config, &dir);
    let mut proxy = Proxy::start_logged(args, &log, "info").await;
    let client = client();
    let get = hyper::Request::get(format!("http://{}/slow?ms=gate", proxy.addr))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let running = try_request(&client, get);
    let mut running = std::pin::pin!(running);
    tokio::select! {
        biased;
        _ = backend.held() => {}
        reply = &mut running => panic!("answered before the backend held it: {reply:?}"),
    }
    proxy.terminate();
    assert!(
        proxy.wait_exit().await,
        "no key's work was abandoned: status 0"
    );
    backend.open_gate();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("the requests cut held no key in flight"),
        "{text}"
    );
}

/// Attack: SIGTERM while an execution runs upstream past
/// `shutdown_timeout` (30 s by default, against a 5 min
/// `execution_timeout`: any request longer than the drain). The proxy
/// exited with the key in flight under a lease nobody renewed, and once
/// the lease ran out a retry on the restarted proxy executed the request
/// again, although the upstream had it and may have acted. Now the drain
/// stores "executed, outcome unknown" (504) for it as its owner: the retry
/// replays that, and the upstream sees the request once. The timeout is
/// just under two seconds: Pingora's own grace period, in whole seconds,
/// once ended the process (status 0, nothing stored) before the drain's
/// thread, when it was the timeout's seconds plus one.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_past_shutdown_timeout_leaves_no_key_to_run_again() {
    let backend = Backend::start().await;
    let dir = temp_dir("abandon-marked");
    let config = config("1s").replacen("[proxy]\n", "[proxy]\nshutdown_timeout = \"1999ms\"\n", 1);
    let start = |log: Option<&std::path::Path>| {
        let mut args = ProxyArgs::new(backend.url(), &config, &dir);
        args.store = "sqlite://idempotency.db".into();
        let log = log.map(std::path::Path::to_path_buf);
        async move {
            match log {
                Some(log) => Proxy::start_logged(args, &log, "info").await,
                None => Proxy::start(args).await,
            }
        }
    };
    let log = dir.join("first.log");
    let mut first = start(Some(&log)).await;
    let client = client();
    let running = try_request(
        &client,
        post(first.addr, "/slow?ms=gate", "abandoned-then-retried", "{}"),
    );
    let mut running = std::pin::pin!(running);
    tokio::select! {
        biased;
        _ = backend.held() => {}
        reply = &mut running => panic!("answered before the backend held it: {reply:?}"),
    }
    first.terminate();
    assert!(
        !first.wait_exit().await,
        "work was abandoned: exit status 1"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("stored \"outcome unknown\""), "{text}");
    backend.open_gate();
    // Past the lease the first proxy no longer renews.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = start(None).await;
    let retry = try_request(
        &client,
        post(second.addr, "/slow?ms=gate", "abandoned-then-retried", "{}"),
    )
    .await
    .expect("the retry is answered");
    assert_eq!(retry.status, 504, "{}", retry.text());
    assert_eq!(
        retry
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "{retry:?}"
    );
    assert_eq!(backend.hits("/slow"), 1, "the retry ran the request again");
}

/// Attack (from a review of the shutdown): SIGINT (Ctrl-C, or an image
/// whose stop signal it is) while a covered request is at the upstream.
/// The proxy exited at once, its key in flight and unmarked, and once the
/// lease ran out the retry on the restarted proxy ran the request again.
/// Now SIGINT still exits at once (130), after the drain's marking: the
/// retry replays "executed, outcome unknown" (504).
#[tokio::test(flavor = "multi_thread")]
async fn sigint_with_a_request_at_the_upstream_leaves_no_key_to_run_again() {
    let backend = Backend::start().await;
    let dir = temp_dir("sigint-marked");
    let config = config("1s");
    let start = || {
        let mut args = ProxyArgs::new(backend.url(), &config, &dir);
        args.store = "sqlite://idempotency.db".into();
        Proxy::start(args)
    };
    let mut first = start().await;
    let client = client();
    let running = try_request(
        &client,
        post(
            first.addr,
            "/slow?ms=gate",
            "interrupted-then-retried",
            "{}",
        ),
    );
    let mut running = std::pin::pin!(running);
    tokio::select! {
        biased;
        _ = backend.held() => {}
        reply = &mut running => panic!("answered before the backend held it: {reply:?}"),
    }
    let status = std::process::Command::new("kill")
        .args(["-INT", &first.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(first.exit_code().await, Some(130));
    backend.open_gate();
    // Past the lease the first proxy no longer renews.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = start().await;
    let retry = try_request(
        &client,
        post(
            second.addr,
            "/slow?ms=gate",
            "interrupted-then-retried",
            "{}",
        ),
    )
    .await
    .expect("the retry is answered");
    assert_eq!(retry.status, 504, "{}", retry.text());
    assert_eq!(backend.hits("/slow"), 1, "the retry ran the request again");
}

/// Attack (from a review of the shutdown): SIGINT a moment after the
/// upstream answered, while the answer's first attempt at the store waits
/// (SQLite's write lock held elsewhere for a moment). The drain marked
/// only executions still running and answers whose first attempt had
/// failed: this one was neither, the process exited with the attempt cut,
/// and once the lease ran out the retry on the restarted proxy ran the
/// request again. An answer being stored now gets half a second to land.
#[tokio::test(flavor = "multi_thread")]
async fn sigint_while_an_answer_is_first_stored_leaves_no_key_to_run_again() {
    use sqlx::Connection;
    let backend = Backend::start().await;
    let dir = temp_dir("sigint-storing");
    let config = config("1s");
    let start = || {
        let mut args = ProxyArgs::new(backend.url(), &config, &dir);
        args.store = "sqlite://idempotency.db".into();
        Proxy::start(args)
    };
    let first = start().await;
    let client = client();
    let key = "interrupted-while-stored";
    let request = post(first.addr, "/slow?ms=gate", key, "{}");
    let running = tokio::spawn({
        let client = client.clone();
        async move { try_request(&client, request).await }
    });
    backend.held().await;
    // Another process takes the database's write lock: the answer's first
    // attempt waits for it (within the store's busy timeout).
    let file = dir.join("idempotency.db");
    let mut lock = sqlx::SqliteConnection::connect(&format!("sqlite://{}", file.display()))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut lock)
        .await
        .unwrap();
    backend.open_gate();
    // The upstream has answered and the proxy is storing it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = std::process::Command::new("kill")
        .args(["-INT", &first.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    tokio::time::sleep(Duration::from_millis(150)).await;
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();
    drop(lock);
    let mut first = first;
    assert_eq!(first.exit_code().await, Some(130));
    let _ = running.await;
    // Past the lease the first proxy no longer renews.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = start().await;
    let retry = try_request(&client, post(second.addr, "/slow?ms=gate", key, "{}"))
        .await
        .expect("the retry is answered");
    assert_eq!(backend.hits("/slow"), 1, "the retry ran the request again");
    // SQLite's one writer stores the answer before any marker: it replays.
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, true),
        "{}",
        retry.text()
    );
}

/// Attack (from an audit of the shutdown guarantee): SIGTERM while the
/// upstream is still sending a covered answer's body (its head and the
/// first KiB of 100 KB out, then a KiB every 100 ms), past
/// `shutdown_timeout`. The upstream has acted. The first client never gets
/// a body that looks whole, and the retry on the restarted proxy is
/// answered from the key (the drain's "outcome unknown", or "response
/// incomplete"), replayed, without the upstream running again.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_mid_body_past_shutdown_timeout_never_runs_the_request_again() {
    const LENGTH: usize = 100_000;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut chunk = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&chunk[..n]),
                    }
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let head = format!(
                    "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\n\
                     Content-Length: {LENGTH}\r\n\r\n"
                );
                if conn.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                for _ in 0..LENGTH / 1000 {
                    if conn.write_all(&[b'x'; 1000]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
        }
    });
    let dir = temp_dir("sigterm-mid-body");
    let config = config("1s").replacen("[proxy]\n", "[proxy]\nshutdown_timeout = \"1999ms\"\n", 1);
    let start = || {
        let mut args = ProxyArgs::new(upstream.clone(), &config, &dir);
        args.store = "sqlite://idempotency.db".into();
        Proxy::start(args)
    };
    let mut first = start().await;
    let client = client();
    let addr = first.addr;
    let running = tokio::spawn({
        let client = client.clone();
        async move { try_request(&client, post(addr, "/orders", "cut-by-sigterm", "{}")).await }
    });
    while hits.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.terminate();
    first.wait_exit().await;
    // A cut connection (an error here) is what the client should see.
    if let Ok(reply) = running.await.unwrap() {
        assert!(
            reply.status != 201 || reply.body.len() < LENGTH,
            "the first client got a whole-looking answer: {} bytes",
            reply.body.len()
        );
    }
    // Past the lease the first proxy no longer renews.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = start().await;
    let retry = try_request(
        &client,
        post(second.addr, "/orders", "cut-by-sigterm", "{}"),
    )
    .await
    .expect("the retry is answered");
    assert!(
        [504, 409].contains(&retry.status),
        "{} {}",
        retry.status,
        retry.text()
    );
    assert_eq!(
        retry
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "{retry:?}"
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "the retry ran the request again"
    );
}

/// Three proxies share one PostgreSQL database; every key is sent three
/// times to each of them at once: each key executes exactly once and all
/// nine requests get the same answer.
#[tokio::test(flavor = "multi_thread")]
async fn three_proxies_on_one_database_execute_each_key_once() {
    let _heavy = HEAVY.lock().await;
    let backend = Backend::start().await;
    let database = shared_postgres();
    let mut proxies = Vec::new();
    for _ in 0..3 {
        proxies.push(start_proxy(backend.url(), &database, None, "30s").await);
    }
    let run = run_id();
    let keys = 16;
    let requests: Vec<_> = (0..keys * 9)
        .map(|n| {
            let (i, proxy) = (n % keys, &proxies[n / keys % 3]);
            let key = format!("three-{run}-{i}");
            (
                i,
                spawn_request(post(proxy.addr, &format!("/api/{key}"), &key, "{}")),
            )
        })
        .collect();
    let mut answers: HashMap<usize, Vec<Bytes>> = HashMap::new();
    for (i, request) in requests {
        let reply = request.await.unwrap().unwrap();
        assert_eq!(reply.status, 201, "{}", reply.text());
        answers.entry(i).or_default().push(reply.body);
    }
    for i in 0..keys {
        assert_eq!(backend.hits(&format!("/api/three-{run}-{i}")), 1);
        let bodies = &answers[&i];
        assert_eq!(bodies.len(), 9);
        assert!(bodies.iter().all(|body| *body == bodies[0]));
    }
}

/// What one worker of the sustained run saw.
#[derive(Default)]
struct LoadReport {
    unique: usize,
    duplicates: usize,
    changed: usize,
    unexpected: Vec<String>,
}

/// 64 connections for `SOAK_SECS` seconds (default 15), 10% duplicate keys
/// and 1% changed payloads, against the shared PostgreSQL: executions ==
/// unique keys, every duplicate (of a key already answered) a replay, every changed payload a
/// 422, no other status, and the proxy's memory flat at the end.
#[tokio::test(flavor = "multi_thread")]
async fn sustained_load_executes_each_key_once_with_flat_memory() {
    let _heavy = HEAVY.lock().await;
    let seconds: u64 = std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let backend = Backend::start().await;
    let proxy = start_proxy(backend.url(), &shared_postgres(), None, "30s").await;
    let run = run_id();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(seconds);
    let warmed = tokio::time::Instant::now() + Duration::from_secs(seconds / 4);
    let workers: Vec<_> = (0..64u64)
        .map(|w| {
            let (addr, run) = (proxy.addr, run.clone());
            tokio::spawn(async move {
                let client = client();
                let mut report = LoadReport::default();
                let mut done: Vec<String> = Vec::new();
                let mut seed = w.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                while tokio::time::Instant::now() < deadline {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let dice = seed % 100;
                    let (key, body, expect) = match done
                        .get((seed >> 8) as usize % done.len().max(1))
                    {
                        Some(key) if dice == 0 => (key.clone(), "{\"changed\":true}", "changed"),
                        Some(key) if dice <= 10 => (key.clone(), "{}", "duplicate"),
                        _ => (format!("load-{run}-{w}-{}", report.unique), "{}", "unique"),
                    };
                    let reply = try_request(&client, post(addr, "/api/load", &key, body)).await;
                    let status = reply.as_ref().map_or(0, |r| r.status);
                    let replayed = reply.as_ref().is_ok_and(Reply::replayed);
                    let ok = match expect {
                        "unique" if status == 201 && !replayed => {
                            report.unique += 1;
                            done.push(key);
                            true
                        }
                        "unique" => false,
                        // Sent after its key's 201 came back, which the
                        // proxy answers only once the record is stored: a
                        // 409 would be an answer sent before its record.
                        "duplicate" => {
                            report.duplicates += 1;
                            status == 201 && replayed
                        }
                        _ => {
                            report.changed += 1;
                            status == 422
                        }
                    };
                    if !ok {
                        report
                            .unexpected
                            .push(format!("{expect}: {status} {:?}", reply.map(|r| r.text())));
                    }
                }
                report
            })
        })
        .collect();
    tokio::time::sleep_until(warmed).await;
    let rss_warm = rss_kib(proxy.pid());
    let mut total = LoadReport::default();
    for worker in workers {
        let report = worker.await.unwrap();
        total.unique += report.unique;
        total.duplicates += report.duplicates;
        total.changed += report.changed;
        total.unexpected.extend(report.unexpected);
    }
    let rss_end = rss_kib(proxy.pid());
    eprintln!(
        "sustained load: {seconds} s, {} unique, {} duplicates, {} changed, RSS {rss_warm} KiB after warm-up, {rss_end} KiB at the end",
        total.unique, total.duplicates, total.changed
    );
    assert!(
        total.unexpected.is_empty(),
        "{:?}",
        &total.unexpected[..total.unexpected.len().min(10)]
    );
    assert_eq!(
        backend.hits("/api/load"),
        total.unique,
        "executions == unique keys"
    );
    assert!(
        total.duplicates > 0 && total.changed > 0,
        "the mix was exercised"
    );
    assert!(
        rss_end <= rss_warm + rss_warm / 2 + 32 * 1024,
        "proxy memory grew from {rss_warm} KiB to {rss_end} KiB"
    );
}

/// The secrets of one request, in the forms a store or log could hold them.
const SECRET_KEY: &str = "SECRET-KEY-4f1d9b";
const SECRET_PRINCIPAL: &str = "Bearer PRINCIPAL-TOKEN-77e2";
const SECRET_BODY: &str = "BODY-SECRET-CARD-4242";

fn assert_no_secret(place: &str, haystack: &[u8]) {
    for secret in [
        SECRET_KEY,
        SECRET_PRINCIPAL,
        "PRINCIPAL-TOKEN-77e2",
        SECRET_BODY,
    ] {
        let hex = common::hex(secret.as_bytes());
        for needle in [secret.as_bytes(), hex.as_bytes()] {
            assert!(
                !haystack.windows(needle.len()).any(|w| w == needle),
                "{secret} found in {place}"
            );
        }
    }
}

/// No raw key, principal or body reaches PostgreSQL, Redis or the proxy's
/// log (at debug level), whatever the outcome.
#[tokio::test(flavor = "multi_thread")]
async fn no_key_principal_or_body_in_postgres_redis_or_logs() {
    let pg = tokio::task::spawn_blocking(PrivatePostgres::start)
        .await
        .unwrap();
    let redis = PrivateRedis::start();
    let backend = Backend::start().await;
    let dir = temp_dir("leaks");
    let mut args = ProxyArgs::new(backend.url(), &config("30s"), &dir);
    args.store = pg.url();
    args.redis = Some(redis.url());
    let log = dir.join("proxy.log");
    let proxy = Proxy::start_logged(args, &log, "debug").await;
    let secret = |key: &str, body: &str| {
        let mut request = post(proxy.addr, "/api/secret", key, Bytes::from(body.to_owned()));
        request
            .headers_mut()
            .insert("authorization", SECRET_PRINCIPAL.parse().unwrap());
        request
    };
    let body = format!(r#"{{"card":"{SECRET_BODY}"}}"#);
    let changed = format!(r#"{{"card":"{SECRET_BODY}-2"}}"#);
    let invalid = format!("{SECRET_KEY} {SECRET_BODY}");
    let client = client();
    let first = try_request(&client, secret(SECRET_KEY, &body))
        .await
        .unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));
    for _ in 0..3 {
        let replay = try_request(&client, secret(SECRET_KEY, &body))
            .await
            .unwrap();
        assert!(replay.replayed());
    }
    let mismatch = try_request(&client, secret(SECRET_KEY, &changed))
        .await
        .unwrap();
    assert_eq!(mismatch.status, 422);
    let refused = try_request(&client, secret(&invalid, &body)).await.unwrap();
    assert_eq!(refused.status, 400);
    eventually("the completed record is cached", || redis.key_count() > 0).await;
    assert_eq!(backend.hits("/api/secret"), 1);

    // The stored response is visible (hex-encoded in PostgreSQL), so the
    // searches below really look at the records.
    let stored = b"\"execution\":1";
    let dump = pg.dump();
    assert!(dump.contains(&common::hex(stored)), "no record in the dump");
    assert_no_secret("PostgreSQL", dump.as_bytes());
    let cached = redis.dump();
    assert!(
        cached.windows(stored.len()).any(|w| w == stored),
        "no cached record"
    );
    assert_no_secret("Redis", &cached);
    // Every line written (the log is written in batches).
    let mut proxy = proxy;
    proxy.stop().await;
    let logs = std::fs::read(&log).unwrap();
    assert!(!logs.is_empty(), "the proxy logged");
    assert_no_secret("the proxy log", &logs);
}
