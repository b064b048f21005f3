-- Operations: pausing routes and endpoints, and indexes for retention cleanup.

-- A paused route holds its partitions at its first event (nothing is skipped);
-- a paused endpoint's intents are not claimed. Every relay process reads this
-- table, so a pause applies to the whole deployment.
CREATE TABLE relay.pauses (
    kind      text        NOT NULL,
    name      text        NOT NULL,
    reason    text,
    paused_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pauses_pkey PRIMARY KEY (kind, name),
    CONSTRAINT pauses_kind_known CHECK (kind IN ('route', 'endpoint'))
);

-- Cleanup deletes the oldest finished rows in small batches; these keep each
-- batch an index range scan instead of a sequential scan.
CREATE INDEX intents_succeeded_at ON relay.intents (finished_at) WHERE state = 'succeeded';
CREATE INDEX outbox_published_at ON relay.outbox (published_at) WHERE state = 'published';
CREATE INDEX idempotency_keys_created_at ON relay.idempotency_keys (created_at);
CREATE INDEX dead_letters_created_at ON relay.dead_letters (created_at);
