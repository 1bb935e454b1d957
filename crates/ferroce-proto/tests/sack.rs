//! Selective acknowledgements and tail-loss probes between two selective-repeat QPs, driven
//! packet by packet with chosen losses (see `ferroce_proto::sack`): every hole of a window is
//! resent in the same round trip, a lost resend is found by the next SACK, a loss at the end
//! of a burst by a probe — none by the retransmission timeout — and the responder's memory
//! ends byte for byte as the requester's source. Then SACKs no requester could have caused.

use core::time::Duration;

use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{
    Access, Instant, PathMtu, QpCaps, QueuePair, RtrAttr, RtsAttr, SendOp, SendWr, Sge, VecMemory,
    WcStatus,
};
use ferroce_wire::{Opcode, PacketRepr, Psn, RocePacket};

const A_QPN: u32 = 0x11;
const B_QPN: u32 = 0x22;
const A_PSN: u32 = 0xff_fff8; // the 24-bit wrap falls inside the first message
const MTU: usize = 256;
const SRC: u64 = 0x1000;
const DST: u64 = 0x9_0000;
const RTT: Duration = Duration::from_micros(100);

/// A (requester) and B (responder), both keeping what arrives after a gap; no congestion
/// control (these cases follow packets, not the window).
struct Bed {
    a: QueuePair,
    b: QueuePair,
    ma: VecMemory,
    mb: VecMemory,
    lkey: u32,
    rkey: u32,
    dst: usize,
    sent: usize,
}

fn bed(selective: bool) -> Bed {
    let make = |qpn, peer, sq, rq| {
        let rtr = RtrAttr {
            path_mtu: PathMtu::Mtu256,
            ..default_rtr(peer, Psn::new(rq))
        };
        let rts = RtsAttr {
            sq_psn: Psn::new(sq),
            ..default_rts()
        };
        let mut qp = connected_qp(qpn, QpCaps::default(), &rtr, &rts);
        qp.set_congestion_control(ferroce_proto::CcConfig {
            algorithm: ferroce_proto::CcAlgorithm::Off,
            target_delay: ferroce_proto::cc::DEFAULT_TARGET_DELAY,
        });
        qp.set_selective_repeat(selective);
        qp
    };
    let mut ma = VecMemory::new();
    let src = ma.register(1, SRC, 64 * MTU, Access::ALL);
    let data: Vec<u8> = (0..64 * MTU).map(|i| (i * 7 + i / MTU) as u8).collect();
    ma.region_mut(src).bytes.copy_from_slice(&data);
    let mut mb = VecMemory::new();
    let dst = mb.register(1, DST, 64 * MTU, Access::ALL);
    Bed {
        lkey: ma.region(src).lkey,
        rkey: mb.region(dst).rkey,
        a: make(A_QPN, B_QPN, A_PSN, 0),
        b: make(B_QPN, A_QPN, 0, A_PSN),
        ma,
        mb,
        dst,
        sent: 0,
    }
}

fn at(us: u64) -> Instant {
    Instant::from_nanos(us * 1_000)
}

fn drain(q: &mut QueuePair, now: Instant, mem: &mut VecMemory) -> Vec<Vec<u8>> {
    ferroce_proto::sim::pair::transmit_all(q, now, mem)
}

fn feed(q: &mut QueuePair, now: Instant, mem: &mut VecMemory, packets: &[Vec<u8>]) {
    for p in packets {
        q.handle_packet(now, mem, p).unwrap();
    }
}

/// PSN offsets from `A_PSN` of request packets.
fn offsets(packets: &[Vec<u8>]) -> Vec<u32> {
    packets
        .iter()
        .map(|p| {
            RocePacket::new_checked(&p[..])
                .unwrap()
                .bth()
                .psn()
                .distance_from(Psn::new(A_PSN))
        })
        .collect()
}

/// `packets` but those at the indices in `lost`.
fn except(packets: &[Vec<u8>], lost: &[usize]) -> Vec<Vec<u8>> {
    packets
        .iter()
        .enumerate()
        .filter(|(i, _)| !lost.contains(i))
        .map(|(_, p)| p.clone())
        .collect()
}

fn opcode(p: &[u8]) -> Opcode {
    RocePacket::new_checked(p).unwrap().opcode()
}

impl Bed {
    /// Posts a WRITE of the next `pkts` packets of A's source to the same place in B.
    fn write(&mut self, wr_id: u64, pkts: usize) {
        let off = (self.sent * MTU) as u64;
        let sge = Sge {
            addr: SRC + off,
            length: (pkts * MTU) as u32,
            lkey: self.lkey,
        };
        self.a
            .post_send(SendWr::new(wr_id, SendOp::Write, vec![sge]).remote(DST + off, self.rkey))
            .unwrap();
        self.sent += pkts;
    }

