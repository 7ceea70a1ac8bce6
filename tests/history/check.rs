//! The invariants, checked on one history.
//!
//! A scope is what the client means by it: (principal, key). The store's
//! side of the history (every call the store under test answered, with its
//! owner tokens and times by the store's own clock) decides when a second
//! execution is legitimate.

use std::collections::HashMap;
use std::time::Duration;

use super::faulty::{Answer, Fault, FaultKind, Op, Stamp, StoreEvent, Switch};
use super::sim::{
    deadline, host_of, upstream_headers, Exec, History, Req, Schedule, Seen, Upstream, BODIES,
    LOCATIONS,
};
use tower_idempotency::store::OwnerToken;

/// One broken invariant. `hole` names the item of the "guarantee holes"
/// issue that explains it, when one does.
#[derive(Clone, Debug)]
pub struct Violation {
    pub rule: &'static str,
    pub hole: Option<u8>,
    #[allow(dead_code)] // read through Debug, in failure reports
    pub text: String,
}

/// (host, principal, key): the engine scopes by the host by default (the
/// path is the same in every spelling).
type Scope = (usize, usize, usize);

fn scope(req: &Req) -> Scope {
    (host_of(req.host), req.principal, req.key)
}

/// The same request for a last-wins JSON parser (what the upstream acts on).
fn same_request(a: usize, b: usize) -> bool {
    let parse = |i: usize| serde_json::from_str::<serde_json::Value>(BODIES[i]).unwrap();
    parse(a) == parse(b)
}

fn exec_id(body: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(body).ok()?;
    text.strip_prefix("exec:")?.split(':').next()?.parse().ok()
}

/// The execution an answer came from: named in its body, or, for an empty
/// body (a 204), by its first `x-exec` header.
fn answer_exec_id(body: &[u8], headers: &[(String, Vec<u8>)]) -> Option<usize> {
    if !body.is_empty() {
        return exec_id(body);
    }
    let (_, value) = headers.iter().find(|(name, _)| name == "x-exec")?;
    std::str::from_utf8(value).ok()?.parse().ok()
}

fn acq_i_start(acquired: &HashMap<usize, &StoreEvent>, exec: &Exec) -> u64 {
    acquired[&exec.request].start.seq
}

/// Whether a fault of this kind makes a call fail without its work being
/// done in time: the ones that can keep a lease from being renewed, a
/// completion from being stored or a release from freeing the key. (The
/// others commit at once or soon: the store's lease is renewed although
/// the engine hears otherwise.)
fn fails(kind: FaultKind) -> bool {
    matches!(
        kind,
        FaultKind::Error | FaultKind::Stall | FaultKind::LateCommit
    )
}

/// Whether `instance` crashed between the sequence numbers `from` and `to`,
/// or had a failing fault on completions or releases at some time in
/// between (storing the outcome gives up after about a lease; a release
/// that fails leaves the key to its lease), or its renewals could not get
/// through for the renewal window `renewals` (store time): a failing fault
/// on them in force with no fault-free stretch longer than `gap` (the
/// renewer sends another attempt within it, without waiting for a hanging
/// one). A brief renewal fault no longer excuses a lease that ran out: a
/// heartbeat that gave up after it would have hidden behind it. Nor does a
/// storing fault that never hit the owner's own storing (`own_storing`: a
/// completion or release of its own sent under a fault hitting it):
/// another request's failed completion says nothing of this one's lease.
fn excused(
    switches: &[Switch],
    instance: usize,
    (from, to): (u64, u64),
    renewals: (Duration, Duration),
    gap: Duration,
    own_storing: bool,
    t: &dyn Fn(&Stamp) -> Duration,
) -> bool {
    // A release that fails at once but commits a moment later
    // (`ErrorThenCommit`) stops the renewals at once too, and the lease may
    // run out before its commit frees the key.
    let storing = |f: Option<Fault>| {
        own_storing
            && f.is_some_and(|f| {
                (fails(f.kind) && (f.hits(Op::Complete) || f.hits(Op::Release)))
                    || (f.kind == FaultKind::ErrorThenCommit && f.hits(Op::Release))
            })
    };
    let blocks = |f: Option<Fault>| f.is_some_and(|f| fails(f.kind) && f.hits(Op::Renew));
    let mine: Vec<&Switch> = switches.iter().filter(|s| s.instance == instance).collect();
    // Crashes and storing faults, by the order of calls.
    let mut at_from: Option<Fault> = None;
    for switch in &mine {
        if switch.at.seq > to {
            break;
        }
        if switch.crash {
            return true;
        }
        if switch.at.seq < from {
            at_from = switch.fault;
        } else if storing(switch.fault) {
            return true;
        }
    }
    if storing(at_from) {
        return true;
    }
    // Renewals, by the store's clock.
    let (start, end) = renewals;
    let mut current: Option<Fault> = None;
    let mut free_since = None;
    let mut opened = false;
    for switch in &mine {
        let at = t(&switch.at);
        if at <= start {
            current = switch.fault;
            continue;
        }
        if !opened {
            opened = true;
            free_since = (!blocks(current)).then_some(start);
        }
        if at > end {
            break;
        }
        match (free_since, blocks(switch.fault)) {
            (Some(since), true) => {
                if at.saturating_sub(since) > gap {
                    return false;
                }
                free_since = None;
            }
            (None, false) => free_since = Some(at),
            _ => {}
        }
    }
    if !opened {
        free_since = (!blocks(current)).then_some(start);
    }
    free_since.is_none_or(|since| end.saturating_sub(since) <= gap)
}

