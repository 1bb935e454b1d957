//! Many flows through one bottleneck: the simulator's test bed for congestion control.
//!
//! `flows` RC queue pairs, each from a sender of its own (or all from one sending node), write
//! `bytes_per_flow` into a receiver through one shared [`Link`] into the receiver, the incast
//! shape of a collective's all-to-one step or of `tbf` on the test bed's receiving veth. Each
//! flow posts all its WRITEs at once when it starts (the starts are a few tens of µs apart),
//! with a few FETCH_ADDs on a counter every flow shares spread among them. The
//! acknowledgements come back on a path with latency only.
//!
//! The run checks what the transport promises whatever the network does:
//! * every byte of every flow's destination equals what the flow sent;
//! * every work request completes once, successfully, in posting order;
//! * FETCH_ADD is exactly-once: the shared counter ends at the number of adds, and the
//!   originals the adds returned are 0..N, each once;
//! * every QP ends in RTS and the network goes quiet;
//! * the link kept its invariants ([`Link::check`], after every step when asked), and no flow
//!   was faster than the link.
//!
//! and reports how well the link was used: goodput per flow and in total, utilisation, Jain's
//! fairness index, queue delay, drops, marks and retransmissions ([`BottleneckReport`], whose
//! `Display` is a readable summary and [`BottleneckReport::table`] a row per run). Everything
//! follows from the seed, so a regression is a seed.
//!
//! The report makes no judgement on performance: that is for tests that know what the transport
//! should achieve.

use core::fmt;
use core::time::Duration;

use ferroce_wire::Psn;

use super::link::{LinkConfig, LinkStats, QueueDelay};
use super::scenario::connect_pair;
use super::{Link, LinkAt, NetConfig, NetStats, Rng, Sim};
use crate::attr::{PathMtu, RtsAttr};
use crate::completion::{WcOpcode, WcStatus};
use crate::counters::Counters;
use crate::memory::{Access, Sge};
use crate::qp::QpState;
use crate::time::Instant;
use crate::wr::{SendOp, SendWr};

/// Where the flows start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Senders {
    /// Each flow from a node of its own: an incast of `flows` hosts.
    Nodes,
    /// Every flow a QP of one sending node.
    OneNode,
}

/// Parameters of one bottleneck run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BottleneckConfig {
    /// The seed: data, first PSNs and random loss follow from it.
    pub seed: u64,
    /// Flows (QP pairs), 1 to [`MAX_FLOWS`].
    pub flows: usize,
    /// Where they start.
    pub senders: Senders,
    /// The bottleneck, into the receiver.
    pub link: LinkConfig,
    /// Bytes each flow writes.
    pub bytes_per_flow: usize,
    /// Bytes per WRITE (the last may be shorter).
    pub msg_size: usize,
    /// FETCH_ADDs each flow posts, spread evenly among its WRITEs.
    pub fetch_adds_per_flow: usize,
    /// Each flow posts its work at a time drawn from `0..start_spread` (0: all at once). Flows
    /// never start in the same nanosecond on real hosts, and without loss the draw is what
    /// makes one seed's run differ from another's.
    pub start_spread: Duration,
    /// Path MTU.
    pub mtu: PathMtu,
    /// Probability that any datagram, either way, is lost at random (before the link).
    pub random_loss: f64,
    /// One-way latency of the paths no link is on (the acknowledgements back).
    pub latency: Duration,
    /// Whether the senders' datagrams are ECN-capable, so the link may mark them.
    pub ecn: bool,
    /// Local ACK timeout code.
    pub timeout: u8,
    /// Transport retry count.
    pub retry_cnt: u8,
    /// Virtual time by which every flow must have completed.
    pub deadline: Duration,
    /// Check the link's invariants after every step (else at the end only).
    pub check_every_step: bool,
}

/// Most flows: each sender node needs an address in 10.0.0.0/24.
pub const MAX_FLOWS: usize = 250;

/// Most work requests one flow may post (the send queue depth [`connect_pair`] gives).
pub const MAX_WRS_PER_FLOW: usize = 4096;

