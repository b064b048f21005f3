// An application's transaction in Node.js (pg): its own order row, an event
// and a call to a provider, all or nothing. The same as examples/python.
//
//   DATABASE_URL=postgres://app:secret@db/shop RELAY_TOPIC=orders.events \
//     node enqueue.js ORDER_ID [--rollback] [--die-after-commit]
"use strict";
const { Client } = require("pg");

async function main() {
  const [order, ...flags] = process.argv.slice(2);
  const rollback = flags.includes("--rollback");
  const die = flags.includes("--die-after-commit");
  const topic = process.env.RELAY_TOPIC || "orders.events";
  const db = new Client({ connectionString: process.env.DATABASE_URL });
  await db.connect();
  let event, call;
  try {
    await db.query("BEGIN");
    await db.query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING", [order, 1250]);
    ({ rows: [{ publish: event }] } = await db.query(
      "SELECT relay.publish($1, $2, 'order.placed', $3, id => $4)",
      [topic, order, { order_id: order, amount_cents: 1250 }, `order-${order}-placed`]));
    ({ rows: [{ call }] } = await db.query(
      "SELECT relay.call('psp', 'POST', $1, $2, id => $3, idempotency_key => $4, ordering_key => $5)",
      [`/captures/${order}`, { order_id: order, amount: "1250" }, `capture-${order}`, `capture:${order}`, order]));
    await db.query(rollback ? "ROLLBACK" : "COMMIT");
  } catch (e) {
    await db.query("ROLLBACK").catch(() => {});
    throw e;
  }
  console.log(JSON.stringify({ order, event, call, committed: !rollback }));
  if (die) process.kill(process.pid, "SIGKILL");
  await db.end();
}

main().catch((e) => { console.error(e.message); process.exit(1); });