    /// One 1-packet WRITE answered after [`RTT`]: A has measured the path.
    fn warm_up(&mut self) {
        self.write(100, 1);
        let out = drain(&mut self.a, at(0), &mut self.ma);
        let acks = self.deliver_to_b(at(50), &out);
        self.deliver_to_a(at(100), &acks);
        let wc = self
            .a
            .poll_completion()
            .expect("the warm-up WRITE completes");
        assert_eq!((wc.wr_id, wc.status), (100, WcStatus::Success));
        assert_eq!(self.a.smoothed_rtt(), Some(RTT));
    }

    /// Hands `packets` to B at `now` and returns what B sends then.
    fn deliver_to_b(&mut self, now: Instant, packets: &[Vec<u8>]) -> Vec<Vec<u8>> {
        feed(&mut self.b, now, &mut self.mb, packets);
        drain(&mut self.b, now, &mut self.mb)
    }

    /// Hands `packets` to A at `now`.
    fn deliver_to_a(&mut self, now: Instant, packets: &[Vec<u8>]) {
        feed(&mut self.a, now, &mut self.ma, packets);
    }

    /// Asserts that A's next completion is `wr_id`'s success and B's memory is A's source.
    fn assert_completed(&mut self, wr_id: u64) {
        let wc = self.a.poll_completion().expect("the WRITE completes");
        assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success));
        self.assert_delivered();
    }

    /// Asserts B's memory holds A's source for every packet sent so far.
    fn assert_delivered(&self) {
        let want = &self.ma.region(0).bytes[..self.sent * MTU];
        assert!(
            self.mb.region(self.dst).bytes[..self.sent * MTU] == *want,
            "B's memory differs from A's source"
        );
    }
}

/// Three holes in a window of 20: B keeps the 17 others and its SACK names all three, so A
/// resends exactly those, in one round trip, and nothing else.
#[test]
fn one_sack_names_every_hole_and_only_the_holes_are_resent() {
    let mut t = bed(true);
    t.write(1, 20);
    let out = drain(&mut t.a, at(0), &mut t.ma);
    assert_eq!(out.len(), 20);
    let arrived = except(&out, &[3, 7, 12]);
    let answers = t.deliver_to_b(at(50), &arrived);
    assert_eq!(t.b.counters().ooo_held, 14);
    let sack = answers
        .iter()
        .find(|p| opcode(p) == Opcode::FERROCE_SACK)
        .expect("B sends a SACK");
    let repr = PacketRepr::parse(&RocePacket::new_checked(&sack[..]).unwrap()).unwrap();
    assert_eq!(repr.bth.dest_qpn, A_QPN);
    assert_eq!(
        repr.bth.psn,
        Psn::new(A_PSN).add(2),
        "the last PSN in order"
    );
    assert_eq!(repr.payload_len, 4, "kept: 4..=19 but 7 and 12, one word");
    let bitmap = &sack[sack.len() - 4 - 4..sack.len() - 4];
    // Bit i: PSN 4 + i; 4..=19 kept but 7 and 12 (bits 3 and 8).
    let bits = u32::from_le_bytes(bitmap.try_into().unwrap());
    assert_eq!(bits, 0xffff & !(1 << 3) & !(1 << 8));
    t.deliver_to_a(at(100), &answers);
    // Before any RTT sample the reordering wait is a quarter of the timer granularity.
    assert!(drain(&mut t.a, at(100), &mut t.ma).is_empty());
    let resent = drain(&mut t.a, at(125), &mut t.ma);
    assert_eq!(
        offsets(&resent),
        [3, 7, 12],
        "exactly the holes, oldest first"
    );
    let acks = t.deliver_to_b(at(150), &resent);
    t.deliver_to_a(at(200), &acks);
    t.assert_completed(1);
    let (ca, cb) = (t.a.counters(), t.b.counters());
    assert_eq!((ca.retransmits, ca.sr_retransmits, ca.rto_fired), (3, 3, 0));
    assert_eq!((ca.sacks_rcvd, cb.sacks_sent), (1, 1));
    assert_eq!(cb.rcvd_pkts, 20, "each packet counted once, kept or not");
    assert_eq!(cb.rcvd_bytes, 20 * MTU as u64);
}

