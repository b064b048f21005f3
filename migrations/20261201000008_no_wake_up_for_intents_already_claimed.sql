-- Dispatchers are woken (NOTIFY relay_intents) only by inserts that wrote a
-- pending intent.
--
-- Since claim at ingest (services/relay/src/handoff.rs), a consumer running
-- beside its dispatcher writes most intents already claimed and hands them
-- over in memory; a wake-up for those sends every dispatcher to claim rows
-- that are not there, once per consumer commit. The trigger stays one per
-- statement; it reads the statement's new rows (a transition table) to see
-- whether any is pending.
CREATE FUNCTION relay.notify_pending_intents() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows WHERE state = 'pending') THEN
        PERFORM pg_notify(TG_ARGV[0], '');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER intents_notify ON relay.intents;
CREATE TRIGGER intents_notify AFTER INSERT ON relay.intents
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION relay.notify_pending_intents('relay_intents');
