//! What the outbox costs, as ratios measured in one run against the
//! PostgreSQL at `DATABASE_URL` (default the local test database), in a
//! schema of its own that is dropped at the end:
//!
//! 1. **enqueue**: a transaction writing a business row and
//!    `outbox::enqueue` against the same transaction with a plain `INSERT`
//!    of the same row into an identical table;
//! 2. **throughput**: deliveries per second by one worker with 1, 4 and 16
//!    concurrent deliveries to a no-op HTTP receiver, against two floors of
//!    the claim and complete statements alone at the same concurrency: N
//!    tasks of this process calling `Outbox::claim(1)` and `complete`, and
//!    `pgbench -c N` running the same two statements (SQL of
//!    `src/outbox/postgres.rs`, parameters inlined) as its script — skipped
//!    with a note when `pgbench` is not on `PATH` (or `PGBENCH`);
//! 3. **latency**: median time from commit to the receiver with an idle
//!    worker, woken by `LISTEN/NOTIFY` (polling every second) against
//!    polling every 100 ms.
//!
//! `cargo bench --bench outbox --features outbox,postgres`
//! (`OUTBOX_BENCH_MESSAGES`, default 2000, messages per throughput run).

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tower_idempotency::outbox::{
    self, Backoff, Destination, Message, Outbox, WebhookDeliverer, Worker, WorkerConfig,
};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn messages() -> usize {
    std::env::var("OUTBOX_BENCH_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000)
}

/// Arrival times at the receiver.
type Arrivals = Arc<Mutex<Vec<Instant>>>;

async fn receiver() -> (String, Arrivals) {
    let arrivals: Arrivals = Arc::default();
    let seen = arrivals.clone();
    let app = Router::new().route(
        "/hook",
        post(move || {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(Instant::now());
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, arrivals)
}

fn config(concurrency: usize, poll: Duration, listen: bool) -> WorkerConfig {
    WorkerConfig {
        concurrency,
        poll_interval: poll,
        listen,
        backoff: Backoff {
            base: Duration::from_millis(10),
            ..Backoff::default()
        },
        retention: None,
        ..WorkerConfig::default()
    }
}

async fn enqueue_bench(pool: &PgPool) -> (Duration, Duration) {
    const ROUNDS: usize = 10;
    const PER_ROUND: usize = 200;
    let (mut with_outbox, mut plain) = (Duration::ZERO, Duration::ZERO);
    for round in 0..ROUNDS {
        // Alternate so drift (autovacuum, other load) hits both sides.
        for side in 0..2 {
            let start = Instant::now();
            for i in 0..PER_ROUND {
                let source = format!("e{round}-{side}-{i}");
                let payload = format!(r#"{{"submission":"{source}"}}"#).into_bytes();
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("INSERT INTO submissions (id) VALUES ($1)")
                    .bind(&source)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                if side == 0 {
                    let message = Message::new("crm", source.as_str(), payload);
                    outbox::enqueue(&mut *tx, &message).await.unwrap();
                } else {
                    sqlx::query(
                        "INSERT INTO plain_messages
                             (topic, source, delivery_key, payload, content_type, max_attempts)
                         VALUES ($1, $2, $3, $4, $5, $6)",
                    )
                    .bind("crm")
                    .bind(&source)
                    .bind(Message::derived_key("crm", &source))
                    .bind(payload)
                    .bind("application/json")
                    .bind(12)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                }
                tx.commit().await.unwrap();
            }
            if side == 0 {
                with_outbox += start.elapsed();
            } else {
                plain += start.elapsed();
            }
        }
    }
    (with_outbox, plain)
}

async fn fill(pool: &PgPool, topic: &str, n: usize) {
    sqlx::query(
        "INSERT INTO outbox_messages (topic, source, payload)
         SELECT $1, 'm' || g, convert_to('{}', 'UTF8') FROM generate_series(1, $2) g",
    )
    .bind(topic)
    .bind(n as i64)
    .execute(pool)
    .await
    .unwrap();
}

/// Deliveries per second of one worker with `concurrency` slots.
async fn worker_rate(pool: &PgPool, url: &str, concurrency: usize, n: usize) -> f64 {
    sqlx::query("TRUNCATE outbox_messages")
        .execute(pool)
        .await
        .unwrap();
    fill(pool, "crm", n).await;
    let outbox = Outbox::postgres(pool.clone());
    let deliverer =
        WebhookDeliverer::new().destination("crm", Destination::new(url.parse().unwrap()));
    let start = Instant::now();
    let worker = Worker::new(outbox.clone(), deliverer)
        .config(config(concurrency, Duration::from_millis(10), false))
        .spawn();
    while outbox.metrics().delivered() < n as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    worker.shutdown().await;
    n as f64 / elapsed.as_secs_f64()
}

/// Claim-and-complete cycles per second with `concurrency` tasks, no
/// delivery: the database's floor for the same work.
async fn floor_rate(pool: &PgPool, concurrency: usize, n: usize) -> f64 {
    sqlx::query("TRUNCATE outbox_messages")
        .execute(pool)
        .await
        .unwrap();
    fill(pool, "crm", n).await;
    let outbox = Outbox::postgres(pool.clone());
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let outbox = outbox.clone();
            tokio::spawn(async move {
                loop {
                    let claimed = outbox
                        .claim(1, Duration::from_secs(30), None)
                        .await
                        .unwrap();
                    let Some(delivery) = claimed.first() else {
                        return;
                    };
                    assert!(outbox.complete(delivery, Some(204), None).await.unwrap());
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// The claim (one row) and the fenced complete of `src/outbox/postgres.rs`
/// as a pgbench script: `\gset` keeps the claimed row's id and owner.
const PGBENCH_SCRIPT: &str = r"WITH due AS MATERIALIZED (
    SELECT id FROM outbox_messages
    WHERE state IN ('available', 'retryable') AND next_attempt_at <= now()
      AND (NULL::text[] IS NULL OR topic = ANY(NULL::text[]))
    ORDER BY next_attempt_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
) UPDATE outbox_messages AS m SET state = 'running', attempt = m.attempt + 1, owner = uuid_send(gen_random_uuid()), lease_expires_at = now() + 30000000::bigint * interval '1 microsecond', updated_at = now() FROM due WHERE m.id = due.id AND m.state IN ('available', 'retryable') RETURNING m.id AS claimed, encode(m.owner, 'hex') AS owner, m.topic, m.source, m.delivery_key, m.payload, m.content_type, m.attempt, m.max_attempts \gset
UPDATE outbox_messages SET state = 'completed', owner = NULL, lease_expires_at = NULL, completed_at = now(), updated_at = now(), last_error_class = NULL, last_error = NULL, last_status = 204, last_request_id = NULL WHERE id = :claimed AND owner = decode(':owner', 'hex') AND state = 'running';
";

/// Claim-and-complete cycles per second of `pgbench -c concurrency` on the
/// same table (`None` without pgbench).
async fn pgbench_rate(
    pool: &PgPool,
    url: &str,
    schema: &str,
    concurrency: usize,
    n: usize,
) -> Option<f64> {
    sqlx::query("TRUNCATE outbox_messages")
        .execute(pool)
        .await
        .unwrap();
    let transactions = n / concurrency;
    fill(pool, "crm", transactions * concurrency).await;
    let script = std::env::temp_dir().join(format!("outbox_bench_{}.sql", std::process::id()));
    std::fs::write(&script, PGBENCH_SCRIPT).unwrap();
    let program = std::env::var("PGBENCH").unwrap_or_else(|_| "pgbench".to_owned());
    let output = tokio::process::Command::new(program)
        .env("PGOPTIONS", format!("-c search_path={schema}"))
        .args(["-n", "-f"])
        .arg(&script)
        .args([
            "-c",
            &concurrency.to_string(),
            "-j",
            &concurrency.min(4).to_string(),
        ])
        .args(["-t", &transactions.to_string()])
        .arg(url)
        .output()
        .await;
    let _ = std::fs::remove_file(&script);
    let output = match output {
        Ok(output) if output.status.success() => output,
        Ok(output) => panic!(
            "pgbench failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ),
        Err(error) => {
            println!("pgbench floor skipped: cannot run pgbench ({error})");
            return None;
        }
    };
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_messages WHERE state = 'completed'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(
        completed as usize,
        transactions * concurrency,
        "every pgbench cycle completed a row"
    );
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find(|line| line.starts_with("tps = "))
        .and_then(|line| {
            line["tps = ".len()..]
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
}

/// Median commit-to-receiver time over `samples` messages sent one at a
/// time to an idle worker.
async fn latency(pool: &PgPool, listen: bool, poll: Duration, samples: usize) -> Duration {
    sqlx::query("TRUNCATE outbox_messages")
        .execute(pool)
        .await
        .unwrap();
    let (url, arrivals) = receiver().await;
    let deliverer =
        WebhookDeliverer::new().destination("crm", Destination::new(url.parse().unwrap()));
    let worker = Worker::new(Outbox::postgres(pool.clone()), deliverer)
        .config(config(4, poll, listen))
        .spawn();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut times = Vec::new();
    for i in 0..samples {
        let source = format!("l{listen}-{i}");
        let mut tx = pool.begin().await.unwrap();
        let message = Message::new("crm", source.as_str(), b"{}".to_vec());
        outbox::enqueue(&mut *tx, &message).await.unwrap();
        outbox::notify(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        let committed = Instant::now();
        loop {
            if let Some(arrived) = arrivals.lock().unwrap().get(i) {
                times.push(arrived.saturating_duration_since(committed));
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Idle again, at a random point of the polling cycle.
        tokio::time::sleep(Duration::from_millis(37)).await;
    }
    worker.shutdown().await;
    times.sort();
    times[times.len() / 2]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let url = database_url();
    let schema = format!("outbox_bench_{}", std::process::id());
    let mut admin = PgConnection::connect(&url).await.unwrap();
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&mut admin)
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&url)
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(40)
        .connect_with(options)
        .await
        .unwrap();
    let outbox = Outbox::postgres(pool.clone());
    outbox.migrate().await.unwrap();
    for sql in [
        "CREATE TABLE submissions (id text PRIMARY KEY)",
        "CREATE TABLE plain_messages (LIKE outbox_messages INCLUDING ALL)",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }

    let (with_outbox, plain) = enqueue_bench(&pool).await;
    println!(
        "enqueue in a transaction: {:.1} µs vs plain INSERT {:.1} µs per transaction: {:.2}x (target <= 1.2x)",
        with_outbox.as_secs_f64() * 1e6 / 2000.0,
        plain.as_secs_f64() * 1e6 / 2000.0,
        with_outbox.as_secs_f64() / plain.as_secs_f64()
    );

    let n = messages();
    let url_db = url.clone();
    let (url, _) = receiver().await;
    for concurrency in [1, 4, 16] {
        let delivered = worker_rate(&pool, &url, concurrency, n).await;
        let floor = floor_rate(&pool, concurrency, n).await;
        println!(
            "throughput, {concurrency:>2} concurrent: {delivered:.0} deliveries/s vs floor {floor:.0} claim+complete/s: {:.2}x (target >= 0.7x)",
            delivered / floor
        );
        if let Some(pgbench) = pgbench_rate(&pool, &url_db, &schema, concurrency, n).await {
            println!(
                "throughput, {concurrency:>2} concurrent: {delivered:.0} deliveries/s vs pgbench -c {concurrency} claim+complete {pgbench:.0} tps: {:.2}x (target >= 0.7x)",
                delivered / pgbench
            );
        }
    }

    let notified = latency(&pool, true, Duration::from_secs(1), 50).await;
    let polled = latency(&pool, false, Duration::from_millis(100), 50).await;
    println!(
        "commit to delivery, idle worker (median of 50): LISTEN/NOTIFY {:.1} ms vs polling every 100 ms {:.1} ms: {:.2}x (target < 50 ms)",
        notified.as_secs_f64() * 1e3,
        polled.as_secs_f64() * 1e3,
        notified.as_secs_f64() / polled.as_secs_f64()
    );

    pool.close().await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&mut admin)
        .await
        .unwrap();
}
