-- The front door's guards (issue 30, after its review):
--
-- * Each deployment names its enqueue role, and a caller must be a member
--   of the role of the deployment it enqueues for: a member of one
--   deployment's role cannot write to another's by naming it.
-- * Saga moves on a call's outcomes are limited to the saga types the
--   deployment lets applications move ([application].sagas).
-- * Text that becomes an id, a key, a header or a URL is bounded and free of
--   control characters (relay_core::limits), request headers relay sets
--   itself are refused, and a path cannot climb out of the endpoint's
--   base_url with dot segments.
-- * An id reused for different content is refused instead of silently
--   dropped.
-- * relay.app_id reads its namespace with decode(), independent of
--   standard_conforming_strings (the value is unchanged).
SET LOCAL lock_timeout = '5s';

-- NULL for a door an older relay registered: nobody may enqueue through it
-- until a relay that knows its role registers it again (fail closed).
ALTER TABLE relay.app_front_doors ADD COLUMN role text COLLATE "C";

-- Lower-case names of request headers applications may not set on this
-- endpoint's calls (those relay sets, its key header, its static headers,
-- those that re-route a request); a trailing `*` is a prefix. Written by
-- relay from the dispatcher's own list; NULL where an older relay wrote the
-- row, and then a call with headers is refused (fail closed).
ALTER TABLE relay.app_endpoints ADD COLUMN reserved_headers text[];

-- Saga types a call's outcomes may move, per deployment.
CREATE TABLE relay.app_sagas (
    consumer  text COLLATE "C" NOT NULL REFERENCES relay.app_front_doors ON DELETE CASCADE,
    saga_type text COLLATE "C" NOT NULL,
    PRIMARY KEY (consumer, saga_type)
);
REVOKE ALL ON relay.app_sagas FROM PUBLIC;

