-- Fair shares between keys (issue 29, part 5): a call with a fairness key
-- (a tenant, a merchant) is written due at its key's next slot, one slot
-- every 1 / fair_share_per_second, so a key's burst is spread out and the
-- calls of a key that arrives later start within a slot or two instead of
-- after the whole burst. The claim still takes intents in due order; a key
-- alone still goes at the fair share.
ALTER TABLE relay.intents ADD COLUMN fairness_key text;

CREATE TABLE relay.fairness_clocks (
    consumer  text        COLLATE "C" NOT NULL,
    endpoint  text        COLLATE "C" NOT NULL,
    key       text        COLLATE "C" NOT NULL,
    next_slot timestamptz NOT NULL,
    PRIMARY KEY (consumer, endpoint, key)
);
