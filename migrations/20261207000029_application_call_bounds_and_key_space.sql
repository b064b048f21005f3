-- The front door's bounds on what a call stores, and the applications' own
-- key space:
--
-- * JSON nested more than 64 levels deep is refused in a call's body and in
--   its outcomes' data: the dispatcher reads stored JSON with a reader that
--   stops at 128 levels, and a row it cannot read could never be called.
-- * A call's headers and outcomes count with its body in
--   [application].max_payload_bytes: a claim reads them all back.
-- * An idempotency key or ordering key an application gives is stored (and
--   an idempotency key sent) as app:KEY; relay refuses keys starting with
--   app: where its routes render them, so an application's call can neither
--   reuse a route call's key at the provider nor hold a route's ordering key.
--   Its ordering-key lock has a name space of its own (relay_store::ordering).
SET LOCAL lock_timeout = '5s';

-- Refuse `value` if arrays and objects nest in it more than `max_depth`
-- levels. Walked level by level, keeping only arrays and objects, so it
-- stops one level past the limit however deep the value goes.
CREATE FUNCTION relay.app_check_depth(fn text, field text, value jsonb, max_depth integer DEFAULT 64) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    level jsonb[];
    depth integer := 1;
BEGIN
    IF value IS NULL OR jsonb_typeof(value) NOT IN ('array', 'object') THEN
        RETURN;
    END IF;
    level := ARRAY[value];
    WHILE cardinality(level) > 0 LOOP
        IF depth > max_depth THEN
            PERFORM relay.app_refuse(fn, field, format('nested more than %s levels deep (arrays and objects within '
                'each other); relay takes at most %s', max_depth, max_depth), 'flatten it, or send it as a string');
        END IF;
        level := ARRAY(
            SELECT c.value FROM unnest(level) AS l(v)
             CROSS JOIN LATERAL (
                 SELECT a.value FROM jsonb_array_elements(CASE WHEN jsonb_typeof(l.v) = 'array' THEN l.v END) a
                 UNION ALL
                 SELECT o.value FROM jsonb_each(CASE WHEN jsonb_typeof(l.v) = 'object' THEN l.v END) o) c
             WHERE jsonb_typeof(c.value) IN ('array', 'object'));
        depth := depth + 1;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION relay.app_outcome(consumer text, field text, outcome jsonb) RETURNS jsonb
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    k text;
    e jsonb;
    at text;
    n integer;
    in_order boolean;
    names text[] := '{}';
    emits jsonb := '[]'::jsonb;
    sagas jsonb := '[]'::jsonb;
