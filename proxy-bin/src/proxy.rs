//! The Pingora front end: it moves bytes, the [`Engine`] decides.
//!
//! * A request the engine does not cover (safe methods, unmatched paths,
//!   disabled routes) takes Pingora's normal proxy path: streamed both ways,
//!   never buffered.
//! * A covered request is handled whole in [`ProxyHttp::request_filter`]:
//!   its body is buffered up to the route's limit (over it: 413, nothing
//!   reserved, upstream untouched) and handed to [`Engine::begin`]. A replay
//!   or problem is written without contacting the upstream. Otherwise the
//!   proxy sends the buffered request itself over the shared keep-alive pool
//!   (Pingora's retry buffer holds only 64 KiB, so its own path could not
//!   resend a larger body) and streams the answer back while the engine
//!   captures it.
//! * The upstream exchange runs in a detached task: a client that goes away
//!   does not stop it, and the response is still stored.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderName, Response};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use tokio::sync::mpsc;
use tower_idempotency::{Capture, Decision, Engine, RequestHead, Reservation, RoutePolicy, Routes};
use tracing::Instrument;

use crate::config::route_label;
use crate::shutdown::{Active, Drain};
use crate::upstream::{Upstream, HOP_BY_HOP};

/// The proxy: the engine, the route table (for log labels), the upstream.
pub struct IdempotencyProxy {
    engine: Engine,
    routes: Routes,
    upstream: Arc<Upstream>,
    drain: Drain,
    body_timeout: Duration,
}

/// Per-request state.
pub struct RequestCtx {
    /// The matched route's path pattern, for covered requests.
    route: Option<String>,
    started: Instant,
    _active: Active,
}

impl IdempotencyProxy {
    /// A proxy in front of `upstream`; `routes` must be the table `engine`
    /// was built with. A covered request's body must arrive within
    /// `body_timeout`.
    pub fn new(
        engine: Engine,
        routes: Routes,
        upstream: Arc<Upstream>,
        drain: Drain,
        body_timeout: Duration,
    ) -> Self {
        IdempotencyProxy {
            engine,
            routes,
            upstream,
            drain,
            body_timeout,
        }
    }

    /// Handles a covered request whole; always answers the client itself.
    async fn covered(&self, session: &mut Session, policy: Arc<RoutePolicy>) -> Result<bool> {
        let read = read_body(session, policy.max_body_bytes());
        let read = tokio::time::timeout(self.body_timeout, read).await;
        let body = match read.unwrap_or(Err(BodyFailure::Unreadable { timed_out: true })) {
            Ok(body) => body,
            Err(failure) => {
                // The rest of the body is not read: the connection cannot
                // carry another request.
                session.set_keepalive(None);
                // A client still sending a body that is too large would
                // have its connection reset, and maybe lose the 413, if it
                // were closed at once: read and drop the rest first (a
                // client waiting for `100 Continue` sends nothing).
                let linger = matches!(failure, BodyFailure::TooLarge)
                    && !expects_continue(session.req_header());
                let response = match failure {
                    BodyFailure::TooLarge => self.engine.body_too_large(&policy),
                    BodyFailure::Unreadable { timed_out } => self.engine.body_unreadable(timed_out),
                };
                write_response(session, response).await?;
                if linger {
                    discard_body(session).await;
                }
                return Ok(true);
            }
        };
        let head = request_head(session.req_header());
        let reservation = match self.engine.begin(&policy, head, &body).await {
            Decision::Respond(response) => {
                write_response(session, response).await?;
                return Ok(true);
            }
            Decision::Forward => None,
            Decision::Proceed(reservation) => Some(reservation),
        };
        let request = self.upstream_request(session, body.len());
        let (frames, mut receiver) = mpsc::channel(16);
        let exchange = Exchange {
            engine: self.engine.clone(),
            upstream: self.upstream.clone(),
            frames: Some(frames),
            _active: self.drain.enter(),
        };
        tokio::spawn(
            exchange
                .run(request, body, reservation)
                .instrument(tracing::Span::current()),
        );
        relay(session, &mut receiver).await
    }

