//! Load driver for `idempotency-proxy`: what the guarantee costs end to end.
//!
//! ```text
//! cargo bench --bench proxy_load
//! ```
//!
//! It builds the proxy (release), starts a backend in this process and one
//! proxy per store on loopback, drives each with a fixed-duration load and
//! prints markdown tables: requests/s, p50 and p99 latency per
//! configuration, workload and concurrency, each against plain Pingora
//! passthrough measured in the same run, then the floors (raw PostgreSQL
//! and Redis round trips) and where each target stands.
//!
//! Environment: `DATABASE_URL` (a PostgreSQL server to create a private
//! `bench_<pid>` database on; default `postgres://postgres@127.0.0.1:5432/postgres`),
//! `REDIS_URL` (default `redis://127.0.0.1:6379`; only keys under a private
//! prefix are written, nothing is flushed), `LOAD_SECONDS` (per cell,
//! default 3). Under `cargo test` it does nothing.

mod common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const CONCURRENCY: [usize; 2] = [1, 64];
const WARM_UP: Duration = Duration::from_millis(500);
/// Replays cycle over at most this many completed keys.
const REPLAY_KEYS: u64 = 5_000;

fn main() {
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("proxy_load: run it with `cargo bench --bench proxy_load`");
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Err(error) = runtime.block_on(run()) {
        eprintln!("proxy_load: {error}");
        std::process::exit(1);
    }
}

/// Everything one run needs, cleaned up on drop.
struct Run {
    dir: PathBuf,
    database: Option<Database>,
    redis_prefix: String,
}

struct Database {
    admin_url: String,
    name: String,
}

impl Database {
    fn url(&self) -> String {
        let base = self
            .admin_url
            .rsplit_once('/')
            .map_or(&*self.admin_url, |(base, _)| base);
        format!("{base}/{}", self.name)
    }
}

