//! The HTTP webhook deliverer: signed POSTs per the Standard Webhooks
//! specification, with the delivery key as `Idempotency-Key`.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use base64::Engine as _;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::header::{CONTENT_TYPE, RETRY_AFTER, USER_AGENT};
use http::{HeaderMap, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::Sha256;

use super::deliver::{Delivered, Deliverer, Delivery, DeliveryError, ErrorClass};
use crate::problem::{ProblemKind, PROBLEM_TYPE_HEADER};

/// The most of a receiver's answer body read (and thrown away, so the
/// connection can be reused).
const MAX_ANSWER: usize = 64 * 1024;

/// A destination's signing secret. Its `Debug` output is redacted.
#[derive(Clone)]
pub struct WebhookSecret(Vec<u8>);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(..)")
    }
}

impl WebhookSecret {
    /// A secret of raw key bytes.
    pub fn new(key: impl Into<Vec<u8>>) -> Self {
        WebhookSecret(key.into())
    }

    /// A secret in the Standard Webhooks form, `whsec_` followed by the
    /// base64 of the key (the prefix is optional). `None` when it is not
    /// base64 or empty.
    pub fn from_whsec(secret: &str) -> Option<Self> {
        let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
        let key = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .ok()?;
        (!key.is_empty()).then_some(WebhookSecret(key))
    }

    /// The `webhook-signature` value for message `id` sent at `timestamp`
    /// (Unix seconds) with `body`: `v1,` and the base64 of
    /// HMAC-SHA256(key, `{id}.{timestamp}.{body}`).
    pub fn sign(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        let tag = self.mac(id, timestamp, body).finalize().into_bytes();
        format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(tag)
        )
    }

    fn mac(&self, id: &str, timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }

    /// Checks a received delivery, as a receiver should before acting on
    /// it:
    ///
    /// * one of the `webhook-signature` entries (`v1,…`, space-separated:
    ///   a sender may sign with several secrets) is this secret's signature
    ///   of `webhook-id`, `webhook-timestamp` and `body`, compared in
    ///   constant time (a receiver rotating its own secret calls `verify`
    ///   once per secret it accepts);
    /// * `webhook-timestamp` is within `tolerance` of now (either way), so
    ///   a captured delivery cannot be replayed later (Standard Webhooks
    ///   suggests 5 minutes);
    /// * `Idempotency-Key` is present and equals `webhook-id`. The key is
    ///   not signed; a receiver that deduplicates by it (behind this
    ///   crate's layer or proxy) would otherwise run a captured delivery
    ///   again under a key of the attacker's choosing. This makes it a
    ///   check for this crate's deliveries, not for every Standard
    ///   Webhooks sender (most send no `Idempotency-Key`);
    /// * each of those headers comes exactly once, and `webhook-id` holds no
    ///   `.` (the separator of the signed string).
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        tolerance: Duration,
    ) -> Result<(), VerifyError> {
        // Exactly one line each: a reader that takes another of several
        // would see a value this check did not.
        let header = |name: &'static str| {
            let mut values = headers.get_all(name).iter();
            match (values.next(), values.next()) {
                (Some(value), None) => value.to_str().map_err(|_| VerifyError::Malformed(name)),
                (None, _) => Err(VerifyError::Missing(name)),
                (Some(_), Some(_)) => Err(VerifyError::Malformed(name)),
            }
        };
        let id = header("webhook-id")?;
        // The signed string joins the id, the timestamp and the body with
        // `.`: an id holding one could be spliced with the timestamp (this
        // crate never sends one).
        if id.contains('.') {
            return Err(VerifyError::Malformed("webhook-id"));
        }
        let timestamp: u64 = header("webhook-timestamp")?
            .trim()
            .parse()
            .map_err(|_| VerifyError::Malformed("webhook-timestamp"))?;
        let signatures = header("webhook-signature")?;
        if header("idempotency-key")? != id {
            return Err(VerifyError::KeyMismatch);
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        if now.abs_diff(timestamp) > tolerance.as_secs() {
            return Err(VerifyError::Stale);
        }
        let mac = self.mac(id, timestamp, body);
        let matches = signatures.split(' ').any(|entry| {
            entry
                .strip_prefix("v1,")
                .and_then(|tag| base64::engine::general_purpose::STANDARD.decode(tag).ok())
                .is_some_and(|tag| mac.clone().verify_slice(&tag).is_ok())
        });
        match matches {
            true => Ok(()),
            false => Err(VerifyError::BadSignature),
        }
    }
}

