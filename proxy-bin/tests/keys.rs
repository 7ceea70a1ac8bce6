//! The operator's key operations end to end: the admin API's `/keys/...`
//! routes on the real binary (each behind the bearer token), the story of
//! a key stuck in flight that an operator frees (the first execution's
//! late answer is not stored), and `idempotency-proxy keys …` against an
//! SQLite file and PostgreSQL with no proxy running.

mod common;

use std::path::Path;
use std::process::Command;

use common::{temp_dir, uuid, Backend, Proxy, ProxyArgs, Reply};
use serde_json::{json, Value};
use sqlx::Connection;

const TOKEN: &str = "an-operator-token-of-some-length";

/// `/api/` scoped by a gateway's `x-user-id`; duplicates of an in-flight
/// key answered 409 at once.
const CONFIG: &str = r#"
[proxy]
admin_token_file = "admin.token"

[defaults]
in_flight = "reject"

[[route]]
path = "/api"
principal = { header = "x-user-id" }

[[route]]
path = "/hold-first"
"#;

fn args(backend: &Backend, dir: &Path, store: &str) -> ProxyArgs {
    std::fs::write(dir.join("admin.token"), format!("{TOKEN}\n")).unwrap();
    ProxyArgs {
        store: store.into(),
        ..ProxyArgs::new(backend.url(), CONFIG, dir)
    }
}

async fn operator(proxy: &Proxy, method: &str, path: &str, body: Value) -> Reply {
    let bearer = format!("Bearer {TOKEN}");
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let headers = [
        ("authorization", bearer.as_str()),
        ("content-type", "application/json"),
    ];
    proxy.admin_send(method, path, &headers, body).await
}

async fn order(proxy: &Proxy, key: &str, user: &str) -> Reply {
    let headers = [("idempotency-key", key), ("x-user-id", user)];
    proxy.send("POST", "/api/orders", &headers, "{}").await
}

