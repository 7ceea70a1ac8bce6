//! The outbox statements in PostgreSQL's dialect. Time is the database's
//! `now()`; durations are bound in microseconds.

use super::enqueue::{EnqueueFuture, Message, OutboxConnection};

/// The topic filter parameter: a text array, or NULL for every topic.
pub(super) fn topics(topics: Option<&[String]>) -> Option<Vec<String>> {
    topics.map(<[String]>::to_vec)
}

impl OutboxConnection for sqlx::PgConnection {
    /// [`ENQUEUE`]; when it added nothing, the pair's row decides: there,
    /// the message was enqueued before (`false`); not there, the conflict
    /// was the delivery key's alone, and [`ENQUEUE_PAIR`] reports it as the
    /// unique violation it is.
    fn enqueue_message<'c>(&'c mut self, message: &'c Message) -> EnqueueFuture<'c> {
        Box::pin(async move {
            let insert = |statement| {
                sqlx::query_scalar::<_, i64>(statement)
                    .bind(&message.topic)
                    .bind(&message.source)
                    .bind(&message.delivery_key)
                    .bind(&message.payload)
                    .bind(&message.content_type)
                    .bind(message.max_attempts)
            };
            if insert(ENQUEUE).fetch_optional(&mut *self).await?.is_some() {
                return Ok(true);
            }
            let enqueued: bool = sqlx::query_scalar(PAIR_EXISTS)
                .bind(&message.topic)
                .bind(&message.source)
                .fetch_one(&mut *self)
                .await?;
            if enqueued {
                return Ok(false);
            }
            Ok(insert(ENQUEUE_PAIR).fetch_optional(self).await?.is_some())
        })
    }
}

/// Any conflict adds nothing and returns no row. Every unique index
/// arbitrates: with the pair's alone, an insert racing another of the same
/// pair (and so of the same derived key) could pass the pair's check
/// before the other wrote its entries and then fail on the key's index,
/// aborting the caller's transaction, instead of adding nothing.
const ENQUEUE: &str = "
INSERT INTO outbox_messages (topic, source, delivery_key, payload, content_type, max_attempts)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT DO NOTHING
RETURNING id";

/// Whether the pair's row is there.
const PAIR_EXISTS: &str =
    "SELECT EXISTS (SELECT 1 FROM outbox_messages WHERE topic = $1 AND source = $2)";

/// A conflict on (topic, source) adds nothing; a conflict on the delivery
/// key alone is the unique violation.
const ENQUEUE_PAIR: &str = "
INSERT INTO outbox_messages (topic, source, delivery_key, payload, content_type, max_attempts)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (topic, source) DO NOTHING
RETURNING id";