impl BottleneckConfig {
    /// `flows` flows from nodes of their own through `tbf rate 1gbit burst 32kb latency 1ms`
    /// ([`LinkConfig::gigabit_tbf`]), each writing 256 KiB in 16 KiB WRITEs with 4 FETCH_ADDs,
    /// starting within 100 µs of each other, MTU 1024, no random loss, no ECN, 5 µs back, the
    /// default ACK timeout (4.2 ms) and 7 retries, 10 s of virtual time to finish, invariants
    /// checked every step.
    pub fn new(seed: u64, flows: usize) -> BottleneckConfig {
        BottleneckConfig {
            seed,
            flows,
            senders: Senders::Nodes,
            link: LinkConfig::gigabit_tbf(),
            bytes_per_flow: 256 * 1024,
            msg_size: 16 * 1024,
            fetch_adds_per_flow: 4,
            start_spread: Duration::from_micros(100),
            mtu: PathMtu::Mtu1024,
            random_loss: 0.0,
            latency: Duration::from_micros(5),
            ecn: false,
            timeout: 10,
            retry_cnt: 7,
            deadline: Duration::from_secs(10),
            check_every_step: true,
        }
    }

    /// WRITEs each flow posts.
    pub fn writes_per_flow(&self) -> usize {
        self.bytes_per_flow.div_ceil(self.msg_size.max(1))
    }

    /// Why the configuration cannot run, if it cannot.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_FLOWS).contains(&self.flows) {
            return Err(format!("flows must be 1..={MAX_FLOWS}, not {}", self.flows));
        }
        if self.msg_size == 0 || self.msg_size > 1 << 31 {
            return Err(format!("msg_size {} is not a message size", self.msg_size));
        }
        let wrs = self.writes_per_flow() + self.fetch_adds_per_flow;
        if wrs > MAX_WRS_PER_FLOW {
            return Err(format!(
                "{wrs} work requests per flow: more than the send queue's {MAX_WRS_PER_FLOW}"
            ));
        }
        if self.link.rate_bps == 0 {
            return Err("the link needs a rate".into());
        }
        if !(0.0..1.0).contains(&self.random_loss) {
            return Err(format!("random_loss {} is not below 1", self.random_loss));
        }
        Ok(())
    }
}

/// What a bottleneck run did: correctness in `violations`, the rest for reading and asserting.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BottleneckReport {
    /// The configuration run.
    pub flows: usize,
    /// Application bytes each flow wrote.
    pub bytes_per_flow: u64,
    /// The link's rate.
    pub rate_bps: u64,
    /// The link's queue limit, wire bytes.
    pub queue_limit_bytes: u64,
    /// Each flow's goodput (bytes written × 8 / its completion time), bits per second.
    pub per_flow_goodput_bps: Vec<u64>,
    /// When each flow posted its work, from the start of the run.
    pub per_flow_start: Vec<Duration>,
    /// How long each flow took, from its start to its last completion.
    pub per_flow_completion: Vec<Duration>,
    /// Request packets each flow sent again.
    pub per_flow_retransmits: Vec<u64>,
    /// Local ACK timeouts each flow took.
    pub per_flow_timeouts: Vec<u64>,
    /// All bytes written × 8 / the completion time, bits per second.
    pub total_goodput_bps: u64,
    /// The fraction of the completion time the link spent sending (wire bits / rate / time,
    /// counting every datagram that left by the last completion).
    pub link_utilisation: f64,
    /// Jain's fairness index of the per-flow goodputs: 1 when equal, 1/flows when one flow
    /// had it all.
    pub jain_index: f64,
    /// Queue delay at the link, over every datagram it queued.
    pub queue_delay: QueueDelay,
    /// Datagrams the link refused for a full queue.
    pub tail_drops: u64,
    /// Datagrams the link marked Congestion Experienced.
    pub ce_marks: u64,
    /// Datagrams lost at random (either way).
    pub random_drops: u64,
    /// Request packets the senders sent again (go-back-N resends included).
    pub retransmitted_packets: u64,
    /// Request packets the senders sent, first times and again.
    pub sent_packets: u64,
    /// Datagrams the link delivered by the completion time.
    pub delivered_packets: u64,
    /// Local ACK timeouts the senders took.
    pub timeouts: u64,
    /// PSN-sequence-error NAKs the receiver sent.
    pub seq_naks: u64,
    /// From the first flow's start to the last work request's completion.
    pub completion_time: Duration,
    /// The link's counters at the completion time.
    pub link: LinkStats,
    /// The network's counters at the end (after it went quiet).
    pub net: NetStats,
    /// The senders' QP counters, summed.
    pub sender_counters: Counters,
    /// The receiver's QP counters, summed.
    pub receiver_counters: Counters,
    /// Broken promises; empty when the run kept them all.
    pub violations: Vec<String>,
}

