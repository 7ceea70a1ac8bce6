//! The configuration file (`--config idempotency.toml`).
//!
//! Four parts, all optional:
//!
//! * `[proxy]`: where to listen, the upstream, the store, timeouts
//!   ([`ProxySettings`]); every command-line flag overrides its key here;
//! * `[secrets]`: where the key secret and the encryption keys are read
//!   from, environment variables or files ([`SecretsSettings`]);
//! * `[defaults]`: a [`Policy`] applied to every route (any policy key);
//! * `[outbox]` and `[[outbox.destination]]`: outbox workers
//!   (`crate::outbox::config`);
//! * `[[route]]`: `path` (a prefix such as `/orders`, or a glob with `*` /
//!   `**`), `enabled` (alias `idempotency`; `false` leaves matching paths as
//!   plain passthrough) and any policy key, overriding `[defaults]`.
//!
//! Routes are tried in file order; the first whose path and methods match
//! decides (see [`Routes`]). A top-level `case_insensitive_paths = true`
//! routes and scopes paths without regard to ASCII case.
//! Without any `[[route]]`, `[defaults]` covers every path.
//!
//! The policy keys are exactly [`Policy`]'s fields: this module only merges
//! tables and reports errors. Every mistake is refused at start with the
//! file, the line and the key at fault.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;
use tower_idempotency::policy::PathPattern;
use tower_idempotency::{EngineConfig, Policy, PolicyError, Routes};

use crate::outbox::config::{OutboxFile, OutboxSettings};
use crate::secrets::SecretsSettings;

/// The `[proxy]` table. Every key is optional; the command line overrides
/// it, and [`ProxySettings::resolve`] fills in the defaults.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxySettings {
    /// Where clients connect (`--listen`).
    pub listen: Option<String>,
    /// The backend, `http://host:port` (`--upstream`).
    pub upstream: Option<String>,
    /// `memory`, `sqlite://PATH` or `postgres://URL` (`--store`).
    pub store: Option<String>,
    /// A Redis front cache, `redis://URL` (`--redis`).
    pub redis: Option<String>,
    /// Prepended to every Redis key, before the store's own id
    /// (`--redis-prefix`; default `idem:`).
    pub redis_prefix: Option<String>,
    /// The admin listener for `/healthz` and `/metrics` (`--admin`).
    pub admin: Option<String>,
    /// A file holding the operator API's bearer token (the environment
    /// variable `IDEMPOTENCY_ADMIN_TOKEN` takes precedence). Never a flag.
    pub admin_token_file: Option<PathBuf>,
    /// How long connecting to the upstream may take (502 after it).
    #[serde(default, with = "humantime_serde::option")]
    pub connect_timeout: Option<Duration>,
    /// The longest silence while reading the upstream's answer (504 before
    /// the response head, an aborted response after it).
    #[serde(default, with = "humantime_serde::option")]
    pub read_timeout: Option<Duration>,
    /// The longest a write to the upstream may stall.
    #[serde(default, with = "humantime_serde::option")]
    pub write_timeout: Option<Duration>,
    /// How long an idle upstream connection is kept for reuse.
    #[serde(default, with = "humantime_serde::option")]
    pub idle_timeout: Option<Duration>,
    /// The longest any single store call may take (then 503).
    #[serde(default, with = "humantime_serde::option")]
    pub store_timeout: Option<Duration>,
    /// The longest a client may take to send a covered request's body, in
    /// total (then 408, nothing reserved): a slow trickle cannot hold a
    /// connection for ever.
    #[serde(default, with = "humantime_serde::option")]
    pub body_timeout: Option<Duration>,
    /// On SIGTERM, how long in-flight requests may take to finish.
    #[serde(default, with = "humantime_serde::option")]
    pub shutdown_timeout: Option<Duration>,
    /// How often expired records are swept.
    #[serde(default, with = "humantime_serde::option")]
    pub sweep_interval: Option<Duration>,
    /// Worker threads for the proxy (default: one per CPU).
    pub threads: Option<usize>,
    /// The most bytes of covered request bodies buffered at once (then
    /// 503 `overloaded`, body unread).
    pub max_buffered_bytes: Option<u64>,
    /// With `--store memory`: the most live records it holds (then new
    /// keys get 503).
    pub memory_max_records: Option<usize>,
    /// With `--store memory`: the most bytes of stored responses and
    /// bookkeeping it holds (then new keys get 503).
    pub memory_max_bytes: Option<usize>,
}

/// [`ProxySettings`] with every default applied.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// Where clients connect.
    pub listen: String,
    /// The backend URL.
    pub upstream: Option<String>,
    /// The store URL.
    pub store: String,
    /// The Redis URL, if any.
    pub redis: Option<String>,
    /// The Redis key prefix, if not the default.
    pub redis_prefix: Option<String>,
    /// The admin address, if any.
    pub admin: Option<String>,
    /// The admin token's file, if any.
    pub admin_token_file: Option<PathBuf>,
    /// Upstream connect timeout (default 5 s).
    pub connect_timeout: Duration,
    /// Upstream read timeout (default 60 s).
    pub read_timeout: Duration,
    /// Upstream write timeout (default 60 s).
    pub write_timeout: Duration,
    /// Idle upstream connection lifetime (default 60 s).
    pub idle_timeout: Duration,
    /// Store call timeout (default 5 s).
    pub store_timeout: Duration,
    /// Deadline for reading a covered request's body (default 30 s).
    pub body_timeout: Duration,
    /// Drain time on SIGTERM (default 30 s).
    pub shutdown_timeout: Duration,
    /// Sweep period (default 60 s).
    pub sweep_interval: Duration,
    /// Proxy worker threads.
    pub threads: usize,
    /// Buffered covered bodies, in bytes (default 64 MiB).
    pub max_buffered_bytes: u64,
    /// The memory store's ceilings, records and bytes (defaults:
    /// `MemoryStore`'s, 100,000 and 256 MiB); `None` where not set.
    pub memory_max_records: Option<usize>,
    /// See `memory_max_records`.
    pub memory_max_bytes: Option<usize>,
}

