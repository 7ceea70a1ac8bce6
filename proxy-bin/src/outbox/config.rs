//! The `[outbox]` table and its `[[outbox.destination]]` entries.
//!
//! ```toml
//! [outbox]
//! database = "postgres://app@db/app"   # default: [proxy] store, when PostgreSQL or SQLite
//! concurrency = 16
//! lease = "30s"
//! poll_interval = "1s"
//! retention = "7d"
//!
//! [[outbox.destination]]
//! topic = "crm"
//! url = "http://crm.internal/hooks"
//! secret_env = "CRM_WEBHOOK_SECRET"    # or secret_file = "/run/secrets/crm"
//! max_attempts = 12
//! backoff_base = "1s"
//! backoff_max = "1h"
//! timeout = "10s"
//! ```
//!
//! Everything that can be checked without the environment is checked when
//! the file is parsed (a mistake names its line and key); secrets are read
//! when the workers start ([`OutboxSettings::secrets`]), and a missing one
//! is refused with the same precision.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;
use tower_idempotency::outbox::{Backoff, WebhookSecret, WorkerConfig};

/// `[outbox]` as written in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxFile {
    database: Option<Spanned<String>>,
    concurrency: Option<Spanned<usize>>,
    #[serde(default, with = "humantime_serde::option")]
    lease: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    poll_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    retention: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    rescue_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    shutdown_grace: Option<Duration>,
    listen: Option<bool>,
    #[serde(default)]
    destination: Vec<Spanned<DestinationFile>>,
}

/// One `[[outbox.destination]]` as written in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DestinationFile {
    topic: Option<Spanned<String>>,
    url: Option<Spanned<String>>,
    secret_env: Option<Spanned<String>>,
    secret_file: Option<Spanned<PathBuf>>,
    /// Caught to refuse it with a clear message: secrets are never inline.
    secret: Option<Spanned<toml::Value>>,
    max_attempts: Option<Spanned<u32>>,
    #[serde(default, with = "humantime_serde::option")]
    backoff_base: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    backoff_max: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    timeout: Option<Duration>,
}

/// `[outbox]`, checked, with its defaults applied.
#[derive(Clone, Debug)]
pub struct OutboxSettings {
    /// The outbox database, if given (else the proxy's store).
    pub database: Option<String>,
    /// The settings shared by every destination's worker (its backoff is
    /// the destination's).
    pub worker: WorkerConfig,
    /// Where each topic goes.
    pub destinations: Vec<DestinationSettings>,
}

impl OutboxSettings {
    /// How many workers hold a `LISTEN` connection (PostgreSQL): one per
    /// destination when `listen` is on.
    pub fn listeners(&self) -> usize {
        if self.worker.listen {
            self.destinations.len()
        } else {
            0
        }
    }
}

/// One destination, checked.
#[derive(Clone, Debug)]
pub struct DestinationSettings {
    /// The topic whose rows go there.
    pub topic: String,
    /// `http://…`.
    pub url: http::Uri,
    /// Where its signing secret comes from, if it signs.
    pub secret: Option<SecretSource>,
    /// Attempts before `dead`, when lower than the row's own
    /// `max_attempts`.
    pub max_attempts: Option<u32>,
    /// Its retry schedule.
    pub backoff: Backoff,
    /// The whole exchange's timeout.
    pub timeout: Duration,
}

/// Where a signing secret is read from at start; the line of its key.
#[derive(Clone, Debug)]
pub enum SecretSource {
    /// An environment variable.
    Env(String, usize),
    /// A file (its content, trimmed).
    File(PathBuf, usize),
}

/// An error of the parsed file: its line, if known, and the message.
pub type Refusal = (Option<usize>, String);

const TABLE: &str = "[[outbox.destination]]";

/// The longest any `[outbox]` duration may be: the cap of the `[proxy]`
/// durations (`Resolved::check`), far inside what the workers add them to
/// (a huge `rescue_interval` overflowed the clock and panicked the worker;
/// a huge `lease` left PostgreSQL's time range and failed every claim).
const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The shortest `lease` a worker is given.
const MIN_LEASE: Duration = Duration::from_secs(1);

