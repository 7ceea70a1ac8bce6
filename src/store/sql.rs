//! What the SQL stores share: the row they read, the columns an outcome is
//! written to, the reserve protocol around the atomic writes, and the
//! mapping of sqlx errors onto [`StoreError`].
//!
//! Both schemas (`migrations/`, `migrations/sqlite/`) have the same
//! columns; only time is represented differently (PostgreSQL
//! `timestamptz` by the database clock, SQLite integer microseconds).

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;

use super::{
    Claim, Fingerprint, Outcome, Record, RecordState, SealedOutcome, StoreError, StoredResponse,
};

pub(super) mod admin;
pub(super) use admin::{sql_admin, AdminStatements};

/// The `state` column of a record still held by its owner.
pub(super) const IN_FLIGHT: &str = "in_flight";

/// The `headers` column of a `too_large` row that records an incomplete
/// response ([`Outcome::Incomplete`]). Both outcomes are "executed, no
/// response to replay", carrying the status only; the schema's `state`
/// column knows `completed` and `too_large`, so an incomplete response is a
/// `too_large` row marked here (a plain marker has no headers), and the
/// deployed schema and its rows stay as they are.
const INCOMPLETE_MARKER: &[u8] = b"incomplete";

// A sealed outcome ([`Outcome::Sealed`]) is a `completed` row whose
// `status` and `headers` are NULL and whose `body` holds the sealed bytes:
// status, headers and body are all inside the ciphertext, and the schema
// stays as it is. A plain completed row always has a status.

/// A live record as both stores select it.
#[derive(sqlx::FromRow)]
pub(super) struct RecordRow {
    fingerprint: Vec<u8>,
    state: String,
    /// Lease time left in microseconds (NULL once completed).
    lease_remaining_us: Option<i64>,
    status: Option<i16>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
}

impl RecordRow {
    /// Decodes the row; anything the stores never write is
    /// [`StoreError::Corrupt`].
    pub(super) fn into_record(self) -> Result<Record, StoreError> {
        let corrupt =
            |what: &str| StoreError::Corrupt(format!("{what} of a `{}` record", self.state));
        let status = || {
            self.status
                .and_then(|code| u16::try_from(code).ok())
                .and_then(|code| StatusCode::from_u16(code).ok())
                .ok_or_else(|| corrupt("status"))
        };
        let state = match self.state.as_str() {
            IN_FLIGHT => RecordState::InFlight {
                lease_remaining: Duration::from_micros(
                    self.lease_remaining_us.unwrap_or(0).max(0) as u64
                ),
            },
            "completed" if self.status.is_none() && self.headers.is_none() => {
                let Some(sealed) = self.body else {
                    return Err(corrupt("sealed response"));
                };
                RecordState::Completed(Outcome::Sealed(SealedOutcome::from_bytes(sealed.into())))
            }
            "completed" => {
                let (Some(headers), Some(body)) = (&self.headers, &self.body) else {
                    return Err(corrupt("response"));
                };
                RecordState::Completed(Outcome::Stored(StoredResponse {
                    status: status()?,
                    headers: StoredResponse::decode_headers(headers)?,
                    body: Bytes::copy_from_slice(body),
                }))
            }
            "too_large" if self.headers.as_deref() == Some(INCOMPLETE_MARKER) => {
                RecordState::Completed(Outcome::Incomplete { status: status()? })
            }
            "too_large" => RecordState::Completed(Outcome::TooLarge { status: status()? }),
            other => return Err(StoreError::Corrupt(format!("record state `{other}`"))),
        };
        Ok(Record {
            fingerprint: Fingerprint::from_slice(&self.fingerprint)?,
            state,
        })
    }
}

/// The columns a completed record is written to.
pub(super) struct OutcomeColumns<'a> {
    /// `completed` or `too_large` (also for an incomplete response, see
    /// `INCOMPLETE_MARKER`).
    pub(super) state: &'static str,
    /// NULL for a sealed outcome.
    pub(super) status: Option<i16>,
    pub(super) headers: Option<Vec<u8>>,
    pub(super) body: Option<&'a [u8]>,
}