    /// The request head sent upstream for a buffered body.
    fn upstream_request(&self, session: &Session, length: usize) -> RequestHeader {
        let mut request = session.req_header().clone();
        let listed = connection_listed(&request.headers);
        for name in HOP_BY_HOP.iter().chain(&listed) {
            request.remove_header(name);
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
            route: None,
            started: Instant::now(),
            _active: self.drain.enter(),
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let request = session.req_header();
        let Some(policy) = self.engine.route(&request.method, request.uri.path()) else {
            return Ok(false);
        };
        if self
            .engine
            .passes_without_key(&policy, &request_head(request))
        {
            // Unprotected anyway: stream it, without a body limit.
            return Ok(false);
        }
        if let Some(refused) = self.engine.unsupported_transfer_coding(&request.headers) {
            // Not forwarded, and the body is not read: nothing reserved.
            session.set_keepalive(None);
            write_response(session, refused).await?;
            return Ok(true);
        }
        let route = route_label(&self.routes, &policy);
        let span = tracing::info_span!("request", method = %request.method, route = %route);
        ctx.route = Some(route);
        self.covered(session, policy).instrument(span).await
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        Ok(self.upstream.peer())
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        request: &mut RequestHeader,
        _ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.upstream
            .add_forwarding_headers(request, client_addr(session));
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
        let response = match (error.esource(), error.etype()) {
            (ErrorSource::Upstream, ErrorType::ReadTimedout | ErrorType::WriteTimedout) => {
                self.engine.upstream_failed(true)
            }
            (ErrorSource::Upstream, _) => self.engine.upstream_failed(false),
            (
                ErrorSource::Downstream,
                ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed,
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

    async fn logging(&self, session: &mut Session, error: Option<&Error>, ctx: &mut RequestCtx) {
        let status = session.response_written().map_or(0, |r| r.status.as_u16());
        let request = session.req_header();
        let duration_us = ctx.started.elapsed().as_micros() as u64;
        match &ctx.route {
            Some(route) => {
                tracing::debug!(method = %request.method, route, status, duration_us, error = error.map(tracing::field::display), "request done")
            }
            None => {
                tracing::debug!(method = %request.method, status, duration_us, error = error.map(tracing::field::display), "passthrough done")
            }
        }
    }
}

/// What the engine sees of a request. The proxy knows no principal of its
/// own; callers are told apart by the route's `scope_headers`.
fn request_head(request: &RequestHeader) -> RequestHead<'_> {
    RequestHead {
        method: &request.method,
        uri: &request.uri,
        headers: &request.headers,
        principal: None,
    }
}

fn client_addr(session: &Session) -> Option<SocketAddr> {
    session
        .client_addr()
        .and_then(|addr| addr.as_inet())
        .copied()
}

fn connection_listed(headers: &http::HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

enum BodyFailure {
    TooLarge,
    Unreadable { timed_out: bool },
}

/// Reads the whole request body, refusing it (before reading, when
/// `Content-Length` says so) once it exceeds `limit`.
async fn read_body(session: &mut Session, limit: usize) -> Result<Bytes, BodyFailure> {
    let request = session.req_header();
    let declared = request
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(BodyFailure::TooLarge);
    }
    if expects_continue(request) && session.write_continue_response().await.is_err() {
        return Err(BodyFailure::Unreadable { timed_out: false });
    }
    let mut body = BytesMut::with_capacity(declared.map_or(0, |n| n as usize));
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Err(BodyFailure::TooLarge);
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body.freeze()),
            Err(error) => {
                return Err(BodyFailure::Unreadable {
                    timed_out: matches!(error.etype(), ErrorType::ReadTimedout),
                })
            }
        }
    }
}

