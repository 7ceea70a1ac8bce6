//! The SQLite store beyond the conformance suite: durability.
#![cfg(feature = "sqlite")]

mod fixtures;
mod support;

use tower_idempotency::{Engine, Policy, Routes, SqliteStore};

use support::{post_json, Harness};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_key_still_replays_after_the_store_is_reopened() {
    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let policy = Policy::default();
    let routes = || Routes::all(policy.clone()).unwrap();
    let base = Harness::new(policy.clone());

    let store = SqliteStore::connect(path).await.unwrap();
    let before = base.with_engine(Engine::new(store.clone(), routes()));
    let first = before.send(post_json(b"order-1", r#"{"amount": 5}"#)).await;
    assert_eq!(first.status, http::StatusCode::CREATED);
    store.close().await;
    drop(before);

    let reopened = SqliteStore::connect(&format!("sqlite://{path}"))
        .await
        .unwrap();
    let after = base.with_engine(Engine::new(reopened, routes()));
    let again = after.send(post_json(b"order-1", r#"{"amount": 5}"#)).await;
    assert!(again.replayed());
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    assert_eq!(base.calls(), 1);
}

/// The store's id lives in the file: the same after reopening, another for
/// another file (what keeps two deployments apart in a shared Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_id_is_kept_in_the_file() {
    use tower_idempotency::Store;

    let path = fixtures::sqlite_path();
    let path = path.to_str().unwrap();
    let store = SqliteStore::connect(path).await.unwrap();
    let id = store.identity().await.unwrap().expect("an id");
    store.close().await;
    let reopened = SqliteStore::connect(path).await.unwrap();
    assert_eq!(reopened.identity().await.unwrap(), Some(id.clone()));
    let other = fixtures::sqlite_store().await;
    assert_ne!(other.identity().await.unwrap(), Some(id));
}
