//! The connections the store runs its statements on, kept without sqlx's
//! pool.
//!
//! sqlx 0.8's pool tests every connection it takes back with a `Sync`
//! round trip, in a task spawned for it, and the connection serves no one
//! until that answer is in: each statement held a connection for two round
//! trips. With a pool as large as the load (64 connections for 64
//! clients), replays ran at 0.64× the database's own `SELECT` rate. Here a
//! connection is idle again the moment the database answered its
//! statement.
//!
//! What sqlx's test guarded against is a connection in an unknown state: a
//! statement abandoned halfway (the engine gave up at its `store_timeout`,
//! the client went away) may still run on the server, its answer unread.
//! A [`Lease`] dropped without [`finish`](StatementLease::finish) therefore
//! keeps its connection's permit while a task of its own waits (bounded)
//! for the server to be ready again, as sqlx's test did: the server never
//! holds more than `max` of the store's sessions, however many callers give
//! up. A connection whose server session ended, or that failed itself, is
//! closed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use sqlx::postgres::{PgConnection, PgDatabaseError, PgPool, PgSeverity};
use sqlx::Connection;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::store::sql::StatementLease;

/// How long a connection whose statement was abandoned may take to be
/// ready again before it is closed.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// One connection in this many (at least one, of a pool of two or more)
/// is kept for the [`Lane::Holder`]'s writes.
const KEPT_PER: usize = 8;

/// Who a connection is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lane {
    /// Any statement: reservations, reads, sweeps, the operator's.
    Any,
    /// The writes of a request that holds a key and runs (its renewals,
    /// its completion), which may also take the connections kept for
    /// them. Arrivals whose statements wait on the database (a row
    /// locked, a slow disk) can take every other connection; a holder whose
    /// renewals could not get one would lose its lease to a takeover and
    /// run a second time while it still runs.
    Holder,
}

/// At most the pool's `max_connections` connections, opened on demand by
/// the pool and detached from it, closed after its idle timeout unused and
/// at its maximum lifetime.
#[derive(Debug)]
pub(super) struct Connections {
    /// Where connections are opened and the limits read.
    pool: PgPool,
    /// Idle connections, the longest idle first; `None` once closed.
    idle: Mutex<Option<Vec<Idle>>>,
    /// One permit per connection that any statement may open.
    permits: Arc<Semaphore>,
    /// One permit per connection kept for [`Lane::Holder`] (together with
    /// `permits`, the pool's `max_connections`).
    kept: Arc<Semaphore>,
    /// Whether a task closes connections idle too long.
    reaping: AtomicBool,
}

#[derive(Debug)]
struct Idle {
    connection: Open,
    since: Instant,
}

/// A connection and when it was opened.
#[derive(Debug)]
struct Open {
    connection: PgConnection,
    opened: Instant,
}

impl Connections {
    /// Connections with `pool`'s connect options and limits.
    pub(super) fn new(pool: PgPool) -> Arc<Self> {
        let max = pool.options().get_max_connections().max(1) as usize;
        let kept = match max {
            1 => 0,
            _ => max.div_ceil(KEPT_PER),
        };
        Arc::new(Connections {
            pool,
            idle: Mutex::new(Some(Vec::new())),
            permits: Arc::new(Semaphore::new(max - kept)),
            kept: Arc::new(Semaphore::new(kept)),
            reaping: AtomicBool::new(false),
        })
    }