/// Whether `instance` crashed or had a fault on releases between `from`
/// and `to` (sequence numbers), or had one in force at `from`.
fn excused_release(switches: &[Switch], instance: usize, from: u64, to: u64) -> bool {
    let hits = |f: Option<Fault>| f.is_some_and(|f| f.hits(Op::Release));
    let mut at_from: Option<Fault> = None;
    for switch in switches.iter().filter(|s| s.instance == instance) {
        if switch.at.seq > to {
            break;
        }
        if switch.crash {
            return true;
        }
        if switch.at.seq < from {
            at_from = switch.fault;
        } else if hits(switch.fault) {
            return true;
        }
    }
    hits(at_from)
}

/// What is wrong with the headers of `exec`'s own caller's answer (`None`:
/// nothing): the end-to-end headers the upstream answered with reach it,
/// each name's values in their order, its cookie included (minted for
/// this caller).
fn relayed_headers(exec: &Exec, headers: &[(String, Vec<u8>)]) -> Option<String> {
    let (replayed, not_replayed) = upstream_headers(exec.id);
    let cookie = not_replayed
        .into_iter()
        .filter(|(name, _)| *name == "set-cookie");
    let expected: Vec<(&str, Vec<u8>)> = replayed.into_iter().chain(cookie).collect();
    let problems = mismatches(&expected, headers);
    (!problems.is_empty()).then(|| problems.join("; "))
}

