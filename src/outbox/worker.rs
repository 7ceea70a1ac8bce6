//! Workers: claim due rows, deliver them with bounded concurrency, record
//! the outcome under the row's owner token, rescue expired leases, sweep.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::deliver::{Deliverer, Delivery, DeliveryError};
use super::store::{Outbox, OutboxError};

/// How long a failed attempt waits before the next: exponential from
/// `base`, capped at `max`, with jitter, and never shorter than the
/// receiver's `Retry-After` (itself capped at `max_retry_after`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failed attempt (before jitter). Default 1 s.
    pub base: Duration,
    /// The longest wait the exponential grows to. Default 1 h.
    pub max: Duration,
    /// The longest `Retry-After` honoured. Default 6 h.
    pub max_retry_after: Duration,
    /// Spread each wait uniformly over its upper half (`[d/2, d]`), so
    /// messages that failed together do not come back together. Default on.
    pub jitter: bool,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(3600),
            max_retry_after: Duration::from_secs(6 * 3600),
            jitter: true,
        }
    }
}

impl Backoff {
    /// The wait after failed attempt number `attempt` (from 1):
    /// `min(max, base · 2^(attempt−1))`, jittered, then at least
    /// `min(retry_after, max_retry_after)`.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exponent = attempt.saturating_sub(1).min(32);
        let grown = self
            .base
            .checked_mul(1u32 << exponent.min(31))
            .unwrap_or(self.max)
            .min(self.max);
        let grown = if self.jitter && !grown.is_zero() {
            let half = grown / 2;
            half + rand::rng().random_range(Duration::ZERO..=grown - half)
        } else {
            grown
        };
        match retry_after {
            Some(after) => grown.max(after.min(self.max_retry_after)),
            None => grown,
        }
    }
}

/// The shortest wait for the next rescue or sweep.
const CHORE_PAUSE: Duration = Duration::from_millis(10);

/// How a [`Worker`] runs.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Deliveries in flight at most (and rows held). Default 16.
    pub concurrency: usize,
    /// The lease on a claimed row, renewed every third of it while its
    /// delivery runs. A row whose worker stops renewing is rescued after
    /// it. Default 30 s.
    pub lease: Duration,
    /// How often an idle worker looks for due rows. Default 1 s.
    pub poll_interval: Duration,
    /// Retry schedule.
    pub backoff: Backoff,
    /// How often the worker runs the rescuer. Default 10 s.
    pub rescue_interval: Duration,
    /// Rows re-queued or swept per statement. Default 500.
    pub batch: usize,
    /// Delivered rows older than this are swept; `None` keeps them.
    /// Dead rows are never swept. Default 7 days.
    pub retention: Option<Duration>,
    /// How often the sweeper runs; each run deletes batch after batch
    /// until a short one comes back, for at most a second at a time (a
    /// backlog goes on a second later). Default 60 s.
    pub sweep_interval: Duration,
    /// On shutdown, how long running deliveries may finish; the rows of
    /// those still running then are given back (`retryable`, due now).
    /// Default 10 s.
    pub shutdown_grace: Duration,
    /// Claim only these topics; `None` takes the deliverer's
    /// [`topics`](Deliverer::topics) (every topic if that is `None` too).
    pub topics: Option<Vec<String>>,
    /// PostgreSQL: also wake up when a transaction that called
    /// [`notify`](super::notify) commits, so an idle worker delivers at once
    /// instead of at its next poll. Holds one pooled connection for
    /// `LISTEN`; falls back to polling while it cannot. Ignored on SQLite.
    /// Default on.
    pub listen: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 16,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            backoff: Backoff::default(),
            rescue_interval: Duration::from_secs(10),
            batch: 500,
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            sweep_interval: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
            topics: None,
            listen: true,
        }
    }
}

/// Delivers the outbox's rows through a [`Deliverer`].
///
/// * Claims only as many rows as it has free delivery slots
///   ([`concurrency`](WorkerConfig::concurrency)), so it never holds a row
///   it is not delivering.
/// * Renews each row's lease while its delivery runs; if a renewal finds
///   the row taken over (the worker stalled past its lease), the delivery
///   is dropped and nothing is recorded.
/// * Records success, or failure with its class, the receiver's status and
///   request id, under the row's owner token; schedules retries with
///   [`Backoff`].
/// * Runs the rescuer and the retention sweeper on their intervals (any
///   number of workers may).
/// * Survives database outages: a failed claim is logged and tried again
///   at the next poll.
///
/// Any number of workers, in any number of processes, may share a table.
pub struct Worker<D> {
    outbox: Outbox,
    deliverer: Arc<D>,
    config: WorkerConfig,
}

