//! Random workloads through the simulator, checked against a model.
//!
//! A scenario connects `qp_pairs` pairs of RC queue pairs between two nodes and has both ends of
//! every pair post a random mix of SEND, SEND with immediate, WRITE, WRITE with immediate, READ,
//! FETCH_ADD and COMPARE_SWAP, of sizes around the path MTU and beyond. The network misbehaves
//! for the first `fault_window` of virtual time, then heals. The window is shorter than the
//! retry budget (`retry_cnt` + 1 local ACK timeouts): a longer outage legitimately ends a QP with
//! "transport retry counter exceeded", which the error-path tests cover. The run must then show:
//! * every work request completes, successfully, in posting order, once;
//! * every target region equals the model (each initiator writes its own region, so the model
//!   is the sequence of that QP's WRITEs), and every READ returned the model's bytes as of its
//!   place in the QP's order;
//! * FETCH_ADD is exactly-once: the node's shared counter ends at the number of adds, and the
//!   originals returned are exactly 0..N, each once;
//! * COMPARE_SWAP is exactly-once: each QP's chain CAS(k → k+1) returns k every time;
//! * received SENDs carry the sent bytes, lengths and immediates, in order;
//! * the network goes quiet: no packet in flight and no timer armed.

use core::time::Duration;
use std::collections::BTreeMap;

use ferroce_wire::Psn;

use super::{NetConfig, NetStats, Rng, Sim};
use crate::attr::{PathMtu, QpCaps, RtrAttr, RtsAttr};
use crate::completion::{WcOpcode, WcStatus};
use crate::counters::Counters;
use crate::memory::{Access, Sge};
use crate::qp::QpState;
use crate::time::Instant;
use crate::wr::{RecvWr, SendOp, SendWr};

/// Parameters of one scenario.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScenarioConfig {
    /// The seed: everything random follows from it.
    pub seed: u64,
    /// QP pairs between the two nodes.
    pub qp_pairs: usize,
    /// Work requests each end of each pair posts.
    pub ops_per_qp: usize,
    /// Path MTU.
    pub mtu: PathMtu,
    /// Largest message.
    pub max_size: usize,
    /// The network while it misbehaves.
    pub net: NetConfig,
    /// How long it misbehaves.
    pub fault_window: Duration,
    /// Local ACK timeout code.
    pub timeout: u8,
    /// Transport retry count.
    pub retry_cnt: u8,
    /// First PSN of each QP (to exercise wrap-around, put it near 2^24).
    pub start_psn: Option<u32>,
    /// Both ends keep packets that arrive after a gap and resend only the holes (see
    /// `QueuePair::set_selective_repeat`); off: go-back-N, as toward any IBTA peer.
    pub selective_repeat: bool,
    /// Both responders keep requests that arrive after a gap while both requesters stay
    /// go-back-N (see `QueuePair::set_keep_out_of_order`): how a ferroce responder serves an
    /// IBTA peer.
    pub keep_out_of_order: bool,
}

impl ScenarioConfig {
    /// A scenario whose fault rates are drawn from the seed, up to the given maxima.
    pub fn random(
        seed: u64,
        max_loss: f64,
        reorder: f64,
        duplicate: f64,
        corrupt: f64,
    ) -> ScenarioConfig {
        let mut r = Rng::new(seed ^ 0x5ce7_a810);
        let mtu = [PathMtu::Mtu256, PathMtu::Mtu1024, PathMtu::Mtu4096][r.below(3) as usize];
        ScenarioConfig {
            seed,
            qp_pairs: 1 + r.below(3) as usize,
            ops_per_qp: 4 + r.below(24) as usize,
            mtu,
            max_size: [64, 3 * mtu.bytes() as usize, 20_000][r.below(3) as usize],
            net: NetConfig {
                loss: max_loss * r.unit(),
                reorder: reorder * r.unit(),
                duplicate: duplicate * r.unit(),
                corrupt: corrupt * r.unit(),
                latency: Duration::from_micros(1 + r.below(20)),
                reorder_window: Duration::from_micros(1 + r.below(60)),
            },
            // Faults last less than the retry budget (8 rounds of the 4.2 ms ACK timeout), so a
            // QP never legitimately runs out of retries and every one must survive the window.
            fault_window: Duration::from_millis(1 + r.below(25)),
            timeout: 10,
            retry_cnt: 7,
            start_psn: if r.chance(0.2) {
                Some(0x00ff_ffff - r.below(40) as u32)
            } else {
                None
            },
            selective_repeat: false,
            keep_out_of_order: false,
        }
    }
}

