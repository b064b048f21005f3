-- Throttling that adapts and is shared (issue 29, part 5): an endpoint with
-- [endpoints.NAME.adaptive] has one rate for every dispatcher process on
-- this database, lowered multiplicatively when the provider throttles
-- (429, 503) and raised additively while it does not; each process calls
-- at that rate divided by the processes that call the endpoint, which
-- each beat here. So N dispatchers together stay near what the provider
-- allows instead of N times it.
CREATE TABLE relay.endpoint_rates (
    endpoint     text             COLLATE "C" PRIMARY KEY,
    rate         double precision NOT NULL CHECK (rate > 0),
    throttled_at timestamptz,
    updated_at   timestamptz      NOT NULL DEFAULT now()
);

CREATE TABLE relay.rate_members (
    endpoint text        COLLATE "C" NOT NULL,
    worker   text        COLLATE "C" NOT NULL,
    seen_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (endpoint, worker)
);
