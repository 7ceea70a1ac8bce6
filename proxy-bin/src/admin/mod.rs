//! The admin listener (`--admin`): `/healthz` and `/metrics` for everyone
//! who can reach it, and the operator API behind a bearer token.
//!
//! The token comes from the environment variable `IDEMPOTENCY_ADMIN_TOKEN`
//! or from the file named by `admin_token_file` in `[proxy]`, never from the
//! command line (where `ps` would show it). Without a token, the operator
//! API is off: only `/healthz` and `/metrics` answer.

mod keys;
mod outbox;
mod token;

use async_trait::async_trait;
use http::{header, Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use tower_idempotency::outbox::Outbox;
use tower_idempotency::Engine;

pub use token::{AdminToken, TOKEN_ENV};

/// Serves `/healthz` (200 while the store answers, 503 otherwise),
/// `/metrics` (Prometheus text: requests per outcome, store latency,
/// in-flight count, store counters such as Redis hits and misses; the
/// outbox counters and latencies when `[outbox]` runs here), and,
/// only to a request carrying `Authorization: Bearer <token>`, the operator
/// API.
pub struct Admin {
    /// The engine whose health and metrics are reported.
    pub engine: Engine,
    /// The operator API's bearer token; `None` turns the API off.
    pub token: Option<AdminToken>,
    /// The outbox this process runs workers for (`[outbox]`): its metrics
    /// join `/metrics`, its rows the operator API (`/outbox/…`).
    pub outbox: Option<Outbox>,
}

/// An answer of the admin listener, before it is written.
pub struct Answer {
    status: StatusCode,
    content_type: &'static str,
    body: Vec<u8>,
}

impl Answer {
    /// A plain-text answer.
    pub fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Answer {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into().into_bytes(),
        }
    }

    fn into_response(self, extra: Option<(header::HeaderName, &'static str)>) -> Response<Vec<u8>> {
        let mut response = Response::builder()
            .status(self.status)
            .header(header::CONTENT_TYPE, self.content_type)
            .header(header::CONTENT_LENGTH, self.body.len())
            .header(header::CACHE_CONTROL, "no-store");
        if let Some((name, value)) = extra {
            response = response.header(name, value);
        }
        response.body(self.body).expect("a valid response")
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match session.req_header().uri.path() {
            "/healthz" => return self.health().await.into_response(None),
            "/metrics" => {
                return Answer {
                    status: StatusCode::OK,
                    content_type: "text/plain; version=0.0.4",
                    body: self.metrics().into_bytes(),
                }
                .into_response(None)
            }
            _ => {}
        }
        let Some(token) = &self.token else {
            return Answer::text(
                StatusCode::NOT_FOUND,
                format!(
                    "not found (the operator API is off: set {TOKEN_ENV} or \
                     admin_token_file in [proxy])\n"
                ),
            )
            .into_response(None);
        };
        if !token.admits(session.req_header().headers.get(header::AUTHORIZATION)) {
            return Answer::text(
                StatusCode::UNAUTHORIZED,
                "unauthorized: send Authorization: Bearer <admin token>\n",
            )
            .into_response(Some((header::WWW_AUTHENTICATE, "Bearer")));
        }
        self.operator(session).await.into_response(None)
    }
}

impl Admin {
    async fn health(&self) -> Answer {
        match self.engine.health().await {
            Ok(()) => Answer::text(StatusCode::OK, "ok\n"),
            // The error (a database's user or host name) goes to the log,
            // not to an unauthenticated caller.
            Err(error) => {
                tracing::warn!(%error, "health check: store unavailable");
                Answer::text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
            }
        }
    }

    /// The engine's metrics, then the outbox's when it runs here.
    fn metrics(&self) -> String {
        let mut text = self.engine.render_metrics();
        if let Some(outbox) = &self.outbox {
            text.push_str(&outbox.metrics().render_prometheus());
        }
        text
    }

    /// The operator API, reached only with the right token.
    async fn operator(&self, session: &mut ServerSession) -> Answer {
        if let Some(answer) = keys::serve(&self.engine, session).await {
            return answer;
        }
        if let Some(answer) = outbox::route(self.outbox.as_ref(), session.req_header()).await {
            return answer;
        }
        let path = session.req_header().uri.path().to_owned();
        Answer::text(StatusCode::NOT_FOUND, format!("no operator route {path}\n"))
    }
}
