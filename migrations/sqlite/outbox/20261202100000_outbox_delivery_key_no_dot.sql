-- tower-idempotency transactional outbox (SQLite): a delivery key holds no
-- `.` either (the separator of the signed string); see the PostgreSQL
-- migration of the same name.
DROP TRIGGER IF EXISTS outbox_messages_delivery_key_on_insert;
DROP TRIGGER IF EXISTS outbox_messages_delivery_key_on_update;

CREATE TRIGGER outbox_messages_delivery_key_on_insert
BEFORE INSERT ON outbox_messages
WHEN NEW.delivery_key GLOB '*[^!-~]*' OR NEW.delivery_key GLOB '*[",;.]*'
BEGIN
    SELECT RAISE(ABORT, 'outbox_messages: delivery_key must be visible ASCII without ", ,, ; or .');
END;

CREATE TRIGGER outbox_messages_delivery_key_on_update
BEFORE UPDATE OF delivery_key ON outbox_messages
WHEN NEW.delivery_key GLOB '*[^!-~]*' OR NEW.delivery_key GLOB '*[",;.]*'
BEGIN
    SELECT RAISE(ABORT, 'outbox_messages: delivery_key must be visible ASCII without ", ,, ; or .');
END;
