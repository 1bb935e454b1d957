//! Fuzzes the responder: one QP in RTS fed an arbitrary sequence of request packets, as the UDP
//! engine and the simulator feed it (`handle_packet` with the transport packet, BTH to ICRC).
//! One script in four makes the QP a UC QP (`ferroce_proto::uc`): every SEND and WRITE the
//! script builds then carries UC's opcode (READs, atomics and SEND with invalidate keep RC's,
//! which a UC QP must drop), and the invariants below hold with UC's rules where they differ.
//!
//! The input is a script, not a packet. Its first bytes choose the connection (path MTU, the
//! QP's access rights, first PSN, READ/atomic depth, receive queue depth); then each step picks
//! one of: a single request built from the opcode table with a PSN near the expected one and
//! RETH/AtomicETH fields aimed inside, at the edge of, or outside the registered regions with
//! valid, stale or garbage keys and lengths from 0 to overflowing; a whole SEND/WRITE message
//! cut into packets as a requester would (with a packet dropped, repeated or swapped); a READ or
//! atomic followed by its duplicate; raw fuzz bytes; a built packet with one byte flipped; a
//! receive request; a drain of `poll_transmit`/`poll_completion`; a timeout; a re-registration
//! that makes a key stale; a path MTU change; ERR; a reset and reconnect.
//!
//! Invariants, checked after every step (each a panic that names what broke):
//! * nothing inside ferroce-proto panics, and `handle_packet` accepts exactly what
//!   ferroce-wire parses;
//! * memory: a byte changes only where a request the driver fed granted it (a RETH of a WRITE
//!   or an AtomicETH whose key names a region with that right, or the SGE of a posted receive
//!   into a region with local write); so guard regions around every region, regions without
//!   rights, another protection domain's region never change; the QP asks the memory for the
//!   right it needs (see `Audited`);
//! * a duplicate or out-of-sequence request never changes memory; an accepted atomic changes
//!   its word exactly as the operation says, and its ATOMIC ACK (also a replayed one) carries
//!   the value found there first: atomics execute exactly once;
//! * the expected PSN moves only on an accepted request: by one, or by the packet count of a
//!   READ; on UC also to a packet that starts a message at another PSN (the sequence taken up
//!   again after a gap), or one past it;
//! * a UC QP sends nothing, ever;
//! * every packet `poll_transmit` writes parses with ferroce-wire, is a response (ACK, ATOMIC
//!   ACK or READ response) to the peer QP, fits the MTU, leaves the ICRC to the caller; a READ
//!   response lies in the PSN span of a READ the responder accepted and is cut at the path MTU
//!   that READ was accepted under (a later MTU change reaches new messages only); a positive
//!   ACK acknowledges a PSN already received; a fatal NAK leaves the QP in ERR;
//! * completions: only receive completions, in posting order, each receive exactly once, with
//!   a status the responder may give and a length within the receive's buffers; after ERR every
//!   receive has completed; a key disappears only by a SEND with invalidate naming it;
//! * bounds: one drain never yields more than `MAX_PACKETS_PER_DRAIN` packets; the receive
//!   queue never exceeds its capacity.
#![no_main]

use std::collections::{HashMap, VecDeque};

use ferroce_fuzz::{check_emitted, describe, trace, Audited, Input, World};
use ferroce_proto::qp::MAX_HEADER_LEN;
use ferroce_proto::{
    Access, AtomicOp, InitAttr, Instant, KeyKind, PathMtu, PostError, QpCaps, QpState, QueuePair,
    RecvWr, RtrAttr, RtsAttr, Service, Sge, WcOpcode, WcStatus,
};
use ferroce_wire::aeth::{AethRepr, NakCode, Syndrome};
use ferroce_wire::atomic_ack_eth::AtomicAckEthRepr;
use ferroce_wire::atomic_eth::AtomicEthRepr;
use ferroce_wire::bth::{BthRepr, DEFAULT_PKEY};
use ferroce_wire::deth::DethRepr;
use ferroce_wire::ieth::IethRepr;
use ferroce_wire::immdt::ImmDtRepr;
use ferroce_wire::opcode::{HeaderSet, Operation, Position, Transport, ALL_OPCODES};
use ferroce_wire::reth::RethRepr;
use ferroce_wire::{ExtHeaders, Opcode, PacketRepr, Psn, RocePacket};
use libfuzzer_sys::fuzz_target;

const QPN: u32 = 0x12;
const PEER_QPN: u32 = 0x345;
const PD: u32 = 1;
const MAX_STEPS: usize = 256;
/// Far more than any legitimate step can queue here: the largest region is 8 KiB, so a READ
/// answers in at most 32 packets at the smallest MTU, and a script has at most 256 steps.
const MAX_PACKETS_PER_DRAIN: usize = 4096;
const MTUS: [PathMtu; 5] = [
    PathMtu::Mtu256,
    PathMtu::Mtu512,
    PathMtu::Mtu1024,
    PathMtu::Mtu2048,
    PathMtu::Mtu4096,
];

