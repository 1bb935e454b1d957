//! Loss recovery when retries and their network copies overlap, driven packet by packet: each
//! case reproduces a failure first seen through the chaos relay on real sockets (5% loss,
//! reordering and duplication), where the responder handles a whole batch of received packets
//! before it transmits. Then READ retries in pieces (what `ferroce_proto::requester`'s module
//! doc argues), each case between two real QPs unless it says which responder it imitates.

use ferroce_proto::sim::ack_packet;
use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{
    Access, Instant, PathMtu, QpCaps, QpState, QueuePair, RtrAttr, RtsAttr, SendOp, SendWr, Sge,
    VecMemory, WcOpcode, WcStatus,
};
use ferroce_wire::aeth::{AethRepr, NakCode, Syndrome};
use ferroce_wire::bth::{BthRepr, DEFAULT_PKEY};
use ferroce_wire::{ExtHeaders, Opcode, PacketRepr, Psn, RocePacket};

const A_QPN: u32 = 0x11;
const B_QPN: u32 = 0x22;
const A_PSN: u32 = 1000;
const B_PSN: u32 = 5000;

/// Two QPs in RTS, each pointing at the other, MTU 256, 16 READ/atomic resources each way.
/// No congestion control: the loss window alone (what these cases follow packet by packet).
const OFF: ferroce_proto::CcConfig = ferroce_proto::CcConfig {
    algorithm: ferroce_proto::CcAlgorithm::Off,
    target_delay: ferroce_proto::cc::DEFAULT_TARGET_DELAY,
};

fn pair() -> (QueuePair, QueuePair) {
    let make = |qpn, peer, sq, rq| {
        let rtr = RtrAttr {
            path_mtu: PathMtu::Mtu256,
            max_dest_rd_atomic: 16,
            ..default_rtr(peer, Psn::new(rq))
        };
        let rts = RtsAttr {
            sq_psn: Psn::new(sq),
            max_rd_atomic: 16,
            ..default_rts()
        };
        let mut qp = connected_qp(qpn, QpCaps::default(), &rtr, &rts);
        // These cases follow the loss window packet by packet: no congestion control.
        qp.set_congestion_control(OFF);
        qp
    };
    (
        make(A_QPN, B_QPN, A_PSN, B_PSN),
        make(B_QPN, A_QPN, B_PSN, A_PSN),
    )
}

fn drain(q: &mut QueuePair, now: Instant, mem: &mut VecMemory) -> Vec<Vec<u8>> {
    ferroce_proto::sim::pair::transmit_all(q, now, mem)
}

fn psn_of(p: &[u8]) -> u32 {
    RocePacket::new_checked(p).unwrap().bth().psn().value()
}

fn nak(psn: u32) -> Vec<u8> {
    ack_packet(
        A_QPN,
        Psn::new(psn),
        Syndrome::Nak(NakCode::PsnSequenceError),
    )
}

/// The responder had executed 11 of 16 atomics when the requester's retry of all 16 and a
/// network copy of that retry arrived in one batch. Answers to duplicates hold no resource:
/// the five new atomics are within `max_dest_rd_atomic`, not "one too many" (which sent an
/// invalid-request NAK and killed the QP), and every atomic is answered exactly once.
#[test]
fn a_retried_atomic_window_and_its_network_copy_are_answered_once_each() {
    let (mut a, mut b) = pair();
    let mut ma = VecMemory::new();
    let results = ma.register(1, 0x1000, 8 * 16, Access::ALL);
    let lkey = ma.region(results).lkey;
    let mut mb = VecMemory::new();
    let counter = mb.register(1, 0x8000, 8, Access::ALL);
    let rkey = mb.region(counter).rkey;
    for k in 0..16u64 {
        let sge = Sge {
            addr: 0x1000 + 8 * k,
            length: 8,
            lkey,
        };
        a.post_send(SendWr::new(k, SendOp::FetchAdd { add: 1 }, vec![sge]).remote(0x8000, rkey))
            .unwrap();
    }
    let now = Instant::from_nanos(1_000);
    let requests = drain(&mut a, now, &mut ma);
    assert_eq!(requests.len(), 16);
    for r in &requests[..11] {
        b.handle_packet(now, &mut mb, r).unwrap();
    }
    for _copy in 0..2 {
        for r in &requests[..11] {
            b.handle_packet(now, &mut mb, r).unwrap();
        }
    }
    for r in &requests[11..] {
        b.handle_packet(now, &mut mb, r).unwrap();
    }
    assert_eq!(b.state(), QpState::Rts);
    assert_eq!(b.counters().send_invalid_request, 0);
    let answers = drain(&mut b, now, &mut mb);
    let psns: Vec<u32> = answers.iter().map(|p| psn_of(p)).collect();
    assert_eq!(
        psns,
        (A_PSN..A_PSN + 16).collect::<Vec<_>>(),
        "each answered once, in order"
    );
    assert_eq!(
        mb.region(counter).bytes,
        16u64.to_le_bytes(),
        "executed exactly once each"
    );
    for p in &answers {
        a.handle_packet(now, &mut ma, p).unwrap();
    }
    for k in 0..16u64 {
        let wc = a.poll_completion().unwrap();
        assert_eq!((wc.wr_id, wc.status), (k, WcStatus::Success));
        let got = &ma.region(results).bytes[8 * k as usize..8 * k as usize + 8];
        assert_eq!(got, k.to_le_bytes(), "original of FETCH_ADD {k}");
    }
}

