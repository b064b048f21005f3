-- The relay's tables live in their own schema so they never collide with the
-- application's tables when a team points the relay at an existing database.
-- Forward only: a later change is a new migration, never an edit of this one.
CREATE SCHEMA IF NOT EXISTS relay;

-- ---------------------------------------------------------------------------
-- Inbox: one row per (consumer, input event id). The primary key IS the
-- technical dedup (R2): the consumer writes it with INSERT … ON CONFLICT DO
-- NOTHING in the same transaction as every business write, and zero affected
-- rows means "already recorded".
-- ---------------------------------------------------------------------------
CREATE TABLE relay.inbox (
    consumer        text        NOT NULL,
    event_id        text        NOT NULL,
    event_type      text        NOT NULL,
    -- Where the first delivery that got recorded came from (audit only: a
    -- duplicate at another offset does not change it).
    topic           text        NOT NULL,
    partition       integer     NOT NULL,
    "offset"        bigint      NOT NULL,
    idempotency_key text,
    aggregate_id    text,
    correlation_id  text,
    -- What the guards decided for this event; every no-op has its class (R5).
    outcome         text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT inbox_pkey PRIMARY KEY (consumer, event_id),
    CONSTRAINT inbox_outcome_known CHECK (outcome IN (
        'applied', 'duplicate_key', 'stale', 'duplicate_version',
        'duplicate_transition', 'invalid_transition', 'duplicate_sequence', 'unrouted'))
);
CREATE INDEX inbox_received_at ON relay.inbox (received_at);

-- Business idempotency keys (R4): a logical operation retried upstream under
-- a new event id is still one operation.
CREATE TABLE relay.idempotency_keys (
    consumer        text        NOT NULL,
    idempotency_key text        NOT NULL,
    -- The event id that claimed the key first.
    event_id        text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (consumer, idempotency_key)
);

-- Per-aggregate version and sequence watermarks for the version guard (R5,
-- `version < incoming`) and the optional sequence guard (R6).
CREATE TABLE relay.aggregates (
    consumer     text        NOT NULL,
    aggregate_id text        NOT NULL,
    -- Highest version applied; NULL until a versioned event arrives.
    version      bigint,
    -- Last sequence number applied; 0 means none yet, so the first is 1.
    last_seq     bigint      NOT NULL DEFAULT 0,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT aggregates_pkey PRIMARY KEY (consumer, aggregate_id),
    CONSTRAINT aggregates_last_seq_not_negative CHECK (last_seq >= 0)
);

-- Saga / aggregate state moved by guarded transitions (R5).
CREATE TABLE relay.sagas (
    saga_type     text        NOT NULL,
    saga_id       text        NOT NULL,
    state         text        NOT NULL,
    -- Bumped on every applied transition; lets readers detect change cheaply.
    version       bigint      NOT NULL DEFAULT 1,
    -- The event (or dispatcher outcome) that made the last applied transition.
    last_event_id text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT sagas_pkey PRIMARY KEY (saga_type, saga_id)
);

-- Append-only history is not duplicate-safe by itself (R14): every row carries
-- the id of the event that caused it under a unique constraint.
CREATE TABLE relay.history (
    consumer    text        NOT NULL,
    source_id   text        NOT NULL,
    action      text        NOT NULL,
    kind        text        NOT NULL,
    subject     text,
    detail      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT history_pkey PRIMARY KEY (consumer, source_id, action),
    CONSTRAINT history_kind_known CHECK (kind IN ('saga', 'intent', 'emit', 'outcome'))
);

-- Business counters count unique effects, not deliveries (R20): they are only
-- incremented in the transaction that inserted a new inbox row.
CREATE TABLE relay.counters (
    consumer text   NOT NULL,
    name     text   NOT NULL,
    value    bigint NOT NULL DEFAULT 0,
    CONSTRAINT counters_pkey PRIMARY KEY (consumer, name)
);

