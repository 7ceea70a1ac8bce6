//! The seeds' contact form, made to take effect once by the idempotency
//! layer instead of by hand-written token checks.
//!
//! ```text
//! cargo run --example contact_form        # http://127.0.0.1:3000 (or $PORT)
//! ```
//!
//! * `GET /` renders the form with a fresh hidden `submission_token` (a
//!   UUID v4), as the Laravel tutorial does.
//! * `POST /contact` stores the request, sends one "notification" and
//!   redirects (303) to `/thanks`. Double clicks, a reload of the POST or a
//!   second tab with the same form store nothing twice: the layer replays
//!   the first 303.
//! * `GET /stats` shows how many requests were stored and notifications sent.
//! * A validation error re-renders the form with status 422 and the *same*
//!   token (Laravel's `old()`). The layer does not store 4xx answers, so the
//!   corrected resubmission with that token goes through.
//!
//! The handlers contain no idempotency code at all: [`routes`] is the whole
//! configuration. The tests (`tests/layer.rs`) drive this very app.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{Form, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use tower_idempotency::{Engine, IdempotencyLayer, KeySource, MemoryStore, Policy, Routes};

/// The form field carrying the submission token.
pub const TOKEN_FIELD: &str = "submission_token";

/// One stored contact request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContactRequest {
    /// The submission token it was sent with.
    pub token: String,
    /// The sender's address.
    pub email: String,
    /// What they wrote.
    pub message: String,
}

/// The app's "database" and "mail queue": every stored request and the
/// number of notifications sent.
#[derive(Debug, Default)]
pub struct Contacts {
    requests: Mutex<Vec<ContactRequest>>,
    notifications: AtomicUsize,
}

impl Contacts {
    /// Every stored request, in order.
    pub fn requests(&self) -> Vec<ContactRequest> {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How many notifications were sent.
    pub fn notifications(&self) -> usize {
        self.notifications.load(Ordering::SeqCst)
    }
}

/// The idempotency configuration: `POST /contact` needs a UUID in the
/// `submission_token` form field; nothing else is covered.
pub fn routes() -> Routes {
    let policy = Policy {
        uuid_only: true,
        ..Policy::default()
            .key(KeySource::FormField(TOKEN_FIELD.to_owned()))
            .required(true)
    };
    Routes::new()
        .route("/contact", policy)
        .expect("the contact form policy is valid")
}

/// The whole app behind the idempotency layer driven by `engine`.
pub fn app(engine: Engine, contacts: Arc<Contacts>) -> Router {
    Router::new()
        .route("/", get(show_form))
        .route("/contact", post(submit))
        .route("/thanks", get(thanks))
        .route("/stats", get(stats))
        .with_state(contacts)
        .layer(IdempotencyLayer::new(engine))
}

/// What the browser posts. Missing fields are empty, so they fail
/// validation rather than the extractor.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ContactForm {
    submission_token: String,
    email: String,
    message: String,
}

async fn show_form() -> Html<String> {
    let form = ContactForm {
        submission_token: uuid::Uuid::new_v4().to_string(),
        ..ContactForm::default()
    };
    Html(render_form(&form, &[]))
}

async fn submit(State(contacts): State<Arc<Contacts>>, Form(form): Form<ContactForm>) -> Response {
    let errors = validate(&form);
    if !errors.is_empty() {
        // Same token: the corrected form still belongs to this submission.
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Html(render_form(&form, &errors)),
        )
            .into_response();
    }
    contacts
        .requests
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(ContactRequest {
            token: form.submission_token,
            email: form.email.trim().to_owned(),
            message: form.message.trim().to_owned(),
        });
    // Stands in for queueing the notification mail.
    contacts.notifications.fetch_add(1, Ordering::SeqCst);
    Redirect::to("/thanks").into_response()
}

/// How many requests were stored and notifications sent, as JSON: the
/// numbers that show a double click ran once.
async fn stats(State(contacts): State<Arc<Contacts>>) -> Response {
    let body = format!(
        r#"{{"contact_requests":{},"notifications":{}}}"#,
        contacts.requests().len(),
        contacts.notifications()
    );
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

async fn thanks() -> Html<&'static str> {
    Html(concat!(
        "<!doctype html><title>Thank you</title>",
        "<h1>Thank you</h1><p>We received your request.</p>"
    ))
}

fn validate(form: &ContactForm) -> Vec<&'static str> {
    let mut errors = Vec::new();
    if !is_plausible_email(form.email.trim()) {
        errors.push("Please enter a valid email address.");
    }
    let message = form.message.trim();
    if message.is_empty() {
        errors.push("Please enter a message.");
    } else if message.chars().count() > 5000 {
        errors.push("The message may be at most 5000 characters long.");
    }
    errors
}

/// `local@domain.tld`, at most 254 characters, no whitespace.
fn is_plausible_email(email: &str) -> bool {
    let Some((local, domain)) = email.split_once('@') else {
        return false;
    };
    email.len() <= 254
        && !local.is_empty()
        && !email.chars().any(char::is_whitespace)
        && !domain.contains('@')
        && domain
            .split_once('.')
            .is_some_and(|(name, tld)| !name.is_empty() && !tld.is_empty())
}

fn render_form(form: &ContactForm, errors: &[&str]) -> String {
    let errors: String = errors
        .iter()
        .map(|error| format!("<li>{}</li>", escape(error)))
        .collect();
    let errors = if errors.is_empty() {
        String::new()
    } else {
        format!("<ul class=\"errors\">{errors}</ul>")
    };
    format!(
        concat!(
            "<!doctype html><title>Contact</title><h1>Contact us</h1>{errors}",
            "<form method=\"post\" action=\"/contact\">",
            "<input type=\"hidden\" name=\"{field}\" value=\"{token}\">",
            "<label>Email <input type=\"email\" id=\"email\" name=\"email\" value=\"{email}\" required></label>",
            "<label>Message <textarea id=\"message\" name=\"message\" required>{message}</textarea></label>",
            "<button type=\"submit\" id=\"send\">Send</button></form>"
        ),
        errors = errors,
        field = TOKEN_FIELD,
        token = escape(&form.submission_token),
        email = escape(&form.email),
        message = escape(&form.message),
    )
}

/// Escapes text for HTML element content and quoted attribute values.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.parse()?,
        Err(_) => 3000,
    };
    let engine = Engine::new(MemoryStore::new(), routes());
    let _sweeper = engine.spawn_sweeper(std::time::Duration::from_secs(60), 1000);
    let app = app(engine, Arc::default());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("contact form on http://{}/", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