impl<D> std::fmt::Debug for Worker<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("outbox", &self.outbox)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A running [`Worker`]; [`shutdown`](WorkerHandle::shutdown) stops it
/// gracefully. Dropping the handle starts the same graceful shutdown
/// without waiting for it.
#[derive(Debug)]
pub struct WorkerHandle {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl WorkerHandle {
    /// Stops claiming, lets running deliveries finish within the grace
    /// period, gives back the rows of those that did not, and returns when
    /// the worker has stopped.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }

    /// Stops the worker at once, as a crash would: running deliveries are
    /// dropped and their rows are left to the rescuer.
    pub fn abort(self) {
        self.task.abort();
    }
}

impl<D: Deliverer> Worker<D> {
    /// A worker on `outbox` with the default [`WorkerConfig`].
    pub fn new(outbox: Outbox, deliverer: D) -> Self {
        Worker {
            outbox,
            deliverer: Arc::new(deliverer),
            config: WorkerConfig::default(),
        }
    }

    /// Replaces the configuration.
    pub fn config(mut self, config: WorkerConfig) -> Self {
        self.config = config;
        self
    }

    /// Runs the worker on a new task until
    /// [`WorkerHandle::shutdown`].
    pub fn spawn(self) -> WorkerHandle {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(self.run(async move {
            let _ = stopped.await;
        }));
        WorkerHandle {
            stop: Some(stop),
            task,
        }
    }

    /// Runs the worker until `shutdown` completes, then shuts down
    /// gracefully (see [`WorkerHandle::shutdown`]).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let Worker {
            outbox,
            deliverer,
            config,
        } = self;
        let topics = config.topics.clone().or_else(|| deliverer.topics());
        let concurrency = config.concurrency.max(1);
        let wakeup = Wakeup::new(&outbox, config.listen).await;
        let (cancel, cancelled) = watch::channel(false);
        let mut tasks = JoinSet::new();
        // `None`: an interval too long for the clock, never due again.
        let mut next_rescue = Some(Instant::now());
        let mut next_sweep = Some(Instant::now());
        tokio::pin!(shutdown);

        loop {
            while let Some(result) = tasks.try_join_next() {
                log_panic(result);
            }
            let now = Instant::now();
            if next_rescue.is_some_and(|at| now >= at) {
                next_rescue = now.checked_add(config.rescue_interval);
                match outbox.rescue(config.batch).await {
                    Ok(ids) if !ids.is_empty() => {
                        tracing::info!(rows = ids.len(), "outbox: re-queued expired leases")
                    }
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "outbox: rescue failed"),
                }
            }
            if let Some(retention) = config.retention {
                if next_sweep.is_some_and(|at| now >= at) {
                    next_sweep = match sweep(&outbox, retention, config.batch).await {
                        Swept::Done => now.checked_add(config.sweep_interval),
                        // More left: go on after as long again, so a
                        // backlog takes at most half the worker's time
                        // from deliveries.
                        Swept::Paused => Instant::now().checked_add(SWEEP_BUDGET),
                    };
                }
            }

            let free = concurrency.saturating_sub(tasks.len());
            let mut queue_drained = true;
            if free > 0 {
                // The leases run from no earlier than the claim was sent.
                let sent = Instant::now();
                match outbox
                    .claim_rows(free, config.lease, topics.as_deref())
                    .await
                {
                    Ok((deliveries, claimed)) => {
                        // Unreadable rows went dead in the claim: they
                        // count, or a batch of them would look like an
                        // empty queue and the worker would sleep a poll.
                        queue_drained = claimed < free;
                        for delivery in deliveries {
                            tasks.spawn(deliver(
                                outbox.clone(),
                                deliverer.clone(),
                                delivery,
                                Lease {
                                    length: config.lease,
                                    sent,
                                },
                                config.backoff,
                                cancelled.clone(),
                            ));
                        }
                    }
                    Err(error) => tracing::warn!(%error, "outbox: claim failed"),
                }
            }

