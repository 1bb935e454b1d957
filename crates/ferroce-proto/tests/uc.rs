//! UC queue pairs: SEND and WRITE without acknowledgements. Two UC QPs are driven by hand,
//! packet by packet, so a test can lose exactly the packet it means; the receiver must deliver
//! every message that arrives whole, byte for byte and in order, and nothing of one that lost
//! a packet.

use ferroce_proto::attr::Service;
use ferroce_proto::sim::pair::{default_rtr, default_rts};
use ferroce_proto::{
    Access, InitAttr, Instant, PostError, QpCaps, QpState, QueuePair, RecvWr, SendOp, SendWr, Sge,
    VecMemory, WcOpcode, WcStatus, WorkCompletion,
};
use ferroce_wire::{Opcode, Psn, RocePacket};

struct Node {
    qp: QueuePair,
    mem: VecMemory,
}

const BASE: u64 = 0x10_0000;
const REGION: usize = 1 << 20;

fn uc_qp(qpn: u32, peer: u32, rq_psn: u32, sq_psn: u32) -> QueuePair {
    let mut qp = QueuePair::with_service(qpn, 1, QpCaps::default(), Service::Uc);
    qp.modify_to_init(&InitAttr::default()).unwrap();
    qp.modify_to_rtr(&default_rtr(peer, Psn::new(rq_psn)))
        .unwrap();
    qp.modify_to_rts(&ferroce_proto::RtsAttr {
        sq_psn: Psn::new(sq_psn),
        ..default_rts()
    })
    .unwrap();
    qp
}

/// A (QPN 0x21) connected to B (QPN 0x22) over UC, MTU 1024, A's first PSN 0xfffffe (so the
/// PSNs wrap); each has one 1 MiB region with every right (index 0) at `BASE`.
fn pair() -> (Node, Node) {
    let mk = |qp: QueuePair| {
        let mut mem = VecMemory::new();
        mem.register(1, BASE, REGION, Access::ALL.with(Access::LOCAL_WRITE));
        Node { qp, mem }
    };
    (
        mk(uc_qp(0x21, 0x22, 7, 0x00ff_fffe)),
        mk(uc_qp(0x22, 0x21, 0x00ff_fffe, 7)),
    )
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
    fn fill(&mut self, off: u64, seed: u8, len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        let o = off as usize;
        self.mem.region_mut(0).bytes[o..o + len].copy_from_slice(&data);
        data
    }
    fn bytes(&self, off: u64, len: usize) -> Vec<u8> {
        let o = off as usize;
        self.mem.region(0).bytes[o..o + len].to_vec()
    }
    fn send(&mut self, wr_id: u64, op: SendOp, off: u64, len: u32, remote: u64) {
        let mut wr = SendWr::new(wr_id, op, vec![self.sge(off, len)]);
        if op.is_rdma() {
            wr = wr.remote(BASE + remote, self.rkey());
        }
        self.qp.post_send(wr).unwrap();
    }
    fn recv(&mut self, wr_id: u64, off: u64, len: u32) {
        let sge = self.sge(off, len);
        self.qp
            .post_recv(RecvWr {
                wr_id,
                sgl: vec![sge],
            })
            .unwrap();
    }
    /// Everything the QP sends now.
    fn out(&mut self) -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        let mut buf = vec![0u8; 4096 + 64];
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
    fn completions(&mut self) -> Vec<WorkCompletion> {
        std::iter::from_fn(|| self.qp.poll_completion()).collect()
    }
}

fn opcode(p: &[u8]) -> Opcode {
    RocePacket::new_checked(p).unwrap().opcode()
}

fn ack_req(p: &[u8]) -> bool {
    RocePacket::new_checked(p).unwrap().bth().ack_req()
}

fn ids_and_status(wcs: &[WorkCompletion]) -> Vec<(u64, WcStatus, WcOpcode)> {
    wcs.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect()
}

