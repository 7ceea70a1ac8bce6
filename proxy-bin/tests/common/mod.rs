//! Shared end-to-end harness: a real HTTP backend that counts executions,
//! the real `idempotency-proxy` binary in front of it, and a client.
#![allow(dead_code)]

pub mod services;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

/// How the backend answers, by path:
///
/// * `POST /contact`: a form; without an `email` field 422 (validation
///   error), else 303 to `/contact/thanks`;
/// * `POST /api/...`: 201 with a JSON body numbering the execution;
/// * `POST /upload`: 200 with the SHA-256 and length of the body it got;
/// * `POST /slow?ms=N`: waits N ms (or until [`Backend::open_gate`] when
///   `N` is `gate`), then 201;
/// * `POST /hold-first`: the first request waits for [`Backend::open_gate`],
///   later ones answer 201 at once;
/// * `POST /chunked?n=N`: 201 with N lines of 100 bytes, streamed in
///   chunks (`Transfer-Encoding: chunked`);
/// * anything else: 200 echoing method, path, headers and body as JSON.
///
/// Every request is counted per path ([`Backend::hits`]).
#[derive(Clone)]
pub struct Backend {
    pub addr: SocketAddr,
    state: Arc<BackendState>,
}

#[derive(Default)]
struct BackendState {
    hits: Mutex<HashMap<String, usize>>,
    total: AtomicUsize,
    gate: Notify,
    arrived: Notify,
}

impl Backend {
    /// Starts a backend on a free loopback port.
    pub async fn start() -> Backend {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// Starts a backend on `addr` (e.g. a port that was down before).
    pub async fn start_on(addr: SocketAddr) -> Backend {
        let state = Arc::new(BackendState::default());
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind backend");
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .ok();
        });
        Backend { addr, state }
    }

    /// The upstream URL for `--upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests reached `path`.
    pub fn hits(&self, path: &str) -> usize {
        self.state
            .hits
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    /// How many requests reached the backend at all.
    pub fn total(&self) -> usize {
        self.state.total.load(Ordering::SeqCst)
    }

    /// Lets every `/slow?ms=gate` request finish.
    pub fn open_gate(&self) {
        self.state.gate.notify_waiters();
    }

    /// Waits until a `/slow?ms=gate` request is being held.
    pub async fn held(&self) {
        tokio::time::timeout(Duration::from_secs(10), self.state.arrived.notified())
            .await
            .expect("a request reached the backend");
    }
}

async fn handle(State(state): State<Arc<BackendState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    let n = {
        let mut hits = state.hits.lock().unwrap();
        let n = hits.entry(path.clone()).or_default();
        *n += 1;
        *n
    };
    state.total.fetch_add(1, Ordering::SeqCst);
    if parts.method == Method::POST && path == "/contact" {
        let form = String::from_utf8_lossy(&body);
        let has_email = form.contains("email=") || form.contains("name=\"email\"");
        return if has_email {
            (
                StatusCode::SEE_OTHER,
                [
                    ("location", "/contact/thanks"),
                    ("set-cookie", "flash=thanks"),
                ],
            )
                .into_response()
        } else {
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                "The email field is required.",
            )
                .into_response()
        };
    }
    if parts.method == Method::POST && path.starts_with("/api/") {
        let json = serde_json::json!({ "execution": n, "path": path, "len": body.len() });
        return (StatusCode::CREATED, axum::Json(json)).into_response();
    }
    if parts.method == Method::POST && path == "/upload" {
        let sum = hex(&Sha256::digest(&body));
        return (StatusCode::OK, format!("{sum} {}", body.len())).into_response();
    }
    if parts.method == Method::POST && path == "/chunked" {
        let lines: usize = parts
            .uri
            .query()
            .and_then(|q| q.strip_prefix("n="))
            .and_then(|n| n.parse().ok())
            .unwrap_or(3);
        let chunks = (0..lines).map(move |i| {
            Ok::<_, std::convert::Infallible>(Bytes::from(format!("{n:>8} line {i:>85}\n")))
        });
        let body = axum::body::Body::from_stream(futures::stream::iter(chunks));
        return (StatusCode::CREATED, body).into_response();
    }
    if path == "/slow" || path == "/hold-first" {
        let query = parts.uri.query().unwrap_or("");
        if query.contains("ms=gate") || (path == "/hold-first" && n == 1) {
            let opened = state.gate.notified();
            // A permit, not a wake-up of waiters only: a request that
            // arrives before the test awaits `held()` (a loaded machine) is
            // not missed.
            state.arrived.notify_one();
            opened.await;
        } else if let Some(ms) = query.strip_prefix("ms=").and_then(|v| v.parse().ok()) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let json = serde_json::json!({ "execution": n });
        return (StatusCode::CREATED, axum::Json(json)).into_response();
    }
    if parts.uri.query() == Some("status=204") {
        return StatusCode::NO_CONTENT.into_response();
    }
    let headers: serde_json::Map<String, serde_json::Value> = parts
        .headers
        .iter()
        .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
        .collect();
    let json = serde_json::json!({
        "method": parts.method.as_str(),
        "path": parts.uri.to_string(),
        "headers": headers,
        "body": String::from_utf8_lossy(&body),
    });
    (StatusCode::OK, [("x-backend", "echo")], axum::Json(json)).into_response()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A loopback address with a port nobody listens on right now.
