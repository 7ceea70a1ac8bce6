//! What the outbox answers about its rows: states, counts, one row's
//! status, and its errors.

use std::time::SystemTime;

/// What went wrong talking to the outbox table.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The database failed or could not be reached (the pool reconnects on
    /// its own; the call may be repeated).
    #[error("outbox database error: {0}")]
    Database(#[source] sqlx::Error),
    /// A migration failed.
    #[error("outbox migration failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// A row holds something this crate never writes.
    #[error("corrupt outbox row: {0}")]
    Corrupt(String),
    /// The message cannot be enqueued as given.
    #[error("invalid outbox message: {0}")]
    Invalid(&'static str),
}

impl From<sqlx::Error> for OutboxError {
    fn from(error: sqlx::Error) -> Self {
        OutboxError::Database(error)
    }
}

/// Where a row is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// Enqueued, never attempted.
    Available,
    /// Held by a worker under a lease.
    Running,
    /// Failed transiently; due again at its `next_attempt_at`.
    Retryable,
    /// Delivered (swept after the retention time).
    Completed,
    /// Failed permanently or out of attempts; kept until retried or purged.
    Dead,
}

impl State {
    /// Every state, in the order of a row's life.
    pub const ALL: [State; 5] = [
        State::Available,
        State::Running,
        State::Retryable,
        State::Completed,
        State::Dead,
    ];

    /// The value of the `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Available => "available",
            State::Running => "running",
            State::Retryable => "retryable",
            State::Completed => "completed",
            State::Dead => "dead",
        }
    }

    pub(super) fn parse(value: &str) -> Result<State, OutboxError> {
        State::ALL
            .into_iter()
            .find(|state| state.as_str() == value)
            .ok_or_else(|| OutboxError::Corrupt(format!("state `{value}`")))
    }
}

/// How many rows are in each state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Never attempted.
    pub available: u64,
    /// Held by a worker.
    pub running: u64,
    /// Waiting for their next attempt.
    pub retryable: u64,
    /// Delivered, not yet swept.
    pub completed: u64,
    /// Waiting for someone to look at them.
    pub dead: u64,
}

impl Counts {
    /// The count for `state`.
    pub fn get(&self, state: State) -> u64 {
        match state {
            State::Available => self.available,
            State::Running => self.running,
            State::Retryable => self.retryable,
            State::Completed => self.completed,
            State::Dead => self.dead,
        }
    }

    /// All rows.
    pub fn total(&self) -> u64 {
        State::ALL.into_iter().map(|state| self.get(state)).sum()
    }
}

/// One row as [`Outbox::status`](super::Outbox::status) reads it: everything but the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageStatus {
    /// The row id.
    pub id: i64,
    /// The integration.
    pub topic: String,
    /// The business row.
    pub source: String,
    /// The key sent with every attempt.
    pub delivery_key: String,
    /// Where the row is.
    pub state: State,
    /// Attempts started so far.
    pub attempt: u32,
    /// Attempts allowed before `dead`.
    pub max_attempts: u32,
    /// The last attempt's error class (`transient`, `permanent`,
    /// `lease_expired`); `None` after success.
    pub last_error_class: Option<String>,
    /// The receiver's status in the last attempt, if it answered.
    pub last_status: Option<u16>,
    /// The receiver's request id in the last attempt, if it sent one.
    pub last_request_id: Option<String>,
    /// A short reason for the last failure (never the payload).
    pub last_error: Option<String>,
    /// Not claimed before this time (database clock).
    pub next_attempt_at: SystemTime,
    /// The last change (database clock).
    pub updated_at: SystemTime,
    /// When it was delivered (database clock).
    pub completed_at: Option<SystemTime>,
}

/// A dead row, as [`Outbox::dead`](super::Outbox::dead) lists it.
pub type DeadMessage = MessageStatus;
