//! Printing without panics.
//!
//! `println!` panics when stdout is a closed pipe (Rust ignores `SIGPIPE`), so every line goes
//! through [`stdout_line`] or [`error_line`], which report or swallow write errors instead.

use std::io::Write;

/// Prefix of every line this program writes to stderr.
const PREFIX: &str = "shm-baseline: ";

/// Writes `line` and a newline to stdout; returns whether that worked.
pub fn stdout_line(line: &str) -> bool {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}

/// Writes `shm-baseline: <msg>` as one line to stderr (newlines in `msg` become spaces).
pub fn error_line(msg: &str) {
    let one_line = msg.replace(['\n', '\r'], " ");
    // If stderr itself is gone there is nobody left to tell.
    let _ = writeln!(std::io::stderr().lock(), "{PREFIX}{one_line}");
}

/// `x` rounded to `decimals` digits after the point, so the JSON stays readable (`serde_json`
/// writes every digit of an `f64` otherwise).
pub fn round(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

/// Tests of the rounding helper.
#[cfg(test)]
mod tests {
    use super::*;

    /// Rounding keeps the asked-for digits and no more.
    #[test]
    fn rounding() {
        assert_eq!(round(31.2549, 1), 31.3);
        assert_eq!(round(45.123_456, 3), 45.123);
        assert_eq!(round(7.0, 0), 7.0);
    }
}