impl BottleneckReport {
    /// Whether every promise was kept.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// Retransmitted request packets per datagram the link delivered.
    pub fn retransmit_ratio(&self) -> f64 {
        ratio(self.retransmitted_packets, self.delivered_packets)
    }

    /// How long the link takes to send a full queue: the most a datagram can wait.
    pub fn queue_limit_delay(&self) -> Duration {
        let ns = u128::from(self.queue_limit_bytes) * 8 * 1_000_000_000
            / u128::from(self.rate_bps.max(1));
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// Total goodput as a fraction of the link's rate.
    pub fn goodput_fraction(&self) -> f64 {
        ratio(self.total_goodput_bps, self.rate_bps)
    }

    /// A row per report under one header, to compare runs (say 1, 4, 16 and 64 flows, before
    /// and after a change) at a glance.
    pub fn table(reports: &[BottleneckReport]) -> String {
        let mut s = format!(
            "{:>5} {:>9} {:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>7} {:>6} {:>8} {:>6} {:>6} {:>9} {:>4}\n",
            "flows",
            "KiB/flow",
            "Gbit/s",
            "util",
            "Jain",
            "q p50",
            "q p99",
            "q max",
            "drops",
            "CE",
            "retx",
            "retx%",
            "RTOs",
            "time",
            "ok"
        );
        for r in reports {
            s += &format!(
                "{:>5} {:>9} {:>7.3} {:>6.3} {:>6.3} {:>9} {:>9} {:>9} {:>7} {:>6} {:>8} {:>6.1} {:>6} {:>9} {:>4}\n",
                r.flows,
                r.bytes_per_flow / 1024,
                r.total_goodput_bps as f64 / 1e9,
                r.link_utilisation,
                r.jain_index,
                short(r.queue_delay.p50),
                short(r.queue_delay.p99),
                short(r.queue_delay.max),
                r.tail_drops,
                r.ce_marks,
                r.retransmitted_packets,
                100.0 * r.retransmit_ratio(),
                r.timeouts,
                short(r.completion_time),
                if r.passed() { "yes" } else { "NO" }
            );
        }
        s
    }
}

impl fmt::Display for BottleneckReport {
    /// A summary; the alternate form (`{:#}`) adds a line per flow.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mbps = |b: u64| b as f64 / 1e6;
        writeln!(
            f,
            "{} flow(s) x {} KiB through {:.3} Gbit/s: done in {}",
            self.flows,
            self.bytes_per_flow / 1024,
            self.rate_bps as f64 / 1e9,
            short(self.completion_time)
        )?;
        writeln!(
            f,
            "  goodput       {:.1} Mbit/s ({:.1} % of the rate), link busy {:.1} %",
            mbps(self.total_goodput_bps),
            100.0 * self.goodput_fraction(),
            100.0 * self.link_utilisation
        )?;
        let mut g = self.per_flow_goodput_bps.clone();
        g.sort_unstable();
        writeln!(
            f,
            "  per flow      min {:.1} median {:.1} max {:.1} Mbit/s, Jain {:.3}",
            mbps(g.first().copied().unwrap_or(0)),
            mbps(g.get(g.len() / 2).copied().unwrap_or(0)),
            mbps(g.last().copied().unwrap_or(0)),
            self.jain_index
        )?;
        writeln!(
            f,
            "  queue delay   p50 {} p99 {} max {} ({} datagrams; limit {} B = {} at the rate)",
            short(self.queue_delay.p50),
            short(self.queue_delay.p99),
            short(self.queue_delay.max),
            self.queue_delay.samples,
            self.queue_limit_bytes,
            short(self.queue_limit_delay())
        )?;
        writeln!(
            f,
            "  packets       {} delivered by the link, {} tail-dropped, {} CE-marked, {} lost at random",
            self.delivered_packets, self.tail_drops, self.ce_marks, self.random_drops
        )?;
        writeln!(
            f,
            "  recovery      {} of {} request packets sent again ({:.1} % of delivered), {} ACK timeouts, {} sequence NAKs",
            self.retransmitted_packets,
            self.sent_packets,
            100.0 * self.retransmit_ratio(),
            self.timeouts,
            self.seq_naks
        )?;
        if f.alternate() {
            writeln!(
                f,
                "  {:>5} {:>10} {:>10} {:>10} {:>8} {:>6}",
                "flow", "start", "took", "Mbit/s", "retx", "RTOs"
            )?;
            for i in 0..self.per_flow_goodput_bps.len() {
                let at = |v: &[Duration]| short(v.get(i).copied().unwrap_or_default());
                let n = |v: &[u64]| v.get(i).copied().unwrap_or_default();
                writeln!(
                    f,
                    "  {i:>5} {:>10} {:>10} {:>10.1} {:>8} {:>6}",
                    at(&self.per_flow_start),
                    at(&self.per_flow_completion),
                    mbps(self.per_flow_goodput_bps[i]),
                    n(&self.per_flow_retransmits),
                    n(&self.per_flow_timeouts)
                )?;
            }
        }
        if self.violations.is_empty() {
            writeln!(f, "  correctness   every promise kept")
        } else {
            writeln!(f, "  VIOLATIONS    {}", self.violations.len())?;
            for v in self.violations.iter().take(10) {
                writeln!(f, "    {v}")?;
            }
            Ok(())
        }
    }
}

