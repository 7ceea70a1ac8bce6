//! The Pingora front end: it moves bytes, the [`Engine`] decides.
//!
//! * A request the engine does not cover (safe methods, unmatched paths,
//!   disabled routes) is sent upstream directly when it is plain HTTP/1.1
//!   with a small `Content-Length` body or none (`passthrough.rs`);
//!   otherwise it takes Pingora's normal proxy path: streamed both ways,
//!   never buffered.
//! * A covered request is handled whole in [`ProxyHttp::request_filter`]:
//!   its body is buffered up to the route's limit (over it: 413, nothing
//!   reserved, upstream untouched) and handed to [`Engine::begin`]. A replay
//!   or problem is written without contacting the upstream. Otherwise the
//!   proxy sends the buffered request itself over the shared keep-alive pool
//!   (Pingora's retry buffer holds only 64 KiB, so its own path could not
//!   resend a larger body) and streams the answer back while the engine
//!   records it (`exchange.rs`).
//! * The upstream exchange runs in the client's own task, next to the relay
//!   of its answer; a client that goes away does not stop it: it then runs
//!   on in a task of its own, and the response is still stored.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use http::{header, Response};
use pingora_core::modules::http::HttpModules;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, ProxyWarnLogContext, Session};
use tower_idempotency::engine::{headers, Coverage, Covered, Decision, Execution, RequestHead};
use tower_idempotency::{Engine, RoutePolicy};
use tracing::Instrument;

use crate::body::{discard_body, read_body, BodyFailure};
use crate::client::write_response;
use crate::exchange::{self, Exchange};
use crate::passthrough;
use crate::shutdown::{Active, Drain};
use crate::upstream::Upstream;

/// The proxy: the engine and the upstream.
pub struct IdempotencyProxy {
    engine: Engine,
    upstream: Arc<Upstream>,
    drain: Drain,
    body_timeout: Duration,
}

/// Per-request state.
pub struct RequestCtx {
    /// The covered route, for covered requests.
    covered: Option<Covered>,
    started: Instant,
    _active: Active,
}

impl IdempotencyProxy {
    /// A proxy in front of `upstream`. A covered request's body must
    /// arrive within `body_timeout`, and no write to a client may wait
    /// longer.
    pub fn new(
        engine: Engine,
        upstream: Arc<Upstream>,
        drain: Drain,
        body_timeout: Duration,
    ) -> Self {
        IdempotencyProxy {
            engine,
            upstream,
            drain,
            body_timeout,
        }
    }

    /// Handles a covered request whole; always answers the client itself.
    async fn covered(&self, session: &mut Session, covered: &Covered) -> Result<bool> {
        // Room in the engine's buffer budget, held until decided; refused,
        // the body is not read (and the connection not reused).
        let mut permit = match self
            .engine
            .body_permit(covered, &session.req_header().headers)
        {
            Ok(permit) => permit,
            Err(refused) => {
                session.set_keepalive(None);
                write_response(session, refused).await?;
                return Ok(true);
            }
        };
        let read = read_body(session, covered.max_body_bytes());
        let read = tokio::time::timeout(self.body_timeout, read).await;
        let body = match read.unwrap_or(Err(BodyFailure::Unreadable { timed_out: true })) {
            Ok(body) => body,
            Err(failure) => {
                drop(permit);
                return self.refuse_body(session, covered, failure).await;
            }
        };
        permit.shrink_to(body.len() as u64);
        let head = request_head(session.req_header());
        let decision = self.engine.begin(covered, head, &body).await;
        drop(permit);
        let reservation = match decision {
            Decision::Respond(response) => {
                write_response(session, response).await?;
                return Ok(true);
            }
            Decision::Forward => None,
            Decision::Proceed(reservation) => Some(reservation),
        };
        // The headers the deciding route reads reach the upstream: that
        // route may be another than the one classified before the body
        // named its method (`_method=PUT`).
        let policy: &RoutePolicy = match &reservation {
            Some(reservation) => reservation.policy(),
            None => covered.policy(),
        };
        let request = self.upstream_request(session, policy, body.len());
        // What an HTTP/1.0 client's answer is held up to, to be given a
        // length: the bytes the recorder holds of it anyway.
        let hold = policy.policy().max_response_bytes;
        let (frames, mut receiver) = exchange::channel();
        let exchange = Exchange {
            engine: self.engine.clone(),
            upstream: self.upstream.clone(),
            frames: Some(frames),
            _active: self.drain.enter(),
        };
        let run = exchange.run(request, body, reservation);
        let span = tracing::Span::current();
        // Detached, it keeps the request's span (when there is one).
        let execution = match span.is_disabled() {
            true => Execution::new(run),
            false => Execution::new(run.instrument(span)),
        };
        exchange::run_and_relay(session, execution, &mut receiver, hold).await
    }