/// Why [`WebhookSecret::verify`] refused a delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// A header the check needs is missing (or not text).
    #[error("the `{0}` header is missing")]
    Missing(&'static str),
    /// A header is not what it should be (a timestamp that is no number).
    #[error("the `{0}` header is malformed")]
    Malformed(&'static str),
    /// `Idempotency-Key` differs from `webhook-id`.
    #[error("`Idempotency-Key` differs from `webhook-id`")]
    KeyMismatch,
    /// `webhook-timestamp` is outside the tolerance.
    #[error("`webhook-timestamp` is outside the tolerance")]
    Stale,
    /// No signature entry is this secret's signature of the delivery.
    #[error("no signature matches")]
    BadSignature,
}

/// Where one topic's messages go.
#[derive(Clone, Debug)]
pub struct Destination {
    url: Uri,
    secret: Option<WebhookSecret>,
    timeout: Duration,
}

impl Destination {
    /// POST to `url` (`http://`; for `https://` give the deliverer a TLS
    /// connector with [`WebhookDeliverer::with_connector`]), unsigned, with
    /// the default timeout.
    pub fn new(url: Uri) -> Self {
        Destination {
            url,
            secret: None,
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    /// The whole exchange (connect, send, read the answer) must end within
    /// this, or the attempt fails as transient `timeout`.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

    /// Signs every request with `secret` (`webhook-signature`).
    pub fn secret(mut self, secret: WebhookSecret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// Replaces the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Delivers each message by POSTing its payload to its topic's
/// [`Destination`] with
///
/// * `Idempotency-Key` and `webhook-id`: the delivery key (the same in
///   every attempt, so a receiver behind this crate's layer or
///   `idempotency-proxy` performs the effect once);
/// * `webhook-timestamp`: Unix seconds at sending;
/// * `webhook-signature`: `v1,` + base64(HMAC-SHA256(secret,
///   `{webhook-id}.{webhook-timestamp}.{body}`)), when the destination has
///   a secret (Standard Webhooks);
/// * `Content-Type`: the message's.
///
/// A 2xx answer is success; 408, 429 and 5xx are transient (their
/// `Retry-After`, seconds or an HTTP date, is honoured), and so is an
/// idempotent receiver's "still running the first delivery of the key":
/// any status labelled `Problem-Type: urn:tower-idempotency:in-flight` (this
/// crate's layer and proxy, whatever their route's `in_flight_status`), or
/// a 409 or 425 with `Retry-After`; any other status is permanent, as is a topic
/// without a destination, and so is an idempotent receiver's replay of
/// "executed, outcome unknown" (502 or 504 with `Idempotent-Replayed:
/// true` and this crate's `Problem-Type`): every redelivery of the key
/// would get it. A connection error or a timeout is transient.
/// The receiver's `X-Request-Id` (or `Request-Id`) is kept; its answer
/// body is read (up to 64 KiB) and discarded, never stored.
///
/// A worker given this deliverer claims only the topics it has
/// destinations for.
#[derive(Clone, Debug)]
pub struct WebhookDeliverer<C = HttpConnector> {
    client: Client<C, Full<Bytes>>,
    destinations: HashMap<String, Destination>,
}

impl WebhookDeliverer<HttpConnector> {
    /// A deliverer over plain HTTP (connect timeout 5 s, `TCP_NODELAY`),
    /// with no destinations yet.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        connector.set_nodelay(true);
        Self::with_connector(connector)
    }
}

impl Default for WebhookDeliverer<HttpConnector> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> WebhookDeliverer<C>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    /// A deliverer over `connector` (for example a TLS one).
    pub fn with_connector(connector: C) -> Self {
        WebhookDeliverer {
            client: Client::builder(TokioExecutor::new()).build(connector),
            destinations: HashMap::new(),
        }
    }

    /// Sends `topic`'s messages to `destination`.
    pub fn destination(mut self, topic: impl Into<String>, destination: Destination) -> Self {
        self.destinations.insert(topic.into(), destination);
        self
    }

    async fn exchange(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<(http::StatusCode, HeaderMap), DeliveryError> {
        let response = self.client.request(request).await.map_err(|error| {
            DeliveryError::transient(if error.is_connect() {
                "connection failed"
            } else {
                "request failed"
            })
        })?;
        let (parts, body) = response.into_parts();
        // Drain a bounded answer so the connection can be reused; its
        // content is not kept.
        let _ = Limited::new(body, MAX_ANSWER).collect().await;
        Ok((parts.status, parts.headers))
    }
}

#[async_trait]
impl<C> Deliverer for WebhookDeliverer<C>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    async fn deliver(&self, delivery: &Delivery) -> Result<Delivered, DeliveryError> {
        let Some(destination) = self.destinations.get(delivery.topic()) else {
            return Err(DeliveryError::permanent("no destination for the topic"));
        };
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let key = delivery.delivery_key();
        let mut request = Request::post(destination.url.clone())
            .header(CONTENT_TYPE, delivery.content_type())
            .header(USER_AGENT, "tower-idempotency-outbox")
            .header("idempotency-key", key)
            .header("webhook-id", key)
            .header("webhook-timestamp", timestamp);
        if let Some(secret) = &destination.secret {
            request = request.header(
                "webhook-signature",
                secret.sign(key, timestamp, delivery.payload()),
            );
        }
        let request = request
            .body(Full::new(delivery.payload().clone()))
            .map_err(|_| DeliveryError::permanent("invalid request (key or content type)"))?;

        let (status, headers) = tokio::time::timeout(destination.timeout, self.exchange(request))
            .await
            .map_err(|_| DeliveryError::transient("timeout"))??;
        let request_id = ["x-request-id", "request-id"]
            .iter()
            .find_map(|name| headers.get(*name))
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        if status.is_success() {
            return Ok(Delivered {
                status: Some(status.as_u16()),
                request_id,
            });
        }
        let retry_after = headers.get(RETRY_AFTER).and_then(retry_after);
        if receiver_kept_outcome_unknown(&headers) {
            return Err(DeliveryError {
                class: ErrorClass::Permanent,
                status: Some(status.as_u16()),
                request_id,
                retry_after: None,
                reason: format!(
                    "HTTP {}: the receiver keeps \"executed, outcome unknown\" for this \
                     delivery key (a replay), so every redelivery is answered the same; check \
                     whether it acted, then purge the key there before retrying the row",
                    status.as_u16()
                ),
            });
        }
        Err(DeliveryError {
            class: class_of(status.as_u16(), retry_after.is_some(), &headers),
            status: Some(status.as_u16()),
            request_id,
            retry_after,
            reason: format!("HTTP {}", status.as_u16()),
        })
    }

    fn topics(&self) -> Option<Vec<String>> {
        let mut topics: Vec<String> = self.destinations.keys().cloned().collect();
        topics.sort();
        Some(topics)
    }
}

/// A failed answer's class: [`ErrorClass::of_status`], except that an
/// idempotent receiver's "a request with this key is still in progress"
/// is transient, which must be retried, not sent to `dead`: this crate's
/// layer and `idempotency-proxy` answer so when a redelivery meets the
/// first delivery still running, labelled `Problem-Type:
/// urn:tower-idempotency:in-flight` under whatever status the route sets
/// (`in_flight_status`: 409 by default, 425 in the Next.js recipe), and
/// others with 409 or 425 (Too Early) and `Retry-After`.
fn class_of(status: u16, retry_after: bool, headers: &HeaderMap) -> ErrorClass {
    let in_flight = headers
        .get(PROBLEM_TYPE_HEADER)
        .is_some_and(|kind| kind.as_bytes() == ProblemKind::InFlight.type_uri().as_bytes());
    match (status, retry_after) {
        _ if in_flight => ErrorClass::Transient,
        (409 | 425, true) => ErrorClass::Transient,
        _ => ErrorClass::of_status(status),
    }
}

/// Whether the answer is an idempotent receiver's replay of "executed,
/// outcome unknown" (this crate's layer and `idempotency-proxy` keep the
/// 502 `upstream-unavailable` or 504 `upstream-timeout` of an execution
/// whose upstream failed after receiving it, and replay it to every retry
/// with `Idempotent-Replayed: true`): retrying the same key can never get
/// another answer.
fn receiver_kept_outcome_unknown(headers: &HeaderMap) -> bool {
    let replayed = headers
        .get(crate::engine::REPLAYED_HEADER)
        .is_some_and(|value| value.as_bytes() == b"true");
    let unknown = headers.get(PROBLEM_TYPE_HEADER).is_some_and(|kind| {
        [
            ProblemKind::UpstreamTimeout,
            ProblemKind::UpstreamUnavailable,
        ]
        .iter()
        .any(|k| kind.as_bytes() == k.type_uri().as_bytes())
    });
    replayed && unknown
}

/// A `Retry-After` value: delay-seconds or an HTTP date (from now).
/// Delay-seconds too large for a `u64` are the longest wait there is (the
/// caller caps it), never ignored.
fn retry_after(value: &HeaderValue) -> Option<Duration> {
    let value = value.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(SystemTime::now()).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test vector of the Standard Webhooks reference libraries.
    #[test]
    fn signature_matches_the_standard_webhooks_vector() {
        let secret = WebhookSecret::from_whsec("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signature = secret.sign(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn an_in_flight_answer_is_transient() {
        let none = HeaderMap::new();
        assert_eq!(class_of(409, true, &none), ErrorClass::Transient);
        assert_eq!(class_of(425, true, &none), ErrorClass::Transient);
        assert_eq!(class_of(409, false, &none), ErrorClass::Permanent);
        assert_eq!(class_of(400, true, &none), ErrorClass::Permanent);
        assert_eq!(class_of(503, false, &none), ErrorClass::Transient);
        let mut labelled = HeaderMap::new();
        labelled.insert(
            PROBLEM_TYPE_HEADER,
            HeaderValue::from_static("urn:tower-idempotency:in-flight"),
        );
        assert_eq!(class_of(423, false, &labelled), ErrorClass::Transient);
    }

    /// A delivery as the deliverer signs it, checked by `verify`; then
    /// each way a captured one can be altered or replayed is refused.
    #[test]
    fn verify_takes_a_signed_delivery_and_refuses_every_alteration() {
        let secret = WebhookSecret::from_whsec("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"order":1}"#;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let signed = |id: &str, key: &str, timestamp: u64, signature: String| {
            let mut headers = HeaderMap::new();
            headers.insert("webhook-id", id.parse().unwrap());
            headers.insert("idempotency-key", key.parse().unwrap());
            headers.insert("webhook-timestamp", timestamp.to_string().parse().unwrap());
            headers.insert("webhook-signature", signature.parse().unwrap());
            headers
        };
        let window = Duration::from_secs(300);
        let good = signed("msg_1", "msg_1", now, secret.sign("msg_1", now, body));
        assert_eq!(secret.verify(&good, body, window), Ok(()));
        // Rotation: the right one among several entries.
        let rotating = signed(
            "msg_1",
            "msg_1",
            now,
            format!("v1,AAAA {}", secret.sign("msg_1", now, body)),
        );
        assert_eq!(secret.verify(&rotating, body, window), Ok(()));
        // A new key on a captured delivery.
        let rekeyed = signed("msg_1", "x2", now, secret.sign("msg_1", now, body));
        assert_eq!(
            secret.verify(&rekeyed, body, window),
            Err(VerifyError::KeyMismatch)
        );
        let mut twice = good.clone();
        twice.append("idempotency-key", "x2".parse().unwrap());
        assert_eq!(
            secret.verify(&twice, body, window),
            Err(VerifyError::Malformed("idempotency-key"))
        );
        let mut unkeyed = good.clone();
        unkeyed.remove("idempotency-key");
        assert_eq!(
            secret.verify(&unkeyed, body, window),
            Err(VerifyError::Missing("idempotency-key"))
        );
        // The id re-split at a `.` of the signed string: a delivery of `k`
        // sent an hour ago whose body began with `{now}.` verifies byte for
        // byte as the id `k.{then}` sent now with the rest of the body.
        let then = now - 3600;
        let captured = format!("{now}.rest");
        let spliced_id = format!("k.{then}");
        let spliced = signed(
            &spliced_id,
            &spliced_id,
            now,
            secret.sign("k", then, captured.as_bytes()),
        );
        assert_eq!(
            secret.verify(&spliced, b"rest", window),
            Err(VerifyError::Malformed("webhook-id"))
        );
        // Replayed an hour later.
        let old = now - 3600;
        let stale = signed("msg_1", "msg_1", old, secret.sign("msg_1", old, body));
        assert_eq!(secret.verify(&stale, body, window), Err(VerifyError::Stale));
        // Another body, another id, another secret.
        assert_eq!(
            secret.verify(&good, br#"{"order":2}"#, window),
            Err(VerifyError::BadSignature)
        );
        let other_id = signed("msg_2", "msg_2", now, secret.sign("msg_1", now, body));
        assert_eq!(
            secret.verify(&other_id, body, window),
            Err(VerifyError::BadSignature)
        );
        let other_secret = WebhookSecret::new(b"another key".to_vec());
        assert_eq!(
            other_secret.verify(&good, body, window),
            Err(VerifyError::BadSignature)
        );
    }

    #[test]
    fn secrets_are_not_printed() {
        let secret = WebhookSecret::new(b"hunter2".to_vec());
        assert!(!format!("{secret:?}").contains("hunter2"));
        assert!(WebhookSecret::from_whsec("whsec_***").is_none());
        assert!(WebhookSecret::from_whsec("whsec_").is_none());
    }

    #[test]
    fn retry_after_takes_seconds_and_dates() {
        let seconds = HeaderValue::from_static("120");
        assert_eq!(retry_after(&seconds), Some(Duration::from_secs(120)));
        let later = SystemTime::now() + Duration::from_secs(3600);
        let date = HeaderValue::from_str(&httpdate::fmt_http_date(later)).unwrap();
        let parsed = retry_after(&date).unwrap();
        assert!(parsed > Duration::from_secs(3500) && parsed <= Duration::from_secs(3600));
        let past = HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT");
        assert_eq!(retry_after(&past), Some(Duration::ZERO));
        assert_eq!(retry_after(&HeaderValue::from_static("soon")), None);
    }

    /// From a review: delay-seconds past `u64` failed to parse and were
    /// dropped, so the row was retried within a second; they are the
    /// longest wait, which the backoff caps at `max_retry_after`.
    #[test]
    fn retry_after_too_large_to_count_is_the_longest_wait() {
        let huge = HeaderValue::from_static("99999999999999999999");
        assert_eq!(retry_after(&huge), Some(Duration::from_secs(u64::MAX)));
        let backoff = crate::outbox::Backoff::default();
        assert_eq!(
            backoff.delay(1, retry_after(&huge)),
            backoff.max_retry_after
        );
        assert_eq!(retry_after(&HeaderValue::from_static("-5")), None);
    }
}