impl OutboxFile {
    /// Checks the table; `text` is the whole file (for line numbers), and
    /// `shutdown_timeout` the `[proxy]` one (resolved: the most the
    /// workers' shutdown may take, in the proxy and in `outbox run` alike).
    pub fn check(self, text: &str, shutdown_timeout: Duration) -> Result<OutboxSettings, Refusal> {
        let line = |offset: usize| crate::config::line_of(text, offset);
        let defaults = WorkerConfig::default();
        let database = match self.database {
            Some(url) => {
                let value = url.get_ref();
                if !is_database(value) {
                    return Err((
                        Some(line(url.span().start)),
                        "[outbox] `database`: expected `postgres://URL` or `sqlite://PATH`"
                            .to_owned(),
                    ));
                }
                Some(value.clone())
            }
            None => None,
        };
        let concurrency = match self.concurrency {
            Some(n) if *n.get_ref() == 0 => {
                return Err((
                    Some(line(n.span().start)),
                    "[outbox] `concurrency`: must be at least 1".to_owned(),
                ))
            }
            Some(n) => n.into_inner(),
            None => defaults.concurrency,
        };
        let bounded = |value: Option<Duration>, key: &str| match value {
            Some(d) if d > MAX_DURATION => {
                Err((None, format!("[outbox] `{key}`: must be at most 100 years")))
            }
            _ => Ok(value),
        };
        let positive =
            |value: Option<Duration>, key: &str, default: Duration| match bounded(value, key)? {
                Some(d) if d.is_zero() => Err((
                    None,
                    format!("[outbox] `{key}`: must be longer than zero (e.g. \"1s\")"),
                )),
                Some(d) => Ok(d),
                None => Ok(default),
            };
        let worker = WorkerConfig {
            concurrency,
            lease: match positive(self.lease, "lease", defaults.lease)? {
                // Renewed every third, across database round trips: a
                // shorter lease ran out while the receiver acted, and its
                // rows went dead as "lease expired" though they were sent.
                lease if lease < MIN_LEASE => {
                    return Err((
                        None,
                        "[outbox] `lease`: must be at least 1s (it is renewed every third, \
                         across database round trips)"
                            .to_owned(),
                    ))
                }
                lease => lease,
            },
            poll_interval: positive(self.poll_interval, "poll_interval", defaults.poll_interval)?,
            rescue_interval: positive(
                self.rescue_interval,
                "rescue_interval",
                defaults.rescue_interval,
            )?,
            shutdown_grace: bounded(self.shutdown_grace, "shutdown_grace")?
                .unwrap_or(defaults.shutdown_grace),
            retention: match bounded(self.retention, "retention")? {
                Some(d) if d.is_zero() => None,
                Some(d) => Some(d),
                None => defaults.retention,
            },
            listen: self.listen.unwrap_or(defaults.listen),
            ..defaults
        };
        // The process exits at `shutdown_timeout`: a grace as long leaves
        // no time to give back the rows of the deliveries still running,
        // which then wait for the rescuer. (A zero timeout is refused by
        // the `[proxy]` checks.)
        let timeout = shutdown_timeout;
        let mut worker = worker;
        if self.shutdown_grace.is_none() && worker.shutdown_grace >= timeout {
            // The default grace, under a shorter timeout: half of it.
            worker.shutdown_grace = timeout / 2;
        }
        if !timeout.is_zero() && worker.shutdown_grace >= timeout {
            return Err((
                None,
                format!(
                    "[outbox] `shutdown_grace` ({}) must be shorter than [proxy] \
                     `shutdown_timeout` ({}), which ends the process: the rows of \
                     deliveries still running after the grace are given back within it",
                    humantime::format_duration(worker.shutdown_grace),
                    humantime::format_duration(timeout)
                ),
            ));
        }
        if self.destination.is_empty() {
            return Err((
                None,
                format!("[outbox] needs at least one {TABLE} with a `topic` and a `url`"),
            ));
        }
        let mut topics = HashSet::new();
        let mut destinations = Vec::new();
        for entry in self.destination {
            let at = line(entry.span().start);
            let entry = entry.into_inner();
            let refuse = |span: Option<std::ops::Range<usize>>, key: &str, what: &str| {
                let line = span.map_or(at, |span| line(span.start));
                (Some(line), format!("{TABLE} `{key}`: {what}"))
            };
            let Some(topic) = entry.topic else {
                return Err(refuse(
                    None,
                    "topic",
                    "missing (the topic this destination takes)",
                ));
            };
            if topic.get_ref().is_empty() || topic.get_ref().len() > 200 {
                return Err(refuse(
                    Some(topic.span()),
                    "topic",
                    "must be 1 to 200 bytes",
                ));
            }
            if !topics.insert(topic.get_ref().clone()) {
                return Err(refuse(
                    Some(topic.span()),
                    "topic",
                    &format!(
                        "`{}` has two destinations; give each topic one",
                        topic.get_ref()
                    ),
                ));
            }
            let Some(url) = entry.url else {
                return Err(refuse(
                    None,
                    "url",
                    "missing (e.g. \"http://crm.internal/hooks\")",
                ));
            };
            let url =
                check_url(url.get_ref()).map_err(|what| refuse(Some(url.span()), "url", &what))?;
            if let Some(secret) = &entry.secret {
                return Err(refuse(
                    Some(secret.span()),
                    "secret",
                    "a secret is never written in the file: name an environment variable \
                     with `secret_env` or a file with `secret_file`",
                ));
            }
            let secret = match (entry.secret_env, entry.secret_file) {
                (Some(_), Some(file)) => {
                    return Err(refuse(
                        Some(file.span()),
                        "secret_file",
                        "give `secret_env` or `secret_file`, not both",
                    ))
                }
                (Some(env), None) if env.get_ref().is_empty() => {
                    return Err(refuse(
                        Some(env.span()),
                        "secret_env",
                        "empty variable name",
                    ))
                }
                (Some(env), None) => Some(SecretSource::Env(
                    env.get_ref().clone(),
                    line(env.span().start),
                )),
                (None, Some(file)) => Some(SecretSource::File(
                    file.get_ref().clone(),
                    line(file.span().start),
                )),
                (None, None) => None,
            };
            if let Some(max) = &entry.max_attempts {
                if *max.get_ref() == 0 {
                    return Err(refuse(
                        Some(max.span()),
                        "max_attempts",
                        "must be at least 1",
                    ));
                }
            }
            let backoff = Backoff {
                base: entry.backoff_base.unwrap_or(Backoff::default().base),
                max: entry.backoff_max.unwrap_or(Backoff::default().max),
                ..Backoff::default()
            };
            // No wait between attempts spends `max_attempts` on one
            // outage in milliseconds.
            if backoff.base.is_zero() {
                return Err(refuse(
                    None,
                    "backoff_base",
                    "must be longer than zero (e.g. \"1s\")",
                ));
            }
            if backoff.base > backoff.max {
                return Err(refuse(
                    None,
                    "backoff_base",
                    "must not be longer than `backoff_max`",
                ));
            }
            let timeout = entry
                .timeout
                .unwrap_or(tower_idempotency::outbox::Destination::DEFAULT_TIMEOUT);
            if timeout.is_zero() {
                return Err(refuse(
                    None,
                    "timeout",
                    "must be longer than zero (e.g. \"10s\")",
                ));
            }
            let durations = [("backoff_max", backoff.max), ("timeout", timeout)];
            if let Some((key, _)) = durations.iter().find(|(_, d)| *d > MAX_DURATION) {
                return Err(refuse(None, key, "must be at most 100 years"));
            }
            destinations.push(DestinationSettings {
                topic: topic.into_inner(),
                url,
                secret,
                max_attempts: entry.max_attempts.map(Spanned::into_inner),
                backoff,
                timeout,
            });
        }
        Ok(OutboxSettings {
            database,
            worker,
            destinations,
        })
    }
}

