-- tower-idempotency transactional outbox: a delivery key holds no `.`
-- either. It is the signed `webhook-id`, and the signature covers
-- `{id}.{timestamp}.{body}`: a delivery of `k.T2` sent at `T1` would verify
-- as the id `k` sent at `T2` with the body `T1.{body}`, a new key at the
-- receiver. Refused at insert and update, as the other delimiters are; rows
-- stored before are left alone (see 20261201100000).
CREATE OR REPLACE FUNCTION outbox_messages_delivery_key_token() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.delivery_key ~ '[^!-~]' OR NEW.delivery_key ~ '[",;.]' THEN
        RAISE EXCEPTION 'outbox_messages: delivery_key must be visible ASCII without ", ,, ; or .'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
