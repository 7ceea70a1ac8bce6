//! `idempotency-proxy` next to what a user would compare it with, measured
//! by `wrk` in one run: nginx as a reverse proxy (passthrough) and
//! `idempotent-proxy-server` from crates.io (replays, first executions).
//!
//! ```text
//! cargo bench --bench proxy_peers
//! ```
//!
//! It builds the proxy (release), starts nginx answering a fixed 201 as the
//! backend (one worker), nginx as a reverse proxy in front of it (one
//! worker, upstream keep-alive), the proxy and the peer with their memory
//! stores, each at a quiet log level (`RUST_LOG=warn`, peer
//! `LOG_LEVEL=warn`) and at its default one, and drives every
//! configuration with `wrk` (a 1 KiB JSON `POST`) at concurrency 1, 8, 64
//! and 256, interleaved so each concurrency's cells come from the same
//! minute. It prints one markdown table per concurrency, the targets as
//! ratios, and writes a plot of requests/s and p50 per configuration
//! (`docs/bench/proxy_peers.svg`, or `PLOT=path`).
//!
//! Tools, found on the `PATH` (or named by `WRK`, `NGINX`, `PEER`): `wrk`
//! is required (without it the bench prints a note and stops); without
//! nginx the backend is an in-process axum server and the nginx-as-proxy
//! column is skipped; without the peer (`cargo install
//! idempotent-proxy-server --root tools`; `tools/bin` is looked in too)
//! its columns are skipped. Nothing is downloaded. `LOAD_SECONDS` sets
//! the time per cell (default 4), `CONCURRENCY` the list (`1,8,64,256`),
//! `TARGETS` a comma-separated list of name fragments that selects the
//! configurations measured (e.g. `TARGETS='passthrough,execution,replay'`;
//! a fragment starting with `!` excludes, e.g. `!default`).
//! `ROUNDS=n` measures every cell `n` times (whole passes, interleaved)
//! and reports each cell's median run by requests/s: on two shared cores
//! one pass moves by ±20%.
//! `PROXY=path` measures that build of the proxy instead of building it;
//! `BASELINE_PROXY=path` adds an earlier build of the proxy (quiet log
//! level) as `baseline, …` configurations, for before/after comparisons
//! within one run. Under `cargo test` it does nothing.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "proxy_peers/plot.rs"]
mod plot;

fn main() {
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("proxy_peers: run it with `cargo bench --bench proxy_peers`");
        return;
    }
    if let Err(error) = run() {
        eprintln!("proxy_peers: {error}");
        std::process::exit(1);
    }
}

/// One configuration: a name, where to send the load and how.
struct Target {
    name: &'static str,
    addr: SocketAddr,
    /// The serving process, whose CPU time per request is reported.
    pid: Option<u32>,
    path: String,
    keys: Keys,
}

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// No key (passthrough, nginx).
    None,
    /// A new key every request: first executions.
    Fresh,
    /// One key, completed before the load: replays.
    Replay,
}

/// What `wrk` reported for one cell.
#[derive(Clone, Copy)]
pub struct Stats {
    pub rps: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub requests: u64,
    pub errors: u64,
    /// CPU time (user + system, all threads) the serving process spent
    /// per request; unlike requests/s, other processes waiting for the
    /// cores do not change it much.
    pub cpu: Option<Duration>,
}

