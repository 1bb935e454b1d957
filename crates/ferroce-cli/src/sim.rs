//! `ferroce sim`: the RC transport through a seeded, misbehaving, simulated network.
//!
//! Each scenario connects QP pairs between two simulated hosts, runs a random mix of every
//! operation through a network that drops, reorders, duplicates and corrupts packets, and checks
//! the transport's promises against a model (see `ferroce_proto::sim::scenario`). A fault rate
//! given on the command line is used as is; one left out is drawn per scenario from the seed, up
//! to the default maximum. Any violation prints its seed and the command that replays it.

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::Args;
use ferroce_proto::attr::PathMtu;
use ferroce_proto::sim::scenario::{self, ScenarioConfig};
use ferroce_proto::sim::{Fate, Sim, TraceEvent};
use ferroce_proto::Counters;

/// Arguments of `ferroce sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Seed of the first scenario; scenario i uses seed + i.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Number of scenarios.
    #[arg(long, default_value_t = 100)]
    scenarios: u64,
    /// Packet loss probability (default: drawn per scenario up to 0.2).
    #[arg(long, value_parser = probability)]
    loss: Option<f64>,
    /// Reordering probability (default: drawn up to 0.1).
    #[arg(long, value_parser = probability)]
    reorder: Option<f64>,
    /// Duplication probability (default: drawn up to 0.05).
    #[arg(long, value_parser = probability)]
    duplicate: Option<f64>,
    /// Corruption probability, caught by the ICRC (default: drawn up to 0.02).
    #[arg(long, value_parser = probability)]
    corrupt: Option<f64>,
    /// QP pairs per scenario (default: drawn, 1 to 3).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    qps: Option<u16>,
    /// Work requests per QP and direction (default: drawn, 4 to 27; 3 with --trace).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=10000))]
    ops: Option<u16>,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (default: drawn).
    #[arg(long, value_parser = mtu)]
    mtu: Option<PathMtu>,
    /// Draw the first scenario as a ladder diagram of every packet and completion.
    #[arg(long)]
    trace: bool,
}

fn probability(s: &str) -> Result<f64, String> {
    let p: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{p} is not a probability between 0 and 1"))
    }
}

fn mtu(s: &str) -> Result<PathMtu, String> {
    let n: u32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    PathMtu::from_bytes(n)
        .map_err(|_| format!("{n} is not an IBTA path MTU (256, 512, 1024, 2048, 4096)"))
}

impl SimArgs {
    fn config(&self, seed: u64) -> ScenarioConfig {
        let mut c = ScenarioConfig::random(seed, 0.2, 0.1, 0.05, 0.02);
        if let Some(p) = self.loss {
            c.net.loss = p;
        }
        if let Some(p) = self.reorder {
            c.net.reorder = p;
        }
        if let Some(p) = self.duplicate {
            c.net.duplicate = p;
        }
        if let Some(p) = self.corrupt {
            c.net.corrupt = p;
        }
        if let Some(n) = self.qps {
            c.qp_pairs = n.into();
        }
        if let Some(m) = self.mtu {
            c.mtu = m;
        }
        if self.trace && self.ops.is_none() {
            c.ops_per_qp = 3;
            c.max_size = c.max_size.min(3 * c.mtu.bytes() as usize);
        }
        if let Some(n) = self.ops {
            c.ops_per_qp = n.into();
        }
        c
    }

    /// The command line that replays one scenario.
    fn replay(&self, seed: u64) -> String {
        let mut s = format!("ferroce sim --seed {seed} --scenarios 1");
        let flags = [
            ("loss", self.loss),
            ("reorder", self.reorder),
            ("duplicate", self.duplicate),
            ("corrupt", self.corrupt),
        ];
        for (name, v) in flags {
            if let Some(v) = v {
                let _ = write!(s, " --{name} {v}");
            }
        }
        if let Some(n) = self.qps {
            let _ = write!(s, " --qps {n}");
        }
        if let Some(n) = self.ops {
            let _ = write!(s, " --ops {n}");
        }
        if let Some(m) = self.mtu {
            let _ = write!(s, " --mtu {}", m.bytes());
        }
        s + " --trace"
    }
}

