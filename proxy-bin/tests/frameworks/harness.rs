//! Real web frameworks as backends: a Django app, an Express app and a
//! stand-in for the Laravel seed's controller in plain PHP, each started as
//! its own process on a free port; a cookie-keeping form client; headless
//! Chromium through ChromeDriver (the W3C WebDriver protocol, spoken over
//! plain HTTP).
//!
//! The backends have no idempotency of their own (no unique constraint on
//! the submission token): the proxy in front of them holds the guarantee
//! alone. Each serves `GET /_stats` (records and notifications as JSON),
//! read directly, not through the proxy.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};

use crate::common::{
    client, free_port, send, services::wait_for_port, try_request_within, Reply, TempDir,
};

/// Which framework a backend runs.
#[derive(Clone, Copy, Debug)]
pub enum Framework {
    Django,
    Express,
    Laravel,
}

/// A framework's app, killed when dropped.
pub struct App {
    pub addr: SocketAddr,
    child: Child,
    _dir: TempDir,
}

fn frameworks_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/frameworks")
}

/// Fails with the command that is missing and how `scripts/setup.sh`
/// installs it, instead of a bare "No such file".
fn require(program: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        found,
        "`{program}` is not installed: run ./scripts/setup.sh (it installs the framework test backends)"
    );
}

impl App {
    /// Starts `framework`'s app on a free port and waits until it listens.
    /// `delay_ms` slows each accepted submission down (so that a double
    /// click overlaps the first request).
    pub fn start(framework: Framework, delay_ms: u64) -> App {
        App::start_with(framework, delay_ms, &[])
    }