pub fn free_port() -> SocketAddr {
    let listener = StdListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// Whether process `pid` holds a socket listening on `addr`'s port (read
/// from `/proc`: the process's socket inodes against the listening TCP
/// sockets of its network namespace).
pub fn listens(pid: u32, addr: SocketAddr) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let inodes: std::collections::HashSet<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_str()?;
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_owned(),
            )
        })
        .collect();
    let port = format!("{:04X}", addr.port());
    ["tcp", "tcp6"].iter().any(|table| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        text.lines().skip(1).any(|line| {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 9
                && fields[3] == "0A"
                && fields[1].rsplit(':').next() == Some(port.as_str())
                && inodes.contains(fields[9])
        })
    })
}

/// A fresh directory for one test's files, removed when dropped (declare
/// it before the processes that use it, so they stop first).
pub fn temp_dir(name: &str) -> TempDir {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "idempotency-proxy-{name}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(Some(dir))
}

/// See [`temp_dir`].
pub struct TempDir(Option<PathBuf>);

impl TempDir {
    /// The path, no longer removed on drop (its owner removes it).
    pub fn keep(mut self) -> PathBuf {
        self.0.take().expect("a live directory")
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        self.0.as_deref().expect("a live directory")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A running `idempotency-proxy` process, killed when dropped.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    child: Child,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Removed after the process is killed (fields drop after `drop`).
    dir: Option<TempDir>,
}

/// How to start a proxy.
#[derive(Clone)]
pub struct ProxyArgs {
    pub upstream: String,
    pub store: String,
    pub redis: Option<String>,
    /// The TOML configuration text.
    pub config: String,
    /// The working directory (relative SQLite paths live here).
    pub dir: PathBuf,
    pub extra: Vec<String>,
}

impl ProxyArgs {
    /// A memory store, no Redis, no extra flags.
    pub fn new(upstream: impl Into<String>, config: &str, dir: &Path) -> Self {
        ProxyArgs {
            upstream: upstream.into(),
            store: "memory".into(),
            redis: None,
            config: config.into(),
            dir: dir.to_owned(),
            extra: Vec::new(),
        }
    }
}

impl Proxy {
    /// Keeps `dir` (the proxy's working directory) until the proxy is gone.
    pub fn owning(mut self, dir: TempDir) -> Self {
        self.dir = Some(dir);
        self
    }

    /// Starts the binary with `config` (TOML text) and waits until it
    /// accepts connections.
    pub async fn start(args: ProxyArgs) -> Proxy {
        Self::start_with(args, |_| {}).await
    }

    /// Like [`Proxy::start`], with the proxy's log (stdout and stderr, at
    /// `RUST_LOG=log_level`) written to `log`.
    pub async fn start_logged(args: ProxyArgs, log: &Path, log_level: &str) -> Proxy {
        let file = std::fs::File::create(log).unwrap();
        Self::start_with(args, |command| {
            command
                .env("RUST_LOG", log_level)
                .stdout(file.try_clone().unwrap())
                .stderr(file.try_clone().unwrap());
        })
        .await
    }

