-- tower-idempotency transactional outbox (SQLite): the text columns hold
-- text. SQLite stores whatever type is bound (a 16-byte binary id bound as
-- `source` is a BLOB), and a row whose text columns are not text cannot be
-- read back by a worker: its claim would fail after claiming it, stranding
-- the rows claimed with it. Such an insert or update is refused instead, in
-- the application's own transaction.
CREATE TRIGGER IF NOT EXISTS outbox_messages_text_on_insert
BEFORE INSERT ON outbox_messages
WHEN typeof(NEW.topic) <> 'text' OR typeof(NEW.source) <> 'text'
  OR typeof(NEW.delivery_key) <> 'text' OR typeof(NEW.content_type) <> 'text'
BEGIN
    SELECT RAISE(ABORT, 'outbox_messages: topic, source, delivery_key and content_type must be text');
END;

CREATE TRIGGER IF NOT EXISTS outbox_messages_text_on_update
BEFORE UPDATE OF topic, source, delivery_key, content_type ON outbox_messages
WHEN typeof(NEW.topic) <> 'text' OR typeof(NEW.source) <> 'text'
  OR typeof(NEW.delivery_key) <> 'text' OR typeof(NEW.content_type) <> 'text'
BEGIN
    SELECT RAISE(ABORT, 'outbox_messages: topic, source, delivery_key and content_type must be text');
END;
