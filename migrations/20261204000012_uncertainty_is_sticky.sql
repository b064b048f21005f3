-- Once any attempt of an intent may have been applied by the provider (a
-- timeout after sending, a transport error mid-exchange, a lost lease), the
-- intent may end succeeded or uncertain, never dead: its on_dead effects
-- (payment.failed, a saga moved to failed) would announce a failure for a call
-- that may have gone through. Until now only the last attempt was looked at,
-- so a 409 "still in progress" or a 503 after a timeout forgot it. The flag is
-- set by the statements that record an attempt (from the attempt's outcome,
-- decided in relay-core's retry module) and by the rescuer; a replay keeps it.
ALTER TABLE relay.intents ADD COLUMN ever_uncertain boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN relay.intents.ever_uncertain IS
    'some attempt may have been applied (uncertain or lease_expired): the intent can no longer end dead';
UPDATE relay.intents i
   SET ever_uncertain = true
 WHERE EXISTS (SELECT 1 FROM relay.intent_attempts a
                WHERE a.intent_id = i.id AND a.outcome IN ('uncertain', 'lease_expired'));

-- Error classes are relay_core::retry::ErrorClass; tests/plans.rs checks the
-- lists match. NOT VALID: rows written by earlier versions (which also wrote
-- 'endpoint_unknown', no longer written since claims take only the
-- dispatcher's own endpoints) are kept as they are; new rows are checked.
ALTER TABLE relay.intent_attempts
    ADD CONSTRAINT intent_attempts_error_class_known CHECK (error_class IS NULL OR error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired')) NOT VALID;
ALTER TABLE relay.intents
    ADD CONSTRAINT intents_last_error_class_known CHECK (last_error_class IS NULL OR last_error_class IN (
        'http_status', 'timeout', 'connect', 'transport', 'request', 'budget', 'lease_expired')) NOT VALID;
