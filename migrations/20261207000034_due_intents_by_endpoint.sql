-- The claim reads each endpoint's due intents apart (relay_store::intents::
-- CLAIM): the index of due intents leads with the deployment and the
-- endpoint, so that no claim reads the due rows of another deployment, of a
-- paused endpoint, or of one whose calls are all in flight.
SET LOCAL lock_timeout = '5s';

CREATE INDEX intents_due_by_endpoint ON relay.intents (consumer, endpoint, next_attempt_at, seq)
    WHERE state = 'pending';
DROP INDEX relay.intents_due;
ALTER INDEX relay.intents_due_by_endpoint RENAME TO intents_due;
