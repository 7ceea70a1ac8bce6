//! The one toolkit of the layer tests: a counting upstream that sees each
//! request (a `service_fn`-style handler behind `IdempotencyLayer`, called
//! in process or over a real socket), the [`Harness`] built on it for the
//! common "every path covered, count the executions" case, and [`Reply`].
//!
//! Nothing here waits on its own: a test that needs an execution to last
//! (so that duplicates overlap it) says so with [`Harness::slow`] or in its
//! handler.
#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body as AxumBody;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::layer::{RequestBody, ResponseBody};
use tower_idempotency::{Engine, IdempotencyLayer, MemoryStore, Policy, Routes};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Svc = BoxCloneSyncService<Request<AxumBody>, Response<AxumBody>, Infallible>;

/// A request as the inner service sees it.
pub type Inbound = Request<RequestBody<AxumBody>>;

/// The layer in front of a counting inner service.
#[derive(Clone)]
pub struct Upstream {
    svc: Svc,
    calls: Arc<AtomicUsize>,
}

impl Upstream {
    /// How often the inner service was called.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Sends `request` through the layer; the future owns what it needs,
    /// so it can be spawned.
    pub fn send<B>(&self, request: Request<B>) -> impl Future<Output = Reply> + Send + 'static
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let svc = self.svc.clone();
        let request = request.map(AxumBody::new);
        async move {
            let response = svc.oneshot(request).await.unwrap_or_else(|e| match e {});
            Reply::read(response).await
        }
    }

    /// Sends `request` through the layer and returns the response as it
    /// is, its body not yet read.
    pub async fn call(&self, request: Request<AxumBody>) -> Response<AxumBody> {
        let svc = self.svc.clone();
        svc.oneshot(request).await.unwrap_or_else(|e| match e {})
    }

    /// Serves the layered service on a real socket (127.0.0.1, a free
    /// port) until the returned task is aborted.
    pub async fn serve(&self) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new().fallback_service(self.svc.clone());
        let server = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        (addr, server)
    }
}

/// `engine` in front of `handler`, which gets the execution number (1, 2, …)
/// and the request as the inner service sees it.
pub fn layered<H, F>(engine: &Engine, handler: H) -> Upstream
where
    H: Fn(usize, Inbound) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<AxumBody>> + Send + 'static,
{
    layered_counting(engine, Arc::default(), handler)
}

/// [`layered`], counting into `calls` (shared by several layers).
fn layered_counting<H, F>(engine: &Engine, calls: Arc<AtomicUsize>, handler: H) -> Upstream
where
    H: Fn(usize, Inbound) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<AxumBody>> + Send + 'static,
{
    let counter = calls.clone();
    let inner = tower::service_fn(move |request: Inbound| {
        let execution = counter.fetch_add(1, Ordering::SeqCst) + 1;
        let answer = handler(execution, request);
        async move { Ok::<_, Infallible>(answer.await) }
    });
    let svc = ServiceBuilder::new()
        .map_response(|response: Response<ResponseBody<AxumBody, axum::Error>>| {
            response.map(AxumBody::new)
        })
        .layer(IdempotencyLayer::new(engine.clone()))
        .service(inner);
    Upstream {
        svc: BoxCloneSyncService::new(svc),
        calls,
    }
}

/// A response as the caller saw it.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// Collects `response`.
    pub async fn read<B>(response: Response<B>) -> Self
    where
        B: Body<Data = Bytes>,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = response.into_parts();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    /// Asserts an answer made by the engine itself: RFC 9457 JSON with
    /// `status`, the documented `type` `urn:tower-idempotency:<kind>`, and
    /// never marked as a replay.
    pub fn assert_problem(&self, status: StatusCode, kind: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.problem_type(), format!("urn:tower-idempotency:{kind}"));
        let problem: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(problem["status"], status.as_u16());
        assert!(problem["title"].is_string() && problem["detail"].is_string());
        assert!(!self.replayed());
    }

    /// Whether it is a replay of a stored response.
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The problem `type` of an engine answer (panics if it is not one).
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.headers[http::header::CONTENT_TYPE],
            "application/problem+json"
        );
        let problem: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        problem["type"].as_str().unwrap().to_owned()
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

type Respond = dyn Fn(usize, &Parts) -> Response<Full<Bytes>> + Send + Sync;

/// Every path covered by one policy, over a memory store (or another
/// engine), in front of an inner service that reads the whole body and
/// answers `respond(call_number, request_parts)`.
#[derive(Clone)]
pub struct Harness {
    pub store: MemoryStore,
    pub engine: Engine,
    calls: Arc<AtomicUsize>,
    respond: Arc<Respond>,
    delay: Duration,
}

impl Harness {
    /// Every route covered by `policy`; the inner service answers
    /// `201 order <n>`.
    pub fn new(policy: Policy) -> Self {
        Self::with_response(policy, |n, _| {
            Response::builder()
                .status(StatusCode::CREATED)
                .body(Full::new(Bytes::from(format!("order {n}"))))
                .unwrap()
        })
    }

    /// Every route covered by `policy`; the inner service answers with
    /// `respond(call_number, request_parts)`.
    pub fn with_response(
        policy: Policy,
        respond: impl Fn(usize, &Parts) -> Response<Full<Bytes>> + Send + Sync + 'static,
    ) -> Self {
        let store = MemoryStore::new();
        let engine = Engine::new(store.clone(), Routes::all(policy).unwrap());
        Harness {
            store,
            engine,
            calls: Arc::default(),
            respond: Arc::new(respond),
            delay: Duration::ZERO,
        }
    }

    /// The inner service waits `delay` before it reads the body and
    /// answers: concurrent duplicates then arrive while it runs.
    pub fn slow(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The same inner service (and call count) behind `engine`: another
    /// instance sharing the work, or an engine over another store.
    pub fn with_engine(&self, engine: Engine) -> Self {
        Harness {
            engine,
            ..self.clone()
        }
    }

    /// How often the inner service ran.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// The layered service, counting into this harness.
    pub fn upstream(&self) -> Upstream {
        let (respond, delay) = (self.respond.clone(), self.delay);
        layered_counting(&self.engine, self.calls.clone(), move |n, request| {
            let respond = respond.clone();
            async move {
                let (parts, body) = request.into_parts();
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let _ = body.collect().await;
                respond(n, &parts).map(AxumBody::new)
            }
        })
    }

    /// Sends `request` through the layer and collects the answer.
    pub async fn send<B>(&self, request: Request<B>) -> Reply
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        self.upstream().send(request).await
    }
}

/// `POST /orders` with `key` (raw bytes) as the `Idempotency-Key` header.
pub fn post(key: &[u8]) -> http::request::Builder {
    Request::builder()
        .method(Method::POST)
        .uri("/orders")
        .header("idempotency-key", HeaderValue::from_bytes(key).unwrap())
}

/// `POST /orders` with `key` and a JSON `body`.
pub fn post_json(key: &[u8], body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    post(key)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.into()))
        .unwrap()
}