/// Due rows through the partial `outbox_messages_due` index; rows another
/// claimer has locked are skipped (`SKIP LOCKED`), so concurrent claimers
/// never wait for or share a row. Each row gets its own owner token.
///
/// The locking `SELECT … LIMIT` is a `MATERIALIZED` CTE: as an `IN (…)`
/// subquery the planner may rescan it, and a rescan skips the rows this
/// statement already changed and locks the next ones, taking more than
/// `LIMIT` rows (seen with the sweep: `LIMIT 1` deleted two).
pub(super) const CLAIM: &str = "
WITH due AS MATERIALIZED (
    SELECT id FROM outbox_messages
    WHERE state IN ('available', 'retryable') AND next_attempt_at <= now()
      AND ($2::text[] IS NULL OR topic = ANY($2::text[]))
    ORDER BY next_attempt_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_messages AS m
SET state = 'running',
    attempt = LEAST(m.attempt, 2147483646) + 1,
    owner = uuid_send(gen_random_uuid()),
    lease_expires_at = now() + $3::bigint * interval '1 microsecond',
    updated_at = now()
FROM due
WHERE m.id = due.id AND m.state IN ('available', 'retryable')
RETURNING m.id, m.owner, convert_to(m.topic, 'UTF8') AS topic,
          convert_to(m.source, 'UTF8') AS source,
          convert_to(m.delivery_key, 'UTF8') AS delivery_key, m.payload,
          convert_to(m.content_type, 'UTF8') AS content_type,
          m.attempt::int8 AS attempt, m.max_attempts::int8 AS max_attempts";

/// A claimed row that could not be read back: `dead` at once, never sent.
pub(super) const BURY: &str = "
UPDATE outbox_messages
SET state = 'dead', owner = NULL, lease_expires_at = NULL, updated_at = now(),
    last_error_class = 'unreadable', last_status = NULL, last_request_id = NULL,
    last_error = $3
WHERE id = $1 AND owner = $2 AND state = 'running'";

pub(super) const RENEW: &str = "
UPDATE outbox_messages
SET lease_expires_at = now() + $3::bigint * interval '1 microsecond'
WHERE id = $1 AND owner = $2 AND state = 'running'";

pub(super) const COMPLETE: &str = "
UPDATE outbox_messages
SET state = 'completed', owner = NULL, lease_expires_at = NULL,
    completed_at = now(), updated_at = now(),
    last_error_class = NULL, last_error = NULL,
    last_status = $3, last_request_id = $4
WHERE id = $1 AND owner = $2 AND state = 'running'";

pub(super) const FAIL: &str = "
UPDATE outbox_messages
SET state = CASE WHEN $3 OR attempt >= max_attempts THEN 'dead' ELSE 'retryable' END,
    owner = NULL, lease_expires_at = NULL,
    next_attempt_at = now() + $4::bigint * interval '1 microsecond',
    updated_at = now(),
    last_error_class = $5, last_status = $6, last_request_id = $7, last_error = $8
WHERE id = $1 AND owner = $2 AND state = 'running'
RETURNING state";

pub(super) const RELEASE: &str = "
UPDATE outbox_messages
SET state = 'retryable', owner = NULL, lease_expires_at = NULL,
    next_attempt_at = now(), updated_at = now()
WHERE id = $1 AND owner = $2 AND state = 'running'";

/// Expired leases, oldest first, through `outbox_messages_leases`. Rows
/// another rescuer (or a worker completing) has locked are skipped, and the
/// outer condition is checked again on the locked row, so each expired row
/// is re-queued once.
pub(super) const RESCUE: &str = "
WITH expired AS MATERIALIZED (
    SELECT id FROM outbox_messages
    WHERE state = 'running' AND lease_expires_at <= now()
    ORDER BY lease_expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_messages
SET state = CASE WHEN attempt >= max_attempts THEN 'dead' ELSE 'retryable' END,
    owner = NULL, lease_expires_at = NULL,
    next_attempt_at = now(), updated_at = now(),
    last_error_class = 'lease_expired', last_status = NULL, last_request_id = NULL,
    last_error = 'the worker holding the row did not finish within its lease'
FROM expired
WHERE outbox_messages.id = expired.id
  AND state = 'running' AND lease_expires_at <= now()
RETURNING outbox_messages.id, outbox_messages.state = 'dead' AS dead";

pub(super) const SWEEP: &str = "
WITH old AS MATERIALIZED (
    SELECT id FROM outbox_messages
    WHERE state = 'completed'
      AND completed_at <= now() - $1::bigint * interval '1 microsecond'
    ORDER BY completed_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox_messages USING old
WHERE outbox_messages.id = old.id AND state = 'completed'";

pub(super) const RETRY_DEAD: &str = "
UPDATE outbox_messages
SET state = 'available', attempt = 0, next_attempt_at = now(), updated_at = now()
WHERE id = $1 AND state = 'dead'";

pub(super) const PURGE_DEAD: &str = "
DELETE FROM outbox_messages WHERE id = $1 AND state = 'dead'";

pub(super) const PURGE_DEAD_OLDER: &str = "
DELETE FROM outbox_messages
WHERE state = 'dead' AND ($1::text IS NULL OR topic = $1)
  AND updated_at <= now() - $2::bigint * interval '1 microsecond'";

pub(super) const PAYLOAD: &str = "
SELECT payload, content_type FROM outbox_messages WHERE id = $1";

pub(super) const COUNTS: &str = "
SELECT state, count(*) FROM outbox_messages GROUP BY state";

macro_rules! status_select {
    ($rest:literal) => {
        concat!(
            "SELECT id, convert_to(topic, 'UTF8') AS topic, convert_to(source, 'UTF8') AS source,
                    convert_to(delivery_key, 'UTF8') AS delivery_key, state,
                    attempt::int8 AS attempt, max_attempts::int8 AS max_attempts,
                    last_error_class, last_status::integer AS last_status, last_request_id,
                    last_error,
                    (extract(epoch FROM next_attempt_at) * 1000000)::bigint AS next_attempt_us,
                    (extract(epoch FROM updated_at) * 1000000)::bigint AS updated_us,
                    (extract(epoch FROM completed_at) * 1000000)::bigint AS completed_us
             FROM outbox_messages ",
            $rest
        )
    };
}

pub(super) const DEAD: &str = status_select!("WHERE state = 'dead' ORDER BY id LIMIT $1");

pub(super) const STATUS: &str = status_select!("WHERE topic = $1 AND source = $2");