            let has_tasks = !tasks.is_empty();
            let slots_left = tasks.len() < concurrency;
            if slots_left && !queue_drained {
                // More may be due right now: claim again, unless told to stop.
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = std::future::ready(()) => continue,
                }
            }
            // The rescue and the sweep keep their own intervals, whatever
            // the poll interval, and with every slot busy too.
            let next_chore = next_rescue
                .into_iter()
                .chain(next_sweep.filter(|_| config.retention.is_some()))
                .min();
            let chore = async move {
                match next_chore {
                    // At least a moment away: a zero interval (or a rescue
                    // slower than its interval) never spins the loop.
                    Some(at) => {
                        tokio::time::sleep_until(at.max(Instant::now() + CHORE_PAUSE)).await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut shutdown => break,
                Some(result) = tasks.join_next(), if has_tasks => log_panic(result),
                () = tokio::time::sleep(config.poll_interval), if slots_left => {}
                () = wakeup.wait(), if slots_left => {}
                () = chore => {}
            }
        }

        // Graceful shutdown: no more claims; running deliveries get the
        // grace period, then give their rows back.
        let drain = async {
            while let Some(result) = tasks.join_next().await {
                log_panic(result);
            }
        };
        if tokio::time::timeout(config.shutdown_grace, drain)
            .await
            .is_err()
        {
            let _ = cancel.send(true);
            while let Some(result) = tasks.join_next().await {
                log_panic(result);
            }
        }
    }
}

/// The longest one turn of the sweeper deletes for before the worker
/// claims again (a sweep cut short goes on as long after).
const SWEEP_BUDGET: Duration = Duration::from_secs(1);

/// How a sweep ended.
enum Swept {
    /// A short batch came back (or a statement failed): nothing left for
    /// now.
    Done,
    /// [`SWEEP_BUDGET`] ran out with full batches still coming back.
    Paused,
}

/// Deletes the delivered rows older than `retention`, `batch` per
/// statement, while full batches come back (as the engine's sweeper does),
/// so retention keeps up with any completion rate rather than one batch
/// per `sweep_interval`; for at most [`SWEEP_BUDGET`], so claims never
/// wait long behind a backlog.
async fn sweep(outbox: &Outbox, retention: Duration, batch: usize) -> Swept {
    let batch = batch.max(1);
    let started = Instant::now();
    let mut swept = 0;
    loop {
        match outbox.sweep(retention, batch).await {
            Ok(n) => {
                swept += n;
                if (n as usize) < batch {
                    if swept > 0 {
                        tracing::debug!(rows = swept, "outbox: swept delivered rows");
                    }
                    return Swept::Done;
                }
                if started.elapsed() >= SWEEP_BUDGET {
                    tracing::debug!(rows = swept, "outbox: swept delivered rows; more left");
                    return Swept::Paused;
                }
            }
            Err(error) => {
                tracing::warn!(%error, "outbox: sweep failed");
                return Swept::Done;
            }
        }
    }
}

/// What wakes an idle worker before its next poll: a PostgreSQL
/// notification on [`NOTIFY_CHANNEL`](super::NOTIFY_CHANNEL). The listener
/// runs on a task of its own (a `PgListener` read is not safe to cancel
/// mid-message) and leaves a permit in a [`Notify`](tokio::sync::Notify),
/// whose wait is.
struct Wakeup {
    notify: Arc<tokio::sync::Notify>,
    listener: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Wakeup {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.abort();
        }
    }
}

impl Wakeup {
    #[allow(unused_variables)]
    async fn new(outbox: &Outbox, listen: bool) -> Wakeup {
        let notify = Arc::new(tokio::sync::Notify::new());
        #[cfg(feature = "postgres")]
        if let (true, super::store::Backend::Postgres(pool)) = (listen, &outbox.backend) {
            let listener = async {
                let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
                listener.listen(super::NOTIFY_CHANNEL).await?;
                Ok::<_, sqlx::Error>(listener)
            };
            match listener.await {
                Ok(mut listener) => {
                    let wake = notify.clone();
                    let task = tokio::spawn(async move {
                        loop {
                            // `None`: the connection was lost (a notification
                            // may be missed, so look once); it reconnects.
                            if let Err(error) = listener.try_recv().await {
                                tracing::warn!(%error, "outbox: LISTEN connection failed");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                            }
                            wake.notify_one();
                        }
                    });
                    return Wakeup {
                        notify,
                        listener: Some(task),
                    };
                }
                Err(error) => tracing::warn!(%error, "outbox: LISTEN failed; polling only"),
            }
        }
        Wakeup {
            notify,
            listener: None,
        }
    }

