//! Unsignaled requests that do not ask for an ACK (`QueuePair::set_peer_acks_unasked`), and the
//! responder acknowledging such requests within `UNASKED_ACK_DELAY`. Two QPs are driven by hand,
//! packet by packet, so each test sees exactly which packet asks and when the ACK leaves.

use ferroce_proto::responder::UNASKED_ACK_DELAY;
use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{
    Access, Instant, QpCaps, QueuePair, RtsAttr, SendFlags, SendOp, SendWr, Sge, VecMemory,
    WcOpcode, WcStatus, UNASKED_RUN,
};
use ferroce_wire::{Opcode, Psn, RocePacket};

struct Node {
    qp: QueuePair,
    mem: VecMemory,
}

const BASE: u64 = 0x20_0000;
const T0: Instant = Instant::from_nanos(1_000);

/// A (QPN 0x21) connected to B (QPN 0x22) with local ACK timeout code `timeout`; each has one
/// 64 KiB region with every right at `BASE`.
fn pair(timeout: u8) -> (Node, Node) {
    let mk = |qpn: u32, peer: u32| {
        let rts = RtsAttr {
            sq_psn: Psn::new(100),
            timeout,
            ..default_rts()
        };
        let mut qp = connected_qp(
            qpn,
            QpCaps::default(),
            &default_rtr(peer, Psn::new(100)),
            &rts,
        );
        // Whole runs of messages leave at once here: no congestion window in the way.
        qp.set_congestion_control(ferroce_proto::CcConfig {
            algorithm: ferroce_proto::CcAlgorithm::Off,
            ..Default::default()
        });
        let mut mem = VecMemory::new();
        mem.register(1, BASE, 65_536, Access::ALL.with(Access::LOCAL_WRITE));
        Node { qp, mem }
    };
    (mk(0x21, 0x22), mk(0x22, 0x21))
}

impl Node {
    /// `len` bytes at `off` of this side's region.
    fn bytes(&self, off: u64, len: usize) -> Vec<u8> {
        self.mem.region(0).bytes[off as usize..off as usize + len].to_vec()
    }
    /// Writes `data` at `off` of this side's region and posts a WRITE of it to the same offset
    /// of `peer`'s.
    fn write(&mut self, peer_rkey: u32, id: u64, off: u64, data: &[u8], signaled: bool) {
        let o = off as usize;
        self.mem.region_mut(0).bytes[o..o + data.len()].copy_from_slice(data);
        let sge = Sge {
            addr: BASE + off,
            length: data.len() as u32,
            lkey: self.mem.region(0).lkey,
        };
        let flags = SendFlags {
            signaled,
            ..SendFlags::default()
        };
        self.qp
            .post_send(
                SendWr::new(id, SendOp::Write, vec![sge])
                    .remote(BASE + off, peer_rkey)
                    .flags(flags),
            )
            .unwrap();
    }
    fn rkey(&self) -> u32 {
        self.mem.region(0).rkey
    }
    /// Everything the QP sends at `now`.
    fn out(&mut self, now: Instant) -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        let mut buf = vec![0u8; 4096];
        while let Some(n) = self.qp.poll_transmit(now, &mut self.mem, &mut buf) {
            v.push(buf[..n].to_vec());
        }
        v
    }
    fn take(&mut self, now: Instant, pkts: &[Vec<u8>]) {
        for p in pkts {
            self.qp.handle_packet(now, &mut self.mem, p).unwrap();
        }
    }
}

/// (opcode, PSN, AckReq) of a packet.
fn bth(p: &[u8]) -> (Opcode, u32, bool) {
    let pkt = RocePacket::new_checked(p).unwrap();
    let b = pkt.bth();
    (b.opcode(), b.psn().value(), b.ack_req())
}

