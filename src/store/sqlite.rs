//! The SQLite store: durable records on one node, nothing to install.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

use super::sql::{self, store_error};
use super::sqlite_writer::{self, Writer};
use super::StoreError;

// Time is SQLite's own clock, `unixepoch('subsec')`: seconds since the Unix
// epoch with millisecond precision, the same value throughout a statement.
// Durations are bound in microseconds, as for PostgreSQL.

/// As for PostgreSQL (see there).
const INSERT: &str = "
INSERT INTO idempotency_records
    (key, fingerprint, owner, state, lease_expires_at, expires_at, created_at, principal)
VALUES (?1, ?2, ?3, 'in_flight',
        unixepoch('subsec') + ?4 / 1e6,
        unixepoch('subsec') + ?5 / 1e6,
        unixepoch('subsec'),
        ?6)
ON CONFLICT (key) DO NOTHING
RETURNING false AS takeover";

/// As for PostgreSQL (see there).
const TAKE_OVER: &str = "
UPDATE idempotency_records AS r
SET fingerprint = ?2,
    owner = ?3,
    state = 'in_flight',
    lease_expires_at = unixepoch('subsec') + ?4 / 1e6,
    expires_at = unixepoch('subsec') + ?5 / 1e6,
    status = NULL,
    headers = NULL,
    body = NULL,
    principal = ?6,
    created_at = CASE WHEN r.expires_at <= unixepoch('subsec')
                      THEN unixepoch('subsec') ELSE r.created_at END
WHERE key = ?1
  AND (r.expires_at <= unixepoch('subsec')
       OR (r.state = 'in_flight' AND r.lease_expires_at <= unixepoch('subsec')
           AND r.fingerprint = ?2))
RETURNING created_at < unixepoch('subsec') AS takeover";

const SELECT_LIVE: &str = "
SELECT fingerprint, state, status, headers, body,
       CAST(max(lease_expires_at - unixepoch('subsec'), 0) * 1e6 AS INTEGER)
           AS lease_remaining_us
FROM idempotency_records
WHERE key = ?1 AND expires_at > unixepoch('subsec')";

const COMPLETE: &str = "
UPDATE idempotency_records
SET state = ?3, owner = NULL, lease_expires_at = NULL,
    status = ?4, headers = ?5, body = ?6,
    expires_at = unixepoch('subsec') + ?7 / 1e6
WHERE key = ?1 AND owner = ?2 AND state = 'in_flight'";

const RELEASE: &str = "
DELETE FROM idempotency_records
WHERE key = ?1 AND owner = ?2 AND state = 'in_flight'";

/// A renewed reservation never expires (nor is swept) under its owner.
const RENEW: &str = "
UPDATE idempotency_records
SET lease_expires_at = unixepoch('subsec') + ?3 / 1e6,
    expires_at = max(expires_at, unixepoch('subsec') + ?3 / 1e6)
WHERE key = ?1 AND owner = ?2 AND state = 'in_flight'";

const SWEEP: &str = "
DELETE FROM idempotency_records
WHERE key IN (SELECT key FROM idempotency_records
              WHERE expires_at <= unixepoch('subsec')
              ORDER BY expires_at
              LIMIT ?1)";

/// The id kept in the file (see the migration).
const IDENTITY: &str = "SELECT id FROM idempotency_store";

/// The health check's write: the store's own row, unchanged.
const WRITABLE: &str = "UPDATE idempotency_store SET id = id";

/// What an operator sees of a record (never its body); `FROM` follows.
macro_rules! info_columns {
    () => {
        "SELECT key, fingerprint, state, status,
       CASE WHEN state = 'too_large' THEN headers END AS marker,
       length(body) AS body_bytes,
       length(headers) AS header_bytes,
       CAST((unixepoch('subsec') - created_at) * 1e6 AS INTEGER) AS age_us,
       CAST(max(expires_at - unixepoch('subsec'), 0) * 1e6 AS INTEGER) AS expires_in_us,
       CAST(max(lease_expires_at - unixepoch('subsec'), 0) * 1e6 AS INTEGER)
           AS lease_remaining_us,
       principal IS NOT NULL AS has_principal,
       owner
FROM idempotency_records"
    };
}

