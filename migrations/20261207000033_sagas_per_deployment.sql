-- A saga was one per (type, id) in the database, whichever deployment moved
-- it: an application of one deployment allowed to move its own `order`
-- sagas could move another deployment's `order/o-42`, or start it first so
-- that the other's own records found it already there. A saga is now one
-- per deployment, type and id.
--
-- Sagas written before: each goes to every deployment the history says
-- moved it (two such deployments get a copy each, in the state they shared),
-- and one whose history retention has deleted goes to every deployment
-- that ever wrote to this database, as all of them could move it before.
SET LOCAL lock_timeout = '5s';

ALTER TABLE relay.sagas ADD COLUMN consumer text COLLATE "C";
ALTER TABLE relay.sagas DROP CONSTRAINT sagas_pkey;

CREATE TEMP TABLE saga_owners ON COMMIT DROP AS
SELECT DISTINCT s.saga_type, s.saga_id, h.consumer
  FROM relay.sagas s
  JOIN (SELECT DISTINCT consumer, subject FROM relay.history WHERE subject IS NOT NULL) h
    ON h.subject = s.saga_type || '/' || s.saga_id;

-- Every deployment that wrote an inbox row, read along the primary key's
-- first column one value at a time, not row by row.
CREATE TEMP TABLE deployments ON COMMIT DROP AS
WITH RECURSIVE c(consumer) AS (
    SELECT min(consumer) FROM relay.inbox
    UNION ALL
    SELECT (SELECT min(i.consumer) FROM relay.inbox i WHERE i.consumer > c.consumer) FROM c WHERE c.consumer IS NOT NULL
)
SELECT consumer FROM c WHERE consumer IS NOT NULL
UNION
SELECT consumer FROM relay.app_front_doors;

INSERT INTO saga_owners (saga_type, saga_id, consumer)
SELECT s.saga_type, s.saga_id, d.consumer
  FROM relay.sagas s CROSS JOIN deployments d
 WHERE NOT EXISTS (SELECT 1 FROM saga_owners o WHERE o.saga_type = s.saga_type AND o.saga_id = s.saga_id);

INSERT INTO relay.sagas (consumer, saga_type, saga_id, state, version, last_event_id, created_at, updated_at)
SELECT o.consumer, s.saga_type, s.saga_id, s.state, s.version, s.last_event_id, s.created_at, s.updated_at
  FROM relay.sagas s JOIN saga_owners o ON o.saga_type = s.saga_type AND o.saga_id = s.saga_id
 WHERE s.consumer IS NULL;

-- A saga no deployment ever wrote near (a database written by hand) is kept
-- for none: the empty name.
UPDATE relay.sagas s SET consumer = ''
 WHERE s.consumer IS NULL
   AND NOT EXISTS (SELECT 1 FROM saga_owners o WHERE o.saga_type = s.saga_type AND o.saga_id = s.saga_id);
DELETE FROM relay.sagas WHERE consumer IS NULL;

ALTER TABLE relay.sagas ALTER COLUMN consumer SET NOT NULL;
ALTER TABLE relay.sagas ADD CONSTRAINT sagas_pkey PRIMARY KEY (consumer, saga_type, saga_id);