/// Every RC request opcode, the ones a responder serves.
const REQUESTS: [Opcode; 17] = [
    Opcode::RC_SEND_FIRST,
    Opcode::RC_SEND_MIDDLE,
    Opcode::RC_SEND_LAST,
    Opcode::RC_SEND_LAST_WITH_IMMEDIATE,
    Opcode::RC_SEND_ONLY,
    Opcode::RC_SEND_ONLY_WITH_IMMEDIATE,
    Opcode::RC_RDMA_WRITE_FIRST,
    Opcode::RC_RDMA_WRITE_MIDDLE,
    Opcode::RC_RDMA_WRITE_LAST,
    Opcode::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
    Opcode::RC_RDMA_WRITE_ONLY,
    Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
    Opcode::RC_RDMA_READ_REQUEST,
    Opcode::RC_COMPARE_SWAP,
    Opcode::RC_FETCH_ADD,
    Opcode::RC_SEND_LAST_WITH_INVALIDATE,
    Opcode::RC_SEND_ONLY_WITH_INVALIDATE,
];

/// The fields a built request carries beyond the BTH, chosen before the packet is emitted.
#[derive(Default, Clone, Copy)]
struct Fields {
    reth: Option<RethRepr>,
    atomic: Option<AtomicEthRepr>,
}

struct Harness {
    qp: QueuePair,
    /// RC, or UC (then every built SEND/WRITE carries UC's opcode).
    service: Service,
    world: World,
    /// The QP's access rights (what remote peers may do through it).
    access: Access,
    caps: QpCaps,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    mtu: u32,
    now: Instant,
    /// Receives posted and not yet completed: (wr_id, buffer bytes).
    posted: VecDeque<(u64, u64)>,
    next_wr_id: u64,
    /// PSN spans (first, count) of READs the responder accepted, with the path MTU then.
    reads: VecDeque<(Psn, u32, u32)>,
    /// The value an accepted atomic found, by PSN.
    atomics: HashMap<u32, u64>,
    /// Remote keys each region had, current last.
    keys: Vec<Vec<u32>>,
    /// Keys SEND-with-invalidate packets named in this step.
    invalidations: Vec<u32>,
    rotations: u32,
    tx: Vec<u8>,
    pkt: Vec<u8>,
}

fn layout() -> World {
    let remote = Access::REMOTE_READ.with(Access::REMOTE_WRITE);
    World::new(
        0x1_0000_0000,
        &[
            ("none", 256, Access::NONE, PD),
            ("ro", 512, Access::REMOTE_READ, PD),
            ("rw", 8192, remote, PD),
            ("atomic", 64, Access::REMOTE_ATOMIC, PD),
            ("recv", 2048, Access::LOCAL_WRITE, PD),
            ("all", 2048, Access::ALL, PD),
            ("other_pd", 512, Access::ALL, 2),
        ],
    )
}

fn packets_for(len: u64, mtu: u32) -> u32 {
    len.div_ceil(u64::from(mtu)).max(1) as u32
}

impl Harness {
    fn new(inp: &mut Input<'_>) -> Harness {
        let service = if inp.below(4) == 0 {
            Service::Uc
        } else {
            Service::Rc
        };
        let world = layout();
        let keys = world
            .regions
            .iter()
            .map(|r| vec![world.rkey(r.index)])
            .collect();
        let b = inp.u8();
        let access = if b < 192 {
            Access::REMOTE_READ
                .with(Access::REMOTE_WRITE)
                .with(Access::REMOTE_ATOMIC)
        } else {
            Access::from_bits(u32::from(b))
        };
        let caps = QpCaps {
            max_recv_wr: 1 + inp.below(16) as u32,
            max_recv_sge: 4,
            ..QpCaps::default()
        };
        let mut h = Harness {
            qp: QueuePair::with_service(QPN, PD, caps, service),
            service,
            world,
            access,
            caps,
            max_dest_rd_atomic: 1 + inp.below(16) as u8,
            min_rnr_timer: inp.below(32) as u8,
            mtu: 1024,
            now: Instant::ZERO,
            posted: VecDeque::new(),
            next_wr_id: 1,
            reads: VecDeque::new(),
            atomics: HashMap::new(),
            keys,
            invalidations: Vec::new(),
            rotations: 0,
            tx: vec![0; 4096 + MAX_HEADER_LEN],
            pkt: vec![0; 8192],
        };
        h.connect(inp);
        for _ in 0..inp.below(4) {
            let r = h.world.named("recv").clone();
            let lkey = h.world.lkey(r.index);
            let sge = Sge {
                addr: r.base,
                length: r.len as u32,
                lkey,
            };
            h.post_recv(vec![sge]);
        }
        h
    }

    /// RESET → INIT → RTR → RTS with a first expected PSN and MTU from the input.
    fn connect(&mut self, inp: &mut Input<'_>) {
        let rq_psn = match inp.below(4) {
            0 => 0,
            1 => 0x00ff_ffff - inp.below(8) as u32,
            2 => inp.u32() & 0x00ff_ffff,
            _ => 100,
        };
        let mtu = MTUS[[0, 2, 2, 4][inp.below(4)]];
        self.qp
            .modify_to_init(&InitAttr {
                access: self.access,
                ..InitAttr::default()
            })
            .expect("RESET->INIT");
        self.qp
            .modify_to_rtr(&RtrAttr {
                path_mtu: mtu,
                dest_qpn: PEER_QPN,
                dest_gid: "::ffff:10.0.0.2".parse().expect("a GID"),
                rq_psn: Psn::new(rq_psn),
                max_dest_rd_atomic: self.max_dest_rd_atomic,
                min_rnr_timer: self.min_rnr_timer,
            })
            .expect("INIT->RTR");
        self.qp
            .modify_to_rts(&RtsAttr {
                sq_psn: Psn::new(7),
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
            })
            .expect("RTR->RTS");
        self.mtu = mtu.bytes();
    }

