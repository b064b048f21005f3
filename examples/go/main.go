// An application's transaction in Go (pgx): its own order row, an event and
// a call to a provider, all or nothing. The same as examples/python.
//
//	DATABASE_URL=postgres://app:secret@db/shop RELAY_TOPIC=orders.events \
//	  go run . ORDER_ID [--rollback] [--die-after-commit]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"syscall"

	"github.com/jackc/pgx/v5"
)

var errRollback = errors.New("rolled back on purpose")

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run() error {
	order, flags := os.Args[1], os.Args[2:]
	rollback, die := slices.Contains(flags, "--rollback"), slices.Contains(flags, "--die-after-commit")
	topic := os.Getenv("RELAY_TOPIC")
	if topic == "" {
		topic = "orders.events"
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var event, call string
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id, amount_cents) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
			order, 1250); err != nil {
			return err
		}
		data := map[string]any{"order_id": order, "amount_cents": 1250}
		if err := tx.QueryRow(ctx, "SELECT relay.publish($1, $2, 'order.placed', $3, id => $4)::text",
			topic, order, data, "order-"+order+"-placed").Scan(&event); err != nil {
			return err
		}
		body := map[string]any{"order_id": order, "amount": "1250"}
		if err := tx.QueryRow(ctx,
			"SELECT relay.call('psp', 'POST', $1, $2, id => $3, idempotency_key => $4, ordering_key => $5)::text",
			"/captures/"+order, body, "capture-"+order, "capture:"+order, order).Scan(&call); err != nil {
			return err
		}
		if rollback {
			return errRollback
		}
		return nil
	})
	if err != nil && !errors.Is(err, errRollback) {
		return err
	}
	out, _ := json.Marshal(map[string]any{"order": order, "event": event, "call": call, "committed": !rollback})
	fmt.Println(string(out))
	if die {
		return syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	return nil
}
