//! The Next.js seed's form platform, both halves: a submission accepted
//! once (the idempotency layer), and each of its integrations receiving it
//! once (the transactional outbox, with the receiver behind
//! `idempotency-proxy`).
//!
//! ```text
//! cargo build -p idempotency-proxy
//! PATH=$PWD/target/debug:$PATH cargo run --example form_outbox --features outbox,sqlite
//! curl -i -X POST http://127.0.0.1:3000/forms/contact/submit \
//!      -H 'Idempotency-Key: 7c1e7a52-54c5-4a8e-9d1f-2f0c3c1d1e01' \
//!      -H 'Content-Type: application/json' -d '{"email":"jane@example.com"}'
//! curl http://127.0.0.1:3002/crm           # what the CRM stand-in received
//! ```
//!
//! * `POST /forms/{id}/submit` on :3000 (a UUID `Idempotency-Key`
//!   required) writes the submission and one outbox row per integration
//!   (`crm`, `mail`) in one SQLite transaction and answers 202 with the
//!   submission id. A repeat with the same key is replayed by the layer
//!   (the same id).
//! * A worker delivers each row to the "CRM" stand-in (:3002), which does
//!   no deduplication of its own: it sits behind `idempotency-proxy`
//!   (:3001, started by this example), keyed on `Idempotency-Key` — the
//!   delivery key. A redelivery after a worker crash (the CRM acted, the
//!   worker died before recording it) carries the same key and is answered
//!   by the proxy from its store, so each integration performs its effect
//!   once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use axum::Router;
use sqlx::SqlitePool;
use tower_idempotency::outbox::{self, Destination, Message, WebhookDeliverer, WebhookSecret};
use tower_idempotency::{Engine, IdempotencyLayer, MemoryStore, Policy, Routes};

/// The integrations every submission goes to.
pub const INTEGRATIONS: [&str; 2] = ["crm", "mail"];

