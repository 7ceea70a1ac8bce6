//! Counters per outcome and a store-latency histogram, lock-free.
//!
//! The engine updates them; [`Metrics::render_prometheus`] writes the
//! Prometheus text format (the proxy serves it on `/metrics`).

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// What the engine decided for one request. Each has a counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Event {
    /// Not covered, or no key on an optional route: forwarded untouched.
    Passthrough,
    /// First arrival (or lease takeover): the upstream was called.
    Executed,
    /// A stored response was replayed.
    Replayed,
    /// A duplicate waited for the first request and then replayed it.
    Waited,
    /// A duplicate got 409 because the first is still in flight.
    InFlightConflict,
    /// Same key, different request.
    Mismatch,
    /// Missing (where required) or malformed key.
    InvalidKey,
    /// Request body over the limit.
    TooLarge,
    /// The store failed; answered 503 (or forwarded where fail-open).
    StoreError,
    /// The upstream's answer was not stored (status outside the stored
    /// set, transport failure, abandoned request): the key was released.
    Released,
    /// The upstream's answer was stored.
    Stored,
}

impl Event {
    /// Every event, in a stable order.
    pub const ALL: [Event; 11] = [
        Event::Passthrough,
        Event::Executed,
        Event::Replayed,
        Event::Waited,
        Event::InFlightConflict,
        Event::Mismatch,
        Event::InvalidKey,
        Event::TooLarge,
        Event::StoreError,
        Event::Released,
        Event::Stored,
    ];

    /// The label value used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Passthrough => "passthrough",
            Event::Executed => "executed",
            Event::Replayed => "replayed",
            Event::Waited => "waited",
            Event::InFlightConflict => "in_flight_conflict",
            Event::Mismatch => "mismatch",
            Event::InvalidKey => "invalid_key",
            Event::TooLarge => "too_large",
            Event::StoreError => "store_error",
            Event::Released => "released",
            Event::Stored => "stored",
        }
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Upper bounds of the store-latency buckets, in microseconds.
const BUCKETS_US: [u64; 12] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 500_000, 2_000_000,
];

/// The engine's counters. Cheap to update from any thread.
#[derive(Debug, Default)]
pub struct Metrics {
    events: [AtomicU64; Event::ALL.len()],
    in_flight: AtomicI64,
    store_buckets: [AtomicU64; BUCKETS_US.len()],
    store_count: AtomicU64,
    store_sum_us: AtomicU64,
}

impl Metrics {
    pub(crate) fn record(&self, event: Event) {
        self.events[event as usize].fetch_add(1, Relaxed);
    }

    pub(crate) fn observe_store(&self, elapsed: Duration) {
        let us = elapsed.as_micros().min(u64::MAX as u128) as u64;
        if let Some(i) = BUCKETS_US.iter().position(|&bound| us <= bound) {
            self.store_buckets[i].fetch_add(1, Relaxed);
        }
        self.store_count.fetch_add(1, Relaxed);
        self.store_sum_us.fetch_add(us, Relaxed);
    }

    pub(crate) fn in_flight_add(&self, delta: i64) {
        self.in_flight.fetch_add(delta, Relaxed);
    }

    /// How often `event` happened since start.
    pub fn count(&self, event: Event) -> u64 {
        self.events[event as usize].load(Relaxed)
    }

    /// Requests currently holding a reservation (upstream running).
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Relaxed)
    }

    /// How many store calls were timed.
    pub fn store_calls(&self) -> u64 {
        self.store_count.load(Relaxed)
    }

    /// Appends the Prometheus text exposition of these metrics, plus
    /// `extra` counters (name, help, value), to `out`.
    pub fn render_prometheus(&self, extra: &[(&str, &str, u64)], out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP idempotency_requests_total Requests by engine outcome."
        );
        let _ = writeln!(out, "# TYPE idempotency_requests_total counter");
        for event in Event::ALL {
            let _ = writeln!(
                out,
                "idempotency_requests_total{{outcome=\"{event}\"}} {}",
                self.count(event)
            );
        }
        let _ = writeln!(
            out,
            "# HELP idempotency_in_flight Requests holding a reservation."
        );
        let _ = writeln!(out, "# TYPE idempotency_in_flight gauge");
        let _ = writeln!(out, "idempotency_in_flight {}", self.in_flight());
        let _ = writeln!(
            out,
            "# HELP idempotency_store_latency_seconds Store call latency."
        );
        let _ = writeln!(out, "# TYPE idempotency_store_latency_seconds histogram");
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS_US.iter().zip(&self.store_buckets) {
            cumulative += bucket.load(Relaxed);
            let _ = writeln!(
                out,
                "idempotency_store_latency_seconds_bucket{{le=\"{}\"}} {cumulative}",
                *bound as f64 / 1e6
            );
        }
        let count = self.store_count.load(Relaxed);
        let _ = writeln!(
            out,
            "idempotency_store_latency_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "idempotency_store_latency_seconds_sum {}",
            self.store_sum_us.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "idempotency_store_latency_seconds_count {count}");
        for (name, help, value) in extra {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {value}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_and_histogram() {
        let metrics = Metrics::default();
        metrics.record(Event::Replayed);
        metrics.record(Event::Replayed);
        metrics.observe_store(Duration::from_micros(300));
        metrics.observe_store(Duration::from_secs(10));
        let mut out = String::new();
        metrics.render_prometheus(&[("redis_hits_total", "Hits.", 3)], &mut out);
        assert!(out.contains("idempotency_requests_total{outcome=\"replayed\"} 2"));
        assert!(out.contains("idempotency_store_latency_seconds_bucket{le=\"0.0005\"} 1"));
        assert!(out.contains("idempotency_store_latency_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(out.contains("redis_hits_total 3"));
    }
}
