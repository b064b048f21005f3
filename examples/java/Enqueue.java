// An application's transaction in Java (JDBC, pgjdbc): its own order row, an
// event and a call to a provider, all or nothing. The same as examples/python.
//
//   DATABASE_URL=jdbc:postgresql://db/shop?user=app&password=secret RELAY_TOPIC=orders.events \
//     java -cp postgresql.jar Enqueue.java ORDER_ID [--rollback] [--die-after-commit]

import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.util.List;

public class Enqueue {
    public static void main(String[] args) throws Exception {
        String order = args[0];
        List<String> flags = List.of(args).subList(1, args.length);
        boolean rollback = flags.contains("--rollback");
        boolean die = flags.contains("--die-after-commit");
        String topic = System.getenv().getOrDefault("RELAY_TOPIC", "orders.events");
        String event;
        String call;
        try (Connection db = DriverManager.getConnection(System.getenv("DATABASE_URL"))) {
            db.setAutoCommit(false);
            try {
                try (PreparedStatement s = db.prepareStatement(
                        "INSERT INTO orders (id, amount_cents) VALUES (?, ?) ON CONFLICT (id) DO NOTHING")) {
                    s.setString(1, order);
                    s.setInt(2, 1250);
                    s.executeUpdate();
                }
                event = one(db, "SELECT relay.publish(?, ?, 'order.placed', ?::jsonb, id => ?)::text",
                        topic, order, "{\"order_id\": \"" + order + "\", \"amount_cents\": 1250}",
                        "order-" + order + "-placed");
                call = one(db, "SELECT relay.call('psp', 'POST', ?, ?::jsonb, id => ?, idempotency_key => ?, "
                                + "ordering_key => ?)::text",
                        "/captures/" + order, "{\"order_id\": \"" + order + "\", \"amount\": \"1250\"}",
                        "capture-" + order, "capture:" + order, order);
                if (rollback) {
                    db.rollback();
                } else {
                    db.commit();
                }
            } catch (Exception e) {
                db.rollback();
                throw e;
            }
        }
        System.out.printf("{\"order\": \"%s\", \"event\": \"%s\", \"call\": \"%s\", \"committed\": %s}%n",
                order, event, call, !rollback);
        System.out.flush();
        if (die) {
            // SIGKILL to itself: no shutdown hooks, nothing flushed, like a crash.
            new ProcessBuilder("kill", "-KILL", Long.toString(ProcessHandle.current().pid())).start().waitFor();
        }
    }

    /** The one text value `sql` returns with `params` bound. */
    private static String one(Connection db, String sql, String... params) throws Exception {
        try (PreparedStatement s = db.prepareStatement(sql)) {
            for (int i = 0; i < params.length; i++) {
                s.setString(i + 1, params[i]);
            }
            try (ResultSet r = s.executeQuery()) {
                r.next();
                return r.getString(1);
            }
        }
    }
}