/// The default store: an SQLite file in the working directory.
pub const DEFAULT_STORE: &str = "sqlite://idempotency.db";

impl ProxySettings {
    /// Keys set in `over` replace those in `self`.
    pub fn overridden_by(self, over: ProxySettings) -> ProxySettings {
        ProxySettings {
            listen: over.listen.or(self.listen),
            upstream: over.upstream.or(self.upstream),
            store: over.store.or(self.store),
            redis: over.redis.or(self.redis),
            redis_prefix: over.redis_prefix.or(self.redis_prefix),
            admin: over.admin.or(self.admin),
            admin_token_file: over.admin_token_file.or(self.admin_token_file),
            connect_timeout: over.connect_timeout.or(self.connect_timeout),
            read_timeout: over.read_timeout.or(self.read_timeout),
            write_timeout: over.write_timeout.or(self.write_timeout),
            idle_timeout: over.idle_timeout.or(self.idle_timeout),
            store_timeout: over.store_timeout.or(self.store_timeout),
            body_timeout: over.body_timeout.or(self.body_timeout),
            shutdown_timeout: over.shutdown_timeout.or(self.shutdown_timeout),
            sweep_interval: over.sweep_interval.or(self.sweep_interval),
            threads: over.threads.or(self.threads),
            max_buffered_bytes: over.max_buffered_bytes.or(self.max_buffered_bytes),
            memory_max_records: over.memory_max_records.or(self.memory_max_records),
            memory_max_bytes: over.memory_max_bytes.or(self.memory_max_bytes),
        }
    }

    /// Applies the defaults.
    pub fn resolve(self) -> Resolved {
        let secs = Duration::from_secs;
        Resolved {
            listen: self.listen.unwrap_or_else(|| "127.0.0.1:8080".into()),
            upstream: self.upstream,
            store: self.store.unwrap_or_else(|| DEFAULT_STORE.into()),
            redis: self.redis,
            redis_prefix: self.redis_prefix,
            admin: self.admin,
            admin_token_file: self.admin_token_file,
            connect_timeout: self.connect_timeout.unwrap_or(secs(5)),
            read_timeout: self.read_timeout.unwrap_or(secs(60)),
            write_timeout: self.write_timeout.unwrap_or(secs(60)),
            idle_timeout: self.idle_timeout.unwrap_or(secs(60)),
            store_timeout: self.store_timeout.unwrap_or(secs(5)),
            body_timeout: self.body_timeout.unwrap_or(secs(30)),
            shutdown_timeout: self.shutdown_timeout.unwrap_or(secs(30)),
            sweep_interval: self.sweep_interval.unwrap_or(secs(60)),
            max_buffered_bytes: self
                .max_buffered_bytes
                .unwrap_or(EngineConfig::default().max_buffered_bytes),
            threads: self.threads.filter(|&n| n > 0).unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            }),
            memory_max_records: self.memory_max_records,
            memory_max_bytes: self.memory_max_bytes,
        }
    }
}

impl Resolved {
    /// Refuses settings the proxy cannot run with: a zero `store_timeout`
    /// fails every store call (503 everywhere), a zero `sweep_interval`
    /// stops the sweeper for good, zero upstream or body timeouts fail
    /// every exchange, a zero `shutdown_timeout` abandons every request in
    /// flight at SIGTERM; and any duration over 100 years, which overflows
    /// the clock it is added to (a SIGTERM panicked on a huge
    /// `shutdown_timeout`, with no drain); and a zero
    /// `max_buffered_bytes`, which refuses every covered request's body.
    pub fn check(&self) -> Result<(), String> {
        const MAX: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
        if self.max_buffered_bytes == 0 {
            return Err(
                "`max_buffered_bytes` (in [proxy]) must be more than zero, e.g. 67108864".into(),
            );
        }
        let memory = [
            ("memory_max_records", self.memory_max_records, "100000"),
            ("memory_max_bytes", self.memory_max_bytes, "268435456"),
        ];
        for (name, value, example) in memory {
            if value.is_some() && self.store != "memory" {
                return Err(format!(
                    "`{name}` (in [proxy]) sizes the memory store, but the store is `{}`: \
                     remove it, or use --store memory",
                    self.store.split(':').next().unwrap_or_default()
                ));
            }
            if value == Some(0) {
                return Err(format!(
                    "`{name}` (in [proxy]) must be more than zero, e.g. {example}"
                ));
            }
        }
        let durations = [
            ("store_timeout", self.store_timeout),
            ("sweep_interval", self.sweep_interval),
            ("connect_timeout", self.connect_timeout),
            ("read_timeout", self.read_timeout),
            ("write_timeout", self.write_timeout),
            ("body_timeout", self.body_timeout),
            ("shutdown_timeout", self.shutdown_timeout),
        ];
        if let Some((name, _)) = durations.iter().find(|(_, value)| value.is_zero()) {
            return Err(format!(
                "`{name}` (in [proxy] or its flag) must be longer than zero, e.g. \"5s\""
            ));
        }
        let idle = [("idle_timeout", self.idle_timeout)];
        let mut bounded = durations.iter().chain(&idle);
        match bounded.find(|(_, value)| *value > MAX) {
            Some((name, _)) => Err(format!(
                "`{name}` (in [proxy] or its flag) must be at most 100 years"
            )),
            None => Ok(()),
        }
    }
}

