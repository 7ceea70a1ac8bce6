//! Secrets at rest through the real binary: the `[secrets]` table, what the
//! SQLite file holds, key rotation across restarts, records that cannot be
//! opened (503, the backend not called again), and start-up errors that
//! name the secret at fault without printing it.

mod common;

use std::path::Path;
use std::process::Command;

use common::{temp_dir, Backend, Proxy, ProxyArgs, Reply};
use sqlx::{Connection, SqliteConnection};
use tower_idempotency::engine::sealed_key_id;
use tower_idempotency::store::SealedOutcome;

const SQLITE: &str = "sqlite://idempotency.db";
const SECRET_ENV: &str = "IDEMPOTENCY_TEST_KEY_SECRET";
const KEY_2_ENV: &str = "IDEMPOTENCY_TEST_KEY_2";
const BODY_MARKER: &str = "BODY-MARKER-jane@example.com";
/// The echo backend's response header (`x-backend: echo`).
const HEADER_MARKER: &str = "x-backend";
/// Key 1 as written in its file (base64 of 32 bytes), key 2 (hex, in an
/// environment variable) and the key secret (hex).
const KEY_1: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const KEY_2: &str = "0202020202020202020202020202020202020202020202020202020202020202";
const SECRET: &str = "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e";

/// A `[secrets]` table: the key secret from its variable, key 1 from a
/// file in `dir`, key 2 from its variable, as `keys` lists them.
fn config(dir: &Path, keys: &[&str], current: &str) -> String {
    std::fs::write(dir.join("key-1"), format!("{KEY_1}\n")).unwrap();
    let entries: Vec<String> = keys
        .iter()
        .map(|id| match *id {
            "1" => format!(
                "{{ id = \"1\", file = \"{}\" }}",
                dir.join("key-1").display()
            ),
            _ => format!("{{ id = \"{id}\", env = \"{KEY_2_ENV}\" }}"),
        })
        .collect();
    format!(
        "[secrets]\nkey_secret = {{ env = \"{SECRET_ENV}\" }}\ncurrent_key = \"{current}\"\nkeys = [{}]\n",
        entries.join(", ")
    )
}

async fn start(backend: &Backend, dir: &Path, config: String) -> Proxy {
    let args = ProxyArgs {
        store: SQLITE.into(),
        ..ProxyArgs::new(backend.url(), &config, dir)
    };
    Proxy::start_with(args, |command| {
        command.env(SECRET_ENV, SECRET).env(KEY_2_ENV, KEY_2);
    })
    .await
}

async fn post(proxy: &Proxy, key: &str) -> Reply {
    proxy
        .send(
            "POST",
            "/orders",
            &[("idempotency-key", key), ("content-type", "text/plain")],
            BODY_MARKER,
        )
        .await
}

/// Every row of the proxy's SQLite file: (key, status, body).
async fn rows(dir: &Path) -> Vec<(Vec<u8>, Option<i64>, Vec<u8>)> {
    let url = format!("sqlite://{}", dir.join("idempotency.db").display());
    let mut db = SqliteConnection::connect(&url).await.unwrap();
    let rows = sqlx::query_as(
        "SELECT key, status, coalesce(headers, x'') || coalesce(body, x'') \
         FROM idempotency_records ORDER BY created_at",
    )
    .fetch_all(&mut db)
    .await
    .unwrap();
    db.close().await.unwrap();
    rows
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle.as_bytes())
}

