//! Counters per outcome and a store-latency histogram, lock-free.
//!
//! The engine updates them; [`Metrics::render_prometheus`] writes the
//! Prometheus text format (the proxy serves it on `/metrics`).

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// What the engine decided or did for one request. Each has a counter,
/// which moves exactly when its variant's documentation says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Event {
    /// Forwarded without protection, before anything is reserved: no
    /// route covers it, or its route's key is optional and it has none.
    Passthrough,
    /// The request reserved its key (first arrival, or a takeover of an
    /// expired lease). Counted at the reservation, before the upstream is
    /// called; what became of the call is counted as `Stored` or
    /// `Released`.
    Executed,
    /// Answered from the record at once: its stored response replayed, or,
    /// when the response was too large to store, the
    /// `response-not-stored` 409.
    Replayed,
    /// A duplicate waited for the first request, then replayed its stored
    /// response.
    Waited,
    /// A duplicate got 409 because the first still holds the key (the
    /// route rejects duplicates in flight, or the wait timed out).
    InFlightConflict,
    /// Same key, different request: 422 (or the route's status).
    Mismatch,
    /// 400: a required key is missing, or a key is malformed.
    InvalidKey,
    /// 413: the request body is over the route's limit; nothing reserved.
    TooLarge,
    /// A store call failed or timed out: while deciding (503, or forwarded
    /// on a fail-open route), or while storing an outcome, after the
    /// background retries gave up.
    StoreError,
    /// A reservation ended without storing anything: a status the route
    /// does not store, an upstream that failed or broke off, or an
    /// abandoned request. The key is free again.
    Released,
    /// The upstream's answer — or, for one too large to store, the marker
    /// that it ran — was stored.
    Stored,
    /// 401: the route's principal is missing where required, or its
    /// credential failed verification; nothing reserved.
    PrincipalRefused,
}

impl Event {
    /// Every event, in a stable order.
    pub const ALL: [Event; 12] = [
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
        Event::PrincipalRefused,
    ];

    /// When the counter moves, in a few words (the metric's help text).
    pub fn help(self) -> &'static str {
        match self {
            Event::Passthrough => "forwarded unprotected (not covered, or no optional key)",
            Event::Executed => "key reserved, counted before the upstream is called",
            Event::Replayed => "stored response replayed at once, or response-not-stored 409",
            Event::Waited => "duplicate waited for the first, then replayed",
            Event::InFlightConflict => "409, the first still holds the key",
            Event::Mismatch => "same key, different request",
            Event::InvalidKey => "400, key missing where required or malformed",
            Event::TooLarge => "413, request body over the limit",
            Event::StoreError => "store call failed or timed out (deciding or storing)",
            Event::Released => "reservation ended without storing; key free again",
            Event::Stored => "upstream answer (or too-large marker) stored",
            Event::PrincipalRefused => "401, principal missing where required or not verified",
        }
    }

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
            Event::PrincipalRefused => "principal_refused",
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
    /// Bytes of covered request bodies buffered now (permits held).
    buffered_bytes: AtomicU64,
    /// The most `buffered_bytes` ever was.
    buffered_peak: AtomicU64,
    /// Requests refused because the buffer budget was used up.
    overloaded: AtomicU64,
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

    /// Adds `bytes` to the buffered bytes if the total stays within `max`;
    /// whether it did (counted as an overload when not).
    pub(crate) fn try_buffer(&self, bytes: u64, max: u64) -> bool {
        let added = self.buffered_bytes.fetch_update(Relaxed, Relaxed, |now| {
            now.checked_add(bytes).filter(|&total| total <= max)
        });
        match added {
            Ok(before) => {
                self.buffered_peak.fetch_max(before + bytes, Relaxed);
                true
            }
            Err(_) => {
                self.overloaded.fetch_add(1, Relaxed);
                false
            }
        }
    }

    pub(crate) fn unbuffer(&self, bytes: u64) {
        self.buffered_bytes.fetch_sub(bytes, Relaxed);
    }

    /// Bytes reserved now for covered request bodies being buffered and
    /// decided (see `EngineConfig::max_buffered_bytes`).
    pub fn buffered_bytes(&self) -> u64 {
        self.buffered_bytes.load(Relaxed)
    }

    /// The most bytes ever reserved for covered request bodies at once;
    /// never above `EngineConfig::max_buffered_bytes`.
    pub fn buffered_bytes_peak(&self) -> u64 {
        self.buffered_peak.load(Relaxed)
    }

    /// Requests refused with 503 `overloaded` because the buffer budget was
    /// used up.
    pub fn overloaded(&self) -> u64 {
        self.overloaded.load(Relaxed)
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
    ///
    /// Written here, not with `prometheus-client`: that crate renders
    /// OpenMetrics (a `# EOF` line, its own `_total` and unit rules), which
    /// would change the `/metrics` text scrapers already read, and it wants
    /// every metric registered up front, while a store's counters are only
    /// known when they are rendered. The format here is the 0.0.4 text
    /// format, a few lines per metric.
    pub fn render_prometheus(&self, extra: &[(&str, &str, u64)], out: &mut String) {
        let _ = write!(out, "# HELP idempotency_requests_total Engine outcomes:");
        for (i, event) in Event::ALL.into_iter().enumerate() {
            let end = if i + 1 == Event::ALL.len() { "." } else { ";" };
            let _ = write!(out, " {event}: {}{end}", event.help());
        }
        let _ = writeln!(out);
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
            "# HELP idempotency_in_flight Reservations held now (from the key's reservation until its outcome is stored or released)."
        );
        let _ = writeln!(out, "# TYPE idempotency_in_flight gauge");
        let _ = writeln!(out, "idempotency_in_flight {}", self.in_flight());
        let _ = writeln!(
            out,
            "# HELP idempotency_buffered_bytes Bytes reserved now for covered request bodies being buffered and decided."
        );
        let _ = writeln!(out, "# TYPE idempotency_buffered_bytes gauge");
        let _ = writeln!(out, "idempotency_buffered_bytes {}", self.buffered_bytes());
        let _ = writeln!(
            out,
            "# HELP idempotency_overloaded_total Requests refused with 503 before their body was read: the buffer budget was used up."
        );
        let _ = writeln!(out, "# TYPE idempotency_overloaded_total counter");
        let _ = writeln!(out, "idempotency_overloaded_total {}", self.overloaded());
        let _ = writeln!(
            out,
            "# HELP idempotency_store_latency_seconds Duration of each timed store call: reserve, get, complete, release, renew, sweep, ping (timeouts included; waits are not timed)."
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
