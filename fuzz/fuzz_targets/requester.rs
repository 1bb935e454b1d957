//! Fuzzes the requester and its completer: one QP in RTS with SEND, WRITE, READ and atomic work
//! requests outstanding, fed arbitrary response packets (ACKs, NAKs of every kind, RNR NAKs,
//! READ responses, ATOMIC ACKs, ferroce's SACKs), timeouts, ERR and reconnects, with and
//! without selective repeat.
//!
//! The input is a script. Its first bytes choose the connection (path MTU, first PSN, ACK
//! timeout, retry and RNR retry counts, READ/atomic depth, send queue depth); then each step
//! posts a work request (any operation, gathered from valid or broken buffers, inline or not,
//! fenced, signaled or not), drains `poll_transmit`/`poll_completion`, answers a request the QP
//! sent (correctly, or at a PSN off by a little, or with the wrong kind or length), answers
//! everything sent so far as a correct responder would, feeds raw bytes or a response with one
//! byte flipped, lets time pass, moves the QP to ERR, or resets and reconnects it.
//!
//! The model knows which PSNs each request takes (requests start in posting order, one PSN per
//! packet at the MTU in force when they start, one per atomic), so it checks every packet the
//! QP sends, not just its shape; a path MTU change reaches only requests not yet started.
//! Invariants (each a panic that names what broke):
//! * nothing inside ferroce-proto panics, and `handle_packet` accepts exactly what
//!   ferroce-wire parses;
//! * every packet sent parses, is a request to the peer within the MTU, and is exactly the
//!   packet its work request calls for at that PSN: opcode and position, RETH (a READ resent
//!   from PSN `k` asks, from byte `k` MTUs on, for the rest or whole MTUs of it, and never from
//!   before where its previous request started), ImmDt/IETH, AtomicETH, and payload bytes
//!   equal to the gathered buffers or inline data; it lies in `[unacked, next)`;
//! * completions come in posting order, one per signaled request and one per failed request,
//!   none for an unsignaled success, with the request's opcode and a status a requester may
//!   give; a successful completion reports the request's length; after ERR every request has
//!   completed;
//! * READ and atomic results land only in the local buffers the request names (every other
//!   byte, guards and other regions included, never changes), and a successful READ or atomic
//!   holds exactly the bytes the responses carried;
//! * bounds: one drain never yields more than `MAX_PACKETS_PER_DRAIN` packets; the send queue
//!   never exceeds its capacity.
#![no_main]

use std::collections::VecDeque;

use ferroce_fuzz::{check_emitted, describe, trace, Audited, Input, World};
use ferroce_proto::qp::MAX_HEADER_LEN;
use ferroce_proto::{
    Access, InitAttr, Instant, KeyKind, PathMtu, PostError, QpCaps, QpState, QueuePair, RtrAttr,
    RtsAttr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};
use ferroce_wire::aeth::{AethRepr, NakCode, Syndrome};
use ferroce_wire::atomic_ack_eth::AtomicAckEthRepr;
use ferroce_wire::bth::{BthRepr, DEFAULT_PKEY};
use ferroce_wire::opcode::{Operation, Position};
use ferroce_wire::{ExtHeaders, Opcode, PacketRepr, Psn, RocePacket};
use libfuzzer_sys::fuzz_target;

const QPN: u32 = 0x21;
const PEER_QPN: u32 = 0x456;
const PD: u32 = 1;
const MAX_STEPS: usize = 256;
/// The requester's window is 1024 PSNs; with retransmissions one drain stays far below this.
const MAX_PACKETS_PER_DRAIN: usize = 4096;
const MTUS: [PathMtu; 5] = [
    PathMtu::Mtu256,
    PathMtu::Mtu512,
    PathMtu::Mtu1024,
    PathMtu::Mtu2048,
    PathMtu::Mtu4096,
];

/// A posted request as the model sees it.
#[derive(Debug, Clone)]
struct Posted {
    wr: SendWr,
    /// The message bytes (SEND/WRITE) as the buffers held them when posted, up to the first
    /// buffer the QP cannot gather from.
    data: Vec<u8>,
    len: u64,
    first_psn: Psn,
    /// PSNs it takes (0 until it starts, or if it never will).
    npsn: u32,
    /// Path MTU when it started, which its packets are cut at.
    mtu: u32,
    /// Whether `first_psn`, `npsn` and `mtu` are known: the QP started it, or it was flushed
    /// at once.
    assigned: bool,
    /// A raw or flipped response was fed while it was outstanding: its result bytes are not
    /// predictable.
    tainted: bool,
    /// READ: the packet its latest request started at. Requests for a READ never start
    /// earlier: rxe serves a duplicate READ only from where the last one it served started.
    read_from: u32,
}