    /// [`App::start`] with extra environment variables (`SERVER=gunicorn`
    /// runs the Django app under gunicorn instead of `runserver`).
    pub fn start_with(framework: Framework, delay_ms: u64, env: &[(&str, &str)]) -> App {
        let dir = crate::common::temp_dir(&format!("{framework:?}").to_lowercase());
        let addr = free_port();
        let port = addr.port().to_string();
        let root = frameworks_dir();
        let mut command = match framework {
            Framework::Django => {
                require("python3");
                let mut c = Command::new("python3");
                c.arg(root.join("django/app.py"))
                    .arg(&port)
                    .arg(dir.join("db.sqlite3"))
                    .env("PYTHONDONTWRITEBYTECODE", "1");
                c
            }
            Framework::Express => {
                require("node");
                assert!(
                    root.join("express/node_modules/express").exists(),
                    "express is not installed: run ./scripts/setup.sh (npm ci in {})",
                    root.join("express").display()
                );
                let mut c = Command::new("node");
                c.arg(root.join("express/app.js")).arg(&port);
                c
            }
            Framework::Laravel => {
                require("php");
                let mut c = Command::new("php");
                c.args(["-S", &addr.to_string()])
                    .arg(root.join("laravel/index.php"))
                    .env("DATA_DIR", &*dir)
                    .env("PHP_CLI_SERVER_WORKERS", "8");
                c
            }
        };
        command
            .envs(env.iter().copied())
            .env("SUBMIT_DELAY_MS", delay_ms.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // A group of its own, killed whole: `php -S` forks its workers,
        // which outlived a kill of the server alone (56 a run).
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command.spawn().expect("start the framework app");
        wait_for_port(addr.port());
        App {
            addr,
            child,
            _dir: dir,
        }
    }

    /// The upstream URL for the proxy.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The app's own counts (`GET /_stats`), read directly.
    pub async fn stats(&self) -> Value {
        send(&client(), self.addr, "GET", "/_stats", &[], Bytes::new())
            .await
            .json()
    }

    /// How many records the app holds.
    pub async fn records(&self) -> u64 {
        let stats = self.stats().await;
        stats
            .get("records")
            .or_else(|| stats.get("submissions"))
            .and_then(Value::as_u64)
            .expect("a record count")
    }

    /// How many notifications (or integration events) the app sent.
    pub async fn notifications(&self) -> u64 {
        let stats = self.stats().await;
        stats
            .get("notifications")
            .or_else(|| stats.get("events"))
            .and_then(Value::as_u64)
            .expect("a notification count")
    }
}

impl Drop for App {
    fn drop(&mut self) {
        if let Ok(group) = i32::try_from(self.child.id()) {
            // SAFETY: a plain system call on the group this app leads.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A browser-like form client: keeps cookies, reads hidden fields, does not
/// follow redirects (the tests look at each one).
pub struct FormClient {
    addr: SocketAddr,
    cookies: BTreeMap<String, String>,
    http: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<Bytes>,
    >,
}

impl FormClient {
    /// A client of `addr` (the proxy) with an empty cookie jar.
    pub fn new(addr: SocketAddr) -> Self {
        FormClient {
            addr,
            cookies: BTreeMap::new(),
            http: client(),
        }
    }

    fn cookie_header(&self) -> String {
        self.cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn keep_cookies(&mut self, reply: &Reply) {
        for value in reply.headers.get_all("set-cookie") {
            let Ok(value) = value.to_str() else { continue };
            let pair = value.split(';').next().unwrap_or_default();
            if let Some((name, value)) = pair.split_once('=') {
                self.cookies
                    .insert(name.trim().to_owned(), value.trim().to_owned());
            }
        }
    }

    /// GETs `path` as a browser would (it prefers HTML).
    pub async fn get(&mut self, path: &str) -> Reply {
        let cookie = self.cookie_header();
        let reply = send(
            &self.http,
            self.addr,
            "GET",
            path,
            &[("cookie", &cookie), ("accept", "text/html,*/*;q=0.8")],
            Bytes::new(),
        )
        .await;
        self.keep_cookies(&reply);
        reply
    }

    /// POSTs `fields` urlencoded to `path`, as a browser submits a form.
    pub async fn post_form(&mut self, path: &str, fields: &[(String, String)]) -> Reply {
        let reply = self.post_form_raw(path, fields).await;
        self.keep_cookies(&reply);
        reply
    }

    /// Like [`FormClient::post_form`] without taking the answer's cookies
    /// (for concurrent posts from one page).
    pub async fn post_form_raw(&self, path: &str, fields: &[(String, String)]) -> Reply {
        self.post_form_with(path, fields, &[]).await
    }

    /// [`FormClient::post_form_raw`] with `extra` headers.
    pub async fn post_form_with(
        &self,
        path: &str,
        fields: &[(String, String)],
        extra: &[(&str, &str)],
    ) -> Reply {
        let body = serde_urlencoded::to_string(fields).unwrap();
        let cookie = self.cookie_header();
        let origin = format!("http://{}", self.addr);
        let referer = format!("{origin}/contact");
        let mut headers = vec![
            ("cookie", cookie.as_str()),
            ("content-type", "application/x-www-form-urlencoded"),
            ("accept", "text/html,*/*;q=0.8"),
            ("origin", &origin),
            ("referer", &referer),
        ];
        headers.extend_from_slice(extra);
        send(&self.http, self.addr, "POST", path, &headers, body).await
    }
}

/// The `value` of every `<input type="hidden">` in `html`, by name.
pub fn hidden_fields(html: &str) -> Vec<(String, String)> {
    let mut fields = Vec::new();
    for input in html.split("<input").skip(1) {
        let tag = input.split('>').next().unwrap_or_default();
        if !tag.contains("type=\"hidden\"") {
            continue;
        }
        let attr = |name: &str| {
            let start = tag.find(&format!("{name}=\""))? + name.len() + 2;
            let end = tag[start..].find('"')? + start;
            Some(tag[start..end].to_owned())
        };
        if let (Some(name), Some(value)) = (attr("name"), attr("value")) {
            fields.push((name, value));
        }
    }
    fields
}

/// The hidden fields of the form at `path`, plus `visible` fields.
pub fn form_fields(page: &Reply, visible: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut fields = hidden_fields(&page.text());
    assert!(
        fields.iter().any(|(name, _)| name == "submission_token"),
        "the form carries a submission token: {}",
        page.text()
    );
    fields.extend(visible.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    fields
}

/// The `submission_token` in `fields`.
pub fn token(fields: &[(String, String)]) -> String {
    fields
        .iter()
        .find(|(name, _)| name == "submission_token")
        .map(|(_, value)| value.clone())
        .expect("a submission token")
}

/// The path of a `Location` header (absolute URLs as Laravel writes them,
/// or relative ones).
pub fn location_path(reply: &Reply) -> String {
    let location = reply.header("location").unwrap_or_default();
    match location.find("://") {
        Some(scheme) => {
            let rest = &location[scheme + 3..];
            rest.find('/').map_or("/".into(), |i| rest[i..].to_owned())
        }
        None => location.to_owned(),
    }
}

/// Headless Chromium driven through ChromeDriver; both stop when dropped.
pub struct Browser {
    driver: Child,
    base: SocketAddr,
    session: String,
    _dir: TempDir,
}

impl Browser {
    /// Starts ChromeDriver and a headless Chromium session.
    pub async fn start() -> Browser {
        require("chromedriver");
        require("chromium");
        let dir = crate::common::temp_dir("chromium");
        // A port picked free may be taken by another test's listener before
        // ChromeDriver binds it (it then exits, and the session request
        // reached that listener): only ChromeDriver's own socket counts.
        let (driver, base) = (0..5)
            .find_map(|_| {
                let base = free_port();
                let mut driver = Command::new("chromedriver")
                    .arg(format!("--port={}", base.port()))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start chromedriver");
                if crate::common::services::wait_listening(&mut driver, base) {
                    return Some((driver, base));
                }
                let _ = driver.kill();
                let _ = driver.wait();
                None
            })
            .expect("ChromeDriver never listened on a port of its own");
        let mut browser = Browser {
            driver,
            base,
            session: String::new(),
            _dir: dir,
        };
        let profile = format!("--user-data-dir={}", browser._dir.display());
        let created = browser
            .call(
                "POST",
                "/session",
                // An element looked for is waited for (up to 10 s), not
                // missed on a page still rendering on a loaded machine.
                json!({"capabilities": {"alwaysMatch": {
                    "browserName": "chrome",
                    "timeouts": {"implicit": 10000},
                    "goog:chromeOptions": {
                        "binary": "/usr/bin/chromium",
                        "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                 "--disable-dev-shm-usage", profile]
                    }
                }}}),
            )
            .await;
        browser.session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {created}"))
            .to_owned();
        browser
    }

    async fn call(&self, method: &str, path: &str, body: Value) -> Value {
        let body = if method == "GET" {
            Bytes::new()
        } else {
            Bytes::from(body.to_string())
        };
        let request = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.base))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(body))
            .unwrap();
        // Chromium starting, or a page loading, on a loaded machine may
        // take a while: readiness, not a timing assertion.
        let reply = try_request_within(&client(), request, Duration::from_secs(180))
            .await
            .unwrap_or_else(|error| panic!("WebDriver {method} {path}: {error}"));
        assert!(
            reply.status < 400,
            "WebDriver {method} {path} failed: {}",
            reply.text()
        );
        serde_json::from_slice(&reply.body).unwrap_or(Value::Null)
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    /// Opens `url`.
    pub async fn open(&self, url: &str) {
        self.call("POST", &self.session_path("/url"), json!({ "url": url }))
            .await;
    }

    /// The page's current URL.
    pub async fn url(&self) -> String {
        let value = self
            .call("GET", &self.session_path("/url"), Value::Null)
            .await;
        value["value"].as_str().unwrap_or_default().to_owned()
    }

    /// The page's visible text.
    pub async fn text(&self) -> String {
        let body = self.element("body").await;
        let value = self
            .call(
                "GET",
                &self.session_path(&format!("/element/{body}/text")),
                Value::Null,
            )
            .await;
        value["value"].as_str().unwrap_or_default().to_owned()
    }

    async fn element(&self, css: &str) -> String {
        let value = self
            .call(
                "POST",
                &self.session_path("/element"),
                json!({"using": "css selector", "value": css}),
            )
            .await;
        let element = &value["value"];
        element
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element {css}: {value}"))
            .to_owned()
    }

    /// Types `text` into the element `css`, replacing what it held.
    pub async fn fill(&self, css: &str, text: &str) {
        let element = self.element(css).await;
        self.call(
            "POST",
            &self.session_path(&format!("/element/{element}/clear")),
            json!({}),
        )
        .await;
        if text.is_empty() {
            return;
        }
        self.call(
            "POST",
            &self.session_path(&format!("/element/{element}/value")),
            json!({ "text": text }),
        )
        .await;
    }

    /// Double-clicks the element `css` with the mouse (two full clicks, as
    /// an impatient user does).
    pub async fn double_click(&self, css: &str) {
        self.click_twice(css, Duration::ZERO).await;
    }

    /// Clicks the element `css`, then again after `pause`, in one
    /// sequence of input actions: WebDriver's commands wait for a page
    /// that is loading, so a second command would click on the page the
    /// first click loaded. A user's impatient second click, while the
    /// first submission is still in flight.
    pub async fn click_twice(&self, css: &str, pause: Duration) {
        let element = self.element(css).await;
        let origin = json!({ "element-6066-11e4-a52e-4f735466cecf": element });
        self.call(
            "POST",
            &self.session_path("/actions"),
            json!({"actions": [{
                "type": "pointer", "id": "mouse",
                "parameters": {"pointerType": "mouse"},
                "actions": [
                    {"type": "pointerMove", "origin": origin, "x": 0, "y": 0},
                    {"type": "pointerDown", "button": 0},
                    {"type": "pointerUp", "button": 0},
                    {"type": "pause", "duration": pause.as_millis() as u64},
                    {"type": "pointerDown", "button": 0},
                    {"type": "pointerUp", "button": 0}
                ]
            }]}),
        )
        .await;
    }

    /// Clicks the element `css` once.
    pub async fn click(&self, css: &str) {
        let element = self.element(css).await;
        self.call(
            "POST",
            &self.session_path(&format!("/element/{element}/click")),
            json!({}),
        )
        .await;
    }

    /// The browser's Back button.
    pub async fn back(&self) {
        self.call("POST", &self.session_path("/back"), json!({}))
            .await;
    }

    /// The page's HTML as the browser holds it now.
    pub async fn source(&self) -> String {
        let value = self
            .call("GET", &self.session_path("/source"), Value::Null)
            .await;
        value["value"].as_str().unwrap_or_default().to_owned()
    }

    /// The value of the form field `css` as the browser holds it.
    pub async fn value(&self, css: &str) -> String {
        let element = self.element(css).await;
        let value = self
            .call(
                "GET",
                &self.session_path(&format!("/element/{element}/property/value")),
                Value::Null,
            )
            .await;
        value["value"].as_str().unwrap_or_default().to_owned()
    }

    /// Waits (up to 20 s) until the page's URL ends with `suffix`; the URL.
    pub async fn wait_for_url(&self, suffix: &str) -> String {
        let mut url = String::new();
        for _ in 0..200 {
            url = self.url().await;
            if url.ends_with(suffix) {
                return url;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the browser did not reach {suffix}; it shows {url}");
    }
}

impl Browser {
    /// One blocking WebDriver call (for `Drop`, which cannot await): the
    /// response body.
    fn call_blocking(&self, method: &str, path: &str) -> Option<Vec<u8>> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.base).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .ok()?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.base
        );
        stream.write_all(request.as_bytes()).ok()?;
        let mut response = Vec::new();
        let _ = stream.read_to_end(&mut response);
        let start = response.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        Some(response[start..].to_vec())
    }

    /// Saves what the browser shows to `target/browser-screenshots/` (for
    /// a failed test); the file's path.
    fn save_screenshot(&self) -> Option<PathBuf> {
        use base64::Engine as _;
        let body = self.call_blocking("GET", &self.session_path("/screenshot"))?;
        let value: Value = serde_json::from_slice(strip_chunking(&body)).ok()?;
        let png = base64::engine::general_purpose::STANDARD
            .decode(value["value"].as_str()?)
            .ok()?;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/browser-screenshots");
        std::fs::create_dir_all(&dir).ok()?;
        let name = std::thread::current()
            .name()
            .unwrap_or("browser")
            .replace("::", "-");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).ok()?;
        Some(path)
    }
}

/// A chunked HTTP/1.1 body's payload when it is one chunk (ChromeDriver's
/// way), else the body as it is.
fn strip_chunking(body: &[u8]) -> &[u8] {
    let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") else {
        return body;
    };
    let Ok(size) = usize::from_str_radix(
        std::str::from_utf8(&body[..line_end]).unwrap_or("x").trim(),
        16,
    ) else {
        return body;
    };
    body.get(line_end + 2..line_end + 2 + size).unwrap_or(body)
}

impl Drop for Browser {
    fn drop(&mut self) {
        if std::thread::panicking() {
            match self.save_screenshot() {
                Some(path) => eprintln!("screenshot of the failed test: {}", path.display()),
                None => eprintln!("no screenshot could be taken"),
            }
        }
        // Best effort: end the session (closes Chromium), then the driver.
        let _ = self.call_blocking("DELETE", &self.session_path(""));
        self.driver.kill().ok();
        self.driver.wait().ok();
    }
}