/// Whether `url` names a database the outbox runs on.
pub fn is_database(url: &str) -> bool {
    ["postgres://", "postgresql://", "sqlite:"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
}

fn check_url(url: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|_| "not a URL (e.g. \"http://crm.internal/hooks\")".to_owned())?;
    match uri.scheme_str() {
        // The client drops `user:password@`: every delivery would meet 401.
        Some("http") if uri.authority().is_some_and(|a| a.as_str().contains('@')) => Err(
            "credentials in the URL are never sent (no `Authorization` goes out): remove \
             them and sign the deliveries with `secret_env` or `secret_file` instead, \
             which the receiver verifies"
                .to_owned(),
        ),
        Some("http") if uri.host().is_some() => Ok(uri),
        Some("https") => Err("https:// is not supported by the proxy's deliverer yet: \
                              deliver over http:// to a TLS-terminating sidecar, or use \
                              the library with a TLS connector"
            .to_owned()),
        _ => Err("expected http://HOST[:PORT]/PATH".to_owned()),
    }
}

impl OutboxSettings {
    /// The outbox database: `database`, else the proxy's `store` when it
    /// is PostgreSQL or SQLite.
    pub fn database_or(&self, store: &str) -> Result<String, String> {
        match &self.database {
            Some(url) => Ok(url.clone()),
            None if is_database(store) => Ok(store.to_owned()),
            None => Err(format!(
                "[outbox] has no `database` and the proxy's store is `{}`: set `database` \
                 to postgres://URL or sqlite://PATH",
                store.split(':').next().unwrap_or(store)
            )),
        }
    }

