//! The product's first story in a real browser (headless Chromium through
//! ChromeDriver): the contact form behind the proxy's one-flag demo
//! (`--demo-backend`, no `--config`) and behind the tower layer (the
//! `contact_form` example, run as its own process). A double click stores
//! one request; Back and Send again with the same page stores nothing new;
//! a validation error keeps the token and the typed values, and the
//! corrected form is stored once. A failing test leaves a screenshot in
//! `target/browser-screenshots/`.

mod common;
#[path = "frameworks/harness.rs"]
#[allow(dead_code)]
mod harness;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use bytes::Bytes;
use common::{client, free_port, send, services::wait_listening, temp_dir, Proxy, ProxyArgs};
use harness::{hidden_fields, Browser};

/// How many contact requests the app stored (`GET /stats`, read directly).
async fn stored(app: SocketAddr) -> u64 {
    let stats = send(&client(), app, "GET", "/stats", &[], Bytes::new())
        .await
        .json();
    stats["contact_requests"].as_u64().expect("a count")
}

/// The hidden submission token of the page the browser shows.
async fn token(browser: &Browser) -> String {
    let source = browser.source().await;
    hidden_fields(&source)
        .into_iter()
        .find(|(name, _)| name == "submission_token")
        .map(|(_, value)| value)
        .unwrap_or_else(|| panic!("no token in {source}"))
}

/// The story, against a form at `base` + `form`, whose success page ends
/// in `thanks` and whose counts are at `app`. `invalid_email` passes the
/// browser's own check and fails the app's.
async fn story(base: &str, form: &str, thanks: &str, app: SocketAddr, invalid_email: &str) {
    let browser = Browser::start().await;

    // A double click: one request, and the browser shows the thanks page.
    browser.open(&format!("{base}{form}")).await;
    browser.fill("#email", "ada@example.com").await;
    browser.fill("#message", "Hallo").await;
    browser.double_click("#send").await;
    browser.wait_for_url(thanks).await;
    assert_eq!(stored(app).await, 1, "a double click stores one request");

    // Back, and Send again with the same page: nothing new.
    browser.back().await;
    browser.wait_for_url(form).await;
    browser.fill("#email", "ada@example.com").await;
    browser.fill("#message", "Hallo").await;
    browser.click("#send").await;
    browser.wait_for_url(thanks).await;
    assert_eq!(
        stored(app).await,
        1,
        "the same page sent again stores nothing"
    );

    // A validation error keeps the token and what was typed; the corrected
    // form is stored once.
    browser.open(&format!("{base}{form}")).await;
    let first_token = token(&browser).await;
    browser.fill("#email", invalid_email).await;
    browser.fill("#message", "Zweiter Versuch").await;
    browser.click("#send").await;
    let mut source = String::new();
    for _ in 0..100 {
        source = browser.source().await;
        if source.contains("error") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        source.contains("error"),
        "the form shows its error: {source}"
    );
    assert_eq!(token(&browser).await, first_token, "old() keeps the token");
    assert_eq!(browser.value("#message").await, "Zweiter Versuch");
    assert_eq!(browser.value("#email").await, invalid_email);
    assert_eq!(stored(app).await, 1);
    browser.fill("#email", "ada@example.com").await;
    browser.click("#send").await;
    browser.wait_for_url(thanks).await;
    assert_eq!(stored(app).await, 2, "the corrected form is stored once");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_one_flag_demo_in_a_browser() {
    let demo = free_port();
    let dir = temp_dir("browser-demo");
    // No `--config`: the demo brings the routes it needs.
    let proxy = Proxy::start(ProxyArgs {
        extra: vec!["--demo-backend".into(), demo.to_string()],
        ..ProxyArgs::new(format!("http://{demo}"), "", &dir)
    })
    .await
    .owning(dir);
    let base = format!("http://{}", proxy.addr);
    // The demo's own check: an empty email.
    story(&base, "/contact", "/contact/thanks", demo, "").await;
}

/// The `contact_form` example (built by `cargo test --workspace`), on a
/// free port; killed when dropped.
struct Example(Child);

impl Drop for Example {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_layer_example_in_a_browser() {
    // target/debug/deps/browser-… -> target/debug/examples/contact_form
    let binary = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|deps| deps.parent())
        .map(|debug| debug.join("examples/contact_form"))
        .unwrap();
    assert!(
        binary.exists(),
        "{} is missing: run the workspace's tests (`./scripts/test.sh`), which build the examples",
        binary.display()
    );
    let addr = free_port();
    let mut example = Example(
        Command::new(&binary)
            .env("PORT", addr.port().to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the example"),
    );
    assert!(
        wait_listening(&mut example.0, addr),
        "the example exited at start (its port taken?)"
    );
    // `a@b` passes the browser's check of `type=email`, not the app's.
    story(&format!("http://{addr}"), "/", "/thanks", addr, "a@b").await;
}