/// A process this bench started; killed on drop.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run() -> Result<(), String> {
    let seconds: u64 = env_or("LOAD_SECONDS", 4);
    let concurrencies: Vec<usize> = std::env::var("CONCURRENCY")
        .unwrap_or_else(|_| "1,8,64,256".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let Some(wrk) = tool("WRK", "wrk") else {
        println!("proxy_peers: `wrk` is not installed (apt-get install wrk); nothing measured.");
        return Ok(());
    };
    let proxy_exe = build_proxy()?;
    let dir = std::env::temp_dir().join(format!("proxy_peers_{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = measure(&dir, &wrk, &proxy_exe, seconds, &concurrencies);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(
    dir: &Path,
    wrk: &Path,
    proxy_exe: &Path,
    seconds: u64,
    concurrencies: &[usize],
) -> Result<(), String> {
    let mut notes = Vec::new();
    let mut processes = Vec::new();
    let nginx = tool("NGINX", "nginx");
    let backend = match &nginx {
        Some(nginx) => {
            let (process, addr) = start_nginx(nginx, dir, "backend", None)?;
            processes.push(process);
            addr
        }
        None => {
            notes.push("nginx is not installed: the backend is an in-process axum server (201 + small JSON), and nginx as a reverse proxy is not measured.".to_string());
            start_axum_backend()?
        }
    };
    let backend_pid = processes.first().map(|p: &Process| p.0.id());
    let mut targets = vec![Target {
        name: "backend directly",
        addr: backend,
        pid: backend_pid,
        path: "/orders".into(),
        keys: Keys::None,
    }];
    if let Some(nginx) = &nginx {
        let (process, addr) = start_nginx(nginx, dir, "proxy", Some(backend))?;
        let pid = Some(process.0.id());
        processes.push(process);
        targets.push(Target {
            name: "nginx as a reverse proxy",
            addr,
            pid,
            path: "/orders".into(),
            keys: Keys::None,
        });
    }
    let baseline = std::env::var_os("BASELINE_PROXY").map(PathBuf::from);
    let proxies = [
        (proxy_exe, true, "idempotency-proxy, ", ""),
        (
            proxy_exe,
            false,
            "idempotency-proxy, ",
            " (default log level)",
        ),
    ];
    let baseline = baseline.as_deref().map(|exe| (exe, true, "baseline, ", ""));
    for (exe, quiet, prefix, suffix) in proxies.into_iter().chain(baseline) {
        let name = |what: &str| -> &'static str {
            Box::leak(format!("{prefix}{what}{suffix}").into_boxed_str())
        };
        if !selected(name("passthrough"))
            && !selected(name("first execution"))
            && !selected(name("replay"))
        {
            continue;
        }
        let (process, addr) = start_proxy(exe, dir, backend, quiet)?;
        let pid = Some(process.0.id());
        processes.push(process);
        targets.push(Target {
            name: name("passthrough"),
            addr,
            pid,
            path: "/plain/orders".into(),
            keys: Keys::None,
        });
        targets.push(Target {
            name: name("first execution"),
            addr,
            pid,
            path: "/fresh/orders".into(),
            keys: Keys::Fresh,
        });
        targets.push(Target {
            name: name("replay"),
            addr,
            pid,
            path: "/orders".into(),
            keys: Keys::Replay,
        });
    }
    match tool("PEER", "idempotent-proxy-server") {
        Some(peer) => {
            for (quiet, suffix) in [(true, ""), (false, " (default log level)")] {
                let (process, addr) = start_peer(&peer, dir, backend, quiet)?;
                let pid = Some(process.0.id());
                processes.push(process);
                let name = |what: &str| -> &'static str {
                    Box::leak(format!("peer, {what}{suffix}").into_boxed_str())
                };
                targets.push(Target {
                    name: name("first execution"),
                    addr,
                    pid,
                    path: "/URL_ORDERS".into(),
                    keys: Keys::Fresh,
                });
                targets.push(Target {
                    name: name("replay"),
                    addr,
                    pid,
                    path: "/URL_ORDERS".into(),
                    keys: Keys::Replay,
                });
            }
        }
        None => notes.push(
            "idempotent-proxy-server is not installed (`cargo install idempotent-proxy-server --root tools`): its columns are skipped."
                .to_string(),
        ),
    }

    targets.retain(|target| selected(target.name));
    let body = common::json_body(1024, 7);
    let body = String::from_utf8(body).map_err(|e| e.to_string())?;
    // Every replay target's key is completed, and checked to replay,
    // before any load.
    for target in &targets {
        if target.keys == Keys::Replay {
            let first = post(target.addr, &target.path, Some("replayed-key"), &body)?;
            let again = post(target.addr, &target.path, Some("replayed-key"), &body)?;
            if first.0 != 201 || again.0 != 201 {
                return Err(format!(
                    "{}: a replayed key answered {} then {}, not 201",
                    target.name, first.0, again.0
                ));
            }
            if target.name.starts_with("idempotency-proxy")
                && !again
                    .1
                    .to_ascii_lowercase()
                    .contains("idempotent-replayed: true")
            {
                return Err(format!(
                    "{}: the second answer is not a replay",
                    target.name
                ));
            }
        }
    }
    let scripts = Scripts::write(dir, &body)?;
    // A short warm-up of every target (connection pools, allocators).
    for target in &targets {
        let _ = wrk_cell(wrk, &scripts, target, 16, 1, "warmup");
    }
    let load = uptime();
    let rounds: usize = env_or("ROUNDS", 1).max(1);
    let mut runs: Vec<(usize, &'static str, Result<Stats, String>)> = Vec::new();
    for pass in 0..rounds {
        for (round, &concurrency) in concurrencies.iter().enumerate() {
            for (index, target) in targets.iter().enumerate() {
                let tag = format!("p{pass}r{round}t{index}");
                let stats = wrk_cell(wrk, &scripts, target, concurrency, seconds, &tag);
                runs.push((concurrency, target.name, stats));
            }
        }
    }
    drop(processes);
    let cells = medians(runs, rounds);
    if rounds > 1 {
        notes.push(format!(
            "Each cell is the median of {rounds} passes by requests/s (the passes interleaved)."
        ));
    }
    report(&cells, concurrencies, seconds, &load, &uptime(), &notes);
    let plot_path = std::env::var("PLOT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/bench/proxy_peers.svg")
        });
    let names: Vec<&str> = targets.iter().map(|t| t.name).collect();
    match plot::write(&plot_path, &names, concurrencies, &cells) {
        Ok(()) => println!("\nPlot: {}", plot_path.display()),
        Err(error) => println!("\nPlot not written: {error}"),
    }
    Ok(())
}

