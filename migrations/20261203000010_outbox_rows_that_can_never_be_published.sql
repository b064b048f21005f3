-- An outbox row the broker rejects for good (larger than the producer's
-- message.max.bytes or the topic's max.message.bytes, an invalid topic, a
-- policy violation) was retried forever. It now ends 'dead' with its error,
-- shown in stats, metrics, the console and `relay verify`; an operator who
-- fixed the cause (e.g. raised the topic's limit) requeues it.
ALTER TABLE relay.outbox DROP CONSTRAINT outbox_state_known;
ALTER TABLE relay.outbox
    ADD CONSTRAINT outbox_state_known CHECK (state IN ('pending', 'running', 'published', 'dead'));
CREATE INDEX outbox_dead ON relay.outbox (created_at) WHERE state = 'dead';