/// A loaded configuration file.
#[derive(Debug, Default)]
pub struct Config {
    /// The `[proxy]` table.
    pub proxy: ProxySettings,
    /// The `[secrets]` table.
    pub secrets: SecretsSettings,
    /// The route table, in file order.
    pub routes: Routes,
    /// `[outbox]`: outbox workers to run, if configured.
    pub outbox: Option<OutboxSettings>,
}

impl Config {
    /// The configuration used without `--config`: the default policy on
    /// every path.
    pub fn builtin() -> Self {
        Config {
            proxy: ProxySettings::default(),
            secrets: SecretsSettings::default(),
            routes: Routes::all(Policy::default()).expect("the default policy is valid"),
            outbox: None,
        }
    }

    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError {
            file: path.to_owned(),
            line: None,
            message: format!("cannot read the file: {error}"),
        })?;
        Self::parse(&text).map_err(|(line, message)| ConfigError {
            file: path.to_owned(),
            line,
            message,
        })
    }

    /// Parses a configuration text; an error carries its line (1-based)
    /// where one is known.
    pub fn parse(text: &str) -> Result<Self, (Option<usize>, String)> {
        let file: File = toml::from_str(text).map_err(|error| {
            let message = explain(error.message().trim());
            match error.span() {
                // Name the key on the line at fault, as policy errors do.
                Some(span) => {
                    let line = line_of(text, span.start);
                    let message = match key_on_line(text, line) {
                        Some(key) if !message.contains(&format!("`{key}`")) => {
                            format!("`{key}`: {message}")
                        }
                        _ => message,
                    };
                    (Some(line), message)
                }
                None => (None, message),
            }
        })?;
        let at = |span: &Range<usize>, message: String| (Some(line_of(text, span.start)), message);
        // The outbox's shutdown must fit in the process's.
        let shutdown_timeout = file
            .proxy
            .clone()
            .unwrap_or_default()
            .resolve()
            .shutdown_timeout;
        let outbox = file
            .outbox
            .map(|outbox| outbox.check(text, shutdown_timeout))
            .transpose()?;

        // `[defaults]` alone must be a valid policy, reported at its own lines.
        let defaults = file.defaults.unwrap_or_default();
        let base: Entries = defaults
            .into_iter()
            .map(|(k, v)| (k.into_inner(), v))
            .collect();
        let default_policy = policy_of(&base).map_err(|(span, msg)| at(&span, msg))?;
        if let Err(error) = default_policy.validate() {
            let span = base.get(error.field).map(Spanned::span);
            return Err((
                span.map(|s| line_of(text, s.start)),
                defaults_message(&error),
            ));
        }

        let mut routes = Routes::new();
        if file.route.is_empty() {
            routes = Routes::all(default_policy).map_err(|e| (None, defaults_message(&e)))?;
        }
        // Earlier routes that leave their paths alone: (pattern, line).
        let mut exclusions: Vec<(String, usize)> = Vec::new();
        // The enabled routes so far, with the methods each covers.
        let mut covering: Vec<(String, usize, Vec<String>)> = Vec::new();
        for route in &file.route {
            let route_span = route.span();
            let mut entries = base.clone();
            let mut path: Option<Spanned<String>> = None;
            let mut enabled = true;
            let mut switch: Option<&str> = None;
            // The route's first own setting (beside `path` and `enabled`).
            let mut own: Option<(String, std::ops::Range<usize>)> = None;
            for (key, value) in route.get_ref() {
                match key.get_ref().as_str() {
                    "path" => match value.get_ref() {
                        toml::Value::String(s) => {
                            path = Some(Spanned::new(value.span(), s.clone()))
                        }
                        _ => return Err(at(&value.span(), "`path` must be a string".into())),
                    },
                    name @ ("enabled" | "idempotency") => match value.get_ref() {
                        // One switch under two names: given both, which
                        // one won was the file's key order.
                        _ if switch.is_some() => {
                            return Err(at(
                                &value.span(),
                                "`enabled` and `idempotency` are one switch: give one".into(),
                            ))
                        }
                        toml::Value::Boolean(b) => {
                            enabled = *b;
                            switch = Some(name);
                        }
                        _ => {
                            return Err(at(
                                &value.span(),
                                format!("`{}` must be true or false", key.get_ref()),
                            ))
                        }
                    },
                    other => {
                        own.get_or_insert((other.to_owned(), value.span()));
                        entries.insert(other.to_owned(), value.clone());
                    }
                }
            }
            let Some(path) = path else {
                return Err(at(&route_span, "a [[route]] needs a `path`".into()));
            };
            // A route that leaves its paths alone does so for every method:
            // a `methods` (or any setting) beside `enabled = false` reads as
            // if it narrowed that, and would be silently ignored.
            if let (false, Some((key, span))) = (enabled, &own) {
                return Err(at(
                    span,
                    format!(
                        "route `{}` has `enabled = false`, which leaves every method of its \
                         paths alone: `{key}` has no effect there; remove it (to leave only \
                         some methods alone, list the others in a route's `methods`)",
                        path.get_ref()
                    ),
                ));
            }
            let unreachable = enabled
                .then(|| shadowing(&exclusions, path.get_ref(), file.case_insensitive_paths));
            if let Some(Some((earlier, line))) = unreachable {
                return Err(at(
                    &path.span(),
                    format!(
                        "route `{}` can never apply: the route `{earlier}` (line {line}) before \
                         it leaves every path under it alone; list `{}` first",
                        path.get_ref(),
                        path.get_ref()
                    ),
                ));
            }
            let own_path_left = enabled.then(|| {
                deciding_its_own_path(&exclusions, path.get_ref(), file.case_insensitive_paths)
            });
            if let Some(Some((earlier, line))) = own_path_left {
                return Err(at(
                    &path.span(),
                    format!(
                        "route `{0}` never applies to `{0}` itself: the route `{earlier}` (line \
                         {line}) before it leaves that path alone; list `{0}` first",
                        path.get_ref()
                    ),
                ));
            }
            if !enabled {
                exclusions.push((path.get_ref().clone(), line_of(text, path.span().start)));
            }
            let policy = policy_of(&entries).map_err(|(span, msg)| at(&span, msg))?;
            if enabled {
                // The first route matching a request's path and method
                // decides: one before it covering all its paths for all its
                // methods leaves it nothing (its `principal`, its
                // `required` never applied).
                let methods: Vec<String> = policy
                    .methods
                    .iter()
                    .map(|m| m.to_ascii_uppercase())
                    .collect();
                // And one covering all its paths for some of its methods
                // leaves it those methods: its settings never apply to them.
                let mut hidden: Vec<(&str, String, usize)> = Vec::new();
                for method in &methods {
                    let earlier: Vec<(String, usize)> = covering
                        .iter()
                        .filter(|(_, _, earlier)| earlier.contains(method))
                        .map(|(earlier, line, _)| (earlier.clone(), *line))
                        .collect();
                    let ci = file.case_insensitive_paths;
                    if let Some((earlier, line)) = shadowing(&earlier, path.get_ref(), ci) {
                        hidden.push((method, earlier.clone(), *line));
                    } else if let Some((earlier, line)) =
                        deciding_its_own_path(&earlier, path.get_ref(), ci)
                    {
                        // `/api/*` before `/api/pay`: the deeper paths
                        // reach it, its own path never does.
                        return Err(at(
                            &path.span(),
                            format!(
                                "route `{0}` never applies to `{0}` itself for {method}: the \
                                 route `{earlier}` (line {line}) before it decides that path; \
                                 list `{0}` first",
                                path.get_ref()
                            ),
                        ));
                    }
                }
                if let Some((_, earlier, line)) = hidden.first() {
                    let which = match hidden.len() == methods.len() {
                        true => "can never apply".to_owned(),
                        false => {
                            let names: Vec<&str> = hidden.iter().map(|h| h.0).collect();
                            format!("never applies to {}", names.join(", "))
                        }
                    };
                    return Err(at(
                        &path.span(),
                        format!(
                            "route `{}` {which}: the route `{earlier}` (line {line}) before it \
                             covers every path under it for {}; list `{}` first",
                            path.get_ref(),
                            match hidden.len() {
                                1 => "that method",
                                _ => "those methods",
                            },
                            path.get_ref()
                        ),
                    ));
                }
                let line = line_of(text, path.span().start);
                covering.push((path.get_ref().clone(), line, methods));
            }
            let result = if enabled {
                routes.route(path.get_ref(), policy)
            } else {
                routes.exclude(path.get_ref())
            };
            routes = result.map_err(|error| {
                let span = match error.field {
                    "path" => path.span(),
                    field => entries.get(field).map_or(route_span.clone(), Spanned::span),
                };
                at(&span, format!("route `{}`: {error}", path.get_ref()))
            })?;
        }
        Ok(Config {
            proxy: file.proxy.unwrap_or_default(),
            secrets: file.secrets.unwrap_or_default(),
            routes: routes.case_insensitive(file.case_insensitive_paths),
            outbox,
        })
    }
}