/// Of each cell measured `rounds` times (every pass over all cells in
/// the same order), the measurement with the median requests/s, whole (its
/// latencies and CPU time with it); an error only when every pass failed.
fn medians(
    runs: Vec<(usize, &'static str, Result<Stats, String>)>,
    rounds: usize,
) -> Vec<(usize, &'static str, Result<Stats, String>)> {
    let cells = runs.len() / rounds;
    (0..cells)
        .map(|cell| {
            let (concurrency, name, _) = &runs[cell];
            let mut measured: Vec<Stats> = (0..rounds)
                .filter_map(|pass| runs[pass * cells + cell].2.as_ref().ok().copied())
                .collect();
            measured.sort_by(|a, b| a.rps.total_cmp(&b.rps));
            let median = match measured.get(measured.len() / 2) {
                Some(stats) => Ok(*stats),
                None => runs[cell].2.clone(),
            };
            (*concurrency, *name, median)
        })
        .collect()
}

/// Whether `TARGETS` (name fragments; `!fragment` excludes) selects the
/// configuration `name`; everything without it.
fn selected(name: &str) -> bool {
    let Ok(filter) = std::env::var("TARGETS") else {
        return true;
    };
    let fragments: Vec<&str> = filter
        .split(',')
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .collect();
    let excluded = fragments
        .iter()
        .filter_map(|f| f.strip_prefix('!'))
        .any(|f| name.contains(f));
    let mut included = fragments.iter().filter(|f| !f.starts_with('!')).peekable();
    !excluded && (included.peek().is_none() || included.any(|f| name.contains(f)))
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// An executable named by `$var`, or `name` on the `PATH`, in `/usr/sbin`,
/// or in the repository's `tools/bin`.
fn tool(var: &str, name: &str) -> Option<PathBuf> {
    if let Ok(path) = std::env::var(var) {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([
            PathBuf::from("/usr/sbin"),
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/bin"),
        ])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Builds the proxy in release mode next to this bench and returns its
/// path; `PROXY=path` names a binary built already instead.
fn build_proxy() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("PROXY") {
        return Ok(PathBuf::from(path));
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("proxy_peers: building idempotency-proxy (release)…");
    let status = Command::new(cargo)
        .args(["build", "--release", "-p", "idempotency-proxy"])
        .status()
        .map_err(|e| format!("cargo build: {e}"))?;
    if !status.success() {
        return Err("building idempotency-proxy failed".into());
    }
    // This bench runs from <target>/release/deps/.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let release = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("cannot locate the target directory")?;
    Ok(release.join("idempotency-proxy"))
}

fn free_port() -> Result<SocketAddr, String> {
    let probe = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    probe.local_addr().map_err(|e| e.to_string())
}

/// Waits until `addr` accepts connections, or the process exits.
fn wait_listening(child: &mut Child, addr: SocketAddr, log: &Path) -> Result<(), String> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            return Err(format!("exited ({status}): {}", log.trim()));
        }
        if TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("nothing listened on {addr} within 30 s"))
}

fn spawn(mut command: Command, addr: SocketAddr, log: &Path) -> Result<Process, String> {
    let file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    command
        .stdin(Stdio::null())
        .stdout(file.try_clone().map_err(|e| e.to_string())?)
        .stderr(file);
    let child = command
        .spawn()
        .map_err(|e| format!("{:?}: {e}", command.get_program()))?;
    let mut process = Process(child);
    wait_listening(&mut process.0, addr, log)
        .map_err(|e| format!("{:?}: {e}", command.get_program()))?;
    Ok(process)
}

/// nginx with one worker: answering a fixed 201 (`upstream` `None`), or
/// as a reverse proxy to `upstream` with a keep-alive pool.
fn start_nginx(
    nginx: &Path,
    dir: &Path,
    name: &str,
    upstream: Option<SocketAddr>,
) -> Result<(Process, SocketAddr), String> {
    let addr = free_port()?;
    let prefix = dir.join(format!("nginx_{name}"));
    std::fs::create_dir_all(&prefix).map_err(|e| e.to_string())?;
    let (location, upstream_block) = match upstream {
        None => (
            "return 201 '{\"id\":1,\"received\":true}';".to_string(),
            String::new(),
        ),
        Some(upstream) => (
            "proxy_pass http://backend; proxy_http_version 1.1; \
             proxy_set_header Connection \"\";"
                .to_string(),
            format!(
                "upstream backend {{ server {upstream}; keepalive 64; \
                 keepalive_requests 1000000; }}\n"
            ),
        ),
    };
    // One process (no master): one worker, and killing it stops it all.
    let conf = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {p}/nginx.pid;\n\
         error_log {p}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\naccess_log off;\nkeepalive_requests 1000000;\n\
         client_body_temp_path {p}; proxy_temp_path {p}; fastcgi_temp_path {p};\n\
         uwsgi_temp_path {p}; scgi_temp_path {p};\n\
         default_type application/json;\n{upstream_block}\
         server {{ listen {addr}; location / {{ {location} }} }}\n}}\n",
        p = prefix.display(),
    );
    let conf_path = prefix.join("nginx.conf");
    std::fs::write(&conf_path, conf).map_err(|e| e.to_string())?;
    let mut command = Command::new(nginx);
    command
        .arg("-p")
        .arg(&prefix)
        .arg("-c")
        .arg(&conf_path)
        .arg("-e")
        .arg(prefix.join("error.log"));
    let process = spawn(command, addr, &prefix.join("stderr.log"))?;
    Ok((process, addr))
}

