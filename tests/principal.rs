//! A route's principal through the tower layer (issue 12, hole 11): a
//! refreshed token of the same caller replays, another caller never sees
//! the first one's response, and a token that fails any check is refused
//! before anything is reserved — it never picks a scope.

mod support;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use tower_idempotency::{JwtPolicy, Policy, Principal, PrincipalPolicy, Routes};

use support::{post, Harness, Reply};

/// A file of its own under the temp directory.
fn temp_file(name: &str, content: &[u8]) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "tower-idempotency-principal-test-{}-{}-{name}",
        std::process::id(),
        uuid::Uuid::new_v4()
    ));
    std::fs::write(&path, content).unwrap();
    path
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt")).join(name)
}

fn fixture_bytes(name: &str) -> Vec<u8> {
    std::fs::read(fixture(name)).unwrap()
}

const SECRET: &[u8] = b"a shared secret of at least 32 bytes, for HS256";
const OTHER_SECRET: &[u8] = b"another secret of at least 32 bytes, not trusted";

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A token for `sub` signed with `key`, with claims `extra` on top of a
/// fresh `iat`, an `exp` ten minutes ahead and a unique `jti` (so no two
/// tokens are alike, as with a refresh).
fn token(alg: Algorithm, key: &EncodingKey, sub: &str, extra: serde_json::Value) -> String {
    let mut claims = serde_json::json!({
        "sub": sub,
        "iat": now(),
        "exp": now() + 600,
        "jti": uuid::Uuid::new_v4().to_string(),
    });
    for (name, value) in extra.as_object().unwrap() {
        claims[name] = value.clone();
    }
    jsonwebtoken::encode(&Header::new(alg), &claims, key).unwrap()
}

fn hs256(sub: &str) -> String {
    hs256_with(sub, serde_json::json!({}))
}

/// [`hs256`] with claims `extra` on top.
fn hs256_with(sub: &str, extra: serde_json::Value) -> String {
    token(
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET),
        sub,
        extra,
    )
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// A route whose principal is a JWT verified with [`SECRET`].
fn jwt_policy(jwt: JwtPolicy) -> Policy {
    Policy {
        principal: Some(PrincipalPolicy::jwt(jwt)),
        ..Policy::default()
    }
}

fn hs256_policy() -> Policy {
    jwt_policy(JwtPolicy {
        hs256_secret_file: vec![temp_file("secret", SECRET)],
        ..JwtPolicy::default()
    })
}

/// `POST /orders` with `key` and `Authorization: Bearer <token>`.
fn bearer(key: &str, token: &str) -> Request<Full<Bytes>> {
    post(key.as_bytes())
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::from_static(b"pay 10 EUR")))
        .unwrap()
}

/// `POST /orders.json` with `key` and `Authorization: Bearer <token>`:
/// `/orders` to Rails, a catch-all's to a table that matches it whole.
fn suffixed_order(key: &str, token: &str) -> Request<Full<Bytes>> {
    Request::post("/orders.json")
        .header("idempotency-key", key)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

/// The layer over `routes` (a memory store) in front of a handler that
/// answers `201 order N` for its `N`th execution.
fn orders_behind(routes: Routes) -> support::Upstream {
    let engine = tower_idempotency::Engine::new(tower_idempotency::MemoryStore::new(), routes);
    support::layered(&engine, |n, request| async move {
        let _ = http_body_util::BodyExt::collect(request.into_body()).await;
        http::Response::builder()
            .status(StatusCode::CREATED)
            .body(axum::body::Body::from(format!("order {n}")))
            .unwrap()
    })
}

fn assert_executed(reply: &Reply, n: usize) {
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    assert!(!reply.replayed());
    assert_eq!(reply.text(), format!("order {n}"));
}

fn assert_replay_of(reply: &Reply, n: usize) {
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    assert!(reply.replayed(), "{}", reply.text());
    assert_eq!(reply.text(), format!("order {n}"));
}

/// The documented limit that motivates the principal: scoped by the raw
/// credential, a refreshed token's retry executes again.
#[tokio::test]
async fn raw_credential_scoping_runs_a_refreshed_retry_again() {
    let harness = Harness::new(Policy {
        scope_headers: vec!["authorization".into()],
        ..Policy::default()
    });
    assert_executed(&harness.send(bearer("k1", &hs256("alice"))).await, 1);
    // The client timed out, refreshed its token, and retries.
    assert_executed(&harness.send(bearer("k1", &hs256("alice"))).await, 2);
}

#[tokio::test]
async fn a_refreshed_token_of_the_same_sub_replays() {
    let harness = Harness::new(hs256_policy());
    let first = harness.send(bearer("k1", &hs256("alice"))).await;
    assert_executed(&first, 1);
    // New iat, exp and jti; same sub.
    let refreshed = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET),
        "alice",
        serde_json::json!({ "iat": now() + 5, "exp": now() + 3600 }),
    );
    assert_replay_of(&harness.send(bearer("k1", &refreshed)).await, 1);
    assert_eq!(harness.calls(), 1);
}

