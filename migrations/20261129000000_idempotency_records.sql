-- tower-idempotency: one row per idempotency scope (PostgreSQL).
--
-- The key is the SHA-256 scope hash (principal, method, route, raw key);
-- the raw key, the principal and the request body are never stored.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key              bytea       PRIMARY KEY CHECK (octet_length(key) = 32),
    fingerprint      bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- The worker holding the lease; NULL once the record is completed.
    owner            bytea       CHECK (octet_length(owner) = 16),
    state            text        NOT NULL CHECK (state IN ('in_flight', 'completed', 'too_large')),
    -- Set while in flight; a lease that ran out can be taken over.
    lease_expires_at timestamptz,
    -- Retention: past it the row counts as absent and the sweeper deletes it.
    expires_at       timestamptz NOT NULL,
    -- The stored response (status only for 'too_large').
    status           smallint,
    headers          bytea,
    body             bytea,
    -- When the key was first reserved (kept across a lease takeover).
    created_at       timestamptz NOT NULL DEFAULT now(),
    CHECK ((state = 'in_flight') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);

-- The sweeper deletes expired rows in batches, oldest first.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