-- ---------------------------------------------------------------------------
-- Intents: external calls to make. The id is UUIDv5(consumer, input event id,
-- action) so reprocessing an input can never create a second row (R7).
--
-- Lifecycle: pending -> running (claimed: lease_token set, attempts + 1)
--            running -> succeeded | pending (retry at next_attempt_at) | dead
--            running -> pending | dead   (lease expired: rescued)
-- ---------------------------------------------------------------------------
CREATE TABLE relay.intents (
    id               uuid        NOT NULL,
    -- Insertion order; "earlier" for per-key ordering (R13).
    seq              bigint      GENERATED ALWAYS AS IDENTITY,
    consumer         text        NOT NULL,
    source_event_id  text        NOT NULL,
    action           text        NOT NULL,
    endpoint         text        NOT NULL,
    method           text        NOT NULL,
    path             text        NOT NULL,
    body             jsonb,
    -- Extra request headers rendered from the route ({"name": "value"}).
    request_headers  jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- Sent unchanged on every attempt (R8).
    idempotency_key  text        NOT NULL,
    -- When set, no intent with this key starts while an earlier one is unfinished.
    ordering_key     text,
    state            text        NOT NULL DEFAULT 'pending',
    -- Counted at claim time (R9): a row that kills its worker still runs out of budget.
    attempts         integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL,
    -- created_at + the endpoint's max age: no attempt starts after this.
    expires_at       timestamptz NOT NULL,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- Fencing token of the current claim; finalize only succeeds with it.
    lease_token      uuid,
    locked_by        text,
    locked_until     timestamptz,
    last_status      integer,
    last_error       text,
    last_error_class text,
    -- What to record when the call succeeds / dies (outbox events, saga moves),
    -- rendered at ingest so a dispatcher needs no route configuration.
    on_success       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    on_dead          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- Provenance carried onto outcome events (CloudEvents source, ids, trace).
    emit_source      text        NOT NULL,
    aggregate_id     text,
    correlation_id   text,
    causation_id     text,
    traceparent      text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    -- One row per (consumer, input event, action): the id is derived from
    -- exactly those (UUIDv5), so the primary key is that constraint. (A second
    -- unique index on the three columns would cost an index entry on every
    -- state change of every intent.)
    CONSTRAINT intents_pkey PRIMARY KEY (id),
    CONSTRAINT intents_state_known CHECK (state IN ('pending', 'running', 'succeeded', 'dead')),
    CONSTRAINT intents_running_has_lease CHECK (
        state <> 'running' OR (lease_token IS NOT NULL AND locked_until IS NOT NULL)),
    CONSTRAINT intents_max_attempts_positive CHECK (max_attempts > 0)
);
-- The claim's exact order, so a claim reads only the rows it takes (a plain
-- next_attempt_at index would sort every row of a same-instant burst by seq).
CREATE INDEX intents_due ON relay.intents (next_attempt_at, seq) WHERE state = 'pending';
CREATE INDEX intents_leases ON relay.intents (locked_until) WHERE state = 'running';
CREATE INDEX intents_unfinished_by_key ON relay.intents (ordering_key, seq)
    WHERE state IN ('pending', 'running') AND ordering_key IS NOT NULL;
CREATE INDEX intents_dead ON relay.intents (finished_at) WHERE state = 'dead';

