-- The outbox from any application (issue 30): a service in any language
-- enqueues events (relay.publish) and calls (relay.call) in its own
-- transaction. Rolled back, nothing is sent; committed, relay sends it once,
-- with the guarantees of the rows its consumer writes (leases, budgets,
-- per-key order, uncertain state, verify).
--
-- PL/pgSQL functions rather than a table contract: the row relay needs
-- (derived id, CloudEvents headers, budget, expiry, the ordering key's
-- advisory lock) is built in one place, and a wrong call fails the caller's
-- transaction naming the field, instead of leaving a row no dispatcher can
-- send. The functions are SECURITY DEFINER with a pinned search_path; the
-- enqueue role gets EXECUTE on them and nothing else (relay grants it at
-- registration, see relay_store::application).

-- What a relay deployment (its consumer name) takes from applications.
-- Written by relay from its [application] section at migrate and start.
CREATE TABLE relay.app_front_doors (
    consumer          text COLLATE "C" PRIMARY KEY,
    source            text        NOT NULL,
    max_payload_bytes integer     NOT NULL CHECK (max_payload_bytes > 0),
    registered_at     timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE relay.app_topics (
    consumer text COLLATE "C" NOT NULL REFERENCES relay.app_front_doors ON DELETE CASCADE,
    topic    text COLLATE "C" NOT NULL,
    PRIMARY KEY (consumer, topic)
);

-- An endpoint's budget and key rules, as the consumer applies them to the
-- calls its routes make.
CREATE TABLE relay.app_endpoints (
    consumer       text COLLATE "C" NOT NULL REFERENCES relay.app_front_doors ON DELETE CASCADE,
    endpoint       text COLLATE "C" NOT NULL,
    max_attempts   integer  NOT NULL CHECK (max_attempts > 0),
    max_age        interval NOT NULL,
    -- The provider's longest key (its profile), if it has one.
    key_max_length integer,
    -- The key goes in a body field: the body must be a JSON object.
    key_in_body    boolean  NOT NULL,
    -- The provider gets a key (profile none sends none).
    sends_key      boolean  NOT NULL,
    PRIMARY KEY (consumer, endpoint)
);

-- Nobody but relay reads these directly.
REVOKE ALL ON relay.app_front_doors, relay.app_topics, relay.app_endpoints FROM PUBLIC;

-- relay_core::ids::app_id: a UUIDv8 over SHA-256 of the namespace and the
-- name app/consumer/kind/key, each part `len:part` in UTF-8 bytes. SHA-1
-- (UUIDv5) would need an extension. PL/pgSQL, whose expressions keep their
-- plans (a SQL function that is not inlined is planned on every call:
-- 120 µs a row), and no SET clause (a GUC saved and restored per call):
-- it runs only inside relay.publish and relay.call, whose search_path is
-- pinned, and names pg_catalog's functions in full anyway.
CREATE FUNCTION relay.app_id(consumer text, kind text, business_key text) RETURNS uuid
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    h bytea := pg_catalog.sha256('\x6d1b4f6e2a0c5e3b9c417f2d8a130e55'::bytea
        || pg_catalog.convert_to('3:app'
            || pg_catalog.octet_length(pg_catalog.convert_to(consumer, 'UTF8'))::text || ':' || consumer
            || pg_catalog.octet_length(pg_catalog.convert_to(kind, 'UTF8'))::text || ':' || kind
            || pg_catalog.octet_length(pg_catalog.convert_to(business_key, 'UTF8'))::text || ':' || business_key,
            'UTF8'));
BEGIN
    RETURN pg_catalog.encode(pg_catalog.set_byte(pg_catalog.set_byte(pg_catalog.substring(h, 1, 16),
        6, (pg_catalog.get_byte(h, 6) & 15) | 128), 8, (pg_catalog.get_byte(h, 8) & 63) | 128), 'hex')::uuid;
END
$$;

-- A refusal: SQLSTATE 22023 (invalid_parameter_value), the message naming
-- the function and the field first.
CREATE FUNCTION relay.app_refuse(fn text, field text, why text, hint text DEFAULT NULL) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF hint IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('relay.%s: %s: %s', fn, field, why);
    END IF;
    RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('relay.%s: %s: %s', fn, field, why), HINT = hint;
END
$$;

-- The deployment a call is for: the one named, or the only one registered.
-- The helpers below have no SET clause (a GUC saved and restored on every
-- call): they run only inside relay.publish and relay.call, whose
-- search_path is pinned, and nobody else may execute them.
CREATE FUNCTION relay.app_front_door(fn text, requested text) RETURNS relay.app_front_doors
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    door relay.app_front_doors;
    n integer;
BEGIN
    IF requested IS NOT NULL THEN
        SELECT * INTO door FROM relay.app_front_doors d WHERE d.consumer = requested;
        IF FOUND THEN
            RETURN door;
        END IF;
        PERFORM relay.app_refuse(fn, 'consumer', format(
            'no relay deployment named %L takes rows from applications (registered: %s)', requested,
            coalesce((SELECT string_agg(quote_literal(d.consumer), ', ' ORDER BY d.consumer)
                        FROM relay.app_front_doors d), 'none')),
            'give that relay an [application] section and run `relay migrate`');
    END IF;
    SELECT * INTO door FROM relay.app_front_doors d WHERE (SELECT count(*) FROM relay.app_front_doors) = 1;
    IF FOUND THEN
        RETURN door;
    END IF;
    n := (SELECT count(*) FROM relay.app_front_doors);
    IF n = 0 THEN
        PERFORM relay.app_refuse(fn, 'consumer', 'no relay deployment takes rows from applications in this database',
            'give the relay an [application] section (topics, endpoints) and run `relay migrate`');
    END IF;
    PERFORM relay.app_refuse(fn, 'consumer', format(
        '%s relay deployments take rows from applications here (%s): name one with consumer => ...', n,
        (SELECT string_agg(quote_literal(d.consumer), ', ' ORDER BY d.consumer) FROM relay.app_front_doors d)));
    RETURN door;
END
$$;

-- Extra headers: a JSON object of names to text values.
CREATE FUNCTION relay.app_headers(fn text, headers jsonb) RETURNS SETOF record
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    h record;
BEGIN
    IF headers IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(headers) <> 'object' THEN
        PERFORM relay.app_refuse(fn, 'headers', format('a JSON object of header names to text values, not %s',
            jsonb_typeof(headers)));
    END IF;
    FOR h IN SELECT e.key AS name, e.value FROM jsonb_each(headers) e ORDER BY e.key LOOP
        IF jsonb_typeof(h.value) <> 'string' THEN
            PERFORM relay.app_refuse(fn, 'headers', format('the value of %L is %s; header values are text',
                h.name, jsonb_typeof(h.value)));
        END IF;
        RETURN NEXT h;
    END LOOP;
END
$$;

-- A call's on_success or on_dead, as the caller gives it (the shape of a
-- route's [routes.actions.on_success]: emit {name, type, topic, key,
-- subject, data, ordered}, saga {name, saga, id, from, to, start}, values
-- literal), checked field by field and stored as relay_core::Outcome: the
-- completer reads it back and must never meet one it cannot read.
CREATE FUNCTION relay.app_outcome(consumer text, field text, outcome jsonb) RETURNS jsonb
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
        IF NOT e ? 'data' THEN
            PERFORM relay.app_refuse('call', at || '.data', 'required: a JSON value (null for none)');
        END IF;
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

