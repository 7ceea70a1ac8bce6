-- tower-idempotency: the principal's hash in each record, for operators
-- (SQLite); see the PostgreSQL migration of the same name.
ALTER TABLE idempotency_records
    ADD COLUMN principal BLOB CHECK (length(principal) = 32);

CREATE INDEX IF NOT EXISTS idempotency_records_principal
    ON idempotency_records (principal) WHERE principal IS NOT NULL;

CREATE INDEX IF NOT EXISTS idempotency_records_in_flight
    ON idempotency_records (created_at) WHERE state = 'in_flight';