impl<'a> From<&'a Outcome> for OutcomeColumns<'a> {
    fn from(outcome: &'a Outcome) -> Self {
        // Status codes are 100..=999, so they always fit a smallint.
        let status = outcome.status().map(|status| status.as_u16() as i16);
        match outcome {
            Outcome::Sealed(sealed) => OutcomeColumns {
                state: "completed",
                status: None,
                headers: None,
                body: Some(sealed.as_bytes()),
            },
            Outcome::Stored(response) => OutcomeColumns {
                state: "completed",
                status,
                headers: Some(response.encode_headers()),
                body: Some(&response.body),
            },
            Outcome::TooLarge { .. } => OutcomeColumns {
                state: "too_large",
                status,
                headers: None,
                body: None,
            },
            Outcome::Incomplete { .. } => OutcomeColumns {
                state: "too_large",
                status,
                headers: Some(INCOMPLETE_MARKER.to_vec()),
                body: None,
            },
        }
    }
}

/// A duration as bound to the queries: whole microseconds, saturating.
pub(super) fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

/// What a store's single-statement first attempt at a reservation
/// answered (see [`Statements`] and `sql_store!`'s `insert_or_read`): the
/// record the statement's snapshot holds for the key, or the new record it
/// wrote when its snapshot held none.
pub(super) enum FirstAttempt {
    /// No such statement (the store reads first), or the statement could
    /// not decide: its snapshot held no row, yet its insert met one (another
    /// caller's, committed after the snapshot was taken). The protocol runs
    /// from the start.
    Undecided,
    /// It wrote a new record for the caller's owner token.
    Acquired,
    /// The live record of the key, as the statement's snapshot held it.
    Live(RecordRow),
    /// A row past its retention stands (not live, never answered): only a
    /// takeover may replace it.
    Expired,
}

/// The row of a single-statement first attempt: `inserted` when it wrote
/// the caller's record, else the standing row with `live` telling whether
/// it is within its retention.
#[derive(sqlx::FromRow)]
pub(super) struct InsertOrReadRow {
    inserted: bool,
    live: bool,
    #[sqlx(flatten)]
    record: RecordRow,
}

impl FirstAttempt {
    /// The attempt a single-statement first attempt's row (if any) stands for.
    pub(super) fn from_row(row: Option<InsertOrReadRow>) -> Self {
        match row {
            None => FirstAttempt::Undecided,
            Some(row) if row.inserted => FirstAttempt::Acquired,
            Some(row) if row.live => FirstAttempt::Live(row.record),
            Some(_) => FirstAttempt::Expired,
        }
    }
}

