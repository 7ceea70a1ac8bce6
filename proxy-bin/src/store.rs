//! Building the store named by `--store` and `--redis`.

use std::sync::Arc;

use tower_idempotency::store::{RedisCache, RedisCacheConfig};
use tower_idempotency::{MemoryStore, Store};

/// Opens the store `spec` names (`memory`, `sqlite://PATH`,
/// `postgres://URL`), with a Redis front cache when `redis` is set.
///
/// Must run inside the Tokio runtime that stays alive for the whole process
/// (connection pools are bound to it). Errors never repeat a URL (it may
/// hold a password).
pub async fn open(spec: &str, redis: Option<&str>) -> Result<Arc<dyn Store>, String> {
    if spec == "memory" {
        with_cache(MemoryStore::new(), redis)
    } else if spec.starts_with("sqlite:") {
        Err(format!(
            "the SQLite store is not available in this build (`--store {spec}`); use `--store memory`"
        ))
    } else if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        Err("the PostgreSQL store is not available in this build; use `--store memory`".into())
    } else {
        let scheme = spec.split(':').next().unwrap_or_default();
        Err(format!(
            "unknown store kind `{scheme}`: expected `memory`, `sqlite://PATH` or `postgres://URL`"
        ))
    }
}

/// `inner`, behind a Redis front cache when `redis` names one.
fn with_cache<S: Store>(inner: S, redis: Option<&str>) -> Result<Arc<dyn Store>, String> {
    let Some(url) = redis else {
        return Ok(Arc::new(inner));
    };
    let cache = RedisCache::new(inner, RedisCacheConfig::new(url))
        .map_err(|error| format!("bad `--redis` URL: {error}"))?;
    Ok(Arc::new(cache))
}