fn key_id(body: &[u8]) -> String {
    let sealed = SealedOutcome::from_bytes(body.to_vec().into());
    sealed_key_id(&sealed).unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_file_holds_ciphertext_and_rotation_fails_closed_without_the_old_key() {
    let backend = Backend::start().await;
    let dir = temp_dir("secrets");

    // Without [secrets]: the file shows the response (the raw read sees
    // plaintext where there is some).
    let mut plain = start(&backend, &dir, String::new()).await;
    assert_eq!(post(&plain, "order-1001").await.status, 200);
    plain.kill();
    let before = rows(&dir).await;
    assert_eq!(before.len(), 1);
    assert!(contains(&before[0].2, BODY_MARKER) && contains(&before[0].2, HEADER_MARKER));

    // Key secret and key 1.
    let mut proxy = start(&backend, &dir, config(&dir, &["1"], "1")).await;
    let first = post(&proxy, "order-1001").await;
    assert_eq!(
        (first.status, first.replayed()),
        (200, false),
        "a new scope key"
    );
    assert!(contains(&first.body, BODY_MARKER));
    let replay = post(&proxy, "order-1001").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header(HEADER_MARKER), Some("echo"));
    proxy.kill();
    let sealed = rows(&dir).await;
    assert_eq!(sealed.len(), 2);
    let (key, status, bytes) = &sealed[1];
    assert_ne!(*key, before[0].0, "HMAC, not the plain SHA-256");
    assert_eq!(*status, None);
    assert!(!contains(bytes, BODY_MARKER), "{bytes:?}");
    assert!(!contains(bytes, HEADER_MARKER));
    assert!(!contains(bytes, "order-1001"));
    assert_eq!(key_id(bytes), "1");
    assert_eq!(backend.total(), 2);

    // Rotated: key 2 current, key 1 still listed.
    let mut proxy = start(&backend, &dir, config(&dir, &["1", "2"], "2")).await;
    let replay = post(&proxy, "order-1001").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let second = post(&proxy, "order-2").await;
    assert_eq!((second.status, second.replayed()), (200, false));
    proxy.kill();
    let after = rows(&dir).await;
    assert_eq!(key_id(&after[2].2), "2");
    assert_eq!(backend.total(), 3);

    // Key 1 removed: its record is answered 503 and nothing runs again.
    let proxy = start(&backend, &dir, config(&dir, &["2"], "2")).await;
    let refused = post(&proxy, "order-1001").await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(refused.text().contains("store-unavailable"));
    assert!(post(&proxy, "order-2").await.replayed());
    assert_eq!(backend.total(), 3, "the backend was not called again");

    // Altered bytes: 503 as well.
    let url = format!("sqlite://{}", dir.join("idempotency.db").display());
    let mut db = SqliteConnection::connect(&url).await.unwrap();
    let body: Vec<u8> = sqlx::query_scalar("SELECT body FROM idempotency_records WHERE key = ?1")
        .bind(&after[2].0)
        .fetch_one(&mut db)
        .await
        .unwrap();
    let mut altered = body.clone();
    let at = altered.len() / 2;
    altered[at] ^= 0x80;
    sqlx::query("UPDATE idempotency_records SET body = ?1 WHERE key = ?2")
        .bind(altered)
        .bind(&after[2].0)
        .execute(&mut db)
        .await
        .unwrap();
    db.close().await.unwrap();
    assert_eq!(post(&proxy, "order-2").await.status, 503);
    assert_eq!(backend.total(), 3);
}

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// `redis-cli` against the test Redis; its raw output.
fn redis_cli(args: &[&str]) -> Vec<u8> {
    let output = Command::new("redis-cli")
        .args(["-u", &redis_url(), "--raw"])
        .args(args)
        .output()
        .expect("redis-cli on the PATH");
    assert!(output.status.success(), "redis-cli {args:?}");
    output.stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn postgresql_and_redis_hold_ciphertext_only() {
    let backend = Backend::start().await;
    let dir = temp_dir("secrets-pg");
    let url = database_url();
    let schema = format!(
        "proxy_secrets_{}_{}",
        std::process::id(),
        &common::uuid()[..8]
    );
    let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&mut admin)
        .await
        .unwrap();
    let separator = if url.contains('?') { '&' } else { '?' };
    let store = format!("{url}{separator}options=-c%20search_path%3D{schema}");
    let prefix = format!("test:secrets:{}:", &common::uuid()[..8]);
    let args = ProxyArgs {
        store,
        redis: Some(redis_url()),
        extra: vec!["--redis-prefix".into(), prefix.clone()],
        ..ProxyArgs::new(backend.url(), &config(&dir, &["1"], "1"), &dir)
    };
    let proxy = Proxy::start_with(args, |command| {
        command.env(SECRET_ENV, SECRET).env(KEY_2_ENV, KEY_2);
    })
    .await;
    let first = post(&proxy, "order-1001").await;
    assert_eq!(first.status, 200);
    // The second answer comes from Redis or PostgreSQL; both hold the record.
    let replay = post(&proxy, "order-1001").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(backend.total(), 1);

    let row: (Option<i16>, Option<Vec<u8>>, Vec<u8>) = sqlx::query_as(&format!(
        "SELECT status, headers, body FROM {schema}.idempotency_records"
    ))
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(
        (row.0, row.1),
        (None, None),
        "status and headers are sealed"
    );
    assert!(!contains(&row.2, BODY_MARKER) && !contains(&row.2, HEADER_MARKER));
    assert_eq!(key_id(&row.2), "1");

    // The cache is written behind the answer: wait for its entry.
    let mut keys = Vec::new();
    for _ in 0..250 {
        keys = redis_cli(&["KEYS", &format!("{prefix}*")]);
        if !keys.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let keys = String::from_utf8(keys).unwrap();
    let keys: Vec<&str> = keys.lines().filter(|key| !key.is_empty()).collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let value = redis_cli(&["GET", keys[0]]);
    assert!(value.len() > 100, "the cached record");
    assert!(!contains(&value, BODY_MARKER) && !contains(&value, HEADER_MARKER));
    assert!(!contains(keys[0].as_bytes(), "order-1001"));

    drop(proxy);
    redis_cli(&["DEL", keys[0]]);
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&mut admin)
        .await
        .unwrap();
    admin.close().await.ok();
}