/// The in-process backend when nginx is missing: 201 + a small JSON.
fn start_axum_backend() -> Result<SocketAddr, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("backend runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            let app = axum::Router::new().fallback(|| async {
                (
                    http::StatusCode::CREATED,
                    [(http::header::CONTENT_TYPE, "application/json")],
                    "{\"id\":1,\"received\":true}",
                )
            });
            axum::serve(listener, app).await.expect("backend");
        });
    });
    Ok(addr)
}

/// `idempotency-proxy` with the memory store: `/orders` and `/fresh`
/// covered (the default policy: `Idempotency-Key` header), `/plain/**`
/// passthrough. First executions go to `/fresh`, whose records expire
/// after 3 s, so a run never fills the memory store (100,000 records).
fn start_proxy(
    exe: &Path,
    dir: &Path,
    upstream: SocketAddr,
    quiet: bool,
) -> Result<(Process, SocketAddr), String> {
    let addr = free_port()?;
    let name = if quiet {
        "proxy_quiet"
    } else {
        "proxy_default"
    };
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        "[proxy]\nsweep_interval = \"1h\"\n\n\
         [[route]]\npath = \"/plain/**\"\nenabled = false\n\n\
         [[route]]\npath = \"/orders\"\n\n\
         [[route]]\npath = \"/fresh\"\nlease = \"2s\"\nttl = \"3s\"\n",
    )
    .map_err(|e| e.to_string())?;
    let mut command = Command::new(exe);
    command
        .args(["--listen", &addr.to_string()])
        .args(["--upstream", &format!("http://{upstream}")])
        .args(["--store", "memory", "--config"])
        .arg(&config)
        .current_dir(dir)
        .env_remove("RUST_LOG");
    if quiet {
        command.env("RUST_LOG", "warn");
    }
    let process = spawn(command, addr, &dir.join(format!("{name}.log")))?;
    Ok((process, addr))
}

