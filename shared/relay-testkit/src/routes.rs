//! Route fixtures: the TOML pieces the tests' routes are made of, so that a
//! route names only what sets it apart (an ordering key, a header, a saga
//! step) and the lines every capture shares are written once.
//!
//! `{topic}` and `{out}` are left for the harness to fill in (the input and
//! output topics); `{{ … }}` are the route's own templates. Each piece starts
//! on a line of its own, so pieces join with `concat`.

/// The event's order id, as a template.
const ORDER_ID: &str = "{{ data.order_id }}";

/// A `[[routes]]` table for events of type `event_type` on `{topic}`, named
/// `name` when there is one, with `more` (TOML lines) in it.
pub fn route(name: Option<&str>, event_type: &str, more: &str) -> String {
    let name = name.map(|n| format!("name = \"{n}\"\n")).unwrap_or_default();
    format!("\n[[routes]]\n{name}topic = \"{{topic}}\"\ntype = \"{event_type}\"\n{more}")
}

/// The route most tests use: `order-placed`, for `order.placed` events.
pub fn order_placed(more: &str) -> String {
    route(Some("order-placed"), "order.placed", more)
}

/// A call action `name` to endpoint `endpoint` at `path`, keyed by
/// `name:<order id>`, with `more` lines.
pub fn call(name: &str, endpoint: &str, path: &str, more: &str) -> String {
    call_keyed(name, endpoint, path, &format!("{name}:{ORDER_ID}"), more)
}

/// [`call`], keyed by the template `key`.
pub fn call_keyed(name: &str, endpoint: &str, path: &str, key: &str, more: &str) -> String {
    format!(
        "\n[[routes.actions]]\nkind = \"call\"\nname = \"{name}\"\nendpoint = \"{endpoint}\"\npath = \"{path}\"\nidempotency_key = \"{key}\"\n{more}"
    )
}

/// The capture: a call to `psp` at `/captures/<order id>`.
pub fn capture(more: &str) -> String {
    call("capture", "psp", &format!("/captures/{ORDER_ID}"), more)
}

/// A body of the order id alone.
pub fn order_body() -> String {
    format!("body = {{ order_id = \"{ORDER_ID}\" }}\n")
}

/// A body of the order id and its amount.
pub fn order_and_amount_body() -> String {
    format!("body = {{ order_id = \"{ORDER_ID}\", amount = \"{{{{ data.amount }}}}\" }}\n")
}

/// An event `name` of type `event_type` emitted to `{out}` when the call
/// ends `on` (`on_success`, `on_dead`), keyed by the order id, with `more`
/// lines (its `data` among them).
pub fn emit_on(on: &str, name: &str, event_type: &str, more: &str) -> String {
    format!(
        "\n[[routes.actions.{on}.emit]]\nname = \"{name}\"\ntype = \"{event_type}\"\ntopic = \"{{out}}\"\nkey = \"{ORDER_ID}\"\n{more}"
    )
}

/// Data of the order id alone.
pub fn order_data() -> String {
    format!("data = {{ order_id = \"{ORDER_ID}\" }}\n")
}

/// `payment.captured` of the order when the call succeeds.
pub fn captured() -> String {
    emit_on("on_success", "captured", "payment.captured", &order_data())
}

/// `payment.failed` of the order when the call ends dead.
pub fn failed() -> String {
    emit_on("on_dead", "failed", "payment.failed", &order_data())
}

/// An action `name` starting saga `order` of the order in state `to`.
pub fn saga_start(name: &str, to: &str) -> String {
    format!(
        "\n[[routes.actions]]\nkind = \"saga\"\nname = \"{name}\"\nsaga = \"order\"\nid = \"{ORDER_ID}\"\nstart = true\nto = \"{to}\"\n"
    )
}

/// An action `name` moving the order's saga from `from` to `to`.
pub fn saga_move(name: &str, from: &str, to: &str) -> String {
    format!(
        "\n[[routes.actions]]\nkind = \"saga\"\nname = \"{name}\"\nsaga = \"order\"\nid = \"{ORDER_ID}\"\nfrom = [\"{from}\"]\nto = \"{to}\"\n"
    )
}

/// An action `name` emitting an event of type `event_type` to `{out}`,
/// with `more` lines.
pub fn emit(name: &str, event_type: &str, more: &str) -> String {
    format!(
        "\n[[routes.actions]]\nkind = \"emit\"\nname = \"{name}\"\ntype = \"{event_type}\"\ntopic = \"{{out}}\"\n{more}"
    )
}

/// A versioned update of the order (`order.updated`, counted as
/// `updates`), which emits `order.changed` with `more` lines.
pub fn order_updated(more: &str) -> String {
    [
        route(None, "order.updated", "version_guard = true\ncounter = \"updates\"\n"),
        emit("changed", "order.changed", more),
    ]
    .concat()
}

/// A move `name` of the order's saga from `from` to `to` when the call ends
/// `on` (`on_success`, `on_dead`).
pub fn saga_on(on: &str, name: &str, from: &str, to: &str) -> String {
    format!(
        "\n[[routes.actions.{on}.saga]]\nname = \"{name}\"\nsaga = \"order\"\nid = \"{ORDER_ID}\"\nfrom = [\"{from}\"]\nto = \"{to}\"\n"
    )
}

/// The capture route most tests run: `order.placed` → a capture with the
/// order's amount, `payment.captured` on success and `payment.failed` when
/// it ends dead.
pub fn capture_route() -> String {
    [order_placed("counter = \"orders\"\n"), capture(&order_and_amount_body()), captured(), failed()].concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capture_route_is_the_toml_it_stands_for() {
        let toml = capture_route().replace("{topic}", "orders").replace("{out}", "payments");
        let value: toml::Value = toml::from_str(&toml).expect("valid TOML");
        let route = &value["routes"][0];
        assert_eq!(route["name"].as_str(), Some("order-placed"));
        assert_eq!(route["counter"].as_str(), Some("orders"));
        let call = &route["actions"][0];
        assert_eq!(call["idempotency_key"].as_str(), Some("capture:{{ data.order_id }}"));
        assert_eq!(call["path"].as_str(), Some("/captures/{{ data.order_id }}"));
        assert_eq!(call["body"]["amount"].as_str(), Some("{{ data.amount }}"));
        assert_eq!(call["on_success"]["emit"][0]["type"].as_str(), Some("payment.captured"));
        assert_eq!(call["on_dead"]["emit"][0]["topic"].as_str(), Some("payments"));
    }
}