#[tokio::test]
async fn another_sub_with_the_same_key_executes_apart() {
    let harness = Harness::new(hs256_policy());
    assert_executed(&harness.send(bearer("k1", &hs256("alice"))).await, 1);
    let bob = harness.send(bearer("k1", &hs256("bob"))).await;
    assert_executed(&bob, 2);
    assert_replay_of(&harness.send(bearer("k1", &hs256("bob"))).await, 2);
    assert_replay_of(&harness.send(bearer("k1", &hs256("alice"))).await, 1);
    assert_eq!(harness.calls(), 2);
}

/// An attacker who knows alice's key tries to read her stored response
/// with tokens that claim `sub = "alice"` but fail a check: each is
/// refused with 401, the inner service is not called and nothing is
/// stored.
#[tokio::test]
async fn forged_expired_or_tampered_tokens_are_refused_and_store_nothing() {
    let harness = Harness::new(hs256_policy());
    assert_executed(&harness.send(bearer("k1", &hs256("alice"))).await, 1);
    let stored = harness.store.len();

    let other_key = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(OTHER_SECRET),
        "alice",
        serde_json::json!({}),
    );
    let claims = |sub: &str| {
        b64(serde_json::json!({ "sub": sub, "exp": now() + 600 })
            .to_string()
            .as_bytes())
    };
    let alg_none = format!(
        "{}.{}.",
        b64(br#"{"alg":"none","typ":"JWT"}"#),
        claims("alice")
    );
    let expired = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET),
        "alice",
        serde_json::json!({ "iat": now() - 7200, "exp": now() - 3600 }),
    );
    let not_yet = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(SECRET),
        "alice",
        serde_json::json!({ "nbf": now() + 3600 }),
    );
    // Mallory's own valid token, its payload swapped for alice's.
    let mallory = hs256("mallory");
    let parts: Vec<&str> = mallory.split('.').collect();
    let tampered = format!("{}.{}.{}", parts[0], claims("alice"), parts[2]);
    let no_exp = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &serde_json::json!({ "sub": "alice" }),
        &EncodingKey::from_secret(SECRET),
    )
    .unwrap();
    // Signed right, but with an algorithm the route does not accept.
    let rs256 = token(
        Algorithm::RS256,
        &EncodingKey::from_rsa_pem(&fixture_bytes("rsa_private.pem")).unwrap(),
        "alice",
        serde_json::json!({}),
    );
    for (case, token) in [
        ("another key", other_key),
        ("alg none", alg_none),
        ("expired", expired),
        ("not yet valid", not_yet),
        ("tampered payload", tampered),
        ("no exp", no_exp),
        ("unconfigured algorithm", rs256),
        ("garbage", "not.a.token".to_owned()),
    ] {
        let reply = harness.send(bearer("k1", &token)).await;
        reply.assert_problem(StatusCode::UNAUTHORIZED, "principal-invalid");
        assert_eq!(
            reply.headers["www-authenticate"], "Bearer error=\"invalid_token\"",
            "{case}"
        );
        assert!(!reply.text().contains("order"), "{case}: {}", reply.text());
        // A fresh key: nothing may be reserved for it either.
        let fresh = harness.send(bearer("k2", &token)).await;
        fresh.assert_problem(StatusCode::UNAUTHORIZED, "principal-invalid");
        assert_eq!(harness.calls(), 1, "{case}");
        assert_eq!(harness.store.len(), stored, "{case}: something was stored");
    }
    // A Basic credential is not a bearer token.
    let reply = harness
        .send(
            post(b"k1")
                .header("authorization", "Basic YWxpY2U6c2VjcmV0")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
    reply.assert_problem(StatusCode::UNAUTHORIZED, "principal-invalid");
    // Alice's record is intact and still hers.
    assert_replay_of(&harness.send(bearer("k1", &hs256("alice"))).await, 1);
    assert_eq!(
        harness
            .engine
            .metrics()
            .count(tower_idempotency::Event::PrincipalRefused),
        17
    );
}

