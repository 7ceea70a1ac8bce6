-- tower-idempotency: the store's own id (SQLite); see the PostgreSQL
-- migration of the same name.
CREATE TABLE IF NOT EXISTS idempotency_store (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
    id        TEXT    NOT NULL CHECK (id <> '')
);

INSERT INTO idempotency_store (singleton, id)
VALUES (1, lower(hex(randomblob(16))))
ON CONFLICT (singleton) DO NOTHING;