#[test]
fn send_and_writes_arrive_whole_and_the_sender_completes_without_any_answer() {
    let (mut a, mut b) = pair();
    let sent = a.fill(0, 1, 3000);
    let written = a.fill(8192, 2, 2500);
    b.recv(10, 0, 4096);
    b.recv(11, 4096, 64);
    a.send(1, SendOp::SendWithImm(0xfeed), 0, 3000, 0);
    a.send(2, SendOp::WriteWithImm(0xbeef), 8192, 2500, 65536);
    a.send(3, SendOp::Write, 8192, 0, 0);
    let pkts = a.out();
    let ops: Vec<Opcode> = pkts.iter().map(|p| opcode(p)).collect();
    assert_eq!(
        ops,
        [
            Opcode::UC_SEND_FIRST,
            Opcode::UC_SEND_MIDDLE,
            Opcode::UC_SEND_LAST_WITH_IMMEDIATE,
            Opcode::UC_RDMA_WRITE_FIRST,
            Opcode::UC_RDMA_WRITE_MIDDLE,
            Opcode::UC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
            Opcode::UC_RDMA_WRITE_ONLY,
        ]
    );
    assert!(pkts.iter().all(|p| !ack_req(p)), "UC never asks for an ACK");
    // The PSNs run on across the wrap.
    let psns: Vec<u32> = pkts
        .iter()
        .map(|p| RocePacket::new_checked(&p[..]).unwrap().bth().psn().value())
        .collect();
    assert_eq!(psns, [0xff_fffe, 0xff_ffff, 0, 1, 2, 3, 4]);
    // Sent is done: every request completed before the peer saw a byte.
    let wcs = a.completions();
    assert_eq!(
        ids_and_status(&wcs),
        [
            (1, WcStatus::Success, WcOpcode::Send),
            (2, WcStatus::Success, WcOpcode::RdmaWrite),
            (3, WcStatus::Success, WcOpcode::RdmaWrite),
        ]
    );
    assert_eq!(wcs[0].byte_len, 3000);
    assert_eq!(a.qp.send_queue_len(), 0);
    b.take(&pkts);
    assert!(b.out().is_empty(), "a UC responder answers nothing");
    let wcs = b.completions();
    assert_eq!(
        ids_and_status(&wcs),
        [
            (10, WcStatus::Success, WcOpcode::Recv),
            (11, WcStatus::Success, WcOpcode::RecvRdmaWithImm),
        ]
    );
    assert_eq!((wcs[0].byte_len, wcs[0].imm_data), (3000, Some(0xfeed)));
    assert_eq!((wcs[1].byte_len, wcs[1].imm_data), (2500, Some(0xbeef)));
    assert_eq!(b.bytes(0, 3000), sent);
    assert_eq!(b.bytes(65536, 2500), written);
    assert_eq!(b.qp.expected_psn(), Psn::new(5));
    assert_eq!(b.qp.counters().uc_dropped_packets, 0);
    assert_eq!(a.qp.counters().rdma_sends, 1);
}

#[test]
fn a_lost_packet_drops_its_send_and_the_receive_request_takes_the_next() {
    let (mut a, mut b) = pair();
    a.fill(0, 3, 3000);
    let second = a.fill(4096, 4, 1500);
    b.recv(10, 0, 4096);
    b.recv(11, 8192, 4096);
    a.send(1, SendOp::Send, 0, 3000, 0);
    a.send(2, SendOp::Send, 4096, 1500, 0);
    let mut pkts = a.out();
    assert_eq!(pkts.len(), 5);
    pkts.remove(1); // the first SEND's MIDDLE
    b.take(&pkts);
    let wcs = b.completions();
    // The first SEND is gone whole; its receive request (10) took the second message.
    assert_eq!(
        ids_and_status(&wcs),
        [(10, WcStatus::Success, WcOpcode::Recv)]
    );
    assert_eq!(wcs[0].byte_len, 1500);
    assert_eq!(b.bytes(0, 1500), second);
    assert_eq!(b.qp.recv_queue_len(), 1);
    let c = b.qp.counters();
    assert_eq!(c.uc_dropped_packets, 1, "the LAST behind the gap");
    // The LAST after the gap, and the next FIRST that took the sequence up again.
    assert_eq!(c.out_of_seq_request, 2);
    assert_eq!(b.qp.state(), QpState::Rts);
    // Both sends completed at the sender, which never learns of the loss.
    assert_eq!(a.completions().len(), 2);
}

