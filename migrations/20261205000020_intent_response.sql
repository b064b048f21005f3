-- The provider's answer a call's on_success read (issue 29, part 3):
-- status, headers and a bounded body (endpoints.NAME.response_bytes),
-- recorded with the success and its effects in one transaction, so what
-- the emitted events carry can be checked against what the provider said.
-- NULL for every intent whose on_success does not read `response`.
ALTER TABLE relay.intents ADD COLUMN response jsonb;