/// The reserve protocol shared by the SQL stores.
///
/// `first` is what a store's single-statement first attempt answered (a
/// store without one passes [`FirstAttempt::Undecided`]): a record it wrote
/// is the answer, and a row it read stands for the protocol's first read —
/// the statement only inserts when its own snapshot holds no row for the
/// key, so whatever it read is a committed record the protocol's read could
/// have returned at that moment.
///
/// `existing()` reads the live record of the key, if any: that is the
/// answer (a replay or a wait costs one read, and no write) — unless it is
/// an in-flight record of the same fingerprint whose lease ran out.
/// With no live record, `insert()` writes a new one (for the caller's owner
/// token) unless a row stands (`Some` when it wrote); if one does (another
/// caller inserted it meanwhile, or it is past its retention), `existing()`
/// reads again. Only for an expired row or lease does `take_over()` run:
/// one atomic `UPDATE` whose own condition decides which of several
/// concurrent callers wins; a caller that loses it gets the record it read.
/// If the record vanished in between (released or expired), the round
/// repeats; under any real contention the second round ends it. Every
/// decision to acquire is an atomic write's own; the read only ever
/// answers with a committed record, which is what the write's conflict
/// would have led to as well.
///
/// With a single-statement first attempt, a replay and a first execution
/// each cost that one statement, a takeover two; without, a replay costs
/// one statement (a read), a first execution two (a read, then the
/// insert), a takeover two or three.
pub(super) async fn reserve<I, T, E>(
    fingerprint: &Fingerprint,
    first: FirstAttempt,
    mut insert: impl FnMut() -> I,
    mut take_over: impl FnMut() -> T,
    mut existing: impl FnMut() -> E,
) -> Result<Claim, StoreError>
where
    I: Future<Output = Result<Option<bool>, sqlx::Error>>,
    T: Future<Output = Result<Option<bool>, sqlx::Error>>,
    E: Future<Output = Result<Option<RecordRow>, sqlx::Error>>,
{
    const ROUNDS: usize = 8;
    // `Some(record)`: the first round's read is already done.
    let mut read = match first {
        FirstAttempt::Undecided => None,
        FirstAttempt::Acquired => return Ok(Claim::Acquired { takeover: false }),
        FirstAttempt::Live(row) => Some(Some(row.into_record()?)),
        FirstAttempt::Expired => Some(None),
    };
    for _ in 0..ROUNDS {
        let record = match read.take() {
            Some(record) => record,
            None => {
                let record = existing()
                    .await
                    .map_err(store_error)?
                    .map(RecordRow::into_record)
                    .transpose()?;
                if record.is_none() {
                    if let Some(takeover) = insert().await.map_err(store_error)? {
                        return Ok(Claim::Acquired { takeover });
                    }
                    existing()
                        .await
                        .map_err(store_error)?
                        .map(RecordRow::into_record)
                        .transpose()?
                } else {
                    record
                }
            }
        };
        let candidate = match record {
            Some(record) if !(record.lease_expired() && record.fingerprint == *fingerprint) => {
                return Ok(Claim::Existing(record));
            }
            candidate => candidate,
        };
        if let Some(takeover) = take_over().await.map_err(store_error)? {
            return Ok(Claim::Acquired { takeover });
        }
        // Another caller took the expired lease over first (or the two
        // statements' clocks disagree by a hair): the record read stands,
        // and a waiter looks again. Only a record that vanished is retried.
        if let Some(record) = candidate {
            return Ok(Claim::Existing(record));
        }
    }
    Err(StoreError::Unavailable(
        format!("the record changed under {ROUNDS} reservation attempts").into(),
    ))
}

/// The first pause before retrying a statement the database rolled back for
/// a conflict; it doubles up to [`RETRY_MAX_DELAY`].
const RETRY_FIRST_DELAY: Duration = Duration::from_millis(5);
/// The longest pause between two attempts of one statement.
const RETRY_MAX_DELAY: Duration = Duration::from_millis(200);

/// Whether the database rolled `error`'s statement back for a transient
/// conflict with another transaction: SQLSTATE `40001` (serialization
/// failure, what PostgreSQL-compatible engines with optimistic concurrency —
/// CockroachDB, YugabyteDB — answer a conflict with) or `40P01` (deadlock
/// detected).
///
/// Both mean the statement's transaction was aborted as a whole: nothing it
/// wrote stands. `40003` (statement completion unknown) is *not* one of
/// them, nor is a connection lost mid-statement: there the write may have
/// committed, so it is reported, never repeated blindly.
pub(super) fn is_conflict(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(error) => matches!(error.code().as_deref(), Some("40001" | "40P01")),
        _ => false,
    }
}

/// Runs `statement` until it ends without a conflict (see [`is_conflict`])
/// or `budget` is spent, pausing between attempts with capped exponential
/// backoff and jitter (each pause is half the current delay plus a random
/// part of the other half, so callers that collided do not collide again in
/// step). When the budget would be overrun, the last conflict is returned —
/// a store error, answered fail-closed by the engine; any other error is
/// returned at once.
///
/// Every statement of the SQL stores is a single autocommit statement, so a
/// conflict rolled it back entirely, and running it again is running it for
/// the first time against the current rows; see [`Statements`] for why
/// each one gives the same answer then.
pub(super) async fn retrying<T, F, Fut>(
    budget: Duration,
    mut statement: F,
) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let deadline = Instant::now() + budget;
    let mut delay = RETRY_FIRST_DELAY;
    loop {
        match statement().await {
            Err(error) if is_conflict(&error) => {
                let half = delay / 2;
                let pause = half + half.mul_f64(rand::random::<f64>());
                if Instant::now() + pause >= deadline {
                    tracing::warn!(%error, "a store statement kept conflicting; giving up");
                    return Err(error);
                }
                tracing::debug!(%error, ?pause, "a store statement conflicted; retrying");
                tokio::time::sleep(pause).await;
                delay = (delay * 2).min(RETRY_MAX_DELAY);
            }
            other => return other,
        }
    }
}

