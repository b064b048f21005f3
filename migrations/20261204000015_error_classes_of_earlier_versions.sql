-- The error-class constraints of 20261204000012 were NOT VALID, meant to
-- leave rows of earlier versions alone. But PostgreSQL checks a NOT VALID
-- constraint on every later UPDATE of any row: an intent an earlier version
-- left pending with 'endpoint_unknown' (a dispatcher without its endpoint
-- had tried it) failed the claim statement that took it — and with it every
-- claim, since the row stayed first in line. 'endpoint_unknown' is a class
-- of earlier versions (relay_core::retry::ErrorClass::EndpointUnknown); the
-- constraints now know it and are validated, so no row can fail them.
ALTER TABLE relay.intent_attempts DROP CONSTRAINT intent_attempts_error_class_known;
ALTER TABLE relay.intent_attempts
    ADD CONSTRAINT intent_attempts_error_class_known CHECK (error_class IS NULL OR error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired', 'endpoint_unknown'));
ALTER TABLE relay.intents DROP CONSTRAINT intents_last_error_class_known;
ALTER TABLE relay.intents
    ADD CONSTRAINT intents_last_error_class_known CHECK (last_error_class IS NULL OR last_error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired', 'endpoint_unknown'));
