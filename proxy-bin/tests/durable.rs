//! End-to-end with durable stores: the proxy restarted or killed over an
//! SQLite file, PostgreSQL shared by two proxies, PostgreSQL unreachable.

mod common;

use std::sync::Arc;

use common::{temp_dir, uuid, Backend, Proxy, ProxyArgs};
use sqlx::Connection;

const SHORT_LEASE: &str = r#"
[defaults]
lease = "500ms"
wait_timeout = "10s"
"#;

const SQLITE: &str = "sqlite://idempotency.db";

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_proxy_replays_what_it_completed_before() {
    let backend = Backend::start().await;
    let dir = temp_dir("restart");
    let args = ProxyArgs {
        store: SQLITE.into(),
        ..ProxyArgs::new(backend.url(), SHORT_LEASE, &dir)
    };
    let key = uuid();
    let headers = [("idempotency-key", key.as_str())];
    let mut proxy = Proxy::start(args.clone()).await;
    let first = proxy.send("POST", "/api/orders", &headers, "{}").await;
    assert_eq!((first.status, first.replayed()), (201, false));
    proxy.terminate();
    assert!(proxy.wait_exit().await);

    let proxy = Proxy::start(args).await;
    let replay = proxy.send("POST", "/api/orders", &headers, "{}").await;
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!(replay.body, first.body);
    assert_eq!(backend.hits("/api/orders"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn after_kill_9_the_request_runs_again_exactly_once_when_the_lease_expires() {
    let backend = Backend::start().await;
    let dir = temp_dir("kill9");
    let args = ProxyArgs {
        store: SQLITE.into(),
        ..ProxyArgs::new(backend.url(), SHORT_LEASE, &dir)
    };
    let key = uuid();
    let mut proxy = Proxy::start(args.clone()).await;
    let lost = common::spawn_post(proxy.addr, "/hold-first", &[("idempotency-key", &key)], "x");
    backend.held().await;
    proxy.kill(); // kill -9 while the backend holds the request
    lost.abort();

    // Restarted on the same file, retried concurrently: the key is in
    // flight until its lease expires, then exactly one retry takes it over.
    let proxy = Arc::new(Proxy::start(args).await);
    let retries: Vec<_> = (0..10)
        .map(|_| common::spawn_post(proxy.addr, "/hold-first", &[("idempotency-key", &key)], "x"))
        .collect();
    let mut replies = Vec::new();
    for retry in retries {
        replies.push(retry.await.unwrap());
    }
    backend.open_gate();
    assert_eq!(
        backend.hits("/hold-first"),
        2,
        "once before the kill, once after"
    );
    for reply in &replies {
        assert_eq!(reply.status, 201, "{}", reply.text());
        assert_eq!(reply.body, replies[0].body);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
}

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A fresh schema in the test database: its name, and a `postgres://` URL
/// whose connections use it.
async fn fresh_schema() -> (String, String) {
    let url = database_url();
    let schema = format!(
        "proxy_e2e_{}_{}",
        std::process::id(),
        uuid().replace('-', "")[..8].to_owned()
    );
    let mut admin = sqlx::PgConnection::connect(&url).await.expect("PostgreSQL");
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&mut admin)
        .await
        .unwrap();
    admin.close().await.ok();
    let separator = if url.contains('?') { '&' } else { '?' };
    let scoped = format!("{url}{separator}options=-c%20search_path%3D{schema}");
    (schema, scoped)
}

async fn drop_schema(schema: &str) {
    let mut admin = sqlx::PgConnection::connect(&database_url()).await.unwrap();
    let drop = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
    sqlx::query(&drop).execute(&mut admin).await.ok();
}

#[tokio::test(flavor = "multi_thread")]
async fn two_proxies_sharing_postgresql_run_a_request_once() {
    let backend = Backend::start().await;
    let (schema, database) = fresh_schema().await;
    let mut proxies = Vec::new();
    for name in ["pg-a", "pg-b"] {
        let dir = temp_dir(name);
        // The default lease: no takeover while the first request runs.
        let args = ProxyArgs {
            store: database.clone(),
            ..ProxyArgs::new(backend.url(), "", &dir)
        };
        proxies.push(Proxy::start(args).await.owning(dir));
    }
    let key = uuid();
    let requests: Vec<_> = (0..40)
        .map(|i| {
            let proxy = &proxies[i % 2];
            common::spawn_post(
                proxy.addr,
                "/slow?ms=300",
                &[("idempotency-key", &key)],
                "pay",
            )
        })
        .collect();
    let mut replies = Vec::new();
    for request in requests {
        replies.push(request.await.unwrap());
    }
    assert_eq!(backend.hits("/slow"), 1);
    for reply in &replies {
        assert_eq!(reply.status, 201, "{}", reply.text());
        assert_eq!(reply.body, replies[0].body);
    }
    let health = proxies[0].admin("/healthz").await;
    assert_eq!(health.status, 200);
    drop(proxies);
    drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgresql_unreachable_is_503_and_the_backend_is_not_called() {
    let backend = Backend::start().await;
    let closed = common::free_port();
    let dir = temp_dir("pg-down");
    let proxy = Proxy::start(ProxyArgs {
        store: format!("postgres://postgres@{closed}/test"),
        ..ProxyArgs::new(backend.url(), SHORT_LEASE, &dir)
    })
    .await;
    let key = uuid();
    let reply = proxy
        .send("POST", "/api/orders", &[("idempotency-key", &key)], "{}")
        .await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert!(reply.header("retry-after").is_some());
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(backend.total(), 0);
    assert_eq!(proxy.admin("/healthz").await.status, 503);
    // Requests the engine does not cover still pass through.
    assert_eq!(proxy.send("GET", "/page", &[], "").await.status, 200);
}
