//! What the tower layer adds per request, with the memory store: the same
//! inner service with and without `IdempotencyLayer`, 1 KiB JSON body, for a
//! first execution (a new key every request) and for a replay (one key),
//! and the replay of the same body sent as opaque bytes (raw fingerprint).
//!
//! `cargo bench --bench layer`
//!
//! Both sides build the same request (key header included), call the
//! service and read the whole response body, on the same current-thread
//! Tokio runtime, so everything (spawned tasks included) runs on the bench
//! thread and its CPU time is the cost. The added time per request is
//! `layer - baseline`; the summary printed at the end gives it and the
//! ratio, from the mean of this run's samples, and splits the added time
//! into the request fingerprint (measured alone in the same run: the part
//! that grows with the body) and the rest of the engine. It ends with the
//! target's ratios, the added time over the raw fingerprint of the same
//! body (SHA-256 of it: the floor), and the heap allocations per request
//! of each case, counted outside the timed runs.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use common::{thread_cpu_time, CpuTime};
use criterion::Criterion;
use http::{header, HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::fingerprint::{fingerprint, Exclusions};
use tower_idempotency::{Engine, IdempotencyLayer, MemoryStore, Policy, Routes};

/// The system allocator, counting allocations (and reallocations) while
/// [`COUNTING`] is set: off during the timed runs, where it costs one
/// relaxed load per allocation.
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to `System` unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The application: reads the JSON body, answers 201 with a small JSON.
async fn handler<B>(request: Request<B>) -> Result<Response<Full<Bytes>>, Infallible>
where
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let body = request.into_body().collect().await.unwrap().to_bytes();
    let response = Response::builder()
        .status(201)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, "/orders/4711")
        .body(Full::new(Bytes::from(format!(
            "{{\"id\":4711,\"received\":{}}}",
            body.len()
        ))))
        .unwrap();
    Ok(response)
}

/// How the bench body is sent: as JSON (canonical fingerprint) or as opaque
/// bytes (raw fingerprint), with the names of the benches for each.
struct Kind {
    content_type: &'static str,
    replay: &'static str,
    fingerprint: &'static str,
    label: &'static str,
}

const JSON: Kind = Kind {
    content_type: "application/json",
    replay: "replay",
    fingerprint: "fingerprint_alone",
    label: "1 KiB JSON",
};

const RAW: Kind = Kind {
    content_type: "application/octet-stream",
    replay: "replay_raw",
    fingerprint: "fingerprint_alone_raw",
    label: "the same 1 KiB as opaque bytes",
};

fn request(body: &Bytes, key: HeaderValue) -> Request<Full<Bytes>> {
    request_as(&JSON, body, key)
}

fn request_as(kind: &Kind, body: &Bytes, key: HeaderValue) -> Request<Full<Bytes>> {
    Request::post("/orders")
        .header(header::CONTENT_TYPE, kind.content_type)
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))
        .unwrap()
}

async fn call<S>(service: &mut S, request: Request<Full<Bytes>>) -> usize
where
    S: Service<Request<Full<Bytes>>>,
    S::Response: IntoBody,
    S::Error: std::fmt::Debug,
{
    let response = service.ready().await.unwrap().call(request).await.unwrap();
    response.body_len().await
}

/// Reads a response body whatever the service's body type.
trait IntoBody {
    async fn body_len(self) -> usize;
}

impl<B> IntoBody for Response<B>
where
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    async fn body_len(self) -> usize {
        self.into_body().collect().await.unwrap().to_bytes().len()
    }
}

fn engine() -> Engine {
    Engine::new(
        MemoryStore::new(),
        Routes::new()
            .route("/orders", Policy::default())
            .expect("valid policy"),
    )
}

/// A fresh key per request, formatted outside nothing: both sides pay it.
fn key(n: u64) -> HeaderValue {
    HeaderValue::try_from(format!("order-{n:016x}")).unwrap()
}

/// Fresh store every this many first executions, so the store's size (and
/// the memory the bench uses) stays bounded.
const STORE_BATCH: u64 = 20_000;

