//! The log: lines formatted on the request's thread, written to stderr in
//! batches by a thread of their own.
//!
//! Each engine decision is one line (see docs/proxy.md). Written with a
//! system call per line on the request's thread, that line cost a replay
//! about a fifth of its throughput; handed to a writer thread line by line
//! (a channel that wakes it for each), it cost as much again. Here a line
//! is appended to a shared buffer under a lock, and the writer thread
//! writes what has gathered every [`INTERVAL`] in one `write`, or at once
//! when [`EAGER`] bytes are waiting. A request never waits for stderr:
//! past [`CAP`] bytes waiting (stderr's reader fell behind, or stopped: a
//! log driver whose destination is down blocks every write), new lines
//! are dropped and counted, and the count is written as a line of its own
//! once the writer gets through. (Written by the requests' own threads, a
//! stalled stderr blocked every worker, lease renewals with them, so a
//! duplicate could take a live request's key over, and SIGTERM, whose
//! handler logs first, was never acted on.) Every exit path calls
//! [`flush`], which waits for the writer at most [`FLUSH_WAIT`] (the
//! drained shutdown exits the process itself); a crash may lose up to
//! [`INTERVAL`] of lines.

use std::io::{IsTerminal, Write};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the writer thread writes what has gathered.
const INTERVAL: Duration = Duration::from_millis(20);
/// Waiting bytes that wake the writer thread before its interval.
const EAGER: usize = 64 * 1024;
/// Waiting bytes past which new lines are dropped (and counted).
const CAP: usize = 4 * 1024 * 1024;
/// The longest [`flush`] waits for the writer thread.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// The default filter: our lines at `info`, Pingora's at `warn`.
const DEFAULT_FILTER: &str = "info,pingora_core=warn,pingora_proxy=warn";

struct Pending {
    bytes: Vec<u8>,
    /// Lines dropped since the writer last took a batch.
    dropped: u64,
    /// Set by [`flush`]: the writer thread writes what is left and stops.
    closing: bool,
    /// Set by the writer thread with its last batch taken: lines are
    /// written through from then on.
    stopped: bool,
}

static PENDING: Mutex<Pending> = Mutex::new(Pending {
    bytes: Vec::new(),
    dropped: 0,
    closing: false,
    stopped: false,
});
static WAKE: Condvar = Condvar::new();
static WRITER: Mutex<Option<JoinHandle<()>>> = Mutex::new(None);
/// Set once the writer thread started ([`init`]).
static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn pending() -> MutexGuard<'static, Pending> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// One logging thread's handle on the shared buffer.
struct Batched;

impl Write for Batched {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut pending = pending();
        if pending.stopped {
            drop(pending);
            return std::io::stderr().write_all(line).map(|()| line.len());
        }
        if pending.bytes.len() + line.len() > CAP {
            pending.dropped += 1;
            return Ok(line.len());
        }
        pending.bytes.extend_from_slice(line);
        if pending.bytes.len() >= EAGER {
            WAKE.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs the subscriber: filter from `RUST_LOG` (else
/// [`DEFAULT_FILTER`]), lines to stderr through the writer thread.
pub fn init() {
    let ansi = std::io::stderr().is_terminal();
    let writer = std::thread::Builder::new()
        .name("idempotency-log".into())
        .spawn(write_batches)
        .expect("the log writer thread starts");
    *WRITER.lock().unwrap_or_else(|e| e.into_inner()) = Some(writer);
    STARTED.store(true, std::sync::atomic::Ordering::SeqCst);
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| DEFAULT_FILTER.into());
    use tracing_subscriber::util::SubscriberInitExt;
    subscriber(filter, || Batched, ansi).init();
}

/// Lines written by `writer`, filtered by `filter` (`RUST_LOG`'s
/// directives) and the [`caps`] together, as one filter of the one layer:
/// a layer without a filter of its own (the caps used to be one) makes the
/// registry build every span any layer could want, so every request paid
/// for `info` spans at `RUST_LOG=warn`.
fn subscriber<W>(
    filter: tracing_subscriber::EnvFilter,
    writer: W,
    ansi: bool,
) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::filter::FilterExt;
    use tracing_subscriber::layer::{Layer as _, SubscriberExt};
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi)
        .with_filter(filter.and(caps()));
    tracing_subscriber::registry().with(lines)
}