/// The requester got the first 2 of 8 READ response packets, timed out and asked again from
/// the third. The responder, still sending its first answer, restarts it from there rather than
/// queueing a second answer behind the first (whose rest the requester would drop, and whose
/// draining could outlast the requester's next timeout, and so on).
#[test]
fn a_duplicate_read_restarts_the_answer_under_way() {
    let (mut a, mut b) = pair();
    let len = 8 * 256;
    let mut ma = VecMemory::new();
    let dst = ma.register(1, 0x1000, len, Access::ALL);
    let lkey = ma.region(dst).lkey;
    let mut mb = VecMemory::new();
    let src = mb.register(1, 0x8000, len, Access::ALL);
    let rkey = mb.region(src).rkey;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 256) as u8).collect();
    mb.region_mut(src).bytes.copy_from_slice(&data);
    let sge = Sge {
        addr: 0x1000,
        length: len as u32,
        lkey,
    };
    a.post_send(SendWr::new(9, SendOp::Read, vec![sge]).remote(0x8000, rkey))
        .unwrap();
    let t0 = Instant::from_nanos(1_000);
    let request = drain(&mut a, t0, &mut ma);
    assert_eq!(request.len(), 1);
    b.handle_packet(t0, &mut mb, &request[0]).unwrap();
    let mut buf = vec![0u8; 4096];
    let mut first = Vec::new();
    for _ in 0..3 {
        let n = b.poll_transmit(t0, &mut mb, &mut buf).unwrap();
        first.push(buf[..n].to_vec());
    }
    for p in &first[..2] {
        a.handle_packet(t0, &mut ma, p).unwrap();
    }
    let t1 = a.next_timeout().expect("the READ is outstanding");
    a.handle_timeout(t1);
    let retry = drain(&mut a, t1, &mut ma);
    assert_eq!(
        retry.iter().map(|p| psn_of(p)).collect::<Vec<_>>(),
        vec![A_PSN + 2]
    );
    b.handle_packet(t1, &mut mb, &retry[0]).unwrap();
    let rest = drain(&mut b, t1, &mut mb);
    let psns: Vec<u32> = rest.iter().map(|p| psn_of(p)).collect();
    assert_eq!(
        psns,
        (A_PSN + 2..A_PSN + 8).collect::<Vec<_>>(),
        "one answer, from the retry's PSN"
    );
    for p in &rest {
        a.handle_packet(t1, &mut ma, p).unwrap();
    }
    let wc = a.poll_completion().unwrap();
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::Success));
    assert_eq!(ma.region(dst).bytes, data);
}

/// After a sequence-error NAK made the requester resend from PSN 3 of 10, a NAK for PSN 5
/// says packets 3 and 4 of the new pass arrived and 5 did not: the requester acts on it at once
/// (resending from 5) instead of leaving the loss to the ACK timer, which at 1% loss on a
/// window of a thousand packets would cost a timeout per pass. A second copy of that NAK is
/// the same news and changes nothing.
#[test]
fn a_fresh_loss_inside_a_resend_is_resent_at_once_and_only_once() {
    let (mut a, _b) = pair();
    let mut ma = VecMemory::new();
    let src = ma.register(1, 0x1000, 10 * 256, Access::ALL);
    let lkey = ma.region(src).lkey;
    let sge = Sge {
        addr: 0x1000,
        length: 10 * 256,
        lkey,
    };
    a.post_send(SendWr::new(1, SendOp::Write, vec![sge]).remote(0x9000, 0x77))
        .unwrap();
    let now = Instant::from_nanos(1_000);
    assert_eq!(drain(&mut a, now, &mut ma).len(), 10);
    a.handle_packet(now, &mut ma, &nak(A_PSN + 3)).unwrap();
    let pass: Vec<u32> = drain(&mut a, now, &mut ma)
        .iter()
        .map(|p| psn_of(p))
        .collect();
    assert_eq!(pass, (A_PSN + 3..A_PSN + 10).collect::<Vec<_>>());
    a.handle_packet(now, &mut ma, &nak(A_PSN + 5)).unwrap();
    assert_eq!(
        a.unacked_psn(),
        Psn::new(A_PSN + 5),
        "the NAK acknowledges 3 and 4"
    );
    let again: Vec<u32> = drain(&mut a, now, &mut ma)
        .iter()
        .map(|p| psn_of(p))
        .collect();
    assert_eq!(again, (A_PSN + 5..A_PSN + 10).collect::<Vec<_>>());
    a.handle_packet(now, &mut ma, &nak(A_PSN + 5)).unwrap();
    assert!(
        drain(&mut a, now, &mut ma).is_empty(),
        "a copy of the same NAK is no news"
    );
    assert_eq!(a.counters().retransmits, 12);
    assert_eq!(a.counters().rcvd_seq_err, 3);
}

