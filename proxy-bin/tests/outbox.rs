//! The outbox run by `idempotency-proxy` from its TOML configuration, end
//! to end: the real binary (inside the proxy, or alone with `outbox run`),
//! real PostgreSQL and SQLite, rows enqueued by the plain SQL `INSERT` of
//! docs/outbox.md (what an application in any language does), and a real
//! HTTP receiver that verifies every Standard Webhooks signature and counts
//! each delivery key's effects — itself behind a second `idempotency-proxy`
//! where a redelivery must be absorbed.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use common::services::PrivatePostgres;
use common::{temp_dir, Proxy, ProxyArgs, TempDir};
use hmac::{Hmac, Mac};
use sqlx::Connection;

const TOKEN: &str = "outbox-operator-token-0123456789";
const TOKEN_ENV: &str = "IDEMPOTENCY_ADMIN_TOKEN";
/// Longest wait for the workers (a readiness bound, not a timing claim).
const PATIENCE: Duration = Duration::from_secs(120);

fn crm_secret() -> String {
    "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned()
}

fn mail_secret() -> String {
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(b"the mail integration's own key")
    )
}

// ---------------------------------------------------------------- receiver

/// An HTTP receiver: `POST /hook/{topic}` verifies the Standard Webhooks
/// signature with the topic's secret (401 if wrong), records one effect for
/// the `webhook-id`, and answers 201; `/hook/refuse` answers 400 while
/// `refusing` is set.
#[derive(Clone)]
struct Receiver {
    addr: SocketAddr,
    state: Arc<ReceiverState>,
}

#[derive(Default)]
struct ReceiverState {
    secrets: HashMap<String, Vec<u8>>,
    effects: Mutex<HashMap<String, u32>>,
    bad_signatures: AtomicUsize,
    refusing: AtomicBool,
    /// Each request waits this long before answering (after its effect).
    delay: Duration,
    /// The first request, after its effect, waits for `gate`.
    hold_first: AtomicBool,
    held: tokio::sync::Notify,
    gate: tokio::sync::Notify,
}

impl Receiver {
    async fn start(delay: Duration, hold_first: bool) -> Receiver {
        let secret = |whsec: String| {
            base64::engine::general_purpose::STANDARD
                .decode(whsec.strip_prefix("whsec_").unwrap())
                .unwrap()
        };
        let state = Arc::new(ReceiverState {
            secrets: [
                ("crm".to_owned(), secret(crm_secret())),
                ("mail".to_owned(), secret(mail_secret())),
                ("refuse".to_owned(), secret(crm_secret())),
            ]
            .into(),
            refusing: AtomicBool::new(true),
            delay,
            hold_first: AtomicBool::new(hold_first),
            ..ReceiverState::default()
        });
        let app = axum::Router::new()
            .route("/hook/{topic}", axum::routing::post(receive))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.ok() });
        Receiver { addr, state }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn effects(&self) -> HashMap<String, u32> {
        self.state.effects.lock().unwrap().clone()
    }
}

async fn receive(
    State(state): State<Arc<ReceiverState>>,
    UrlPath(topic): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (id, timestamp) = (header("webhook-id"), header("webhook-timestamp"));
    let key = &state.secrets[&topic];
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(&body);
    let expected = format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    );
    if header("webhook-signature") != expected || header("idempotency-key") != id {
        state.bad_signatures.fetch_add(1, SeqCst);
        return StatusCode::UNAUTHORIZED.into_response();
    }
    if topic == "refuse" && state.refusing.load(SeqCst) {
        return (StatusCode::BAD_REQUEST, "refused").into_response();
    }
    *state.effects.lock().unwrap().entry(id).or_default() += 1;
    if state.hold_first.swap(false, SeqCst) {
        state.held.notify_one();
        state.gate.notified().await;
    }
    tokio::time::sleep(state.delay).await;
    (StatusCode::CREATED, [("x-request-id", "crm-1")]).into_response()
}

// ---------------------------------------------------------------- databases

/// The outbox's database, written and read with plain SQL as an
/// application in any language would.
enum Db {
    Pg(sqlx::PgPool, String),
    Lite(sqlx::SqlitePool, String),
}