/// `idempotent-proxy-server` with its memory cache: it reads `.env` from
/// its working directory and forwards `/URL_ORDERS` to `$URL_ORDERS`.
fn start_peer(
    exe: &Path,
    dir: &Path,
    upstream: SocketAddr,
    quiet: bool,
) -> Result<(Process, SocketAddr), String> {
    let addr = free_port()?;
    let home = dir.join(if quiet { "peer_quiet" } else { "peer_default" });
    std::fs::create_dir_all(&home).map_err(|e| e.to_string())?;
    let mut env = format!("SERVER_ADDR={addr}\nURL_ORDERS=http://{upstream}/orders\n");
    if quiet {
        env.push_str("LOG_LEVEL=warn\n");
    }
    std::fs::write(home.join(".env"), env).map_err(|e| e.to_string())?;
    let mut command = Command::new(exe);
    command
        .current_dir(&home)
        .env_remove("LOG_LEVEL")
        .env_remove("REDIS_URL")
        .env_remove("SERVER_ADDR");
    let process = spawn(command, addr, &home.join("peer.log"))?;
    Ok((process, addr))
}

/// One `POST` on a fresh connection: status and response head.
fn post(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> Result<(u16, String), String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let key = key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{key}\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).into_owned();
    let head = response.split("\r\n\r\n").next().unwrap_or("").to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{addr}{path}: no HTTP answer: {response:?}"))?;
    Ok((status, head))
}

/// The `wrk` scripts: the same 1 KiB JSON body; a fixed key, or a new one
/// per request.
struct Scripts {
    none: PathBuf,
    replay: PathBuf,
    fresh: PathBuf,
}

impl Scripts {
    fn write(dir: &Path, body: &str) -> Result<Scripts, String> {
        let common = format!(
            "wrk.method = \"POST\"\nwrk.body = [==[{body}]==]\n\
             wrk.headers[\"Content-Type\"] = \"application/json\"\n"
        );
        let replay = format!("{common}wrk.headers[\"Idempotency-Key\"] = \"replayed-key\"\n");
        // Each thread numbers its requests; the run tag and the thread id
        // keep keys unique across cells and threads.
        let fresh = format!(
            "{common}local counter = 0\nlocal threads = 0\n\
             function setup(thread)\n  threads = threads + 1\n  thread:set(\"id\", threads)\nend\n\
             function request()\n  counter = counter + 1\n\
               wrk.headers[\"Idempotency-Key\"] = tag .. \"-\" .. id .. \"-\" .. counter\n\
               return wrk.format()\nend\n\
             function init(args)\n  tag = args[1]\nend\n"
        );
        let scripts = Scripts {
            none: dir.join("none.lua"),
            replay: dir.join("replay.lua"),
            fresh: dir.join("fresh.lua"),
        };
        for (path, text) in [
            (&scripts.none, &common),
            (&scripts.replay, &replay),
            (&scripts.fresh, &fresh),
        ] {
            std::fs::write(path, text).map_err(|e| e.to_string())?;
        }
        Ok(scripts)
    }
}

