//! Long transfers: PSN wrap-around inside a message, an ACK past a rewind point, and 1 GiB in
//! one WRITE through the simulator.

use core::time::Duration;

use ferroce_proto::sim::pair::{default_rts, Pair};
use ferroce_proto::sim::{ack_packet, NetConfig, Rng};
use ferroce_proto::{
    Access, InitAttr, PathMtu, QpCaps, QueuePair, RtrAttr, RtsAttr, SendOp, SendWr, Sge, VecMemory,
    WcStatus,
};
use ferroce_wire::aeth::{NakCode, Syndrome};
use ferroce_wire::{Psn, RocePacket};

#[test]
fn messages_cross_the_psn_wrap_both_ways() {
    // Both QPs start 3 PSNs before 2^24; each 10-packet message crosses the wrap.
    let start = (1 << 24) - 3;
    let net = NetConfig {
        loss: 0.05,
        ..NetConfig::perfect(Duration::from_micros(5))
    };
    let mut p = Pair::new(11, net, PathMtu::Mtu256, default_rts(), start, start);
    let len = 2560;
    let a_src = p.register(0, len, Access::ALL);
    let b_dst = p.register(1, len, Access::ALL);
    let b_src = p.register(1, len, Access::ALL);
    let a_dst = p.register(0, len, Access::ALL);
    let mut data = vec![0u8; len];
    Rng::new(5).fill(&mut data);
    p.bytes_mut(a_src).copy_from_slice(&data);
    p.bytes_mut(b_src).copy_from_slice(&data);
    p.post_send(
        0,
        SendWr::new(1, SendOp::Write, vec![a_src.sge(0, len)]).remote(b_dst.addr(0), b_dst.rkey),
    )
    .unwrap();
    p.post_send(
        1,
        SendWr::new(2, SendOp::Write, vec![b_src.sge(0, len)]).remote(a_dst.addr(0), a_dst.rkey),
    )
    .unwrap();
    p.post_send(
        0,
        SendWr::new(3, SendOp::Read, vec![a_dst.sge(0, len)]).remote(b_dst.addr(0), b_dst.rkey),
    )
    .unwrap();
    let a = p.wait_completions(0, 2, Duration::from_secs(10));
    let b = p.wait_completions(1, 1, Duration::from_secs(10));
    assert!(
        a.iter().chain(&b).all(|w| w.status == WcStatus::Success),
        "{a:?} {b:?}"
    );
    assert_eq!(p.bytes(b_dst), &data[..]);
    assert_eq!(p.bytes(a_dst), &data[..]);
    assert!(
        p.qp(0).next_send_psn().value() < 100,
        "the PSN wrapped: {}",
        p.qp(0).next_send_psn()
    );
}

/// Regression (found by scenario seed 28): a sequence-error NAK rewinds the requester, and an
/// older ACK covering packets past the rewind point arrives before it transmits again. The
/// requester must resume after the ACKed packets, with its timer armed, not stall.
#[test]
fn ack_beyond_a_rewind_point_does_not_stall_the_requester() {
    let mut mem = VecMemory::new();
    let src = mem.register(1, 0x1000, 256 * 10, Access::ALL);
    let lkey = mem.region(src).lkey;
    let mut a = QueuePair::new(0x11, 1, QpCaps::default());
    a.modify_to_init(&InitAttr::default()).unwrap();
    let rtr = RtrAttr {
        path_mtu: PathMtu::Mtu256,
        dest_qpn: 0x22,
        dest_gid: std::net::Ipv6Addr::LOCALHOST,
        rq_psn: Psn::new(0),
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
    };
    a.modify_to_rtr(&rtr).unwrap();
    a.modify_to_rts(&RtsAttr {
        sq_psn: Psn::new(100),
        ..default_rts()
    })
    .unwrap();
    let sge = Sge {
        addr: 0x1000,
        length: 256 * 10,
        lkey,
    };
    a.post_send(SendWr::new(1, SendOp::Write, vec![sge]).remote(0x9000, 0x77))
        .unwrap();
    let now = ferroce_proto::Instant::from_nanos(1_000);
    let mut buf = vec![0u8; 4096];
    let mut sent = Vec::new();
    while let Some(n) = a.poll_transmit(now, &mut mem, &mut buf) {
        sent.push(
            RocePacket::new_checked(&buf[..n])
                .unwrap()
                .bth()
                .psn()
                .value(),
        );
    }
    assert_eq!(sent, (100..110).collect::<Vec<_>>());
    // The peer NAKs PSN 103; then an older cumulative ACK through 107 is handled before A sends.
    a.handle_packet(
        now,
        &mut mem,
        &ack_packet(
            0x11,
            Psn::new(103),
            Syndrome::Nak(NakCode::PsnSequenceError),
        ),
    )
    .unwrap();
    a.handle_packet(
        now,
        &mut mem,
        &ack_packet(0x11, Psn::new(107), Syndrome::Ack { credits: 31 }),
    )
    .unwrap();
    assert_eq!(a.unacked_psn(), Psn::new(108));
    let mut resent = Vec::new();
    while let Some(n) = a.poll_transmit(now, &mut mem, &mut buf) {
        resent.push(
            RocePacket::new_checked(&buf[..n])
                .unwrap()
                .bth()
                .psn()
                .value(),
        );
    }
    assert_eq!(resent, vec![108, 109], "resume after what the ACK covered");
    assert!(
        a.next_timeout().is_some(),
        "packets are outstanding, so the ACK timer runs"
    );
    a.handle_packet(
        now,
        &mut mem,
        &ack_packet(0x11, Psn::new(109), Syndrome::Ack { credits: 31 }),
    )
    .unwrap();
    let wc = a.poll_completion().expect("the WRITE completes");
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
}

#[test]
fn one_gib_in_one_write() {
    const LEN: usize = 1 << 30;
    let mut p = Pair::new(
        1,
        NetConfig::perfect(Duration::from_micros(2)),
        PathMtu::Mtu4096,
        default_rts(),
        7,
        9,
    );
    let src = p.register(0, LEN, Access::ALL);
    let dst = p.register(1, LEN, Access::ALL);
    let mut rng = Rng::new(99);
    rng.fill(&mut p.bytes_mut(src)[..]);
    p.post_send(
        0,
        SendWr::new(1, SendOp::Write, vec![src.sge(0, LEN)]).remote(dst.addr(0), dst.rkey),
    )
    .unwrap();
    let a = p.wait_completions(0, 1, Duration::from_secs(60));
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].status, WcStatus::Success);
    let (s, d) = (p.bytes(src), p.bytes(dst));
    assert!(s == d, "1 GiB arrived byte for byte");
    assert_eq!(p.qp(0).counters().sent_pkts, (LEN / 4096) as u64);
}
