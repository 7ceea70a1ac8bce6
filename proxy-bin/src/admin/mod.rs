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
    /// The last health check (when, and whether the store answered).
    pub health: HealthCache,
}

/// `/healthz` answers without a token, so a flood of it must not become a
/// flood of store calls (on SQLite they queue on the one writer, on
/// PostgreSQL they hold pool connections): one check at a time, and its
/// answer is shared for [`HealthCache::FRESH`].
#[derive(Debug, Default)]
pub struct HealthCache {
    last: tokio::sync::Mutex<Option<(tokio::time::Instant, bool)>>,
}

impl HealthCache {
    /// How long one check's answer serves.
    pub const FRESH: std::time::Duration = std::time::Duration::from_secs(1);
}

/// The query parameters of an operator request, each named at most once
/// and only among `allowed`: a misspelt filter (`topc=crm` on a purge) is
/// refused, never read as no filter, and a repeated one never read as
/// whichever comes first. The error says what is expected.
fn query_params(query: &str, allowed: &[&str]) -> Result<Vec<(String, String)>, String> {
    let mut params: Vec<(String, String)> = Vec::new();
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        if !allowed.contains(&&*name) {
            return Err(match allowed {
                [] => format!("unknown parameter `{name}`: this route takes none"),
                _ => format!(
                    "unknown parameter `{name}`: expected {}",
                    allowed.join(", ")
                ),
            });
        }
        if params.iter().any(|(seen, _)| *seen == name) {
            return Err(format!("parameter `{name}` given twice"));
        }
        params.push((name.into_owned(), value.into_owned()));
    }
    Ok(params)
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
        // Callers arriving during a check wait for it and share its answer.
        let mut last = self.health.last.lock().await;
        let fresh = last.filter(|(at, _)| at.elapsed() < HealthCache::FRESH);
        let up = match fresh {
            Some((_, up)) => up,
            None => {
                let up = match self.engine.health().await {
                    Ok(()) => true,
                    // The error (a database's user or host name) goes to
                    // the log, not to an unauthenticated caller.
                    Err(error) => {
                        tracing::warn!(%error, "health check: store unavailable");
                        false
                    }
                };
                *last = Some((tokio::time::Instant::now(), up));
                up
            }
        };
        match up {
            true => Answer::text(StatusCode::OK, "ok\n"),
            false => Answer::text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n"),
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tower_idempotency::store::{Fault, FaultyStore, Op};
    use tower_idempotency::{Engine, MemoryStore, Policy, Routes};

    use super::*;

    /// A flood of `/healthz` makes one store call per [`HealthCache::FRESH`],
    /// and a store that went down shows once the answer is stale.
    #[tokio::test(start_paused = true)]
    async fn a_flood_of_health_checks_is_one_store_call() {
        let store = FaultyStore::new(MemoryStore::new());
        let faults = store.faults();
        let engine = Engine::new(store, Routes::all(Policy::default()).unwrap());
        let admin = Arc::new(Admin {
            engine,
            token: None,
            outbox: None,
            health: HealthCache::default(),
        });
        let checks: Vec<_> = (0..200)
            .map(|_| {
                let admin = admin.clone();
                tokio::spawn(async move { admin.health().await.status })
            })
            .collect();
        for check in checks {
            assert_eq!(check.await.unwrap(), StatusCode::OK);
        }
        assert_eq!(faults.calls(Op::Ping), 1);
        faults.set(Op::Ping, Fault::Down);
        assert_eq!(admin.health().await.status, StatusCode::OK, "still fresh");
        tokio::time::sleep(HealthCache::FRESH).await;
        assert_eq!(admin.health().await.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(faults.calls(Op::Ping), 2);
    }
}