    /// Returns after a notification (at once if one came since the last
    /// wait); never without a listener.
    async fn wait(&self) {
        if self.listener.is_some() {
            self.notify.notified().await;
        } else {
            std::future::pending::<()>().await;
        }
    }
}

fn log_panic(result: Result<(), tokio::task::JoinError>) {
    if let Err(error) = result {
        if error.is_panic() {
            tracing::error!("outbox: a delivery task panicked; its row will be rescued");
        }
    }
}

/// How often an outcome is written again after a database error before
/// the row is left to the rescuer.
const RECORD_TRIES: u32 = 4;

/// A claimed row's lease as its worker knows it.
#[derive(Clone, Copy)]
struct Lease {
    length: Duration,
    /// When the claim was sent: the database's lease began no earlier.
    sent: Instant,
}

/// How a delivery's lease was lost.
enum Lost {
    /// A renewal found the row taken over.
    TakenOver,
    /// No renewal got through before the lease last renewed ran out.
    RanOut,
}

/// One delivery: deliver while renewing the lease; record the outcome. The
/// delivery is dropped once the lease is lost: taken over, or run out by
/// this worker's clock because no renewal got through (the database
/// unreachable from here while the rescuer of a worker that reaches it
/// re-queues the row), so two workers never deliver the row at once.
async fn deliver<D: Deliverer>(
    outbox: Outbox,
    deliverer: Arc<D>,
    delivery: Delivery,
    lease: Lease,
    backoff: Backoff,
    mut cancelled: watch::Receiver<bool>,
) {
    let renew = async {
        let period = (lease.length / 3).max(Duration::from_millis(1));
        // After a failed renewal, sooner: the engine's renewer's rule.
        let retry = crate::engine::renewal_retry_after(lease.length).max(Duration::from_millis(1));
        // The database's lease ends no earlier than this (a lease too long
        // for the clock never runs out here).
        let ends = |from: Instant| from.checked_add(lease.length);
        let mut held_until = ends(lease.sent);
        let mut wait = period;
        loop {
            let next = Instant::now() + wait;
            tokio::time::sleep_until(held_until.map_or(next, |until| next.min(until))).await;
            let asked = Instant::now();
            if held_until.is_some_and(|until| asked >= until) {
                return Lost::RanOut;
            }
            let renewal = outbox.renew(&delivery, lease.length);
            let renewal = match held_until {
                Some(until) => tokio::time::timeout_at(until, renewal).await,
                None => Ok(renewal.await),
            };
            match renewal {
                Ok(Ok(true)) => {
                    held_until = ends(asked);
                    wait = period;
                }
                Ok(Ok(false)) => return Lost::TakenOver,
                Ok(Err(error)) => {
                    tracing::warn!(%error, id = delivery.id, "outbox: renewal failed");
                    wait = retry;
                }
                Err(_) => return Lost::RanOut,
            }
        }
    };
    let started = std::time::Instant::now();
    let result = tokio::select! {
        result = deliverer.deliver(&delivery) => {
            outbox.metrics().delivery_latency.observe(started.elapsed());
            result
        }
        lost = renew => {
            let why = match lost {
                Lost::TakenOver => "outbox: lease taken over during delivery; dropped",
                Lost::RanOut => "outbox: lease ran out during delivery (no renewal got through); dropped",
            };
            tracing::warn!(
                id = delivery.id,
                topic = %delivery.topic,
                attempt = delivery.attempt,
                "{why}",
            );
            outbox.metrics().lost_leases.inc();
            return;
        }
        () = async { let _ = cancelled.wait_for(|cancelled| *cancelled).await; } => {
            retry_db(|| outbox.release(&delivery)).await;
            return;
        }
    };
    match result {
        Ok(delivered) => {
            let recorded = retry_db(|| {
                outbox.complete(&delivery, delivered.status, delivered.request_id.as_deref())
            })
            .await;
            if recorded == Some(false) {
                tracing::warn!(
                    id = delivery.id,
                    topic = %delivery.topic,
                    "outbox: delivered, but the lease had been taken over; not recorded",
                );
            }
        }
        Err(error) => {
            let delay = backoff.delay(delivery.attempt, error.retry_after);
            tracing::info!(
                id = delivery.id,
                topic = %delivery.topic,
                attempt = delivery.attempt,
                class = error.class.as_str(),
                status = error.status,
                "outbox: delivery failed",
            );
            record_failure(&outbox, &delivery, &error, delay).await;
        }
    }
}

