-- tower-idempotency transactional outbox (SQLite): a delivery key is one
-- token that an idempotent receiver reads as it was written; see the
-- PostgreSQL migration of the same name. Keys holding anything but visible
-- ASCII, or `"`, `,` or `;`, are refused at insert and update.
CREATE TRIGGER IF NOT EXISTS outbox_messages_delivery_key_on_insert
BEFORE INSERT ON outbox_messages
WHEN NEW.delivery_key GLOB '*[^!-~]*' OR NEW.delivery_key GLOB '*[",;]*'
BEGIN
    SELECT RAISE(ABORT, 'outbox_messages: delivery_key must be visible ASCII without ", , or ;');
END;

CREATE TRIGGER IF NOT EXISTS outbox_messages_delivery_key_on_update
BEFORE UPDATE OF delivery_key ON outbox_messages
WHEN NEW.delivery_key GLOB '*[^!-~]*' OR NEW.delivery_key GLOB '*[",;]*'
BEGIN
    SELECT RAISE(ABORT, 'outbox_messages: delivery_key must be visible ASCII without ", , or ;');
END;