impl Db {
    /// A fresh schema in the shared test database.
    async fn postgres() -> Db {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let schema = format!(
            "proxy_outbox_{}_{}",
            std::process::id(),
            &common::uuid().replace('-', "")[..8]
        );
        let mut admin = sqlx::PgConnection::connect(&url).await.expect("PostgreSQL");
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut admin)
            .await
            .unwrap();
        admin.close().await.ok();
        let separator = if url.contains('?') { '&' } else { '?' };
        Self::postgres_at(&format!(
            "{url}{separator}options=-c%20search_path%3D{schema}"
        ))
        .await
    }

    async fn postgres_at(url: &str) -> Db {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy(url)
            .unwrap();
        Db::Pg(pool, url.to_owned())
    }

    /// A fresh SQLite file in `dir`.
    async fn sqlite(dir: &Path) -> Db {
        let path = dir.join("outbox.db");
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .unwrap();
        Db::Lite(pool, format!("sqlite://{}", path.display()))
    }

    /// The URL the proxy is given.
    fn url(&self) -> &str {
        match self {
            Db::Pg(_, url) | Db::Lite(_, url) => url,
        }
    }

    /// Waits until the table exists (the proxy creates it at start).
    async fn wait_for_table(&self) {
        eventually("the outbox table", || async {
            self.try_count("1 = 1").await.is_ok()
        })
        .await;
    }

    /// docs/outbox.md's `INSERT`, in a transaction with a business row;
    /// `false` when the row already existed.
    async fn enqueue(&self, topic: &str, source: &str, json: &str) -> bool {
        match self {
            Db::Pg(pool, _) => {
                let mut tx = pool.begin().await.unwrap();
                let done = sqlx::query(
                    "INSERT INTO outbox_messages (topic, source, payload)
                     VALUES ($1, $2, convert_to($3, 'UTF8'))
                     ON CONFLICT (topic, source) DO NOTHING",
                )
                .bind(topic)
                .bind(source)
                .bind(json)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
                done.rows_affected() == 1
            }
            Db::Lite(pool, _) => {
                let mut tx = pool.begin().await.unwrap();
                let done = sqlx::query(
                    "INSERT INTO outbox_messages (topic, source, payload)
                     VALUES (?1, ?2, CAST(?3 AS BLOB))
                     ON CONFLICT (topic, source) DO NOTHING",
                )
                .bind(topic)
                .bind(source)
                .bind(json)
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
                done.rows_affected() == 1
            }
        }
    }

    async fn try_count(&self, condition: &str) -> Result<i64, sqlx::Error> {
        let sql = format!("SELECT count(*) FROM outbox_messages WHERE {condition}");
        match self {
            Db::Pg(pool, _) => sqlx::query_scalar(&sql).fetch_one(pool).await,
            Db::Lite(pool, _) => sqlx::query_scalar(&sql).fetch_one(pool).await,
        }
    }

    async fn count(&self, condition: &str) -> i64 {
        self.try_count(condition).await.unwrap()
    }

    async fn close(&self) {
        match self {
            Db::Pg(pool, _) => pool.close().await,
            Db::Lite(pool, _) => pool.close().await,
        }
    }
}

