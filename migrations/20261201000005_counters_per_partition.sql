-- Business counters get one row per Kafka partition (shard); a counter's
-- value is the sum of its rows.
--
-- With one row per (consumer, name), every partition's transaction updated
-- the same row, so the partitions a consumer writes side by side queued on
-- that row's lock, each until the holder committed: measured with
-- pg_stat_statements in the latency benchmark, the counter upsert was the
-- most expensive statement of the whole ingest (2–4 ms a call on average,
-- nearly all of it waiting). A partition is written by one consumer at a
-- time, so with a row per partition nobody waits.
--
-- Existing values stay in shard 0, so every sum is unchanged.
ALTER TABLE relay.counters ADD COLUMN shard integer NOT NULL DEFAULT 0;
ALTER TABLE relay.counters DROP CONSTRAINT counters_pkey;
ALTER TABLE relay.counters ADD CONSTRAINT counters_pkey PRIMARY KEY (consumer, name, shard);
