//! ECN as RoCE does it (DCQCN): a packet that arrives marked Congestion Experienced makes the
//! receiving QP send its peer a CNP, at most one per 50 µs, ahead of everything else it sends;
//! the CNP cuts the peer's sending rate. Two QPs are driven by hand, packet by packet, in
//! virtual time.

use ferroce_proto::dcqcn::MIN_TIME_BETWEEN_CNPS;
use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{Access, Instant, QpCaps, QpState, QueuePair, SendOp, SendWr, Sge, VecMemory};
use ferroce_wire::opcode::Transport;
use ferroce_wire::{Opcode, PacketRepr, Psn, RocePacket};

struct Node {
    qp: QueuePair,
    mem: VecMemory,
}

const BASE: u64 = 0x10_0000;

/// A (QPN 0x11) connected to B (QPN 0x12), MTU 1024; each has one 1 MiB region with every
/// right at `BASE`.
fn pair() -> (Node, Node) {
    let mk = |qpn: u32, peer: u32| {
        let caps = QpCaps {
            max_send_wr: 1024,
            ..QpCaps::default()
        };
        let mut qp = connected_qp(qpn, caps, &default_rtr(peer, Psn::new(0)), &default_rts());
        // Hundreds of packets leave at once here: no congestion window in the way.
        qp.set_congestion_control(ferroce_proto::CcConfig {
            algorithm: ferroce_proto::CcAlgorithm::Off,
            ..Default::default()
        });
        let mut mem = VecMemory::new();
        mem.register(1, BASE, 1 << 20, Access::ALL.with(Access::LOCAL_WRITE));
        Node { qp, mem }
    };
    (mk(0x11, 0x12), mk(0x12, 0x11))
}

fn us(n: u64) -> Instant {
    Instant::from_nanos(n * 1000)
}

impl Node {
    /// Everything the QP sends at `now`.
    fn out(&mut self, now: Instant) -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        let mut buf = vec![0u8; 4096];
        while let Some(n) = self.qp.poll_transmit(now, &mut self.mem, &mut buf) {
            v.push(buf[..n].to_vec());
        }
        v
    }
    fn take(&mut self, now: Instant, pkts: &[Vec<u8>], ce: bool) {
        for p in pkts {
            self.qp
                .handle_packet_ecn(now, &mut self.mem, p, ce)
                .unwrap();
        }
    }
    /// Posts `n` 1-KiB WRITEs to `peer`'s region (signaled, so every one asks for an ACK).
    fn writes(&mut self, peer: &Node, n: u64) {
        let rkey = peer.mem.region(0).rkey;
        for id in 0..n {
            let sge = Sge {
                addr: BASE + (id % 512) * 1024,
                length: 1024,
                lkey: self.mem.region(0).lkey,
            };
            self.qp
                .post_send(SendWr::new(id, SendOp::Write, vec![sge]).remote(BASE, rkey))
                .unwrap();
        }
    }
}

fn opcode(p: &[u8]) -> Opcode {
    RocePacket::new_checked(p).unwrap().opcode()
}

fn cnps(pkts: &[Vec<u8>]) -> usize {
    pkts.iter().filter(|p| opcode(p) == Opcode::CNP).count()
}

#[test]
fn a_marked_request_owes_one_cnp_sent_before_the_ack() {
    let (mut a, mut b) = pair();
    a.writes(&b, 1);
    let reqs = a.out(us(0));
    assert_eq!(reqs.len(), 1);
    b.take(us(1), &reqs, true);
    let answers = b.out(us(1));
    assert_eq!(
        answers.iter().map(|p| opcode(p)).collect::<Vec<_>>(),
        [Opcode::CNP, Opcode::RC_ACKNOWLEDGE],
        "the CNP leaves first"
    );
    // The CNP as RoCE v2 defines it (IBTA Annex A17.9.2).
    let cnp = RocePacket::new_checked(&answers[0][..]).unwrap();
    let repr = PacketRepr::parse(&cnp).unwrap();
    assert_eq!(
        answers[0].len(),
        12 + 16 + 4,
        "BTH, 16 reserved bytes, ICRC"
    );
    assert_eq!(repr.info().unwrap().transport, Transport::Cnp);
    assert_eq!(repr.bth.dest_qpn, 0x11, "to the peer's QP");
    assert!(repr.bth.becn, "BECN set");
    assert!(!repr.bth.fecn && !repr.bth.ack_req && !repr.bth.solicited);
    assert_eq!(repr.bth.psn, Psn::new(0));
    assert_eq!(repr.payload_len, 0);
    assert_eq!(ferroce_wire::packet::cnp_reserved(&cnp), Some((0, 0)));
    let c = b.qp.counters();
    assert_eq!((c.np_ecn_marked_roce_packets, c.np_cnp_sent), (1, 1));
    assert_eq!(c.dropped_bad_state, 0);
}

