"""An application's transaction in Python (psycopg 3): its own order row, an
event and a call to a provider, all or nothing. It never links relay: the
two functions relay.publish and relay.call are its whole interface.

    DATABASE_URL=postgres://app:secret@db/shop RELAY_TOPIC=orders.events \
        python enqueue.py ORDER_ID [--rollback] [--die-after-commit]

--rollback           the transaction rolls back: relay sends nothing
--die-after-commit   the process kills itself (SIGKILL) right after COMMIT,
                     before anything is sent: relay still sends it, once

Run it again with the same ORDER_ID (a retry after an ambiguous commit) and
nothing is enqueued twice: relay derives the rows' ids from the business keys.
"""

import json
import os
import signal
import sys

import psycopg
from psycopg.types.json import Jsonb


def main() -> None:
    order = sys.argv[1]
    rollback = "--rollback" in sys.argv[2:]
    die = "--die-after-commit" in sys.argv[2:]
    topic = os.environ.get("RELAY_TOPIC", "orders.events")
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        with conn.transaction():
            conn.execute(
                "INSERT INTO orders (id, amount_cents) VALUES (%s, %s) ON CONFLICT (id) DO NOTHING",
                (order, 1250),
            )
            (event_id,) = conn.execute(
                "SELECT relay.publish(%s, %s, 'order.placed', %s, id => %s)",
                (topic, order, Jsonb({"order_id": order, "amount_cents": 1250}), f"order-{order}-placed"),
            ).fetchone()
            (call_id,) = conn.execute(
                "SELECT relay.call('psp', 'POST', %s, %s, id => %s, idempotency_key => %s, ordering_key => %s)",
                (
                    f"/captures/{order}",
                    Jsonb({"order_id": order, "amount": "1250"}),
                    f"capture-{order}",
                    f"capture:{order}",
                    order,
                ),
            ).fetchone()
            if rollback:
                raise psycopg.Rollback()
        print(json.dumps({"order": order, "event": str(event_id), "call": str(call_id), "committed": not rollback}))
        sys.stdout.flush()
        if die:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