fn ack(psn: u32) -> Vec<u8> {
    ack_packet(A_QPN, Psn::new(psn), Syndrome::Ack { credits: 31 })
}

/// Each go-back halves the send window, and acknowledged PSNs grow it back: after a loss in a
/// full window of 1024 packets the resend covers 512, and once those are acknowledged the
/// window is full again.
#[test]
fn a_loss_halves_the_window_and_acknowledgements_restore_it() {
    let (mut a, _b) = pair();
    let mut ma = VecMemory::new();
    let len = 3000 * 256;
    let src = ma.register(1, 0x10_0000, len, Access::ALL);
    let lkey = ma.region(src).lkey;
    let sge = Sge {
        addr: 0x10_0000,
        length: len as u32,
        lkey,
    };
    a.post_send(SendWr::new(1, SendOp::Write, vec![sge]).remote(0x9000, 0x77))
        .unwrap();
    let now = Instant::from_nanos(1_000);
    assert_eq!(drain(&mut a, now, &mut ma).len(), 1024, "the full window");
    a.handle_packet(now, &mut ma, &nak(A_PSN + 100)).unwrap();
    let resend: Vec<u32> = drain(&mut a, now, &mut ma)
        .iter()
        .map(|p| psn_of(p))
        .collect();
    assert_eq!(
        resend,
        (A_PSN + 100..A_PSN + 612).collect::<Vec<_>>(),
        "half a window"
    );
    a.handle_packet(now, &mut ma, &ack(A_PSN + 611)).unwrap();
    let next = drain(&mut a, now, &mut ma);
    assert_eq!(
        next.len(),
        1024,
        "512 acknowledged PSNs grew it back to the full window"
    );
    assert_eq!(psn_of(&next[0]), A_PSN + 612);
}

// ---- READ retries in pieces ------------------------------------------------------------------
//
// A READ longer than the requester's window (1100 packets of 256 bytes; the window is 1024
// PSNs, halved by each loss) shows what a retry asks for: one piece of the rest, at most the
// loss window's worth of packets, from the first missing response, then the next piece once
// that one is in.

const MTU: usize = 256;
const BIG_READ_PKTS: usize = 1100;
const DST_BASE: u64 = 0x10_0000;
const SRC_BASE: u64 = 0x80_0000;

/// The bytes B serves: every packet's worth differs from its neighbours'.
fn source_bytes(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ (i / MTU).wrapping_mul(13) as u8)
        .collect()
}

struct ReadSetup {
    a: QueuePair,
    b: QueuePair,
    ma: VecMemory,
    mb: VecMemory,
    dst: usize,
    src_rkey: u32,
    data: Vec<u8>,
}

impl ReadSetup {
    /// Posts the READ of the whole region as work request `wr_id`.
    fn post_read(&mut self, wr_id: u64) {
        let sge = Sge {
            addr: DST_BASE,
            length: self.data.len() as u32,
            lkey: self.ma.region(self.dst).lkey,
        };
        self.a
            .post_send(SendWr::new(wr_id, SendOp::Read, vec![sge]).remote(SRC_BASE, self.src_rkey))
            .unwrap();
    }
}

/// A READ of `pkts` packets from B's region into A's, posted as work request `wr_id`.
fn read_setup(pkts: usize, wr_id: u64) -> ReadSetup {
    let mut s = regions(pkts);
    s.post_read(wr_id);
    s
}

/// A pair and the regions of a READ of `pkts` packets from B to A, nothing posted.
fn regions(pkts: usize) -> ReadSetup {
    let (a, b) = pair();
    let len = pkts * MTU;
    let mut ma = VecMemory::new();
    let dst = ma.register(1, DST_BASE, len, Access::ALL);
    let mut mb = VecMemory::new();
    let src = mb.register(1, SRC_BASE, len, Access::ALL);
    let src_rkey = mb.region(src).rkey;
    let data = source_bytes(len);
    mb.region_mut(src).bytes.copy_from_slice(&data);
    ReadSetup {
        a,
        b,
        ma,
        mb,
        dst,
        src_rkey,
        data,
    }
}