#[tokio::test]
async fn a_missing_principal_is_refused_when_required_and_anonymous_when_not() {
    let required = Harness::new(hs256_policy());
    let anonymous = || {
        post(b"k1")
            .body(Full::new(Bytes::from_static(b"pay")))
            .unwrap()
    };
    let reply = required.send(anonymous()).await;
    reply.assert_problem(StatusCode::UNAUTHORIZED, "principal-missing");
    assert_eq!(reply.headers["www-authenticate"], "Bearer");
    assert_eq!((required.calls(), required.store.len()), (0, 0));
    // Without a key on an optional-key route nothing is protected, and
    // nothing is checked: the engine is not an authenticator.
    let no_key = Request::post("/orders")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(required.send(no_key).await.status, StatusCode::CREATED);

    let mut policy = hs256_policy();
    policy.principal = policy.principal.map(|p| p.required(false));
    let optional = Harness::new(policy);
    assert_executed(&optional.send(anonymous()).await, 1);
    assert_replay_of(&optional.send(anonymous()).await, 1);
    // An authenticated caller with the same key is another scope.
    assert_executed(&optional.send(bearer("k1", &hs256("alice"))).await, 2);
    // A present but invalid token is refused even where none is required.
    let forged = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(OTHER_SECRET),
        "alice",
        serde_json::json!({}),
    );
    let reply = optional.send(bearer("k1", &forged)).await;
    reply.assert_problem(StatusCode::UNAUTHORIZED, "principal-invalid");
    assert_eq!(optional.calls(), 2);
}

#[tokio::test]
async fn rs256_and_es256_public_keys_verify_and_replay() {
    let rsa = EncodingKey::from_rsa_pem(&fixture_bytes("rsa_private.pem")).unwrap();
    let ec = EncodingKey::from_ec_pem(&fixture_bytes("ec_private.pem")).unwrap();
    let harness = Harness::new(jwt_policy(JwtPolicy {
        rs256_public_key_file: vec![fixture("rsa_public.pem")],
        es256_public_key_file: vec![fixture("ec_public.pem")],
        ..JwtPolicy::default()
    }));
    let none = serde_json::json!({});
    assert_executed(
        &harness
            .send(bearer(
                "k1",
                &token(Algorithm::RS256, &rsa, "alice", none.clone()),
            ))
            .await,
        1,
    );
    // Alice again, with a token from the other key: the same caller.
    assert_replay_of(
        &harness
            .send(bearer(
                "k1",
                &token(Algorithm::ES256, &ec, "alice", none.clone()),
            ))
            .await,
        1,
    );
    assert_executed(
        &harness
            .send(bearer(
                "k1",
                &token(Algorithm::ES256, &ec, "bob", none.clone()),
            ))
            .await,
        2,
    );
    // Algorithm confusion: HS256 "signed" with the RSA public key as the
    // secret. HS256 is not configured on this route, so it is refused.
    let confused = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(&fixture_bytes("rsa_public.pem")),
        "alice",
        none,
    );
    let reply = harness.send(bearer("k1", &confused)).await;
    reply.assert_problem(StatusCode::UNAUTHORIZED, "principal-invalid");
    assert_eq!(harness.calls(), 2);
}

#[tokio::test]
async fn issuer_and_audience_are_checked_when_configured() {
    let var = format!("TOWER_IDEMPOTENCY_TEST_SECRET_{}", std::process::id());
    std::env::set_var(&var, std::str::from_utf8(SECRET).unwrap());
    let harness = Harness::new(jwt_policy(JwtPolicy {
        hs256_secret_env: vec![var],
        issuer: vec!["https://id.example".into()],
        audience: vec!["payments".into()],
        ..JwtPolicy::default()
    }));
    let key = EncodingKey::from_secret(SECRET);
    let good = serde_json::json!({ "iss": "https://id.example", "aud": "payments" });
    assert_executed(
        &harness
            .send(bearer(
                "k1",
                &token(Algorithm::HS256, &key, "alice", good.clone()),
            ))
            .await,
        1,
    );
    for claims in [
        serde_json::json!({ "iss": "https://evil.example", "aud": "payments" }),
        serde_json::json!({ "aud": "payments" }),
        serde_json::json!({ "iss": "https://id.example", "aud": "billing" }),
        serde_json::json!({ "iss": "https://id.example" }),
    ] {
        let reply = harness
            .send(bearer(
                "k1",
                &token(Algorithm::HS256, &key, "alice", claims.clone()),
            ))
            .await;
        reply.assert_problem(StatusCode::UNAUTHORIZED, "principal-invalid");
        assert!(!reply.text().contains("order"), "{claims}");
    }
    assert_replay_of(
        &harness
            .send(bearer("k1", &token(Algorithm::HS256, &key, "alice", good)))
            .await,
        1,
    );
    assert_eq!(harness.calls(), 1);
}