const INSPECT: &str = concat!(
    info_columns!(),
    " WHERE key = ?1 AND expires_at > unixepoch('subsec')"
);

const PURGE: &str = "DELETE FROM idempotency_records WHERE key = ?1";

const PRINCIPAL_KEYS: &str = "SELECT key FROM idempotency_records WHERE principal = ?1 LIMIT ?2";

/// Through the partial index on `principal`, in batches of `?2`.
const PURGE_PRINCIPAL: &str = "
DELETE FROM idempotency_records
WHERE key IN (SELECT key FROM idempotency_records WHERE principal = ?1 LIMIT ?2)
RETURNING key";

const FORCE_RELEASE: &str =
    "DELETE FROM idempotency_records WHERE key = ?1 AND state = 'in_flight'";

/// Through the partial index on in-flight rows' `created_at`.
const IN_FLIGHT_OLDER_THAN: &str = concat!(
    info_columns!(),
    " WHERE state = 'in_flight' AND expires_at > unixepoch('subsec')
  AND created_at <= unixepoch('subsec') - ?1 / 1e6
ORDER BY created_at
LIMIT ?2"
);

const COUNTS: &str = "
SELECT count(*) FILTER (WHERE expires_at > unixepoch('subsec') AND state = 'in_flight'
                          AND lease_expires_at > unixepoch('subsec')) AS in_flight,
       count(*) FILTER (WHERE expires_at > unixepoch('subsec') AND state = 'in_flight'
                          AND lease_expires_at <= unixepoch('subsec')) AS lease_expired,
       count(*) FILTER (WHERE expires_at > unixepoch('subsec') AND state = 'completed')
           AS completed,
       count(*) FILTER (WHERE expires_at > unixepoch('subsec') AND state = 'too_large'
                          AND headers IS NULL) AS too_large,
       count(*) FILTER (WHERE expires_at > unixepoch('subsec') AND state = 'too_large'
                          AND headers IS NOT NULL) AS incomplete,
       count(*) FILTER (WHERE expires_at <= unixepoch('subsec')) AS expired
FROM idempotency_records";

