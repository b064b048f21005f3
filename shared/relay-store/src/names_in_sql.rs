//! The SQL of this crate writes state and outcome names as literals (partial
//! indexes match only literal predicates, so they cannot be parameters): the
//! compiler cannot check them, so this test does. Every literal compared with
//! a column of stored names must be a name of that column's enum.

use relay_core::retry::{AttemptOutcome, ErrorClass};
use relay_core::{HistoryKind, InboxOutcome, IntentState, OutboxState, PauseKind, ReplayState, profile::Reconciled};

/// The names a column of that name may hold, whichever table it is on.
fn known(column: &str) -> Vec<&'static str> {
    let names = |all: &[&'static str]| all.to_vec();
    match column {
        "state" => {
            [names(&IntentState::ALL.map(IntentState::as_str)), names(&OutboxState::ALL.map(OutboxState::as_str))]
                .concat()
        }
        "outcome" => [
            names(&InboxOutcome::ALL.map(InboxOutcome::as_str)),
            names(&AttemptOutcome::ALL.map(AttemptOutcome::as_str)),
            vec!["running"],
        ]
        .concat(),
        "kind" => {
            [names(&PauseKind::ALL.map(PauseKind::as_str)), names(&HistoryKind::ALL.map(HistoryKind::as_str))].concat()
        }
        "verdict" => names(&Reconciled::ALL.map(Reconciled::as_str)),
        "replay_state" => names(&ReplayState::ALL.map(ReplayState::as_str)),
        _ => names(&ErrorClass::ALL.map(ErrorClass::as_str)),
    }
}

const COLUMNS: [&str; 7] = ["state", "outcome", "kind", "verdict", "replay_state", "error_class", "last_error_class"];

/// `(column, literal)` for every comparison `column = 'x'`, `column <> 'x'`,
/// `column IN ('x', …)` and every `THEN 'x'` / `ELSE 'x'` of a
/// `column = CASE … END`, in `sql`.
fn compared(sql: &'static str) -> Vec<(&'static str, String)> {
    let b = sql.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut found = Vec::new();
    for column in COLUMNS {
        let mut from = 0;
        while let Some(at) = sql[from..].find(column).map(|i| i + from) {
            from = at + column.len();
            if (at > 0 && word(b[at - 1])) || b.get(from).copied().is_some_and(word) {
                continue;
            }
            let rest = sql[from..].trim_start();
            // One quoted literal right after an operator, quotes kept.
            let literal = |r: &'static str| -> Option<&'static str> {
                let r = r.trim_start();
                r.strip_prefix('\'')?.find('\'').map(|end| &r[..end + 2])
            };
            let (list, case) = if let Some(r) = rest.strip_prefix("<>").or(rest.strip_prefix("!=")) {
                (literal(r), false)
            } else if let Some(r) = rest.strip_prefix('=') {
                let r = r.trim_start();
                if let Some(body) = r.strip_prefix("CASE") {
                    (body.split("END").next(), true)
                } else {
                    (literal(r), false)
                }
            } else if let Some(r) = rest.strip_prefix("IN").or(rest.strip_prefix("NOT IN")) {
                (r.trim_start().strip_prefix('(').and_then(|r| r.split(')').next()), false)
            } else {
                (None, false)
            };
            let Some(list) = list else { continue };
            let literals = list.split('\'').skip(1).step_by(2);
            if case {
                // Only the values a CASE gives, not the strings it compares or builds.
                let mut parts = list.split('\'');
                let mut before = parts.next().unwrap_or("");
                while let (Some(lit), Some(after)) = (parts.next(), parts.next()) {
                    let b = before.trim_end();
                    if b.ends_with("THEN") || b.ends_with("ELSE") {
                        found.push((column, lit.to_owned()));
                    }
                    before = after;
                }
            } else {
                // A `'{placeholder}'` is filled in by Rust from an enum.
                found.extend(literals.filter(|l| !l.starts_with('{')).map(|l| (column, l.to_owned())));
            }
        }
    }
    found
}

#[test]
fn every_name_the_sql_compares_a_stored_column_with_is_a_name_of_its_enum() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") || path.ends_with("names_in_sql.rs") {
            continue;
        }
        let text: &'static str = std::fs::read_to_string(&path).unwrap().leak();
        for (column, literal) in compared(text) {
            assert!(
                known(column).contains(&literal.as_str()),
                "{}: {column} compared with {literal:?}, which is no name of its enum",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 50, "the scan found only {checked} literals: has the SQL's spelling changed?");
}

#[test]
fn the_scan_finds_comparisons_lists_and_case_values() {
    let sql = "WHERE i.state = 'pending' AND o.state IN ('dead', 'skiped') AND relkind = 'r'
               SET state = CASE WHEN x = 'a' THEN 'uncertain' ELSE 'dead' END, outcome <> 'applied'";
    let found: Vec<String> = compared(sql).into_iter().map(|(c, l)| format!("{c}:{l}")).collect();
    assert_eq!(
        found,
        ["state:pending", "state:dead", "state:skiped", "state:uncertain", "state:dead", "outcome:applied"]
    );
}