async fn record_failure(
    outbox: &Outbox,
    delivery: &Delivery,
    error: &DeliveryError,
    delay: Duration,
) {
    if let Some(None) = retry_db(|| outbox.fail(delivery, error, delay)).await {
        tracing::warn!(
            id = delivery.id,
            topic = %delivery.topic,
            "outbox: failure not recorded, the lease had been taken over",
        );
    }
}

/// Runs `write` until it succeeds, at most [`RECORD_TRIES`] times with a
/// short doubling pause; `None` when every try failed.
async fn retry_db<T, F, Fut>(mut write: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, OutboxError>>,
{
    let mut pause = Duration::from_millis(100);
    for attempt in 1..=RECORD_TRIES {
        match write().await {
            Ok(value) => return Some(value),
            Err(error) => {
                tracing::warn!(%error, attempt, "outbox: writing an outcome failed");
                if attempt < RECORD_TRIES {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_caps_and_honours_retry_after() {
        let backoff = Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(60),
            max_retry_after: Duration::from_secs(600),
            jitter: false,
        };
        assert_eq!(backoff.delay(1, None), Duration::from_secs(1));
        assert_eq!(backoff.delay(2, None), Duration::from_secs(2));
        assert_eq!(backoff.delay(5, None), Duration::from_secs(16));
        assert_eq!(backoff.delay(7, None), Duration::from_secs(60));
        assert_eq!(backoff.delay(u32::MAX, None), Duration::from_secs(60));
        let after = Some(Duration::from_secs(120));
        assert_eq!(backoff.delay(1, after), Duration::from_secs(120));
        // A shorter Retry-After never shortens the backoff.
        assert_eq!(
            backoff.delay(3, Some(Duration::from_secs(1))),
            Duration::from_secs(4)
        );
        // A huge Retry-After is capped.
        let huge = Some(Duration::from_secs(86_400));
        assert_eq!(backoff.delay(1, huge), Duration::from_secs(600));
    }

    /// `rescue_interval = "500000000000y"` panicked the worker: its next
    /// run overflowed the clock. An interval too long for the clock never
    /// comes due instead.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn an_interval_too_long_for_the_clock_never_comes_due() {
        struct Nothing;
        #[async_trait::async_trait]
        impl Deliverer for Nothing {
            async fn deliver(
                &self,
                _: &Delivery,
            ) -> Result<crate::outbox::Delivered, DeliveryError> {
                Err(DeliveryError::permanent("never called"))
            }
            fn topics(&self) -> Option<Vec<String>> {
                Some(vec!["none".to_owned()])
            }
        }
        let path = std::env::temp_dir().join(format!(
            "tower-idempotency-worker-{}-{:?}.db",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        let outbox = Outbox::connect(path.to_str().unwrap()).await.unwrap();
        let worker = Worker::new(outbox, Nothing).config(WorkerConfig {
            poll_interval: Duration::from_millis(10),
            rescue_interval: Duration::MAX,
            sweep_interval: Duration::MAX,
            listen: false,
            ..WorkerConfig::default()
        });
        let run = tokio::spawn(worker.run(tokio::time::sleep(Duration::from_millis(200))));
        let ran = run.await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
        assert!(ran.is_ok(), "the worker panicked: {ran:?}");
    }

    #[test]
    fn jitter_stays_in_the_upper_half() {
        let backoff = Backoff {
            base: Duration::from_secs(8),
            ..Backoff::default()
        };
        let delays: Vec<_> = (0..200).map(|_| backoff.delay(1, None)).collect();
        assert!(delays
            .iter()
            .all(|d| *d >= Duration::from_secs(4) && *d <= Duration::from_secs(8)));
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 100, "jitter spreads: {}", distinct.len());
    }
}
