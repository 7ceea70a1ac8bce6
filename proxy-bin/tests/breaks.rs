//! Breaks of the README's guarantees through the real proxy binary, found
//! by an adversarial review. Each test is the attack; the ones that still
//! break are `#[ignore = "BREAK: …"]` (remove the `ignore` with the fix:
//! the test must then pass).

mod common;
#[path = "frameworks/harness.rs"]
#[allow(dead_code)]
mod harness;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;

use common::{client, send, temp_dir, Proxy, ProxyArgs};
use harness::{form_fields, App, Framework};

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

/// `docs/frameworks.md`'s Django recipe, as `tests/frameworks.rs` runs it.
const DJANGO: &str = r#"
[[route]]
path = "/contact*"
methods = ["POST"]
key = { form_field = "submission_token" }
required = true
uuid_only = true
fingerprint_exclude = ["csrfmiddlewaretoken"]
store_statuses = ["3xx"]
success_redirects = ["/contact/thanks"]
mismatch = "replay"
"#;

/// Scenario: the Django recipe in front of the real Django app (the seed's
/// contact form), and a form posted with the method spelled `post`. The
/// proxy passes any method token on; Django's `runserver` (and uvicorn)
/// hand it on as sent, and Django upper-cases it (`WSGIRequest.method =
/// environ["REQUEST_METHOD"].upper()`), so the view, the CSRF check and
/// the form all run as for `POST`. The route covers `POST` only, so the
/// proxy passes `post` through: a form without a token is not refused
/// (400 `key-missing`), and the same form with the same token, sent
/// twice, is two records and two notifications. Impact ("at most one
/// execution"; a `required` route skipped).
#[tokio::test(flavor = "multi_thread")]
async fn django_runs_a_lower_case_post_once() {
    let app = App::start(Framework::Django, 0);
    let dir = temp_dir("breaks-django-method");
    let proxy = Proxy::start(ProxyArgs::new(app.url(), DJANGO, &dir))
        .await
        .owning(dir);
    let http = client();
    let page = send(
        &http,
        proxy.addr,
        "GET",
        "/contact",
        &[("accept", "text/html")],
        Bytes::new(),
    )
    .await;
    assert_eq!(page.status, 200, "{page:?}");
    let cookie: Vec<String> = page
        .headers
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok()?.split(';').next().map(str::to_owned))
        .collect();
    let cookie = cookie.join("; ");
    let origin = format!("http://{}", proxy.addr);
    let referer = format!("{origin}/contact");
    let headers = [
        ("cookie", cookie.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
        ("accept", "text/html"),
        ("origin", origin.as_str()),
        ("referer", referer.as_str()),
    ];
    let fields = form_fields(&page, &[("email", "ada@example.com"), ("message", "Hallo")]);
    let body = serde_urlencoded::to_string(&fields).unwrap();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let reply = send(
            &http,
            proxy.addr,
            "post",
            "/contact",
            &headers,
            body.clone(),
        )
        .await;
        answers.push((reply.status, reply.header("location").map(str::to_owned)));
    }
    assert_eq!(
        app.records().await,
        1,
        "one form, one token, two records; answers: {answers:?}"
    );
}

/// A `php -S` process, killed when dropped.
struct Php(std::process::Child);

