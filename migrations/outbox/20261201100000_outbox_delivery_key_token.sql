-- tower-idempotency transactional outbox: a delivery key is one token that
-- an idempotent receiver reads as it was written. It is sent bare as
-- `Idempotency-Key`, and this crate's layer and `idempotency-proxy` (as any
-- reader of the IETF draft's sf-string) refuse a bare key holding `"`, `,`
-- or `;` (400: the row went `dead` on its first attempt) and read `"k"` as
-- `k` (two rows, one key at the receiver). Such keys are refused at insert
-- and when the key is updated, in the application's own transaction. A
-- trigger rather than a table CHECK: PostgreSQL checks a CHECK (even one
-- added NOT VALID) on every update of a row, so a row stored before this
-- migration would fail every claim of its batch; here it is left alone.
CREATE OR REPLACE FUNCTION outbox_messages_delivery_key_token() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.delivery_key ~ '[^!-~]' OR NEW.delivery_key ~ '[",;]' THEN
        RAISE EXCEPTION 'outbox_messages: delivery_key must be visible ASCII without ", , or ;'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_messages_delivery_key_token
BEFORE INSERT OR UPDATE OF delivery_key ON outbox_messages
FOR EACH ROW EXECUTE FUNCTION outbox_messages_delivery_key_token();