/// Runs the scenarios; exit 1 if any promise was broken.
pub fn run(args: &SimArgs) -> Result<ExitCode, String> {
    if args.scenarios == 0 {
        return Err("--scenarios must be at least 1".into());
    }
    let mut totals = Counters::default();
    let (mut ops, mut completions, mut failed) = (0u64, 0u64, 0u64);
    let mut net = ferroce_proto::sim::NetStats::default();
    for i in 0..args.scenarios {
        let seed = args.seed.wrapping_add(i);
        let cfg = args.config(seed);
        let draw = args.trace && i == 0;
        let (report, sim) = scenario::run_with_trace(&cfg, draw);
        if draw {
            print!("{}", ladder(&sim, &cfg));
        }
        ops += report.ops;
        completions += report.completions;
        scenario::add_counters(&mut totals, &report.counters);
        add_net(&mut net, &report.net);
        if !report.violations.is_empty() {
            failed += 1;
            println!(
                "scenario seed {seed}: {} violation(s)",
                report.violations.len()
            );
            for v in report.violations.iter().take(5) {
                println!("  {v}");
            }
            println!("  replay: {}", args.replay(seed));
        }
    }
    println!(
        "{} scenarios, {} operations executed, {} completions; {} packets sent, {} dropped, {} duplicated, {} reordered, {} corrupted (all caught by the ICRC: {})",
        args.scenarios, ops, completions, net.sent, net.dropped, net.duplicated, net.reordered, net.corrupted, net.icrc_errors
    );
    println!(
        "{} retransmissions, {} timeouts, {} PSN-sequence NAKs, {} RNR NAKs, {} duplicate requests answered; {} invariant violations in {} scenarios",
        totals.retransmits, totals.completer_retry_err, totals.send_seq_nak, totals.send_rnr_err, totals.duplicate_request,
        failed, failed
    );
    Ok(if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn add_net(a: &mut ferroce_proto::sim::NetStats, b: &ferroce_proto::sim::NetStats) {
    a.sent += b.sent;
    a.dropped += b.dropped;
    a.blackholed += b.blackholed;
    a.duplicated += b.duplicated;
    a.corrupted += b.corrupted;
    a.reordered += b.reordered;
    a.delivered += b.delivered;
    a.icrc_errors += b.icrc_errors;
}

const WIDTH: usize = 66;

/// Draws a recorded scenario as a ladder diagram: host A's lifeline on the left, host B's on the
/// right, each packet an arrow labelled with its opcode and PSN, and what the network did to it.
fn ladder(sim: &Sim, cfg: &ScenarioConfig) -> String {
    let mut out = String::new();
    let (a, b) = (sim.nodes[0].ip, sim.nodes[1].ip);
    let _ = writeln!(
        out,
        "scenario seed {}: {} QP pair(s), {} ops each way, MTU {}, loss {:.3} reorder {:.3} duplicate {:.3} corrupt {:.3}",
        cfg.seed, cfg.qp_pairs, cfg.ops_per_qp, cfg.mtu.bytes(), cfg.net.loss, cfg.net.reorder, cfg.net.duplicate, cfg.net.corrupt
    );
    let a = a.to_string();
    let _ = writeln!(
        out,
        "{:>11}  host A {a:<w$}  host B {b}",
        "time (µs)",
        w = WIDTH - 7
    );
    let Some(trace) = sim.trace.as_ref() else {
        return out;
    };
    for e in trace {
        match e {
            TraceEvent::Packet {
                at,
                from,
                opcode,
                psn,
                detail,
                fate,
                ..
            } => {
                let label = if detail.is_empty() {
                    format!(" {opcode} psn={psn} ")
                } else {
                    format!(" {opcode} psn={psn} {detail} ")
                };
                let fate_note = match fate {
                    Fate::Sent => "",
                    Fate::Dropped => "dropped",
                    Fate::Blackholed => "blackholed",
                    Fate::Duplicated => "duplicated",
                    Fate::Corrupted => "corrupted",
                    Fate::Reordered => "delayed",
                };
                let lost = matches!(fate, Fate::Dropped | Fate::Blackholed);
                let arrow = arrow(*from == 0, &label, lost);
                let _ = writeln!(out, "{:>11}  |{arrow}|  {fate_note}", micros(at.as_nanos()));
            }
            TraceEvent::IcrcDrop { at, node } => {
                let side = if *node == 0 { "A" } else { "B" };
                let _ = writeln!(
                    out,
                    "{:>11}  {side} refuses a packet: ICRC mismatch (corrupted in flight)",
                    micros(at.as_nanos())
                );
            }
            TraceEvent::Completion { at, node, wc } => {
                let text = format!(
                    "completion {:?} wr 0x{:x} qp 0x{:x}: {}",
                    wc.opcode, wc.wr_id, wc.qp_num, wc.status
                );
                let line = if *node == 0 {
                    format!("* {text}")
                } else {
                    format!("{:>w$}", format!("{text} *"), w = WIDTH + 2)
                };
                let _ = writeln!(out, "{:>11}  {line}", micros(at.as_nanos()));
            }
        }
    }
    out
}

fn micros(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

/// An arrow of `WIDTH` characters carrying `label`, left to right or right to left; a lost
/// packet's arrow stops short with an ✗.
fn arrow(left_to_right: bool, label: &str, lost: bool) -> String {
    let label_len = label.chars().count();
    let room = WIDTH.saturating_sub(label_len + 3);
    let (lead, tail) = (2, room.saturating_sub(2));
    if left_to_right {
        if lost {
            let stub = tail / 2;
            format!(
                "{}{label}{}✗{}",
                "─".repeat(lead),
                "─".repeat(stub),
                " ".repeat(tail - stub + 1)
            )
        } else {
            format!("{}{label}{}▶", "─".repeat(lead), "─".repeat(tail + 1))
        }
    } else if lost {
        let stub = tail / 2;
        format!(
            "{}✗{}{label}{}",
            " ".repeat(tail - stub + 1),
            "─".repeat(stub),
            "─".repeat(lead)
        )
    } else {
        format!("◀{}{label}{}", "─".repeat(tail + 1), "─".repeat(lead))
    }
}