/// Runs `wrk` against one target and parses its report.
fn wrk_cell(
    wrk: &Path,
    scripts: &Scripts,
    target: &Target,
    concurrency: usize,
    seconds: u64,
    tag: &str,
) -> Result<Stats, String> {
    let script = match target.keys {
        Keys::None => &scripts.none,
        Keys::Replay => &scripts.replay,
        Keys::Fresh => &scripts.fresh,
    };
    let threads = concurrency.min(2);
    let url = format!("http://{}{}", target.addr, target.path);
    let cpu_before = target.pid.and_then(cpu_time);
    let output = Command::new(wrk)
        .args([
            &format!("-t{threads}"),
            &format!("-c{concurrency}"),
            &format!("-d{seconds}s"),
            "--latency",
            "--timeout",
            "10s",
            "-s",
        ])
        .arg(script)
        .arg(&url)
        .arg("--")
        .arg(format!("{tag}-{}", std::process::id()))
        .output()
        .map_err(|e| format!("wrk: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "wrk failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let mut stats = parse_wrk(&text).ok_or_else(|| format!("unexpected wrk output: {text}"))?;
    if let (Some(before), Some(after)) = (cpu_before, target.pid.and_then(cpu_time)) {
        stats.cpu = Some(after.saturating_sub(before) / stats.requests.max(1) as u32);
    }
    Ok(stats)
}

/// The CPU time (user + system) process `pid` has used, from
/// `/proc/PID/stat` (Linux; `None` elsewhere).
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (in parentheses): utime and stime
    // are the 12th and 13th, in clock ticks.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| Duration::from_secs_f64(ticks as f64 / per_second as f64))
}

fn parse_wrk(text: &str) -> Option<Stats> {
    let duration = |s: &str| -> Option<Duration> {
        let (number, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic())?);
        let number: f64 = number.parse().ok()?;
        let seconds = match unit {
            "us" => number / 1e6,
            "ms" => number / 1e3,
            "s" => number,
            "m" => number * 60.0,
            _ => return None,
        };
        Some(Duration::from_secs_f64(seconds))
    };
    let mut stats = Stats {
        rps: 0.0,
        p50: Duration::ZERO,
        p99: Duration::ZERO,
        requests: 0,
        errors: 0,
        cpu: None,
    };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Requests/sec:", rps] => stats.rps = rps.parse().ok()?,
            ["50%", p50] => stats.p50 = duration(p50)?,
            ["99%", p99] => stats.p99 = duration(p99)?,
            [n, "requests", "in", ..] => stats.requests = n.parse().ok()?,
            ["Non-2xx", "or", "3xx", "responses:", n] => stats.errors += n.parse::<u64>().ok()?,
            ["Socket", "errors:", rest @ ..] => {
                stats.errors += rest
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>();
            }
            _ => {}
        }
    }
    (stats.rps > 0.0).then_some(stats)
}

fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

