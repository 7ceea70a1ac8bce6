-- tower-idempotency transactional outbox (PostgreSQL).
--
-- One row per (topic, source): a message to deliver to one integration
-- (`topic`, e.g. `crm`) about one business row (`source`, e.g. a submission
-- id). Applications enqueue in the same transaction as their business row:
--
--   INSERT INTO outbox_messages (topic, source, payload)
--   VALUES ($1, $2, convert_to($3, 'UTF8'))
--   ON CONFLICT (topic, source) DO NOTHING;
--
-- The error columns hold an error class, the receiver's status and request
-- id and a short reason written by the worker: never the payload.
CREATE TABLE IF NOT EXISTS outbox_messages (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The integration (destination) the message goes to.
    topic            text        NOT NULL CHECK (length(topic) BETWEEN 1 AND 200),
    -- The business row it is about; unique per topic.
    source           text        NOT NULL CHECK (length(source) BETWEEN 1 AND 200),
    -- Sent downstream with every attempt (`Idempotency-Key`, `webhook-id`);
    -- never changes.
    delivery_key     text        NOT NULL DEFAULT gen_random_uuid()::text
                                 CHECK (length(delivery_key) BETWEEN 1 AND 255),
    payload          bytea       NOT NULL,
    content_type     text        NOT NULL DEFAULT 'application/json',
    state            text        NOT NULL DEFAULT 'available'
                                 CHECK (state IN ('available', 'running', 'retryable', 'completed', 'dead')),
    -- Attempts started so far (a claim counts as one).
    attempt          integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     integer     NOT NULL DEFAULT 12 CHECK (max_attempts >= 1),
    -- The worker holding the row and until when; set exactly while running.
    owner            bytea       CHECK (octet_length(owner) = 16),
    lease_expires_at timestamptz,
    -- Not claimed before this time.
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- The last attempt's outcome: `transient`, `permanent` or `lease_expired`
    -- (NULL after success), the receiver's status and request id, a reason.
    last_error_class text,
    last_status      smallint,
    last_request_id  text,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    CONSTRAINT outbox_messages_topic_source UNIQUE (topic, source),
    CONSTRAINT outbox_messages_delivery_key UNIQUE (delivery_key),
    CHECK ((state = 'running') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CHECK ((state = 'completed') = (completed_at IS NOT NULL))
);

-- Workers claim due rows, oldest due first.
CREATE INDEX IF NOT EXISTS outbox_messages_due ON outbox_messages (next_attempt_at, id)
    WHERE state IN ('available', 'retryable');
-- The rescuer finds rows whose lease ran out.
CREATE INDEX IF NOT EXISTS outbox_messages_leases ON outbox_messages (lease_expires_at)
    WHERE state = 'running';
-- Retention: completed rows are swept, oldest first.
CREATE INDEX IF NOT EXISTS outbox_messages_completed ON outbox_messages (completed_at)
    WHERE state = 'completed';
