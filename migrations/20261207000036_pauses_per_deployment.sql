-- Pauses were one per kind and name in the database: deployments sharing a
-- database and naming an endpoint or route alike (the examples' `payments`)
-- paused each other's, and one deployment's operator could resume another's
-- pause taken during that deployment's incident. A pause is now a
-- deployment's. Pauses taken before this migration stay every deployment's
-- (consumer ''), as they were, until one resumes them.
SET LOCAL lock_timeout = '5s';

ALTER TABLE relay.pauses ADD COLUMN consumer text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE relay.pauses ALTER COLUMN consumer DROP DEFAULT;
ALTER TABLE relay.pauses DROP CONSTRAINT pauses_pkey;
ALTER TABLE relay.pauses ADD CONSTRAINT pauses_pkey PRIMARY KEY (consumer, kind, name);