#[test]
fn a_write_whose_first_packet_is_lost_touches_nothing() {
    let (mut a, mut b) = pair();
    a.fill(0, 5, 3072);
    let later = a.fill(4096, 6, 100);
    a.send(1, SendOp::Write, 0, 3072, 0);
    a.send(2, SendOp::Write, 4096, 100, 8192);
    let mut pkts = a.out();
    pkts.remove(0);
    b.take(&pkts);
    assert!(b.bytes(0, 3072).iter().all(|&x| x == 0), "nothing placed");
    assert_eq!(b.bytes(8192, 100), later);
    assert_eq!(b.qp.counters().uc_dropped_packets, 2);
}

#[test]
fn refused_messages_are_dropped_silently_and_the_qp_serves_the_next() {
    let (mut a, mut b) = pair();
    let data = a.fill(0, 7, 2048);
    // No receive request: the SEND is dropped, no RNR NAK, the QP stays up.
    a.send(1, SendOp::Send, 0, 2048, 0);
    // A bad R_Key: dropped, no NAK.
    let mut bad = SendWr::new(2, SendOp::Write, vec![a.sge(0, 2048)]).remote(BASE, 0xdead_0000);
    bad.flags.signaled = true;
    a.qp.post_send(bad).unwrap();
    // Too long for the receive request posted next: dropped, the request kept.
    a.send(3, SendOp::Send, 0, 2048, 0);
    let first = a.out();
    b.take(&first[..2]);
    b.take(&first[2..4]);
    b.recv(10, 0, 1024);
    b.take(&first[4..]);
    assert!(b.out().is_empty(), "nothing answered");
    assert!(b.completions().is_empty());
    let c = b.qp.counters();
    assert_eq!(
        (c.send_rnr_err, c.rkey_violations, c.send_invalid_request),
        (1, 1, 1)
    );
    // The first two were refused at their first packet and their second was skipped; the
    // third was refused at its second, when it overflowed the receive request.
    assert_eq!(c.uc_dropped_packets, 2);
    assert_eq!(b.qp.state(), QpState::Rts);
    // The QP serves the next message, into the same receive request.
    b.recv(11, 4096, 4096);
    a.send(4, SendOp::Send, 0, 1000, 0);
    a.send(5, SendOp::Send, 0, 2048, 0);
    let pkts = a.out();
    b.take(&pkts);
    let wcs = b.completions();
    assert_eq!(
        ids_and_status(&wcs),
        [
            (10, WcStatus::Success, WcOpcode::Recv),
            (11, WcStatus::Success, WcOpcode::Recv)
        ]
    );
    assert_eq!(b.bytes(0, 1000), data[..1000]);
    assert_eq!(b.bytes(4096, 2048), data);
    assert!(a
        .completions()
        .iter()
        .all(|w| w.status == WcStatus::Success));
}

#[test]
fn reads_atomics_and_invalidation_are_not_carried() {
    let (mut a, _b) = pair();
    for op in [
        SendOp::Read,
        SendOp::FetchAdd { add: 1 },
        SendOp::CompareSwap {
            compare: 0,
            swap: 1,
        },
        SendOp::SendWithInvalidate(5),
    ] {
        let wr = SendWr::new(1, op, vec![a.sge(0, 8)]).remote(BASE, a.rkey());
        assert_eq!(
            a.qp.post_send(wr),
            Err(PostError::NotOnService(Service::Uc)),
            "{op:?}"
        );
    }
    assert_eq!(a.qp.send_queue_len(), 0);
}