/// The earlier exclusion (pattern, line) that leaves every path `pattern`
/// matches alone, if one does, judged by the engine's own matcher on
/// paths standing for all that `pattern` matches: a prefix itself and a
/// path three segments under it, a glob with each `*` one segment and
/// each `**` one and three. Their segments are `%`, which no pattern holds
/// (escapes are refused), so only an exclusion's wildcard or prefix
/// matches them: `/api/**` or `/api` leaves `/api/pay` alone, `/api/*`
/// only `/api/pay` itself. Under `case_insensitive_paths`, in any case.
fn shadowing<'e>(
    exclusions: &'e [(String, usize)],
    pattern: &str,
    case_insensitive: bool,
) -> Option<&'e (String, usize)> {
    let samples = match pattern.contains('*') {
        // `**` as one segment and as three: an exclusion of a fixed depth
        // (`/api/*/*/*`) leaves some of a `/api/**` route's paths alone,
        // never all.
        true => vec![
            pattern.replace("**", "%").replace('*', "%"),
            pattern.replace("**", "%/%/%").replace('*', "%"),
        ],
        false => vec![
            format!("{}/%/%/%", pattern.trim_end_matches('/')),
            pattern.to_owned(),
        ],
    };
    first_matching_all(exclusions, &samples, case_insensitive)
}