/// A SQL store's connection for one statement, taken with the store's
/// `lease()`: an executor to run the statement on, and what becomes of the
/// connection by the statement's result.
pub(super) trait StatementLease {
    /// What the statement runs on.
    type Executor<'e>: sqlx::Executor<'e>
    where
        Self: 'e;

    /// The executor.
    fn executor(&mut self) -> Self::Executor<'_>;

    /// Passes `result` through, deciding by it whether the connection
    /// serves another statement.
    fn finish<T>(self, result: Result<T, sqlx::Error>) -> Result<T, sqlx::Error>;
}

/// A statement on a sqlx pool: the pool takes its connection back and
/// tests it itself.
pub(super) struct PoolLease<'p, DB: sqlx::Database>(pub(super) &'p sqlx::Pool<DB>);

impl<'p, DB: sqlx::Database> StatementLease for PoolLease<'p, DB>
where
    for<'e> &'e sqlx::Pool<DB>: sqlx::Executor<'e, Database = DB>,
{
    type Executor<'e>
        = &'e sqlx::Pool<DB>
    where
        Self: 'e;

    fn executor(&mut self) -> &sqlx::Pool<DB> {
        self.0
    }

    fn finish<T>(self, result: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        result
    }
}

/// Runs one statement on a connection of `store` (its `lease()`, a
/// [`StatementLease`]): `|executor| statement` names the executor in an
/// expression giving the statement's future. A future of the statement's
/// `Result<_, sqlx::Error>`.
macro_rules! on_connection {
    ($store:expr, |$executor:ident| $statement:expr) => {
        async {
            use $crate::store::sql::StatementLease as _;
            let mut lease = $store.lease().await?;
            let result = {
                let $executor = lease.executor();
                $statement.await
            };
            lease.finish(result)
        }
    };
}
pub(super) use on_connection;

/// Maps a sqlx error: no connection in time is [`StoreError::Timeout`], an
/// undecodable row is [`StoreError::Corrupt`], anything else (I/O, TLS, a
/// closed pool, a database error) is [`StoreError::Unavailable`].
pub(super) fn store_error(error: sqlx::Error) -> StoreError {
    match error {
        sqlx::Error::PoolTimedOut => StoreError::Timeout,
        // A row was read and one of its values does not decode: a record
        // exists, and the engine never treats it as a miss.
        sqlx::Error::Decode(_) | sqlx::Error::ColumnDecode { .. } => {
            StoreError::Corrupt(error.to_string())
        }
        // A missing column or type is the schema's (a migration not run),
        // not a record's: the store is unavailable, as the fail mode says.
        other => StoreError::Unavailable(Box::new(other)),
    }
}

/// Maps a failed migration onto [`StoreError::Unavailable`].
pub(super) fn migrate_error(error: sqlx::migrate::MigrateError) -> StoreError {
    match error {
        sqlx::migrate::MigrateError::Execute(error) => store_error(error),
        other => StoreError::Unavailable(Box::new(other)),
    }
}

