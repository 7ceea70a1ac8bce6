-- tower-idempotency: the principal's hash in each record, for operators
-- (PostgreSQL).
--
-- A record reserved for an authenticated caller keeps the SHA-256 of its
-- principal (never the principal itself), so "delete everything stored
-- for this caller" finds its records through an index. Records written
-- before this migration, and records of routes without a principal, keep
-- NULL. Both indexes are partial: only rows with a principal, and only
-- rows in flight (few at any time), are indexed.
--
-- On a large table each CREATE INDEX blocks writes while it scans; to
-- avoid that, create both indexes beforehand with CREATE INDEX
-- CONCURRENTLY and the same names and definitions (IF NOT EXISTS then
-- skips them).
ALTER TABLE idempotency_records
    ADD COLUMN IF NOT EXISTS principal bytea CHECK (octet_length(principal) = 32);

CREATE INDEX IF NOT EXISTS idempotency_records_principal
    ON idempotency_records (principal) WHERE principal IS NOT NULL;

-- Operators list in-flight records older than some age.
CREATE INDEX IF NOT EXISTS idempotency_records_in_flight
    ON idempotency_records (created_at) WHERE state = 'in_flight';