/// What a scenario did and whether it kept its promises.
#[derive(Debug, Clone, Default)]
pub struct ScenarioReport {
    /// Work requests posted (sends and receives).
    pub ops: u64,
    /// Completions seen.
    pub completions: u64,
    /// The network's counters.
    pub net: NetStats,
    /// Every QP's counters summed.
    pub counters: Counters,
    /// Virtual time the run took.
    pub elapsed: Duration,
    /// Broken promises; empty when the scenario passed.
    pub violations: Vec<String>,
}

/// Connects two QPs on nodes `a` and `b` of `sim`, leaving both in RTS. Returns their numbers.
pub fn connect_pair(
    sim: &mut Sim,
    a: usize,
    b: usize,
    mtu: PathMtu,
    rts: RtsAttr,
    psn_a: Psn,
    psn_b: Psn,
) -> (u32, u32) {
    let qpn_a = 0x11 + sim.nodes[a].qps.len() as u32 * 2 + a as u32 * 0x1000;
    let qpn_b = 0x11 + sim.nodes[b].qps.len() as u32 * 2 + b as u32 * 0x1000 + 1;
    let (gid_a, gid_b) = (sim.nodes[a].gid(), sim.nodes[b].gid());
    for (node, qpn, peer, gid, rq_psn, sq_psn) in [
        (a, qpn_a, qpn_b, gid_b, psn_b, psn_a),
        (b, qpn_b, qpn_a, gid_a, psn_a, psn_b),
    ] {
        let caps = QpCaps {
            max_send_wr: 4096,
            max_recv_wr: 4096,
            ..QpCaps::default()
        };
        let rtr = RtrAttr {
            path_mtu: mtu,
            dest_gid: gid,
            max_dest_rd_atomic: 16,
            ..super::pair::default_rtr(peer, rq_psn)
        };
        let qp = super::pair::connected_qp(qpn, caps, &rtr, &RtsAttr { sq_psn, ..rts });
        sim.nodes[node].qps.insert(qpn, qp);
    }
    (qpn_a, qpn_b)
}

#[derive(Debug, Clone)]
enum Expect {
    /// Nothing to check beyond success (WRITE, SEND: checked at the target).
    Done,
    /// A READ: the local buffer at (region, offset) must hold these bytes.
    Read {
        region: usize,
        offset: usize,
        bytes: Vec<u8>,
    },
    /// A FETCH_ADD on the shared counter: the original goes into the node's set.
    FetchAdd { region: usize, offset: usize },
    /// A COMPARE_SWAP in a chain: the original must be `k`.
    Cas {
        region: usize,
        offset: usize,
        k: u64,
    },
}

#[derive(Debug)]
struct InitiatorPlan {
    node: usize,
    qpn: u32,
    expects: Vec<(u64, WcOpcode, Expect)>,
}

#[derive(Debug)]
struct RecvExpect {
    wr_id: u64,
    region: usize,
    offset: usize,
    bytes: Vec<u8>,
    imm: Option<u32>,
    opcode: WcOpcode,
}

#[derive(Debug)]
struct RecvPlan {
    node: usize,
    qpn: u32,
    expects: Vec<RecvExpect>,
}

fn pick_size(r: &mut Rng, mtu: usize, max: usize) -> usize {
    let s = match r.below(8) {
        0 => 0,
        1 => 1,
        2 => mtu - 1,
        3 => mtu,
        4 => mtu + 1,
        _ => r.below(max as u64 + 1) as usize,
    };
    s.min(max)
}

const TARGET_LEN: usize = 64 * 1024;

/// Runs one scenario.
pub fn run(cfg: &ScenarioConfig) -> ScenarioReport {
    run_with_trace(cfg, false).0
}

