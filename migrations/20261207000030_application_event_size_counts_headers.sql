-- An application event's data, key and headers count together against
-- [application].max_payload_bytes: the producer counts the whole record
-- against its message.max.bytes, and relay checks at start that the limit
-- fits it. A limit on the data alone let 64 headers of 8 KiB each through,
-- and such a record ended a dead outbox row holding its key.
--
-- An event's ordering key is stored as app:KEY, in the applications' key
-- space, as a call's is (migration 29): a route's ordered events of the same
-- Kafka key are not held by it.
SET LOCAL lock_timeout = '5s';

CREATE OR REPLACE FUNCTION relay.publish(
    topic          text,
    key            text,
    type           text,
    data           jsonb,
    id             text,
    headers        jsonb   DEFAULT NULL,
    ordered        boolean DEFAULT NULL,
    subject        text    DEFAULT NULL,
    correlation_id text    DEFAULT NULL,
    causation_id   text    DEFAULT NULL,
    traceparent    text    DEFAULT NULL,
    consumer       text    DEFAULT NULL
) RETURNS uuid
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    door relay.app_front_doors := relay.app_front_door('publish', publish.consumer);
    in_order boolean := coalesce(publish.ordered, publish.key IS NOT NULL);
    ordering text := 'app:' || publish.key;
    row_id uuid;
    key_bytes bytea := convert_to(publish.key, 'UTF8');
    payload bytea;
    hs jsonb;
    h record;
    prior record;
