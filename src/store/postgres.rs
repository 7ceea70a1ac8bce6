//! The PostgreSQL store: the source of truth when several instances share
//! the work.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgArguments, PgPool, PgPoolOptions, Postgres};
use sqlx::query::{Query, QueryAs, QueryScalar};

use super::sql::{self, store_error};
use super::StoreError;

mod connections;

use connections::{Connections, Lane};

/// A new record. Conflicts are skipped without locking the existing row.
const INSERT: &str = "
INSERT INTO idempotency_records
    (key, fingerprint, owner, state, lease_expires_at, expires_at, principal)
VALUES ($1, $2, $3, 'in_flight',
        now() + $4::bigint * interval '1 microsecond',
        now() + $5::bigint * interval '1 microsecond',
        $6)
ON CONFLICT (key) DO NOTHING
RETURNING false AS takeover";

/// A reservation's first (and usually only) statement: the key's row as
/// the statement's snapshot holds it, or — only when that holds none — a
/// new record (`ON CONFLICT DO NOTHING`, as [`INSERT`]), in one round trip
/// and, for a row that stands, without writing anything. No row comes back
/// when the insert meets a row committed after the snapshot was taken; the
/// shared protocol then reads it (see `sql::reserve`). The `live` column
/// tells a row within its retention from one past it (which only a
/// takeover may replace).
const INSERT_OR_READ: &str = "
WITH found AS (
    SELECT fingerprint, state, status, headers, body,
           expires_at > now() AS live,
           (extract(epoch FROM greatest(lease_expires_at - now(), interval '0')) * 1000000)::bigint
               AS lease_remaining_us
    FROM idempotency_records
    WHERE key = $1
), inserted AS (
    INSERT INTO idempotency_records
        (key, fingerprint, owner, state, lease_expires_at, expires_at, principal)
    SELECT $1, $2, $3, 'in_flight',
           now() + $4::bigint * interval '1 microsecond',
           now() + $5::bigint * interval '1 microsecond',
           $6
    WHERE NOT EXISTS (SELECT FROM found)
    ON CONFLICT (key) DO NOTHING
    RETURNING fingerprint
)
SELECT true AS inserted, true AS live, fingerprint, 'in_flight'::text AS state,
       NULL::smallint AS status, NULL::bytea AS headers, NULL::bytea AS body,
       $4::bigint AS lease_remaining_us
FROM inserted
UNION ALL
SELECT false, live, fingerprint, state, status, headers, body, lease_remaining_us
FROM found";

/// Overwrites a record whose retention ran out, or whose lease ran out (same
/// fingerprint only). Concurrent callers queue on the row lock and check the
/// condition again on the row the winner wrote, so exactly one succeeds. A
/// takeover keeps the first reservation's `created_at`, which is how it is
/// told apart from a reused key.
const TAKE_OVER: &str = "
UPDATE idempotency_records AS r
SET fingerprint = $2,
    owner = $3,
    state = 'in_flight',
    lease_expires_at = now() + $4::bigint * interval '1 microsecond',
    expires_at = now() + $5::bigint * interval '1 microsecond',
    status = NULL,
    headers = NULL,
    body = NULL,
    principal = $6,
    created_at = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END
WHERE key = $1
  AND (r.expires_at <= now()
       OR (r.state = 'in_flight' AND r.lease_expires_at <= now() AND r.fingerprint = $2))
RETURNING created_at < now() AS takeover";

const SELECT_LIVE: &str = "
SELECT fingerprint, state, status, headers, body,
       (extract(epoch FROM greatest(lease_expires_at - now(), interval '0')) * 1000000)::bigint
           AS lease_remaining_us
FROM idempotency_records
WHERE key = $1 AND expires_at > now()";

const COMPLETE: &str = "
UPDATE idempotency_records
SET state = $3, owner = NULL, lease_expires_at = NULL,
    status = $4, headers = $5, body = $6,
    expires_at = now() + $7::bigint * interval '1 microsecond'
