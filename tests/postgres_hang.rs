//! A real PostgreSQL server that hangs: its processes stopped (`SIGSTOP`),
//! so its sockets stay open and nothing answers, and then resumed
//! (`SIGCONT`), so every statement that reached it while it hung runs
//! late. Each test starts a server of its own (`initdb` into a temporary
//! directory, run as the `postgres` user), since stopping the shared test
//! server would stall every other test.
//!
//! Written from the client's side: whatever each request saw during the
//! hang, the handler runs at most once per key, and afterwards every retry
//! gets the one execution's answer or, where that execution never ran, one
//! execution of its own.
#![cfg(all(feature = "postgres", target_os = "linux"))]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body as AxumBody;
use futures::future::join_all;
use http::{Response, StatusCode};
use sqlx::postgres::PgConnectOptions;
use tokio::sync::Notify;
use tower_idempotency::engine::EngineConfig;
use tower_idempotency::{Engine, Policy, PostgresStore, Routes};

use support::{layered, post_json, Reply, Upstream};

/// The PostgreSQL binaries of the machine's (only) major version.
fn postgres_bin() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap_or_else(|error| panic!("no PostgreSQL server binaries under {root:?}: {error}"))
        .map(|entry| entry.unwrap().path().join("bin"))
        .filter(|bin| bin.join("postgres").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("no PostgreSQL server binaries to start a server of the test's own")
}

/// A PostgreSQL server of this test's own, on a free port, stopped and
/// removed when dropped.
struct PrivateServer {
    dir: PathBuf,
    postmaster: Child,
    port: u16,
}