BEGIN
    IF publish.id IS NULL OR relay.app_blank(publish.id) THEN
        PERFORM relay.app_refuse('publish', 'id', 'required: a stable id or business key of the event, the same on '
            'every retry of your transaction (relay derives the event''s id from it)');
    END IF;
    PERFORM relay.app_check_text('publish', 'id', publish.id, 1024);
    IF publish.topic IS NULL OR NOT EXISTS (
        SELECT 1 FROM relay.app_topics t WHERE t.consumer = door.consumer AND t.topic = publish.topic) THEN
        PERFORM relay.app_refuse('publish', 'topic', format('%L is not a topic relay %L publishes for applications '
            '(allowed: %s)', publish.topic, door.consumer,
            coalesce((SELECT string_agg(quote_literal(t.topic), ', ' ORDER BY t.topic) FROM relay.app_topics t
                       WHERE t.consumer = door.consumer), 'none')),
            'add it to [application].topics in the relay''s config');
    END IF;
    IF publish.type IS NULL OR publish.type = '' THEN
        PERFORM relay.app_refuse('publish', 'type', 'required: the CloudEvents type of the event');
    END IF;
    PERFORM relay.app_check_text('publish', 'type', publish.type, 1024);
    IF publish.data IS NULL THEN
        PERFORM relay.app_refuse('publish', 'data', 'required: a JSON value (''null''::jsonb for none)');
    END IF;
    IF in_order AND publish.key IS NULL THEN
        PERFORM relay.app_refuse('publish', 'key', 'an ordered event needs a key (events are ordered per key): '
            'give one, or ordered => false');
    END IF;
    PERFORM relay.app_check_key('publish', 'key', publish.key);
    PERFORM relay.app_check_text('publish', 'subject', publish.subject, 1024);
    PERFORM relay.app_check_text('publish', 'correlation_id', publish.correlation_id, 1024);
    PERFORM relay.app_check_text('publish', 'causation_id', publish.causation_id, 1024);
    PERFORM relay.app_check_text('publish', 'traceparent', publish.traceparent, 1024);
    payload := convert_to(publish.data::text, 'UTF8');
    IF octet_length(payload) > door.max_payload_bytes THEN
        PERFORM relay.app_refuse('publish', 'data', format('%s bytes, more than the %s bytes relay accepts',
            octet_length(payload), door.max_payload_bytes), 'raise [application].max_payload_bytes, or send less');
    END IF;
    -- The record as the producer sends it: data, key and headers together
    -- (64 headers of 8 KiB each would otherwise pass a limit on the data
    -- alone, and a record over the producer's limit is never published).
    IF octet_length(payload) + coalesce(octet_length(key_bytes), 0)
       + coalesce(octet_length(publish.headers::text), 0) > door.max_payload_bytes THEN
        PERFORM relay.app_refuse('publish', 'headers', format('data (%s bytes), key (%s) and headers (%s) together '
            'are more than the %s bytes relay accepts for one event', octet_length(payload),
            coalesce(octet_length(key_bytes), 0), coalesce(octet_length(publish.headers::text), 0),
            door.max_payload_bytes), 'send fewer or smaller headers, or less data');
    END IF;
    row_id := relay.app_id(door.consumer, 'publish', publish.id);
    -- CloudEvents binary mode, as relay_core::effects::encode_event writes it.
    hs := jsonb_build_array(
        jsonb_build_object('name', 'ce_specversion', 'text', '1.0'),
        jsonb_build_object('name', 'ce_id', 'text', row_id::text),
        jsonb_build_object('name', 'ce_type', 'text', publish.type),
        jsonb_build_object('name', 'ce_source', 'text', door.source),
        jsonb_build_object('name', 'ce_time', 'text',
            to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')),
        jsonb_build_object('name', 'content-type', 'text', 'application/json'));
    IF publish.subject IS NOT NULL THEN
        hs := hs || jsonb_build_array(jsonb_build_object('name', 'ce_subject', 'text', publish.subject));
    END IF;
    IF publish.correlation_id IS NOT NULL THEN
        hs := hs || jsonb_build_array(jsonb_build_object('name', 'ce_correlationid', 'text', publish.correlation_id));
    END IF;
    IF publish.causation_id IS NOT NULL THEN
        hs := hs || jsonb_build_array(jsonb_build_object('name', 'ce_causationid', 'text', publish.causation_id));
    END IF;
    IF publish.traceparent IS NOT NULL THEN
        hs := hs || jsonb_build_array(jsonb_build_object('name', 'ce_traceparent', 'text', publish.traceparent));
    END IF;
    IF publish.headers IS NOT NULL THEN
        FOR h IN SELECT * FROM relay.app_headers('publish', publish.headers, ARRAY['ce_*', 'relay_*', 'content-type'])
                             AS x(name text, value jsonb) LOOP
            hs := hs || jsonb_build_array(jsonb_build_object('name', h.name, 'text', h.value #>> '{}'));
        END LOOP;
    END IF;
    -- relay_store::ordering: the key's rows take seq in commit order. The
    -- ordering key is stored as app:KEY, so that an application's event
    -- (one that ends dead, say) never holds a route's events of its Kafka
    -- key, and locked in the applications' own name space (APP_OUTBOX).
    IF in_order THEN
        PERFORM pg_advisory_xact_lock(1380273157,
            hashtext(door.consumer || chr(2) || publish.topic || chr(1) || ordering));
    END IF;
    INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, headers, payload, event_type, ordering_key)
    VALUES (row_id, door.consumer, publish.id, 'application', publish.topic, key_bytes, hs,
            payload, publish.type, CASE WHEN in_order THEN ordering END)
    ON CONFLICT ON CONSTRAINT outbox_pkey DO NOTHING;
    IF NOT FOUND THEN
        -- A retried transaction gives the same event (its time and tracing
        -- aside: a retry runs under a span of its own); anything else under
        -- this id would be dropped unseen.
        SELECT o.topic, o.key, o.payload, o.event_type, o.ordering_key,
               (SELECT jsonb_agg(x.h ORDER BY x.n) FROM jsonb_array_elements(o.headers) WITH ORDINALITY x(h, n)
                 WHERE x.h ->> 'name' NOT IN ('ce_time', 'ce_traceparent', 'ce_correlationid', 'ce_causationid'))
                 AS headers
          INTO prior FROM relay.outbox o WHERE o.id = row_id;
        IF FOUND AND (prior.topic IS DISTINCT FROM publish.topic OR prior.key IS DISTINCT FROM key_bytes
                      OR prior.payload IS DISTINCT FROM payload OR prior.event_type IS DISTINCT FROM publish.type
                      OR prior.ordering_key IS DISTINCT FROM CASE WHEN in_order THEN ordering END
                      OR prior.headers IS DISTINCT FROM (
                          SELECT jsonb_agg(x.h ORDER BY x.n) FROM jsonb_array_elements(hs) WITH ORDINALITY x(h, n)
                           WHERE x.h ->> 'name' NOT IN ('ce_time', 'ce_traceparent', 'ce_correlationid',
                                                        'ce_causationid'))) THEN
            PERFORM relay.app_reused('publish', publish.id, format('topic %L, type %L', prior.topic, prior.event_type));
        END IF;
    END IF;
    RETURN row_id;
END
$$;

-- Applications' events stored before their ordering keys were prefixed take
-- the prefix, so an event published after this migration still waits
-- behind them (an ordering key is never sent: the Kafka key is `key`).
UPDATE relay.outbox SET ordering_key = 'app:' || ordering_key
 WHERE action = 'application' AND ordering_key IS NOT NULL;
