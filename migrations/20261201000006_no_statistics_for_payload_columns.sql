-- No planner statistics for the columns no statement ever filters, joins or
-- sorts on: the payload of intents and outbox rows (bodies, headers, effects,
-- provenance, error texts).
--
-- Autoanalyze samples every column of a table; on these two tables most of
-- its time went to the wide JSON and bytea columns, whose statistics nothing
-- reads. Measured on the rows of a latency benchmark run (64 000 intents and
-- outbox rows, ANALYZE alone on an idle machine): intents 206 → 80 ms, outbox
-- 296 → 110 ms. Autovacuum runs on the same cores as the relay; in the
-- latency benchmark at 90 % of the peak rate (16 runs, alternating builds)
-- autoanalyze of intents and outbox took 0.2–1.2 s each before and 0.2–0.6 s
-- after. (The p99 latency of those runs did not move beyond its spread: the
-- slow seconds coincide with the whole autovacuum pass — several tables'
-- vacuum and analyze — not with these two analyses alone.)
--
-- Kept: every column a statement compares (ids, state, seq, due and lease
-- times, ordering keys, endpoint, consumer, topic, finished/published times).
-- A later query that does filter on one of these columns still gets a plan,
-- from PostgreSQL's default estimates; give the column a target again then.
ALTER TABLE relay.intents
    ALTER COLUMN source_event_id SET STATISTICS 0,
    ALTER COLUMN action SET STATISTICS 0,
    ALTER COLUMN method SET STATISTICS 0,
    ALTER COLUMN path SET STATISTICS 0,
    ALTER COLUMN body SET STATISTICS 0,
    ALTER COLUMN request_headers SET STATISTICS 0,
    ALTER COLUMN idempotency_key SET STATISTICS 0,
    ALTER COLUMN locked_by SET STATISTICS 0,
    ALTER COLUMN last_error SET STATISTICS 0,
    ALTER COLUMN last_error_class SET STATISTICS 0,
    ALTER COLUMN on_success SET STATISTICS 0,
    ALTER COLUMN on_dead SET STATISTICS 0,
    ALTER COLUMN emit_source SET STATISTICS 0,
    ALTER COLUMN aggregate_id SET STATISTICS 0,
    ALTER COLUMN correlation_id SET STATISTICS 0,
    ALTER COLUMN causation_id SET STATISTICS 0,
    ALTER COLUMN traceparent SET STATISTICS 0;
ALTER TABLE relay.outbox
    ALTER COLUMN source_id SET STATISTICS 0,
    ALTER COLUMN action SET STATISTICS 0,
    ALTER COLUMN key SET STATISTICS 0,
    ALTER COLUMN headers SET STATISTICS 0,
    ALTER COLUMN payload SET STATISTICS 0,
    ALTER COLUMN event_type SET STATISTICS 0,
    ALTER COLUMN last_error SET STATISTICS 0;