async fn run() -> Result<(), String> {
    let seconds: f64 = std::env::var("LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let duration = Duration::from_secs_f64(seconds);
    let admin_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let pid = std::process::id();
    let proxy_exe = build_proxy()?;
    let dir = std::env::temp_dir().join(format!("proxy_load_{pid}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut run = Run {
        dir,
        database: None,
        redis_prefix: format!("bench_{pid}:"),
    };
    let result = measure(&mut run, &proxy_exe, &admin_url, &redis_url, duration).await;
    cleanup(&run, &redis_url).await;
    result
}

/// Builds the proxy in release mode next to this bench and returns its path.
fn build_proxy() -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("proxy_load: building idempotency-proxy (release)…");
    let status = Command::new(cargo)
        .args(["build", "--release", "-p", "idempotency-proxy"])
        .status()
        .map_err(|e| format!("cargo build: {e}"))?;
    if !status.success() {
        return Err("building idempotency-proxy failed".into());
    }
    // This bench runs from <target>/release/deps/.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let release = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("cannot locate the target directory")?;
    Ok(release.join("idempotency-proxy"))
}

/// One row of the result table.
struct Cell {
    config: String,
    workload: &'static str,
    concurrency: usize,
    outcome: Result<Stats, String>,
}

#[derive(Clone, Copy)]
struct Stats {
    rps: f64,
    p50: Duration,
    p99: Duration,
    requests: usize,
    errors: usize,
}

/// Which keys a workload sends.
#[derive(Clone)]
enum Keys {
    /// A new key every request: first executions.
    Fresh {
        prefix: String,
        next: Arc<AtomicU64>,
    },
    /// Keys already completed: replays.
    Replay { prefix: String, count: u64 },
}

impl Keys {
    fn key(&self, n: u64) -> String {
        match self {
            Keys::Fresh { prefix, next } => format!("{prefix}-{}", next.fetch_add(1, Relaxed)),
            Keys::Replay { prefix, count } => format!("{prefix}-{}", n % count),
        }
    }
}

async fn measure(
    run: &mut Run,
    proxy_exe: &Path,
    admin_url: &str,
    redis_url: &str,
    duration: Duration,
) -> Result<(), String> {
    let body = Bytes::from(common::json_body(1024, 7));
    let backend = start_backend()?;
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http();
    let mut cells = Vec::new();

    // Floors and the database first: the PostgreSQL proxies need it.
    let floors = floors(run, admin_url, redis_url).await;

    let backend_url = format!("http://{backend}");
    let memory = Proxy::start(proxy_exe, &run.dir, "memory", backend, "memory", None).await?;
    for concurrency in CONCURRENCY {
        let keys = fresh(&format!("direct-{concurrency}"));
        let targets = [
            ("backend directly", backend_url.clone(), "/orders"),
            (
                "proxy, idempotency off (passthrough)",
                memory.url(),
                "/plain/orders",
            ),
        ];
        for (config, url, path) in targets {
            let stats = load(
                &client,
                &url,
                path,
                &body,
                &keys,
                concurrency,
                duration,
                None,
            )
            .await;
            cells.push(Cell {
                config: config.into(),
                workload: "any",
                concurrency,
                outcome: Ok(stats),
            });
        }
    }
    drop(memory);

    let pid = std::process::id();
    let mut stores: Vec<(&str, Result<String, String>, Option<String>)> = vec![
        ("memory", Ok("memory".into()), None),
        (
            "SQLite",
            Ok(format!("sqlite://{}", run.dir.join("bench.db").display())),
            None,
        ),
    ];
    let postgres = match &run.database {
        Some(db) => Ok(db.url()),
        None => Err("PostgreSQL unavailable".to_string()),
    };
    stores.push(("PostgreSQL", postgres.clone(), None));
    stores.push(("PostgreSQL + Redis", postgres, Some(redis_url.to_string())));
    stores.push((
        "memory + Redis",
        Ok("memory".into()),
        Some(redis_url.to_string()),
    ));
    for (name, store, redis) in stores {
        let proxy = match store {
            Ok(store) => {
                Proxy::start(proxy_exe, &run.dir, name, backend, &store, redis.as_deref()).await
            }
            Err(error) => Err(error),
        };
        let proxy = match proxy {
            Ok(proxy) => proxy,
            Err(error) => {
                for workload in ["first execution", "replay"] {
                    for concurrency in CONCURRENCY {
                        cells.push(Cell {
                            config: format!("proxy, {name}"),
                            workload,
                            concurrency,
                            outcome: Err(error.clone()),
                        });
                    }
                }
                continue;
            }
        };
        let prefix = format!("bench-{pid}-{}", name.replace(' ', ""));
        let next = Arc::new(AtomicU64::new(0));
        let fresh = Keys::Fresh {
            prefix: prefix.clone(),
            next: next.clone(),
        };
        // Replays use the keys the first executions completed.
        let completed = || Keys::Replay {
            prefix: prefix.clone(),
            count: next.load(Relaxed).clamp(1, REPLAY_KEYS),
        };
        for (workload, replayed) in [("first execution", false), ("replay", true)] {
            let keys = if replayed { completed() } else { fresh.clone() };
            for concurrency in CONCURRENCY {
                let url = proxy.url();
                let stats = load(
                    &client,
                    &url,
                    "/orders",
                    &body,
                    &keys,
                    concurrency,
                    duration,
                    Some(replayed),
                )
                .await;
                cells.push(Cell {
                    config: format!("proxy, {name}"),
                    workload,
                    concurrency,
                    outcome: Ok(stats),
                });
            }
        }
    }
    report(&cells, &floors, duration);
    Ok(())
}

fn fresh(prefix: &str) -> Keys {
    Keys::Fresh {
        prefix: format!("bench-{}-{prefix}", std::process::id()),
        next: Arc::new(AtomicU64::new(0)),
    }
}

/// Drives `path` with `concurrency` request loops for `duration` (after a
/// short warm-up). `replayed`: what `Idempotent-Replayed` must say (`None`:
/// not checked); a wrong answer or status counts as an error.
#[allow(clippy::too_many_arguments)]
async fn load(
    client: &HttpClient,
    base: &str,
    path: &str,
    body: &Bytes,
    keys: &Keys,
    concurrency: usize,
    duration: Duration,
    replayed: Option<bool>,
) -> Stats {
    let uri: http::Uri = format!("{base}{path}").parse().expect("uri");
    let started = Instant::now();
    let measure_from = started + WARM_UP;
    let deadline = measure_from + duration;
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let (client, uri, body, keys) = (client.clone(), uri.clone(), body.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0usize;
            let mut n = worker as u64;
            loop {
                let sent = Instant::now();
                if sent >= deadline {
                    break;
                }
                let request = Request::post(uri.clone())
                    .header(header::CONTENT_TYPE, "application/json")
                    .header("idempotency-key", keys.key(n))
                    .body(Full::new(body.clone()))
                    .expect("request");
                n += concurrency as u64;
                let ok = match client.request(request).await {
                    Ok(response) => {
                        let status_ok = response.status() == StatusCode::CREATED;
                        let flag = response.headers().get("idempotent-replayed").is_some();
                        let read = response.into_body().collect().await.is_ok();
                        status_ok && read && replayed.is_none_or(|want| want == flag)
                    }
                    Err(_) => false,
                };
                if sent >= measure_from {
                    latencies.push(sent.elapsed());
                    errors += usize::from(!ok);
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (l, e) = task.await.expect("load task");
        latencies.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed().saturating_sub(WARM_UP);
    latencies.sort();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Stats {
        rps: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
        requests: latencies.len(),
        errors,
    }
}

/// The backend: reads the JSON body, answers 201 with a small JSON, on its
/// own runtime so the driver's load does not share its threads.
fn start_backend() -> Result<SocketAddr, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("backend runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            let counter = Arc::new(AtomicU64::new(0));
            let app = axum::Router::new().fallback(move |body: Bytes| {
                let id = counter.fetch_add(1, Relaxed);
                async move {
                    (
                        StatusCode::CREATED,
                        [(header::CONTENT_TYPE, "application/json")],
                        format!("{{\"id\":{id},\"received\":{}}}", body.len()),
                    )
                }
            });
            axum::serve(listener, app).await.expect("backend");
        });
    });
    Ok(addr)
}

