//! The subcommands of `idempotency-proxy` (without one, it runs the
//! proxy): `keys …`, the operator's key operations against a store, and
//! `outbox …`, the outbox's workers and repairs, with no proxy running.
//!
//! ```text
//! idempotency-proxy keys lookup --key order-1 --path /orders --host shop.example \
//!     --principal alice --store postgres://… [--config idempotency.toml]
//! idempotency-proxy keys purge --scope <64 hex> --store sqlite://idempotency.db
//! idempotency-proxy keys purge-principal --jwt-sub user-42 --jwt-iss https://id.example …
//! idempotency-proxy keys release --key order-1 --path /orders …
//! idempotency-proxy keys in-flight --older-than 30s …
//! idempotency-proxy keys counts …
//! ```
//!
//! The configuration file gives the routes a scope hash is computed with
//! (and `store` and `redis` from `[proxy]` unless given as flags): give the
//! proxy's own file, or a lookup computes another hash than the proxy's.
//! The answer is JSON on stdout (as the admin API's); the log goes to
//! stderr. Exit status 0, 2 for bad input or configuration, 1 when the
//! store failed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use tower_idempotency::{Engine, EngineConfig};

use crate::config::Config;
use crate::keys::{self, Failure, JwtCaller, Op, PrincipalInput, Query, Target};

/// A subcommand; none runs the proxy.
// Parsed once per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Look up, purge and force-release idempotency keys in a store, list
    /// stuck keys and count records — without a running proxy.
    Keys(KeysArgs),
    /// Run outbox workers alone, or look at and repair the outbox table,
    /// without a running proxy.
    Outbox(crate::outbox::cli::OutboxArgs),
}

/// `keys`: where the records are, and the operation.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// The store: `sqlite://PATH` or `postgres://URL` [default: `store` in
    /// [proxy] of --config].
    #[arg(long, value_name = "STORE", global = true)]
    store: Option<String>,

    /// The proxy's configuration file: its routes decide scope hashes, its
    /// [proxy] table names the store and Redis unless given as flags.
    #[arg(long, value_name = "FILE", global = true)]
    config: Option<PathBuf>,

    /// The Redis front cache in use, so purged records are invalidated
    /// there too [default: `redis` in [proxy] of --config].
    #[arg(long, value_name = "URL", global = true)]
    redis: Option<String>,

    /// The Redis key prefix in use [default: `redis_prefix` in [proxy], or
    /// idem:].
    #[arg(long, value_name = "PREFIX", global = true)]
    redis_prefix: Option<String>,

    #[command(subcommand)]
    command: KeysCommand,
}

/// The key operations.
#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// The record a request with this key would meet: state, created,
    /// expires, lease left, stored status and size.
    Lookup {
        #[command(flatten)]
        target: TargetArgs,
        /// Also print the stored response (status, headers, body).
        #[arg(long)]
        body: bool,
    },
    /// Delete a record in any state; the next request with its key runs.
    Purge(TargetArgs),
    /// Delete every record stored for one caller.
    PurgePrincipal(PrincipalArgs),
    /// Release an in-flight key whoever holds it (or, with --holder, only
    /// while that holder still does); its holder's response will not be
    /// stored, and the next request with the key runs.
    Release {
        #[command(flatten)]
        target: TargetArgs,
        /// Release only while this holder (16 hex characters, as `lookup`
        /// and `in-flight` print it) still holds the key: a retry that took
        /// it over since keeps it.
        #[arg(long, value_name = "HEX")]
        holder: Option<String>,
    },
    /// List keys in flight for at least some time, oldest first.
    InFlight {
        /// The least age, such as 30s or 5m.
        #[arg(long, value_name = "AGE", default_value = "0s")]
        older_than: String,
        /// The most records listed.
        #[arg(long, default_value_t = keys::DEFAULT_LIMIT)]
        limit: usize,
    },
    /// Count records by state.
    Counts,
}

/// Which record: `--scope`, or what the client sent.
#[derive(Debug, Args)]
struct TargetArgs {
    /// The record's scope hash (64 hex characters, as `lookup` prints it).
    #[arg(long, value_name = "HEX", conflicts_with_all = ["key", "path", "method", "host", "headers", "headers_file"])]
    scope: Option<String>,
    /// The raw idempotency key the client sent.
    #[arg(long, required_unless_present = "scope")]
    key: Option<String>,
    /// The method the client used [default: POST].
    #[arg(long)]
    method: Option<String>,
    /// The path the client sent, such as /orders.
    #[arg(long, required_unless_present = "scope")]
    path: Option<String>,
    /// The Host the client addressed.
    #[arg(long)]
    host: Option<String>,
    /// A header the route scopes by, as `name: value` (repeatable). A
    /// credential here shows in `ps` and the shell's history: give it in
    /// `--headers-file` instead.
    #[arg(long = "header", value_name = "NAME: VALUE", id = "headers")]
    headers: Vec<String>,
    /// A file of `name: value` lines, one header each, read as `--header`s
    /// (`-`: standard input): for credentials (`Authorization`, `Cookie`)
    /// of a route that scopes by them.
    #[arg(long, value_name = "FILE")]
    headers_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    principal: PrincipalArgs,
}

