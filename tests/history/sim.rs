//! Schedules: drawn from a seed, then played through the tower layer on a
//! paused-clock runtime of their own.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower::util::BoxCloneService;
use tower::ServiceExt;
use tower_idempotency::engine::{EncryptionKey, KeySecret, Keyring};
use tower_idempotency::layer::RequestBody;
use tower_idempotency::{
    Engine, EngineConfig, FailMode, IdempotencyLayer, InFlightPolicy, Policy, Principal, Routes,
};

use super::faulty::{Backend, Fault, FaultKind, Faulty, Mutant, Mutation, Stamp, REQUEST};

/// The principals clients act as (`None`: no principal set).
pub const PRINCIPALS: [Option<&str>; 4] = [None, Some(""), Some("alice"), Some("bob")];

/// Request bodies. 0 and 1 are the same request spelled twice; 2 differs;
/// 3 and 4 differ for a last-wins JSON parser (escaped duplicate keys).
pub const BODIES: [&str; 5] = [
    r#"{"amount":10}"#,
    r#"{ "amount" : 10 }"#,
    r#"{"amount":11}"#,
    r#"{"amount":10,"\u0061mount":1000}"#,
    r#"{"\u0061mount":1000,"amount":10}"#,
];

/// `Host` header values. 0 and 1 are one host spelled twice (case, a
/// trailing dot, a port); 2 is another host (another tenant): the scope
/// includes the host by default.
pub const HOSTS: [&str; 3] = ["shop.example", "SHOP.Example.:8080", "other.example"];

/// Which host a `Host` value names.
pub fn host_of(host: usize) -> usize {
    usize::from(host == 2)
}

/// Spellings of one path: the engine scopes and fingerprints the
/// normalised path, so they are all the same request.
pub const PATHS: [&str; 5] = ["/orders", "/orders/", "//orders", "/./orders", "/%6Frders"];

/// Which store a schedule runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Memory,
    Sql,
}

/// What the upstream does with one execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upstream {
    /// Answers this status (stored: 2xx/3xx).
    Answer(u16),
    /// Answers 303 to [`LOCATIONS`]`[i]` (stored where the route has no
    /// `success_redirects`, or the location is its success page).
    Redirect(usize),
    /// Fails before its head (the service returns `Err`).
    ErrBeforeHead,
    /// Sends a 201 head and part of the body, then the body fails.
    MidBody,
}

impl Upstream {
    /// Whether the answer consumes the key, judged as the route's backend
    /// means it: on a route with `success_redirects` (the success page
    /// [`SUCCESS`]), only a 2xx or a redirect whose location, decoded as a
    /// browser reads it, is that page.
    pub fn stored(self, success_redirects: bool) -> bool {
        match self {
            Upstream::Answer(s) if (200..300).contains(&s) => true,
            Upstream::Answer(s) if (300..400).contains(&s) => !success_redirects,
            Upstream::Redirect(i) => !success_redirects || is_success(LOCATIONS[i]),
            _ => false,
        }
    }
}

/// The success page of a route with `success_redirects`, as written in
/// the configuration.
pub const SUCCESS: &str = "/kontakt/bestätigt";

/// Where redirects point, as frameworks send them (escaped, absolute or
/// not, with a query); the last is back to the form (a failure).
pub const LOCATIONS: [&str; 4] = [
    "/kontakt/best%C3%A4tigt",
    "http://shop.example/kontakt/best%c3%a4tigt?sent=1",
    "/kontakt/best%C3%A4tigt/",
    "/kontakt?error=1",
];

/// Whether `location` is the page [`SUCCESS`] or under it: its path, every
/// escape decoded, as a browser goes there.
fn is_success(location: &str) -> bool {
    let path = match location.split_once("://") {
        Some((_, rest)) => &rest[rest.find('/').unwrap_or(rest.len())..],
        None => location,
    };
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let bytes = path.as_bytes();
    let mut decoded = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                decoded.push((hex(h).unwrap() * 16 + hex(l).unwrap()) as u8);
                i += 3;
            }
            (b, _, _) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    let decoded = String::from_utf8_lossy(&decoded);
    decoded == SUCCESS || decoded.starts_with(&format!("{SUCCESS}/"))
}