/// A resend that is lost again is named by the next SACK and resent once a round trip has
/// passed since the first resend — not left to the retransmission timeout.
#[test]
fn a_lost_resend_is_resent_after_a_round_trip_on_the_next_sack() {
    let mut t = bed(true);
    t.warm_up();
    t.write(1, 20);
    let out = drain(&mut t.a, at(1000), &mut t.ma);
    let arrived = except(&out, &[3, 12]);
    let answers = t.deliver_to_b(at(1050), &arrived);
    t.deliver_to_a(at(1100), &answers);
    // A reported hole waits a quarter of the minimum RTT (RACK's reordering window).
    assert!(drain(&mut t.a, at(1100), &mut t.ma).is_empty());
    let resent = drain(&mut t.a, at(1125), &mut t.ma);
    assert_eq!(offsets(&resent), [1 + 3, 1 + 12]);
    // The resend of 3 is lost; 12's arrives and B names 3 again.
    let answers = t.deliver_to_b(at(1150), &resent[1..]);
    assert!(answers.iter().any(|p| opcode(p) == Opcode::FERROCE_SACK));
    // Within a round trip of the resend it is news already acted on...
    t.deliver_to_a(at(1150), &answers);
    assert!(drain(&mut t.a, at(1150), &mut t.ma).is_empty());
    // ...after one, the hole is resent again at the next report.
    let answers = t.deliver_to_b(at(1260), &resent[1..]);
    t.deliver_to_a(at(1260), &answers);
    let again = drain(&mut t.a, at(1285), &mut t.ma);
    assert_eq!(offsets(&again), [1 + 3]);
    let acks = t.deliver_to_b(at(1300), &again);
    t.deliver_to_a(at(1350), &acks);
    t.assert_completed(1);
    let c = t.a.counters();
    assert_eq!(
        (c.sr_retransmits, c.rto_fired, c.completer_retry_err),
        (3, 0, 0)
    );
}

/// The last two packets of a burst are lost, so nothing after them can reveal the loss: two
/// round trips later A probes with the newest packet, B keeps it and names the hole, and the
/// hole is resent — long before the retransmission timeout.
#[test]
fn a_tail_loss_is_found_by_a_probe_not_by_the_timeout() {
    let mut t = bed(true);
    t.warm_up();
    t.write(1, 10);
    let out = drain(&mut t.a, at(1000), &mut t.ma);
    assert_eq!(out.len(), 10);
    feed(&mut t.b, at(1050), &mut t.mb, &out[..8]);
    // The last delivered packet did not ask for an acknowledgement: B owes none yet.
    let quiet = drain(&mut t.b, at(1050), &mut t.mb);
    assert!(quiet.is_empty(), "{} packets", quiet.len());
    let probe_at = t.a.next_timeout().expect("a timer is armed");
    assert_eq!(
        probe_at,
        at(1200),
        "two smoothed round trips after the send"
    );
    t.a.handle_timeout(probe_at);
    let probe = drain(&mut t.a, probe_at, &mut t.ma);
    assert_eq!(offsets(&probe), [1 + 9], "the newest packet");
    assert_eq!(t.a.counters().tail_loss_probes, 1);
    // One probe per episode: stepping through every timer until the retransmission timeout
    // sends nothing more (the probe pushed that timeout back to a full one from itself).
    {
        let mut t = bed(true);
        t.warm_up();
        t.write(1, 10);
        drain(&mut t.a, at(1000), &mut t.ma);
        let mut now = at(1000);
        loop {
            let next =
                t.a.next_timeout()
                    .expect("the retransmission timeout is armed");
            assert!(next > now, "a timer due in the past");
            now = next;
            t.a.handle_timeout(now);
            let out = drain(&mut t.a, now, &mut t.ma);
            if t.a.counters().rto_fired > 0 {
                assert!(now >= probe_at + Duration::from_micros(500), "{now:?}");
                assert_eq!(offsets(&out)[0], 1, "the timeout resends from una");
                break;
            }
            let probes = t.a.counters().tail_loss_probes;
            assert_eq!(out.len() as u64, probes, "only the probe, once, at {now:?}");
            assert_eq!(probes, u64::from(now >= probe_at));
        }
    }
    let answers = t.deliver_to_b(at(1250), &probe);
    assert!(answers.iter().any(|p| opcode(p) == Opcode::FERROCE_SACK));
    t.deliver_to_a(at(1300), &answers);
    let resent = drain(&mut t.a, at(1325), &mut t.ma);
    assert_eq!(offsets(&resent), [1 + 8]);
    assert!(
        t.a.next_timeout().unwrap() > at(1400),
        "the retransmission timeout lies beyond the recovery"
    );
    let acks = t.deliver_to_b(at(1350), &resent);
    t.deliver_to_a(at(1400), &acks);
    t.assert_completed(1);
    let c = t.a.counters();
    assert_eq!(
        (c.retransmits, c.rto_fired, c.completer_retry_err),
        (2, 0, 0)
    );
    assert!(
        t.a.next_timeout().is_none(),
        "nothing outstanding, no timer"
    );
}