/// The earliest of `earlier` that matches a prefix pattern's own path
/// (`/api/*` for `/api/pay`), when `pattern` is a prefix: that route then
/// decides the path the later route is named for. `None` for a glob.
fn deciding_its_own_path<'e>(
    earlier: &'e [(String, usize)],
    pattern: &str,
    case_insensitive: bool,
) -> Option<&'e (String, usize)> {
    match pattern.contains('*') {
        true => None,
        false => first_matching_all(earlier, &[pattern.to_owned()], case_insensitive),
    }
}

/// The first of `earlier` (pattern, line) whose pattern matches every one
/// of `paths`, by the engine's own matcher; under `case_insensitive_paths`
/// patterns and paths are compared in one case, as the engine routes them.
fn first_matching_all<'e>(
    earlier: &'e [(String, usize)],
    paths: &[String],
    case_insensitive: bool,
) -> Option<&'e (String, usize)> {
    let fold = |p: &str| match case_insensitive {
        true => p.to_ascii_lowercase(),
        false => p.to_owned(),
    };
    let paths: Vec<String> = paths.iter().map(|path| fold(path)).collect();
    earlier.iter().find(|(earlier, _)| {
        PathPattern::parse(&fold(earlier))
            .is_ok_and(|earlier| paths.iter().all(|path| earlier.matches(path)))
    })
}

fn defaults_message(error: &PolicyError) -> String {
    format!("[defaults]: {error}")
}

type Entries = BTreeMap<String, Spanned<toml::Value>>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    /// Route and scope paths without regard to ASCII case
    /// ([`Routes::case_insensitive`]).
    #[serde(default)]
    case_insensitive_paths: bool,
    proxy: Option<ProxySettings>,
    secrets: Option<SecretsSettings>,
    defaults: Option<BTreeMap<Spanned<String>, Spanned<toml::Value>>>,
    #[serde(default)]
    route: Vec<Spanned<BTreeMap<Spanned<String>, Spanned<toml::Value>>>>,
    /// Outbox workers (`crate::outbox::config`).
    outbox: Option<OutboxFile>,
}

/// Deserializes a [`Policy`] from merged entries. Each key is first tried
/// alone, so an error names the key at fault and its span.
fn policy_of(entries: &Entries) -> Result<Policy, (Range<usize>, String)> {
    for (key, value) in entries {
        let mut single = toml::Table::new();
        single.insert(key.clone(), value.get_ref().clone());
        if let Err(error) = toml::Value::Table(single).try_into::<Policy>() {
            let message = explain(error.message().trim());
            return Err((value.span(), format!("`{key}`: {message}")));
        }
    }
    let table: toml::Table = entries
        .iter()
        .map(|(k, v)| (k.clone(), v.get_ref().clone()))
        .collect();
    toml::Value::Table(table)
        .try_into::<Policy>()
        .map_err(|error| (0..0, error.message().trim().to_owned()))
}

pub(crate) fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The key assigned on `line` (1-based), if the line is `key = value`.
fn key_on_line(text: &str, line: usize) -> Option<&str> {
    let (key, _) = text.lines().nth(line.checked_sub(1)?)?.split_once('=')?;
    let key = key.trim().trim_matches('"');
    (!key.is_empty() && !key.starts_with('[') && !key.contains(char::is_whitespace)).then_some(key)
}

/// A deserializer's message with what the value should look like, where
/// the message alone leaves a newcomer guessing.
fn explain(message: &str) -> String {
    let hint = if message.contains("duration") {
        Some("write a quoted duration with its unit, e.g. \"30s\", \"500ms\", \"10m\"")
    } else if message.contains("variant") && message.contains("header") {
        Some(
            "a key source is a table: key = { header = \"Idempotency-Key\" }, \
             { form_field = \"…\" }, { json_pointer = \"/…\" } or { query = \"…\" }",
        )
    } else if message.contains("invalid type: string")
        && ["integer", "usize", "u16", "u32", "u64", "i64"]
            .iter()
            .any(|number| message.contains(&format!("expected {number}")))
    {
        Some("write the number without quotes")
    } else {
        None
    };
    match hint {
        Some(hint) => format!("{message} ({hint})"),
        None => message.to_owned(),
    }
}

/// A configuration file that was refused: where, and why.
#[derive(Debug)]
pub struct ConfigError {
    file: PathBuf,
    line: Option<usize>,
    message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use tower_idempotency::engine::{Coverage, RequestHead};

    fn error(text: &str) -> (Option<usize>, String) {
        Config::parse(text).expect_err("the config should be refused")
    }

    #[test]
    fn a_zero_timeout_or_interval_is_refused_naming_it() {
        let config =
            Config::parse("[proxy]\nupstream = \"http://a:1\"\nsweep_interval = \"0s\"\n").unwrap();
        let message = config.proxy.clone().resolve().check().unwrap_err();
        assert!(message.contains("`sweep_interval`"), "{message}");
        let config =
            Config::parse("[proxy]\nupstream = \"http://a:1\"\nstore_timeout = \"0s\"\n").unwrap();
        let message = config.proxy.clone().resolve().check().unwrap_err();
        assert!(message.contains("`store_timeout`"), "{message}");
        let config = Config::parse("[proxy]\nupstream = \"http://a:1\"\n").unwrap();
        assert_eq!(config.proxy.clone().resolve().check(), Ok(()));
        // No budget refuses every covered body (from a review of
        // operations): refused at start like a zero timeout.
        let config =
            Config::parse("[proxy]\nupstream = \"http://a:1\"\nmax_buffered_bytes = 0\n").unwrap();
        let message = config.proxy.clone().resolve().check().unwrap_err();
        assert!(message.contains("`max_buffered_bytes`"), "{message}");
    }

