//! Form routes behind the tower layer, answered the way real frameworks
//! answer them: a validation error is a 302 back to the form (Laravel) or
//! the form rendered again with 200 (Django), success a 302 to a thanks
//! page. Only `success_redirects` tell them apart; `mismatch = "replay"`
//! gives a consumed token the seed's semantics (its success, not an error);
//! browsers get problems as HTML. The same rules run behind the proxy in
//! `proxy-bin/tests/frameworks.rs` against real frameworks.

mod support;

use axum::body::Body;
use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower_idempotency::{Engine, KeySource, MemoryStore, MismatchPolicy, Policy, Routes};

use support::{layered, Reply, Upstream};

/// A Laravel-style controller: without a valid email, 302 back to
/// `back_to`; with one, a new record and 302 to the thanks page, written
/// as Laravel writes redirects (`absolute`) or as a relative path.
fn laravel_like(engine: &Engine, back_to: &'static str, absolute: bool) -> Upstream {
    layered(engine, move |n, request| async move {
        let body = request.into_body().collect().await.unwrap().to_bytes();
        // A valid email has an (encoded) `@`.
        let valid = String::from_utf8_lossy(&body).contains("email=ada%40");
        let host = if absolute { "http://app.test" } else { "" };
        let location = if valid {
            format!("{host}/contact/thanks")
        } else {
            format!("{host}{back_to}")
        };
        Response::builder()
            .status(StatusCode::FOUND)
            .header(header::LOCATION, location)
            .header("x-record", n.to_string())
            .body(Body::empty())
            .unwrap()
    })
}

/// A Django-style view: an invalid form is rendered again with 200.
fn django_like(engine: &Engine) -> Upstream {
    layered(engine, |n, request| async move {
        let body = request.into_body().collect().await.unwrap().to_bytes();
        if String::from_utf8_lossy(&body).contains("%40") {
            Response::builder()
                .status(StatusCode::FOUND)
                .header(header::LOCATION, "/contact/thanks")
                .header("x-record", n.to_string())
                .body(Body::empty())
                .unwrap()
        } else {
            Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "text/html")
                .body(Body::from("<form>errors</form>"))
                .unwrap()
        }
    })
}

fn form_policy() -> Policy {
    Policy {
        key: KeySource::FormField("submission_token".into()),
        required: true,
        store_statuses: "3xx".parse().unwrap(),
        success_redirects: vec!["/contact/thanks".into()],
        mismatch: MismatchPolicy::Replay,
        ..Policy::default()
    }
}

fn engine(policy: Policy) -> Engine {
    Engine::new(MemoryStore::new(), Routes::all(policy).unwrap())
}

fn form_post(fields: &str) -> Request<Full<Bytes>> {
    Request::post("/contact")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .header(header::ACCEPT, "text/html,application/xhtml+xml,*/*;q=0.8")
        .body(Full::new(Bytes::from(fields.to_owned())))
        .unwrap()
}

const INVALID: &str = "submission_token=t-1&email=nope";
const VALID: &str = "submission_token=t-1&email=ada%40example.com";

fn location(reply: &Reply) -> &str {
    reply.headers[header::LOCATION].to_str().unwrap()
}

#[tokio::test]
async fn a_redirect_back_releases_the_token_and_the_corrected_form_runs_once() {
    for absolute in [false, true] {
        let engine = engine(form_policy());
        let app = laravel_like(&engine, "/contact", absolute);
        let failed = app.send(form_post(INVALID)).await;
        assert_eq!(failed.status, StatusCode::FOUND);
        assert!(location(&failed).ends_with("/contact"));
        let ok = app.send(form_post(VALID)).await;
        assert_eq!(ok.status, StatusCode::FOUND);
        assert!(location(&ok).ends_with("/contact/thanks"));
        assert!(!ok.replayed());
        // The same token again, with the corrected or with the old data.
        for body in [VALID, INVALID] {
            let again = app.send(form_post(body)).await;
            assert!(again.replayed(), "{again:?}");
            assert_eq!(again.headers["x-record"], ok.headers["x-record"]);
        }
        assert_eq!(app.calls(), 2, "the failed attempt and the one success");
    }
}

