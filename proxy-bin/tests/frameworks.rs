//! The seeds' flows behind the real proxy, in front of backends we did not
//! design for it: a real Django app, a real Express app and a faithful
//! stand-in for the Laravel seed's controller (plain PHP). None of them has
//! a unique constraint on the submission token: the proxy alone holds the
//! guarantee. The configurations are the recipes of `docs/frameworks.md`.
//!
//! For each form backend: the seed's three feature tests (same token twice;
//! two tokens, same data; missing or invalid token), the `old()` flow
//! (invalid, then corrected with the same token), 20 concurrent posts of
//! one form, and a double click in headless Chromium.

mod common;
#[path = "frameworks/harness.rs"]
#[allow(dead_code)]
mod harness;

use bytes::Bytes;
use common::{temp_dir, uuid, Proxy, ProxyArgs, Reply};
use harness::{form_fields, location_path, token, App, Browser, FormClient, Framework};

/// `docs/frameworks.md`, Laravel: validation failure and success are both
/// 302; only a redirect to the thanks route consumes the token.
const LARAVEL: &str = r#"
[[route]]
path = "/contact*"
methods = ["POST"]
key = { form_field = "submission_token" }
required = true
uuid_only = true
fingerprint_exclude = ["_token"]
store_statuses = ["3xx"]
success_redirects = ["/contact/thanks"]
mismatch = "replay"
"#;

/// `docs/frameworks.md`, Django: an invalid form is re-rendered with 200;
/// only the redirect to the thanks page consumes the token.
const DJANGO: &str = r#"
[[route]]
path = "/contact*"
methods = ["POST"]
key = { form_field = "submission_token" }
required = true
uuid_only = true
fingerprint_exclude = ["csrfmiddlewaretoken"]
store_statuses = ["3xx"]
success_redirects = ["/contact/thanks"]
mismatch = "replay"
"#;

/// `docs/frameworks.md`, Express / Next.js API routes: 202 on acceptance,
/// 422 on validation errors (released), 409 for a changed payload (the
/// seed's choice) and a distinct status for "still in flight".
const EXPRESS: &str = r#"
case_insensitive_paths = true
[[route]]
path = "/api/forms/*/submit"
methods = ["POST"]
required = true
uuid_only = true
store_statuses = ["2xx"]
mismatch_status = 409
in_flight_status = 425
unreplayable_status = 502
"#;

struct Stack {
    app: App,
    proxy: Proxy,
}

async fn stack(framework: Framework, config: &str, delay_ms: u64) -> Stack {
    let app = App::start(framework, delay_ms);
    let dir = temp_dir("frameworks");
    let proxy = Proxy::start(ProxyArgs::new(app.url(), config, &dir))
        .await
        .owning(dir);
    Stack { app, proxy }
}

fn form_config(framework: Framework) -> &'static str {
    match framework {
        Framework::Django => DJANGO,
        Framework::Laravel => LARAVEL,
        Framework::Express => unreachable!("Express serves the JSON flow"),
    }
}

const VALID: &[(&str, &str)] = &[("email", "ada@example.com"), ("message", "Hallo")];
const INVALID: &[(&str, &str)] = &[("email", "not-an-email"), ("message", "Hallo")];

fn assert_thanks(reply: &Reply, replayed: bool) {
    assert_eq!(reply.status, 302, "{reply:?}");
    assert_eq!(location_path(reply), "/contact/thanks", "{reply:?}");
    assert_eq!(reply.replayed(), replayed, "{reply:?}");
}

/// Whether `reply` is the framework's answer to an invalid form: Laravel
/// redirects back to the form, Django renders it again with its errors.
fn assert_validation_failure(framework: Framework, reply: &Reply) {
    match framework {
        Framework::Laravel => {
            assert_eq!(reply.status, 302, "{reply:?}");
            assert_eq!(location_path(reply), "/contact", "{reply:?}");
        }
        Framework::Django => {
            assert_eq!(reply.status, 200, "{reply:?}");
            assert!(reply.text().contains("class=\"errors\""), "{reply:?}");
        }
        Framework::Express => unreachable!(),
    }
    assert!(!reply.replayed());
}