async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn payload(source: &str) -> String {
    format!(r#"{{"submission":"{source}","email":"jane.doe@example.com"}}"#)
}

// ---------------------------------------------------------------- processes

fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idempotency-proxy"));
    command
        .env_remove(TOKEN_ENV)
        .env(
            "RUST_LOG",
            std::env::var("PROXY_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null());
    command
}

/// `idempotency-proxy outbox …` to completion.
fn cli(dir: &Path, args: &[&str]) -> Output {
    binary()
        .current_dir(dir)
        .arg("outbox")
        .args(args)
        .output()
        .unwrap()
}

fn cli_json(dir: &Path, args: &[&str]) -> serde_json::Value {
    let output = cli(dir, args);
    assert!(
        output.status.success(),
        "outbox {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// `idempotency-proxy outbox run --config FILE` in the background; killed
/// (`kill -9`) when dropped.
struct Runner(Child);

impl Runner {
    fn start(dir: &Path, config: &Path) -> Runner {
        let child = binary()
            .current_dir(dir)
            .env("CRM_SECRET", crm_secret())
            .args(["outbox", "run", "--config"])
            .arg(config)
            .spawn()
            .unwrap();
        Runner(child)
    }

    fn kill(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }

    fn terminate(&mut self) -> bool {
        self.signal("-TERM");
        self.0.wait().unwrap().success()
    }

    /// Sends `signal` (`-HUP`, …) to the runner.
    fn signal(&self, signal: &str) {
        let pid = self.0.id().to_string();
        assert!(Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap()
            .success());
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An `[outbox]` configuration delivering `topics` to `base/hook/{topic}`.
fn outbox_config(database: Option<&str>, base: &str, topics: &[&str], extra: &str) -> String {
    let mut text =
        String::from("[outbox]\npoll_interval = \"100ms\"\nrescue_interval = \"200ms\"\n");
    if let Some(database) = database {
        text.push_str(&format!("database = \"{database}\"\n"));
    }
    text.push_str(extra);
    for topic in topics {
        text.push_str(&format!(
            "\n[[outbox.destination]]\ntopic = \"{topic}\"\nurl = \"{base}/hook/{topic}\"\n"
        ));
        match *topic {
            "mail" => text.push_str("secret_file = \"mail.secret\"\n"),
            _ => text.push_str("secret_env = \"CRM_SECRET\"\nbackoff_base = \"50ms\"\n"),
        }
    }
    text
}

// ---------------------------------------------------------------- item 5

macro_rules! per_database {
    ($($name:ident: $db:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let dir = temp_dir("outbox");
            let db = match stringify!($db) {
                "postgres" => Db::postgres().await,
                _ => Db::sqlite(&dir).await,
            };
            proxy_runs_the_destinations_of_its_configuration(db, dir).await;
        }
    )*};
}

per_database! {
    proxy_delivers_plain_sql_rows_signed_and_operates_them_postgres: postgres;
    proxy_delivers_plain_sql_rows_signed_and_operates_them_sqlite: sqlite;
}

/// Workers inside the proxy, from `[outbox]` with its default database
/// (the proxy's own store): rows written by plain SQL reach their
/// destinations signed with the secret from the environment or a file;
/// counts, dead rows, retry and purge work through the admin API (with
/// the token) and the command line; the outbox metrics are on `/metrics`.
async fn proxy_runs_the_destinations_of_its_configuration(db: Db, dir: TempDir) {
    let receiver = Receiver::start(Duration::ZERO, false).await;
    std::fs::write(dir.join("mail.secret"), format!("{}\n", mail_secret())).unwrap();
    let backend = common::Backend::start().await;
    let mut args = ProxyArgs::new(
        backend.url(),
        &outbox_config(None, &receiver.url(), &["crm", "mail", "refuse"], ""),
        &dir,
    );
    args.store = db.url().to_owned();
    let proxy = Proxy::start_with(args, |command| {
        command
            .env("CRM_SECRET", crm_secret())
            .env(TOKEN_ENV, TOKEN);
    })
    .await;
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("authorization", bearer.as_str())];

    // The proxy creates the table; the operator API answers once it has.
    eventually("the operator API's counts", || async {
        proxy
            .admin_send("GET", "/outbox/counts", &auth, "")
            .await
            .status
            == 200
    })
    .await;
    let n = 40;
    for i in 0..n {
        let source = format!("sub-{i}");
        for topic in ["crm", "mail"] {
            assert!(db.enqueue(topic, &source, &payload(&source)).await);
        }
        // A handler that runs twice adds nothing.
        assert!(!db.enqueue("crm", &source, &payload(&source)).await);
    }
    for i in 0..3 {
        assert!(db.enqueue("refuse", &format!("r-{i}"), &payload("r")).await);
    }
    eventually("every row delivered or dead", || async {
        db.count("state = 'completed'").await == 2 * n && db.count("state = 'dead'").await == 3
    })
    .await;
    let effects = receiver.effects();
    assert_eq!(effects.len(), 2 * n as usize, "one effect per delivery key");
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    assert_eq!(
        receiver.state.bad_signatures.load(SeqCst),
        0,
        "every signature verified"
    );

    // Metrics of this process's workers (counted just after the row's
    // state is committed, so read once they have caught up).
    let counted = format!("outbox_delivered_total {}\n", 2 * n);
    eventually("the outbox counters", || async {
        let metrics = proxy.admin("/metrics").await.text();
        metrics.contains(&counted) && metrics.contains("outbox_dead_total 3\n")
    })
    .await;
    let metrics = proxy.admin("/metrics").await.text();
    assert!(
        metrics.contains(&format!("outbox_delivered_total {}\n", 2 * n)),
        "{metrics}"
    );
    assert!(metrics.contains("outbox_dead_total 3\n"), "{metrics}");
    assert!(metrics.contains("outbox_claim_seconds_count "), "{metrics}");
    assert!(
        !metrics.contains("outbox_delivery_seconds_count 0\n"),
        "{metrics}"
    );

    // The operator API needs the token.
    assert_eq!(proxy.admin("/outbox/counts").await.status, 401);
    let counts = proxy
        .admin_send("GET", "/outbox/counts", &auth, "")
        .await
        .json();
    assert_eq!(counts["completed"], 2 * n);
    assert_eq!(counts["dead"], 3);
    let dead = proxy
        .admin_send("GET", "/outbox/dead", &auth, "")
        .await
        .json();
    let dead = dead["dead"].as_array().unwrap().clone();
    assert_eq!(dead.len(), 3);
    assert!(dead.iter().all(|row| row["last_status"] == 400
        && row["last_error_class"] == "permanent"
        && row.get("payload").is_none()));
    let with_payload = proxy
        .admin_send("GET", "/outbox/dead?payload=1&limit=1", &auth, "")
        .await
        .json();
    assert_eq!(with_payload["dead"].as_array().unwrap().len(), 1);
    assert_eq!(with_payload["dead"][0]["payload"], payload("r"));

    // The receiver recovers: one dead row retried through the admin API,
    // one through the command line (on the table alone, no proxy asked).
    receiver.state.refusing.store(false, SeqCst);
    let (first, second) = (
        dead[0]["id"].as_i64().unwrap(),
        dead[1]["id"].as_i64().unwrap(),
    );
    let retried = proxy
        .admin_send("POST", &format!("/outbox/dead/{first}/retry"), &auth, "")
        .await;
    assert_eq!(retried.status, 200, "{}", retried.text());
    assert_eq!(retried.json()["retried"], true);
    let again = proxy
        .admin_send("POST", &format!("/outbox/dead/{first}/retry"), &auth, "")
        .await;
    assert_eq!(again.status, 404, "no longer dead: {}", again.text());
    // The command line finds the database by URL, or through a
    // configuration file's [proxy] store.
    std::fs::write(
        dir.join("cli.toml"),
        format!("[proxy]\nstore = \"{}\"\n", db.url()),
    )
    .unwrap();
    let target: Vec<&str> = match &db {
        Db::Pg(_, url) => vec!["--store", url],
        Db::Lite(..) => vec!["--config", "cli.toml"],
    };
    let second_id = second.to_string();
    let retried = cli_json(&dir, &[&["retry", &second_id][..], &target].concat());
    assert_eq!(retried["retried"], true);
    eventually("both retried rows delivered", || async {
        db.count("state = 'completed'").await == 2 * n + 2
    })
    .await;
    let counts = cli_json(&dir, &[&["counts"][..], &target].concat());
    assert_eq!(counts["completed"], 2 * n + 2);
    assert_eq!(counts["dead"], 1);
    let listed = cli_json(&dir, &[&["dead", "--payload"][..], &target].concat());
    assert_eq!(listed["dead"][0]["id"], dead[2]["id"]);
    assert_eq!(listed["dead"][0]["payload"], payload("r"));

    // Purge: a filter is required; a topic's dead rows of any age go.
    let refused = proxy.admin_send("POST", "/outbox/purge", &auth, "").await;
    assert_eq!(refused.status, 400);
    assert!(refused.text().contains("older_than"), "{}", refused.text());
    let purged = proxy
        .admin_send("POST", "/outbox/purge?older_than=0s&topic=crm", &auth, "")
        .await
        .json();
    assert_eq!(
        purged["purged"], 0,
        "no dead crm rows; delivered ones untouched"
    );
    // From a review: a misspelt filter was ignored, so `topc=crm` purged
    // every topic's dead rows; a repeated one read as its first. Refused,
    // nothing purged; so is an unknown `payload` value on the listing.
    for misspelt in [
        "/outbox/purge?older_than=0s&topc=crm",
        "/outbox/purge?older_than=0s&Topic=crm",
        "/outbox/purge?older_than=0s&topic=crm&topic=refuse",
        "/outbox/purge?id=1&force=1",
    ] {
        let refused = proxy.admin_send("POST", misspelt, &auth, "").await;
        assert_eq!(refused.status, 400, "{misspelt}: {}", refused.text());
        assert!(refused.text().contains("parameter"), "{}", refused.text());
    }
    for (path, method) in [
        ("/outbox/dead?payload=yes", "GET"),
        ("/outbox/dead?limt=1", "GET"),
        ("/outbox/counts?topic=crm", "GET"),
        ("/keys/in-flight?limit=1&limit=2", "GET"),
        ("/keys/counts?older_than=1s", "GET"),
    ] {
        let refused = proxy.admin_send(method, path, &auth, "").await;
        assert_eq!(refused.status, 400, "{path}: {}", refused.text());
    }
    // The route and method are judged before the query: 404 and 405.
    for (method, path, status) in [
        ("GET", "/outbox/nosuch?x=1", 404),
        ("POST", "/outbox/counts?x=1", 405),
        ("POST", "/outbox/dead?limit=1", 405),
    ] {
        let answer = proxy.admin_send(method, path, &auth, "").await;
        assert_eq!(answer.status, status, "{method} {path}: {}", answer.text());
    }
    assert_eq!(db.count("state = 'dead'").await, 1, "nothing purged");
    let purged = proxy
        .admin_send(
            "POST",
            "/outbox/purge?older_than=0s&topic=refuse",
            &auth,
            "",
        )
        .await
        .json();
    assert_eq!(purged["purged"], 1);
    let output = cli(&dir, &[&["purge", "--id", "999999"][..], &target].concat());
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("no dead row with id 999999"));
    let output = cli(&dir, &["counts", "--store", "sqlite://no/such/file.db"]);
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("no SQLite database at no/such/file.db")
    );
    assert!(!dir.join("no").exists(), "nothing created");
    assert_eq!(db.count("state = 'dead'").await, 0);
    assert_eq!(db.count("1 = 1").await, 2 * n + 2);
    drop(proxy);
    db.close().await;
}

/// SIGTERM to a proxy running workers: it exits, and no row is left
/// `running` (finished within the grace, or given back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_no_row_held() {
    let dir = temp_dir("outbox-term");
    let db = Db::sqlite(&dir).await;
    let receiver = Receiver::start(Duration::from_secs(30), false).await;
    let backend = common::Backend::start().await;
    let config = outbox_config(
        Some(db.url()),
        &receiver.url(),
        &["crm"],
        "shutdown_grace = \"300ms\"\nconcurrency = 4\n",
    );
    let mut proxy = Proxy::start_with(ProxyArgs::new(backend.url(), &config, &dir), |command| {
        command.env("CRM_SECRET", crm_secret());
    })
    .await;
    db.wait_for_table().await;
    for i in 0..8 {
        db.enqueue("crm", &format!("s{i}"), &payload("s")).await;
    }
    eventually("four deliveries held by the slow receiver", || async {
        db.count("state = 'running'").await == 4
    })
    .await;
    proxy.terminate();
    assert!(proxy.wait_exit().await, "a clean exit");
    assert_eq!(db.count("state = 'running'").await, 0);
    assert_eq!(
        db.count("state = 'retryable'").await,
        4,
        "given back, due now"
    );
    assert_eq!(db.count("attempt = 1").await, 4);
}

/// A bad `[outbox]` is refused at start, with the file, the line and the
/// key — by the proxy and by `outbox run`; a secret is never inline.
#[test]
fn a_bad_outbox_configuration_is_refused_naming_its_key() {
    let dir = temp_dir("outbox-bad");
    let good =
        "[outbox]\ndatabase = \"sqlite://x.db\"\n\n[[outbox.destination]]\ntopic = \"crm\"\n";
    let cases: [(&str, &str, &[&str]); 9] = [
        (
            "url = \"http://crm:hunter2@crm.example/h\"\n",
            ":6:",
            &["`url`", "credentials", "secret_env"],
        ),
        (
            "url = \"http://a/h\"\nsecret = \"whsec_abc\"\n",
            ":7:",
            &["`secret`", "secret_env"],
        ),
        (
            "url = \"https://crm.example/h\"\n",
            ":6:",
            &["`url`", "https://"],
        ),
        (
            "url = \"http://a/h\"\nmax_attempt = 3\n",
            ":7:",
            &["max_attempt"],
        ),
        (
            "url = \"http://a/h\"\ntimeout = 10\n",
            ":7:",
            &["`timeout`", "\"30s\""],
        ),
        ("", ":4:", &["`url`", "missing"]),
        (
            "url = \"http://a/h\"\nsecret_env = \"NOT_SET_ANYWHERE_1\"\n",
            ":7:",
            &["`secret_env`", "NOT_SET_ANYWHERE_1 is not set"],
        ),
        (
            "url = \"http://a/h\"\nsecret_env = \"A\"\nsecret_file = \"b\"\n",
            ":8:",
            &["`secret_file`", "not both"],
        ),
        (
            "url = \"http://a/h\"\nsecret_file = \"missing.secret\"\n",
            ":7:",
            &["`secret_file`", "cannot read missing.secret"],
        ),
    ];
    for (destination, line, needles) in cases {
        let path = dir.join("bad.toml");
        std::fs::write(&path, format!("{good}{destination}")).unwrap();
        let runs = [
            cli(&dir, &["run", "--config", "bad.toml"]),
            binary()
                .current_dir(&*dir)
                .args(["--upstream", "http://127.0.0.1:9", "--config", "bad.toml"])
                .args(["--listen", &common::free_port().to_string()])
                .output()
                .unwrap(),
        ];
        for output in runs {
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(output.status.code(), Some(2), "{destination}: {stderr}");
            assert!(
                stderr.contains(&format!("bad.toml{line}")),
                "{destination}: {stderr}"
            );
            for needle in needles {
                assert!(
                    stderr.contains(needle),
                    "{destination}: `{needle}` in {stderr}"
                );
            }
            assert!(
                !stderr.contains("whsec_abc") && !stderr.contains("hunter2"),
                "the secret is never repeated"
            );
        }
    }
    // A proxy whose store is memory needs [outbox] `database`.
    std::fs::write(
        dir.join("memory.toml"),
        "[outbox]\n[[outbox.destination]]\ntopic = \"crm\"\nurl = \"http://a/h\"\n",
    )
    .unwrap();
    let output = binary()
        .current_dir(&*dir)
        .args(["--upstream", "http://127.0.0.1:9", "--store", "memory"])
        .args(["--config", "memory.toml"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("`database`") && stderr.contains("memory"),
        "{stderr}"
    );
}

// ---------------------------------------------------------------- item 6

/// A CRM stand-in behind a real `idempotency-proxy` (keyed on
/// `Idempotency-Key`, the delivery key).
struct ProxiedCrm {
    receiver: Receiver,
    proxy: Proxy,
}

impl ProxiedCrm {
    async fn start(delay: Duration, hold_first: bool) -> ProxiedCrm {
        let receiver = Receiver::start(delay, hold_first).await;
        let proxy = Proxy::start(ProxyArgs::new(receiver.url(), "", &temp_dir("crm"))).await;
        ProxiedCrm { receiver, proxy }
    }

    fn url(&self) -> String {
        format!("http://{}", self.proxy.addr)
    }
}

macro_rules! kill_test {
    ($($name:ident: $db:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let dir = temp_dir("outbox-kill");
            let db = match stringify!($db) {
                "postgres" => Db::postgres().await,
                _ => Db::sqlite(&dir).await,
            };
            a_worker_killed_after_the_effect(db, dir).await;
        }
    )*};
}

kill_test! {
    a_worker_killed_after_the_receivers_effect_is_absorbed_by_the_proxy_postgres: postgres;
    a_worker_killed_after_the_receivers_effect_is_absorbed_by_the_proxy_sqlite: sqlite;
}

/// `outbox run` is killed (`kill -9`) after the receiver performed the
/// effect and before the completion is recorded; after the lease a second
/// `outbox run` redelivers the same key, and the receiver — behind our
/// proxy — performs the effect once.
async fn a_worker_killed_after_the_effect(db: Db, dir: TempDir) {
    let crm = ProxiedCrm::start(Duration::ZERO, true).await;
    let config = dir.join("outbox.toml");
    std::fs::write(
        &config,
        outbox_config(Some(db.url()), &crm.url(), &["crm"], "lease = \"1s\"\n"),
    )
    .unwrap();
    let mut first = Runner::start(&dir, &config);
    db.wait_for_table().await;
    let n = 20;
    for i in 0..n {
        db.enqueue("crm", &format!("s{i}"), &payload("s")).await;
    }
    tokio::time::timeout(PATIENCE, crm.receiver.state.held.notified())
        .await
        .expect("a delivery reached the receiver");
    // The receiver has performed the effect; its answer is on the way.
    first.kill();
    crm.receiver.state.gate.notify_one();
    assert!(
        db.count("state = 'running'").await >= 1,
        "the killed worker held rows"
    );

    let _second = Runner::start(&dir, &config);
    eventually("every row delivered", || async {
        db.count("state = 'completed'").await == n
    })
    .await;
    let effects = crm.receiver.effects();
    assert_eq!(effects.len(), n as usize);
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    // The held row was delivered twice with the same key: the second
    // attempt met the proxy's stored answer.
    assert!(db.count("attempt >= 2").await >= 1, "a redelivery happened");
    assert_eq!(crm.receiver.state.bad_signatures.load(SeqCst), 0);
    drop(crm.proxy);
    db.close().await;
}

// ---------------------------------------------------------------- item 3

/// The database restarted mid-run (a private PostgreSQL, stopped with
/// `pg_ctl stop -m immediate` and started again): the `outbox run`
/// workers recover, every message is delivered, and each delivery key's
/// effect happens once at the receiver behind our proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_restarted_mid_run_nothing_lost_nothing_doubled() {
    let pg = Arc::new(
        tokio::task::spawn_blocking(PrivatePostgres::start)
            .await
            .unwrap(),
    );
    let dir = temp_dir("outbox-restart");
    let db = Db::postgres_at(&pg.url()).await;
    let crm = ProxiedCrm::start(Duration::from_millis(50), false).await;
    let config = dir.join("outbox.toml");
    std::fs::write(
        &config,
        outbox_config(
            Some(db.url()),
            &crm.url(),
            &["crm"],
            "lease = \"2s\"\nconcurrency = 8\n",
        ),
    )
    .unwrap();
    let runners = [Runner::start(&dir, &config), Runner::start(&dir, &config)];
    db.wait_for_table().await;
    let n = 600;
    for i in 0..n {
        db.enqueue("crm", &format!("s{i}"), &payload("s")).await;
    }
    eventually("deliveries under way", || async {
        crm.receiver.effects().len() >= n / 4
    })
    .await;
    let stopping = pg.clone();
    tokio::task::spawn_blocking(move || stopping.stop())
        .await
        .unwrap();
    let at_stop = crm.receiver.effects().len();
    assert!(at_stop < n, "the restart came before the end of the run");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let starting = pg.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .unwrap();
    eventually("every message delivered after the restart", || async {
        db.try_count("state = 'completed'").await.ok() == Some(n as i64)
    })
    .await;
    let effects = crm.receiver.effects();
    assert_eq!(effects.len(), n, "nothing lost");
    assert!(
        effects.values().all(|count| *count == 1),
        "nothing doubled: {effects:?}"
    );
    assert_eq!(crm.receiver.state.bad_signatures.load(SeqCst), 0);
    for mut runner in runners {
        assert!(runner.terminate(), "a clean exit on SIGTERM");
    }
    assert_eq!(db.count("state <> 'completed'").await, 0);
    db.close().await;
    drop(crm.proxy);
}

