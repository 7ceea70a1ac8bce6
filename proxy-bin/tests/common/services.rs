//! Private PostgreSQL and Redis servers that a fault test may stop, kill and
//! restart without touching the shared instances other tests use.
//!
//! PostgreSQL: a throwaway cluster (`initdb` in a temporary directory,
//! trust auth, its own port), run as the `postgres` user via `runuser` when
//! the tests run as root (as in CI). Redis: `redis-server` on its own port
//! with persistence off and RDB compression off (so a `SAVE` dump can be
//! searched byte for byte).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, temp_dir};

/// Polls until something accepts connections on `port` (readiness, not a
/// timing assertion: gives up after a minute).
pub fn wait_for_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls until `child` itself listens on `addr` (true), or exits first
/// (false). Another test's listener on a port picked free does not count.
/// Readiness, not a timing assertion: gives up after a minute.
pub fn wait_listening(child: &mut Child, addr: std::net::SocketAddr) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !super::listens(child.id(), addr) {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        assert!(
            Instant::now() < deadline,
            "nothing of ours listens on {addr}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn check(what: &str, output: std::io::Result<Output>) -> Output {
    let output = output.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// A PostgreSQL cluster of its own.
pub struct PrivatePostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    /// Creates and starts a fresh cluster on a free port. A port picked
    /// free may be taken by another test before the server binds it; the
    /// server then fails to start, and is started on another.
    pub fn start() -> Self {
        let bin = postgres_bin();
        let dir = temp_dir("pg").keep();
        let as_root = is_root();
        if as_root {
            check(
                "chown",
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&dir)
                    .output(),
            );
        }
        let mut postgres = PrivatePostgres {
            bin,
            dir,
            port: free_port().port(),
        };
        let data = postgres.data();
        postgres.run(
            "initdb",
            &["-A", "trust", "-U", "postgres", "--no-sync", "-D", &data],
        );
        for _ in 0..5 {
            if postgres.try_start().status.success() {
                return postgres;
            }
            postgres.port = free_port().port();
        }
        panic!("postgres failed to start five times");
    }

    /// `postgres://…` for the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once (`immediate`: like a crash, connections cut).
    pub fn stop(&self) {
        self.run(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
    }

    /// Starts the (stopped) server again on the same port and data.
    pub fn start_again(&self) {
        let output = self.try_start();
        assert!(
            output.status.success(),
            "pg_ctl start on {} failed: {}{}",
            self.port,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// `pg_ctl -w start` on the cluster's port: its output, success or not
    /// (a port another test took makes the server exit at start). `-w`
    /// waits until this server accepts connections, so another listener on
    /// the port is never taken for it.
    fn try_start(&self) -> Output {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log");
        self.command("pg_ctl")
            .args(["-D", &self.data(), "-o", &options, "-l"])
            .arg(&log)
            .args(["-w", "start"])
            .output()
            .expect("pg_ctl")
    }

    /// The whole database as SQL text (`pg_dump`), to search for leaks.
    pub fn dump(&self) -> String {
        let port = self.port.to_string();
        let output = self.run(
            "pg_dump",
            &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", "postgres"],
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn data(&self) -> String {
        self.dir.join("data").to_str().unwrap().to_owned()
    }

    fn run(&self, program: &str, args: &[&str]) -> Output {
        check(program, self.command(program).args(args).output())
    }

    /// `program` from the server's binaries, run as `postgres` when the
    /// tests run as root, in the cluster's directory.
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut command = if is_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(&program);
            command
        } else {
            Command::new(&program)
        };
        command.current_dir(&self.dir).stdin(Stdio::null());
        command
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.data();
        let _ = std::panic::catch_unwind(|| {
            self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
        });
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// The newest `/usr/lib/postgresql/<version>/bin`, or `$PG_BIN`.
fn postgres_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("PG_BIN") {
        return bin.into();
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql (or set PG_BIN)")
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL version").1
}

/// A Redis server of its own.
pub struct PrivateRedis {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl PrivateRedis {
    /// Starts `redis-server` on a free port. A port picked free may be
    /// taken by another test before Redis binds it; Redis then exits at
    /// once, and is started on another.
    pub fn start() -> Self {
        let mut redis = PrivateRedis {
            dir: temp_dir("redis").keep(),
            port: free_port().port(),
            child: None,
        };
        for _ in 0..5 {
            if redis.try_start() {
                return redis;
            }
            redis.port = free_port().port();
        }
        panic!("redis-server exited at start five times");
    }

    /// `redis://…` for it.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: no shutdown, every key gone (persistence is off).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn start_again(&mut self) {
        assert!(
            self.try_start(),
            "redis-server exited at start on {}",
            self.port
        );
    }

    /// Starts it on its port and waits until this process listens there
    /// (not merely something: another test's listener may hold a port
    /// picked free); false when it exited first.
    fn try_start(&mut self) -> bool {
        assert!(self.child.is_none(), "already running");
        let port = self.port.to_string();
        let child = Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--rdbcompression", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server");
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let child = self.child.insert(child);
        if wait_listening(child, addr) {
            return true;
        }
        self.child = None;
        false
    }

    /// Every byte Redis holds (an uncompressed RDB snapshot), to search for
    /// leaks.
    pub fn dump(&self) -> Vec<u8> {
        let port = self.port.to_string();
        check(
            "redis-cli SAVE",
            Command::new("redis-cli")
                .args(["-p", &port, "SAVE"])
                .output(),
        );
        std::fs::read(self.dir.join("dump.rdb")).unwrap()
    }

    /// How many keys it holds.
    pub fn key_count(&self) -> usize {
        let port = self.port.to_string();
        let output = check(
            "redis-cli DBSIZE",
            Command::new("redis-cli")
                .args(["-p", &port, "DBSIZE"])
                .output(),
        );
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The resident set size of process `pid`, in KiB (`VmRSS` in
/// `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> u64 {
    let status =
        std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}