/// The byte a READ response at `psn` carries at `i` (a pure function, so every copy of a
/// response carries the same bytes).
fn fill(psn: Psn, i: usize) -> u8 {
    (psn.value() as u8).wrapping_mul(31) ^ (i as u8) ^ 0x5a
}

/// The value an ATOMIC ACK at `psn` reports.
fn original(psn: Psn) -> u64 {
    u64::from(psn.value()).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x0123_4567
}

fn packets_for(len: u64, mtu: u32) -> u32 {
    len.div_ceil(u64::from(mtu)).max(1) as u32
}

struct Harness {
    qp: QueuePair,
    world: World,
    caps: QpCaps,
    mtu: u32,
    now: Instant,
    /// Requests posted and not yet known complete, in posting order.
    posted: VecDeque<Posted>,
    /// PSN the next request will start at.
    next_psn: Psn,
    next_wr_id: u64,
    /// PSNs sent (request packets), most recent last, to aim responses at.
    sent: VecDeque<Psn>,
    /// Raw or altered bytes were fed at some point.
    untrusted_fed: bool,
    /// Per region, per byte: the latest READ/atomic posted whose result covers it (a later
    /// one may overwrite an earlier one's result before that is checked).
    result_owner: Vec<Vec<u64>>,
    tx: Vec<u8>,
}

fn layout() -> World {
    World::new(
        0x2_0000_0000,
        &[
            ("src", 8192, Access::LOCAL_WRITE, PD),
            ("dst", 8192, Access::LOCAL_WRITE, PD),
            ("norights", 1024, Access::NONE, PD),
            (
                "remote_only",
                512,
                Access::REMOTE_WRITE.with(Access::REMOTE_READ),
                PD,
            ),
            ("other_pd", 512, Access::ALL, 2),
        ],
    )
}

