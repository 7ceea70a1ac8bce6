//! `idempotency-proxy`: a reverse proxy that makes unsafe HTTP requests take
//! effect once, in front of any backend, without a code change there.
//!
//! ```text
//! idempotency-proxy --listen 127.0.0.1:8080 --upstream http://127.0.0.1:3000 \
//!     [--store memory | sqlite://PATH | postgres://URL] [--redis redis://URL | redis+cluster://HOST:PORT,…] \
//!     [--config idempotency.toml] [--admin 127.0.0.1:9090]
//! idempotency-proxy outbox run --config idempotency.toml
//! idempotency-proxy outbox counts|dead|retry ID|purge … --store URL | --config FILE
//! idempotency-proxy keys lookup|purge|purge-principal|release|in-flight|counts … \
//!     --store URL [--config idempotency.toml]
//! ```
//!
//! Every decision is the [`Engine`]'s; see `proxy.rs` for how bytes move.

#![deny(unsafe_code)]

mod admin;
mod body;
mod cli;
mod client;
mod config;
mod demo;
mod exchange;
mod keys;
mod logs;
mod outbox;
mod passthrough;
mod proxy;
mod secrets;
mod shutdown;
mod store;
mod upstream;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::{RunArgs, Server};
use tower_idempotency::policy::PathPattern;
use tower_idempotency::{Engine, EngineConfig};

use crate::config::{Config, ProxySettings};
use crate::shutdown::{Drain, Signals};
use crate::upstream::{Timeouts, Upstream};

/// mimalloc instead of glibc's `malloc`: a request allocates and frees
/// many small objects across threads (Pingora's sessions, headers, the
/// engine's records), where glibc's allocator took about a tenth of the
/// proxy's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Makes POST/PATCH requests take effect once, in front of any HTTP backend.
///
/// A request carrying an idempotency key (by default the `Idempotency-Key`
/// header) runs once upstream; retries with the same key get the stored
/// response replayed, with `Idempotent-Replayed: true`. Routes, key sources
/// and limits are set in the configuration file (see
/// idempotency.example.toml). Flags override the file.
#[derive(Debug, Parser)]
#[command(name = "idempotency-proxy", version, about, long_about)]
struct Cli {
    /// Address to accept client connections on [default: 127.0.0.1:8080].
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,

    /// The backend every request is forwarded to, as http://HOST:PORT.
    #[arg(long, value_name = "URL")]
    upstream: Option<String>,

    /// Where idempotency records live: `memory` (lost on restart),
    /// `sqlite://PATH` (one node, survives restarts) or `postgres://URL`
    /// (shared by several proxies) [default: sqlite://idempotency.db in the
    /// working directory].
    #[arg(long, value_name = "STORE")]
    store: Option<String>,

    /// A Redis front cache (redis://HOST:PORT, or
    /// redis+cluster://HOST:PORT,HOST:PORT for a Redis Cluster) in front of
    /// the store: replays are answered from Redis; Redis never decides who
    /// runs a request.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,

    /// Prepended to every Redis key, before the store's own id (so two
    /// deployments with separate stores never share entries) [default:
    /// idem:].
    #[arg(long, value_name = "PREFIX")]
    redis_prefix: Option<String>,

    /// A TOML file with the [proxy] settings, [defaults] and [[route]]
    /// policies, and [outbox] workers to run. A bad file is refused at
    /// start with its line and key.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Address for the admin listener serving /healthz and /metrics
    /// (Prometheus). Off unless given.
    #[arg(long, value_name = "ADDR")]
    admin: Option<String>,

    /// Also run the bundled demo backend (a contact form and a JSON orders
    /// endpoint that count their executions) on ADDR, and use it as the
    /// upstream unless --upstream is given. Without --config, the proxy
    /// then protects the demo's form and API routes. For trying it out.
    #[arg(
        long,
        value_name = "ADDR",
        num_args = 0..=1,
        default_missing_value = "127.0.0.1:3000"
    )]
    demo_backend: Option<String>,

    /// Without a subcommand, runs the proxy.
    #[command(subcommand)]
    command: Option<cli::Command>,
}

