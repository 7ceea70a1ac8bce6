-- One reservation and its completion as the PostgreSQL store writes them,
-- with a principal hash: `pgbench -n -c 4 -j 2 -T 15 -f` against a schema
-- migrated with and one without the principal and in-flight indexes.
\set r random(1, 1000000000000)
INSERT INTO idempotency_records (key, fingerprint, owner, state, lease_expires_at, expires_at, principal) VALUES (sha256(:r::text::bytea), sha256(('f' || :r)::bytea), substr(sha256(('o' || :r)::bytea), 1, 16), 'in_flight', now() + interval '30 seconds', now() + interval '1 day', sha256(('p' || (:r % 1000))::bytea)) ON CONFLICT (key) DO NOTHING;
UPDATE idempotency_records SET state = 'completed', owner = NULL, lease_expires_at = NULL, status = 201, headers = '\x00'::bytea, body = 'body'::bytea, expires_at = now() + interval '1 day' WHERE key = sha256(:r::text::bytea) AND owner = substr(sha256(('o' || :r)::bytea), 1, 16) AND state = 'in_flight';