/// Runs one scenario, recording a trace when `trace` is set.
pub fn run_with_trace(cfg: &ScenarioConfig, trace: bool) -> (ScenarioReport, Sim) {
    let mut r = Rng::new(cfg.seed);
    let mut sim = Sim::new(cfg.seed.wrapping_mul(31).wrapping_add(7), cfg.net);
    if trace {
        sim.trace = Some(Vec::new());
    }
    let nodes = [sim.add_node(), sim.add_node()];
    let mtu = cfg.mtu.bytes() as usize;
    let max_size = cfg.max_size.min(TARGET_LEN);
    let rts = RtsAttr {
        sq_psn: Psn::new(0),
        timeout: cfg.timeout,
        retry_cnt: cfg.retry_cnt,
        rnr_retry: 7,
        max_rd_atomic: 4,
    };

    // Each node: one counter region (shared counter at 0, then one CAS word per QP).
    let counter_region: Vec<usize> = nodes
        .iter()
        .map(|&n| {
            sim.nodes[n]
                .mem
                .register(1, 0x7000_0000, 8 + 8 * cfg.qp_pairs, Access::ALL)
        })
        .collect();
    let mut report = ScenarioReport::default();
    let mut initiators = Vec::new();
    let mut receivers = Vec::new();
    // (node, region, model bytes)
    let mut targets: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    let mut fetch_adds = [0u64; 2];
    let mut fetch_add_originals: [Vec<u64>; 2] = [Vec::new(), Vec::new()];

    for pair in 0..cfg.qp_pairs {
        let psn_a = Psn::new(cfg.start_psn.unwrap_or(r.below(1 << 24) as u32));
        let psn_b = Psn::new(cfg.start_psn.unwrap_or(r.below(1 << 24) as u32));
        let (qa, qb) = connect_pair(&mut sim, nodes[0], nodes[1], cfg.mtu, rts, psn_a, psn_b);
        if cfg.selective_repeat || cfg.keep_out_of_order {
            for (n, q) in [(nodes[0], qa), (nodes[1], qb)] {
                if let Some(qp) = sim.nodes[n].qps.get_mut(&q) {
                    qp.set_selective_repeat(cfg.selective_repeat);
                    qp.set_keep_out_of_order(cfg.keep_out_of_order);
                }
            }
        }
        for (ini, tgt, qi, qt) in [(0usize, 1usize, qa, qb), (1, 0, qb, qa)] {
            let (ni, nt) = (nodes[ini], nodes[tgt]);
            // Target region with random contents, mirrored by the model.
            let base_t = 0x1000_0000 + (pair as u64) * 0x100_0000 + ini as u64 * 0x80_0000;
            let treg = sim.nodes[nt]
                .mem
                .register(1, base_t, TARGET_LEN, Access::ALL);
            let mut model = vec![0u8; TARGET_LEN];
            r.fill(&mut model);
            sim.nodes[nt]
                .mem
                .region_mut(treg)
                .bytes
                .copy_from_slice(&model);
            let rkey = sim.nodes[nt].mem.region(treg).rkey;
            // Plan the ops first to size the local and receive regions.
            let mut plan = Vec::new();
            let mut cas_k = 0u64;
            for _ in 0..cfg.ops_per_qp {
                let op = match r.below(9) {
                    0 | 1 => 0, // SEND
                    2 => 1,     // SEND with immediate
                    3 | 4 => 2, // WRITE
                    5 => 3,     // WRITE with immediate
                    6 => 4,     // READ
                    7 => 5,     // FETCH_ADD
                    _ => 6,     // COMPARE_SWAP
                };
                let len = if op >= 5 {
                    8
                } else {
                    pick_size(&mut r, mtu, max_size)
                };
                let off = if op == 2 || op == 3 || op == 4 {
                    r.below((TARGET_LEN - len) as u64 + 1) as usize
                } else {
                    0
                };
                plan.push((op, len, off));
            }
            let local_len: usize = plan.iter().map(|p| p.1 + 8).sum::<usize>().max(8);
            let recv_len: usize = plan
                .iter()
                .filter(|p| p.0 <= 1)
                .map(|p| p.1 + 8)
                .sum::<usize>()
                .max(8);
            let base_l = 0x2000_0000 + (pair as u64) * 0x100_0000 + ini as u64 * 0x80_0000;
            let lreg = sim.nodes[ni]
                .mem
                .register(1, base_l, local_len, Access::LOCAL_WRITE);
            let rreg =
                sim.nodes[nt]
                    .mem
                    .register(1, base_l + 0x40_0000, recv_len, Access::LOCAL_WRITE);
            let lkey = sim.nodes[ni].mem.region(lreg).lkey;
            let rlkey = sim.nodes[nt].mem.region(rreg).lkey;
            let (cbase, crkey) = {
                let c = sim.nodes[nt].mem.region(counter_region[tgt]);
                (c.base, c.rkey)
            };
            let mut ip = InitiatorPlan {
                node: ni,
                qpn: qi,
                expects: Vec::new(),
            };
            let mut rp = RecvPlan {
                node: nt,
                qpn: qt,
                expects: Vec::new(),
            };
            let (mut loff, mut roff) = (0usize, 0usize);
            let mut reads: Vec<(usize, usize)> = Vec::new();
            for (i, (op, len, off)) in plan.into_iter().enumerate() {
                let wr_id = (pair as u64) << 32 | (ini as u64) << 24 | i as u64;
                let mut data = vec![0u8; len];
                r.fill(&mut data);
                let laddr = base_l + loff as u64;
                let sge = Sge {
                    addr: laddr,
                    length: len as u32,
                    lkey,
                };
                let imm = r.next_u64() as u32;
                let (sop, wc_op, expect) = match op {
                    0 | 1 => {
                        sim.nodes[ni].mem.region_mut(lreg).bytes[loff..loff + len]
                            .copy_from_slice(&data);
                        let rsge = Sge {
                            addr: base_l + 0x40_0000 + roff as u64,
                            length: len as u32 + 8,
                            lkey: rlkey,
                        };
                        let rid = wr_id | 1 << 40;
                        sim.nodes[nt]
                            .qps
                            .get_mut(&qt)
                            .expect("qp")
                            .post_recv(RecvWr {
                                wr_id: rid,
                                sgl: vec![rsge],
                            })
                            .expect("post_recv");
                        let imm = (op == 1).then_some(imm);
                        rp.expects.push(RecvExpect {
                            wr_id: rid,
                            region: rreg,
                            offset: roff,
                            bytes: data.clone(),
                            imm,
                            opcode: WcOpcode::Recv,
                        });
                        roff += len + 8;
                        let sop = if let Some(v) = imm {
                            SendOp::SendWithImm(v)
                        } else {
                            SendOp::Send
                        };
                        (sop, WcOpcode::Send, Expect::Done)
                    }
                    2 | 3 => {
                        sim.nodes[ni].mem.region_mut(lreg).bytes[loff..loff + len]
                            .copy_from_slice(&data);
                        model[off..off + len].copy_from_slice(&data);
                        let sop = if op == 3 {
                            let rid = wr_id | 1 << 40;
                            sim.nodes[nt]
                                .qps
                                .get_mut(&qt)
                                .expect("qp")
                                .post_recv(RecvWr {
                                    wr_id: rid,
                                    sgl: vec![],
                                })
                                .expect("post_recv");
                            rp.expects.push(RecvExpect {
                                wr_id: rid,
                                region: rreg,
                                offset: 0,
                                bytes: Vec::new(),
                                imm: Some(imm),
                                opcode: WcOpcode::RecvRdmaWithImm,
                            });
                            SendOp::WriteWithImm(imm)
                        } else {
                            SendOp::Write
                        };
                        (sop, WcOpcode::RdmaWrite, Expect::Done)
                    }
                    4 => (
                        SendOp::Read,
                        WcOpcode::RdmaRead,
                        Expect::Read {
                            region: lreg,
                            offset: loff,
                            bytes: model[off..off + len].to_vec(),
                        },
                    ),
                    5 => {
                        fetch_adds[tgt] += 1;
                        (
                            SendOp::FetchAdd { add: 1 },
                            WcOpcode::FetchAdd,
                            Expect::FetchAdd {
                                region: lreg,
                                offset: loff,
                            },
                        )
                    }
                    _ => {
                        cas_k += 1;
                        (
                            SendOp::CompareSwap {
                                compare: cas_k - 1,
                                swap: cas_k,
                            },
                            WcOpcode::CompareSwap,
                            Expect::Cas {
                                region: lreg,
                                offset: loff,
                                k: cas_k - 1,
                            },
                        )
                    }
                };
                let remote = match op {
                    5 => (cbase, crkey),
                    6 => (cbase + 8 + 8 * pair as u64, crkey),
                    _ => (base_t + off as u64, rkey),
                };
                let mut wr = SendWr::new(
                    wr_id,
                    sop,
                    if len == 0 && op != 5 && op != 6 {
                        vec![]
                    } else {
                        vec![sge]
                    },
                )
                .remote(remote.0, remote.1);
                // The responder reads READ data as it sends it, so a later WRITE to the same bytes
                // may be seen unless it is fenced (IBTA ordering rules): fence such WRITEs.
                if op == 2 || op == 3 {
                    wr.flags.fence = reads.iter().any(|&(o, l)| o < off + len && off < o + l);
                }
                if op == 4 {
                    reads.push((off, len));
                }
                sim.nodes[ni]
                    .qps
                    .get_mut(&qi)
                    .expect("qp")
                    .post_send(wr)
                    .expect("post_send");
                ip.expects.push((wr_id, wc_op, expect));
                loff += len + 8;
                report.ops += 1;
            }
            report.ops += rp.expects.len() as u64;
            targets.push((nt, treg, model));
            initiators.push(ip);
            receivers.push(rp);
        }
    }

    // Faults for the window, then a healed network.
    let fault_end = Instant::ZERO + cfg.fault_window;
    let deadline = Instant::ZERO + Duration::from_secs(120);
    let expected: usize = initiators.iter().map(|p| p.expects.len()).sum::<usize>()
        + receivers.iter().map(|p| p.expects.len()).sum::<usize>();
    let done = |s: &Sim| s.nodes.iter().map(|n| n.completions.len()).sum::<usize>() >= expected;
    // Nothing at or after `fault_end` happens under faults: a step jumps to the next event,
    // which may be an ACK timeout well past the window.
    sim.run_while(fault_end, |s| {
        !done(s) && s.now < fault_end && s.next_event().map_or(true, |t| t < fault_end)
    });
    sim.net = NetConfig::perfect(cfg.net.latency);
    if !sim.run_while(deadline, |s| !done(s)) {
        report.violations.push(format!(
            "only {} of {} completions by {} (virtual)",
            sim.nodes.iter().map(|n| n.completions.len()).sum::<usize>(),
            expected,
            sim.now
        ));
    }
    if !sim.run_until_idle(sim.now + Duration::from_secs(10)) {
        report
            .violations
            .push("the network did not go quiet after the work completed".into());
    }
    report.elapsed = sim.now - Instant::ZERO;
    report.net = sim.stats;

    check(
        &sim,
        &initiators,
        &receivers,
        &targets,
        &mut fetch_add_originals,
        &mut report,
    );
    for (t, &n) in fetch_adds.iter().enumerate() {
        let counter = {
            let c = sim.nodes[nodes[t]].mem.region(counter_region[t]);
            u64::from_ne_bytes(c.bytes[0..8].try_into().expect("8 bytes"))
        };
        if counter != n {
            report.violations.push(format!(
                "node {t}: shared counter is {counter} after {n} FETCH_ADDs"
            ));
        }
        let mut got = fetch_add_originals[t].clone();
        got.sort_unstable();
        if got != (0..n).collect::<Vec<_>>() {
            report.violations.push(format!(
                "node {t}: FETCH_ADD originals are not 0..{n} once each: {got:?}"
            ));
        }
    }
    for node in &sim.nodes {
        for qp in node.qps.values() {
            if qp.state() != QpState::Rts {
                report
                    .violations
                    .push(format!("QP 0x{:x} ended in {:?}", qp.qpn(), qp.state()));
            }
            add_counters(&mut report.counters, qp.counters());
        }
    }
    report.completions = sim.nodes.iter().map(|n| n.completions.len() as u64).sum();
    (report, sim)
}

