//! The bundled demo backend (`--demo-backend`): a tiny application that is
//! *not* idempotent by itself and counts how often it executes, to watch
//! the proxy at work.
//!
//! * `GET /contact`: the Laravel seed's contact form, with a hidden
//!   `submission_token` (a fresh UUID);
//! * `POST /contact`: counts a submission and redirects (303) to
//!   `/contact/thanks`; without an email it answers 422 and shows the form
//!   again with the same token and what was typed (Laravel's `old()`);
//! * `POST /api/orders`: counts an order and answers 201 with JSON;
//! * `GET /stats`: how many times each ran.
//!
//! Every POST takes half a second, so a double click arrives while the
//! first is still running.
//!
//! Started without `--config`, the proxy protects the demo with
//! [`CONFIG`]: the form keyed on its hidden token, the JSON API on the
//! `Idempotency-Key` header.

/// The routes the one-flag demo (`--demo-backend` without `--config`)
/// runs with: what `idempotency.example.toml` says for the same paths.
pub const CONFIG: &str = r#"
[[route]]
path = "/contact"
methods = ["POST"]
key = { form_field = "submission_token" }
required = true
uuid_only = true
store_statuses = ["3xx"]
success_redirects = ["/contact/thanks"]
mismatch = "replay"

[[route]]
path = "/api/**"
required = true
scope_headers = ["Authorization"]
mismatch_status = 409
"#;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use http::{header, Method, Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;

/// The demo application's counters.
#[derive(Default)]
pub struct DemoBackend {
    contacts: AtomicU64,
    orders: AtomicU64,
}

#[async_trait]
impl ServeHttp for DemoBackend {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_owned();
        let mut body = Vec::new();
        while let Ok(Some(chunk)) = session.read_request_body().await {
            body.extend_from_slice(&chunk);
        }
        if method == Method::POST {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        match (method, path.as_str()) {
            (Method::GET, "/" | "/contact") => html(StatusCode::OK, &form(&uuid(), "", "", "")),
            (Method::POST, "/contact") => {
                let field = |name: &str| {
                    form_urlencoded::parse(&body)
                        .find(|(key, _)| key == name)
                        .map(|(_, value)| value.into_owned())
                        .unwrap_or_default()
                };
                let token = field("submission_token");
                if field("email").trim().is_empty() {
                    let page = form(
                        &token,
                        "<p class=error>The email field is required.</p>",
                        &field("email"),
                        &field("message"),
                    );
                    return html(StatusCode::UNPROCESSABLE_ENTITY, &page);
                }
                let n = self.contacts.fetch_add(1, Ordering::SeqCst) + 1;
                tracing::info!(n, "demo backend: contact request stored, notification sent");
                redirect("/contact/thanks")
            }
            (Method::GET, "/contact/thanks") => {
                let n = self.contacts.load(Ordering::SeqCst);
                html(
                    StatusCode::OK,
                    &format!(
                        "<h1>Thank you!</h1><p>The backend has stored {n} contact \
                         request(s) so far.</p><p><a href=/contact>Again</a></p>"
                    ),
                )
            }
            (Method::POST, "/api/orders") => {
                let n = self.orders.fetch_add(1, Ordering::SeqCst) + 1;
                tracing::info!(n, "demo backend: order placed");
                json(
                    StatusCode::CREATED,
                    &format!(r#"{{"order":{n},"received_bytes":{}}}"#, body.len()),
                )
            }
            (Method::GET, "/stats") => json(
                StatusCode::OK,
                &format!(
                    r#"{{"contact_requests":{},"orders":{}}}"#,
                    self.contacts.load(Ordering::SeqCst),
                    self.orders.load(Ordering::SeqCst)
                ),
            ),
            _ => html(StatusCode::NOT_FOUND, "<h1>Not found</h1>"),
        }
    }
}

fn uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The contact form; `email` and `message` are what the user typed
/// (escaped), kept after a validation error as Laravel's `old()` does.
fn form(token: &str, error: &str, email: &str, message: &str) -> String {
    let (token, email, message) = (escape(token), escape(email), escape(message));
    format!(
        "<!doctype html><title>Contact</title><h1>Contact</h1>{error}\
         <form method=post action=/contact>\
         <input type=hidden name=submission_token value=\"{token}\">\
         <p><input type=email id=email name=email placeholder=Email value=\"{email}\"></p>\
         <p><textarea id=message name=message placeholder=Message>{message}</textarea></p>\
         <p><button type=submit id=send>Send</button> (double-click it)</p></form>"
    )
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn respond(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CONTENT_LENGTH, body.len())
        .body(body)
        .expect("a valid response")
}

fn html(status: StatusCode, page: &str) -> Response<Vec<u8>> {
    respond(status, "text/html; charset=utf-8", page.as_bytes().to_vec())
}

fn json(status: StatusCode, text: &str) -> Response<Vec<u8>> {
    respond(status, "application/json", text.as_bytes().to_vec())
}

fn redirect(location: &str) -> Response<Vec<u8>> {
    let mut response = respond(StatusCode::SEE_OTHER, "text/plain", Vec::new());
    response.headers_mut().insert(
        header::LOCATION,
        http::HeaderValue::from_str(location).expect("a valid location"),
    );
    response
}