/// Scenario: the proxy's PostgreSQL outbox with a dozen destinations, each
/// worker `LISTEN`ing (the default). Each listener holds a connection for
/// good; the pool had sqlx's 10, so claims, renewals and the operator API
/// waited for a connection that never came, and no row was delivered (a
/// warning per poll was the only sign). The pool now has room for every
/// listener besides its working connections: every row is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dozen_listening_destinations_still_deliver() {
    let dir = temp_dir("outbox-listeners");
    let db = Db::postgres().await;
    let receiver = Receiver::start(Duration::ZERO, false).await;
    let mut topics = vec!["crm".to_owned()];
    topics.extend((1..12).map(|i| format!("quiet{i}")));
    let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
    let config = dir.join("outbox.toml");
    std::fs::write(
        &config,
        outbox_config(Some(db.url()), &receiver.url(), &topics, ""),
    )
    .unwrap();
    let _runner = Runner::start(&dir, &config);
    db.wait_for_table().await;
    for i in 0..10 {
        let source = format!("many-{i}");
        assert!(db.enqueue("crm", &source, &payload(&source)).await);
    }
    eventually("every row delivered", || async {
        db.count("state = 'completed'").await == 10
    })
    .await;
    let effects = receiver.effects();
    assert_eq!(effects.len(), 10);
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
}