/// `a / b`, 0 when `b` is 0.
fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// A duration in the unit that suits it, three significant-ish digits.
fn short(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}us", ns as f64 / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2}ms", ns as f64 / 1e6)
    } else {
        format!("{:.3}s", ns as f64 / 1e9)
    }
}

/// `bytes` × 8 over `d`, in bits per second (0 over no time).
fn bits_per_second(bytes: u64, d: Duration) -> u64 {
    let ns = d.as_nanos();
    if ns == 0 {
        return 0;
    }
    u64::try_from(u128::from(bytes) * 8 * 1_000_000_000 / ns).unwrap_or(u64::MAX)
}

/// Jain's fairness index, (Σx)² / (n·Σx²): 1 for equal shares.
pub fn jain_index(xs: &[u64]) -> f64 {
    let sum: f64 = xs.iter().map(|&x| x as f64).sum();
    let squares: f64 = xs.iter().map(|&x| (x as f64) * (x as f64)).sum();
    if squares == 0.0 {
        return 0.0;
    }
    sum * sum / (xs.len() as f64 * squares)
}

/// One work request of a flow's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// The WRITE of message `i`.
    Write(usize),
    /// FETCH_ADD number `k`.
    FetchAdd(usize),
}

/// `writes` WRITEs in order with `fas` FETCH_ADDs among them, FETCH_ADD k after
/// (k+1)·writes/(fas+1) WRITEs: spread evenly, so the adds meet the queue in every phase of
/// the flow, not only at its start or end.
fn posting_order(writes: usize, fas: usize) -> Vec<Op> {
    let mut ops = Vec::with_capacity(writes + fas);
    let mut k = 0;
    for i in 0..=writes {
        while k < fas && (k + 1) * writes / (fas + 1) == i {
            ops.push(Op::FetchAdd(k));
            k += 1;
        }
        if i < writes {
            ops.push(Op::Write(i));
        }
    }
    ops
}