impl PrivateServer {
    fn start(name: &str) -> Self {
        let bin = postgres_bin();
        let dir = std::env::temp_dir().join(format!("ti_pg_hang_{name}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // The server refuses to run as root: the data directory and the
        // processes are the `postgres` user's.
        let run_as_postgres = |program: &Path| {
            let mut command = Command::new("setpriv");
            command
                .args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
                .arg(program);
            command
        };
        let chown = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(chown.success(), "chown {dir:?}");
        let data = dir.join("data");
        let initdb = run_as_postgres(&bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(
            initdb.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&initdb.stderr)
        );
        let port = free_port();
        let postmaster = run_as_postgres(&bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(port.to_string())
            .arg("-k")
            .arg(&dir)
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = PrivateServer {
            dir,
            postmaster,
            port,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the private server never listened"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
    }

    /// The server's processes: the postmaster and every process it forked
    /// (backends, background workers).
    fn processes(&self) -> Vec<i32> {
        let postmaster = self.postmaster.id() as i32;
        let mut pids = vec![postmaster];
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid …`; comm may hold spaces.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|ppid| ppid.parse::<i32>().ok());
            if ppid == Some(postmaster) {
                pids.push(pid);
            }
        }
        pids
    }

    /// Stops every process of the server: connections stay open, new ones
    /// are accepted by the kernel and never answered, nothing runs.
    fn hang(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Resumes the server: what reached it meanwhile runs now.
    fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        // The postmaster first on a stop (no new backend forks after the
        // list is read), last on a resume.
        let mut pids = self.processes();
        if signal == libc::SIGCONT {
            pids.reverse();
        }
        for pid in pids {
            // SAFETY: `kill` has no memory effects; a process that ended
            // meanwhile only makes it fail.
            unsafe { libc::kill(pid, signal) };
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.resume();
        // An immediate shutdown: the data directory is thrown away.
        unsafe { libc::kill(self.postmaster.id() as i32, libc::SIGQUIT) };
        let _ = self.postmaster.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Short enough that the tests run in seconds, long enough that a hang of
/// `HANG` stays inside what README promises to ride out (an outage of
/// less than about two thirds of the lease).
const LEASE: Duration = Duration::from_secs(8);
const HANG: Duration = Duration::from_millis(2500);
const STORE_TIMEOUT: Duration = Duration::from_millis(400);

/// An engine over a migrated store on `server`, with short timeouts.
async fn engine(server: &PrivateServer) -> Engine {
    let pool = PostgresStore::pool_options()
        .max_connections(4)
        .connect_lazy_with(server.options());
    let store = PostgresStore::from_pool(pool);
    store.migrate().await.unwrap();
    let policy = Policy {
        lease: LEASE,
        wait_timeout: Duration::from_millis(300),
        ..Policy::default()
    };
    let config = EngineConfig {
        store_timeout: STORE_TIMEOUT,
        ..EngineConfig::default()
    };
    Engine::with_config(Arc::new(store), Routes::all(policy).unwrap(), config)
}

/// The layer in front of a handler that answers `201 order <n>` once
/// `gate` lets it (at once when it is not closed).
fn gated(engine: &Engine, gate: Arc<Gate>) -> Upstream {
    layered(engine, move |n, _request| {
        let gate = gate.clone();
        async move {
            gate.pass().await;
            Response::builder()
                .status(StatusCode::CREATED)
                .body(AxumBody::from(format!("order {n}")))
                .unwrap()
        }
    })
}

/// A gate the handler waits at while it is closed.
struct Gate {
    open: std::sync::atomic::AtomicBool,
    opened: Notify,
    reached: Notify,
}

impl Gate {
    fn closed() -> Arc<Self> {
        Arc::new(Gate {
            open: false.into(),
            opened: Notify::new(),
            reached: Notify::new(),
        })
    }

    async fn pass(&self) {
        self.reached.notify_one();
        loop {
            let opened = self.opened.notified();
            if self.open.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            opened.await;
        }
    }

    fn open(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
        self.opened.notify_waiters();
    }
}

/// `n` copies of the same request sent at once.
async fn at_once(upstream: &Upstream, n: usize, key: &[u8], body: &'static str) -> Vec<Reply> {
    join_all((0..n).map(|_| tokio::spawn(upstream.send(post_json(key, body)))))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// Retries `key` until its answer is no longer a refusal to wait or a 503,
/// for at most `within`; returns that answer.
async fn settled(upstream: &Upstream, key: &[u8], body: &'static str, within: Duration) -> Reply {
    let until = Instant::now() + within;
    loop {
        let reply = upstream.send(post_json(key, body)).await;
        let waiting = matches!(
            reply.status,
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
        );
        if !waiting || Instant::now() >= until {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The database hangs while a request runs and while it completes: its
/// duplicates and new keys sent during the hang are refused (503), never
/// executed; the first caller gets its answer; once the database resumes,
/// the statements that waited in its sockets (renewals, the completion and
/// its retries) run late, and every retry replays the one execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_hangs_mid_execution_never_lets_a_duplicate_run() {
    let server = PrivateServer::start("mid");
    let engine = engine(&server).await;
    let gate = Gate::closed();
    let upstream = gated(&engine, gate.clone());

    let reached = gate.reached.notified();
    let first = tokio::spawn(upstream.send(post_json(b"pay-1", r#"{"amount": 5}"#)));
    reached.await;
    server.hang();

    // During the hang: the key's duplicates, and a key never seen.
    let duplicates = at_once(&upstream, 20, b"pay-1", r#"{"amount": 5}"#);
    let fresh = at_once(&upstream, 10, b"pay-2", r#"{"amount": 7}"#);
    let (duplicates, fresh) = tokio::join!(duplicates, fresh);
    for reply in duplicates.iter().chain(&fresh) {
        reply.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
        assert!(reply.headers.contains_key(http::header::RETRY_AFTER));
    }
    assert_eq!(upstream.calls(), 1, "a request ran while the store hung");

    // The handler answers while the store still hangs: its completion
    // cannot be written now.
    gate.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.text(), "order 1");
    let hung_for = Instant::now();
    tokio::time::sleep(HANG.saturating_sub(hung_for.elapsed())).await;
    server.resume();

    // After it: the late statements run; the key replays, however many
    // retries arrive at once, and the key never seen executes once.
    let settled_first = settled(&upstream, b"pay-1", r#"{"amount": 5}"#, LEASE).await;
    assert!(settled_first.replayed(), "{settled_first:?}");
    assert_eq!(settled_first.text(), "order 1");
    let retries = at_once(&upstream, 30, b"pay-1", r#"{"amount": 5}"#).await;
    for reply in &retries {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(reply.replayed());
        assert_eq!(reply.text(), "order 1");
    }
    let fresh = at_once(&upstream, 10, b"pay-2", r#"{"amount": 7}"#).await;
    let executed: Vec<_> = fresh.iter().filter(|r| !r.replayed()).collect();
    assert!(executed.len() <= 1, "{fresh:?}");
    let fresh = settled(&upstream, b"pay-2", r#"{"amount": 7}"#, LEASE).await;
    assert_eq!(fresh.text(), "order 2", "{fresh:?}");
    assert_eq!(upstream.calls(), 2);
}

/// The database hangs before it has run a reservation: the caller gets 503
/// and nothing runs; the reservation and the engine's release of it then
/// run late, in either order. The key is never held for longer than its
/// lease by the request that gave up, and afterwards exactly one of many
/// retries executes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_hangs_before_a_reservation_runs_it_late_and_once() {
    let server = PrivateServer::start("reserve");
    let engine = engine(&server).await;
    let gate = Gate::closed();
    gate.open();
    let upstream = gated(&engine, gate);
    // Warm the pool: the reservation then goes out on an open connection.
    let warm = upstream.send(post_json(b"warm", "{}")).await;
    assert_eq!(warm.status, StatusCode::CREATED);

    server.hang();
    let during = at_once(&upstream, 20, b"pay-3", r#"{"amount": 9}"#).await;
    for reply in &during {
        reply.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "store-unavailable");
    }
    assert_eq!(upstream.calls(), 1, "a request ran while the store hung");
    tokio::time::sleep(HANG).await;
    let resumed = Instant::now();
    server.resume();

    let after = at_once(&upstream, 30, b"pay-3", r#"{"amount": 9}"#).await;
    let executed = after
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed());
    assert!(executed.count() <= 1, "{after:?}");
    let reply = settled(&upstream, b"pay-3", r#"{"amount": 9}"#, LEASE * 2).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert_eq!(reply.text(), "order 2");
    assert!(
        resumed.elapsed() < LEASE + Duration::from_secs(2),
        "the key stayed held past its lease: {:?}",
        resumed.elapsed()
    );
    let again = at_once(&upstream, 20, b"pay-3", r#"{"amount": 9}"#).await;
    for reply in &again {
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(reply.text(), "order 2");
    }
    assert_eq!(upstream.calls(), 2);
}