/// Only the ACK was lost: the probe is a duplicate for B, which acknowledges it again.
#[test]
fn a_probe_after_a_lost_ack_is_acknowledged_again() {
    let mut t = bed(true);
    t.warm_up();
    t.write(1, 4);
    let out = drain(&mut t.a, at(1000), &mut t.ma);
    let lost_ack = t.deliver_to_b(at(1050), &out);
    assert_eq!(lost_ack.len(), 1);
    let probe_at = t.a.next_timeout().unwrap();
    t.a.handle_timeout(probe_at);
    let probe = drain(&mut t.a, probe_at, &mut t.ma);
    assert_eq!(offsets(&probe), [1 + 3]);
    let ack = t.deliver_to_b(probe_at, &probe);
    assert_eq!(ack.len(), 1);
    assert_eq!(opcode(&ack[0]), Opcode::RC_ACKNOWLEDGE);
    t.deliver_to_a(probe_at + RTT, &ack);
    let wc = t.a.poll_completion().expect("the WRITE completes");
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(t.b.counters().duplicate_request, 1);
    t.assert_delivered();
}

/// Without selective repeat there is no probe (a go-back-N peer would take the repeated
/// packet for a gap and NAK it) and no SACK either way.
#[test]
fn go_back_n_queue_pairs_neither_probe_nor_sack() {
    let mut t = bed(false);
    t.warm_up();
    t.write(1, 10);
    let out = drain(&mut t.a, at(1000), &mut t.ma);
    let arrived = except(&out, &[2]);
    let answers = t.deliver_to_b(at(1050), &arrived);
    assert!(answers.iter().all(|p| opcode(p) == Opcode::RC_ACKNOWLEDGE));
    assert_eq!(t.b.counters().sacks_sent, 0);
    let first = t.a.next_timeout().unwrap();
    assert!(
        first >= at(1000) + Duration::from_millis(4),
        "the IBTA timeout alone"
    );
    t.a.handle_timeout(first);
    let again = drain(&mut t.a, first, &mut t.ma);
    assert_eq!(
        offsets(&again),
        (1..=10).collect::<Vec<_>>(),
        "go-back-N from una"
    );
    assert_eq!(t.a.counters().tail_loss_probes, 0);
    // B keeps nothing and owes no SACK, even for what arrives after the gap again.
    let answers = t.deliver_to_b(first, &again[3..]);
    assert!(answers.iter().all(|p| opcode(p) == Opcode::RC_ACKNOWLEDGE));
    assert_eq!((t.b.counters().ooo_held, t.b.counters().sacks_sent), (0, 0));
}

/// While a hole is resent, what the peer keeps after it has left the network: the window
/// counts only what is in flight, so new packets keep leaving (a NAK alone, naming only the
/// hole, lets none leave until it is filled).
#[test]
fn packets_kept_past_a_hole_free_the_window_for_new_ones() {
    let run = |with_sack: bool| -> (Vec<u32>, u32) {
        let mut t = bed(true);
        t.a.set_congestion_control(ferroce_proto::CcConfig::default());
        t.write(1, 60);
        let out = drain(&mut t.a, at(0), &mut t.ma);
        let first = out.len() as u32;
        let arrived = except(&out, &[2]);
        let answers: Vec<Vec<u8>> = t
            .deliver_to_b(at(50), &arrived)
            .into_iter()
            .filter(|p| with_sack || opcode(p) != Opcode::FERROCE_SACK)
            .collect();
        t.deliver_to_a(at(100), &answers);
        let next = drain(&mut t.a, at(200), &mut t.ma);
        assert_eq!(
            t.a.unacked_psn(),
            Psn::new(A_PSN).add(2),
            "the hole holds una"
        );
        (offsets(&next), first)
    };
    let (with, first) = run(true);
    assert_eq!(with[0], 2, "the hole first");
    assert!(
        with.len() > 1,
        "new packets leave beside the resend: {with:?}"
    );
    assert_eq!(
        with[1..].to_vec(),
        (first..first + with.len() as u32 - 1).collect::<Vec<_>>()
    );
    let (without, _) = run(false);
    assert_eq!(without, [2], "the hole alone");
}