// ------------------------------------------------------- refused or bounded

/// `idempotency-proxy outbox ARGS` in `dir`, given 20 s to exit; `None`
/// (and killed) if it was still running.
fn exits_within(dir: &Path, args: &[&str]) -> Option<Output> {
    let mut child = binary()
        .current_dir(dir)
        .arg("outbox")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(child.wait_with_output().unwrap())
}

/// `outbox run` on a file with `[outbox]` but no `database` and no
/// `[proxy] store` created an empty `./idempotency.db` (the proxy's default
/// store) and polled it for ever: no application enqueues there. It is
/// refused, naming the ways to give one, and creates nothing.
#[test]
fn outbox_run_without_an_outbox_database_refuses_and_creates_nothing() {
    let dir = temp_dir("outbox-nodb");
    std::fs::write(
        dir.join("outbox.toml"),
        "[outbox]\n[[outbox.destination]]\ntopic = \"crm\"\nurl = \"http://127.0.0.1:9/h\"\n",
    )
    .unwrap();
    let output = exits_within(&dir, &["run", "--config", "outbox.toml"]);
    let created: Vec<_> = std::fs::read_dir(&*dir)
        .unwrap()
        .flatten()
        .map(|entry| entry.file_name())
        .filter(|name| name != "outbox.toml")
        .collect();
    assert!(created.is_empty(), "nothing is created: {created:?}");
    let output = output.expect("`outbox run` refuses at once");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    for needle in [
        "outbox.toml",
        "no outbox database",
        "`database`",
        "[proxy] `store`",
        "--store",
    ] {
        assert!(stderr.contains(needle), "`{needle}` in {stderr}");
    }
}