/// A caller: a trusted header's value, or a JWT's `sub` (and `iss`).
#[derive(Debug, Args)]
struct PrincipalArgs {
    /// The principal as the route reads it (a trusted header's value).
    #[arg(long, conflicts_with = "jwt_sub")]
    principal: Option<String>,
    /// A JWT route's caller: the token's `sub`.
    #[arg(long, value_name = "SUB")]
    jwt_sub: Option<String>,
    /// With --jwt-sub: the token's `iss`, if it has one.
    #[arg(long, value_name = "ISS", requires = "jwt_sub")]
    jwt_iss: Option<String>,
    /// With --jwt-sub, once per tenant claim of the route
    /// (`tenant_claims`): the claim as the token holds it, `NAME=VALUE`;
    /// the value read as JSON when it is JSON (`org_id=7` is the number;
    /// `org_id='"7"'` the string), else as text.
    #[arg(long, value_name = "NAME=VALUE", requires = "jwt_sub")]
    jwt_claim: Vec<String>,
}

impl PrincipalArgs {
    fn input(&self) -> Result<Option<PrincipalInput>, Failure> {
        if let Some(sub) = &self.jwt_sub {
            let mut tenant = std::collections::BTreeMap::new();
            for claim in &self.jwt_claim {
                let Some((name, value)) = claim.split_once('=') else {
                    return Err(Failure::Input(format!(
                        "--jwt-claim `{claim}`: expected NAME=VALUE, such as org_id=org_a"
                    )));
                };
                let value = serde_json::from_str(value)
                    .unwrap_or_else(|_| serde_json::Value::String(value.to_owned()));
                tenant.insert(name.to_owned(), value);
            }
            return Ok(Some(PrincipalInput::Jwt(JwtCaller {
                sub: sub.clone(),
                iss: self.jwt_iss.clone(),
                tenant,
            })));
        }
        Ok(self.principal.clone().map(PrincipalInput::Raw))
    }
}

impl TargetArgs {
    fn target(&self) -> Result<Target, Failure> {
        if let Some(scope) = &self.scope {
            return Ok(Target::Scope {
                scope: scope.clone(),
            });
        }
        let mut query = Query {
            key: self.key.clone().unwrap_or_default(),
            method: self.method.clone(),
            path: self.path.clone().unwrap_or_default(),
            host: self.host.clone(),
            principal: self.principal.input()?,
            ..Query::default()
        };
        for header in &self.headers {
            let Some((name, value)) = header_line(header) else {
                return Err(Failure::Input(format!(
                    "--header: expected `name: value`, got `{header}`"
                )));
            };
            query.add_header(name, value);
        }
        if let Some(path) = &self.headers_file {
            let text = match path.as_os_str() == "-" {
                true => std::io::read_to_string(std::io::stdin()),
                false => std::fs::read_to_string(path),
            }
            .map_err(|error| {
                Failure::Input(format!("--headers-file {}: {error}", path.display()))
            })?;
            for (n, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                // The line is never echoed: it may hold a credential.
                let Some((name, value)) = header_line(line) else {
                    return Err(Failure::Input(format!(
                        "--headers-file {}: line {}: expected `name: value`",
                        path.display(),
                        n + 1
                    )));
                };
                query.add_header(name, value);
            }
        }
        Ok(Target::Query(query))
    }
}

/// A `name: value` header line (of `--header` or `--headers-file`), both
/// trimmed.
fn header_line(line: &str) -> Option<(&str, &str)> {
    let (name, value) = line.split_once(':')?;
    Some((name.trim(), value.trim()))
}

impl KeysCommand {
    fn op(&self) -> Result<Op, Failure> {
        Ok(match self {
            KeysCommand::Lookup { target, body } => Op::Lookup {
                target: target.target()?,
                body: *body,
            },
            KeysCommand::Purge(target) => Op::Purge(target.target()?),
            KeysCommand::Release { target, holder } => Op::Release {
                target: target.target()?,
                holder: holder.as_deref().map(str::parse).transpose().map_err(
                    |error: keys::HolderError| Failure::Input(format!("--holder: {error}")),
                )?,
            },
            KeysCommand::PurgePrincipal(principal) => {
                Op::PurgePrincipal(principal.input()?.ok_or_else(|| {
                    Failure::Input(
                        "purge-principal: give --principal VALUE or --jwt-sub SUB [--jwt-iss ISS]"
                            .into(),
                    )
                })?)
            }
            KeysCommand::InFlight { older_than, limit } => Op::InFlight {
                older_than: keys::parse_age(older_than)?,
                limit: *limit,
            },
            KeysCommand::Counts => Op::Counts,
        })
    }
}

