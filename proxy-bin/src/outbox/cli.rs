//! `idempotency-proxy outbox …`: the workers alone (`run`), and the
//! operator's commands (`counts`, `dead`, `retry`, `purge`), which print
//! the same JSON as the admin API.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tower_idempotency::outbox::Outbox;

use super::config::is_database;
use super::ops::{self, Purge};
use super::workers::{self, Workers};
use crate::config::Config;

/// `idempotency-proxy outbox …`.
#[derive(Debug, Args)]
pub struct OutboxArgs {
    #[command(subcommand)]
    command: OutboxCommand,
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// Run the workers of the file's [outbox] destinations alone (no
    /// proxy) until SIGTERM or SIGINT, which finish or give back what
    /// they hold.
    Run {
        /// The configuration file with [outbox] and its
        /// [[outbox.destination]] entries.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The outbox database, overriding the file's.
        #[arg(long, value_name = "URL")]
        store: Option<String>,
    },
    /// Rows per state.
    Counts(Target),
    /// Dead rows with their error columns, oldest first.
    Dead {
        #[command(flatten)]
        target: Target,
        /// At most this many (up to 1000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Include each row's payload.
        #[arg(long)]
        payload: bool,
    },
    /// Put a dead row back in the queue with a fresh attempt budget.
    Retry {
        /// The row id (from `dead`).
        id: i64,
        #[command(flatten)]
        target: Target,
    },
    /// Delete dead rows: one (--id), or those older than a duration
    /// (--older-than, 0s for all), optionally of one --topic.
    Purge {
        #[command(flatten)]
        target: Target,
        /// One dead row.
        #[arg(long, conflicts_with_all = ["older_than", "topic"])]
        id: Option<i64>,
        /// Dead rows last changed longer ago than this (e.g. 7d; 0s: all).
        #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
        /// Only this topic's (with --older-than).
        #[arg(long, requires = "older_than")]
        topic: Option<String>,
    },
}

/// Which outbox table a command works on.
#[derive(Debug, Args)]
struct Target {
    /// The outbox database: postgres://URL or sqlite://PATH.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// A configuration file: its [outbox] `database`, else its [proxy]
    /// `store`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

impl Target {
    fn database(&self) -> Result<String, String> {
        if let Some(url) = &self.store {
            return checked(url);
        }
        let Some(path) = &self.config else {
            return Err("say which outbox: --store postgres://URL | sqlite://PATH, \
                        or --config FILE"
                .to_owned());
        };
        let config = Config::load(path).map_err(|error| error.to_string())?;
        database_of(&config, path)
    }
}

fn checked(url: &str) -> Result<String, String> {
    if is_database(url) {
        Ok(url.to_owned())
    } else {
        Err("`--store`: expected postgres://URL or sqlite://PATH".to_owned())
    }
}

/// `[outbox] database`, else `[proxy] store` when it is a database.
fn database_of(config: &Config, path: &Path) -> Result<String, String> {
    let store = config.proxy.clone().resolve().store;
    match &config.outbox {
        Some(settings) => settings.database_or(&store),
        None if is_database(&store) && config.proxy.store.is_some() => Ok(store),
        None => Err(format!(
            "{}: neither [outbox] `database` nor a PostgreSQL or SQLite [proxy] `store`",
            path.display()
        )),
    }
}

/// Runs `idempotency-proxy outbox …`.
pub fn run(args: OutboxArgs) -> Result<(), Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("idempotency-outbox")
        .enable_all()
        .build()?;
    let result = runtime.block_on(async move {
        let answer = match args.command {
            OutboxCommand::Run { config, store } => return run_workers(&config, store).await,
            OutboxCommand::Counts(target) => ops::counts(&open(&target).await?).await,
            OutboxCommand::Dead {
                target,
                limit,
                payload,
            } => ops::dead(&open(&target).await?, limit, payload).await,
            OutboxCommand::Retry { id, target } => ops::retry(&open(&target).await?, id).await,
            OutboxCommand::Purge {
                target,
                id,
                older_than,
                topic,
            } => {
                let purge = Purge {
                    id,
                    older_than,
                    topic,
                };
                if purge.id.is_none() && purge.older_than.is_none() {
                    return Err("say which dead rows to purge: --id N, or --older-than \
                                DURATION (0s for every dead row) with an optional --topic"
                        .into());
                }
                ops::purge(&open(&target).await?, &purge).await
            }
        };
        match answer {
            Ok(value) => {
                println!("{}", serde_json::to_string_pretty(&value)?);
                Ok(())
            }
            Err(refusal) => Err(refusal.message.into()),
        }
    });
    // What is still running is abandoned (a delivery a second stop signal
    // or `shutdown_timeout` cut short, a name lookup on the blocking pool):
    // dropped, the runtime would wait for its blocking tasks without end.
    runtime.shutdown_timeout(Duration::from_millis(500));
    result
}

