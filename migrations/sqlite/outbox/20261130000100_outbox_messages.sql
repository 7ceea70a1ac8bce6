-- tower-idempotency transactional outbox (SQLite).
--
-- Same columns as the PostgreSQL schema; times are seconds since the Unix
-- epoch (REAL, millisecond precision) by SQLite's own clock,
-- unixepoch('subsec'). Enqueue in the business row's transaction:
--
--   INSERT INTO outbox_messages (topic, source, payload)
--   VALUES (?1, ?2, CAST(?3 AS BLOB))
--   ON CONFLICT (topic, source) DO NOTHING;
CREATE TABLE IF NOT EXISTS outbox_messages (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    topic            TEXT    NOT NULL CHECK (length(topic) BETWEEN 1 AND 200),
    source           TEXT    NOT NULL CHECK (length(source) BETWEEN 1 AND 200),
    -- A random UUID (version 4) unless the application gives one.
    delivery_key     TEXT    NOT NULL DEFAULT (lower(
                                 hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' ||
                                 substr(hex(randomblob(2)), 2) || '-' ||
                                 substr('89ab', 1 + (abs(random()) % 4), 1) ||
                                 substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6))))
                             CHECK (length(delivery_key) BETWEEN 1 AND 255),
    payload          BLOB    NOT NULL,
    content_type     TEXT    NOT NULL DEFAULT 'application/json',
    state            TEXT    NOT NULL DEFAULT 'available'
                             CHECK (state IN ('available', 'running', 'retryable', 'completed', 'dead')),
    attempt          INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     INTEGER NOT NULL DEFAULT 12 CHECK (max_attempts >= 1),
    owner            BLOB    CHECK (length(owner) = 16),
    lease_expires_at REAL,
    next_attempt_at  REAL    NOT NULL DEFAULT (unixepoch('subsec')),
    last_error_class TEXT,
    last_status      INTEGER,
    last_request_id  TEXT,
    last_error       TEXT,
    created_at       REAL    NOT NULL DEFAULT (unixepoch('subsec')),
    updated_at       REAL    NOT NULL DEFAULT (unixepoch('subsec')),
    completed_at     REAL,
    CONSTRAINT outbox_messages_topic_source UNIQUE (topic, source),
    CONSTRAINT outbox_messages_delivery_key UNIQUE (delivery_key),
    CHECK ((state = 'running') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CHECK ((state = 'completed') = (completed_at IS NOT NULL))
);

CREATE INDEX IF NOT EXISTS outbox_messages_due ON outbox_messages (next_attempt_at, id)
    WHERE state IN ('available', 'retryable');
CREATE INDEX IF NOT EXISTS outbox_messages_leases ON outbox_messages (lease_expires_at)
    WHERE state = 'running';
CREATE INDEX IF NOT EXISTS outbox_messages_completed ON outbox_messages (completed_at)
    WHERE state = 'completed';
