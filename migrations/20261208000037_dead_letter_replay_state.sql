-- Whether a dead letter is still open, resolved by a replay, or skipped,
-- in a column of its own: it was read from a "failed" prefix of the replay
-- outcome's text. replay_outcome keeps the detail for people. And its
-- error class, written from relay_core::PoisonClass by every version, is
-- held to those names.
--
-- The table is locked while this runs, kept short: the new column's
-- default is stored once (no rewrite) and only replayed letters are
-- updated. Waiting on another transaction's lock past 5 s fails the
-- migration (the upgrade retries) instead of queueing every writer of
-- dead letters behind it.
SET LOCAL lock_timeout = '5s';

ALTER TABLE relay.dead_letters ADD COLUMN replay_state text NOT NULL DEFAULT 'open';

UPDATE relay.dead_letters
   SET replay_state = CASE WHEN replay_outcome = 'skipped' THEN 'skipped' ELSE 'resolved' END
 WHERE replay_outcome IS NOT NULL AND replay_outcome NOT LIKE 'failed%';

ALTER TABLE relay.dead_letters
    ADD CONSTRAINT dead_letters_replay_state_known CHECK (replay_state IN ('open', 'resolved', 'skipped'));

ALTER TABLE relay.dead_letters
    ADD CONSTRAINT dead_letters_error_class_known CHECK (error_class IN (
        'oversized', 'bad_json', 'missing_id', 'missing_type', 'not_cloudevent', 'bad_header', 'bad_field',
        'schema_invalid', 'unknown_type', 'template_error', 'rejected', 'missing_reference', 'sequence_gap',
        'unreadable', 'held', 'bad_encoding'));
