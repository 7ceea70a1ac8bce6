//! The subcommands of `idempotency-proxy`. Without one, the proxy runs.

use clap::Subcommand;

/// What to do instead of running the proxy.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run outbox workers alone, or look at and repair the outbox table,
    /// without a running proxy.
    Outbox(crate::outbox::cli::OutboxArgs),
}
