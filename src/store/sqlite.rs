//! The SQLite store: durable records on one node, nothing to install.

use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

use super::sql::{self, micros, store_error, OutcomeColumns, RecordRow};
use super::{Claim, Fingerprint, Outcome, OwnerToken, Record, ScopeKey, Store, StoreError};

// `?4` is always "now" in microseconds since the Unix epoch.

/// The same single-statement upsert as the PostgreSQL store (see there).
const RESERVE: &str = "
INSERT INTO idempotency_records AS r
    (key, fingerprint, owner, state, lease_expires_at, expires_at, created_at)
VALUES (?1, ?2, ?3, 'in_flight', ?4 + ?5, ?4 + ?6, ?4)
ON CONFLICT (key) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    owner = excluded.owner,
    state = 'in_flight',
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    status = NULL,
    headers = NULL,
    body = NULL,
    created_at = CASE WHEN r.expires_at <= ?4 THEN ?4 ELSE r.created_at END
WHERE r.expires_at <= ?4
   OR (r.state = 'in_flight' AND r.lease_expires_at <= ?4
       AND r.fingerprint = excluded.fingerprint)
RETURNING created_at < ?4 AS takeover";

const SELECT_LIVE: &str = "
SELECT fingerprint, state, status, headers, body,
       max(lease_expires_at - ?2, 0) AS lease_remaining_us
FROM idempotency_records
WHERE key = ?1 AND expires_at > ?2";

const COMPLETE: &str = "
UPDATE idempotency_records
SET state = ?3, owner = NULL, lease_expires_at = NULL,
    status = ?4, headers = ?5, body = ?6, expires_at = ?7 + ?8
WHERE key = ?1 AND owner = ?2 AND state = 'in_flight'";

const RELEASE: &str = "
DELETE FROM idempotency_records
WHERE key = ?1 AND owner = ?2 AND state = 'in_flight'";

/// A renewed reservation never expires (nor is swept) under its owner.
const RENEW: &str = "
UPDATE idempotency_records
SET lease_expires_at = ?3 + ?4, expires_at = max(expires_at, ?3 + ?4)
WHERE key = ?1 AND owner = ?2 AND state = 'in_flight'";

const SWEEP: &str = "
DELETE FROM idempotency_records
WHERE key IN (SELECT key FROM idempotency_records
              WHERE expires_at <= ?2
              ORDER BY expires_at
              LIMIT ?1)";

/// Keeps records in one SQLite file (WAL mode), so a single node keeps its
/// guarantee across restarts. The proxy's default store.
///
/// * Every reservation, completion, release and renewal is one statement,
///   and SQLite runs write statements one at a time, so the pool's
///   connections (and other processes opening the same file) never see a
///   half-made decision. A writer waits up to
///   [`BUSY_TIMEOUT`](SqliteStore::BUSY_TIMEOUT) for the file lock.
/// * Time is the node's system clock, read once per statement (SQLite has
///   no other clock; every process on the node shares it).
/// * Every commit is synced to disk (`synchronous = FULL`): a record the
///   engine was told is stored survives a crash or power loss.
/// * Waiters poll with the default bounded backoff.
///
/// Clones share the pool.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// The schema migrations (`migrations/sqlite/*.sql`), for teams that
    /// apply them separately.
    pub const MIGRATOR: Migrator = Migrator {
        ignore_missing: true,
        ..sqlx::migrate!("./migrations/sqlite")
    };

    /// How long a writer waits for another connection's write to finish
    /// before the store reports [`StoreError::Unavailable`].
    pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

    /// Opens (creating it if missing) the database at `path_or_url` — a file
    /// path such as `idempotency.db`, or a `sqlite://` URL — and applies the
    /// migrations.
    pub async fn connect(path_or_url: &str) -> Result<Self, StoreError> {
        let options = if path_or_url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(path_or_url).map_err(store_error)?
        } else {
            SqliteConnectOptions::new().filename(path_or_url)
        };
        let store = Self::connect_with(options).await?;
        store.migrate().await?;
        Ok(store)
    }

    /// Opens the database described by `options` with the settings this
    /// store relies on (created if missing, WAL, busy timeout, full sync).
    /// Nothing is migrated: call [`migrate`](SqliteStore::migrate) or apply
    /// [`MIGRATOR`](SqliteStore::MIGRATOR) yourself.
    pub async fn connect_with(options: SqliteConnectOptions) -> Result<Self, StoreError> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
            .busy_timeout(Self::BUSY_TIMEOUT);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Self::BUSY_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(store_error)?;
        Ok(SqliteStore { pool })
    }

    /// Creates or upgrades the table; safe on every start.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        Self::MIGRATOR
            .run(&self.pool)
            .await
            .map_err(sql::migrate_error)
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Closes the database (waiting for running statements); later calls
    /// fail with [`StoreError::Unavailable`].
    pub async fn close(&self) {
        self.pool.close().await;
    }

    async fn select_live(&self, key: &ScopeKey) -> Result<Option<RecordRow>, sqlx::Error> {
        sqlx::query_as(SELECT_LIVE)
            .bind(key.as_bytes().as_slice())
            .bind(now())
            .fetch_optional(&self.pool)
            .await
    }
}

/// Microseconds since the Unix epoch by the system clock.
fn now() -> i64 {
    micros(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default(),
    )
}

#[async_trait]
impl Store for SqliteStore {
    async fn reserve(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Claim, StoreError> {
        sql::reserve(
            |owner| async move {
                sqlx::query_scalar::<_, bool>(RESERVE)
                    .bind(key.as_bytes().as_slice())
                    .bind(fingerprint.as_bytes().as_slice())
                    .bind(owner.as_bytes().as_slice())
                    .bind(now())
                    .bind(micros(lease))
                    .bind(micros(ttl))
                    .fetch_optional(&self.pool)
                    .await
            },
            || self.select_live(key),
        )
        .await
    }

    async fn complete(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        outcome: &Outcome,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let columns = OutcomeColumns::from(outcome);
        let done = sqlx::query(COMPLETE)
            .bind(key.as_bytes().as_slice())
            .bind(owner.as_bytes().as_slice())
            .bind(columns.state)
            .bind(columns.status)
            .bind(columns.headers)
            .bind(columns.body)
            .bind(now())
            .bind(micros(ttl))
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, key: &ScopeKey, owner: &OwnerToken) -> Result<bool, StoreError> {
        let done = sqlx::query(RELEASE)
            .bind(key.as_bytes().as_slice())
            .bind(owner.as_bytes().as_slice())
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        &self,
        key: &ScopeKey,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(RENEW)
            .bind(key.as_bytes().as_slice())
            .bind(owner.as_bytes().as_slice())
            .bind(now())
            .bind(micros(lease))
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn get(&self, key: &ScopeKey) -> Result<Option<Record>, StoreError> {
        self.select_live(key)
            .await
            .map_err(store_error)?
            .map(RecordRow::into_record)
            .transpose()
    }

    async fn sweep(&self, batch: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(SWEEP)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .bind(now())
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(done.rows_affected())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(store_error)?;
        Ok(())
    }
}