    fn reconnect(&mut self, inp: &mut Input<'_>) {
        self.drain();
        self.qp.reset();
        assert!(
            self.qp.poll_completion().is_none(),
            "a reset QP still has completions"
        );
        assert_eq!(self.qp.recv_queue_len(), 0, "a reset QP kept receives");
        self.posted.clear();
        self.reads.clear();
        self.atomics.clear();
        self.connect(inp);
    }

    fn data_region(&self, inp: &mut Input<'_>) -> usize {
        let n = self.world.data_regions().count();
        let k = inp.below(n);
        self.world.data_regions().nth(k).expect("k < count").index
    }

    fn rkey(&self, inp: &mut Input<'_>, region: usize) -> u32 {
        match inp.below(16) {
            0..=9 => self.world.rkey(region),
            10 => self.world.lkey(region),
            11 => {
                let stale: Vec<u32> = self
                    .keys
                    .iter()
                    .flat_map(|h| h[..h.len() - 1].iter().copied())
                    .collect();
                stale
                    .get(inp.below(stale.len()))
                    .copied()
                    .unwrap_or(0x0bad_0001)
            }
            12 => 0,
            13 => inp.u32(),
            14 => self.world.rkey(inp.below(self.world.regions.len())),
            _ => self.world.rkey(region) ^ 0x100,
        }
    }

    fn va(&self, inp: &mut Input<'_>, region: usize) -> u64 {
        let r = &self.world.regions[region];
        let len = r.len as u64;
        match inp.below(8) {
            0..=3 => r.base + u64::from(inp.u16()) % len,
            4 => r.base + len - u64::from(inp.u8() % 16),
            5 => r.base.wrapping_sub(u64::from(inp.u8() % 16)),
            6 => inp.u64(),
            _ => r.base,
        }
    }

    /// A DMA length: mostly `natural`, else 0, small, a whole region, or one of the lengths at
    /// and past the 2^31 limit.
    fn dma_len(&self, inp: &mut Input<'_>, natural: u32) -> u32 {
        match inp.below(12) {
            0..=5 => natural,
            6 => 0,
            7 => u32::from(inp.u8()),
            8 => u32::from(inp.u16()),
            9 => [1 << 31, (1 << 31) + 1, u32::MAX, u32::MAX - 7][inp.below(4)],
            10 => natural.wrapping_add(1 + inp.below(4) as u32),
            _ => inp.u32(),
        }
    }

    fn psn(&self, inp: &mut Input<'_>) -> Psn {
        let e = self.qp.expected_psn();
        match inp.below(16) {
            0..=10 => e,
            11..=12 => e.add(1 + inp.below(4) as u32),
            13 => e.sub(1 + inp.below(4) as u32),
            14 => e.sub(1 + inp.below(64) as u32),
            _ => Psn::new(inp.u32() & 0x00ff_ffff),
        }
    }

    fn bth(&self, inp: &mut Input<'_>, opcode: Opcode, psn: Psn) -> BthRepr {
        let f = inp.u8();
        BthRepr {
            opcode,
            solicited: f & 1 != 0,
            migreq: f & 2 != 0,
            pad_count: 0,
            pkey: if f & 0x80 != 0 {
                inp.u16()
            } else {
                DEFAULT_PKEY
            },
            fecn: f & 4 != 0,
            becn: f & 8 != 0,
            dest_qpn: if f & 0x40 != 0 {
                inp.u32() & 0x00ff_ffff
            } else {
                QPN
            },
            ack_req: f & 0x30 != 0,
            psn,
        }
    }

    /// The extension headers `info` requires, with fields from the input.
    fn ext(&self, inp: &mut Input<'_>, set: HeaderSet, f: Fields) -> ExtHeaders {
        let mut e = ExtHeaders::default();
        if set.contains(HeaderSet::RETH) {
            e.reth = Some(f.reth.unwrap_or_else(|| {
                let region = self.data_region(inp);
                RethRepr {
                    va: self.va(inp, region),
                    rkey: self.rkey(inp, region),
                    dma_len: self.dma_len(inp, self.mtu),
                }
            }));
        }
        if set.contains(HeaderSet::ATOMIC_ETH) {
            e.atomic_eth = Some(f.atomic.unwrap_or_else(|| self.atomic_eth(inp)));
        }
        if set.contains(HeaderSet::AETH) {
            e.aeth = Some(AethRepr {
                syndrome: Syndrome::from_byte(inp.u8()),
                msn: inp.u32() & 0x00ff_ffff,
            });
        }
        if set.contains(HeaderSet::ATOMIC_ACK_ETH) {
            e.atomic_ack_eth = Some(AtomicAckEthRepr {
                original: inp.u64(),
            });
        }
        if set.contains(HeaderSet::IMMDT) {
            e.immdt = Some(ImmDtRepr { value: inp.u32() });
        }
        if set.contains(HeaderSet::IETH) {
            let region = self.data_region(inp);
            e.ieth = Some(IethRepr {
                rkey: self.rkey(inp, region),
            });
        }
        if set.contains(HeaderSet::DETH) {
            e.deth = Some(DethRepr {
                qkey: inp.u32(),
                src_qpn: inp.u32() & 0x00ff_ffff,
            });
        }
        e
    }

