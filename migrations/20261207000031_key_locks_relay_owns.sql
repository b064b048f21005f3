-- Ordering keys, and the few things only one relay process may do at a
-- time, are locked as rows of a table relay owns (relay.key_locks), no
-- longer as advisory locks. pg_advisory_xact_lock may be called by every
-- role that can connect, so any such role could take a key's lock, hold it,
-- and stall every batch of that key's partition; a row of relay.key_locks
-- can be locked only by a role with UPDATE on the table: relay's own, and
-- the front door's functions, which run as relay.
--
-- A key's lock is the row (deployment, slot): the slot is 20 bits of the
-- SHA-256 of the key's name, in one of four spaces (route intents, route
-- outbox rows, application intents, application outbox rows), as
-- relay_store::ordering computes it. Rows are written on a slot's first
-- use and kept, so a deployment has at most 4 × 2^20 of them; two keys that
-- share a slot only wait for each other, rarely: two batches of 200 keys
-- share one about once in 25. A deployment's rows are its own, so an
-- application can hold no other deployment's keys.
SET LOCAL lock_timeout = '5s';

CREATE TABLE relay.key_locks (
    consumer text    COLLATE "C" NOT NULL,
    slot     integer NOT NULL,
    CONSTRAINT key_locks_pkey PRIMARY KEY (consumer, slot)
);
-- The singletons, of no deployment: -1 the front door's registration, -2
-- the retention cleaner.
INSERT INTO relay.key_locks (consumer, slot) VALUES ('', -1), ('', -2);
REVOKE ALL ON relay.key_locks FROM PUBLIC;

-- The slot of `name` in `space` (0 to 3).
CREATE FUNCTION relay.key_slot(space integer, name text) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT ($1 << 20) | (get_byte(d, 0) << 12) | (get_byte(d, 1) << 4) | (get_byte(d, 2) >> 4)
      FROM (SELECT sha256(convert_to($2, 'UTF8')) AS d) h
$$;

