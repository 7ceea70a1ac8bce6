//! The transactional outbox against real PostgreSQL and SQLite: one test
//! macro, instantiated per database (each test on a schema or file of its
//! own), with an axum receiver that verifies every signature and counts
//! each delivery key's effects.
#![cfg(all(feature = "outbox", feature = "postgres", feature = "sqlite"))]

mod fixtures;

// The seed's form platform (examples/form_outbox.rs), driven below.
#[path = "../examples/form_outbox.rs"]
#[allow(dead_code)]
mod form_outbox;

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use sqlx::postgres::PgConnectOptions;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{PgPool, SqlitePool};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use tower_idempotency::outbox::{
    self, Backoff, Destination, Message, Outbox, State, WebhookDeliverer, WebhookSecret, Worker,
    WorkerConfig, WorkerHandle,
};
use tower_idempotency::outbox::{Delivered, Deliverer, Delivery, DeliveryError};
use tower_idempotency::{Engine, IdempotencyLayer, MemoryStore, Policy, Routes, SqliteStore};

/// The signing secret of every test destination.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// Personal data in every payload; it must never reach an error column.
const PII: &str = "jane.doe@example.com";
/// How long a test waits for the workers before it gives up.
const PATIENCE: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------- databases

enum Pool {
    Pg(PgPool, Box<PgConnectOptions>),
    Lite(SqlitePool, String),
}

/// A database of its own: the business table `submissions` and the outbox.
struct TestDb {
    pool: Pool,
    outbox: Outbox,
}

impl TestDb {
    async fn postgres() -> TestDb {
        let options = fixtures::fresh_schema().await;
        let pool = fixtures::pool(options.clone(), 8).await;
        sqlx::query("CREATE TABLE submissions (id text PRIMARY KEY)")
            .execute(&pool)
            .await
            .unwrap();
        let outbox = Outbox::postgres(pool.clone());
        outbox.migrate().await.unwrap();
        TestDb {
            pool: Pool::Pg(pool, Box::new(options)),
            outbox,
        }
    }

    async fn sqlite() -> TestDb {
        let path = fixtures::sqlite_path().to_str().unwrap().to_owned();
        let pool = sqlite_pool(&path).await;
        sqlx::query("CREATE TABLE submissions (id TEXT PRIMARY KEY)")
            .execute(&pool)
            .await
            .unwrap();
        let outbox = Outbox::sqlite(pool.clone());
        outbox.migrate().await.unwrap();
        TestDb {
            pool: Pool::Lite(pool, path),
            outbox,
        }
    }

    /// The same table through a pool of its own, as another process sees
    /// it.
    async fn another_outbox(&self) -> Outbox {
        match &self.pool {
            Pool::Pg(_, options) => Outbox::postgres(fixtures::pool((**options).clone(), 4).await),
            Pool::Lite(_, path) => Outbox::sqlite(sqlite_pool(path).await),
        }
    }