    fn atomic_eth(&self, inp: &mut Input<'_>) -> AtomicEthRepr {
        let region = self.data_region(inp);
        let r = &self.world.regions[region];
        let va = match inp.below(4) {
            0..=2 => r.base + (u64::from(inp.u8()) * 8) % (r.len as u64),
            _ => self.va(inp, region),
        };
        let rkey = self.rkey(inp, region);
        let current = self.world.word(rkey, va).unwrap_or(0);
        AtomicEthRepr {
            va,
            rkey,
            swap_add: match inp.below(3) {
                0 => 1,
                1 => u64::MAX,
                _ => inp.u64(),
            },
            // Half the time the value there, so COMPARE_SWAP really swaps.
            compare: if inp.u8() & 1 == 0 {
                current
            } else {
                inp.u64()
            },
        }
    }

    /// Payload length a well-formed packet at `position` would carry.
    fn natural_payload(&self, inp: &mut Input<'_>, info_pos: Position, f: &ExtHeaders) -> usize {
        let mtu = self.mtu as usize;
        match info_pos {
            Position::First | Position::Middle => mtu,
            Position::Last => 1 + inp.below(256) * mtu / 256,
            Position::Only => match f.reth {
                Some(r) if (r.dma_len as usize) <= mtu => r.dma_len as usize,
                _ => inp.below(256) * mtu / 255,
            },
        }
    }

    /// Emits a packet into `self.pkt`, payload filled from `seed`; returns its length.
    fn build(&mut self, bth: BthRepr, ext: ExtHeaders, payload_len: usize, seed: u8) -> usize {
        let mut bth = bth;
        // RC's SEND and WRITE opcodes (0x00..=0x0b) have UC twins 0x20 above them, with the
        // same headers.
        if self.service == Service::Uc && bth.opcode.0 <= 0x0b {
            bth.opcode = Opcode(bth.opcode.0 | 0x20);
        }
        let repr = PacketRepr::new(bth, ext, payload_len);
        let n = repr.emit(&mut self.pkt).expect("a built packet emits");
        let mut p = RocePacket::new_unchecked(&mut self.pkt[..n]);
        for (i, b) in p.payload_mut().iter_mut().enumerate() {
            *b = seed.wrapping_add(i as u8);
        }
        n
    }

    /// One request built from the opcode table (sometimes any opcode ferroce parses).
    fn single(&mut self, inp: &mut Input<'_>, flip: bool) {
        let b = inp.u8();
        let opcode = if b < 232 {
            REQUESTS[usize::from(b) % REQUESTS.len()]
        } else {
            ALL_OPCODES[inp.below(ALL_OPCODES.len())]
        };
        let info = opcode.info().expect("table opcode");
        let psn = self.psn(inp);
        let bth = self.bth(inp, opcode, psn);
        let ext = self.ext(inp, info.headers, Fields::default());
        let mut plen = if info.has_payload {
            self.natural_payload(inp, info.position, &ext)
        } else {
            0
        };
        if info.has_payload && inp.below(8) == 0 {
            plen = inp.below(256) * (self.mtu as usize + 64) / 255;
        }
        let n = self.build(bth, ext, plen, inp.u8());
        if flip {
            let at = usize::from(inp.u16()) % n;
            self.pkt[at] ^= 1 << inp.below(8);
        }
        let bytes = self.pkt[..n].to_vec();
        self.feed(&bytes);
    }

