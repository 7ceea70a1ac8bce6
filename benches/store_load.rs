//! The stores alone, under load, against their own floors.
//!
//! ```text
//! cargo bench --bench store_load --features sqlite,postgres,redis
//! ```
//!
//! Drives each store's [`Store`] calls directly (no HTTP): a **first
//! execution** is `reserve` of a new key (must be `Acquired`) then `complete`
//! with a 1 KiB response (must be `true`); a **replay** is `reserve` of a
//! completed key (must be `Existing` and completed). Each cell is a
//! closed loop of N concurrent tasks for `LOAD_SECONDS` (default 3) on a
//! two-worker Tokio runtime.
//!
//! The floors, measured in the same run:
//!
//! * PostgreSQL: `pgbench -M prepared` with the store's own `INSERT` and
//!   `UPDATE` (one transaction each, as the store runs them) at the same
//!   number of clients, and its own `SELECT` by key;
//! * SQLite: the store's own `SELECT` run directly through a sqlx pool of N
//!   connections by N tasks, on the same file;
//! * Redis: `redis-benchmark -c 1 -t get -d 1024` p50.
//!
//! Then the memory: bytes per stored record and per in-flight
//! reservation of the memory store, and its resident memory with 100,000
//! stored 1 KiB responses.
//!
//! Environment: `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`; a private `bench_store_<pid>`
//! database is created and dropped), `REDIS_URL` (default
//! `redis://127.0.0.1:6379`; keys under a private prefix only, never
//! flushed), `LOAD_SECONDS`, `STORES` (comma-separated subset of
//! `sqlite,postgres,redis,memory`). Under `cargo test` it does nothing.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use tower_idempotency::store::{
    Claim, Fingerprint, Outcome, OwnerToken, RecordState, ScopeKey, StoredResponse,
};
use tower_idempotency::{
    MemoryStore, PostgresStore, RedisCache, RedisCacheConfig, SqliteStore, Store,
};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(86_400);
const CONCURRENCY: [usize; 2] = [1, 64];

fn main() {
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("store_load: run it with `cargo bench --bench store_load --features sqlite,postgres,redis`");
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Err(error) = runtime.block_on(run()) {
        eprintln!("store_load: {error}");
        std::process::exit(1);
    }
}

fn seconds() -> Duration {
    let s: f64 = std::env::var("LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(s)
}

fn wanted(store: &str) -> bool {
    std::env::var("STORES")
        .map(|s| s.split(',').any(|s| s.trim() == store))
        .unwrap_or(true)
}

fn outcome() -> Outcome {
    Outcome::Stored(StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![(
            HeaderName::from_static("content-type"),
            HeaderValue::from_static("application/json"),
        )],
        body: Bytes::from(vec![b'x'; 1024]),
    })
}

/// Key `n` of a run: distinct per run (`salt`) so reruns never collide.
fn key(salt: u64, n: u64) -> ScopeKey {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&salt.to_be_bytes());
    bytes[8..16].copy_from_slice(&n.to_be_bytes());
    bytes[16..24].copy_from_slice(&std::process::id().to_be_bytes().repeat(2));
    ScopeKey(bytes)
}

const FINGERPRINT: Fingerprint = Fingerprint([7; 32]);

/// One measured cell.
struct Cell {
    ops: u64,
    elapsed: Duration,
    p50: Duration,
}

impl Cell {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }
}

/// Runs `op(n)` from `concurrency` tasks for the configured time;
/// `op` panics on a wrong answer.
async fn drive<F, Fut>(concurrency: usize, op: F) -> Cell
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (op, next, stop) = (op.clone(), next.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            while !stop.load(Relaxed) {
                let n = next.fetch_add(1, Relaxed);
                let t = Instant::now();
                op(n).await;
                samples.push(t.elapsed());
                // The memory store never waits: let the timer run.
                tokio::task::yield_now().await;
            }
            samples
        }));
    }
    tokio::time::sleep(seconds()).await;
    stop.store(true, Relaxed);
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.expect("a load task panicked"));
    }
    let elapsed = started.elapsed();
    samples.sort();
    Cell {
        ops: samples.len() as u64,
        elapsed,
        p50: samples[samples.len() / 2],
    }
}

