-- A lease token exists only while its row is running.
--
-- Every move out of 'running' (finished, retried, released, rescued) already
-- clears the token; these constraints make the database hold it too. The
-- fenced finishes (relay-store/src/intents.rs, outbox.rs) rely on it: they
-- match a row on its id and token alone, without `state = 'running'`. With
-- that condition the planner could — and, with many finished rows and the
-- statistics saying almost nothing is running, did — read the whole
-- `*_leases` partial index once per row finished: with 1 M finished intents,
-- claim + finish ran at half the speed of an empty table (BENCHMARKS.md,
-- Growth). Matching on the primary key is one index probe per row whatever
-- the statistics say.
--
-- Validating reads each table once while holding its lock (about a second per
-- few million rows); rows written by any earlier relay version pass.
ALTER TABLE relay.intents
    ADD CONSTRAINT intents_lease_only_while_running CHECK (state = 'running' OR lease_token IS NULL);
ALTER TABLE relay.outbox
    ADD CONSTRAINT outbox_lease_only_while_running CHECK (state = 'running' OR lease_token IS NULL);
