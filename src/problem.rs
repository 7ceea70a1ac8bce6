//! The responses the engine itself produces: RFC 9457 problem details.
//!
//! Every such response is `application/problem+json` with a stable `type`
//! URI per case (see [`ProblemKind::type_uri`]), so clients can branch on it,
//! or, for a request that prefers `text/html` (a browser's form post), the
//! same problem as a short HTML page (RFC 9457 allows other formats). Both
//! carry the type in the `Problem-Type` header. Details are fixed texts
//! written here; no request input is ever echoed.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

/// The header that names the problem's `type` on every problem response,
/// JSON or HTML, so logs and tests need not parse the body.
pub const PROBLEM_TYPE_HEADER: HeaderName = HeaderName::from_static("problem-type");

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
    /// will not run again. 409, or the route's `unreplayable_status`.
    ResponseNotStored,
    /// The first response broke off after its head (the upstream acted):
    /// the request ran once, its response is not complete, and it will not
    /// run again. 409, or the route's `unreplayable_status`.
    ResponseIncomplete,
    /// The idempotency store cannot be reached. 503 with `Retry-After`.
    StoreUnavailable,
    /// Too many covered request bodies are buffered at once (the engine's
    /// `max_buffered_bytes`); refused before the body is read, nothing
    /// reserved. 503 with `Retry-After`.
    Overloaded,
    /// The upstream could not be reached or broke the connection. 502. The
    /// key was released when the request head never reached it, and is
    /// kept as the outcome ("executed, outcome unknown") once it may have.
    UpstreamUnavailable,
    /// The upstream (or, in the layer, the inner service) did not answer
    /// in time. 504. Kept as the key's outcome once the request may have
    /// run; released when nothing ran (an inner service never ready).
    UpstreamTimeout,
    /// The request body has a transfer coding other than `chunked` (such
    /// as `gzip, chunked`), which the engine does not decode; refused
    /// before anything is reserved. 501.
    TransferCodingUnsupported,
    /// The route reads its key from the body, and the body has a
    /// `Content-Encoding` (gzip, …) the engine does not read: the key could
    /// hide in it. 415; nothing reserved.
    ContentEncodingUnsupported,
    /// The route requires a principal (`Policy::principal`) and the request
    /// names none. 401; nothing reserved.
    PrincipalMissing,
    /// The request's credential for the route's principal failed its
    /// checks (a JWT's signature, algorithm, `exp`, `nbf`, `iss`, `aud`; a
    /// repeated or empty gateway header). 401; nothing reserved, and it
    /// never picks a scope.
    PrincipalInvalid,
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
            ProblemKind::ResponseIncomplete => "urn:tower-idempotency:response-incomplete",
            ProblemKind::StoreUnavailable => "urn:tower-idempotency:store-unavailable",
            ProblemKind::Overloaded => "urn:tower-idempotency:overloaded",
            ProblemKind::UpstreamUnavailable => "urn:tower-idempotency:upstream-unavailable",
            ProblemKind::UpstreamTimeout => "urn:tower-idempotency:upstream-timeout",
            ProblemKind::TransferCodingUnsupported => {
                "urn:tower-idempotency:transfer-coding-unsupported"
            }
            ProblemKind::ContentEncodingUnsupported => {
                "urn:tower-idempotency:content-encoding-unsupported"
            }
            ProblemKind::PrincipalMissing => "urn:tower-idempotency:principal-missing",
            ProblemKind::PrincipalInvalid => "urn:tower-idempotency:principal-invalid",
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
            ProblemKind::ResponseIncomplete => "Original response incomplete",
            ProblemKind::StoreUnavailable => "Idempotency store unavailable",
            ProblemKind::Overloaded => "Too many requests in progress",
            ProblemKind::UpstreamUnavailable => "Upstream unavailable",
            ProblemKind::UpstreamTimeout => "Upstream timed out",
            ProblemKind::TransferCodingUnsupported => "Transfer coding not implemented",
            ProblemKind::ContentEncodingUnsupported => "Content encoding not supported",
            ProblemKind::PrincipalMissing => "Principal missing",
            ProblemKind::PrincipalInvalid => "Principal invalid",
        }
    }

    fn default_status(self) -> StatusCode {
        match self {
            ProblemKind::KeyMissing | ProblemKind::KeyInvalid | ProblemKind::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            ProblemKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::KeyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::InFlight
            | ProblemKind::ResponseNotStored
            | ProblemKind::ResponseIncomplete => StatusCode::CONFLICT,
            ProblemKind::StoreUnavailable | ProblemKind::Overloaded => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProblemKind::UpstreamUnavailable => StatusCode::BAD_GATEWAY,
            ProblemKind::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProblemKind::TransferCodingUnsupported => StatusCode::NOT_IMPLEMENTED,
            ProblemKind::ContentEncodingUnsupported => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ProblemKind::PrincipalMissing | ProblemKind::PrincipalInvalid => {
                StatusCode::UNAUTHORIZED
            }
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
    /// The request may have taken effect and its key is kept ("executed,
    /// outcome unknown"): the page says to check, not to send again.
    kept: bool,
}

impl Problem {
    /// A problem of `kind` with its default status and `detail`.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            status: kind.default_status(),
            detail: detail.into(),
            retry_after: None,
            kept: false,
        }
    }

    /// Marks the request as possibly carried out, its key kept: the HTML
    /// page asks the reader to check its result rather than send it again
    /// (going back renders the form anew, with a new key). The JSON body
    /// is the same.
    pub(crate) fn outcome_kept(mut self) -> Self {
        self.kept = true;
        self
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
        self.render(Format::Json)
    }

    /// The response in the format the request prefers: a short HTML page
    /// when its `Accept` ranks `text/html` above JSON (a browser), else
    /// `application/problem+json`. Status and headers are the same either
    /// way.
    pub fn into_response_for(self, request: &HeaderMap) -> Response<Bytes> {
        let format = if prefers_html(request) {
            Format::Html
        } else {
            Format::Json
        };
        self.render(format)
    }

    fn render(self, format: Format) -> Response<Bytes> {
        let (content_type, body) = match format {
            Format::Json => {
                let body = serde_json::json!({
                    "type": self.kind.type_uri(),
                    "title": self.kind.title(),
                    "status": self.status.as_u16(),
                    "detail": self.detail,
                });
                let body = serde_json::to_vec(&body).unwrap_or_default();
                ("application/problem+json", Bytes::from(body))
            }
            Format::Html => ("text/html; charset=utf-8", Bytes::from(self.html())),
        };
        let length = body.len();
        let mut response = Response::new(body);
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        headers.insert(
            PROBLEM_TYPE_HEADER,
            HeaderValue::from_static(self.kind.type_uri()),
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl Problem {
    /// The HTML page: the title, the detail and what the reader can do.
    fn html(&self) -> String {
        let title = escape_html(self.kind.title());
        let detail = escape_html(&self.detail);
        let advice = match self.kind {
            _ if self.kept => {
                "It may have been carried out: please check its result before sending it again."
            }
            ProblemKind::InFlight | ProblemKind::StoreUnavailable | ProblemKind::Overloaded => {
                // Reloading sends the same submission (its key) again; going
                // back may render the form anew, with a new key, and run twice.
                "Please wait a moment, then reload this page to send the same form again."
            }
            ProblemKind::KeyMissing | ProblemKind::KeyInvalid | ProblemKind::KeyMismatch => {
                "Please go back, reload the form and fill it in again."
            }
            ProblemKind::BodyTooLarge => "Please go back and send less data.",
            ProblemKind::ResponseIncomplete => {
                "It was carried out: please check its result before sending it again."
            }
            _ => "Please go back and try again.",
        };
        format!(
            "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\
             <body><h1>{title}</h1><p>{detail}</p><p>{advice}</p></body></html>\n"
        )
    }
}

#[derive(Clone, Copy)]
enum Format {
    Json,
    Html,
}

/// The kind and detail of what reads as the engine's own "executed,
/// outcome unknown" problem (upstream-unavailable or upstream-timeout,
/// as JSON): its `Problem-Type` header and its body's `type` and
/// `detail`. The caller checks that the response is that problem exactly.
pub(crate) fn unknown_outcome_in(
    headers: &[(HeaderName, HeaderValue)],
    body: &[u8],
) -> Option<(ProblemKind, String)> {
    let named = |kind: &ProblemKind| {
        headers.iter().any(|(name, value)| {
            *name == PROBLEM_TYPE_HEADER && value.as_bytes() == kind.type_uri().as_bytes()
        })
    };
    let kind = [
        ProblemKind::UpstreamUnavailable,
        ProblemKind::UpstreamTimeout,
    ]
    .into_iter()
    .find(named)?;
    let stored: serde_json::Value = serde_json::from_slice(body).ok()?;
    if stored.get("type")?.as_str()? != kind.type_uri() {
        return None;
    }
    Some((kind, stored.get("detail")?.as_str()?.to_owned()))
}

/// Whether `Accept` ranks `text/html` (or `text/*`) strictly above every
/// JSON range (`application/problem+json`, `application/json`,
/// `application/*`, `*/*`). A missing or unreadable `Accept` means JSON.
pub(crate) fn prefers_html(headers: &HeaderMap) -> bool {
    let mut html = 0.0_f32;
    let mut json = 0.0_f32;
    for value in headers.get_all(header::ACCEPT) {
        let Ok(value) = value.to_str() else { continue };
        for range in value.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.trim().strip_prefix("q="))
                .find_map(|q| q.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "text/html" | "application/xhtml+xml" | "text/*" => html = html.max(q),
                "application/problem+json" | "application/json" | "application/*" | "*/*" => {
                    json = json.max(q)
                }
                _ => {}
            }
        }
    }
    html > json
}

fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
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

    fn accept(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::ACCEPT, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn browsers_get_html_and_api_clients_json() {
        let browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8";
        for (value, html) in [
            (browser, true),
            ("text/html", true),
            ("*/*", false),
            ("application/json", false),
            ("application/json, text/html;q=0.5", false),
            ("text/html;q=0.5, application/problem+json", false),
            ("text/*;q=0.9, */*;q=0.1", true),
        ] {
            let response = Problem::new(ProblemKind::KeyMissing, "no key <here>")
                .into_response_for(&accept(value));
            let content_type = response.headers()[header::CONTENT_TYPE].to_str().unwrap();
            assert_eq!(content_type.starts_with("text/html"), html, "{value}");
            assert_eq!(
                response.headers()[PROBLEM_TYPE_HEADER],
                "urn:tower-idempotency:key-missing"
            );
            assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        }
        let none = Problem::new(ProblemKind::InFlight, "x").into_response_for(&HeaderMap::new());
        assert_eq!(
            none.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }

    #[test]
    fn the_html_page_escapes_and_keeps_the_retry_hint() {
        let response = Problem::new(ProblemKind::InFlight, "wait <b>\"now\"</b>")
            .retry_after(3)
            .into_response_for(&accept("text/html"));
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
        let page = std::str::from_utf8(response.body()).unwrap();
        assert!(
            page.contains("wait &lt;b&gt;&quot;now&quot;&lt;/b&gt;"),
            "{page}"
        );
        assert!(!page.contains("<b>"), "{page}");
        assert_eq!(
            response.headers()[header::CONTENT_LENGTH],
            response.body().len().to_string().as_str()
        );
    }
}