fn repr_of(p: &[u8]) -> PacketRepr {
    PacketRepr::parse(&RocePacket::new_checked(p).unwrap()).unwrap()
}

/// `(PSN, remote address, length)` of a READ request.
fn read_request(p: &[u8]) -> (u32, u64, u32) {
    let r = repr_of(p);
    assert_eq!(r.bth.opcode, Opcode::RC_RDMA_READ_REQUEST, "{r:?}");
    let reth = r.ext.reth.expect("a READ request carries a RETH");
    assert_eq!(r.bth.dest_qpn, B_QPN);
    (r.bth.psn.value(), reth.va, reth.dma_len)
}

/// Asserts `answer` is exactly one READ answer for response packets `[from, to)`: one packet
/// per PSN in order, FIRST (or ONLY) to LAST, each carrying the source bytes of its PSN.
fn assert_answers(answer: &[Vec<u8>], from: usize, to: usize, data: &[u8]) {
    let psns: Vec<u32> = answer.iter().map(|p| psn_of(p)).collect();
    let want: Vec<u32> = (from..to).map(|k| A_PSN + k as u32).collect();
    assert_eq!(psns, want, "the answer covers exactly the piece asked for");
    for (i, p) in answer.iter().enumerate() {
        let k = from + i;
        let pkt = RocePacket::new_checked(&p[..]).unwrap();
        let opcode = pkt.opcode();
        let expected = match (i == 0, k + 1 == to) {
            (true, true) => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
            (true, false) => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
            (false, true) => Opcode::RC_RDMA_READ_RESPONSE_LAST,
            (false, false) => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
        };
        assert_eq!(opcode, expected, "response {k}");
        let end = ((k + 1) * MTU).min(data.len());
        assert_eq!(pkt.payload(), &data[k * MTU..end], "bytes of response {k}");
    }
}

fn feed(q: &mut QueuePair, now: Instant, mem: &mut VecMemory, packets: &[Vec<u8>]) {
    for p in packets {
        q.handle_packet(now, mem, p).unwrap();
    }
}

/// The answer to the original READ was lost from packet 300 on (a burst). The retry asks for
/// one piece, half the window (512 packets), not the 800 left; the responder, which executed
/// the original, serves the piece as a duplicate inside it — exactly those PSNs, ending with a
/// LAST — and once it is in, the window is back to full and the next piece is the rest.
#[test]
fn a_read_retry_after_a_burst_loss_asks_for_a_window_sized_piece() {
    let mut s = read_setup(BIG_READ_PKTS, 7);
    let t0 = Instant::from_nanos(1_000);
    let original = drain(&mut s.a, t0, &mut s.ma);
    assert_eq!(original.len(), 1);
    assert_eq!(
        read_request(&original[0]),
        (A_PSN, SRC_BASE, (BIG_READ_PKTS * MTU) as u32),
        "the first transmission asks for the whole message"
    );
    s.b.handle_packet(t0, &mut s.mb, &original[0]).unwrap();
    let answer = drain(&mut s.b, t0, &mut s.mb);
    assert_answers(&answer, 0, BIG_READ_PKTS, &s.data);
    feed(&mut s.a, t0, &mut s.ma, &answer[..300]);

    let t1 = s.a.next_timeout().expect("the READ is outstanding");
    s.a.handle_timeout(t1);
    let retry = drain(&mut s.a, t1, &mut s.ma);
    assert_eq!(retry.len(), 1);
    assert_eq!(
        read_request(&retry[0]),
        (A_PSN + 300, SRC_BASE + 300 * MTU as u64, (512 * MTU) as u32),
        "a piece of half the window, from the first missing response"
    );
    s.b.handle_packet(t1, &mut s.mb, &retry[0]).unwrap();
    assert_eq!(s.b.counters().duplicate_request, 1);
    let piece = drain(&mut s.b, t1, &mut s.mb);
    assert_answers(&piece, 300, 812, &s.data);
    feed(&mut s.a, t1, &mut s.ma, &piece);
    assert!(s.a.poll_completion().is_none(), "288 packets still missing");

    let next = drain(&mut s.a, t1, &mut s.ma);
    assert_eq!(next.len(), 1);
    assert_eq!(
        read_request(&next[0]),
        (
            A_PSN + 812,
            SRC_BASE + 812 * MTU as u64,
            ((BIG_READ_PKTS - 812) * MTU) as u32
        ),
        "the window grew back: the next piece is the rest"
    );
    s.b.handle_packet(t1, &mut s.mb, &next[0]).unwrap();
    let rest = drain(&mut s.b, t1, &mut s.mb);
    assert_answers(&rest, 812, BIG_READ_PKTS, &s.data);
    feed(&mut s.a, t1, &mut s.ma, &rest);
    let wc = s.a.poll_completion().expect("the READ completes");
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len as usize),
        (
            7,
            WcStatus::Success,
            WcOpcode::RdmaRead,
            BIG_READ_PKTS * MTU
        )
    );
    assert!(s.a.poll_completion().is_none());
    assert_eq!(s.ma.region(s.dst).bytes, s.data, "every byte read");
    assert_eq!(s.a.counters().retransmits, 2);
    assert_eq!(s.b.state(), QpState::Rts);
}