CREATE FUNCTION relay.publish(
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
    row_id uuid;
    payload bytea;
    hs jsonb;
    h record;
BEGIN
    IF publish.id IS NULL OR publish.id = '' THEN
        PERFORM relay.app_refuse('publish', 'id', 'required: a stable id or business key of the event, the same on '
            'every retry of your transaction (relay derives the event''s id from it)');
    END IF;
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
    IF publish.data IS NULL THEN
        PERFORM relay.app_refuse('publish', 'data', 'required: a JSON value (''null''::jsonb for none)');
    END IF;
    IF in_order AND publish.key IS NULL THEN
        PERFORM relay.app_refuse('publish', 'key', 'an ordered event needs a key (events are ordered per key): '
            'give one, or ordered => false');
    END IF;
    payload := convert_to(publish.data::text, 'UTF8');
    IF octet_length(payload) > door.max_payload_bytes THEN
        PERFORM relay.app_refuse('publish', 'data', format('%s bytes, more than the %s bytes relay accepts',
            octet_length(payload), door.max_payload_bytes), 'raise [application].max_payload_bytes, or send less');
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
    FOR h IN SELECT * FROM relay.app_headers('publish', publish.headers) AS x(name text, value jsonb)
              WHERE publish.headers IS NOT NULL LOOP
        IF lower(h.name) LIKE 'ce\_%' OR lower(h.name) LIKE 'relay\_%' OR lower(h.name) = 'content-type' THEN
            PERFORM relay.app_refuse('publish', 'headers', format('%L is relay''s to set (ce_*, relay_*, '
                'content-type); pass CloudEvents attributes as arguments', h.name));
        END IF;
        hs := hs || jsonb_build_array(jsonb_build_object('name', h.name, 'text', h.value #>> '{}'));
    END LOOP;
    -- relay_store::ordering: the key's rows take seq in commit order.
    IF in_order THEN
        PERFORM pg_advisory_xact_lock(1380273154,
            hashtext(door.consumer || chr(2) || publish.topic || chr(1) || publish.key));
    END IF;
    INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, headers, payload, event_type, ordering_key)
    VALUES (row_id, door.consumer, publish.id, 'application', publish.topic, convert_to(publish.key, 'UTF8'), hs,
            payload, publish.type, CASE WHEN in_order THEN publish.key END)
    ON CONFLICT ON CONSTRAINT outbox_pkey DO NOTHING;
    RETURN row_id;
END
$$;

CREATE FUNCTION relay.call(
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
    request_headers jsonb := '{}'::jsonb;
    succeeded jsonb;
    died jsonb;
    h record;
BEGIN
    IF call.id IS NULL OR call.id = '' THEN
        PERFORM relay.app_refuse('call', 'id', 'required: a stable id or business key of the call, the same on '
            'every retry of your transaction (relay derives the call''s id and default idempotency key from it)');
    END IF;
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
    IF call.path IS NULL OR left(call.path, 1) <> '/' OR call.path ~ '\s' THEN
        PERFORM relay.app_refuse('call', 'path', format('%L must start with / and hold no spaces (it is appended '
            'to the endpoint''s base_url)', call.path));
    END IF;
    IF call.body IS NOT NULL AND octet_length(convert_to(call.body::text, 'UTF8')) > door.max_payload_bytes THEN
        PERFORM relay.app_refuse('call', 'body', format('%s bytes, more than the %s bytes relay accepts',
            octet_length(convert_to(call.body::text, 'UTF8')), door.max_payload_bytes),
            'raise [application].max_payload_bytes, or send less');
    END IF;
    IF ep.key_in_body AND (call.body IS NULL OR jsonb_typeof(call.body) <> 'object') THEN
        PERFORM relay.app_refuse('call', 'body', format('endpoint %L takes the idempotency key in a body field: '
            'the body must be a JSON object', call.endpoint));
    END IF;
    row_id := relay.app_id(door.consumer, 'call', call.id);
    key := coalesce(call.idempotency_key, row_id::text);
    IF ep.sends_key AND key = '' THEN
        PERFORM relay.app_refuse('call', 'idempotency_key', 'empty: the provider could not deduplicate retries');
    END IF;
    IF ep.key_max_length IS NOT NULL AND char_length(key) > ep.key_max_length THEN
        PERFORM relay.app_refuse('call', 'idempotency_key', format('%s characters; endpoint %L (its profile, or '
            'idempotency.max_length) accepts at most %s', char_length(key), call.endpoint, ep.key_max_length));
    END IF;
    IF call.ordering_key = '' THEN
        PERFORM relay.app_refuse('call', 'ordering_key', 'empty: give a key, or leave it out for no order');
    END IF;
    FOR h IN SELECT * FROM relay.app_headers('call', call.headers) AS x(name text, value jsonb) LOOP
        request_headers := request_headers || jsonb_build_object(h.name, h.value);
    END LOOP;
    succeeded := relay.app_outcome(door.consumer, 'on_success', call.on_success);
    died := relay.app_outcome(door.consumer, 'on_dead', call.on_dead);
    -- relay_store::ordering: the key's intents take seq in commit order.
    IF call.ordering_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1380273153, hashtext(door.consumer || chr(2) || call.ordering_key));
    END IF;
    INSERT INTO relay.intents (id, consumer, source_event_id, action, endpoint, method, path, body, request_headers,
                               idempotency_key, ordering_key, max_attempts, expires_at, on_success, on_dead,
                               emit_source, correlation_id, causation_id, traceparent)
    VALUES (row_id, door.consumer, call.id, 'application', call.endpoint, verb, call.path, call.body,
            request_headers, key, call.ordering_key, ep.max_attempts, now() + ep.max_age, succeeded, died,
            door.source, call.correlation_id, call.causation_id, call.traceparent)
    ON CONFLICT ON CONSTRAINT intents_pkey DO NOTHING;
    RETURN row_id;
END
$$;

-- Only the enqueue role (granted at registration) runs the front door; the
-- helpers run inside it, as its owner.
REVOKE ALL ON FUNCTION relay.app_id(text, text, text),
    relay.app_refuse(text, text, text, text), relay.app_front_door(text, text), relay.app_headers(text, jsonb),
    relay.app_outcome(text, text, jsonb),
    relay.publish(text, text, text, jsonb, text, jsonb, boolean, text, text, text, text, text),
    relay.call(text, text, text, jsonb, text, text, text, jsonb, jsonb, jsonb, text, text, text, text)
    FROM PUBLIC;