async fn first_executions<S: Store + Clone>(store: &S, salt: u64, concurrency: usize) -> Cell {
    let store = store.clone();
    let done = Arc::new(outcome());
    drive(concurrency, move |n| {
        let (store, done) = (store.clone(), done.clone());
        async move {
            let key = key(salt, n);
            let owner = OwnerToken::random();
            let claim = store
                .reserve(&key, &FINGERPRINT, &owner, LEASE, TTL)
                .await
                .expect("reserve");
            assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
            assert!(store
                .complete(&key, &owner, &done, TTL)
                .await
                .expect("complete"));
        }
    })
    .await
}

/// Replays of the first `completed` keys of run `salt`, round robin.
async fn replays<S: Store + Clone>(
    store: &S,
    salt: u64,
    completed: u64,
    concurrency: usize,
) -> Cell {
    let store = store.clone();
    drive(concurrency, move |n| {
        let store = store.clone();
        async move {
            let key = key(salt, n % completed);
            let claim = store
                .reserve(&key, &FINGERPRINT, &OwnerToken::random(), LEASE, TTL)
                .await
                .expect("reserve");
            match claim {
                Claim::Existing(record) => {
                    assert!(matches!(record.state, RecordState::Completed(_)))
                }
                other => panic!("a replay acquired: {other:?}"),
            }
        }
    })
    .await
}

/// First executions then replays at each concurrency: (label, cell) rows.
async fn store_cells<S: Store + Clone>(name: &str, store: &S) -> Vec<(String, Cell)> {
    let mut rows = Vec::new();
    let salt: u64 = rand::random();
    // Keys completed ahead for the replays.
    let warm = first_executions(store, salt, 8).await;
    for &c in &CONCURRENCY {
        let cell = first_executions(store, salt ^ (c as u64 + 1), c).await;
        rows.push((format!("{name} | first execution | {c}"), cell));
    }
    for &c in &CONCURRENCY {
        let cell = replays(store, salt, warm.ops.min(5_000), c).await;
        rows.push((format!("{name} | replay | {c}"), cell));
    }
    rows
}

