//! Make an unsafe HTTP request — a form submission, a payment, a booking —
//! take effect **once**, however often it arrives.
//!
//! One [`Engine`] holds every rule: which requests are covered, how the key
//! is found and validated, how a request is fingerprinted, and what a
//! duplicate gets (a replay, a wait, 409, 422). It talks to a [`Store`]
//! (memory, SQLite, PostgreSQL, optionally with a Redis front cache) and is
//! driven by two thin front ends: the tower [`IdempotencyLayer`] in this
//! crate, and the `idempotency-proxy` binary.
//!
//! # Quick start
//!
//! ```
//! use axum::{routing::post, Router};
//! use tower_idempotency::{Engine, IdempotencyLayer, MemoryStore, Policy, Routes};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::new(MemoryStore::new(), Routes::all(Policy::default())?);
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { "paid" }))
//!     .layer(IdempotencyLayer::new(engine));
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # Features
//!
//! * `layer` (default): the tower front end.
//! * `sqlite`, `postgres`: the durable stores (sqlx).
//! * `redis`: the Redis front cache.
//! * `outbox`: the transactional [`outbox`] (with `postgres` and/or
//!   `sqlite`): durable, once-in-effect delivery to integrations.

#![warn(missing_docs)]
#![deny(unsafe_code, unreachable_pub)]

pub mod engine;
pub mod fingerprint;
pub mod formats;
pub mod key;
#[cfg(feature = "layer")]
pub mod layer;
pub mod metrics;
#[cfg(feature = "outbox")]
pub mod outbox;
pub mod policy;
pub mod problem;
pub mod store;

pub use engine::{Engine, EngineConfig};
#[cfg(feature = "layer")]
pub use layer::{ExecutionScope, Idempotency, IdempotencyLayer, Principal};
pub use metrics::{Event, Metrics};
#[cfg(feature = "outbox")]
pub use outbox::{Outbox, Worker, WorkerConfig};
pub use policy::{
    FailMode, InFlightPolicy, JwtPolicy, KeySource, MismatchPolicy, Policy, PolicyError,
    PrincipalPolicy, RoutePolicy, Routes,
};
pub use problem::{Problem, ProblemKind};
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
pub use store::{MemoryStore, Store, StoreError};
#[cfg(feature = "redis")]
pub use store::{RedisCache, RedisCacheConfig};