#[tokio::test]
async fn a_trusted_gateway_header_keeps_callers_apart() {
    let harness = Harness::new(Policy {
        principal: Some(PrincipalPolicy::header("x-user-id")),
        ..Policy::default()
    });
    let as_user = |user: &str, token: &str| {
        post(b"k1")
            .header("x-user-id", user)
            .header("authorization", format!("Bearer {token}"))
            .body(Full::new(Bytes::from_static(b"pay")))
            .unwrap()
    };
    assert_executed(&harness.send(as_user("alice", "t1")).await, 1);
    // Another credential of the same user: the same scope.
    assert_replay_of(&harness.send(as_user("alice", "t2")).await, 1);
    assert_executed(&harness.send(as_user("bob", "t1")).await, 2);
    // Two values (a client's own header appended to the gateway's): refused.
    let twice = post(b"k1")
        .header("x-user-id", "bob")
        .header("x-user-id", "alice")
        .body(Full::new(Bytes::from_static(b"pay")))
        .unwrap();
    harness
        .send(twice)
        .await
        .assert_problem(StatusCode::UNAUTHORIZED, "principal-invalid");
    let missing = post(b"k1")
        .body(Full::new(Bytes::from_static(b"pay")))
        .unwrap();
    harness
        .send(missing)
        .await
        .assert_problem(StatusCode::UNAUTHORIZED, "principal-missing");
    assert_eq!(harness.calls(), 2);
}

/// The application's own authentication, a `Principal` extension, wins
/// over the route's configured source: the token is then not consulted.
#[tokio::test]
async fn a_principal_extension_wins_over_the_configured_source() {
    let harness = Harness::new(hs256_policy());
    let with_extension = |user: &'static str, token: &str| {
        post(b"k1")
            .header("authorization", format!("Bearer {token}"))
            .extension(Principal::new(user))
            .body(Full::new(Bytes::from_static(b"pay 10 EUR")))
            .unwrap()
    };
    assert_executed(&harness.send(with_extension("alice", "opaque")).await, 1);
    assert_replay_of(&harness.send(with_extension("alice", "other")).await, 1);
    assert_executed(&harness.send(with_extension("bob", "opaque")).await, 2);
}

/// 50 retries at once, each with a freshly issued token of one `sub`:
/// one execution, every caller gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_retries_with_fifty_fresh_tokens_run_once() {
    let harness = Harness::new(hs256_policy()).slow(Duration::from_millis(200));
    let upstream = harness.upstream();
    let tasks: Vec<_> = (0..50)
        .map(|_| tokio::spawn(upstream.send(bearer("k1", &hs256("alice")))))
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.unwrap());
    }
    assert_eq!(harness.calls(), 1);
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        assert_eq!(reply.text(), "order 1");
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
}

#[test]
fn a_bad_key_is_refused_when_the_routes_are_built() {
    let policy = jwt_policy(JwtPolicy {
        rs256_public_key_file: vec![fixture("rsa_private.pem")],
        ..JwtPolicy::default()
    });
    let error = Routes::new().route("/orders", policy).unwrap_err();
    assert_eq!(error.field, "principal");
    assert!(error.to_string().contains("private key"), "{error}");
    let policy = jwt_policy(JwtPolicy {
        es256_public_key_file: vec![fixture("rsa_public.pem")],
        ..JwtPolicy::default()
    });
    let error = Routes::new().route("/orders", policy).unwrap_err();
    assert!(error.to_string().contains("EC public key"), "{error}");
}

/// From a review of isolation: a `Principal` extension may hold any
/// bytes, and one an application set from a user-chosen id spelled like a
/// JWT caller's principal (`\0jwt\0[null,"alice"]`) landed in alice's
/// scope, replayed her answer. An extension never reaches a JWT caller's
/// scope.
#[tokio::test]
async fn a_principal_extension_never_reaches_a_jwt_callers_scope() {
    let harness = Harness::new(hs256_policy());
    assert_executed(&harness.send(bearer("k1", &hs256("alice"))).await, 1);
    let spelled = post(b"k1")
        .extension(Principal::new(&b"\0jwt\0[null,\"alice\"]"[..]))
        .body(Full::new(Bytes::from_static(b"pay 10 EUR")))
        .unwrap();
    assert_executed(&harness.send(spelled).await, 2);
}

