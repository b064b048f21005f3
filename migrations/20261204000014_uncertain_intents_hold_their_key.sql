-- An uncertain intent (its budget ran out after an attempt the provider may
-- have applied) now holds its ordering key: the later intents of the key
-- wait until an operator replays it, instead of running while the earlier
-- call's effect is unknown. A dead intent still releases its key (its call
-- did not take effect); replayed, it is queued behind the key's later
-- intents (relay_store::intents::requeue).
--
-- The claim's lookup of an earlier unfinished row of the key reads this
-- index, so it now holds uncertain rows too (there are few).
DROP INDEX relay.intents_unfinished_by_key;
CREATE INDEX intents_unfinished_by_key ON relay.intents (ordering_key, seq)
    WHERE state IN ('pending', 'running', 'uncertain') AND ordering_key IS NOT NULL;
