//! The connections the store runs every request's statements on, kept
//! without sqlx's pool.
//!
//! sqlx 0.8's pool tests every connection it takes back with a `Sync`
//! round trip, in a task spawned for it, and the connection serves no one
//! until that answer is in: each statement held a connection for two round
//! trips. With a pool as large as the load (64 connections for 64
//! clients), replays ran at 0.64× the database's own `SELECT` rate. Here a
//! connection is idle again the moment its statement answered.
//!
//! What sqlx's test guarded against is a connection left in an unknown
//! state: a statement abandoned halfway (the engine gave up at its
//! `store_timeout`, the client went away) may have written half a
//! message. A [`Lease`] therefore gives its connection back only through
//! [`Lease::finish`], and only when the statement ended with an answer of
//! the database (rows, or an error the database sent); dropped any other
//! way, or after a failure of the connection itself, it closes the
//! connection.

use std::sync::Mutex;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

/// At most `max` connections to one database, opened on demand and closed
/// after `idle_timeout` unused.
#[derive(Debug)]
pub(super) struct Connections {
    options: PgConnectOptions,
    /// Idle connections, the longest idle first.
    idle: Mutex<Vec<Idle>>,
    /// One permit per connection that may be out; closed by [`close`](Self::close).
    permits: Semaphore,
    acquire_timeout: Duration,
    idle_timeout: Option<Duration>,
}

#[derive(Debug)]
struct Idle {
    connection: PgConnection,
    since: Instant,
}

impl Connections {
    /// Up to `max` connections made with `options`.
    pub(super) fn new(
        options: PgConnectOptions,
        max: u32,
        acquire_timeout: Duration,
        idle_timeout: Option<Duration>,
    ) -> Self {
        Connections {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(max.max(1) as usize),
            acquire_timeout,
            idle_timeout,
        }
    }

    /// A connection for one statement: the most recently used idle one, or
    /// a new one. Waits while `max` are out; fails with
    /// [`sqlx::Error::PoolTimedOut`] when none is free (or none could be
    /// opened) within the acquire timeout, with
    /// [`sqlx::Error::PoolClosed`] once [`close`](Self::close) was called,
    /// and with the connection's error when the database refused it.
    pub(super) async fn acquire(&self) -> Result<Lease<'_>, sqlx::Error> {
        let deadline = Instant::now() + self.acquire_timeout;
        let permit = match tokio::time::timeout_at(deadline, self.permits.acquire()).await {
            Err(_) => return Err(sqlx::Error::PoolTimedOut),
            Ok(Err(_)) => return Err(sqlx::Error::PoolClosed),
            Ok(Ok(permit)) => permit,
        };
        let connection = match self.take_idle() {
            Some(connection) => connection,
            None => tokio::time::timeout_at(deadline, PgConnection::connect_with(&self.options))
                .await
                .map_err(|_| sqlx::Error::PoolTimedOut)??,
        };
        Ok(Lease {
            connection: Some(connection),
            connections: self,
            _permit: permit,
        })
    }

    /// The most recently used idle connection, after closing those idle
    /// longer than the idle timeout.
    fn take_idle(&self) -> Option<PgConnection> {
        let (stale, connection) = {
            let mut idle = self.idle.lock().unwrap();
            let stale = match self.idle_timeout {
                Some(timeout) => {
                    let count = idle
                        .iter()
                        .take_while(|idle| idle.since.elapsed() >= timeout)
                        .count();
                    idle.drain(..count).collect()
                }
                None => Vec::new(),
            };
            (stale, idle.pop().map(|idle| idle.connection))
        };
        drop(stale);
        connection
    }

    /// Closes the idle connections; later [`acquire`](Self::acquire)s
    /// fail, and connections out now are closed when their statement ends.
    pub(super) fn close(&self) {
        self.permits.close();
        let idle = std::mem::take(&mut *self.idle.lock().unwrap());
        drop(idle);
    }
}

/// One connection, out for one statement. Dropped without
/// [`finish`](Lease::finish), it closes the connection.
#[derive(Debug)]
pub(super) struct Lease<'a> {
    connection: Option<PgConnection>,
    connections: &'a Connections,
    _permit: SemaphorePermit<'a>,
}

impl Lease<'_> {
    /// The connection to run the statement on.
    pub(super) fn connection(&mut self) -> &mut PgConnection {
        self.connection
            .as_mut()
            .expect("a lease holds its connection")
    }

    /// Gives the connection back for the next statement: only after the
    /// database answered the last one in full.
    pub(super) fn release(mut self) {
        if self.connections.permits.is_closed() {
            return;
        }
        let connection = self
            .connection
            .take()
            .expect("a lease holds its connection");
        self.connections.idle.lock().unwrap().push(Idle {
            connection,
            since: Instant::now(),
        });
    }
}

impl super::sql::StatementLease for Lease<'_> {
    type Executor<'e>
        = &'e mut PgConnection
    where
        Self: 'e;

    fn executor(&mut self) -> &mut PgConnection {
        self.connection()
    }

    /// Gives the connection back when `result` shows it ready for the next
    /// statement: the database answered (rows, or an error it sent; sqlx
    /// reads any rest of the answer before its next statement). After an
    /// error of the connection itself (I/O, protocol, TLS) it is closed.
    fn finish<T>(self, result: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        if matches!(result, Ok(_) | Err(sqlx::Error::Database(_))) {
            self.release();
        }
        result
    }
}
