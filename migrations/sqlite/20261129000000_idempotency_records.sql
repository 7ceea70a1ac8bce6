-- tower-idempotency: one row per idempotency scope (SQLite).
--
-- Same columns as the PostgreSQL schema; times are seconds since the Unix
-- epoch (REAL, millisecond precision) by SQLite's own clock,
-- unixepoch('subsec').
CREATE TABLE IF NOT EXISTS idempotency_records (
    key              BLOB    PRIMARY KEY CHECK (length(key) = 32),
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    owner            BLOB    CHECK (length(owner) = 16),
    state            TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'too_large')),
    lease_expires_at REAL,
    expires_at       REAL    NOT NULL,
    status           INTEGER,
    headers          BLOB,
    body             BLOB,
    created_at       REAL    NOT NULL,
    CHECK ((state = 'in_flight') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL))
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
