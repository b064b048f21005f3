//! Composing statements: one statement made of several, each with its own
//! `$n` parameters, renumbered to follow each other ([`shift_params`]).

use sqlx::Postgres;

/// A statement with its parameters bound so far.
pub(crate) type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// `sql` with every parameter `$n` renumbered `$n + by`, so that it can be
/// one part of a larger statement whose earlier parts take `$1`…`$by`. The
/// relay's statements hold no `$` but in parameters (no dollar quoting, no
/// `$` in literals).
pub(crate) fn shift_params(sql: &str, by: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut rest = sql;
    while let Some((before, n, after)) = next_param(rest) {
        out.push_str(before);
        out.push_str(&(n + by).to_string());
        rest = after;
    }
    out.push_str(rest);
    out
}

/// How many parameters `sql` takes: its highest `$n` (see [`shift_params`]).
pub(crate) fn param_count(sql: &str) -> usize {
    let (mut most, mut rest) = (0, sql);
    while let Some((_, n, after)) = next_param(rest) {
        most = most.max(n);
        rest = after;
    }
    most
}

/// The text up to and including the next `$`, the parameter's number, and
/// the text after it.
fn next_param(sql: &str) -> Option<(&str, usize, &str)> {
    let at = sql.find('$')?;
    let rest = &sql[at + 1..];
    let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    let n = rest[..digits].parse().expect("a `$` in a relay statement is a parameter");
    Some((&sql[..=at], n, &rest[digits..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_renumbered_and_nothing_else_changes() {
        assert_eq!(shift_params("SELECT $1, $2::int4[], $10)", 20), "SELECT $21, $22::int4[], $30)");
        assert_eq!(shift_params("SELECT 1", 5), "SELECT 1");
        assert_eq!(shift_params("$3", 0), "$3");
        assert_eq!(
            shift_params("SELECT '$1'", 2),
            "SELECT '$3'",
            "a $ in a literal is renumbered too: keep none in statements"
        );
    }

    #[test]
    fn parameters_are_counted_by_the_highest_number() {
        assert_eq!(param_count("SELECT $2, $1, $12"), 12);
        assert_eq!(param_count("SELECT 1"), 0);
    }
}