/// The original READ request was lost; the WRITE after it drew a PSN-sequence NAK. The retry
/// asks for a piece at the READ's first PSN, which the responder executes as a fresh, shorter
/// READ (its expected PSN moves to the piece's end); the next piece arrives exactly there and
/// is executed fresh too. Nothing after the READ is sent while a piece is answered, so the
/// WRITE goes again only behind the READ's last piece, at its own PSNs, and is accepted.
#[test]
fn a_lost_read_request_is_asked_for_again_in_pieces_each_executed_fresh() {
    // 1000 packets: the READ and the WRITE fit the first window together.
    let pkts = 1000;
    let mut s = read_setup(pkts, 1);
    let wlen = 600;
    let wsrc = s.ma.register(1, 0x40_0000, wlen, Access::ALL);
    let wdata: Vec<u8> = (0..wlen).map(|i| (i * 3 + 1) as u8).collect();
    s.ma.region_mut(wsrc).bytes.copy_from_slice(&wdata);
    let wlkey = s.ma.region(wsrc).lkey;
    let wdst = s.mb.register(1, 0x90_0000, wlen, Access::ALL);
    let wrkey = s.mb.region(wdst).rkey;
    let sge = Sge {
        addr: 0x40_0000,
        length: wlen as u32,
        lkey: wlkey,
    };
    s.a.post_send(SendWr::new(2, SendOp::Write, vec![sge]).remote(0x90_0000, wrkey))
        .unwrap();
    let t0 = Instant::from_nanos(1_000);
    let first = drain(&mut s.a, t0, &mut s.ma);
    let psns: Vec<u32> = first.iter().map(|p| psn_of(p)).collect();
    let write_psn = A_PSN + pkts as u32;
    assert_eq!(psns, vec![A_PSN, write_psn, write_psn + 1, write_psn + 2]);
    // The READ request is lost; the WRITE arrives out of sequence.
    feed(&mut s.b, t0, &mut s.mb, &first[1..]);
    let nak = drain(&mut s.b, t0, &mut s.mb);
    assert_eq!(nak.len(), 1, "one sequence-error NAK");
    assert_eq!(psn_of(&nak[0]), A_PSN);
    s.a.handle_packet(t0, &mut s.ma, &nak[0]).unwrap();

    let retry = drain(&mut s.a, t0, &mut s.ma);
    assert_eq!(retry.len(), 1, "only the piece: the WRITE waits behind it");
    assert_eq!(
        read_request(&retry[0]),
        (A_PSN, SRC_BASE, (512 * MTU) as u32)
    );
    s.b.handle_packet(t0, &mut s.mb, &retry[0]).unwrap();
    assert_eq!(
        s.b.expected_psn(),
        Psn::new(A_PSN + 512),
        "executed as a fresh READ of 512 packets"
    );
    let piece = drain(&mut s.b, t0, &mut s.mb);
    assert_answers(&piece, 0, 512, &s.data);
    feed(&mut s.a, t0, &mut s.ma, &piece);

    let next = drain(&mut s.a, t0, &mut s.ma);
    let psns: Vec<u32> = next.iter().map(|p| psn_of(p)).collect();
    assert_eq!(
        psns,
        vec![A_PSN + 512, write_psn, write_psn + 1, write_psn + 2],
        "the READ's last piece, then the WRITE"
    );
    assert_eq!(
        read_request(&next[0]),
        (
            A_PSN + 512,
            SRC_BASE + 512 * MTU as u64,
            ((pkts - 512) * MTU) as u32
        )
    );
    feed(&mut s.b, t0, &mut s.mb, &next);
    assert_eq!(s.b.expected_psn(), Psn::new(write_psn + 3));
    assert_eq!(s.b.counters().duplicate_request, 0, "every piece was new");
    let answers = drain(&mut s.b, t0, &mut s.mb);
    assert_answers(&answers[..pkts - 512], 512, pkts, &s.data);
    assert_eq!(answers.len(), pkts - 512 + 1, "and the WRITE's ACK");
    feed(&mut s.a, t0, &mut s.ma, &answers);
    let wcs: Vec<_> = std::iter::from_fn(|| s.a.poll_completion())
        .map(|wc| (wc.wr_id, wc.status, wc.opcode))
        .collect();
    assert_eq!(
        wcs,
        vec![
            (1, WcStatus::Success, WcOpcode::RdmaRead),
            (2, WcStatus::Success, WcOpcode::RdmaWrite)
        ]
    );
    assert_eq!(s.ma.region(s.dst).bytes, s.data);
    assert_eq!(s.mb.region(wdst).bytes, wdata);
}

