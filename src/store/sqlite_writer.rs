//! Group commit for the SQLite store: one writer connection that runs the
//! writes of concurrent callers in one transaction and answers each of them
//! only after that transaction is on disk.
//!
//! SQLite runs one write transaction at a time, and with `synchronous =
//! FULL` every commit waits for the disk. One transaction per write makes
//! the disk sync the bottleneck: concurrent requests queue on the file lock
//! and each pays a sync of its own. Here every write (reservation,
//! takeover, completion, release, renewal) is a job sent to one writer,
//! which owns the only connection that writes records:
//!
//! * it takes the first job waiting and, if others wait too, begins one
//!   transaction (`BEGIN IMMEDIATE`), runs every job waiting (and those that
//!   arrive meanwhile, up to [`MAX_BATCH`]) in order, commits, and only then
//!   answers each job with its own statement's result;
//! * a lone job runs on its own (its statement is its own transaction, as
//!   before), so a quiet store costs no extra round trip;
//! * jobs run one after another on one connection, so each statement sees
//!   every earlier one: the outcome of each job is the one it would have had
//!   run alone in that order, and the atomicity of each statement (an
//!   `INSERT … ON CONFLICT DO NOTHING`, an `UPDATE … WHERE owner = ?`) is
//!   what it always was;
//! * a statement SQLite refuses by itself (a constraint, a value over its
//!   limits) undoes only itself: its job is answered with its error and
//!   the others go on; if any other statement error or the commit fails,
//!   the whole transaction is rolled back and **every** job of it is
//!   answered with an error: no caller is ever told of a write that is not
//!   on disk; a rollback that fails too (the transaction may still be open,
//!   or SQLite undid it itself) replaces the connection, so no later
//!   statement runs inside a transaction nobody commits;
//! * the writer runs on a thread of its own, so a caller that goes away
//!   mid-call (a timeout) never leaves a transaction half done, and the
//!   store works from any Tokio runtime.
//!
//! Reads go through the store's pool and see committed records only, which
//! is also all that any caller has been told about.

use std::collections::VecDeque;

use sqlx::query::{Query, QueryScalar};
use sqlx::sqlite::{Sqlite, SqliteArguments, SqliteConnectOptions, SqliteConnection};
use sqlx::Connection;
use tokio::sync::{mpsc, oneshot};

/// A statement that returns whether it wrote (`RETURNING` a boolean).
pub(super) type Scalar = QueryScalar<'static, Sqlite, bool, SqliteArguments<'static>>;
/// A statement whose count of changed rows is its answer.
pub(super) type Statement = Query<'static, Sqlite, SqliteArguments<'static>>;

/// The most jobs one transaction runs; more wait for the next.
pub(super) const MAX_BATCH: usize = 256;

enum Job {
    Scalar(Scalar, oneshot::Sender<Result<Option<bool>, sqlx::Error>>),
    Execute(Statement, oneshot::Sender<Result<u64, sqlx::Error>>),
    Close(oneshot::Sender<()>),
}

/// An answer held until its transaction is committed.
enum Answer {
    Scalar(
        Option<bool>,
        oneshot::Sender<Result<Option<bool>, sqlx::Error>>,
    ),
    Execute(u64, oneshot::Sender<Result<u64, sqlx::Error>>),
}

impl Answer {
    fn send(self) {
        // A caller that went away no longer wants its answer.
        match self {
            Answer::Scalar(value, to) => drop(to.send(Ok(value))),
            Answer::Execute(value, to) => drop(to.send(Ok(value))),
        }
    }

    fn fail(self, why: &str) {
        match self {
            Answer::Scalar(_, to) => drop(to.send(Err(batch_failed(why)))),
            Answer::Execute(_, to) => drop(to.send(Err(batch_failed(why)))),
        }
    }
}

fn batch_failed(why: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!(
        "the transaction this write was grouped in failed and was rolled back: {why}"
    ))
}

/// Whether `error` undid only its own statement and left the batch's
/// transaction open: SQLite rolls back just the failing statement on a
/// constraint violation (`CONSTRAINT`, also a trigger's `RAISE(ABORT)`),
/// and refuses a value over its limits (`TOOBIG`, a response over the
/// blob limit) or of the wrong type (`MISMATCH`) before writing it. Any
/// other error (a full disk, I/O, `BUSY`, memory, an interrupt) may have
/// rolled back the whole transaction, so the batch fails with it. *Limit:*
/// a trigger's `RAISE(ROLLBACK)` or an `ON CONFLICT ROLLBACK` clause also
/// answers `CONSTRAINT` but undoes the whole transaction; the statements
/// after it then run on their own, and the batch's failed commit tells
/// their callers of a failure although they are on disk (the harmless
/// direction: the engine releases a reservation it was told failed). The
/// store's schema has neither; a trigger an operator adds could.
fn statement_only(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(database) = error else {
        return false;
    };
    let code = database.code().and_then(|code| code.parse::<i32>().ok());
    // The primary result code is the extended code's low byte.
    code.is_some_and(|code| matches!(code & 0xff, 18..=20))
}

