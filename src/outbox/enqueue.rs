//! Writing outbox rows inside the caller's transaction.

use std::future::Future;
use std::pin::Pin;

use sha2::{Digest, Sha256};

use super::store::OutboxError;

/// Longest `topic` and `source`, in bytes (the schema checks the same).
pub(crate) const MAX_NAME: usize = 200;

/// One message to enqueue: what goes to which integration about which
/// business row.
///
/// Its `Debug` output leaves out the payload.
#[derive(Clone)]
pub struct Message {
    pub(crate) topic: String,
    pub(crate) source: String,
    pub(crate) delivery_key: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) content_type: String,
    pub(crate) max_attempts: i32,
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Message")
            .field("topic", &self.topic)
            .field("source", &self.source)
            .field("delivery_key", &self.delivery_key)
            .field("payload_len", &self.payload.len())
            .field("content_type", &self.content_type)
            .field("max_attempts", &self.max_attempts)
            .finish()
    }
}

impl Message {
    /// The attempts a message gets unless [`max_attempts`](Message::max_attempts)
    /// says otherwise (the schema's default too).
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 12;

    /// A message for integration `topic` (e.g. `crm`) about business row
    /// `source` (e.g. a submission id), with a JSON payload.
    ///
    /// Its delivery key is derived from (`topic`, `source`) alone — see
    /// [`Message::derived_key`] — so the same pair always carries the same
    /// key, even if the row was swept by retention and enqueued again.
    pub fn new(topic: impl Into<String>, source: impl Into<String>, payload: Vec<u8>) -> Self {
        let topic = topic.into();
        let source = source.into();
        Message {
            delivery_key: Self::derived_key(&topic, &source),
            topic,
            source,
            payload,
            content_type: "application/json".to_owned(),
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS as i32,
        }
    }

    /// Uses `key` as the delivery key instead of the derived one (for
    /// example a key the provider issued). It must be unique across the
    /// table and visible ASCII without `"`, `,` or `;` (it is sent bare as
    /// `Idempotency-Key`, which receivers read as one token) or `.` (it is
    /// the signed `webhook-id`, joined to the timestamp by `.`).
    pub fn delivery_key(mut self, key: impl Into<String>) -> Self {
        self.delivery_key = key.into();
        self
    }

    /// The payload's media type (default `application/json`).
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = content_type.into();
        self
    }

    /// How many attempts the message gets before it goes to `dead`
    /// (at least 1; default [`DEFAULT_MAX_ATTEMPTS`](Message::DEFAULT_MAX_ATTEMPTS)).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.clamp(1, i32::MAX as u32) as i32;
        self
    }

    /// The key [`Message::new`] gives (`topic`, `source`): a UUID
    /// (version 8) made of the SHA-256 of both, length-prefixed so that no
    /// two pairs share a key. Stable across versions of this crate.
    pub fn derived_key(topic: &str, source: &str) -> String {
        let mut hash = Sha256::new();
        hash.update(b"tower-idempotency outbox delivery key\0");
        hash.update((topic.len() as u64).to_be_bytes());
        hash.update(topic.as_bytes());
        hash.update(source.as_bytes());
        let digest = hash.finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        bytes[6] = (bytes[6] & 0x0f) | 0x80; // version 8
        bytes[8] = (bytes[8] & 0x3f) | 0x80; // RFC 9562 variant
        let hex = hex::encode(bytes);
        format!(
            "{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        )
    }

    /// The integration.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The business row.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The delivery key sent with every attempt.
    pub fn key(&self) -> &str {
        &self.delivery_key
    }

    pub(crate) fn validate(&self) -> Result<(), OutboxError> {
        if self.topic.is_empty() || self.topic.len() > MAX_NAME {
            return Err(OutboxError::Invalid("topic must be 1 to 200 bytes"));
        }
        if self.source.is_empty() || self.source.len() > MAX_NAME {
            return Err(OutboxError::Invalid("source must be 1 to 200 bytes"));
        }
        if !valid_key(&self.delivery_key) {
            return Err(OutboxError::Invalid(
                "delivery key must be 1 to 255 bytes of visible ASCII, without `\"`, `,`, `;` or `.`",
            ));
        }
        if http::HeaderValue::from_str(&self.content_type).is_err() {
            return Err(OutboxError::Invalid("content type is not a header value"));
        }
        Ok(())
    }
}

/// Whether `key` can be a delivery key: a bare key token
/// ([`crate::key::is_bare_token`]: 1 to 255 bytes of visible ASCII but `"`,
/// `,` and `;`). It is sent bare as `Idempotency-Key`, and an
/// idempotent receiver (this crate's layer, `idempotency-proxy`, any reader
/// of the IETF draft's sf-string) refuses a bare key holding those, or
/// reads `"k"` as `k`: the row would go `dead` on its first attempt, or two
/// rows share one key at the receiver. Nor `.`: the key is the signed
/// `webhook-id`, and the signature covers `{id}.{timestamp}.{body}`, so a
/// delivery of `k.T2` sent at `T1` would verify as `k` sent at `T2` with
/// the body `T1.{body}`: a new key at the receiver, run again.
pub(crate) fn valid_key(key: &str) -> bool {
    crate::key::is_bare_token(key.as_bytes()) && !key.contains('.')
}