/// What is wrong with the headers of a replay of `exec` (`None`: nothing):
/// every header the upstream answered with comes back, each name's values
/// in their order, and `Location` for a redirect; `Set-Cookie` (no
/// `replay_set_cookie` here) and a header `Connection` named do not.
fn replayed_headers(exec: &Exec, headers: &[(String, Vec<u8>)]) -> Option<String> {
    let (replayed, not_replayed) = upstream_headers(exec.id);
    let mut expected: Vec<(&str, Vec<u8>)> = replayed;
    if let Upstream::Redirect(i) = exec.upstream {
        expected.push(("location", LOCATIONS[i].as_bytes().to_vec()));
    }
    let mut problems = mismatches(&expected, headers);
    for (name, _) in not_replayed {
        if headers.iter().any(|(n, _)| n == name) {
            problems.push(format!("`{name}` was replayed"));
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

/// Each name of `expected` whose values in `headers` are not exactly its
/// values there, byte for byte, in their order.
fn mismatches(expected: &[(&str, Vec<u8>)], headers: &[(String, Vec<u8>)]) -> Vec<String> {
    let shown = |values: &[&[u8]]| -> Vec<String> {
        values
            .iter()
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .collect()
    };
    let mut names: Vec<&str> = expected.iter().map(|(name, _)| *name).collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .filter_map(|name| {
            let want: Vec<&[u8]> = expected
                .iter()
                .filter(|(n, _)| *n == name)
                .map(|(_, v)| v.as_slice())
                .collect();
            let got: Vec<&[u8]> = headers
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice())
                .collect();
            (want != got).then(|| format!("`{name}` is {:?}, not {:?}", shown(&got), shown(&want)))
        })
        .collect()
}

/// The `type` of a problem answer (`None`: not one).
fn problem_type(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(value.get("type")?.as_str()?.to_owned())
}

/// Whether `instance` had a fault on the calls a refusal comes from (its
/// lookups, waits and renewals) in force at some moment between the
/// sequence numbers `from` and `to`, or crashed.
fn faulted(switches: &[Switch], instance: usize, from: u64, to: u64) -> bool {
    let refuses = |f: Option<Fault>| {
        f.is_some_and(|f| {
            [Op::Reserve, Op::Get, Op::Wait, Op::Renew]
                .iter()
                .any(|op| f.hits(*op))
        })
    };
    let mut current = None;
    for switch in switches.iter().filter(|s| s.instance == instance) {
        if switch.at.seq > to {
            break;
        }
        if switch.at.seq < from {
            current = switch.fault;
        } else if switch.crash || refuses(switch.fault) {
            return true;
        }
    }
    refuses(current)
}

pub fn check(schedule: &Schedule, history: &History) -> Vec<Violation> {
    let config = &schedule.config;
    let reqs: HashMap<usize, &Req> = schedule.requests().map(|r| (r.id, r)).collect();
    let mut out = Vec::new();
    let mut flag = |rule, hole, text: String| out.push(Violation { rule, hole, text });

    // The store's clock: virtual for the memory store, real for SQL.
    let real = history.real_clock;
    let t = |s: &Stamp| if real { s.real } else { s.virt };
    let margin = if real {
        Duration::from_millis(5)
    } else {
        Duration::ZERO
    };

    let store = &history.store;
    let acquired: HashMap<usize, &StoreEvent> = store
        .iter()
        .filter(|e| e.op == Op::Reserve && matches!(e.answer, Answer::Acquired(_)))
        .filter_map(|e| e.request.map(|r| (r, e)))
        .collect();
    // The reservations that protected an execution: answered to the engine
    // as acquired, before the execution started. One whose answer a fault
    // replaced, or that committed only after the engine gave up on it (a
    // stall, a late commit: its guard then releases it), protected none:
    // the request ran unprotected, where the route fails open.
    let started: HashMap<usize, u64> = history
        .execs
        .iter()
        .map(|e| (e.request, e.start.seq))
        .collect();
    let held: HashMap<usize, &StoreEvent> = acquired
        .iter()
        .filter(|(_, e)| e.owner.is_some_and(|o| history.answered.contains(&o)))
        .filter(|(r, e)| started.get(r).is_none_or(|&start| e.end.seq < start))
        .map(|(r, e)| (*r, *e))
        .collect();
    let owner_req: HashMap<OwnerToken, usize> = acquired
        .iter()
        .filter_map(|(r, e)| e.owner.map(|o| (o, *r)))
        .collect();
    let execs: HashMap<usize, &Exec> = history.execs.iter().map(|e| (e.id, e)).collect();
    let exec_of_req: HashMap<usize, &Exec> = history.execs.iter().map(|e| (e.request, e)).collect();
    let accepted = |op: Op, owner: OwnerToken| {
        store.iter().filter(move |e| {
            e.op == op && e.owner == Some(owner) && matches!(e.answer, Answer::Done(true))
        })
    };

    // 0. A request runs without holding its key only on a fail-open route,
    //    and only if the engine was never told the key is held: a
    //    reservation that found the record, or a look (a waiter's) that did,
    //    whose answer reached it (one lost to a fault is a store failure,
    //    which fail-open forwards). Forwarded after that, it runs beside the
    //    holder, or after it.
    for exec in &history.execs {
        if held.contains_key(&exec.request) {
            continue;
        }
        let saw_held = history.saw_held.contains(&exec.request);
        if !config.fail_open {
            flag(
                "exclusive",
                None,
                format!("exec {} ran without holding its key (fail closed)", exec.id),
            );
        } else if saw_held {
            flag(
                "exclusive",
                None,
                format!(
                    "exec {} ran unprotected (fail open) after it saw its key held",
                    exec.id
                ),
            );
        }
    }

    // 1. At most one execution per scope, except after its predecessor
    //    legitimately let the key go (an answer that is not stored, a failure
    //    before the head) or was a crashed or stalled owner whose lease ran
    //    out by the store's clock (then only a request with the same
    //    fingerprint may take over). This also rules out two concurrent
    //    executions while the first's lease is live.
    let mut by_scope: HashMap<Scope, Vec<&Exec>> = HashMap::new();
    for exec in &history.execs {
        by_scope
            .entry(scope(reqs[&exec.request]))
            .or_default()
            .push(exec);
    }
    for list in by_scope.values_mut() {
        list.sort_by_key(|e| e.start.seq);
        for j in 1..list.len() {
            let ej = list[j];
            // Unprotected: judged by rule 0.
            let Some(acq_j) = held.get(&ej.request) else {
                continue;
            };
            for &ei in &list[..j] {
                let Some(owner_i) = held.get(&ei.request).and_then(|e| e.owner) else {
                    continue;
                };
                let (bi, bj) = (reqs[&ei.request].body, reqs[&ej.request].body);
                if let Some(done) =
                    accepted(Op::Complete, owner_i).find(|c| c.end.seq < acq_j.start.seq)
                {
                    flag(
                        "exclusive",
                        None,
                        format!(
                            "exec {} ran after exec {}'s response was stored (at {:?})",
                            ej.id, ei.id, done.end.virt
                        ),
                    );
                    continue;
                }
                if accepted(Op::Release, owner_i).any(|r| r.start.seq < acq_j.end.seq) {
                    match ei.upstream {
                        Upstream::ErrBeforeHead => {}
                        Upstream::Answer(_) | Upstream::Redirect(_)
                            if !ei.upstream.stored(config.success_redirects) => {}
                        Upstream::MidBody => flag(
                            "exclusive",
                            Some(5),
                            format!(
                                "exec {} ran again after exec {} had answered its head and \
                                 failed mid-body (the key was released)",
                                ej.id, ei.id
                            ),
                        ),
                        Upstream::Redirect(i) => flag(
                            "exclusive",
                            None,
                            format!(
                                "exec {} ran after exec {} redirected to its success page \
                                 ({}) and was released",
                                ej.id,
                                ei.id,
                                super::sim::LOCATIONS[i]
                            ),
                        ),
                        Upstream::Answer(status) => flag(
                            "exclusive",
                            None,
                            format!(
                                "exec {} ran after exec {} answered {status} and was released",
                                ej.id, ei.id
                            ),
                        ),
                    }
                    continue;
                }
                let refreshed = store
                    .iter()
                    .filter(|e| e.owner == Some(owner_i) && e.start.seq < acq_j.end.seq)
                    .filter(|e| {
                        matches!(
                            (e.op, &e.answer),
                            (Op::Reserve, Answer::Acquired(_)) | (Op::Renew, Answer::Done(true))
                        )
                    })
                    .map(|e| t(&e.start))
                    .max();
                let Some(refreshed) = refreshed else {
                    // `ei` reserved the key only after `ej`'s reservation
                    // was written, and ran first: `ej` ran on a
                    // reservation taken over before its answer arrived.
                    flag(
                        "exclusive",
                        None,
                        format!(
                            "exec {} ran on a reservation that exec {}'s request had taken \
                             over before it started",
                            ej.id, ei.id
                        ),
                    );
                    continue;
                };
                // On the memory store (one exact clock) a lease runs out under
                // a live owner only for a reason: its instance crashed, or a
                // fault hit its renewals or its completion meanwhile. (SQL
                // stores keep real time, which passes while the schedule's
                // clock stands still: there the lease alone decides.)
                let retry = (config.lease / 10).min(Duration::from_secs(1));
                let own_storing = match acquired[&ei.request].answer {
                    Answer::Acquired(owner) => history.storing_faulted.contains(&owner),
                    _ => false,
                };
                let reason = real
                    || excused(
                        &history.switches,
                        ei.instance,
                        (acq_i_start(&acquired, ei), acq_j.end.seq),
                        (refreshed + config.lease / 3, refreshed + config.lease),
                        retry + config.store_timeout,
                        own_storing,
                        &t,
                    );
                if t(&acq_j.end) + margin >= refreshed + config.lease && !reason {
                    flag(
                        "exclusive",
                        None,
                        format!(
                            "exec {} took over exec {}'s lease, which ran out although its \
                             instance neither crashed nor had its renewals (or its storing) failed \
                             long enough",
                            ej.id, ei.id
                        ),
                    );
                    continue;
                }
                if t(&acq_j.end) + margin >= refreshed + config.lease {
                    // A takeover of this very record (no one held the key in
                    // between) needs the same fingerprint.
                    let acq_i = acquired[&ei.request];
                    let direct = !store.iter().any(|a| {
                        a.key == acq_j.key
                            && matches!(a.answer, Answer::Acquired(_))
                            && a.end.seq > acq_i.end.seq
                            && a.end.seq < acq_j.start.seq
                    });
                    if direct && !same_request(bi, bj) {
                        flag(
                            "exclusive",
                            None,
                            format!(
                                "exec {} (body {bj}) took over exec {}'s key (body {bi}): \
                                 a different request",
                                ej.id, ei.id
                            ),
                        );
                    }
                    continue;
                }
                let concurrent = ei.end.is_none_or(|end| end.seq > ej.start.seq);
                flag(
                    "exclusive",
                    None,
                    format!(
                        "exec {} ran{} while exec {}'s lease was live (renewed at {:?}, \
                         lease {:?}, taken at {:?})",
                        ej.id,
                        if concurrent { " concurrently" } else { "" },
                        ei.id,
                        refreshed,
                        config.lease,
                        t(&acq_j.end)
                    ),
                );
            }
        }
    }

    // The first accepted completion of each scope: what must be replayed.
    let mut stored: HashMap<Scope, (&StoreEvent, usize)> = HashMap::new();
    for e in store
        .iter()
        .filter(|e| e.op == Op::Complete && matches!(e.answer, Answer::Done(true)))
    {
        let Some(&req) = e.owner.and_then(|o| owner_req.get(&o)) else {
            continue;
        };
        let entry = stored.entry(scope(reqs[&req])).or_insert((e, req));
        if e.end.seq < entry.0.end.seq {
            *entry = (e, req);
        }
    }

    // The stored response is what its execution answered, byte for byte.
    for (event, req) in stored.values() {
        if let Some(exec) = exec_of_req.get(req) {
            // (A marker without a body, such as "too large", has nothing to
            // compare.)
            if event.body.as_ref().is_some_and(|body| *body != exec.body) {
                flag(
                    "replay",
                    None,
                    format!("exec {}'s stored body is not what it answered", exec.id),
                );
            }
        }
    }

    // 1b. A response is stored only if it consumes the key, as the backend
    //     means it: a 2xx, or a 3xx where the route has no success page,
    //     or a redirect to that page. A redirect back to the form (the
    //     Laravel `old()` flow) or an error answer releases the key, so a
    //     corrected form goes through.
    for e in store
        .iter()
        .filter(|e| e.op == Op::Complete && matches!(e.answer, Answer::Done(true)))
    {
        let Some(exec) = e.request.and_then(|r| exec_of_req.get(&r)) else {
            continue;
        };
        let answered = matches!(exec.upstream, Upstream::Answer(_) | Upstream::Redirect(_));
        if answered && !exec.upstream.stored(config.success_redirects) {
            flag(
                "stored",
                None,
                format!(
                    "exec {}'s answer ({:?}) was stored although it does not consume the key",
                    exec.id, exec.upstream
                ),
            );
        }
    }

    // 2. Answers: replays are byte-identical to the stored response of
    //    their own scope, never answer a different request; direct answers
    //    come from the request's own execution; every request is answered
    //    within its deadline.
    for answered in &history.answers {
        let req = reqs[&answered.request];
        match &answered.seen {
            Seen::Dropped | Seen::Crashed => continue,
            Seen::Hung => {
                flag(
                    "deadline",
                    None,
                    format!("request {} was never answered", req.id),
                );
                continue;
            }
            _ => {}
        }
        let took = answered.at.virt.saturating_sub(answered.sent.virt);
        if took > deadline(config, req) {
            flag(
                "deadline",
                None,
                format!(
                    "request {} took {took:?}, over its deadline {:?}",
                    req.id,
                    deadline(config, req)
                ),
            );
        }
        let Seen::Reply {
            status,
            replayed,
            headers,
            body: Some(body),
        } = &answered.seen
        else {
            continue;
        };
        let Some(exec) = answer_exec_id(body, headers).and_then(|id| execs.get(&id)) else {
            if *replayed {
                flag(
                    "replay",
                    None,
                    format!("request {} got a replay of unknown bytes", req.id),
                );
            }
            continue;
        };
        let origin = reqs[&exec.request];
        if scope(origin) != scope(req) {
            flag(
                "isolation",
                None,
                format!(
                    "request {} (scope {:?}) got exec {}'s answer from scope {:?}",
                    req.id,
                    scope(req),
                    exec.id,
                    scope(origin)
                ),
            );
            continue;
        }
        let expected_status = match exec.upstream {
            Upstream::Answer(s) => s,
            Upstream::Redirect(_) => 303,
            _ => 201,
        };
        if !replayed {
            if exec.request != req.id || *body != exec.body {
                flag(
                    "replay",
                    None,
                    format!(
                        "request {} got exec {}'s answer without a replay mark",
                        req.id, exec.id
                    ),
                );
            } else if status.as_u16() != expected_status {
                flag(
                    "relay",
                    None,
                    format!(
                        "request {}'s own answer (exec {}) came as {status}, the upstream \
                         answered {expected_status}",
                        req.id, exec.id
                    ),
                );
            } else if let Some(text) = relayed_headers(exec, headers) {
                flag(
                    "relay",
                    None,
                    format!("request {}'s own answer (exec {}): {text}", req.id, exec.id),
                );
            }
            continue;
        }
        if *body != exec.body || status.as_u16() != expected_status {
            flag(
                "replay",
                None,
                format!(
                    "request {}'s replay of exec {} is not byte-identical",
                    req.id, exec.id
                ),
            );
        }
        if let Some(text) = replayed_headers(exec, headers) {
            flag(
                "replay",
                None,
                format!("request {}'s replay of exec {}: {text}", req.id, exec.id),
            );
        }
        if !same_request(req.body, origin.body) {
            flag(
                "fingerprint",
                None,
                format!(
                    "request {} (body {}) got a replay of exec {} (body {})",
                    req.id, req.body, exec.id, origin.body
                ),
            );
        }
        match stored.get(&scope(req)) {
            Some((_, first)) if exec_of_req.get(first).map(|e| e.id) == Some(exec.id) => {}
            Some((_, first)) => flag(
                "replay",
                None,
                format!(
                    "request {} got a replay of exec {}, but the stored response is request \
                     {first}'s",
                    req.id, exec.id
                ),
            ),
            None => flag(
                "replay",
                None,
                format!(
                    "request {} got a replay of exec {}, which was never stored",
                    req.id, exec.id
                ),
            ),
        }
    }

    // 3. A release or completion wakes the requests waiting on the key (at
    //    once with the memory store; within one polling step otherwise).
    let slack = if real {
        Duration::from_millis(201)
    } else {
        Duration::from_millis(1)
    };
    for w in store.iter().filter(|e| e.op == Op::Wait) {
        if let Some(e) = store.iter().find(|e| {
            e.key == w.key
                && matches!(e.op, Op::Release | Op::Complete)
                && matches!(e.answer, Answer::Done(true))
                && w.start.seq < e.start.seq
                && e.end.seq < w.end.seq
                && w.end.virt > e.end.virt + slack
        }) {
            flag(
                "wake-up",
                None,
                format!(
                    "a waiter (request {:?}) slept from {:?} to {:?} through a {:?} at {:?}",
                    w.request, w.start.virt, w.end.virt, e.op, e.end.virt
                ),
            );
        }
    }

    // 4. A write is accepted only from the key's current owner.
    for e in store.iter().filter(|e| {
        matches!(e.op, Op::Complete | Op::Release | Op::Renew)
            && matches!(e.answer, Answer::Done(true))
    }) {
        let Some(mine) = store
            .iter()
            .find(|a| a.op == Op::Reserve && e.owner.is_some() && a.owner == e.owner)
        else {
            continue;
        };
        if let Some(next) = store.iter().find(|a| {
            a.op == Op::Reserve
                && a.key == e.key
                && a.owner.is_some()
                && a.owner != e.owner
                // Sent after this owner's reservation was answered: calls
                // that overlap (a commit landing after its error, on a
                // database whose leases run on real time) end in another
                // order than the database ran them.
                && a.start.seq > mine.end.seq
                && a.end.seq < e.start.seq
        }) {
            flag(
                "fencing",
                None,
                format!(
                    "a {:?} by request {:?}'s owner was accepted after request {:?} took the key",
                    e.op,
                    owner_req.get(&e.owner.unwrap()),
                    next.request
                ),
            );
        }
    }

    // 1c. An execution starts only while its reservation is its own: no
    //     other owner acquired the key between this one's acquisition and
    //     the execution's start (a late answer, or a late confirmation, run
    //     beside its taker). On the memory store only: on a SQL store real
    //     time passes while the schedule's clock stands still, and there the
    //     lease alone decides.
    if !real {
        for exec in &history.execs {
            let Some(acq) = held.get(&exec.request) else {
                continue;
            };
            let taken = store.iter().find(|l| {
                l.op == Op::Reserve
                    && l.key == acq.key
                    && l.owner != acq.owner
                    && matches!(l.answer, Answer::Acquired(_))
                    && l.end.seq > acq.end.seq
                    && l.end.seq < exec.start.seq
            });
            if let Some(taken) = taken {
                flag(
                    "exclusive",
                    None,
                    format!(
                        "exec {} started after request {:?} had taken its key over",
                        exec.id, taken.request
                    ),
                );
            }
        }
    }

    // 6. A request refused with 503 ("not executed") leaves nothing behind:
    //    a reservation it committed before it gave up (the store answered
    //    too late) must not hold the key against the next request. The
    //    engine releases it at once, and once more when the abandoned call
    //    ends (if it ends within a lease). Once that release has run (the
    //    first after the reservation landed; or, with none, from the
    //    refusal, or from the end of the call for a commit that landed
    //    after it) no reservation may meet the orphan. Excused: a crashed
    //    instance, a fault on releases (the orphan could not be released),
    //    and a late commit whose call the engine stopped waiting for (its
    //    own lease bounds it).
    let answer_of: HashMap<usize, &super::sim::Answered> =
        history.answers.iter().map(|a| (a.request, a)).collect();
    for (&q, a) in &acquired {
        if exec_of_req.contains_key(&q) {
            continue;
        }
        let Some(refused) = answer_of.get(&q) else {
            continue;
        };
        let Seen::Reply { status, .. } = &refused.seen else {
            continue;
        };
        if status.as_u16() != 503 {
            continue;
        }
        // From when on nothing may meet the orphan.
        let release = store
            .iter()
            .find(|e| e.op == Op::Release && e.owner == a.owner && e.start.seq > a.end.seq);
        // A call that failed at once and committed later (`ErrorThenCommit`)
        // is released a second time `store_timeout` after the first release
        // ends (`release_lost`): until then the orphan may stand.
        let mut due = None;
        let from = if a.end.seq < refused.at.seq {
            refused.at.seq
        } else {
            let Some(end) = a.owner.and_then(|o| history.reserve_ends.get(&o)) else {
                continue;
            };
            if end.seq < a.start.seq {
                let first = store
                    .iter()
                    .find(|e| e.op == Op::Release && e.owner == a.owner && e.start.seq >= end.seq);
                // Only a first release that ran before the commit landed
                // leaves the orphan to the second; one after it must free it.
                if first.is_none_or(|r| r.start.seq < a.start.seq) {
                    let first_end = first.map_or(end.virt + config.store_timeout, |r| r.end.virt);
                    due = Some(first_end + config.store_timeout);
                }
            }
            end.seq
        };
        // On a SQL store, a release bounded by `store_timeout` may be cut by
        // the schedule's clock (it advances while the database's call runs
        // in real time) before it reaches the store: judged on the memory
        // store, where no call takes virtual time.
        if real && release.is_none() {
            continue;
        }
        let settled = release.map_or(from, |release| release.end.seq.max(from));
        let met = store.iter().find(|e| {
            e.op == Op::Reserve
                && e.key == a.key
                && matches!(e.answer, Answer::Existing)
                && e.start.seq > settled
                && due.is_none_or(|due| e.start.virt > due)
                // A late commit of a request already answered (a ghost:
                // nobody acts on what it met).
                && e.request.and_then(|r| answer_of.get(&r)).is_none_or(|x| x.at.seq > e.start.seq)
                // The orphan was not released before (then it met another
                // record) ...
                && !accepted(Op::Release, a.owner.expect("acquired"))
                    .any(|r| r.end.seq < e.start.seq)
                // ... and no later reservation (even one still under way,
                // whose row a database may hold already) could be the one
                // it met.
                && !store.iter().any(|l| {
                    l.key == a.key
                        && matches!(l.answer, Answer::Acquired(_))
                        && l.end.seq > a.end.seq
                        && l.start.seq < e.end.seq
                })
                && !excused_release(&history.switches, a.instance, refused.at.seq, e.end.seq)
        });
        if let Some(e) = met {
            flag(
                "orphan",
                None,
                format!(
                    "request {:?}'s reservation met the one request {q} committed before it \
                     was refused with 503 (the orphan was not released)",
                    e.request
                ),
            );
        }
    }

    // 7. Refusals are earned: "store unavailable" (503) only when the
    //    engine's own calls to the store could fail. On the memory store
    //    (which neither fails nor stalls by itself) a request whose
    //    instance had no fault on its lookups or renewals in force from its
    //    sending to its answer, and did not crash, gets no 503. (A real
    //    database can time out under load by itself: not judged there. A
    //    request a lying store answered with another key's record, the
    //    mutation, is excused: a sealed engine refuses that record.)
    for answered in history.answers.iter().filter(|_| !real) {
        let Seen::Reply { status, body, .. } = &answered.seen else {
            continue;
        };
        let req = reqs[&answered.request];
        if status.as_u16() != 503
            || body.as_deref().and_then(problem_type).as_deref()
                != Some("urn:tower-idempotency:store-unavailable")
            || history.substituted.contains(&req.id)
        {
            continue;
        }
        if !faulted(
            &history.switches,
            answered.instance,
            answered.sent.seq,
            answered.at.seq,
        ) {
            flag(
                "refusal-earned",
                None,
                format!(
                    "request {} was refused with 503 although its instance's store had \
                     no fault on its lookups or renewals from its sending to its answer",
                    req.id
                ),
            );
        }
    }

    // 9b. Conflicts are earned, judged against the record the request's
    //     last lookup (reserve or get) could have met: a reservation of its
    //     key by another owner, started before that lookup ended, that no
    //     later reservation of the key had replaced before the lookup began
    //     (several may qualify when calls overlap). "In flight" (409) only
    //     if such a reservation was neither completed nor released before
    //     the lookup began; "key mismatch" (422) only if one, not released
    //     before it, was for a body that differs in more than whitespace;
    //     "response incomplete" (409) only if a mid-body break of the key
    //     was stored (its owner's completion accepted) before the answer.
    //     On the memory store only: with a real clock, leases and
    //     retention run while the schedule's clock stands still, and calls
    //     overlap in ways the sequence numbers do not order.
    let acquisitions: Vec<&StoreEvent> = store
        .iter()
        .filter(|e| e.op == Op::Reserve && matches!(e.answer, Answer::Acquired(_)))
        .collect();
    let done_by = |owner: OwnerToken, op: Op, before: u64| {
        accepted(op, owner).any(move |e| e.end.seq < before)
    };
    for answered in history.answers.iter().filter(|_| !real) {
        let Seen::Reply {
            body: Some(body), ..
        } = &answered.seen
        else {
            continue;
        };
        let Some(problem) = problem_type(body) else {
            continue;
        };
        let req = reqs[&answered.request];
        if history.substituted.contains(&req.id) {
            continue;
        }
        let Some(lookup) = store
            .iter()
            .filter(|e| e.request == Some(req.id) && matches!(e.op, Op::Reserve | Op::Get))
            .filter(|e| e.start.seq < answered.at.seq)
            .max_by_key(|e| e.start.seq)
        else {
            continue;
        };
        let key = lookup.key;
        // Only a record of the same caller's key could make it so: the
        // checker's own scope, never the engine's key, is the judge (a key
        // two callers share would otherwise earn one of them the other's
        // 409 or 422).
        let same_scope = |a: &StoreEvent| a.request.is_none_or(|r| scope(reqs[&r]) == scope(req));
        let met: Vec<&StoreEvent> = acquisitions
            .iter()
            .copied()
            .filter(|a| a.key == key && a.request != Some(req.id) && same_scope(a))
            .filter(|a| a.start.seq < lookup.end.seq)
            .filter(|a| {
                !acquisitions.iter().any(|b| {
                    b.key == key
                        && b.owner != a.owner
                        && b.start.seq > a.end.seq
                        && b.end.seq < lookup.start.seq
                })
            })
            .collect();
        let owner = |a: &StoreEvent| a.owner.expect("acquired");
        let earned = match problem.as_str() {
            "urn:tower-idempotency:in-flight" => met.iter().any(|a| {
                !done_by(owner(a), Op::Complete, lookup.start.seq)
                    && !done_by(owner(a), Op::Release, lookup.start.seq)
            }),
            // Whitespace aside (README: the JSON fingerprint ignores it),
            // any other body may be another request.
            "urn:tower-idempotency:key-mismatch" => {
                let bare = |i: usize| BODIES[i].replace(' ', "");
                met.iter().any(|a| {
                    !done_by(owner(a), Op::Release, lookup.start.seq)
                        && a.request
                            .is_some_and(|r| bare(reqs[&r].body) != bare(req.body))
                })
            }
            "urn:tower-idempotency:response-incomplete" => history.execs.iter().any(|e| {
                e.upstream == Upstream::MidBody
                    && acquired.get(&e.request).is_some_and(|a| {
                        a.key == key
                            && same_scope(a)
                            && done_by(owner(a), Op::Complete, answered.at.seq)
                    })
            }),
            // Histories send no answer too large to store, nor a coded one:
            // the marker is earned only by its owner's storing having met a
            // fault (the engine falls back to it after about a lease).
            "urn:tower-idempotency:response-not-stored" => history.execs.iter().any(|e| {
                acquired.get(&e.request).is_some_and(|a| {
                    a.key == key
                        && same_scope(a)
                        && done_by(owner(a), Op::Complete, answered.at.seq)
                        && history.storing_faulted.contains(&owner(a))
                })
            }),
            _ => true,
        };
        if !earned {
            flag(
                "conflict-earned",
                None,
                format!(
                    "request {} was answered `{problem}` although no record its last lookup \
                     could have met made its key so",
                    req.id
                ),
            );
        }
    }

    // 5. No key stays in flight once its owner is gone and its lease passed.
    for stuck in &history.stuck {
        flag("stuck", None, stuck.clone());
    }
    out
}