fn closed() -> sqlx::Error {
    sqlx::Error::PoolClosed
}

/// The handle to the writer; clones share it. The writer stops when the
/// last handle is dropped or [`close`](Writer::close) is called.
#[derive(Clone, Debug)]
pub(super) struct Writer {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Writer {
    /// Opens the writer's own connection with `options` and starts it.
    pub(super) async fn open(options: &SqliteConnectOptions) -> Result<Self, sqlx::Error> {
        let connection = SqliteConnection::connect_with(options).await?;
        let (jobs, queue) = mpsc::unbounded_channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(sqlx::Error::Io)?;
        let options = options.clone();
        std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || runtime.block_on(run(options, connection, queue)))
            .map_err(sqlx::Error::Io)?;
        Ok(Writer { jobs })
    }

    /// Runs `query` in the next group commit; `Some(returned)` when it
    /// returned a row, answered once the transaction is on disk.
    pub(super) async fn fetch(&self, query: Scalar) -> Result<Option<bool>, sqlx::Error> {
        let (to, answer) = oneshot::channel();
        self.jobs
            .send(Job::Scalar(query, to))
            .map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }

    /// Runs `statement` in the next group commit; the number of rows it
    /// changed, answered once the transaction is on disk.
    pub(super) async fn execute(&self, statement: Statement) -> Result<u64, sqlx::Error> {
        let (to, answer) = oneshot::channel();
        self.jobs
            .send(Job::Execute(statement, to))
            .map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }

    /// Finishes the jobs sent so far, closes the connection and stops;
    /// later writes fail.
    pub(super) async fn close(&self) {
        let (to, done) = oneshot::channel();
        if self.jobs.send(Job::Close(to)).is_ok() {
            let _ = done.await;
        }
    }
}

/// The writer's loop: one batch per turn. A connection whose transaction
/// could not be rolled back is replaced (closing it rolls back whatever it
/// left open), and until a new one opens every job fails: no statement
/// ever runs inside a transaction nobody will commit.
async fn run(
    options: SqliteConnectOptions,
    connection: SqliteConnection,
    mut queue: mpsc::UnboundedReceiver<Job>,
) {
    let mut connection = Some(connection);
    let mut waiting = VecDeque::new();
    let mut closing = None;
    while closing.is_none() {
        let Some(first) = queue.recv().await else {
            break;
        };
        waiting.push_back(first);
        while waiting.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => break,
            }
        }
        if connection.is_none() {
            match SqliteConnection::connect_with(&options).await {
                Ok(reopened) => connection = Some(reopened),
                Err(error) => {
                    let why = format!("the writer's connection could not be reopened: {error}");
                    closing = fail_all(&mut waiting, &why);
                    continue;
                }
            }
        }
        let open = connection.as_mut().expect("a connection");
        if waiting.len() == 1 {
            // Alone: the statement is its own transaction.
            let job = waiting.pop_front().expect("one job");
            match run_one(job, open).await {
                Ok(Some(answer)) => answer.send(),
                Ok(None) => {}
                Err(to) => closing = Some(to),
            }
            continue;
        }
        let ended = batch(open, &mut waiting, &mut queue).await;
        closing = ended.closing;
        if ended.left_open {
            tracing::error!("idempotency SQLite writer could not roll back a failed transaction; its connection is replaced");
            // The new one opens first: a shared in-memory database lives
            // only as long as some connection to it does.
            let reopened = SqliteConnection::connect_with(&options).await.ok();
            if let Some(stale) = std::mem::replace(&mut connection, reopened) {
                let _ = stale.close().await;
            }
        }
    }
    // Jobs queued behind a close are refused (their senders see `closed`).
    drop(queue);
    if let Some(connection) = connection {
        let _ = connection.close().await;
    }
    if let Some(to) = closing {
        let _ = to.send(());
    }
}

