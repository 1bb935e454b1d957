//! `ferroce sim` as a user runs it.

use std::process::{Command, Output};

fn ferroce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferroce"))
        .args(args)
        .output()
        .expect("run ferroce")
}

#[test]
fn lossy_scenarios_pass_and_report_what_happened() {
    let out = ferroce(&[
        "sim",
        "--seed",
        "5",
        "--scenarios",
        "40",
        "--loss",
        "0.1",
        "--qps",
        "2",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("40 scenarios"), "{text}");
    assert!(text.contains("0 invariant violations"), "{text}");
    let retransmissions: u64 = text
        .lines()
        .find_map(|l| {
            l.split(" retransmissions")
                .next()
                .and_then(|n| n.trim().parse().ok())
        })
        .expect("a retransmission count");
    assert!(
        retransmissions > 0,
        "10% loss must cause retransmissions: {text}"
    );
}

#[test]
fn trace_draws_a_ladder_with_losses_and_completions() {
    let out = ferroce(&[
        "sim",
        "--seed",
        "7",
        "--scenarios",
        "1",
        "--trace",
        "--loss",
        "0.2",
        "--qps",
        "1",
        "--mtu",
        "1024",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("host A 10.0.0.1") && text.contains("host B 10.0.0.2"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.contains("▶|") && l.contains("psn=")),
        "left-to-right arrows: {text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("|◀") && l.contains("RC_ACKNOWLEDGE")),
        "ACK arrows: {text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains('✗') && l.ends_with("dropped")),
        "a drop is drawn: {text}"
    );
    assert!(
        text.contains("completion") && text.contains(": success"),
        "{text}"
    );
}

#[test]
fn same_seed_same_output() {
    let a = ferroce(&["sim", "--seed", "77", "--scenarios", "3", "--loss", "0.05"]);
    let b = ferroce(&["sim", "--seed", "77", "--scenarios", "3", "--loss", "0.05"]);
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn bad_arguments_are_one_line_and_exit_two() {
    for args in [
        &["sim", "--loss", "2"][..],
        &["sim", "--mtu", "1000"],
        &["sim", "--scenarios", "0"],
        &["sim", "--qps", "0"],
        &["sim", "--bogus"],
    ] {
        let out = ferroce(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("ferroce: "), "{err}");
    }
}