#[test]
fn unsignaled_writes_go_unasked_and_one_ack_covers_them_after_the_delay() {
    let (mut a, mut b) = pair(14);
    a.qp.set_peer_acks_unasked(true);
    let rkey = b.rkey();
    for i in 0..3u64 {
        a.write(rkey, i, i * 64, &[0x40 + i as u8; 8], false);
    }
    let sent = a.out(T0);
    let seen: Vec<_> = sent.iter().map(|p| bth(p)).collect();
    assert_eq!(
        seen,
        vec![
            (Opcode::RC_RDMA_WRITE_ONLY, 100, false),
            (Opcode::RC_RDMA_WRITE_ONLY, 101, false),
            (Opcode::RC_RDMA_WRITE_ONLY, 102, false),
        ]
    );
    b.take(T0, &sent);
    for i in 0..3u64 {
        assert_eq!(
            b.bytes(i * 64, 8),
            vec![0x40 + i as u8; 8],
            "WRITE {i} landed"
        );
    }
    // Nothing asked, so nothing leaves yet; the ACK is due one delay after the first request.
    assert!(b.out(T0).is_empty());
    let due = T0 + UNASKED_ACK_DELAY;
    assert_eq!(b.qp.next_timeout(), Some(due));
    b.qp.handle_timeout(Instant::from_nanos(due.as_nanos() - 1));
    assert!(b.out(due).is_empty(), "no ACK before it is due");
    b.qp.handle_timeout(due);
    let acks = b.out(due);
    assert_eq!(acks.len(), 1, "one ACK for the three");
    assert_eq!(
        (bth(&acks[0]).0, bth(&acks[0]).1),
        (Opcode::RC_ACKNOWLEDGE, 102)
    );
    assert_eq!(b.qp.next_timeout(), None, "nothing more held");
    a.take(due, &acks);
    assert!(a.qp.is_send_queue_empty(), "the ACK retired all three");
    assert!(
        a.qp.poll_completion().is_none(),
        "unsignaled: no completion"
    );
    assert_eq!(a.qp.next_timeout(), None, "no retransmission timer left");
    assert_eq!(a.qp.counters().retransmits, 0);
}

#[test]
fn a_signaled_write_asks_and_its_ack_leaves_at_once_covering_the_unasked_ones() {
    let (mut a, mut b) = pair(14);
    a.qp.set_peer_acks_unasked(true);
    let rkey = b.rkey();
    a.write(rkey, 1, 0, b"unasked!", false);
    a.write(rkey, 2, 64, b"signaled", true);
    let sent = a.out(T0);
    let asks: Vec<_> = sent.iter().map(|p| bth(p).2).collect();
    assert_eq!(asks, vec![false, true]);
    b.take(T0, &sent);
    let acks = b.out(T0);
    assert_eq!(acks.len(), 1);
    assert_eq!(
        (bth(&acks[0]).0, bth(&acks[0]).1),
        (Opcode::RC_ACKNOWLEDGE, 101)
    );
    assert_eq!(
        b.qp.next_timeout(),
        None,
        "the asked ACK covered the unasked"
    );
    a.take(T0, &acks);
    let wc =
        a.qp.poll_completion()
            .expect("the signaled WRITE completes");
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (2, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert!(a.qp.poll_completion().is_none());
    assert!(a.qp.is_send_queue_empty());
    assert_eq!(b.bytes(0, 8), b"unasked!");
    assert_eq!(b.bytes(64, 8), b"signaled");
}

#[test]
fn a_run_of_unsignaled_messages_asks_every_so_often() {
    let (mut a, b) = pair(14);
    a.qp.set_peer_acks_unasked(true);
    let n = 2 * UNASKED_RUN as usize + 2;
    for i in 0..n {
        a.write(b.rkey(), i as u64, 8 * i as u64, &[i as u8; 8], false);
    }
    let asks: Vec<bool> = a.out(T0).iter().map(|p| bth(p).2).collect();
    let run = UNASKED_RUN as usize;
    let mut expected = vec![false; n];
    expected[run] = true;
    expected[2 * run + 1] = true;
    assert_eq!(asks, expected);
}

#[test]
fn every_message_asks_by_default_and_under_a_short_ack_timeout() {
    // Off (the default): a responder such as rxe acknowledges only what asks.
    let (mut a, b) = pair(14);
    for i in 0..3u64 {
        a.write(b.rkey(), i, 8 * i, &[1; 8], false);
    }
    assert!(a.out(T0).iter().all(|p| bth(p).2));
    // On, but the retransmission timer (code 7: 524 us) is shorter than four times the delay
    // the peer may hold an unasked ACK: asking is the only way not to time out.
    let (mut a, b) = pair(7);
    a.qp.set_peer_acks_unasked(true);
    for i in 0..3u64 {
        a.write(b.rkey(), i, 8 * i, &[1; 8], false);
    }
    assert!(a.out(T0).iter().all(|p| bth(p).2));
}
