//! What secrets at rest cost per request, against the same work without
//! them, in one run:
//!
//! * the scope hash: HMAC-SHA-256 under a key secret vs plain SHA-256, over
//!   the parts the engine hashes for a typical request;
//! * a 1 KiB response: sealing and opening it (AES-256-GCM, the keyring)
//!   vs encoding and decoding it in the clear (what a store persists
//!   without encryption);
//! * the whole tower layer over `MemoryStore`, 1 KiB response: a first
//!   execution and a replay with a key secret and encryption vs without.
//!
//! `cargo bench --bench secrets`
//!
//! CPU time of the bench thread (see `benches/common`); the summary printed
//! at the end gives each pair's times and ratio from this run's samples.

mod common;

use std::convert::Infallible;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use common::{thread_cpu_time, CpuTime};
use criterion::Criterion;
use http::{header, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::engine::{EncryptionKey, IdentityHasher, KeySecret, Keyring};
use tower_idempotency::store::{Outcome, ScopeKey, StoredResponse};
use tower_idempotency::{
    Engine, EngineConfig, IdempotencyLayer, MemoryStore, Policy, Routes, Store,
};

/// The 1 KiB response every case stores or replays.
fn response_body() -> Bytes {
    Bytes::from(common::json_body(1024, 11))
}

async fn handler<B>(_: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::builder()
        .status(201)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, "/orders/4711")
        .body(Full::new(response_body()))
        .unwrap())
}

fn secret() -> KeySecret {
    KeySecret::new(vec![0x5e; 32]).unwrap()
}

fn keyring() -> Keyring {
    Keyring::new(vec![EncryptionKey::new("1", &[1; 32]).unwrap()], "1").unwrap()
}

fn engine(secrets: bool) -> Engine {
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(MemoryStore::new());
    Engine::with_config(
        store,
        Routes::new().route("/orders", Policy::default()).unwrap(),
        EngineConfig {
            key_secret: secrets.then(secret),
            encryption: secrets.then(keyring),
            ..EngineConfig::default()
        },
    )
}

fn request(key: HeaderValue) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{\"amount\":5}")))
        .unwrap()
}

fn key(n: u64) -> HeaderValue {
    HeaderValue::try_from(format!("order-{n:016x}")).unwrap()
}

async fn call<S, B>(service: &mut S, request: Request<Full<Bytes>>) -> usize
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .len()
}

/// The parts the engine hashes for `POST /orders` with a key and no
/// principal, length-prefixed as it does.
fn scope_hash(hasher: &IdentityHasher) -> [u8; 32] {
    let mut digest = hasher.start();
    for part in [
        &b"-"[..],
        b"POST",
        b"api.example.com",
        b"/orders",
        b"order-00000000000004d2",
    ] {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part);
    }
    digest.finalize()
}

fn outcome() -> Outcome {
    Outcome::Stored(StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                HeaderName::from_static("location"),
                HeaderValue::from_static("/orders/4711"),
            ),
        ],
        body: response_body(),
    })
}

const STORE_BATCH: u64 = 20_000;

