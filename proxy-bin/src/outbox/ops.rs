//! The operator's outbox operations, shared by the admin API
//! (`admin/outbox.rs`) and the command line (`outbox counts|dead|retry|purge`):
//! each answers JSON, the same on both.

use std::time::{Duration, SystemTime};

use serde_json::{json, Value};
use tower_idempotency::outbox::{MessageStatus, Outbox, State};

/// The most dead rows listed at once.
pub const MAX_DEAD: usize = 1000;

/// Why an operation gave no answer: an HTTP status for the admin API
/// (the command line exits with 2, as for any failed outbox command) and a
/// message.
#[derive(Debug)]
pub struct Refused {
    /// 400 (bad request), 404 (no such row) or 503 (database error).
    pub status: u16,
    /// What is wrong, and what is expected.
    pub message: String,
}

impl Refused {
    /// A bad request.
    pub fn bad(message: impl Into<String>) -> Self {
        Refused {
            status: 400,
            message: message.into(),
        }
    }

    fn unavailable(error: impl std::fmt::Display) -> Self {
        Refused {
            status: 503,
            message: format!("the outbox database failed: {error}"),
        }
    }
}

/// Rows per state, and the total.
pub async fn counts(outbox: &Outbox) -> Result<Value, Refused> {
    let counts = outbox.counts().await.map_err(Refused::unavailable)?;
    let mut answer = serde_json::Map::new();
    for state in State::ALL {
        answer.insert(state.as_str().to_owned(), counts.get(state).into());
    }
    answer.insert("total".to_owned(), counts.total().into());
    Ok(Value::Object(answer))
}

/// Up to `limit` dead rows, oldest first, with their error columns; with
/// their payloads only when `payload` is set.
pub async fn dead(outbox: &Outbox, limit: usize, payload: bool) -> Result<Value, Refused> {
    let rows = outbox
        .dead(limit.min(MAX_DEAD))
        .await
        .map_err(Refused::unavailable)?;
    let mut listed = Vec::with_capacity(rows.len());
    for row in rows {
        let mut entry = status_json(&row);
        if payload {
            if let Some((bytes, content_type)) =
                outbox.payload(row.id).await.map_err(Refused::unavailable)?
            {
                entry["content_type"] = content_type.into();
                match String::from_utf8(bytes) {
                    Ok(text) => entry["payload"] = text.into(),
                    Err(error) => entry["payload_hex"] = hex(error.as_bytes()).into(),
                }
            }
        }
        listed.push(entry);
    }
    Ok(json!({ "dead": listed }))
}

/// Puts dead row `id` back in the queue with a fresh attempt budget.
pub async fn retry(outbox: &Outbox, id: i64) -> Result<Value, Refused> {
    if outbox.retry_dead(id).await.map_err(Refused::unavailable)? {
        Ok(json!({ "id": id, "retried": true }))
    } else {
        Err(Refused {
            status: 404,
            message: format!("no dead row with id {id}"),
        })
    }
}

/// Which dead rows to delete: one by id, or those older than a duration
/// (optionally of one topic). There is no "everything" without saying
/// so: `older_than = 0s` is every dead row.
#[derive(Debug, Default)]
pub struct Purge {
    /// One dead row.
    pub id: Option<i64>,
    /// Dead rows last changed longer ago than this.
    pub older_than: Option<Duration>,
    /// Only this topic's (with `older_than`).
    pub topic: Option<String>,
}

/// What [`Purge`] needs, for error messages.
pub const PURGE_USAGE: &str = "say which dead rows to purge: id=N, or older_than=DURATION \
     (e.g. 7d; 0s for every dead row) with an optional topic=NAME";

/// Deletes the dead rows `purge` selects.
pub async fn purge(outbox: &Outbox, purge: &Purge) -> Result<Value, Refused> {
    let purged = match (purge.id, purge.older_than) {
        (Some(id), None) if purge.topic.is_none() => {
            if !outbox.purge_dead(id).await.map_err(Refused::unavailable)? {
                return Err(Refused {
                    status: 404,
                    message: format!("no dead row with id {id}"),
                });
            }
            1
        }
        (None, Some(older_than)) => outbox
            .purge_dead_older_than(purge.topic.as_deref(), older_than)
            .await
            .map_err(Refused::unavailable)?,
        _ => return Err(Refused::bad(PURGE_USAGE)),
    };
    Ok(json!({ "purged": purged }))
}

/// A row as JSON: everything but the payload; times in RFC 3339 (UTC).
fn status_json(row: &MessageStatus) -> Value {
    json!({
        "id": row.id,
        "topic": row.topic,
        "source": row.source,
        "delivery_key": row.delivery_key,
        "state": row.state.as_str(),
        "attempt": row.attempt,
        "max_attempts": row.max_attempts,
        "last_error_class": row.last_error_class,
        "last_status": row.last_status,
        "last_request_id": row.last_request_id,
        "last_error": row.last_error,
        "next_attempt_at": time(row.next_attempt_at),
        "updated_at": time(row.updated_at),
    })
}

fn time(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