/// The seed's feature test: the same token twice is one record, and the
/// second answer is the same thanks redirect.
async fn same_token_twice(framework: Framework) {
    let Stack { app, proxy } = stack(framework, form_config(framework), 20).await;
    let mut browser = FormClient::new(proxy.addr);
    let page = browser.get("/contact").await;
    assert_eq!(page.status, 200);
    let fields = form_fields(&page, VALID);
    assert_thanks(&browser.post_form("/contact", &fields).await, false);
    assert_thanks(&browser.post_form("/contact", &fields).await, true);
    assert_eq!(app.records().await, 1);
    assert_eq!(app.notifications().await, 1);
}

/// The seed's feature test: two tokens with the same data are two records.
async fn two_tokens_same_data(framework: Framework) {
    let Stack { app, proxy } = stack(framework, form_config(framework), 20).await;
    for _ in 0..2 {
        let mut browser = FormClient::new(proxy.addr);
        let page = browser.get("/contact").await;
        let fields = form_fields(&page, VALID);
        assert_thanks(&browser.post_form("/contact", &fields).await, false);
    }
    assert_eq!(app.records().await, 2);
}

/// The seed's feature test: a missing or malformed token creates nothing;
/// a browser gets a readable HTML page that names the problem.
async fn missing_or_invalid_token(framework: Framework) {
    let Stack { app, proxy } = stack(framework, form_config(framework), 20).await;
    let mut browser = FormClient::new(proxy.addr);
    let page = browser.get("/contact").await;
    let fields = form_fields(&page, VALID);
    let without: Vec<_> = fields
        .iter()
        .filter(|(name, _)| name != "submission_token")
        .cloned()
        .collect();
    let mut invalid = without.clone();
    invalid.push(("submission_token".into(), "not-a-uuid".into()));
    for (body, kind) in [(without, "key-missing"), (invalid, "key-invalid")] {
        let reply = browser.post_form("/contact", &body).await;
        assert_eq!(reply.status, 400, "{reply:?}");
        let content_type = reply.header("content-type").unwrap_or_default();
        assert!(content_type.starts_with("text/html"), "{reply:?}");
        assert_eq!(
            reply.header("problem-type"),
            Some(&*format!("urn:tower-idempotency:{kind}"))
        );
        assert!(reply.text().contains("<html"), "{}", reply.text());
    }
    assert_eq!(app.records().await, 0);
}

/// The `old()` flow: an invalid submission does not consume the token; the
/// corrected one with the same token is the one record; the same token sent
/// again, with the corrected or with the old data, gets the thanks redirect.
async fn old_input_flow(framework: Framework) {
    let Stack { app, proxy } = stack(framework, form_config(framework), 20).await;
    let mut browser = FormClient::new(proxy.addr);
    let page = browser.get("/contact").await;
    let first = form_fields(&page, INVALID);
    let failed = browser.post_form("/contact", &first).await;
    assert_validation_failure(framework, &failed);
    // The form again, as the browser shows it after the failure: the same
    // hidden token (Laravel: `old()` after the redirect; Django: the page
    // rendered in the answer itself).
    let again = match framework {
        Framework::Laravel => browser.get("/contact").await,
        _ => failed.clone(),
    };
    let corrected = form_fields(&again, VALID);
    assert_eq!(token(&corrected), token(&first), "old() keeps the token");
    assert!(
        again.text().contains("not-an-email"),
        "the old input is shown"
    );
    assert_thanks(&browser.post_form("/contact", &corrected).await, false);
    assert_eq!(app.records().await, 1);
    assert_thanks(&browser.post_form("/contact", &corrected).await, true);
    // The token is consumed: even the old, invalid data now gets the
    // stored success (the seed's catch block), never a second record.
    assert_thanks(&browser.post_form("/contact", &first).await, true);
    assert_eq!(app.records().await, 1);
    assert_eq!(app.notifications().await, 1);
    let stats = app.stats().await;
    assert_eq!(stats["emails"][0], "ada@example.com");
}

/// Twenty concurrent posts of one form: one record, twenty thanks.
async fn twenty_concurrent_posts(framework: Framework) {
    let Stack { app, proxy } = stack(framework, form_config(framework), 200).await;
    let mut browser = FormClient::new(proxy.addr);
    let page = browser.get("/contact").await;
    let fields = form_fields(&page, VALID);
    let browser = std::sync::Arc::new(browser);
    let posts: Vec<_> = (0..20)
        .map(|_| {
            let (browser, fields) = (browser.clone(), fields.clone());
            tokio::spawn(async move { browser.post_form_raw("/contact", &fields).await })
        })
        .collect();
    let mut replayed = 0;
    for post in posts {
        let reply = post.await.unwrap();
        assert_eq!(reply.status, 302, "{reply:?}");
        assert_eq!(location_path(&reply), "/contact/thanks");
        replayed += usize::from(reply.replayed());
    }
    assert_eq!(replayed, 19, "one execution, nineteen replays");
    assert_eq!(app.records().await, 1);
    assert_eq!(app.notifications().await, 1);
}

