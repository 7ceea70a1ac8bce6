#!/usr/bin/env bash
# The test command: starts what the tests need, then runs every test of the
# workspace (library, stores against real PostgreSQL and Redis, the proxy
# binary end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
cargo test --workspace --all-features "$@"