/// The statements of one SQL dialect. Every field must be given, so a
/// dialect that lacks a statement is a compile error naming it.
///
/// Both dialects take the same parameters in the same order and keep time
/// by the database's own clock, so the Rust side is written once:
///
/// | statement | parameters |
/// |---|---|
/// | `insert`, `take_over` | key, fingerprint, owner, lease µs, ttl µs, principal hash (or NULL) → `takeover` |
/// | `select_live` | key → [`RecordRow`] |
/// | `complete` | key, owner, state, status, headers, body, ttl µs |
/// | `release` | key, owner |
/// | `renew` | key, owner, lease µs |
/// | `sweep` | batch |
/// | `identity` | → the store's id (text) |
///
/// A statement the database rolled back with a serialization failure or a
/// deadlock (see [`is_conflict`]) is run again within the store's retry
/// budget ([`retrying`]). That is safe for each of them because each is one
/// autocommit statement — the conflict undid all of it — and each decides
/// from the rows as they are when it runs:
///
/// | statement | why running it again is safe |
/// |---|---|
/// | `insert` | `ON CONFLICT DO NOTHING`: the rolled-back insert left no row; the retry inserts, or finds the row another caller wrote and the protocol reads it |
/// | `take_over` | its `WHERE` re-checks expiry and fingerprint on the current row: of several callers still exactly one wins |
/// | `select_live`, `identity` | reads |
/// | `complete`, `release`, `renew` | `WHERE owner = $2 AND state = 'in_flight'`: it applies once, or finds the reservation lost, as the first attempt would have |
/// | `sweep` | deletes only rows expired at the time it runs |
pub(super) struct Statements {
    /// A new record, unless one stands; returns `takeover` (false).
    pub(super) insert: &'static str,
    /// Overwrites an expired record, or an expired lease of the same
    /// fingerprint; returns `takeover`.
    pub(super) take_over: &'static str,
    /// The live record of a key.
    pub(super) select_live: &'static str,
    /// Completes a record the owner still holds.
    pub(super) complete: &'static str,
    /// Deletes an in-flight record the owner still holds.
    pub(super) release: &'static str,
    /// Extends the lease (and retention) of a record the owner still holds.
    pub(super) renew: &'static str,
    /// Deletes at most `batch` expired records.
    pub(super) sweep: &'static str,
    /// The id kept in the store's one-row metadata table.
    pub(super) identity: &'static str,
}

