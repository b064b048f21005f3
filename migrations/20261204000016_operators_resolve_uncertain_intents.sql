-- An operator may resolve an uncertain intent as failed once the provider
-- says it did not apply the call (`relay intents resolve ID --failed`): the
-- intent ends dead with its on_dead effects and error class 'resolved',
-- which `relay verify` accepts as the operator's word, not a dead end after
-- an unknown outcome (relay_core::retry::ErrorClass::Resolved).
ALTER TABLE relay.intent_attempts DROP CONSTRAINT intent_attempts_error_class_known;
ALTER TABLE relay.intent_attempts
    ADD CONSTRAINT intent_attempts_error_class_known CHECK (error_class IS NULL OR error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired', 'endpoint_unknown',
        'resolved'));
ALTER TABLE relay.intents DROP CONSTRAINT intents_last_error_class_known;
ALTER TABLE relay.intents
    ADD CONSTRAINT intents_last_error_class_known CHECK (last_error_class IS NULL OR last_error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired', 'endpoint_unknown',
        'resolved'));
