//! A route's principal through the real `idempotency-proxy` binary
//! (issue 12, hole 11): a refreshed JWT of the same `sub` replays, another
//! `sub` never sees the first one's response, a token that fails a check
//! is refused with 401 before the backend is called, and a trusted
//! gateway's header keeps callers apart.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use common::{temp_dir, uuid, Backend, Proxy, ProxyArgs, Reply};
use jsonwebtoken::{Algorithm, EncodingKey, Header};

const SECRET: &[u8] = b"a shared secret of at least 32 bytes, for HS256";
const OTHER_SECRET: &[u8] = b"another secret of at least 32 bytes, not trusted";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/jwt"
    ))
    .join(name)
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A token for `sub`: a fresh `iat`, `exp` ten minutes ahead, a unique
/// `jti`, then `extra` on top.
fn token(alg: Algorithm, key: &EncodingKey, sub: &str, extra: serde_json::Value) -> String {
    let mut claims = serde_json::json!({
        "sub": sub,
        "iat": now(),
        "exp": now() + 600,
        "jti": uuid(),
    });
    for (name, value) in extra.as_object().unwrap() {
        claims[name] = value.clone();
    }
    jsonwebtoken::encode(&Header::new(alg), &claims, key).unwrap()
}

fn hs256(sub: &str) -> String {
    token(
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET),
        sub,
        serde_json::json!({}),
    )
}

/// The operator API's token.
const ADMIN_TOKEN: &str = "an-operator-token-of-some-length";

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Five routes: `/api/rsa` (RS256 and ES256 public keys), `/api/gw` (a
/// trusted gateway's `x-user-id`), `/api/org` (HS256 from the `JWT_SECRET`
/// variable, the `org_id` claim naming the tenant), `/api` (HS256 from a
/// file, issuer checked), and `/slow` (HS256 from `JWT_SECRET`).
fn config(dir: &Path) -> String {
    let secret = dir.join("jwt-secret");
    std::fs::write(&secret, [SECRET, b"\n"].concat()).unwrap();
    format!(
        r#"
[defaults]
required = true
lease = "5s"

[[route]]
path = "/api/rsa"
principal = {{ jwt = {{ rs256_public_key_file = "{rsa}", es256_public_key_file = ["{ec}"] }} }}

[[route]]
path = "/api/gw"
principal = {{ header = "x-user-id" }}

[[route]]
path = "/api/org"
principal = {{ jwt = {{ hs256_secret_env = "JWT_SECRET", tenant_claims = ["org_id"] }} }}

[[route]]
path = "/api"
principal = {{ jwt = {{ hs256_secret_file = "{secret}", issuer = "https://id.example" }} }}

[[route]]
path = "/slow"
principal = {{ jwt = {{ hs256_secret_env = "JWT_SECRET" }} }}
"#,
        secret = secret.display(),
        rsa = fixture("rsa_public.pem").display(),
        ec = fixture("ec_public.pem").display(),
    )
}

async fn start(name: &str) -> (Backend, Proxy) {
    let backend = Backend::start().await;
    let dir = temp_dir(name);
    let config = config(&dir);
    let proxy = Proxy::start_with(ProxyArgs::new(backend.url(), &config, &dir), |command| {
        command.env("JWT_SECRET", std::str::from_utf8(SECRET).unwrap());
        command.env("IDEMPOTENCY_ADMIN_TOKEN", ADMIN_TOKEN);
    })
    .await
    .owning(dir);
    (backend, proxy)
}

fn issued(sub: &str) -> String {
    token(
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET),
        sub,
        serde_json::json!({ "iss": "https://id.example" }),
    )
}

async fn pay(proxy: &Proxy, path: &str, key: &str, token: &str) -> Reply {
    let bearer = format!("Bearer {token}");
    let headers = [("idempotency-key", key), ("authorization", bearer.as_str())];
    proxy.send("POST", path, &headers, "pay 10 EUR").await
}

fn assert_problem(reply: &Reply, kind: &str) {
    assert_eq!(reply.status, 401, "{}", reply.text());
    assert_eq!(
        reply.header("problem-type"),
        Some(format!("urn:tower-idempotency:{kind}").as_str())
    );
    assert!(!reply.replayed());
    assert!(!reply.text().contains("execution"), "{}", reply.text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refreshed_token_replays_and_another_sub_executes_apart() {
    let (backend, proxy) = start("principal-refresh").await;
    let key = uuid();
    let first = pay(&proxy, "/api/pay", &key, &issued("alice")).await;
    assert_eq!((first.status, first.replayed()), (201, false));
    // Timed out, refreshed the token (new iat, exp, jti), retried.
    let refreshed = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET),
        "alice",
        serde_json::json!({ "iss": "https://id.example", "iat": now() + 5, "exp": now() + 3600 }),
    );
    let retry = pay(&proxy, "/api/pay", &key, &refreshed).await;
    assert!(retry.replayed(), "{}", retry.text());
    assert_eq!(retry.body, first.body);
    assert_eq!(backend.hits("/api/pay"), 1);

    let bob = pay(&proxy, "/api/pay", &key, &issued("bob")).await;
    assert_eq!((bob.status, bob.replayed()), (201, false));
    assert_ne!(bob.body, first.body);
    assert_eq!(backend.hits("/api/pay"), 2);

    // Public keys: RS256 and ES256 tokens of one sub are one caller.
    let rsa = EncodingKey::from_rsa_pem(&std::fs::read(fixture("rsa_private.pem")).unwrap());
    let ec = EncodingKey::from_ec_pem(&std::fs::read(fixture("ec_private.pem")).unwrap());
    let none = serde_json::json!({});
    let by_rsa = token(Algorithm::RS256, &rsa.unwrap(), "carol", none.clone());
    let by_ec = token(Algorithm::ES256, &ec.unwrap(), "carol", none);
    let a = pay(&proxy, "/api/rsa/pay", &key, &by_rsa).await;
    let b = pay(&proxy, "/api/rsa/pay", &key, &by_ec).await;
    assert_eq!((a.status, a.replayed(), b.replayed()), (201, false, true));
    assert_eq!(backend.hits("/api/rsa/pay"), 1);
}