#[derive(Clone, Debug)]
pub struct Req {
    pub id: usize,
    pub at: Duration,
    pub instance: usize,
    /// Index into [`HOSTS`].
    pub host: usize,
    /// Index into [`PATHS`].
    pub path: usize,
    pub principal: usize,
    pub key: usize,
    pub body: usize,
    pub delay: Duration,
    pub upstream: Upstream,
    /// The client goes away this long after sending.
    pub drop_after: Option<Duration>,
}

#[derive(Clone, Debug)]
pub enum Action {
    Request(Req),
    Fault {
        at: Duration,
        instance: usize,
        fault: Option<Fault>,
    },
    Crash {
        at: Duration,
        instance: usize,
    },
}

impl Action {
    fn at(&self) -> Duration {
        match self {
            Action::Request(r) => r.at,
            Action::Fault { at, .. } | Action::Crash { at, .. } => *at,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub seed: u64,
    #[allow(dead_code)] // read through Debug, in failure reports
    pub store: StoreKind,
    pub lease: Duration,
    pub wait_timeout: Duration,
    pub store_timeout: Duration,
    pub in_flight: InFlightPolicy,
    pub instances: usize,
    pub mutation: Option<Mutation>,
    /// Every instance keys its scopes with one secret and seals what it
    /// stores with one keyring (secrets at rest).
    pub secrets: bool,
    /// The route fails open: a request whose store failed before it saw
    /// its key held is forwarded unprotected.
    pub fail_open: bool,
    /// The route's redirects consume the key only to [`SUCCESS`].
    pub success_redirects: bool,
}

#[derive(Clone, Debug)]
pub struct Schedule {
    pub config: Config,
    pub actions: Vec<Action>,
}

impl Schedule {
    pub fn requests(&self) -> impl Iterator<Item = &Req> {
        self.actions.iter().filter_map(|a| match a {
            Action::Request(r) => Some(r),
            _ => None,
        })
    }
}

fn pick<T: Copy>(rng: &mut StdRng, items: &[T]) -> T {
    items[rng.random_range(0..items.len())]
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Draws a schedule from `seed`.
pub fn generate(seed: u64, store: StoreKind, mutation: Option<Mutation>) -> Schedule {
    let mut rng = StdRng::seed_from_u64(seed);
    let lease = match store {
        StoreKind::Memory => pick(&mut rng, &[ms(300), ms(1000), ms(3000)]),
        // SQL leases run on the database's real clock: short, so that a
        // crashed owner's lease runs out within the end check.
        StoreKind::Sql => ms(150),
    };
    let config = Config {
        seed,
        store,
        lease,
        wait_timeout: pick(&mut rng, &[ms(200), ms(1000), ms(2000), ms(5000)]),
        store_timeout: pick(&mut rng, &[ms(100), ms(250), ms(500)]),
        in_flight: if rng.random_bool(0.8) {
            InFlightPolicy::Wait
        } else {
            InFlightPolicy::Reject
        },
        instances: rng.random_range(1..=2),
        mutation,
        secrets: false,
        fail_open: rng.random_bool(0.3),
        success_redirects: rng.random_bool(0.3),
    };
    let span = lease * 4;
    let principals: Vec<usize> = {
        let mut all = vec![0, 1, 2, 3];
        let n = rng.random_range(1..=3);
        let mut chosen = Vec::new();
        for _ in 0..n {
            chosen.push(all.remove(rng.random_range(0..all.len())));
        }
        chosen
    };
    let keys = rng.random_range(1..=2);
    let escaped = rng.random_bool(0.2);
    // Most schedules use one host (spelled in several ways); some two.
    let two_hosts = rng.random_bool(0.25);
    let mut actions = Vec::new();
    let n = rng.random_range(3..=12);
    let mut at = Duration::ZERO;
    for id in 0..n {
        // Concurrent (same moment), soon after, or a later retry.
        at += match rng.random_range(0..10) {
            0..=3 => Duration::ZERO,
            4..=6 => ms(rng.random_range(1..50)),
            _ => span.mul_f64(rng.random::<f64>() / 2.0),
        };
        let body = match rng.random_range(0..20) {
            0..=9 => 0,
            10..=15 => 1,
            16 | 17 => 2,
            _ if escaped => rng.random_range(3..=4),
            _ => 0,
        };
        let delay = pick(&mut rng, &[ms(0), ms(5), lease / 2, lease * 2, lease * 3]);
        let upstream = match rng.random_range(0..20) {
            0..=5 if config.success_redirects => {
                Upstream::Redirect(rng.random_range(0..LOCATIONS.len()))
            }
            0..=11 => Upstream::Answer(pick(&mut rng, &[200, 201, 204, 303])),
            12 | 13 => Upstream::Answer(pick(&mut rng, &[409, 422, 500, 503])),
            14 | 15 => Upstream::ErrBeforeHead,
            _ => Upstream::MidBody,
        };
        let drop_after = rng
            .random_bool(0.15)
            .then(|| ms(rng.random_range(0..=(delay.as_millis() as u64 + 50))));
        let host = match rng.random_range(0..10) {
            0..=2 if two_hosts => 2,
            0..=7 => 0,
            _ => 1,
        };
        let path = if rng.random_bool(0.3) {
            rng.random_range(1..PATHS.len())
        } else {
            0
        };
        actions.push(Action::Request(Req {
            id,
            at,
            instance: rng.random_range(0..config.instances),
            host,
            path,
            principal: pick(&mut rng, &principals),
            key: rng.random_range(0..keys),
            body,
            delay,
            upstream,
            drop_after,
        }));
    }
    let end = at + lease;
    for _ in 0..rng.random_range(0..=3) {
        let from = end.mul_f64(rng.random::<f64>());
        let length = pick(&mut rng, &[ms(20), lease / 2, lease, lease * 2]);
        let instance = rng.random_range(0..config.instances);
        let kind = pick(
            &mut rng,
            &[
                FaultKind::Error,
                FaultKind::Stall,
                FaultKind::CommitThenTimeout,
                FaultKind::LateCommit,
                FaultKind::ErrorThenCommit,
                FaultKind::SlowAnswer,
            ],
        );
        // Everything (a partition), or a random few operations.
        let ops = if rng.random_bool(0.4) {
            63
        } else {
            rng.random_range(1..64)
        };
        actions.push(Action::Fault {
            at: from,
            instance,
            fault: Some(Fault { kind, ops }),
        });
        actions.push(Action::Fault {
            at: from + length,
            instance,
            fault: None,
        });
    }
    if rng.random_bool(0.2) {
        actions.push(Action::Crash {
            at: end.mul_f64(rng.random::<f64>()),
            instance: rng.random_range(0..config.instances),
        });
    }
    // The end, on the memory store's virtual clock: one more retry of
    // every scope the history used, sent as its first request was, once
    // every fault has ended and every execution, with the lease of any it
    // left behind, is over. A record lost or changed meanwhile shows as a
    // second execution or a wrong replay, a key left stuck as a wait past
    // its deadline, though no later request happened to look.
    if store == StoreKind::Memory {
        let quiet = actions.iter().map(Action::at).max().unwrap_or(at) + lease * 7;
        let mut scopes = Vec::new();
        let firsts: Vec<Req> = actions
            .iter()
            .filter_map(|action| match action {
                Action::Request(req) => Some(req.clone()),
                _ => None,
            })
            .collect();
        for req in firsts {
            let scope = (host_of(req.host), req.principal, req.key);
            if scopes.contains(&scope) {
                continue;
            }
            scopes.push(scope);
            actions.push(Action::Request(Req {
                id: n + scopes.len() - 1,
                at: quiet,
                delay: ms(5),
                upstream: Upstream::Answer(201),
                drop_after: None,
                ..req
            }));
        }
    }
    actions.sort_by_key(Action::at);
    Schedule { config, actions }
}

impl Schedule {
    /// The schedule as text, for a failure report.
    pub fn describe(&self) -> String {
        let mut out = format!("{:?}\n", self.config);
        for action in &self.actions {
            let _ = writeln!(out, "  {action:?}");
        }
        out
    }
}

/// One upstream call.
#[derive(Clone, Debug)]
pub struct Exec {
    pub id: usize,
    pub request: usize,
    #[allow(dead_code)] // read through Debug, in failure reports
    pub instance: usize,
    pub start: Stamp,
    pub end: Option<Stamp>,
    pub upstream: Upstream,
    pub body: Bytes,
}

/// What a client saw.
#[derive(Clone, Debug)]
pub enum Seen {
    Reply {
        status: StatusCode,
        replayed: bool,
        /// Every header, in order, as the client read it.
        headers: Vec<(String, Vec<u8>)>,
        /// `None`: the body failed.
        body: Option<Bytes>,
    },
    /// The service answered `Err`.
    Error,
    /// The client went away on purpose.
    Dropped,
    /// Its instance crashed.
    Crashed,
    /// No answer within the watchdog.
    Hung,
}

#[derive(Clone, Debug)]
pub struct Answered {
    pub request: usize,
    /// The engine instance that answered (a fresh one after a crash has a
    /// number of its own, unlike the schedule's slot).
    pub instance: usize,
    pub sent: Stamp,
    pub at: Stamp,
    pub seen: Seen,
}

/// Everything that happened.
pub struct History {
    pub execs: Vec<Exec>,
    pub answers: Vec<Answered>,
    pub store: Vec<super::faulty::StoreEvent>,
    /// Keys still in flight after every owner was gone and its lease passed.
    pub stuck: Vec<String>,
    pub real_clock: bool,
    /// Faults switched and crashes, per instance.
    pub switches: Vec<super::faulty::Switch>,
    /// When each reserve call returned to the engine, by owner token.
    pub reserve_ends: HashMap<tower_idempotency::store::OwnerToken, Stamp>,
    /// The requests the engine was told (by a reserve or a get that
    /// reached it) their key's record is there.
    pub saw_held: std::collections::HashSet<usize>,
    /// Owners a completion or release of which was sent under a fault
    /// hitting it.
    pub storing_faulted: std::collections::HashSet<tower_idempotency::store::OwnerToken>,
    /// Requests the store answered with another key's record (a mutation).
    pub substituted: std::collections::HashSet<usize>,
    /// The owners whose reservation answered `Acquired` through the fault
    /// wrapper: to the engine, or to the guard that releases a reservation
    /// the engine gave up on (the checker tells them apart by time).
    pub answered: std::collections::HashSet<tower_idempotency::store::OwnerToken>,
}

type Svc = BoxCloneService<Request<Full<Bytes>>, Response<Bytes>, std::io::Error>;
type Inbound = Request<RequestBody<Full<Bytes>>>;
type ResBody = BoxBody<Bytes, std::io::Error>;

struct Shared {
    mutant: Arc<Mutant>,
    execs: Mutex<Vec<Exec>>,
    answers: Mutex<Vec<Answered>>,
    next_exec: AtomicUsize,
    scripts: HashMap<usize, Req>,
}

struct Instance {
    faulty: Arc<Faulty>,
    svc: Svc,
    tasks: Vec<tokio::task::AbortHandle>,
    /// Client tasks that may still answer.
    handles: Vec<(usize, tokio::task::JoinHandle<()>)>,
}

fn instance(id: usize, shared: &Arc<Shared>, config: &Config) -> Instance {
    let faulty = Faulty::new(id, shared.mutant.clone(), config.store_timeout);
    let svc = build(faulty.clone(), shared.clone(), config);
    Instance {
        faulty,
        svc,
        tasks: Vec::new(),
        handles: Vec::new(),
    }
}

/// The layer over the upstream, with the response body read into bytes (a
/// failing body becomes an `Err` of kind `Other` with this marker).
fn build(faulty: Arc<Faulty>, shared: Arc<Shared>, config: &Config) -> Svc {
    let policy = Policy {
        lease: config.lease,
        wait_timeout: config.wait_timeout,
        in_flight: config.in_flight,
        scope_authority: config.mutation != Some(Mutation::ScopeWithoutHost),
        fail_mode: match config.fail_open {
            true => FailMode::Open,
            false => FailMode::Closed,
        },
        success_redirects: match config.success_redirects {
            true => vec![SUCCESS.into()],
            false => Vec::new(),
        },
        ..Policy::default()
    };
    let engine = Engine::with_config(
        faulty.clone(),
        Routes::all(policy).expect("valid policy"),
        EngineConfig {
            store_timeout: config.store_timeout,
            key_secret: config
                .secrets
                .then(|| KeySecret::new(vec![0x5e; 32]).expect("a valid secret")),
            encryption: config.secrets.then(|| {
                let key = EncryptionKey::new("1", &[1; 32]).expect("a valid key");
                Keyring::new(vec![key], "1").expect("a valid keyring")
            }),
            ..EngineConfig::default()
        },
    );
    let upstream = tower::service_fn(move |request: Inbound| {
        let shared = shared.clone();
        let faulty = faulty.clone();
        async move { upstream(&shared, &faulty, request).await }
    });
    let layered = tower::Layer::layer(&IdempotencyLayer::new(engine), upstream);
    let relabel = config.mutation == Some(Mutation::FirstAnswerAs200);
    BoxCloneService::new(
        layered.and_then(move |response: Response<Layered>| async move {
            let (mut parts, body) = response.into_parts();
            if relabel
                && parts.status == StatusCode::CREATED
                && !parts.headers.contains_key("idempotent-replayed")
            {
                parts.status = StatusCode::OK;
            }
            match body.collect().await {
                Ok(collected) => {
                    let mut response = Response::from_parts(parts, collected.to_bytes());
                    response.extensions_mut().insert(BodyOk);
                    Ok(response)
                }
                Err(_) => Ok(Response::from_parts(parts, Bytes::new())),
            }
        }),
    )
}

type Layered = tower_idempotency::layer::ResponseBody<ResBody, std::io::Error>;

/// Marks a response whose body arrived whole.
#[derive(Clone, Copy)]
struct BodyOk;

async fn upstream(
    shared: &Shared,
    faulty: &Faulty,
    request: Inbound,
) -> Result<Response<ResBody>, std::io::Error> {
    let id: usize = request.headers()["x-request"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let script = shared.scripts[&id].clone();
    let exec = shared.next_exec.fetch_add(1, Ordering::SeqCst);
    // A 204 carries no body: its execution is named by `x-exec` alone.
    let body = match script.upstream {
        Upstream::Answer(204) => Bytes::new(),
        _ => Bytes::from(format!("exec:{exec}:request:{id}")),
    };
    let index = {
        let mut execs = shared.execs.lock().unwrap();
        execs.push(Exec {
            id: exec,
            request: id,
            instance: faulty.instance,
            start: shared.mutant.stamp(),
            end: None,
            upstream: script.upstream,
            body: body.clone(),
        });
        execs.len() - 1
    };
    tokio::time::sleep(script.delay).await;
    if faulty.is_dead() {
        // The process is gone: no answer, ever.
        return std::future::pending().await;
    }
    shared.execs.lock().unwrap()[index].end = Some(shared.mutant.stamp());
    let frames: Vec<Result<http_body::Frame<Bytes>, std::io::Error>> = match script.upstream {
        Upstream::ErrBeforeHead => return Err(std::io::Error::other("upstream down")),
        Upstream::Answer(204) => vec![],
        Upstream::Answer(_) | Upstream::Redirect(_) => vec![
            Ok(http_body::Frame::data(body.slice(..6))),
            Ok(http_body::Frame::data(body.slice(6..))),
        ],
        Upstream::MidBody => vec![
            Ok(http_body::Frame::data(body.slice(..6))),
            Err(std::io::Error::other("upstream cut the body")),
        ],
    };
    let status = match script.upstream {
        Upstream::Answer(status) => StatusCode::from_u16(status).unwrap(),
        Upstream::Redirect(_) => StatusCode::SEE_OTHER,
        _ => StatusCode::CREATED,
    };
    let body = BoxBody::new(StreamBody::new(futures::stream::iter(frames)));
    let mut response = Response::builder().status(status);
    if let Upstream::Redirect(i) = script.upstream {
        response = response.header(http::header::LOCATION, LOCATIONS[i]);
    }
    let (replayed, not_replayed) = upstream_headers(exec);
    for (name, value) in replayed.into_iter().chain(not_replayed) {
        response = response.header(name, HeaderValue::from_bytes(&value).unwrap());
    }
    Ok(response.body(body).unwrap())
}

/// Header lines, by name, in order.
pub type Headers = Vec<(&'static str, Vec<u8>)>;

/// The headers execution `exec` answers with besides `Location`: those a
/// replay must carry, in this order (a repeated name, a value that is not
/// UTF-8), and those it must not (a cookie, and a hop-by-hop header named
/// by `Connection`), as README states them.
pub fn upstream_headers(exec: usize) -> (Headers, Headers) {
    let replayed = vec![
        ("content-type", b"text/plain; charset=utf-8".to_vec()),
        ("x-exec", exec.to_string().into_bytes()),
        ("x-trace", format!("first-{exec}").into_bytes()),
        (
            "x-bytes",
            [b"caf\xe9 ".as_slice(), exec.to_string().as_bytes()].concat(),
        ),
        ("x-trace", format!("second-{exec}").into_bytes()),
    ];
    let not_replayed = vec![
        (
            "set-cookie",
            format!("session={exec}; HttpOnly").into_bytes(),
        ),
        ("connection", b"x-hop".to_vec()),
        ("x-hop", format!("hop-{exec}").into_bytes()),
    ];
    (replayed, not_replayed)
}

/// The longest a request may take, by its script and the configuration.
pub fn deadline(config: &Config, req: &Req) -> Duration {
    config.wait_timeout + config.store_timeout * 5 + req.delay + ms(10)
}

/// The key header value of a request: unique to the schedule.
pub fn raw_key(config: &Config, req: &Req) -> String {
    format!("s{}-k{}", config.seed, req.key)
}

/// Plays `schedule` on `backend` and returns its history.
pub fn run(schedule: &Schedule, backend: Backend) -> History {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(play(schedule, backend))
}

async fn play(schedule: &Schedule, backend: Backend) -> History {
    let config = &schedule.config;
    let mutant = Mutant::new(backend, config.mutation);
    let shared = Arc::new(Shared {
        mutant: mutant.clone(),
        execs: Mutex::default(),
        answers: Mutex::default(),
        next_exec: AtomicUsize::new(0),
        scripts: schedule.requests().map(|r| (r.id, r.clone())).collect(),
    });
    let mut next_instance = config.instances;
    let mut instances: Vec<Instance> = (0..config.instances)
        .map(|i| instance(i, &shared, config))
        .collect();
    let start = tokio::time::Instant::now();
    let mut dead: Vec<Instance> = Vec::new();
    for action in &schedule.actions {
        tokio::time::sleep_until(start + action.at()).await;
        match action {
            Action::Request(req) => {
                let target = &mut instances[req.instance];
                let handle = tokio::spawn(client(
                    shared.clone(),
                    (target.svc.clone(), target.faulty.instance),
                    config.clone(),
                    req.clone(),
                ));
                target.tasks.push(handle.abort_handle());
                target.handles.push((req.id, handle));
            }
            Action::Fault {
                instance, fault, ..
            } => instances[*instance].faulty.set_fault(*fault),
            Action::Crash { instance: i, .. } => {
                let fresh = instance(next_instance, &shared, config);
                next_instance += 1;
                let crashed = std::mem::replace(&mut instances[*i], fresh);
                crashed.faulty.kill();
                for task in &crashed.tasks {
                    task.abort();
                }
                dead.push(crashed);
            }
        }
    }
    for instance in instances.iter_mut().chain(dead.iter_mut()) {
        for (id, handle) in instance.handles.drain(..) {
            if handle.await.is_err() {
                let now = mutant.stamp();
                shared.answers.lock().unwrap().push(Answered {
                    request: id,
                    instance: instance.faulty.instance,
                    sent: now,
                    at: now,
                    seen: Seen::Crashed,
                });
            }
        }
    }
    // Let every background settlement (retried completions, renewals of
    // abandoned work) run out.
    for instance in &instances {
        instance.faulty.set_fault(None);
    }
    tokio::time::sleep(config.lease * 4 + config.store_timeout * 20).await;
    // Every owner is gone now: no key may stay in flight past its lease.
    let mut keys: Vec<_> = mutant.log().iter().map(|e| e.key).collect();
    keys.sort();
    keys.dedup();
    let mut stuck = Vec::new();
    for key in keys {
        if let Some(remaining) = in_flight(&mutant, key).await {
            let wait = remaining + ms(20);
            if mutant.real_clock() {
                tokio::task::spawn_blocking(move || std::thread::sleep(wait))
                    .await
                    .unwrap();
            } else {
                tokio::time::sleep(wait).await;
            }
            if let Some(left) = in_flight(&mutant, key).await {
                stuck.push(format!("{key:?} still in flight, {left:?} of lease left"));
            }
        }
    }
    let execs = shared.execs.lock().unwrap().clone();
    let answers = shared.answers.lock().unwrap().clone();
    History {
        execs,
        answers,
        store: mutant.log(),
        stuck,
        real_clock: mutant.real_clock(),
        switches: mutant.switches(),
        reserve_ends: mutant.reserve_ends(),
        saw_held: mutant.saw_held(),
        storing_faulted: mutant.storing_faulted(),
        substituted: mutant.substituted(),
        answered: mutant.answered(),
    }
}

async fn in_flight(mutant: &Mutant, key: tower_idempotency::store::ScopeKey) -> Option<Duration> {
    match super::faulty::peek(mutant, key).await {
        Ok(Some(tower_idempotency::store::Record {
            state: tower_idempotency::store::RecordState::InFlight { lease_remaining },
            ..
        })) if !lease_remaining.is_zero() => Some(lease_remaining),
        _ => None,
    }
}

/// Sends `req` to `svc`, the engine instance numbered `instance`.
async fn client(shared: Arc<Shared>, (svc, instance): (Svc, usize), config: Config, req: Req) {
    let mut request = Request::post(PATHS[req.path])
        .header("host", HOSTS[req.host])
        .header("idempotency-key", raw_key(&config, &req))
        .header("content-type", "application/json")
        .header("x-request", req.id.to_string())
        .body(Full::new(Bytes::from_static(BODIES[req.body].as_bytes())))
        .unwrap();
    let principal = PRINCIPALS[req.principal];
    if let Some(p) = principal {
        if config.mutation != Some(Mutation::ScopeWithoutPrincipal) {
            request
                .extensions_mut()
                .insert(Principal::new(Bytes::from(p.as_bytes().to_vec())));
        }
    }
    let sent = shared.mutant.stamp();
    let call = REQUEST.scope(req.id, svc.oneshot(request));
    let watchdog = deadline(&config, &req) + Duration::from_secs(5);
    let seen = match req.drop_after {
        Some(after) if after < watchdog => match tokio::time::timeout(after, call).await {
            Err(_) => Seen::Dropped,
            Ok(result) => seen(result),
        },
        _ => match tokio::time::timeout(watchdog, call).await {
            Err(_) => Seen::Hung,
            Ok(result) => seen(result),
        },
    };
    let at = shared.mutant.stamp();
    shared.answers.lock().unwrap().push(Answered {
        request: req.id,
        instance,
        sent,
        at,
        seen,
    });
}

fn seen(result: Result<Response<Bytes>, std::io::Error>) -> Seen {
    match result {
        Err(_) => Seen::Error,
        Ok(response) => Seen::Reply {
            status: response.status(),
            replayed: response.headers().contains_key("idempotent-replayed"),
            headers: response
                .headers()
                .iter()
                .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
                .collect(),
            body: response
                .extensions()
                .get::<BodyOk>()
                .map(|_| response.body().clone()),
        },
    }
}
