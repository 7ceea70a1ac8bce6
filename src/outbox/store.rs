//! The outbox table and every statement run on it, for both databases.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::deliver::{Delivery, DeliveryError};
use super::enqueue::{Message, OutboxConnection};
use super::metrics::OutboxMetrics;
pub use super::types::{Counts, DeadMessage, MessageStatus, OutboxError, State};

/// Longest reason or receiver request id kept in the error columns.
const MAX_NOTE: usize = 200;

#[derive(Clone, Debug)]
pub(crate) enum Backend {
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
}

/// Runs `$body` with `$pool` bound to the backend's pool and `$sql` to its
/// dialect module (the SQL text and its parameter shapes).
macro_rules! with_backend {
    ($outbox:expr, |$pool:ident, $sql:ident| $body:expr) => {
        match &$outbox.backend {
            #[cfg(feature = "postgres")]
            Backend::Postgres($pool) => {
                use super::postgres as $sql;
                $body
            }
            #[cfg(feature = "sqlite")]
            Backend::Sqlite($pool) => {
                use super::sqlite as $sql;
                $body
            }
        }
    };
}

/// The outbox table (`outbox_messages`, see `migrations/outbox/` and
/// `migrations/sqlite/outbox/`) on a PostgreSQL or SQLite pool.
///
/// Every method is one statement, atomic on its own:
///
/// * [`claim`](Outbox::claim) hands each due row to exactly one caller,
///   with a fresh owner token and a lease, however many workers claim at
///   once;
/// * [`renew`](Outbox::renew), [`complete`](Outbox::complete),
///   [`fail`](Outbox::fail) and [`release`](Outbox::release) change a row
///   only while the caller's token still owns it, and say whether they did;
/// * [`rescue`](Outbox::rescue) re-queues each row whose lease ran out
///   once, however many rescuers run at once.
///
/// Clones share the pool and the [metrics](Outbox::metrics).
#[derive(Clone, Debug)]
pub struct Outbox {
    pub(crate) backend: Backend,
    metrics: std::sync::Arc<OutboxMetrics>,
}