-- Lock `slots` of `consumer` until the transaction ends: a slot's row is
-- written if it is new (a writer of the same new slot waits for this
-- transaction, as for a lock), then every row is locked, in one order.
CREATE FUNCTION relay.lock_keys(consumer text, slots integer[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO relay.key_locks (consumer, slot)
    SELECT lock_keys.consumer, u.s FROM (SELECT DISTINCT s FROM unnest(lock_keys.slots) s) u ORDER BY u.s
    ON CONFLICT DO NOTHING;
    PERFORM 1 FROM relay.key_locks k WHERE k.consumer = lock_keys.consumer AND k.slot = ANY(lock_keys.slots)
      ORDER BY k.slot FOR UPDATE;
END
$$;

-- Lock the key `name` in `space` of `consumer`, as the front door does in
-- an application's transaction: a key another transaction holds for long
-- fails the call after 5 s rather than leave it waiting without end.
CREATE FUNCTION relay.lock_key(consumer text, space integer, name text) RETURNS void
    LANGUAGE sql VOLATILE
    SET search_path = pg_catalog, pg_temp
    SET lock_timeout = '5s'
AS $$
    SELECT relay.lock_keys($1, ARRAY[relay.key_slot($2, $3)])
$$;

REVOKE ALL ON FUNCTION relay.key_slot(integer, text), relay.lock_keys(text, integer[]),
    relay.lock_key(text, integer, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION relay.call(
    endpoint        text,
    method          text,
    path            text,
    body            jsonb,
    id              text,
    idempotency_key text  DEFAULT NULL,
    ordering_key    text  DEFAULT NULL,
    headers         jsonb DEFAULT NULL,
    on_success      jsonb DEFAULT NULL,
    on_dead         jsonb DEFAULT NULL,
    correlation_id  text  DEFAULT NULL,
    causation_id    text  DEFAULT NULL,
    traceparent     text  DEFAULT NULL,
    consumer        text  DEFAULT NULL
) RETURNS uuid
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    door relay.app_front_doors := relay.app_front_door('call', call.consumer);
    ep relay.app_endpoints;
    row_id uuid;
    verb text := upper(call.method);
    key text;
    stored_ordering_key text := 'app:' || call.ordering_key;
    sizes bigint[];
    largest integer;
    request_headers jsonb := '{}'::jsonb;
    succeeded jsonb;
    died jsonb;
    h record;
    prior record;
BEGIN
    IF call.id IS NULL OR relay.app_blank(call.id) THEN
        PERFORM relay.app_refuse('call', 'id', 'required: a stable id or business key of the call, the same on '
            'every retry of your transaction (relay derives the call''s id and default idempotency key from it)');
    END IF;
    PERFORM relay.app_check_text('call', 'id', call.id, 1024);
    SELECT * INTO ep FROM relay.app_endpoints e WHERE e.consumer = door.consumer AND e.endpoint = call.endpoint;
    IF NOT FOUND THEN
        PERFORM relay.app_refuse('call', 'endpoint', format('%L is not an endpoint relay %L calls for applications '
            '(allowed: %s)', call.endpoint, door.consumer,
            coalesce((SELECT string_agg(quote_literal(e.endpoint), ', ' ORDER BY e.endpoint) FROM relay.app_endpoints e
                       WHERE e.consumer = door.consumer), 'none')),
            'add it to [application].endpoints in the relay''s config');
    END IF;
    IF verb IS NULL OR verb NOT IN ('GET', 'POST', 'PUT', 'PATCH', 'DELETE') THEN
        PERFORM relay.app_refuse('call', 'method', format('%L is not one of GET, POST, PUT, PATCH, DELETE', call.method));
    END IF;
    IF call.path IS NULL OR left(call.path, 1) <> '/' OR call.path ~ E'[\\s#\\\\]'
       OR split_part(call.path, '?', 1) ~* '%(2f|5c|25)' THEN
        PERFORM relay.app_refuse('call', 'path', format('%L must start with / and hold no spaces, #, backslash or '
            'encoded /, backslash or %% before its query (it is appended to the endpoint''s base_url)', call.path));
    END IF;
    PERFORM relay.app_check_text('call', 'path', call.path, 2048);
    -- `.` and `..` segments, percent-encoded or not, with `;parameters` or
    -- not, would climb out of the base_url's path once the provider's
    -- server resolves them.
    IF EXISTS (SELECT 1 FROM unnest(string_to_array(split_part(call.path, '?', 1), '/')) s
                WHERE replace(lower(s), '%2e', '.') ~ E'^\\.{1,2}(;|$)') THEN
        PERFORM relay.app_refuse('call', 'path', format('%L holds a . or .. segment: it would leave the endpoint''s '
            'base_url', call.path));
    END IF;
    IF call.body IS NOT NULL AND octet_length(convert_to(call.body::text, 'UTF8')) > door.max_payload_bytes THEN
        PERFORM relay.app_refuse('call', 'body', format('%s bytes, more than the %s bytes relay accepts',
            octet_length(convert_to(call.body::text, 'UTF8')), door.max_payload_bytes),
            'raise [application].max_payload_bytes, or send less');
    END IF;
    -- Everything a call stores is read back whole by each claim that takes
    -- it: its headers and outcomes count with its body, before any of them
    -- is looked into.
    sizes := ARRAY[coalesce(octet_length(convert_to(call.body::text, 'UTF8')), 0),
                   coalesce(octet_length(convert_to(call.headers::text, 'UTF8')), 0),
                   coalesce(octet_length(convert_to(call.on_success::text, 'UTF8')), 0),
                   coalesce(octet_length(convert_to(call.on_dead::text, 'UTF8')), 0)];
    IF sizes[1] + sizes[2] + sizes[3] + sizes[4] > door.max_payload_bytes THEN
        largest := (SELECT s.n FROM unnest(sizes) WITH ORDINALITY AS s(bytes, n) ORDER BY s.bytes DESC, s.n LIMIT 1);
        PERFORM relay.app_refuse('call', (ARRAY['body', 'headers', 'on_success', 'on_dead'])[largest], format(
            'the call is %s bytes (body %s, headers %s, on_success %s, on_dead %s), more than the %s bytes relay '
            'accepts', sizes[1] + sizes[2] + sizes[3] + sizes[4], sizes[1], sizes[2], sizes[3], sizes[4],
            door.max_payload_bytes), 'raise [application].max_payload_bytes, or send less');
    END IF;
    PERFORM relay.app_check_depth('call', 'body', call.body);
    IF ep.key_in_body AND (call.body IS NULL OR jsonb_typeof(call.body) <> 'object') THEN
        PERFORM relay.app_refuse('call', 'body', format('endpoint %L takes the idempotency key in a body field: '
            'the body must be a JSON object', call.endpoint));
    END IF;
    row_id := relay.app_id(door.consumer, 'call', call.id);
    -- A key the application gives is sent as app:KEY, a prefix relay refuses
    -- in the keys its routes render: no application call can share a key
    -- with a route's call. So is the default, the call's id: a route whose
    -- key renders a whole field of its input could otherwise be fed it. An
    -- empty key is refused, whatever the endpoint: sent, or signed as a
    -- webhook-id, it would be every such call's one key.
    IF call.idempotency_key = '' THEN
        PERFORM relay.app_refuse('call', 'idempotency_key', 'empty: give a key, or leave it out and the call''s '
            'id is its key');
    END IF;
    key := 'app:' || coalesce(call.idempotency_key, row_id::text);
    PERFORM relay.app_check_key('call', 'idempotency_key', coalesce(call.idempotency_key, key));
    IF ep.key_max_length IS NOT NULL AND char_length(key) > ep.key_max_length THEN
        PERFORM relay.app_refuse('call', 'idempotency_key', format('%s characters as sent (%s with relay''s app: '
            'prefix); endpoint %L (its profile, or idempotency.max_length) accepts at most %s', char_length(key),
            CASE WHEN call.idempotency_key IS NULL THEN 'the call''s id' ELSE 'the key given' END,
            call.endpoint, ep.key_max_length));
    END IF;
    IF call.ordering_key = '' THEN
        PERFORM relay.app_refuse('call', 'ordering_key', 'empty: give a key, or leave it out for no order');
    END IF;
    PERFORM relay.app_check_key('call', 'ordering_key', call.ordering_key);
    PERFORM relay.app_check_text('call', 'correlation_id', call.correlation_id, 1024);
    PERFORM relay.app_check_text('call', 'causation_id', call.causation_id, 1024);
    PERFORM relay.app_check_text('call', 'traceparent', call.traceparent, 1024);
    IF call.headers IS NOT NULL THEN
        FOR h IN SELECT * FROM relay.app_headers('call', call.headers, ep.reserved_headers) AS x(name text, value jsonb)
        LOOP
            request_headers := request_headers || jsonb_build_object(h.name, h.value);
        END LOOP;
    END IF;
    succeeded := relay.app_outcome(door.consumer, 'on_success', call.on_success);
    died := relay.app_outcome(door.consumer, 'on_dead', call.on_dead);
    -- relay_store::ordering: the key's intents take seq in commit order. An
    -- application's ordering key is stored as app:KEY, as its idempotency
    -- key, so that it never orders (or holds) a route's calls; and it is
    -- locked in the applications' own space of slots, so that a key chosen
    -- to share a route key's slot cannot make the route's writers wait on an
    -- application's open transaction.
    IF call.ordering_key IS NOT NULL THEN
        PERFORM relay.lock_key(door.consumer, 2, door.consumer || chr(2) || stored_ordering_key);
    END IF;
    INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
                               idempotency_key, ordering_key, max_attempts, expires_at, on_success, on_dead,
                               emit_source, correlation_id, causation_id, traceparent)
    VALUES (row_id, door.consumer, call.id, 'application', call.endpoint, verb, call.path, call.body,
            request_headers, key, stored_ordering_key, ep.max_attempts, now() + ep.max_age, succeeded, died,
            door.source, call.correlation_id, call.causation_id, call.traceparent)
    ON CONFLICT ON CONSTRAINT intents_pkey DO NOTHING;
    IF NOT FOUND THEN
        SELECT i.endpoint, i.method, i.path, i.body, i.request_headers, i.idempotency_key, i.ordering_key,
               i.on_success, i.on_dead
          INTO prior FROM relay.intents i WHERE i.id = row_id;
        IF FOUND AND (prior.endpoint IS DISTINCT FROM call.endpoint OR prior.method IS DISTINCT FROM verb
                      OR prior.path IS DISTINCT FROM call.path OR prior.body IS DISTINCT FROM call.body
                      OR prior.request_headers IS DISTINCT FROM request_headers
                      -- A call stored before keys were prefixed kept the
                      -- application's key as it was: the same call.
                      OR (prior.idempotency_key IS DISTINCT FROM key
                          AND prior.idempotency_key IS DISTINCT FROM call.idempotency_key)
                      OR (prior.ordering_key IS DISTINCT FROM stored_ordering_key
                          AND prior.ordering_key IS DISTINCT FROM call.ordering_key)
                      OR prior.on_success IS DISTINCT FROM succeeded OR prior.on_dead IS DISTINCT FROM died) THEN
            PERFORM relay.app_reused('call', call.id, format('%s %s on endpoint %L', prior.method, prior.path,
                prior.endpoint));
        END IF;
    END IF;
    RETURN row_id;
END
$$;


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
    -- key, and locked in the applications' own space of slots.
    IF in_order THEN
        PERFORM relay.lock_key(door.consumer, 3, door.consumer || chr(2) || publish.topic || chr(1) || ordering);
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