/// One flow's plan and what was seen of it.
#[derive(Debug)]
struct Flow {
    start: Instant,
    /// The work requests, until posted at `start`.
    wrs: Vec<SendWr>,
    node: usize,
    qpn: u32,
    /// Receiver QP.
    peer: u32,
    src: Vec<u8>,
    dst_region: usize,
    result_region: usize,
    /// Posting order: (wr_id, opcode, for a FETCH_ADD the result's offset).
    posted: Vec<(u64, WcOpcode, Option<usize>)>,
    /// Completions seen so far, in order.
    done: usize,
    finished_at: Option<Instant>,
}

/// Runs one bottleneck scenario.
pub fn run(cfg: &BottleneckConfig) -> BottleneckReport {
    let mut report = BottleneckReport {
        flows: cfg.flows,
        bytes_per_flow: cfg.bytes_per_flow as u64,
        rate_bps: cfg.link.rate_bps,
        queue_limit_bytes: cfg.link.queue_limit_bytes,
        ..BottleneckReport::default()
    };
    if let Err(e) = cfg.validate() {
        report.violations.push(e);
        return report;
    }
    let mut r = Rng::new(cfg.seed ^ 0xb077_1e4e);
    let net = NetConfig {
        loss: cfg.random_loss,
        ..NetConfig::perfect(cfg.latency)
    };
    let mut sim = Sim::new(cfg.seed.wrapping_mul(0x9e37).wrapping_add(29), net);
    let receiver = sim.add_node();
    let sender_nodes: Vec<usize> = match cfg.senders {
        Senders::Nodes => (0..cfg.flows).map(|_| sim.add_node()).collect(),
        Senders::OneNode => vec![sim.add_node(); cfg.flows],
    };
    sim.add_link(LinkAt::Into(receiver), cfg.link);
    if cfg.ecn {
        for &n in &sender_nodes {
            sim.set_ect(n, None, true);
        }
    }
    let rts = RtsAttr {
        sq_psn: Psn::new(0),
        timeout: cfg.timeout,
        retry_cnt: cfg.retry_cnt,
        rnr_retry: 7,
        max_rd_atomic: 4,
    };
    let counter_base = 0x7000_0000u64;
    let counter_region = sim.nodes[receiver]
        .mem
        .register(1, counter_base, 8, Access::ALL);
    let counter_rkey = sim.nodes[receiver].mem.region(counter_region).rkey;
    let stride = (cfg.bytes_per_flow as u64 + 0x1_ffff) & !0xffff;
    let writes = cfg.writes_per_flow();
    let fas = cfg.fetch_adds_per_flow;
    let mut flows = Vec::with_capacity(cfg.flows);
    for (f, &node) in sender_nodes.iter().enumerate() {
        let (psn_a, psn_b) = (r.below(1 << 24) as u32, r.below(1 << 24) as u32);
        let (qpn, peer) = connect_pair(
            &mut sim,
            node,
            receiver,
            cfg.mtu,
            rts,
            Psn::new(psn_a),
            Psn::new(psn_b),
        );
        let base = 0x1_0000_0000 + f as u64 * stride;
        let mut src = vec![0u8; cfg.bytes_per_flow];
        r.fill(&mut src);
        let mem = &mut sim.nodes[node].mem;
        let src_region = mem.register(1, base, src.len(), Access::LOCAL_WRITE);
        mem.region_mut(src_region).bytes.copy_from_slice(&src);
        let lkey = mem.region(src_region).lkey;
        let result_base = 0x2_0000_0000 + f as u64 * 0x1_0000;
        let result_region = mem.register(1, result_base, 8 * fas.max(1), Access::LOCAL_WRITE);
        let result_lkey = mem.region(result_region).lkey;
        let dst_region =
            sim.nodes[receiver]
                .mem
                .register(1, base, cfg.bytes_per_flow, Access::REMOTE_WRITE);
        let rkey = sim.nodes[receiver].mem.region(dst_region).rkey;
        let mut wrs = Vec::with_capacity(writes + fas);
        let mut posted = Vec::with_capacity(writes + fas);
        for op in posting_order(writes, fas) {
            let id = (f as u64) << 32 | posted.len() as u64;
            match op {
                Op::FetchAdd(k) => {
                    let sge = Sge {
                        addr: result_base + 8 * k as u64,
                        length: 8,
                        lkey: result_lkey,
                    };
                    wrs.push(
                        SendWr::new(id, SendOp::FetchAdd { add: 1 }, vec![sge])
                            .remote(counter_base, counter_rkey),
                    );
                    posted.push((id, WcOpcode::FetchAdd, Some(8 * k)));
                }
                Op::Write(i) => {
                    let off = i * cfg.msg_size;
                    let len = cfg.msg_size.min(cfg.bytes_per_flow - off);
                    let sge = Sge {
                        addr: base + off as u64,
                        length: len as u32,
                        lkey,
                    };
                    wrs.push(
                        SendWr::new(id, SendOp::Write, vec![sge]).remote(base + off as u64, rkey),
                    );
                    posted.push((id, WcOpcode::RdmaWrite, None));
                }
            }
        }
        let spread = u64::try_from(cfg.start_spread.as_nanos()).unwrap_or(u64::MAX);
        flows.push(Flow {
            start: Instant::from_nanos(r.below(spread)),
            wrs,
            node,
            qpn,
            peer,
            src,
            dst_region,
            result_region,
            posted,
            done: 0,
            finished_at: None,
        });
    }

    // Run, posting each flow's work at its start and taking note of each completion as it
    // comes, so that the order and each flow's finishing time are known.
    let deadline = Instant::ZERO + cfg.deadline;
    let mut seen = vec![0usize; sim.nodes.len()];
    let mut unfinished = flows.len();
    let mut by_start: Vec<usize> = (0..flows.len()).collect();
    by_start.sort_by_key(|&f| (flows[f].start, f));
    let mut unposted = &by_start[..];
    let first_start = flows.iter().map(|f| f.start).min().unwrap_or(Instant::ZERO);
    while unfinished > 0 {
        while let Some((&f, rest)) = unposted.split_first() {
            if flows[f].start > sim.now {
                break;
            }
            unposted = rest;
            let fl = &mut flows[f];
            let qp = sim.nodes[fl.node]
                .qps
                .get_mut(&fl.qpn)
                .expect("the flow's QP");
            for wr in std::mem::take(&mut fl.wrs) {
                if let Err(e) = qp.post_send(wr) {
                    report
                        .violations
                        .push(format!("flow {f}: post_send: {e:?}"));
                    return report;
                }
            }
        }
        if sim.now > deadline {
            report.violations.push(format!(
                "{unfinished} flow(s) unfinished by {} (virtual)",
                sim.now
            ));
            break;
        }
        let next_start = unposted.first().map(|&f| flows[f].start);
        let went_on = match next_start {
            Some(t) => sim.step_until(t),
            None => sim.step(),
        };
        if !went_on {
            report.violations.push(format!(
                "the network went idle at {} with {unfinished} flow(s) unfinished",
                sim.now
            ));
            break;
        }
        unfinished -= observe(&sim, &mut flows, &mut seen, &mut report.violations);
        if cfg.check_every_step {
            if let Err(e) = sim.check_links() {
                report.violations.push(format!("at {}: {e}", sim.now));
                break;
            }
        }
    }
    report.completion_time = sim.now - first_start;
    let link = |sim: &Sim| -> Link {
        sim.link(LinkAt::Into(receiver))
            .expect("the bottleneck")
            .clone()
    };
    let at_end = link(&sim);
    report.link = *at_end.stats();

    // Then the network must go quiet, and nothing more may complete.
    if !sim.run_until_idle(sim.now + Duration::from_secs(10)) {
        report
            .violations
            .push("the network did not go quiet after the work completed".into());
    }
    observe(&sim, &mut flows, &mut seen, &mut report.violations);
    if let Err(e) = sim.check_links() {
        report.violations.push(e);
    }
    if sim.nodes[receiver].completions.iter().any(|_| true) {
        report.violations.push(format!(
            "the receiver has {} completions; WRITEs and FETCH_ADDs make none there",
            sim.nodes[receiver].completions.len()
        ));
    }
    check(&sim, receiver, counter_region, &flows, &mut report);

    // Figures.
    for (i, fl) in flows.iter().enumerate() {
        let t = fl.finished_at.unwrap_or(sim.now) - fl.start;
        report.per_flow_start.push(fl.start - Instant::ZERO);
        report.per_flow_completion.push(t);
        report
            .per_flow_goodput_bps
            .push(bits_per_second(cfg.bytes_per_flow as u64, t));
        let qp = &sim.nodes[fl.node].qps[&fl.qpn];
        report.per_flow_retransmits.push(qp.counters().retransmits);
        report
            .per_flow_timeouts
            .push(qp.counters().completer_retry_err);
        report.sender_counters.add(qp.counters());
        report
            .receiver_counters
            .add(sim.nodes[receiver].qps[&fl.peer].counters());
        if report.per_flow_goodput_bps[i] > cfg.link.rate_bps {
            report.violations.push(format!(
                "flow {i}: goodput {} bit/s above the link's {}",
                report.per_flow_goodput_bps[i], cfg.link.rate_bps
            ));
        }
    }
    let total = cfg.bytes_per_flow as u64 * cfg.flows as u64;
    report.total_goodput_bps = bits_per_second(total, report.completion_time);
    if report.total_goodput_bps > cfg.link.rate_bps {
        report.violations.push(format!(
            "goodput {} bit/s above the link's {}",
            report.total_goodput_bps, cfg.link.rate_bps
        ));
    }
    report.link_utilisation = ratio(
        bits_per_second(report.link.bytes_departed, report.completion_time),
        cfg.link.rate_bps,
    );
    report.jain_index = jain_index(&report.per_flow_goodput_bps);
    report.queue_delay = link(&sim).queue_delay();
    report.tail_drops = report.link.tail_drops;
    report.ce_marks = report.link.ce_marked;
    report.delivered_packets = report.link.departed;
    report.net = sim.stats;
    report.random_drops = sim.stats.dropped;
    report.retransmitted_packets = report.sender_counters.retransmits;
    report.sent_packets = report.sender_counters.sent_pkts;
    report.timeouts = report.sender_counters.completer_retry_err;
    report.seq_naks = report.receiver_counters.send_seq_nak;
    report
}

