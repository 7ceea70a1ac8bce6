//! Hostile input through the tower layer: malformed keys, oversized and
//! malformed bodies. Every refusal is a 400/413 problem, the inner service
//! never runs, and nothing is reserved; every odd body is fingerprinted
//! consistently.

mod support;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use support::{post, post_json, Harness};
use tower_idempotency::fingerprint::MAX_JSON_DEPTH;
use tower_idempotency::policy::MIB;
use tower_idempotency::{KeySource, Policy};

const KEY_INVALID: &str = "urn:tower-idempotency:key-invalid";

async fn assert_refused(harness: &Harness, request: Request<Full<Bytes>>, case: &str) {
    let reply = harness.send(request).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{case}");
    assert_eq!(reply.problem_type(), KEY_INVALID, "{case}");
    assert_eq!(harness.calls(), 0, "{case}: the inner service ran");
    assert!(harness.store.is_empty(), "{case}: something was reserved");
}

#[tokio::test]
async fn malformed_keys_get_400_and_reserve_nothing() {
    let harness = Harness::new(Policy::default());
    let too_long = vec![b'k'; 256];
    let quoted_too_long = [&b"\""[..], &too_long, b"\""].concat();
    let cases: &[(&str, &[u8])] = &[
        ("empty", b""),
        ("empty quoted", b"\"\""),
        ("256 bytes", &too_long),
        ("256 bytes quoted", &quoted_too_long),
        ("tab", b"a\tb"),
        ("space", b"a b"),
        ("leading space", b" abc"),
        ("UTF-8", "café".as_bytes()),
        ("raw high bytes", b"\xff\xfe\x80"),
        ("UTF-8 quoted", "\"café\"".as_bytes()),
        ("merged list", b"key-1,key-2"),
        ("merged quoted list", br#""key-1", "key-2""#),
        ("parameter", b"key;x=1"),
        ("quoted with parameter", br#""key";x=1"#),
        ("stray quote", br#"ab"c"#),
        ("unterminated quote", br#""abc"#),
        ("bad escape", br#""a\nb""#),
        ("escaped tab", b"\"a\\\tb\""),
    ];
    for (case, key) in cases {
        assert_refused(&harness, post(key).body(Full::default()).unwrap(), case).await;
    }
}

#[tokio::test]
async fn control_characters_cannot_even_reach_the_layer() {
    // CR, LF, NUL and DEL are refused by `http` itself: no header injection
    // can be smuggled inside a key value.
    for bad in [
        &b"a\r\nX-Injected: 1"[..],
        b"a\nb",
        b"a\0b",
        b"a\x7fb",
        b"a\x01b",
    ] {
        assert!(HeaderValue::from_bytes(bad).is_err(), "{bad:?}");
    }
}

#[tokio::test]
async fn several_key_headers_get_400() {
    let harness = Harness::new(Policy::default());
    for (first, second) in [("same", "same"), ("one", "two")] {
        let request = post(first.as_bytes())
            .header("Idempotency-Key", second)
            .body(Full::default())
            .unwrap();
        assert_refused(&harness, request, "repeated header").await;
    }
}

#[tokio::test]
async fn keys_at_the_limits_are_accepted_and_quoting_is_transparent() {
    let harness = Harness::new(Policy::default());
    let longest = vec![b'~'; 255];
    let first = harness
        .send(post(&longest).body(Full::default()).unwrap())
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    // A bare key and the same key as a quoted sf-string are one key.
    let quoted = [&b"\""[..], &longest, b"\""].concat();
    let again = harness
        .send(post(&quoted).body(Full::default()).unwrap())
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // Delimiters are fine inside quotes.
    let tricky = harness
        .send(post(br#""a,b;c\"d\\""#).body(Full::default()).unwrap())
        .await;
    assert_eq!(tricky.status, StatusCode::CREATED);
    assert_eq!(harness.calls(), 2);
}

static CHUNK: [u8; 64 * 1024] = [b'x'; 64 * 1024];

/// A request body that would yield `left` bytes, counting what it yielded.
struct Flood {
    left: usize,
    yielded: Arc<AtomicUsize>,
    declared: bool,
}

impl Body for Flood {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(CHUNK.len());
        self.left -= n;
        self.yielded.fetch_add(n, Ordering::SeqCst);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(&CHUNK[..n])))))
    }

    fn size_hint(&self) -> SizeHint {
        if self.declared {
            SizeHint::with_exact(self.left as u64)
        } else {
            SizeHint::default()
        }
    }
}

#[tokio::test]
async fn oversized_bodies_get_413_without_being_read() {
    let harness = Harness::new(Policy::default());
    for declared in [false, true] {
        let yielded = Arc::new(AtomicUsize::new(0));
        let body = Flood {
            left: 100 * MIB,
            yielded: yielded.clone(),
            declared,
        };
        let reply = harness.send(post(b"big").body(body).unwrap()).await;
        assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(reply.problem_type(), "urn:tower-idempotency:body-too-large");
        let read = yielded.load(Ordering::SeqCst);
        if declared {
            // A declared length over the limit is refused before any read.
            assert_eq!(read, 0);
        } else {
            // An undeclared one is read up to the limit and no further.
            assert!(read <= MIB + CHUNK.len(), "read {read} bytes");
        }
    }
    assert_eq!(harness.calls(), 0);
    assert!(harness.store.is_empty());
    // Exactly at the limit is fine.
    let body = Flood {
        left: MIB,
        yielded: Arc::default(),
        declared: false,
    };
    let reply = harness.send(post(b"big").body(body).unwrap()).await;
    assert_eq!(reply.status, StatusCode::CREATED);
}

/// One chunk, then an error: a client that went away mid-body.
struct Broken(bool);

impl Body for Broken {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if std::mem::replace(&mut self.0, true) {
            Poll::Ready(Some(Err(std::io::ErrorKind::ConnectionReset.into())))
        } else {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"{\"a\":")))))
        }
    }
}