    /// The memory store's ceilings: more than zero, and only beside
    /// `--store memory` (a ceiling for a store that has none is no
    /// protection anyone gets).
    #[test]
    fn memory_store_ceilings_are_checked() {
        let check = |text: &str, store: &str| {
            let mut settings = Config::parse(text).unwrap().proxy.resolve();
            settings.store = store.into();
            settings.check()
        };
        assert!(check("[proxy]\nmemory_max_records = 10\n", "memory").is_ok());
        let zero = check("[proxy]\nmemory_max_bytes = 0\n", "memory").unwrap_err();
        assert!(zero.contains("`memory_max_bytes`"), "{zero}");
        let elsewhere = check("[proxy]\nmemory_max_records = 10\n", "sqlite://x.db").unwrap_err();
        assert!(elsewhere.contains("sizes the memory store"), "{elsewhere}");
    }

    /// A route an earlier enabled route hides whole (every path it matches,
    /// for every method it covers) is refused: the first matching route
    /// decides, so `/api` before `/api/pay` with `principal` and
    /// `required` left every `/api/pay` caller in one shared key space,
    /// and the proxy started without a word (from a review of the
    /// configuration). A route the earlier one hides only for some methods
    /// or some paths is kept.
    #[test]
    fn a_route_hidden_whole_by_an_earlier_route_is_refused() {
        let later = "[[route]]\npath = \"/api/pay\"\nprincipal = { header = \"x-user\" }\n\
                     required = true\n";
        for earlier in [
            "[[route]]\npath = \"/api\"\n",
            "[[route]]\npath = \"/api/**\"\n",
            "[[route]]\npath = \"/**\"\nmethods = [\"POST\", \"PATCH\", \"PUT\"]\n",
        ] {
            let (line, message) = error(&format!("{earlier}\n{later}"));
            assert!(line.is_some(), "{earlier}: {message}");
            assert!(
                message.contains("can never apply") && message.contains("line 2"),
                "{earlier}: {message}"
            );
        }
        // Hidden for some of its methods (from a later review: `/api`'s
        // default POST and PATCH before `/api/pay` for POST and PUT left
        // `/api/pay`'s POST unprotected by its `required` and `principal`,
        // without a word): refused, naming the methods.
        for (earlier, methods, hidden) in [
            (
                "[[route]]\npath = \"/api\"\nmethods = [\"POST\"]\n",
                "",
                "POST",
            ),
            (
                "[[route]]\npath = \"/api\"\n",
                "methods = [\"POST\", \"PUT\"]\n",
                "POST",
            ),
            (
                "[[route]]\npath = \"/**\"\nmethods = [\"put\", \"PATCH\"]\n",
                "methods = [\"POST\", \"PUT\", \"PATCH\"]\n",
                "PUT, PATCH",
            ),
        ] {
            let (line, message) = error(&format!("{earlier}\n{later}{methods}"));
            assert!(line.is_some(), "{earlier}: {message}");
            assert!(
                message.contains(&format!("never applies to {hidden}:"))
                    && message.contains("line 2"),
                "{earlier}: {message}"
            );
        }
        // Its own path decided by an earlier glob (from a review of the
        // fix: `/api/*` before `/api/pay` left `POST /api/pay` itself to
        // `/api/*`, only `/api/pay/x` reaching the required route).
        for earlier in [
            "[[route]]\npath = \"/api/*\"\n",
            "[[route]]\npath = \"/*/pay\"\nmethods = [\"PATCH\"]\n",
        ] {
            let (line, message) = error(&format!("{earlier}\n{later}"));
            assert!(line.is_some(), "{earlier}: {message}");
            assert!(
                message.contains("never applies to `/api/pay` itself")
                    && message.contains("line 2"),
                "{earlier}: {message}"
            );
        }
        for earlier in [
            // Other methods only.
            "[[route]]\npath = \"/api\"\nmethods = [\"PUT\"]\n",
            // Some paths only, its own not among them.
            "[[route]]\npath = \"/api/pay/x\"\n",
            "[[route]]\npath = \"/api/*/x\"\n",
        ] {
            let text = format!("{earlier}\n{later}");
            assert!(Config::parse(&text).is_ok(), "{earlier}");
        }
    }

    /// From a review: on an `enabled = false` route every other setting
    /// was silently ignored — `methods = ["PATCH"]` read as excluding PATCH
    /// alone, while the exclusion took every method (a POST skipped the
    /// required route after it), and an invalid `mismatch_status` passed.
    /// Refused, naming the key and its line.
    #[test]
    fn a_setting_beside_enabled_false_is_refused() {
        for (setting, key) in [
            ("methods = [\"PATCH\"]", "methods"),
            ("required = true", "required"),
            ("mismatch_status = 400", "mismatch_status"),
        ] {
            let text =
                format!("[[route]]\npath = \"/orders/export\"\nenabled = false\n{setting}\n");
            let (line, message) = error(&text);
            assert_eq!(line, Some(4), "{message}");
            assert!(
                message.contains(&format!("`{key}` has no effect")),
                "{message}"
            );
        }
        let alone = "[[route]]\npath = \"/orders/export\"\nenabled = false\n";
        assert!(Config::parse(alone).is_ok());
        // `[defaults]` still apply to the routes that use them.
        let text = format!("[defaults]\nrequired = true\n\n{alone}");
        assert!(Config::parse(&text).is_ok());
    }

