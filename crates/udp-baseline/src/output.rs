//! Printing without panics, and the little JSON this program writes by hand.
//!
//! `println!` panics when stdout is a closed pipe (Rust ignores `SIGPIPE`), so every line goes
//! through [`stdout_line`] or [`error_line`], which report or swallow write errors instead.

use std::io::Write;

/// Prefix of every line this program writes to stderr.
const PREFIX: &str = "udp-baseline: ";

/// Writes `line` and a newline to stdout; returns whether that worked.
pub fn stdout_line(line: &str) -> bool {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}

/// Writes `udp-baseline: <msg>` as one line to stderr (newlines in `msg` become spaces).
pub fn error_line(msg: &str) {
    let one_line = msg.replace(['\n', '\r'], " ");
    // If stderr itself is gone there is nobody left to tell.
    let _ = writeln!(std::io::stderr().lock(), "{PREFIX}{one_line}");
}

/// `s` as a JSON string literal, quotes included.
pub fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `x` with `decimals` digits after the point, as a JSON number (`null` if not finite, which
/// JSON cannot express; the measurements refuse to produce such figures in the first place).
pub fn json_num(x: f64, decimals: usize) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}")
    } else {
        "null".to_string()
    }
}

/// Tests of the JSON helpers.
#[cfg(test)]
mod tests {
    use super::*;

    /// Quotes, backslashes and control characters are escaped.
    #[test]
    fn strings_are_escaped() {
        assert_eq!(json_str("plain"), "\"plain\"");
        assert_eq!(json_str("a\"b\\c\nd\u{1}"), "\"a\\\"b\\\\c\\nd\\u0001\"");
    }

    /// Finite numbers keep their decimals; others become `null`.
    #[test]
    fn numbers() {
        assert_eq!(json_num(2.5, 3), "2.500");
        assert_eq!(json_num(f64::NAN, 3), "null");
        assert_eq!(json_num(f64::INFINITY, 1), "null");
    }
}