/// The demo's signing secret (a real one comes from the environment).
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Creates the business table next to the outbox's.
pub async fn migrate(pool: &SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    outbox::Outbox::sqlite(pool.clone()).migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS submissions (
             id TEXT PRIMARY KEY, form_id TEXT NOT NULL, data BLOB NOT NULL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The form platform behind the idempotency layer: `POST /forms/{id}/submit`
/// needs a UUID key.
pub fn app(pool: SqlitePool) -> Router {
    let policy = Policy {
        uuid_only: true,
        ..Policy::default().required(true)
    };
    let routes = Routes::new()
        .route("/forms/*/submit", policy)
        .expect("the form policy is valid");
    Router::new()
        .route("/forms/{form_id}/submit", post(submit))
        .with_state(pool)
        .layer(IdempotencyLayer::new(Engine::new(
            MemoryStore::new(),
            routes,
        )))
}

/// Accepts a submission: the business row and its outbox rows, one commit.
async fn submit(
    State(pool): State<SqlitePool>,
    Path(form_id): Path<String>,
    body: Bytes,
) -> Response {
    let id = uuid::Uuid::new_v4().to_string();
    let result = async {
        let mut tx = pool.begin().await?;
        sqlx::query("INSERT INTO submissions (id, form_id, data) VALUES (?1, ?2, ?3)")
            .bind(&id)
            .bind(&form_id)
            .bind(body.as_ref())
            .execute(&mut *tx)
            .await?;
        for integration in INTEGRATIONS {
            // Identifiers only: the integration fetches what it may see.
            let payload = serde_json::json!({ "submission": id, "form": form_id });
            let message = Message::new(integration, id.as_str(), payload.to_string().into());
            outbox::enqueue(&mut *tx, &message).await?;
        }
        tx.commit().await?;
        Ok::<_, outbox::OutboxError>(())
    }
    .await;
    match result {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({ "submission": id })),
        )
            .into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// What the CRM stand-in has done: one record per delivery key it acted
/// on, and how many times it acted on each.
#[derive(Debug, Default)]
pub struct Crm {
    effects: Mutex<BTreeMap<String, u32>>,
}

impl Crm {
    /// Effects per delivery key.
    pub fn effects(&self) -> BTreeMap<String, u32> {
        self.effects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The CRM stand-in: `POST /crm/{integration}` verifies the signature and
/// records one effect per request; `GET /crm` lists them. It does not
/// deduplicate: put it behind `idempotency-proxy` (as `main` does) or this
/// crate's layer, keyed on `Idempotency-Key`.
pub fn crm(crm: Arc<Crm>) -> Router {
    Router::new()
        .route("/crm", get(crm_effects))
        .route("/crm/{integration}", post(crm_receive))
        .with_state(crm)
}

async fn crm_receive(State(crm): State<Arc<Crm>>, headers: HeaderMap, body: Bytes) -> Response {
    // The signature (constant time), a 5-minute window, and the key equal
    // to the signed id (the proxy in front deduplicates by the key).
    let secret = WebhookSecret::from_whsec(SECRET).expect("the demo secret is valid");
    if secret
        .verify(&headers, &body, std::time::Duration::from_secs(300))
        .is_err()
    {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let id = headers
        .get("webhook-id")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    *crm.effects
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(id.to_owned())
        .or_default() += 1;
    StatusCode::CREATED.into_response()
}

async fn crm_effects(State(crm): State<Arc<Crm>>) -> Json<BTreeMap<String, u32>> {
    Json(crm.effects())
}

/// Delivers every integration to the CRM stand-in at `base` (`http://…`).
pub fn deliverer(base: &str) -> WebhookDeliverer {
    INTEGRATIONS
        .iter()
        .fold(WebhookDeliverer::new(), |deliverer, integration| {
            let url = format!("{base}/crm/{integration}")
                .parse()
                .expect("a valid URL");
            let secret = WebhookSecret::from_whsec(SECRET).expect("the demo secret is valid");
            deliverer.destination(*integration, Destination::new(url).secret(secret))
        })
}

#[allow(dead_code)] // the tests use the functions above, not `main`
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let outbox = outbox::Outbox::connect("form_outbox.db").await?;
    let pool = outbox_pool("form_outbox.db").await?;
    migrate(&pool).await?;
    // The CRM stand-in on :3002, and idempotency-proxy in front of it on
    // :3001 (records in memory: enough for the demo).
    let crm_listener = tokio::net::TcpListener::bind("127.0.0.1:3002").await?;
    tokio::spawn(async move { axum::serve(crm_listener, crm(Arc::default())).await });
    let proxy = std::env::var("IDEMPOTENCY_PROXY").unwrap_or_else(|_| "idempotency-proxy".into());
    let mut proxy = std::process::Command::new(&proxy)
        .args([
            "--listen",
            "127.0.0.1:3001",
            "--upstream",
            "http://127.0.0.1:3002",
        ])
        .args(["--store", "memory"])
        .spawn()
        .map_err(|error| {
            format!(
                "cannot start `{proxy}` ({error}): build it with `cargo build -p \
                 idempotency-proxy` and put target/debug on PATH, or set IDEMPOTENCY_PROXY"
            )
        })?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    let worker = outbox::Worker::new(outbox, deliverer("http://127.0.0.1:3001")).spawn();
    println!(
        "form platform on http://127.0.0.1:3000: POST /forms/contact/submit; \
         CRM stand-in behind idempotency-proxy: GET http://127.0.0.1:3002/crm"
    );
    // On Ctrl-C the worker stops first (finishing what it holds).
    let served = axum::serve(listener, app(pool))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
            worker.shutdown().await;
        })
        .await;
    let _ = proxy.kill();
    let _ = proxy.wait();
    Ok(served?)
}

/// The application's own pool on the same file (the store's settings).
async fn outbox_pool(path: &str) -> Result<SqlitePool, Box<dyn std::error::Error>> {
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(path);
    Ok(tower_idempotency::SqliteStore::connect_with(options)
        .await?
        .pool()
        .clone())
}
