//! Runs the built `shm-baseline` binary with small parameters and checks what it prints: one
//! well-formed JSON object per result with consistent figures, one stderr line plus exit code 2
//! for bad arguments, and a responder that refuses anything but the page `pingpong` makes. No
//! figure is held to a time limit: the machine may be busy.

use std::fs::File;
use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// Runs the binary with `args` and returns its output.
fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shm-baseline"))
        .args(args)
        .output()
        .expect("the shm-baseline binary runs")
}

/// The JSON objects a successful run of `args` printed, one per line.
fn run_json(args: &[&str]) -> Vec<Value> {
    let out = run(args);
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    assert!(
        out.status.success(),
        "{args:?} failed ({:?}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.ends_with('\n'), "{args:?}: {stdout:?}");
    stdout
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"));
            assert!(v.is_object(), "{l}");
            v
        })
        .collect()
}

/// The value of `key` as a positive, finite number.
fn positive(v: &Value, key: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"));
    assert!(x.is_finite() && x > 0.0, "{key} = {x} in {v}");
    x
}

/// The value of `key` as a whole number.
fn whole(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not a whole number in {v}"))
}

/// A short two-process ping-pong prints one JSON object: every ping was echoed by the responder
/// process, and the one-way latencies are ordered and positive.
#[test]
fn pingpong_json() {
    let r = run_json(&["pingpong", "--iters", "20000", "--warmup", "500", "--json"]);
    assert_eq!(r.len(), 1, "{r:?}");
    let r = &r[0];
    assert_eq!(r["test"], "pingpong");
    assert_eq!(whole(r, "iterations"), 20_000);
    assert_eq!(whole(r, "warmup"), 500);
    assert_eq!(whole(r, "responder_echoes"), 20_500);
    positive(r, "ns_per_tick");
    positive(r, "clock_resolution_ns");
    let min = positive(r, "t_min_ns");
    let typical = positive(r, "t_typical_ns");
    let avg = positive(r, "t_avg_ns");
    let p99 = positive(r, "p99_ns");
    let max = positive(r, "t_max_ns");
    assert!(min <= typical && typical <= p99 && p99 <= max, "{r}");
    assert!(min <= avg && avg <= max, "{r}");
}

/// Without `--json` the ping-pong prints one line of text that says the figure is one-way.
#[test]
fn pingpong_human_is_one_line() {
    let out = run(&["pingpong", "--iters", "1000", "--warmup", "0"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout:?}");
    assert!(
        stdout.starts_with("pingpong one-way (half round trip), 1000 round trips"),
        "{stdout:?}"
    );
}

/// One memcpy size prints one object whose two bandwidth units agree (GB = 10^9 B,
/// MB = 2^20 B) and whose best round is at least the average.
#[test]
fn memcpy_one_size_json() {
    let r = run_json(&["memcpy", "--size", "65536", "--iters", "200", "--json"]);
    assert_eq!(r.len(), 1, "{r:?}");
    let r = &r[0];
    assert_eq!(r["test"], "memcpy");
    assert_eq!(whole(r, "size"), 65536);
    assert_eq!(whole(r, "iterations"), 200);
    assert_eq!(whole(r, "rounds"), 10);
    let seconds = positive(r, "seconds");
    let gb_s = positive(r, "gb_s");
    let mb_s = positive(r, "mb_s");
    assert!((mb_s * 1_048_576.0 / 1e9 / gb_s - 1.0).abs() < 0.01, "{r}");
    // Bytes over seconds, from the printed (rounded) figures.
    let from_time = 65536.0 * 200.0 / seconds / 1e9;
    assert!((from_time / gb_s - 1.0).abs() < 0.05, "{r}");
    assert!(positive(r, "best_gb_s") >= gb_s * 0.999, "{r}");
    assert!(positive(r, "best_mb_s") >= mb_s * 0.999, "{r}");
}

/// `--all` prints eleven objects, 4 KiB to 4 MiB in doubling steps, each with the iterations
/// asked for.
#[test]
fn memcpy_all_sizes() {
    let r = run_json(&["memcpy", "--all", "--iters", "4", "--json"]);
    let sizes: Vec<u64> = r.iter().map(|v| whole(v, "size")).collect();
    let expected: Vec<u64> = (12..=22).map(|k| 1u64 << k).collect();
    assert_eq!(sizes, expected);
    for v in &r {
        assert_eq!(whole(v, "iterations"), 4, "{v}");
        positive(v, "gb_s");
    }
}

/// Bad arguments: exit code 2, nothing on stdout, exactly one `shm-baseline: ` line on stderr.
#[test]
fn bad_arguments_exit_2_with_one_line() {
    for args in [
        &[][..],
        &["bogus"][..],
        &["pingpong", "--iters", "0"][..],
        &["pingpong", "--iters", "abc"][..],
        &["pingpong", "--iters", "-5"][..],
        &["pingpong", "--iters", "99999999999999999999999"][..],
        &["pingpong", "--warmup"][..],
        &["pingpong", "--size", "8"][..],
        &["pingpong", "--json=yes"][..],
        &["memcpy"][..],
        &["memcpy", "--size", "0"][..],
        &["memcpy", "--size", "2000000000"][..],
        &["memcpy", "--size", "4096", "--all"][..],
        &["memcpy", "--all", "--iters", "0"][..],
        &["memcpy", "--size", "4k"][..],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr:?}");
        assert!(stderr.starts_with("shm-baseline: "), "{args:?}: {stderr:?}");
        assert!(stderr.ends_with(" (try --help)\n"), "{args:?}: {stderr:?}");
    }
}

/// The hidden responder, run by hand, refuses an ordinary file as its page and leaves it as it
/// was; with no usable stdin it fails the same way. One line, exit code 1, no panic.
#[test]
fn responder_refuses_anything_but_its_page() {
    let path = std::env::temp_dir().join(format!("shm-baseline-cli-{}", std::process::id()));
    let original = [0x5au8; 4096];
    File::create(&path).unwrap().write_all(&original).unwrap();
    let stdins = [
        Stdio::from(File::options().read(true).write(true).open(&path).unwrap()),
        Stdio::null(),
    ];
    for stdin in stdins {
        let out = Command::new(env!("CARGO_BIN_EXE_shm-baseline"))
            .arg("pingpong-responder")
            .stdin(stdin)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
        assert!(stderr.contains("not a page made by"), "{stderr:?}");
    }
    let after = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(after, original);
}

/// `--help` prints the usage on stdout and succeeds; the responder stays hidden.
#[test]
fn help_succeeds() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Usage:") && text.contains("pingpong") && text.contains("memcpy"));
    assert!(!text.contains("pingpong-responder"), "{text}");
}
