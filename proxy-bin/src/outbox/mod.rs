//! The transactional outbox, run by the proxy: workers for the
//! destinations of `[outbox]` (inside the proxy, or alone with
//! `idempotency-proxy outbox run`), and the operator's operations on the
//! table (the admin API and `idempotency-proxy outbox counts|dead|retry|purge`).

pub mod cli;
pub mod config;
pub mod ops;
pub mod workers;
