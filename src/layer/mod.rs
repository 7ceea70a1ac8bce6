//! The tower front end: [`IdempotencyLayer`] and [`Idempotency`].
//!
//! Wrap any `tower::Service<http::Request<B>>` — an axum `Router`, a hyper
//! service — and unsafe requests on covered routes take effect once:
//!
//! ```
//! use axum::{routing::post, Router};
//! use tower_idempotency::{Engine, IdempotencyLayer, MemoryStore, Policy, Routes};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let routes = Routes::new().route("/orders", Policy::default().required(true))?;
//! let engine = Engine::new(MemoryStore::new(), routes);
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .layer(IdempotencyLayer::new(engine));
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # What the layer guarantees
//!
//! * Requests the engine does not cover (other methods, other paths, no
//!   key where the key is an optional header or query parameter) reach the
//!   inner service untouched and unbuffered.
//! * A covered request's body is buffered (up to the route's limit; over
//!   it, 413 and the inner service is not called) and the engine decides.
//! * Once the request holds its key, a caller that goes away does **not**
//!   cancel the inner call: it is moved to a task of its own, runs to
//!   completion, its response is stored, and the retry replays it. (It runs
//!   in the caller's task until then, so the common case spawns nothing.)
//! * The response is stored *before* it is returned, so a client that got
//!   an answer and retries always gets a replay. A response larger than the
//!   storage cap is still returned whole; only a marker is stored.
//! * An execution still running after its route's
//!   [`execution_timeout`](crate::Policy::execution_timeout) (default
//!   5 min, to the end of its response body) is no longer waited for: the
//!   caller gets 504 `upstream-timeout`, and that answer is stored as the
//!   key's outcome, since the handler may still act: retries replay it and
//!   never execute again.
//! * Covered bodies buffered at once are capped engine-wide
//!   ([`EngineConfig::max_buffered_bytes`](crate::EngineConfig)): past it,
//!   503 `overloaded` before the body is read.
//! * The engine's own answers (400, 409, 413, 422, 503) are responses, not
//!   errors. The inner service's errors pass through (and release the key).
//!
//! # Graceful shutdown
//!
//! An answer whose storing failed is returned anyway and stored in the
//! background, and an execution whose caller went away runs on in a task
//! of its own. After your server's graceful shutdown, call
//! [`Engine::drain`](crate::Engine::drain) with a bound before the process
//! exits, or such a key stays in flight until its lease runs out and its
//! retry executes again. Once it has returned the engine executes nothing
//! more (a keyed request gets 503): call it only after your server stopped
//! serving, not beside it:
//!
//! ```no_run
//! # async fn run(engine: tower_idempotency::Engine) {
//! // axum::serve(listener, app).with_graceful_shutdown(signal).await?;
//! // Logs each key it had to abandon; the report lists them too.
//! let report = engine.drain(std::time::Duration::from_secs(30)).await;
//! # let _ = report;
//! # }
//! ```
//!
//! Requires a Tokio runtime.

mod body;
mod future;
#[allow(clippy::module_inception)]
mod layer;
mod service;

pub use body::{RequestBody, ResponseBody, ResponseBodyError};
pub use future::ResponseFuture;
pub use layer::IdempotencyLayer;
pub use service::{ExecutionScope, Idempotency, Principal};