/// `outbox run` skipped the `[proxy]` checks the proxy applies to the same
/// file (its `shutdown_timeout` bounds the workers' shutdown): it refuses
/// what the proxy refuses.
#[test]
fn outbox_run_refuses_the_proxy_settings_the_proxy_refuses() {
    let dir = temp_dir("outbox-check");
    let file = "[proxy]\nshutdown_timeout = \"500000000000y\"\n\n[outbox]\n\
                database = \"sqlite://outbox.db\"\n\n[[outbox.destination]]\n\
                topic = \"crm\"\nurl = \"http://127.0.0.1:9/h\"\n";
    std::fs::write(dir.join("outbox.toml"), file).unwrap();
    let output = exits_within(&dir, &["run", "--config", "outbox.toml"])
        .expect("`outbox run` refuses at once");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("`shutdown_timeout`") && stderr.contains("at most 100 years"),
        "{stderr}"
    );
    assert!(!dir.join("outbox.db").exists(), "refused before opening");
}

macro_rules! sweep_test {
    ($($name:ident: $db:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let dir = temp_dir("outbox-sweep");
            let db = match stringify!($db) {
                "postgres" => Db::postgres().await,
                _ => Db::sqlite(&dir).await,
            };
            a_backlog_of_delivered_rows_is_swept_in_one_pass(db, dir).await;
        }
    )*};
}

