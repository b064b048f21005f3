-- Reconciliation of uncertain intents (issue 29, part 2): an endpoint may
-- say how to ask its provider what became of a call whose outcome is
-- unknown. Each question and its answer is a row here, beside the intent's
-- attempts; `reconciles` counts them against the endpoint's budget and
-- `next_reconcile_at` says when to ask again (NULL: the endpoint's `after`
-- from when the intent became uncertain). The verdicts are
-- relay_core::profile::Reconciled.
ALTER TABLE relay.intents
    ADD COLUMN reconciles integer NOT NULL DEFAULT 0,
    ADD COLUMN next_reconcile_at timestamptz;

CREATE TABLE relay.intent_reconciliations (
    intent_id   uuid        NOT NULL REFERENCES relay.intents (id) ON DELETE CASCADE,
    n           integer     NOT NULL,
    worker      text        NOT NULL,
    started_at  timestamptz,
    finished_at timestamptz NOT NULL DEFAULT now(),
    status      integer,
    verdict     text        NOT NULL,
    error       text,
    CONSTRAINT intent_reconciliations_pkey PRIMARY KEY (intent_id, n),
    CONSTRAINT intent_reconciliations_verdict_known CHECK (verdict IN ('succeeded', 'not_applied', 'unknown'))
);

-- A reconciler finds the uncertain intents due through intents_uncertain
-- (finished_at, WHERE state = 'uncertain'): they are few, and another index
-- on every intent update costs the hot path more than it would save here.