    /// A whole SEND or WRITE cut into packets as a requester cuts it, maybe with one packet
    /// dropped, repeated or two swapped.
    fn message(&mut self, inp: &mut Input<'_>) {
        let kind = inp.below(5);
        let mtu = self.mtu as u64;
        let total = match inp.below(4) {
            0 => u64::from(inp.u16()) % (mtu + 1),
            1 => mtu * (1 + inp.below(4) as u64),
            2 => mtu * (1 + inp.below(4) as u64) + 1 + u64::from(inp.u16()) % (mtu - 1),
            _ => 0,
        };
        let npk = packets_for(total, self.mtu);
        let write = kind >= 3;
        let reth = if write {
            let region = self.data_region(inp);
            let va = self.va(inp, region);
            let rkey = self.rkey(inp, region);
            Some(RethRepr {
                va,
                rkey,
                dma_len: self.dma_len(inp, total as u32),
            })
        } else {
            None
        };
        let imm = inp.u32();
        let ieth_region = self.data_region(inp);
        let ieth = self.rkey(inp, ieth_region);
        let mut order: Vec<u32> = (0..npk).collect();
        let j = inp.below(npk as usize) as u32;
        match inp.below(8) {
            0 => order.retain(|&k| k != j),
            1 => order.insert(j as usize, j),
            2 if npk > 1 => order.swap(j as usize, (j as usize + 1) % npk as usize),
            _ => {}
        }
        let first_psn = self.psn(inp);
        let every_ack = inp.u8() & 1 == 0;
        let seed = inp.u8();
        for k in order {
            let position = match (k == 0, k + 1 == npk) {
                (true, true) => Position::Only,
                (true, false) => Position::First,
                (false, true) => Position::Last,
                (false, false) => Position::Middle,
            };
            use Opcode as O;
            let opcode = match (kind, position) {
                (3 | 4, Position::First) => O::RC_RDMA_WRITE_FIRST,
                (3 | 4, Position::Middle) => O::RC_RDMA_WRITE_MIDDLE,
                (3, Position::Last) => O::RC_RDMA_WRITE_LAST,
                (3, Position::Only) => O::RC_RDMA_WRITE_ONLY,
                (4, Position::Last) => O::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
                (4, Position::Only) => O::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                (_, Position::First) => O::RC_SEND_FIRST,
                (_, Position::Middle) => O::RC_SEND_MIDDLE,
                (1, Position::Last) => O::RC_SEND_LAST_WITH_IMMEDIATE,
                (1, Position::Only) => O::RC_SEND_ONLY_WITH_IMMEDIATE,
                (2, Position::Last) => O::RC_SEND_LAST_WITH_INVALIDATE,
                (2, Position::Only) => O::RC_SEND_ONLY_WITH_INVALIDATE,
                (_, Position::Last) => O::RC_SEND_LAST,
                (_, Position::Only) => O::RC_SEND_ONLY,
            };
            let info = opcode.info().expect("table opcode");
            let mut ext = ExtHeaders::default();
            if info.headers.contains(HeaderSet::RETH) {
                ext.reth = reth;
            }
            if info.headers.contains(HeaderSet::IMMDT) {
                ext.immdt = Some(ImmDtRepr { value: imm });
            }
            if info.headers.contains(HeaderSet::IETH) {
                ext.ieth = Some(IethRepr { rkey: ieth });
            }
            let offset = u64::from(k) * mtu;
            let plen = (total - offset.min(total)).min(mtu) as usize;
            let bth = BthRepr {
                opcode,
                solicited: false,
                migreq: false,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qpn: QPN,
                ack_req: every_ack || position.ends_message(),
                psn: first_psn.add(k),
            };
            let n = self.build(bth, ext, plen, seed.wrapping_add(k as u8));
            let bytes = self.pkt[..n].to_vec();
            self.feed(&bytes);
        }
    }

    /// A READ at the expected PSN, then perhaps its duplicate as a requester's retry sends it
    /// (from packet `k`: the RETH moved on by `k` MTUs) or with fields of the input's choosing.
    fn read(&mut self, inp: &mut Input<'_>) {
        let region = self.data_region(inp);
        let r = self.world.regions[region].clone();
        let off = u64::from(inp.u16()) % r.len as u64;
        let len = (u64::from(inp.u16()) % (r.len as u64 - off + 1)) as u32;
        let reth = RethRepr {
            va: r.base + off,
            rkey: self.rkey(inp, region),
            dma_len: self.dma_len(inp, len),
        };
        let psn = self.psn(inp);
        let bth = self.bth(inp, Opcode::RC_RDMA_READ_REQUEST, psn);
        let ext = ExtHeaders {
            reth: Some(reth),
            ..Default::default()
        };
        let n = self.build(bth, ext, 0, 0);
        let bytes = self.pkt[..n].to_vec();
        self.feed(&bytes);
        if inp.below(2) == 0 {
            self.drain();
        }
        let npsn = packets_for(u64::from(reth.dma_len), self.mtu);
        let k = inp.below(npsn.min(256) as usize) as u32;
        let moved = u64::from(k) * u64::from(self.mtu);
        let dup = match inp.below(4) {
            0 | 1 => RethRepr {
                va: reth.va.wrapping_add(moved),
                dma_len: reth.dma_len.saturating_sub(moved as u32),
                ..reth
            },
            2 => RethRepr {
                dma_len: self.dma_len(inp, reth.dma_len),
                va: if inp.u8() & 1 == 0 {
                    reth.va
                } else {
                    self.va(inp, region)
                },
                ..reth
            },
            _ => return,
        };
        let bth = BthRepr {
            psn: psn.add(k),
            ..bth
        };
        let ext = ExtHeaders {
            reth: Some(dup),
            ..Default::default()
        };
        let n = self.build(bth, ext, 0, 0);
        let bytes = self.pkt[..n].to_vec();
        self.feed(&bytes);
    }

    /// An atomic, then perhaps the same packet again (a retry): it must not execute twice.
    fn atomic(&mut self, inp: &mut Input<'_>) {
        let opcode = if inp.u8() & 1 == 0 {
            Opcode::RC_COMPARE_SWAP
        } else {
            Opcode::RC_FETCH_ADD
        };
        let psn = self.psn(inp);
        let bth = self.bth(inp, opcode, psn);
        let a = self.atomic_eth(inp);
        let ext = ExtHeaders {
            atomic_eth: Some(a),
            ..Default::default()
        };
        let n = self.build(bth, ext, 0, 0);
        let bytes = self.pkt[..n].to_vec();
        self.feed(&bytes);
        if inp.below(2) == 0 {
            self.drain();
        }
        if inp.below(2) == 0 {
            self.feed(&bytes);
        }
    }

    fn raw(&mut self, inp: &mut Input<'_>) {
        let len = usize::from(inp.u16()) % 1200;
        let bytes = inp.bytes(len).to_vec();
        self.feed(&bytes);
    }