async fn run() -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("store_load_{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let _cleanup = Cleanup(dir.clone());
    println!(
        "load: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let mut rows: Vec<(String, Cell)> = Vec::new();
    let mut floors: Vec<(String, f64, Duration)> = Vec::new();

    if wanted("sqlite") {
        let path = dir.join("store.db");
        let store = SqliteStore::connect(path.to_str().unwrap())
            .await
            .map_err(|e| e.to_string())?;
        rows.extend(store_cells("SQLite", &store).await);
        for &c in &CONCURRENCY {
            let cell = sqlite_select_floor(&path, c).await?;
            floors.push((
                format!("SQLite: the store's `SELECT` by key, {c} sqlx connection(s) and tasks"),
                cell.rate(),
                cell.p50,
            ));
        }
        store.close().await;
    }
    if wanted("postgres") {
        let admin = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let db = Database::create(&admin)?;
        let store = PostgresStore::connect(&db.url())
            .await
            .map_err(|e| e.to_string())?;
        rows.extend(store_cells("PostgreSQL", &store).await);
        store.close().await;
        // The same with a larger pool (`PG_POOL`, e.g. 64: one connection
        // per concurrent request, as pgbench has).
        if let Some(size) = std::env::var("PG_POOL")
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
        {
            let pool = PostgresStore::pool_options()
                .max_connections(size)
                .connect(&db.url())
                .await
                .map_err(|e| e.to_string())?;
            let store = PostgresStore::from_pool(pool);
            rows.extend(store_cells(&format!("PostgreSQL, pool of {size}"), &store).await);
            store.close().await;
        }
        floors.extend(postgres_floors(&db.url(), &dir)?);
        // Where a replay's time goes on the client: the store's lookup run
        // through sqlx directly, from a pool (which answers a returned
        // connection with one more round trip, its test) and from a
        // connection of each task's own.
        for pooled in [true, false] {
            let c = CONCURRENCY[CONCURRENCY.len() - 1];
            let cell = postgres_sqlx_select(&db.url(), c, pooled).await?;
            let how = if pooled {
                "a sqlx pool of as many connections"
            } else {
                "one sqlx connection per task, no pool"
            };
            floors.push((
                format!("PostgreSQL: the store's `SELECT` by key through {how}, {c} tasks"),
                cell.rate(),
                cell.p50,
            ));
        }
    }
    if wanted("redis") {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let prefix = format!("bench_store_{}:", std::process::id());
        let store = RedisCache::new(
            MemoryStore::with_limits(usize::MAX, usize::MAX),
            RedisCacheConfig::new(url.clone()).prefix(prefix.clone()),
        )
        .map_err(|e| e.to_string())?;
        // Completed records reach Redis in the background.
        let salt: u64 = rand::random();
        let warm = first_executions(&store, salt, 8).await;
        store.settled().await;
        let cell = replays(&store, salt, warm.ops.min(5_000), 1).await;
        rows.push(("memory + Redis | replay | 1".into(), cell));
        floors.push(redis_floor(&url)?);
        cleanup_redis(&url, &prefix);
    }
    if wanted("memory") {
        let store = MemoryStore::with_limits(usize::MAX, usize::MAX);
        rows.extend(store_cells("memory", &store).await);
    }

    println!("\n| store | workload | concurrency | operations/s | p50 |");
    println!("|---|---|---:|---:|---:|");
    for (label, cell) in &rows {
        println!("| {label} | {:.0} | {} |", cell.rate(), us(cell.p50));
    }
    println!("\n| floor | operations/s | p50 |");
    println!("|---|---:|---:|");
    for (label, rate, p50) in &floors {
        println!("| {label} | {rate:.0} | {} |", us(*p50));
    }
    if wanted("memory") {
        memory_report().await;
    }
    println!(
        "load: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    Ok(())
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The columns of the store's lookup.
type LiveRow = (
    Vec<u8>,
    String,
    Option<i16>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Option<i64>,
);

/// The store's own lookup (as `src/store/sqlite.rs` has it), run directly.
async fn sqlite_select_floor(path: &std::path::Path, concurrency: usize) -> Result<Cell, String> {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    let pool = SqlitePoolOptions::new()
        .max_connections(concurrency as u32)
        .connect_with(SqliteConnectOptions::new().filename(path))
        .await
        .map_err(|e| e.to_string())?;
    let keys: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT key FROM idempotency_records WHERE state = 'completed' LIMIT 5000",
    )
    .fetch_all(&pool)
    .await
    .map_err(|e| e.to_string())?;
    let keys = Arc::new(keys);
    let cell = drive(concurrency, move |n| {
        let (pool, keys) = (pool.clone(), keys.clone());
        async move {
            let row: Option<LiveRow> = sqlx::query_as(
                "SELECT fingerprint, state, status, headers, body,
                            CAST(max(lease_expires_at - unixepoch('subsec'), 0) * 1e6 AS INTEGER)
                                AS lease_remaining_us
                     FROM idempotency_records
                     WHERE key = ?1 AND expires_at > unixepoch('subsec')",
            )
            .bind(&keys[n as usize % keys.len()])
            .fetch_optional(&pool)
            .await
            .expect("select");
            assert!(row.is_some());
        }
    })
    .await;
    Ok(cell)
}

/// The store's own lookup (as `src/store/postgres.rs` has it) through
/// sqlx by `concurrency` tasks, over a pool of `concurrency` connections or
/// with a connection of each task's own.
async fn postgres_sqlx_select(url: &str, concurrency: usize, pooled: bool) -> Result<Cell, String> {
    use sqlx::postgres::PgPoolOptions;
    use sqlx::Connection;
    const SELECT: &str = "
SELECT fingerprint, state, status, headers, body,
       (extract(epoch FROM greatest(lease_expires_at - now(), interval '0')) * 1000000)::bigint
           AS lease_remaining_us
FROM idempotency_records
WHERE key = $1 AND expires_at > now()";
    let pool = PgPoolOptions::new()
        .max_connections(concurrency as u32)
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let keys: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT key FROM idempotency_records WHERE state = 'completed' LIMIT 5000",
    )
    .fetch_all(&pool)
    .await
    .map_err(|e| e.to_string())?;
    let keys = Arc::new(keys);
    if pooled {
        return Ok(drive(concurrency, move |n| {
            let (pool, keys) = (pool.clone(), keys.clone());
            async move {
                let row: Option<LiveRow> = sqlx::query_as(SELECT)
                    .bind(keys[n as usize % keys.len()].as_slice())
                    .fetch_optional(&pool)
                    .await
                    .expect("select");
                assert!(row.is_some());
            }
        })
        .await);
    }
    pool.close().await;
    let mut connections = Vec::new();
    for _ in 0..concurrency {
        connections.push(
            sqlx::PgConnection::connect(url)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = connections
        .into_iter()
        .map(|mut connection| {
            let (keys, next, stop) = (keys.clone(), next.clone(), stop.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while !stop.load(Relaxed) {
                    let n = next.fetch_add(1, Relaxed);
                    let t = Instant::now();
                    let row: Option<LiveRow> = sqlx::query_as(SELECT)
                        .bind(keys[n as usize % keys.len()].as_slice())
                        .fetch_optional(&mut connection)
                        .await
                        .expect("select");
                    assert!(row.is_some());
                    samples.push(t.elapsed());
                }
                samples
            })
        })
        .collect();
    tokio::time::sleep(seconds()).await;
    stop.store(true, Relaxed);
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.map_err(|e| e.to_string())?);
    }
    let elapsed = started.elapsed();
    samples.sort();
    Ok(Cell {
        ops: samples.len() as u64,
        elapsed,
        p50: samples[samples.len() / 2],
    })
}

