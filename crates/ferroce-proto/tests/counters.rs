//! Counters: each event bumps the counter named for it, on the side that sees it. Two QPs are
//! driven by hand, packet by packet, so a test can drop or replay exactly the packet it means.

use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{
    Access, Instant, QpCaps, QpState, QueuePair, RecvWr, RtsAttr, SendOp, SendWr, Sge, VecMemory,
    WcStatus,
};
use ferroce_wire::{Opcode, Psn, RocePacket};

struct Node {
    qp: QueuePair,
    mem: VecMemory,
}

const BASE: u64 = 0x10_0000;

/// A (QPN 0x11) connected to B (QPN 0x12), MTU 1024; each has one 64 KiB region with every
/// right (index 0) at `BASE`.
fn pair() -> (Node, Node) {
    let mk = |qpn: u32, peer: u32| {
        let rts = RtsAttr {
            timeout: 14,
            ..default_rts()
        };
        let qp = connected_qp(
            qpn,
            QpCaps::default(),
            &default_rtr(peer, Psn::new(0)),
            &rts,
        );
        let mut mem = VecMemory::new();
        mem.register(1, BASE, 65_536, Access::ALL.with(Access::LOCAL_WRITE));
        Node { qp, mem }
    };
    (mk(0x11, 0x12), mk(0x12, 0x11))
}

impl Node {
    fn sge(&self, off: u64, len: u32) -> Sge {
        Sge {
            addr: BASE + off,
            length: len,
            lkey: self.mem.region(0).lkey,
        }
    }
    fn rkey(&self) -> u32 {
        self.mem.region(0).rkey
    }
    /// Everything the QP sends now.
    fn out(&mut self) -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        let mut buf = vec![0u8; 4096];
        while let Some(n) = self
            .qp
            .poll_transmit(Instant::from_nanos(0), &mut self.mem, &mut buf)
        {
            v.push(buf[..n].to_vec());
        }
        v
    }
    fn take(&mut self, pkts: &[Vec<u8>]) {
        for p in pkts {
            self.qp
                .handle_packet(Instant::from_nanos(0), &mut self.mem, p)
                .unwrap();
        }
    }
}

fn opcode(p: &[u8]) -> Opcode {
    RocePacket::new_checked(p).unwrap().opcode()
}

/// Runs both sides until neither has anything to send.
fn settle(a: &mut Node, b: &mut Node) {
    for _ in 0..100 {
        let ab = a.out();
        let ba = b.out();
        if ab.is_empty() && ba.is_empty() {
            return;
        }
        b.take(&ab);
        a.take(&ba);
    }
    panic!("the pair did not settle");
}

#[test]
fn sends_and_receives_are_counted_as_rxe_counts_them() {
    let (mut a, mut b) = pair();
    for id in 0..2 {
        let sge = b.sge(0, 64);
        b.qp.post_recv(RecvWr {
            wr_id: id,
            sgl: vec![sge],
        })
        .unwrap();
    }
    let s = a.sge(0, 10);
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![s]))
        .unwrap();
    a.qp.post_send(SendWr::new(2, SendOp::Write, vec![s]).remote(BASE, b.rkey()))
        .unwrap();
    a.qp.post_send(SendWr::new(3, SendOp::WriteWithImm(7), vec![s]).remote(BASE, b.rkey()))
        .unwrap();
    settle(&mut a, &mut b);
    let (ca, cb) = (*a.qp.counters(), *b.qp.counters());
    assert_eq!(ca.rdma_sends, 1, "only the SEND is an rdma_send: {ca:?}");
    assert_eq!(
        cb.rdma_recvs, 2,
        "the SEND and the WRITE with immediate: {cb:?}"
    );
    assert_eq!((ca.sent_pkts, cb.rcvd_pkts), (3, 3));
    assert_eq!(cb.sent_bytes, 0);
    assert_eq!(ca.sent_bytes, 30);
    assert_eq!(cb.rcvd_bytes, 30);
}

#[test]
fn an_ack_past_a_lost_read_response_is_an_implied_nak() {
    let (mut a, mut b) = pair();
    let s = a.sge(0, 8);
    a.qp.post_send(SendWr::new(1, SendOp::Read, vec![s]).remote(BASE, b.rkey()))
        .unwrap();
    a.qp.post_send(SendWr::new(2, SendOp::Write, vec![s]).remote(BASE + 64, b.rkey()))
        .unwrap();
    let reqs = a.out();
    assert_eq!(reqs.len(), 2);
    b.take(&reqs);
    let answers = b.out();
    assert_eq!(
        answers.iter().map(|p| opcode(p)).collect::<Vec<_>>(),
        [Opcode::RC_RDMA_READ_RESPONSE_ONLY, Opcode::RC_ACKNOWLEDGE]
    );
    // The READ response is lost; the ACK of the WRITE behind it arrives.
    a.take(&answers[1..]);
    assert_eq!(a.qp.counters().implied_nak_seq_err, 1);
    let again = a.out();
    assert_eq!(
        opcode(&again[0]),
        Opcode::RC_RDMA_READ_REQUEST,
        "the READ goes again"
    );
    assert!(a.qp.counters().retransmits >= 1);
    b.take(&again);
    assert_eq!(b.qp.counters().duplicate_request, again.len() as u64);
    settle(&mut a, &mut b);
    assert_eq!(a.qp.state(), QpState::Rts);
    let wcs: Vec<_> = std::iter::from_fn(|| a.qp.poll_completion())
        .map(|w| (w.wr_id, w.status))
        .collect();
    assert_eq!(wcs, [(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(b.mem.region(0).bytes[64..72], [0u8; 8]);
}

#[test]
fn naks_are_counted_on_both_sides_by_code() {
    // Remote access error: a WRITE with a bad rkey.
    let (mut a, mut b) = pair();
    let s = a.sge(0, 8);
    a.qp.post_send(SendWr::new(1, SendOp::Write, vec![s]).remote(BASE, b.rkey() ^ 0x100))
        .unwrap();
    settle(&mut a, &mut b);
    assert_eq!(b.qp.counters().rkey_violations, 1);
    assert_eq!(a.qp.counters().req_remote_access_errors, 1);
    assert_eq!(
        (a.qp.state(), b.qp.state()),
        (QpState::Error, QpState::Error)
    );

    // Invalid request: a misaligned atomic.
    let (mut a, mut b) = pair();
    let s = a.sge(0, 8);
    a.qp.post_send(SendWr::new(1, SendOp::FetchAdd { add: 1 }, vec![s]).remote(BASE + 4, b.rkey()))
        .unwrap();
    settle(&mut a, &mut b);
    assert_eq!(b.qp.counters().send_invalid_request, 1);
    assert_eq!(a.qp.counters().req_remote_invalid_request, 1);
    assert_eq!(b.mem.region(0).bytes[..16], [0u8; 16], "nothing added");

    // Remote operational error: a SEND into a receive request whose buffer key is bad.
    let (mut a, mut b) = pair();
    let mut bad = b.sge(0, 64);
    bad.lkey ^= 0x100;
    b.qp.post_recv(RecvWr {
        wr_id: 9,
        sgl: vec![bad],
    })
    .unwrap();
    let s = a.sge(0, 8);
    a.qp.post_send(SendWr::new(1, SendOp::Send, vec![s]))
        .unwrap();
    settle(&mut a, &mut b);
    assert_eq!(b.qp.counters().send_remote_op_err, 1);
    assert_eq!(a.qp.counters().remote_op_err, 1);
    assert_eq!(b.qp.counters().rdma_recvs, 0, "the receive failed");
}