/// A double click on the submit button in a real browser: one record, and
/// the browser lands on the thanks page. As fast as WebDriver makes it,
/// Chromium may drop the first submission before sending it (seen behind
/// the Laravel stand-in), leaving no duplicate to stop; so the flow is
/// then run again with the second click made while the first submission
/// is in flight (the user sees nothing happen and clicks again), which
/// always sends both: one executes, the other is answered from it.
async fn double_click_in_chromium(framework: Framework) {
    // Each submission takes 2.5 s: the second click lands while the
    // first is in flight.
    let Stack { app, proxy } = stack(framework, form_config(framework), 2500).await;
    let browser = Browser::start().await;
    browser
        .open(&format!("http://{}/contact", proxy.addr))
        .await;
    browser.fill("#email", "ada@example.com").await;
    browser.fill("#message", "Doppelklick").await;
    browser.double_click("#send").await;
    browser.wait_for_url("/contact/thanks").await;
    assert_eq!(app.records().await, 1);
    assert_eq!(app.notifications().await, 1);

    browser
        .open(&format!("http://{}/contact", proxy.addr))
        .await;
    browser.fill("#email", "grace@example.com").await;
    browser.fill("#message", "Ungeduld").await;
    let before = outcomes(&proxy).await;
    browser
        .click_twice("#send", std::time::Duration::from_millis(1000))
        .await;
    browser.wait_for_url("/contact/thanks").await;
    let after = outcomes(&proxy).await;
    assert_eq!(app.records().await, 2, "one record per form sent");
    assert_eq!(app.notifications().await, 2);
    assert_eq!(after.executed - before.executed, 1, "{after:?}");
    assert!(
        after.duplicates > before.duplicates,
        "the second click never reached the proxy: {after:?}"
    );
}

/// The proxy's counts of executed requests and of duplicates answered
/// from them (replayed, waited, in-flight conflicts), from `/metrics`.
#[derive(Debug)]
struct Outcomes {
    executed: u64,
    duplicates: u64,
}

