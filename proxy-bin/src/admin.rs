//! The admin listener (`--admin`): `/healthz` and `/metrics`.

use async_trait::async_trait;
use http::{header, Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use tower_idempotency::Engine;

/// Serves `/healthz` (200 while the store answers, 503 otherwise) and
/// `/metrics` (Prometheus text: requests per outcome, store latency,
/// in-flight count, store counters such as Redis hits and misses).
pub struct Admin {
    /// The engine whose health and metrics are reported.
    pub engine: Engine,
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let (status, content_type, body) = match session.req_header().uri.path() {
            "/healthz" => match self.engine.health().await {
                Ok(()) => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
                Err(error) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("store unavailable: {error}\n"),
                ),
            },
            "/metrics" => (
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.engine.render_metrics(),
            ),
            _ => (
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found\n".to_owned(),
            ),
        };
        Response::builder()
            .status(status)
            .header(header::CONTENT_TYPE, content_type)
            .header(header::CONTENT_LENGTH, body.len())
            .body(body.into_bytes())
            .expect("a valid response")
    }
}