#[test]
fn marked_packets_yield_exactly_one_cnp_per_50_us() {
    let (mut a, mut b) = pair();
    a.writes(&b, 400);
    let reqs = a.out(us(0));
    assert!(reqs.len() > 201, "{} packets", reqs.len());
    let mut sent = Vec::new();
    let mut marked = 0;
    // A packet every 5 µs for 1 ms, each marked: 201 packets, CNPs at 0, 50, ..., 1000 µs.
    for (i, t) in (0..=1000).step_by(5).enumerate() {
        let now = us(t);
        b.take(now, &reqs[i..=i], true);
        marked += 1;
        let out = b.out(now);
        if cnps(&out) > 0 {
            sent.push(t);
        }
        assert!(cnps(&out) <= 1);
        a.take(now, &out, false);
    }
    let want: Vec<u64> = (0..=1000).step_by(50).collect();
    assert_eq!(sent, want);
    assert_eq!(MIN_TIME_BETWEEN_CNPS.as_micros(), 50);
    let c = b.qp.counters();
    assert_eq!(c.np_ecn_marked_roce_packets, marked);
    assert_eq!(c.np_cnp_sent, want.len() as u64);
    assert_eq!(a.qp.counters().rp_cnp_handled, want.len() as u64);
}

#[test]
fn unmarked_traffic_owes_no_cnp() {
    let (mut a, mut b) = pair();
    a.writes(&b, 8);
    let reqs = a.out(us(0));
    b.take(us(0), &reqs, false);
    assert_eq!(cnps(&b.out(us(0))), 0);
    let c = b.qp.counters();
    assert_eq!((c.np_ecn_marked_roce_packets, c.np_cnp_sent), (0, 0));
    assert_eq!(a.qp.congestion_rate(us(0)), None);
}

#[test]
fn a_cnp_cuts_the_senders_rate_and_recovery_lifts_it() {
    let (mut a, mut b) = pair();
    a.writes(&b, 64);
    let reqs = a.out(us(0));
    b.take(us(10), &reqs, true);
    let answers = b.out(us(10));
    assert_eq!(cnps(&answers), 1);
    assert_eq!(a.qp.congestion_rate(us(10)), None, "no CNP yet");
    a.take(us(20), &answers, false);
    let c = a.qp.counters();
    assert_eq!((c.rp_cnp_handled, c.rp_cnp_ignored), (1, 0));
    assert_eq!(c.dropped_bad_state, 0, "a CNP is not a bad-state drop");
    let cut = a.qp.congestion_rate(us(20)).expect("limited after a CNP");
    let line = a.qp.dcqcn().config().line_rate;
    assert!(cut <= line / 2, "{cut} is not at most half of {line}");
    // With no further CNP the rate climbs back, and in the end is unlimited again.
    let later = a.qp.congestion_rate(us(20 + 300)).unwrap();
    assert!(later > cut);
    assert_eq!(a.qp.congestion_rate(us(20 + 2_000_000)), None);
}

#[test]
fn a_cnp_to_a_qp_that_is_not_sending_is_ignored() {
    let (mut a, mut b) = pair();
    a.writes(&b, 1);
    let reqs = a.out(us(0));
    b.take(us(0), &reqs, true);
    let answers = b.out(us(0));
    let cnp: Vec<Vec<u8>> = answers
        .into_iter()
        .filter(|p| opcode(p) == Opcode::CNP)
        .collect();
    a.qp.modify_to_sqd().unwrap();
    a.take(us(1), &cnp, false);
    assert_eq!(a.qp.counters().rp_cnp_handled, 1, "SQD still sends");
    a.qp.modify_to_error();
    assert_eq!(a.qp.state(), QpState::Error);
    a.take(us(100), &cnp, false);
    let c = a.qp.counters();
    assert_eq!((c.rp_cnp_handled, c.rp_cnp_ignored), (1, 1));
    assert_eq!(c.dropped_bad_state, 0);
}

#[test]
fn a_marked_cnp_owes_no_cnp_back() {
    let (mut a, mut b) = pair();
    a.writes(&b, 1);
    let reqs = a.out(us(0));
    b.take(us(0), &reqs, true);
    let answers = b.out(us(0));
    let cnp: Vec<Vec<u8>> = answers
        .into_iter()
        .filter(|p| opcode(p) == Opcode::CNP)
        .collect();
    a.take(us(1), &cnp, true);
    assert_eq!(cnps(&a.out(us(1))), 0);
    assert_eq!(a.qp.counters().np_cnp_sent, 0);
}

#[test]
fn a_cnp_owed_when_the_qp_fails_is_not_sent() {
    let (mut a, mut b) = pair();
    a.writes(&b, 1);
    let reqs = a.out(us(0));
    b.take(us(0), &reqs, true);
    b.qp.modify_to_error();
    assert_eq!(cnps(&b.out(us(0))), 0);
    assert_eq!(b.qp.counters().np_cnp_sent, 0);
}