/// Runs the binary with `config` and the key variables set as given; its
/// exit code and what it printed.
fn refused(dir: &Path, config: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let path = dir.join("refused.toml");
    std::fs::write(&path, config).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_idempotency-proxy"));
    command
        .current_dir(dir)
        .args(["--listen", &common::free_port().to_string()])
        .args(["--upstream", "http://127.0.0.1:9"])
        .args(["--store", "memory"])
        .arg("--config")
        .arg(&path)
        .env_remove(SECRET_ENV)
        .env_remove(KEY_2_ENV);
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().unwrap();
    let mut text = String::from_utf8_lossy(&output.stderr).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stdout));
    (output.status.code(), text)
}

/// A configuration, the variables set, what the refusal must say.
type Case<'a> = (String, Vec<(&'a str, &'a str)>, Vec<String>);

#[test]
fn bad_secrets_are_refused_at_start_naming_the_key() {
    let dir = temp_dir("secrets-refused");
    let short = "ab".repeat(16);
    let cases: Vec<Case> = vec![
        // Wrong length.
        (
            config(&dir, &["2"], "2"),
            vec![(SECRET_ENV, SECRET), (KEY_2_ENV, &short)],
            vec!["key \"2\"".into(), "16 bytes".into(), KEY_2_ENV.into()],
        ),
        // Not hex, not base64.
        (
            config(&dir, &["2"], "2"),
            vec![(SECRET_ENV, SECRET), (KEY_2_ENV, "not a key!")],
            vec!["key \"2\"".into(), "neither hex nor base64".into()],
        ),
        // Unset variable.
        (
            config(&dir, &["1", "2"], "2"),
            vec![(SECRET_ENV, SECRET)],
            vec![format!("{KEY_2_ENV} is not set"), "key \"2\"".into()],
        ),
        // A short key secret.
        (
            config(&dir, &["1"], "1"),
            vec![(SECRET_ENV, &short)],
            vec!["key_secret".into(), "at least 32".into()],
        ),
        // Duplicate id.
        (
            config(&dir, &["1", "1"], "1"),
            vec![(SECRET_ENV, SECRET)],
            vec!["\"1\" is listed twice".into()],
        ),
        // The current key is not listed.
        (
            config(&dir, &["1"], "3"),
            vec![(SECRET_ENV, SECRET)],
            vec!["\"3\" is not listed".into()],
        ),
        // Inline in the file.
        (
            format!("[secrets]\nkey_secret = \"{SECRET}\"\n"),
            Vec::new(),
            vec!["never written".into(), "key_secret".into()],
        ),
    ];
    for (config, env, expected) in cases {
        let (code, output) = refused(&dir, &config, &env);
        assert_eq!(code, Some(2), "{config}\n{output}");
        for text in expected {
            assert!(output.contains(&text), "expected {text:?} in: {output}");
        }
        for secret in [SECRET, KEY_1, KEY_2, short.as_str()] {
            assert!(!output.contains(secret), "a secret was printed: {output}");
        }
    }
}