/// Pingora's modules that print whole request and response heads at debug
/// and trace (`Idempotency-Key`, `Authorization`, the operator's bearer
/// token, `Set-Cookie`).
const HEAD_PRINTING: [&str; 3] = [
    "pingora_core::protocols",
    "pingora_core::apps",
    "pingora_proxy",
];

/// Pingora's HTTP server application (the admin listener's), which logs a
/// head it could not parse at `error`, raw bytes and all: an operator's
/// bearer token, a key and a principal in a `/keys` request's body.
const ERROR_PRINTING: &str = "pingora_core::apps::http_app";

/// A filter of its own beside `RUST_LOG`'s, so no directive there (however
/// specific) loosens it: [`HEAD_PRINTING`] at `info` at most and
/// [`ERROR_PRINTING`] off, so no log line ever carries a key or a
/// credential; everything else as `RUST_LOG` says.
fn caps() -> tracing_subscriber::filter::Targets {
    use tracing_subscriber::filter::LevelFilter;
    HEAD_PRINTING
        .into_iter()
        .fold(
            tracing_subscriber::filter::Targets::new().with_default(LevelFilter::TRACE),
            |caps, target| caps.with_target(target, LevelFilter::INFO),
        )
        .with_target(ERROR_PRINTING, LevelFilter::OFF)
}

/// A Pingora error as a log line may show it. Pingora puts the raw bytes of
/// a head it could not parse in the error's context (`buf: …`): a client's
/// `Authorization`, an upstream's `Set-Cookie`, a key, the start of a body.
/// Those bytes are left out; the error's kind, source and the rest of its
/// chain are kept.
pub struct Redacted<'a>(pub &'a pingora_error::Error);

impl std::fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut previous: Option<&pingora_error::Error> = None;
        let mut error = self.0;
        loop {
            if previous.is_none_or(|p| p.esource != error.esource) {
                write!(f, "{}", error.esource.as_str())?;
            }
            if previous.is_none_or(|p| p.etype != error.etype) {
                write!(f, " {}", error.etype.as_str())?;
            }
            if let Some(context) = &error.context {
                let context = context.as_str();
                match context.find("buf:") {
                    Some(at) => write!(f, " context: {}buf: (left out)", &context[..at])?,
                    None => write!(f, " context: {context}")?,
                }
            }
            let Some(cause) = &error.cause else {
                return Ok(());
            };
            match cause.downcast_ref::<pingora_error::BError>() {
                Some(inner) => {
                    write!(f, " cause: ")?;
                    previous = Some(error);
                    error = inner;
                }
                None => return write!(f, " cause: {cause}"),
            }
        }
    }
}

/// The writer thread: every [`INTERVAL`] (or when woken), takes what has
/// gathered and writes it; ends once [`flush`] stopped the log.
fn write_batches() {
    let mut batch = Vec::new();
    loop {
        let (stopped, dropped) = {
            let pending = pending();
            let (mut pending, _) = WAKE
                .wait_timeout(pending, INTERVAL)
                .unwrap_or_else(|e| e.into_inner());
            std::mem::swap(&mut batch, &mut pending.bytes);
            // The last batch is taken under the same lock that makes later
            // lines write through: none is lost, none overtakes it.
            pending.stopped = pending.closing;
            (pending.stopped, std::mem::take(&mut pending.dropped))
        };
        if dropped > 0 {
            // After the batch: the lines dropped came after its lines.
            let notice = format!(
                "WARN idempotency_proxy::logs: {dropped} log lines dropped: stderr's reader fell \
                 behind (the proxy never waits for its log)\n"
            );
            batch.extend_from_slice(notice.as_bytes());
        }
        if !batch.is_empty() {
            let _ = std::io::stderr().write_all(&batch);
            batch.clear();
        }
        if stopped {
            return;
        }
    }
}

