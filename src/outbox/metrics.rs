//! Outbox counters: plain atomics, rendered in the Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

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

/// Upper bounds of the latency buckets, in microseconds.
const BUCKETS_US: [u64; 13] = [
    1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000,
    5_000_000, 10_000_000,
];

/// A latency histogram with fixed buckets (plus `+Inf`).
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; BUCKETS_US.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        if let Some(i) = BUCKETS_US.iter().position(|&bound| us <= bound) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS_US.iter().zip(&self.buckets) {
            cumulative += bucket.load(Relaxed);
            let le = *bound as f64 / 1e6;
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_us.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {count}");
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
    pub(crate) unreadable: Counter,
    pub(crate) rescued: Counter,
    pub(crate) lost_leases: Counter,
    pub(crate) claim_latency: Histogram,
    pub(crate) delivery_latency: Histogram,
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

    /// Rows sent to `dead` by a failed attempt, or by the rescuer when the
    /// attempt whose lease ran out was their last.
    pub fn dead(&self) -> u64 {
        self.dead.get()
    }

    /// Claimed rows that could not be read back (a value of the wrong type,
    /// stored by plain SQL) and were marked `dead` unsent.
    pub fn unreadable(&self) -> u64 {
        self.unreadable.get()
    }

    /// Rows whose expired lease was re-queued by this process's rescuer
    /// (or sent to `dead`, on their last attempt; counted there too).
    pub fn rescued(&self) -> u64 {
        self.rescued.get()
    }

    /// Completions and failures refused because the row's lease had been
    /// taken over (the worker was too slow; another delivers it).
    pub fn lost_leases(&self) -> u64 {
        self.lost_leases.get()
    }

    /// The counters in the Prometheus text format, each named
    /// `outbox_<name>_total`, and two latency histograms:
    /// `outbox_claim_seconds` (one claim statement) and
    /// `outbox_delivery_seconds` (one delivery attempt, to the receiver's
    /// answer or the error).
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
                "Rows sent to dead by a failed attempt or, on their last attempt, by the rescuer.",
                self.dead(),
            ),
            (
                "unreadable",
                "Claimed rows that could not be read back, sent to dead unsent.",
                self.unreadable(),
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
        self.claim_latency.render(
            "outbox_claim_seconds",
            "Time of one claim statement.",
            &mut out,
        );
        self.delivery_latency.render(
            "outbox_delivery_seconds",
            "Time of one delivery attempt.",
            &mut out,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::OutboxMetrics;
    use std::time::Duration;

    #[test]
    fn renders_every_counter() {
        let metrics = OutboxMetrics::default();
        metrics.delivered.add(3);
        metrics.dead.inc();
        let text = metrics.render_prometheus();
        assert!(text.contains("outbox_delivered_total 3\n"), "{text}");
        assert!(text.contains("outbox_dead_total 1\n"), "{text}");
        assert!(text.contains("outbox_enqueued_total 0\n"), "{text}");
        assert_eq!(text.matches("# TYPE").count(), 10);
        metrics.delivery_latency.observe(Duration::from_millis(3));
        metrics.delivery_latency.observe(Duration::from_secs(60));
        let text = metrics.render_prometheus();
        assert!(
            text.contains("outbox_delivery_seconds_bucket{le=\"0.0025\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("outbox_delivery_seconds_bucket{le=\"0.005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("outbox_delivery_seconds_bucket{le=\"10\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("outbox_delivery_seconds_bucket{le=\"+Inf\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("outbox_delivery_seconds_count 2\n"), "{text}");
        assert!(
            text.contains("outbox_delivery_seconds_sum 60.003\n"),
            "{text}"
        );
        assert!(text.contains("outbox_claim_seconds_count 0\n"), "{text}");
    }
}
