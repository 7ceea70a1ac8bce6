//! Shared by the hostile-input and security tests: the tower layer over a
//! [`MemoryStore`] around an inner service that counts its executions.
#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceExt};
use tower_idempotency::layer::RequestBody;
use tower_idempotency::{Engine, Idempotency, MemoryStore, Policy, Routes};

type Respond = dyn Fn(usize, &Parts) -> Response<Full<Bytes>> + Send + Sync;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inner service: counts calls, reads the whole body, answers with
/// `respond(call_number, request_parts)`.
#[derive(Clone)]
pub struct Counting {
    calls: Arc<AtomicUsize>,
    respond: Arc<Respond>,
}

impl<B> Service<Request<RequestBody<B>>> for Counting
where
    B: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<RequestBody<B>>) -> Self::Future {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let respond = self.respond.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            // Let concurrent duplicates pile up behind this execution.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let _ = body.collect().await;
            Ok(respond(n, &parts))
        })
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

/// The layer, its store and the inner service.
#[derive(Clone)]
pub struct Harness {
    pub store: MemoryStore,
    pub engine: Engine,
    inner: Counting,
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
            inner: Counting {
                calls: Arc::default(),
                respond: Arc::new(respond),
            },
        }
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
        self.inner.calls.load(Ordering::SeqCst)
    }

    /// Sends `request` through the layer and collects the answer.
    pub async fn send<B>(&self, request: Request<B>) -> Reply
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let service = Idempotency::new(self.inner.clone(), self.engine.clone());
        Reply::read(service.oneshot(request).await.unwrap()).await
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