/// Scenario (review): `/orders` scopes by a verified JWT, a catch-all `/`
/// by nothing; `POST /orders.json` is the catch-all's to the table and
/// `/orders` to Rails, so its scope holds what `/orders` scopes by too.
/// Read by verifying the token there, every caller whose token failed
/// (expired: a backend with a longer leeway still runs it as them) was
/// alike, and one got another's answer; and a caller's own retry, once its
/// token expired, changed scope and ran again; read as the raw credential
/// (a second review), a retry with a refreshed token ran again. The other
/// route's part is who the token names, its signature checked, its expiry
/// not; a token that fails is its own.
#[tokio::test]
async fn a_jwt_route_reached_by_another_reading_scopes_by_who_the_token_names() {
    let orders = jwt_policy(JwtPolicy {
        hs256_secret_file: vec![temp_file("secret", SECRET)],
        leeway: Duration::ZERO,
        ..JwtPolicy::default()
    });
    let routes = Routes::new()
        .route("/orders", orders)
        .unwrap()
        .route("/", Policy::default())
        .unwrap();
    let app = orders_behind(routes);
    let order = suffixed_order;
    let expired = |sub: &str| hs256_with(sub, serde_json::json!({"exp": now() - 60}));
    let alice = app.send(order("k-expired", &expired("alice"))).await;
    let bob = app.send(order("k-expired", &expired("bob"))).await;
    assert_eq!(alice.status, StatusCode::CREATED);
    // Bob's order runs in his own scope: never alice's answer, never refused.
    assert_executed(&bob, 2);

    // Valid now, expired by the retry.
    let soon = hs256_with("carol", serde_json::json!({"exp": now() + 1}));
    let first = app.send(order("k-soon", &soon)).await;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let retry = app.send(order("k-soon", &soon)).await;
    assert!(retry.replayed(), "the retry ran again: {:?}", retry.text());
    assert_eq!(retry.body, first.body);

    // A refreshed token of the same caller: the same scope.
    let first = app.send(order("k-refresh", &hs256("dave"))).await;
    let refreshed = app.send(order("k-refresh", &hs256("dave"))).await;
    assert!(
        refreshed.replayed(),
        "the retry with a refreshed token ran again"
    );
    assert_eq!(refreshed.body, first.body);
    // A token for dave signed with a key the route does not trust is not
    // dave's.
    let forged = token(
        Algorithm::HS256,
        &EncodingKey::from_secret(OTHER_SECRET),
        "dave",
        serde_json::json!({}),
    );
    let mallory = app.send(order("k-refresh", &forged)).await;
    // A forged token is its own caller: its order runs, never dave's answer.
    assert_executed(&mallory, 5);
}

/// From a third review of the same: (1) read with no time check at all, a
/// token of alice's that expired days ago (an old capture) named alice
/// there, and with her key it met her record; the window is the record's
/// retention now. (2) Where the deciding route verified the very header
/// another route refuses (another `aud`), the refused credential was
/// hashed by its bytes: a refreshed token moved the retry to another
/// scope, and it ran again.
#[tokio::test]
async fn another_routes_token_check_is_bounded_and_never_moves_a_verified_retry() {
    let secret = temp_file("secret", SECRET);
    let audience = |aud: &str| {
        jwt_policy(JwtPolicy {
            hs256_secret_file: vec![secret.clone()],
            audience: vec![aud.into()],
            leeway: Duration::ZERO,
            ..JwtPolicy::default()
        })
    };
    let (signed, app, order) = (hs256_with, orders_behind, suffixed_order);

    // (1) `/orders` by token, an unscoped catch-all decides `/orders.json`.
    let shop = app(Routes::new()
        .route("/orders", audience("orders"))
        .unwrap()
        .route("/", Policy::default())
        .unwrap());
    let fresh = signed("alice", serde_json::json!({"aud": "orders"}));
    let old = signed(
        "alice",
        serde_json::json!({"aud": "orders", "exp": now() - 3 * 86_400}),
    );
    let alice = shop.send(order("k-old", &fresh)).await;
    assert_eq!(alice.status, StatusCode::CREATED);
    let captured = shop.send(order("k-old", &old)).await;
    // A token expired days ago is its own caller: it never meets alice's
    // record, and its order runs.
    assert_executed(&captured, 2);

    // (2) The catch-all verifies the header for `aud = api`; `/orders`
    // refuses those tokens.
    let api = app(Routes::new()
        .route("/orders", audience("orders"))
        .unwrap()
        .route(
            "/",
            Policy {
                required: true,
                ..audience("api")
            },
        )
        .unwrap());
    let first = api
        .send(order(
            "k-aud",
            &signed("bob", serde_json::json!({"aud": "api"})),
        ))
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.text());
    let refreshed = api
        .send(order(
            "k-aud",
            &signed("bob", serde_json::json!({"aud": "api"})),
        ))
        .await;
    assert!(
        refreshed.replayed(),
        "the retry with a refreshed token ran again"
    );
}