/// Runs a subcommand to its exit status.
pub fn run(command: Command) -> ExitCode {
    let args = match command {
        Command::Keys(args) => args,
        Command::Outbox(args) => {
            return match crate::outbox::cli::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("idempotency-proxy: {error}");
                    ExitCode::from(2)
                }
            }
        }
    };
    match run_keys(&args) {
        Ok(answer) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&answer).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("idempotency-proxy keys: {failure}");
            ExitCode::from(match failure {
                Failure::Input(_) => 2,
                Failure::Unsupported(_) | Failure::Store(_) => 1,
            })
        }
    }
}

/// How long one store call of the command line may take (an operator's
/// count of a large table takes a while).
const STORE_TIMEOUT: Duration = Duration::from_secs(60);

fn run_keys(args: &KeysArgs) -> Result<serde_json::Value, Failure> {
    let op = args.command.op()?;
    let config = match &args.config {
        Some(path) => Config::load(path).map_err(|error| Failure::Input(error.to_string()))?,
        None => {
            if op.computes_scopes() {
                // Not refused: a proxy run without a file uses these too.
                eprintln!(
                    "warning: no --config: scopes are computed with the built-in routes and \
                     no key secret; a proxy configured otherwise stores its records under \
                     other scopes, which this does not find (pass the proxy's --config)"
                );
            }
            Config::builtin()
        }
    };
    let settings = &config.proxy;
    let store = args
        .store
        .as_ref()
        .or(settings.store.as_ref())
        .ok_or_else(|| {
            Failure::Input(
                "no store: pass --store URL (sqlite://PATH or postgres://URL), or --config with \
             `store` in [proxy]"
                    .into(),
            )
        })?;
    if store == "memory" {
        return Err(Failure::Input(
            "--store memory: a memory store lives inside its proxy; use the admin API \
             (/keys/...) of that proxy instead"
                .into(),
        ));
    }
    // The proxy creates its SQLite file; the command line would create an
    // empty one wherever it is run (a relative path is read against the
    // operator's directory) and answer from it as if from the proxy's.
    if let Some(path) = sqlite_file(store) {
        if !path.exists() {
            return Err(Failure::Input(format!(
                "no SQLite store at `{}` (a relative path is read against the current \
                 directory): give the path of the proxy's own file",
                path.display()
            )));
        }
    }
    let redis = args.redis.as_ref().or(settings.redis.as_ref());
    if redis.is_none() && matches!(op, keys::Op::Purge(_) | keys::Op::PurgePrincipal(_)) {
        eprintln!(
            "note: no Redis given (--redis, or `redis` in [proxy] of --config): if the proxy \
             runs with a Redis cache, purge with it too, or the cached copy is replayed until \
             its ttl"
        );
    }
    let prefix = args
        .redis_prefix
        .as_ref()
        .or(settings.redis_prefix.as_ref());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| Failure::Store(format!("cannot start a runtime: {error}")))?;
    // The same key secret and keys as the proxy: scopes are hashed under
    // the secret, and stored bodies open only with the keyring.
    let secrets = config.secrets.load().map_err(Failure::Input)?;
    runtime.block_on(async {
        let store = crate::store::open(
            store,
            redis.map(String::as_str),
            prefix.map(String::as_str),
            STORE_TIMEOUT,
            (None, None),
        )
        .await
        .map_err(Failure::Input)?;
        let engine = Engine::with_config(
            store,
            config.routes.clone(),
            EngineConfig {
                store_timeout: STORE_TIMEOUT,
                key_secret: secrets.key_secret,
                encryption: secrets.keyring,
                ..EngineConfig::default()
            },
        );
        keys::run(&engine, op).await
    })
}

/// The file an `sqlite:` store URL names, as the store opens it; `None`
/// for other stores and in-memory databases.
fn sqlite_file(store: &str) -> Option<std::path::PathBuf> {
    store
        .starts_with("sqlite:")
        .then(|| tower_idempotency::SqliteStore::file_of(store))
        .flatten()
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn sqlite_urls_name_the_file_the_store_opens() {
        let file = |url| super::sqlite_file(url).map(|p| p.display().to_string());
        assert_eq!(
            file("sqlite:///var/x%20y.db").as_deref(),
            Some("/var/x y.db")
        );
        assert_eq!(file("sqlite://rel.db?mode=rwc").as_deref(), Some("rel.db"));
        assert_eq!(file("sqlite::memory:"), None);
        assert_eq!(file("sqlite://x?mode=memory"), None);
        assert_eq!(file("postgres://db/app"), None);
    }

    #[test]
    fn the_command_line_is_well_formed() {
        crate::Cli::command().debug_assert();
    }
}
