//! What a worker hands a deliverer, and what it gets back.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

/// One claimed row on its way to the receiver. Its `Debug` output leaves
/// out the payload.
#[derive(Clone)]
pub struct Delivery {
    pub(crate) id: i64,
    pub(crate) owner: [u8; 16],
    pub(crate) topic: String,
    pub(crate) source: String,
    pub(crate) delivery_key: String,
    pub(crate) payload: Bytes,
    pub(crate) content_type: String,
    pub(crate) attempt: u32,
    pub(crate) max_attempts: u32,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("id", &self.id)
            .field("topic", &self.topic)
            .field("source", &self.source)
            .field("delivery_key", &self.delivery_key)
            .field("payload_len", &self.payload.len())
            .field("attempt", &self.attempt)
            .field("max_attempts", &self.max_attempts)
            .finish()
    }
}

impl Delivery {
    /// The row id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The integration.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The business row.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The key to send downstream (`Idempotency-Key`, an external
    /// reference): the same in every attempt.
    pub fn delivery_key(&self) -> &str {
        &self.delivery_key
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The payload's media type.
    pub fn content_type(&self) -> &str {
        &self.content_type
    }

    /// This attempt's number, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Attempts allowed before the row goes to `dead`.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
}

/// The receiver accepted the delivery.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delivered {
    /// Its status, when it is an HTTP receiver.
    pub status: Option<u16>,
    /// Its request id, when it sent one (kept as the provider reference).
    pub request_id: Option<String>,
}

/// Whether a failed delivery is worth another attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Might succeed later (timeout, connection error, 408, 429, 5xx):
    /// retried after a backoff.
    Transient,
    /// Will not succeed as it is (any other 4xx, no destination, a
    /// malformed request): the row goes to `dead` at once.
    Permanent,
}

impl ErrorClass {
    /// The value written to `last_error_class`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Permanent => "permanent",
        }
    }

    /// `true` for [`ErrorClass::Permanent`].
    pub fn is_permanent(self) -> bool {
        self == ErrorClass::Permanent
    }

    /// The class of an HTTP status the receiver answered with (not for
    /// 2xx): 408, 429 and 5xx are transient, everything else permanent.
    pub fn of_status(status: u16) -> ErrorClass {
        match status {
            408 | 429 | 500..=599 => ErrorClass::Transient,
            _ => ErrorClass::Permanent,
        }
    }
}

/// A failed delivery. Everything in it is written to the row's error
/// columns, so it must never carry the payload (nor personal data from
/// it): `reason` is a short text the deliverer writes itself, cut at 200
/// bytes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} delivery failure: {reason}", class.as_str())]
pub struct DeliveryError {
    /// Retry or not.
    pub class: ErrorClass,
    /// The receiver's status, if it answered.
    pub status: Option<u16>,
    /// The receiver's request id, if it sent one.
    pub request_id: Option<String>,
    /// The receiver's `Retry-After`: the next attempt is not earlier.
    pub retry_after: Option<Duration>,
    /// A short reason (e.g. `HTTP 503`, `timeout`).
    pub reason: String,
}

impl DeliveryError {
    /// A transient failure.
    pub fn transient(reason: impl Into<String>) -> Self {
        Self::new(ErrorClass::Transient, reason)
    }

    /// A permanent failure.
    pub fn permanent(reason: impl Into<String>) -> Self {
        Self::new(ErrorClass::Permanent, reason)
    }

    fn new(class: ErrorClass, reason: impl Into<String>) -> Self {
        DeliveryError {
            class,
            status: None,
            request_id: None,
            retry_after: None,
            reason: reason.into(),
        }
    }
}

/// Takes a claimed row to its receiver. One per worker, shared by its
/// concurrent deliveries.
///
/// A deliverer should send [`Delivery::delivery_key`] downstream (as an
/// idempotency key, an external reference, an upsert key) so that a second
/// delivery of the same row — after a crash between the receiver's success
/// and the row's completion — has no second effect there.
///
/// A delivery may be cancelled (dropped) when the worker loses the row's
/// lease or shuts down past its grace period.
#[async_trait]
pub trait Deliverer: Send + Sync + 'static {
    /// Delivers one message.
    async fn deliver(&self, delivery: &Delivery) -> Result<Delivered, DeliveryError>;

    /// The topics this deliverer handles, so a worker claims only those;
    /// `None` (the default) for every topic.
    fn topics(&self) -> Option<Vec<String>> {
        None
    }
}

#[async_trait]
impl<D: Deliverer + ?Sized> Deliverer for std::sync::Arc<D> {
    async fn deliver(&self, delivery: &Delivery) -> Result<Delivered, DeliveryError> {
        (**self).deliver(delivery).await
    }

    fn topics(&self) -> Option<Vec<String>> {
        (**self).topics()
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorClass;

    #[test]
    fn statuses_are_classified_as_the_issue_says() {
        for status in [408, 429, 500, 502, 503, 504] {
            assert_eq!(
                ErrorClass::of_status(status),
                ErrorClass::Transient,
                "{status}"
            );
        }
        for status in [300, 301, 400, 401, 403, 404, 409, 410, 413, 422] {
            assert_eq!(
                ErrorClass::of_status(status),
                ErrorClass::Permanent,
                "{status}"
            );
        }
    }
}