    /// Like [`Proxy::start`], letting `configure` adjust the command.
    pub async fn start_with(args: ProxyArgs, mut configure: impl FnMut(&mut Command)) -> Proxy {
        let config_path = args.dir.join("idempotency.toml");
        std::fs::write(&config_path, &args.config).unwrap();
        // A free port may be taken by someone else before the proxy binds
        // it; the proxy then exits at once, and is started on new ports.
        for _ in 0..5 {
            let addr = free_port();
            let admin = free_port();
            let mut command = Command::new(env!("CARGO_BIN_EXE_idempotency-proxy"));
            if let Some(redis) = &args.redis {
                command.args(["--redis", redis]);
            }
            command
                .current_dir(&args.dir)
                .args(["--listen", &addr.to_string()])
                .args(["--upstream", &args.upstream])
                .args(["--store", &args.store])
                .args(&args.extra)
                .args(["--admin", &admin.to_string()]);
            // An empty configuration text: started without `--config`.
            if !args.config.is_empty() {
                command.arg("--config").arg(&config_path);
            }
            command
                .env(
                    "RUST_LOG",
                    std::env::var("PROXY_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .stdin(Stdio::null());
            configure(&mut command);
            let child = command.spawn().expect("spawn idempotency-proxy");
            let mut proxy = Proxy {
                addr,
                admin,
                child,
                client: Client::builder(TokioExecutor::new()).build_http(),
                dir: None,
            };
            if proxy.wait_ready().await {
                return proxy;
            }
        }
        panic!("idempotency-proxy exited at start five times");
    }

    /// Whether the proxy came up (false: it exited at start). Up means
    /// this process listens on both ports: a port picked free may have been
    /// taken by another test's listener, which would answer a connect just
    /// as well.
    async fn wait_ready(&mut self) -> bool {
        for _ in 0..500 {
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            let pid = self.child.id();
            if listens(pid, self.addr) && listens(pid, self.admin) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("idempotency-proxy did not start listening");
    }

    /// Sends a request through the proxy.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        send(&self.client, self.addr, method, path, headers, body).await
    }

    /// GETs a path from the admin listener.
    pub async fn admin(&self, path: &str) -> Reply {
        send(&self.client, self.admin, "GET", path, &[], Bytes::new()).await
    }

    /// Any request to the admin listener.
    pub async fn admin_send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        send(&self.client, self.admin, method, path, headers, body.into()).await
    }

    /// The process id (for `/proc/<pid>/status`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process at once (`kill -9`).
    pub fn kill(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// SIGTERM, then waits for a clean exit: every log line is written
    /// (the proxy writes its log in batches; `kill` may lose the last).
    pub async fn stop(&mut self) {
        self.terminate();
        assert!(
            self.wait_exit().await,
            "idempotency-proxy exited with an error"
        );
    }

    /// Waits (at most 20 s) for the process to exit; its success.
    pub async fn wait_exit(&mut self) -> bool {
        self.exit_code().await == Some(0)
    }

    /// Waits for the process to exit: its exit status (`None` if a signal
    /// ended it).
    pub async fn exit_code(&mut self) -> Option<i32> {
        for _ in 0..1000 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("idempotency-proxy did not exit");
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A response, fully read.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {}", self.text()))
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// A client of its own (a fresh connection pool).
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let body = body.into();
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (name, value) in headers {
        request = request.header(*name, HeaderValue::from_str(value).unwrap());
    }
    let request = request.body(Full::new(body)).unwrap();
    try_request(client, request).await.unwrap()
}

/// Sends `request`; an error (connection refused or cut, no answer within
/// 30 s) is returned, not a panic.
pub async fn try_request(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: hyper::Request<Full<Bytes>>,
) -> Result<Reply, String> {
    try_request_within(client, request, Duration::from_secs(30)).await
}

/// [`try_request`] with its own limit (a browser starting on a loaded
/// machine takes its time).
pub async fn try_request_within(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: hyper::Request<Full<Bytes>>,
    limit: Duration,
) -> Result<Reply, String> {
    let response = tokio::time::timeout(limit, client.request(request))
        .await
        .map_err(|_| format!("no answer in {limit:?}"))?
        .map_err(|error| format!("request failed: {error}"))?;
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|error| format!("body cut off: {error}"))?
        .to_bytes();
    Ok(Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

/// POSTs `body` with `headers` on a connection of its own, in the
/// background.
pub fn spawn_post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> tokio::task::JoinHandle<Reply> {
    let path = path.to_owned();
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let body = body.into();
    tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (&**k, &**v)).collect();
        send(&client(), addr, "POST", &path, &headers, body).await
    })
}

/// An `application/x-www-form-urlencoded` body.
pub fn urlencoded(fields: &[(&str, &str)]) -> String {
    serde_urlencoded::to_string(fields).unwrap()
}

/// A `multipart/form-data` body and its content type.
pub fn multipart(fields: &[(&str, &str)]) -> (String, String) {
    let boundary = "----proxytestboundary7MA4YWxk";
    let mut body = String::new();
    for (name, value) in fields {
        body.push_str(&format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
        ));
    }
    body.push_str(&format!("--{boundary}--\r\n"));
    (body, format!("multipart/form-data; boundary={boundary}"))
}

pub fn uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Writes `request` (raw bytes) on a connection of its own and reads until
/// it closes (at most 10 s): the answer as text, and how the read ended (a
/// reset is an error, the bytes before it kept).
pub async fn send_raw(addr: SocketAddr, request: &str) -> (String, std::io::Result<usize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let read = stream.read_to_end(&mut answer);
    let read = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the proxy answers and closes the connection");
    (String::from_utf8_lossy(&answer).into_owned(), read)
}