impl Cli {
    fn settings(&self) -> ProxySettings {
        ProxySettings {
            listen: self.listen.clone(),
            upstream: self.upstream.clone().or_else(|| {
                let demo = self.demo_backend.as_ref()?;
                Some(format!("http://{demo}"))
            }),
            store: self.store.clone(),
            redis: self.redis.clone(),
            redis_prefix: self.redis_prefix.clone(),
            admin: self.admin.clone(),
            ..ProxySettings::default()
        }
    }
}

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    logs::init();
    let result = match cli.command.take() {
        Some(command) => {
            let code = cli::run(command);
            logs::flush();
            return code;
        }
        None => run(cli),
    };
    logs::flush();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idempotency-proxy: {error}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let config = match (&cli.config, &cli.demo_backend) {
        (Some(path), _) => Config::load(path)?,
        // The one-flag demo protects its own routes.
        (None, Some(_)) => Config::parse(demo::CONFIG).expect("the demo configuration is valid"),
        (None, None) => Config::builtin(),
    };
    let settings = config.proxy.clone().overridden_by(cli.settings()).resolve();
    settings.check()?;
    let upstream_url = settings
        .upstream
        .clone()
        .ok_or("no upstream: pass --upstream http://HOST:PORT (or `upstream` in [proxy])")?;
    let upstream = Arc::new(Upstream::new(
        &upstream_url,
        Timeouts {
            connect: settings.connect_timeout,
            read: settings.read_timeout,
            write: settings.write_timeout,
            idle: settings.idle_timeout,
        },
    )?);
    let admin_token = admin::AdminToken::load(settings.admin_token_file.as_deref())?;
    let secrets = config.secrets.load()?;
    let keyed_scopes = secrets.key_secret.is_some();
    let encryption_key = secrets
        .keyring
        .as_ref()
        .map_or("off".to_owned(), |keyring| keyring.current_id().to_owned());
    let listeners = [
        Some(&settings.listen),
        settings.admin.as_ref(),
        cli.demo_backend.as_ref(),
    ];
    // Fail early and clearly; Pingora binds again when it starts. All are
    // held until each is bound, so two that name one port (`--listen` and
    // `--admin` alike, or a wildcard and a loopback address) are refused:
    // the second bind of a port just let go succeeded, and one of the two
    // services failed to start inside a process that ran on without it.
    let mut bound = Vec::new();
    for address in listeners.into_iter().flatten() {
        let listener = std::net::TcpListener::bind(address)
            .map_err(|error| format!("cannot listen on {address}: {error}"))?;
        bound.push(listener);
    }
    drop(bound);

    // Store connections belong to this runtime; it lives as long as the
    // process.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("idempotency-store")
        .enable_all()
        .build()?;
    let store = runtime.block_on(store::open(
        &settings.store,
        settings.redis.as_deref(),
        settings.redis_prefix.as_deref(),
        settings.store_timeout,
        (settings.memory_max_records, settings.memory_max_bytes),
    ))?;
    let engine = Engine::with_config(
        store,
        config.routes.clone(),
        EngineConfig {
            store_timeout: settings.store_timeout,
            max_buffered_bytes: settings.max_buffered_bytes,
            key_secret: secrets.key_secret,
            encryption: secrets.keyring,
            ..EngineConfig::default()
        },
    );
    {
        let _entered = runtime.enter();
        engine.spawn_sweeper(settings.sweep_interval, 1000);
    }
    // `[outbox]`: its workers run on the store's runtime.
    let outbox = match &config.outbox {
        Some(outbox_settings) => {
            let file = cli.config.as_deref().unwrap_or(std::path::Path::new("-"));
            let database = outbox_settings.database_or(&settings.store)?;
            let secrets = outbox_settings.secrets(file)?;
            let listeners = outbox_settings.listeners();
            let outbox = runtime.block_on(outbox::workers::open(&database, listeners))?;
            let _entered = runtime.enter();
            let workers = outbox::workers::Workers::start(outbox.clone(), outbox_settings, secrets);
            Some((outbox, workers))
        }
        None => None,
    };

    let mut conf = ServerConf::new().ok_or("Pingora configuration")?;
    conf.threads = settings.threads;
    // The shutdown thread (`shutdown.rs`) exits at `shutdown_timeout`, and
    // up to a second later once it stored what it abandons; Pingora's
    // own grace period is the backstop, in whole seconds: rounded up, with
    // two to spare, so that it never ends the process (status 0, nothing
    // stored) before that thread does.
    let grace = settings.shutdown_timeout.as_secs()
        + u64::from(settings.shutdown_timeout.subsec_nanos() > 0)
        + 2;
    conf.grace_period_seconds = Some(grace);
    conf.graceful_shutdown_timeout_seconds = Some(1);
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let drain = Drain::default();
    let engine_for_shutdown = engine.clone();
    let mut proxy = pingora_proxy::http_proxy_service(
        &server.configuration,
        proxy::IdempotencyProxy::new(
            engine.clone(),
            upstream,
            drain.clone(),
            settings.body_timeout,
        ),
    );
    proxy.add_tcp(&settings.listen);
    server.add_service(proxy);
    let operator_api = admin_token.is_some();
    if let Some(address) = &settings.admin {
        let mut admin = pingora_core::services::listening::Service::new(
            "admin".to_owned(),
            admin::Admin {
                engine,
                token: admin_token,
                outbox: outbox.as_ref().map(|(outbox, _)| outbox.clone()),
                health: admin::HealthCache::default(),
            },
        );
        admin.threads = Some(1);
        admin.add_tcp(address);
        server.add_service(admin);
    }
    if let Some(address) = &cli.demo_backend {
        let mut demo = pingora_core::services::listening::Service::new(
            "demo backend".to_owned(),
            demo::DemoBackend::default(),
        );
        demo.threads = Some(1);
        demo.add_tcp(address);
        server.add_service(demo);
        tracing::info!(%address, "demo backend started: open http://{}/contact", settings.listen);
    }
    tracing::info!(
        listen = %settings.listen,
        upstream = %upstream_url,
        store = store_kind(&settings.store),
        redis = settings.redis.is_some(),
        admin = settings.admin.as_deref().unwrap_or("off"),
        operator_api,
        outbox_destinations = config.outbox.as_ref().map_or(0, |o| o.destinations.len()),
        keyed_scopes,
        encryption_key = %encryption_key,
        "idempotency-proxy started"
    );
    warn_of_shared_scopes(&config.routes);
    let signals = Signals {
        drain,
        engine: engine_for_shutdown,
        outbox: outbox.map(|(_, workers)| workers),
        runtime: runtime.handle().clone(),
        timeout: settings.shutdown_timeout,
    };
    server.run(RunArgs {
        shutdown_signal: Box::new(signals),
    });
    drop(runtime);
    Ok(())
}