    /// A connection for one statement of `lane`: the most recently used
    /// idle one, or a new one. Waits while all that `lane` may use are
    /// out; fails with [`sqlx::Error::PoolTimedOut`] when none is free (or
    /// none could be opened) within the acquire timeout, with
    /// [`sqlx::Error::PoolClosed`] once [`close`](Self::close) was called,
    /// and with the connection's error when the database refused it.
    pub(super) async fn acquire(self: &Arc<Self>, lane: Lane) -> Result<Lease, sqlx::Error> {
        let deadline = Instant::now() + self.pool.options().get_acquire_timeout();
        let any = self.permits.clone().acquire_owned();
        let permit = async {
            match lane {
                Lane::Any => any.await,
                Lane::Holder => tokio::select! {
                    biased;
                    kept = self.kept.clone().acquire_owned() => kept,
                    any = any => any,
                },
            }
        };
        let permit = match tokio::time::timeout_at(deadline, permit).await {
            Err(_) => return Err(sqlx::Error::PoolTimedOut),
            Ok(Err(_)) => return Err(sqlx::Error::PoolClosed),
            Ok(Ok(permit)) => permit,
        };
        let connection = match self.take_idle()? {
            Some(connection) => connection,
            // Opened by the pool (its connect options and `after_connect`
            // hook, a `search_path` set there included), then detached: the
            // pool counts it no more, the permit does.
            None => {
                let connection = tokio::time::timeout_at(deadline, self.pool.acquire())
                    .await
                    .map_err(|_| sqlx::Error::PoolTimedOut)??;
                Open {
                    connection: connection.detach(),
                    opened: Instant::now(),
                }
            }
        };
        Ok(Lease {
            connection: Some(connection),
            connections: self.clone(),
            permit: Some(permit),
            discard: false,
        })
    }

    /// The most recently used idle connection that is not past the idle
    /// timeout or its lifetime (those are closed).
    fn take_idle(&self) -> Result<Option<Open>, sqlx::Error> {
        let mut guard = self.idle();
        let idle = guard.as_mut().ok_or(sqlx::Error::PoolClosed)?;
        let stale = self.drain_stale(idle);
        while let Some(Idle { connection, .. }) = idle.pop() {
            if !self.past_lifetime(&connection) {
                drop(guard);
                drop(stale);
                return Ok(Some(connection));
            }
        }
        drop(guard);
        drop(stale);
        Ok(None)
    }

    /// Takes out the connections idle longer than the idle timeout (the
    /// oldest are first).
    fn drain_stale(&self, idle: &mut Vec<Idle>) -> Vec<Idle> {
        let Some(timeout) = self.pool.options().get_idle_timeout() else {
            return Vec::new();
        };
        let count = idle
            .iter()
            .take_while(|idle| idle.since.elapsed() >= timeout)
            .count();
        idle.drain(..count).collect()
    }

    fn past_lifetime(&self, connection: &Open) -> bool {
        self.pool
            .options()
            .get_max_lifetime()
            .is_some_and(|lifetime| connection.opened.elapsed() >= lifetime)
    }

    /// Makes `connection` idle, unless the connections are closed or it is
    /// past its lifetime (then it is closed).
    fn give_back(self: &Arc<Self>, connection: Open) {
        if self.past_lifetime(&connection) {
            return;
        }
        let mut guard = self.idle();
        let Some(idle) = guard.as_mut() else { return };
        idle.push(Idle {
            connection,
            since: Instant::now(),
        });
        drop(guard);
        self.reap_later();
    }

    /// Starts the task that closes connections idle past the idle timeout,
    /// unless it runs: it ends when no connection is idle.
    fn reap_later(self: &Arc<Self>) {
        let Some(timeout) = self.pool.options().get_idle_timeout() else {
            return;
        };
        if self.reaping.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.reaping.store(false, Ordering::Release);
            return;
        };
        /// Clears the flag however the task ends (a runtime shut down
        /// while it slept included), so a later give-back starts another.
        struct Reaping(Weak<Connections>);
        impl Drop for Reaping {
            fn drop(&mut self) {
                if let Some(connections) = self.0.upgrade() {
                    connections.reaping.store(false, Ordering::Release);
                }
            }
        }
        let connections: Weak<Self> = Arc::downgrade(self);
        let reaping = Reaping(connections.clone());
        runtime.spawn(async move {
            let mut reaping = reaping;
            loop {
                tokio::time::sleep(timeout / 2).await;
                let Some(connections) = connections.upgrade() else {
                    return;
                };
                let stale;
                {
                    let mut guard = connections.idle();
                    let Some(idle) = guard.as_mut() else { return };
                    stale = connections.drain_stale(idle);
                    if idle.is_empty() {
                        // Cleared under the lock: a give-back after it
                        // starts another reaper.
                        connections.reaping.store(false, Ordering::Release);
                        reaping.0 = Weak::new();
                        drop(guard);
                        drop(stale);
                        return;
                    }
                }
                drop(stale);
            }
        });
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Option<Vec<Idle>>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the idle connections; later [`acquire`](Self::acquire)s
    /// fail, and connections out now are closed when their statement ends.
    pub(super) async fn close(&self) {
        self.permits.close();
        self.kept.close();
        let idle = self.idle().take().unwrap_or_default();
        for idle in idle {
            let _ = idle.connection.connection.close().await;
        }
    }
}