/// Whether the client waits for `100 Continue` before it sends the body.
fn expects_continue(request: &RequestHeader) -> bool {
    request
        .headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The most a refused body is read (and dropped) after its 413, in bytes
/// and in time, before the connection is closed.
const LINGER_BYTES: usize = 8 << 20;
const LINGER_TIME: Duration = Duration::from_secs(2);

/// Reads and drops what is left of the request body, within the linger
/// bounds: closing a socket with unread data resets it, and the client
/// could see the reset instead of the answer already sent.
async fn discard_body(session: &mut Session) {
    let drain = async {
        let mut left = LINGER_BYTES;
        while let Ok(Some(chunk)) = session.read_request_body().await {
            left = left.saturating_sub(chunk.len());
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}

/// Writes a whole response (a replay or one of the engine's problems).
async fn write_response(session: &mut Session, response: Response<Bytes>) -> Result<()> {
    let (parts, body) = response.into_parts();
    let mut head: ResponseHeader = parts.into();
    head.insert_header(header::CONTENT_LENGTH, body.len())?;
    session
        .write_response_header(Box::new(head), body.is_empty())
        .await?;
    if !body.is_empty() {
        session.write_response_body(Some(body), true).await?;
    }
    Ok(())
}

/// What the upstream exchange hands to the client side.
enum Frame {
    /// The upstream's response head.
    Head(Box<ResponseHeader>),
    /// A body chunk.
    Body(Bytes),
    /// The response is complete.
    End,
    /// The upstream failed before answering: this problem replaces it.
    Failed(Response<Bytes>),
    /// The upstream broke off mid-response: cut the client's connection.
    Abort,
}

/// Writes the frames of one exchange to the client.
async fn relay(session: &mut Session, frames: &mut mpsc::Receiver<Frame>) -> Result<bool> {
    while let Some(frame) = frames.recv().await {
        match frame {
            Frame::Head(head) => session.write_response_header(head, false).await?,
            Frame::Body(chunk) => session.write_response_body(Some(chunk), false).await?,
            Frame::End => {
                session.write_response_body(None, true).await?;
                return Ok(true);
            }
            Frame::Failed(response) => {
                session.set_keepalive(None);
                write_response(session, response).await?;
                return Ok(true);
            }
            Frame::Abort => break,
        }
    }
    Error::e_explain(ErrorType::ReadError, "the upstream broke off its response")
        .map_err(|e| e.into_up())
}

/// One request sent upstream by the proxy itself, detached from the client.
struct Exchange {
    engine: Engine,
    upstream: Arc<Upstream>,
    /// `None` once the client is gone; the exchange then goes on alone.
    frames: Option<mpsc::Sender<Frame>>,
    _active: Active,
}

impl Exchange {
    async fn send(&mut self, frame: Frame) {
        if let Some(frames) = &self.frames {
            if frames.send(frame).await.is_err() {
                tracing::info!("client went away; the upstream response is still recorded");
                self.frames = None;
            }
        }
    }

    /// Sends the request, streams the answer to the client and settles the
    /// reservation: stored (before the client sees the end of the
    /// response), or released when the upstream failed.
    async fn run(mut self, request: RequestHeader, body: Bytes, reservation: Option<Reservation>) {
        let mut session = match self.upstream.send(&request, &body).await {
            Ok(session) => session,
            Err(failure) => {
                tracing::warn!(error = %failure.error, timed_out = failure.timed_out, "upstream failed");
                if let Some(reservation) = reservation {
                    reservation.release().await;
                }
                let problem = self.engine.upstream_failed(failure.timed_out);
                self.send(Frame::Failed(problem)).await;
                return;
            }
        };
        let mut head = session
            .resp_header()
            .expect("a response head was read")
            .clone();
        let mut pending: Option<(Reservation, Capture)> = reservation.map(|reservation| {
            let capture = reservation.capture(head.status, &head.headers);
            (reservation, capture)
        });
        // A status the route does not store frees the key at once.
        settle_if(&mut pending, |capture| !capture.wants_body()).await;
        for name in connection_listed(&head.headers)
            .iter()
            .chain(&HOP_BY_HOP[..3])
        {
            head.remove_header(name);
        }
        self.send(Frame::Head(Box::new(head))).await;
        loop {
            match session.read_body_bytes().await {
                Ok(Some(chunk)) => {
                    if let Some((_, capture)) = &mut pending {
                        capture.push(&chunk);
                    }
                    // Store before the client sees the last byte; past the
                    // storage cap, store the marker now.
                    let done = session.is_body_done();
                    settle_if(&mut pending, |capture| done || !capture.wants_body()).await;
                    self.send(Frame::Body(chunk)).await;
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%error, "upstream broke off its response");
                    if let Some((reservation, _)) = pending {
                        reservation.release().await;
                    }
                    self.send(Frame::Abort).await;
                    return;
                }
            }
        }
        settle_if(&mut pending, |_| true).await;
        self.send(Frame::End).await;
        self.upstream.release(session).await;
    }
}

/// Finishes the reservation when `now` says so.
async fn settle_if(
    pending: &mut Option<(Reservation, Capture)>,
    now: impl FnOnce(&Capture) -> bool,
) {
    if pending.as_ref().is_some_and(|(_, capture)| now(capture)) {
        if let Some((reservation, capture)) = pending.take() {
            reservation.finish(capture).await;
        }
    }
}