sweep_test! {
    retention_keeps_up_with_more_than_a_batch_per_sweep_interval_postgres: postgres;
    retention_keeps_up_with_more_than_a_batch_per_sweep_interval_sqlite: sqlite;
}

/// The sweeper deleted one batch (500 rows) per `sweep_interval` (60 s)
/// per worker: above about 8 deliveries a second, delivered rows piled up
/// for ever. 2,000 expired rows are gone after one sweep (the next is a
/// minute later); a row younger than `retention` stays.
async fn a_backlog_of_delivered_rows_is_swept_in_one_pass(db: Db, dir: TempDir) {
    let config = dir.join("outbox.toml");
    std::fs::write(
        &config,
        outbox_config(
            Some(db.url()),
            "http://127.0.0.1:9",
            &["crm"],
            "retention = \"1h\"\n",
        ),
    )
    .unwrap();
    // A first run creates the table.
    let mut first = Runner::start(&dir, &config);
    db.wait_for_table().await;
    assert!(first.terminate(), "a clean exit");
    let (pg, lite) = (
        "INSERT INTO outbox_messages (topic, source, payload, state, completed_at)
         SELECT 'crm', 'old-' || g, '\\x7b7d'::bytea, 'completed', now() - interval '2 hours'
         FROM generate_series(1, 2000) g
         UNION ALL SELECT 'crm', 'fresh', '\\x7b7d'::bytea, 'completed', now()",
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 2000)
         INSERT INTO outbox_messages (topic, source, payload, state, completed_at)
         SELECT 'crm', 'old-' || n, X'7B7D', 'completed', unixepoch('subsec') - 7200 FROM g
         UNION ALL SELECT 'crm', 'fresh', X'7B7D', 'completed', unixepoch('subsec')",
    );
    let inserted = match &db {
        Db::Pg(pool, _) => sqlx::query(pg).execute(pool).await.unwrap().rows_affected(),
        Db::Lite(pool, _) => sqlx::query(lite)
            .execute(pool)
            .await
            .unwrap()
            .rows_affected(),
    };
    assert_eq!(inserted, 2001);

    let _second = Runner::start(&dir, &config);
    // Its first sweep runs as its worker starts; the next one a minute later.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = db.count("state = 'completed'").await;
        if left == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{left} delivered rows left after the first sweep"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(db.count("source = 'fresh'").await, 1, "a young row stays");
    db.close().await;
}

