//! Error paths: each gives its IBTA status, moves the QP to ERR and flushes what was behind it.

use core::time::Duration;

use ferroce_proto::attr::ack_timeout;
use ferroce_proto::sim::pair::{default_rts, Pair, Region};
use ferroce_proto::sim::NetConfig;
use ferroce_proto::{
    Access, InitAttr, PathMtu, QpState, RtsAttr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

const LIMIT: Duration = Duration::from_secs(30);

/// A on the left posts `first` and then two WRITEs that should be flushed.
fn fail_then_flush(
    p: &mut Pair,
    first: SendWr,
    ok_target: Region,
    src: Region,
) -> Vec<WorkCompletion> {
    p.post_send(0, first).unwrap();
    for id in [101, 102] {
        p.post_send(
            0,
            SendWr::new(id, SendOp::Write, vec![src.sge(0, 8)])
                .remote(ok_target.addr(0), ok_target.rkey),
        )
        .unwrap();
    }
    p.wait_completions(0, 3, LIMIT)
}

fn assert_failed_and_flushed(wcs: &[WorkCompletion], status: WcStatus) {
    assert_eq!(wcs.len(), 3, "{wcs:?}");
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, status), "{wcs:?}");
    for (wc, id) in wcs[1..].iter().zip([101, 102]) {
        assert_eq!((wc.wr_id, wc.status), (id, WcStatus::WorkRequestFlushed));
    }
}

fn setup() -> (Pair, Region, Region, Region) {
    let mut p = Pair::lossless();
    let src = p.register(0, 4096, Access::LOCAL_WRITE);
    let target = p.register(1, 4096, Access::ALL);
    let ok = p.register(1, 64, Access::ALL);
    p.bytes_mut(src).fill(0x5a);
    (p, src, target, ok)
}

#[test]
fn wrong_rkey_is_a_remote_access_error() {
    let (mut p, src, target, ok) = setup();
    let wr = SendWr::new(1, SendOp::Write, vec![src.sge(0, 100)])
        .remote(target.addr(0), target.rkey ^ 0x100);
    let wcs = fail_then_flush(&mut p, wr, ok, src);
    assert_failed_and_flushed(&wcs, WcStatus::RemoteAccessError);
    assert_eq!(p.state(0), QpState::Error);
    assert_eq!(
        p.state(1),
        QpState::Error,
        "the responder of a class C error goes to ERR too"
    );
    assert!(p.bytes(target).iter().all(|&b| b == 0), "nothing written");
    assert!(
        p.bytes(ok).iter().all(|&b| b == 0),
        "the flushed WRITEs never ran"
    );
    assert_eq!(p.qp(1).counters().rkey_violations, 1);
}

#[test]
fn out_of_bounds_write_and_read_are_remote_access_errors() {
    for op in [SendOp::Write, SendOp::Read] {
        let (mut p, src, target, ok) = setup();
        // One byte past the end.
        let wr =
            SendWr::new(1, op, vec![src.sge(0, 100)]).remote(target.addr(4096 - 99), target.rkey);
        let wcs = fail_then_flush(&mut p, wr, ok, src);
        assert_failed_and_flushed(&wcs, WcStatus::RemoteAccessError);
        assert!(p.bytes(target).iter().all(|&b| b == 0));
        if op == SendOp::Read {
            assert!(p.bytes(src).iter().all(|&b| b == 0x5a), "no data came back");
        }
    }
}

#[test]
fn address_below_the_region_and_length_overflow_are_refused() {
    let (mut p, src, target, ok) = setup();
    let wr =
        SendWr::new(1, SendOp::Write, vec![src.sge(0, 16)]).remote(target.addr(0) - 8, target.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::RemoteAccessError,
    );
    let (mut p, src, target, ok) = setup();
    let wr = SendWr::new(1, SendOp::Write, vec![src.sge(0, 16)]).remote(u64::MAX - 4, target.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::RemoteAccessError,
    );
}

