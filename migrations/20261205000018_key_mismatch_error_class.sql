-- A provider's answer that an idempotency key was already used with a
-- different request (IETF draft 422, Stripe's idempotency_error) ends an
-- intent dead and is never retried: two calls share a key, a bug upstream.
-- Its class is 'key_mismatch' (relay_core::retry::ErrorClass::KeyMismatch),
-- so it can be found and alerted on apart from other client errors.
ALTER TABLE relay.intent_attempts DROP CONSTRAINT intent_attempts_error_class_known;
ALTER TABLE relay.intent_attempts
    ADD CONSTRAINT intent_attempts_error_class_known CHECK (error_class IS NULL OR error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired', 'endpoint_unknown',
        'resolved', 'key_mismatch'));
ALTER TABLE relay.intents DROP CONSTRAINT intents_last_error_class_known;
ALTER TABLE relay.intents
    ADD CONSTRAINT intents_last_error_class_known CHECK (last_error_class IS NULL OR last_error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired', 'endpoint_unknown',
        'resolved', 'key_mismatch'));
