-- A dead letter was unique per source position alone, so that a poison
-- record redelivered after a crash (between the database commit and the
-- offset commit) is parked once. But a position is not a record: after a
-- topic is deleted and created again, or a consumer group moves to a mirror
-- whose offsets start again, a new record at the position of one parked
-- earlier was taken for its redelivery and dropped unseen, its offset
-- committed; a held record, a good event, was never applied. Dead letters
-- are kept for good by default, so the collision waits for the first new
-- record at an old position. A dead letter is now unique per position and
-- record: the SHA-256 of its key and payload, each with its length (NULL
-- apart from empty).
SET LOCAL lock_timeout = '5s';

ALTER TABLE relay.dead_letters
    ADD COLUMN fingerprint bytea NOT NULL GENERATED ALWAYS AS (
        sha256(int4send(coalesce(length(key), -1)) || coalesce(key, ''::bytea)
               || int4send(coalesce(length(payload), -1)) || coalesce(payload, ''::bytea))
    ) STORED;
ALTER TABLE relay.dead_letters DROP CONSTRAINT dead_letters_once_per_position;
ALTER TABLE relay.dead_letters
    ADD CONSTRAINT dead_letters_once_per_record UNIQUE (consumer, topic, partition, "offset", fingerprint);
