#!/usr/bin/env bash
# How far one PostgreSQL goes for the store: the store's own statements on
# its own schema (migrations/), timed with pgbench at growing concurrency.
#
#   scripts/pg_capacity.sh     # env: DATABASE_ADMIN_URL, CELL_SECONDS (5), CLIENTS ("1 4 16 32")
#
# A "first execution" is what the store runs for a new key: the reserve
# INSERT … ON CONFLICT DO NOTHING and the complete UPDATE, each its own
# transaction (two commits, two WAL flushes). A "replay" is the conflicting
# INSERT and the SELECT of the record. It creates a database of its own
# (capacity_<pid>) and drops it at the end. Needs psql and pgbench.
set -euo pipefail

ADMIN_URL=${DATABASE_ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres}
SECONDS_PER_CELL=${CELL_SECONDS:-5}
CLIENTS=${CLIENTS:-"1 4 16 32"}
DB=capacity_$$
BASE=${ADMIN_URL%/*}
URL=$BASE/$DB
WORK=$(mktemp -d)
cleanup() {
    psql "$ADMIN_URL" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

psql "$ADMIN_URL" -qc "CREATE DATABASE $DB" >/dev/null
for file in "$(dirname "$0")"/../migrations/*.sql; do
    psql "$URL" -q -v ON_ERROR_STOP=1 -f "$file" >/dev/null
done
# 100 000 completed records to replay.
psql "$URL" -q -v ON_ERROR_STOP=1 -c "
INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at, status, headers, body)
SELECT sha256(int8send(g)), sha256(int8send(g)), NULL, 'completed', NULL, now() + interval '1 day',
       201, '\x'::bytea, convert_to(repeat('x', 1024), 'UTF8')
FROM generate_series(1, 100000) g" >/dev/null

KEY="sha256(int8send(:k))"
OWNER="substr(sha256(int8send(:k)), 1, 16)"
cat >"$WORK/first.sql" <<SQL
\set k random(1000000, 9000000000000000)
INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at) VALUES ($KEY, $KEY, $OWNER, 'in_flight', now() + 30000000::bigint * interval '1 microsecond', now() + 86400000000::bigint * interval '1 microsecond') ON CONFLICT (key) DO NOTHING RETURNING false AS takeover;
UPDATE idempotency_records SET state = 'completed', owner = NULL, lease_expires_at = NULL, status = 201, headers = '\x'::bytea, body = convert_to(repeat('x', 1024), 'UTF8'), expires_at = now() + 86400000000::bigint * interval '1 microsecond' WHERE key = $KEY AND owner = $OWNER AND state = 'in_flight';
SQL
cat >"$WORK/replay.sql" <<SQL
\set k random(1, 100000)
INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at) VALUES ($KEY, $KEY, $OWNER, 'in_flight', now() + 30000000::bigint * interval '1 microsecond', now() + 86400000000::bigint * interval '1 microsecond') ON CONFLICT (key) DO NOTHING RETURNING false AS takeover;
SELECT fingerprint, state, status, headers, body, (extract(epoch FROM greatest(lease_expires_at - now(), interval '0')) * 1000000)::bigint AS lease_remaining_us FROM idempotency_records WHERE key = $KEY AND expires_at > now();
SQL

tps() {
    pgbench -n -M prepared -j 2 -c "$1" -T "$SECONDS_PER_CELL" -f "$WORK/$2.sql" "$URL" 2>/dev/null |
        sed -n 's/^tps = \([0-9.]*\).*/\1/p' | head -1
}

echo "| clients | first executions/s | vs 1 client | replays/s | vs 1 client | replays ÷ first executions |"
echo "|---:|---:|---:|---:|---:|---:|"
first1=""
replay1=""
for c in $CLIENTS; do
    first=$(tps "$c" first)
    replay=$(tps "$c" replay)
    first1=${first1:-$first}
    replay1=${replay1:-$replay}
    awk -v c="$c" -v f="$first" -v r="$replay" -v f1="$first1" -v r1="$replay1" 'BEGIN {
        printf "| %d | %.0f | %.2f | %.0f | %.2f | %.2f |\n", c, f, f / f1, r, r / r1, r / f }'
done