/// Every key route answers only the token's bearer, in JSON, and says
/// what is wrong with bad input.
#[tokio::test(flavor = "multi_thread")]
async fn every_key_route_needs_the_token_and_answers_json() {
    let backend = Backend::start().await;
    let dir = temp_dir("keys-api");
    let proxy = Proxy::start(args(&backend, &dir, "memory"))
        .await
        .owning(dir);
    let key = uuid();
    let first = order(&proxy, &key, "alice").await;
    assert_eq!(first.status, 201);
    let query = json!({ "key": key, "path": "/api/orders", "host": "127.0.0.1",
                        "principal": "alice" });

    let routes = [
        ("POST", "/keys/lookup", query.clone()),
        ("POST", "/keys/purge", json!({ "scope": "00".repeat(32) })),
        (
            "POST",
            "/keys/purge-principal",
            json!({ "principal": "nobody" }),
        ),
        ("POST", "/keys/release", query.clone()),
        ("GET", "/keys/in-flight?older_than=0s", Value::Null),
        ("GET", "/keys/counts", Value::Null),
    ];
    for (method, path, body) in &routes {
        for authorization in [None, Some("Bearer wrong-token-of-some-length")] {
            let headers: Vec<_> = authorization
                .map(|a| ("authorization", a))
                .into_iter()
                .collect();
            let reply = proxy
                .admin_send(method, path, &headers, body.to_string())
                .await;
            assert_eq!(reply.status, 401, "{method} {path} {authorization:?}");
        }
        let reply = operator(&proxy, method, path, body.clone()).await;
        assert_eq!(reply.status, 200, "{method} {path}: {}", reply.text());
        assert_eq!(reply.header("content-type"), Some("application/json"));
        reply.json();
    }

    let found = operator(&proxy, "POST", "/keys/lookup", query.clone())
        .await
        .json();
    assert_eq!(found["state"], "completed");
    assert_eq!(found["status"], 201);
    assert_eq!(found["route"], "/api");
    assert_eq!(found["principal_kept"], true);
    assert!(found["body_bytes"].as_u64().unwrap() > 0);
    assert!(found.get("response").is_none(), "no body unless asked");
    let mut with_body = query.clone();
    with_body["body"] = json!(true);
    let shown = operator(&proxy, "POST", "/keys/lookup", with_body)
        .await
        .json();
    assert_eq!(shown["response"]["status"], 201);
    assert_eq!(shown["response"]["body"].as_str().unwrap(), first.text());
    let bob = json!({ "key": key, "path": "/api/orders", "host": "127.0.0.1", "principal": "bob" });
    let other = operator(&proxy, "POST", "/keys/lookup", bob).await.json();
    assert_eq!(other["state"], "absent");
    assert_ne!(other["scope"], found["scope"]);

    let counts = operator(&proxy, "GET", "/keys/counts", Value::Null)
        .await
        .json();
    assert_eq!(
        (counts["completed"].as_u64(), counts["total"].as_u64()),
        (Some(1), Some(1))
    );
    let release = operator(&proxy, "POST", "/keys/release", query.clone())
        .await
        .json();
    assert_eq!(
        (release["released"].as_bool(), release["state"].as_str()),
        (Some(false), Some("completed"))
    );
    let purge = operator(
        &proxy,
        "POST",
        "/keys/purge",
        json!({ "scope": found["scope"] }),
    )
    .await;
    assert_eq!(purge.json()["purged"], true);
    let again = order(&proxy, &key, "alice").await;
    assert!(!again.replayed(), "a purged key runs again");
    assert_eq!(backend.hits("/api/orders"), 2);
    let purged = operator(
        &proxy,
        "POST",
        "/keys/purge-principal",
        json!({ "principal": "alice" }),
    )
    .await;
    assert_eq!(purged.json()["purged"], 1);
    let counts = operator(&proxy, "GET", "/keys/counts", Value::Null)
        .await
        .json();
    assert_eq!(counts["total"], 0);

    // Bad input: 400 naming the field and what is expected.
    for (method, path, body, expected) in [
        (
            "POST",
            "/keys/lookup",
            json!({ "key": key }),
            "missing field `path`",
        ),
        (
            "POST",
            "/keys/lookup",
            json!({ "key": key, "path": "/nowhere", "principal": "a" }),
            "no route covers POST /nowhere",
        ),
        (
            "POST",
            "/keys/lookup",
            json!({ "key": key, "path": "/api/orders" }),
            "principal",
        ),
        (
            "POST",
            "/keys/lookup",
            json!({ "key": key, "path": "/hold-first", "principal": "a" }),
            "does not scope keys by a principal",
        ),
        // Without the host on a host-scoped route: a scope no request has.
        (
            "POST",
            "/keys/lookup",
            json!({ "key": key, "path": "/api/orders", "principal": "alice" }),
            "host: the route",
        ),
        // A JWT caller on a route whose principal is a header's value
        // names a scope no request has: refused, not "absent".
        (
            "POST",
            "/keys/lookup",
            json!({ "key": key, "path": "/api/orders", "host": "127.0.0.1",
                    "principal": { "sub": "alice" } }),
            "from a header",
        ),
        (
            "POST",
            "/keys/purge",
            json!({ "scope": "abc" }),
            "64 hex characters",
        ),
        ("POST", "/keys/purge-principal", json!({}), "principal"),
        // A purge narrows to nothing: a `host` beside the principal (which
        // the operator may take to limit it to one tenant) is refused.
        (
            "POST",
            "/keys/purge-principal",
            json!({ "principal": "42", "host": "a.example" }),
            "every host and route",
        ),
        // A tenant claim beside `sub` rather than under `tenant` names
        // another principal: refused rather than purging nothing.
        (
            "POST",
            "/keys/purge-principal",
            json!({ "principal": { "sub": "42", "org_id": "a" } }),
            "principal",
        ),
        (
            "GET",
            "/keys/in-flight?older_than=soon",
            Value::Null,
            "expected a duration",
        ),
    ] {
        let reply = operator(&proxy, method, path, body).await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.text());
        let error = reply.json()["error"].as_str().unwrap().to_owned();
        assert!(error.contains(expected), "{path}: {error}");
    }
    let reply = operator(&proxy, "GET", "/keys/lookup", Value::Null).await;
    assert_eq!(reply.status, 405);
    let reply = operator(&proxy, "GET", "/keys/nothing", Value::Null).await;
    assert_eq!(reply.status, 404);
}