async fn outcomes(proxy: &Proxy) -> Outcomes {
    let metrics = proxy.admin("/metrics").await.text();
    let count = |outcome: &str| -> u64 {
        let line = format!("idempotency_requests_total{{outcome=\"{outcome}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map_or(0, |n| n.trim().parse().unwrap())
    };
    Outcomes {
        executed: count("executed"),
        duplicates: count("replayed") + count("waited") + count("in_flight_conflict"),
    }
}

macro_rules! form_suite {
    ($module:ident, $framework:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread")]
            async fn same_token_twice_is_one_record() {
                same_token_twice($framework).await;
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn two_tokens_with_the_same_data_are_two_records() {
                two_tokens_same_data($framework).await;
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn a_missing_or_invalid_token_creates_nothing() {
                missing_or_invalid_token($framework).await;
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn the_old_input_flow_is_one_record() {
                old_input_flow($framework).await;
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn twenty_concurrent_posts_are_one_record() {
                twenty_concurrent_posts($framework).await;
            }

            #[tokio::test(flavor = "multi_thread")]
            async fn a_double_click_in_chromium_is_one_record() {
                double_click_in_chromium($framework).await;
            }
        }
    };
}

form_suite!(laravel, Framework::Laravel);
form_suite!(django, Framework::Django);

/// Scenario (from a review of the proxy's path readings): gunicorn, which
/// trusts a proxy on `127.0.0.1` by default, takes WSGI's `SCRIPT_NAME`
/// from a request header of that name and routes Django by the rest of
/// the path: `POST /x/contact` with `SCRIPT_NAME: /x` runs the contact
/// view. The proxy classified `/x/contact` (no route), forwarded the
/// header, and each copy of the form was a record. Impact ("once"), behind
/// a backend we did not write. The header's path is now a reading of the
/// request: the form is covered by its route, once, and replayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_script_name_header_is_read_as_the_form_route() {
    let app = App::start_with(Framework::Django, 20, &[("SERVER", "gunicorn")]);
    // The attack works against the backend itself: one record.
    let mut direct = FormClient::new(app.addr);
    let page = direct.get("/contact").await;
    let fields = form_fields(&page, VALID);
    let rewritten = [("script_name", "/x")];
    let reply = direct
        .post_form_with("/x/contact", &fields, &rewritten)
        .await;
    assert_eq!(reply.status, 302, "{reply:?}");
    assert_eq!(app.records().await, 1, "gunicorn routes by SCRIPT_NAME");
    let dir = temp_dir("frameworks");
    let proxy = Proxy::start(ProxyArgs::new(app.url(), DJANGO, &dir))
        .await
        .owning(dir);
    let mut browser = FormClient::new(proxy.addr);
    let page = browser.get("/contact").await;
    let fields = form_fields(&page, VALID);
    let first = browser
        .post_form_with("/x/contact", &fields, &rewritten)
        .await;
    assert_thanks(&first, false);
    let again = browser
        .post_form_with("/x/contact", &fields, &rewritten)
        .await;
    assert_thanks(&again, true);
    assert_eq!(app.records().await, 2, "one record through the proxy");
}

/// Scenario (from a review of the proxy's path readings): Laravel behind
/// nginx or Apache routes `/index.php/contact` as `/contact` (Symfony's
/// path info). The proxy read no route there, so the same form sent twice
/// to that spelling was two records. Now it is read as the front
/// controller routes it: one record, the second answer a replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_front_controller_spelling_is_the_form_route() {
    let Stack { app, proxy } = stack(Framework::Laravel, LARAVEL, 20).await;
    for path in ["/index.php/contact", "/ind%65x.php/contact"] {
        let mut browser = FormClient::new(proxy.addr);
        let page = browser.get("/contact").await;
        let fields = form_fields(&page, VALID);
        let first = browser.post_form(path, &fields).await;
        assert_thanks(&first, false);
        let again = browser.post_form(path, &fields).await;
        assert_thanks(&again, true);
        let missing: Vec<_> = fields
            .iter()
            .filter(|(name, _)| name != "submission_token")
            .cloned()
            .collect();
        let refused = browser.post_form(path, &missing).await;
        assert_eq!(refused.status, 400, "{path}: {refused:?}");
    }
    assert_eq!(app.records().await, 2);
}

/// Scenario (from a review of success criteria): the German seed's form,
/// its thanks page `/kontakt/bestätigt` written in the route as it reads.
/// Django redirects there with the path escaped, as every framework does
/// (`Location: /kontakt/best%C3%A4tigt`); the proxy matched the escaped
/// path against the written one, so no success ever consumed the token:
/// each was read as a failure, the key released, and the same form sent
/// twice was two records. Impact ("once"), behind a backend we did not
/// write.
#[tokio::test(flavor = "multi_thread")]
async fn a_thanks_page_outside_ascii_consumes_the_token() {
    let config = DJANGO
        .replace("\"/contact*\"", "\"/kontakt*\"")
        .replace("\"/contact/thanks\"", "\"/kontakt/bestätigt\"");
    let Stack { app, proxy } = stack(Framework::Django, &config, 20).await;
    let mut browser = FormClient::new(proxy.addr);
    let page = browser.get("/kontakt").await;
    assert_eq!(page.status, 200);
    let fields = form_fields(&page, VALID);
    let first = browser.post_form("/kontakt", &fields).await;
    assert_eq!(first.status, 302, "{first:?}");
    assert_eq!(
        location_path(&first),
        "/kontakt/best%C3%A4tigt",
        "{first:?}"
    );
    assert!(!first.replayed());
    let second = browser.post_form("/kontakt", &fields).await;
    assert_eq!(location_path(&second), "/kontakt/best%C3%A4tigt");
    assert!(
        second.replayed(),
        "the success did not consume the token: {second:?}"
    );
    assert_eq!(app.records().await, 1);
}

/// Attack, behind a backend we did not write: Django's `APPEND_SLASH`
/// answers `POST /signup` with a 301 to `/signup/` before any view runs,
/// and the client sends the form again there with the same token. The
/// engine reads both spellings as one scope; on a route without
/// `success_redirects` the 301 was stored as the token's answer and
/// replayed to the corrected post: the form could never be submitted with
/// that token. A 301, 307 or 308 back to the request's own path is no
/// answer: the token stays free, the post at `/signup/` runs once, and its
/// retry is replayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_slash_redirect_leaves_the_token_for_the_request_it_asks_for() {
    let config = r#"
[[route]]
path = "/signup"
methods = ["POST"]
key = { form_field = "submission_token" }
required = true
uuid_only = true
fingerprint_exclude = ["csrfmiddlewaretoken"]
"#;
    let Stack { app, proxy } = stack(Framework::Django, config, 20).await;
    let mut browser = FormClient::new(proxy.addr);
    let page = browser.get("/signup/").await;
    assert_eq!(page.status, 200, "{page:?}");
    let fields = form_fields(&page, VALID);
    let moved = browser.post_form("/signup", &fields).await;
    assert_eq!(moved.status, 301, "{moved:?}");
    assert_eq!(location_path(&moved), "/signup/", "{moved:?}");
    assert_eq!(app.records().await, 0);
    let posted = browser.post_form("/signup/", &fields).await;
    assert_thanks(&posted, false);
    assert_thanks(&browser.post_form("/signup/", &fields).await, true);
    assert_eq!(app.records().await, 1);
}

mod express {
    use super::*;

    const LEAD: &str = r#"{"email":"ada@example.com","name":"Ada"}"#;

    async fn submit(proxy: &Proxy, key: &str, body: &str) -> Reply {
        proxy
            .send(
                "POST",
                "/api/forms/contact/submit",
                &[
                    ("content-type", "application/json"),
                    ("idempotency-key", key),
                ],
                Bytes::from(body.to_owned()),
            )
            .await
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_retry_returns_the_original_receipt() {
        let Stack { app, proxy } = stack(Framework::Express, EXPRESS, 20).await;
        let key = uuid();
        let first = submit(&proxy, &key, LEAD).await;
        assert_eq!(first.status, 202, "{first:?}");
        let again = submit(&proxy, &key, LEAD).await;
        assert_eq!(again.status, 202);
        assert!(again.replayed());
        assert_eq!(first.json()["submissionId"], again.json()["submissionId"]);
        assert_eq!(app.records().await, 1);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn two_keys_with_the_same_data_are_two_submissions() {
        let Stack { app, proxy } = stack(Framework::Express, EXPRESS, 20).await;
        for _ in 0..2 {
            assert_eq!(submit(&proxy, &uuid(), LEAD).await.status, 202);
        }
        assert_eq!(app.records().await, 2);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_missing_or_invalid_key_creates_nothing() {
        let Stack { app, proxy } = stack(Framework::Express, EXPRESS, 20).await;
        let missing = proxy
            .send(
                "POST",
                "/api/forms/contact/submit",
                &[("content-type", "application/json")],
                Bytes::from_static(LEAD.as_bytes()),
            )
            .await;
        assert_eq!(missing.status, 400);
        assert_eq!(missing.json()["type"], "urn:tower-idempotency:key-missing");
        let invalid = submit(&proxy, "not-a-uuid", LEAD).await;
        assert_eq!(invalid.status, 400);
        assert_eq!(invalid.json()["type"], "urn:tower-idempotency:key-invalid");
        assert_eq!(app.records().await, 0);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_validation_error_releases_the_key_and_a_changed_payload_is_409() {
        let Stack { app, proxy } = stack(Framework::Express, EXPRESS, 20).await;
        let key = uuid();
        let invalid = submit(&proxy, &key, r#"{"email":"nope","name":"Ada"}"#).await;
        assert_eq!(invalid.status, 422);
        assert_eq!(submit(&proxy, &key, LEAD).await.status, 202);
        let changed = submit(&proxy, &key, r#"{"email":"eve@example.com","name":"Eve"}"#).await;
        assert_eq!(changed.status, 409);
        assert_eq!(app.records().await, 1);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn twenty_concurrent_submissions_are_one() {
        let Stack { app, proxy } = stack(Framework::Express, EXPRESS, 300).await;
        let key = uuid();
        let proxy = std::sync::Arc::new(proxy);
        let posts: Vec<_> = (0..20)
            .map(|_| {
                let (proxy, key) = (proxy.clone(), key.clone());
                tokio::spawn(async move { submit(&proxy, &key, LEAD).await })
            })
            .collect();
        let mut ids = std::collections::HashSet::new();
        for post in posts {
            let reply = post.await.unwrap();
            assert_eq!(reply.status, 202, "{reply:?}");
            ids.insert(reply.json()["submissionId"].to_string());
        }
        assert_eq!(ids.len(), 1, "every answer is the one receipt");
        assert_eq!(app.records().await, 1);
    }

    /// The seed's client (`LeadForm`) drops its key on any 409. Its first
    /// attempt's answer is lost, the user clicks again while that attempt is
    /// still in flight, then once more after it finished: with the recipe's
    /// distinct in-flight status the client keeps its key and the third
    /// click replays the one submission; with 409 for both conflicts it
    /// would throw the key away and submit twice.
    #[tokio::test(flavor = "multi_thread")]
    async fn the_seed_client_keeps_its_key_through_an_in_flight_conflict() {
        let config = format!("{EXPRESS}in_flight = \"reject\"\n");
        let Stack { app, proxy } = stack(Framework::Express, &config, 1500).await;
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/frameworks/express/lead-client.js");
        let output = tokio::process::Command::new("node")
            .arg(script)
            .arg(format!("http://{}", proxy.addr))
            .arg("2000")
            .output()
            .await
            .expect("run node");
        assert!(output.status.success(), "{output:?}");
        let run: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(
            run["first"]["ok"], false,
            "the first answer was lost: {run}"
        );
        assert!(run["keptKey"].is_string(), "the client kept its key: {run}");
        assert_eq!(run["second"]["ok"], false, "in flight: {run}");
        assert_eq!(run["second"]["error"], "Submission failed", "{run}");
        assert_eq!(run["second"]["key"], run["keptKey"], "not dropped: {run}");
        assert_eq!(run["third"]["ok"], true, "{run}");
        assert_eq!(app.records().await, 1, "one submission: {run}");
    }

    /// Scenario (from a review against the seed): the backend commits the
    /// submission, then its answer breaks off after the head (a restart
    /// mid-response). The proxy keeps the key as "executed, response
    /// incomplete", and answered every retry 409; the seed's client reads
    /// any 409 as "this submission changed", drops its key, and its next
    /// click submitted again under a new key: two submissions. With the
    /// recipe's `unreplayable_status` the client keeps its key through
    /// every click, and the submission is made once.
    #[tokio::test(flavor = "multi_thread")]
    async fn the_seed_client_keeps_its_key_when_the_answer_broke_off() {
        let Stack { app, proxy } = stack(Framework::Express, EXPRESS, 20).await;
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/frameworks/express/lead-client.js");
        let output = tokio::process::Command::new("node")
            .arg(script)
            .arg(format!("http://{}", proxy.addr))
            .arg("200")
            .arg("broken")
            .output()
            .await
            .expect("run node");
        assert!(output.status.success(), "{output:?}");
        let run: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(run["first"]["ok"], false, "the answer broke off: {run}");
        for click in ["second", "third"] {
            assert_eq!(run[click]["ok"], false, "{click}: {run}");
            assert_eq!(run[click]["error"], "Submission failed", "{click}: {run}");
            assert_eq!(
                run[click]["key"], run["keptKey"],
                "{click} dropped the key: {run}"
            );
        }
        assert_eq!(app.records().await, 1, "one submission: {run}");
    }

    /// A double click on the seed's lead form in a real browser: both
    /// clicks carry the same key; one submission, one receipt shown.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_double_click_in_chromium_is_one_submission() {
        let Stack { app, proxy } = stack(Framework::Express, EXPRESS, 300).await;
        let browser = Browser::start().await;
        browser.open(&format!("http://{}/lead", proxy.addr)).await;
        browser.fill("#email", "ada@example.com").await;
        browser.fill("#name", "Ada").await;
        browser.double_click("#send").await;
        let mut text = String::new();
        for _ in 0..200 {
            text = browser.text().await;
            if text.contains("accepted") || text.contains("error") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(text.contains("accepted"), "{text}");
        assert_eq!(app.records().await, 1);
        // Both clicks reached the proxy: the page's script sends each.
        let counts = outcomes(&proxy).await;
        assert_eq!(counts.executed, 1, "{counts:?}");
        assert!(
            counts.duplicates >= 1,
            "one click never reached the proxy: {counts:?}"
        );
    }
}