WHERE key = $1 AND owner = $2 AND state = 'in_flight'";

const RELEASE: &str = "
DELETE FROM idempotency_records
WHERE key = $1 AND owner = $2 AND state = 'in_flight'";

/// A renewed reservation never expires (nor is swept) under its owner.
const RENEW: &str = "
UPDATE idempotency_records
SET lease_expires_at = now() + $3::bigint * interval '1 microsecond',
    expires_at = greatest(expires_at, now() + $3::bigint * interval '1 microsecond')
WHERE key = $1 AND owner = $2 AND state = 'in_flight'";

/// Oldest expired rows first, through the `expires_at` index, at most `$1`
/// (the materialized CTE is evaluated once, so the batch bound holds). `SKIP LOCKED`
/// lets sweepers of several instances run side by side; the outer condition
/// is checked again on the locked row, so a key reserved anew a moment ago
/// is never deleted.
const SWEEP: &str = "
WITH doomed AS MATERIALIZED (
    SELECT key FROM idempotency_records
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED)
DELETE FROM idempotency_records AS r
USING doomed
WHERE r.key = doomed.key
  AND r.expires_at <= now()";

/// The id every instance on this database shares (see the migration).
const IDENTITY: &str = "SELECT id FROM idempotency_store";

/// What an operator sees of a record (never its body); `FROM` follows.
macro_rules! info_columns {
    () => {
        "SELECT key, fingerprint, state, status,
       CASE WHEN state = 'too_large' THEN headers END AS marker,
       octet_length(body)::bigint AS body_bytes,
       octet_length(headers)::bigint AS header_bytes,
       (extract(epoch FROM now() - created_at) * 1000000)::bigint AS age_us,
       (extract(epoch FROM greatest(expires_at - now(), interval '0')) * 1000000)::bigint
           AS expires_in_us,
       (extract(epoch FROM greatest(lease_expires_at - now(), interval '0')) * 1000000)::bigint
           AS lease_remaining_us,
       principal IS NOT NULL AS has_principal,
       owner
FROM idempotency_records"
    };
}

const INSPECT: &str = concat!(info_columns!(), " WHERE key = $1 AND expires_at > now()");

const PURGE: &str = "DELETE FROM idempotency_records WHERE key = $1";

const PRINCIPAL_KEYS: &str = "SELECT key FROM idempotency_records WHERE principal = $1 LIMIT $2";

/// Through the partial index on `principal`, in batches of `$2`.
const PURGE_PRINCIPAL: &str = "
DELETE FROM idempotency_records
WHERE key IN (SELECT key FROM idempotency_records WHERE principal = $1 LIMIT $2)
RETURNING key";

const FORCE_RELEASE: &str =
    "DELETE FROM idempotency_records WHERE key = $1 AND state = 'in_flight'";

/// Through the partial index on in-flight rows' `created_at`.
const IN_FLIGHT_OLDER_THAN: &str = concat!(
    info_columns!(),
    " WHERE state = 'in_flight' AND expires_at > now()
  AND created_at <= now() - $1::bigint * interval '1 microsecond'
ORDER BY created_at
LIMIT $2"
);

const COUNTS: &str = "
SELECT count(*) FILTER (WHERE expires_at > now() AND state = 'in_flight'
                          AND lease_expires_at > now()) AS in_flight,
       count(*) FILTER (WHERE expires_at > now() AND state = 'in_flight'
                          AND lease_expires_at <= now()) AS lease_expired,
       count(*) FILTER (WHERE expires_at > now() AND state = 'completed') AS completed,
       count(*) FILTER (WHERE expires_at > now() AND state = 'too_large'
                          AND headers IS NULL) AS too_large,
       count(*) FILTER (WHERE expires_at > now() AND state = 'too_large'
                          AND headers IS NOT NULL) AS incomplete,
       count(*) FILTER (WHERE expires_at <= now()) AS expired
FROM idempotency_records";