    /// Answers a body that was too large or could not be read (nothing was
    /// reserved) and ends the connection.
    async fn refuse_body(
        &self,
        session: &mut Session,
        covered: &Covered,
        failure: BodyFailure,
    ) -> Result<bool> {
        // The rest of the body is not read: the connection cannot carry
        // another request.
        session.set_keepalive(None);
        // A client still sending a body that is too large would have its
        // connection reset, and maybe lose the 413, if it were closed at
        // once: read and drop the rest first (a client still waiting for
        // `100 Continue` sends nothing; one that got it sends all).
        let linger = matches!(failure, BodyFailure::TooLarge { sending: true });
        let request = &session.req_header().headers;
        let response = match failure {
            BodyFailure::TooLarge { .. } => self.engine.body_too_large(covered, request),
            BodyFailure::Unreadable { timed_out } => {
                self.engine.body_unreadable(covered, timed_out, request)
            }
        };
        write_response(session, response).await?;
        if linger {
            discard_body(session).await;
        }
        Ok(true)
    }

    /// The request head sent upstream for a buffered body `policy` covers.
    fn upstream_request(
        &self,
        session: &Session,
        policy: &RoutePolicy,
        length: usize,
    ) -> RequestHeader {
        let mut request = session.req_header().clone();
        for name in headers::not_forwarded_for(&request.headers, policy) {
            request.remove_header(&name);
        }
        request.set_version(http::Version::HTTP_11);
        let _ = request.insert_header(header::CONTENT_LENGTH, length);
        self.upstream
            .add_forwarding_headers(&mut request, client_addr(session));
        request
    }
}

