//! Security properties of the layer: keys are scoped by principal, nothing
//! sensitive is stored or logged, sensitive headers are not replayed, and
//! problem responses never echo input.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use support::{post, post_json, Harness, Reply};
use tower_idempotency::{InFlightPolicy, Policy, Principal};

const KEY: &[u8] = b"SECRET-KEY-7f3a9c";
const PRINCIPAL: &str = "PRINCIPAL-alice-42";
const TOKEN: &str = "Bearer TOKEN-c2VjcmV0";
const BODY_MARK: &str = "BODY-CARD-4242424242424242";

fn as_principal(principal: &str, mut request: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    request
        .extensions_mut()
        .insert(Principal::new(principal.to_owned()));
    request
}

fn order(key: &[u8]) -> Request<Full<Bytes>> {
    post_json(key, format!(r#"{{"card":"{BODY_MARK}"}}"#))
}

#[tokio::test]
async fn principals_with_the_same_key_never_share_a_response() {
    let harness = Harness::new(Policy::default());
    let alice = harness.send(as_principal("alice", order(KEY))).await;
    let bob = harness.send(as_principal("bob", order(KEY))).await;
    let anonymous = harness.send(order(KEY)).await;
    for reply in [&alice, &bob, &anonymous] {
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
    }
    assert_eq!(harness.calls(), 3);
    let alice_again = harness.send(as_principal("alice", order(KEY))).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(harness.calls(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn principals_stay_apart_under_concurrency() {
    // Each execution lasts long enough for the duplicates to overlap it.
    let harness = Harness::new(Policy::default()).slow(Duration::from_millis(20));
    let requests = (0..50).map(|i| {
        let harness = harness.clone();
        let principal = if i % 2 == 0 { "alice" } else { "bob" };
        tokio::spawn(async move {
            let reply = harness.send(as_principal(principal, order(KEY))).await;
            (principal, reply)
        })
    });
    let replies: Vec<(&str, Reply)> = join_all(requests)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(harness.calls(), 2, "one execution per principal");
    let body_of = |who: &str| -> Vec<Bytes> {
        replies
            .iter()
            .filter(|(p, _)| *p == who)
            .map(|(_, reply)| {
                assert_eq!(reply.status, StatusCode::CREATED);
                reply.body.clone()
            })
            .collect()
    };
    let (alice, bob) = (body_of("alice"), body_of("bob"));
    assert_eq!(alice.len(), 25);
    assert!(alice.iter().all(|body| *body == alice[0]));
    assert!(bob.iter().all(|body| *body == bob[0]));
    assert_ne!(alice[0], bob[0]);
}

#[tokio::test]
async fn scope_headers_separate_callers() {
    let policy = Policy {
        scope_headers: vec!["authorization".into()],
        ..Policy::default()
    };
    let harness = Harness::new(policy);
    let mut replies = Vec::new();
    for token in ["Bearer one", "Bearer two", "Bearer one"] {
        let mut request = order(KEY);
        request
            .headers_mut()
            .insert("authorization", token.parse().unwrap());
        replies.push(harness.send(request).await);
    }
    assert_eq!(harness.calls(), 2);
    assert_ne!(replies[0].body, replies[1].body);
    assert!(replies[2].replayed());
    assert_eq!(replies[2].body, replies[0].body);
}

/// A session cookie as the scope: an HTTP/2 client may send each cookie
/// on a line of its own (RFC 9113, 8.2.3), its HTTP/1.1 retry the same
/// cookies on one line. Both are one caller: the retry replays; another
/// session's cookies are another caller.
#[tokio::test]
async fn cookies_split_over_lines_are_the_same_caller() {
    let harness = Harness::new(Policy {
        scope_headers: vec!["cookie".into()],
        ..Policy::default()
    });
    let with_cookies = |lines: &[&'static str]| {
        let mut request = order(KEY);
        for line in lines {
            let value = http::HeaderValue::from_static(line);
            request.headers_mut().append(http::header::COOKIE, value);
        }
        request
    };
    let split = harness
        .send(with_cookies(&["session=alice", "theme=dark"]))
        .await;
    assert_eq!(split.status, StatusCode::CREATED);
    let joined = harness
        .send(with_cookies(&["session=alice; theme=dark"]))
        .await;
    assert!(joined.replayed(), "{joined:?}");
    assert_eq!(joined.body, split.body);
    let bob = harness
        .send(with_cookies(&["session=bob", "theme=dark"]))
        .await;
    assert!(!bob.replayed());
    assert_ne!(bob.body, split.body);
    assert_eq!(harness.calls(), 2);
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuffer {
    type Writer = LogBuffer;

    fn make_writer(&'a self) -> LogBuffer {
        self.clone()
    }
}

/// Every outcome once, with the secret markers in key, principal, scope
/// header and body.
async fn run_every_outcome(harness: &Harness) {
    let secret = |request: Request<Full<Bytes>>| {
        let mut request = as_principal(PRINCIPAL, request);
        request
            .headers_mut()
            .insert("authorization", TOKEN.parse().unwrap());
        request
    };
    harness.send(secret(order(KEY))).await; // executed
    harness.send(secret(order(KEY))).await; // replayed
    let changed = post_json(KEY, format!(r#"{{"card":"{BODY_MARK}-2"}}"#));
    harness.send(secret(changed)).await; // mismatch
    let invalid = [KEY, b" <script>"].concat();
    harness
        .send(secret(post(&invalid).body(Full::default()).unwrap()))
        .await; // invalid key
    let too_long = [KEY.repeat(20), BODY_MARK.as_bytes().to_vec()].concat();
    harness
        .send(secret(post(&too_long).body(Full::default()).unwrap()))
        .await; // too long
    let failing = post(b"SECRET-KEY-fails")
        .header("x-fail", "1")
        .body(Full::new(Bytes::from(BODY_MARK)))
        .unwrap();
    harness.send(secret(failing)).await; // released after a 500
}

#[tokio::test]
async fn logs_hold_no_key_principal_or_body() {
    let logs = LogBuffer::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::FULL)
        .with_ansi(false)
        .finish();
    // Global, not `set_default`: a thread-local dispatcher races with the
    // callsite interest cache while other tests of this binary run, and
    // lines go missing. Every test here uses the same secrets, so their
    // lines must be clean as well.
    tracing::subscriber::set_global_default(subscriber).expect("only this test sets it");
    let policy = Policy {
        scope_headers: vec!["authorization".into()],
        ..Policy::default()
    };
    let harness = Harness::with_response(policy, |n, parts| {
        let status = if parts.headers.contains_key("x-fail") {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::CREATED
        };
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(format!("order {n}"))))
            .unwrap()
    });
    run_every_outcome(&harness).await;
    // Let the background release of the failed request log too.
    tokio::task::yield_now().await;
    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    for outcome in [
        "executed",
        "replayed",
        "mismatch",
        "invalid_key",
        "released",
    ] {
        assert!(logs.contains(outcome), "no {outcome} line in:\n{logs}");
    }
    for secret in ["SECRET-KEY", PRINCIPAL, "TOKEN-", "BODY-CARD", "<script>"] {
        assert!(
            !logs.contains(secret),
            "{secret} leaked into the logs:\n{logs}"
        );
    }
}

#[tokio::test]
async fn the_store_holds_no_key_principal_or_body() {
    let harness = Harness::new(Policy {
        scope_headers: vec!["authorization".into()],
        ..Policy::default()
    });
    run_every_outcome(&harness).await;
    assert!(!harness.store.is_empty());
    let state = format!("{:?}", harness.store);
    assert!(state.contains("order 1"), "the stored response is visible");
    for secret in ["SECRET-KEY", PRINCIPAL, "TOKEN-", "BODY-CARD"] {
        assert!(!state.contains(secret), "{secret} is in the store: {state}");
    }
}

fn loaded_response() -> Response<Full<Bytes>> {
    Response::builder()
        .status(StatusCode::OK)
        .header("set-cookie", "session=first-callers-session")
        .header("authorization", "Bearer leaked")
        .header("proxy-authenticate", "Basic")
        .header("connection", "x-conn-listed, keep-alive")
        .header("x-conn-listed", "hop")
        .header("keep-alive", "timeout=5")
        .header("trailer", "x-checksum")
        .header("upgrade", "h2c")
        .header("date", "Sun, 06 Nov 1994 08:49:37 GMT")
        .header("x-kept", "yes")
        .body(Full::new(Bytes::from_static(b"ok")))
        .unwrap()
}

#[tokio::test]
async fn sensitive_and_hop_by_hop_headers_are_not_replayed() {
    const NEVER: [&str; 9] = [
        "authorization",
        "proxy-authenticate",
        "connection",
        "x-conn-listed",
        "keep-alive",
        "trailer",
        "upgrade",
        "date",
        "transfer-encoding",
    ];
    for allow_cookie in [false, true] {
        let policy = Policy {
            replay_set_cookie: allow_cookie,
            ..Policy::default()
        };
        let harness = Harness::with_response(policy, |_, _| loaded_response());
        let first = harness.send(order(KEY)).await;
        assert_eq!(first.headers["set-cookie"], "session=first-callers-session");
        let replay = harness.send(order(KEY)).await;
        assert!(replay.replayed());
        assert_eq!(replay.headers["x-kept"], "yes");
        assert_eq!(replay.body, "ok");
        for name in NEVER {
            assert!(!replay.headers.contains_key(name), "{name} was replayed");
        }
        assert_eq!(replay.headers.contains_key("set-cookie"), allow_cookie);
        assert_eq!(harness.calls(), 1);
    }
}

/// Asserts an engine answer is a problem that echoes none of the input.
fn assert_clean_problem(reply: &Reply, status: StatusCode, kind: &str) {
    assert_eq!(reply.status, status, "{}", reply.text());
    assert_eq!(
        reply.problem_type(),
        format!("urn:tower-idempotency:{kind}")
    );
    let text = reply.text();
    for echoed in ["<", ">", "script", "SECRET", "BODY-CARD", "alert"] {
        assert!(!text.contains(echoed), "{kind} echoes {echoed:?}: {text}");
    }
}

#[tokio::test]
async fn problems_never_echo_raw_input() {
    let script = b"<script>alert(1)</script>";
    // An execution that is still running when its duplicate arrives.
    let harness = Harness::new(Policy {
        in_flight: InFlightPolicy::Reject,
        max_body_bytes: 64,
        ..Policy::default()
    })
    .slow(Duration::from_millis(20));
    let with_space = [&script[..], b" SECRET"].concat();
    let reply = harness
        .send(post(&with_space).body(Full::default()).unwrap())
        .await;
    assert_clean_problem(&reply, StatusCode::BAD_REQUEST, "key-invalid");
    let long = script.repeat(11);
    let reply = harness
        .send(post(&long).body(Full::default()).unwrap())
        .await;
    assert_clean_problem(&reply, StatusCode::BAD_REQUEST, "key-invalid");
    let reply = harness
        .send(post_json(
            script,
            format!("\"{}{BODY_MARK}\"", "<script>".repeat(9)),
        ))
        .await;
    assert_clean_problem(&reply, StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    // The script-like key itself is a valid key (visible ASCII).
    let (first, second) = tokio::join!(harness.send(order(script)), harness.send(order(script)));
    assert_eq!(first.status, StatusCode::CREATED);
    assert_clean_problem(&second, StatusCode::CONFLICT, "in-flight");
    let changed = post_json(script, r#"{"card":"<script>alert(2)</script>"}"#);
    let reply = harness.send(changed).await;
    assert_clean_problem(&reply, StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");

    let required = Harness::new(Policy::default().required(true));
    let reply = required
        .send(
            Request::post("/%3Cscript%3E?k=%3Cscript%3E")
                .body(Full::default())
                .unwrap(),
        )
        .await;
    assert_clean_problem(&reply, StatusCode::BAD_REQUEST, "key-missing");
}