#[test]
fn rc_packets_do_not_reach_a_uc_qp_nor_uc_packets_an_rc_qp() {
    use ferroce_proto::sim::pair::connected_qp;
    let (mut a, mut b) = pair();
    let mut rc = Node {
        qp: connected_qp(
            0x22,
            QpCaps::default(),
            &default_rtr(0x21, Psn::new(0x00ff_fffe)),
            &default_rts(),
        ),
        mem: VecMemory::new(),
    };
    rc.mem
        .register(1, BASE, REGION, Access::ALL.with(Access::LOCAL_WRITE));
    a.fill(0, 8, 64);
    a.send(1, SendOp::Write, 0, 64, 0);
    let uc_pkts = a.out();
    rc.take(&uc_pkts);
    assert_eq!(rc.qp.counters().dropped_bad_state, 1);
    assert!(rc.bytes(0, 64).iter().all(|&x| x == 0));
    let rc_pkts = {
        rc.fill(0, 9, 64);
        let wr = SendWr::new(1, SendOp::Write, vec![rc.sge(0, 64)]).remote(BASE, b.rkey());
        rc.qp.post_send(wr).unwrap();
        rc.out()
    };
    assert_eq!(opcode(&rc_pkts[0]), Opcode::RC_RDMA_WRITE_ONLY);
    b.take(&rc_pkts);
    assert_eq!(b.qp.counters().dropped_bad_state, 1);
    assert!(b.bytes(0, 64).iter().all(|&x| x == 0));
}

#[test]
fn a_local_protection_error_fails_the_request_and_flushes_the_rest() {
    let (mut a, _b) = pair();
    let bad = SendWr::new(
        1,
        SendOp::Send,
        vec![Sge {
            addr: BASE,
            length: 64,
            lkey: 0xbad,
        }],
    );
    a.qp.post_send(bad).unwrap();
    a.send(2, SendOp::Send, 0, 64, 0);
    assert!(a.out().is_empty());
    assert_eq!(a.qp.state(), QpState::Error);
    assert_eq!(
        ids_and_status(&a.completions()),
        [
            (1, WcStatus::LocalProtectionError, WcOpcode::Send),
            (2, WcStatus::WorkRequestFlushed, WcOpcode::Send),
        ]
    );
}

/// A small deterministic generator (xorshift64*), so a failure replays from its seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Under random loss the receiver completes exactly the messages that arrived whole, in
/// order, each byte for byte, each in the next receive request; every send completes.
#[test]
fn under_random_loss_exactly_the_whole_messages_are_delivered_in_order() {
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let (mut a, mut b) = pair();
        let loss_percent = 5 + rng.below(30);
        let mut expected: Vec<(u32, Vec<u8>)> = Vec::new();
        let mut delivered = 0usize;
        for m in 0..60u32 {
            let len = rng.below(5000) as u32 + 1;
            let write = rng.below(3) == 0;
            let data = a.fill(0, m as u8, len as usize);
            if write {
                a.send(u64::from(m), SendOp::WriteWithImm(m), 0, len, 0);
            } else {
                a.send(u64::from(m), SendOp::SendWithImm(m), 0, len, 0);
            }
            // One receive request per message; those of lost messages are reused.
            b.recv(u64::from(m), 0, 8192);
            let pkts = a.out();
            let kept: Vec<Vec<u8>> = pkts
                .iter()
                .filter(|_| rng.below(100) >= loss_percent)
                .cloned()
                .collect();
            let whole = kept.len() == pkts.len();
            b.take(&kept);
            let wcs = b.completions();
            if whole {
                expected.push((m, data.clone()));
            }
            assert_eq!(wcs.len(), usize::from(whole), "seed {seed} message {m}");
            if let Some(wc) = wcs.first() {
                assert_eq!(wc.status, WcStatus::Success);
                assert_eq!(wc.imm_data, Some(m), "seed {seed}");
                assert_eq!(wc.byte_len, len);
                // The receive requests are taken in order, the lost messages' reused.
                assert_eq!(wc.wr_id, delivered as u64, "seed {seed}");
                assert_eq!(b.bytes(0, len as usize), data, "seed {seed} message {m}");
                delivered += 1;
            }
            let sent = a.completions();
            assert_eq!(sent.len(), 1);
            assert_eq!(sent[0].status, WcStatus::Success);
        }
        assert_eq!(delivered, expected.len());
        assert_eq!(b.qp.state(), QpState::Rts);
        assert!(b.out().is_empty());
    }
}