fn check(
    sim: &Sim,
    initiators: &[InitiatorPlan],
    receivers: &[RecvPlan],
    targets: &[(usize, usize, Vec<u8>)],
    originals: &mut [Vec<u64>; 2],
    report: &mut ScenarioReport,
) {
    let v = &mut report.violations;
    // Group completions by QP, keeping their order.
    let mut by_qp: BTreeMap<(usize, u32), Vec<crate::WorkCompletion>> = BTreeMap::new();
    for (i, n) in sim.nodes.iter().enumerate() {
        for wc in &n.completions {
            by_qp.entry((i, wc.qp_num)).or_default().push(*wc);
        }
    }
    for p in initiators {
        let got: Vec<_> = by_qp
            .get(&(p.node, p.qpn))
            .map(|w| {
                w.iter()
                    .filter(|w| !matches!(w.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        if got.len() != p.expects.len() {
            v.push(format!(
                "QP 0x{:x}: {} send completions for {} requests",
                p.qpn,
                got.len(),
                p.expects.len()
            ));
        }
        for (wc, (wr_id, op, expect)) in got.iter().zip(&p.expects) {
            if wc.wr_id != *wr_id || wc.opcode != *op || wc.status != WcStatus::Success {
                v.push(format!(
                    "QP 0x{:x}: completion {wc:?}, expected wr_id {wr_id:#x} {op:?} success",
                    p.qpn
                ));
                continue;
            }
            let mem = &sim.nodes[p.node].mem;
            match expect {
                Expect::Done => {}
                Expect::Read {
                    region,
                    offset,
                    bytes,
                } => {
                    let have = &mem.region(*region).bytes[*offset..*offset + bytes.len()];
                    if have != &bytes[..] {
                        v.push(format!(
                            "QP 0x{:x}: READ {wr_id:#x} returned other bytes than the model",
                            p.qpn
                        ));
                    }
                }
                Expect::FetchAdd { region, offset } => {
                    let b = &mem.region(*region).bytes[*offset..*offset + 8];
                    originals[1 - p.node].push(u64::from_ne_bytes(b.try_into().expect("8")));
                }
                Expect::Cas { region, offset, k } => {
                    let b = &mem.region(*region).bytes[*offset..*offset + 8];
                    let orig = u64::from_ne_bytes(b.try_into().expect("8"));
                    if orig != *k {
                        v.push(format!(
                            "QP 0x{:x}: CAS {wr_id:#x} found {orig}, expected {k}",
                            p.qpn
                        ));
                    }
                }
            }
        }
    }
    for p in receivers {
        let got: Vec<_> = by_qp
            .get(&(p.node, p.qpn))
            .map(|w| {
                w.iter()
                    .filter(|w| matches!(w.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        if got.len() != p.expects.len() {
            v.push(format!(
                "QP 0x{:x}: {} receive completions for {} receives",
                p.qpn,
                got.len(),
                p.expects.len()
            ));
        }
        for (wc, e) in got.iter().zip(&p.expects) {
            let RecvExpect {
                wr_id,
                region,
                offset,
                bytes,
                imm,
                opcode: op,
            } = e;
            let len_ok = *op == WcOpcode::RecvRdmaWithImm || wc.byte_len as usize == bytes.len();
            if wc.wr_id != *wr_id
                || wc.status != WcStatus::Success
                || wc.imm_data != *imm
                || wc.opcode != *op
                || !len_ok
            {
                v.push(format!(
                    "QP 0x{:x}: receive completion {wc:?}, expected {wr_id:#x} imm {imm:?} len {}",
                    p.qpn,
                    bytes.len()
                ));
                continue;
            }
            let have = &sim.nodes[p.node].mem.region(*region).bytes[*offset..*offset + bytes.len()];
            if have != &bytes[..] {
                v.push(format!(
                    "QP 0x{:x}: receive {wr_id:#x} holds other bytes than were sent",
                    p.qpn
                ));
            }
        }
    }
    for (node, region, model) in targets {
        if &sim.nodes[*node].mem.region(*region).bytes != model {
            let at = sim.nodes[*node]
                .mem
                .region(*region)
                .bytes
                .iter()
                .zip(model)
                .position(|(a, b)| a != b);
            v.push(format!(
                "node {node} region {region}: memory differs from the model at byte {at:?}"
            ));
        }
    }
}

/// Adds `b` into `a`.
pub fn add_counters(a: &mut Counters, b: &Counters) {
    a.add(b);
}
