//! One conformance suite for every [`Store`](tower_idempotency::Store): a
//! store that passes it can be swapped for any other.
//!
//! The suite lives in the library (`store_conformance!`, feature
//! `test-util`), so a store written elsewhere runs it the same way. To check
//! a new backend, add one line below:
//! `store_conformance!(name, async { /* a fresh, empty store */ });`
#![cfg(feature = "test-util")]

mod fixtures;

use tower_idempotency::store::FaultyStore;
use tower_idempotency::{store_conformance, MemoryStore};

store_conformance!(memory, async { MemoryStore::new() });
// The fault injector with no fault switched on is its inner store exactly.
store_conformance!(faulty_memory, async {
    FaultyStore::new(MemoryStore::new())
});
#[cfg(feature = "sqlite")]
store_conformance!(sqlite, fixtures::sqlite_store());
#[cfg(feature = "postgres")]
store_conformance!(postgres, fixtures::postgres_store());
#[cfg(feature = "redis")]
store_conformance!(redis_memory, async {
    fixtures::redis_cache(MemoryStore::new())
});
#[cfg(all(feature = "redis", feature = "postgres"))]
store_conformance!(redis_postgres, async {
    fixtures::redis_cache(fixtures::postgres_store().await)
});
// The same against a three-node Redis Cluster on loopback.
#[cfg(feature = "redis")]
store_conformance!(redis_cluster_memory, async {
    fixtures::redis_cluster_cache(MemoryStore::new())
});
#[cfg(all(feature = "redis", feature = "postgres"))]
store_conformance!(redis_cluster_postgres, async {
    fixtures::redis_cluster_cache(fixtures::postgres_store().await)
});
