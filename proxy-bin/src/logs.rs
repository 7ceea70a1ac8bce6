//! The log: lines formatted on the request's thread, written to stderr by
//! a thread of their own.
//!
//! Each engine decision is one line (see docs/proxy.md). Written with a
//! system call per line on the request's own thread, that line cost a
//! replay about a fifth of its throughput. The writer thread takes lines
//! from a queue and writes them in batches (one `write` per batch, flushed
//! whenever the queue runs empty), so a line costs the request its
//! formatting and a queue push. Nothing is dropped: when the queue is full
//! (a log that cannot keep up), requests wait for room. Every exit path
//! calls [`flush`] (the drained shutdown exits the process itself).

use std::io::{BufWriter, IsTerminal};
use std::sync::Mutex;

use tracing_appender::non_blocking::{NonBlockingBuilder, WorkerGuard};

/// The writer thread's guard: dropping it writes what is queued.
static WRITER: Mutex<Option<WorkerGuard>> = Mutex::new(None);

/// The default filter: our lines at `info`, Pingora's at `warn`.
const DEFAULT_FILTER: &str = "info,pingora_core=warn,pingora_proxy=warn";

/// Installs the subscriber: filter from `RUST_LOG` (else
/// [`DEFAULT_FILTER`]), lines to stderr through the writer thread.
pub fn init() {
    let ansi = std::io::stderr().is_terminal();
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(false)
        .thread_name("idempotency-log")
        .finish(BufWriter::with_capacity(64 * 1024, std::io::stderr()));
    *WRITER.lock().unwrap_or_else(|e| e.into_inner()) = Some(guard);
    tracing_subscriber::fmt()
        .with_writer(writer)
        .with_ansi(ansi)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| DEFAULT_FILTER.into()),
        )
        .init();
}

/// Writes every queued line to stderr and stops the writer thread; lines
/// logged afterwards are lost. Call it before the process exits.
pub fn flush() {
    let guard = WRITER.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(guard);
}
