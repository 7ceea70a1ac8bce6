use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;

use super::future::Step;
use super::{RequestBody, ResponseBody, ResponseFuture};
use crate::engine::{headers, Coverage, Decision, Ended, Flow, RequestHead, Reservation};
use crate::Engine;

/// The authenticated caller, set as a request extension by an auth layer
/// that runs before [`Idempotency`]. It is hashed into the key's scope, so
/// two principals using the same key never see each other's responses. It
/// is never stored or logged.
///
/// When set, it wins over the route's configured
/// [`Policy::principal`](crate::Policy::principal): the route's header or
/// JWT is then not read (the application has authenticated the caller).
/// When not set, the route's principal, if any, is resolved and verified
/// by the engine. The extension's bytes and a route's header principal's
/// value share one namespace (a JWT's principal has its own, which no
/// extension reaches, whatever bytes it holds): where some
/// callers of a header-principal route come with the extension and others
/// with the header, give them ids that cannot be equal (a prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal(pub Bytes);

impl Principal {
    /// A principal from any stable identifier (user id, tenant id, …).
    pub fn new(id: impl Into<Bytes>) -> Self {
        Principal(id.into())
    }

    /// The bytes the key's scope is made of: the id as it is, or, for an
    /// id that starts with NUL (no header value can), behind a tag of its
    /// own, so it is never the NUL-tagged principal of a JWT caller
    /// (`\0jwt\0[null,"alice"]` set by an application from a user-chosen
    /// id would otherwise have been alice's scope).
    fn scoped(&self) -> Bytes {
        match self.0.first() {
            Some(0) => [&b"\0ext\0"[..], &self.0].concat().into(),
            _ => self.0.clone(),
        }
    }
}

/// Set by the layer on a request it executes under a held key: a stable id
/// of the request's idempotency scope (everything its key is scoped by:
/// principal, method, host unless `scope_authority` is off, path, scope
/// headers, key), the same for every execution of that key — a second one
/// after a released key, or a takeover after a crash — and different for
/// any other scope. A domain-separated SHA-256 of the scope key (itself
/// keyed by the engine's key secret when one is set): not the id the store
/// files the record under.
///
/// Use it where the handler records an effect that must happen once per
/// key even when the key runs again: as an outbox `Message`'s `source`,
/// so a handler that enqueued, then answered a status that releases the
/// key (a 500 after its commit), enqueues nothing the second time (the
/// outbox keeps one row per topic and source). It is an opaque hash; but
/// without a key secret, whoever knows (or guesses) a request's key and
/// principal can compute it. Not set on a request forwarded without a held
/// key (an uncovered route, a fail-open route whose store is down): take
/// it as an `Option`.
///
/// The id is computed when first asked for: a request whose handler never
/// reads it costs a copy of 32 bytes.
#[derive(Clone)]
pub struct ExecutionScope {
    key: crate::store::ScopeKey,
    /// The owner the key is held under: a layer nested inside checks with
    /// it (an owner-checked renewal) that its own store holds the key for
    /// this very execution.
    owner: crate::store::OwnerToken,
    /// The outer route's lease: the inner layer's check renews with it, as
    /// an early heartbeat of the outer's (never a shorter lease, which a
    /// retry could take over while the execution still runs).
    lease: std::time::Duration,
    id: std::sync::OnceLock<String>,
}

impl ExecutionScope {
    fn of(reservation: &Reservation) -> Self {
        ExecutionScope {
            key: reservation.scope_key(),
            owner: reservation.owner_token(),
            lease: reservation.policy().policy().lease,
            id: std::sync::OnceLock::new(),
        }
    }

    /// The id, 64 hex digits.
    pub fn as_str(&self) -> &str {
        self.id
            .get_or_init(|| crate::engine::execution_scope_id(&self.key))
    }
}

impl PartialEq for ExecutionScope {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for ExecutionScope {}

impl std::hash::Hash for ExecutionScope {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

impl std::fmt::Debug for ExecutionScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ExecutionScope")
            .field(&self.as_str())
            .finish()
    }
}

/// Makes unsafe requests to the inner service take effect once. Built by
/// [`IdempotencyLayer`](super::IdempotencyLayer); see the
/// [module docs](crate::layer) for the guarantees.
///
/// Always ready ([`Service::poll_ready`] fails only when the inner
/// service's does): a replay, a duplicate's 409 and the engine's refusals
/// never call the inner service, so they never wait for its readiness (a
/// concurrency limit held by slow executions). A request that does call it
/// waits for that readiness inside its own future, on a clone of its own;
/// load shedding (`LoadShedLayer`) belongs inside the layer, beside the
/// limit, where it sheds only what would call the inner service.
#[derive(Debug)]
pub struct Idempotency<S> {
    inner: S,
    engine: Engine,
    /// Whether `inner` said it was ready to the last `poll_ready` and was
    /// not called since: a passthrough then calls it directly.
    inner_ready: bool,
}

