//! Fixtures shared by the store tests: keys, fresh databases, a TCP switch.
//!
//! Every fixture is private to one test: an SQLite file of its own, a
//! PostgreSQL schema of its own. Their names start with the creation time;
//! a new fixture removes those of earlier runs older than [`STALE`], so
//! nothing piles up and nothing of a running test is touched.
#![allow(dead_code)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tower_idempotency::store::{Fingerprint, ScopeKey};

/// Fixtures older than this belong to finished runs.
const STALE: Duration = Duration::from_secs(15 * 60);

/// A key no other test uses.
pub fn random_key() -> ScopeKey {
    let mut bytes = [0; 32];
    bytes[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    bytes[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
    ScopeKey(bytes)
}

/// A fingerprint made of one repeated byte.
pub fn fingerprint(byte: u8) -> Fingerprint {
    Fingerprint([byte; 32])
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `<prefix><secs>_<random>`, and whether a name of that shape is stale.
fn fixture_name(prefix: &str) -> String {
    format!("{prefix}{}_{}", unix_secs(), uuid::Uuid::new_v4().simple())
}

fn is_stale(prefix: &str, name: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|rest| rest.split('_').next())
        .and_then(|secs| secs.parse::<u64>().ok())
        .is_some_and(|secs| secs + STALE.as_secs() < unix_secs())
}

/// A path for a new SQLite database file in a directory of test databases.
pub fn sqlite_path() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join("tower-idempotency-tests");
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        if is_stale("db_", &entry.file_name().to_string_lossy()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    dir.join(format!("{}.db", fixture_name("db_")))
}

/// An SQLite store on a new file.
#[cfg(feature = "sqlite")]
pub async fn sqlite_store() -> tower_idempotency::SqliteStore {
    tower_idempotency::SqliteStore::connect(sqlite_path().to_str().unwrap())
        .await
        .unwrap()
}

#[cfg(feature = "postgres")]
pub use pg::*;

#[cfg(feature = "postgres")]
mod pg {
    use std::str::FromStr;

    use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
    use sqlx::{Connection, PgConnection};
    use tower_idempotency::PostgresStore;

    use super::{fixture_name, is_stale};

    const SCHEMA_PREFIX: &str = "ti_test_";

    /// `DATABASE_URL`, by default the local test database.
    pub fn database_url() -> String {
        std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
    }

    /// Connection options for a new, empty schema of the test database
    /// (first on the `search_path`, so the store's table lands there).
    pub async fn fresh_schema() -> PgConnectOptions {
        let url = database_url();
        let mut admin = PgConnection::connect(&url).await.unwrap();
        let schemas: Vec<String> =
            sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE $1")
                .bind(format!("{SCHEMA_PREFIX}%"))
                .fetch_all(&mut admin)
                .await
                .unwrap();
        for schema in schemas.iter().filter(|s| is_stale(SCHEMA_PREFIX, s)) {
            let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                .execute(&mut admin)
                .await;
        }
        let schema = fixture_name(SCHEMA_PREFIX);
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut admin)
            .await
            .unwrap();
        admin.close().await.unwrap();
        PgConnectOptions::from_str(&url)
            .unwrap()
            .options([("search_path", schema.as_str())])
    }

    /// A pool of at most `connections` on `options`, with the store's
    /// acquire timeout.
    pub async fn pool(options: PgConnectOptions, connections: u32) -> PgPool {
        PostgresStore::pool_options()
            .max_connections(connections)
            .connect_with(options)
            .await
            .unwrap()
    }

    /// A migrated PostgreSQL store on a fresh schema.
    pub async fn postgres_store() -> PostgresStore {
        let store = PostgresStore::from_pool(pool(fresh_schema().await, 5).await);
        store.migrate().await.unwrap();
        store
    }

    /// A pool that does not connect until used (for a database that is
    /// down at the time).
    pub fn lazy_pool(options: PgConnectOptions) -> PgPool {
        PgPoolOptions::new()
            .acquire_timeout(PostgresStore::ACQUIRE_TIMEOUT)
            .connect_lazy_with(options)
    }
}