    /// A route no request can reach (every path it matches left alone by
    /// an earlier `enabled = false` route) and a route giving its one
    /// switch under both names are refused, naming the line: both loaded
    /// without a word, the first leaving a `required` route unprotected.
    #[test]
    fn a_route_that_can_never_apply_or_switches_twice_is_refused() {
        let plain = "[[route]]\npath = \"/api\"\nenabled = false\n\n";
        for later in ["/api/orders", "/api", "/api/*/submit"] {
            let text = format!("{plain}[[route]]\npath = \"{later}\"\nrequired = true\n");
            let (line, message) = error(&text);
            assert_eq!(line, Some(6), "{later}: {message}");
            assert!(
                message.contains("can never apply") && message.contains("line 2"),
                "{message}"
            );
        }
        for later in ["/apis", "/api*", "/other"] {
            let text = format!("{plain}[[route]]\npath = \"{later}\"\n");
            assert!(Config::parse(&text).is_ok(), "{later}");
        }
        // Glob exclusions, and exclusions in another case under
        // case-insensitive routing (from a review of the configuration:
        // both loaded, and the required route protected nothing).
        for (exclusion, later, folded) in [
            ("/api/**", "/api/pay", false),
            ("/api/**", "/api/*/submit", false),
            ("/**", "/contact", false),
            ("/api/*", "/api/x*", false),
            ("/API", "/api/pay", true),
            ("/Api/**", "/API/pay", true),
        ] {
            let flag = if folded {
                "case_insensitive_paths = true\n"
            } else {
                ""
            };
            let text = format!(
                "{flag}[[route]]\npath = \"{exclusion}\"\nenabled = false\n\n\
                 [[route]]\npath = \"{later}\"\nrequired = true\n"
            );
            let (_, message) = error(&text);
            assert!(
                message.contains("can never apply"),
                "{exclusion} {later}: {message}"
            );
        }
        // An exclusion of a prefix route's own path.
        let text = "[[route]]\npath = \"/api/*\"\nenabled = false\n\n\
                    [[route]]\npath = \"/api/pay\"\nrequired = true\n";
        let (_, message) = error(text);
        assert!(
            message.contains("never applies to `/api/pay` itself"),
            "{message}"
        );
        // Exclusions that leave only some of a route's paths alone.
        for (exclusion, later) in [
            ("/api/*", "/api/**"),
            ("/api/*/internal", "/api/*/submit"),
            ("/api/*/*/*", "/api/**"),
            ("/api/**/*", "/api/**"),
            ("/API", "/api/pay"),
            ("/api/pay/x", "/api/pay"),
        ] {
            let text = format!(
                "[[route]]\npath = \"{exclusion}\"\nenabled = false\n\n\
                 [[route]]\npath = \"{later}\"\nrequired = true\n"
            );
            assert!(Config::parse(&text).is_ok(), "{exclusion} {later}");
        }
        // A redundant exclusion is harmless.
        let text = format!("{plain}[[route]]\npath = \"/api/health\"\nenabled = false\n");
        assert!(Config::parse(&text).is_ok());
        let (line, message) =
            error("[[route]]\npath = \"/pay\"\nenabled = true\nidempotency = false\n");
        assert!(
            line.is_some() && message.contains("one switch"),
            "{message}"
        );
    }

    /// A SIGTERM used to panic (the deadline overflowed the clock) under a
    /// huge `shutdown_timeout`, and a zero one abandoned every request in
    /// flight: both are refused at start.
    #[test]
    fn a_zero_or_huge_shutdown_timeout_is_refused() {
        for (value, says) in [
            ("0s", "longer than zero"),
            ("500000000000y", "at most 100 years"),
        ] {
            let text =
                format!("[proxy]\nupstream = \"http://a:1\"\nshutdown_timeout = \"{value}\"\n");
            let config = Config::parse(&text).unwrap();
            let message = config.proxy.clone().resolve().check().unwrap_err();
            assert!(
                message.contains("`shutdown_timeout`") && message.contains(says),
                "{message}"
            );
        }
        let text = "[proxy]\nupstream = \"http://a:1\"\nidle_timeout = \"500000000000y\"\n";
        let message = Config::parse(text)
            .unwrap()
            .proxy
            .resolve()
            .check()
            .unwrap_err();
        assert!(message.contains("`idle_timeout`"), "{message}");
    }

    #[test]
    fn a_bad_value_names_its_key_and_what_is_expected() {
        let (line, message) = error("[proxy]\nupstream = \"http://a:1\"\nread_timeout = 30\n");
        assert_eq!(line, Some(3));
        assert!(message.contains("`read_timeout`"), "{message}");
        assert!(message.contains("\"30s\""), "{message}");
        let (line, message) = error("[proxy]\nthreads = \"4\"\n");
        assert_eq!(line, Some(2));
        assert!(message.contains("`threads`"), "{message}");
        assert!(message.contains("without quotes"), "{message}");
        let (line, message) = error("[[route]]\npath = \"/a\"\nkey = \"Idempotency-Key\"\n");
        assert_eq!(line, Some(3));
        assert!(message.contains("`key`"), "{message}");
        assert!(
            message.contains("{ header = \"Idempotency-Key\" }"),
            "{message}"
        );
        let (_, message) = error("[defaults]\nlease = 30\n");
        assert!(
            message.contains("`lease`") && message.contains("\"30s\""),
            "{message}"
        );
    }