/// Implements [`Store`](super::Store) and [`Maintenance`](super::Maintenance)
/// for a SQL store: a type with a `pool` field and an `id` field (an
/// `Arc<OnceLock<String>>` caching [`Statements::identity`]), given its
/// dialect's [`Statements`]. Reads run on a connection of the type's own
/// `lease()` (a [`StatementLease`], see [`on_connection`]); the record
/// writes go through its `write_scalar` (a statement returning whether it
/// wrote), `write_execute` (its count of changed rows: a renewal or a
/// completion) and `write_release` (the same for a release), which take the
/// statement with owned (`'static`) parameters, so a store may hand it to
/// a writer of its own (SQLite's group commit).
///
/// A reservation is a `SELECT` of the live record, then (with none)
/// `INSERT … ON CONFLICT DO NOTHING`, then (only when a record may be
/// taken over) `UPDATE … WHERE <expired>`. Each write is atomic on its
/// own, and a duplicate of a live record writes nothing: replays and
/// polling waiters take no row lock and cost no commit flush.
///
/// With `retry = field, insert_or_read = STATEMENT`, a reservation starts
/// with that one statement instead, through the type's own `write_row` (a
/// statement returning at most one [`InsertOrReadRow`]): it reads the key's
/// row and, only when its snapshot holds none, inserts the caller's record
/// (`ON CONFLICT DO NOTHING`), returning the record it wrote or the row it
/// read — or no row when its insert met a row its snapshot could not see.
/// Its answer enters [`reserve`] as the [`FirstAttempt`]; the protocol
/// above runs only when it cannot decide (no row, or a record to take
/// over). Parameters as for `insert`. Like every statement it is one
/// autocommit statement, so a conflict undid all of it and it is retried
/// like `insert`.
///
/// With `retry = field`, statements the database rolls back for a conflict
/// are run again for as long as `self.field` (a [`Duration`]) allows (see
/// [`retrying`]); without it (SQLite, whose single writer never conflicts)
/// they are not retried and the protocol reads first.
macro_rules! sql_store {
    ($store:ty, $statements:expr, retry = $retry:ident, insert_or_read = $first:expr) => {
        impl $store {
            /// The single-statement first attempt at a reservation, through
            /// the store's `write_row`.
            async fn first_attempt(
                &self,
                key: &$crate::store::ScopeKey,
                fingerprint: &$crate::store::Fingerprint,
                owner: &$crate::store::OwnerToken,
                lease: std::time::Duration,
                ttl: std::time::Duration,
                principal: Option<&[u8]>,
            ) -> Result<$crate::store::sql::FirstAttempt, $crate::store::StoreError> {
                let row = $crate::store::sql::retrying(self.statement_retry_budget(), || {
                    self.write_row(
                        sqlx::query_as($first)
                            .bind(key.as_bytes().as_slice())
                            .bind(fingerprint.as_bytes().as_slice())
                            .bind(owner.as_bytes().as_slice())
                            .bind($crate::store::sql::micros(lease))
                            .bind($crate::store::sql::micros(ttl))
                            .bind(principal),
                    )
                })
                .await
                .map_err($crate::store::sql::store_error)?;
                Ok($crate::store::sql::FirstAttempt::from_row(row))
            }
        }
        $crate::store::sql::sql_store!(@impl $store, $statements, |store| store.$retry);
    };
    ($store:ty, $statements:expr) => {
        impl $store {
            /// No single-statement first attempt: the protocol reads first.
            async fn first_attempt(
                &self,
                _: &$crate::store::ScopeKey,
                _: &$crate::store::Fingerprint,
                _: &$crate::store::OwnerToken,
                _: std::time::Duration,
                _: std::time::Duration,
                _: Option<&[u8]>,
            ) -> Result<$crate::store::sql::FirstAttempt, $crate::store::StoreError> {
                Ok($crate::store::sql::FirstAttempt::Undecided)
            }
        }
        // Conflicting statements are not retried.
        $crate::store::sql::sql_store!(@impl $store, $statements, |_store| std::time::Duration::ZERO);
    };
    (@impl $store:ty, $statements:expr, |$this:ident| $budget:expr) => {
        impl $store {
            /// How long a conflicting statement is retried.
            fn statement_retry_budget(&self) -> std::time::Duration {
                let $this = self;
                $budget
            }
        }
        impl $store {
            const STATEMENTS: $crate::store::sql::Statements = $statements;

            async fn select_live(
                &self,
                key: &$crate::store::ScopeKey,
            ) -> Result<Option<$crate::store::sql::RecordRow>, sqlx::Error> {
                $crate::store::sql::retrying(self.statement_retry_budget(), || {
                    $crate::store::sql::on_connection!(self, |executor| {
                        sqlx::query_as(Self::STATEMENTS.select_live)
                            .bind(key.as_bytes().as_slice())
                            .fetch_optional(executor)
                    })
                })
                .await
            }

            /// [`Store::reserve`](crate::store::Store::reserve), keeping
            /// `principal` with the record.
            async fn reserve_with(
                &self,
                key: &$crate::store::ScopeKey,
                fingerprint: &$crate::store::Fingerprint,
                owner: &$crate::store::OwnerToken,
                lease: std::time::Duration,
                ttl: std::time::Duration,
                principal: Option<&$crate::store::PrincipalHash>,
            ) -> Result<$crate::store::Claim, $crate::store::StoreError> {
                let principal = principal.map(|p| p.as_bytes().to_vec());
                let first = self
                    .first_attempt(key, fingerprint, owner, lease, ttl, principal.as_deref())
                    .await?;
                let write = |statement: &'static str| {
                    let principal = principal.clone();
                    $crate::store::sql::retrying(self.statement_retry_budget(), move || {
                        // Through the store's writer (SQLite: the group commit).
                        self.write_scalar(
                            sqlx::query_scalar::<_, bool>(statement)
                                .bind(key.as_bytes().to_vec())
                                .bind(fingerprint.as_bytes().to_vec())
                                .bind(owner.as_bytes().to_vec())
                                .bind($crate::store::sql::micros(lease))
                                .bind($crate::store::sql::micros(ttl))
                                .bind(principal.clone()),
                        )
                    })
                };
                $crate::store::sql::reserve(
                    fingerprint,
                    first,
                    || write(Self::STATEMENTS.insert),
                    || write(Self::STATEMENTS.take_over),
                    || self.select_live(key),
                )
                .await
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::Store for $store {
            async fn reserve(
                &self,
                key: &$crate::store::ScopeKey,
                fingerprint: &$crate::store::Fingerprint,
                owner: &$crate::store::OwnerToken,
                lease: std::time::Duration,
                ttl: std::time::Duration,
            ) -> Result<$crate::store::Claim, $crate::store::StoreError> {
                self.reserve_with(key, fingerprint, owner, lease, ttl, None)
                    .await
            }

            async fn complete(
                &self,
                key: &$crate::store::ScopeKey,
                owner: &$crate::store::OwnerToken,
                outcome: &$crate::store::Outcome,
                ttl: std::time::Duration,
            ) -> Result<bool, $crate::store::StoreError> {
                let columns = $crate::store::sql::OutcomeColumns::from(outcome);
                let done = $crate::store::sql::retrying(self.statement_retry_budget(), || {
                    self.write_execute(
                        sqlx::query(Self::STATEMENTS.complete)
                            .bind(key.as_bytes().to_vec())
                            .bind(owner.as_bytes().to_vec())
                            .bind(columns.state)
                            .bind(columns.status)
                            .bind(columns.headers.clone())
                            .bind(columns.body.map(<[u8]>::to_vec))
                            .bind($crate::store::sql::micros(ttl)),
                    )
                })
                .await
                .map_err($crate::store::sql::store_error)?;
                Ok(done == 1)
            }

            async fn release(
                &self,
                key: &$crate::store::ScopeKey,
                owner: &$crate::store::OwnerToken,
            ) -> Result<bool, $crate::store::StoreError> {
                let done = $crate::store::sql::retrying(self.statement_retry_budget(), || {
                    self.write_release(
                        sqlx::query(Self::STATEMENTS.release)
                            .bind(key.as_bytes().to_vec())
                            .bind(owner.as_bytes().to_vec()),
                    )
                })
                .await
                .map_err($crate::store::sql::store_error)?;
                Ok(done == 1)
            }

            async fn renew(
                &self,
                key: &$crate::store::ScopeKey,
                owner: &$crate::store::OwnerToken,
                lease: std::time::Duration,
            ) -> Result<bool, $crate::store::StoreError> {
                let done = $crate::store::sql::retrying(self.statement_retry_budget(), || {
                    self.write_execute(
                        sqlx::query(Self::STATEMENTS.renew)
                            .bind(key.as_bytes().to_vec())
                            .bind(owner.as_bytes().to_vec())
                            .bind($crate::store::sql::micros(lease)),
                    )
                })
                .await
                .map_err($crate::store::sql::store_error)?;
                Ok(done == 1)
            }

            async fn get(
                &self,
                key: &$crate::store::ScopeKey,
            ) -> Result<Option<$crate::store::Record>, $crate::store::StoreError> {
                self.select_live(key)
                    .await
                    .map_err($crate::store::sql::store_error)?
                    .map($crate::store::sql::RecordRow::into_record)
                    .transpose()
            }

            /// Whether the store can write, not only read: the type's own
            /// `writable()` (SQLite's writer thread, PostgreSQL's
            /// connections).
            async fn ping(&self) -> Result<(), $crate::store::StoreError> {
                self.writable()
                    .await
                    .map_err($crate::store::sql::store_error)
            }

            async fn identity(&self) -> Result<Option<String>, $crate::store::StoreError> {
                if let Some(id) = self.id.get() {
                    return Ok(Some(id.clone()));
                }
                let id: String = $crate::store::sql::retrying(self.statement_retry_budget(), || {
                    $crate::store::sql::on_connection!(self, |executor| {
                        sqlx::query_scalar(Self::STATEMENTS.identity).fetch_optional(executor)
                    })
                })
                .await
                .map_err($crate::store::sql::store_error)?
                    .ok_or_else(|| {
                        $crate::store::StoreError::Corrupt("the store has no id row".into())
                    })?;
                Ok(Some(self.id.get_or_init(|| id).clone()))
            }

            fn maintenance(&self) -> Option<&dyn $crate::store::Maintenance> {
                Some(self)
            }

            fn admin(&self) -> Option<&dyn $crate::store::Admin> {
                Some(self)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::Maintenance for $store {
            async fn sweep(&self, batch: usize) -> Result<u64, $crate::store::StoreError> {
                let batch = i64::try_from(batch).unwrap_or(i64::MAX);
                let done = $crate::store::sql::retrying(self.statement_retry_budget(), || {
                    $crate::store::sql::on_connection!(self, |executor| {
                        sqlx::query(Self::STATEMENTS.sweep).bind(batch).execute(executor)
                    })
                })
                .await
                .map_err($crate::store::sql::store_error)?;
                Ok(done.rows_affected())
            }
        }
    };
}
pub(super) use sql_store;
