//! Thousands of seeded random scenarios through a misbehaving network (loss up to 20%,
//! reordering, duplication, corruption), each checked against a model: every operation executes
//! exactly once, memory matches, completions arrive in order with the right statuses, and every
//! QP quiesces once the faults stop. A failure names its seed and the command that replays it.

use ferroce_proto::sim::scenario::{self, ScenarioConfig};
use ferroce_proto::Counters;

/// The fault maxima `ferroce sim` uses by default, so a seed replays there unchanged.
fn config(seed: u64) -> ScenarioConfig {
    ScenarioConfig::random(seed, 0.2, 0.1, 0.05, 0.02)
}

/// Runs every seed's scenario; returns the operations run and every QP's counters summed.
fn run_seeds(
    seeds: impl Iterator<Item = u64>,
    tweak: impl Fn(&mut ScenarioConfig),
) -> (u64, Counters) {
    let mut ops = 0;
    let mut total = Counters::default();
    let mut failures = Vec::new();
    for seed in seeds {
        let mut cfg = config(seed);
        tweak(&mut cfg);
        let r = scenario::run(&cfg);
        ops += r.ops;
        total.add(&r.counters);
        if !r.violations.is_empty() {
            failures.push(format!(
                "seed {seed}: {}\n  replay: cargo run -p ferroce-cli -- sim --seed {seed} --scenarios 1 --trace",
                r.violations.join("\n  ")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} scenario(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    (ops, total)
}

#[test]
fn lossless_scenarios_keep_every_promise() {
    let (ops, c) = run_seeds(0..500, |c| {
        c.net.loss = 0.0;
        c.net.reorder = 0.0;
        c.net.duplicate = 0.0;
        c.net.corrupt = 0.0;
    });
    assert!(ops > 10_000);
    assert_eq!(
        c.retransmits, 0,
        "a perfect network needs no retransmission"
    );
}

#[test]
fn lossless_scenarios_with_selective_repeat_neither_probe_nor_resend() {
    let (ops, c) = run_seeds(0..300, |c| {
        c.selective_repeat = true;
        c.net.loss = 0.0;
        c.net.reorder = 0.0;
        c.net.duplicate = 0.0;
        c.net.corrupt = 0.0;
    });
    assert!(ops > 5_000);
    assert_eq!(
        (c.retransmits, c.tail_loss_probes, c.sacks_sent),
        (0, 0, 0),
        "a perfect network needs no probe, SACK or retransmission"
    );
}

#[test]
fn five_thousand_lossy_scenarios_keep_every_promise() {
    let (ops, c) = run_seeds(1_000..6_000, |_| {});
    assert!(ops > 100_000, "{ops}");
    assert!(
        c.retransmits > 10_000,
        "the faults must actually bite: {}",
        c.retransmits
    );
}

#[test]
fn lossy_scenarios_with_selective_repeat_keep_every_promise() {
    let (ops, c) = run_seeds(1_000..3_500, |c| c.selective_repeat = true);
    assert!(ops > 50_000, "{ops}");
    assert!(
        c.retransmits > 5_000,
        "the faults must bite: {}",
        c.retransmits
    );
    // Recovery takes the selective paths: SACKs name holes, probes find tail losses.
    assert!(
        c.sacks_rcvd > 1_000 && c.sr_retransmits > 1_000 && c.tail_loss_probes > 100,
        "{c:?}"
    );
}

/// Responders that keep what follows a gap, toward go-back-N requesters (a ferroce responder
/// serving an IBTA peer): every promise holds, the requesters still go back (no SACK is ever
/// sent), and the kept packets are taken.
#[test]
fn lossy_scenarios_with_responders_keeping_out_of_order_requests() {
    let (ops, c) = run_seeds(1_000..3_000, |c| c.keep_out_of_order = true);
    assert!(ops > 40_000, "{ops}");
    assert!(
        c.retransmits > 5_000,
        "the faults must bite: {}",
        c.retransmits
    );
    assert_eq!((c.sacks_sent, c.sr_retransmits), (0, 0), "{c:?}");
    assert!(c.ooo_held > 1_000, "{c:?}");
}

#[test]
fn heavy_loss_with_selective_repeat() {
    run_seeds(50_000..50_200, |c| {
        c.selective_repeat = true;
        c.net.loss = 0.2;
        c.qp_pairs = 8;
        c.ops_per_qp = 12;
    });
}

#[test]
fn duplication_and_reordering_with_selective_repeat() {
    run_seeds(60_000..60_300, |c| {
        c.selective_repeat = true;
        c.net.loss = 0.01;
        c.net.duplicate = 0.3;
        c.net.reorder = 0.3;
    });
}

#[test]
fn heavy_loss_on_many_queue_pairs() {
    run_seeds(50_000..50_200, |c| {
        c.net.loss = 0.2;
        c.qp_pairs = 8;
        c.ops_per_qp = 12;
    });
}

#[test]
fn duplication_and_reordering_without_loss() {
    run_seeds(60_000..60_500, |c| {
        c.net.loss = 0.0;
        c.net.duplicate = 0.3;
        c.net.reorder = 0.3;
    });
}

#[test]
fn scenarios_across_the_psn_wrap() {
    run_seeds(70_000..70_500, |c| {
        c.start_psn = Some(0x00ff_ffff - (c.seed % 64) as u32)
    });
}

/// Seeds that once exposed bugs, kept as named regressions:
/// * 28 (then): an ACK from before a go-back-N rewind raised the acknowledged count above the
///   rewound send point; the next PSN fell behind the window and nothing armed the timer (stall).
/// * 1 (then): a READ's own next response was taken for an ACK beyond an unanswered READ.
#[test]
fn regression_seeds() {
    run_seeds([1, 28, 2239, 2910].into_iter(), |_| {});
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let a = scenario::run(&config(4242));
    let b = scenario::run(&config(4242));
    assert_eq!(a.net, b.net);
    assert_eq!(a.counters, b.counters);
    assert_eq!(a.elapsed, b.elapsed);
}
