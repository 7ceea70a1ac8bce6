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
use common::services::PrivateRedis;
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
store_timeout = "500ms"
read_timeout = "10s"

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
    Proxy::start(args).await
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

/// A hand-written HTTP/1.1 upstream for faults a real server never makes.
/// It reads every request whole, counts it per path, then:
///
/// * `/reset`: resets the connection (TCP RST) while `resets` is above 0
///   (counting it down), else answers 201;
/// * `/halves`: sends the head and half of a 64 KiB body, waits for a
///   permit of `release`, then sends the rest;
/// * anything else: 201 `done <n>`, keeping the connection alive.
#[derive(Clone)]
struct RawUpstream {
    addr: SocketAddr,
    hits: Arc<std::sync::Mutex<HashMap<String, usize>>>,
    resets: Arc<AtomicUsize>,
    release: Arc<Semaphore>,
}

impl RawUpstream {
    async fn start() -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = RawUpstream {
            addr: listener.local_addr().unwrap(),
            hits: Arc::default(),
            resets: Arc::default(),
            release: Arc::new(Semaphore::new(0)),
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

/// The upstream takes the request and resets the connection: 502, the key
/// is released, and the retry executes again (the upstream may or may not
/// have acted on the first one: only it can know). The proxy itself never
/// resends a request the upstream may have received.
#[tokio::test(flavor = "multi_thread")]
async fn upstream_reset_after_the_request_is_502_and_the_retry_executes_again() {
    let upstream = RawUpstream::start().await;
    let proxy = start_proxy(upstream.url(), "memory", None, "30s").await;
    let client = client();
    // A first exchange leaves a pooled keep-alive connection behind, so the
    // reset below hits a reused connection.
    let warm = try_request(&client, post(proxy.addr, "/warm", "w", "{}")).await;
    assert_eq!(warm.unwrap().status, 201);
    upstream.resets.store(2, Ordering::SeqCst);
    for attempt in 1..=2 {
        let reply = try_request(&client, post(proxy.addr, "/reset", "r", "{}"))
            .await
            .unwrap();
        assert_eq!(reply.status, 502, "{}", reply.text());
        assert_eq!(
            problem_type(&reply),
            "urn:tower-idempotency:upstream-unavailable"
        );
        assert_eq!(
            upstream.hits("/reset"),
            attempt,
            "one upstream request per client request"
        );
    }
    let reply = try_request(&client, post(proxy.addr, "/reset", "r", "{}"))
        .await
        .unwrap();
    assert_eq!((reply.status, reply.replayed()), (201, false));
    let replay = try_request(&client, post(proxy.addr, "/reset", "r", "{}"))
        .await
        .unwrap();
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!(replay.body, reply.body);
    assert_eq!(upstream.hits("/reset"), 3);
}

/// The client sends half its body and goes away: nothing is reserved, the
/// upstream is not called, the key is free at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_mid_request_leaves_nothing_behind() {
    let backend = Backend::start().await;
    let proxy = start_proxy(backend.url(), "memory", None, "30s").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"POST /api/cut HTTP/1.1\r\nhost: x\r\nidempotency-key: cut-1\r\n\
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

/// The client goes away in the middle of the response body: the exchange
/// goes on, the response is stored, and the retry is a replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_gone_mid_response_still_gets_it_recorded() {
    let upstream = RawUpstream::start().await;
    let proxy = start_proxy(upstream.url(), "memory", None, "30s").await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(
            b"POST /halves HTTP/1.1\r\nhost: x\r\nidempotency-key: halves-1\r\n\
              content-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
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