/// The store's kind, for the log: never the URL (it may hold a password).
fn store_kind(spec: &str) -> &str {
    spec.split(':').next().unwrap_or(spec)
}

/// Warns, once at start, of covered routes that scope keys by host and path
/// alone (no `principal`, no `scope_headers`): every caller of such a route
/// shares one key space, so a caller that sends another's key is answered
/// with the other's response. Right for a single-tenant backend; a warning
/// so that no one runs it by oversight in front of several users. Worse
/// where such a route replays `Set-Cookie` (a session): warned apart.
fn warn_of_shared_scopes(routes: &tower_idempotency::Routes) {
    let shared = |also: fn(&tower_idempotency::Policy) -> bool| -> Vec<String> {
        routes
            .iter()
            .filter_map(|route| {
                let policy = route.policy.as_ref()?.policy();
                let shared = policy.principal.is_none() && policy.scope_headers.is_empty();
                (shared && also(policy)).then(|| match &route.path {
                    PathPattern::Prefix(path) | PathPattern::Glob(path) => path.clone(),
                })
            })
            .collect()
    };
    let all = shared(|_| true);
    if !all.is_empty() {
        tracing::warn!(
            routes = %all.join(" "),
            "covered routes without `principal` or `scope_headers`: all their callers share \
             one key space, and a caller sending another's key gets the other's response; \
             set `principal` (or `scope_headers`) unless the backend serves one tenant"
        );
    }
    let cookies = shared(|policy| policy.replay_set_cookie);
    if !cookies.is_empty() {
        tracing::warn!(
            routes = %cookies.join(" "),
            "covered routes that replay `Set-Cookie` in one shared key space: a caller \
             sending another's key is handed the cookies (a session) minted for the other; \
             set `principal` (or `scope_headers`), or `replay_set_cookie = false`"
        );
    }
}