/// A client's retries all get 409: its first request is stuck upstream.
/// The operator finds the key, force-releases it, and the retry runs.
/// When the stuck execution finally answers, its client gets that answer,
/// but it is not stored: later retries replay the retry's response. The
/// log names the key by its short hash, never the raw key or principal.
#[tokio::test(flavor = "multi_thread")]
async fn an_operator_frees_a_stuck_key_and_the_first_answer_is_not_stored() {
    let backend = Backend::start().await;
    let dir = temp_dir("keys-story");
    let log = dir.join("proxy.log");
    let proxy = Proxy::start_logged(args(&backend, &dir, "memory"), &log, "info").await;
    let key = format!("stuck-{}", uuid());
    let headers = [("idempotency-key", key.as_str())];
    let stuck = common::spawn_post(proxy.addr, "/hold-first", &headers, "x");
    backend.held().await;
    let retry = proxy.send("POST", "/hold-first", &headers, "x").await;
    assert_eq!(retry.status, 409, "{}", retry.text());

    let listed = operator(&proxy, "GET", "/keys/in-flight?older_than=0s", Value::Null)
        .await
        .json();
    let records = listed["records"].as_array().unwrap();
    assert_eq!(records.len(), 1, "{listed}");
    let query = json!({ "key": key, "path": "/hold-first", "host": "127.0.0.1" });
    let found = operator(&proxy, "POST", "/keys/lookup", query.clone())
        .await
        .json();
    assert_eq!(found["state"], "in_flight");
    assert!(found["lease_remaining_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(found["scope"], records[0]["scope"]);
    // Released only while the holder the operator saw still holds it (a
    // retry taking it over since keeps it): another holder is refused.
    let holder = records[0]["holder"].as_str().expect("a holder").to_owned();
    assert_eq!(holder.len(), 16, "{listed}");
    assert_eq!(found["holder"], holder.as_str());
    let mut fenced = query.clone();
    let other = if holder == "0000000000000000" {
        "1"
    } else {
        "0"
    }
    .repeat(16);
    fenced["holder"] = json!(other);
    let refused = operator(&proxy, "POST", "/keys/release", fenced.clone())
        .await
        .json();
    assert_eq!(
        (&refused["released"], &refused["state"], &refused["holder"]),
        (&json!(false), &json!("in_flight"), &json!(holder)),
        "{refused}"
    );
    // Neither a bad holder nor `null` (a lookup's answer for a record no
    // one holds) is read as "whoever holds it".
    for bad in [json!("not hex"), Value::Null, json!(7)] {
        fenced["holder"] = bad;
        let bad = operator(&proxy, "POST", "/keys/release", fenced.clone()).await;
        assert_eq!(bad.status, 400, "{}", bad.text());
        assert!(bad.text().contains("holder"), "{}", bad.text());
    }
    fenced["holder"] = json!(holder);
    let released = operator(&proxy, "POST", "/keys/release", fenced)
        .await
        .json();
    assert_eq!(released["released"], true, "{released}");

    let rerun = proxy.send("POST", "/hold-first", &headers, "x").await;
    assert_eq!(
        (rerun.status, rerun.replayed()),
        (201, false),
        "{}",
        rerun.text()
    );
    assert_eq!(rerun.json()["execution"], 2);
    backend.open_gate();
    let late = stuck.await.unwrap();
    assert_eq!(late.status, 201, "its client gets the upstream's answer");
    assert_eq!(late.json()["execution"], 1);
    let replay = proxy.send("POST", "/hold-first", &headers, "x").await;
    assert!(replay.replayed());
    assert_eq!(
        replay.body, rerun.body,
        "the late first answer was not stored"
    );
    assert_eq!(backend.hits("/hold-first"), 2);

    let mut proxy = proxy;
    proxy.stop().await;
    let text = std::fs::read_to_string(&log).unwrap();
    let short = &found["scope"].as_str().unwrap()[..8];
    assert!(
        text.contains("force-released") && text.contains(short),
        "{text}"
    );
    assert!(!text.contains(&key), "the raw key was logged");
    drop(proxy);
}

/// The command line against the wrong store, from the operator's side: an
/// SQLite path that is not the proxy's file (a relative path read against
/// another directory) used to create an empty store there and answer
/// "absent" or "purged: false" with exit 0; it is refused, and no file is
/// made. A purge without Redis says that a proxy's Redis copy would stay
/// (from a review of operations).
#[tokio::test]
async fn the_command_line_refuses_a_store_that_is_not_there() {
    let dir = temp_dir("cli-missing-store");
    let missing = dir.join("records.db");
    let url = format!("sqlite://{}", missing.display());
    let (code, _, log) = cli(&["counts", "--store", &url]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("no SQLite store"), "{log}");
    assert!(!missing.exists(), "the command line made a store");

    let existing = dir.join("proxy.db");
    tower_idempotency::SqliteStore::connect(existing.to_str().unwrap())
        .await
        .unwrap()
        .close()
        .await;
    let url = format!("sqlite://{}", existing.display());
    let scope = "ab".repeat(32);
    let (code, purged, log) = cli(&["purge", "--scope", &scope, "--store", &url]);
    assert_eq!((code, &purged["purged"]), (0, &json!(false)), "{log}");
    assert!(log.contains("no Redis given"), "{log}");
}

/// Runs `idempotency-proxy keys <args>`; its exit code, stdout as JSON
/// (null when not JSON) and stderr.
fn cli(args: &[&str]) -> (i32, Value, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idempotency-proxy"))
        .arg("keys")
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stdout = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.code().unwrap_or(-1), stdout, stderr)
}

/// The command line against a store the proxy left behind (killed with a
/// request in flight): counts, lists, looks up, releases and purges; the
/// restarted proxy then runs the released and purged keys again.
async fn the_command_line_works_on_a_store(name: &str, store: &str) {
    let backend = Backend::start().await;
    let dir = temp_dir(name);
    let config = dir.join("idempotency.toml");
    let args = args(&backend, &dir, store);
    let mut proxy = Proxy::start(args.clone()).await;
    let (alices, bobs, held) = (uuid(), uuid(), uuid());
    assert_eq!(order(&proxy, &alices, "alice").await.status, 201);
    assert_eq!(order(&proxy, &bobs, "bob").await.status, 201);
    let lost = common::spawn_post(
        proxy.addr,
        "/hold-first",
        &[("idempotency-key", &held)],
        "x",
    );
    backend.held().await;
    proxy.kill();
    lost.abort();

    let at = ["--store", store, "--config", config.to_str().unwrap()];
    let run = |extra: &[&str]| {
        let mut all: Vec<&str> = extra.to_vec();
        all.extend_from_slice(&at);
        cli(&all)
    };
    let (code, counts, log) = run(&["counts"]);
    assert_eq!(code, 0, "{log}");
    assert_eq!(
        (counts["completed"].as_u64(), counts["in_flight"].as_u64()),
        (Some(2), Some(1)),
        "{counts}"
    );
    let (_, listed, _) = run(&["in-flight", "--older-than", "0s"]);
    assert_eq!(listed["records"].as_array().unwrap().len(), 1, "{listed}");
    let holder = listed["records"][0]["holder"]
        .as_str()
        .expect("a holder")
        .to_owned();

    let alice = [
        "--key",
        &alices,
        "--path",
        "/api/orders",
        "--host",
        "127.0.0.1",
        "--principal",
        "alice",
    ];
    let (code, found, log) = run(&[&["lookup"][..], &alice].concat());
    assert_eq!(code, 0, "{log}");
    assert_eq!(
        (found["state"].as_str(), found["status"].as_u64()),
        (Some("completed"), Some(201))
    );
    assert!(found.get("response").is_none());
    assert!(
        !log.contains(&alices) && !log.contains("alice"),
        "raw key or principal logged: {log}"
    );
    let (_, shown, _) = run(&[&["lookup", "--body"][..], &alice].concat());
    assert_eq!(shown["response"]["status"], 201);
    assert!(shown["response"]["body"]
        .as_str()
        .unwrap()
        .contains("execution"));

    let stuck = [
        "--key",
        &held,
        "--path",
        "/hold-first",
        "--host",
        "127.0.0.1",
    ];
    let other = if holder == "0000000000000000" {
        "1"
    } else {
        "0"
    }
    .repeat(16);
    let (code, refused, log) = run(&[&["release", "--holder", &other][..], &stuck].concat());
    assert_eq!(
        (code, &refused["released"], &refused["holder"]),
        (0, &json!(false), &json!(holder)),
        "{log}"
    );
    let (code, _, log) = run(&[&["release", "--holder", "xyz"][..], &stuck].concat());
    assert_ne!(code, 0, "{log}");
    assert!(log.contains("--holder"), "{log}");
    let (code, released, log) = run(&[&["release", "--holder", &holder][..], &stuck].concat());
    assert_eq!((code, &released["released"]), (0, &json!(true)), "{log}");
    let scope = found["scope"].as_str().unwrap();
    let (_, purged, _) = run(&["purge", "--scope", scope]);
    assert_eq!(purged["purged"], true);
    // Without the proxy's configuration (from a review of operations:
    // against a proxy with a key secret it answered "purged: 0" without a
    // word), the scopes it computes are named as possibly another's.
    let lookup = [
        "lookup",
        "--key",
        &held,
        "--path",
        "/hold-first",
        "--store",
        store,
    ];
    let (_, _, log) = cli(&lookup);
    assert!(log.contains("no --config"), "{log}");
    let (_, _, log) = cli(&["counts", "--store", store]);
    assert!(!log.contains("no --config"), "{log}");
    let (_, purged, log) = run(&["purge-principal", "--principal", "bob"]);
    assert!(!log.contains("no --config"), "{log}");
    assert_eq!(purged["purged"], 1);
    let (_, counts, _) = run(&["counts"]);
    assert_eq!(counts["total"], 0, "{counts}");

    // Bad input: exit status 2, the fault named.
    let (code, _, log) = run(&["lookup", "--key", "k", "--path", "/nowhere"]);
    assert_eq!(code, 2);
    assert!(log.contains("no route covers POST /nowhere"), "{log}");
    let (code, _, log) = cli(&["counts"]);
    assert_eq!(code, 2);
    assert!(log.contains("no store"), "{log}");

    let proxy = Proxy::start(args).await.owning(dir);
    assert!(
        !order(&proxy, &alices, "alice").await.replayed(),
        "purged: runs again"
    );
    let rerun = proxy
        .send("POST", "/hold-first", &[("idempotency-key", &held)], "x")
        .await;
    assert_eq!(
        (rerun.status, rerun.replayed()),
        (201, false),
        "released: runs again"
    );
    assert_eq!(backend.hits("/api/orders"), 3);
    assert_eq!(backend.hits("/hold-first"), 2);
    backend.open_gate();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_command_line_works_on_an_sqlite_file() {
    let dir = temp_dir("keys-cli-sqlite-db");
    let store = format!("sqlite://{}", dir.join("records.db").display());
    the_command_line_works_on_a_store("keys-cli-sqlite", &store).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_command_line_works_on_postgresql() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let schema = format!("keys_cli_{}", uuid().replace('-', ""));
    let mut admin = sqlx::PgConnection::connect(&url).await.expect("PostgreSQL");
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&mut admin)
        .await
        .unwrap();
    let separator = if url.contains('?') { '&' } else { '?' };
    let store = format!("{url}{separator}options=-c%20search_path%3D{schema}");
    the_command_line_works_on_a_store("keys-cli-pg", &store).await;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&mut admin)
        .await
        .ok();
}

