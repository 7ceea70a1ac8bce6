-- tower-idempotency: the store's own id (PostgreSQL).
--
-- One row, created once with a random id: every instance connected to this
-- database reads the same id, another database has another. A cache in
-- front of the store (Redis) puts it into its key namespace, so two
-- deployments sharing one Redis never see each other's records. A database
-- restored from another's copy keeps that id: give it a new one with
-- `UPDATE idempotency_store SET id = gen_random_uuid()::text`.
CREATE TABLE IF NOT EXISTS idempotency_store (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    id        text    NOT NULL CHECK (id <> '')
);

INSERT INTO idempotency_store (singleton, id)
VALUES (true, replace(gen_random_uuid()::text, '-', ''))
ON CONFLICT (singleton) DO NOTHING;
