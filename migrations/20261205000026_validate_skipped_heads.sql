-- no-transaction
-- Validate the constraints migration 0025 added NOT VALID. Outside that
-- migration's transaction, VALIDATE holds SHARE UPDATE EXCLUSIVE only:
-- the consumer and the dispatcher read and write relay.inbox and
-- relay.held_keys while the existing rows are checked.
ALTER TABLE relay.inbox VALIDATE CONSTRAINT inbox_outcome_known;
ALTER TABLE relay.held_keys VALIDATE CONSTRAINT held_keys_head;
