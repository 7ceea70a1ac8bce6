//! Fingerprint throughput: raw bytes (SHA-256 bound) and canonical JSON
//! (parse, sort members, re-emit, hash) at 1 KiB, 64 KiB and 1 MiB, next to
//! plain SHA-256 of the same bytes (the floor) measured in the same run.
//!
//! `cargo bench --bench fingerprint`
//!
//! Times are the bench thread's CPU time, so other load on the machine
//! does not inflate them.

mod common;

use common::CpuTime;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use http::{header::CONTENT_TYPE, HeaderMap, HeaderValue, Method, Uri};
use sha2::{Digest, Sha256};
use std::hint::black_box;
use tower_idempotency::fingerprint::{canonical_json, fingerprint, Exclusions};

const SIZES: [(&str, usize); 3] = [("1KiB", 1 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20)];

fn headers(content_type: &'static str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers
}

fn bench(c: &mut Criterion<CpuTime>) {
    let uri = Uri::from_static("/orders");
    let fingerprinted = [CONTENT_TYPE];
    let mut group = c.benchmark_group("fingerprint");
    for (label, size) in SIZES {
        let body = common::json_body(size, 42);
        assert_eq!(body.len(), size);
        assert!(
            canonical_json(&body, &[]).is_some(),
            "the bench body is JSON"
        );
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("sha256", label), &body, |b, body| {
            b.iter(|| Sha256::digest(black_box(body)))
        });
        for (name, content_type) in [
            ("raw", "application/octet-stream"),
            ("canonical_json", "application/json"),
        ] {
            let headers = headers(content_type);
            group.bench_with_input(BenchmarkId::new(name, label), &body, |b, body| {
                b.iter(|| {
                    fingerprint(
                        &Method::POST,
                        &uri,
                        &headers,
                        &fingerprinted,
                        black_box(body),
                        Exclusions::default(),
                    )
                })
            });
        }
    }
    group.finish();
    multipart_near_matches(c);
}

/// The worst multipart body for a boundary search: 1 MiB of near-matches
/// of a 70-byte boundary (each one byte short), next to the same bytes
/// fingerprinted raw. A search that backtracked would cost ~70 comparisons
/// per byte; the ratio shows it does not.
fn multipart_near_matches(c: &mut Criterion<CpuTime>) {
    let uri = Uri::from_static("/upload");
    let fingerprinted = [CONTENT_TYPE];
    let boundary = "b".repeat(70);
    let near = format!("\r\n--{}x", &boundary[..69]);
    let mut body = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\n");
    while body.len() < 1 << 20 {
        body.push_str(&near);
    }
    body.push_str(&format!("\r\n--{boundary}--\r\n"));
    let body = body.into_bytes();
    let multipart: &'static str =
        Box::leak(format!("multipart/form-data; boundary={boundary}").into_boxed_str());
    let mut group = c.benchmark_group("multipart_worst");
    group.throughput(Throughput::Bytes(body.len() as u64));
    for (name, content_type) in [
        ("raw", "application/octet-stream"),
        ("multipart", multipart),
    ] {
        let headers = headers(content_type);
        group.bench_with_input(BenchmarkId::new(name, "1MiB"), &body, |b, body| {
            b.iter(|| {
                fingerprint(
                    &Method::POST,
                    &uri,
                    &headers,
                    &fingerprinted,
                    black_box(body),
                    Exclusions::default(),
                )
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = bench
}
criterion_main!(benches);