/// Takes note of the completions that arrived since the last call: each must be the next one
/// its flow posted, successful. Returns how many flows finished just now.
fn observe(
    sim: &Sim,
    flows: &mut [Flow],
    seen: &mut [usize],
    violations: &mut Vec<String>,
) -> usize {
    let mut finished = 0;
    for (node, n) in sim.nodes.iter().enumerate() {
        for wc in &n.completions[seen[node]..] {
            let f = (wc.wr_id >> 32) as usize;
            let Some(fl) = flows.get_mut(f).filter(|fl| fl.qpn == wc.qp_num) else {
                violations.push(format!("node {node}: a completion of no flow: {wc:?}"));
                continue;
            };
            match fl.posted.get(fl.done) {
                Some(&(id, op, _))
                    if wc.wr_id == id && wc.opcode == op && wc.status == WcStatus::Success => {}
                Some(&(id, op, _)) => violations.push(format!(
                    "flow {f}: completion {wc:?}, expected wr_id {id:#x} {op:?} success"
                )),
                None => violations.push(format!("flow {f}: one completion too many: {wc:?}")),
            }
            fl.done += 1;
            if fl.done == fl.posted.len() {
                fl.finished_at = Some(sim.now);
                finished += 1;
            }
        }
        seen[node] = n.completions.len();
    }
    finished
}

