//! The randomized history checker: thousands of seeded schedules played
//! through the tower layer, each history checked against the guarantee.
//!
//! A schedule (drawn from a `u64` seed) mixes clients sending one key with
//! the same or a different body, at once and in sequence, as several
//! principals, some going away mid-request; an upstream that is slow, fails
//! before its head or mid-body, answers stored and unstored statuses; store
//! faults per engine instance (errors, stalls past `store_timeout`, commits
//! whose answer is lost, commits that land late); leases that run out; an
//! instance that crashes with work in flight and a fresh one on the same
//! store. Time is tokio's paused clock, so a seed replays its history.
//!
//! * `HISTORY_SEED=<n>` replays one schedule (and prints its history).
//! * `HISTORY_SCHEDULES=<n>` runs `n` schedules per store (a soak).
//!
//! The invariants are in `history/check.rs`; RELIABILITY.md has the results.

// Without a SQL store feature, the parts that drive one are unused.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres")),
    allow(dead_code, unused_imports)
)]

#[path = "history/check.rs"]
mod check;
#[path = "history/faulty.rs"]
mod faulty;
#[path = "fixtures/mod.rs"]
mod fixtures;
#[path = "history/sim.rs"]
mod sim;

use std::sync::Arc;
use std::time::Instant;

use check::{check, Violation};
use faulty::{Backend, Mutation};
use sim::{generate, run, StoreKind};
use tower_idempotency::{MemoryStore, Store};

/// Holes of the "guarantee holes" issue that today's code still has: a
/// violation they explain is counted and reported, not failed. Remove a
/// number when its fix lands (and un-ignore its `hole_N_is_closed` test).
const KNOWN_HOLES: &[u8] = &[];

/// Where schedule seeds start (any fixed value: CI runs the same seeds;
/// `HISTORY_BASE=<n>` starts elsewhere, for a run on other schedules).
const BASE_SEED: u64 = 0x1d3e_0000;

