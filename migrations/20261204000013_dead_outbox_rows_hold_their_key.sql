-- A dead outbox row now holds its ordering key: the rows of its topic and key
-- written after it wait until an operator replays it (`relay outbox replay`:
-- published first, in order) or skips it (`relay outbox skip`: 'skipped', and
-- the rows after it go on). Before, the rows after it were published at once,
-- and a later requeue published the dead row after them — out of order, and
-- for "latest per key" consumers a stale state that won.
--
-- The claim's lookup of an earlier unfinished row of the key reads this
-- index, so it now holds dead rows too (there are few).
ALTER TABLE relay.outbox DROP CONSTRAINT outbox_state_known;
ALTER TABLE relay.outbox
    ADD CONSTRAINT outbox_state_known CHECK (state IN ('pending', 'running', 'published', 'dead', 'skipped'));
DROP INDEX relay.outbox_unpublished_by_key;
CREATE INDEX outbox_unpublished_by_key ON relay.outbox (topic, ordering_key, seq)
    WHERE state IN ('pending', 'running', 'dead') AND ordering_key IS NOT NULL;