CREATE OR REPLACE FUNCTION relay.app_id(consumer text, kind text, business_key text) RETURNS uuid
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    h bytea := pg_catalog.sha256(pg_catalog.decode('6d1b4f6e2a0c5e3b9c417f2d8a130e55', 'hex')
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

-- Text that becomes an id, a key or a header: at most `max_bytes` and, as
-- relay_core::limits::check_controls, free of control characters
-- (U+0001–U+001F, U+007F–U+009F; text cannot hold U+0000).
CREATE FUNCTION relay.app_check_text(fn text, field text, value text, max_bytes integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF value IS NULL THEN
        RETURN;
    END IF;
    IF octet_length(value) > max_bytes THEN
        PERFORM relay.app_refuse(fn, field, format('%s bytes, over the %s-byte limit', octet_length(value), max_bytes));
    END IF;
    IF value ~ E'[\\u0001-\\u001f\\u007f-\\u009f]' THEN
        PERFORM relay.app_refuse(fn, field, format('holds the control character U+%s at character %s; ids, keys '
            'and headers cannot carry one',
            upper(lpad(to_hex(ascii(substring(value FROM E'[\\u0001-\\u001f\\u007f-\\u009f]'))), 4, '0')),
            strpos(value, substring(value FROM E'[\\u0001-\\u001f\\u007f-\\u009f]'))));
    END IF;
END
$$;

-- Whether `value` is empty or only white space, as Rust's
-- char::is_whitespace has it (relay_core::limits::is_blank). The
-- characters beyond ASCII exist only in a UTF-8 database: built with chr()
-- in a branch taken there alone, so the function is created anywhere.
CREATE FUNCTION relay.app_blank(value text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF pg_catalog.getdatabaseencoding() = 'UTF8' THEN
        RETURN btrim(value, E' \t\n\u000b\f\r' || chr(133) || chr(160) || chr(5760) || chr(8192) || chr(8193)
            || chr(8194) || chr(8195) || chr(8196) || chr(8197) || chr(8198) || chr(8199) || chr(8200) || chr(8201)
            || chr(8202) || chr(8232) || chr(8233) || chr(8239) || chr(8287) || chr(12288)) = '';
    END IF;
    RETURN btrim(value, E' \t\n\u000b\f\r') = '';
END
$$;

-- A key: bounded (relay_core::limits::MAX_KEY_BYTES), no control
-- characters, and not blank (limits::is_blank).
CREATE FUNCTION relay.app_check_key(fn text, field text, value text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF value IS NOT NULL AND relay.app_blank(value) THEN
        PERFORM relay.app_refuse(fn, field, 'blank: give a key, or leave it out (NULL)');
    END IF;
    PERFORM relay.app_check_text(fn, field, value, 1024);
END
$$;

-- The deployment a call is for (the one named, or the only one
-- registered), if the caller may enqueue for it: the role it acts as (set
-- with SET ROLE, else its login: these functions run as their owner, so
-- current_user is not the caller's) must have the deployment's role's
-- privileges (pg_has_role USAGE: a member that inherits them). relay itself
-- (the owner) may. A superuser may not unless it is the owner: code an
-- application hides in an index expression runs with a superuser as the
-- session when autovacuum or a DBA maintains the table. A door an older
-- relay registered has no role yet, and takes nothing.
CREATE OR REPLACE FUNCTION relay.app_front_door(fn text, requested text) RETURNS relay.app_front_doors
    LANGUAGE plpgsql STABLE
AS $$
DECLARE
    door relay.app_front_doors;
    n integer;
    caller text := coalesce(nullif(pg_catalog.current_setting('role'), 'none'), session_user);
BEGIN
    IF requested IS NOT NULL THEN
        SELECT * INTO door FROM relay.app_front_doors d WHERE d.consumer = requested;
        IF NOT FOUND THEN
            PERFORM relay.app_refuse(fn, 'consumer', format(
                'no relay deployment named %L takes rows from applications (registered: %s)', requested,
                coalesce((SELECT string_agg(quote_literal(d.consumer), ', ' ORDER BY d.consumer)
                            FROM relay.app_front_doors d), 'none')),
                'give that relay an [application] section and run `relay migrate`');
        END IF;
    ELSE
        n := (SELECT count(*) FROM relay.app_front_doors);
        IF n = 0 THEN
            PERFORM relay.app_refuse(fn, 'consumer', 'no relay deployment takes rows from applications in this database',
                'give the relay an [application] section (topics, endpoints) and run `relay migrate`');
        ELSIF n > 1 THEN
            PERFORM relay.app_refuse(fn, 'consumer', format(
                '%s relay deployments take rows from applications here (%s): name one with consumer => ...', n,
                (SELECT string_agg(quote_literal(d.consumer), ', ' ORDER BY d.consumer) FROM relay.app_front_doors d)));
        END IF;
        -- In one statement: a door registered meanwhile must not be picked.
        SELECT * INTO door FROM relay.app_front_doors d WHERE (SELECT count(*) FROM relay.app_front_doors) = 1;
        IF NOT FOUND THEN
            PERFORM relay.app_refuse(fn, 'consumer', 'the relay deployments here changed during the call: name one '
                'with consumer => ...');
        END IF;
    END IF;
    IF door.role IS NULL AND caller <> current_user THEN
        RAISE EXCEPTION USING ERRCODE = '42501',
            MESSAGE = format('relay.%s: consumer: relay %L was registered by an older relay, which named no role: it '
                'takes nothing until it registers again', fn, door.consumer),
            HINT = 'run `relay migrate` with the current relay';
    END IF;
    IF caller <> current_user AND NOT (
        EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = door.role)
        AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = caller AND r.rolsuper)
        AND pg_catalog.pg_has_role(caller, door.role, 'USAGE')) THEN
        RAISE EXCEPTION USING ERRCODE = '42501',
            MESSAGE = format('relay.%s: consumer: role %I may not enqueue for relay %L: it does not have the '
                'privileges of %I, the role that deployment takes rows from', fn, caller, door.consumer, door.role),
            HINT = format('GRANT %I TO %I (as the DBA), or name the deployment whose role it has', door.role,
                caller);
    END IF;
    RETURN door;
END
$$;

-- Extra headers: a JSON object of at most 64 names to text values, each
-- name a bounded HTTP token outside `reserved` (lower-case names, a
-- trailing `*` a prefix), each value at most 8 KiB without control
-- characters (they become Kafka or HTTP headers).
DROP FUNCTION relay.app_headers(text, jsonb);
CREATE FUNCTION relay.app_headers(fn text, headers jsonb, reserved text[]) RETURNS SETOF record
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    h record;
BEGIN
    IF headers IS NULL THEN
        RETURN;
    END IF;
    IF reserved IS NULL THEN
        PERFORM relay.app_refuse(fn, 'headers', 'this endpoint was registered by an older relay, which did not say '
            'which headers are relay''s: none are taken until it registers again', 'run `relay migrate` with the '
            'current relay');
    END IF;
    IF jsonb_typeof(headers) <> 'object' THEN
        PERFORM relay.app_refuse(fn, 'headers', format('a JSON object of header names to text values, not %s',
            jsonb_typeof(headers)));
    END IF;
    IF (SELECT count(*) FROM jsonb_object_keys(headers)) > 64 THEN
        PERFORM relay.app_refuse(fn, 'headers', format('%s headers; at most 64',
            (SELECT count(*) FROM jsonb_object_keys(headers))));
    END IF;
    FOR h IN SELECT e.key AS name, e.value FROM jsonb_each(headers) e ORDER BY e.key LOOP
        IF h.name !~ '^[!#$%&''*+.^_`|~0-9A-Za-z-]+$' OR octet_length(h.name) > 256 THEN
            PERFORM relay.app_refuse(fn, 'headers', format('%L is not a header name (1 to 256 letters, digits and '
                '!#$%%&''*+.^_`|~-)', h.name));
        END IF;
        IF EXISTS (SELECT 1 FROM unnest(reserved) r
                    WHERE lower(h.name) = r OR (right(r, 1) = '*' AND starts_with(lower(h.name), left(r, -1)))) THEN
            PERFORM relay.app_refuse(fn, 'headers', format('%L is relay''s to set (%s)', h.name,
                array_to_string(reserved, ', ')),
                CASE WHEN fn = 'publish' THEN 'pass CloudEvents attributes as arguments' END);
        END IF;
        IF jsonb_typeof(h.value) <> 'string' THEN
            PERFORM relay.app_refuse(fn, 'headers', format('the value of %L is %s; header values are text',
                h.name, jsonb_typeof(h.value)));
        END IF;
        PERFORM relay.app_check_text(fn, format('headers.%s', h.name), h.value #>> '{}', 8192);
        RETURN NEXT h;
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

-- A refusal of an id already used for something else: the row it names
-- stays as it was.
CREATE FUNCTION relay.app_reused(fn text, business_key text, what text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    PERFORM relay.app_refuse(fn, 'id', format('%L was already used for a different %s (%s): an id names one '
        'row, the same on every retry of its transaction', business_key, CASE WHEN fn = 'publish' THEN 'event'
        ELSE 'call' END, what), 'give a new row an id of its own');
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
    -- relay_store::ordering: the key's rows take seq in commit order.
    IF in_order THEN
        PERFORM pg_advisory_xact_lock(1380273154,
            hashtext(door.consumer || chr(2) || publish.topic || chr(1) || publish.key));
    END IF;
    INSERT INTO relay.outbox (id, consumer, source_id, action, topic, key, headers, payload, event_type, ordering_key)
    VALUES (row_id, door.consumer, publish.id, 'application', publish.topic, key_bytes, hs,
            payload, publish.type, CASE WHEN in_order THEN publish.key END)
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
                      OR prior.ordering_key IS DISTINCT FROM CASE WHEN in_order THEN publish.key END
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
    IF ep.key_in_body AND (call.body IS NULL OR jsonb_typeof(call.body) <> 'object') THEN
        PERFORM relay.app_refuse('call', 'body', format('endpoint %L takes the idempotency key in a body field: '
            'the body must be a JSON object', call.endpoint));
    END IF;
    row_id := relay.app_id(door.consumer, 'call', call.id);
    key := coalesce(call.idempotency_key, row_id::text);
    IF ep.sends_key AND key = '' THEN
        PERFORM relay.app_refuse('call', 'idempotency_key', 'empty: the provider could not deduplicate retries');
    END IF;
    IF key <> '' THEN
        PERFORM relay.app_check_key('call', 'idempotency_key', key);
    END IF;
    IF ep.key_max_length IS NOT NULL AND char_length(key) > ep.key_max_length THEN
        PERFORM relay.app_refuse('call', 'idempotency_key', format('%s characters; endpoint %L (its profile, or '
            'idempotency.max_length) accepts at most %s', char_length(key), call.endpoint, ep.key_max_length));
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
    IF NOT FOUND THEN
        SELECT i.endpoint, i.method, i.path, i.body, i.request_headers, i.idempotency_key, i.ordering_key,
               i.on_success, i.on_dead
          INTO prior FROM relay.intents i WHERE i.id = row_id;
        IF FOUND AND (prior.endpoint IS DISTINCT FROM call.endpoint OR prior.method IS DISTINCT FROM verb
                      OR prior.path IS DISTINCT FROM call.path OR prior.body IS DISTINCT FROM call.body
                      OR prior.request_headers IS DISTINCT FROM request_headers
                      OR prior.idempotency_key IS DISTINCT FROM key
                      OR prior.ordering_key IS DISTINCT FROM call.ordering_key
                      OR prior.on_success IS DISTINCT FROM succeeded OR prior.on_dead IS DISTINCT FROM died) THEN
            PERFORM relay.app_reused('call', call.id, format('%s %s on endpoint %L', prior.method, prior.path,
                prior.endpoint));
        END IF;
    END IF;
    RETURN row_id;
END
$$;

REVOKE ALL ON FUNCTION relay.app_blank(text), relay.app_check_text(text, text, text, integer),
    relay.app_check_key(text, text, text),
    relay.app_headers(text, jsonb, text[]), relay.app_reused(text, text, text) FROM PUBLIC;