/// Keeps records in a PostgreSQL table, `idempotency_records` (see
/// `migrations/`), shared by every instance that connects to it.
///
/// * A reservation is an atomic `INSERT … ON CONFLICT DO NOTHING`, a lease
///   takeover one atomic `UPDATE … WHERE lease_expires_at <= now()`: of any
///   number of concurrent callers on any number of instances, exactly one
///   gets the key, and an expired lease is taken over by exactly one caller
///   with the same fingerprint. A duplicate of a live record writes nothing.
/// * Completion, release and renewal are `… WHERE owner = $2`: a worker
///   that lost its lease can never overwrite its successor.
/// * All time is the database's clock (`now()`); instance clocks never
///   matter.
/// * Waiters poll with the default bounded backoff (10 ms doubling to
///   200 ms, one primary-key lookup per step), and only while a duplicate
///   actually waits. `LISTEN/NOTIFY` was not used: a committing `NOTIFY`
///   takes a database-wide lock, which would serialise every completion.
/// * A statement the database rolled back with a serialization failure
///   (SQLSTATE `40001`) or a deadlock (`40P01`) is run again, with capped
///   exponential backoff and jitter, for up to
///   [`retry_budget`](PostgresStore::retry_budget) (default
///   [`RETRY_BUDGET`](PostgresStore::RETRY_BUDGET), the engine's default
///   `store_timeout`; the engine abandons the call at its own
///   `store_timeout` in any case). Such a conflict undid the whole
///   statement, so the retry is its first run against the current rows;
///   PostgreSQL itself rarely answers these to our single-row statements,
///   but PostgreSQL-compatible engines with optimistic concurrency
///   (CockroachDB, YugabyteDB) do under contention. A statement whose
///   outcome is unknown (connection lost, `40003`) is never retried.
/// * A failed connection, no connection within the acquire timeout, a
///   conflict that outlasts the retry budget, or any other database error
///   becomes a [`StoreError`], which the engine answers with 503 (fail
///   closed). Connections are opened again on demand.
/// * Every statement runs on connections of the store's own: opened by the
///   pool (its connect options and `after_connect` hook) and detached from
///   it, at most the pool's `max_connections` at once, with its acquire
///   timeout, idle timeout and maximum lifetime. A connection serves the
///   next statement the moment the database answered the last one, without
///   the test round trip sqlx's pool makes on every release (which held
///   each connection for two round trips per statement). A statement
///   abandoned halfway (the engine's `store_timeout`, a client gone) keeps
///   its connection's place until the server is ready again (at most 30 s,
///   then it is closed), so the server never runs more than
///   `max_connections` of the store's sessions. A connection whose session
///   the server ended (`FATAL`, a restart, a failover) is closed, not
///   reused. Detached connections no longer count against the pool: one
///   the application also uses for its own queries may have up to twice
///   its size open. The pool's `after_release` hook does not run.
///
/// The table is searched through the connection's `search_path`; to keep it
/// in another schema, add `?options=-c%20search_path%3Dmy_schema` to the URL.
///
/// Clones share the pool and the connections.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
    /// The connections of every request's statements.
    connections: Arc<Connections>,
    /// The store's id, read once.
    id: Arc<OnceLock<String>>,
    /// How long a statement that conflicted is retried.
    retry: Duration,
}

/// What keeps the store from writing its records, or NULL
/// ([`PostgresStore::ping`]). `CASE` tests in order, so the privileges are
/// asked only of a table that exists; each on its own, since one call
/// listing several is true when any one is held.
const WRITABLE: &str = "
SELECT CASE
    WHEN current_setting('transaction_read_only') = 'on'
        THEN 'the database is read-only (a standby, or default_transaction_read_only)'
    WHEN to_regclass('idempotency_records') IS NULL
        THEN 'idempotency_records does not exist: the migrations were not applied'
    WHEN NOT (has_table_privilege('idempotency_records', 'SELECT')
              AND has_table_privilege('idempotency_records', 'INSERT')
              AND has_table_privilege('idempotency_records', 'UPDATE')
              AND has_table_privilege('idempotency_records', 'DELETE'))
        THEN 'the role may not read and write idempotency_records'