/// Every (iterations, CPU time) sample, per bench, for the summary.
static SAMPLES: Mutex<Vec<(&'static str, u64, Duration)>> = Mutex::new(Vec::new());

fn record(name: &'static str, iters: u64, elapsed: Duration) -> Duration {
    SAMPLES.lock().unwrap().push((name, iters, elapsed));
    elapsed
}

fn bench(c: &mut Criterion<CpuTime>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = Bytes::from(common::json_body(1024, 7));
    let baseline = tower::service_fn(handler::<tower_idempotency::layer::RequestBody<Full<Bytes>>>);
    let plain = tower::service_fn(handler::<Full<Bytes>>);

    let mut group = c.benchmark_group("layer");
    group.bench_function("baseline", |b| {
        let mut n = 0u64;
        b.to_async(&runtime).iter_custom(|iters| {
            let (body, mut service) = (body.clone(), plain);
            let start = n;
            n += iters;
            async move {
                let started = thread_cpu_time();
                for i in start..start + iters {
                    std::hint::black_box(call(&mut service, request(&body, key(i))).await);
                }
                record("baseline", iters, thread_cpu_time() - started)
            }
        })
    });
    group.bench_function("first_execution", |b| {
        let mut n = 0u64;
        b.to_async(&runtime).iter_custom(|iters| {
            let body = body.clone();
            let start = n;
            n += iters;
            async move {
                let mut total = Duration::ZERO;
                let mut i = start;
                while i < start + iters {
                    let end = (i + STORE_BATCH).min(start + iters);
                    let mut service = IdempotencyLayer::new(engine()).layer(baseline);
                    let started = thread_cpu_time();
                    for k in i..end {
                        let len = call(&mut service, request(&body, key(k))).await;
                        debug_assert_eq!(len, 27);
                        std::hint::black_box(len);
                    }
                    total += thread_cpu_time() - started;
                    i = end;
                }
                record("first_execution", iters, total)
            }
        })
    });
    for kind in [&JSON, &RAW] {
        group.bench_function(kind.replay, |b| {
            b.to_async(&runtime).iter_custom(|iters| {
                let body = body.clone();
                async move {
                    let mut service = IdempotencyLayer::new(engine()).layer(baseline);
                    let key = key(u64::MAX);
                    call(&mut service, request_as(kind, &body, key.clone())).await;
                    let started = thread_cpu_time();
                    for _ in 0..iters {
                        let request = request_as(kind, &body, key.clone());
                        std::hint::black_box(call(&mut service, request).await);
                    }
                    record(kind.replay, iters, thread_cpu_time() - started)
                }
            })
        });
        // The part of the layer's work that is a function of the body
        // alone: the request fingerprint (canonical JSON or raw bytes,
        // SHA-256), as the engine computes it for this request.
        group.bench_function(kind.fingerprint, |b| {
            let request = request_as(kind, &body, key(0));
            let fingerprinted = [header::CONTENT_TYPE];
            b.iter_custom(|iters| {
                let started = thread_cpu_time();
                for _ in 0..iters {
                    std::hint::black_box(fingerprint(
                        request.method(),
                        request.uri(),
                        request.headers(),
                        &fingerprinted,
                        std::hint::black_box(&body),
                        Exclusions::default(),
                    ));
                }
                record(kind.fingerprint, iters, thread_cpu_time() - started)
            })
        });
    }
    group.finish();
}

/// The mean time per request over the last `sample_size` samples of `name`
/// (criterion's measured samples come after its warm-up calls).
fn per_request(name: &str, sample_size: usize) -> Option<Duration> {
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
    let Some(baseline) = per_request("baseline", sample_size) else {
        return;
    };
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "\n| layer, memory store, 1 KiB body | CPU time per request | added by the layer | of which the fingerprint | the rest | ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| without the layer | {:.2} µs | | | | 1.00 |",
        us(baseline)
    );
    let rows = [
        ("first_execution", &JSON),
        (JSON.replay, &JSON),
        (RAW.replay, &RAW),
    ];
    for (name, kind) in rows {
        let Some(t) = per_request(name, sample_size) else {
            continue;
        };
        let added = us(t) - us(baseline);
        let (of_which, rest) = match per_request(kind.fingerprint, sample_size) {
            Some(f) => (
                format!("{:.2} µs", us(f)),
                format!("{:+.2} µs", added - us(f)),
            ),
            None => (String::new(), String::new()),
        };
        println!(
            "| {name}, {} | {:.2} µs | {added:+.2} µs | {of_which} | {rest} | {:.2} |",
            kind.label,
            us(t),
            t.as_secs_f64() / baseline.as_secs_f64()
        );
    }
    // The target: what the layer adds, over the raw fingerprint of the
    // same body (SHA-256 of it, the floor), JSON replay and first execution.
    if let Some(raw) = per_request(RAW.fingerprint, sample_size) {
        let ratio = |name: &str| {
            per_request(name, sample_size).map_or(String::from("-"), |t| {
                format!("{:.2}", (us(t) - us(baseline)) / us(raw))
            })
        };
        println!(
            "\nadded ÷ raw fingerprint ({:.2} µs), target ≤ 3: replay {}, first execution {} (replay_raw {})",
            us(raw),
            ratio(JSON.replay),
            ratio("first_execution"),
            ratio(RAW.replay),
        );
    }
}