/// Opens the table an operator's command works on; an SQLite file that
/// does not exist is an error (a mistyped path creates nothing). An
/// SQLite file is opened as it is: no table created, its journal mode
/// left alone (the workers' way in switched an application's database to
/// WAL for good, and created the table in a file that had none).
async fn open(target: &Target) -> Result<Outbox, String> {
    let url = target.database()?;
    let Some(path) = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
    else {
        return workers::open(&url, 0).await;
    };
    let path = path.split('?').next().unwrap_or_default();
    if !Path::new(path).exists() {
        return Err(format!("no SQLite database at {path}"));
    }
    match Outbox::open_existing_sqlite(&url).await {
        Ok(Some(outbox)) => Ok(outbox),
        Ok(None) => Err(format!(
            "no outbox table in the SQLite database at {path}: the proxy or `outbox run` \
             creates it when it first starts"
        )),
        Err(error) => Err(format!(
            "cannot open the SQLite database at {path}: {error}"
        )),
    }
}

/// `outbox run`: the workers alone until SIGTERM or SIGINT. The file is
/// checked as the proxy checks it (`[proxy]` included: its
/// `shutdown_timeout` bounds the workers' shutdown). Without `--store`, the
/// file must name the database (`[outbox] database` or `[proxy] store`):
/// the proxy's default store is never assumed, so a file that names none
/// creates nothing.
async fn run_workers(path: &Path, store: Option<String>) -> Result<(), Box<dyn std::error::Error>> {
    // As the proxy reads them: SIGTERM, SIGINT and SIGQUIT stop the
    // workers, SIGHUP is ignored (their default actions killed the process
    // with deliveries under way, leaving rows to the rescuer, and a row on
    // its last attempt dead). Installed first: a signal that arrives while
    // the database is opened (an SQLite file is migrated there) or the
    // workers start is a stop, never a kill.
    let mut stops = Stops::install()?;
    let config = Config::load(path)?;
    let resolved = config.proxy.clone().resolve();
    resolved
        .check()
        .map_err(|error| format!("{}: {error}", path.display()))?;
    let Some(settings) = &config.outbox else {
        return Err(format!(
            "{}: no [outbox] table: add [outbox] and its [[outbox.destination]] entries",
            path.display()
        )
        .into());
    };
    let database = match store {
        Some(url) => checked(&url)?,
        None if settings.database.is_none() && config.proxy.store.is_none() => {
            return Err(format!(
                "{}: no outbox database is configured: set `database` in [outbox] or \
                 [proxy] `store`, or pass --store postgres://URL | sqlite://PATH \
                 (`outbox run` does not assume the proxy's default store)",
                path.display()
            )
            .into())
        }
        None => database_of(&config, path)?,
    };
    let secrets = settings.secrets(path)?;
    let outbox = workers::open(&database, settings.listeners()).await?;
    let workers = Workers::start(outbox, settings, secrets);
    tracing::info!(
        destinations = settings.destinations.len(),
        database = database.split(':').next().unwrap_or_default(),
        "outbox workers started"
    );
    let signal = stops.next().await;
    tracing::info!(signal, "stopping the outbox workers");
    let timeout = resolved.shutdown_timeout;
    tokio::select! {
        stopped = tokio::time::timeout(timeout, workers.shutdown()) => match stopped {
            Ok(()) => tracing::info!("outbox workers stopped"),
            Err(_) => {
                tracing::error!("shutdown_timeout passed; exiting with rows left to the rescuer");
            }
        },
        signal = stops.next() => {
            tracing::warn!(signal, "second stop signal: exiting with rows left to the rescuer");
        }
    }
    Ok(())
}

/// The signals that stop `outbox run`, and SIGHUP, which is ignored.
struct Stops {
    term: Signal,
    int: Signal,
    quit: Signal,
    hup: Signal,
}

impl Stops {
    fn install() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            quit: signal(SignalKind::quit())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Waits for the next stop signal and names it.
    async fn next(&mut self) -> &'static str {
        loop {
            tokio::select! {
                _ = self.term.recv() => return "SIGTERM",
                _ = self.int.recv() => return "SIGINT",
                _ = self.quit.recv() => return "SIGQUIT",
                _ = self.hup.recv() => {
                    tracing::info!("SIGHUP ignored: SIGTERM stops the outbox workers");
                }
            }
        }
    }
}
