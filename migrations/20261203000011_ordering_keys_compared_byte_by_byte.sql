-- The per-key ordering columns compare byte by byte (COLLATE "C"), as the
-- unique keys do since 20261201000007, for the same reason.
--
-- Why: intents_unfinished_by_key and outbox_unpublished_by_key are what an
-- intent's claim and an outbox row's claim look up to see whether an earlier
-- row of the same ordering key is still unfinished (R13). An index in a
-- linguistic collation is ordered by the C library's rules; when an upgrade
-- changes them, the existing index is out of order without PostgreSQL
-- noticing, the lookup can miss the earlier row, and two calls of one key
-- run out of order. Byte order never changes, and these columns are only
-- compared for equality (ingest review, "to check").
--
-- PostgreSQL rebuilds the indexes on these columns while it holds the
-- table's lock; the partial indexes hold only unfinished rows.
ALTER TABLE relay.intents
    ALTER COLUMN ordering_key TYPE text COLLATE "C";
ALTER TABLE relay.outbox
    ALTER COLUMN topic TYPE text COLLATE "C",
    ALTER COLUMN ordering_key TYPE text COLLATE "C";
