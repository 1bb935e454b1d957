//! Flows through one shared bottleneck: `tbf rate 1gbit burst 32kb latency 1ms` into a
//! receiver, as on the test bed. Each run checks what the transport promises (every byte
//! written, every completion successful, in order, once, FETCH_ADD exactly once, the link's
//! invariants after every step) and prints what it achieved: goodput, fairness, queue delay,
//! drops and retransmissions. Nothing here asserts on performance yet: congestion control will
//! bring the assertions, and these runs are its "before".
//!
//! The table for 1, 4, 16 and 64 flows, sized by `BOTTLENECK_KIB` (KiB per flow, default 256):
//! `cargo test -p ferroce-proto --test bottleneck -- --ignored --nocapture table`

use core::time::Duration;

use ferroce_proto::sim::bottleneck::{self, BottleneckConfig, BottleneckReport, Senders};
use ferroce_proto::sim::pair::Pair;
use ferroce_proto::sim::{LinkAt, LinkConfig, TraceEvent};
use ferroce_proto::{Access, SendOp, SendWr, WcStatus};

fn config(seed: u64, flows: usize, kib: usize) -> BottleneckConfig {
    BottleneckConfig {
        bytes_per_flow: kib * 1024,
        ..BottleneckConfig::new(seed, flows)
    }
}

/// Runs `cfg`, prints its report, and fails with the report if a promise was broken.
fn run(cfg: &BottleneckConfig) -> BottleneckReport {
    let r = bottleneck::run(cfg);
    println!("seed {}: {r:#}", cfg.seed);
    assert!(r.passed(), "seed {}: {r}", cfg.seed);
    // What the report says must add up, whatever the transport does.
    assert_eq!(r.per_flow_goodput_bps.len(), cfg.flows);
    assert!(r.total_goodput_bps <= cfg.link.rate_bps);
    assert!(r.link_utilisation <= 1.0 + 1e-9, "{}", r.link_utilisation);
    assert!(r.jain_index > 0.0 && r.jain_index <= 1.0 + 1e-9);
    assert!(r.queue_delay.p50 <= r.queue_delay.p99 && r.queue_delay.p99 <= r.queue_delay.max);
    // Nothing waits longer than a full queue takes to drain.
    let drain = cfg.link.serialization_ns(cfg.link.queue_limit_bytes);
    assert!(r.queue_delay.max <= Duration::from_nanos(drain));
    assert_eq!(r.tail_drops, r.net.queue_drops);
    r
}

/// What congestion control must achieve through the shared queue: the link kept busy, flows
/// sharing it fairly, the queue held well below its limit (the delay-based window aims at
/// about 300 µs, more for small windows), and nothing or almost nothing resent.
fn assert_controlled(r: &BottleneckReport, goodput: f64, jain: f64, p99: Duration, retx: f64) {
    assert!(r.link_utilisation >= 0.95, "utilisation: {r}");
    assert!(r.goodput_fraction() >= goodput, "goodput: {r}");
    assert!(r.jain_index >= jain, "fairness: {r}");
    assert!(r.queue_delay.p99 <= p99, "queue delay: {r}");
    assert!(r.retransmit_ratio() <= retx, "retransmissions: {r}");
}

#[test]
fn one_flow_through_a_gigabit_tbf_keeps_every_promise() {
    let r = run(&config(1, 1, 1024));
    assert_eq!(r.jain_index, 1.0);
    assert_eq!(r.tail_drops, 0, "{r}");
    assert_controlled(&r, 0.9, 1.0, Duration::from_micros(800), 0.0);
}

#[test]
fn four_flows_through_a_gigabit_tbf_keep_every_promise() {
    let r = run(&config(4, 4, 1024));
    assert_eq!(r.tail_drops, 0, "{r}");
    assert_controlled(&r, 0.9, 0.9, Duration::from_micros(1_000), 0.0);
}

/// Sixteen flows: fair and busy; the queue rises towards its limit while they all start (16
/// initial windows are more than the queue) and a few packets are lost then.
#[test]
fn sixteen_flows_through_a_gigabit_tbf_keep_every_promise() {
    let r = run(&config(16, 16, 1024));
    assert_controlled(&r, 0.85, 0.95, Duration::from_micros(1_300), 0.08);
}

/// 32 KiB each: with more, flows that start into a queue the others already filled take the
/// queued delay for the path's own (the delay-based window has no other view of the base
/// RTT), the queue stays full, and some flows are locked out for eight ACK timeouts in a row
/// and end in "transport retry counter exceeded" (see
/// `sixty_four_flows_of_256_kib_each_all_finish`).
#[test]
fn sixty_four_flows_through_a_gigabit_tbf_keep_every_promise() {
    run(&config(64, 64, 32));
}

#[test]
fn sixteen_queue_pairs_of_one_sender_keep_every_promise() {
    run(&BottleneckConfig {
        senders: Senders::OneNode,
        ..config(116, 16, 128)
    });
}

#[test]
fn random_loss_and_ecn_marks_on_top_of_the_queue_keep_every_promise() {
    let r = run(&BottleneckConfig {
        random_loss: 0.01,
        ecn: true,
        link: LinkConfig::gigabit_tbf().with_ecn(30_000),
        ..config(5, 4, 256)
    });
    assert!(r.random_drops > 0, "the random loss must bite");
    assert!(
        r.ce_marks > 0,
        "a queue above 30 kB must mark ECT datagrams"
    );
    // Marked datagrams arrive marked (unless lost later at random: marking is after the fate).
    assert!(r.net.ce_delivered > 0 && r.net.ce_delivered <= r.ce_marks);
}

