//! Loss recovery when retries and their network copies overlap, driven packet by packet: each
//! case reproduces a failure first seen through the chaos relay on real sockets (5% loss,
//! reordering and duplication), where the responder handles a whole batch of received packets
//! before it transmits.

use ferroce_proto::sim::ack_packet;
use ferroce_proto::sim::pair::default_rts;
use ferroce_proto::{
    Access, InitAttr, Instant, PathMtu, QpCaps, QpState, QueuePair, RtrAttr, RtsAttr, SendOp,
    SendWr, Sge, VecMemory, WcStatus,
};
use ferroce_wire::aeth::{NakCode, Syndrome};
use ferroce_wire::{Psn, RocePacket};

const A_QPN: u32 = 0x11;
const B_QPN: u32 = 0x22;
const A_PSN: u32 = 1000;
const B_PSN: u32 = 5000;

/// Two QPs in RTS, each pointing at the other, MTU 256, 16 READ/atomic resources each way.
fn pair() -> (QueuePair, QueuePair) {
    let make = |qpn, peer, sq, rq| {
        let mut q = QueuePair::new(qpn, 1, QpCaps::default());
        q.modify_to_init(&InitAttr::default()).unwrap();
        q.modify_to_rtr(&RtrAttr {
            path_mtu: PathMtu::Mtu256,
            dest_qpn: peer,
            dest_gid: std::net::Ipv6Addr::LOCALHOST,
            rq_psn: Psn::new(rq),
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
        })
        .unwrap();
        q.modify_to_rts(&RtsAttr {
            sq_psn: Psn::new(sq),
            max_rd_atomic: 16,
            ..default_rts()
        })
        .unwrap();
        q
    };
    (
        make(A_QPN, B_QPN, A_PSN, B_PSN),
        make(B_QPN, A_QPN, B_PSN, A_PSN),
    )
}

fn drain(q: &mut QueuePair, now: Instant, mem: &mut VecMemory) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 4096];
    while let Some(n) = q.poll_transmit(now, mem, &mut buf) {
        out.push(buf[..n].to_vec());
    }
    out
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