static SAMPLES: Mutex<Vec<(&'static str, u64, Duration)>> = Mutex::new(Vec::new());

fn record(name: &'static str, iters: u64, elapsed: Duration) -> Duration {
    SAMPLES.lock().unwrap().push((name, iters, elapsed));
    elapsed
}

/// Times `iters` runs of `f`.
fn timed(name: &'static str, iters: u64, mut f: impl FnMut()) -> Duration {
    let started = thread_cpu_time();
    for _ in 0..iters {
        f();
    }
    record(name, iters, thread_cpu_time() - started)
}

fn bench(c: &mut Criterion<CpuTime>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("secrets");

    for (name, hasher) in [
        ("scope_sha256", IdentityHasher::default()),
        ("scope_hmac", IdentityHasher::new(Some(secret()))),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                timed(name, iters, || {
                    std::hint::black_box(scope_hash(std::hint::black_box(&hasher)));
                })
            })
        });
    }

    let scope = ScopeKey([7; 32]);
    let plain = outcome();
    group.bench_function("encode_decode_1k", |b| {
        b.iter_custom(|iters| {
            timed("encode_decode_1k", iters, || {
                let bytes = std::hint::black_box(&plain).encode();
                std::hint::black_box(Outcome::decode(&bytes).unwrap());
            })
        })
    });
    let ring = keyring();
    group.bench_function("seal_open_1k", |b| {
        b.iter_custom(|iters| {
            timed("seal_open_1k", iters, || {
                let sealed = ring.seal(&scope, std::hint::black_box(&plain)).unwrap();
                std::hint::black_box(ring.open(&scope, &sealed).unwrap());
            })
        })
    });

    for (name, secrets) in [("first_plain", false), ("first_secrets", true)] {
        let mut n = 0u64;
        group.bench_function(name, |b| {
            b.to_async(&runtime).iter_custom(|iters| {
                let start = n;
                n += iters;
                async move {
                    let mut total = Duration::ZERO;
                    let mut i = start;
                    while i < start + iters {
                        let end = (i + STORE_BATCH).min(start + iters);
                        let mut service = IdempotencyLayer::new(engine(secrets))
                            .layer(tower::service_fn(handler));
                        let started = thread_cpu_time();
                        for k in i..end {
                            std::hint::black_box(call(&mut service, request(key(k))).await);
                        }
                        total += thread_cpu_time() - started;
                        i = end;
                    }
                    record(name, iters, total)
                }
            })
        });
    }
    for (name, secrets) in [("replay_plain", false), ("replay_secrets", true)] {
        group.bench_function(name, |b| {
            b.to_async(&runtime).iter_custom(|iters| async move {
                let mut service =
                    IdempotencyLayer::new(engine(secrets)).layer(tower::service_fn(handler));
                call(&mut service, request(key(u64::MAX))).await;
                let started = thread_cpu_time();
                for _ in 0..iters {
                    std::hint::black_box(call(&mut service, request(key(u64::MAX))).await);
                }
                record(name, iters, thread_cpu_time() - started)
            })
        });
    }
    group.finish();
}

fn per_call(name: &str, sample_size: usize) -> Option<Duration> {
    let samples = SAMPLES.lock().unwrap();
    let (iters, total) = samples
        .iter()
        .rev()
        .filter(|(n, _, _)| *n == name)
        .take(sample_size)
        .fold((0u64, Duration::ZERO), |(i, t), (_, iters, elapsed)| {
            (i + iters, t + *elapsed)
        });
    (iters > 0).then(|| total.div_f64(iters as f64))
}

fn summary(sample_size: usize) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("\n| CPU time per call | without | with | added | ratio |");
    println!("|---|---:|---:|---:|---:|");
    let pairs = [
        (
            "scope hash: SHA-256 → HMAC-SHA-256",
            "scope_sha256",
            "scope_hmac",
        ),
        (
            "1 KiB response: encode + decode → seal + open",
            "encode_decode_1k",
            "seal_open_1k",
        ),
        (
            "layer, first execution, 1 KiB response",
            "first_plain",
            "first_secrets",
        ),
        (
            "layer, replay, 1 KiB response",
            "replay_plain",
            "replay_secrets",
        ),
    ];
    for (label, without, with) in pairs {
        let (Some(a), Some(b)) = (per_call(without, sample_size), per_call(with, sample_size))
        else {
            continue;
        };
        println!(
            "| {label} | {:.3} µs | {:.3} µs | {:+.3} µs | {:.2} |",
            us(a),
            us(b),
            us(b) - us(a),
            b.as_secs_f64() / a.as_secs_f64()
        );
    }
}

const SAMPLE_SIZE: usize = 100;

fn main() {
    let mut criterion = common::criterion()
        .sample_size(SAMPLE_SIZE)
        .configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
    if std::env::args().any(|arg| arg == "--bench") {
        summary(SAMPLE_SIZE);
    }
}
