//! Canonical JSON and the fingerprint over arbitrary bodies: never a panic,
//! never unbounded recursion, and canonical output is a fixed point.
#![no_main]

use http::{header, HeaderMap, HeaderValue, Method, Uri};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::fingerprint::{canonical_json, fingerprint, parse_pointer, Exclusions};

fuzz_target!(|data: &[u8]| {
    if let Some(canonical) = canonical_json(data, &[]) {
        assert!(std::str::from_utf8(&canonical).is_ok());
        assert_eq!(canonical_json(&canonical, &[]).as_ref(), Some(&canonical));
    }
    let exclude = [
        parse_pointer("/a"),
        parse_pointer("/b/0"),
        parse_pointer("/~1"),
    ];
    let _ = canonical_json(data, &exclude);
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let fingerprint_of = |body: &[u8]| {
        fingerprint(
            &Method::POST,
            &Uri::from_static("/orders"),
            &headers,
            &[header::CONTENT_TYPE],
            body,
            Exclusions::default(),
        )
    };
    assert_eq!(fingerprint_of(data), fingerprint_of(data));
});
