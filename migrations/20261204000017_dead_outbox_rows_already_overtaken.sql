-- Migration 0013 made a dead outbox row hold its ordering key. A row that
-- died before it, whose key's later rows were already published, would now
-- hold up the rows written after the upgrade, and a replay would publish it
-- after the rows it was meant to precede. Such rows are marked skipped (the
-- operator may still publish it by hand knowing it is out of order); dead
-- rows whose key has nothing published after them keep holding it.
UPDATE relay.outbox d
   SET state = 'skipped',
       last_error = concat_ws('; ', d.last_error,
                              'skipped at the upgrade: later rows of its key were already published')
 WHERE d.state = 'dead' AND d.ordering_key IS NOT NULL
   AND EXISTS (SELECT 1 FROM relay.outbox l
                WHERE l.consumer = d.consumer AND l.topic = d.topic AND l.ordering_key = d.ordering_key
                  AND l.seq > d.seq AND l.state = 'published');