/// The future [`OutboxConnection::enqueue_message`] returns.
pub type EnqueueFuture<'c> = Pin<Box<dyn Future<Output = Result<bool, sqlx::Error>> + Send + 'c>>;

/// A connection the outbox can be written through: `PgConnection` or
/// `SqliteConnection` (sealed). A transaction dereferences to one
/// (`&mut *tx`), as does a pooled connection (`&mut *conn`).
pub trait OutboxConnection: Send + sealed::Sealed {
    /// Writes `message`; `true` when a row was added. Use [`enqueue`],
    /// which validates the message first.
    #[doc(hidden)]
    fn enqueue_message<'c>(&'c mut self, message: &'c Message) -> EnqueueFuture<'c>;
}

pub(crate) mod sealed {
    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for sqlx::PgConnection {}
    #[cfg(feature = "sqlite")]
    impl Sealed for sqlx::SqliteConnection {}
}

/// Enqueues `message` on `connection` — typically the caller's open
/// transaction (`&mut *tx`), so the message commits or rolls back with the
/// business row written in it. Returns `true` when a row was added, `false`
/// when one for the same (`topic`, `source`) already exists (it is left as
/// it is: enqueueing twice adds nothing). The future is `Send`, so it can
/// be awaited in any handler or spawned task.
///
/// The same as this SQL (PostgreSQL; `?1`… on SQLite):
///
/// ```sql
/// INSERT INTO outbox_messages (topic, source, delivery_key, payload, content_type, max_attempts)
/// VALUES ($1, $2, $3, $4, $5, $6)
/// ON CONFLICT (topic, source) DO NOTHING
/// ```
///
/// A delivery key already used by another (`topic`, `source`) is an error
/// (the unique constraint on `delivery_key`), not a silent skip. On
/// PostgreSQL the insert says `ON CONFLICT DO NOTHING`, every unique index
/// arbitrating, so the same message enqueued by transactions racing each
/// other is added once and is `false` for the others, never a unique
/// violation; when it added nothing and no row holds the pair, the key was
/// taken by another pair, and that is reported.
pub async fn enqueue<C>(connection: &mut C, message: &Message) -> Result<bool, OutboxError>
where
    C: OutboxConnection + ?Sized,
{
    message.validate()?;
    connection
        .enqueue_message(message)
        .await
        .map_err(OutboxError::Database)
}

/// The PostgreSQL channel workers `LISTEN` on.
pub const NOTIFY_CHANNEL: &str = "outbox_messages";

/// Wakes idle workers listening on this PostgreSQL database
/// ([`WorkerConfig::listen`](super::WorkerConfig::listen)) when the caller's
/// transaction commits; call it once per transaction after enqueueing.
/// Without it, messages are still delivered, at the workers' next poll. The
/// same as `SELECT pg_notify('outbox_messages', '')`.
///
/// A committing `NOTIFY` takes a database-wide lock until its commit is
/// flushed, so notifying transactions commit one at a time: skip it where
/// enqueue throughput matters more than delivery latency.
#[cfg(feature = "postgres")]
pub async fn notify(connection: &mut sqlx::PgConnection) -> Result<(), OutboxError> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(NOTIFY_CHANNEL)
        .execute(connection)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_are_uuids_unique_per_pair() {
        let key = Message::derived_key("crm", "sub_1");
        assert_eq!(key.len(), 36);
        assert_eq!(&key[14..15], "8", "version 8: {key}");
        assert!(
            matches!(&key[19..20], "8" | "9" | "a" | "b"),
            "variant: {key}"
        );
        assert_eq!(key, Message::derived_key("crm", "sub_1"));
        // The length prefix keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(
            Message::derived_key("ab", "c"),
            Message::derived_key("a", "bc")
        );
        assert_ne!(key, Message::derived_key("mail", "sub_1"));
    }

    #[test]
    fn invalid_messages_are_refused() {
        let ok = Message::new("crm", "s", vec![]);
        assert!(ok.validate().is_ok());
        assert!(Message::new("", "s", vec![]).validate().is_err());
        assert!(Message::new("crm", "x".repeat(201), vec![])
            .validate()
            .is_err());
        assert!(ok.clone().delivery_key("a b").validate().is_err());
        assert!(ok.clone().delivery_key("").validate().is_err());
        assert!(ok.clone().delivery_key("k".repeat(256)).validate().is_err());
    }

    #[test]
    fn debug_leaves_out_the_payload() {
        let message = Message::new("crm", "s", b"jane@example.com".to_vec());
        let debug = format!("{message:?}");
        assert!(!debug.contains("jane"), "{debug}");
    }
}
