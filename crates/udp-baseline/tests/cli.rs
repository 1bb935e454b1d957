//! Runs the built `udp-baseline` binary with small parameters and checks what it prints: one
//! well-formed JSON object per run with sane figures, and one stderr line plus exit code 2 for
//! bad arguments. No figure is held to a time limit: the machine may be busy.

use std::process::{Command, Output};

/// Runs the binary with `args` and returns its output.
fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_udp-baseline"))
        .args(args)
        .output()
        .expect("the udp-baseline binary runs")
}

/// A value in a flat JSON object, kept as its source text (strings without their quotes).
#[derive(Debug, Clone, PartialEq)]
enum Value {
    /// A string (no escape sequences expected in this program's keys and values).
    Str(String),
    /// A number, `true`, `false` or `null`, as written.
    Bare(String),
}

/// Parses a flat JSON object — `{"key":value,...}` with string, number, boolean or null values
/// and no whitespace, exactly the shape the program prints — into its key/value pairs.
fn parse_flat_object(text: &str) -> Vec<(String, Value)> {
    let inner = text
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .unwrap_or_else(|| panic!("not a JSON object: {text}"));
    let mut pairs = Vec::new();
    let mut rest = inner;
    while !rest.is_empty() {
        let after_quote = rest
            .strip_prefix('"')
            .unwrap_or_else(|| panic!("key expected at {rest:?} in {text}"));
        let (key, after_key) = after_quote
            .split_once("\":")
            .unwrap_or_else(|| panic!("unterminated key at {rest:?} in {text}"));
        assert!(!key.contains('"'), "odd key {key:?} in {text}");
        let (value, after_value) = if let Some(s) = after_key.strip_prefix('"') {
            let end = s
                .find('"')
                .unwrap_or_else(|| panic!("unterminated string in {text}"));
            assert!(!s[..end].contains('\\'), "escape in {text}");
            (Value::Str(s[..end].to_string()), &s[end + 1..])
        } else {
            let end = after_key.find(',').unwrap_or(after_key.len());
            let bare = &after_key[..end];
            let ok = matches!(bare, "true" | "false" | "null") || bare.parse::<f64>().is_ok();
            assert!(ok, "bad value {bare:?} for {key} in {text}");
            (Value::Bare(bare.to_string()), &after_key[end..])
        };
        assert!(
            pairs.iter().all(|(k, _)| k != key),
            "duplicate key {key} in {text}"
        );
        pairs.push((key.to_string(), value));
        rest = match after_value.strip_prefix(',') {
            Some(r) => {
                assert!(!r.is_empty(), "trailing comma in {text}");
                r
            }
            None => {
                assert!(after_value.is_empty(), "junk {after_value:?} in {text}");
                after_value
            }
        };
    }
    pairs
}

/// The JSON object printed by a successful run of `args`, as key/value pairs.
fn run_json(args: &[&str]) -> Vec<(String, Value)> {
    let out = run(args);
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{args:?} failed ({:?}): {stderr}",
        out.status
    );
    let line = stdout
        .strip_suffix('\n')
        .unwrap_or_else(|| panic!("{args:?}: output does not end in a newline: {stdout:?}"));
    assert!(
        !line.contains('\n'),
        "{args:?}: more than one line: {stdout:?}"
    );
    parse_flat_object(line)
}

/// The value of `key`, which must be present.
fn get<'a>(pairs: &'a [(String, Value)], key: &str) -> &'a Value {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no key {key} in {pairs:?}"))
}

/// The value of `key` as a string.
fn string(pairs: &[(String, Value)], key: &str) -> String {
    match get(pairs, key) {
        Value::Str(s) => s.clone(),
        v => panic!("{key} is not a string: {v:?}"),
    }
}

/// The value of `key` as a number.
fn number(pairs: &[(String, Value)], key: &str) -> f64 {
    match get(pairs, key) {
        Value::Bare(b) => b
            .parse()
            .unwrap_or_else(|_| panic!("{key} is not a number: {b}")),
        v => panic!("{key} is not a number: {v:?}"),
    }
}