#[async_trait]
impl ProxyHttp for IdempotencyProxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            covered: None,
            started: Instant::now(),
            _active: self.drain.enter(),
        }
    }

    /// No downstream modules. Pingora's default is a response compression
    /// module at level 0 (off), which still inspects every request and
    /// response; the proxy relays bodies as the upstream encoded them.
    fn init_downstream_modules(&self, _modules: &mut HttpModules) {}

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        // A client that takes none of its answer for this long is cut: a
        // stalled reader never holds an upstream connection (Pingora sets
        // no write timeout of its own).
        session.set_write_timeout(Some(self.body_timeout));
        let request = session.req_header();
        if let Some(reason) = refused_target(request) {
            // Not forwarded, and the body is not read.
            session.set_keepalive(None);
            write_response(session, bad_request(reason)).await?;
            return Ok(true);
        }
        if self.network_path_covered(request) {
            session.set_keepalive(None);
            let reason = "The request target's path starts with `//` or holds `\\`, which \
                          backends read as a host or as `/`: send the path with one leading \
                          slash and `/` between its segments.";
            write_response(session, bad_request(reason)).await?;
            return Ok(true);
        }
        let Coverage::Covered(covered) = self.engine.classify(&request_head(request)) else {
            // Not covered, or unprotected anyway: sent directly when it
            // is a plain HTTP/1.1 request with a small body, otherwise
            // streamed by Pingora, without a body limit.
            return match passthrough::eligible(request) {
                Some(length) => {
                    passthrough::forward(
                        session,
                        &self.engine,
                        &self.upstream,
                        length,
                        self.body_timeout,
                    )
                    .await
                }
                None => Ok(false),
            };
        };
        if let Some(refused) = self
            .engine
            .unsupported_transfer_coding(&covered, &request.headers)
        {
            // Not forwarded, and the body is not read: nothing reserved.
            session.set_keepalive(None);
            write_response(session, refused).await?;
            return Ok(true);
        }
        let span =
            tracing::info_span!("request", method = %request.method, route = covered.label());
        let covered = ctx.covered.insert(covered);
        match span.is_disabled() {
            true => self.covered(session, covered).await,
            false => self.covered(session, covered).instrument(span).await,
        }
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        Ok(self.upstream.peer())
    }

    /// Pingora's path: the requests [`passthrough::eligible`] leaves to it
    /// (chunked or large bodies, `Expect`, HTTP/1.0, upgrades). Its pool
    /// takes a connection back after any answer but a 101, so one whose
    /// answer may leave bytes on it (an early answer to a body the upstream
    /// never read, a `HEAD`, a body sent with a `GET`, a refused upgrade)
    /// could answer the next request with a request smuggled in that body.
    /// None of these connections is kept: the request says `close`, which
    /// Pingora's client obeys whatever the upstream answers, and which
    /// tells the upstream to read no further request on it. A request that
    /// asks for an upgrade says `upgrade, close`, so the upgrade still goes
    /// through: Pingora passes on WebSocket upgrades only (`Upgrade:
    /// websocket`, with `Connection: Upgrade` it adds itself) and strips
    /// any other `Upgrade` before this filter, which then gets `close`.
    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        request: &mut RequestHeader,
        _ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.upstream
            .add_forwarding_headers(request, client_addr(session));
        let upgrade = request.headers.contains_key(header::UPGRADE)
            && headers::connection_listed(&request.headers).contains(&header::UPGRADE);
        let connection = if upgrade { "upgrade, close" } else { "close" };
        request.insert_header(header::CONNECTION, connection)?;
        Ok(())
    }

    /// The head of an answer relayed on Pingora's path, as the client
    /// reads it ([`exchange::for_client`]: no chunks to HTTP/1.0).
    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        _ctx: &mut RequestCtx,
    ) -> Result<()> {
        exchange::for_client(session, upstream_response);
        Ok(())
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        error: &Error,
        _ctx: &mut RequestCtx,
    ) -> FailToProxy {
        let gone = FailToProxy {
            error_code: 0,
            can_reuse_downstream: false,
        };
        if session.response_written().is_some() {
            // Mid-response: all that is left is to cut the connection.
            return gone;
        }
        let request = &session.req_header().headers;
        let response = match (error.esource(), error.etype()) {
            (ErrorSource::Upstream, ErrorType::ReadTimedout | ErrorType::WriteTimedout) => {
                self.engine.upstream_failed(true, request)
            }
            (ErrorSource::Upstream, _) => self.engine.upstream_failed(false, request),
            // A client that took none of its answer in time ([`write_head`])
            // is gone too: an error page written to it would block again,
            // with no timeout, and after a partial head.
            (
                ErrorSource::Downstream,
                ErrorType::WriteError
                | ErrorType::WriteTimedout
                | ErrorType::ReadError
                | ErrorType::ConnectionClosed,
            ) => return gone,
            _ => {
                let code = match error.etype() {
                    ErrorType::HTTPStatus(code) => *code,
                    _ if *error.esource() == ErrorSource::Downstream => 400,
                    _ => 500,
                };
                session.respond_error(code).await.ok();
                return FailToProxy {
                    error_code: code,
                    can_reuse_downstream: false,
                };
            }
        };
        let code = response.status().as_u16();
        session.set_keepalive(None);
        if write_response(session, response).await.is_err() {
            return gone;
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    /// What Pingora's own error lines say about a request: method and path,
    /// never the query (a key may travel there) or headers.
    fn request_summary(&self, session: &Session, _ctx: &RequestCtx) -> String {
        let request = session.req_header();
        format!("{} {}", request.method, request.uri.path())
    }

    /// Pingora's own error lines print the error whole, with the raw bytes
    /// of a head it could not parse (an upstream's `Set-Cookie`, a
    /// client's `Authorization`); [`logging`](Self::logging) writes the
    /// line instead, with those bytes left out.
    fn suppress_error_log(&self, _session: &Session, _ctx: &RequestCtx, _error: &Error) -> bool {
        true
    }

    /// As [`suppress_error_log`](Self::suppress_error_log), for the lines
    /// of retried attempts.
    fn suppress_proxy_warn_log(
        &self,
        _session: &Session,
        _ctx: &RequestCtx,
        _error: &Error,
        _context: ProxyWarnLogContext,
    ) -> bool {
        true
    }

    async fn logging(&self, session: &mut Session, error: Option<&Error>, ctx: &mut RequestCtx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        let request = session.req_header();
        let duration_us = ctx.started.elapsed().as_micros() as u64;
        let route = ctx.covered.as_ref().map(|covered| covered.label());
        let path = request.uri.path();
        match error {
            // A client that went away is its own business.
            Some(error) if *error.esource() != ErrorSource::Downstream => {
                let error = crate::logs::Redacted(error);
                tracing::warn!(method = %request.method, path, route, status, duration_us, %error, "request failed")
            }
            error => {
                let error =
                    error.map(|error| tracing::field::display(crate::logs::Redacted(error)));
                tracing::debug!(method = %request.method, route, status, duration_us, error, "request done")
            }
        }
    }
}

/// Why the proxy refuses `request`'s target, if it does: every request is
/// matched, scoped and fingerprinted by the path the upstream will read,
/// so a target whose path the proxy reads otherwise is never forwarded.
/// Pingora reads a target that is neither a path nor an `http(s)` URL
/// (`x:/orders`) as `/` and forwards it as it came, where Rack, Django
/// and Go read `/orders`; a target that is not UTF-8 it reads with its
/// bytes replaced (so `/a/\xff` and `/a/\xfe` would share a scope); and an
/// absolute-form target without `Host`, or any HTTP/1.1 request without
/// one (RFC 9112 requires it), names a host the scope never sees; and two
/// `Host` lines (RFC 9112 forbids them) name two, of which a backend may
/// read either.
fn refused_target(request: &RequestHeader) -> Option<&'static str> {
    if !request.raw_path_is_utf8() {
        return Some("The request target is not UTF-8: percent-encode it.");
    }
    let target = request.raw_path();
    let absolute = [&b"http://"[..], b"https://"].iter().any(|scheme| {
        target
            .get(..scheme.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(scheme))
    });
    let host = request.headers.contains_key(header::HOST);
    if request
        .headers
        .get_all(header::HOST)
        .iter()
        .nth(1)
        .is_some()
    {
        // RFC 9112, 3.2: a backend may read either line, another tenant's.
        Some("A request must carry one Host header, not several.")
    } else if request.version == http::Version::HTTP_11 && !host {
        // RFC 9112, 3.2: no `Host`, no authority to scope the key by.
        Some("An HTTP/1.1 request must carry a Host header.")
    } else if target.first() == Some(&b'/') || target == b"*" {
        None
    } else if !absolute {
        Some("The request target must be a path (/...) or an http(s) URL.")
    } else if !host {
        Some("A request whose target is a URL must carry a Host header too.")
    } else {
        None
    }
}

