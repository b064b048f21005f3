-- An intent whose retry budget ran out on an *uncertain* attempt (a timeout
-- after sending, a transport error mid-response, a lost lease) ends in its
-- own state: the provider may have applied the call, so it is neither dead
-- (its on_dead effects, e.g. payment.failed, would tell a lie) nor succeeded.
-- An operator or a reconciliation decides: a replay asks again with the same
-- idempotency key, and the provider answers what it did.
ALTER TABLE relay.intents DROP CONSTRAINT intents_state_known;
ALTER TABLE relay.intents
    ADD CONSTRAINT intents_state_known CHECK (state IN ('pending', 'running', 'succeeded', 'dead', 'uncertain'));
CREATE INDEX intents_uncertain ON relay.intents (finished_at) WHERE state = 'uncertain';