/// The end state: memory, the counter, the adds' originals, the QPs' states.
fn check(
    sim: &Sim,
    receiver: usize,
    counter_region: usize,
    flows: &[Flow],
    report: &mut BottleneckReport,
) {
    let v = &mut report.violations;
    let mut originals = Vec::new();
    for (f, fl) in flows.iter().enumerate() {
        if fl.done != fl.posted.len() {
            v.push(format!(
                "flow {f}: {} completions for {} work requests",
                fl.done,
                fl.posted.len()
            ));
        }
        let dst = &sim.nodes[receiver].mem.region(fl.dst_region).bytes;
        if let Some(at) = dst.iter().zip(&fl.src).position(|(a, b)| a != b) {
            v.push(format!(
                "flow {f}: the destination differs from what was sent at byte {at}"
            ));
        }
        let results = &sim.nodes[fl.node].mem.region(fl.result_region).bytes;
        for &(_, _, off) in &fl.posted {
            if let Some(off) = off {
                let b: [u8; 8] = results[off..off + 8].try_into().expect("8 bytes");
                originals.push(u64::from_ne_bytes(b));
            }
        }
        for (node, qpn) in [(fl.node, fl.qpn), (receiver, fl.peer)] {
            let state = sim.nodes[node].qps[&qpn].state();
            if state != QpState::Rts {
                v.push(format!("flow {f}: QP 0x{qpn:x} ended in {state:?}"));
            }
        }
    }
    let n = originals.len() as u64;
    let c = &sim.nodes[receiver].mem.region(counter_region).bytes;
    let counter = u64::from_ne_bytes(c[0..8].try_into().expect("8 bytes"));
    if counter != n {
        v.push(format!(
            "the shared counter is {counter} after {n} FETCH_ADDs"
        ));
    }
    originals.sort_unstable();
    if originals.iter().copied().ne(0..n) {
        v.push(format!(
            "the FETCH_ADD originals are not 0..{n} once each (first {:?})",
            &originals[..originals.len().min(16)]
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_is_one_for_equal_shares_and_one_over_n_for_a_monopoly() {
        assert_eq!(jain_index(&[5, 5, 5, 5]), 1.0);
        assert!((jain_index(&[8, 0, 0, 0]) - 0.25).abs() < 1e-12);
        assert_eq!(jain_index(&[]), 0.0);
    }

    #[test]
    fn a_bad_configuration_is_a_violation_not_a_panic() {
        let mut c = BottleneckConfig::new(1, 0);
        assert!(!run(&c).passed());
        c.flows = 1;
        c.msg_size = 1;
        c.bytes_per_flow = 5_000;
        assert!(run(&c).violations[0].contains("work requests per flow"));
    }

    #[test]
    fn fetch_adds_are_spread_evenly_among_the_writes() {
        use Op::{FetchAdd as F, Write as W};
        assert_eq!(
            posting_order(10, 3),
            [
                W(0),
                W(1),
                F(0),
                W(2),
                W(3),
                W(4),
                F(1),
                W(5),
                W(6),
                F(2),
                W(7),
                W(8),
                W(9)
            ]
        );
        assert_eq!(posting_order(0, 2), [F(0), F(1)]);
        assert_eq!(posting_order(2, 0), [W(0), W(1)]);
        assert_eq!(posting_order(1, 3), [F(0), F(1), F(2), W(0)]);
    }

    #[test]
    fn a_small_run_with_more_adds_than_writes_keeps_every_promise() {
        let mut c = BottleneckConfig::new(3, 2);
        c.bytes_per_flow = 3 * 1024;
        c.msg_size = 1024;
        c.fetch_adds_per_flow = 5;
        let r = run(&c);
        assert!(r.passed(), "{r}");
        // Not ECT, so never marked.
        assert_eq!((r.ce_marks, r.net.ce_delivered), (0, 0));
        assert_eq!(r.sent_packets, 2 * (3 + 5) + r.retransmitted_packets);
    }
}