    fn recv(&mut self, inp: &mut Input<'_>) {
        let n = match inp.below(16) {
            0 => 0,
            1 => 5,
            k => 1 + k % 3,
        };
        let mut sgl = Vec::new();
        for _ in 0..n {
            let region = if inp.below(4) == 0 {
                self.data_region(inp)
            } else {
                self.world.named("recv").index
            };
            let r = self.world.regions[region].clone();
            let off = u64::from(inp.u16()) % r.len as u64;
            let addr = if inp.below(8) == 0 {
                self.va(inp, region)
            } else {
                r.base + off
            };
            let length = match inp.below(8) {
                0 => 0,
                1 => inp.u32(),
                2 => (r.len as u64 - off + 1) as u32,
                _ => (u64::from(inp.u16()) % (r.len as u64 - off + 1)) as u32,
            };
            let lkey = match inp.below(8) {
                0 => self.world.rkey(region),
                1 => inp.u32(),
                _ => self.world.lkey(region),
            };
            sgl.push(Sge { addr, length, lkey });
        }
        self.post_recv(sgl);
    }

    fn post_recv(&mut self, sgl: Vec<Sge>) {
        for s in &sgl {
            self.world.grant(
                PD,
                KeyKind::Local,
                s.lkey,
                s.addr,
                u64::from(s.length),
                Access::LOCAL_WRITE,
            );
        }
        let total: u64 = sgl.iter().map(|s| u64::from(s.length)).sum();
        let nsge = sgl.len();
        let wr_id = self.next_wr_id;
        self.next_wr_id += 1;
        let queued = self.qp.recv_queue_len();
        match self.qp.post_recv(RecvWr { wr_id, sgl }) {
            Ok(()) => self.posted.push_back((wr_id, total)),
            Err(PostError::QueueFull(cap)) => {
                assert_eq!(cap, self.caps.max_recv_wr);
                assert!(queued >= cap as usize, "QueueFull with {queued} of {cap}");
            }
            Err(PostError::TooManySge { given, max }) => {
                assert_eq!((given, max), (nsge, self.caps.max_recv_sge));
                assert!(nsge > self.caps.max_recv_sge as usize);
            }
            Err(e) => panic!("post_recv refused in {:?}: {e:?}", self.qp.state()),
        }
    }

    /// Hands one packet to the QP and checks what it did to PSNs and memory.
    fn feed(&mut self, bytes: &[u8]) {
        let parsed = RocePacket::new_checked(bytes)
            .ok()
            .and_then(|p| PacketRepr::parse(&p).ok());
        let expected = self.qp.expected_psn();
        let state = self.qp.state();
        let mut request = None;
        let own_transport = match self.service {
            Service::Rc => Transport::Rc,
            Service::Uc => Transport::Uc,
        };
        if let Some(repr) = &parsed {
            let info = repr.info().expect("a parsed packet has info");
            if info.transport == own_transport {
                self.grants(repr, info.operation, info.position);
                if !matches!(
                    info.operation,
                    Operation::Acknowledge
                        | Operation::AtomicAcknowledge
                        | Operation::RdmaReadResponse
                ) {
                    request = Some((repr, info.operation));
                }
            }
        }
        let serving = matches!(
            state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        );
        let request = request.filter(|_| serving);
        // A request that is not the expected one must leave memory alone (on UC, unless it
        // starts a message: there the sequence is taken up again).
        let starts = |r: &PacketRepr| r.info().is_ok_and(|i| i.position.starts_message());
        let uc = self.service == Service::Uc;
        let snap = request
            .filter(|(r, _)| r.bth.psn != expected && !(uc && starts(r)))
            .map(|_| self.world.snapshot());
        let atomic_before = request.and_then(|(r, op)| match (op, r.ext.atomic_eth) {
            (Operation::CompareSwap | Operation::FetchAdd, Some(a)) if r.bth.psn == expected => {
                Some((a, self.world.word(a.rkey, a.va)))
            }
            _ => None,
        });
        let mut mem = Audited {
            mem: &mut self.world.mem,
            pd: PD,
        };
        let res = self.qp.handle_packet(self.now, &mut mem, bytes);
        if trace() {
            eprintln!(
                "  in  {} -> {:?} epsn {} -> {}",
                describe(bytes),
                self.qp.state(),
                expected.value(),
                self.qp.expected_psn().value()
            );
        }
        assert_eq!(
            res.is_ok(),
            parsed.is_some(),
            "handle_packet and ferroce-wire disagree on {bytes:02x?}: {res:?}"
        );
        if let Some(snap) = snap {
            self.world
                .assert_unchanged(&snap, "a duplicate or out-of-sequence request");
        }
        let after = self.qp.expected_psn();
        if after != expected && uc {
            let Some((r, _)) = request else {
                panic!("the expected PSN moved {expected:?} -> {after:?} on a non-request");
            };
            assert!(
                after == r.bth.psn.next() || (after == r.bth.psn && starts(r)),
                "a UC packet at {:?} moved the expected PSN {expected:?} -> {after:?}",
                r.bth.psn
            );
        } else if after != expected {
            let Some((r, op)) = request else {
                panic!("the expected PSN moved {expected:?} -> {after:?} on a non-request");
            };
            assert_eq!(r.bth.psn, expected, "the expected PSN moved on another PSN");
            let step = after.distance_from(expected);
            if op == Operation::RdmaReadRequest {
                let reth = r.ext.reth.expect("a READ has a RETH");
                let npsn = packets_for(u64::from(reth.dma_len), self.mtu);
                assert_eq!(
                    step, npsn,
                    "a READ of {} moved the PSN by {step}",
                    reth.dma_len
                );
                assert!(
                    u64::from(reth.dma_len) <= 1 << 31,
                    "READ of {} accepted",
                    reth.dma_len
                );
                self.reads.push_back((r.bth.psn, npsn, self.mtu));
                if self.reads.len() > 64 {
                    self.reads.pop_front();
                }
            } else {
                assert_eq!(step, 1, "a {op:?} moved the PSN by {step}");
            }
            if let Some((a, before)) = atomic_before {
                let Some(old) = before else {
                    panic!(
                        "an atomic at {:#x} key {:#x} that no region holds was accepted",
                        a.va, a.rkey
                    );
                };
                let op = if r.bth.opcode == Opcode::RC_COMPARE_SWAP {
                    AtomicOp::CompareSwap {
                        compare: a.compare,
                        swap: a.swap_add,
                    }
                } else {
                    AtomicOp::FetchAdd { add: a.swap_add }
                };
                let now = self.world.word(a.rkey, a.va);
                assert_eq!(now, Some(op.apply(old)), "atomic {op:?} on {old:#x}");
                self.atomics.insert(r.bth.psn.value(), old);
            }
        }
    }