/// Keeps records in one SQLite file (WAL mode), so a single node keeps its
/// guarantee across restarts. The proxy's default store.
///
/// * Every write (insert, takeover, completion, release, renewal) is one
///   statement, run by the store's one writer connection, so the pool's
///   connections (and other processes on the same host opening the same
///   file on a local file system; never a file shared across hosts, as on
///   NFS) never see a half-made decision. The writer waits up to
///   [`BUSY_TIMEOUT`](SqliteStore::BUSY_TIMEOUT) for the file lock.
/// * **Group commit**: the writes of concurrent callers are run one after
///   another in one transaction (at most
///   [`MAX_BATCH`](SqliteStore::MAX_BATCH)), and each caller is answered
///   only once that transaction is on disk; a statement SQLite refuses by
///   itself (a constraint, a value over its limits) fails alone, and any
///   other failed statement or commit rolls the whole transaction back
///   and fails every write in it. Each
///   write's outcome is the one it would have had alone in that order; one
///   disk sync serves many requests.
/// * Time is SQLite's own clock (`unixepoch('subsec')`, millisecond
///   precision), the same value throughout a statement.
/// * Every commit is synced to disk (`synchronous = FULL`): a record the
///   engine was told is stored survives a crash or power loss.
/// * Waiters poll with the default bounded backoff.
///
/// Clones share the pool.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    /// Reads, migrations, sweeps.
    pool: SqlitePool,
    /// The record writes, grouped into transactions.
    writer: Writer,
    /// The store's id, read once.
    id: Arc<OnceLock<String>>,
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

    /// The most writes one group commit holds.
    pub const MAX_BATCH: usize = sqlite_writer::MAX_BATCH;

    /// The file [`connect`](Self::connect) opens for `path_or_url`, read as
    /// it reads it (an `sqlite:` URL percent-decoded, its options apart);
    /// `None` for an in-memory database or a malformed URL.
    pub fn file_of(path_or_url: &str) -> Option<std::path::PathBuf> {
        let options = Self::options_of(path_or_url).ok()?;
        let path = options.get_filename();
        let name = path.to_string_lossy();
        // sqlx names an in-memory database `file:sqlx-in-memory-N`.
        let memory = name.is_empty()
            || name.contains(":memory:")
            || name.starts_with("file:sqlx-in-memory")
            || path_or_url.contains("mode=memory");
        (!memory).then(|| path.to_owned())
    }

    fn options_of(path_or_url: &str) -> Result<SqliteConnectOptions, sqlx::Error> {
        Ok(if path_or_url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(path_or_url)?
        } else {
            SqliteConnectOptions::new().filename(path_or_url)
        })
    }

    /// Opens (creating it if missing) the database at `path_or_url` — a file
    /// path such as `idempotency.db`, or a `sqlite://` URL — and applies the
    /// migrations.
    pub async fn connect(path_or_url: &str) -> Result<Self, StoreError> {
        let options = Self::options_of(path_or_url).map_err(store_error)?;
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
            .connect_with(options.clone())
            .await
            .map_err(store_error)?;
        let writer = Writer::open(&options).await.map_err(store_error)?;
        Ok(SqliteStore {
            pool,
            writer,
            id: Arc::default(),
        })
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
        self.writer.close().await;
        self.pool.close().await;
    }

    /// A connection for a read or an admin statement: the pool's, beside
    /// the writer.
    async fn lease(&self) -> Result<sql::PoolLease<'_, sqlx::Sqlite>, sqlx::Error> {
        Ok(sql::PoolLease(&self.pool))
    }

    /// Whether writes go through: a write through the writer (whose thread
    /// a read through the pool would not check), committed as a
    /// reservation is. A `SELECT 1` passed on a full disk, a read-only
    /// file or one another process held locked, while every reservation
    /// failed.
    async fn writable(&self) -> Result<(), sqlx::Error> {
        self.writer.execute(sqlx::query(WRITABLE)).await.map(drop)
    }

    /// A record write that returns whether it wrote: in the next group
    /// commit, answered once it is on disk.
    async fn write_scalar(
        &self,
        query: sqlite_writer::Scalar,
    ) -> Result<Option<bool>, sqlx::Error> {
        self.writer.fetch(query).await
    }

    /// A record write answered with its count of changed rows: in the next
    /// group commit, answered once it is on disk.
    async fn write_execute(&self, statement: sqlite_writer::Statement) -> Result<u64, sqlx::Error> {
        self.writer.execute(statement).await
    }

    /// A release: a record write like the others (one writer serves all).
    async fn write_release(&self, statement: sqlite_writer::Statement) -> Result<u64, sqlx::Error> {
        self.writer.execute(statement).await
    }
}

super::sql::sql_store!(
    SqliteStore,
    sql::Statements {
        insert: INSERT,
        take_over: TAKE_OVER,
        select_live: SELECT_LIVE,
        complete: COMPLETE,
        release: RELEASE,
        renew: RENEW,
        sweep: SWEEP,
        identity: IDENTITY,
    }
);

super::sql::sql_admin!(
    SqliteStore,
    sql::AdminStatements {
        inspect: INSPECT,
        purge: PURGE,
        principal_keys: PRINCIPAL_KEYS,
        purge_principal: PURGE_PRINCIPAL,
        force_release: FORCE_RELEASE,
        in_flight_older_than: IN_FLIGHT_OLDER_THAN,
        counts: COUNTS,
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    /// A health check that read through the pool stayed green with the
    /// writer gone, while every write failed: the ping goes through the
    /// writer.
    #[tokio::test]
    async fn the_health_check_fails_when_the_writer_is_gone() {
        let path = std::env::temp_dir().join(format!(
            "ti_ping_{}_{}.db",
            std::process::id(),
            rand::random::<u64>()
        ));
        let store = SqliteStore::connect(path.to_str().unwrap()).await.unwrap();
        assert!(store.ping().await.is_ok());
        store.writer.close().await;
        assert!(
            store.ping().await.is_err(),
            "healthy without a writer: every write fails"
        );
        store.close().await;
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
}
