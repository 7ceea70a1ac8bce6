//! The answers the engine makes itself: replays of stored responses and
//! problem documents (RFC 9457). A front end writes them as they are.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};

use super::{Covered, Engine};
use crate::key::KeyError;
use crate::metrics::Event;
use crate::policy::{KeySource, RoutePolicy};
use crate::problem::{Problem, ProblemKind};
use crate::store::{Outcome, ScopeKey, StoredResponse};

/// The header added to every replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The outcome of an answer the engine made itself, carried on the response
/// (as an extension) from where it is decided to the one place that logs the
/// decision ([`Engine::begin`]), which removes it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Answered(pub(super) &'static str);

/// Logs one decision. Every decision line has the same fields: `outcome`,
/// `status` (the status the client is sent), `duration_us` (since `since`)
/// and, once the request's key has been read, `key` (8 hex digits of the
/// scope hash — never the key itself).
pub(super) fn log_decision(
    outcome: &str,
    status: StatusCode,
    since: std::time::Instant,
    key: Option<&ScopeKey>,
) {
    let duration_us = since.elapsed().as_micros() as u64;
    let status = status.as_u16();
    match key {
        Some(key) => {
            tracing::info!(outcome, status, duration_us, key = %super::scope::Short::of(key), "idempotency")
        }
        None => tracing::info!(outcome, status, duration_us, "idempotency"),
    }
}

impl Engine {
    /// The 413 answer for a body over the limit of `covered`'s route.
    /// Nothing is reserved. Like every problem the engine answers, it is
    /// HTML when the request's headers (`request`) prefer it, JSON
    /// otherwise. Logged as a decision (no key hash: the key was not read).
    pub fn body_too_large(&self, covered: &Covered, request: &HeaderMap) -> Response<Bytes> {
        let response = self.over_limit(covered.max_body_bytes(), request);
        self.logged_before_key(covered, response)
    }

    /// The 413 answer for a body over `limit` bytes.
    pub(super) fn over_limit(&self, limit: usize, request: &HeaderMap) -> Response<Bytes> {
        self.reject(
            request,
            Event::TooLarge,
            Problem::new(
                ProblemKind::BodyTooLarge,
                format!("The request body exceeds the limit of {limit} bytes."),
            ),
        )
    }

    /// The answer for a body that could not be read (client gone or too
    /// slow: `timed_out`). Nothing is reserved. Logged as a decision
    /// (`body_unreadable`, no key hash).
    pub fn body_unreadable(
        &self,
        covered: &Covered,
        timed_out: bool,
        request: &HeaderMap,
    ) -> Response<Bytes> {
        let problem = Problem::new(
            ProblemKind::BodyUnreadable,
            "The request body could not be read completely.",
        );
        let problem = if timed_out {
            problem.with_status(StatusCode::REQUEST_TIMEOUT)
        } else {
            problem
        };
        let mut response = problem.into_response_for(request);
        response
            .extensions_mut()
            .insert(Answered("body_unreadable"));
        self.logged_before_key(covered, response)
    }

    /// Logs the decision `response` carries, made before the key was read.
    pub(super) fn logged_before_key(
        &self,
        covered: &Covered,
        mut response: Response<Bytes>,
    ) -> Response<Bytes> {
        if let Some(Answered(outcome)) = response.extensions_mut().remove::<Answered>() {
            log_decision(outcome, response.status(), covered.arrived(), None);
        }
        response
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
    /// before the body is read; nothing is reserved. Logged as a decision
    /// (`transfer_coding_unsupported`, no key hash).
    pub fn unsupported_transfer_coding(
        &self,
        covered: &Covered,
        request: &HeaderMap,
    ) -> Option<Response<Bytes>> {
        let unsupported = super::headers::lists_coding_other_than(
            request,
            &header::TRANSFER_ENCODING,
            b"chunked",
        );
        unsupported.then(|| {
            let mut response = Problem::new(
                ProblemKind::TransferCodingUnsupported,
                "The request's transfer coding is not implemented; send it unencoded or \
                 only chunked. The request was not executed.",
            )
            .into_response_for(request);
            response
                .extensions_mut()
                .insert(Answered("transfer_coding_unsupported"));
            self.logged_before_key(covered, response)
        })
    }

    /// Counts `event` and answers with `problem`, marked with the event for
    /// the decision's log line.
    pub(super) fn reject(
        &self,
        request: &HeaderMap,
        event: Event,
        problem: Problem,
    ) -> Response<Bytes> {
        self.inner.metrics.record(event);
        let mut response = problem.into_response_for(request);
        response.extensions_mut().insert(Answered(event.as_str()));
        response
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

    /// 409 (or the route's `unreplayable_status`): the request ran once,
    /// but its response was not stored (too large, or the store kept
    /// refusing it, or the process stopped while it was being stored).
    /// Counted as a replay: the answer stands for the stored outcome.
    pub(super) fn not_stored(
        &self,
        policy: &RoutePolicy,
        status: StatusCode,
        request: &HeaderMap,
    ) -> Response<Bytes> {
        self.reject(
            request,
            Event::Replayed,
            Problem::new(
                ProblemKind::ResponseNotStored,
                format!(
                    "The request was executed once (status {}), but its response \
                     could not be stored (too large to keep, or the store failed while \
                     it was being saved); it will not be executed again.",
                    status.as_u16()
                ),
            )
            .with_status(policy.unreplayable_status),
        )
    }

    /// 409 `response-incomplete` (or the route's `unreplayable_status`):
    /// the request ran, but its response broke off after the head.
    pub(super) fn incomplete(
        &self,
        policy: &RoutePolicy,
        status: StatusCode,
        request: &HeaderMap,
    ) -> Response<Bytes> {
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
            )
            .with_status(policy.unreplayable_status),
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

    /// 503 with `Retry-After`: the store failed on a fail-closed route
    /// (counted where the failure is).
    pub(super) fn store_unavailable(&self, request: &HeaderMap) -> Response<Bytes> {
        let mut response = Problem::new(
            ProblemKind::StoreUnavailable,
            "The idempotency store is unavailable; the request was not executed.",
        )
        .retry_after(self.inner.config.store_retry_after)
        .into_response_for(request);
        response
            .extensions_mut()
            .insert(Answered(Event::StoreError.as_str()));
        response
    }
}

/// A stored response as `request`'s client gets it again ([`replay`]),
/// but for the engine's own "executed, outcome unknown" problem, stored as
/// JSON whatever its first caller preferred: a client that prefers HTML
/// gets its page (a browser's retry showed the JSON raw), with the same
/// status and detail, marked replayed. Only a record that is exactly that
/// problem as the engine stores it: a backend's own answer that looks
/// like one is replayed as stored.
pub(super) fn replay_for(stored: StoredResponse, request: &HeaderMap) -> Response<Bytes> {
    if !crate::problem::prefers_html(request) {
        return replay(stored);
    }
    let Some((kind, detail)) = crate::problem::unknown_outcome_in(&stored.headers, &stored.body)
    else {
        return replay(stored);
    };
    let ours = super::execution::unknown(kind, &detail);
    if !matches!(&ours, Outcome::Stored(ours) if *ours == stored) {
        return replay(stored);
    }
    let mut page = Problem::new(kind, detail)
        .outcome_kept()
        .into_response_for(request);
    page.headers_mut()
        .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    page
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
    if super::headers::bodiless(response.status()) {
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
