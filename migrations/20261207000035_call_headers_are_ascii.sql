-- What relay.call stores to send as an HTTP header (the idempotency key,
-- correlation_id, traceparent, headers) was checked for control characters
-- only: text beyond printable ASCII was accepted, and the request could
-- then never be built, so the call ended dead and recorded on_dead. An HTTP
-- header value is printable ASCII: the call is refused at once, in the
-- caller's transaction, as every call that could never be sent is.
SET LOCAL lock_timeout = '5s';

CREATE OR REPLACE FUNCTION relay.app_check_text(fn text, field text, value text, max_bytes integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    odd text;
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
    IF fn = 'call' AND (field IN ('idempotency_key', 'correlation_id', 'traceparent') OR starts_with(field, 'headers.')) THEN
        odd := substring(value FROM '[^ -~]');
        IF odd IS NOT NULL THEN
            PERFORM relay.app_refuse(fn, field, format('holds %L at character %s; it is sent as an HTTP header, '
                'whose values are printable ASCII', odd, strpos(value, odd)));
        END IF;
    END IF;
END
$$;