#[test]
fn missing_access_flags_are_remote_access_errors() {
    // A WRITE into a region registered without remote write.
    let (mut p, src, _, ok) = setup();
    let ro = p.register(1, 64, Access::REMOTE_READ);
    let wr = SendWr::new(1, SendOp::Write, vec![src.sge(0, 8)]).remote(ro.addr(0), ro.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::RemoteAccessError,
    );
    // A READ from a region without remote read.
    let (mut p, src, _, ok) = setup();
    let wo = p.register(1, 64, Access::REMOTE_WRITE);
    let wr = SendWr::new(1, SendOp::Read, vec![src.sge(0, 8)]).remote(wo.addr(0), wo.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::RemoteAccessError,
    );
    // An atomic on a region without remote atomic.
    let (mut p, src, _, ok) = setup();
    let rw = p.register(1, 64, Access::REMOTE_READ.with(Access::REMOTE_WRITE));
    let wr = SendWr::new(1, SendOp::FetchAdd { add: 1 }, vec![src.sge(0, 8)])
        .remote(rw.addr(0), rw.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::RemoteAccessError,
    );
}

#[test]
fn qp_without_remote_write_refuses_writes_even_to_open_regions() {
    let (mut p, src, target, _) = setup();
    // B's QP allows everything by default: reset it and reconnect it with remote read only,
    // while its region still grants remote write.
    let qpn_b = p.qpn[1];
    let qpb = p.qp(1);
    qpb.reset();
    qpb.modify_to_init(&InitAttr {
        access: Access::REMOTE_READ,
        ..InitAttr::default()
    })
    .unwrap();
    let gid_a = p.sim.nodes[0].gid();
    let qpn_a = p.qpn[0];
    let psn = p.qp(0).next_send_psn();
    let qpb = p.sim.nodes[1].qps.get_mut(&qpn_b).unwrap();
    qpb.modify_to_rtr(&ferroce_proto::RtrAttr {
        path_mtu: PathMtu::Mtu1024,
        dest_qpn: qpn_a,
        dest_gid: gid_a,
        rq_psn: psn,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
    })
    .unwrap();
    let wr = SendWr::new(1, SendOp::Write, vec![src.sge(0, 8)]).remote(target.addr(0), target.rkey);
    p.post_send(0, wr).unwrap();
    let wcs = p.wait_completions(0, 1, LIMIT);
    assert_eq!(wcs[0].status, WcStatus::RemoteAccessError);
    assert!(p.bytes(target).iter().all(|&b| b == 0));
}

#[test]
fn misaligned_atomic_is_an_invalid_request() {
    let (mut p, src, target, ok) = setup();
    let wr = SendWr::new(1, SendOp::FetchAdd { add: 1 }, vec![src.sge(0, 8)])
        .remote(target.addr(4), target.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::RemoteInvalidRequestError,
    );
}

#[test]
fn send_longer_than_the_receive_buffer() {
    let (mut p, src, target, ok) = setup();
    p.post_recv(1, 9, vec![target.sge(0, 100)]).unwrap();
    let wr = SendWr::new(1, SendOp::Send, vec![src.sge(0, 2000)]);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::RemoteInvalidRequestError,
    );
    let b = p.take_completions(1);
    assert_eq!(
        (b[0].wr_id, b[0].status, b[0].opcode),
        (9, WcStatus::LocalLengthError, WcOpcode::Recv)
    );
}

#[test]
fn bad_local_key_is_a_local_protection_error() {
    let (mut p, src, target, ok) = setup();
    let mut sge = src.sge(0, 64);
    sge.lkey ^= 0x4400;
    let wr = SendWr::new(1, SendOp::Write, vec![sge]).remote(target.addr(0), target.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::LocalProtectionError,
    );
    // A READ whose local buffer cannot be written.
    let (mut p, src, target, ok) = setup();
    let ro = p.register(0, 64, Access::NONE);
    let wr = SendWr::new(1, SendOp::Read, vec![ro.sge(0, 64)]).remote(target.addr(0), target.rkey);
    assert_failed_and_flushed(
        &fail_then_flush(&mut p, wr, ok, src),
        WcStatus::LocalProtectionError,
    );
}