    /// Allows the writes a request may legitimately make: a WRITE's RETH range, an atomic's
    /// word, each in a region whose key, rights and protection domain fit.
    fn grants(&mut self, repr: &PacketRepr, op: Operation, pos: Position) {
        if let Some(ieth) = repr.ext.ieth {
            self.invalidations.push(ieth.rkey);
        }
        if op == Operation::RdmaWrite
            && pos.starts_message()
            && self.access.contains(Access::REMOTE_WRITE)
        {
            if let Some(r) = repr.ext.reth {
                self.world.grant(
                    PD,
                    KeyKind::Remote,
                    r.rkey,
                    r.va,
                    u64::from(r.dma_len),
                    Access::REMOTE_WRITE,
                );
            }
        }
        if matches!(op, Operation::CompareSwap | Operation::FetchAdd)
            && self.access.contains(Access::REMOTE_ATOMIC)
        {
            if let Some(a) = repr.ext.atomic_eth {
                if a.va % 8 == 0 {
                    self.world
                        .grant(PD, KeyKind::Remote, a.rkey, a.va, 8, Access::REMOTE_ATOMIC);
                }
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
            n += 1;
            assert_eq!(
                self.service,
                Service::Rc,
                "a UC QP sent {}",
                describe(&self.tx[..len])
            );
            assert!(
                n <= MAX_PACKETS_PER_DRAIN,
                "more than {MAX_PACKETS_PER_DRAIN} packets queued at once"
            );
            if trace() {
                eprintln!("  out {}", describe(&self.tx[..len]));
            }
            let repr = check_emitted(&self.tx[..len], 4096, PEER_QPN);
            self.check_response(&repr);
        }
        self.world.check("poll_transmit");
        while let Some(wc) = self.qp.poll_completion() {
            if trace() {
                eprintln!("  wc  {wc:?}");
            }
            assert_eq!(wc.qp_num, QPN, "completion of another QP");
            assert!(
                matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm),
                "a send completion {wc:?} though nothing was posted to send"
            );
            let (id, total) = self
                .posted
                .pop_front()
                .unwrap_or_else(|| panic!("receive completion {wc:?} with none posted"));
            assert_eq!(wc.wr_id, id, "receive completions out of posting order");
            assert!(
                matches!(
                    wc.status,
                    WcStatus::Success
                        | WcStatus::LocalLengthError
                        | WcStatus::LocalProtectionError
                        | WcStatus::RemoteInvalidRequestError
                        | WcStatus::WorkRequestFlushed
                ),
                "a receive completed with {:?}",
                wc.status
            );
            if wc.status == WcStatus::Success && wc.opcode == WcOpcode::Recv {
                assert!(
                    u64::from(wc.byte_len) <= total,
                    "received {} bytes into {total}",
                    wc.byte_len
                );
            }
            if let Some(k) = wc.invalidated_rkey {
                assert!(
                    self.keys.iter().any(|h| h.contains(&k)),
                    "invalidated key {k:#x} was never a region's"
                );
            }
        }
        if self.qp.state() == QpState::Error {
            assert!(
                self.posted.is_empty(),
                "in ERR with {} receives never completed",
                self.posted.len()
            );
        } else {
            assert_eq!(
                self.qp.recv_queue_len(),
                self.posted.len(),
                "receive queue length"
            );
        }
    }