#[tokio::test]
async fn without_success_redirects_the_redirect_back_consumes_the_token() {
    // What the defaults do to a Laravel form (the reason for the option).
    let engine = engine(Policy {
        key: KeySource::FormField("submission_token".into()),
        ..Policy::default()
    });
    let app = laravel_like(&engine, "/contact", true);
    app.send(form_post(INVALID)).await;
    let corrected = app.send(form_post(VALID)).await;
    assert_eq!(corrected.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        corrected.headers["problem-type"],
        "urn:tower-idempotency:key-mismatch"
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn a_relative_location_is_resolved_against_the_request_path() {
    let engine = engine(Policy {
        success_redirects: vec!["/thanks".into()],
        ..form_policy()
    });
    // `Location: thanks` from `/contact` is `/thanks`; `./contact` is back.
    let app = layered(&engine, |n, request| async move {
        let body = request.into_body().collect().await.unwrap().to_bytes();
        let target = if body.ends_with(b"ok") {
            "thanks"
        } else {
            "./contact"
        };
        Response::builder()
            .status(StatusCode::SEE_OTHER)
            .header(header::LOCATION, target)
            .header("x-record", n.to_string())
            .body(Body::empty())
            .unwrap()
    });
    let back = app.send(form_post("submission_token=r&x=no")).await;
    assert!(!back.replayed());
    let thanks = app.send(form_post("submission_token=r&x=ok")).await;
    assert_eq!(location(&thanks), "thanks");
    let again = app.send(form_post("submission_token=r&x=ok")).await;
    assert!(again.replayed());
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn a_200_re_render_releases_the_token() {
    let engine = engine(form_policy());
    let app = django_like(&engine);
    let failed = app.send(form_post(INVALID)).await;
    assert_eq!(failed.status, StatusCode::OK);
    let ok = app.send(form_post(VALID)).await;
    assert_eq!(location(&ok), "/contact/thanks");
    assert!(!ok.replayed());
    let again = app.send(form_post(INVALID)).await;
    assert!(again.replayed());
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn concurrent_posts_of_one_form_run_once() {
    let engine = engine(form_policy());
    let app = layered(&engine, |n, _| async move {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        Response::builder()
            .status(StatusCode::FOUND)
            .header(header::LOCATION, "/contact/thanks")
            .header("x-record", n.to_string())
            .body(Body::empty())
            .unwrap()
    });
    let posts: Vec<_> = (0..20)
        .map(|_| tokio::spawn(app.send(form_post(VALID))))
        .collect();
    for post in posts {
        let reply = post.await.unwrap();
        assert_eq!(location(&reply), "/contact/thanks");
        assert_eq!(reply.headers["x-record"], "1");
    }
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn browsers_get_problems_as_html_and_api_clients_as_json() {
    let engine = engine(form_policy());
    let app = laravel_like(&engine, "/contact", false);
    let page = app.send(form_post("email=ada%40example.com")).await;
    assert_eq!(page.status, StatusCode::BAD_REQUEST);
    assert!(page.headers[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert_eq!(
        page.headers["problem-type"],
        "urn:tower-idempotency:key-missing"
    );
    assert!(page.text().contains("<h1>"), "{}", page.text());
    assert!(
        page.text().contains("form field `submission_token`"),
        "the problem says where the key goes: {}",
        page.text()
    );
    let api = app
        .send(
            Request::post("/contact")
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                .header(header::ACCEPT, "application/json")
                .body(Full::new(Bytes::from_static(b"email=x")))
                .unwrap(),
        )
        .await;
    api.assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    assert_eq!(app.calls(), 0);
}

#[tokio::test]
async fn the_in_flight_status_is_the_routes_own() {
    let engine = engine(Policy {
        in_flight: tower_idempotency::InFlightPolicy::Reject,
        in_flight_status: 425,
        ..Policy::default()
    });
    let (started, release) = (
        std::sync::Arc::new(tokio::sync::Notify::new()),
        std::sync::Arc::new(tokio::sync::Notify::new()),
    );
    let (s, r) = (started.clone(), release.clone());
    let app = layered(&engine, move |_, _| {
        let (s, r) = (s.clone(), r.clone());
        async move {
            s.notify_one();
            r.notified().await;
            Response::new(Body::from("done"))
        }
    });
    let request = || {
        Request::post("/orders")
            .header("idempotency-key", "k-425")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let first = tokio::spawn(app.send(request()));
    started.notified().await;
    let duplicate = app.send(request()).await;
    duplicate.assert_problem(StatusCode::from_u16(425).unwrap(), "in-flight");
    // A rejecting route answers at once; its hint is not `wait_timeout`.
    assert_eq!(duplicate.headers[header::RETRY_AFTER], "1");
    release.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    assert_eq!(app.calls(), 1);
}

#[test]
fn inconsistent_form_settings_are_refused() {
    let no_redirect_stored = Policy {
        store_statuses: "2xx".parse().unwrap(),
        success_redirects: vec!["/thanks".into()],
        ..Policy::default()
    };
    let error = no_redirect_stored.validate().unwrap_err();
    assert_eq!(error.field, "success_redirects");
    let not_a_pattern = Policy {
        success_redirects: vec!["thanks".into()],
        ..Policy::default()
    };
    assert_eq!(
        not_a_pattern.validate().unwrap_err().field,
        "success_redirects"
    );
    let not_an_error = Policy {
        in_flight_status: 200,
        ..Policy::default()
    };
    assert_eq!(
        not_an_error.validate().unwrap_err().field,
        "in_flight_status"
    );
    let not_an_error = Policy {
        unreplayable_status: 302,
        ..Policy::default()
    };
    assert_eq!(
        not_an_error.validate().unwrap_err().field,
        "unreplayable_status"
    );
}

/// The Next.js seed hashes its form's schema version into the fingerprint,
/// and a retry across a schema change is a conflict, not the old answer
/// replayed. A route's `fingerprint_version`: the same bytes under the same
/// key after the version changed are refused (422); under the old version
/// they replay; the backend ran once.
#[tokio::test]
async fn a_retry_across_a_fingerprint_version_change_is_refused() {
    let store = MemoryStore::new();
    let versioned = |version: &str| {
        Engine::new(
            store.clone(),
            Routes::all(Policy {
                fingerprint_version: version.into(),
                ..Policy::default()
            })
            .unwrap(),
        )
    };
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = |engine: &Engine| {
        let calls = calls.clone();
        layered(engine, move |_, _| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Response::new(Body::from("accepted")) }
        })
    };
    let request = || {
        Request::post("/api/forms/contact/submit")
            .header("idempotency-key", "lead-7")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"email":"ada@example.com"}"#,
            )))
            .unwrap()
    };
    let (v1, v2) = (versioned("1"), versioned("2"));
    assert_eq!(app(&v1).send(request()).await.status, StatusCode::OK);
    let across = app(&v2).send(request()).await;
    across.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    let same = app(&v1).send(request()).await;
    assert!(same.replayed());
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}