/// From a review of the operator surface: a route scoped by a credential
/// (`scope_headers = ["authorization"]`) could be looked up only with the
/// credential in `--header`, where `ps` and the shell's history show it.
/// `--headers-file` reads it from a file (or standard input), and a bad
/// line is refused without being echoed.
#[tokio::test(flavor = "multi_thread")]
async fn the_command_line_reads_credentials_from_a_file() {
    let backend = Backend::start().await;
    let dir = temp_dir("keys-cli-headers-file");
    let store = format!("sqlite://{}", dir.join("records.db").display());
    let config = "[[route]]\npath = \"/scoped\"\nscope_headers = [\"authorization\"]\n";
    let mut args = ProxyArgs::new(backend.url(), config, &dir);
    args.store = store.clone();
    let mut proxy = Proxy::start(args).await;
    let key = uuid();
    let headers = [
        ("idempotency-key", key.as_str()),
        ("authorization", "Bearer secret-token-of-alice"),
    ];
    let first = proxy.send("POST", "/scoped", &headers, "{}").await;
    assert!((200..300).contains(&first.status), "{}", first.status);
    proxy.stop().await;
    let file = dir.join("headers");
    let config = dir.join("idempotency.toml");
    let lookup = |file: &Path| {
        cli(&[
            "lookup",
            "--key",
            &key,
            "--path",
            "/scoped",
            "--host",
            "127.0.0.1",
            "--headers-file",
            file.to_str().unwrap(),
            "--store",
            &store,
            "--config",
            config.to_str().unwrap(),
        ])
    };
    std::fs::write(&file, "authorization: Bearer secret-token-of-alice\n").unwrap();
    let (code, found, log) = lookup(&file);
    assert_eq!(
        (code, found["state"].as_str()),
        (0, Some("completed")),
        "{found} {log}"
    );
    std::fs::write(&file, "authorization: Bearer another-token\n").unwrap();
    let (_, missing, _) = lookup(&file);
    assert_ne!(missing["state"].as_str(), Some("completed"), "{missing}");
    std::fs::write(&file, "Bearer secret-token-of-alice\n").unwrap();
    let (code, _, log) = lookup(&file);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("line 1"), "{log}");
    assert!(
        !log.contains("secret-token"),
        "the credential was echoed: {log}"
    );
}