    fn check_response(&self, repr: &PacketRepr) {
        let op = repr.bth.opcode;
        let info = repr.info().expect("checked");
        let psn = repr.bth.psn;
        let expected = self.qp.expected_psn();
        match info.operation {
            Operation::Acknowledge => {
                let aeth = repr.ext.aeth.expect("an ACK has an AETH");
                match aeth.syndrome {
                    Syndrome::Ack { .. } => assert!(
                        psn.is_before(expected),
                        "ACK of {psn:?}, not yet received (expected {expected:?})"
                    ),
                    Syndrome::RnrNak { timer } => {
                        assert_eq!(timer, self.min_rnr_timer, "RNR NAK timer");
                        assert!(!psn.is_after(expected), "RNR NAK of a future PSN");
                    }
                    Syndrome::Nak(NakCode::PsnSequenceError) => {
                        assert!(
                            !psn.is_after(expected),
                            "sequence NAK past the expected PSN"
                        )
                    }
                    Syndrome::Nak(code) => {
                        assert!(
                            matches!(
                                code,
                                NakCode::InvalidRequest
                                    | NakCode::RemoteAccessError
                                    | NakCode::RemoteOperationalError
                            ),
                            "NAK code {code:?}"
                        );
                        assert_eq!(
                            self.qp.state(),
                            QpState::Error,
                            "a fatal NAK {code:?} from a QP not in ERR"
                        );
                    }
                    Syndrome::Reserved(v) => panic!("reserved syndrome {v}"),
                }
            }
            Operation::AtomicAcknowledge => {
                let orig = repr
                    .ext
                    .atomic_ack_eth
                    .expect("has an AtomicAckETH")
                    .original;
                if let Some(&want) = self.atomics.get(&psn.value()) {
                    assert_eq!(orig, want, "ATOMIC ACK of {psn:?} carries another value");
                } else {
                    panic!("ATOMIC ACK of {psn:?}, which no accepted atomic had");
                }
            }
            Operation::RdmaReadResponse => {
                let Some(&(_, _, mtu)) = self
                    .reads
                    .iter()
                    .rev()
                    .find(|&&(f, n, _)| psn.distance_from(f) < n)
                else {
                    panic!(
                        "READ response at {psn:?} outside every accepted READ {:?}",
                        self.reads
                    );
                };
                assert!(
                    repr.payload_len <= mtu as usize,
                    "{op:?} over its READ's MTU"
                );
                if matches!(info.position, Position::First | Position::Middle) {
                    assert_eq!(
                        repr.payload_len, mtu as usize,
                        "{op:?} not a full MTU of its READ"
                    );
                }
            }
            _ => panic!("the responder sent a request {op:?}"),
        }
    }

    /// Checks that hold after any step.
    fn after_step(&mut self, what: &str) {
        self.world.check(what);
        for (i, r) in self.world.regions.iter().enumerate() {
            let now = self.world.rkey(r.index);
            let hist = &mut self.keys[i];
            let was = *hist.last().expect("a key");
            if now != was {
                assert_eq!(now, 0, "region '{}' key changed to {now:#x}", r.name);
                assert!(
                    self.invalidations.contains(&was),
                    "key {was:#x} of '{}' invalidated though no packet named it",
                    r.name
                );
                hist.push(now);
            }
        }
        self.invalidations.clear();
        assert!(self.qp.recv_queue_len() <= self.caps.max_recv_wr as usize);
    }

    /// Re-registers a region under a new key (the old one becomes stale).
    fn rotate(&mut self, inp: &mut Input<'_>) {
        let region = self.data_region(inp);
        self.rotations += 1;
        let key = ((region as u32) << 8) | 0x80 | (self.rotations & 0x7f);
        let key = key | (self.rotations >> 7) << 20;
        self.world.mem.region_mut(region).rkey = key;
        self.keys[region].push(key);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input::new(data);
    let mut h = Harness::new(&mut inp);
    h.after_step("setup");
    let mut steps = 0;
    while !inp.is_empty() && steps < MAX_STEPS {
        steps += 1;
        let what = match inp.below(32) {
            0..=9 | 30 | 31 => {
                h.single(&mut inp, false);
                "request"
            }
            10..=13 => {
                h.message(&mut inp);
                "message"
            }
            14 | 15 => {
                h.read(&mut inp);
                "READ"
            }
            16 => {
                h.atomic(&mut inp);
                "atomic"
            }
            17..=19 => {
                h.recv(&mut inp);
                "post_recv"
            }
            20 | 21 => {
                h.drain();
                "drain"
            }
            22 => {
                h.raw(&mut inp);
                "raw bytes"
            }
            23 => {
                h.single(&mut inp, true);
                "flipped request"
            }
            24 => {
                h.now = h.now + core::time::Duration::from_nanos(u64::from(inp.u32()) << 8);
                h.qp.handle_timeout(h.now);
                "timeout"
            }
            25 => {
                h.rotate(&mut inp);
                "re-registration"
            }
            26 => {
                let mtu = MTUS[inp.below(MTUS.len())];
                let state = h.qp.state();
                match h.qp.set_path_mtu(mtu) {
                    Ok(()) => h.mtu = mtu.bytes(),
                    Err(e) => assert_eq!(state, QpState::Error, "MTU change refused: {e}"),
                }
                "MTU change"
            }
            27 => {
                h.qp.modify_to_error();
                "modify to ERR"
            }
            _ => {
                h.reconnect(&mut inp);
                "reconnect"
            }
        };
        if trace() {
            eprintln!(
                "step {steps}: {what} (state {:?}, mtu {})",
                h.qp.state(),
                h.mtu
            );
        }
        h.after_step(what);
    }
    h.drain();
    h.after_step("final drain");
});