type Cells = [(usize, &'static str, Result<Stats, String>)];

fn report(
    cells: &Cells,
    concurrencies: &[usize],
    seconds: u64,
    load_before: &str,
    load_after: &str,
    notes: &[String],
) {
    let get = |concurrency: usize, name: &str| {
        cells
            .iter()
            .find(|(c, n, _)| *c == concurrency && *n == name)
            .and_then(|(_, _, s)| s.as_ref().ok().copied())
    };
    println!(
        "\n### Against nginx and the peer (`wrk`, {seconds} s per cell, 1 KiB JSON POST, loopback)\n"
    );
    println!("Load average before / after the run: {load_before} / {load_after}.\n");
    for note in notes {
        println!("{note}\n");
    }
    for &concurrency in concurrencies {
        println!("\n#### Concurrency {concurrency}\n");
        println!("| configuration | requests/s | p50 | p99 | CPU per request | errors |");
        println!("|---|---:|---:|---:|---:|---:|");
        for (c, name, outcome) in cells {
            if *c != concurrency {
                continue;
            }
            match outcome {
                Ok(s) => println!(
                    "| {name} | {:.0} | {} | {} | {} | {}/{} |",
                    s.rps,
                    us(s.p50),
                    us(s.p99),
                    s.cpu.map_or("—".into(), |cpu| format!(
                        "{:.1} µs",
                        cpu.as_secs_f64() * 1e6
                    )),
                    s.errors,
                    s.requests
                ),
                Err(error) => println!("| {name} | — | — | — | — | not run: {error} |"),
            }
        }
    }
    println!("\n### Targets (ratios within this run)\n");
    println!(
        "The status follows the requests/s (or p50) ratio. \"As CPU\" is the same comparison \
         from each process's CPU time per request (theirs ÷ ours: what the requests/s ratio \
         would be if both were bound by their own CPU), which moves less when other processes \
         load the machine.\n"
    );
    println!("| target | measured | as CPU | status |\n|---|---:|---:|---|");
    // `a` against `b`: a ratio of requests/s (or of p50 when `latency`),
    // and b's CPU per request over a's.
    let line = |what: &str,
                a: Option<Stats>,
                b: Option<Stats>,
                latency: bool,
                goal: &dyn Fn(f64) -> bool| {
        let measured = match (a, b) {
            (Some(a), Some(b)) if latency => Some(a.p50.as_secs_f64() / b.p50.as_secs_f64()),
            (Some(a), Some(b)) => Some(a.rps / b.rps),
            _ => None,
        };
        let cpu = match (a.and_then(|a| a.cpu), b.and_then(|b| b.cpu)) {
            (Some(a), Some(b)) if !latency && !a.is_zero() => {
                format!("{:.2}×", b.as_secs_f64() / a.as_secs_f64())
            }
            _ => "—".into(),
        };
        match measured {
            Some(r) => println!(
                "| {what} | {r:.2}× | {cpu} | {} |",
                if goal(r) { "met" } else { "missed" }
            ),
            None => println!("| {what} | not measured | — | — |"),
        }
    };
    let ours = |what: &str| get(64, &format!("idempotency-proxy, {what}"));
    line(
        "replay requests/s at 64 ≥ 1.3× the peer's (both quiet)",
        ours("replay"),
        get(64, "peer, replay"),
        false,
        &|r| r >= 1.3,
    );
    line(
        "replay p50 at 1 ≤ the peer's (both quiet; ours ÷ the peer's)",
        get(1, "idempotency-proxy, replay"),
        get(1, "peer, replay"),
        true,
        &|r| r <= 1.0,
    );
    line(
        "replay requests/s at 64 ahead of the peer's, both at default log levels",
        ours("replay (default log level)"),
        get(64, "peer, replay (default log level)"),
        false,
        &|r| r > 1.0,
    );
    line(
        "passthrough requests/s at 64 ≥ 0.9× nginx as a reverse proxy",
        ours("passthrough"),
        get(64, "nginx as a reverse proxy"),
        false,
        &|r| r >= 0.9,
    );
    line(
        "first execution requests/s at 64 ≥ 0.9× passthrough (memory store)",
        ours("first execution"),
        ours("passthrough"),
        false,
        &|r| r >= 0.9,
    );
    line(
        "first execution requests/s at 64 against the peer's (both quiet)",
        ours("first execution"),
        get(64, "peer, first execution"),
        false,
        &|r| r > 1.0,
    );
    for what in ["first execution", "replay", "passthrough"] {
        let baseline = get(64, &format!("baseline, {what}"));
        if baseline.is_some() {
            line(
                &format!("{what} requests/s at 64, this build ÷ the baseline build"),
                ours(what),
                baseline,
                false,
                &|r| r >= 1.0,
            );
        }
    }
    line(
        "the decision log line: replay requests/s at 64, default ÷ quiet log level",
        ours("replay (default log level)"),
        ours("replay"),
        false,
        &|r| r >= 0.9,
    );
}
