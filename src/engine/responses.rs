//! The answers the engine makes itself: replays of stored responses and
//! problem documents (RFC 9457). A front end writes them as they are.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};

use super::Engine;
use crate::key::KeyError;
use crate::metrics::Event;
use crate::policy::{KeySource, RoutePolicy};
use crate::problem::{Problem, ProblemKind};
use crate::store::StoredResponse;

/// The header added to every replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

impl Engine {
    /// The 413 answer for a body over `policy`'s limit. Nothing is reserved.
    /// Like every problem the engine answers, it is HTML when the request's
    /// headers (`request`) prefer it, JSON otherwise.
    pub fn body_too_large(&self, policy: &RoutePolicy, request: &HeaderMap) -> Response<Bytes> {
        self.reject(
            request,
            Event::TooLarge,
            Problem::new(
                ProblemKind::BodyTooLarge,
                format!(
                    "The request body exceeds the limit of {} bytes.",
                    policy.max_body_bytes()
                ),
            ),
        )
    }

    /// The answer for a body that could not be read (client gone or too
    /// slow: `timed_out`). Nothing is reserved.
    pub fn body_unreadable(&self, timed_out: bool, request: &HeaderMap) -> Response<Bytes> {
        let problem = Problem::new(
            ProblemKind::BodyUnreadable,
            "The request body could not be read completely.",
        );
        let problem = if timed_out {
            problem.with_status(StatusCode::REQUEST_TIMEOUT)
        } else {
            problem
        };
        problem.into_response_for(request)
    }

    /// The 502 (or 504 when `timed_out`) answer for an upstream transport
    /// failure, after [`Reservation::release`](super::Reservation::release).
    pub fn upstream_failed(&self, timed_out: bool, request: &HeaderMap) -> Response<Bytes> {
        let problem = if timed_out {
            Problem::new(
                ProblemKind::UpstreamTimeout,
                "The upstream did not answer in time; the request may be retried.",
            )
        } else {
            Problem::new(
                ProblemKind::UpstreamUnavailable,
                "The upstream could not be reached; the request may be retried.",
            )
        };
        problem.into_response_for(request)
    }

    /// The 501 answer for a covered request whose body has a transfer
    /// coding other than `chunked` (`Transfer-Encoding: gzip, chunked`):
    /// the engine could neither fingerprint nor key such a body, and must
    /// not pretend the upstream failed. `None` when there is none. Asked
    /// before the body is read; nothing is reserved.
    pub fn unsupported_transfer_coding(&self, request: &HeaderMap) -> Option<Response<Bytes>> {
        let unsupported = request
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|value| value.as_bytes().split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"chunked"));
        unsupported.then(|| {
            Problem::new(
                ProblemKind::TransferCodingUnsupported,
                "The request's transfer coding is not implemented; send it unencoded or \
                 only chunked. The request was not executed.",
            )
            .into_response_for(request)
        })
    }

    /// Counts `event`, logs it and answers with `problem`.
    pub(super) fn reject(
        &self,
        request: &HeaderMap,
        event: Event,
        problem: Problem,
    ) -> Response<Bytes> {
        self.inner.metrics.record(event);
        tracing::info!(outcome = %event, status = problem.status().as_u16(), "idempotency");
        problem.into_response_for(request)
    }

    /// 400: a required key is missing.
    pub(super) fn key_missing(&self, source: &KeySource, request: &HeaderMap) -> Response<Bytes> {
        let place = match source {
            KeySource::Header(name) => format!("in the `{name}` header"),
            KeySource::FormField(name) => format!("in the form field `{name}`"),
            KeySource::JsonPointer(pointer) => format!("in the JSON body at `{pointer}`"),
            KeySource::Query(name) => format!("in the query parameter `{name}`"),
        };
        self.reject(
            request,
            Event::InvalidKey,
            Problem::new(
                ProblemKind::KeyMissing,
                format!("This endpoint requires an idempotency key {place}."),
            ),
        )
    }

    /// 400: the key is malformed.
    pub(super) fn invalid_key(&self, error: KeyError, request: &HeaderMap) -> Response<Bytes> {
        self.reject(
            request,
            Event::InvalidKey,
            Problem::new(ProblemKind::KeyInvalid, error.to_string()),
        )
    }

    /// 422 (or the route's `mismatch_status`): the key was used for a
    /// different request.
    pub(super) fn mismatch(&self, policy: &RoutePolicy, request: &HeaderMap) -> Response<Bytes> {
        self.reject(
            request,
            Event::Mismatch,
            Problem::new(
                ProblemKind::KeyMismatch,
                "This idempotency key was already used for a different request.",
            )
            .with_status(policy.mismatch),
        )
    }

    /// 409: the request ran once, but its response was too large to store.
    /// Counted as a replay: the answer stands for the stored outcome.
    pub(super) fn not_stored(&self, status: StatusCode, request: &HeaderMap) -> Response<Bytes> {
        self.reject(
            request,
            Event::Replayed,
            Problem::new(
                ProblemKind::ResponseNotStored,
                format!(
                    "The request was executed once (status {}), but its response \
                     was too large to store; it will not be executed again.",
                    status.as_u16()
                ),
            ),
        )
    }

    /// 409 `response-incomplete`: the request ran, but its response broke
    /// off after the head.
    pub(super) fn incomplete(&self, status: StatusCode, request: &HeaderMap) -> Response<Bytes> {
        self.reject(
            request,
            Event::Replayed,
            Problem::new(
                ProblemKind::ResponseIncomplete,
                format!(
                    "The request was executed once (status {}), but its response \
                     broke off before it was complete; it will not be executed again.",
                    status.as_u16()
                ),
            ),
        )
    }

    /// 409 (or the route's `in_flight_status`) with `Retry-After`: the
    /// first request still holds the key.
    pub(super) fn in_flight(
        &self,
        policy: &RoutePolicy,
        retry_after: u64,
        request: &HeaderMap,
    ) -> Response<Bytes> {
        self.reject(
            request,
            Event::InFlightConflict,
            Problem::new(
                ProblemKind::InFlight,
                "A request with this idempotency key is still being \
                 processed; retry later.",
            )
            .with_status(policy.in_flight_status)
            .retry_after(retry_after),
        )
    }

    /// 503 with `Retry-After`: the store failed on a fail-closed route.
    pub(super) fn store_unavailable(&self, request: &HeaderMap) -> Response<Bytes> {
        Problem::new(
            ProblemKind::StoreUnavailable,
            "The idempotency store is unavailable; the request was not executed.",
        )
        .retry_after(self.inner.config.store_retry_after)
        .into_response_for(request)
    }
}

/// A stored response as the client gets it again: its status, headers and
/// body, with `Content-Length` and `Idempotent-Replayed: true`. A 204 (or
/// 304) never carries `Content-Length` (RFC 9110, 8.6).
pub(super) fn replay(stored: StoredResponse) -> Response<Bytes> {
    let length = stored.body.len();
    let mut response = Response::new(stored.body);
    *response.status_mut() = stored.status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        headers.append(name, value);
    }
    if matches!(
        response.status(),
        StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED
    ) || response.status().is_informational()
    {
        response.headers_mut().remove(header::CONTENT_LENGTH);
    } else {
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    }
    let headers = response.headers_mut();
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}