impl<S: Clone> Clone for Idempotency<S> {
    /// A clone's inner service is a clone, not ready until polled.
    fn clone(&self) -> Self {
        Idempotency::new(self.inner.clone(), self.engine.clone())
    }
}

impl<S> Idempotency<S> {
    /// Wraps `inner` with `engine`.
    pub fn new(inner: S, engine: Engine) -> Self {
        Idempotency {
            inner,
            engine,
            inner_ready: false,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<S, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + Unpin + 'static,
    ResB::Error: Send + 'static,
{
    type Response = Response<ResponseBody<ResB, ResB::Error>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.inner_ready {
            match self.inner.poll_ready(cx) {
                Poll::Ready(Ok(())) => self.inner_ready = true,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                // Ready all the same: see the type's docs. A request that
                // calls the inner service waits for it on a clone; this
                // instance, left waiting, is dropped for a fresh clone, so
                // nothing it queued for (a concurrency limit's permit,
                // handed to the first waiter in line) stays pinned by an
                // instance nobody polls again.
                Poll::Pending => {
                    let fresh = self.inner.clone();
                    drop(std::mem::replace(&mut self.inner, fresh));
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let head = RequestHead {
            method: request.method(),
            uri: original_uri(request.extensions(), request.uri()),
            headers: request.headers(),
            principal: None,
            routed: Some(request.uri()),
        };
        let ready_now = std::mem::take(&mut self.inner_ready);
        let Coverage::Covered(covered) = self.engine.classify(&head) else {
            let request = request.map(RequestBody::streaming);
            if ready_now {
                return ResponseFuture::passthrough(self.inner.call(request));
            }
            let inner = self.inner.clone();
            return ResponseFuture::engine(Box::pin(forward(inner, request)));
        };
        // A clone, made ready only when it is called: the instance polled
        // ready is dropped here (a fresh clone takes its place), so what its
        // readiness holds (a concurrency limit's permit, a buffer's slot) is
        // not held while the body is read and the engine decides, nor by a
        // replay that never calls it, nor by a caller that keeps this
        // service and would otherwise pin it.
        let inner = self.inner.clone();
        drop(std::mem::replace(&mut self.inner, inner.clone()));
        let engine = self.engine.clone();
        ResponseFuture::engine(Box::pin(async move {
            let (parts, body) = request.into_parts();
            if let Some(refused) = engine.unsupported_transfer_coding(&covered, &parts.headers) {
                return Step::Done(Ok(refused.map(ResponseBody::full)));
            }
            // Room in the engine's buffer budget, held until decided.
            let mut permit = match engine.body_permit(&covered, &parts.headers) {
                Ok(permit) => permit,
                Err(refused) => return Step::Done(Ok(refused.map(ResponseBody::full))),
            };
            let read = crate::engine::within(
                engine.body_timeout(),
                read_body(body, covered.max_body_bytes()),
            );
            let body = match read.await.unwrap_or(Err(ReadError::TimedOut)) {
                Ok(body) => body,
                Err(ReadError::TooLarge) => {
                    let response = engine.body_too_large(&covered, &parts.headers);
                    return Step::Done(Ok(response.map(ResponseBody::full)));
                }
                Err(failed) => {
                    let timed_out = matches!(failed, ReadError::TimedOut);
                    let response = engine.body_unreadable(&covered, timed_out, &parts.headers);
                    return Step::Done(Ok(response.map(ResponseBody::full)));
                }
            };
            permit.shrink_to(body.len() as u64);
            let principal = parts.extensions.get::<Principal>().map(Principal::scoped);
            let head = RequestHead {
                method: &parts.method,
                uri: original_uri(&parts.extensions, &parts.uri),
                headers: &parts.headers,
                principal: principal.as_deref(),
                routed: Some(&parts.uri),
            };
            // Under a key an outer layer holds in this layer's store too (a
            // layer nested in another over the same records), the request
            // goes on as the outer layer's execution: waiting for the key
            // would wait for itself. Over another store, it is decided as
            // any request (that store holds no such lease).
            let held = parts
                .extensions
                .get::<ExecutionScope>()
                .map(|held| (&held.key, &held.owner, held.lease));
            let decision = engine.begin_within(&covered, head, &body, held).await;
            let request = Request::from_parts(parts, RequestBody::buffered(body));
            let mut inner = inner;
            // The body stays counted in the budget until the inner service
            // is ready for it: bodies queued behind a concurrency limit are
            // buffered bodies too.
            match decision {
                Decision::Respond(response) => Step::Done(Ok(response.map(ResponseBody::full))),
                Decision::Forward => {
                    if let Err(error) = ready(&mut inner).await {
                        return Step::Done(Err(error));
                    }
                    drop(permit);
                    forward(inner, request).await
                }
                // Runs in the caller's task; if the caller goes away, the
                // `ResponseFuture` moves it to a task of its own.
                Decision::Proceed(reservation) => {
                    // Ready within the execution's time, or nothing runs:
                    // the key is free again, and the caller gets 504. One
                    // deadline for both: the key is held for at most
                    // `execution_timeout` in all.
                    let timeout = reservation.policy().policy().execution_timeout;
                    let deadline = tokio::time::Instant::now() + timeout;
                    match tokio::time::timeout_at(deadline, ready(&mut inner)).await {
                        Ok(Ok(())) => {
                            let execution = execute(inner, request, reservation, deadline);
                            Step::Execute(Box::pin(execution))
                        }
                        Ok(Err(error)) => {
                            reservation.release().await;
                            Step::Done(Err(error))
                        }
                        Err(_) => {
                            reservation.release().await;
                            let response = engine.upstream_failed(true, request.headers());
                            Step::Done(Ok(response.map(ResponseBody::full)))
                        }
                    }
                }
            }
        }))
    }
}

/// The URI the request arrived with: axum records it as `OriginalUri`
/// before `Router::nest` strips a prefix, and the scope must tell
/// `/shop-a/orders` from `/shop-b/orders` even where the layer sees
/// `/orders` for both; else `uri`, the one the layer sees. (Routes are
/// still matched on the path the layer sees, as they are written for where
/// the layer sits: [`RequestHead::routed`].)
fn original_uri<'a>(
    #[cfg_attr(not(feature = "axum"), allow(unused_variables))] extensions: &'a http::Extensions,
    uri: &'a http::Uri,
) -> &'a http::Uri {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::OriginalUri(uri)) = extensions.get() {
        return uri;
    }
    uri
}

/// Calls `service` once it is ready, its answer streamed as it is.
async fn forward<S, ReqB, ResB>(
    mut service: S,
    request: Request<RequestBody<ReqB>>,
) -> Step<ResB, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Unpin,
{
    if let Err(error) = ready(&mut service).await {
        return Step::Done(Err(error));
    }
    let answer = service.call(request).await;
    Step::Done(answer.map(|response| response.map(|body| ResponseBody::streaming(body))))
}

/// Waits until `service` is ready for a call.
async fn ready<S, R>(service: &mut S) -> Result<(), S::Error>
where
    S: Service<R>,
{
    std::future::poll_fn(|cx| service.poll_ready(cx)).await
}

/// Whether a body's error, or one it was caused by, is a length limit's.
fn over_a_limit(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut error = Some(error);
    while let Some(cause) = error {
        if cause.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        error = cause.source();
    }
    false
}

enum ReadError {
    TooLarge,
    Failed,
    TimedOut,
}

/// Collects a request body, refusing it as soon as it exceeds `limit`, or
/// when a limit outside the layer cut it (`http_body_util::Limited`, which
/// tower-http's `RequestBodyLimitLayer` wraps bodies in: 413 as there,
/// not 400).
async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge);
    }
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut buffer = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => {
                let error: BoxError = error.into();
                return Err(match over_a_limit(&*error) {
                    true => ReadError::TooLarge,
                    false => ReadError::Failed,
                });
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let total = first.as_ref().map_or(0, Bytes::len) + buffer.len() + data.len();
        if total > limit {
            return Err(ReadError::TooLarge);
        }
        // The common single-chunk body is passed on without a copy.
        match first.take() {
            None if buffer.is_empty() => first = Some(data),
            Some(previous) => {
                buffer.extend_from_slice(&previous);
                buffer.extend_from_slice(&data);
            }
            None => buffer.extend_from_slice(&data),
        }
    }
    Ok(first.unwrap_or_else(|| buffer.freeze()))
}