#[test]
fn silent_peer_exhausts_the_transport_retry_counter() {
    for retry_cnt in [0u8, 3, 7] {
        let rts = RtsAttr {
            retry_cnt,
            timeout: 12,
            ..default_rts()
        };
        let mut p = Pair::new(
            3,
            NetConfig::perfect(Duration::from_micros(5)),
            PathMtu::Mtu1024,
            rts,
            1,
            2,
        );
        let src = p.register(0, 64, Access::LOCAL_WRITE);
        let dst = p.register(1, 64, Access::ALL);
        p.sim
            .cut_link(0, 1, ferroce_proto::Instant::from_nanos(u64::MAX));
        let start = p.now();
        p.post_send(
            0,
            SendWr::new(1, SendOp::Write, vec![src.sge(0, 8)]).remote(dst.addr(0), dst.rkey),
        )
        .unwrap();
        p.post_send(0, SendWr::new(2, SendOp::Send, vec![src.sge(0, 8)]))
            .unwrap();
        let wcs = p.wait_completions(0, 2, Duration::from_secs(60));
        assert_eq!(wcs.len(), 2);
        assert_eq!(
            (wcs[0].wr_id, wcs[0].status),
            (1, WcStatus::TransportRetryExceeded)
        );
        assert_eq!(
            (wcs[1].wr_id, wcs[1].status),
            (2, WcStatus::WorkRequestFlushed)
        );
        // The first try and `retry_cnt` retries, each waited out for one timeout.
        let timeout = ack_timeout(12).unwrap();
        let took = p.now() - start;
        let expected = timeout * (u32::from(retry_cnt) + 1);
        assert!(
            took >= expected && took < expected + timeout,
            "retry_cnt {retry_cnt}: {took:?} vs {expected:?}"
        );
        // Each timeout retries once, and each retry resends the first packet at least, both
        // while the congestion window (halved by every timeout) still holds two. No fast
        // retransmission timeout fires: no RTT was ever measured, and without one the fast
        // timeout is the IBTA one.
        let c = p.qp(0).counters();
        assert_eq!(c.completer_retry_err, u64::from(retry_cnt) + 1, "{c:?}");
        assert_eq!(c.rto_fired, 0, "{c:?}");
        let retries = u64::from(retry_cnt);
        assert!((retries..=2 * retries).contains(&c.retransmits), "{c:?}");
        assert_eq!(p.state(0), QpState::Error);
    }
}

#[test]
fn no_receive_with_rnr_retry_zero_is_rnr_retry_exceeded() {
    let rts = RtsAttr {
        rnr_retry: 0,
        ..default_rts()
    };
    let mut p = Pair::new(
        3,
        NetConfig::perfect(Duration::from_micros(5)),
        PathMtu::Mtu1024,
        rts,
        1,
        2,
    );
    let src = p.register(0, 64, Access::LOCAL_WRITE);
    p.post_send(0, SendWr::new(1, SendOp::Send, vec![src.sge(0, 8)]))
        .unwrap();
    p.post_send(0, SendWr::new(2, SendOp::Send, vec![src.sge(0, 8)]))
        .unwrap();
    let wcs = p.wait_completions(0, 2, LIMIT);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (1, WcStatus::RnrRetryExceeded)
    );
    assert_eq!(
        (wcs[1].wr_id, wcs[1].status),
        (2, WcStatus::WorkRequestFlushed)
    );
    assert_eq!(p.qp(0).counters().rcvd_rnr_err, 1);
    assert_eq!(p.qp(1).counters().send_rnr_err, 1);
}

#[test]
fn rnr_back_off_waits_for_a_receive_then_delivers() {
    let rts = RtsAttr {
        rnr_retry: 7,
        ..default_rts()
    };
    let mut p = Pair::new(
        3,
        NetConfig::perfect(Duration::from_micros(5)),
        PathMtu::Mtu1024,
        rts,
        1,
        2,
    );
    let src = p.register(0, 64, Access::LOCAL_WRITE);
    let dst = p.register(1, 64, Access::LOCAL_WRITE);
    p.bytes_mut(src)[..5].copy_from_slice(b"hello");
    p.post_send(0, SendWr::new(1, SendOp::Send, vec![src.sge(0, 5)]))
        .unwrap();
    // Let a few RNR NAKs happen (min RNR timer code 1 = 10 µs), then post the receive.
    p.run(Duration::from_micros(200));
    assert!(p.qp(1).counters().send_rnr_err >= 2);
    assert!(p.take_completions(0).is_empty());
    p.post_recv(1, 8, vec![dst.sge(0, 64)]).unwrap();
    let a = p.wait_completions(0, 1, LIMIT);
    assert_eq!(a[0].status, WcStatus::Success);
    assert_eq!(&p.bytes(dst)[..5], b"hello");
    assert_eq!(p.state(0), QpState::Rts);
}