    #[test]
    fn routes_merge_over_defaults_in_file_order() {
        let config = Config::parse(
            r#"
[proxy]
upstream = "http://127.0.0.1:3000"
read_timeout = "2s"
redis_prefix = "staging:"

[defaults]
required = true
lease = "300ms"

[[route]]
path = "/health"
enabled = false

[[route]]
path = "/contact"
key = { form_field = "submission_token" }
uuid_only = true

[[route]]
path = "/api/**"
mismatch_status = 409
"#,
        )
        .unwrap();
        assert_eq!(config.proxy.read_timeout, Some(Duration::from_secs(2)));
        assert_eq!(config.proxy.redis_prefix.as_deref(), Some("staging:"));
        let routes = &config.routes;
        assert!(routes.find(&Method::POST, "/health").is_none());
        let contact = routes.find(&Method::POST, "/contact").unwrap();
        assert!(contact.policy().uuid_only && contact.policy().required);
        assert_eq!(contact.policy().lease, Duration::from_millis(300));
        let engine =
            tower_idempotency::Engine::new(tower_idempotency::MemoryStore::new(), routes.clone());
        let (uri, headers) = (http::Uri::from_static("/contact"), http::HeaderMap::new());
        let head = RequestHead {
            method: &Method::POST,
            uri: &uri,
            headers: &headers,
            principal: None,
            routed: None,
        };
        match engine.classify(&head) {
            Coverage::Covered(covered) => assert_eq!(covered.label(), "/contact"),
            Coverage::PassThrough => panic!("/contact is covered"),
        }
        let api = routes.find(&Method::PATCH, "/api/v1/orders").unwrap();
        assert_eq!(api.policy().mismatch_status, 409);
        assert!(!api.policy().uuid_only);
        assert!(routes.find(&Method::POST, "/elsewhere").is_none());
    }

    #[test]
    fn the_example_file_is_valid_and_complete() {
        let text = include_str!("../idempotency.example.toml");
        let config = Config::parse(text).unwrap();
        assert!(config
            .routes
            .find(&Method::POST, "/webhooks/stripe")
            .is_none());
        let api = config
            .routes
            .find(&Method::DELETE, "/api/orders/7")
            .unwrap();
        assert_eq!(api.policy().max_body_bytes, 16 * 1024 * 1024);
        // Every policy key is documented in [defaults], with its default value.
        let file: File = toml::from_str(text).unwrap();
        let defaults: Entries = file
            .defaults
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k.into_inner(), v))
            .collect();
        assert_eq!(policy_of(&defaults).unwrap(), Policy::default());
        let documented = toml::Value::try_from(Policy::default()).unwrap();
        for key in documented.as_table().unwrap().keys() {
            assert!(defaults.contains_key(key), "`{key}` is not in the example");
        }
    }

    #[test]
    fn paths_may_be_routed_without_regard_to_case() {
        let text = "[[route]]\npath = \"/Api/Pay\"\nrequired = true\n";
        let exact = Config::parse(text).unwrap();
        assert!(exact.routes.find(&Method::POST, "/api/PAY").is_none());
        let folded = Config::parse(&format!("case_insensitive_paths = true\n{text}")).unwrap();
        assert!(folded.routes.find(&Method::POST, "/api/PAY").is_some());
    }

    #[test]
    fn defaults_alone_cover_every_path() {
        let config = Config::parse("[defaults]\nrequired = true\n").unwrap();
        assert!(
            config
                .routes
                .find(&Method::POST, "/x")
                .unwrap()
                .policy()
                .required
        );
        let config = Config::parse("").unwrap();
        assert!(config.routes.find(&Method::POST, "/x").is_some());
    }

    #[test]
    fn errors_name_the_line_and_the_key() {
        let (line, message) =
            error("[[route]]\npath = \"/a\"\n\n[[route]]\npath = \"/b\"\ntll = \"1h\"\n");
        assert_eq!(line, Some(6));
        assert!(message.contains("tll"), "{message}");

        let (line, message) = error("[[route]]\npath = \"/a\"\nmismatch_status = 400\n");
        assert_eq!(line, Some(3));
        assert!(
            message.contains("mismatch_status") && message.contains("/a"),
            "{message}"
        );

        let (line, message) = error("[[route]]\npath = \"/a\"\nlease = \"soon\"\n");
        assert_eq!(line, Some(3));
        assert!(message.contains("lease"), "{message}");

        let (line, message) = error("[defaults]\nmethods = [\"GET\"]\n");
        assert_eq!(line, Some(2));
        assert!(message.contains("methods"), "{message}");

        let (line, message) = error("[[route]]\nrequired = true\n");
        assert_eq!(line, Some(1));
        assert!(message.contains("path"), "{message}");

        let (line, message) = error("[[route]]\npath = \"orders\"\n");
        assert_eq!(line, Some(2));
        assert!(message.contains("path"), "{message}");

        let (line, message) = error("[proxy]\nlisten = \"a\"\nupstreem = \"b\"\n");
        assert_eq!(line, Some(3));
        assert!(message.contains("upstreem"), "{message}");

        let (line, _) = error("[proxy\n");
        assert_eq!(line, Some(1));
    }
}