BEGIN
    IF outcome IS NULL THEN
        RETURN '{}'::jsonb;
    END IF;
    IF jsonb_typeof(outcome) <> 'object' THEN
        PERFORM relay.app_refuse('call', field, format('an object {"emit": [...], "saga": [...]}, not %s',
            jsonb_typeof(outcome)));
    END IF;
    FOR k IN SELECT jsonb_object_keys(outcome) LOOP
        IF k NOT IN ('emit', 'saga') THEN
            PERFORM relay.app_refuse('call', field || '.' || k, 'unknown: an outcome has emit and saga');
        END IF;
    END LOOP;
    IF outcome ? 'emit' AND jsonb_typeof(outcome -> 'emit') <> 'array' THEN
        PERFORM relay.app_refuse('call', field || '.emit', 'an array of events');
    END IF;
    IF outcome ? 'saga' AND jsonb_typeof(outcome -> 'saga') <> 'array' THEN
        PERFORM relay.app_refuse('call', field || '.saga', 'an array of saga moves');
    END IF;
    -- Each ordered event takes an advisory lock when the call ends, all of
    -- one completer batch in one statement, and each saga move a statement:
    -- thousands in one outcome would fill PostgreSQL's lock table (53200)
    -- and fail every call finished beside it.
    IF jsonb_array_length(coalesce(outcome -> 'emit', '[]'::jsonb)) > 64 THEN
        PERFORM relay.app_refuse('call', field || '.emit', format('%s events; an outcome has at most 64',
            jsonb_array_length(outcome -> 'emit')), 'publish the rest with relay.publish, or from a consumer of the first');
    END IF;
    IF jsonb_array_length(coalesce(outcome -> 'saga', '[]'::jsonb)) > 64 THEN
        PERFORM relay.app_refuse('call', field || '.saga', format('%s saga moves; an outcome has at most 64',
            jsonb_array_length(outcome -> 'saga')));
    END IF;
    n := 0;
    FOR e IN SELECT x.value FROM jsonb_array_elements(coalesce(outcome -> 'emit', '[]'::jsonb)) x LOOP
        at := format('%s.emit[%s]', field, n);
        n := n + 1;
        IF jsonb_typeof(e) <> 'object' THEN
            PERFORM relay.app_refuse('call', at, 'an object {name, type, topic, key, subject, data, ordered}');
        END IF;
        FOR k IN SELECT jsonb_object_keys(e) LOOP
            IF k NOT IN ('name', 'type', 'topic', 'key', 'subject', 'data', 'ordered') THEN
                PERFORM relay.app_refuse('call', at || '.' || k,
                    'unknown: an event has name, type, topic, key, subject, data, ordered');
            END IF;
        END LOOP;
        FOREACH k IN ARRAY ARRAY['name', 'type', 'topic'] LOOP
            IF jsonb_typeof(e -> k) IS DISTINCT FROM 'string' OR e ->> k = '' THEN
                PERFORM relay.app_refuse('call', at || '.' || k, 'required: a non-empty string');
            END IF;
        END LOOP;
        FOREACH k IN ARRAY ARRAY['key', 'subject'] LOOP
            IF jsonb_typeof(e -> k) NOT IN ('string', 'null') THEN
                PERFORM relay.app_refuse('call', at || '.' || k, 'a string');
            END IF;
        END LOOP;
        PERFORM relay.app_check_text('call', at || '.name', e ->> 'name', 1024);
        PERFORM relay.app_check_text('call', at || '.type', e ->> 'type', 1024);
        PERFORM relay.app_check_text('call', at || '.subject', e ->> 'subject', 1024);
        PERFORM relay.app_check_key('call', at || '.key', e ->> 'key');
        IF NOT e ? 'data' THEN
            PERFORM relay.app_refuse('call', at || '.data', 'required: a JSON value (null for none)');
        END IF;
        PERFORM relay.app_check_depth('call', at || '.data', e -> 'data');
        IF jsonb_typeof(e -> 'ordered') NOT IN ('boolean', 'null') THEN
            PERFORM relay.app_refuse('call', at || '.ordered', 'true or false');
        END IF;
        IF NOT EXISTS (SELECT 1 FROM relay.app_topics t WHERE t.consumer = app_outcome.consumer
                                                         AND t.topic = e ->> 'topic') THEN
            PERFORM relay.app_refuse('call', at || '.topic', format('%L is not a topic relay %L publishes for '
                'applications', e ->> 'topic', app_outcome.consumer), 'add it to [application].topics');
        END IF;
        -- The event's id is derived from the intent and the name.
        IF (e ->> 'name') = ANY (names) THEN
            PERFORM relay.app_refuse('call', at || '.name', format('%L twice: each event needs a name of its own',
                e ->> 'name'));
        END IF;
        names := names || (e ->> 'name');
        in_order := CASE WHEN jsonb_typeof(e -> 'ordered') = 'boolean' THEN (e -> 'ordered')::boolean
                         ELSE jsonb_typeof(e -> 'key') IS NOT DISTINCT FROM 'string' END;
        IF in_order AND jsonb_typeof(e -> 'key') IS DISTINCT FROM 'string' THEN
            PERFORM relay.app_refuse('call', at || '.key', 'an ordered event needs a key: give one, or ordered false');
        END IF;
        emits := emits || jsonb_build_array(jsonb_build_object(
            'action', e ->> 'name', 'event_type', e ->> 'type', 'topic', e ->> 'topic',
            'key', coalesce(e -> 'key', 'null'::jsonb), 'subject', coalesce(e -> 'subject', 'null'::jsonb),
            'data', e -> 'data', 'ordered', in_order));
    END LOOP;
    n := 0;
    FOR e IN SELECT x.value FROM jsonb_array_elements(coalesce(outcome -> 'saga', '[]'::jsonb)) x LOOP
        at := format('%s.saga[%s]', field, n);
        n := n + 1;
        IF jsonb_typeof(e) <> 'object' THEN
            PERFORM relay.app_refuse('call', at, 'an object {name, saga, id, from, to, start}');
        END IF;
        FOR k IN SELECT jsonb_object_keys(e) LOOP
            IF k NOT IN ('name', 'saga', 'id', 'from', 'to', 'start') THEN
                PERFORM relay.app_refuse('call', at || '.' || k, 'unknown: a saga move has name, saga, id, from, to, start');
            END IF;
        END LOOP;
        FOREACH k IN ARRAY ARRAY['name', 'saga', 'id', 'to'] LOOP
            IF jsonb_typeof(e -> k) IS DISTINCT FROM 'string' OR e ->> k = '' THEN
                PERFORM relay.app_refuse('call', at || '.' || k, 'required: a non-empty string');
            END IF;
        END LOOP;
        -- A saga whose state gates money (force a call dead, and on_dead
        -- marks it paid) is the deployment's to open to applications.
        IF NOT EXISTS (SELECT 1 FROM relay.app_sagas s WHERE s.consumer = app_outcome.consumer
                                                        AND s.saga_type = e ->> 'saga') THEN
            PERFORM relay.app_refuse('call', at || '.saga', format('%L is not a saga type relay %L lets applications '
                'move (allowed: %s)', e ->> 'saga', app_outcome.consumer,
                coalesce((SELECT string_agg(quote_literal(s.saga_type), ', ' ORDER BY s.saga_type) FROM relay.app_sagas s
                           WHERE s.consumer = app_outcome.consumer), 'none')),
                'add it to [application].sagas in the relay''s config');
        END IF;
        PERFORM relay.app_check_key('call', at || '.id', e ->> 'id');
        PERFORM relay.app_check_text('call', at || '.name', e ->> 'name', 1024);
        PERFORM relay.app_check_text('call', at || '.to', e ->> 'to', 1024);
        IF jsonb_typeof(e -> 'from') NOT IN ('array', 'null') OR EXISTS (
            SELECT 1 FROM jsonb_array_elements(coalesce(e -> 'from', '[]'::jsonb)) f WHERE jsonb_typeof(f.value) <> 'string') THEN
            PERFORM relay.app_refuse('call', at || '.from', 'an array of states (strings)');
        END IF;
        IF jsonb_typeof(e -> 'start') NOT IN ('boolean', 'null') THEN
            PERFORM relay.app_refuse('call', at || '.start', 'true or false');
        END IF;
        sagas := sagas || jsonb_build_array(jsonb_build_object(
            'action', e ->> 'name', 'saga_type', e ->> 'saga', 'saga_id', e ->> 'id',
            'from', coalesce(e -> 'from', '[]'::jsonb), 'to', e ->> 'to',
            'start', CASE WHEN jsonb_typeof(e -> 'start') = 'boolean' THEN (e -> 'start')::boolean ELSE false END));
    END LOOP;
    RETURN jsonb_build_object('emit', emits, 'saga', sagas);
END
$$;


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
    -- locked in the applications' own name space (APP_INTENTS), so that a
    -- key chosen to collide with a route's in hashtext cannot make the
    -- route's writers wait on an application's open transaction.
    IF call.ordering_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1380273156, hashtext(door.consumer || chr(2) || stored_ordering_key));
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


REVOKE ALL ON FUNCTION relay.app_check_depth(text, text, jsonb, integer) FROM PUBLIC;

-- Applications' calls stored before keys were prefixed: their ordering keys
-- take the prefix, so a call made after this migration still waits behind
-- them (ordering keys are never sent). Their idempotency keys stay as they
-- were sent: a retry must send the same one.
UPDATE relay.intents SET ordering_key = 'app:' || ordering_key
 WHERE action = 'application' AND ordering_key IS NOT NULL;