/// The value of `key` as a whole number.
fn whole(pairs: &[(String, Value)], key: &str) -> u64 {
    match get(pairs, key) {
        Value::Bare(b) => b
            .parse()
            .unwrap_or_else(|_| panic!("{key} is not a whole number: {b}")),
        v => panic!("{key} is not a number: {v:?}"),
    }
}

/// The value of `key` as a positive, finite number.
fn positive(pairs: &[(String, Value)], key: &str) -> f64 {
    let x = number(pairs, key);
    assert!(x.is_finite() && x > 0.0, "{key} = {x} in {pairs:?}");
    x
}

/// A small ping-pong prints one JSON object with ordered, positive latencies.
#[test]
fn pingpong_json() {
    let r = run_json(&["pingpong", "--size", "8", "--iters", "2000", "--json"]);
    assert_eq!(string(&r, "test"), "pingpong");
    assert_eq!(whole(&r, "size"), 8);
    assert_eq!(whole(&r, "iterations"), 2000);
    let min = positive(&r, "t_min_us");
    let typical = positive(&r, "t_typical_us");
    let avg = positive(&r, "t_avg_us");
    let p99 = positive(&r, "p99_us");
    assert!(min <= typical && typical <= p99, "{r:?}");
    assert!(min <= avg, "{r:?}");
}

/// A 16 MiB stream in each mode prints one JSON object with consistent counts and a positive bandwidth.
#[test]
fn stream_json_every_mode() {
    const BYTES: u64 = 16_777_216;
    for mode in ["send", "sendmmsg", "gso"] {
        let r = run_json(&[
            "stream", "--size", "4096", "--bytes", "16777216", "--mode", mode, "--json",
        ]);
        assert_eq!(string(&r, "test"), "stream");
        assert_eq!(string(&r, "requested_mode"), mode);
        let used = string(&r, "mode");
        // GSO may be missing from the kernel; then the program says so and measures sendmmsg.
        match get(&r, "fallback") {
            Value::Bare(null) if null == "null" => assert_eq!(used, mode),
            Value::Str(_) => assert_eq!((mode, used.as_str()), ("gso", "sendmmsg")),
            v => panic!("fallback: {v:?}"),
        }
        assert_eq!(whole(&r, "size"), 4096);
        assert_eq!(whole(&r, "bytes_sent"), BYTES, "{mode}");
        let sent = whole(&r, "datagrams_sent");
        assert_eq!(sent, BYTES / 4096, "{mode}");
        let received = whole(&r, "bytes_received");
        assert!(received > 0 && received <= BYTES, "{mode}: {r:?}");
        let lost = whole(&r, "datagrams_lost");
        assert_eq!(
            whole(&r, "datagrams_received") + lost,
            sent,
            "{mode}: {r:?}"
        );
        let mb_s = positive(&r, "mb_s");
        let gb_s = positive(&r, "gb_s");
        assert!((mb_s / 1000.0 - gb_s).abs() <= 0.001, "{mode}: {r:?}");
        positive(&r, "seconds");
    }
}

/// Without `--json` the result is one line of text.
#[test]
fn human_output_is_one_line() {
    let out = run(&["stream", "--bytes", "4194304"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout:?}");
    assert!(
        stdout.starts_with("stream sendmmsg 4096 B: receiver "),
        "{stdout:?}"
    );
}

/// Bad arguments: exit code 2, nothing on stdout, exactly one `udp-baseline: ` line on stderr.
#[test]
fn bad_arguments_exit_2_with_one_line() {
    for args in [
        &[][..],
        &["bogus"][..],
        &["pingpong", "--size", "abc"][..],
        &["pingpong", "--size", "0"][..],
        &["pingpong", "--iters"][..],
        &["pingpong", "--bytes", "5"][..],
        &["stream", "--mode", "carrier-pigeon"][..],
        &["stream", "--size", "70000"][..],
        &["stream", "--json=yes"][..],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr:?}");
        assert!(stderr.starts_with("udp-baseline: "), "{args:?}: {stderr:?}");
        assert!(stderr.ends_with('\n'), "{args:?}: {stderr:?}");
    }
}

/// `--help` prints the usage on stdout and succeeds.
#[test]
fn help_succeeds() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8(out.stdout).unwrap().contains("usage:"));
}
