//! Outbox counters: plain atomics, rendered in the Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// One monotonically increasing count.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn inc(&self) {
        self.add(1);
    }

    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Relaxed);
    }

    fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// What this process's [`Outbox`](super::Outbox) handle (and its clones and
/// workers) did since it was made. Counts in the table itself (which other
/// processes share) come from [`Outbox::counts`](super::Outbox::counts).
#[derive(Debug, Default)]
pub struct OutboxMetrics {
    pub(crate) enqueued: Counter,
    pub(crate) claimed: Counter,
    pub(crate) delivered: Counter,
    pub(crate) retried: Counter,
    pub(crate) dead: Counter,
    pub(crate) rescued: Counter,
    pub(crate) lost_leases: Counter,
}

impl OutboxMetrics {
    /// Rows added through [`Outbox::enqueue`](super::Outbox::enqueue) (the
    /// free [`enqueue`](super::enqueue) runs in the caller's transaction and
    /// is not counted: it may roll back).
    pub fn enqueued(&self) -> u64 {
        self.enqueued.get()
    }

    /// Rows claimed (attempts started).
    pub fn claimed(&self) -> u64 {
        self.claimed.get()
    }

    /// Rows marked delivered.
    pub fn delivered(&self) -> u64 {
        self.delivered.get()
    }

    /// Failed attempts scheduled for a retry.
    pub fn retried(&self) -> u64 {
        self.retried.get()
    }

    /// Rows sent to `dead` by a failed attempt.
    pub fn dead(&self) -> u64 {
        self.dead.get()
    }

    /// Rows whose expired lease was re-queued by this process's rescuer.
    pub fn rescued(&self) -> u64 {
        self.rescued.get()
    }

    /// Completions and failures refused because the row's lease had been
    /// taken over (the worker was too slow; another delivers it).
    pub fn lost_leases(&self) -> u64 {
        self.lost_leases.get()
    }

    /// The counters in the Prometheus text format, each named
    /// `outbox_<name>_total`.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::new();
        for (name, help, value) in [
            ("enqueued", "Rows enqueued.", self.enqueued()),
            ("claimed", "Delivery attempts started.", self.claimed()),
            ("delivered", "Rows delivered.", self.delivered()),
            (
                "retried",
                "Failed attempts scheduled for a retry.",
                self.retried(),
            ),
            (
                "dead",
                "Rows sent to dead by a failed attempt.",
                self.dead(),
            ),
            ("rescued", "Expired leases re-queued.", self.rescued()),
            (
                "lost_leases",
                "Outcomes refused after a lease takeover.",
                self.lost_leases(),
            ),
        ] {
            let _ = writeln!(out, "# HELP outbox_{name}_total {help}");
            let _ = writeln!(out, "# TYPE outbox_{name}_total counter");
            let _ = writeln!(out, "outbox_{name}_total {value}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::OutboxMetrics;

    #[test]
    fn renders_every_counter() {
        let metrics = OutboxMetrics::default();
        metrics.delivered.add(3);
        metrics.dead.inc();
        let text = metrics.render_prometheus();
        assert!(text.contains("outbox_delivered_total 3\n"), "{text}");
        assert!(text.contains("outbox_dead_total 1\n"), "{text}");
        assert!(text.contains("outbox_enqueued_total 0\n"), "{text}");
        assert_eq!(text.matches("# TYPE").count(), 7);
    }
}
