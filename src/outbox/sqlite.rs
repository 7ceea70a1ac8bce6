//! The outbox statements in SQLite's dialect. Time is SQLite's own clock,
//! `unixepoch('subsec')` (the same value throughout a statement);
//! durations are bound in microseconds. Every write is one statement, and
//! SQLite runs one write at a time, so a claim or a rescue is atomic with
//! respect to every other connection and process on the file.

use super::enqueue::{EnqueueFuture, Message, OutboxConnection};

/// The topic filter parameter: a JSON array of names, or NULL for every
/// topic.
pub(super) fn topics(topics: Option<&[String]>) -> Option<String> {
    topics.map(|topics| serde_json::Value::from(topics.to_vec()).to_string())
}

impl OutboxConnection for sqlx::SqliteConnection {
    fn enqueue_message<'c>(&'c mut self, message: &'c Message) -> EnqueueFuture<'c> {
        Box::pin(async move {
            let id: Option<i64> = sqlx::query_scalar(ENQUEUE)
                .bind(&message.topic)
                .bind(&message.source)
                .bind(&message.delivery_key)
                .bind(&message.payload)
                .bind(&message.content_type)
                .bind(message.max_attempts)
                .fetch_optional(self)
                .await?;
            Ok(id.is_some())
        })
    }
}

/// As for PostgreSQL.
const ENQUEUE: &str = "
INSERT INTO outbox_messages (topic, source, delivery_key, payload, content_type, max_attempts)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (topic, source) DO NOTHING
RETURNING id";

/// One write statement: atomic against every other writer of the file.
pub(super) const CLAIM: &str = "
UPDATE outbox_messages
SET state = 'running',
    attempt = attempt + 1,
    owner = randomblob(16),
    lease_expires_at = unixepoch('subsec') + ?3 / 1e6,
    updated_at = unixepoch('subsec')
WHERE id IN (SELECT id FROM outbox_messages
             WHERE state IN ('available', 'retryable')
               AND next_attempt_at <= unixepoch('subsec')
               AND (?2 IS NULL OR topic IN (SELECT value FROM json_each(?2)))
             ORDER BY next_attempt_at, id
             LIMIT ?1)
RETURNING id, owner, CAST(topic AS BLOB) AS topic, CAST(source AS BLOB) AS source,
          CAST(delivery_key AS BLOB) AS delivery_key, CAST(payload AS BLOB) AS payload,
          CAST(content_type AS BLOB) AS content_type,
          CASE WHEN typeof(attempt) = 'integer' THEN attempt ELSE -1 END AS attempt,
          CASE WHEN typeof(max_attempts) = 'integer' THEN max_attempts ELSE -1 END
            AS max_attempts";

/// As for PostgreSQL.
pub(super) const BURY: &str = "
UPDATE outbox_messages
SET state = 'dead', owner = NULL, lease_expires_at = NULL, updated_at = unixepoch('subsec'),
    last_error_class = 'unreadable', last_status = NULL, last_request_id = NULL,
    last_error = ?3
WHERE id = ?1 AND owner = ?2 AND state = 'running'";

pub(super) const RENEW: &str = "
UPDATE outbox_messages
SET lease_expires_at = unixepoch('subsec') + ?3 / 1e6
WHERE id = ?1 AND owner = ?2 AND state = 'running'";

pub(super) const COMPLETE: &str = "
UPDATE outbox_messages
SET state = 'completed', owner = NULL, lease_expires_at = NULL,
    completed_at = unixepoch('subsec'), updated_at = unixepoch('subsec'),
    last_error_class = NULL, last_error = NULL,
    last_status = ?3, last_request_id = ?4
WHERE id = ?1 AND owner = ?2 AND state = 'running'";

pub(super) const FAIL: &str = "
UPDATE outbox_messages
SET state = CASE WHEN ?3 OR attempt >= max_attempts THEN 'dead' ELSE 'retryable' END,
    owner = NULL, lease_expires_at = NULL,
    next_attempt_at = unixepoch('subsec') + ?4 / 1e6,
    updated_at = unixepoch('subsec'),
    last_error_class = ?5, last_status = ?6, last_request_id = ?7, last_error = ?8
WHERE id = ?1 AND owner = ?2 AND state = 'running'
RETURNING state";

pub(super) const RELEASE: &str = "
UPDATE outbox_messages
SET state = 'retryable', owner = NULL, lease_expires_at = NULL,
    next_attempt_at = unixepoch('subsec'), updated_at = unixepoch('subsec')
WHERE id = ?1 AND owner = ?2 AND state = 'running'";

pub(super) const RESCUE: &str = "
UPDATE outbox_messages
SET state = CASE WHEN attempt >= max_attempts THEN 'dead' ELSE 'retryable' END,
    owner = NULL, lease_expires_at = NULL,
    next_attempt_at = unixepoch('subsec'), updated_at = unixepoch('subsec'),
    last_error_class = 'lease_expired', last_status = NULL, last_request_id = NULL,
    last_error = 'the worker holding the row did not finish within its lease'
WHERE id IN (SELECT id FROM outbox_messages
             WHERE state = 'running' AND lease_expires_at <= unixepoch('subsec')
             ORDER BY lease_expires_at
             LIMIT ?1)
RETURNING id, state = 'dead' AS dead";

pub(super) const SWEEP: &str = "
DELETE FROM outbox_messages
WHERE id IN (SELECT id FROM outbox_messages
             WHERE state = 'completed'
               AND completed_at <= unixepoch('subsec') - ?1 / 1e6
             ORDER BY completed_at
             LIMIT ?2)";

pub(super) const RETRY_DEAD: &str = "
UPDATE outbox_messages
SET state = 'available', attempt = 0, next_attempt_at = unixepoch('subsec'),
    updated_at = unixepoch('subsec')
WHERE id = ?1 AND state = 'dead'";

pub(super) const PURGE_DEAD: &str = "
DELETE FROM outbox_messages WHERE id = ?1 AND state = 'dead'";

pub(super) const PURGE_DEAD_OLDER: &str = "
DELETE FROM outbox_messages
WHERE state = 'dead' AND (?1 IS NULL OR topic = ?1)
  AND updated_at <= unixepoch('subsec') - ?2 / 1e6";

pub(super) const PAYLOAD: &str = "
SELECT CAST(payload AS BLOB) AS payload, content_type FROM outbox_messages WHERE id = ?1";

pub(super) const COUNTS: &str = "
SELECT state, count(*) FROM outbox_messages GROUP BY state";

macro_rules! status_select {
    ($rest:literal) => {
        concat!(
            "SELECT id, CAST(topic AS BLOB) AS topic, CAST(source AS BLOB) AS source,
                    CAST(delivery_key AS BLOB) AS delivery_key, state,
                    CAST(attempt AS INTEGER) AS attempt,
                    CAST(max_attempts AS INTEGER) AS max_attempts,
                    last_error_class, last_status, last_request_id, last_error,
                    CAST(round(next_attempt_at * 1e6) AS INTEGER) AS next_attempt_us,
                    CAST(round(updated_at * 1e6) AS INTEGER) AS updated_us,
                    CAST(round(completed_at * 1e6) AS INTEGER) AS completed_us
             FROM outbox_messages ",
            $rest
        )
    };
}

pub(super) const DEAD: &str = status_select!("WHERE state = 'dead' ORDER BY id LIMIT ?1");

pub(super) const STATUS: &str = status_select!("WHERE topic = ?1 AND source = ?2");