impl Drop for Php {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Scenario: a JSON-less PHP endpoint (`$_POST`, the plain PHP a Laravel
/// app reads forms with) behind the proxy, the default policy (`mismatch
/// = "reject"`), and two urlencoded bodies with the same key:
/// `total_amount=10&total.amount=1000` and
/// `total.amount=1000&total_amount=10`. PHP turns `.` (and ` `, and a
/// lone `[`) in field names into `_`, and the last field wins, so it reads
/// `total_amount` as 1000 from the first and 10 from the second. The
/// fingerprint sorts fields by their names as sent (`total.amount` and
/// `total_amount` are two names, each kept in place), so both bodies are
/// one canonical form. Impact ("same key, different request is refused,
/// never replayed"): the changed payment is answered with the first one's
/// response (200 "charged 1000") instead of 422, and never executed; the
/// form analogue of the `\u0061mount` JSON case the README rules out.
#[tokio::test(flavor = "multi_thread")]
async fn php_form_fields_read_differently_never_share_a_fingerprint() {
    let dir = temp_dir("breaks-php-names");
    let script = dir.join("pay.php");
    std::fs::write(
        &script,
        "<?php echo 'charged ', $_POST['total_amount'] ?? 'nothing';\n",
    )
    .unwrap();
    let addr = common::free_port();
    let mut php = Php(std::process::Command::new("php")
        .args(["-S", &addr.to_string()])
        .arg(&script)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("php is installed (scripts/setup.sh)"));
    assert!(
        common::services::wait_listening(&mut php.0, addr),
        "php -S exited at start (its port taken?)"
    );
    let proxy = Proxy::start(ProxyArgs::new(
        format!("http://{addr}"),
        "[[route]]\npath = \"/pay\"\n",
        &dir,
    ))
    .await;
    let headers = [
        ("idempotency-key", "pay-1"),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let first = proxy
        .send(
            "POST",
            "/pay",
            &headers,
            "total_amount=10&total.amount=1000",
        )
        .await;
    assert_eq!(first.text(), "charged 1000");
    let changed = proxy
        .send(
            "POST",
            "/pay",
            &headers,
            "total.amount=1000&total_amount=10",
        )
        .await;
    // What PHP reads from the changed body, asked directly.
    let direct = send(
        &client(),
        addr,
        "POST",
        "/pay",
        &headers[1..],
        "total.amount=1000&total_amount=10",
    )
    .await;
    assert_eq!(direct.text(), "charged 10");
    assert_eq!(
        changed.status,
        422,
        "a request PHP reads as another payment got: {} {} (replayed: {})",
        changed.status,
        changed.text(),
        changed.replayed()
    );
    drop(php);
}

/// `docs/frameworks.md`'s Express recipe, as `tests/frameworks.rs` runs it.
const EXPRESS: &str = r#"
case_insensitive_paths = true
[[route]]
path = "/api/forms/*/submit"
methods = ["POST"]
required = true
uuid_only = true
store_statuses = ["2xx"]
mismatch_status = 409
in_flight_status = 425
"#;

/// Scenario: the Express recipe in front of the real Express app, and a
/// client (or a link, a proxy, a hand-typed URL) that spells the path in
/// another case: `/API/Forms/contact/Submit`. Express routes
/// case-insensitively by default (`caseSensitive: false`), so the app
/// accepts the submission; the proxy routes case-sensitively
/// (`case_insensitive_paths` is off, and the recipe does not set it), so
/// the request is not covered. Two identical submissions with one
/// `Idempotency-Key` are two submissions. Impact ("at most one
/// execution"; a `required` route skipped) behind the documented recipe.
#[tokio::test(flavor = "multi_thread")]
async fn express_runs_a_submission_once_in_any_case() {
    let app = App::start(Framework::Express, 0);
    let dir = temp_dir("breaks-express-case");
    let proxy = Proxy::start(ProxyArgs::new(app.url(), EXPRESS, &dir))
        .await
        .owning(dir);
    let key = common::uuid();
    let headers = [
        ("content-type", "application/json"),
        ("idempotency-key", key.as_str()),
    ];
    let body = r#"{"email":"ada@example.com","name":"Ada"}"#;
    let mut answers = Vec::new();
    for _ in 0..2 {
        let reply = proxy
            .send("POST", "/API/Forms/contact/Submit", &headers, body)
            .await;
        answers.push((reply.status, reply.replayed()));
    }
    assert_eq!(
        app.records().await,
        1,
        "one key, two submissions; answers: {answers:?}"
    );
}

/// The state a [`draining_backend`] shares with its test.
struct Draining {
    url: String,
    /// Lets the upload connection read (drain) the upload's body.
    resume: Arc<tokio::sync::Notify>,
    /// Every byte the backend read as the body of `POST /uploads`.
    upload_body: Arc<std::sync::Mutex<Vec<u8>>>,
    /// Executions of `POST /orders`.
    orders: Arc<AtomicUsize>,
}

/// A raw HTTP/1.1 backend that keeps connections alive and frames requests
/// by `Content-Length`, as RFC 9112 says. `POST /uploads` is answered as
/// soon as its head is read (201, before the body: a server may), and its
/// body is read (drained, and kept) only once the test says `resume` —
/// a busy server. `POST /orders` reads its body, counts, and answers
/// `201 order-done`. The listening socket has a small receive buffer, so
/// an unread upload fills it quickly.
async fn draining_backend() -> Draining {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(64).unwrap();
    let state = Draining {
        url: format!("http://{}", listener.local_addr().unwrap()),
        resume: Arc::new(tokio::sync::Notify::new()),
        upload_body: Arc::default(),
        orders: Arc::default(),
    };
    let (resume, upload_body, orders) = (
        state.resume.clone(),
        state.upload_body.clone(),
        state.orders.clone(),
    );
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let (resume, upload_body, orders) =
                (resume.clone(), upload_body.clone(), orders.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 64 * 1024];
                loop {
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    buf.drain(..end);
                    let length: usize = head
                        .lines()
                        .find_map(|line| line.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    let upload = head.contains(" /uploads ");
                    if upload {
                        let answer = b"HTTP/1.1 201 Created\r\nContent-Length: 8\r\n\r\nuploaded";
                        if conn.write_all(answer).await.is_err() {
                            return;
                        }
                        resume.notified().await;
                    }
                    let mut body = Vec::new();
                    while body.len() + buf.len() < length {
                        body.append(&mut buf);
                        if upload {
                            upload_body.lock().unwrap().clone_from(&body);
                        }
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let rest = length - body.len();
                    body.extend(buf.drain(..rest));
                    if upload {
                        upload_body.lock().unwrap().clone_from(&body);
                        continue;
                    }
                    orders.fetch_add(1, Ordering::SeqCst);
                    let answer = b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done";
                    if conn.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    state
}

/// Scenario: the proxy's own upstream pool takes back a connection whose
/// request was never written whole. Client A uploads 12 MiB to a covered
/// route; the backend answers 201 from the head (as RFC 9112 allows) but
/// is busy and reads nothing for a while, so the proxy's write of the body
/// stalls past `write_timeout`. `Upstream::exchange_head` then reads the
/// answer ("the upstream answered before reading the body"), relays the
/// 201 — and `Upstream::release` pools the connection: Pingora's session
/// never saw the request, so nothing marks it unfinished. The next covered
/// request, client B's `POST /orders` carrying its credentials, is written
/// on that connection, where the backend (framing by `Content-Length`, as
/// it must) reads it as the rest of A's upload body. Impact ("never leaks
/// one"; "at most one execution", "loses nothing"): B's whole request,
/// headers and body, is delivered to A's endpoint as A's data (classic
/// request smuggling: A's upload stores B's `Authorization`), B's order is
/// never executed, and B gets a 504 after `read_timeout` with its key kept
/// as "outcome unknown". Minimal reproduction: this test (small backend
/// receive buffer, `write_timeout = "300ms"`, one large upload, then one
/// small POST). Fix: never pool a connection whose request body was not
/// written whole (close it when `exchange_head`'s write failed or timed
/// out).
#[tokio::test(flavor = "multi_thread")]
async fn a_request_body_cut_by_write_timeout_never_carries_the_next_request() {
    let backend = draining_backend().await;
    let dir = temp_dir("breaks-write-timeout-pool");
    let config = r#"
[proxy]
write_timeout = "300ms"
read_timeout = "3s"

[[route]]
path = "/uploads"
required = true
max_body_bytes = 16777216

[[route]]
path = "/orders"
required = true
"#;
    let proxy = Proxy::start(ProxyArgs::new(backend.url.clone(), config, &dir))
        .await
        .owning(dir);
    let upload = proxy
        .send(
            "POST",
            "/uploads",
            &[
                ("idempotency-key", "upload-a"),
                ("content-type", "application/octet-stream"),
            ],
            vec![b'a'; 12 << 20],
        )
        .await;
    // Whatever A is answered (the backend's 201 today), the backend gets
    // to the upload's body now; B comes after.
    backend.resume.notify_one();
    let order = proxy
        .send(
            "POST",
            "/orders",
            &[
                ("idempotency-key", "order-b"),
                ("authorization", "Bearer secret-of-client-b"),
                ("content-type", "application/json"),
            ],
            r#"{"item":"b"}"#,
        )
        .await;
    let smuggled = backend
        .upload_body
        .lock()
        .unwrap()
        .windows(b"secret-of-client-b".len())
        .any(|w| w == b"secret-of-client-b");
    assert!(
        !smuggled,
        "client B's request (with its credentials) was read as client A's upload body; A got {}, B got {} {}",
        upload.status,
        order.status,
        order.text()
    );
    assert_eq!(order.status, 201, "{}", order.text());
    assert_eq!(order.text(), "order-done");
    assert_eq!(backend.orders.load(Ordering::SeqCst), 1);
}

/// A raw HTTP/1.1 backend that frames every request by its
/// `Content-Length` (RFC 9112 section 6.3: a `HEAD` with one has a body
/// too) and keeps connections alive. `HEAD` gets `200` with
/// `Content-Length: 5` and no body as soon as its head is read, and its
/// body is discarded after (as nginx's `discard_request_body` does);
/// `POST /orders` counts and answers
/// `201 order-done`; a request line it cannot read gets `400` and the
/// connection closed. Returns its URL and the executions of `/orders`.
async fn framing_backend() -> (String, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let orders = Arc::new(AtomicUsize::new(0));
    let counter = orders.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let orders = counter.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 16 * 1024];
                loop {
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end);
                    let length: usize = head
                        .lines()
                        .find_map(|line| {
                            let (name, value) = line.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    let line = head.lines().next().unwrap_or_default();
                    if line.starts_with("HEAD ") {
                        // Answered at once; its body is discarded after.
                        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n";
                        if conn.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                    while buf.len() < length {
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..length);
                    let answer: &[u8] = if line.starts_with("HEAD ") {
                        continue;
                    } else if line == "POST /orders HTTP/1.1" {
                        orders.fetch_add(1, Ordering::SeqCst);
                        b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done"
                    } else {
                        let _ = conn
                            .write_all(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 11\r\n\r\nbad request")
                            .await;
                        return;
                    };
                    if conn.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, orders)
}

/// Scenario: any client sends `HEAD /status` with `Content-Length: 24`
/// and 24 bytes of body (valid HTTP/1.1: the body is framed by its length;
/// RFC 9110 gives it no meaning, but every hop must still frame it). The
/// request is not covered, so it takes the direct path
/// (`passthrough::forward`): the proxy reads the 24 bytes from the client
/// and forwards the head *with* `Content-Length: 24` — but
/// `Upstream::exchange_head` writes a `HEAD` through Pingora's session
/// (`write_request_header`, `finish_body`) and never writes the body. The
/// upstream answers the `HEAD` and waits for its 24 bytes; the proxy,
/// having read a complete bodiless `HEAD` answer, pools the connection. The
/// next request written on it — another client's covered `POST /orders` —
/// loses its first 24 bytes to the `HEAD`'s body, and the upstream reads
/// the rest as a new request. Impact ("never leaks one", "loses nothing";
/// request smuggling into the shared pool): one unauthenticated request
/// desynchronises a pooled connection, and the next client's request is
/// cut and misread (here answered 400 and never executed; with other
/// lengths, its headers and body are parsed as a request of their own).
/// Minimal reproduction: this test. Fix: write the body of a `HEAD` too
/// (or refuse/strip a `HEAD` body and send `Content-Length: 0`), and never
/// pool a connection whose request body was not written whole.
#[tokio::test(flavor = "multi_thread")]
async fn a_head_with_a_body_never_desynchronises_the_pool() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (upstream, orders) = framing_backend().await;
    let dir = temp_dir("breaks-head-body");
    let config = r#"
[[route]]
path = "/orders"
methods = ["POST"]
required = true
"#;
    let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir);
    // Client A: a HEAD with a 24-byte body, on a raw connection.
    let mut a = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    a.write_all(
        b"HEAD /status HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 24\r\n\r\n0123456789abcdefghijklmn",
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    let mut chunk = [0u8; 1024];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = a.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the proxy closed A's connection: {answer:?}");
        answer.extend_from_slice(&chunk[..n]);
    }
    // Any answer will do (200 from the backend today; a refusal would be
    // a fix): what matters is the next client's request.
    assert!(answer.starts_with(b"HTTP/1.1 "));
    // Client B: an ordinary covered order.
    let order = proxy
        .send(
            "POST",
            "/orders",
            &[
                ("idempotency-key", "order-after-head"),
                ("content-type", "application/json"),
            ],
            r#"{"item":"b"}"#,
        )
        .await;
    assert_eq!(
        (order.status, order.text().as_str()),
        (201, "order-done"),
        "B's order was misread by the upstream"
    );
    assert_eq!(orders.load(Ordering::SeqCst), 1);
}

/// Scenario: a covered form `POST` whose client lists
/// `Connection: content-type` (or `content-encoding`, or
/// `x-http-method-override`, by which the engine scoped it). The engine reads the
/// key, the method a `POST` names and the fingerprint by the content type;
/// the proxy then removed every header `Connection` lists, so the upstream
/// got the body without its type — which Rack reads as a form and others as
/// opaque bytes, and the engine read as the type said. Impact ("at most one
/// execution"; "same key, different request is refused"): the engine and
/// the backend read one body two ways (a form key the engine did not see
/// forwards each retry on an optional route; two JSON bodies alike to the
/// engine are two forms to Rails). Fix: the headers the body is read by
/// are forwarded whatever `Connection` lists, as nginx forwards them.
#[tokio::test(flavor = "multi_thread")]
async fn the_headers_a_body_is_read_by_reach_the_upstream_whatever_connection_lists() {
    let backend = common::Backend::start().await;
    let dir = temp_dir("breaks-connection-listed");
    // The route reads its callers by `x-user-id` (a gateway's) and by
    // `x-tenant` (a scope header): the upstream must run the request as
    // the identity the engine scoped it by.
    let config = "[[route]]\npath = \"/echo\"\nscope_headers = [\"x-tenant\"]\n\
                  principal = { header = \"x-user-id\" }\n";
    let proxy = Proxy::start(ProxyArgs::new(backend.url(), config, &dir))
        .await
        .owning(dir);
    let reply = proxy
        .send(
            "POST",
            "/echo",
            &[
                ("idempotency-key", "connection-listed-1"),
                ("content-type", "application/x-www-form-urlencoded"),
                ("content-encoding", "identity"),
                ("x-http-method-override", "PATCH"),
                ("x-user-id", "alice"),
                ("x-tenant", "shop-a"),
                ("x-dropped", "yes"),
                (
                    "connection",
                    "content-type, content-encoding, x-http-method-override, \
                     x-user-id, x-tenant, idempotency-key, x-dropped",
                ),
            ],
            "amount=10",
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = reply.json();
    assert_eq!(
        seen["headers"]["content-type"], "application/x-www-form-urlencoded",
        "{seen}"
    );
    assert_eq!(seen["headers"]["content-encoding"], "identity", "{seen}");
    assert_eq!(seen["headers"]["x-http-method-override"], "PATCH", "{seen}");
    assert_eq!(seen["headers"]["x-user-id"], "alice", "{seen}");
    assert_eq!(seen["headers"]["x-tenant"], "shop-a", "{seen}");
    assert_eq!(
        seen["headers"]["idempotency-key"], "connection-listed-1",
        "{seen}"
    );
    // Other listed headers are still the client's connection's own.
    assert!(seen["headers"].get("x-dropped").is_none(), "{seen}");
}

/// Scenario (isolation): the same listing on a `POST` whose form names
/// another method (`_method=PUT`), covered by a `PUT` route that scopes by
/// `x-tenant`, beside a `POST` route that reads no header. The proxy kept
/// the headers of the route it classified the request under before its
/// body was read (the `POST` route), so the request was scoped as
/// `victim-co`'s and ran upstream with no tenant: the default tenant's
/// answer stored in `victim-co`'s scope. Fix: the deciding route's
/// headers are forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn the_headers_of_the_route_a_body_names_reach_the_upstream() {
    let backend = common::Backend::start().await;
    let dir = temp_dir("breaks-connection-override");
    let config = "[[route]]\npath = \"/echo\"\nmethods = [\"PUT\"]\nrequired = true\n\
                  scope_headers = [\"x-tenant\"]\n\n\
                  [[route]]\npath = \"/echo\"\nmethods = [\"POST\"]\n";
    let proxy = Proxy::start(ProxyArgs::new(backend.url(), config, &dir))
        .await
        .owning(dir);
    let reply = proxy
        .send(
            "POST",
            "/echo",
            &[
                ("idempotency-key", "connection-override-1"),
                ("content-type", "application/x-www-form-urlencoded"),
                ("x-tenant", "victim-co"),
                ("connection", "x-tenant"),
            ],
            "_method=PUT&qty=1",
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let seen = reply.json();
    assert_eq!(seen["headers"]["x-tenant"], "victim-co", "{seen}");
}

/// Scenario (isolation): a client lists `Host` in `Connection`. The proxy
/// dropped every listed header but those the engine reads the body by, so
/// `Host` went too and Pingora put in the upstream's own authority: the
/// order was scoped as `tenant-a.example` and run by the backend's default
/// virtual host (another tenant), and a passthrough reached it as well.
/// Impact ("the upstream runs the request as the identity it was scoped
/// by"). Fix: `Host` is always forwarded.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_listed_in_connection_still_reaches_the_upstream() {
    let backend = common::Backend::start().await;
    let dir = temp_dir("breaks-connection-host");
    let config = "[[route]]\npath = \"/echo\"\n";
    let proxy = Proxy::start(ProxyArgs::new(backend.url(), config, &dir))
        .await
        .owning(dir);
    for (method, key) in [("POST", "idempotency-key: host-1\r\n"), ("GET", "")] {
        let request = format!(
            "{method} /echo HTTP/1.1\r\nHost: tenant-a.example\r\nConnection: host, close\r\n\
             {key}Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
        );
        let answer = raw_exchange(proxy.addr, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{method}: {answer}");
        let (_, body) = answer.split_once("\r\n\r\n").unwrap();
        let seen: serde_json::Value = serde_json::from_str(body.trim()).unwrap();
        assert_eq!(
            seen["headers"]["host"], "tenant-a.example",
            "{method}: {seen}"
        );
    }
}

/// Reads one request from `conn` (its head, then a `Content-Length` body;
/// bytes already in `buf` first) and drops it from `buf`; `false` when the
/// connection ended first.
async fn read_request(conn: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> bool {
    read_request_head(conn, buf).await.is_some()
}

/// [`read_request`], returning the request's head (lower-cased).
async fn read_request_head(conn: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map_or(0, |value| value.trim().parse().unwrap_or(0));
    while buf.len() < end + length {
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    buf.drain(..end + length);
    Some(head)
}

/// A raw backend: every connection is served by `serve` (given the
/// connection), and each accepted connection is counted. Returns its URL
/// and the count.
async fn raw_backend<F, Fut>(serve: F) -> (String, Arc<AtomicUsize>)
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(conn));
        }
    });
    (url, accepted)
}

/// A backend that reads one request, writes `answer` as is and closes the
/// connection: an answer framed by the close, as HTTP/1.0 servers
/// (Python's `http.server`) and hand-written ones send. Returns its URL
/// and the requests it answered (one per connection).
async fn closing_backend(answer: &'static [u8]) -> (String, Arc<AtomicUsize>) {
    raw_backend(move |mut conn| async move {
        use tokio::io::AsyncWriteExt;
        if read_request(&mut conn, &mut Vec::new()).await {
            let _ = conn.write_all(answer).await;
            let _ = conn.shutdown().await;
        }
    })
    .await
}

/// The proxy in front of `upstream` with one route, `POST /orders`, its
/// key optional.
async fn orders_proxy(upstream: String, name: &str) -> Proxy {
    let dir = temp_dir(name);
    let config = "[[route]]\npath = \"/orders\"\nmethods = [\"POST\"]\n";
    Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir)
}

/// Scenario: an HTTP/1.0 backend (Python's `http.server`, which README
/// names) answers a covered order with a body framed by its close. The
/// proxy chunks such a body so a cut shows as a cut, but relayed the head
/// still labelled `HTTP/1.0`, and `Transfer-Encoding` means nothing in
/// HTTP/1.0: hyper and reqwest refuse the answer, Go hands the chunk
/// framing to the caller as the body. Impact ("no lost response"): the
/// first caller of an executed order gets an error or a corrupted body,
/// while its retry is replayed a different (correct) answer. The same on
/// the direct path for requests the proxy does not cover.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_1_0_answer_framed_by_its_close_reaches_the_client_whole() {
    let (upstream, calls) = closing_backend(
        b"HTTP/1.0 201 Created\r\nContent-Type: application/json\r\n\r\n{\"id\":1}",
    )
    .await;
    let proxy = orders_proxy(upstream, "breaks-http10").await;
    let headers = [
        ("idempotency-key", "order-http10"),
        ("content-type", "application/json"),
    ];
    let first = proxy.send("POST", "/orders", &headers, "{}").await;
    assert_eq!((first.status, first.text().as_str()), (201, r#"{"id":1}"#));
    let retry = proxy.send("POST", "/orders", &headers, "{}").await;
    assert!(retry.replayed());
    assert_eq!(retry.text(), first.text());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Not covered: the direct path relays the same framing.
    let plain = proxy.send("POST", "/status", &[], "").await;
    assert_eq!((plain.status, plain.text().as_str()), (201, r#"{"id":1}"#));
}

/// Scenario: a backend answers a covered order under a transfer coding
/// other than chunked (`Transfer-Encoding: gzip`, framed by its close).
/// The first caller decodes it (chunked, then gzip); the stored record
/// kept the body but not its coding (`Transfer-Encoding` is never stored),
/// so every retry was replayed the raw gzip bytes as if they were the
/// body. Impact ("replays the stored response"): a retry gets garbage
/// where its first attempt got the answer. Now such a body is not stored:
/// a retry gets `response-not-stored`, and the order still ran once.
#[tokio::test(flavor = "multi_thread")]
async fn a_body_under_a_transfer_coding_is_never_replayed_without_it() {
    let (upstream, calls) = closing_backend(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nConnection: close\r\n\r\n\x1f\x8b\x08\x00coded",
    )
    .await;
    let proxy = orders_proxy(upstream, "breaks-te-gzip").await;
    let headers = [
        ("idempotency-key", "order-gzip"),
        ("content-type", "application/json"),
    ];
    let first = proxy.send("POST", "/orders", &headers, "{}").await;
    assert_eq!(first.status, 200);
    assert!(
        first
            .header("transfer-encoding")
            .is_some_and(|coding| coding.contains("gzip")),
        "the first caller must get the coding with the coded body: {:?}",
        first.headers
    );
    let retry = proxy.send("POST", "/orders", &headers, "{}").await;
    assert!(
        !(retry.replayed() && retry.status == 200),
        "a coded body replayed without its coding: {} {:?}",
        retry.status,
        retry.text()
    );
    assert!(
        retry.text().contains("response-not-stored"),
        "{} {}",
        retry.status,
        retry.text()
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Scenario: a Node.js backend (its `keepAliveTimeout` is 5 s, announced
/// as `Keep-Alive: timeout=5`) behind the proxy, whose pool kept idle
/// connections 60 s. A request written on a connection idle for about the
/// backend's timeout meets the backend closing it: the head was written,
/// so the proxy must keep the 502 as the key's outcome (README), and an
/// order that never ran is answered 502 for good. Now a connection is not
/// kept past a second under the idle time the upstream announces: here
/// `timeout=2`, so a request 1.5 s later goes out on a new connection.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_is_not_reused_past_the_idle_time_the_upstream_announces() {
    let (upstream, connections) = raw_backend(|mut conn| async move {
        use tokio::io::AsyncWriteExt;
        let mut buf = Vec::new();
        while read_request(&mut conn, &mut buf).await {
            let answer = b"HTTP/1.1 201 Created\r\nConnection: keep-alive\r\n\
                Keep-Alive: timeout=2\r\nContent-Length: 2\r\n\r\nok";
            if conn.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    let proxy = orders_proxy(upstream, "breaks-keep-alive").await;
    let order = |key: &'static str| {
        let proxy = &proxy;
        async move {
            proxy
                .send(
                    "POST",
                    "/orders",
                    &[
                        ("idempotency-key", key),
                        ("content-type", "application/json"),
                    ],
                    "{}",
                )
                .await
        }
    };
    assert_eq!(order("first").await.status, 201);
    assert_eq!(order("at-once").await.status, 201);
    assert_eq!(
        connections.load(Ordering::SeqCst),
        1,
        "a connection within its idle time is reused"
    );
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(order("later").await.status, 201);
    assert_eq!(
        connections.load(Ordering::SeqCst),
        2,
        "a connection past the announced idle time (less a second) was reused"
    );
}

/// Scenario (from an audit of the pool): the upstream answers a covered
/// order `201` on a kept-alive connection, announcing no idle time, and
/// closes that connection a moment later (its own idle timeout), once
/// with a FIN and once with a reset (`SO_LINGER 0`). The next order, well
/// after, must not be written on the dead connection: the write would go
/// out, the read fail, and the order be kept "executed, outcome unknown"
/// (502) for good although it never reached the upstream. Each order runs
/// once, on a fresh connection, answered 201.
#[tokio::test(flavor = "multi_thread")]
async fn a_pooled_connection_the_upstream_closed_unannounced_is_never_written_to() {
    for reset in [false, true] {
        let (upstream, connections) = raw_backend(move |mut conn| async move {
            use tokio::io::AsyncWriteExt;
            if !read_request(&mut conn, &mut Vec::new()).await {
                return;
            }
            let answer = b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok";
            if conn.write_all(answer).await.is_err() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            if reset {
                // A zero linger resets at once: nothing blocks on the drop.
                #[allow(deprecated)]
                let _ = conn.set_linger(Some(std::time::Duration::ZERO));
                drop(conn);
            } else {
                let _ = conn.shutdown().await;
            }
        })
        .await;
        let proxy = orders_proxy(upstream, "breaks-stale-pool").await;
        assert_eq!(json_order(&proxy, "first").await.0, 201);
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let (status, text) = json_order(&proxy, "second").await;
        assert_eq!((status, text.as_str()), (201, "ok"), "reset: {reset}");
        assert_eq!(connections.load(Ordering::SeqCst), 2, "reset: {reset}");
        // The second order ran: its retry is its replay, not a kept 502.
        let retry = proxy
            .send(
                "POST",
                "/orders",
                &[
                    ("idempotency-key", "second"),
                    ("content-type", "application/json"),
                ],
                "{}",
            )
            .await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (201, true),
            "reset: {reset}"
        );
    }
}

/// Scenario (from a review behind uvicorn, whose keep-alive timeout, 5 s
/// by default, is never announced): the upstream's idle close of a pooled
/// connection crosses the next keyed order written on it — here the
/// upstream closes that connection, unread, the moment the order arrives,
/// as its timer would have a moment before. No check can see that close
/// coming: the order failed after its write and was kept as "executed,
/// outcome unknown" (502) for good, though it never reached the upstream
/// (3 of 90 orders sent about a keep-alive timeout apart). A keyed
/// request never rides on a connection idle for half a second or more
/// (a review of the fix: a second was what uvicorn or gunicorn set to `1`
/// closes at, and the proxy's idle clock starts late by the latency): both
/// orders run, each once.
#[tokio::test(flavor = "multi_thread")]
async fn a_keyed_order_never_rides_on_a_connection_idle_for_half_a_second() {
    let (upstream, connections) = raw_backend(|mut conn| async move {
        use tokio::io::AsyncWriteExt;
        let mut buffer = Vec::new();
        if !read_request(&mut conn, &mut buffer).await {
            return;
        }
        let answer = b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok";
        if conn.write_all(answer).await.is_err() {
            return;
        }
        // The next request on this connection meets the idle close: reset,
        // nothing read.
        let mut byte = [0u8; 1];
        let _ = tokio::io::AsyncReadExt::read(&mut conn, &mut byte).await;
        #[allow(deprecated)]
        let _ = conn.set_linger(Some(std::time::Duration::ZERO));
    })
    .await;
    let proxy = orders_proxy(upstream, "breaks-idle-close").await;
    assert_eq!(json_order(&proxy, "before-the-pause").await.0, 201);
    // Past half a second, short of the second a looser bound would allow.
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let (status, text) = json_order(&proxy, "after-the-pause").await;
    assert_eq!((status, text.as_str()), (201, "ok"), "the order was lost");
    assert_eq!(connections.load(Ordering::SeqCst), 2);
}

/// Scenario: an upstream answers `GET /status` with a `204` that declares
/// a body (`Content-Length: 49`, a framework bug or a hostile app) and
/// sends those 49 bytes only later — here when the connection carries its
/// next request. A 204 is read as bodiless, so the proxy pooled the
/// connection, and the next client's covered `POST /orders` written on it
/// read the late bytes (a whole `201 LEAKED` answer) as its own: the order
/// got someone else's bytes, stored and replayed under its key, and its
/// real answer was never read. Impact ("never leaks one"): a desynchronised
/// pool. Fix: a connection is not pooled after an answer whose framing
/// leaves bytes in doubt (a bodiless status declaring a body, a HEAD, an
/// error answer to a request with a body).
/// The same with a `304` declaring 49 bytes: its `Content-Length` may
/// describe the representation rather than bytes that follow, and the
/// connection was pooled on that reading.
#[tokio::test(flavor = "multi_thread")]
async fn late_bytes_after_a_bodiless_answer_never_reach_the_next_request() {
    // The 49 bytes each declares are the `LEAKED` answer's.
    for (status, head) in [
        (
            204,
            &b"HTTP/1.1 204 No Content\r\nContent-Length: 49\r\n\r\n"[..],
        ),
        (
            304,
            &b"HTTP/1.1 304 Not Modified\r\nContent-Length: 49\r\n\r\n"[..],
        ),
    ] {
        let upstream = leaking_backend(head).await;
        let proxy = orders_proxy(upstream, "breaks-late-bytes").await;
        let answer = proxy.send("GET", "/status", &[], "").await;
        assert_eq!(answer.status, status);
        assert_eq!(
            json_order(&proxy, &format!("order-after-{status}")).await,
            (201, "order-done".to_owned()),
            "after a {status}, the order read another answer's late bytes"
        );
    }
}

/// Scenario: an interim answer (`103 Early Hints`) that declares a body
/// (`Content-Length: 49`), then those 49 bytes: a whole `201` the upstream
/// never meant as the order's answer. A 1xx has no content (RFC 9110,
/// 15.2); the proxy skipped the interim head and read the bytes after it
/// as the final answer, stored and replayed under the order's key. Fix:
/// such an interim answer is a broken answer: 502, kept as the key's
/// outcome (the upstream had the request), and the connection closed.
#[tokio::test(flavor = "multi_thread")]
async fn an_interim_answer_that_declares_a_body_is_no_answer() {
    let (upstream, _) = raw_backend(|mut conn| async move {
        use tokio::io::AsyncWriteExt;
        let mut buf = Vec::new();
        if read_request(&mut conn, &mut buf).await {
            let _ = conn
                .write_all(
                    b"HTTP/1.1 103 Early Hints\r\nContent-Length: 49\r\n\r\n\
                      HTTP/1.1 201 Created\r\nContent-Length: 6\r\n\r\nLEAKED\
                      HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done",
                )
                .await;
        }
    })
    .await;
    let proxy = orders_proxy(upstream, "breaks-interim-body").await;
    let (status, body) = json_order(&proxy, "order-after-103").await;
    assert_eq!(status, 502, "{body}");
    assert!(!body.contains("LEAKED"), "{body}");
    // Kept: the upstream had the request.
    let headers = [
        ("idempotency-key", "order-after-103"),
        ("content-type", "application/json"),
    ];
    let again = proxy.send("POST", "/orders", &headers, "{}").await;
    assert_eq!((again.status, again.replayed()), (502, true), "{again:?}");
}

/// A backend whose first connection answers its first request with
/// `first`, and its second with a whole `201 LEAKED` answer before the
/// real one (the bytes a hop that framed `first` otherwise would read as
/// its body); every other request gets `201 order-done`. Returns its URL.
async fn leaking_backend(first: &'static [u8]) -> String {
    use tokio::io::AsyncWriteExt;
    let connections = Arc::new(AtomicUsize::new(0));
    let (upstream, _) = raw_backend(move |mut conn| {
        let first_connection = connections.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            let mut buf = Vec::new();
            let mut answered = 0;
            while read_request(&mut conn, &mut buf).await {
                let answer: &[u8] = if first_connection && answered == 0 {
                    first
                } else if first_connection && answered == 1 {
                    b"HTTP/1.1 201 Created\r\nContent-Length: 6\r\n\r\nLEAKED\
                      HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done"
                } else {
                    b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done"
                };
                answered += 1;
                if conn.write_all(answer).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    upstream
}

/// Scenario: an answer framed both ways (`Transfer-Encoding: chunked` and
/// `Content-Length`), which RFC 9112 (6.3) calls a sign of smuggling: the
/// proxy read it as chunked, but a hop in front of the upstream may have
/// framed it by its length, and what follows on the connection is then
/// another answer's bytes. The proxy pooled the connection, and the next
/// order read an answer nobody asked for. Fix: not pooled.
#[tokio::test(flavor = "multi_thread")]
async fn an_answer_framed_two_ways_never_leaves_its_connection_pooled() {
    let upstream = leaking_backend(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length : 2\r\n\r\n\
          2\r\nok\r\n0\r\n\r\n",
    )
    .await;
    let proxy = orders_proxy(upstream, "breaks-two-framings").await;
    let status = proxy.send("GET", "/status", &[], "").await;
    assert_eq!(status.status, 200);
    assert_eq!(
        json_order(&proxy, "order-after-two-framings").await,
        (201, "order-done".to_owned()),
        "the order read an answer nobody asked for"
    );
}

/// Scenario: an upstream answers `204 No Content` with
/// `Transfer-Encoding: chunked` (or a `Content-Length`), framing a body a
/// 204 never has. The proxy relayed the head as it came: a client or a
/// front proxy that pools its connection to this one reads the next
/// answer as this one's body. Fix: a 1xx or 204 is relayed without
/// framing headers (a 304 keeps its `Content-Length`, which describes the
/// representation).
#[tokio::test(flavor = "multi_thread")]
async fn a_bodiless_answer_is_relayed_without_framing() {
    use tokio::io::AsyncWriteExt;
    let (upstream, _) = raw_backend(move |mut conn| async move {
        let mut buf = Vec::new();
        while read_request(&mut conn, &mut buf).await {
            let answer: &[u8] =
                b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n";
            if conn.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    let proxy = orders_proxy(upstream, "breaks-bodiless-framing").await;
    let answer = raw_exchange(
        proxy.addr,
        b"GET /status HTTP/1.1\r\nHost: shop.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 204"), "{answer}");
    let head = answer.to_ascii_lowercase();
    assert!(!head.contains("transfer-encoding"), "{answer}");
    assert!(!head.contains("content-length: 5"), "{answer}");
}

/// Scenario: an upstream refuses `POST /admin` (401) as soon as it has
/// read the head, without reading the body, and keeps the connection open
/// (Python's `http.server` does, for a handler that never reads the body).
/// A client's body there is another request: `GET /smuggled …`. The proxy
/// had written the whole body, so it pooled the connection; the upstream
/// then read the body as a request of its own, and its answer reached the
/// next client on that connection. Impact ("never leaks one", request
/// smuggling past the proxy's rules): one client chooses what the next one
/// reads. Fix: a connection is not pooled after an error answer to a
/// request with a body.
#[tokio::test(flavor = "multi_thread")]
async fn a_body_an_upstream_refused_unread_never_answers_the_next_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (upstream, _) = raw_backend(|mut conn| async move {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
                continue;
            };
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let answer: &[u8] = if head.starts_with("POST /admin ") {
                // Refused unread: only the head is consumed.
                buf.drain(..end + 4);
                b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 6\r\n\r\ndenied"
            } else if head.starts_with("GET /page ") {
                // A page whose handler never reads a GET's body.
                buf.drain(..end + 4);
                b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\npage"
            } else {
                let mut rest = buf.split_off(end + 4);
                buf.clear();
                let length: usize = head
                    .to_ascii_lowercase()
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length:"))
                    .map_or(0, |value| value.trim().parse().unwrap_or(0));
                while rest.len() < length {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => rest.extend_from_slice(&chunk[..n]),
                    }
                }
                buf.extend_from_slice(&rest[length..]);
                if head.starts_with("GET /smuggled ") {
                    // A slow handler: it answers once the next request
                    // is on the connection.
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nSMUGGLED!"
                } else {
                    b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done"
                }
            };
            if conn.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    let proxy = orders_proxy(upstream, "breaks-refused-unread").await;
    let smuggled = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    // An error answer, and (from a later review) a success to a `GET`
    // whose body its handler ignores.
    for (method, path, status) in [("POST", "/admin", 401), ("GET", "/page", 200)] {
        let answered = proxy.send(method, path, &[], smuggled).await;
        assert_eq!(answered.status, status);
        for n in 0..3 {
            let key = format!("order-after-{status}-{n}");
            assert_eq!(
                json_order(&proxy, &key).await,
                (201, "order-done".to_owned()),
                "after {method} {path}: the order got the answer to a request smuggled in a body"
            );
        }
    }
    // From a later review: the same on Pingora's path, which takes the
    // bodies the direct path leaves to it (over 16 KiB here) and pooled
    // its connection after any answer; the next such request (an upload
    // the proxy does not cover) got the smuggled request's answer.
    let padding = 20 * 1024;
    let smuggled = format!(
        "GET /smuggled HTTP/1.1\r\nHost: x\r\nContent-Length: {padding}\r\n\r\n{}",
        "p".repeat(padding)
    );
    // And (from a review of that fix) a small body behind `Upgrade:
    // websocket`, which takes Pingora's path, where it asks for an upgrade
    // (Pingora lists it in `Connection`): exempt from the fix as an
    // upgrade, its refusal (401, the body unread) left the connection
    // pooled.
    let small = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n".to_owned();
    for (method, path, status, headers, body) in [
        ("POST", "/admin", 401, &[][..], &smuggled),
        ("GET", "/page", 200, &[][..], &smuggled),
        (
            "POST",
            "/admin",
            401,
            &[("upgrade", "websocket")][..],
            &small,
        ),
    ] {
        let answered = proxy.send(method, path, headers, body.clone()).await;
        assert_eq!(answered.status, status);
        for n in 0..3 {
            let upload = proxy
                .send("POST", "/upload", &[], "u".repeat(padding))
                .await;
            assert_eq!(
                (upload.status, upload.text().as_str()),
                (201, "order-done"),
                "upload {n} after {method} {path} {headers:?}: it got the answer to a request smuggled in a body"
            );
        }
    }
}

/// A covered `POST /orders` with `key` and an empty JSON body, through
/// `proxy`: its status and body.
async fn json_order(proxy: &Proxy, key: &str) -> (u16, String) {
    let headers = [
        ("idempotency-key", key),
        ("content-type", "application/json"),
    ];
    let order = proxy.send("POST", "/orders", &headers, "{}").await;
    (order.status, order.text())
}

/// Writes `request` to the proxy at `addr` and reads until it closes.
async fn raw_exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    let mut received = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        conn.read_to_end(&mut received),
    )
    .await;
    String::from_utf8_lossy(&received).into_owned()
}

/// Scenario: request targets the proxy read differently from the
/// backend. Pingora reads `POST x:/orders` (neither a path nor an
/// `http(s)` URL) as `/` and forwards it as it came; Rack (Puma), Django
/// (gunicorn) and Go read `/orders`, so the required route was skipped and
/// every keyless retry ran. A target that is not UTF-8 was read with its
/// bytes replaced, so `/orders/\xff` and `/orders/\xfe` shared one scope
/// and fingerprint (a replay of another account's order). An absolute-form
/// target without `Host` named a tenant the scope never saw, and so did
/// an HTTP/1.1 request without `Host`. A target starting with `//` was a
/// path to the proxy (`//evil.example/orders` merged to
/// `/evil.example/orders`, no route) but the path `/orders` on another
/// host to Python's `urlsplit` and Node's `new URL`. Impact ("at most one
/// execution", "never leaks one"). Fix: such targets get 400 and are never
/// forwarded (a `//` target only where either reading is covered).
/// Two `Host` lines (RFC 9112, 3.2: a server must answer 400): the engine
/// would scope by both, but a backend reads one of them, the first or the
/// last, and may serve another tenant's host: refused before anything is
/// forwarded, covered or not (from an audit of the host guarantee).
#[tokio::test(flavor = "multi_thread")]
async fn a_request_with_two_host_lines_is_refused() {
    let (upstream, accepted) =
        closing_backend(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok").await;
    let dir = temp_dir("breaks-two-hosts");
    let config = "[[route]]\npath = \"/orders\"\nmethods = [\"POST\"]\n";
    let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir);
    for request in [
        &b"POST /orders HTTP/1.1\r\nHost: shop-a.example\r\nHost: shop-b.example\r\n\
           Idempotency-Key: order-1001\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"[..],
        b"GET /status HTTP/1.1\r\nHost: shop-a.example\r\nHost: shop-b.example\r\n\
          Connection: close\r\n\r\n",
    ] {
        // (Pingora's HTTP/1 parser refuses it first, with a bare 400; the
        // proxy's own check stands behind it.)
        let answer = raw_exchange(proxy.addr, request).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "nothing was forwarded");
    let answer = raw_exchange(
        proxy.addr,
        b"GET /status HTTP/1.1\r\nHost: shop-a.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}

#[tokio::test(flavor = "multi_thread")]
async fn request_targets_the_proxy_cannot_read_as_the_backend_does_are_refused() {
    let (upstream, accepted) =
        closing_backend(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok").await;
    let dir = temp_dir("breaks-targets");
    let config = "[[route]]\npath = \"/orders\"\nmethods = [\"POST\"]\nrequired = true\n";
    let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir);
    // Python's `urlsplit` and Node's `new URL` read `//shop.example/orders`
    // as the path `/orders` (on another host); the proxy merges slashes.
    for target in [
        &b"x:/orders"[..],
        b"orders",
        b"/orders/\xff",
        b"http://shop.example/orders",
        b"//shop.example/orders",
        b"//evil.example/orders?x=1",
        b"//orders",
        b"/\\evil.example/orders",
        b"///shop.example/orders",
        b"/\\/shop.example/orders",
        b"//shop.example/a\\..\\orders",
        b"/orders",
    ] {
        // The last: HTTP/1.1 without `Host`.
        let host: &[u8] = match target.starts_with(b"http:") || target == b"/orders" {
            true => b"",
            false => b"Host: shop.example\r\n",
        };
        let request = [
            &b"POST "[..],
            target,
            b" HTTP/1.1\r\n",
            host,
            b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
        ]
        .concat();
        let answer = raw_exchange(proxy.addr, &request).await;
        let shown = String::from_utf8_lossy(target);
        assert!(answer.starts_with("HTTP/1.1 400"), "{shown}: {answer}");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "nothing was forwarded");
    // The forms a backend reads as the proxy does still pass.
    let answer = raw_exchange(
        proxy.addr,
        b"GET http://shop.example/status HTTP/1.1\r\nHost: shop.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let answer = raw_exchange(
        proxy.addr,
        b"GET //static/site.css HTTP/1.1\r\nHost: shop.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    // A `\` in the query is the query's.
    let answer = raw_exchange(
        proxy.addr,
        b"POST /orders?note=C:\\tmp HTTP/1.1\r\nHost: shop.example\r\nIdempotency-Key: q-1\r\n\
          Content-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
}

/// A WebSocket upgrade still goes through Pingora's path now that it asks
/// the upstream to close (`Connection: upgrade, close`): the upstream sees
/// `upgrade` listed, answers 101, and bytes flow both ways.
#[tokio::test(flavor = "multi_thread")]
async fn an_upgrade_still_switches_protocols() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (upstream, _) = raw_backend(|mut conn| async move {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if conn.read(&mut byte).await.unwrap_or(0) == 0 {
                return;
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        let asked = head
            .lines()
            .any(|line| line.starts_with("connection:") && line.contains("upgrade"));
        if !asked {
            let _ = conn
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .await;
            return;
        }
        let switched =
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
        if conn.write_all(switched).await.is_err() {
            return;
        }
        let mut buf = [0u8; 64];
        while let Ok(n) = conn.read(&mut buf).await {
            if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    })
    .await;
    let proxy = orders_proxy(upstream, "breaks-upgrade").await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(
            b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
              Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    let read_head = async {
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(client.read(&mut byte).await.unwrap(), 1, "closed mid-head");
            head.push(byte[0]);
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), read_head)
        .await
        .expect("an answer to the upgrade");
    let head = String::from_utf8_lossy(&head).into_owned();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    client.write_all(b"ping").await.unwrap();
    let mut echoed = [0u8; 4];
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        client.read_exact(&mut echoed),
    )
    .await
    .expect("the echo")
    .unwrap();
    assert_eq!(&echoed, b"ping");
}

/// Scenario (from a review of the response path): an upstream that keeps
/// its connection busy without ever finishing — interim `102 Processing`
/// answers every 200 ms, or a body trickled a byte at a time — never
/// trips `read_timeout` (each read is quick), and the exchange held its
/// key in flight for as long as the upstream liked: every retry got 409
/// `in-flight`, the client's task and the connection stayed taken. Impact
/// (availability; a key stuck). Now the exchange ends at the route's
/// `execution_timeout`, as the layer's does, and the key keeps "executed,
/// outcome unknown": the retry is replayed the 504, the order ran once.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_never_finishes_holds_its_key_no_longer_than_execution_timeout() {
    use tokio::io::AsyncWriteExt;
    for trickle in [false, true] {
        let (upstream, calls) = raw_backend(move |mut conn| async move {
            if !read_request(&mut conn, &mut Vec::new()).await {
                return;
            }
            if trickle {
                let head = b"HTTP/1.1 201 Created\r\nContent-Length: 1000\r\n\r\n";
                let _ = conn.write_all(head).await;
            }
            for _ in 0..150 {
                let bytes: &[u8] = match trickle {
                    true => b"x",
                    false => b"HTTP/1.1 102 Processing\r\n\r\n",
                };
                if conn.write_all(bytes).await.is_err() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        })
        .await;
        let dir = temp_dir("breaks-stall");
        let config = "[proxy]\nread_timeout = \"10s\"\n\n[[route]]\npath = \"/orders\"\n\
                      methods = [\"POST\"]\nexecution_timeout = \"1s\"\n";
        let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
            .await
            .owning(dir);
        let key = format!("order-stall-{trickle}");
        let headers = [
            ("idempotency-key", key.as_str()),
            ("content-type", "application/json"),
        ];
        let first = common::spawn_post(proxy.addr, "/orders", &headers, "{}");
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        let retry = proxy.send("POST", "/orders", &headers, "{}").await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (504, true),
            "trickle {trickle}: {}",
            retry.text()
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "trickle {trickle}");
        first.abort();
    }
}

/// Sends `request` (raw bytes) on a new connection and reads until the
/// proxy closes it: the answer as an HTTP/1.0 client reads it.
async fn exchange_raw(addr: std::net::SocketAddr, request: &str) -> String {
    let (answer, read) = common::send_raw(addr, request).await;
    read.unwrap();
    answer
}

/// Scenario (from a review of the response path): an HTTP/1.0 client (it
/// reads a body to the connection's close and knows no chunks) sends an
/// order; the upstream answers chunked. The proxy relayed the chunks as
/// they came, and the client kept `4\r\ndone\r\n0\r\n\r\n` as its body
/// while retries were replayed `done`: the first caller's answer was not
/// the stored one. Impact ("never loses a response"). Now an HTTP/1.0
/// client gets the body framed by the close, on the covered path and on
/// Pingora's path for uncovered requests alike.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_1_0_client_never_gets_chunks() {
    let (upstream, calls) = closing_backend(
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n4\r\ndone\r\n0\r\n\r\n",
    )
    .await;
    let proxy = orders_proxy(upstream, "breaks-http10-client").await;
    let order = "POST /orders HTTP/1.0\r\nHost: shop.example\r\nIdempotency-Key: order-10\r\n\
                 Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let plain = "POST /status HTTP/1.0\r\nHost: shop.example\r\nContent-Length: 2\r\n\r\n{}";
    for request in [order, plain] {
        let answer = exchange_raw(proxy.addr, request).await;
        let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
        assert!(
            head.starts_with("HTTP/1.") && head.contains(" 201"),
            "{answer}"
        );
        let head = head.to_ascii_lowercase();
        assert!(!head.contains("transfer-encoding"), "{answer}");
        assert!(!head.contains("keep-alive"), "{answer}");
        assert_eq!(body, "done", "{request}");
        if request == order {
            // Recorded: held and given its length.
            assert!(head.contains("content-length: 4"), "{answer}");
        }
    }
    let retry = exchange_raw(proxy.addr, order).await;
    let (head, body) = retry.split_once("\r\n\r\n").expect("a head");
    assert!(
        head.to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{retry}"
    );
    assert_eq!(body, "done");
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Cut mid-body: framed by the close, the cut would look like an end
    // (a front nginx, whose default proxy_http_version is 1.0, would
    // hand the truncated 201 on as whole). The recorded answer is held
    // and given a length, so the client never gets it as complete.
    let (upstream, _) = closing_backend(
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n4\r\ndo",
    )
    .await;
    let proxy = orders_proxy(upstream, "breaks-http10-cut").await;
    let answer = exchange_raw(proxy.addr, order).await;
    let complete = answer.split_once("\r\n\r\n").is_some_and(|(head, body)| {
        let head = head.to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:").map(str::trim));
        head.contains(" 201") && length.is_none_or(|length| length == body.len().to_string())
    });
    assert!(
        !complete,
        "a cut answer reached an HTTP/1.0 client as complete: {answer}"
    );
    // Nor another answer than the key's outcome (a 502 saying "retry").
    assert!(answer.is_empty(), "{answer}");
}

/// Scenario (from a review of the route readings): a request target of
/// thousands of PHP front-controller segments (`/x.php/x.php/…/pay`) was
/// read one controller deeper per segment, in recursion, until the stack
/// overflowed and the proxy aborted: one request took every client's
/// service down. Impact (availability, and every key in flight left to
/// its lease). Now it is answered like any request, and the proxy serves
/// the next one.
#[tokio::test(flavor = "multi_thread")]
async fn a_target_of_many_front_controllers_never_brings_the_proxy_down() {
    let backend = common::Backend::start().await;
    let dir = temp_dir("breaks-front-controllers");
    let config = "[[route]]\npath = \"/pay\"\nrequired = true\n";
    let proxy = Proxy::start(ProxyArgs::new(backend.url(), config, &dir))
        .await
        .owning(dir);
    let deep = format!("{}/pay", "/x.php".repeat(8_000));
    let request = format!(
        "POST {deep} HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    let answer = exchange_raw(proxy.addr, &request).await;
    assert!(
        answer.starts_with("HTTP/1.1 4"),
        "{}",
        &answer[..answer.len().min(300)]
    );
    assert_eq!(backend.total(), 0, "the unprotected request was forwarded");
    let next = proxy
        .send("POST", "/pay", &[("idempotency-key", "after-deep")], "{}")
        .await;
    assert_eq!(next.status, 200, "{}", next.text());
}

/// Python's own `http.server` (not a backend of ours) speaking HTTP/1.1:
/// `GET`, `HEAD`, `DELETE` and `OPTIONS` of any path answer a page
/// without reading a body, as a handler that ignores such bodies does;
/// `POST` reads its body and writes a line per execution to the log.
const PYTHON_BACKEND: &str = r#"
import http.server, sys
log = open(sys.argv[1], "a", buffering=1)
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def page(self):
        self.send_response(200)
        self.send_header("Content-Length", "4")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(b"page")
    do_GET = do_HEAD = do_DELETE = do_OPTIONS = page
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        log.write("%s %s\n" % (self.path, self.headers.get("Idempotency-Key")))
        self.send_response(201)
        self.send_header("Content-Length", "10")
        self.end_headers()
        self.wfile.write(b"order-done")
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

/// Scenario (from a review of the framing): a client sends `GET /page`
/// (or `HEAD`, `DELETE`, `OPTIONS`) with a body that is a whole covered
/// request, `POST /orders` under a key the proxy has already stored.
/// Python's `http.server` answers the page without reading the body and,
/// the connection kept alive, reads the body as its next request and runs
/// the order. The proxy no longer pooled such a connection, but the
/// upstream had the body in its buffer already. Impact ("at most one
/// execution"; `required` keys, scopes and every rule bypassed): each
/// such request executed the order once more. Fix: these requests say
/// `Connection: close`, and the upstream reads nothing after their head.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_smuggled_in_an_ignored_body_never_runs() {
    use std::io::BufRead;
    let dir = temp_dir("breaks-smuggled-ignored-body");
    let log = dir.join("executions.log");
    std::fs::write(&log, "").unwrap();
    let mut python = std::process::Command::new("python3")
        .args(["-c", PYTHON_BACKEND])
        .arg(&log)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut port = String::new();
    std::io::BufReader::new(python.stdout.take().unwrap())
        .read_line(&mut port)
        .unwrap();
    let upstream = format!("http://127.0.0.1:{}", port.trim());
    let proxy = orders_proxy(upstream, "breaks-smuggled-ignored-body-proxy").await;
    let executions = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|line| line.starts_with("/orders "))
            .count()
    };
    assert_eq!(json_order(&proxy, "order-smuggled").await.0, 201);
    assert_eq!(executions(), 1);
    let smuggled = "POST /orders HTTP/1.1\r\nHost: shop.example\r\n\
        Idempotency-Key: order-smuggled\r\nContent-Type: application/json\r\n\
        Content-Length: 2\r\n\r\n{}";
    for method in ["GET", "HEAD", "DELETE", "OPTIONS"] {
        for _ in 0..3 {
            let page = proxy.send(method, "/page", &[], smuggled).await;
            assert_eq!(page.status, 200, "{method}");
        }
    }
    // The covered order again, as the proxy sees it: a replay.
    let retry = json_order(&proxy, "order-smuggled").await;
    assert_eq!(retry, (201, "order-done".to_owned()));
    // What an upstream runs from its buffer, it runs within milliseconds.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let _ = python.kill();
    let _ = python.wait();
    assert_eq!(
        executions(),
        1,
        "the order smuggled in an ignored body ran at the upstream: {}",
        std::fs::read_to_string(&log).unwrap()
    );
}

/// Scenario (from a review of the framing): an HTTP/1.0 client's covered
/// order says `Expect: 100-continue` and sends its body at once, as RFC
/// 9110 (10.1.1) has it: a server must ignore that expectation from
/// HTTP/1.0. The proxy answered `100 Continue` first, which an HTTP/1.0
/// intermediary may take for the final answer to the order.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_1_0_expectation_gets_no_interim_answer() {
    let (upstream, calls) =
        closing_backend(b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done").await;
    let proxy = orders_proxy(upstream, "breaks-http10-expect").await;
    let answer = raw_exchange(
        proxy.addr,
        b"POST /orders HTTP/1.0\r\nHost: shop.example\r\nIdempotency-Key: order-expect\r\n\
          Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await;
    let status_line = answer.lines().next().unwrap_or_default();
    assert!(status_line.ends_with(" 201 Created"), "{answer}");
    assert!(!answer.contains("100 Continue"), "{answer}");
    assert!(answer.ends_with("order-done"), "{answer}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// Scenario (from a review of the framing): a client says `Expect:
/// 100-continue` with a chunked body over the route's limit. The proxy
/// sends `100 Continue`, the client streams, the limit is crossed and the
/// 413 is written; the proxy then closed the connection with the body
/// still arriving, as if the client were still waiting: a close with
/// unread data resets the connection, which fails the client's upload and
/// can destroy the 413 before it is read (Linux's loopback kept it). The
/// rest of the body is drained first now (up to the linger bounds).
#[tokio::test(flavor = "multi_thread")]
async fn a_body_over_the_limit_after_100_continue_still_gets_its_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (upstream, calls) =
        closing_backend(b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\norder-done").await;
    let dir = temp_dir("breaks-expect-too-large");
    let config = "[[route]]\npath = \"/orders\"\nmethods = [\"POST\"]\nmax_body_bytes = 1024\n";
    let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir);
    for attempt in 0..5 {
        let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        conn.write_all(
            b"POST /orders HTTP/1.1\r\nHost: shop.example\r\nIdempotency-Key: order-large\r\n\
              Content-Type: application/json\r\nExpect: 100-continue\r\n\
              Transfer-Encoding: chunked\r\n\r\n",
        )
        .await
        .unwrap();
        let mut interim = [0u8; 25];
        conn.read_exact(&mut interim).await.unwrap();
        assert!(interim.starts_with(b"HTTP/1.1 100"), "{interim:?}");
        // A megabyte in 4 KiB chunks, as a client streaming an upload
        // does, whatever comes back meanwhile.
        let chunk = format!("1000\r\n{}\r\n", "x".repeat(4096));
        let mut written = 0;
        for _ in 0..256 {
            if conn.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
            written += 1;
        }
        let ended = conn.write_all(b"0\r\n\r\n").await.is_ok();
        assert!(
            written == 256 && ended,
            "attempt {attempt}: the connection was reset under the upload after {written} chunks"
        );
        let mut received = Vec::new();
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            conn.read_to_end(&mut received),
        )
        .await;
        let answer = String::from_utf8_lossy(&received);
        assert!(
            answer.starts_with("HTTP/1.1 413"),
            "attempt {attempt}: the 413 was lost: {answer:?}"
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "nothing reached the upstream"
    );
}

/// Scenario (from a review of the response side): an upstream answers a
/// covered order under `Transfer-Encoding: gzip, chunked` to an HTTP/1.0
/// client (a front nginx's default). An HTTP/1.0 client reads no
/// transfer codings, so the proxy drops the header and frames the body
/// itself, but only the chunks were decoded: the client got the gzip bytes
/// labelled as the plain body. The coding goes on as `Content-Encoding`.
#[tokio::test(flavor = "multi_thread")]
async fn a_transfer_coding_reaches_an_http_1_0_client_as_a_content_coding() {
    let (upstream, calls) = closing_backend(
        b"HTTP/1.1 201 Created\r\nContent-Encoding: br\r\nTransfer-Encoding: gzip, chunked\r\n\r\n\
          5\r\nCODED\r\n0\r\n\r\n",
    )
    .await;
    let proxy = orders_proxy(upstream, "breaks-te-http10").await;
    let answer = raw_exchange(
        proxy.addr,
        b"POST /orders HTTP/1.0\r\nHost: shop.example\r\nIdempotency-Key: order-te-10\r\n\
          Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await;
    let (head, body) = answer.split_once("\r\n\r\n").expect("an answer");
    let head = head.to_ascii_lowercase();
    assert!(
        head.lines().next().unwrap().ends_with(" 201 created"),
        "{answer}"
    );
    assert!(!head.contains("transfer-encoding"), "{answer}");
    let codings: Vec<&str> = head
        .lines()
        .filter_map(|line| line.strip_prefix("content-encoding:"))
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .collect();
    assert_eq!(codings, ["br", "gzip"], "{answer}");
    assert_eq!(body, "CODED");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// From a review of that fix: the answer to an HTTP/1.0 `HEAD` has no
/// body to carry a coding, so a transfer coding moved into
/// `Content-Encoding` there relabelled the representation (a cache that
/// refreshes its stored `GET` from a `HEAD` would read the plain body as
/// gzip). It is dropped instead.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_1_0_head_gets_no_content_coding_from_a_transfer_coding() {
    let (upstream, _) =
        closing_backend(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n").await;
    let proxy = orders_proxy(upstream, "breaks-te-head-10").await;
    let answer = raw_exchange(
        proxy.addr,
        b"HEAD /page HTTP/1.0\r\nHost: shop.example\r\n\r\n",
    )
    .await;
    let head = answer.to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 200") || head.starts_with("http/1.0 200"),
        "{answer}"
    );
    assert!(!head.contains("content-encoding"), "{answer}");
    assert!(!head.contains("transfer-encoding"), "{answer}");
}

/// Scenario (a review of the response side): a backend that writes a body
/// after a `204 No Content` anyway, a moment later (a framework that
/// flushes the head, then the body it was given; RFC 9110 says a 204 ends
/// at its head). The proxy relays the 204 and pools the connection; the
/// next covered request takes it before the stray bytes arrive, and they
/// are read as its answer: `forged` relayed to another client and stored
/// as its key's outcome (replayed for the TTL), while the answer the
/// backend gave it was thrown away. Impact ("no leaked response", "no lost
/// response"). A connection whose last answer was a 204 or 304 no longer
/// carries a request a key rides on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_written_after_a_204_never_answers_the_next_key() {
    use tokio::io::AsyncWriteExt;
    let executed = Arc::new(AtomicUsize::new(0));
    let count = executed.clone();
    let (upstream, _) = raw_backend(move |mut conn| {
        let count = count.clone();
        async move {
            let mut buf = Vec::new();
            while let Some(head) = read_request_head(&mut conn, &mut buf).await {
                let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                if head.starts_with("post /orders/late ") {
                    let _ = conn.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    let forged = b"HTTP/1.1 201 Created\r\nContent-Length: 6\r\n\r\nforged";
                    let _ = conn.write_all(forged).await;
                } else if head.starts_with("get /page ") {
                    // Slow: its answer comes after the next request took
                    // the connection, if one did.
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    let page = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\npage";
                    let _ = conn.write_all(page).await;
                } else {
                    let body = format!("victim-{n}");
                    let answer = format!(
                        "HTTP/1.1 201 Created\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(answer.as_bytes()).await;
                }
            }
        }
    })
    .await;
    let dir = temp_dir("late-204");
    let config = "[[route]]\npath = \"/orders/**\"\nmethods = [\"POST\"]\n";
    let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir);
    let late = proxy
        .send("POST", "/orders/late", &[("idempotency-key", "ka")], "{}")
        .await;
    assert_eq!(late.status, 204);
    let victim = proxy
        .send("POST", "/orders/victim", &[("idempotency-key", "kb")], "{}")
        .await;
    assert!(
        victim.text().starts_with("victim-"),
        "the next key got another request's bytes: {} {:?}",
        victim.status,
        victim.text()
    );
    let replay = proxy
        .send("POST", "/orders/victim", &[("idempotency-key", "kb")], "{}")
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), victim.text(), "the stored answer is its own");
    assert_eq!(executed.load(Ordering::SeqCst), 2);

    // The mark stays: an uncovered request may take the connection (and
    // read the stray bytes as its answer, as behind any keep-alive proxy),
    // but its own answer, late, then waits on it for the next request.
    let late = proxy
        .send("POST", "/orders/late", &[("idempotency-key", "kc")], "{}")
        .await;
    assert_eq!(late.status, 204);
    let page = proxy.send("GET", "/page", &[], "").await;
    assert_eq!(page.text(), "forged", "the uncovered request took it");
    let victim = proxy
        .send("POST", "/orders/victim", &[("idempotency-key", "kd")], "{}")
        .await;
    assert!(
        victim.text().starts_with("victim-"),
        "a key got another request's answer: {} {:?}",
        victim.status,
        victim.text()
    );
}

/// Scenario: a backend that answers a covered `POST` with `101 Switching
/// Protocols` (RFC 9110 forbids it for a request that asks for no
/// upgrade, and the proxy sends none on a covered request). The proxy
/// took the 101 as the final answer, which stores nothing and released
/// the key: the retry with the same key ran the order again. Impact ("at
/// most one execution"). A 101 there is now a broken answer after the
/// request was sent: 502, kept as the key's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_to_a_covered_post_never_releases_its_key() {
    use tokio::io::AsyncWriteExt;
    let (upstream, accepted) = raw_backend(|mut conn| async move {
        if read_request(&mut conn, &mut Vec::new()).await {
            let _ = conn
                .write_all(b"HTTP/1.1 101 Switching Protocols\r\n\r\nhello")
                .await;
            let _ = conn.shutdown().await;
        }
    })
    .await;
    let proxy = orders_proxy(upstream, "covered-101").await;
    let first = proxy
        .send("POST", "/orders", &[("idempotency-key", "k101")], "{}")
        .await;
    assert_eq!(first.status, 502, "{:?}", first.text());
    let retry = proxy
        .send("POST", "/orders", &[("idempotency-key", "k101")], "{}")
        .await;
    // The 502 is the key's outcome: the retry replays it.
    assert_eq!(
        (retry.status, retry.replayed()),
        (502, true),
        "{:?}",
        retry.text()
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "the retry ran again");
}

/// Scenario (a review of the seeds' flows): the Laravel and Django recipes
/// covered `path = "/contact"`, a prefix, so a resource route's delete form
/// (`POST /contact/5` with `_method=DELETE`, no submission token) and any
/// other form under `/contact/` were refused 400 `key-missing` by the
/// `required` route. The recipes' glob covers `/contact` and `/contact/`,
/// not the paths below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_form_recipes_cover_the_form_and_not_the_resources_under_it() {
    let (upstream, answered) =
        closing_backend(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            .await;
    let dir = temp_dir("recipe-path");
    let proxy = Proxy::start(ProxyArgs::new(upstream, DJANGO, &dir))
        .await
        .owning(dir);
    let form = [("content-type", "application/x-www-form-urlencoded")];
    for path in ["/contact/5", "/contact/thanks/feedback"] {
        let reply = proxy.send("POST", path, &form, "_method=DELETE").await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
    }
    assert_eq!(answered.load(Ordering::SeqCst), 2);
    for path in ["/contact", "/contact/"] {
        let reply = proxy.send("POST", path, &form, "name=A").await;
        assert_eq!(reply.status, 400, "{path} is the form: {}", reply.text());
    }
    assert_eq!(answered.load(Ordering::SeqCst), 2);
}

/// Scenario (a review of the seeds' flows): a form posted from a browser,
/// and a backend that dies without answering (a crashed PHP worker). The
/// first attempt gets the readable 502 page; the key is kept as "executed,
/// outcome unknown", stored as JSON, and the browser's retry (back and
/// send again, the same hidden token) was shown that JSON raw. A client
/// that prefers HTML now gets the page, marked replayed; one that takes
/// JSON the stored bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_is_replayed_to_a_browser_as_its_page() {
    let (upstream, answered) = closing_backend(b"").await;
    let proxy = orders_proxy(upstream, "unknown-page").await;
    let browser = [
        ("idempotency-key", "k-page"),
        ("accept", "text/html,application/xhtml+xml;q=0.9,*/*;q=0.8"),
    ];
    let first = proxy.send("POST", "/orders", &browser, "{}").await;
    assert_eq!(first.status, 502);
    assert!(first
        .header("content-type")
        .unwrap()
        .starts_with("text/html"));
    let retry = proxy.send("POST", "/orders", &browser, "{}").await;
    assert_eq!(retry.status, 502);
    assert!(retry.replayed(), "{:?}", retry.text());
    assert!(
        retry
            .header("content-type")
            .unwrap()
            .starts_with("text/html"),
        "{:?}: {}",
        retry.header("content-type"),
        retry.text()
    );
    assert!(
        retry.text().contains("will not be executed again"),
        "{}",
        retry.text()
    );
    // Going back would render the form anew, with a new key: the page
    // says to check instead.
    assert!(
        retry.text().contains("check its result"),
        "{}",
        retry.text()
    );
    assert!(!retry.text().contains("go back"), "{}", retry.text());
    let api = proxy
        .send("POST", "/orders", &[("idempotency-key", "k-page")], "{}")
        .await;
    assert_eq!(api.status, 502);
    assert!(api.replayed());
    assert_eq!(api.header("content-type"), Some("application/problem+json"));
    assert_eq!(
        api.json()["type"],
        "urn:tower-idempotency:upstream-unavailable"
    );
    assert_eq!(answered.load(Ordering::SeqCst), 1, "executed once");
}

/// The review of that fix: a backend's own answer shaped like the engine's
/// problem (a service behind another idempotency layer, on a route that
/// stores 5xx) is the backend's response, replayed as stored, headers and
/// bytes, to a browser too: only the engine's own record is rendered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backends_lookalike_problem_is_replayed_as_stored() {
    let body = r#"{"type":"urn:tower-idempotency:upstream-unavailable","detail":"theirs"}"#;
    let answer = format!(
        "HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/problem+json\r\n\
         Problem-Type: urn:tower-idempotency:upstream-unavailable\r\nX-Theirs: 1\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let (upstream, answered) =
        closing_backend(Box::leak(answer.into_bytes().into_boxed_slice())).await;
    let dir = temp_dir("lookalike-problem");
    let config = "[[route]]\npath = \"/orders\"\nmethods = [\"POST\"]\n\
                  store_statuses = [\"2xx\", \"3xx\", \"5xx\"]\n";
    let proxy = Proxy::start(ProxyArgs::new(upstream, config, &dir))
        .await
        .owning(dir);
    let browser = [("idempotency-key", "k-theirs"), ("accept", "text/html")];
    let first = proxy.send("POST", "/orders", &browser, "{}").await;
    assert_eq!((first.status, first.text()), (502, body.to_owned()));
    let retry = proxy.send("POST", "/orders", &browser, "{}").await;
    assert!(retry.replayed());
    assert_eq!(retry.text(), body, "the backend's bytes");
    assert_eq!(retry.header("x-theirs"), Some("1"));
    assert_eq!(answered.load(Ordering::SeqCst), 1);
}

/// The review of the 204 fix: keyed requests skip connections whose last
/// answer was a 204, so a keyed API answering 204 opened a connection per
/// request and kept every one idle in the pool (up to 128, each an
/// upstream worker's slot for the idle timeout). At most a few marked
/// connections are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_api_answering_204_does_not_hoard_upstream_connections() {
    use tokio::io::AsyncWriteExt;
    let open = Arc::new(AtomicUsize::new(0));
    let count = open.clone();
    let (upstream, accepted) = raw_backend(move |mut conn| {
        let open = count.clone();
        async move {
            open.fetch_add(1, Ordering::SeqCst);
            let mut buf = Vec::new();
            while read_request(&mut conn, &mut buf).await {
                let _ = conn.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
            }
            open.fetch_sub(1, Ordering::SeqCst);
        }
    })
    .await;
    let proxy = orders_proxy(upstream, "hoarded-204").await;
    for n in 0..48 {
        let key = format!("k204-{n}");
        let reply = proxy
            .send("POST", "/orders", &[("idempotency-key", &key)], "{}")
            .await;
        assert_eq!(reply.status, 204);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 48, "one connection each");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while open.load(Ordering::SeqCst) > 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} upstream connections held idle",
            open.load(Ordering::SeqCst)
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
