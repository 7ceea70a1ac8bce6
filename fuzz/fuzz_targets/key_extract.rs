//! Key extraction from every source (header, form, multipart, JSON pointer,
//! query) over arbitrary input: never a panic, and a header key that is
//! accepted is exactly the header value, bare or as a quoted sf-string.
#![no_main]

use http::{header, HeaderMap, HeaderValue, Uri};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::fingerprint::{fingerprint, Exclusions};
use tower_idempotency::key::{extract, validate};
use tower_idempotency::KeySource;

const CONTENT_TYPES: [&str; 5] = [
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=XyZ",
    "multipart/form-data; boundary=\"a b\"",
    "application/json",
    "text/plain",
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    // The first byte picks the source and content type; the rest is split
    // at the first NUL into a header/query part and a body.
    let (head, body) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &b""[..]),
    };
    let content_type = CONTENT_TYPES[usize::from(selector >> 3) % CONTENT_TYPES.len()];
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let source = match selector % 4 {
        0 => KeySource::default(),
        1 => KeySource::FormField("token".into()),
        2 => KeySource::JsonPointer("/meta/token".into()),
        _ => KeySource::Query("token".into()),
    };
    let uri = std::str::from_utf8(head)
        .ok()
        .and_then(|query| format!("/x?{query}").parse::<Uri>().ok())
        .unwrap_or_else(|| Uri::from_static("/x"));
    let header_value = HeaderValue::from_bytes(head).ok();
    if let Some(value) = &header_value {
        headers.insert("idempotency-key", value.clone());
    }
    if let Ok(Some(key)) = extract(&source, &uri, &headers, body) {
        let valid = validate(&key, false).is_ok();
        let _ = validate(&key, true);
        if valid && matches!(source, KeySource::Header(_)) {
            let mut quoted = vec![b'"'];
            for &b in &key {
                if b == b'"' || b == b'\\' {
                    quoted.push(b'\\');
                }
                quoted.push(b);
            }
            quoted.push(b'"');
            assert!(head == key.as_slice() || head == quoted.as_slice());
        }
    }
    let _ = fingerprint(
        &http::Method::POST,
        &uri,
        &headers,
        &[header::CONTENT_TYPE],
        body,
        Exclusions::default(),
    );
});
