//! The responses the engine itself produces: RFC 9457 problem details.
//!
//! Every such response is `application/problem+json` with a stable `type`
//! URI per case (see [`ProblemKind::type_uri`]), so clients can branch on it.
//! Details are fixed texts written here; no request input is ever echoed.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

/// The cases the engine answers itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// The route requires a key and the request has none. 400.
    KeyMissing,
    /// The key is malformed (length, characters, quoting, not a UUID). 400.
    KeyInvalid,
    /// The request body exceeds the route's limit. 413.
    BodyTooLarge,
    /// The request body could not be read completely (the client went away
    /// or was too slow). 400, or 408 for a timeout.
    BodyUnreadable,
    /// The key was used before for a different request. 422 or 409.
    KeyMismatch,
    /// The key's first request is still running. 409 with `Retry-After`.
    InFlight,
    /// The first response was too large to store; the request ran once and
    /// will not run again. 409.
    ResponseNotStored,
    /// The idempotency store cannot be reached. 503 with `Retry-After`.
    StoreUnavailable,
    /// The upstream could not be reached or broke the connection; the key
    /// was released. 502.
    UpstreamUnavailable,
    /// The upstream did not answer in time; the key was released. 504.
    UpstreamTimeout,
    /// The request body has a transfer coding other than `chunked` (such
    /// as `gzip, chunked`), which the engine does not decode; refused
    /// before anything is reserved. 501.
    TransferCodingUnsupported,
}

impl ProblemKind {
    /// The stable `type` URI of this case.
    pub fn type_uri(self) -> &'static str {
        match self {
            ProblemKind::KeyMissing => "urn:tower-idempotency:key-missing",
            ProblemKind::KeyInvalid => "urn:tower-idempotency:key-invalid",
            ProblemKind::BodyTooLarge => "urn:tower-idempotency:body-too-large",
            ProblemKind::BodyUnreadable => "urn:tower-idempotency:body-unreadable",
            ProblemKind::KeyMismatch => "urn:tower-idempotency:key-mismatch",
            ProblemKind::InFlight => "urn:tower-idempotency:in-flight",
            ProblemKind::ResponseNotStored => "urn:tower-idempotency:response-not-stored",
            ProblemKind::StoreUnavailable => "urn:tower-idempotency:store-unavailable",
            ProblemKind::UpstreamUnavailable => "urn:tower-idempotency:upstream-unavailable",
            ProblemKind::UpstreamTimeout => "urn:tower-idempotency:upstream-timeout",
            ProblemKind::TransferCodingUnsupported => {
                "urn:tower-idempotency:transfer-coding-unsupported"
            }
        }
    }

    fn title(self) -> &'static str {
        match self {
            ProblemKind::KeyMissing => "Idempotency key missing",
            ProblemKind::KeyInvalid => "Idempotency key invalid",
            ProblemKind::BodyTooLarge => "Request body too large",
            ProblemKind::BodyUnreadable => "Request body unreadable",
            ProblemKind::KeyMismatch => "Idempotency key reused for a different request",
            ProblemKind::InFlight => "Request with this idempotency key in progress",
            ProblemKind::ResponseNotStored => "Original response not stored",
            ProblemKind::StoreUnavailable => "Idempotency store unavailable",
            ProblemKind::UpstreamUnavailable => "Upstream unavailable",
            ProblemKind::UpstreamTimeout => "Upstream timed out",
            ProblemKind::TransferCodingUnsupported => "Transfer coding not implemented",
        }
    }

    fn default_status(self) -> StatusCode {
        match self {
            ProblemKind::KeyMissing | ProblemKind::KeyInvalid | ProblemKind::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            ProblemKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::KeyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::InFlight | ProblemKind::ResponseNotStored => StatusCode::CONFLICT,
            ProblemKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::UpstreamUnavailable => StatusCode::BAD_GATEWAY,
            ProblemKind::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProblemKind::TransferCodingUnsupported => StatusCode::NOT_IMPLEMENTED,
        }
    }
}

/// One problem response, ready to be turned into HTTP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    kind: ProblemKind,
    status: StatusCode,
    detail: String,
    retry_after: Option<u64>,
}

impl Problem {
    /// A problem of `kind` with its default status and `detail`.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            status: kind.default_status(),
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Overrides the status (e.g. 409 instead of 422 for a mismatch).
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds `Retry-After: seconds`.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds.max(1));
        self
    }

    /// Which case this is.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The `application/problem+json` response.
    pub fn into_response(self) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": self.kind.type_uri(),
            "title": self.kind.title(),
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let body = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        let length = body.len();
        let mut response = Response::new(body);
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_json_shape() {
        let response = Problem::new(ProblemKind::InFlight, "wait \"a\" <b>")
            .retry_after(0)
            .into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(body["type"], "urn:tower-idempotency:in-flight");
        assert_eq!(body["status"], 409);
        assert_eq!(body["detail"], "wait \"a\" <b>");
    }

    #[test]
    fn mismatch_status_override() {
        let problem = Problem::new(ProblemKind::KeyMismatch, "x").with_status(StatusCode::CONFLICT);
        assert_eq!(problem.into_response().status(), StatusCode::CONFLICT);
    }
}