#[tokio::test]
async fn a_body_cut_off_midway_reserves_nothing() {
    let harness = Harness::new(Policy::default());
    let reply = harness
        .send(post(b"cut").body(Broken(false)).unwrap())
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        reply.problem_type(),
        "urn:tower-idempotency:body-unreadable"
    );
    assert_eq!(harness.calls(), 0);
    assert!(harness.store.is_empty());
}

/// Sends `first` then each of `same` (expecting replays) and each of
/// `different` (expecting 422), all with one key.
async fn assert_fingerprints(first: &[u8], same: &[&[u8]], different: &[&[u8]]) {
    let harness = Harness::new(Policy::default());
    let key = b"fp-key";
    let original = harness
        .send(post_json(key, Bytes::copy_from_slice(first)))
        .await;
    assert_eq!(original.status, StatusCode::CREATED);
    for body in same {
        let reply = harness
            .send(post_json(key, Bytes::copy_from_slice(body)))
            .await;
        assert!(
            reply.replayed(),
            "{:?} should replay",
            String::from_utf8_lossy(body)
        );
        assert_eq!(reply.body, original.body);
    }
    for body in different {
        let reply = harness
            .send(post_json(key, Bytes::copy_from_slice(body)))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{:?} should be a mismatch",
            String::from_utf8_lossy(body)
        );
    }
    assert_eq!(harness.calls(), 1);
}

#[tokio::test]
async fn invalid_utf8_under_json_is_raw_bytes() {
    assert_fingerprints(
        b"{\"name\":\"\xff\xfe\"}",
        &[b"{\"name\":\"\xff\xfe\"}"],
        &[b"{\"name\":\"\xff\xfd\"}", b"{\"name\": \"\xff\xfe\"}"],
    )
    .await;
}

#[tokio::test]
async fn non_json_under_json_is_raw_bytes() {
    // Not JSON, so whitespace and order are significant: raw bytes.
    assert_fingerprints(
        b"{\"a\":1, \"b\":2",
        &[b"{\"a\":1, \"b\":2"],
        &[b"{\"a\":1,\"b\":2", b"{\"b\":2, \"a\":1"],
    )
    .await;
    assert_fingerprints(b"amount=10", &[b"amount=10"], &[b"amount=11"]).await;
}

#[tokio::test]
async fn json_nested_100000_deep_is_bounded() {
    let deep = |inner: &str| {
        let depth = 100_000;
        format!("{}{inner}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes()
    };
    // No stack overflow: past MAX_JSON_DEPTH the body is hashed raw.
    assert_fingerprints(&deep("1"), &[&deep("1")], &[&deep("2"), &deep(" 1")]).await;
    // Right below the bound it is still canonical JSON.
    let depth = MAX_JSON_DEPTH - 1;
    let nested = |inner: &str, ws: &str| {
        format!(
            "{}{inner}{}",
            "[".repeat(depth),
            format!("{ws}]").repeat(depth)
        )
        .into_bytes()
    };
    assert_fingerprints(
        &nested("1", ""),
        &[&nested("1", " \n")],
        &[&nested("2", "")],
    )
    .await;
}

/// 100,000 nested arrays next to the key: read without recursion (no
/// stack overflow), and the key is found, as `JSON.parse` finds it, so the
/// request runs once and its retry replays.
#[tokio::test]
async fn json_pointer_key_in_a_deep_body_is_found_without_recursion() {
    let policy = Policy::default()
        .key(KeySource::JsonPointer("/key".into()))
        .required(true);
    let harness = Harness::new(policy);
    let deep = format!(
        r#"{{"key":"k","x":{}1{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let request = || {
        Request::post("/orders")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(deep.clone())))
            .unwrap()
    };
    let first = harness.send(request()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = harness.send(request()).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.headers.contains_key("idempotent-replayed"),
        "{retry:?}"
    );
}

#[tokio::test]
async fn huge_numbers_are_compared_exactly() {
    let big = |digits: &str| format!(r#"{{"amount":{digits}}}"#).into_bytes();
    let n = "1".repeat(400);
    let n_plus_one = format!("{}2", "1".repeat(399));
    assert_fingerprints(
        &big(&n),
        &[&big(&n)],
        &[
            &big(&n_plus_one),
            &big("1e400"),
            &big(&format!("{n}.0")),
            // Equal as f64, different requests.
            &big("12345678901234567890123"),
        ],
    )
    .await;
    assert_fingerprints(
        &big("1e400"),
        &[&big("1e400")],
        &[&big("1e401"), &big("1E400")],
    )
    .await;
}

#[tokio::test]
async fn duplicate_json_keys_keep_their_order() {
    // See the module docs of `tower_idempotency::fingerprint`: a last-wins
    // backend reads a=2 from the first body and a=1 from the other one.
    assert_fingerprints(
        br#"{"a":1,"a":2}"#,
        &[br#"{ "a" : 1 , "a" : 2 }"#],
        &[br#"{"a":2,"a":1}"#, br#"{"a":2}"#],
    )
    .await;
    assert_fingerprints(
        br#"{"a":1,"b":0,"a":2}"#,
        &[br#"{"b":0,"a":1,"a":2}"#, br#"{"a":1,"a":2,"b":0}"#],
        &[br#"{"b":0,"a":2,"a":1}"#],
    )
    .await;
}