-- Every attempt, for audit: written by the worker that holds the lease when
-- the attempt finishes, or as 'lease_expired' by the rescuer when it was lost.
CREATE TABLE relay.intent_attempts (
    intent_id   uuid        NOT NULL REFERENCES relay.intents (id) ON DELETE CASCADE,
    attempt     integer     NOT NULL,
    worker      text        NOT NULL,
    lease_token uuid        NOT NULL,
    -- When the row was written (the attempt's end, or its rescue).
    claimed_at  timestamptz NOT NULL DEFAULT now(),
    -- When the request was handed to the HTTP client (after waiting for the
    -- endpoint's concurrency and rate limits); NULL if the worker was lost first.
    started_at  timestamptz,
    finished_at timestamptz,
    outcome     text        NOT NULL DEFAULT 'running',
    status      integer,
    error_class text,
    error       text,
    CONSTRAINT intent_attempts_pkey PRIMARY KEY (intent_id, attempt),
    CONSTRAINT intent_attempts_outcome_known CHECK (outcome IN (
        'running', 'succeeded', 'retryable', 'permanent', 'uncertain', 'lease_expired'))
);

-- ---------------------------------------------------------------------------
-- Outbox: Kafka records to emit, already encoded (CloudEvents binary mode for
-- events, the original bytes for dead-letter copies). Id derived like intents.
-- ---------------------------------------------------------------------------
CREATE TABLE relay.outbox (
    id              uuid        NOT NULL,
    seq             bigint      GENERATED ALWAYS AS IDENTITY,
    consumer        text        NOT NULL,
    source_id       text        NOT NULL,
    action          text        NOT NULL,
    topic           text        NOT NULL,
    key             bytea,
    -- [[name, value-or-null], …]; values are UTF-8 text.
    headers         jsonb       NOT NULL DEFAULT '[]'::jsonb,
    payload         bytea,
    event_type      text,
    -- Rows with the same ordering key are published in seq order.
    ordering_key    text,
    state           text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_token     uuid,
    locked_until    timestamptz,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    CONSTRAINT outbox_pkey PRIMARY KEY (id),
    CONSTRAINT outbox_state_known CHECK (state IN ('pending', 'running', 'published')),
    CONSTRAINT outbox_running_has_lease CHECK (
        state <> 'running' OR (lease_token IS NOT NULL AND locked_until IS NOT NULL))
);
-- Claims walk pending rows in seq order; next_due_at needs the earliest due time.
CREATE INDEX outbox_pending_by_seq ON relay.outbox (seq) WHERE state = 'pending';
CREATE INDEX outbox_due ON relay.outbox (next_attempt_at) WHERE state = 'pending';
CREATE INDEX outbox_leases ON relay.outbox (locked_until) WHERE state = 'running';
CREATE INDEX outbox_unpublished_by_key ON relay.outbox (topic, ordering_key, seq)
    WHERE state IN ('pending', 'running') AND ordering_key IS NOT NULL;

-- ---------------------------------------------------------------------------
-- Dead letters: input records that could not be processed (R11, R19). Unique
-- per source position, so a poison record redelivered after a crash is parked once.
-- ---------------------------------------------------------------------------
CREATE TABLE relay.dead_letters (
    id             bigint      GENERATED ALWAYS AS IDENTITY,
    consumer       text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    "offset"       bigint      NOT NULL,
    event_id       text,
    event_type     text,
    key            bytea,
    payload        bytea,
    headers        jsonb       NOT NULL DEFAULT '[]'::jsonb,
    error_class    text        NOT NULL,
    reason         text        NOT NULL,
    attempts       integer     NOT NULL DEFAULT 1,
    created_at     timestamptz NOT NULL DEFAULT now(),
    replayed_at    timestamptz,
    replay_outcome text,
    CONSTRAINT dead_letters_pkey PRIMARY KEY (id),
    CONSTRAINT dead_letters_once_per_position UNIQUE (consumer, topic, partition, "offset")
);

-- ---------------------------------------------------------------------------
-- Wake-ups: one notification per inserting statement (not per row), and
-- PostgreSQL folds identical notifications of one transaction into one.
-- ---------------------------------------------------------------------------
CREATE FUNCTION relay.notify_work() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;
CREATE TRIGGER intents_notify AFTER INSERT ON relay.intents
    FOR EACH STATEMENT EXECUTE FUNCTION relay.notify_work('relay_intents');
CREATE TRIGGER outbox_notify AFTER INSERT ON relay.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION relay.notify_work('relay_outbox');