/// How many requests the allocation count runs per case.
const COUNTED: u64 = 1_000;

/// Counts the heap allocations `run` makes.
async fn counting(run: impl std::future::Future<Output = ()>) -> u64 {
    ALLOCATIONS.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    run.await;
    COUNTING.store(false, Ordering::Relaxed);
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Prints the heap allocations (and reallocations) per request of each
/// case, over [`COUNTED`] requests after a warm-up one, untimed.
fn allocations(runtime: &tokio::runtime::Runtime, body: &Bytes) {
    let layered = tower::service_fn(handler::<tower_idempotency::layer::RequestBody<Full<Bytes>>>);
    let mut plain = tower::service_fn(handler::<Full<Bytes>>);
    let per_request = |n: u64| n as f64 / COUNTED as f64;
    let fingerprinted = [header::CONTENT_TYPE];
    let mut rows = Vec::new();
    runtime.block_on(async {
        call(&mut plain, request(body, key(0))).await;
        let n = counting(async {
            for i in 1..=COUNTED {
                call(&mut plain, request(body, key(i))).await;
            }
        })
        .await;
        rows.push(("baseline", per_request(n)));
        let mut service = IdempotencyLayer::new(engine()).layer(layered);
        call(&mut service, request(body, key(0))).await;
        let n = counting(async {
            for i in 1..=COUNTED {
                call(&mut service, request(body, key(i))).await;
            }
        })
        .await;
        rows.push(("first_execution", per_request(n)));
        for kind in [&JSON, &RAW] {
            let mut service = IdempotencyLayer::new(engine()).layer(layered);
            call(&mut service, request_as(kind, body, key(0))).await;
            let n = counting(async {
                for _ in 0..COUNTED {
                    call(&mut service, request_as(kind, body, key(0))).await;
                }
            })
            .await;
            rows.push((kind.replay, per_request(n)));
            let request = request_as(kind, body, key(0));
            let n = counting(async {
                for _ in 0..COUNTED {
                    std::hint::black_box(fingerprint(
                        request.method(),
                        request.uri(),
                        request.headers(),
                        &fingerprinted,
                        body,
                        Exclusions::default(),
                    ));
                }
            })
            .await;
            rows.push((kind.fingerprint, per_request(n)));
        }
    });
    let baseline = rows[0].1;
    println!("\n| heap allocations per request | count | added by the layer |");
    println!("|---|---:|---:|");
    for (name, n) in rows {
        let added = match name {
            "first_execution" | "replay" | "replay_raw" => format!("{:+.1}", n - baseline),
            _ => String::new(),
        };
        println!("| {name} | {n:.1} | {added} |");
    }
}

const SAMPLE_SIZE: usize = 100;

fn main() {
    let mut criterion = common::criterion()
        .sample_size(SAMPLE_SIZE)
        .configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
    // `cargo bench` passes `--bench`; `cargo test --benches` runs each bench
    // once, unoptimised, which makes no meaningful summary.
    if std::env::args().any(|arg| arg == "--bench") {
        summary(SAMPLE_SIZE);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        allocations(&runtime, &Bytes::from(common::json_body(1024, 7)));
    }
}
