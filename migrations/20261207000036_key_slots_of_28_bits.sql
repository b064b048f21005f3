-- A key's slot was 20 bits of its name's SHA-256 per space: a consumer's
-- batches of 500 keys on four partitions met on a slot in most rounds
-- (two batches share one with odds of about 1 in 5), and each such meeting
-- made one partition's transaction wait for another's whole commit. Slots
-- are now 28 bits per space (the four spaces still fit an integer): two
-- such batches share one about once in a thousand. Rows are still written
-- on a slot's first use, so a deployment has one per key it has seen (up
-- to 2^28 per space). The 20-bit rows are dropped: relays of the earlier
-- slots must be stopped before this runs, as for any migration that
-- changes how keys lock (see the README's upgrade rule).
SET LOCAL lock_timeout = '5s';

CREATE OR REPLACE FUNCTION relay.key_slot(space integer, name text) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT ($1 << 28) | (get_byte(d, 0) << 20) | (get_byte(d, 1) << 12) | (get_byte(d, 2) << 4)
           | (get_byte(d, 3) >> 4)
      FROM (SELECT sha256(convert_to($2, 'UTF8')) AS d) h
$$;

DELETE FROM relay.key_locks WHERE slot >= 0;