/// SACKs a requester could not have caused — beyond what it sent, far behind, a bitmap longer
/// than any reorder buffer, or to a QP that never negotiated them — move nothing, resend no
/// more than what was sent and is unacknowledged, and are counted.
#[test]
fn sacks_no_requester_could_have_caused_are_counted_and_move_nothing() {
    let mut t = bed(true);
    t.write(1, 8);
    let out = drain(&mut t.a, at(0), &mut t.ma);
    assert_eq!(out.len(), 8);
    let base = Psn::new(A_PSN);
    // Beyond next_psn, and far behind una.
    for psn in [base.add(8), base.add(100_000), base.sub(2)] {
        let p = ferroce_proto::sim::sack_packet(A_QPN, psn, &[0xff; 4]);
        t.a.handle_packet(at(10), &mut t.ma, &p).unwrap();
    }
    assert_eq!(t.a.counters().duplicate_response, 3);
    assert_eq!(t.a.counters().sacks_rcvd, 0);
    assert_eq!(t.a.unacked_psn(), base);
    assert!(drain(&mut t.a, at(10), &mut t.ma).is_empty());
    // Every bit set over 4 KiB: the holes named are only what was sent, each resent once.
    let p = ferroce_proto::sim::sack_packet(A_QPN, base.sub(1), &[0x55; 4096]);
    t.a.handle_packet(at(20), &mut t.ma, &p).unwrap();
    t.a.handle_packet(at(20), &mut t.ma, &p).unwrap();
    let resent = drain(&mut t.a, at(50), &mut t.ma);
    assert_eq!(offsets(&resent), [0, 2, 4, 6], "the even ones, once each");
    // A QP without selective repeat drops one as a foreign transport.
    let mut g = bed(false);
    g.write(1, 2);
    drain(&mut g.a, at(0), &mut g.ma);
    let p = ferroce_proto::sim::sack_packet(A_QPN, base.add(0), &[0x01, 0, 0, 0]);
    g.a.handle_packet(at(10), &mut g.ma, &p).unwrap();
    assert_eq!(g.a.counters().dropped_bad_state, 1);
    assert_eq!(g.a.unacked_psn(), base, "its cumulative part is not taken");
}

/// On a path that never loses (a shared-memory ring) only the IBTA timeout resends: no probe
/// and no fast timeout, even toward a selective-repeat peer.
#[test]
fn a_lossless_path_neither_probes_nor_times_out_fast() {
    let mut t = bed(true);
    t.a.set_lossless_path(true);
    assert!(t.a.lossless_path());
    t.warm_up();
    t.write(1, 4);
    drain(&mut t.a, at(1000), &mut t.ma);
    let first = t.a.next_timeout().unwrap();
    assert!(
        first >= at(1000) + Duration::from_millis(4),
        "the IBTA timeout alone: {first:?}"
    );
    t.a.handle_timeout(first);
    assert_eq!(offsets(&drain(&mut t.a, first, &mut t.ma)), [1, 2, 3, 4]);
    let c = t.a.counters();
    assert_eq!(
        (c.tail_loss_probes, c.rto_fired, c.completer_retry_err),
        (0, 0, 1)
    );
}

/// A packet that was only reordered, not lost: the SACK names it as a hole, but it arrives
/// (and its acknowledgement comes) within the reordering wait, so it is never resent.
#[test]
fn a_reordered_packet_is_not_resent() {
    let mut t = bed(true);
    t.warm_up();
    t.write(1, 6);
    let out = drain(&mut t.a, at(1000), &mut t.ma);
    // Packet 2 is overtaken by 3..=5.
    let mut order: Vec<Vec<u8>> = out.clone();
    let late = order.remove(2);
    let answers = t.deliver_to_b(at(1050), &order);
    assert!(answers.iter().any(|p| opcode(p) == Opcode::FERROCE_SACK));
    t.deliver_to_a(at(1100), &answers);
    // The late packet lands a few µs later; B's ACK covers everything.
    let acks = t.deliver_to_b(at(1052), &[late]);
    t.deliver_to_a(at(1105), &acks);
    // Past the reordering wait (a quarter of the 100 µs minimum RTT): nothing to resend.
    assert!(drain(&mut t.a, at(1130), &mut t.ma).is_empty());
    let wc = t.a.poll_completion().expect("the WRITE completes");
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(t.a.counters().retransmits, 0);
    t.assert_delivered();
}