/// From a review of the lifecycle: `outbox run` handled SIGTERM and
/// SIGINT only, so SIGHUP (a closed terminal, a process manager's reload)
/// and SIGQUIT (which process managers also send to stop) killed it by
/// their default actions with deliveries under way. SIGHUP is ignored now
/// and SIGQUIT stops the workers cleanly, as the proxy reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_run_ignores_sighup_and_stops_on_sigquit() {
    let dir = temp_dir("outbox-signals");
    let db = Db::sqlite(&dir).await;
    let config = dir.join("outbox.toml");
    std::fs::write(
        &config,
        outbox_config(Some(db.url()), "http://127.0.0.1:9", &["crm"], ""),
    )
    .unwrap();
    let mut runner = Runner::start(&dir, &config);
    db.wait_for_table().await;
    runner.signal("-HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        runner.0.try_wait().unwrap().is_none(),
        "SIGHUP ended outbox run"
    );
    runner.signal("-QUIT");
    let status = runner.0.wait().unwrap();
    assert!(status.success(), "SIGQUIT is a clean stop: {status:?}");
}

/// A second stop signal ends `outbox run`'s shutdown at once: the first
/// waits for the deliveries under way (up to `shutdown_grace`, 10 s by
/// default), and an operator's second Ctrl-C was ignored until then. The
/// row held by the receiver stays leased, left to the rescuer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_run_exits_on_a_second_stop_signal_during_its_shutdown() {
    let dir = temp_dir("outbox-second-signal");
    let db = Db::sqlite(&dir).await;
    let crm = Receiver::start(Duration::ZERO, true).await;
    let config = dir.join("outbox.toml");
    std::fs::write(
        &config,
        outbox_config(Some(db.url()), &crm.url(), &["crm"], ""),
    )
    .unwrap();
    let mut runner = Runner::start(&dir, &config);
    db.wait_for_table().await;
    assert!(db.enqueue("crm", "order-1", "{}").await);
    // The receiver holds the first delivery: it is under way.
    tokio::time::timeout(Duration::from_secs(20), crm.state.held.notified())
        .await
        .expect("the delivery reached the receiver");
    runner.signal("-TERM");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        runner.0.try_wait().unwrap().is_none(),
        "the first SIGTERM waits for the delivery under way"
    );
    runner.signal("-INT");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(status) = runner.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a second stop signal did not end the shutdown"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
    assert_eq!(
        db.count("state = 'completed'").await,
        0,
        "the held delivery was never answered"
    );
}

/// From a review: `outbox counts --store sqlite://…` on an application's
/// database without an outbox created the table (and sqlx's migration
/// table) and switched the file to WAL for good. An operator's command
/// opens the file as it is: no table, no journal mode changed, and a
/// clear error where there is no outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_command_leaves_an_sqlite_file_as_it_was() {
    use sqlx::ConnectOptions;
    let dir = temp_dir("outbox-ops-sqlite");
    let file = dir.join("app.db");
    let url = format!("sqlite://{}", file.display());
    {
        let mut app = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&file)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Delete)
            .connect()
            .await
            .unwrap();
        sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
            .execute(&mut app)
            .await
            .unwrap();
    }
    let output = cli(&dir, &["counts", "--store", &url]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no outbox table"), "{stderr}");
    let mut app = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&file)
        .connect()
        .await
        .unwrap();
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .fetch_all(&mut app)
            .await
            .unwrap();
    assert_eq!(tables, ["orders"]);
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut app)
        .await
        .unwrap();
    assert_eq!(mode, "delete");
}
