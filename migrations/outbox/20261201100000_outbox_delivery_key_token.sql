-- tower-idempotency transactional outbox: a delivery key is one token that
-- an idempotent receiver reads as it was written. It is sent bare as
-- `Idempotency-Key`, and this crate's layer and `idempotency-proxy` (as any
-- reader of the IETF draft's sf-string) refuse a bare key holding `"`, `,`
-- or `;` (400: the row went `dead` on its first attempt) and read `"k"` as
-- `k` (two rows, one key at the receiver). Such keys are refused at insert,
-- in the application's own transaction; rows already stored are not checked.
ALTER TABLE outbox_messages
    ADD CONSTRAINT outbox_messages_delivery_key_token
    CHECK (delivery_key !~ '[^!-~]' AND delivery_key !~ '[",;]') NOT VALID;