/// Scenario (from a review of scopes): Auth0 Organizations and Clerk keep
/// one `sub` across a user's organisations, and the backend picks the
/// tenant from `org_id`. The principal was `(iss, sub)` alone, so the same
/// key in organisation B was replayed organisation A's invoice (leak), and
/// B's was never created. With `tenant_claims = ["org_id"]` each
/// organisation is its own scope; a purge names the organisation too.
#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_claim_keeps_one_users_organisations_apart() {
    let (backend, proxy) = start("principal-tenant").await;
    let key = uuid();
    let in_org = |org: serde_json::Value| {
        let claims = match org {
            serde_json::Value::Null => serde_json::json!({}),
            org => serde_json::json!({ "org_id": org }),
        };
        token(
            Algorithm::HS256,
            &EncodingKey::from_secret(SECRET),
            "alice",
            claims,
        )
    };
    let a = pay(&proxy, "/api/org/invoices", &key, &in_org("org_a".into())).await;
    let b = pay(&proxy, "/api/org/invoices", &key, &in_org("org_b".into())).await;
    assert_eq!(
        (a.status, b.status, b.replayed()),
        (201, 201, false),
        "{}",
        b.text()
    );
    assert_ne!(a.body, b.body);
    let none = pay(
        &proxy,
        "/api/org/invoices",
        &key,
        &in_org(serde_json::Value::Null),
    )
    .await;
    assert!(!none.replayed());
    let again = pay(&proxy, "/api/org/invoices", &key, &in_org("org_a".into())).await;
    assert!(again.replayed());
    assert_eq!(again.body, a.body);
    assert_eq!(backend.hits("/api/org/invoices"), 3);
    // Purged in organisation A only: B's record stays.
    let purge =
        serde_json::json!({ "principal": { "sub": "alice", "tenant": { "org_id": "org_a" } } });
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let headers = [
        ("authorization", bearer.as_str()),
        ("content-type", "application/json"),
    ];
    let purged = proxy
        .admin_send("POST", "/keys/purge-principal", &headers, purge.to_string())
        .await;
    assert_eq!(purged.json()["purged"], 1, "{}", purged.text());
    let b_again = pay(&proxy, "/api/org/invoices", &key, &in_org("org_b".into())).await;
    assert!(b_again.replayed());
    let a_again = pay(&proxy, "/api/org/invoices", &key, &in_org("org_a".into())).await;
    assert!(!a_again.replayed());
    assert_eq!(backend.hits("/api/org/invoices"), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_that_fail_a_check_are_refused_before_the_backend() {
    let (backend, proxy) = start("principal-forged").await;
    let key = uuid();
    let alice = pay(&proxy, "/api/pay", &key, &issued("alice")).await;
    assert_eq!(alice.status, 201);

    let claims = |sub: &str| {
        b64(
            serde_json::json!({ "sub": sub, "iss": "https://id.example", "exp": now() + 600 })
                .to_string()
                .as_bytes(),
        )
    };
    let mallory = issued("mallory");
    let parts: Vec<&str> = mallory.split('.').collect();
    let forged = [
        (
            "another key",
            token(
                Algorithm::HS256,
                &EncodingKey::from_secret(OTHER_SECRET),
                "alice",
                serde_json::json!({ "iss": "https://id.example" }),
            ),
        ),
        (
            "alg none",
            format!(
                "{}.{}.",
                b64(br#"{"alg":"none","typ":"JWT"}"#),
                claims("alice")
            ),
        ),
        (
            "expired",
            token(
                Algorithm::HS256,
                &EncodingKey::from_secret(SECRET),
                "alice",
                serde_json::json!({ "iss": "https://id.example", "exp": now() - 3600 }),
            ),
        ),
        (
            "tampered payload",
            format!("{}.{}.{}", parts[0], claims("alice"), parts[2]),
        ),
        ("wrong issuer", hs256("alice")),
    ];
    for (case, token) in &forged {
        let reply = pay(&proxy, "/api/pay", &key, token).await;
        assert_problem(&reply, "principal-invalid");
        assert_eq!(
            reply.header("www-authenticate"),
            Some("Bearer error=\"invalid_token\""),
            "{case}"
        );
        // Nothing was reserved under a fresh key either.
        let fresh = pay(&proxy, "/api/pay", &uuid(), token).await;
        assert_problem(&fresh, "principal-invalid");
    }
    let missing = proxy
        .send("POST", "/api/pay", &[("idempotency-key", &key)], "pay")
        .await;
    assert_problem(&missing, "principal-missing");
    assert_eq!(backend.hits("/api/pay"), 1);

    let metrics = proxy.admin("/metrics").await.text();
    let line = format!(
        "idempotency_requests_total{{outcome=\"principal_refused\"}} {}",
        forged.len() * 2 + 1
    );
    assert!(metrics.contains(&line), "{metrics}");
    // Only alice's execution was ever reserved and stored.
    assert!(metrics.contains("idempotency_requests_total{outcome=\"executed\"} 1\n"));
    assert!(metrics.contains("idempotency_requests_total{outcome=\"stored\"} 1\n"));
    // And her record is still hers.
    let again = pay(&proxy, "/api/pay", &key, &issued("alice")).await;
    assert!(again.replayed());
    assert_eq!(again.body, alice.body);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trusted_gateway_header_keeps_callers_apart() {
    let (backend, proxy) = start("principal-gateway").await;
    let key = uuid();
    let send = |user: &'static str, credential: &'static str| {
        let (proxy, key) = (&proxy, key.clone());
        async move {
            let headers = [
                ("idempotency-key", key.as_str()),
                ("x-user-id", user),
                ("authorization", credential),
            ];
            proxy.send("POST", "/api/gw/pay", &headers, "pay").await
        }
    };
    let alice = send("alice", "Bearer one").await;
    assert_eq!((alice.status, alice.replayed()), (201, false));
    let again = send("alice", "Bearer refreshed").await;
    assert!(again.replayed());
    assert_eq!(again.body, alice.body);
    let bob = send("bob", "Bearer one").await;
    assert_eq!((bob.status, bob.replayed()), (201, false));
    assert_ne!(bob.body, alice.body);
    let twice = proxy
        .send(
            "POST",
            "/api/gw/pay",
            &[
                ("idempotency-key", key.as_str()),
                ("x-user-id", "bob"),
                ("x-user-id", "alice"),
            ],
            "pay",
        )
        .await;
    assert_problem(&twice, "principal-invalid");
    assert_eq!(backend.hits("/api/gw/pay"), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_retries_with_fifty_fresh_tokens_run_once() {
    let (backend, proxy) = start("principal-concurrent").await;
    let key = uuid();
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let bearer = format!("Bearer {}", hs256("alice"));
            common::spawn_post(
                proxy.addr,
                "/slow?ms=300",
                &[("idempotency-key", &key), ("authorization", &bearer)],
                "pay 10 EUR",
            )
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    assert_eq!(backend.hits("/slow"), 1);
    for reply in &replies {
        assert_eq!(reply.status, 201, "{}", reply.text());
        assert_eq!(reply.body, replies[0].body);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
}

/// A key the proxy cannot use stops it at start, with the file and the
/// reason; a secret is never taken from the configuration text.
#[test]
fn a_bad_key_or_an_inline_secret_is_refused_at_start() {
    let dir = temp_dir("principal-bad-key");
    let short = dir.join("short-secret");
    std::fs::write(&short, "too short").unwrap();
    for (setting, expected) in [
        (
            format!(
                "jwt = {{ rs256_public_key_file = \"{}\" }}",
                fixture("rsa_private.pem").display()
            ),
            "private key",
        ),
        (
            format!(
                "jwt = {{ es256_public_key_file = \"{}\" }}",
                fixture("rsa_public.pem").display()
            ),
            "EC public key",
        ),
        (
            format!("jwt = {{ hs256_secret_file = \"{}\" }}", short.display()),
            "at least 32",
        ),
        (
            "jwt = { hs256_secret_env = \"NO_SUCH_SECRET_VARIABLE\" }".to_owned(),
            "not set",
        ),
        (
            "jwt = { hs256_secret = \"inline secret of more than 32 bytes\" }".to_owned(),
            "hs256_secret",
        ),
    ] {
        let config = dir.join("idempotency.toml");
        std::fs::write(
            &config,
            format!("[[route]]\npath = \"/api\"\nprincipal = {{ {setting} }}\n"),
        )
        .unwrap();
        let output = Command::new(env!("CARGO_BIN_EXE_idempotency-proxy"))
            .args(["--listen", &common::free_port().to_string()])
            .args(["--upstream", "http://127.0.0.1:9"])
            .args(["--store", "memory"])
            .arg("--config")
            .arg(&config)
            .env_remove("NO_SUCH_SECRET_VARIABLE")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{setting}: {stderr}");
        assert!(
            stderr.contains("principal") && stderr.contains(expected),
            "{setting}: {stderr}"
        );
    }
}