END";

impl PostgresStore {
    /// The schema migrations (`migrations/*.sql`), for teams that apply them
    /// separately. It tolerates other migrations recorded in the same
    /// `_sqlx_migrations` table (the application's own).
    pub const MIGRATOR: Migrator = Migrator {
        ignore_missing: true,
        ..sqlx::migrate!("./migrations")
    };

    /// How long a request waits for a pooled connection before the store
    /// reports [`StoreError::Timeout`] (and the engine answers 503).
    pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

    /// The default [`retry_budget`](PostgresStore::retry_budget): 5 s, the
    /// engine's default `store_timeout`.
    pub const RETRY_BUDGET: Duration = Duration::from_secs(5);

    /// Connects to `url` (`postgres://user:password@host/database`) with
    /// [`PostgresStore::pool_options`] and applies the migrations.
    ///
    /// Fails when the database cannot be reached now or a migration fails;
    /// once connected, an outage only fails the calls made during it.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        // Lazy: the store runs its statements on connections of its own,
        // and the migration below is the first to reach the database.
        let pool = Self::pool_options()
            .connect_lazy(url)
            .map_err(store_error)?;
        let store = Self::from_pool(pool);
        store.migrate().await?;
        Ok(store)
    }

    /// The pool settings [`connect`](PostgresStore::connect) uses:
    ///
    /// * an acquire timeout of [`ACQUIRE_TIMEOUT`](PostgresStore::ACQUIRE_TIMEOUT),
    ///   so an unreachable database becomes a quick 503 rather than a hung
    ///   request;
    /// * no test query before a pooled connection is handed out (sqlx's
    ///   default sends one, doubling every statement's round trips). A
    ///   connection that broke while idle (the database restarted) fails
    ///   the one call that draws it — nothing was executed, the request gets
    ///   503 — and is replaced; idle connections are closed after a minute,
    ///   so few survive to break.
    pub fn pool_options() -> PgPoolOptions {
        PgPoolOptions::new()
            .acquire_timeout(Self::ACQUIRE_TIMEOUT)
            .test_before_acquire(false)
            .idle_timeout(Duration::from_secs(60))
    }

    /// A store with `pool`'s connect options and limits (see the type's
    /// doc: the store opens its connections itself). Nothing is migrated: call
    /// [`migrate`](PostgresStore::migrate), or apply
    /// [`MIGRATOR`](PostgresStore::MIGRATOR) or the SQL files yourself.
    pub fn from_pool(pool: PgPool) -> Self {
        PostgresStore {
            connections: Connections::new(pool.clone()),
            pool,
            id: Arc::default(),
            retry: Self::RETRY_BUDGET,
        }
    }

    /// Sets how long one statement that the database rolled back for a
    /// conflict (SQLSTATE `40001` or `40P01`) is run again before the
    /// conflict is reported as [`StoreError::Unavailable`]. Set it to the
    /// engine's `store_timeout` (the proxy does); `Duration::ZERO` never
    /// retries.
    pub fn retry_budget(mut self, budget: Duration) -> Self {
        self.retry = budget;
        self
    }

    /// Creates or upgrades the table. Safe to run from several instances at
    /// once (the migrator holds an advisory lock) and on every start.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut lease = self
            .connections
            .acquire(Lane::Any)
            .await
            .map_err(store_error)?;
        // Abandoned (a caller's timeout), the run may hold the migrator's
        // advisory lock: the connection must not serve again.
        lease.discard_if_abandoned();
        // `run_direct`: sqlx's own way around `run`'s `Acquire` bound, whose
        // future over a borrowed connection could not be spawned.
        match Self::MIGRATOR.run_direct(lease.connection()).await {
            Ok(()) => lease.release(),
            // A failed run may leave the migrator's advisory lock held (it
            // unlocks only at the end): the connection must not serve again.
            Err(error) => {
                lease.close();
                return Err(sql::migrate_error(error));
            }
        }
        Ok(())
    }

    /// The pool the store was made with, for the application's own queries
    /// (the store runs none on it).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Closes the store's connections and the pool; later calls fail with
    /// [`StoreError::Unavailable`].
    pub async fn close(&self) {
        self.connections.close().await;
        self.pool.close().await;
    }

    /// A connection of the store's own for one statement.
    async fn lease(&self) -> Result<connections::Lease, sqlx::Error> {
        self.connections.acquire(Lane::Any).await
    }

    /// Whether the store can take a reservation, on one of its
    /// connections: the database answers, is not read-only (a hot standby,
    /// `default_transaction_read_only`), holds the records' table (the
    /// migrations were applied) and lets the role write it. A database that
    /// only answered `SELECT 1` passed while every reservation failed.
    ///
    /// A problem found is an error of the statement's own, so the lease
    /// closes the connection it asked on, as after a reservation's `25006`:
    /// the next check asks a new one, which after a failover reaches the
    /// new primary (an idle connection to the old one kept answering
    /// "read-only" while nothing else used it).
    async fn writable(&self) -> Result<(), sqlx::Error> {
        sql::on_connection!(self, |executor| async {
            let problem: Option<String> = sqlx::query_scalar(WRITABLE).fetch_one(executor).await?;
            match problem {
                None => Ok(()),
                Some(problem) => Err(sqlx::Error::Configuration(problem.into())),
            }
        })
        .await
    }

    /// A record write that returns whether it wrote: its own transaction.
    async fn write_scalar(
        &self,
        query: QueryScalar<'static, Postgres, bool, PgArguments>,
    ) -> Result<Option<bool>, sqlx::Error> {
        sql::on_connection!(self, |executor| query.fetch_optional(executor)).await
    }

    /// A release, answered with its count of changed rows: its own
    /// transaction, on any connection but those kept for holders. Most
    /// releases free keys of arrivals that gave up on a slow store (their
    /// reservations' guards), the traffic the kept connections are kept
    /// from; a release that does not get through leaves the key in flight
    /// until its lease runs out, never run twice.
    async fn write_release(
        &self,
        statement: Query<'static, Postgres, PgArguments>,
    ) -> Result<u64, sqlx::Error> {
        self.execute_on(Lane::Any, statement).await
    }

    /// A record write answered with its count of changed rows: its own
    /// transaction. These are the writes that keep a running request's
    /// key (renew) and store its outcome (complete), which may take the
    /// connections kept for them ([`Lane::Holder`]).
    async fn write_execute(
        &self,
        statement: Query<'static, Postgres, PgArguments>,
    ) -> Result<u64, sqlx::Error> {
        self.execute_on(Lane::Holder, statement).await
    }

    /// `statement` on a connection of `lane`, answered with its count of
    /// changed rows.
    async fn execute_on(
        &self,
        lane: Lane,
        statement: Query<'static, Postgres, PgArguments>,
    ) -> Result<u64, sqlx::Error> {
        use sql::StatementLease as _;
        let mut lease = self.connections.acquire(lane).await?;
        let result = statement.execute(lease.executor()).await;
        Ok(lease.finish(result)?.rows_affected())
    }

    /// A reservation's first statement (`INSERT_OR_READ`): its own
    /// transaction.
    async fn write_row(
        &self,
        query: QueryAs<'_, Postgres, sql::InsertOrReadRow, PgArguments>,
    ) -> Result<Option<sql::InsertOrReadRow>, sqlx::Error> {
        sql::on_connection!(self, |executor| query.fetch_optional(executor)).await
    }
}

super::sql::sql_store!(
    PostgresStore,
    sql::Statements {
        insert: INSERT,
        take_over: TAKE_OVER,
        select_live: SELECT_LIVE,
        complete: COMPLETE,
        release: RELEASE,
        renew: RENEW,
        sweep: SWEEP,
        identity: IDENTITY,
    },
    retry = retry,
    insert_or_read = INSERT_OR_READ
);

super::sql::sql_admin!(
    PostgresStore,
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
