//! Opening the outbox database and running one worker per destination.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tower_idempotency::outbox::{
    Delivered, Deliverer, Delivery, DeliveryError, Destination, ErrorClass, Outbox,
    WebhookDeliverer, WebhookSecret, Worker, WorkerConfig, WorkerHandle,
};
use tower_idempotency::PostgresStore;

use super::config::{DestinationSettings, OutboxSettings};

/// The PostgreSQL connections an outbox has for its statements (claims,
/// renewals, outcomes, the rescuer, the operator API) beside its workers'
/// `LISTEN` connections, each of which holds one for good.
const WORKING_CONNECTIONS: u32 = 10;

/// Opens the outbox on `url` (`postgres://…` or `sqlite://…`) without
/// applying the migrations, for `listeners` workers that `LISTEN`. A
/// PostgreSQL pool connects lazily, so the proxy starts (and its operator
/// API answers 503) while the database is down; it has
/// [`WORKING_CONNECTIONS`] besides one per listener. An SQLite file that
/// cannot be opened is an error. Errors never repeat the URL (it may hold
/// a password).
pub async fn open(url: &str, listeners: usize) -> Result<Outbox, String> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let listeners = u32::try_from(listeners).unwrap_or(u32::MAX);
        let pool = PostgresStore::pool_options()
            .max_connections(WORKING_CONNECTIONS.saturating_add(listeners))
            .connect_lazy(url)
            .map_err(|_| "the outbox's PostgreSQL URL is malformed".to_owned())?;
        Ok(Outbox::postgres(pool))
    } else {
        Outbox::connect(url)
            .await
            .map_err(|error| format!("cannot open the outbox's SQLite database: {error}"))
    }
}

/// The running workers, one per destination; clones share them.
#[derive(Clone, Debug, Default)]
pub struct Workers {
    handles: Arc<Mutex<Vec<WorkerHandle>>>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

impl Workers {
    /// Applies the migrations (retrying every second while the database
    /// is unreachable), then starts one worker per destination on the
    /// current runtime. Returns at once; the workers start in the
    /// background.
    pub fn start(
        outbox: Outbox,
        settings: &OutboxSettings,
        secrets: Vec<Option<WebhookSecret>>,
    ) -> Workers {
        let workers = Workers::default();
        let plans: Vec<(WorkerConfig, Capped)> = settings
            .destinations
            .iter()
            .zip(secrets)
            .map(|(destination, secret)| plan(&settings.worker, destination, secret))
            .collect();
        let started = workers.clone();
        tokio::spawn(async move {
            // Said again every minute: a lasting failure (a role without
            // the right to create the table's trigger, a migration that
            // conflicts) must not be one line lost in the log.
            let mut attempts = 0u64;
            let mut warned: Option<std::time::Instant> = None;
            while let Err(error) = outbox.migrate().await {
                attempts += 1;
                if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(%error, attempts, "outbox database unavailable or its migrations failed; no row is delivered until they succeed");
                    warned = Some(std::time::Instant::now());
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                if started.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
            }
            let mut handles = started
                .handles
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if started.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            for (config, deliverer) in plans {
                tracing::info!(
                    topic = %deliverer.topic,
                    concurrency = config.concurrency,
                    "outbox worker started"
                );
                handles.push(
                    Worker::new(outbox.clone(), deliverer)
                        .config(config)
                        .spawn(),
                );
            }
        });
        workers
    }

    /// Stops every worker gracefully: no more claims, running deliveries
    /// finish within `shutdown_grace`, the rows of the others are given
    /// back (`retryable`, due now). Workers not yet started never start.
    pub async fn shutdown(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let handles =
            std::mem::take(&mut *self.handles.lock().unwrap_or_else(PoisonError::into_inner));
        futures_join(handles.into_iter().map(WorkerHandle::shutdown)).await;
    }
}

/// Awaits every future, concurrently.
async fn futures_join<F: std::future::Future<Output = ()> + Send + 'static>(
    futures: impl Iterator<Item = F>,
) {
    let mut set = tokio::task::JoinSet::new();
    for future in futures {
        set.spawn(future);
    }
    while set.join_next().await.is_some() {}
}

/// A destination's worker configuration and deliverer.
fn plan(
    shared: &WorkerConfig,
    destination: &DestinationSettings,
    secret: Option<WebhookSecret>,
) -> (WorkerConfig, Capped) {
    let mut target = Destination::new(destination.url.clone()).timeout(destination.timeout);
    if let Some(secret) = secret {
        target = target.secret(secret);
    }
    let config = WorkerConfig {
        backoff: destination.backoff,
        topics: Some(vec![destination.topic.clone()]),
        ..shared.clone()
    };
    let deliverer = Capped {
        topic: destination.topic.clone(),
        inner: WebhookDeliverer::new().destination(destination.topic.clone(), target),
        max_attempts: destination.max_attempts,
    };
    (config, deliverer)
}

/// The webhook deliverer of one destination, whose `max_attempts` (when
/// set) ends a row's retries even if the row allows more: the failure of
/// its last allowed attempt is recorded as permanent, so the row goes to
/// `dead`.
struct Capped {
    topic: String,
    inner: WebhookDeliverer,
    max_attempts: Option<u32>,
}

#[async_trait]
impl Deliverer for Capped {
    async fn deliver(&self, delivery: &Delivery) -> Result<Delivered, DeliveryError> {
        match (self.inner.deliver(delivery).await, self.max_attempts) {
            (Err(mut error), Some(max))
                if delivery.attempt() >= max && !error.class.is_permanent() =>
            {
                error.class = ErrorClass::Permanent;
                error.reason = format!(
                    "{}; the destination's max_attempts ({max}) reached",
                    error.reason
                );
                Err(error)
            }
            (result, _) => result,
        }
    }

    fn topics(&self) -> Option<Vec<String>> {
        self.inner.topics()
    }
}