#[test]
fn the_same_config_gives_the_same_report() {
    let cfg = BottleneckConfig {
        random_loss: 0.005,
        ecn: true,
        link: LinkConfig::gigabit_tbf().with_ecn(50_000),
        ..config(99, 16, 64)
    };
    let a = bottleneck::run(&cfg);
    let b = bottleneck::run(&cfg);
    assert!(a.passed(), "{a}");
    assert_eq!(a, b);
    // And the seed matters: another one runs differently.
    let c = bottleneck::run(&BottleneckConfig { seed: 100, ..cfg });
    assert_ne!(a.per_flow_completion, c.per_flow_completion);
}

/// A directed link takes the datagrams of its pair of nodes even where a link into the
/// receiver exists; a tiny queue drops (the trace says so), go-back-N recovers, and a QP made
/// ECN-capable on its own gets its datagrams marked.
#[test]
fn a_directed_link_takes_its_pair_s_datagrams_before_the_link_into_the_node() {
    let mut p = Pair::lossless();
    p.sim.trace = Some(Vec::new());
    let tiny = LinkConfig {
        queue_limit_bytes: 4 * 1100,
        ..LinkConfig::gigabit_tbf().with_ecn(1_000)
    };
    p.sim.add_link(LinkAt::Between { from: 0, to: 1 }, tiny);
    p.sim.add_link(LinkAt::Into(1), LinkConfig::gigabit_tbf());
    let qpn = p.qpn[0];
    p.sim.set_ect(0, Some(qpn), true);
    let src = p.register(0, 64 * 1024, Access::LOCAL_WRITE);
    let dst = p.register(1, 64 * 1024, Access::ALL);
    p.bytes_mut(src).fill(0x5a);
    let wr =
        SendWr::new(7, SendOp::Write, vec![src.sge(0, 64 * 1024)]).remote(dst.addr(0), dst.rkey);
    p.post_send(0, wr).unwrap();
    let wcs = p.wait_completions(0, 1, Duration::from_secs(1));
    assert_eq!(wcs.len(), 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert!(p.bytes(dst).iter().all(|&b| b == 0x5a));
    let between = *p
        .sim
        .link(LinkAt::Between { from: 0, to: 1 })
        .unwrap()
        .stats();
    let into = *p.sim.link(LinkAt::Into(1)).unwrap().stats();
    assert!(
        between.offered >= 64 && between.tail_drops > 0,
        "{between:?}"
    );
    assert_eq!(into.offered, 0);
    assert!(between.ce_marked > 0 && between.ect_enqueued == between.enqueued);
    assert_eq!(p.sim.stats.queue_drops, between.tail_drops);
    p.sim.check_links().unwrap();
    let trace = p.sim.trace.as_ref().unwrap();
    let noted = |what: &str| {
        trace
            .iter()
            .filter(|e| matches!(e, TraceEvent::Packet { detail, .. } if detail.contains(what)))
            .count() as u64
    };
    assert_eq!(noted("link:queue-drop"), between.tail_drops);
    assert_eq!(noted("link:CE"), between.ce_marked);
}

/// 64 flows of 256 KiB each with delay alone: flows that start into a full queue take it for
/// the base delay, and some are locked out until their retries run out (see above).
#[test]
#[ignore = "64 late-starting flows defeat a delay-based window without ECN (the base RTT they measure already holds a full queue)"]
fn sixty_four_flows_of_256_kib_each_all_finish() {
    run(&config(64, 64, 256));
}

/// With the bottleneck marking ECN above 30 kB (as RoCE deployments configure their
/// switches), DCQCN's CNPs cut the late starters' rates too: 64 flows of 256 KiB each all
/// finish, and the queue stays well below its limit most of the time.
#[test]
fn sixty_four_flows_with_ecn_marking_all_finish() {
    let r = run(&BottleneckConfig {
        ecn: true,
        link: LinkConfig::gigabit_tbf().with_ecn(30_000),
        ..config(64, 64, 256)
    });
    assert!(r.ce_marks > 0, "{r}");
    assert!(r.receiver_counters.np_cnp_sent > 0, "{r}");
    assert!(r.sender_counters.rp_cnp_handled > 0, "{r}");
    assert!(r.jain_index >= 0.9, "{r}");
    assert!(r.link_utilisation >= 0.9, "{r}");
}

/// Prints the before/after table for 1, 4, 16 and 64 flows (`BOTTLENECK_KIB` per flow, 256 by
/// default; `BOTTLENECK_SEED`, 1 by default). Checks nothing beyond printing: a flow may fail.
#[test]
#[ignore = "a table to read, not a check: run with --ignored --nocapture"]
fn table() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let kib = env("BOTTLENECK_KIB", 256) as usize;
    let seed = env("BOTTLENECK_SEED", 1);
    let reports: Vec<_> = [1, 4, 16, 64]
        .into_iter()
        .map(|flows| {
            let r = bottleneck::run(&config(seed, flows, kib));
            println!("{r}");
            r
        })
        .collect();
    println!("{}", BottleneckReport::table(&reports));
}