/// The body's next frame, or `None` once `deadline` has passed.
///
/// A body that is always ready with frames that carry nothing (empty data,
/// trailers) without end would never let the timer be looked at, nor the
/// worker run anything else: after such a frame the task yields once its
/// cooperative budget is spent, and the deadline is read. The deadline is
/// read only then, so an answer ready exactly at it is still the answer.
async fn next_frame<B: Body<Data = Bytes> + Unpin>(
    body: &mut B,
    deadline: tokio::time::Instant,
) -> Option<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
    let frame = tokio::time::timeout_at(deadline, body.frame()).await.ok()?;
    let empty = match &frame {
        Some(Ok(frame)) => frame.data_ref().is_none_or(Bytes::is_empty),
        _ => false,
    };
    if empty {
        tokio::task::consume_budget().await;
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
    }
    Some(frame)
}

/// Calls the inner service while holding the reservation and hands its
/// answer to the engine's recorder; the answer is stored before the caller
/// gets it. Past `deadline` (the route's `execution_timeout` from when the
/// key was held; to the end of the recorded body) it stops waiting: 504,
/// stored as the key's outcome.
async fn execute<S, ReqB, ResB>(
    mut inner: S,
    request: Request<RequestBody<ReqB>>,
    reservation: Reservation,
    deadline: tokio::time::Instant,
) -> Result<Response<ResponseBody<ResB, ResB::Error>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Unpin,
{
    // What the 504 is written for (HTML or JSON), kept before the request
    // goes to the inner service.
    let mut accept = http::HeaderMap::new();
    for value in request.headers().get_all(http::header::ACCEPT) {
        accept.append(http::header::ACCEPT, value.clone());
    }
    let mut request = request;
    request
        .extensions_mut()
        .insert(ExecutionScope::of(&reservation));
    if !reservation.acting() {
        // The key may be another arrival's now (the store was out for the
        // whole lease while this one waited for the inner service).
        let response = reservation.lost(&accept).await;
        return Ok(response.map(ResponseBody::full));
    }
    let call = tokio::time::timeout_at(deadline, inner.call(request)).await;
    let Ok(call) = call else {
        let response = reservation.execution_timed_out(&accept).await;
        return Ok(response.map(ResponseBody::full));
    };
    let response = match call {
        Ok(response) => response,
        Err(error) => {
            reservation.release().await;
            return Err(error);
        }
    };
    let (mut parts, mut body) = response.into_parts();
    let mut recorder = reservation.record(parts.status, &parts.headers).await;
    if !recorder.is_recording() {
        // Not a status the route stores (the key is free): stream it.
        return Ok(Response::from_parts(parts, ResponseBody::streaming(body)));
    }
    loop {
        let Some(frame) = next_frame(&mut body, deadline).await else {
            let response = recorder.execution_timed_out(&accept).await;
            return Ok(response.map(ResponseBody::full));
        };
        let data = match frame {
            None => break,
            Some(Err(error)) => {
                let received = recorder.fail().await;
                declare_cut(&mut parts, received.len());
                let body = ResponseBody::failed(received, error);
                return Ok(Response::from_parts(parts, body));
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue,
            },
        };
        if let Flow::Pass { recorded } = recorder.chunk(&data).await {
            // Past the storage cap (the marker is stored): stream the rest.
            let mut received = BytesMut::from(&recorded[..]);
            received.extend_from_slice(&data);
            let body = ResponseBody::prefixed(received.freeze(), body);
            return Ok(Response::from_parts(parts, body));
        }
    }
    let body = match recorder.end().await {
        // The caller gets the stored bytes themselves (no second copy),
        // framed by their own length: a server trusts a body's exact
        // length over the header it writes, so a `Content-Length` the
        // engine could not read as one number (two lines that differ, or
        // none) must not go out beside it.
        Ended::Whole(received) => {
            let framed = !headers::bodiless(parts.status);
            if framed && parts.headers.contains_key(http::header::CONTENT_LENGTH) {
                let length = http::HeaderValue::from(received.len());
                parts.headers.insert(http::header::CONTENT_LENGTH, length);
            }
            ResponseBody::full(received)
        }
        Ended::Cut(received) => {
            declare_cut(&mut parts, received.len());
            ResponseBody::cut(received)
        }
    };
    Ok(Response::from_parts(parts, body))
}

/// Declares a body one byte longer than the `received` bytes that follow,
/// whether it came short, long or broke off: the server frames it by that
/// header and ends the connection (HTTP/1) or the stream (a checking
/// HTTP/2 client) short of it, so the caller sees the cut. Without it, a
/// body that broke off reached an HTTP/1.0 caller framed by the close,
/// which there is a complete body.
fn declare_cut(parts: &mut http::response::Parts, received: usize) {
    if !headers::bodiless(parts.status) {
        let length = http::HeaderValue::from(received + 1);
        // A length frames the body alone (a handler that copied an
        // upstream's `Transfer-Encoding` would have hyper refuse both).
        parts.headers.remove(http::header::TRANSFER_ENCODING);
        parts.headers.insert(http::header::CONTENT_LENGTH, length);
    }
}