/// Answers every job in `waiting` with `why`; returns a close request
/// among them.
fn fail_all(waiting: &mut VecDeque<Job>, why: &str) -> Option<oneshot::Sender<()>> {
    let mut closing = None;
    for job in waiting.drain(..) {
        match job {
            Job::Scalar(_, to) => drop(to.send(Err(batch_failed(why)))),
            Job::Execute(_, to) => drop(to.send(Err(batch_failed(why)))),
            Job::Close(to) => closing = closing.or(Some(to)),
        }
    }
    closing
}

/// How a [`batch`] ended.
struct Ended {
    /// A close request met on the way (the jobs before it are committed
    /// first).
    closing: Option<oneshot::Sender<()>>,
    /// Its transaction failed and `ROLLBACK` failed too: the connection
    /// may still be inside it.
    left_open: bool,
}

/// The first row of `query`, stepped to its end. `fetch_optional` stops
/// after the first row and discards what finishing the statement reports:
/// for a lone autocommit statement, that is its commit, and a commit that
/// failed (disk full, an I/O error) would answer with a row of a write
/// SQLite rolled back.
async fn first_row(query: Scalar, connection: &mut SqliteConnection) -> sqlx::Result<Option<bool>> {
    Ok(query.fetch_all(connection).await?.into_iter().next())
}

/// Runs one job on its own; `Err` carries a close request.
async fn run_one(
    job: Job,
    connection: &mut SqliteConnection,
) -> Result<Option<Answer>, oneshot::Sender<()>> {
    match job {
        Job::Scalar(query, to) => {
            let _ = to.send(first_row(query, connection).await);
        }
        Job::Execute(statement, to) => {
            let result = statement.execute(&mut *connection).await;
            let _ = to.send(result.map(|done| done.rows_affected()));
        }
        Job::Close(to) => return Err(to),
    }
    Ok(None)
}

/// One group commit of the jobs waiting (and those that arrive while it
/// runs, up to [`MAX_BATCH`]).
async fn batch(
    connection: &mut SqliteConnection,
    waiting: &mut VecDeque<Job>,
    queue: &mut mpsc::UnboundedReceiver<Job>,
) -> Ended {
    let mut answers = Vec::with_capacity(waiting.len());
    let mut closing = None;
    let mut failure = sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut *connection)
        .await
        .err();
    // A `BEGIN` that failed (the file lock held past the busy timeout)
    // opened nothing for a rollback to close.
    let begun = failure.is_none();
    let mut taken = 0;
    while failure.is_none() && closing.is_none() {
        let job = match waiting.pop_front() {
            Some(job) => job,
            None if taken < MAX_BATCH => match queue.try_recv() {
                Ok(job) => job,
                Err(_) => break,
            },
            None => break,
        };
        taken += 1;
        match job {
            Job::Scalar(query, to) => match first_row(query, connection).await {
                Ok(value) => answers.push(Answer::Scalar(value, to)),
                // Undone alone: its caller is told, the batch goes on.
                Err(error) if statement_only(&error) => drop(to.send(Err(error))),
                Err(error) => {
                    let _ = to.send(Err(batch_failed(&error.to_string())));
                    failure = Some(error);
                }
            },
            Job::Execute(statement, to) => match statement.execute(&mut *connection).await {
                Ok(done) => answers.push(Answer::Execute(done.rows_affected(), to)),
                Err(error) if statement_only(&error) => drop(to.send(Err(error))),
                Err(error) => {
                    let _ = to.send(Err(batch_failed(&error.to_string())));
                    failure = Some(error);
                }
            },
            Job::Close(to) => closing = Some(to),
        }
    }
    if failure.is_none() {
        failure = sqlx::query("COMMIT").execute(&mut *connection).await.err();
    }
    let mut left_open = false;
    match failure {
        None => answers.into_iter().for_each(Answer::send),
        Some(error) => {
            // Whatever SQLite already undid, nothing of this batch stays.
            // A rollback that fails may leave the transaction open (an I/O
            // error), or find none (SQLite undid it itself): either way
            // the connection is replaced, so no later statement runs in it.
            if begun {
                let rollback = sqlx::query("ROLLBACK").execute(&mut *connection).await;
                left_open = rollback.is_err();
            }
            let why = error.to_string();
            answers.into_iter().for_each(|answer| answer.fail(&why));
            // Jobs not yet run (a failed BEGIN) are answered with the same
            // failure, never run outside a transaction.
            let queued = fail_all(waiting, &why);
            closing = closing.or(queued);
        }
    }
    Ended { closing, left_open }
}