    /// Reads every destination's secret (`file` is the configuration file:
    /// a relative `secret_file` is found next to it). A variable that is unset or a file that cannot be
    /// read, or a value that is not `whsec_<base64>`, is refused with its
    /// line and key; the value is never printed.
    pub fn secrets(&self, file: &Path) -> Result<Vec<Option<WebhookSecret>>, String> {
        let refuse = |line: usize, key: &str, what: String| {
            format!("{}:{line}: {TABLE} `{key}`: {what}", file.display())
        };
        let decode = |value: &str, line: usize, key: &str, origin: &str| {
            WebhookSecret::from_whsec(value.trim()).ok_or_else(|| {
                refuse(
                    line,
                    key,
                    format!("{origin} is not a secret of the form whsec_<base64>"),
                )
            })
        };
        self.destinations
            .iter()
            .map(|destination| match &destination.secret {
                None => Ok(None),
                Some(SecretSource::Env(name, line)) => {
                    let value = std::env::var(name).map_err(|_| {
                        refuse(
                            *line,
                            "secret_env",
                            format!("the environment variable {name} is not set"),
                        )
                    })?;
                    decode(&value, *line, "secret_env", &format!("the value of {name}")).map(Some)
                }
                Some(SecretSource::File(path, line)) => {
                    let path = &file.parent().unwrap_or(Path::new("")).join(path);
                    let value = std::fs::read_to_string(path).map_err(|error| {
                        refuse(
                            *line,
                            "secret_file",
                            format!("cannot read {}: {error}", path.display()),
                        )
                    })?;
                    decode(&value, *line, "secret_file", &path.display().to_string()).map(Some)
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// The example file's `[outbox]` block, uncommented (one secret
    /// source: they exclude each other).
    fn example_outbox() -> String {
        let text = include_str!("../../idempotency.example.toml");
        let block = &text[text.find("# [outbox]").expect("an [outbox] block")..];
        block
            .lines()
            .filter_map(|line| {
                let code = line.strip_prefix("# ")?;
                let is_code = code.starts_with('[')
                    || code.split_once(" = ").is_some_and(|(key, _)| {
                        key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    });
                (is_code && !code.starts_with("secret_file")).then(|| format!("{code}\n"))
            })
            .collect()
    }

    #[test]
    fn the_examples_outbox_block_is_valid_and_shows_the_defaults() {
        let config = Config::parse(&example_outbox()).unwrap();
        let outbox = config.outbox.unwrap();
        let defaults = WorkerConfig::default();
        assert_eq!(outbox.worker.concurrency, defaults.concurrency);
        assert_eq!(outbox.worker.lease, defaults.lease);
        assert_eq!(outbox.worker.poll_interval, defaults.poll_interval);
        assert_eq!(outbox.worker.rescue_interval, defaults.rescue_interval);
        assert_eq!(outbox.worker.retention, defaults.retention);
        assert_eq!(outbox.worker.shutdown_grace, defaults.shutdown_grace);
        let crm = &outbox.destinations[0];
        assert_eq!(crm.topic, "crm");
        assert_eq!(crm.backoff, Backoff::default());
        assert_eq!(crm.timeout, Duration::from_secs(10));
        assert_eq!(crm.max_attempts, Some(12));
        assert!(
            matches!(&crm.secret, Some(SecretSource::Env(name, _)) if name == "CRM_WEBHOOK_SECRET")
        );
    }

    #[test]
    fn the_database_defaults_to_the_proxys_store_when_it_is_one() {
        let text = "[outbox]\n[[outbox.destination]]\ntopic = \"t\"\nurl = \"http://a/h\"\n";
        let outbox = Config::parse(text).unwrap().outbox.unwrap();
        assert_eq!(
            outbox.database_or("sqlite://x.db").unwrap(),
            "sqlite://x.db"
        );
        assert_eq!(
            outbox.database_or("postgres://db/app").unwrap(),
            "postgres://db/app"
        );
        let error = outbox.database_or("memory").unwrap_err();
        assert!(error.contains("`database`"), "{error}");
        let (line, message) = Config::parse(&format!("{text}[outbox]\n")).unwrap_err();
        assert!(line.is_some() && message.contains("outbox"), "{message}");
        let (_, message) = Config::parse("[outbox]\nlease = \"30s\"\n").unwrap_err();
        assert!(message.contains("[[outbox.destination]]"), "{message}");
    }

    #[test]
    fn a_zero_backoff_is_refused() {
        let text = "[outbox]\n[[outbox.destination]]\ntopic = \"t\"\nurl = \"http://a/h\"\n\
                    backoff_base = \"0s\"\n";
        let (_, message) = Config::parse(text).unwrap_err();
        assert!(message.contains("`backoff_base`"), "{message}");
    }

    /// From a review: a `lease` of `1ms` was taken, and every row the
    /// receiver accepted went dead as "lease expired".
    #[test]
    fn a_lease_under_a_second_is_refused() {
        let (_, message) = Config::parse(&destination("").replacen(
            "[outbox]\n",
            "[outbox]\nlease = \"1ms\"\n",
            1,
        ))
        .unwrap_err();
        assert!(
            message.contains("`lease`") && message.contains("1s"),
            "{message}"
        );
        let text = destination("").replacen("[outbox]\n", "[outbox]\nlease = \"1s\"\n", 1);
        assert!(Config::parse(&text).is_ok());
    }

    fn destination(extra: &str) -> String {
        format!("[outbox]\n[[outbox.destination]]\ntopic = \"t\"\nurl = \"http://a/h\"\n{extra}")
    }

    /// A duration too long for the clock panicked the worker (`rescue_interval`:
    /// the next run overflowed `Instant`) or failed every claim (`lease`,
    /// past PostgreSQL's range): every `[outbox]` duration is refused above
    /// the `[proxy]` cap, naming its key.
    #[test]
    fn a_duration_too_long_for_the_clock_is_refused_naming_its_key() {
        let huge = "\"500000000000y\"";
        for key in [
            "lease",
            "poll_interval",
            "rescue_interval",
            "retention",
            "shutdown_grace",
        ] {
            let text =
                destination("").replacen("[outbox]\n", &format!("[outbox]\n{key} = {huge}\n"), 1);
            let (_, message) = Config::parse(&text).unwrap_err();
            assert!(
                message.contains(&format!("`{key}`")) && message.contains("at most 100 years"),
                "{key}: {message}"
            );
        }
        for key in ["backoff_max", "timeout"] {
            let (line, message) =
                Config::parse(&destination(&format!("{key} = {huge}\n"))).unwrap_err();
            assert_eq!(line, Some(2), "{key}: {message}");
            assert!(
                message.contains(&format!("`{key}`")) && message.contains("at most 100 years"),
                "{key}: {message}"
            );
        }
        let text = destination("").replacen("[outbox]\n", "[outbox]\nlease = \"36500d\"\n", 1);
        assert!(Config::parse(&text).is_ok(), "the cap itself is allowed");
    }

    /// The HTTP client drops a URL's `user:password@` (no `Authorization`
    /// is sent): every delivery met 401 and every row went dead. Refused,
    /// pointing at signing; the password is never repeated.
    #[test]
    fn credentials_in_a_destination_url_are_refused() {
        for url in [
            "http://user:hunter2@crm/hooks",
            "http://hunter2@crm:8080/hooks",
        ] {
            let text = destination("").replace("http://a/h", url);
            let (line, message) = Config::parse(&text).unwrap_err();
            assert_eq!(line, Some(4), "{message}");
            assert!(
                message.contains("`url`")
                    && message.contains("credentials")
                    && message.contains("secret_env"),
                "{message}"
            );
            assert!(!message.contains("hunter2"), "{message}");
        }
    }

    /// The process ends at `shutdown_timeout` whatever the workers do: a
    /// `shutdown_grace` as long leaves no time to give the rows back (they
    /// wait for the rescuer, after their lease), so it is refused.
    #[test]
    fn a_shutdown_grace_not_shorter_than_shutdown_timeout_is_refused() {
        let with = |proxy: &str, outbox: &str| {
            destination("").replacen(
                "[outbox]\n",
                &format!("[proxy]\n{proxy}[outbox]\n{outbox}"),
                1,
            )
        };
        for (proxy, outbox) in [
            ("shutdown_timeout = \"5s\"\n", "shutdown_grace = \"5s\"\n"),
            ("shutdown_timeout = \"5s\"\n", "shutdown_grace = \"1m\"\n"),
            // The defaults: a 30 s timeout.
            ("", "shutdown_grace = \"30s\"\n"),
        ] {
            let (_, message) = Config::parse(&with(proxy, outbox)).unwrap_err();
            assert!(
                message.contains("`shutdown_grace`") && message.contains("`shutdown_timeout`"),
                "{proxy}{outbox}: {message}"
            );
        }
        assert!(Config::parse(&with(
            "shutdown_timeout = \"5s\"\n",
            "shutdown_grace = \"4s\"\n"
        ))
        .is_ok());
        assert!(Config::parse(&with("", "shutdown_grace = \"29s\"\n")).is_ok());
        // The default grace (10 s) under a shorter timeout is half of it.
        let config = Config::parse(&with("shutdown_timeout = \"5s\"\n", "")).unwrap();
        let outbox = config.outbox.unwrap();
        assert_eq!(outbox.worker.shutdown_grace, Duration::from_millis(2500));
    }

    #[test]
    fn a_topic_has_one_destination() {
        let one = "[[outbox.destination]]\ntopic = \"crm\"\nurl = \"http://a/h\"\n";
        let (line, message) = Config::parse(&format!("[outbox]\n{one}{one}")).unwrap_err();
        assert_eq!(line, Some(6));
        assert!(
            message.contains("`topic`") && message.contains("crm"),
            "{message}"
        );
    }
}