impl Harness {
    fn new(inp: &mut Input<'_>) -> Harness {
        let mut world = layout();
        // Source bytes that differ from position to position, so a misplaced gather shows.
        let src = world.named("src").index;
        for (i, b) in world.mem.region_mut(src).bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(7) ^ (i >> 8) as u8;
        }
        world.accept();
        let caps = QpCaps {
            max_send_wr: 1 + inp.below(32) as u32,
            max_send_sge: 4,
            max_inline_data: 64,
            ..QpCaps::default()
        };
        let mut h = Harness {
            qp: QueuePair::new(QPN, PD, caps),
            world,
            caps,
            mtu: 1024,
            now: Instant::ZERO,
            posted: VecDeque::new(),
            next_psn: Psn::new(0),
            next_wr_id: 1,
            sent: VecDeque::new(),
            untrusted_fed: false,
            result_owner: Vec::new(),
            tx: vec![0; 4096 + MAX_HEADER_LEN],
        };
        h.result_owner = h.world.regions.iter().map(|r| vec![0; r.len]).collect();
        h.connect(inp);
        h
    }

    fn connect(&mut self, inp: &mut Input<'_>) {
        let sq_psn = match inp.below(4) {
            0 => 0,
            1 => 0x00ff_ffff - inp.below(8) as u32,
            2 => inp.u32() & 0x00ff_ffff,
            _ => 1000,
        };
        let mtu = MTUS[[0, 1, 2, 4][inp.below(4)]];
        let b = inp.u8();
        let rts = RtsAttr {
            sq_psn: Psn::new(sq_psn),
            timeout: 1 + (b & 0x0f),
            retry_cnt: (b >> 4) & 7,
            rnr_retry: inp.below(8) as u8,
            max_rd_atomic: 1 + inp.below(16) as u8,
        };
        self.qp
            .modify_to_init(&InitAttr::default())
            .expect("RESET->INIT");
        self.qp
            .modify_to_rtr(&RtrAttr {
                path_mtu: mtu,
                dest_qpn: PEER_QPN,
                dest_gid: "::ffff:10.0.0.3".parse().expect("a GID"),
                rq_psn: Psn::new(5),
                max_dest_rd_atomic: 4,
                min_rnr_timer: 1,
            })
            .expect("INIT->RTR");
        self.qp.modify_to_rts(&rts).expect("RTR->RTS");
        // Half the connections keep what arrives after a gap at the peer (selective repeat,
        // as negotiated between ferroce peers): NAKs and SACKs then ask for single packets,
        // and tail-loss probes go out.
        self.qp.set_selective_repeat(inp.u8() & 1 == 1);
        self.mtu = mtu.bytes();
        self.next_psn = Psn::new(sq_psn);
        self.sent.clear();
    }

    fn reconnect(&mut self, inp: &mut Input<'_>) {
        self.drain();
        self.qp.reset();
        assert!(
            self.qp.poll_completion().is_none(),
            "a reset QP still has completions"
        );
        assert_eq!(self.qp.send_queue_len(), 0, "a reset QP kept requests");
        self.posted.clear();
        self.connect(inp);
    }

    /// A local buffer: mostly a valid piece of `preferred`, sometimes any region, an edge, a
    /// garbage key or a huge length.
    fn sge(&self, inp: &mut Input<'_>, preferred: &str) -> Sge {
        let r = if inp.below(4) == 0 {
            // Results never land where SENDs and WRITEs gather from: the model snapshots what
            // they gather when they are posted, the QP gathers when it sends.
            let other = if preferred == "src" { "dst" } else { "src" };
            let data: Vec<_> = self
                .world
                .data_regions()
                .filter(|r| r.name != other)
                .map(|r| r.index)
                .collect();
            self.world.regions[data[inp.below(data.len())]].clone()
        } else {
            self.world.named(preferred).clone()
        };
        let off = u64::from(inp.u16()) % r.len as u64;
        let room = r.len as u64 - off;
        let length = match inp.below(10) {
            0 => 0,
            1 => (room + 1) as u32,
            2 => inp.u32(),
            3..=5 => (u64::from(inp.u8()) % (room + 1)) as u32,
            _ => (u64::from(inp.u16()) % (room + 1)) as u32,
        };
        let lkey = match inp.below(10) {
            0 => self.world.rkey(r.index),
            1 => inp.u32(),
            _ => self.world.lkey(r.index),
        };
        Sge {
            addr: r.base + off,
            length,
            lkey,
        }
    }

    /// The bytes `sgl` describes, up to the first byte the QP cannot gather (bad key,
    /// protection domain, or past a region's end: the QP reads packet by packet, so the part of
    /// an element before the end is still sent), and whether all of it could be.
    fn gather(&self, sgl: &[Sge]) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        for s in sgl {
            if s.length == 0 {
                continue;
            }
            let found = self
                .world
                .regions
                .iter()
                .find(|r| r.pd == PD && self.world.lkey(r.index) == s.lkey)
                .filter(|r| s.addr >= r.base)
                .and_then(|r| Some((r, r.clip(s.addr, u64::from(s.length))?)));
            let Some((r, (a, b))) = found else {
                return (out, false);
            };
            out.extend_from_slice(&self.world.mem.region(r.index).bytes[a..b]);
            if (b - a) as u64 != u64::from(s.length) {
                return (out, false);
            }
        }
        (out, true)
    }

    fn post(&mut self, inp: &mut Input<'_>) {
        let op = match inp.below(10) {
            0 => SendOp::Send,
            1 => SendOp::SendWithImm(inp.u32()),
            2 => SendOp::SendWithInvalidate(inp.u32()),
            3 | 4 => SendOp::Write,
            5 => SendOp::WriteWithImm(inp.u32()),
            6 | 7 => SendOp::Read,
            8 => SendOp::CompareSwap {
                compare: inp.u64(),
                swap: inp.u64(),
            },
            _ => SendOp::FetchAdd { add: inp.u64() },
        };
        let wr_id = self.next_wr_id;
        self.next_wr_id += 1;
        let mut sgl = Vec::new();
        let mut inline = None;
        if op.is_atomic() {
            let mut s = self.sge(inp, "dst");
            if inp.below(8) != 0 {
                s.length = 8;
            }
            sgl.push(s);
        } else if !op.is_read_or_atomic() && inp.below(4) == 0 {
            let n = match inp.below(8) {
                0 => 65,
                _ => inp.below(65),
            };
            let seed = inp.u8();
            inline = Some(
                (0..n)
                    .map(|i| seed.wrapping_add(i as u8))
                    .collect::<Vec<u8>>(),
            );
        } else {
            let n = match inp.below(12) {
                0 => 0,
                1 => 5,
                k => 1 + k % 3,
            };
            let preferred = if op == SendOp::Read { "dst" } else { "src" };
            for _ in 0..n {
                sgl.push(self.sge(inp, preferred));
            }
        }
        let f = inp.u8();
        let mut wr = SendWr::new(wr_id, op, sgl).flags(SendFlags {
            signaled: f & 3 != 0,
            fence: f & 4 != 0,
            solicited: f & 8 != 0,
        });
        // The remote address names the request, so a response can be traced back to it.
        wr = wr.remote(wr_id << 32, inp.u32());
        if let Some(d) = inline {
            wr = wr.inline(d);
        }
        let len = wr.data_len();
        // Result buffers may change; nothing else may.
        if op.is_read_or_atomic() {
            for s in &wr.sgl {
                for (i, r) in self.world.regions.iter().enumerate() {
                    if self.world.lkey(r.index) == s.lkey {
                        if let Some((a, b)) = r.clip(s.addr, u64::from(s.length)) {
                            self.result_owner[i][a..b].fill(wr_id);
                        }
                    }
                }
                self.world.grant(
                    PD,
                    KeyKind::Local,
                    s.lkey,
                    s.addr,
                    u64::from(s.length),
                    Access::LOCAL_WRITE,
                );
            }
        }
        let data = match (&wr.inline_data, op.is_read_or_atomic()) {
            (_, true) => Vec::new(),
            (Some(d), false) => d.clone(),
            (None, false) => self.gather(&wr.sgl).0,
        };
        let queued = self.qp.send_queue_len();
        let state = self.qp.state();
        if trace() {
            eprintln!("  post {wr:?} (gathers {} of {len})", data.len());
        }
        match self.qp.post_send(wr.clone()) {
            Ok(()) => {
                // In ERR it completes at once with the flush status and takes no PSN; else its
                // PSNs are known when the QP starts it.
                let flushed = state == QpState::Error;
                self.posted.push_back(Posted {
                    wr,
                    data,
                    len,
                    first_psn: self.next_psn,
                    npsn: 0,
                    mtu: self.mtu,
                    assigned: flushed,
                    tainted: flushed,
                    read_from: 0,
                });
            }
            Err(PostError::QueueFull(cap)) => {
                assert_eq!(cap, self.caps.max_send_wr);
                assert!(queued >= cap as usize, "QueueFull with {queued} of {cap}");
            }
            Err(PostError::TooManySge { given, .. }) => {
                assert!(given > self.caps.max_send_sge as usize)
            }
            Err(PostError::InlineNotAllowed { given, .. }) => {
                assert!(given > self.caps.max_inline_data as usize)
            }
            Err(PostError::BadAtomicBuffer) => {
                assert!(op.is_atomic() && wr.sgl[0].length != 8)
            }
            Err(PostError::MessageTooLong(n)) => assert!(n > 1 << 31),
            Err(e) => panic!("post_send refused in {state:?}: {e:?}"),
        }
    }

    /// Gives PSNs to the requests the QP has started since the last call, as the QP must:
    /// in posting order, one per packet at the MTU in force when each started (one for an
    /// atomic), up to its next PSN.
    fn sync_psns(&mut self) {
        let target = self.qp.next_send_psn();
        for p in self.posted.iter_mut() {
            if self.next_psn == target {
                break;
            }
            if p.assigned {
                continue;
            }
            p.assigned = true;
            p.first_psn = self.next_psn;
            p.mtu = self.mtu;
            p.npsn = if p.wr.op.is_atomic() {
                1
            } else {
                packets_for(p.len, self.mtu)
            };
            self.next_psn = self.next_psn.add(p.npsn);
        }
        assert_eq!(
            self.next_psn, target,
            "requests did not take PSNs in posting order, one per packet at their MTU"
        );
    }

    /// The request holding `psn`, with the packet index within it.
    fn owner(&self, psn: Psn) -> Option<(usize, u32)> {
        self.posted.iter().enumerate().find_map(|(i, p)| {
            let k = psn.distance_from(p.first_psn);
            (p.npsn > 0 && k < p.npsn).then_some((i, k))
        })
    }

    /// Checks a request packet against the work request it belongs to.
    fn check_request(&mut self, repr: &PacketRepr, payload: &[u8]) {
        let psn = repr.bth.psn;
        let una = self.qp.unacked_psn();
        let next = self.qp.next_send_psn();
        assert!(
            psn.distance_from(una) < next.distance_from(una),
            "sent PSN {psn:?} outside [{una:?}, {next:?})"
        );
        let Some((i, k)) = self.owner(psn) else {
            panic!("sent PSN {psn:?} that no posted request holds");
        };
        let p = &self.posted[i];
        let op = p.wr.op;
        let mtu = u64::from(p.mtu);
        let e = repr.ext;
        let got = repr.bth.opcode;
        match op {
            SendOp::Read => {
                assert_eq!(got, Opcode::RC_RDMA_READ_REQUEST, "READ wr {}", p.wr.wr_id);
                let reth = e.reth.expect("READ has a RETH");
                let off = u64::from(k) * mtu;
                assert_eq!(reth.va, p.wr.remote_addr + off, "READ resent from {k}: va");
                // The rest, or (a retry inside a narrowed window) whole MTUs of it.
                let rest = p.len - off;
                let asked = u64::from(reth.dma_len);
                assert!(
                    asked == rest || (asked > 0 && asked < rest && asked % mtu == 0),
                    "READ resent from packet {k} asks for {asked} of the {rest} left"
                );
                assert_eq!(reth.rkey, p.wr.rkey);
                assert!(
                    k >= p.read_from,
                    "READ wr {} asked from packet {k} after asking from {}",
                    p.wr.wr_id,
                    p.read_from
                );
                self.posted[i].read_from = k;
            }
            SendOp::CompareSwap { compare, swap } => {
                assert_eq!(got, Opcode::RC_COMPARE_SWAP);
                let a = e.atomic_eth.expect("atomic has an AtomicETH");
                assert_eq!((a.va, a.rkey), (p.wr.remote_addr, p.wr.rkey));
                assert_eq!((a.compare, a.swap_add), (compare, swap));
            }
            SendOp::FetchAdd { add } => {
                assert_eq!(got, Opcode::RC_FETCH_ADD);
                let a = e.atomic_eth.expect("atomic has an AtomicETH");
                assert_eq!(
                    (a.va, a.rkey, a.swap_add),
                    (p.wr.remote_addr, p.wr.rkey, add)
                );
            }
            _ => {
                let info = got.info().expect("checked");
                let want_pos = match (k == 0, k + 1 == p.npsn) {
                    (true, true) => Position::Only,
                    (true, false) => Position::First,
                    (false, true) => Position::Last,
                    (false, false) => Position::Middle,
                };
                assert_eq!(
                    info.position, want_pos,
                    "{got:?} for packet {k} of {}",
                    p.npsn
                );
                let write = matches!(op, SendOp::Write | SendOp::WriteWithImm(_));
                let want_op = if write {
                    Operation::RdmaWrite
                } else {
                    Operation::Send
                };
                assert_eq!(info.operation, want_op, "{got:?} for {op:?}");
                if write && want_pos.starts_message() {
                    let reth = e.reth.expect("WRITE first has a RETH");
                    assert_eq!(
                        (reth.va, reth.rkey, u64::from(reth.dma_len)),
                        (p.wr.remote_addr, p.wr.rkey, p.len)
                    );
                }
                if want_pos.ends_message() {
                    match op {
                        SendOp::SendWithImm(v) | SendOp::WriteWithImm(v) => {
                            assert_eq!(e.immdt.map(|i| i.value), Some(v), "immediate")
                        }
                        SendOp::SendWithInvalidate(r) => {
                            assert_eq!(e.ieth.map(|i| i.rkey), Some(r), "IETH")
                        }
                        _ => assert!(e.immdt.is_none() && e.ieth.is_none()),
                    }
                    assert_eq!(
                        repr.bth.solicited, p.wr.flags.solicited,
                        "solicited bit on the last packet"
                    );
                }
                let off = (u64::from(k) * mtu) as usize;
                let end = (off as u64 + mtu).min(p.len) as usize;
                assert!(
                    end <= p.data.len(),
                    "sent packet {k} of wr {} whose buffers do not gather",
                    p.wr.wr_id
                );
                assert_eq!(payload, &p.data[off.min(end)..end], "payload of packet {k}");
            }
        }
    }

    /// Takes every packet and completion the QP has and checks each.
    fn drain(&mut self) {
        let mut n = 0;
        loop {
            let mut mem = Audited {
                mem: &mut self.world.mem,
                pd: PD,
            };
            let Some(len) = self.qp.poll_transmit(self.now, &mut mem, &mut self.tx) else {
                break;
            };
            self.sync_psns();
            n += 1;
            assert!(
                n <= MAX_PACKETS_PER_DRAIN,
                "more than {MAX_PACKETS_PER_DRAIN} packets queued at once"
            );
            let bytes = self.tx[..len].to_vec();
            if trace() {
                eprintln!("  out {}", describe(&bytes));
            }
            let repr = check_emitted(&bytes, 4096, PEER_QPN);
            let pkt = RocePacket::new_checked(&bytes[..]).expect("checked");
            let op = repr.info().expect("checked").operation;
            if op == Operation::SelectiveAck {
                assert!(
                    self.qp.selective_repeat(),
                    "a SACK from a QP without selective repeat"
                );
            }
            if matches!(
                op,
                Operation::Acknowledge
                    | Operation::AtomicAcknowledge
                    | Operation::RdmaReadResponse
                    | Operation::SelectiveAck
            ) {
                // The QP's responder answering a request that came in raw bytes.
                assert!(
                    self.untrusted_fed,
                    "a response {op:?} though no request came in"
                );
                continue;
            }
            self.check_request(&repr, pkt.payload());
            self.sent.push_back(repr.bth.psn);
            if self.sent.len() > 128 {
                self.sent.pop_front();
            }
        }
        self.sync_psns();
        self.world.check("poll_transmit");
        self.completions();
    }

    fn completions(&mut self) {
        while let Some(wc) = self.qp.poll_completion() {
            if trace() {
                eprintln!("  wc  {wc:?}");
            }
            assert_eq!(wc.qp_num, QPN, "completion of another QP");
            let Some(i) = self.posted.iter().position(|p| p.wr.wr_id == wc.wr_id) else {
                panic!("completion {wc:?} of no outstanding request");
            };
            for skipped in self.posted.drain(..i) {
                assert!(
                    !skipped.wr.flags.signaled,
                    "signaled wr {} never completed, yet {} after it did",
                    skipped.wr.wr_id, wc.wr_id
                );
            }
            let p = self.posted.pop_front().expect("found above");
            let want = match p.wr.op {
                SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInvalidate(_) => {
                    WcOpcode::Send
                }
                SendOp::Write | SendOp::WriteWithImm(_) => WcOpcode::RdmaWrite,
                SendOp::Read => WcOpcode::RdmaRead,
                SendOp::CompareSwap { .. } => WcOpcode::CompareSwap,
                SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            };
            assert_eq!(wc.opcode, want, "completion opcode of {:?}", p.wr.op);
            assert!(
                !matches!(wc.status, WcStatus::Success) || p.wr.flags.signaled,
                "an unsignaled request completed successfully with a completion"
            );
            if wc.status == WcStatus::WorkRequestFlushed {
                assert_eq!(self.qp.state(), QpState::Error, "flushed outside ERR");
            }
            if wc.status == WcStatus::Success {
                assert_eq!(u64::from(wc.byte_len), p.len, "byte_len of a success");
                if !p.tainted {
                    self.check_result(&p);
                }
            }
        }
        if self.qp.send_queue_len() == 0 {
            for p in self.posted.drain(..) {
                assert!(
                    !p.wr.flags.signaled,
                    "signaled wr {} left the queue without a completion",
                    p.wr.wr_id
                );
            }
        }
        if self.qp.state() == QpState::Error {
            assert_eq!(
                self.qp.send_queue_len(),
                0,
                "in ERR with requests not completed"
            );
        }
        assert!(self.qp.send_queue_len() <= self.caps.max_send_wr as usize);
    }

    /// A successful READ or atomic holds exactly what the responses carried.
    fn check_result(&self, p: &Posted) {
        let want: Vec<u8> = match p.wr.op {
            SendOp::Read => (0..p.len as usize)
                .map(|j| {
                    let k = j / p.mtu as usize;
                    fill(p.first_psn.add(k as u32), j % p.mtu as usize)
                })
                .collect(),
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                original(p.first_psn).to_ne_bytes().to_vec()
            }
            _ => return,
        };
        let (_, whole) = self.gather(&p.wr.sgl);
        assert!(
            whole,
            "wr {} succeeded with buffers that do not resolve",
            p.wr.wr_id
        );
        // Scatter `want` as the QP does, element after element, so that where elements overlap
        // the later one wins; then every byte must hold what was scattered there last.
        let mut last = std::collections::BTreeMap::new();
        let mut at = 0usize;
        for s in &p.wr.sgl {
            for j in 0..s.length as usize {
                if at + j >= want.len() {
                    break;
                }
                last.insert((s.lkey, s.addr + j as u64), want[at + j]);
            }
            at += s.length as usize;
        }
        for (&(lkey, addr), &byte) in &last {
            let (i, r) = self
                .world
                .regions
                .iter()
                .enumerate()
                .find(|(_, r)| self.world.lkey(r.index) == lkey)
                .expect("resolved above");
            let off = (addr - r.base) as usize;
            if self.result_owner[i][off] != p.wr.wr_id {
                continue;
            }
            let got = self.world.mem.region(r.index).bytes[off];
            assert_eq!(
                got, byte,
                "result of wr {} ({:?}) at {addr:#x}",
                p.wr.wr_id, p.wr.op
            );
        }
    }

    fn response(&self, opcode: Opcode, psn: Psn, ext: ExtHeaders, payload: &[u8]) -> Vec<u8> {
        let bth = BthRepr {
            opcode,
            solicited: false,
            migreq: false,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qpn: QPN,
            ack_req: false,
            psn,
        };
        let repr = PacketRepr::new(bth, ext, payload.len());
        let mut buf = vec![0; repr.buffer_len().expect("known opcode")];
        repr.emit(&mut buf).expect("a built response emits");
        RocePacket::new_unchecked(&mut buf[..])
            .payload_mut()
            .copy_from_slice(payload);
        buf
    }

    fn ack(&self, psn: Psn, syndrome: Syndrome) -> Vec<u8> {
        let ext = ExtHeaders {
            aeth: Some(AethRepr { syndrome, msn: 0 }),
            ..Default::default()
        };
        self.response(Opcode::RC_ACKNOWLEDGE, psn, ext, &[])
    }

    /// The correct answer to packet `k` of request `p` (for a READ: response packet `k`).
    fn answer(&self, p: &Posted, k: u32) -> Option<Vec<u8>> {
        let psn = p.first_psn.add(k);
        let ack = Some(AethRepr {
            syndrome: Syndrome::Ack { credits: 31 },
            msn: 0,
        });
        match p.wr.op {
            SendOp::Read => {
                let mtu = p.mtu as usize;
                let off = k as usize * mtu;
                let n = (p.len as usize - off.min(p.len as usize)).min(mtu);
                let payload: Vec<u8> = (0..n).map(|i| fill(psn, i)).collect();
                let opcode = match (k == 0, k + 1 == p.npsn) {
                    (true, true) => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
                    (true, false) => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
                    (false, true) => Opcode::RC_RDMA_READ_RESPONSE_LAST,
                    (false, false) => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
                };
                let ext = ExtHeaders {
                    aeth: if k == 0 || k + 1 == p.npsn { ack } else { None },
                    ..Default::default()
                };
                Some(self.response(opcode, psn, ext, &payload))
            }
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                let ext = ExtHeaders {
                    aeth: ack,
                    atomic_ack_eth: Some(AtomicAckEthRepr {
                        original: original(psn),
                    }),
                    ..Default::default()
                };
                Some(self.response(Opcode::RC_ATOMIC_ACKNOWLEDGE, psn, ext, &[]))
            }
            _ => (k + 1 == p.npsn).then(|| self.ack(psn, Syndrome::Ack { credits: 31 })),
        }
    }

    /// One response aimed at a PSN the QP sent (or near it).
    fn respond(&mut self, inp: &mut Input<'_>, flip: bool) {
        self.sync_psns();
        let base = if self.sent.is_empty() {
            self.qp.unacked_psn()
        } else {
            let n = self.sent.len();
            self.sent[n - 1 - inp.below(n)]
        };
        let psn = match inp.below(8) {
            0..=4 => base,
            5 => base.add(1 + inp.below(3) as u32),
            6 => base.sub(1 + inp.below(3) as u32),
            _ => Psn::new(inp.u32() & 0x00ff_ffff),
        };
        let owner = self.owner(psn);
        let mut untrusted = flip;
        let bytes = match inp.below(13) {
            0..=3 => match owner {
                Some((i, k)) => {
                    let p = self.posted[i].clone();
                    // For a READ any of its response packets, else this packet's answer.
                    let k = if p.wr.op == SendOp::Read {
                        k + inp.below((p.npsn - k).min(256) as usize) as u32
                    } else {
                        k
                    };
                    match self.answer(&p, k) {
                        Some(b) => b,
                        None => self.ack(psn, Syndrome::Ack { credits: 31 }),
                    }
                }
                None => self.ack(psn, Syndrome::Ack { credits: 31 }),
            },
            4 | 5 => self.ack(
                psn,
                Syndrome::Ack {
                    credits: inp.u8() & 31,
                },
            ),
            6 => self.ack(
                psn,
                Syndrome::RnrNak {
                    timer: inp.u8() & 31,
                },
            ),
            7 => self.ack(psn, Syndrome::Nak(NakCode::PsnSequenceError)),
            8 => {
                let code = [
                    NakCode::InvalidRequest,
                    NakCode::RemoteAccessError,
                    NakCode::RemoteOperationalError,
                    NakCode::InvalidRdRequest,
                ][inp.below(4)];
                self.ack(psn, Syndrome::Nak(code))
            }
            9 => self.ack(psn, Syndrome::from_byte(inp.u8())),
            10 => {
                let n = inp.below(256) * (self.mtu as usize + 8) / 255;
                let payload: Vec<u8> = (0..n).map(|i| fill(psn, i)).collect();
                let opcode = Opcode(0x0d + inp.below(4) as u8);
                let info = opcode.info().expect("READ response opcode");
                let ext = ExtHeaders {
                    aeth: info
                        .headers
                        .contains(ferroce_wire::opcode::HeaderSet::AETH)
                        .then_some(AethRepr {
                            syndrome: Syndrome::from_byte(inp.u8() & 0x7f),
                            msn: 0,
                        }),
                    ..Default::default()
                };
                self.response(opcode, psn, ext, &payload)
            }
            12 => {
                // A SACK: the last PSN in order, then a bitmap of any length (a real one is at
                // most 64 bytes).
                let n = inp.below(80);
                let bitmap = inp.bytes(n).to_vec();
                let ext = ExtHeaders {
                    aeth: Some(AethRepr {
                        syndrome: Syndrome::Ack { credits: 31 },
                        msn: 0,
                    }),
                    ..Default::default()
                };
                self.response(Opcode::FERROCE_SACK, psn, ext, &bitmap)
            }
            _ => {
                let value = if inp.u8() & 1 == 0 {
                    original(psn)
                } else {
                    untrusted = true;
                    inp.u64()
                };
                let ext = ExtHeaders {
                    aeth: Some(AethRepr {
                        syndrome: Syndrome::from_byte(inp.u8() & 0x7f),
                        msn: 0,
                    }),
                    atomic_ack_eth: Some(AtomicAckEthRepr { original: value }),
                    ..Default::default()
                };
                self.response(Opcode::RC_ATOMIC_ACKNOWLEDGE, psn, ext, &[])
            }
        };
        let mut bytes = bytes;
        if flip {
            let at = usize::from(inp.u16()) % bytes.len();
            bytes[at] ^= 1 << inp.below(8);
        }
        self.feed(&bytes, untrusted);
    }

    /// Answers everything outstanding as a correct responder would, oldest first.
    fn respond_all(&mut self, inp: &mut Input<'_>) {
        self.drain();
        let skip = inp.u8();
        let mut answers = Vec::new();
        for (i, p) in self.posted.iter().enumerate() {
            if p.npsn == 0 {
                continue;
            }
            for k in 0..p.npsn.min(64) {
                // Leave out one answer now and then: a gap the requester must notice.
                if skip != 0 && (i as u32 * 64 + k) % 251 == u32::from(skip) {
                    continue;
                }
                if let Some(b) = self.answer(p, k) {
                    answers.push(b);
                }
            }
        }
        for b in answers {
            self.feed(&b, false);
        }
    }

    fn feed(&mut self, bytes: &[u8], untrusted: bool) {
        let parsed = RocePacket::new_checked(bytes)
            .ok()
            .and_then(|p| PacketRepr::parse(&p).ok());
        if untrusted {
            // Its payload or value may have been altered: results are no longer predictable.
            for p in &mut self.posted {
                p.tainted = true;
            }
            self.untrusted_fed = true;
        }
        // A raw packet may be a request the QP's responder serves: allow what it may write.
        if let Some(r) = &parsed {
            let op = r.info().expect("parsed").operation;
            if let Some(reth) = r.ext.reth.filter(|_| op == Operation::RdmaWrite) {
                self.world.grant(
                    PD,
                    KeyKind::Remote,
                    reth.rkey,
                    reth.va,
                    u64::from(reth.dma_len),
                    Access::REMOTE_WRITE,
                );
            }
            if let Some(a) = r.ext.atomic_eth {
                self.world
                    .grant(PD, KeyKind::Remote, a.rkey, a.va, 8, Access::REMOTE_ATOMIC);
            }
        }
        let mut mem = Audited {
            mem: &mut self.world.mem,
            pd: PD,
        };
        let res = self.qp.handle_packet(self.now, &mut mem, bytes);
        if trace() {
            eprintln!("  in  {} -> {:?}", describe(bytes), self.qp.state());
        }
        assert_eq!(
            res.is_ok(),
            parsed.is_some(),
            "handle_packet and ferroce-wire disagree on {bytes:02x?}: {res:?}"
        );
    }

    fn raw(&mut self, inp: &mut Input<'_>) {
        let len = usize::from(inp.u16()) % 1200;
        let bytes = inp.bytes(len).to_vec();
        self.feed(&bytes, true);
    }

    fn timeout(&mut self, inp: &mut Input<'_>) {
        self.now = match (inp.below(4), self.qp.next_timeout()) {
            (0..=2, Some(t)) => t.max(self.now),
            _ => self.now + core::time::Duration::from_nanos(u64::from(inp.u32()) << 4),
        };
        self.qp.handle_timeout(self.now);
        if let Some(t) = self.qp.next_timeout() {
            assert!(
                t > self.now,
                "next_timeout {t} not after the timeout just handled"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mut h = Harness::new(&mut inp);
    let mut steps = 0;
    while !inp.is_empty() && steps < MAX_STEPS {
        steps += 1;
        let what = match inp.below(32) {
            0..=8 => {
                h.post(&mut inp);
                "post_send"
            }
            9..=12 => {
                h.drain();
                "drain"
            }
            13..=19 => {
                h.respond(&mut inp, false);
                "response"
            }
            20..=22 => {
                h.respond_all(&mut inp);
                "respond to all"
            }
            23 => {
                h.raw(&mut inp);
                "raw bytes"
            }
            24 => {
                h.respond(&mut inp, true);
                "flipped response"
            }
            25..=27 => {
                h.timeout(&mut inp);
                "timeout"
            }
            28 => {
                h.qp.modify_to_error();
                "modify to ERR"
            }
            29 => {
                // Drained first, so the model knows which requests started at the old MTU.
                h.drain();
                let mtu = MTUS[inp.below(MTUS.len())];
                if h.qp.set_path_mtu(mtu).is_ok() {
                    h.mtu = mtu.bytes();
                }
                "MTU change"
            }
            _ => {
                h.reconnect(&mut inp);
                "reconnect"
            }
        };
        if trace() {
            eprintln!(
                "step {steps}: {what} (state {:?}, mtu {}, sq {}, una {}, next {})",
                h.qp.state(),
                h.mtu,
                h.qp.send_queue_len(),
                h.qp.unacked_psn().value(),
                h.qp.next_send_psn().value()
            );
        }
        h.world.check(what);
    }
    h.drain();
    h.world.check("final drain");
});
