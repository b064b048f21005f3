-- A dead letter skipped by an operator (the head of a held key, issue 29
-- part 6) is never applied: its event gets an inbox row with outcome
-- 'skipped' in the skip's transaction, so neither a redelivery of the record
-- (a crash before the offset commit) nor a later replay applies it after the
-- records of its key that were released behind it.
--
-- The constraints are added NOT VALID (enforced on every write from here,
-- existing rows not scanned under this migration's ACCESS EXCLUSIVE locks)
-- and validated by the next migration, outside this transaction. The
-- ALTERs still need ACCESS EXCLUSIVE for a moment: wait for it at most 5 s
-- (behind a long transaction, every reader would queue behind this one),
-- fail, and let `relay migrate` be run again.
SET LOCAL lock_timeout = '5s';
ALTER TABLE relay.inbox DROP CONSTRAINT inbox_outcome_known;
ALTER TABLE relay.inbox ADD CONSTRAINT inbox_outcome_known CHECK (outcome IN (
    'applied', 'duplicate_key', 'stale', 'duplicate_version',
    'duplicate_transition', 'invalid_transition', 'duplicate_sequence', 'unrouted',
    'skipped')) NOT VALID;

-- A hold's head is a dead letter of the hold: it cannot be deleted from
-- under it (deletes, purges and retention skip held letters already; this
-- makes a mistake there an error, not a key held behind nothing).
ALTER TABLE relay.held_keys
    ADD CONSTRAINT held_keys_head FOREIGN KEY (head) REFERENCES relay.dead_letters (id) NOT VALID;
-- Deleting a dead letter looks up the hold it heads, if any, through this.
-- held_keys has a row per held key: building it is quick.
CREATE INDEX held_keys_by_head ON relay.held_keys (head);