    /// A form handler: the submission and one outbox row per topic in one
    /// transaction, committed or rolled back. Returns what each enqueue
    /// added.
    async fn submit(&self, id: &str, topics: &[&str], commit: bool) -> Vec<bool> {
        let messages: Vec<Message> = topics
            .iter()
            .map(|topic| Message::new(*topic, id, payload(id)))
            .collect();
        let mut added = Vec::new();
        match &self.pool {
            Pool::Pg(pool, _) => {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("INSERT INTO submissions (id) VALUES ($1) ON CONFLICT DO NOTHING")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                for message in &messages {
                    added.push(outbox::enqueue(&mut *tx, message).await.unwrap());
                }
                if commit {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
            }
            Pool::Lite(pool, _) => {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("INSERT INTO submissions (id) VALUES (?1) ON CONFLICT DO NOTHING")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                for message in &messages {
                    added.push(outbox::enqueue(&mut *tx, message).await.unwrap());
                }
                if commit {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
            }
        }
        added
    }

    async fn submissions(&self) -> i64 {
        let sql = "SELECT count(*) FROM submissions";
        match &self.pool {
            Pool::Pg(pool, _) => sqlx::query_scalar(sql).fetch_one(pool).await.unwrap(),
            Pool::Lite(pool, _) => sqlx::query_scalar(sql).fetch_one(pool).await.unwrap(),
        }
    }

    /// Every row's error columns, concatenated.
    async fn error_columns(&self) -> String {
        let sql = "SELECT coalesce(last_error_class, '') || ' ' || coalesce(last_request_id, '')
                   || ' ' || coalesce(last_error, '') FROM outbox_messages";
        let rows: Vec<String> = match &self.pool {
            Pool::Pg(pool, _) => sqlx::query_scalar(sql).fetch_all(pool).await.unwrap(),
            Pool::Lite(pool, _) => sqlx::query_scalar(sql).fetch_all(pool).await.unwrap(),
        };
        rows.join("\n")
    }
}

async fn sqlite_pool(path: &str) -> SqlitePool {
    SqliteStore::connect_with(SqliteConnectOptions::new().filename(path))
        .await
        .unwrap()
        .pool()
        .clone()
}

fn payload(source: &str) -> Vec<u8> {
    format!(r#"{{"submission":"{source}","email":"{PII}"}}"#).into_bytes()
}

// ----------------------------------------------------------------- receiver

/// One scripted answer.
#[derive(Clone)]
struct Answer {
    status: u16,
    retry_after: Option<&'static str>,
    /// Hold the answer this long (a slow receiver).
    delay: Duration,
}

impl Answer {
    fn status(status: u16) -> Answer {
        Answer {
            status,
            retry_after: None,
            delay: Duration::ZERO,
        }
    }
}

#[derive(Default)]
struct Log {
    /// Per key, the answers still to give (then 201).
    scripts: HashMap<String, VecDeque<Answer>>,
    /// Every request: (key, status answered), in arrival order.
    requests: Vec<(String, u16)>,
    /// 2xx answers per key: the effect.
    effects: HashMap<String, u32>,
    /// Requests whose signature, id or key did not check out.
    bad: Vec<String>,
    requests_seen: u64,
    /// Requests whose sender went away before the answer (the handler was
    /// dropped while it held the answer).
    abandoned: u64,
}

/// An HTTP receiver standing in for a CRM.
#[derive(Clone)]
struct Receiver {
    log: Arc<Mutex<Log>>,
    addr: SocketAddr,
}

impl Receiver {
    async fn start() -> Receiver {
        let log = Arc::new(Mutex::new(Log::default()));
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(log.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Receiver { log, addr }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn script(&self, key: &str, answers: Vec<Answer>) {
        self.log
            .lock()
            .unwrap()
            .scripts
            .insert(key.to_owned(), answers.into());
    }

    fn destination(&self) -> Destination {
        Destination::new(format!("http://{}/hook", self.addr).parse().unwrap())
            .secret(WebhookSecret::from_whsec(SECRET).unwrap())
    }

    /// A webhook deliverer sending topics `crm` and `mail` here.
    fn deliverer(&self) -> WebhookDeliverer {
        WebhookDeliverer::new()
            .destination("crm", self.destination())
            .destination("mail", self.destination())
    }

    fn statuses(&self, key: &str) -> Vec<u16> {
        let log = self.log.lock().unwrap();
        log.requests
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, status)| *status)
            .collect()
    }

    fn effects(&self) -> HashMap<String, u32> {
        self.log.lock().unwrap().effects.clone()
    }

    fn requests(&self) -> usize {
        self.log.lock().unwrap().requests.len()
    }

    fn bad(&self) -> Vec<String> {
        self.log.lock().unwrap().bad.clone()
    }

    fn abandoned(&self) -> u64 {
        self.log.lock().unwrap().abandoned
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

async fn receive(
    AxumState(log): AxumState<Arc<Mutex<Log>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = header(&headers, "idempotency-key").to_owned();
    let id = header(&headers, "webhook-id");
    let timestamp = header(&headers, "webhook-timestamp");
    // Verify as a Standard Webhooks receiver would, independently of the
    // crate's signing code.
    let secret = base64::engine::general_purpose::STANDARD
        .decode(SECRET.trim_start_matches("whsec_"))
        .unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(&body);
    let expected = format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    );
    let answer = {
        let mut log = log.lock().unwrap();
        log.requests_seen += 1;
        if key.is_empty() || id != key || header(&headers, "webhook-signature") != expected {
            log.bad.push(key.clone());
        }
        let answer = log
            .scripts
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .unwrap_or(Answer::status(201));
        log.requests.push((key.clone(), answer.status));
        answer
    };
    // Counts the request as abandoned if the sender drops it while held.
    struct Held(Option<Arc<Mutex<Log>>>);
    impl Drop for Held {
        fn drop(&mut self) {
            if let Some(log) = self.0.take() {
                log.lock().unwrap().abandoned += 1;
            }
        }
    }
    let mut held = Held(Some(log.clone()));
    tokio::time::sleep(answer.delay).await;
    held.0 = None;
    if (200..300).contains(&answer.status) {
        *log.lock().unwrap().effects.entry(key.clone()).or_default() += 1;
    }
    let seen = log.lock().unwrap().requests_seen;
    let mut response = (
        StatusCode::from_u16(answer.status).unwrap(),
        // A careless receiver echoes the request in its error answers.
        body,
    )
        .into_response();
    response
        .headers_mut()
        .insert("x-request-id", format!("req-{seen}").parse().unwrap());
    if let Some(after) = answer.retry_after {
        response
            .headers_mut()
            .insert("retry-after", after.parse().unwrap());
    }
    response
}

// ------------------------------------------------------------------ helpers

/// Short intervals for tests; no jitter, so schedules are exact.
fn fast() -> WorkerConfig {
    WorkerConfig {
        concurrency: 8,
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_millis(20),
        backoff: Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(50),
            max_retry_after: Duration::from_secs(60),
            jitter: false,
        },
        rescue_interval: Duration::from_millis(100),
        batch: 100,
        retention: None,
        sweep_interval: Duration::from_secs(60),
        shutdown_grace: Duration::from_secs(5),
        topics: None,
        listen: true,
    }
}

fn spawn_worker_to(
    outbox: Outbox,
    deliverer: WebhookDeliverer,
    config: WorkerConfig,
) -> WorkerHandle {
    Worker::new(outbox, deliverer).config(config).spawn()
}

fn spawn_worker(outbox: Outbox, receiver: &Receiver, config: WorkerConfig) -> WorkerHandle {
    Worker::new(outbox, receiver.deliverer())
        .config(config)
        .spawn()
}

/// Waits until `check` holds (a liveness bound, not a timing claim).
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn state_of(outbox: &Outbox, topic: &str, source: &str) -> outbox::MessageStatus {
    outbox.status(topic, source).await.unwrap().unwrap()
}

/// How many messages the many-workers test sends: 2,000, or
/// `OUTBOX_MESSAGES` (e.g. 10000 in a release run).
fn many() -> usize {
    std::env::var("OUTBOX_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000)
}

/// A receiver with an effect (a CRM record per request that reaches it)
/// behind the idempotency layer, keyed on `Idempotency-Key`.
#[derive(Clone)]
struct LayeredReceiver {
    addr: SocketAddr,
    /// Requests that reached the layer, and whether each was a replay.
    requests: Arc<Mutex<Vec<bool>>>,
    /// Effects performed by the handler.
    effects: Arc<AtomicUsize>,
    /// Handler entries (before its effect).
    entered: Arc<AtomicUsize>,
}

impl LayeredReceiver {
    /// The handler takes `slow` before its effect.
    async fn start(slow: Duration) -> LayeredReceiver {
        Self::start_with(slow, Policy::default()).await
    }

    /// The handler takes `slow` before its effect; the layer has `policy`.
    async fn start_with(slow: Duration, policy: Policy) -> LayeredReceiver {
        let effects = Arc::new(AtomicUsize::new(0));
        let entered = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let engine = Engine::new(MemoryStore::new(), Routes::all(policy).unwrap());
        let handler = {
            let (effects, entered) = (effects.clone(), entered.clone());
            move || async move {
                entered.fetch_add(1, SeqCst);
                tokio::time::sleep(slow).await;
                effects.fetch_add(1, SeqCst);
                (StatusCode::CREATED, "crm record created")
            }
        };
        let seen = requests.clone();
        let app = Router::new()
            .route("/hook", post(handler))
            .layer(IdempotencyLayer::new(engine))
            .layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let seen = seen.clone();
                    async move {
                        let response = next.run(request).await;
                        let replayed = response.headers().contains_key("idempotent-replayed");
                        seen.lock().unwrap().push(replayed);
                        response
                    }
                },
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        LayeredReceiver {
            addr,
            requests,
            effects,
            entered,
        }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn deliverer(&self) -> WebhookDeliverer {
        WebhookDeliverer::new().destination("crm", Destination::new(self.url().parse().unwrap()))
    }
}

/// Delivers, then hangs before the worker can record the success: the
/// worker "dies" between the receiver's success and the completion.
struct HangsAfterSuccess {
    inner: WebhookDeliverer,
    delivered: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Deliverer for HangsAfterSuccess {
    async fn deliver(&self, delivery: &Delivery) -> Result<Delivered, DeliveryError> {
        self.inner.deliver(delivery).await?;
        self.delivered.fetch_add(1, SeqCst);
        std::future::pending().await
    }
}

// ------------------------------------------------------- a worker process

/// Where [`child_worker`] finds its work: `db|receiver|workers|lease_ms`.
const CHILD_ENV: &str = "OUTBOX_TEST_CHILD";

/// Workers in another process: this test binary again, running only the
/// ignored test [`child_worker`]. Killed with SIGKILL when dropped.
struct ChildWorker(std::process::Child);

impl ChildWorker {
    async fn spawn(db: &TestDb, receiver: &str, workers: usize, lease: Duration) -> ChildWorker {
        let target = match &db.pool {
            Pool::Pg(pool, _) => {
                let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
                    .fetch_one(pool)
                    .await
                    .unwrap();
                format!("pg:{schema}")
            }
            Pool::Lite(_, path) => format!("sqlite:{path}"),
        };
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["child_worker", "--exact", "--ignored", "--test-threads=1"])
            .env(
                CHILD_ENV,
                format!("{target}|{receiver}|{workers}|{}", lease.as_millis()),
            )
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        ChildWorker(child)
    }

    /// `kill -9`, and reaps it.
    fn kill(self) {
        drop(self);
    }
}

impl Drop for ChildWorker {
    fn drop(&mut self) {
        let _ = self.0.kill(); // SIGKILL
        let _ = self.0.wait();
    }
}

/// The child's side: `workers` workers on the given database delivering to
/// the given receiver (topics `crm` and `mail`), until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that other tests start"]
async fn child_worker() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let [target, receiver, workers, lease_ms] = spec.split('|').collect::<Vec<_>>()[..] else {
        panic!("bad {CHILD_ENV}: {spec}");
    };
    let outbox = match target.split_once(':').unwrap() {
        ("pg", schema) => {
            let options = PgConnectOptions::from_str(&fixtures::database_url())
                .unwrap()
                .options([("search_path", schema)]);
            Outbox::postgres(fixtures::pool(options, 8).await)
        }
        (_, path) => Outbox::sqlite(sqlite_pool(path).await),
    };
    let destination = Destination::new(receiver.parse().unwrap())
        .secret(WebhookSecret::from_whsec(SECRET).unwrap());
    let config = WorkerConfig {
        lease: Duration::from_millis(lease_ms.parse().unwrap()),
        ..fast()
    };
    let mut handles = Vec::new();
    for _ in 0..workers.parse().unwrap() {
        let deliverer = WebhookDeliverer::new()
            .destination("crm", destination.clone())
            .destination("mail", destination.clone());
        handles.push(
            Worker::new(outbox.clone(), deliverer)
                .config(config.clone())
                .spawn(),
        );
    }
    std::future::pending::<()>().await;
}

// -------------------------------------------------------------------- tests

macro_rules! outbox_tests {
    ($db:ident, $make:expr) => {
        mod $db {
            use super::*;

            async fn db() -> TestDb {
                $make.await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn business_row_and_outbox_rows_commit_or_roll_back_together() {
                let db = db().await;
                assert_eq!(
                    db.submit("sub-1", &["crm", "mail"], true).await,
                    [true, true]
                );
                assert_eq!(
                    db.submit("sub-2", &["crm", "mail"], false).await,
                    [true, true]
                );
                assert_eq!(db.submissions().await, 1);
                let counts = db.outbox.counts().await.unwrap();
                assert_eq!(counts.available, 2, "{counts:?}");
                assert_eq!(counts.total(), 2);
                assert!(db.outbox.status("crm", "sub-2").await.unwrap().is_none());

                // The handler runs again (a retry, a fan-out to every
                // integration): nothing is added.
                assert_eq!(
                    db.submit("sub-1", &["crm", "mail"], true).await,
                    [false, false]
                );
                assert_eq!(db.outbox.counts().await.unwrap().total(), 2);
                let crm = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(crm.delivery_key, Message::derived_key("crm", "sub-1"));
                assert_eq!(crm.state, State::Available);
                assert_eq!(crm.attempt, 0);
                assert_ne!(
                    crm.delivery_key,
                    state_of(&db.outbox, "mail", "sub-1").await.delivery_key
                );

                // A key taken by another (topic, source) is an error, not a
                // silent skip.
                let clash = Message::new("crm", "sub-3", payload("sub-3"))
                    .delivery_key(crm.delivery_key.clone());
                assert!(db.outbox.enqueue(&clash).await.is_err());
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn four_workers_deliver_every_message_with_each_key_taking_effect_once() {
                let db = db().await;
                let receiver = Receiver::start().await;
                let n = many();
                let topics = ["crm", "mail"];
                let mut expected = HashSet::new();
                for chunk in 0..n / 100 {
                    // One transaction per 50 submissions (100 messages).
                    let ids: Vec<String> =
                        (0..50).map(|i| format!("sub-{}", chunk * 50 + i)).collect();
                    for id in &ids {
                        for topic in topics {
                            expected.insert(Message::derived_key(topic, id));
                        }
                    }
                    match &db.pool {
                        Pool::Pg(pool, _) => {
                            let mut tx = pool.begin().await.unwrap();
                            for id in &ids {
                                for topic in topics {
                                    let message = Message::new(topic, id.as_str(), payload(id));
                                    assert!(outbox::enqueue(&mut *tx, &message).await.unwrap());
                                }
                            }
                            tx.commit().await.unwrap();
                        }
                        Pool::Lite(pool, _) => {
                            let mut tx = pool.begin().await.unwrap();
                            for id in &ids {
                                for topic in topics {
                                    let message = Message::new(topic, id.as_str(), payload(id));
                                    assert!(outbox::enqueue(&mut *tx, &message).await.unwrap());
                                }
                            }
                            tx.commit().await.unwrap();
                        }
                    }
                }
                assert_eq!(expected.len(), n / 100 * 100);

                // Four workers in two processes: two here, two in a child.
                let child = ChildWorker::spawn(&db, &receiver.url(), 2, fast().lease).await;
                eventually("the child process delivers", || async {
                    receiver.requests() > 0
                })
                .await;
                let mut outboxes = Vec::new();
                let mut workers = Vec::new();
                for _ in 0..2 {
                    let outbox = db.another_outbox().await;
                    workers.push(spawn_worker(outbox.clone(), &receiver, fast()));
                    outboxes.push(outbox);
                }
                eventually("every message delivered", || async {
                    db.outbox.counts().await.unwrap().completed == expected.len() as u64
                })
                .await;
                for worker in workers {
                    worker.shutdown().await;
                }
                child.kill();

                let effects = receiver.effects();
                let keys: HashSet<String> = effects.keys().cloned().collect();
                assert_eq!(keys, expected);
                let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
                assert!(twice.is_empty(), "delivered more than once: {twice:?}");
                assert_eq!(receiver.requests(), expected.len());
                assert!(
                    receiver.bad().is_empty(),
                    "bad signatures: {:?}",
                    receiver.bad()
                );
                // This process's workers did part of the work, the child the rest.
                let here: u64 = outboxes.iter().map(|o| o.metrics().delivered()).sum();
                assert!(here < expected.len() as u64, "the child delivered nothing");
                let counts = db.outbox.counts().await.unwrap();
                assert_eq!(counts.completed, counts.total(), "{counts:?}");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_stale_worker_whose_lease_was_taken_over_cannot_complete_or_fail() {
                let db = db().await;
                db.submit("sub-1", &["crm"], true).await;
                let stale_outbox = db.another_outbox().await;
                let stale = stale_outbox
                    .claim(10, Duration::from_millis(1), None)
                    .await
                    .unwrap();
                assert_eq!(stale.len(), 1);
                let stale = &stale[0];
                assert_eq!(stale.attempt(), 1);
                // Its lease runs out (by the database's clock); the rescuer
                // re-queues the row and another worker claims it.
                let deadline = tokio::time::Instant::now() + PATIENCE;
                let rescued = loop {
                    let rescued = db.outbox.rescue(10).await.unwrap();
                    if !rescued.is_empty() {
                        break rescued;
                    }
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the lease never ran out"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                };
                assert_eq!(rescued, [stale.id()]);
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.state, State::Retryable);
                assert_eq!(row.last_error_class.as_deref(), Some("lease_expired"));

                let fresh = db
                    .outbox
                    .claim(10, Duration::from_secs(60), None)
                    .await
                    .unwrap();
                assert_eq!(fresh.len(), 1);
                let fresh = &fresh[0];
                assert_eq!(fresh.id(), stale.id());
                assert_eq!(fresh.attempt(), 2);
                assert_eq!(fresh.delivery_key(), stale.delivery_key());

                // The stale worker is fenced out of every write.
                assert!(!stale_outbox
                    .renew(stale, Duration::from_secs(60))
                    .await
                    .unwrap());
                assert!(!stale_outbox.complete(stale, Some(201), None).await.unwrap());
                let error = outbox::DeliveryError::permanent("HTTP 400");
                assert_eq!(
                    stale_outbox
                        .fail(stale, &error, Duration::ZERO)
                        .await
                        .unwrap(),
                    None
                );
                assert!(!stale_outbox.release(stale).await.unwrap());
                assert_eq!(stale_outbox.metrics().lost_leases(), 2);
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.state, State::Running);
                assert_eq!(row.attempt, 2);

                // Nor can the rescuer take a live lease.
                assert!(db.outbox.rescue(10).await.unwrap().is_empty());
                assert!(db
                    .outbox
                    .complete(fresh, Some(201), Some("req-9"))
                    .await
                    .unwrap());
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.state, State::Completed);
                assert_eq!(row.last_status, Some(201));
                assert_eq!(row.last_request_id.as_deref(), Some("req-9"));
                assert_eq!(row.last_error_class, None);
                assert!(row.completed_at.is_some());
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_500_then_a_429_with_retry_after_then_201_is_retried_on_schedule() {
                let db = db().await;
                let receiver = Receiver::start().await;
                let key = Message::derived_key("crm", "sub-1");
                receiver.script(
                    &key,
                    vec![
                        Answer::status(500),
                        Answer {
                            retry_after: Some("2"),
                            ..Answer::status(429)
                        },
                    ],
                );
                db.submit("sub-1", &["crm"], true).await;
                let worker = spawn_worker(db.another_outbox().await, &receiver, fast());

                // After the 429, the row waits for the receiver's
                // Retry-After, by the database's clock.
                let deadline = tokio::time::Instant::now() + PATIENCE;
                let waiting = loop {
                    let row = state_of(&db.outbox, "crm", "sub-1").await;
                    assert!(row.attempt <= 2, "the 429's Retry-After was not honoured");
                    if row.last_status == Some(429) && row.state == State::Retryable {
                        break row;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "no 429 recorded");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                };
                assert_eq!(waiting.attempt, 2);
                assert_eq!(waiting.last_error_class.as_deref(), Some("transient"));
                let scheduled = waiting
                    .next_attempt_at
                    .duration_since(waiting.updated_at)
                    .unwrap();
                let off = scheduled.abs_diff(Duration::from_secs(2));
                assert!(
                    off < Duration::from_millis(1),
                    "scheduled {scheduled:?} after"
                );

                eventually("delivered", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
                assert_eq!(receiver.statuses(&key), [500, 429, 201]);
                assert_eq!(receiver.effects()[&key], 1);
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.attempt, 3);
                assert_eq!(row.last_status, Some(201));
                // The claim that delivered came no earlier than scheduled.
                assert!(row.completed_at.unwrap() >= waiting.next_attempt_at);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_400_is_dead_at_once_with_its_status_and_no_payload() {
                let db = db().await;
                let receiver = Receiver::start().await;
                let key = Message::derived_key("crm", "sub-1");
                receiver.script(&key, vec![Answer::status(400)]);
                db.submit("sub-1", &["crm"], true).await;
                let outbox = db.another_outbox().await;
                let worker = spawn_worker(outbox.clone(), &receiver, fast());
                eventually("dead", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Dead
                })
                .await;
                worker.shutdown().await;
                assert_eq!(receiver.statuses(&key), [400]);
                assert!(receiver.effects().is_empty());
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.attempt, 1);
                assert_eq!(row.last_error_class.as_deref(), Some("permanent"));
                assert_eq!(row.last_status, Some(400));
                assert_eq!(row.last_request_id.as_deref(), Some("req-1"));
                assert_eq!(row.last_error.as_deref(), Some("HTTP 400"));
                assert_eq!(outbox.metrics().dead(), 1);
                let metrics = outbox.metrics().render_prometheus();
                assert!(metrics.contains("outbox_dead_total 1\n"), "{metrics}");
                assert!(metrics.contains("outbox_delivery_seconds_count 1\n"), "{metrics}");
                assert!(!metrics.contains("outbox_claim_seconds_count 0\n"), "{metrics}");
                let dead = db.outbox.dead(10).await.unwrap();
                assert_eq!(dead.len(), 1);
                assert_eq!(dead[0].id, row.id);
                // The receiver echoed the payload; none of it was kept.
                let errors = db.error_columns().await;
                assert!(
                    !errors.contains(PII) && !errors.contains("submission"),
                    "{errors}"
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn max_attempts_exhausted_is_dead_and_retrying_a_dead_row_delivers_it() {
                let db = db().await;
                let receiver = Receiver::start().await;
                let message = Message::new("crm", "sub-1", payload("sub-1")).max_attempts(3);
                let key = message.key().to_owned();
                receiver.script(&key, vec![Answer::status(503); 3]);
                assert!(db.outbox.enqueue(&message).await.unwrap());
                let worker = spawn_worker(db.another_outbox().await, &receiver, fast());
                eventually("dead", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Dead
                })
                .await;
                assert_eq!(receiver.statuses(&key), [503, 503, 503]);
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.attempt, 3);
                assert_eq!(row.max_attempts, 3);
                assert_eq!(row.last_error_class.as_deref(), Some("transient"));
                assert_eq!(row.last_status, Some(503));
                let errors = db.error_columns().await;
                assert!(!errors.contains(PII), "{errors}");

                // Only a dead row can be retried; it gets a fresh budget.
                assert!(!db.outbox.retry_dead(row.id + 1000).await.unwrap());
                assert!(db.outbox.retry_dead(row.id).await.unwrap());
                assert!(!db.outbox.retry_dead(row.id).await.unwrap());
                eventually("delivered after the retry", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
                assert_eq!(receiver.statuses(&key), [503, 503, 503, 201]);
                assert_eq!(receiver.effects()[&key], 1);
                assert_eq!(state_of(&db.outbox, "crm", "sub-1").await.attempt, 1);
                assert!(db.outbox.dead(10).await.unwrap().is_empty());
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_rescuers_at_once_re_queue_each_expired_row_once() {
                let db = db().await;
                for i in 0..100 {
                    db.submit(&format!("sub-{i}"), &["crm", "mail"], true).await;
                }
                // One live lease that no rescuer may touch.
                let live = db
                    .outbox
                    .claim(1, Duration::from_secs(600), None)
                    .await
                    .unwrap();
                let expiring = db
                    .outbox
                    .claim(1000, Duration::from_millis(1), None)
                    .await
                    .unwrap();
                assert_eq!(expiring.len(), 199);
                tokio::time::sleep(Duration::from_millis(20)).await;

                let rescuers = [db.another_outbox().await, db.another_outbox().await];
                let start = Arc::new(tokio::sync::Barrier::new(2));
                let tasks: Vec<_> = rescuers
                    .into_iter()
                    .map(|outbox| {
                        let start = start.clone();
                        tokio::spawn(async move {
                            start.wait().await;
                            let mut ids = Vec::new();
                            loop {
                                let batch = outbox.rescue(7).await.unwrap();
                                if batch.is_empty() {
                                    return ids;
                                }
                                ids.extend(batch);
                            }
                        })
                    })
                    .collect();
                let mut all = Vec::new();
                for task in tasks {
                    all.extend(task.await.unwrap());
                }
                let unique: HashSet<i64> = all.iter().copied().collect();
                assert_eq!(unique.len(), all.len(), "a row was re-queued twice");
                let expected: HashSet<i64> = expiring.iter().map(|d| d.id()).collect();
                assert_eq!(unique, expected);
                let counts = db.outbox.counts().await.unwrap();
                assert_eq!((counts.retryable, counts.running), (199, 1), "{counts:?}");
                assert!(db.outbox.complete(&live[0], Some(200), None).await.unwrap());
            }

            /// From a review: a row the rescuer sent to `dead` (its worker
            /// died on its last attempt) was counted as rescued only, and an
            /// alert on `outbox_dead_total` never saw it.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_the_rescuer_buries_is_counted_dead() {
                let db = db().await;
                let last = Message::new("crm", "sub-1", payload("sub-1")).max_attempts(1);
                assert!(db.outbox.enqueue(&last).await.unwrap());
                let claimed = db
                    .outbox
                    .claim(1, Duration::from_millis(200), None)
                    .await
                    .unwrap();
                assert_eq!(claimed.len(), 1);
                let rescued = loop {
                    let rescued = db.outbox.rescue(10).await.unwrap();
                    if !rescued.is_empty() {
                        break rescued;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                assert_eq!(rescued, [claimed[0].id()]);
                assert_eq!(state_of(&db.outbox, "crm", "sub-1").await.state, State::Dead);
                assert_eq!(db.outbox.metrics().dead(), 1);
                assert_eq!(db.outbox.metrics().rescued(), 1);
            }

            /// From a review: the rescuer ran only when the worker woke to
            /// poll, so with a long `poll_interval` (sensible beside
            /// `LISTEN`) a crashed worker's rows waited a poll interval past
            /// their lease, not a `rescue_interval`.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_rescuer_keeps_its_interval_under_a_long_poll_interval() {
                let db = db().await;
                let receiver = Receiver::start().await;
                db.submit("sub-1", &["crm"], true).await;
                // A worker that claimed the row and died: its lease runs out.
                let crashed = db
                    .outbox
                    .claim(1, Duration::from_millis(500), None)
                    .await
                    .unwrap();
                assert_eq!(crashed.len(), 1);
                let config = WorkerConfig {
                    poll_interval: PATIENCE * 3,
                    rescue_interval: Duration::from_millis(100),
                    listen: false,
                    ..fast()
                };
                let worker = spawn_worker(db.another_outbox().await, &receiver, config);
                eventually("the crashed worker's row delivered", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_slow_delivery_keeps_its_lease_by_renewing_it() {
                let db = db().await;
                let receiver = Receiver::start().await;
                let key = Message::derived_key("crm", "sub-1");
                receiver.script(
                    &key,
                    vec![Answer {
                        delay: Duration::from_millis(2400),
                        ..Answer::status(201)
                    }],
                );
                db.submit("sub-1", &["crm"], true).await;
                // The delivery takes four leases; the rescuer runs often.
                // (A 300 ms lease once ran out on a loaded machine, its
                // renewal queued behind other tests' SQLite writes.)
                let config = WorkerConfig {
                    lease: Duration::from_millis(600),
                    rescue_interval: Duration::from_millis(20),
                    ..fast()
                };
                let worker = spawn_worker(db.another_outbox().await, &receiver, config.clone());
                let rescuer = spawn_worker(db.another_outbox().await, &receiver, config);
                eventually("delivered", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
                rescuer.shutdown().await;
                assert_eq!(receiver.statuses(&key), [201]);
                assert_eq!(state_of(&db.outbox, "crm", "sub-1").await.attempt, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shutdown_gives_back_the_rows_it_could_not_finish() {
                let db = db().await;
                let receiver = Receiver::start().await;
                let key = Message::derived_key("crm", "sub-1");
                receiver.script(
                    &key,
                    vec![Answer {
                        delay: Duration::from_secs(3600),
                        ..Answer::status(201)
                    }],
                );
                db.submit("sub-1", &["crm"], true).await;
                let config = WorkerConfig {
                    shutdown_grace: Duration::from_millis(50),
                    ..fast()
                };
                let worker = spawn_worker(db.another_outbox().await, &receiver, config);
                eventually("the request reached the receiver", || async {
                    receiver.requests() == 1
                })
                .await;
                worker.shutdown().await;
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.state, State::Retryable);
                assert_eq!(row.attempt, 1);
                // Due now: the next worker takes it at once and delivers.
                let worker = spawn_worker(db.another_outbox().await, &receiver, fast());
                eventually("delivered by the next worker", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
                assert_eq!(receiver.effects()[&key], 1);
                assert_eq!(state_of(&db.outbox, "crm", "sub-1").await.attempt, 2);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_worker_dead_after_the_receivers_success_is_redelivered_with_the_same_key_and_absorbed() {
                let db = db().await;
                let receiver = LayeredReceiver::start(Duration::ZERO).await;
                db.submit("sub-1", &["crm"], true).await;
                let delivered = Arc::new(AtomicUsize::new(0));
                let config = WorkerConfig {
                    lease: Duration::from_millis(300),
                    rescue_interval: Duration::from_millis(20),
                    ..fast()
                };
                let crashing = Worker::new(
                    db.another_outbox().await,
                    HangsAfterSuccess {
                        inner: receiver.deliverer(),
                        delivered: delivered.clone(),
                    },
                )
                .config(config.clone())
                .spawn();
                eventually("the receiver succeeded", || async {
                    delivered.load(SeqCst) == 1
                })
                .await;
                crashing.abort(); // dies before recording the success
                assert_eq!(state_of(&db.outbox, "crm", "sub-1").await.state, State::Running);

                let worker = Worker::new(db.another_outbox().await, receiver.deliverer())
                    .config(config)
                    .spawn();
                eventually("completed by the second worker", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!(row.attempt, 2);
                assert_eq!(row.last_status, Some(201));
                // Delivered twice with one key: the second was a replay.
                assert_eq!(*receiver.requests.lock().unwrap(), [false, true]);
                assert_eq!(receiver.effects.load(SeqCst), 1);
            }

            /// Scenario (from a review of the outbox): the receiver sits
            /// behind our layer as the Next.js recipe sets it
            /// (`in_flight = "reject"`, `in_flight_status = 425`). The
            /// first delivery outlasts the destination's timeout (a
            /// transient failure) while the receiver's handler runs on;
            /// the redelivery meets it in flight: 425 with `Retry-After`.
            /// Only a 409 was read as "still in progress", so the row went
            /// to `dead` while its effect was happening. Now every answer
            /// the engine labels in flight is retried: the row completes,
            /// the effect performed once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_in_flight_answer_under_any_status_is_retried_not_dead() {
                let db = db().await;
                let policy = Policy {
                    in_flight: tower_idempotency::InFlightPolicy::Reject,
                    in_flight_status: 425,
                    ..Policy::default()
                };
                let receiver = LayeredReceiver::start_with(Duration::from_millis(600), policy).await;
                db.submit("sub-1", &["crm"], true).await;
                let destination = Destination::new(receiver.url().parse().unwrap())
                    .timeout(Duration::from_millis(150));
                let deliverer = WebhookDeliverer::new().destination("crm", destination);
                let worker = Worker::new(db.another_outbox().await, deliverer)
                    .config(fast())
                    .spawn();
                eventually("completed", || async {
                    let state = state_of(&db.outbox, "crm", "sub-1").await.state;
                    assert_ne!(state, State::Dead, "the in-flight answer sent the row to dead");
                    state == State::Completed
                })
                .await;
                worker.shutdown().await;
                assert_eq!(receiver.effects.load(SeqCst), 1);
            }

            /// A receiver behind our layer whose handler outlasts its
            /// `execution_timeout` keeps "executed, outcome unknown" (504)
            /// for the delivery key and replays it to every redelivery:
            /// retrying could never get another answer (from a review).
            /// The first 504 is retried (it may be a passing failure); its
            /// replay sends the row to `dead` at once, saying why, instead
            /// of spending every attempt on the same answer.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_receivers_kept_outcome_unknown_is_dead_at_its_replay_not_retried_on() {
                let db = db().await;
                let policy = Policy {
                    execution_timeout: Duration::from_millis(100),
                    ..Policy::default()
                };
                let receiver = LayeredReceiver::start_with(Duration::from_secs(2), policy).await;
                db.submit("sub-1", &["crm"], true).await;
                let worker = spawn_worker_to(db.another_outbox().await, receiver.deliverer(), fast());
                eventually("dead", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Dead
                })
                .await;
                worker.shutdown().await;
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!((row.attempt, row.last_status), (2, Some(504)), "{row:?}");
                assert_eq!(row.last_error_class.as_deref(), Some("permanent"));
                let reason = row.last_error.unwrap_or_default();
                assert!(reason.contains("outcome unknown"), "{reason}");
                assert_eq!(*receiver.requests.lock().unwrap(), [false, true]);
                assert!(receiver.entered.load(SeqCst) <= 1, "the receiver ran twice");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_worker_process_killed_mid_delivery_is_taken_over_and_the_effect_happens_once() {
                let db = db().await;
                let receiver = LayeredReceiver::start(Duration::from_millis(500)).await;
                db.submit("sub-1", &["crm"], true).await;
                let config = WorkerConfig {
                    lease: Duration::from_millis(200),
                    rescue_interval: Duration::from_millis(20),
                    ..fast()
                };
                let killed = ChildWorker::spawn(&db, &receiver.url(), 1, config.lease).await;
                eventually("the request reached the handler", || async {
                    receiver.entered.load(SeqCst) == 1
                })
                .await;
                killed.kill(); // kill -9 mid-request
                let row = state_of(&db.outbox, "crm", "sub-1").await;
                assert_eq!((row.state, row.attempt), (State::Running, 1));
                let worker = Worker::new(db.another_outbox().await, receiver.deliverer())
                    .config(config)
                    .spawn();
                eventually("completed after the takeover", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
                assert_eq!(state_of(&db.outbox, "crm", "sub-1").await.attempt, 2);
                assert_eq!(receiver.effects.load(SeqCst), 1);
                assert_eq!(receiver.entered.load(SeqCst), 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn retention_sweeps_delivered_rows_and_keeps_dead_ones() {
                let db = db().await;
                for source in ["a", "b", "c"] {
                    db.submit(source, &["crm"], true).await;
                }
                let claimed = db
                    .outbox
                    .claim(3, Duration::from_secs(60), None)
                    .await
                    .unwrap();
                assert!(db
                    .outbox
                    .complete(&claimed[0], Some(200), None)
                    .await
                    .unwrap());
                assert!(db
                    .outbox
                    .complete(&claimed[1], Some(200), None)
                    .await
                    .unwrap());
                let error = outbox::DeliveryError::permanent("HTTP 410");
                assert_eq!(
                    db.outbox
                        .fail(&claimed[2], &error, Duration::ZERO)
                        .await
                        .unwrap(),
                    Some(State::Dead)
                );
                // Not old enough yet.
                assert_eq!(
                    db.outbox
                        .sweep(Duration::from_secs(3600), 10)
                        .await
                        .unwrap(),
                    0
                );
                assert_eq!(db.outbox.sweep(Duration::ZERO, 1).await.unwrap(), 1);
                assert_eq!(db.outbox.sweep(Duration::ZERO, 10).await.unwrap(), 1);
                assert_eq!(db.outbox.sweep(Duration::ZERO, 10).await.unwrap(), 0);
                let counts = db.outbox.counts().await.unwrap();
                assert_eq!((counts.dead, counts.total()), (1, 1));
                let dead = db.outbox.dead(10).await.unwrap();
                assert!(db.outbox.purge_dead(dead[0].id).await.unwrap());
                assert_eq!(db.outbox.counts().await.unwrap().total(), 0);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_worker_claims_only_its_deliverers_topics() {
                let db = db().await;
                let receiver = Receiver::start().await;
                db.submit("sub-1", &["crm", "billing"], true).await;
                let worker = spawn_worker(db.another_outbox().await, &receiver, fast());
                eventually("crm delivered", || async {
                    state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed
                })
                .await;
                worker.shutdown().await;
                let billing = state_of(&db.outbox, "billing", "sub-1").await;
                assert_eq!((billing.state, billing.attempt), (State::Available, 0));
                assert_eq!(receiver.requests(), 1);
            }
        }
    };
}

outbox_tests!(postgres, TestDb::postgres());
outbox_tests!(sqlite, TestDb::sqlite());

#[tokio::test]
async fn the_plain_sql_insert_of_the_docs_enqueues_from_any_language() {
    // PostgreSQL, as a Node or PHP application would write it.
    let db = TestDb::postgres().await;
    let Pool::Pg(pool, _) = &db.pool else {
        unreachable!()
    };
    let insert = "INSERT INTO outbox_messages (topic, source, payload)
                  VALUES ($1, $2, convert_to($3, 'UTF8'))
                  ON CONFLICT (topic, source) DO NOTHING";
    for _ in 0..2 {
        sqlx::query(insert)
            .bind("crm")
            .bind("sub-1")
            .bind(r#"{"a":1}"#)
            .execute(pool)
            .await
            .unwrap();
    }
    let row = state_of(&db.outbox, "crm", "sub-1").await;
    assert_eq!(row.state, State::Available);
    assert_eq!(
        uuid::Uuid::parse_str(&row.delivery_key)
            .unwrap()
            .get_version_num(),
        4
    );
    let claimed = db
        .outbox
        .claim(5, Duration::from_secs(5), None)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(&claimed[0].payload()[..], br#"{"a":1}"#);
    assert_eq!(claimed[0].content_type(), "application/json");

    // SQLite.
    let db = TestDb::sqlite().await;
    let Pool::Lite(pool, _) = &db.pool else {
        unreachable!()
    };
    let insert = "INSERT INTO outbox_messages (topic, source, payload)
                  VALUES (?1, ?2, CAST(?3 AS BLOB))
                  ON CONFLICT (topic, source) DO NOTHING";
    for _ in 0..2 {
        sqlx::query(insert)
            .bind("crm")
            .bind("sub-1")
            .bind(r#"{"a":1}"#)
            .execute(pool)
            .await
            .unwrap();
    }
    let row = state_of(&db.outbox, "crm", "sub-1").await;
    assert_eq!(
        uuid::Uuid::parse_str(&row.delivery_key)
            .unwrap()
            .get_version_num(),
        4
    );
    let claimed = db
        .outbox
        .claim(5, Duration::from_secs(5), None)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(&claimed[0].payload()[..], br#"{"a":1}"#);
    assert_eq!(db.outbox.counts().await.unwrap().total(), 1);
}

/// Scenario (from a review of the outbox): a delivery key the outbox took
/// but its receiver behind this crate's layer or proxy reads otherwise.
/// Sent bare as `Idempotency-Key`, `inv:42;line:3` (or one holding `,` or
/// `"`) is refused there with 400, so the row went `dead` on its first
/// attempt after the business row committed; `"k"` is read as `k`, two
/// rows one key. Such keys are refused at enqueue, through `Message` and
/// through the documented plain-SQL insert alike, on both databases; a
/// plain token still goes in.
#[tokio::test]
async fn a_delivery_key_a_receiver_reads_otherwise_is_refused_at_enqueue() {
    async fn enqueue_one(db: &TestDb, message: &Message) -> Result<bool, outbox::OutboxError> {
        match &db.pool {
            Pool::Pg(pool, _) => {
                let mut tx = pool.begin().await.unwrap();
                let added = outbox::enqueue(&mut *tx, message).await?;
                tx.commit().await.unwrap();
                Ok(added)
            }
            Pool::Lite(pool, _) => {
                let mut tx = pool.begin().await.unwrap();
                let added = outbox::enqueue(&mut *tx, message).await?;
                tx.commit().await.unwrap();
                Ok(added)
            }
        }
    }
    // `k.1733150000`: the signed string is `{id}.{timestamp}.{body}`, so it
    // sent at T would verify as `k` sent at 1733150000 with the body `T.…`.
    let bad = [
        "inv:42;line:3",
        "tenant,order-9",
        "\"k1\"",
        "two words",
        "k.1733150000",
    ];
    for db in [TestDb::postgres().await, TestDb::sqlite().await] {
        for key in bad {
            let message =
                Message::new("crm", format!("src-{key}"), br#"{"a":1}"#.to_vec()).delivery_key(key);
            let refused = enqueue_one(&db, &message).await;
            assert!(refused.is_err(), "{key}: {refused:?}");
        }
        let plain_sql: Vec<_> = match &db.pool {
            Pool::Pg(pool, _) => {
                let insert = "INSERT INTO outbox_messages (topic, source, payload, delivery_key)
                              VALUES ('crm', $1, convert_to('{}', 'UTF8'), $1)";
                let mut results = Vec::new();
                for key in bad {
                    results.push(sqlx::query(insert).bind(key).execute(pool).await.is_err());
                }
                results
            }
            Pool::Lite(pool, _) => {
                let insert = "INSERT INTO outbox_messages (topic, source, payload, delivery_key)
                              VALUES ('crm', ?1, CAST('{}' AS BLOB), ?1)";
                let mut results = Vec::new();
                for key in bad {
                    results.push(sqlx::query(insert).bind(key).execute(pool).await.is_err());
                }
                results
            }
        };
        assert_eq!(
            plain_sql, [true; 5],
            "plain SQL took a key the receiver refuses"
        );
        let message =
            Message::new("crm", "src-ok", br#"{"a":1}"#.to_vec()).delivery_key("inv-42:line-3");
        assert!(enqueue_one(&db, &message).await.unwrap());
        assert_eq!(db.outbox.counts().await.unwrap().total(), 1);
        // A row stored with such a key before the check existed (from a
        // review of it) is still claimed: a table CHECK would have failed
        // every claim of its batch, stalling the outbox.
        if let Pool::Pg(pool, _) = &db.pool {
            let mut conn = pool.acquire().await.unwrap();
            let trigger = |on: &str| {
                format!(
                    "ALTER TABLE outbox_messages {on} TRIGGER outbox_messages_delivery_key_token"
                )
            };
            sqlx::query(&trigger("DISABLE"))
                .execute(&mut *conn)
                .await
                .unwrap();
            sqlx::query(
                "INSERT INTO outbox_messages (topic, source, payload, delivery_key)
                 VALUES ('crm', 'old', convert_to('{}', 'UTF8'), 'old;key')",
            )
            .execute(&mut *conn)
            .await
            .unwrap();
            sqlx::query(&trigger("ENABLE"))
                .execute(&mut *conn)
                .await
                .unwrap();
            let claimed = db
                .outbox
                .claim(5, Duration::from_secs(5), None)
                .await
                .unwrap();
            assert_eq!(claimed.len(), 2, "the old row stalled the claim");
        }
    }
}

/// SQLite does not enforce a column's type: an application whose ids are
/// binary (a 16-byte UUID blob, common on SQLite) stored its `source` as a
/// BLOB through the documented plain-SQL insert. Such a row could not be
/// read back, so every claim of the batch it was in failed after claiming
/// it: the row and its batch-mates went from lease to lease until `dead`,
/// never sent, and the dead list failed to load (from a review of the
/// outbox). The insert is refused instead, in the application's own
/// transaction, and the rows beside it are claimed.
#[tokio::test]
async fn an_sqlite_row_that_could_not_be_read_back_is_refused_at_insert() {
    let db = TestDb::sqlite().await;
    let Pool::Lite(pool, _) = &db.pool else {
        unreachable!()
    };
    let insert = "INSERT INTO outbox_messages (topic, source, payload)
                  VALUES (?1, ?2, CAST(?3 AS BLOB))";
    for n in 0..4 {
        sqlx::query(insert)
            .bind("crm")
            .bind(format!("sub-{n}"))
            .bind("{}")
            .execute(pool)
            .await
            .unwrap();
    }
    let binary_id = [
        0xc3u8, 0x28, 0xa0, 0xa1, 0xe2, 0x28, 0xa1, 0xf0, 0x28, 0x8c, 0xbc, 0xf0, 0x90, 0x28, 0x8c,
        0x28,
    ];
    let refused = sqlx::query(insert)
        .bind("crm")
        .bind(&binary_id[..])
        .bind("{}")
        .execute(pool)
        .await;
    let error = refused.expect_err("a BLOB source was stored");
    assert!(error.to_string().contains("text"), "{error}");
    let claimed = db
        .outbox
        .claim(16, Duration::from_secs(5), None)
        .await
        .expect("the claim of the rows beside it");
    assert_eq!(claimed.len(), 4);
    assert!(db.outbox.dead(10).await.unwrap().is_empty());
}

/// Rows that pass SQLite's triggers but that no worker can use (from a
/// review): text that is not UTF-8 (`CAST(? AS TEXT)` over a binary id, the
/// obvious way round the BLOB refusal), a `max_attempts` past 32 bits or not
/// an integer. Read as one batch, the claim failed after claiming them, and
/// the rows claimed beside them went from lease to lease until `dead`,
/// never sent; the dead list failed to load. Now each such row is `dead` at
/// once with its reason, listed, and its batch-mates are delivered.
#[tokio::test]
async fn an_sqlite_row_no_worker_can_read_does_not_strand_its_batch() {
    let db = TestDb::sqlite().await;
    let Pool::Lite(pool, _) = &db.pool else {
        unreachable!()
    };
    for n in 0..4 {
        sqlx::query(
            "INSERT INTO outbox_messages (topic, source, payload) VALUES ('crm', ?1, CAST('{}' AS BLOB))",
        )
        .bind(format!("sub-{n}"))
        .execute(pool)
        .await
        .unwrap();
    }
    let binary_id = [0xc3u8, 0x28, 0xa0, 0xa1, 0xe2, 0x28, 0xa1, 0xf0];
    sqlx::query(
        "INSERT INTO outbox_messages (topic, source, payload)
         VALUES ('crm', CAST(?1 AS TEXT), CAST('{}' AS BLOB))",
    )
    .bind(&binary_id[..])
    .execute(pool)
    .await
    .expect("text that is not UTF-8 passes the type trigger");
    for (source, max_attempts) in [("huge", "3000000000"), ("real", "2.5")] {
        sqlx::query(&format!(
            "INSERT INTO outbox_messages (topic, source, payload, max_attempts)
             VALUES ('crm', '{source}', CAST('{{}}' AS BLOB), {max_attempts})"
        ))
        .execute(pool)
        .await
        .unwrap();
    }
    let claimed = db
        .outbox
        .claim(16, Duration::from_secs(5), None)
        .await
        .expect("the claim of the rows beside the unreadable ones");
    let mut sources: Vec<_> = claimed.iter().map(|d| d.source().to_owned()).collect();
    sources.sort();
    assert_eq!(sources, ["sub-0", "sub-1", "sub-2", "sub-3"]);
    let dead = db.outbox.dead(10).await.expect("the dead list loads");
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(dead
        .iter()
        .all(|row| row.last_error_class.as_deref() == Some("unreadable")));
    let counts = db.outbox.counts().await.unwrap();
    assert_eq!((counts.running, counts.dead), (4, 3));
    assert_eq!(db.outbox.metrics().unreadable(), 3);
    assert!(db
        .outbox
        .metrics()
        .render_prometheus()
        .contains("outbox_unreadable_total 3\n"));
}

/// A claim that finds only unreadable rows buries them all and hands the
/// worker nothing: the worker read that as an empty queue and slept a
/// whole poll interval with due rows behind them (from a review). Here the
/// poll interval is an hour and nothing wakes the worker: the row behind
/// is delivered all the same.
#[tokio::test]
async fn a_claim_of_only_unreadable_rows_does_not_put_the_worker_to_sleep() {
    let db = TestDb::sqlite().await;
    let Pool::Lite(pool, _) = &db.pool else {
        unreachable!()
    };
    for n in 0..4u8 {
        sqlx::query(
            "INSERT INTO outbox_messages (topic, source, payload)
             VALUES ('crm', CAST(?1 AS TEXT), CAST('{}' AS BLOB))",
        )
        .bind(&[0xc3u8, 0x28, 0xa0, n][..])
        .execute(pool)
        .await
        .unwrap();
    }
    db.submit("sub-1", &["crm"], true).await;
    let receiver = Receiver::start().await;
    let outbox = db.another_outbox().await;
    let config = WorkerConfig {
        concurrency: 2,
        poll_interval: Duration::from_secs(3600),
        listen: false,
        ..fast()
    };
    let worker = spawn_worker(outbox.clone(), &receiver, config);
    eventually(
        "the row behind the unreadable ones is delivered",
        || async { state_of(&db.outbox, "crm", "sub-1").await.state == State::Completed },
    )
    .await;
    worker.shutdown().await;
    assert_eq!(outbox.metrics().unreadable(), 4);
    assert_eq!(outbox.metrics().delivered(), 1);
}

/// A worker that cannot renew its lease (its renewals cannot reach the
/// row: here a lock holds them, as a cut link or a stalled database would)
/// stops delivering when the lease it last renewed runs out, instead of
/// delivering on while the rescuer of any worker that still reaches the
/// database re-queues the row for a second delivery at the same moment
/// (from a review of the outbox). The receiver sees the first delivery
/// abandoned; the row is rescued once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_renew_stops_delivering_when_its_lease_runs_out() {
    let db = TestDb::postgres().await;
    let Pool::Pg(pool, _) = &db.pool else {
        unreachable!()
    };
    let receiver = Receiver::start().await;
    let key = Message::derived_key("crm", "sub-1");
    receiver.script(
        &key,
        vec![Answer {
            delay: Duration::from_secs(3600),
            ..Answer::status(201)
        }],
    );
    db.submit("sub-1", &["crm"], true).await;
    let config = WorkerConfig {
        lease: Duration::from_millis(600),
        rescue_interval: Duration::from_secs(3600),
        ..fast()
    };
    // Only the lease may end the delivery: its timeout is an hour.
    let deliverer = WebhookDeliverer::new().destination(
        "crm",
        receiver.destination().timeout(Duration::from_secs(3600)),
    );
    let worker = Worker::new(db.another_outbox().await, deliverer)
        .config(config)
        .spawn();
    eventually("the delivery reached the receiver", || async {
        receiver.log.lock().unwrap().requests_seen == 1
    })
    .await;
    // Renewals of the row now wait for this transaction.
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM outbox_messages FOR UPDATE")
        .fetch_all(&mut *lock)
        .await
        .unwrap();
    eventually("the delivery was given up", || async {
        receiver.abandoned() == 1
    })
    .await;
    lock.rollback().await.unwrap();
    worker.shutdown().await;
    assert_eq!(receiver.effects().get(&key), None, "no effect yet");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notifying_commit_wakes_an_idle_postgres_worker() {
    let db = TestDb::postgres().await;
    let Pool::Pg(pool, _) = &db.pool else {
        unreachable!()
    };
    let receiver = Receiver::start().await;
    // It polls hourly: within the test only a notification can wake it.
    let config = WorkerConfig {
        poll_interval: Duration::from_secs(3600),
        rescue_interval: Duration::from_secs(3600),
        ..fast()
    };
    let worker = spawn_worker(db.another_outbox().await, &receiver, config);
    for (i, source) in ["sub-0", "sub-1", "sub-2"].into_iter().enumerate() {
        let mut tx = pool.begin().await.unwrap();
        let message = Message::new("crm", source, payload(source));
        assert!(outbox::enqueue(&mut *tx, &message).await.unwrap());
        outbox::notify(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        eventually("delivered after the notification", || async {
            state_of(&db.outbox, "crm", source).await.state == State::Completed
        })
        .await;
        assert_eq!(receiver.requests(), i + 1);
        // Let the worker go idle again (not a timing claim: a later
        // message is delivered whenever it wakes).
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    worker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_recover_from_a_database_outage_with_nothing_lost_or_doubled() {
    let db = TestDb::postgres().await;
    let Pool::Pg(_, options) = &db.pool else {
        unreachable!()
    };
    let receiver = LayeredReceiver::start(Duration::from_millis(2)).await;
    let n = 400;
    for i in 0..n / 50 {
        let sources: Vec<String> = (0..50).map(|j| format!("sub-{}", i * 50 + j)).collect();
        for source in &sources {
            db.outbox
                .enqueue(&Message::new("crm", source.as_str(), payload(source)))
                .await
                .unwrap();
        }
    }
    // The workers reach the database through a switch that can cut it.
    let switch = fixtures::Switch::start(options).await;
    let config = WorkerConfig {
        lease: Duration::from_secs(1),
        ..fast()
    };
    let mut workers = Vec::new();
    for _ in 0..2 {
        let pool = fixtures::pool(switch.route(options), 4).await;
        let worker = Worker::new(Outbox::postgres(pool), receiver.deliverer())
            .config(config.clone())
            .spawn();
        workers.push(worker);
    }
    eventually("deliveries under way", || async {
        receiver.effects.load(SeqCst) >= n / 4
    })
    .await;
    switch.set(false).await;
    let at_cut = db.outbox.counts().await.unwrap().completed;
    assert!(at_cut < n as u64, "the outage came after the run");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    switch.set(true).await;
    eventually("every message delivered after the outage", || async {
        db.outbox.counts().await.unwrap().completed == n as u64
    })
    .await;
    for worker in workers {
        worker.shutdown().await;
    }
    // Deliveries whose completion was lost in the outage were sent again
    // with the same key; the receiver performed each effect once.
    assert_eq!(receiver.effects.load(SeqCst), n);
    let requests = receiver.requests.lock().unwrap().clone();
    let replays = requests.iter().filter(|replayed| **replayed).count();
    assert_eq!(requests.len() - replays, n, "first deliveries");
}

#[tokio::test]
async fn connect_opens_and_migrates_an_sqlite_file() {
    let path = fixtures::sqlite_path();
    let outbox = Outbox::connect(path.to_str().unwrap()).await.unwrap();
    assert!(outbox
        .enqueue(&Message::new("crm", "sub-1", payload("sub-1")))
        .await
        .unwrap());
    assert_eq!(outbox.metrics().enqueued(), 1);
    // Again, by URL: migrations are idempotent and the row is still there.
    let again = Outbox::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    assert_eq!(again.counts().await.unwrap().available, 1);
}

/// The outbox may live in the idempotency store's own database (as
/// `idempotency-proxy` runs it by default): both sets of migrations apply,
/// in either order, on one `_sqlx_migrations` table.
#[tokio::test]
async fn the_outbox_and_the_store_share_one_database() {
    let path = fixtures::sqlite_path();
    let url = format!("sqlite://{}", path.display());
    SqliteStore::connect(&url).await.unwrap();
    let outbox = Outbox::connect(&url).await.unwrap();
    SqliteStore::connect(&url).await.unwrap();
    assert!(outbox
        .enqueue(&Message::new("crm", "sub-1", payload("sub-1")))
        .await
        .unwrap());

    let options = fixtures::fresh_schema().await;
    let pool = fixtures::pool(options, 2).await;
    let store = tower_idempotency::PostgresStore::from_pool(pool.clone());
    let outbox = Outbox::postgres(pool.clone());
    outbox.migrate().await.unwrap();
    store.migrate().await.unwrap();
    outbox.migrate().await.unwrap();
    assert!(outbox
        .enqueue(&Message::new("crm", "sub-1", payload("sub-1")))
        .await
        .unwrap());
}

/// Everything the crate logs while a message fails transiently, then
/// permanently: never the payload, the delivery key or the secret.
#[tokio::test(flavor = "current_thread")]
async fn logs_carry_no_payload_key_or_secret() {
    let logs = fixtures::Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "tower_idempotency=trace",
        ))
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = TestDb::sqlite().await;
    let receiver = Receiver::start().await;
    let key = Message::derived_key("crm", "sub-1");
    receiver.script(&key, vec![Answer::status(500), Answer::status(400)]);
    db.submit("sub-1", &["crm"], true).await;
    let worker = spawn_worker(db.another_outbox().await, &receiver, fast());
    eventually("dead", || async {
        state_of(&db.outbox, "crm", "sub-1").await.state == State::Dead
    })
    .await;
    worker.shutdown().await;
    assert_eq!(receiver.statuses(&key), [500, 400]);

    let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("delivery failed"), "nothing logged: {logs}");
    for secret in [
        PII,
        key.as_str(),
        SECRET,
        SECRET.trim_start_matches("whsec_"),
    ] {
        assert!(!logs.contains(secret), "`{secret}` in the logs:\n{logs}");
    }
}

/// Scenario (from a review of the outbox): the same message (one pair,
/// so one derived delivery key) enqueued by several transactions at the
/// same moment: a handler run twice, a reconciliation job racing it. Each
/// must add nothing beside the first (`false`). Only the pair's index
/// arbitrated the conflict, so an insert that passed that check before the
/// first wrote its entries met the delivery key's unique index instead and
/// failed its whole transaction with a unique violation naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_enqueued_at_once_is_added_once_without_an_error() {
    let db = TestDb::postgres().await;
    let Pool::Pg(pool, _) = &db.pool else {
        unreachable!()
    };
    for round in 0..60 {
        let barrier = Arc::new(tokio::sync::Barrier::new(6));
        let tasks: Vec<_> = (0..6)
            .map(|_| {
                let (pool, barrier) = (pool.clone(), barrier.clone());
                tokio::spawn(async move {
                    let mut tx = pool.begin().await.unwrap();
                    let message = Message::new("crm", format!("s{round}"), payload("s"));
                    barrier.wait().await;
                    let added = outbox::enqueue(&mut *tx, &message).await;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if added.is_ok() {
                        tx.commit().await.unwrap();
                    }
                    added.map_err(|error| error.to_string())
                })
            })
            .collect();
        let mut added = 0;
        for task in tasks {
            match task.await.unwrap() {
                Ok(true) => added += 1,
                Ok(false) => {}
                Err(error) => panic!("round {round}: an enqueue failed: {error}"),
            }
        }
        assert_eq!(added, 1, "round {round}");
    }
}

/// `enqueue` in a handler: its future must be `Send` (spawned here as a
/// server spawns each request), with the transaction borrowed across it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_can_be_awaited_in_spawned_tasks() {
    let db = TestDb::postgres().await;
    let Pool::Pg(pool, _) = &db.pool else {
        unreachable!()
    };
    let pool = pool.clone();
    let task = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let message = Message::new("crm", "sub-1", payload("sub-1"));
        let added = outbox::enqueue(&mut *tx, &message).await.unwrap();
        outbox::notify(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        added
    });
    assert!(task.await.unwrap());

    let db = TestDb::sqlite().await;
    let Pool::Lite(pool, _) = &db.pool else {
        unreachable!()
    };
    let pool = pool.clone();
    let task = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        let message = Message::new("crm", "sub-1", payload("sub-1"));
        outbox::enqueue(&mut *conn, &message).await.unwrap()
    });
    assert!(task.await.unwrap());
    assert_eq!(db.outbox.counts().await.unwrap().available, 1);
}

/// The seed's platform end to end: ten identical submissions with one key
/// at once are one submission, one outbox row per integration, and one
/// effect per integration at the CRM stand-in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_form_platform_example_takes_each_submission_and_each_integration_once() {
    let path = fixtures::sqlite_path();
    let pool = sqlite_pool(path.to_str().unwrap()).await;
    form_outbox::migrate(&pool).await.unwrap();
    let crm = Arc::new(form_outbox::Crm::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    // The CRM stand-in deduplicates nothing itself: here it sits behind
    // the layer keyed on the delivery key, as it sits behind
    // idempotency-proxy in the example's `main` (and in
    // proxy-bin/tests/outbox.rs, where a worker is killed after its effect).
    let crm_routes = Routes::new()
        .route("/crm/*", Policy::default().required(true))
        .unwrap();
    let crm_app = form_outbox::crm(crm.clone()).layer(IdempotencyLayer::new(Engine::new(
        MemoryStore::new(),
        crm_routes,
    )));
    let server = form_outbox::app(pool.clone()).merge(crm_app);
    tokio::spawn(async move { axum::serve(listener, server).await.unwrap() });
    let outbox = Outbox::sqlite(pool.clone());
    let worker = Worker::new(outbox.clone(), form_outbox::deliverer(&base))
        .config(fast())
        .spawn();

    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<Bytes>>();
    let key = uuid::Uuid::new_v4().to_string();
    let submissions = (0..10).map(|_| {
        let request = http::Request::post(format!("{base}/forms/contact/submit"))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from_static(
                br#"{"email":"jane.doe@example.com"}"#,
            )))
            .unwrap();
        let client = client.clone();
        tokio::spawn(async move {
            use http_body_util::BodyExt;
            let response = client.request(request).await.unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, body)
        })
    });
    let mut answers = Vec::new();
    for submission in submissions.collect::<Vec<_>>() {
        answers.push(submission.await.unwrap());
    }
    assert!(
        answers.iter().all(|(status, _)| *status == 202),
        "{answers:?}"
    );
    let bodies: HashSet<&Bytes> = answers.iter().map(|(_, body)| body).collect();
    assert_eq!(bodies.len(), 1, "one submission id for every answer");
    let submissions: i64 = sqlx::query_scalar("SELECT count(*) FROM submissions")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(submissions, 1);

    eventually("both integrations delivered", || async {
        outbox.counts().await.unwrap().completed == 2
    })
    .await;
    worker.shutdown().await;
    assert_eq!(outbox.counts().await.unwrap().total(), 2);
    let effects = crm.effects();
    assert_eq!(effects.len(), 2, "{effects:?}");
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
}

/// A handler that enqueues its message and then answers a status that
/// releases the key (a 500 after its commit: the row stands) runs again on
/// the retry: with a source of its own making (a new submission id) it
/// would enqueue a second message, delivered twice. With the layer's
/// `ExecutionScope` as the source, the second execution's enqueue finds
/// the first's row: one message per key, however often the key runs; and
/// another key, or another caller with the same key, gets its own.
#[tokio::test]
async fn a_key_that_runs_again_enqueues_its_message_once_with_the_execution_scope() {
    use tower::ServiceExt;
    use tower_idempotency::{ExecutionScope, Principal};

    let db = TestDb::sqlite().await;
    let outbox = db.outbox.clone();
    let runs = Arc::new(AtomicUsize::new(0));
    let added = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let (runs, added) = (runs.clone(), added.clone());
        move |axum::Extension(scope): axum::Extension<ExecutionScope>| async move {
            let message = Message::new("crm", scope.as_str(), payload("order"));
            let fresh = outbox.enqueue(&message).await.unwrap();
            added.lock().unwrap().push(fresh);
            // The first run fails after its commit: the key is released.
            if runs.fetch_add(1, SeqCst) == 0 {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::CREATED
            }
        }
    };
    let engine = Engine::new(MemoryStore::new(), Routes::all(Policy::default()).unwrap());
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(IdempotencyLayer::new(engine));
    let send = |key: &'static str, user: &'static str| {
        let app = app.clone();
        async move {
            let mut request = axum::http::Request::post("/orders")
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(axum::body::Body::from(r#"{"item":1}"#))
                .unwrap();
            request.extensions_mut().insert(Principal::new(user));
            app.oneshot(request).await.unwrap().status()
        }
    };
    assert_eq!(send("k1", "alice").await, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(send("k1", "alice").await, StatusCode::CREATED);
    assert_eq!(send("k1", "alice").await, StatusCode::CREATED, "a replay");
    assert_eq!(runs.load(SeqCst), 2, "the released key ran again");
    assert_eq!(
        *added.lock().unwrap(),
        [true, false],
        "one message for the key"
    );
    assert_eq!(send("k2", "alice").await, StatusCode::CREATED);
    assert_eq!(send("k1", "bob").await, StatusCode::CREATED);
    assert_eq!(*added.lock().unwrap(), [true, false, true, true]);
    assert_eq!(db.outbox.counts().await.unwrap().total(), 3);
}

/// From a review: a PostgreSQL row whose `attempt` is already the largest
/// 32-bit integer (written by plain SQL) made every claim of its topic
/// fail as a whole (`attempt + 1`: integer out of range), so no row behind
/// it was ever delivered. The claim no longer counts past it; the row is
/// claimed once more and its batch-mates with it.
#[tokio::test]
async fn a_postgres_row_at_the_largest_attempt_does_not_stop_the_claims() {
    let db = TestDb::postgres().await;
    let Pool::Pg(pool, _) = &db.pool else {
        unreachable!()
    };
    for n in 0..3 {
        sqlx::query(
            "INSERT INTO outbox_messages (topic, source, payload) VALUES ('crm', $1, '\\x7b7d')",
        )
        .bind(format!("sub-{n}"))
        .execute(pool)
        .await
        .unwrap();
    }
    sqlx::query(
        "INSERT INTO outbox_messages (topic, source, payload, attempt, max_attempts)
         VALUES ('crm', 'worn', '\\x7b7d', 2147483647, 2147483647)",
    )
    .execute(pool)
    .await
    .unwrap();
    let claimed = db
        .outbox
        .claim(16, Duration::from_secs(5), None)
        .await
        .expect("the claim of the rows beside the worn one");
    let mut sources: Vec<_> = claimed.iter().map(|d| d.source().to_owned()).collect();
    sources.sort();
    assert_eq!(sources, ["sub-0", "sub-1", "sub-2", "worn"]);
}