/// The original READ request and then the first piece (512 packets) were lost; the next
/// timeout halves the window again and asks for 256. The responder executes that one fresh.
/// The first piece was only late: when it arrives it reaches past what the responder
/// executed, so it is no duplicate the responder can serve, and it is dropped (rxe drops it
/// too) — which is why the requester's next piece stops at the first piece's end (512) rather
/// than asking past it: had the late 512-packet piece been the one executed, a longer request
/// would be dropped in turn, forever.
#[test]
fn a_lost_read_piece_is_asked_for_again_and_its_late_copy_is_ignored() {
    let mut s = read_setup(BIG_READ_PKTS, 3);
    let t0 = Instant::from_nanos(1_000);
    assert_eq!(drain(&mut s.a, t0, &mut s.ma).len(), 1, "lost");
    let t1 = s.a.next_timeout().unwrap();
    s.a.handle_timeout(t1);
    let late = drain(&mut s.a, t1, &mut s.ma);
    assert_eq!(late.len(), 1);
    assert_eq!(
        read_request(&late[0]),
        (A_PSN, SRC_BASE, (512 * MTU) as u32)
    );
    let t2 = s.a.next_timeout().unwrap();
    s.a.handle_timeout(t2);
    let retry = drain(&mut s.a, t2, &mut s.ma);
    assert_eq!(retry.len(), 1);
    assert_eq!(
        read_request(&retry[0]),
        (A_PSN, SRC_BASE, (256 * MTU) as u32)
    );

    s.b.handle_packet(t2, &mut s.mb, &retry[0]).unwrap();
    assert_eq!(s.b.expected_psn(), Psn::new(A_PSN + 256));
    let piece = drain(&mut s.b, t2, &mut s.mb);
    assert_answers(&piece, 0, 256, &s.data);
    s.b.handle_packet(t2, &mut s.mb, &late[0]).unwrap();
    assert!(
        drain(&mut s.b, t2, &mut s.mb).is_empty(),
        "the late, longer piece is not served"
    );
    assert_eq!(s.b.counters().duplicate_request, 1);
    assert_eq!(s.b.state(), QpState::Rts);

    feed(&mut s.a, t2, &mut s.ma, &piece);
    let next = drain(&mut s.a, t2, &mut s.ma);
    assert_eq!(next.len(), 1);
    assert_eq!(
        read_request(&next[0]),
        (A_PSN + 256, SRC_BASE + 256 * MTU as u64, (256 * MTU) as u32),
        "up to the lost piece's end, though the window (now 512) allows more"
    );
    s.b.handle_packet(t2, &mut s.mb, &next[0]).unwrap();
    let piece = drain(&mut s.b, t2, &mut s.mb);
    assert_answers(&piece, 256, 512, &s.data);
    feed(&mut s.a, t2, &mut s.ma, &piece);

    let last = drain(&mut s.a, t2, &mut s.ma);
    assert_eq!(last.len(), 1);
    assert_eq!(
        read_request(&last[0]),
        (
            A_PSN + 512,
            SRC_BASE + 512 * MTU as u64,
            ((BIG_READ_PKTS - 512) * MTU) as u32
        )
    );
    s.b.handle_packet(t2, &mut s.mb, &last[0]).unwrap();
    let rest = drain(&mut s.b, t2, &mut s.mb);
    assert_answers(&rest, 512, BIG_READ_PKTS, &s.data);
    feed(&mut s.a, t2, &mut s.ma, &rest);
    let wc = s.a.poll_completion().expect("the READ completes");
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::Success));
    assert_eq!(s.ma.region(s.dst).bytes, s.data);
    assert_eq!(
        s.b.counters().duplicate_request,
        1,
        "every other piece was new"
    );
}