/// A private database with the store's schema, dropped at the end.
struct Database {
    admin: String,
    name: String,
}

impl Database {
    fn create(admin: &str) -> Result<Self, String> {
        let name = format!("bench_store_{}", std::process::id());
        psql(admin, &format!("CREATE DATABASE {name}"))?;
        Ok(Database {
            admin: admin.to_string(),
            name,
        })
    }

    fn url(&self) -> String {
        match self.admin.rfind('/') {
            Some(i) => format!("{}/{}", &self.admin[..i], self.name),
            None => self.admin.clone(),
        }
    }
}

impl Drop for Database {
    fn drop(&mut self) {
        let _ = psql(
            &self.admin,
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

fn output(command: &mut Command) -> Result<String, String> {
    let out = command.output().map_err(|e| format!("{command:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{command:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn psql(url: &str, sql: &str) -> Result<String, String> {
    output(Command::new("psql").args([url, "-v", "ON_ERROR_STOP=1", "-qAtc", sql]))
}

/// `pgbench -M prepared` at 1 and 64 clients: the store's reserve `INSERT`
/// then its complete `UPDATE` of the same key (a first execution's two
/// transactions), and its `SELECT` by key (a replay). The schema is the
/// store's own (the store connected first and migrated it).
fn postgres_floors(
    url: &str,
    dir: &std::path::Path,
) -> Result<Vec<(String, f64, Duration)>, String> {
    const KEY: &str = "sha256(int8send(:k))";
    const OWNER: &str = "substr(sha256(int8send(:k)), 1, 16)";
    let first = format!(
        "\\set k random(1, 9000000000000000000)\n\
         INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at) \
         VALUES ({KEY}, {KEY}, {OWNER}, 'in_flight', \
                 now() + 30000000::bigint * interval '1 microsecond', \
                 now() + 86400000000::bigint * interval '1 microsecond') \
         ON CONFLICT (key) DO NOTHING RETURNING false AS takeover;\n\
         UPDATE idempotency_records \
         SET state = 'completed', owner = NULL, lease_expires_at = NULL, \
             status = 201, headers = '\\x0000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e', \
             body = convert_to(repeat('x', 1024), 'UTF8'), \
             expires_at = now() + 86400000000::bigint * interval '1 microsecond' \
         WHERE key = {KEY} AND owner = {OWNER} AND state = 'in_flight';\n"
    );
    psql(
        url,
        "INSERT INTO idempotency_records (key, fingerprint, owner, state, status, headers, body, expires_at) \
         SELECT sha256(int8send(-g)), sha256(int8send(-g)), NULL, 'completed', 201, '\\x00'::bytea, \
                convert_to(repeat('x', 1024), 'UTF8'), now() + interval '1 day' \
         FROM generate_series(1, 5000) g",
    )?;
    let select = "\\set k random(-5000, -1)\n\
         SELECT fingerprint, state, status, headers, body, \
                (extract(epoch FROM greatest(lease_expires_at - now(), interval '0')) * 1000000)::bigint \
         FROM idempotency_records WHERE key = sha256(int8send(:k)) AND expires_at > now();\n";
    let mut floors = Vec::new();
    for (name, script) in [
        ("first execution (INSERT + UPDATE)", first.as_str()),
        ("replay (SELECT)", select),
    ] {
        let file = dir.join("pgbench.sql");
        std::fs::write(&file, script).map_err(|e| e.to_string())?;
        for &c in &CONCURRENCY {
            let out = output(
                Command::new("pgbench")
                    .args([
                        "-n",
                        "-M",
                        "prepared",
                        "-j",
                        "2",
                        "-c",
                        &c.to_string(),
                        "-T",
                    ])
                    .arg(seconds().as_secs().max(1).to_string())
                    .arg("-f")
                    .arg(&file)
                    .arg(url),
            )?;
            let tps = out
                .lines()
                .find_map(|l| l.strip_prefix("tps = "))
                .and_then(|l| l.split_whitespace().next())
                .and_then(|t| t.parse::<f64>().ok())
                .ok_or_else(|| format!("no tps in pgbench output: {out}"))?;
            let latency = out
                .lines()
                .find_map(|l| l.strip_prefix("latency average = "))
                .and_then(|l| l.split_whitespace().next())
                .and_then(|t| t.parse::<f64>().ok())
                .unwrap_or(0.0);
            floors.push((
                format!(
                    "PostgreSQL: pgbench, the store's {name}, {c} client(s) (latency: average)"
                ),
                tps,
                Duration::from_secs_f64(latency / 1e3),
            ));
        }
    }
    Ok(floors)
}

/// `redis-benchmark -c 1 -t get -d 1024`: its own p50.
fn redis_floor(url: &str) -> Result<(String, f64, Duration), String> {
    let rest = url.trim_start_matches("redis://");
    let hostport = rest
        .rsplit('@')
        .next()
        .unwrap_or(rest)
        .trim_end_matches('/');
    let (host, port) = hostport.split_once(':').unwrap_or((hostport, "6379"));
    let out = output(Command::new("redis-benchmark").args([
        "-h", host, "-p", port, "-c", "1", "-n", "20000", "-t", "get", "-d", "1024", "-q",
    ]))?;
    // "GET: 17000.00 requests per second, p50=0.055 msec"
    let line = out
        .split(['\r', '\n'])
        .rfind(|l| l.starts_with("GET:"))
        .ok_or_else(|| format!("no GET line: {out}"))?;
    let rate = line
        .trim_start_matches("GET:")
        .split_whitespace()
        .next()
        .and_then(|r| r.parse::<f64>().ok())
        .unwrap_or(0.0);
    let p50 = line
        .split("p50=")
        .nth(1)
        .and_then(|p| p.split_whitespace().next())
        .and_then(|p| p.parse::<f64>().ok())
        .ok_or_else(|| format!("no p50 in: {line}"))?;
    Ok((
        "Redis: `redis-benchmark -c 1 -t get -d 1024`".into(),
        rate,
        Duration::from_secs_f64(p50 / 1e3),
    ))
}

fn cleanup_redis(url: &str, prefix: &str) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "redis-cli -u '{url}' --scan --pattern '{prefix}*' | xargs -r redis-cli -u '{url}' del > /dev/null"
        ))
        .status();
}

/// Resident set size of this process, from `/proc/self/statm`.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// The memory store's footprint: resident memory before and after 100,000
/// completed 1 KiB responses, and after 10,000 in-flight reservations.
async fn memory_report() {
    const RECORDS: u64 = 100_000;
    const IN_FLIGHT: u64 = 10_000;
    let store = MemoryStore::with_limits(usize::MAX, usize::MAX);
    let done = outcome();
    let before = rss();
    for n in 0..RECORDS {
        let key = key(1, n);
        let owner = OwnerToken::random();
        store
            .reserve(&key, &FINGERPRINT, &owner, LEASE, TTL)
            .await
            .expect("reserve");
        // A body of its own per record, as a real store holds.
        let Outcome::Stored(response) = &done else {
            unreachable!()
        };
        let own = Outcome::Stored(StoredResponse {
            body: Bytes::copy_from_slice(&response.body),
            ..response.clone()
        });
        assert!(store
            .complete(&key, &owner, &own, TTL)
            .await
            .expect("complete"));
    }
    let stored = rss();
    for n in 0..IN_FLIGHT {
        store
            .reserve(&key(2, n), &FINGERPRINT, &OwnerToken::random(), LEASE, TTL)
            .await
            .expect("reserve");
    }
    let in_flight = rss();
    println!("\n| memory store | resident memory |");
    println!("|---|---:|");
    println!(
        "| empty (the process) | {:.1} MiB |",
        before as f64 / 1048576.0
    );
    println!(
        "| {RECORDS} stored 1 KiB responses | {:.1} MiB (+{:.1} MiB, {} bytes per record) |",
        stored as f64 / 1048576.0,
        (stored - before) as f64 / 1048576.0,
        (stored - before) / RECORDS
    );
    println!(
        "| + {IN_FLIGHT} in-flight reservations | {:.1} MiB ({} bytes per reservation) |",
        in_flight as f64 / 1048576.0,
        in_flight.saturating_sub(stored) / IN_FLIGHT
    );
    drop(store);
}