impl Outbox {
    /// The PostgreSQL migrations (`migrations/outbox/`). They share the
    /// `_sqlx_migrations` table with the store's and the application's own
    /// and tolerate both.
    #[cfg(feature = "postgres")]
    pub const POSTGRES_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
        ignore_missing: true,
        ..sqlx::migrate!("./migrations/outbox")
    };

    /// The SQLite migrations (`migrations/sqlite/outbox/`).
    #[cfg(feature = "sqlite")]
    pub const SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
        ignore_missing: true,
        ..sqlx::migrate!("./migrations/sqlite/outbox")
    };

    /// The outbox on a PostgreSQL pool. The table is found through the
    /// connections' `search_path`. Nothing is migrated.
    #[cfg(feature = "postgres")]
    pub fn postgres(pool: sqlx::PgPool) -> Self {
        Self::with_backend(Backend::Postgres(pool))
    }

    /// The outbox on an SQLite pool (open it with
    /// [`SqliteStore::connect_with`](crate::SqliteStore::connect_with)'s
    /// settings: WAL, a busy timeout). Nothing is migrated.
    #[cfg(feature = "sqlite")]
    pub fn sqlite(pool: sqlx::SqlitePool) -> Self {
        Self::with_backend(Backend::Sqlite(pool))
    }

    fn with_backend(backend: Backend) -> Self {
        Outbox {
            backend,
            metrics: Default::default(),
        }
    }

    /// Connects to `url` — `postgres://…`, or an SQLite path or
    /// `sqlite://` URL — with the same pool settings as the matching store,
    /// and applies the migrations.
    pub async fn connect(url: &str) -> Result<Self, OutboxError> {
        let outbox = if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            #[cfg(feature = "postgres")]
            {
                let pool = crate::PostgresStore::pool_options().connect(url).await?;
                Self::postgres(pool)
            }
            #[cfg(not(feature = "postgres"))]
            return Err(OutboxError::Invalid("built without the `postgres` feature"));
        } else {
            #[cfg(feature = "sqlite")]
            {
                use std::str::FromStr;
                let options = if url.starts_with("sqlite:") {
                    sqlx::sqlite::SqliteConnectOptions::from_str(url)?
                } else {
                    sqlx::sqlite::SqliteConnectOptions::new().filename(url)
                };
                // The store's settings: created if missing, WAL, every
                // commit synced, a busy timeout for concurrent writers.
                let options = options
                    .create_if_missing(true)
                    .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                    .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
                    .busy_timeout(crate::SqliteStore::BUSY_TIMEOUT);
                let pool = sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(crate::SqliteStore::BUSY_TIMEOUT)
                    .connect_with(options)
                    .await?;
                Self::sqlite(pool)
            }
            #[cfg(not(feature = "sqlite"))]
            return Err(OutboxError::Invalid("built without the `sqlite` feature"));
        };
        outbox.migrate().await?;
        Ok(outbox)
    }

    /// Opens the outbox in an existing SQLite file as it is, for a tool
    /// that reads or mends rows (an operator's command): nothing is
    /// created, nothing migrated, and the file keeps its journal mode
    /// ([`Outbox::connect`] makes it WAL, the store's setting, for good).
    /// `None` when the file holds no outbox table.
    #[cfg(feature = "sqlite")]
    pub async fn open_existing_sqlite(url: &str) -> Result<Option<Self>, OutboxError> {
        use std::str::FromStr;
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)?
            .create_if_missing(false)
            .busy_timeout(crate::SqliteStore::BUSY_TIMEOUT);
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(crate::SqliteStore::BUSY_TIMEOUT)
            .connect_with(options)
            .await?;
        let table: Option<i64> = sqlx::query_scalar(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'outbox_messages'",
        )
        .fetch_optional(&pool)
        .await?;
        Ok(table.map(|_| Self::sqlite(pool)))
    }

    /// Creates or upgrades the table; safe on every start and from several
    /// processes at once.
    pub async fn migrate(&self) -> Result<(), OutboxError> {
        match &self.backend {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pool) => Self::POSTGRES_MIGRATOR.run(pool).await,
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(pool) => Self::SQLITE_MIGRATOR.run(pool).await,
        }
        .map_err(OutboxError::Migrate)
    }

    /// The counters of this outbox and its workers.
    pub fn metrics(&self) -> &OutboxMetrics {
        &self.metrics
    }

    /// Enqueues `message` on its own (outside any transaction of the
    /// caller). See [`enqueue`](super::enqueue) to write it with a business
    /// row.
    pub async fn enqueue(&self, message: &Message) -> Result<bool, OutboxError> {
        message.validate()?;
        let added = match &self.backend {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pool) => pool.acquire().await?.enqueue_message(message).await?,
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(pool) => pool.acquire().await?.enqueue_message(message).await?,
        };
        if added {
            self.metrics.enqueued.inc();
        }
        Ok(added)
    }

    /// Claims up to `limit` due rows (`available`, or `retryable` whose
    /// time has come), oldest due first, optionally only of `topics`: each
    /// becomes `running` under a fresh owner token with a lease of `lease`,
    /// and its attempt count goes up by one. Rows held by a concurrent
    /// claimer are skipped, never waited for or handed out twice.
    ///
    /// A claimed row that cannot be read back (stored by plain SQL with a
    /// value of the wrong type) is marked `dead` at once, not delivered,
    /// and counted in [`OutboxMetrics::unreadable`](super::OutboxMetrics::unreadable).
    pub async fn claim(
        &self,
        limit: usize,
        lease: Duration,
        topics: Option<&[String]>,
    ) -> Result<Vec<Delivery>, OutboxError> {
        Ok(self.claim_rows(limit, lease, topics).await?.0)
    }

    /// [`claim`](Self::claim), and how many rows the statement claimed
    /// (the unreadable ones too): fewer than `limit` means none more was
    /// due.
    pub(super) async fn claim_rows(
        &self,
        limit: usize,
        lease: Duration,
        topics: Option<&[String]>,
    ) -> Result<(Vec<Delivery>, usize), OutboxError> {
        if limit == 0 {
            return Ok((Vec::new(), 0));
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let started = std::time::Instant::now();
        let rows: Vec<ClaimRow> = with_backend!(self, |pool, sql| {
            sqlx::query_as(sql::CLAIM)
                .bind(limit)
                .bind(sql::topics(topics))
                .bind(micros(lease))
                .fetch_all(pool)
                .await?
        });
        self.metrics.claim_latency.observe(started.elapsed());
        // Each row is read on its own: one that cannot be (text that is not
        // UTF-8, a count that is not a 32-bit integer, stored by plain SQL
        // on SQLite, which enforces no column type) goes `dead` at once
        // with its reason, and the rows claimed with it are delivered (read
        // as a batch, they were stranded with it, lease after lease, until
        // `dead` unsent).
        let (mut deliveries, claimed) = (Vec::with_capacity(rows.len()), rows.len());
        for row in rows {
            let (id, owner) = (row.id, row.owner.clone());
            match row.into_delivery() {
                Ok(delivery) => deliveries.push(delivery),
                // A burial that fails leaves the row to its lease (the
                // rescuer re-queues it, a later claim buries it): the rows
                // read beside it are delivered all the same.
                Err(error) => {
                    if let Err(failed) = self.bury(id, &owner, &error).await {
                        tracing::warn!(id, error = %failed, "outbox: could not mark an unreadable row dead");
                    }
                }
            }
        }
        self.metrics.claimed.add(deliveries.len() as u64);
        Ok((deliveries, claimed))
    }

    /// Marks a claimed row that could not be read back `dead`, with why.
    async fn bury(&self, id: i64, owner: &[u8], error: &OutboxError) -> Result<(), OutboxError> {
        tracing::error!(id, %error, "outbox row cannot be read back: marking it dead, not sent");
        let message = error.to_string();
        let buried = with_backend!(self, |pool, sql| {
            sqlx::query(sql::BURY)
                .bind(id)
                .bind(owner)
                .bind(note(&message))
                .execute(pool)
                .await?
                .rows_affected()
        });
        if buried == 1 {
            self.metrics.unreadable.inc();
        }
        Ok(())
    }

    /// Extends the lease of a row `delivery`'s worker still owns to `lease`
    /// from now; `false` when it no longer owns it.
    pub async fn renew(&self, delivery: &Delivery, lease: Duration) -> Result<bool, OutboxError> {
        let done = with_backend!(self, |pool, sql| {
            sqlx::query(sql::RENEW)
                .bind(delivery.id)
                .bind(&delivery.owner[..])
                .bind(micros(lease))
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(done == 1)
    }

    /// Marks the row delivered, recording the receiver's status and request
    /// id; `false` (and nothing written) when `delivery`'s worker no longer
    /// owns it.
    pub async fn complete(
        &self,
        delivery: &Delivery,
        status: Option<u16>,
        request_id: Option<&str>,
    ) -> Result<bool, OutboxError> {
        let done = with_backend!(self, |pool, sql| {
            sqlx::query(sql::COMPLETE)
                .bind(delivery.id)
                .bind(&delivery.owner[..])
                .bind(status.map(i32::from))
                .bind(request_id.map(note))
                .execute(pool)
                .await?
                .rows_affected()
        });
        if done == 1 {
            self.metrics.delivered.inc();
        } else {
            self.metrics.lost_leases.inc();
        }
        Ok(done == 1)
    }

    /// Records a failed attempt: the row goes to `dead` when the error is
    /// permanent or this was its last allowed attempt, else to `retryable`,
    /// due `delay` from now (the database's now). Returns the new state, or
    /// `None` (and nothing written) when `delivery`'s worker no longer owns
    /// the row.
    pub async fn fail(
        &self,
        delivery: &Delivery,
        error: &DeliveryError,
        delay: Duration,
    ) -> Result<Option<State>, OutboxError> {
        let state: Option<String> = with_backend!(self, |pool, sql| {
            sqlx::query_scalar(sql::FAIL)
                .bind(delivery.id)
                .bind(&delivery.owner[..])
                .bind(error.class.is_permanent())
                .bind(micros(delay))
                .bind(error.class.as_str())
                .bind(error.status.map(i32::from))
                .bind(error.request_id.as_deref().map(note))
                .bind(note(&error.reason))
                .fetch_optional(pool)
                .await?
        });
        let state = state.as_deref().map(State::parse).transpose()?;
        match state {
            Some(State::Dead) => self.metrics.dead.inc(),
            Some(_) => self.metrics.retried.inc(),
            None => self.metrics.lost_leases.inc(),
        }
        Ok(state)
    }

    /// Gives a row back without counting against it beyond the attempt
    /// already started: `retryable`, due now (graceful shutdown). `false`
    /// when `delivery`'s worker no longer owns it.
    pub async fn release(&self, delivery: &Delivery) -> Result<bool, OutboxError> {
        let done = with_backend!(self, |pool, sql| {
            sqlx::query(sql::RELEASE)
                .bind(delivery.id)
                .bind(&delivery.owner[..])
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(done == 1)
    }

    /// Re-queues up to `limit` rows whose lease ran out (their worker died
    /// or stalled): `retryable` and due now, or `dead` when that was their
    /// last allowed attempt; error class `lease_expired`. Returns their ids.
    /// Rescuers running at once re-queue each row once.
    pub async fn rescue(&self, limit: usize) -> Result<Vec<i64>, OutboxError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<(i64, bool)> = with_backend!(self, |pool, sql| {
            sqlx::query_as(sql::RESCUE)
                .bind(limit)
                .fetch_all(pool)
                .await?
        });
        self.metrics.rescued.add(rows.len() as u64);
        // A row on its last attempt goes dead here: counted as every dead
        // row is, so an alert on `outbox_dead_total` sees it.
        let dead = rows.iter().filter(|(_, dead)| *dead).count();
        self.metrics.dead.add(dead as u64);
        Ok(rows.into_iter().map(|(id, _)| id).collect())
    }

    /// Deletes up to `limit` rows delivered more than `older_than` ago,
    /// oldest first; returns how many. Dead rows are never swept.
    pub async fn sweep(&self, older_than: Duration, limit: usize) -> Result<u64, OutboxError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Ok(with_backend!(self, |pool, sql| {
            sqlx::query(sql::SWEEP)
                .bind(micros(older_than))
                .bind(limit)
                .execute(pool)
                .await?
                .rows_affected()
        }))
    }

    /// Puts a dead row back in the queue with a fresh attempt budget (the
    /// attempt count starts again at 0; the last error is kept until the
    /// next attempt). `false` when `id` is not a dead row.
    pub async fn retry_dead(&self, id: i64) -> Result<bool, OutboxError> {
        let done = with_backend!(self, |pool, sql| {
            sqlx::query(sql::RETRY_DEAD)
                .bind(id)
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(done == 1)
    }

    /// Deletes a dead row. `false` when `id` is not a dead row.
    pub async fn purge_dead(&self, id: i64) -> Result<bool, OutboxError> {
        let done = with_backend!(self, |pool, sql| {
            sqlx::query(sql::PURGE_DEAD)
                .bind(id)
                .execute(pool)
                .await?
                .rows_affected()
        });
        Ok(done == 1)
    }

    /// Deletes the dead rows last changed more than `older_than` ago
    /// (`Duration::ZERO`: every dead row), only of `topic` when given;
    /// returns how many. Rows in any other state are never touched.
    pub async fn purge_dead_older_than(
        &self,
        topic: Option<&str>,
        older_than: Duration,
    ) -> Result<u64, OutboxError> {
        Ok(with_backend!(self, |pool, sql| {
            sqlx::query(sql::PURGE_DEAD_OLDER)
                .bind(topic)
                .bind(micros(older_than))
                .execute(pool)
                .await?
                .rows_affected()
        }))
    }

    /// The payload and content type of row `id`, for an operator looking
    /// at a dead row; `None` when there is no such row.
    pub async fn payload(&self, id: i64) -> Result<Option<(Vec<u8>, String)>, OutboxError> {
        Ok(with_backend!(self, |pool, sql| {
            sqlx::query_as(sql::PAYLOAD)
                .bind(id)
                .fetch_optional(pool)
                .await?
        }))
    }

    /// How many rows are in each state.
    pub async fn counts(&self) -> Result<Counts, OutboxError> {
        let rows: Vec<(String, i64)> = with_backend!(self, |pool, sql| {
            sqlx::query_as(sql::COUNTS).fetch_all(pool).await?
        });
        let mut counts = Counts::default();
        for (state, count) in rows {
            let count = u64::try_from(count).unwrap_or(0);
            match State::parse(&state)? {
                State::Available => counts.available = count,
                State::Running => counts.running = count,
                State::Retryable => counts.retryable = count,
                State::Completed => counts.completed = count,
                State::Dead => counts.dead = count,
            }
        }
        Ok(counts)
    }

    /// Up to `limit` dead rows, oldest id first.
    pub async fn dead(&self, limit: usize) -> Result<Vec<DeadMessage>, OutboxError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<StatusRow> = with_backend!(self, |pool, sql| {
            sqlx::query_as(sql::DEAD)
                .bind(limit)
                .fetch_all(pool)
                .await?
        });
        rows.into_iter().map(StatusRow::into_status).collect()
    }

    /// The row for (`topic`, `source`), if there is one.
    pub async fn status(
        &self,
        topic: &str,
        source: &str,
    ) -> Result<Option<MessageStatus>, OutboxError> {
        let row: Option<StatusRow> = with_backend!(self, |pool, sql| {
            sqlx::query_as(sql::STATUS)
                .bind(topic)
                .bind(source)
                .fetch_optional(pool)
                .await?
        });
        row.map(StatusRow::into_status).transpose()
    }
}

/// A duration as bound to the queries: whole microseconds, saturating.
pub(crate) fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

/// At most [`MAX_NOTE`] bytes of `text`, cut at a character boundary.
fn note(text: &str) -> &str {
    if text.len() <= MAX_NOTE {
        return text;
    }
    let mut end = MAX_NOTE;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn time(micros: i64) -> SystemTime {
    if micros >= 0 {
        UNIX_EPOCH + Duration::from_micros(micros as u64)
    } else {
        UNIX_EPOCH - Duration::from_micros(micros.unsigned_abs())
    }
}

fn count(value: i32, what: &str) -> Result<u32, OutboxError> {
    u32::try_from(value).map_err(|_| OutboxError::Corrupt(format!("{what} {value}")))
}

/// A count as a listing shows it: clamped into `u32`.
fn lenient(value: i64) -> u32 {
    u32::try_from(value.max(0)).unwrap_or(u32::MAX)
}

/// A claimed row as both dialects return it.
///
/// Text comes as bytes and counts as 64-bit integers, so that a row the
/// worker cannot use fails on its own ([`ClaimRow::into_delivery`]), not
/// the whole claim.
#[derive(sqlx::FromRow)]
struct ClaimRow {
    id: i64,
    owner: Vec<u8>,
    topic: Vec<u8>,
    source: Vec<u8>,
    delivery_key: Vec<u8>,
    payload: Vec<u8>,
    content_type: Vec<u8>,
    attempt: i64,
    max_attempts: i64,
}

impl ClaimRow {
    fn into_delivery(self) -> Result<Delivery, OutboxError> {
        let owner = <[u8; 16]>::try_from(self.owner.as_slice())
            .map_err(|_| OutboxError::Corrupt("owner token".to_owned()))?;
        let text = |bytes: Vec<u8>, what: &str| {
            String::from_utf8(bytes)
                .map_err(|_| OutboxError::Corrupt(format!("{what} is not UTF-8")))
        };
        let wide = |value: i64, what: &str| {
            i32::try_from(value)
                .map_err(|_| OutboxError::Corrupt(format!("{what} {value}")))
                .and_then(|value| count(value, what))
        };
        Ok(Delivery {
            id: self.id,
            owner,
            attempt: wide(self.attempt, "attempt")?,
            max_attempts: wide(self.max_attempts, "max_attempts")?,
            topic: text(self.topic, "topic")?,
            source: text(self.source, "source")?,
            delivery_key: text(self.delivery_key, "delivery_key")?,
            payload: Bytes::from(self.payload),
            content_type: text(self.content_type, "content_type")?,
        })
    }
}

/// A row without its payload, as both dialects select it. Text comes as
/// bytes and counts as 64-bit integers, read leniently: a row a worker
/// could not use (see [`ClaimRow`]) is still listed, so it can be seen and
/// purged.
#[derive(sqlx::FromRow)]
struct StatusRow {
    id: i64,
    topic: Vec<u8>,
    source: Vec<u8>,
    delivery_key: Vec<u8>,
    state: String,
    attempt: i64,
    max_attempts: i64,
    last_error_class: Option<String>,
    last_status: Option<i32>,
    last_request_id: Option<String>,
    last_error: Option<String>,
    next_attempt_us: i64,
    updated_us: i64,
    completed_us: Option<i64>,
}

impl StatusRow {
    fn into_status(self) -> Result<MessageStatus, OutboxError> {
        Ok(MessageStatus {
            id: self.id,
            state: State::parse(&self.state)?,
            attempt: lenient(self.attempt),
            max_attempts: lenient(self.max_attempts),
            topic: String::from_utf8_lossy(&self.topic).into_owned(),
            source: String::from_utf8_lossy(&self.source).into_owned(),
            delivery_key: String::from_utf8_lossy(&self.delivery_key).into_owned(),
            last_error_class: self.last_error_class,
            last_status: self.last_status.and_then(|s| u16::try_from(s).ok()),
            last_request_id: self.last_request_id,
            last_error: self.last_error,
            next_attempt_at: time(self.next_attempt_us),
            updated_at: time(self.updated_us),
            completed_at: self.completed_us.map(time),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_at_a_character_boundary() {
        assert_eq!(note("short"), "short");
        let long = "é".repeat(150); // 300 bytes
        let cut = note(&long);
        assert!(cut.len() <= MAX_NOTE);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
