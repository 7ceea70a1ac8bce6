//! Building the store named by `--store` and `--redis`.

use std::sync::Arc;

use tower_idempotency::{MemoryStore, Store};

/// Opens the store `spec` names (`memory`, `sqlite://PATH`,
/// `postgres://URL`), with a Redis front cache when `redis` is set.
///
/// Must run inside the Tokio runtime that stays alive for the whole process
/// (connection pools are bound to it).
pub async fn open(spec: &str, redis: Option<&str>) -> Result<Arc<dyn Store>, String> {
    let store: Arc<dyn Store> = if spec == "memory" {
        Arc::new(MemoryStore::new())
    } else if spec.starts_with("sqlite:") {
        return Err(format!(
            "the SQLite store is not available in this build (`--store {spec}`); use `--store memory`"
        ));
    } else if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        return Err(
            "the PostgreSQL store is not available in this build; use `--store memory`".into(),
        );
    } else {
        // Only the scheme: the rest may hold a password.
        let scheme = spec.split(':').next().unwrap_or_default();
        return Err(format!(
            "unknown store kind `{scheme}`: expected `memory`, `sqlite://PATH` or `postgres://URL`"
        ));
    };
    if redis.is_some() {
        return Err("the Redis front cache is not available in this build".into());
    }
    Ok(store)
}