/// A proxy process this driver started; killed on drop.
struct Proxy {
    child: Child,
    addr: SocketAddr,
}

impl Proxy {
    async fn start(
        exe: &Path,
        dir: &Path,
        name: &str,
        upstream: SocketAddr,
        store: &str,
        redis: Option<&str>,
    ) -> Result<Proxy, String> {
        let addr: SocketAddr = {
            let probe = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            probe.local_addr().map_err(|e| e.to_string())?
        };
        let slug: String = name.chars().filter(char::is_ascii_alphanumeric).collect();
        let config = dir.join(format!("{slug}.toml"));
        std::fs::write(
            &config,
            "[proxy]\nsweep_interval = \"1h\"\n\n\
             [[route]]\npath = \"/plain/**\"\nenabled = false\n\n\
             [[route]]\npath = \"/orders\"\n",
        )
        .map_err(|e| e.to_string())?;
        let log_path = dir.join(format!("{slug}.log"));
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        command
            .args(["--listen", &addr.to_string()])
            .args(["--upstream", &format!("http://{upstream}")])
            .args(["--store", store])
            .arg("--config")
            .arg(&config)
            .current_dir(dir)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        if let Some(redis) = redis {
            command.args(["--redis", redis]);
        }
        let child = command
            .spawn()
            .map_err(|e| format!("{}: {e}", exe.display()))?;
        let mut proxy = Proxy { child, addr };
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(status)) = proxy.child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let last = log
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                return Err(format!("the proxy exited ({status}): {}", last.trim()));
            }
            if TcpStream::connect(addr).is_ok() {
                return Ok(proxy);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err("the proxy did not listen within 30 s".into())
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The raw round trips the stores are built from, measured from this
/// machine with the servers' own tools (`pgbench` with prepared statements,
/// `redis-benchmark`), one connection, sequential: p50 of each.
#[derive(Default)]
struct Floors {
    pg: Option<PgFloors>,
    redis_get: Option<Duration>,
    notes: Vec<String>,
}

const FLOOR_ROUNDS: usize = 2_000;

async fn floors(run: &mut Run, admin_url: &str, redis_url: &str) -> Floors {
    let mut floors = Floors::default();
    match postgres_floors(run, admin_url) {
        Ok(pg) => floors.pg = Some(pg),
        Err(error) => floors
            .notes
            .push(format!("PostgreSQL floors not measured: {error}")),
    }
    match redis_floor(&run.redis_prefix, redis_url) {
        Ok(get) => floors.redis_get = Some(get),
        Err(error) => floors
            .notes
            .push(format!("Redis floor not measured: {error}")),
    }
    floors
}

/// Runs a command, returning its stdout, or its stderr as the error.
fn output(command: &mut Command) -> Result<String, String> {
    let out = command
        .output()
        .map_err(|e| format!("{:?}: {e}", command.get_program()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

fn psql(url: &str, sql: &str) -> Result<String, String> {
    output(Command::new("psql").args([url, "-v", "ON_ERROR_STOP=1", "-qAtc", sql]))
}

/// Creates the private database with the store's own schema (the
/// migrations in `migrations/`), then times the store's own statements
/// with `pgbench`: the reserve `INSERT`, the complete `UPDATE` and the
/// replay `SELECT` (mirroring `src/store/postgres.rs`, with 32-byte keys).
/// The same `INSERT` and `UPDATE` on a minimal table (bigint key, no
/// second index) are timed too, to show what the schema itself costs.
fn postgres_floors(run: &mut Run, admin_url: &str) -> Result<PgFloors, String> {
    let name = format!("bench_{}", std::process::id());
    psql(admin_url, &format!("CREATE DATABASE {name}"))?;
    let database = Database {
        admin_url: admin_url.to_string(),
        name,
    };
    let url = database.url();
    run.database = Some(database);
    let migrations = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&migrations)
        .map_err(|e| format!("{}: {e}", migrations.display()))?
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
        .collect();
    files.sort();
    for file in &files {
        output(
            Command::new("psql")
                .args([&url, "-v", "ON_ERROR_STOP=1", "-q", "-f"])
                .arg(file),
        )?;
    }
    // Keys, fingerprints and owners as the store writes them: 32, 32 and 16
    // bytes, derived from a number so a script can name them.
    const KEY: &str = "sha256(int8send(:k))";
    const OWNER: &str = "substr(sha256(int8send(:k)), 1, 16)";
    psql(
        &url,
        "INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at) \
         SELECT sha256(int8send(g)), sha256(int8send(g)), substr(sha256(int8send(g)), 1, 16), \
                'in_flight', now() + interval '1 hour', now() + interval '1 day' \
         FROM generate_series(1, 100000) g; \
         CREATE TABLE floor (key bigint PRIMARY KEY, owner bigint, state text, response text); \
         INSERT INTO floor SELECT g, g, 'in_flight', NULL FROM generate_series(1, 2000) g",
    )?;
    let time = |name: &str, sql: &str| -> Result<Duration, String> {
        let script = run.dir.join(format!("{name}.sql"));
        std::fs::write(&script, sql).map_err(|e| e.to_string())?;
        let prefix = run.dir.join(format!("pgbench_{name}"));
        output(
            Command::new("pgbench")
                .args([
                    "-n",
                    "-M",
                    "prepared",
                    "-c",
                    "1",
                    "-t",
                    &FLOOR_ROUNDS.to_string(),
                    "-l",
                ])
                .arg(format!("--log-prefix={}", prefix.display()))
                .arg("-f")
                .arg(&script)
                .arg(&url)
                .current_dir(&run.dir),
        )?;
        // Log lines: client, transaction, latency in µs, …
        let mut samples = Vec::new();
        for entry in std::fs::read_dir(&run.dir).map_err(|e| e.to_string())? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with(&format!("pgbench_{name}")))
            {
                let log = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
                samples.extend(log.lines().filter_map(|line| {
                    line.split_whitespace()
                        .nth(2)?
                        .parse::<u64>()
                        .ok()
                        .map(Duration::from_micros)
                }));
            }
        }
        if samples.is_empty() {
            return Err(format!("pgbench wrote no log for {name}"));
        }
        Ok(median(samples))
    };
    let reserve = time(
        "reserve",
        &format!(
            "\\set k random(1000000, 2000000000)\n\
             INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at) \
             VALUES ({KEY}, {KEY}, {OWNER}, 'in_flight', \
                     now() + 30000000::bigint * interval '1 microsecond', \
                     now() + 86400000000::bigint * interval '1 microsecond') \
             ON CONFLICT (key) DO NOTHING RETURNING false AS takeover;\n"
        ),
    )?;
    let complete = time(
        "complete",
        &format!(
            "\\set k random(1, 100000)\n\
             UPDATE idempotency_records \
             SET state = 'completed', owner = NULL, lease_expires_at = NULL, \
                 status = 201, headers = '\\x0000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e', \
                 body = convert_to(repeat('x', 27), 'UTF8'), \
                 expires_at = now() + 86400000000::bigint * interval '1 microsecond' \
             WHERE key = {KEY} AND owner = {OWNER} AND state = 'in_flight';\n"
        ),
    )?;
    let select = time(
        "select",
        &format!(
            "\\set k random(1, 100000)\n\
             SELECT fingerprint, state, status, headers, body, \
                    (extract(epoch FROM greatest(lease_expires_at - now(), interval '0')) * 1000000)::bigint \
             FROM idempotency_records WHERE key = {KEY} AND expires_at > now();\n"
        ),
    )?;
    let minimal_insert = time(
        "minimal_insert",
        "\\set k random(3000, 2000000000)\n\
         INSERT INTO floor (key, owner, state) VALUES (:k, :k, 'in_flight') ON CONFLICT DO NOTHING;\n",
    )?;
    let minimal_update = time(
        "minimal_update",
        "\\set k random(1, 2000)\n\
         UPDATE floor SET state = 'completed', response = repeat('x', 1024) WHERE key = :k AND owner = :k;\n",
    )?;
    Ok(PgFloors {
        reserve,
        complete,
        select,
        minimal_insert,
        minimal_update,
    })
}

/// The PostgreSQL round trips, p50 each.
struct PgFloors {
    reserve: Duration,
    complete: Duration,
    select: Duration,
    minimal_insert: Duration,
    minimal_update: Duration,
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// A 1 KiB value under the private prefix, then `GET` it.
fn redis_floor(prefix: &str, url: &str) -> Result<Duration, String> {
    let key = format!("{prefix}floor");
    output(Command::new("redis-cli").args([
        "-u",
        url,
        "SET",
        &key,
        &"x".repeat(1024),
        "EX",
        "600",
    ]))?;
    let csv = output(Command::new("redis-benchmark").args([
        "-u",
        url,
        "-c",
        "1",
        "-n",
        &FLOOR_ROUNDS.to_string(),
        "--csv",
        "GET",
        &key,
    ]))?;
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms",…
    let p50 = csv
        .lines()
        .nth(1)
        .and_then(|line| line.split(',').nth(4))
        .and_then(|field| field.trim_matches('"').parse::<f64>().ok())
        .ok_or_else(|| format!("unexpected redis-benchmark output: {csv}"))?;
    Ok(Duration::from_secs_f64(p50 / 1000.0))
}

/// Drops the private database and deletes the one key written under the
/// private Redis prefix (the proxies' cache entries expire with their
/// TTL; nothing is flushed).
async fn cleanup(run: &Run, redis_url: &str) {
    if let Some(db) = &run.database {
        let _ = psql(
            &db.admin_url,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", db.name),
        );
    }
    let key = format!("{}floor", run.redis_prefix);
    let _ = output(Command::new("redis-cli").args(["-u", redis_url, "DEL", &key]));
    let _ = std::fs::remove_dir_all(&run.dir);
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

fn report(cells: &[Cell], floors: &Floors, duration: Duration) {
    let passthrough = |concurrency: usize| {
        cells
            .iter()
            .find(|c| c.config.contains("passthrough") && c.concurrency == concurrency)
            .and_then(|c| c.outcome.as_ref().ok().copied())
    };
    println!(
        "\n### Proxy load ({:.0} s per cell, 1 KiB JSON body, loopback)\n",
        duration.as_secs_f64()
    );
    println!("| configuration | workload | concurrency | requests/s | p50 | p99 | requests/s vs passthrough | p50 above passthrough | errors |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for cell in cells {
        match &cell.outcome {
            Ok(stats) => {
                let base = passthrough(cell.concurrency);
                let ratio = base.map_or("—".into(), |b| format!("{:.2}", stats.rps / b.rps));
                let above = base.map_or("—".into(), |b| {
                    let d = stats.p50.as_secs_f64() - b.p50.as_secs_f64();
                    format!("{:+.0} µs", d * 1e6)
                });
                println!(
                    "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {}/{} |",
                    cell.config,
                    cell.workload,
                    cell.concurrency,
                    stats.rps,
                    us(stats.p50),
                    us(stats.p99),
                    ratio,
                    above,
                    stats.errors,
                    stats.requests
                );
            }
            Err(error) => println!(
                "| {} | {} | {} | — | — | — | — | — | not run: {} |",
                cell.config, cell.workload, cell.concurrency, error
            ),
        }
    }
    println!("\n### Floors (p50 of {FLOOR_ROUNDS} sequential round trips, one connection)\n");
    println!("| operation | p50 |\n|---|---:|");
    let pg = floors.pg.as_ref();
    for (name, value) in [
        (
            "PostgreSQL reserve: the store's `INSERT … ON CONFLICT DO NOTHING`",
            pg.map(|pg| pg.reserve),
        ),
        (
            "PostgreSQL complete: the store's `UPDATE … WHERE key AND owner`",
            pg.map(|pg| pg.complete),
        ),
        (
            "PostgreSQL replay: the store's `SELECT` by key",
            pg.map(|pg| pg.select),
        ),
        (
            "for reference: that `INSERT` on a minimal table (bigint key, one index)",
            pg.map(|pg| pg.minimal_insert),
        ),
        (
            "for reference: that `UPDATE` on a minimal table",
            pg.map(|pg| pg.minimal_update),
        ),
        ("Redis `GET` (1 KiB value)", floors.redis_get),
    ] {
        println!("| {name} | {} |", value.map_or("not measured".into(), us));
    }
    for note in &floors.notes {
        println!("\n{note}");
    }
    let stats = |config: &str, workload: &str, concurrency: usize| {
        cells
            .iter()
            .find(|c| c.config == config && c.workload == workload && c.concurrency == concurrency)
            .and_then(|c| c.outcome.as_ref().ok().copied())
    };
    println!("\n### Targets\n");
    println!("| target | measured | status |\n|---|---|---|");
    if let (Some(replay), Some(base)) = (stats("proxy, memory", "replay", 64), passthrough(64)) {
        let ratio = replay.rps / base.rps;
        println!(
            "| memory replay ≥ 90% of passthrough requests/s at concurrency 64 | {:.0}% | {} |",
            ratio * 100.0,
            met(ratio >= 0.9)
        );
    }
    if let (Some(first), Some(base), Some(pg)) = (
        stats("proxy, PostgreSQL", "first execution", 1),
        passthrough(1),
        pg,
    ) {
        let above = first.p50.as_secs_f64() - base.p50.as_secs_f64();
        let bound = 1.2 * (pg.reserve + pg.complete).as_secs_f64();
        println!(
            "| PostgreSQL first execution, concurrency 1: p50 above passthrough ≤ 1.2 × (reserve + complete) | {:.0} µs vs {:.0} µs | {} |",
            above * 1e6, bound * 1e6, met(above <= bound)
        );
    }
    let redis_replay = stats("proxy, PostgreSQL + Redis", "replay", 1)
        .or_else(|| stats("proxy, memory + Redis", "replay", 1));
    if let (Some(replay), Some(base), Some(get)) = (redis_replay, passthrough(1), floors.redis_get)
    {
        let above = replay.p50.as_secs_f64() - base.p50.as_secs_f64();
        let bound = 1.2 * get.as_secs_f64();
        println!(
            "| Redis replay, concurrency 1: p50 ≤ passthrough + 1.2 × GET | {:+.0} µs vs {:.0} µs | {} |",
            above * 1e6, bound * 1e6, met(above <= bound)
        );
    }
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "missed"
    }
}
