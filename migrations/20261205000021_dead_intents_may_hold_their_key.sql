-- A route may say on_poison = "hold_key" (issue 29, part 6): a dead intent
-- of it then holds its ordering key, as an uncertain one does, so the
-- key's later intents wait (recorded, not called) until an operator
-- replays it (it keeps its place and runs first) or skips it
-- (`relay intents skip`: holds_key cleared, it stays dead, the key goes
-- on). Other keys flow meanwhile. Without the setting a dead intent
-- releases its key, as before.
--
-- The claim's lookup of an earlier unfinished row of the key reads this
-- index, so it now holds the dead rows that hold their key too (few).
ALTER TABLE relay.intents ADD COLUMN holds_key boolean NOT NULL DEFAULT false;
DROP INDEX relay.intents_unfinished_by_key;
CREATE INDEX intents_unfinished_by_key ON relay.intents (ordering_key, seq)
    WHERE (state IN ('pending', 'running', 'uncertain') OR (state = 'dead' AND holds_key))
      AND ordering_key IS NOT NULL;
-- What the gauge relay_intents_holding_keys counts every few seconds, and
-- what retention must never delete (it would release the key unseen).
CREATE INDEX intents_holding_keys ON relay.intents (finished_at) WHERE state = 'dead' AND holds_key;
