//! The transactional outbox: after a business row commits, every
//! integration it concerns (a CRM, a confirmation mail, a webhook) receives
//! it — even when a worker crashes mid-delivery — and each delivery carries
//! a key that never changes, so the receiver can make its effect happen
//! once.
//!
//! The idempotency layer makes a submission take effect once; the outbox
//! carries that guarantee to the last external boundary:
//!
//! 1. **Enqueue in the same transaction** as the business row
//!    ([`enqueue`], or the plain SQL `INSERT` in `docs/outbox.md` from any
//!    language). One row per (`topic`, `source`) — a unique constraint — so
//!    a handler that runs twice adds nothing. Commit or roll back together.
//! 2. **Workers** ([`Worker`]) claim due rows atomically (PostgreSQL
//!    `FOR UPDATE SKIP LOCKED`; SQLite one write statement), each with its
//!    own owner token and a lease renewed while the delivery runs. Completion
//!    and failure are written only under that token, so a worker whose
//!    lease was taken over cannot complete or fail the row.
//! 3. **Failures**: a transient one (timeout, connection error, 408, 429,
//!    5xx, and an idempotent receiver's "still in flight": see
//!    [`WebhookDeliverer`]) is retried with exponential backoff, jitter and
//!    a cap, never earlier than the receiver's `Retry-After`; a permanent
//!    one (any other 4xx) and the last allowed attempt go to `dead`, where
//!    the row stays
//!    until someone [retries](Outbox::retry_dead) or
//!    [purges](Outbox::purge_dead) it. Each failure records an error class,
//!    the receiver's status and request id and a short reason — never the
//!    payload.
//! 4. **Rescue**: rows whose lease ran out (their worker died) are put back
//!    in the queue by [`Outbox::rescue`], which any number of workers may run
//!    at once; each row is re-queued once.
//! 5. **Delivery**: through a [`Deliverer`]; [`WebhookDeliverer`] POSTs the
//!    payload with `Idempotency-Key` and the Standard Webhooks headers
//!    (`webhook-id`, `webhook-timestamp`, `webhook-signature`).
//!
//! Delivery is **at least once**; the effect is once when the receiver
//! deduplicates on the delivery key (for example behind this crate's layer
//! or `idempotency-proxy`, keyed on `Idempotency-Key`). A local "completed"
//! flag alone cannot do that: a worker can die after the receiver succeeded
//! and before the row is marked completed.
//!
//! Every schedule (due times, leases, retention) runs on the database's
//! clock; only the `webhook-timestamp` header is the sender's, as the
//! Standard Webhooks specification asks.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::outbox::{self, Destination, Message, Outbox, WebhookDeliverer, Worker};
//!
//! let outbox = Outbox::postgres(pool.clone());
//! outbox.migrate().await?;
//!
//! // In the request handler: the business row and its outbox rows, one commit.
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO submissions (id, form_id) VALUES ($1, $2)")
//!     .bind("sub_42").bind("contact").execute(&mut *tx).await?;
//! outbox::enqueue(&mut *tx, &Message::new("crm", "sub_42", br#"{"submission":"sub_42"}"#.to_vec())).await?;
//! tx.commit().await?;
//!
//! // In the worker process.
//! let deliverer = WebhookDeliverer::new()
//!     .destination("crm", Destination::new("http://crm.internal/hooks".parse()?));
//! let worker = Worker::new(outbox, deliverer).spawn();
//! // … on shutdown:
//! worker.shutdown().await;
//! # Ok(())
//! # }
//! ```

mod deliver;
mod enqueue;
mod metrics;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;
mod types;
mod webhook;
mod worker;

#[cfg(not(any(feature = "postgres", feature = "sqlite")))]
compile_error!("the `outbox` feature needs `postgres` and/or `sqlite`");

pub use deliver::{Delivered, Deliverer, Delivery, DeliveryError, ErrorClass};
#[cfg(feature = "postgres")]
pub use enqueue::notify;
pub use enqueue::{enqueue, EnqueueFuture, Message, OutboxConnection, NOTIFY_CHANNEL};
pub use metrics::OutboxMetrics;
pub use store::{Counts, DeadMessage, MessageStatus, Outbox, OutboxError, State};
pub use webhook::{Destination, VerifyError, WebhookDeliverer, WebhookSecret};
pub use worker::{Backoff, Worker, WorkerConfig, WorkerHandle};
