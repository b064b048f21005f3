-- Park one key, keep the partition moving (issue 29, part 6, consumer side).
-- When a record of a route with on_poison = "hold_key" is dead-lettered,
-- its Kafka record key is held on its partition: the later records of that
-- key are stored as dead letters of class 'held' (bytes, position, headers:
-- recorded, not applied, not lost) while other keys flow. Replaying the
-- head so that it resolves, or skipping it, replays the held records in
-- offset order and drops the hold.
--
-- The key is compared by its SHA-256 in the unique index (a Kafka key may
-- be far longer than an index entry can hold) and byte by byte on lookup.
CREATE TABLE relay.held_keys (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer    text COLLATE "C" NOT NULL,
    topic       text COLLATE "C" NOT NULL,
    partition   integer     NOT NULL,
    key         bytea       NOT NULL,
    -- The dead letter that holds the key, and its offset: a record at or
    -- before it (a redelivery) is never held behind it.
    head        bigint      NOT NULL,
    head_offset bigint      NOT NULL,
    since       timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX held_keys_once ON relay.held_keys (consumer, topic, partition, sha256(key));

-- The hold a dead letter belongs to (its head, or held behind it). While it
-- is set, the letter is unfinished business: never deleted, purged or
-- cleaned up by retention. Dropping the hold clears it.
ALTER TABLE relay.dead_letters
    ADD COLUMN hold_id bigint REFERENCES relay.held_keys (id) ON DELETE SET NULL;
CREATE INDEX dead_letters_by_hold ON relay.dead_letters (hold_id, "offset") WHERE hold_id IS NOT NULL;