/// One connection, out for one statement, holding its permit.
#[derive(Debug)]
pub(super) struct Lease {
    connection: Option<Open>,
    connections: Arc<Connections>,
    permit: Option<OwnedSemaphorePermit>,
    /// Dropped without `finish`, the connection is closed rather than
    /// recovered (see [`Lease::discard_if_abandoned`]).
    discard: bool,
}

impl Lease {
    /// The connection to run the statement on.
    pub(super) fn connection(&mut self) -> &mut PgConnection {
        &mut self
            .connection
            .as_mut()
            .expect("a lease holds its connection")
            .connection
    }

    /// Closes the connection if this lease is dropped without being
    /// finished, instead of recovering it: for work that leaves session
    /// state behind when abandoned (the migrator's advisory lock).
    pub(super) fn discard_if_abandoned(&mut self) {
        self.discard = true;
    }

    /// Gives the connection back for the next statement: only after the
    /// database answered the last one in full.
    pub(super) fn release(mut self) {
        if let Some(connection) = self.connection.take() {
            self.connections.give_back(connection);
        }
    }

    /// Closes the connection.
    pub(super) fn close(mut self) {
        self.connection = None;
    }
}

impl StatementLease for Lease {
    type Executor<'e>
        = &'e mut PgConnection
    where
        Self: 'e;

    fn executor(&mut self) -> &mut PgConnection {
        self.connection()
    }

    /// Gives the connection back when `result` shows it ready for the next
    /// statement: the database answered (rows, or an error it sent about
    /// the statement; sqlx reads any rest of the answer before its next
    /// statement). Closes it after an error of the connection itself (I/O,
    /// protocol, TLS), one of the session (`FATAL`, `57P…`: the server is
    /// shutting down or ended it), or one that a reconnect may cure (a
    /// connection or resource error, a read-only server after a failover,
    /// a prepared statement the server did not know or knew already: a
    /// transaction-mode pooler moved the session, docs/scaling.md).
    /// A statement the server cancelled (`57014`, `statement_timeout`)
    /// leaves the connection usable.
    fn finish<T>(self, result: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        let reusable = match &result {
            Ok(_) => true,
            Err(sqlx::Error::Database(error)) => error
                .try_downcast_ref::<PgDatabaseError>()
                .is_some_and(|error| {
                    let code = error.code();
                    error.severity() == PgSeverity::Error
                        && !["08", "53", "57P"]
                            .iter()
                            .any(|class| code.starts_with(class))
                        && !["25006", "26000", "42P05"].contains(&code)
                }),
            Err(_) => false,
        };
        if reusable {
            self.release();
        } else {
            self.close();
        }
        result
    }
}

impl Drop for Lease {
    /// A statement abandoned halfway: its connection keeps its permit while
    /// a task waits for the server to be ready again (it may still be
    /// running the statement), then goes back to the idle list, or is
    /// closed after [`RECOVERY_TIMEOUT`] or an error.
    fn drop(&mut self) {
        if self.discard {
            return;
        }
        let (Some(mut open), Some(permit)) = (self.connection.take(), self.permit.take()) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let connections = self.connections.clone();
        runtime.spawn(async move {
            let ready = tokio::time::timeout(RECOVERY_TIMEOUT, open.connection.ping()).await;
            if matches!(ready, Ok(Ok(()))) {
                connections.give_back(open);
            }
            drop(permit);
        });
    }
}
