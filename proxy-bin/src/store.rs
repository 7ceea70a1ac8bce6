//! Building the store named by `--store` and `--redis`.

use std::sync::Arc;
use std::time::Duration;

use tower_idempotency::{
    MemoryStore, PostgresStore, RedisCache, RedisCacheConfig, SqliteStore, Store,
};

/// Opens the store `spec` names (`memory`, `sqlite://PATH`,
/// `postgres://URL`), with a Redis front cache when `redis` is set
/// (`redis://…`, or `redis+cluster://host:port,host:port` for a Redis
/// Cluster), its keys under `prefix` (default `idem:`) and the store's own
/// id. PostgreSQL statements that conflict (SQLSTATE 40001, 40P01) are
/// retried for up to `store_timeout`.
///
/// An SQLite file that cannot be opened is an error. An unreachable
/// PostgreSQL is not: the proxy starts, answers 503 (fail closed) and
/// reports unhealthy until the database answers and the migrations are
/// applied (which it retries every second) — so a sidecar may start before
/// its database.
///
/// Must run inside the Tokio runtime that stays alive for the whole process
/// (connection pools are bound to it). Errors never repeat a URL (it may
/// hold a password).
pub async fn open(
    spec: &str,
    redis: Option<&str>,
    prefix: Option<&str>,
    store_timeout: Duration,
    memory_limits: (Option<usize>, Option<usize>),
) -> Result<Arc<dyn Store>, String> {
    let redis = redis.map(|url| (url, prefix));
    if spec == "memory" {
        let (records, bytes) = memory_limits;
        let store = MemoryStore::with_limits(
            records.unwrap_or(MemoryStore::DEFAULT_MAX_RECORDS),
            bytes.unwrap_or(MemoryStore::DEFAULT_MAX_BYTES),
        );
        with_cache(store, redis)
    } else if spec.starts_with("sqlite:") {
        let store = SqliteStore::connect(spec)
            .await
            .map_err(|error| format!("cannot open the SQLite store `{spec}`: {error}"))?;
        with_cache(store, redis)
    } else if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        with_cache(postgres(spec).await?.retry_budget(store_timeout), redis)
    } else {
        let scheme = spec.split(':').next().unwrap_or_default();
        Err(format!(
            "unknown store kind `{scheme}`: expected `memory`, `sqlite://PATH` or `postgres://URL`"
        ))
    }
}

async fn postgres(url: &str) -> Result<PostgresStore, String> {
    let pool = PostgresStore::pool_options()
        .connect_lazy(url)
        .map_err(|_| "the PostgreSQL URL given to `--store` is malformed".to_owned())?;
    let store = PostgresStore::from_pool(pool);
    if let Err(error) = store.migrate().await {
        tracing::warn!(%error, "PostgreSQL is unavailable; answering 503 until it answers");
        let store = store.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if store.migrate().await.is_ok() {
                    tracing::info!("PostgreSQL is available; migrations applied");
                    return;
                }
            }
        });
    }
    Ok(store)
}

/// `inner`, behind a Redis front cache when `redis` names one (URL, and a
/// key prefix if not the default).
fn with_cache<S: Store>(
    inner: S,
    redis: Option<(&str, Option<&str>)>,
) -> Result<Arc<dyn Store>, String> {
    let Some((url, prefix)) = redis else {
        return Ok(Arc::new(inner));
    };
    let mut config = RedisCacheConfig::new(url);
    if let Some(prefix) = prefix {
        config = config.prefix(prefix);
    }
    let cache =
        RedisCache::new(inner, config).map_err(|error| format!("bad `--redis` URL: {error}"))?;
    Ok(Arc::new(cache))
}