fn base_seed() -> u64 {
    std::env::var("HISTORY_BASE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(BASE_SEED)
}

fn schedules(default: usize) -> usize {
    std::env::var("HISTORY_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// Seeds that once found an oracle's or the engine's mistake, run before
/// the schedule's own (unless one seed is asked for).
const REGRESSIONS: &[u64] = &[
    // An `ErrorThenCommit` reservation met before the engine's second
    // release of it was due (an oracle false positive, found at base 777777).
    782_740,
];

fn seeds(default: usize) -> Vec<u64> {
    let mut seeds = seeds_from(0, default);
    if std::env::var("HISTORY_SEED").is_err() {
        seeds.splice(0..0, REGRESSIONS.iter().copied());
    }
    seeds
}

/// `default` seeds (or `HISTORY_SCHEDULES`) from `offset` past the base.
fn seeds_from(offset: u64, default: usize) -> Vec<u64> {
    if let Some(seed) = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let base = base_seed() + offset;
    (0..schedules(default) as u64).map(|i| base + i).collect()
}

/// What a run of many schedules found.
#[derive(Default)]
struct Findings {
    schedules: usize,
    /// (seed, violations) of every schedule with an unexplained violation.
    failed: Vec<(u64, Vec<Violation>)>,
    /// Per known hole: how many schedules showed it, and the first seed.
    known: std::collections::BTreeMap<u8, (usize, u64)>,
}

fn explore(
    store: StoreKind,
    seeds: &[u64],
    mutation: Option<Mutation>,
    known: &[u8],
    backend: &dyn Fn() -> Backend,
    stop_at_first: bool,
) -> Findings {
    explore_with(store, seeds, mutation, known, backend, stop_at_first, false)
}

/// [`explore`], with every instance keying and sealing its records when
/// `secrets` is set.
fn explore_with(
    store: StoreKind,
    seeds: &[u64],
    mutation: Option<Mutation>,
    known: &[u8],
    backend: &dyn Fn() -> Backend,
    stop_at_first: bool,
    secrets: bool,
) -> Findings {
    let verbose = std::env::var("HISTORY_SEED").is_ok();
    let mut findings = Findings::default();
    for &seed in seeds {
        let mut schedule = generate(seed, store, mutation);
        schedule.config.secrets = secrets;
        let history = run(&schedule, backend());
        let violations = check(&schedule, &history);
        findings.schedules += 1;
        if verbose {
            eprintln!("{}", schedule.describe());
            eprintln!("{}", describe_history(&history));
            eprintln!("violations: {violations:#?}");
        }
        let mut holes: Vec<u8> = violations.iter().filter_map(|v| v.hole).collect();
        holes.dedup();
        for hole in holes.into_iter().filter(|h| known.contains(h)) {
            let entry = findings.known.entry(hole).or_insert((0, seed));
            entry.0 += 1;
        }
        let unexplained: Vec<Violation> = violations
            .into_iter()
            .filter(|v| v.hole.is_none_or(|h| !known.contains(&h)))
            .collect();
        if !unexplained.is_empty() {
            if findings.failed.is_empty() && !stop_at_first {
                eprintln!(
                    "HISTORY_SEED={seed} violates the guarantee:\n{unexplained:#?}\n{}\n{}",
                    schedule.describe(),
                    describe_history(&history)
                );
            }
            findings.failed.push((seed, unexplained));
            if stop_at_first {
                break;
            }
        }
    }
    findings
}

fn describe_history(history: &sim::History) -> String {
    let mut out = String::from("executions:\n");
    for e in &history.execs {
        out += &format!("  {e:?}\n");
    }
    out += "answers:\n";
    for a in &history.answers {
        out += &format!("  {a:?}\n");
    }
    out += "store:\n";
    for e in &history.store {
        out += &format!(
            "  #{:>4}-{:<4} {:?} {:?} req {:?} owner {:?} inst {} at {:?}/{:?} -> {:?}\n",
            e.start.seq,
            e.end.seq,
            e.op,
            e.key,
            e.request,
            e.owner,
            e.instance,
            e.start.virt,
            e.start.real,
            e.answer
        );
    }
    for s in &history.stuck {
        out += &format!("stuck: {s}\n");
    }
    out
}

fn memory() -> Backend {
    Backend::Direct(Arc::new(MemoryStore::new()))
}

fn report(name: &str, findings: &Findings, started: Instant) {
    eprintln!(
        "history[{name}]: {} schedules in {:.1?}; known holes found: {:?}",
        findings.schedules,
        started.elapsed(),
        findings.known
    );
}

fn assert_clean(findings: &Findings) {
    assert!(
        findings.failed.is_empty(),
        "{} of {} schedules violate the guarantee; first: HISTORY_SEED={} {:#?}",
        findings.failed.len(),
        findings.schedules,
        findings.failed[0].0,
        findings.failed[0].1
    );
}

#[test]
fn memory_store_histories_keep_the_guarantee() {
    let started = Instant::now();
    let findings = explore(
        StoreKind::Memory,
        &seeds(8_500),
        None,
        KNOWN_HOLES,
        &memory,
        false,
    );
    report("memory", &findings, started);
    assert_clean(&findings);
}

/// The same histories with a key secret and sealed outcomes: the engine
/// seals what it stores and opens what it reads on every path (replays,
/// waiters, takeovers), and the guarantee holds unchanged.
#[test]
fn encrypted_memory_store_histories_keep_the_guarantee() {
    let started = Instant::now();
    let findings = explore_with(
        StoreKind::Memory,
        &seeds_from(100_000, 1_500),
        None,
        KNOWN_HOLES,
        &memory,
        false,
        true,
    );
    report("memory, secrets at rest", &findings, started);
    assert_clean(&findings);
}

/// A runtime of its own for a SQL store's connections (the schedules' own
/// runtimes come and go).
fn io_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_store_histories_keep_the_guarantee() {
    let io = io_runtime();
    let dir = std::path::Path::new("/dev/shm");
    let path = if dir.is_dir() {
        dir.join(format!("history-{}.db", uuid::Uuid::new_v4().simple()))
    } else {
        fixtures::sqlite_path()
    };
    let store: Arc<dyn Store> = Arc::new(
        io.block_on(tower_idempotency::SqliteStore::connect(
            path.to_str().unwrap(),
        ))
        .unwrap(),
    );
    let findings = explore_remote("sqlite", store, &io, 800);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    assert_clean(&findings);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_store_histories_keep_the_guarantee() {
    let io = io_runtime();
    let store: Arc<dyn Store> = Arc::new(io.block_on(fixtures::postgres_store()));
    assert_clean(&explore_remote("postgres", store, &io, 300));
}

/// `n` schedules on `store`, a store of the I/O runtime `io` keeping its
/// leases by the real clock, reported as `name`.
fn explore_remote(
    name: &str,
    store: Arc<dyn Store>,
    io: &tokio::runtime::Runtime,
    n: usize,
) -> Findings {
    let handle = io.handle().clone();
    let started = Instant::now();
    let findings = explore(
        StoreKind::Sql,
        &seeds(n),
        None,
        KNOWN_HOLES,
        &|| Backend::Remote(store.clone(), handle.clone()),
        false,
    );
    report(name, &findings, started);
    findings
}

/// The same histories with the Redis front cache before the store (a
/// memory store on the I/O runtime, so its leases run on the real clock,
/// as a SQL store's do): replays from Redis, copies written behind the
/// answers, fills after misses. The cache must change no outcome.
#[cfg(feature = "redis")]
#[test]
fn redis_fronted_histories_keep_the_guarantee() {
    let io = io_runtime();
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let config = tower_idempotency::RedisCacheConfig::new(url)
        .prefix(format!("history:{}:", uuid::Uuid::new_v4().simple()));
    let cache = tower_idempotency::RedisCache::new(MemoryStore::new(), config).unwrap();
    let store: Arc<dyn Store> = Arc::new(cache.clone());
    assert_clean(&explore_remote("redis over memory", store, &io, 300));
    let counters = cache.maintenance().unwrap().counters();
    let hits = counters
        .iter()
        .find(|(name, _, _)| *name == "idempotency_redis_hits_total")
        .map_or(0, |(_, _, n)| *n);
    eprintln!("history[redis over memory]: {counters:?}");
    assert!(hits > 0, "no replay came from Redis: {counters:?}");
}

/// Runs memory schedules with `mutation` until one violates the guarantee;
/// asserts that one does within the budget (4,000: the rarest need about
/// 1,000 on one seed range and 1,500 on another; a found one stops the run)
/// and prints its seed.
fn finds(mutation: Mutation, rule: &str) {
    let started = Instant::now();
    let findings = explore(
        StoreKind::Memory,
        &seeds(4000),
        Some(mutation),
        KNOWN_HOLES,
        &memory,
        true,
    );
    let Some((seed, violations)) = findings.failed.first() else {
        panic!(
            "{mutation:?}: no violating schedule in {} schedules",
            findings.schedules
        );
    };
    eprintln!(
        "{mutation:?}: found after {} schedules ({:.1?}): HISTORY_SEED={seed} {:?}",
        findings.schedules,
        started.elapsed(),
        violations[0]
    );
    // `a|b`: either rule.
    assert!(
        violations
            .iter()
            .any(|v| rule.split('|').any(|r| v.rule == r)),
        "{mutation:?} was expected to break `{rule}`: {violations:#?}"
    );
}

#[test]
fn finds_a_takeover_that_ignores_the_lease() {
    finds(Mutation::TakeoverIgnoresLease, "exclusive");
}

#[test]
fn finds_a_completion_not_fenced_on_the_owner() {
    finds(Mutation::UnfencedCompletion, "fencing");
}

#[test]
fn finds_a_release_that_forgets_the_waiters() {
    finds(Mutation::ReleaseForgetsWaiters, "wake-up");
}

#[test]
fn finds_a_scope_without_the_principal() {
    // Two callers' shared key shows as one's answer replayed to the
    // other, or as the other's 409 or 422 that no record of its own earned.
    finds(Mutation::ScopeWithoutPrincipal, "isolation|conflict-earned");
}

#[test]
fn finds_a_scope_without_the_host() {
    // Two callers' shared key shows as one's answer replayed to the
    // other, or as the other's 409 or 422 that no record of its own earned.
    finds(Mutation::ScopeWithoutHost, "isolation|conflict-earned");
}

#[test]
fn finds_a_replay_of_another_record() {
    finds(Mutation::ReplayOtherRecord, "isolation");
}

/// A store that answers with another key's record (the mutation above)
/// cannot make a sealed engine replay it: the ciphertext is bound to its
/// own scope key, so it does not open (503), and no history breaks
/// isolation.
#[test]
fn sealed_records_do_not_replay_under_another_key() {
    let findings = explore_with(
        StoreKind::Memory,
        &seeds(1500),
        Some(Mutation::ReplayOtherRecord),
        KNOWN_HOLES,
        &memory,
        true,
        true,
    );
    assert_clean(&findings);
}

#[test]
fn finds_a_wait_that_ignores_its_limit() {
    finds(Mutation::WaitIgnoresMax, "deadline");
}

#[test]
fn finds_an_orphaned_reservation_that_cannot_be_released() {
    finds(Mutation::OrphanUnreleasable, "orphan");
}

/// An engine-side bug, modelled in the instance's way to the store: the
/// heartbeat stops after one failed renewal. A brief renewal fault once
/// excused any lease that ran out after it, and this passed.
#[test]
fn finds_a_heartbeat_that_gives_up_after_a_failure() {
    finds(Mutation::HeartbeatGivesUp, "exclusive");
}

#[test]
fn finds_a_stored_response_that_keeps_one_value_per_header() {
    finds(Mutation::HeadersAsMap, "replay");
}

#[test]
fn finds_a_replayed_cookie() {
    finds(Mutation::CookieKept, "replay");
}

#[test]
fn finds_a_redirect_replayed_without_its_location() {
    finds(Mutation::LocationDropped, "replay");
}

/// A whole response stored as "response not stored" with no fault in the
/// way: every retry's 409 is unearned.
#[test]
fn finds_a_response_stored_as_the_not_stored_marker() {
    finds(Mutation::StoredAsMarker, "conflict-earned");
}

/// The first caller's own answer relayed with another status than its
/// upstream's: its body and headers alone would not show it.
#[test]
fn finds_a_first_answer_relayed_with_another_status() {
    finds(Mutation::FirstAnswerAs200, "relay");
}

/// A store that fails now and then with no fault switched on: the engine's
/// 503s are not earned.
#[test]
fn finds_a_store_that_fails_without_a_fault() {
    finds(Mutation::SpuriousUnavailable, "refusal-earned");
}

/// A store that answers "in flight" for a key its holder released: the
/// 409 is not earned.
#[test]
fn finds_a_released_key_answered_as_in_flight() {
    finds(Mutation::ReleasedKeyInFlight, "conflict-earned");
}

/// With hole `n` no longer excused, no schedule may show it: 500 memory
/// schedules of the hole's own (past those of the main run, so each such
/// test adds schedules rather than repeating them).
fn closed(hole: u8) {
    let known: Vec<u8> = KNOWN_HOLES.iter().copied().filter(|h| *h != hole).collect();
    let seeds = seeds_from(1_000_000 * u64::from(hole), 500);
    let findings = explore(StoreKind::Memory, &seeds, None, &known, &memory, true);
    assert_clean(&findings);
}

/// Hole 1 (escaped duplicate JSON keys: the fingerprint read the first
/// key, the upstream the last), found by HISTORY_SEED=490602705 before its
/// fix (with the schedules of that time). Closed: the checker no longer
/// excuses it anywhere.
#[test]
fn hole_1_is_closed() {
    closed(1);
}

/// Hole 5 (a body that fails after the head released the key, so the
/// retry executed again), found by HISTORY_SEED=490602499 before its fix
/// (the engine now stores "executed, response incomplete"). Closed.
#[test]
fn hole_5_is_closed() {
    closed(5);
}

/// Hole 6 (a reservation committed by a reserve that timed out stays in
/// flight, unreleasable, and answers 409 until its lease runs out), found
/// by HISTORY_SEED=490603269 before its fix (the engine now draws the
/// owner token and releases such a reservation). Closed.
#[test]
fn hole_6_is_closed() {
    closed(6);
}

/// Hole 9 (no principal and `Principal("")` share a scope), found by
/// HISTORY_SEED=490602496 before its fix. Closed.
#[test]
fn hole_9_is_closed() {
    closed(9);
}