impl IdempotencyProxy {
    /// Whether `request`'s target reads another way to WHATWG URL parsers
    /// (Node's `new URL(target, base)`) or Python's `urlsplit`, and any
    /// reading of it is covered: every `\` read as `/`, and a start of two
    /// or more slashes read as a host (all leading slashes skipped, the
    /// host up to the next `/`, `?` or `#`) and then the path
    /// (`//shop.example/pay` and `///shop.example/pay` are `/pay`), where
    /// the proxy merges the slashes (`/shop.example/pay`). Such a request
    /// is refused: no spelling skips a required route, or is scoped apart
    /// from the path a backend serves.
    fn network_path_covered(&self, request: &RequestHeader) -> bool {
        let target = request.raw_path();
        let slashes = target
            .iter()
            .take_while(|b| matches!(b, b'/' | b'\\'))
            .count();
        // The path only: a `\` in the query is the query's.
        let path_end = target
            .iter()
            .position(|b| matches!(b, b'?' | b'#'))
            .unwrap_or(target.len());
        if slashes < 2 && !target[..path_end].contains(&b'\\') {
            return false;
        }
        let covered = |path: Vec<u8>| {
            let Ok(uri) = http::Uri::try_from(path) else {
                return true;
            };
            let head = RequestHead {
                uri: &uri,
                ..request_head(request)
            };
            matches!(self.engine.classify(&head), Coverage::Covered(_))
        };
        let mapped: Vec<u8> = target
            .iter()
            .enumerate()
            .map(|(at, &b)| if b == b'\\' && at < path_end { b'/' } else { b })
            .collect();
        if covered(
            request
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .into(),
        ) || covered(mapped.clone())
        {
            return true;
        }
        if slashes < 2 {
            return false;
        }
        let rest = &mapped[slashes..];
        let host = rest
            .iter()
            .position(|b| matches!(b, b'/' | b'?' | b'#'))
            .unwrap_or(rest.len());
        let rest = &rest[host..];
        let path = match rest.first() {
            Some(b'/') => rest.to_vec(),
            _ => [&b"/"[..], rest].concat(),
        };
        covered(path)
    }
}

/// A plain 400 saying `reason`.
fn bad_request(reason: &'static str) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from_static(reason.as_bytes()));
    *response.status_mut() = http::StatusCode::BAD_REQUEST;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// What the engine sees of a request. The proxy knows no principal of its
/// own; callers are told apart by the route's `scope_headers` and
/// `principal` (a gateway header or a JWT the engine verifies).
fn request_head(request: &RequestHeader) -> RequestHead<'_> {
    RequestHead {
        method: &request.method,
        uri: &request.uri,
        headers: &request.headers,
        principal: None,
        routed: None,
    }
}

fn client_addr(session: &Session) -> Option<SocketAddr> {
    session
        .client_addr()
        .and_then(|addr| addr.as_inet())
        .copied()
}