/// Writes every waiting line to stderr and stops the writer thread; lines
/// logged afterwards are written directly. Call it before the process
/// exits. Waits at most [`FLUSH_WAIT`]: a stderr nobody reads would hold
/// the exit for good.
pub fn flush() {
    let writer = WRITER.lock().unwrap_or_else(|e| e.into_inner()).take();
    let Some(writer) = writer else {
        if !STARTED.load(std::sync::atomic::Ordering::SeqCst) {
            pending().stopped = true;
            return;
        }
        // Another flush has the writer (SIGINT during the drain's exit):
        // wait for its last batch as it does, or lines would be lost.
        wait_at_most(FLUSH_WAIT, || pending().stopped);
        return;
    };
    pending().closing = true;
    WAKE.notify_one();
    if wait_at_most(FLUSH_WAIT, || writer.is_finished()) {
        let _ = writer.join();
    }
}

/// Polls `done` until it holds or `limit` has passed; whether it holds.
fn wait_at_most(limit: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while !done() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    done()
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::EnvFilter;

    /// The proxy's own subscriber over `directives`, writing nowhere.
    fn subscriber(directives: &str) -> impl tracing::Subscriber + Send + Sync {
        super::subscriber(EnvFilter::new(directives), std::io::sink, false)
    }

    /// Runs `f` with [`subscriber`]`(directives)` as this thread's default,
    /// one test at a time, the callsites' cached interest rebuilt for it: a
    /// test on another thread with another subscriber could otherwise
    /// leave a callsite cached as always enabled.
    fn with_subscriber(directives: &str, f: impl FnOnce()) {
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        tracing::subscriber::with_default(subscriber(directives), || {
            tracing::callsite::rebuild_interest_cache();
            f()
        });
    }

    /// Even `RUST_LOG=trace`, or a directive naming the module itself,
    /// keeps Pingora's head-printing modules at info.
    #[test]
    fn pingora_heads_are_never_logged_below_info() {
        for directives in [
            "trace",
            "pingora_core::protocols::http=trace,pingora_proxy=trace",
        ] {
            with_subscriber(directives, || {
                assert!(
                    !tracing::enabled!(target: "pingora_core::protocols::http::v1::client", tracing::Level::DEBUG),
                    "{directives}"
                );
                assert!(
                    !tracing::enabled!(target: "pingora_core::apps::http_app", tracing::Level::TRACE),
                    "{directives}"
                );
                assert!(
                    !tracing::enabled!(target: "pingora_proxy::proxy_h1", tracing::Level::DEBUG),
                    "{directives}"
                );
                assert!(
                    tracing::enabled!(target: "pingora_core::protocols::http::v1::client", tracing::Level::INFO)
                );
            });
        }
        with_subscriber("trace", || {
            assert!(tracing::enabled!(target: "idempotency_proxy", tracing::Level::TRACE));
        });
    }

    /// At a quiet level, the spans each request opens (`info`) are not
    /// built at all: a disabled span costs nothing to enter, an enabled
    /// one a registry slot and a stack push on every poll.
    #[test]
    fn spans_below_the_level_are_disabled() {
        with_subscriber("warn", || {
            assert!(tracing::info_span!("request").is_disabled());
            assert!(tracing::info_span!(target: "tower_idempotency", "idempotency").is_disabled());
            assert!(!tracing::warn_span!("kept").is_disabled());
        });
        with_subscriber("info", || {
            assert!(!tracing::info_span!("request").is_disabled());
        });
    }
}