/// Responses that arrive after a gap are placed at once (their bytes do not depend on which
/// request they answer), so the retry asks for the hole alone and the READ completes when it
/// is filled.
#[test]
fn read_responses_after_a_gap_are_kept_and_only_the_hole_is_asked_again() {
    let mut s = read_setup(8, 4);
    let t0 = Instant::from_nanos(1_000);
    let request = drain(&mut s.a, t0, &mut s.ma);
    s.b.handle_packet(t0, &mut s.mb, &request[0]).unwrap();
    let answer = drain(&mut s.b, t0, &mut s.mb);
    assert_eq!(answer.len(), 8);
    feed(&mut s.a, t0, &mut s.ma, &answer[..2]);
    feed(&mut s.a, t0, &mut s.ma, &answer[3..]);
    let retry = drain(&mut s.a, t0, &mut s.ma);
    assert_eq!(retry.len(), 1, "the gap is an implied NAK");
    assert_eq!(
        read_request(&retry[0]),
        (A_PSN + 2, SRC_BASE + 2 * MTU as u64, MTU as u32),
        "only the missing packet"
    );
    assert!(s.a.poll_completion().is_none());
    s.b.handle_packet(t0, &mut s.mb, &retry[0]).unwrap();
    let hole = drain(&mut s.b, t0, &mut s.mb);
    assert_answers(&hole, 2, 3, &s.data);
    feed(&mut s.a, t0, &mut s.ma, &hole);
    let wc = s.a.poll_completion().expect("the READ completes");
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (4, WcStatus::Success, 8 * 256)
    );
    assert_eq!(s.ma.region(s.dst).bytes, s.data);
    assert_eq!(s.a.counters().retransmits, 1);
    assert!(
        drain(&mut s.a, t0, &mut s.ma).is_empty(),
        "nothing left to ask"
    );
}

/// rxe answers a duplicate READ that starts inside the original with MIDDLE packets and ends
/// it with a LAST where the request ends: the requester takes such an answer to a piece, ends
/// included, and asks for the next piece from there.
#[test]
fn an_rxe_style_answer_to_a_piece_middle_to_last_completes_it() {
    let mut s = read_setup(BIG_READ_PKTS, 5);
    let t0 = Instant::from_nanos(1_000);
    let _lost = drain(&mut s.a, t0, &mut s.ma);
    // The responder executed the original; its first 100 packets arrived.
    let answer = rxe_answer(&s.data, 0, BIG_READ_PKTS, true);
    feed(&mut s.a, t0, &mut s.ma, &answer[..100]);
    let t1 = s.a.next_timeout().unwrap();
    s.a.handle_timeout(t1);
    let retry = drain(&mut s.a, t1, &mut s.ma);
    assert_eq!(
        read_request(&retry[0]),
        (A_PSN + 100, SRC_BASE + 100 * MTU as u64, (512 * MTU) as u32)
    );
    feed(
        &mut s.a,
        t1,
        &mut s.ma,
        &rxe_answer(&s.data, 100, 612, false),
    );
    let next = drain(&mut s.a, t1, &mut s.ma);
    assert_eq!(next.len(), 1, "the LAST at 611 ended the piece");
    assert_eq!(
        read_request(&next[0]),
        (
            A_PSN + 612,
            SRC_BASE + 612 * MTU as u64,
            ((BIG_READ_PKTS - 612) * MTU) as u32
        )
    );
    feed(
        &mut s.a,
        t1,
        &mut s.ma,
        &rxe_answer(&s.data, 612, BIG_READ_PKTS, false),
    );
    let wc = s.a.poll_completion().expect("the READ completes");
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
    assert_eq!(s.ma.region(s.dst).bytes, s.data);
}

/// READ response packets `[from, to)` as rxe sends them: FIRST/ONLY only for an answer from the
/// READ's first PSN (`fresh`), else MIDDLE, and LAST at the end; AETH on the first and last.
fn rxe_answer(data: &[u8], from: usize, to: usize, fresh: bool) -> Vec<Vec<u8>> {
    (from..to)
        .map(|k| {
            let first = k == from && fresh;
            let last = k + 1 == to;
            let opcode = match (first, last) {
                (true, true) => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
                (true, false) => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
                (false, true) => Opcode::RC_RDMA_READ_RESPONSE_LAST,
                (false, false) => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
            };
            let payload = &data[k * MTU..((k + 1) * MTU).min(data.len())];
            let bth = BthRepr {
                opcode,
                solicited: false,
                migreq: false,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qpn: A_QPN,
                ack_req: false,
                psn: Psn::new(A_PSN + k as u32),
            };
            let ext = ExtHeaders {
                aeth: (first || last).then_some(AethRepr {
                    syndrome: Syndrome::Ack { credits: 31 },
                    msn: 1,
                }),
                ..Default::default()
            };
            let repr = PacketRepr::new(bth, ext, payload.len());
            let mut buf = vec![0u8; repr.buffer_len().unwrap()];
            repr.emit(&mut buf).unwrap();
            RocePacket::new_checked(&mut buf[..])
                .unwrap()
                .payload_mut()
                .copy_from_slice(payload);
            buf
        })
        .collect()
}

