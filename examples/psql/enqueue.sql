-- An application's transaction, in plain SQL: its own row, an event and a
-- call to a provider, all or nothing. Run as a role in relay_enqueue:
--
--   psql "$DATABASE_URL" -v topic=orders.events -v order=o-1 -f examples/psql/enqueue.sql
--
-- The first transaction rolls back: relay sends nothing for it. The second
-- commits: relay publishes its event and makes its call once, however many
-- times the transaction is run again (the ids come from the business keys).
\set ON_ERROR_STOP on

BEGIN;
INSERT INTO orders (id, amount_cents) VALUES (:'order' || '-rolled-back', 500);
SELECT relay.publish(:'topic', :'order' || '-rolled-back', 'order.placed',
                     jsonb_build_object('order_id', :'order' || '-rolled-back', 'amount_cents', 500),
                     id => 'order-' || :'order' || '-rolled-back-placed');
SELECT relay.call('psp', 'POST', '/captures/' || :'order' || '-rolled-back',
                  jsonb_build_object('order_id', :'order' || '-rolled-back', 'amount', '500'),
                  id => 'capture-' || :'order' || '-rolled-back',
                  idempotency_key => 'capture:' || :'order' || '-rolled-back');
ROLLBACK;

BEGIN;
INSERT INTO orders (id, amount_cents) VALUES (:'order', 1250) ON CONFLICT (id) DO NOTHING;
SELECT relay.publish(:'topic', :'order', 'order.placed',
                     jsonb_build_object('order_id', :'order', 'amount_cents', 1250),
                     id => 'order-' || :'order' || '-placed') AS event_id;
SELECT relay.call('psp', 'POST', '/captures/' || :'order',
                  jsonb_build_object('order_id', :'order', 'amount', '1250'),
                  id => 'capture-' || :'order',
                  idempotency_key => 'capture:' || :'order',
                  ordering_key => :'order') AS call_id;
COMMIT;