/// A READ behind an atomic whose answer is still missing asks for the whole rest on a retry,
/// not a piece: a responder executing pieces fresh would take a resource for each, and could
/// recycle the atomic's before its replay (the atomic would then never be answered).
#[test]
fn a_read_behind_an_unanswered_atomic_retries_whole() {
    let pkts = 1000;
    let mut s = regions(pkts);
    let result = s.ma.register(1, 0x30_0000, 8, Access::ALL);
    let rlkey = s.ma.region(result).lkey;
    let counter = s.mb.register(1, 0xa0_0000, 8, Access::ALL);
    let crkey = s.mb.region(counter).rkey;
    let sge = Sge {
        addr: 0x30_0000,
        length: 8,
        lkey: rlkey,
    };
    s.a.post_send(SendWr::new(1, SendOp::FetchAdd { add: 5 }, vec![sge]).remote(0xa0_0000, crkey))
        .unwrap();
    s.post_read(2);
    let t0 = Instant::from_nanos(1_000);
    let sent = drain(&mut s.a, t0, &mut s.ma);
    assert_eq!(sent.len(), 2);
    s.b.handle_packet(t0, &mut s.mb, &sent[0]).unwrap();
    let _lost_atomic_ack = drain(&mut s.b, t0, &mut s.mb);
    // The READ request is lost too.
    let t1 = s.a.next_timeout().unwrap();
    s.a.handle_timeout(t1);
    let retry = drain(&mut s.a, t1, &mut s.ma);
    assert_eq!(retry.len(), 2, "the atomic and the READ again");
    let len = pkts * MTU;
    assert_eq!(
        read_request(&retry[1]),
        (A_PSN + 1, SRC_BASE, len as u32),
        "the whole READ, not a piece, though the window is now 512"
    );
    feed(&mut s.b, t1, &mut s.mb, &retry);
    let answers = drain(&mut s.b, t1, &mut s.mb);
    assert_eq!(answers.len(), 1 + pkts);
    assert_eq!(s.b.counters().duplicate_request, 1, "the atomic");
    feed(&mut s.a, t1, &mut s.ma, &answers);
    let wcs: Vec<_> = std::iter::from_fn(|| s.a.poll_completion())
        .map(|wc| (wc.wr_id, wc.status, wc.opcode))
        .collect();
    assert_eq!(
        wcs,
        vec![
            (1, WcStatus::Success, WcOpcode::FetchAdd),
            (2, WcStatus::Success, WcOpcode::RdmaRead)
        ]
    );
    assert_eq!(
        s.ma.region(result).bytes,
        0u64.to_ne_bytes(),
        "the original"
    );
    assert_eq!(
        s.mb.region(counter).bytes,
        5u64.to_ne_bytes(),
        "executed once"
    );
    assert_eq!(s.ma.region(s.dst).bytes, s.data);
}

/// A READ scattering into two elements over the same buffer (found by the requester fuzz
/// target): answers in order leave the later element's bytes there. Responses that arrive
/// after a gap are placed early only for a single-element READ, else the first packet, filled
/// in last, would overwrite the third's bytes; here the retry asks again from the gap.
#[test]
fn a_read_into_overlapping_elements_keeps_the_later_elements_bytes() {
    let (mut a, mut b) = pair();
    let mut ma = VecMemory::new();
    let dst = ma.register(1, DST_BASE, 2 * MTU, Access::ALL);
    let lkey = ma.region(dst).lkey;
    let mut mb = VecMemory::new();
    let src = mb.register(1, SRC_BASE, 4 * MTU, Access::ALL);
    let rkey = mb.region(src).rkey;
    let data = source_bytes(4 * MTU);
    mb.region_mut(src).bytes.copy_from_slice(&data);
    let half = Sge {
        addr: DST_BASE,
        length: 2 * MTU as u32,
        lkey,
    };
    a.post_send(SendWr::new(6, SendOp::Read, vec![half, half]).remote(SRC_BASE, rkey))
        .unwrap();
    let t0 = Instant::from_nanos(1_000);
    let request = drain(&mut a, t0, &mut ma);
    b.handle_packet(t0, &mut mb, &request[0]).unwrap();
    let answer = drain(&mut b, t0, &mut mb);
    feed(&mut a, t0, &mut ma, &answer[1..]);
    let retry = drain(&mut a, t0, &mut ma);
    assert_eq!(
        read_request(&retry[0]),
        (A_PSN, SRC_BASE, 4 * MTU as u32),
        "nothing was kept past the gap"
    );
    b.handle_packet(t0, &mut mb, &retry[0]).unwrap();
    feed(&mut a, t0, &mut ma, &drain(&mut b, t0, &mut mb));
    let wc = a.poll_completion().expect("the READ completes");
    assert_eq!((wc.wr_id, wc.status), (6, WcStatus::Success));
    assert_eq!(
        ma.region(dst).bytes,
        &data[2 * MTU..],
        "the later element's bytes"
    );
}
