//! The verbs API between two contexts on loopback, on both providers — RoCE v2 over real UDP
//! sockets, and shared memory — every operation and size, shared receive queues, completion
//! channels, many QPs, and teardown. Each test runs once per provider (modules `udp`, `shm`).

use std::time::Duration;

use ferroce::{
    device_by_name, Access, CompletionQueue, Context, ContextOptions, InitAttr, MemoryRegion,
    ProtectionDomain, Provider, QpCaps, QpInitAttr, QueuePair, RecvWr, RtrAttr, RtsAttr, SendOp,
    SendWr, SharedReceiveQueue, WcOpcode, WcStatus,
};

const T: Duration = Duration::from_secs(20);

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

fn side(provider: Provider) -> Side {
    let ctx = device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            provider,
            ..ContextOptions::with_port(0)
        })
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096, None).unwrap();
    Side { ctx, pd, cq }
}

fn qp(s: &Side, srq: Option<&SharedReceiveQueue>) -> QueuePair {
    let caps = QpCaps {
        max_send_wr: 512,
        max_recv_wr: 512,
        ..QpCaps::default()
    };
    s.pd.create_qp(&QpInitAttr {
        send_cq: &s.cq,
        recv_cq: &s.cq,
        caps,
        srq,
    })
    .unwrap()
}

fn connect(a: &QueuePair, actx: &Context, b: &QueuePair, bctx: &Context) {
    for (q, peer, pctx, psn) in [(a, b, bctx, 1000u32), (b, a, actx, 5000)] {
        q.modify_to_init(&InitAttr::default()).unwrap();
        let rtr = RtrAttr {
            path_mtu: ferroce::PathMtu::Mtu4096,
            dest_qpn: peer.qpn(),
            dest_gid: pctx.gid(),
            rq_psn: ferroce::Psn::new(if psn == 1000 { 5000 } else { 1000 }),
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
        };
        q.modify_to_rtr_with_port(&rtr, pctx.local_addr().port())
            .unwrap();
        let rts = RtsAttr {
            sq_psn: ferroce::Psn::new(psn),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        };
        q.modify_to_rts(&rts).unwrap();
    }
    // Both contexts use the same provider; a QP uses it (shm is forced, not just allowed).
    let want = actx.provider();
    assert_eq!(
        (a.provider(), b.provider()),
        (want, want),
        "provider of the QPs"
    );
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7) ^ (i >> 8)) as u8)
        .collect()
}

fn pair(p: Provider) -> (Side, Side, QueuePair, QueuePair) {
    let (a, b) = (side(p), side(p));
    let (qa, qb) = (qp(&a, None), qp(&b, None));
    connect(&qa, &a.ctx, &qb, &b.ctx);
    (a, b, qa, qb)
}

const SIZES: [usize; 9] = [0, 1, 1023, 4095, 4096, 4097, 65_536, 1 << 20, 16 << 20];

fn mr(s: &Side, len: usize) -> MemoryRegion {
    s.pd.alloc_mr(len.max(8), Access::ALL).unwrap()
}

fn sgl(m: &MemoryRegion, len: usize) -> Vec<ferroce::Sge> {
    if len == 0 {
        vec![]
    } else {
        vec![m.sge(0, len).unwrap()]
    }
}

fn write_read_send_at_every_size_up_to_16_mib(p: Provider) {
    let (a, b, qa, qb) = pair(p);
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(i, len);
        let src = mr(&a, len);
        let dst = mr(&b, len);
        src.write(0, &data).unwrap();
        // WRITE A → B.
        qa.post_send(SendWr::new(1, SendOp::Write, sgl(&src, len)).remote(dst.addr(), dst.rkey()))
            .unwrap();
        let wc = a.cq.wait(1, T).unwrap();
        assert_eq!(
            (wc[0].status, wc[0].opcode),
            (WcStatus::Success, WcOpcode::RdmaWrite),
            "WRITE {len}"
        );
        assert!(
            dst.to_vec(0, len).unwrap() == data,
            "WRITE {len}: bytes differ"
        );
        // READ it back into a fresh buffer.
        let back = mr(&a, len);
        qa.post_send(SendWr::new(2, SendOp::Read, sgl(&back, len)).remote(dst.addr(), dst.rkey()))
            .unwrap();
        let wc = a.cq.wait(1, T).unwrap();
        assert_eq!(
            (wc[0].status, wc[0].opcode),
            (WcStatus::Success, WcOpcode::RdmaRead),
            "READ {len}"
        );
        assert!(
            back.to_vec(0, len).unwrap() == data,
            "READ {len}: bytes differ"
        );
        // SEND with immediate A → B.
        let rbuf = mr(&b, len);
        qb.post_recv(RecvWr {
            wr_id: 70,
            sgl: sgl(&rbuf, len),
        })
        .unwrap();
        qa.post_send(SendWr::new(
            3,
            SendOp::SendWithImm(len as u32),
            sgl(&src, len),
        ))
        .unwrap();
        let wa = a.cq.wait(1, T).unwrap();
        let wb = b.cq.wait(1, T).unwrap();
        assert_eq!(wa[0].status, WcStatus::Success);
        assert_eq!(
            (
                wb[0].wr_id,
                wb[0].status,
                wb[0].byte_len as usize,
                wb[0].imm_data
            ),
            (70, WcStatus::Success, len, Some(len as u32))
        );
        assert!(
            rbuf.to_vec(0, len).unwrap() == data,
            "SEND {len}: bytes differ"
        );
    }
}

fn write_with_immediate_and_atomics(p: Provider) {
    let (a, b, qa, qb) = pair(p);
    let src = mr(&a, 4096);
    let dst = mr(&b, 4096);
    src.write(0, &pattern(1, 4096)).unwrap();
    qb.post_recv(RecvWr {
        wr_id: 9,
        sgl: vec![],
    })
    .unwrap();
    qa.post_send(
        SendWr::new(
            1,
            SendOp::WriteWithImm(0xabcd),
            vec![src.sge(0, 4096).unwrap()],
        )
        .remote(dst.addr(), dst.rkey()),
    )
    .unwrap();
    let wb = b.cq.wait(1, T).unwrap();
    assert_eq!(
        (wb[0].opcode, wb[0].imm_data, wb[0].byte_len),
        (WcOpcode::RecvRdmaWithImm, Some(0xabcd), 4096)
    );
    assert_eq!(a.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
    assert_eq!(dst.to_vec(0, 4096).unwrap(), pattern(1, 4096));

    let result = mr(&a, 128);
    dst.write_u64(0, 100).unwrap();
    for i in 0..10u64 {
        let wr = SendWr::new(
            10 + i,
            SendOp::FetchAdd { add: 3 },
            vec![result.sge(8 * i as usize, 8).unwrap()],
        );
        qa.post_send(wr.remote(dst.addr(), dst.rkey())).unwrap();
    }
    let wcs = a.cq.wait(10, T).unwrap();
    assert!(wcs
        .iter()
        .all(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::FetchAdd));
    for i in 0..10 {
        assert_eq!(result.read_u64(8 * i).unwrap(), 100 + 3 * i as u64);
    }
    assert_eq!(dst.read_u64(0).unwrap(), 130);
    let wr = SendWr::new(
        30,
        SendOp::CompareSwap {
            compare: 130,
            swap: 7,
        },
        vec![result.sge(0, 8).unwrap()],
    );
    qa.post_send(wr.remote(dst.addr(), dst.rkey())).unwrap();
    assert_eq!(a.cq.wait(1, T).unwrap()[0].opcode, WcOpcode::CompareSwap);
    assert_eq!(
        (result.read_u64(0).unwrap(), dst.read_u64(0).unwrap()),
        (130, 7)
    );
}

fn bad_rkey_gives_remote_access_error_and_untouched_memory(p: Provider) {
    let (a, b, qa, _qb) = pair(p);
    let src = mr(&a, 64);
    let dst = mr(&b, 64);
    src.fill(0, 64, 0xee).unwrap();
    qa.post_send(
        SendWr::new(1, SendOp::Write, vec![src.sge(0, 64).unwrap()])
            .remote(dst.addr(), dst.rkey() ^ 0x100),
    )
    .unwrap();
    qa.post_send(
        SendWr::new(2, SendOp::Write, vec![src.sge(0, 64).unwrap()]).remote(dst.addr(), dst.rkey()),
    )
    .unwrap();
    let wcs = a.cq.wait(2, T).unwrap();
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (1, WcStatus::RemoteAccessError)
    );
    assert_eq!(
        (wcs[1].wr_id, wcs[1].status),
        (2, WcStatus::WorkRequestFlushed)
    );
    assert!(dst.to_vec(0, 64).unwrap().iter().all(|&x| x == 0));
    assert_eq!(qa.state(), ferroce::QpState::Error);
}

/// A run of requests reusing the same buffers (the shape a same-host peer serves from its cache
/// of the last regions) still has every request checked: a repeat that leaves the local region,
/// the remote region, or the local rights fails with its own status and touches nothing.
fn repeated_requests_are_checked_every_time(p: Provider) {
    enum Bad {
        LocalBounds,
        RemoteBounds,
        LocalRights,
    }
    for bad in [Bad::LocalBounds, Bad::RemoteBounds, Bad::LocalRights] {
        let (a, b, qa, _qb) = pair(p);
        // Without local write: a WRITE may read it, a READ may not land in it.
        let src = a.pd.alloc_mr(64, Access::REMOTE_READ).unwrap();
        let dst = mr(&b, 64);
        src.write(0, &pattern(3, 64)).unwrap();
        for i in 0..4 {
            qa.post_send(
                SendWr::new(i, SendOp::Write, vec![src.sge(0, 16).unwrap()])
                    .remote(dst.addr(), dst.rkey()),
            )
            .unwrap();
        }
        let wcs = a.cq.wait(4, T).unwrap();
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        let (wr, want) = match bad {
            Bad::LocalBounds => (
                SendWr::new(
                    9,
                    SendOp::Write,
                    vec![ferroce::Sge {
                        addr: src.addr() + 56,
                        length: 16,
                        lkey: src.lkey(),
                    }],
                )
                .remote(dst.addr() + 16, dst.rkey()),
                WcStatus::LocalProtectionError,
            ),
            Bad::RemoteBounds => (
                SendWr::new(9, SendOp::Write, vec![src.sge(0, 16).unwrap()])
                    .remote(dst.addr() + 56, dst.rkey()),
                WcStatus::RemoteAccessError,
            ),
            Bad::LocalRights => (
                SendWr::new(9, SendOp::Read, vec![src.sge(0, 16).unwrap()])
                    .remote(dst.addr() + 16, dst.rkey()),
                WcStatus::LocalProtectionError,
            ),
        };
        qa.post_send(wr).unwrap();
        let wc = a.cq.wait(1, T).unwrap();
        assert_eq!((wc[0].wr_id, wc[0].status), (9, want));
        assert_eq!(qa.state(), ferroce::QpState::Error);
        let mut expected = pattern(3, 16);
        expected.resize(64, 0);
        assert_eq!(dst.to_vec(0, 64).unwrap(), expected, "the target's region");
        assert_eq!(
            src.to_vec(0, 64).unwrap(),
            pattern(3, 64),
            "the local region"
        );
    }
}

fn shared_receive_queue_feeds_several_qps(p: Provider) {
    let (a, b) = (side(p), side(p));
    let srq = b.pd.create_srq(64, 1).unwrap();
    let pairs: Vec<(QueuePair, QueuePair)> = (0..3)
        .map(|_| {
            let (qa, qb) = (qp(&a, None), qp(&b, Some(&srq)));
            connect(&qa, &a.ctx, &qb, &b.ctx);
            (qa, qb)
        })
        .collect();
    let bufs = mr(&b, 6 * 64);
    for i in 0..6 {
        srq.post_recv(RecvWr {
            wr_id: 100 + i as u64,
            sgl: vec![bufs.sge(i * 64, 64).unwrap()],
        })
        .unwrap();
    }
    assert!(
        pairs[0]
            .1
            .post_recv(RecvWr {
                wr_id: 1,
                sgl: vec![]
            })
            .is_err(),
        "an SRQ QP has no own receive queue"
    );
    let src = mr(&a, 64);
    for (i, (qa, _)) in pairs.iter().enumerate() {
        for j in 0..2 {
            src.write(0, &[(i * 2 + j) as u8; 64]).unwrap();
            qa.post_send(SendWr::new(
                j as u64,
                SendOp::Send,
                vec![src.sge(0, 16).unwrap()],
            ))
            .unwrap();
            a.cq.wait(1, T).unwrap();
        }
    }
    let wcs = b.cq.wait(6, T).unwrap();
    assert_eq!(wcs.len(), 6);
    let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (100..106).collect::<Vec<_>>(),
        "each SRQ entry consumed once"
    );
    assert!(srq.is_empty());
}

fn completion_channel_wakes_a_blocked_thread(p: Provider) {
    let (a, b) = (side(p), side(p));
    let ch = b.ctx.create_comp_channel().unwrap();
    let cq = b.ctx.create_cq(16, Some(&ch)).unwrap();
    let qa = qp(&a, None);
    let qb =
        b.pd.create_qp(&QpInitAttr::new(&cq, QpCaps::default()))
            .unwrap();
    connect(&qa, &a.ctx, &qb, &b.ctx);
    let buf = mr(&b, 64);
    qb.post_recv(RecvWr {
        wr_id: 5,
        sgl: vec![buf.sge(0, 64).unwrap()],
    })
    .unwrap();
    cq.req_notify(false).unwrap();
    let waiter = std::thread::spawn(move || {
        let got = ch.get_event(Some(Duration::from_secs(10))).unwrap();
        (got, cq.poll_one().unwrap())
    });
    std::thread::sleep(Duration::from_millis(50));
    let src = mr(&a, 8);
    qa.post_send(SendWr::new(1, SendOp::Send, vec![src.sge(0, 8).unwrap()]))
        .unwrap();
    let (got, wc) = waiter.join().unwrap();
    assert!(got, "the event arrived");
    assert_eq!(
        wc.map(|w| (w.wr_id, w.status)),
        Some((5, WcStatus::Success))
    );
}

fn sixty_four_qps_at_once(p: Provider) {
    let (a, b) = (side(p), side(p));
    let pairs: Vec<(QueuePair, QueuePair)> = (0..64)
        .map(|_| {
            let (qa, qb) = (qp(&a, None), qp(&b, None));
            connect(&qa, &a.ctx, &qb, &b.ctx);
            (qa, qb)
        })
        .collect();
    let len = 8192;
    let src = mr(&a, len);
    let dst = mr(&b, len * 64);
    src.write(0, &pattern(3, len)).unwrap();
    for (i, (qa, _)) in pairs.iter().enumerate() {
        for k in 0..4u64 {
            let wr = SendWr::new(k, SendOp::Write, vec![src.sge(0, len).unwrap()])
                .remote(dst.addr() + (i * len) as u64, dst.rkey());
            qa.post_send(wr).unwrap();
        }
    }
    let wcs = a.cq.wait(256, T).unwrap();
    assert_eq!(wcs.len(), 256);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
    for i in 0..64 {
        assert_eq!(dst.to_vec(i * len, len).unwrap(), pattern(3, len), "QP {i}");
    }
    assert_eq!(a.ctx.queue_pair_count(), 64);
}

/// Contexts opened with `host_slot` take ports 4791, 4792, … and number their QPs by the slot,
/// so `modify_to_rtr` (no port given) finds a same-host peer from its QPN alone: what the
/// drop-in libibverbs relies on, since C programs exchange only a GID and a QPN.
fn host_slots_name_ports_and_qpns(p: Provider) {
    let open = || {
        let ctx = device_by_name("lo")
            .unwrap()
            .open(&ContextOptions {
                capture: None,
                provider: p,
                host_slot: true,
                ..ContextOptions::default()
            })
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64, None).unwrap();
        Side { ctx, pd, cq }
    };
    let (a, b) = (open(), open());
    let (pa, pb) = (a.ctx.local_addr().port(), b.ctx.local_addr().port());
    assert_ne!(pa, pb);
    let (qa, qb) = (qp(&a, None), qp(&b, None));
    for (q, port) in [(&qa, pa), (&qb, pb)] {
        assert!((4791..4791 + 4096).contains(&port), "port {port}");
        assert_eq!(
            ferroce::host_slot::port_of_qpn(q.qpn()),
            port,
            "QPN {:#x}",
            q.qpn()
        );
    }
    for (q, peer, pctx) in [(&qa, &qb, &b.ctx), (&qb, &qa, &a.ctx)] {
        q.modify_to_init(&InitAttr::default()).unwrap();
        q.modify_to_rtr(&RtrAttr {
            path_mtu: ferroce::PathMtu::Mtu4096,
            dest_qpn: peer.qpn(),
            dest_gid: pctx.gid(),
            rq_psn: ferroce::Psn::new(7),
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
        })
        .unwrap();
        q.modify_to_rts(&RtsAttr {
            sq_psn: ferroce::Psn::new(7),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        })
        .unwrap();
    }
    let (src, dst) = (mr(&a, 4096), mr(&b, 8192));
    src.write(0, &pattern(9, 4096)).unwrap();
    qb.post_recv(RecvWr {
        wr_id: 1,
        sgl: vec![dst.sge(4096, 4096).unwrap()],
    })
    .unwrap();
    qa.post_send(SendWr::new(2, SendOp::Send, sgl(&src, 4096)))
        .unwrap();
    qa.post_send(SendWr::new(3, SendOp::Write, sgl(&src, 4096)).remote(dst.addr(), dst.rkey()))
        .unwrap();
    let got: Vec<(u64, WcStatus)> =
        a.cq.wait(2, T)
            .unwrap()
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect();
    assert_eq!(got, vec![(2, WcStatus::Success), (3, WcStatus::Success)]);
    let recv = b.cq.wait(1, T).unwrap();
    assert_eq!(
        (recv[0].wr_id, recv[0].status, recv[0].byte_len),
        (1, WcStatus::Success, 4096)
    );
    assert_eq!(dst.to_vec(0, 4096).unwrap(), pattern(9, 4096));
    assert_eq!(dst.to_vec(4096, 4096).unwrap(), pattern(9, 4096));
}

/// One completion channel, two armed CQs: each firing is one event naming its CQ, read once,
/// in order, as from a kernel completion channel (`ibv_get_cq_event` returns which CQ).
fn one_channel_reports_each_armed_cq_once(p: Provider) {
    let (a, b) = (side(p), side(p));
    let ch = b.ctx.create_comp_channel().unwrap();
    let cqs = [
        b.ctx.create_cq(16, Some(&ch)).unwrap(),
        b.ctx.create_cq(16, Some(&ch)).unwrap(),
    ];
    assert_ne!(cqs[0].event_id(), cqs[1].event_id());
    let buf = mr(&b, 128);
    let src = mr(&a, 8);
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for (i, cq) in cqs.iter().enumerate() {
        let qa = qp(&a, None);
        let qb =
            b.pd.create_qp(&QpInitAttr::new(cq, QpCaps::default()))
                .unwrap();
        connect(&qa, &a.ctx, &qb, &b.ctx);
        qb.post_recv(RecvWr {
            wr_id: i as u64,
            sgl: vec![buf.sge(64 * i, 64).unwrap()],
        })
        .unwrap();
        cq.req_notify(false).unwrap();
        senders.push(qa);
        receivers.push(qb);
    }
    assert_eq!(
        ch.try_next_event().unwrap(),
        None,
        "no event before a completion"
    );
    for (i, qa) in senders.iter().enumerate() {
        qa.post_send(SendWr::new(
            10 + i as u64,
            SendOp::Send,
            vec![src.sge(0, 8).unwrap()],
        ))
        .unwrap();
        let fired = ch.next_event(Some(T)).unwrap();
        assert_eq!(fired, Some(cqs[i].event_id()), "event {i} names CQ {i}");
        assert_eq!(cqs[i].wait(1, T).unwrap()[0].wr_id, i as u64);
    }
    // Each CQ fired once per arming: nothing more is waiting.
    assert_eq!(ch.try_next_event().unwrap(), None);
}

/// Each test once per provider.
/// One `#[test]` per provider for each scenario: `udp::name` and `shm::name`.
macro_rules! on_both_providers {
    ($($name:ident),* $(,)?) => {
        mod udp {
            $(
                #[test]
                fn $name() {
                    super::$name(ferroce::Provider::Udp)
                }
            )*
        }
        mod shm {
            $(
                #[test]
                fn $name() {
                    super::$name(ferroce::Provider::Shm)
                }
            )*
        }
    };
}

on_both_providers!(
    write_read_send_at_every_size_up_to_16_mib,
    write_with_immediate_and_atomics,
    bad_rkey_gives_remote_access_error_and_untouched_memory,
    repeated_requests_are_checked_every_time,
    shared_receive_queue_feeds_several_qps,
    completion_channel_wakes_a_blocked_thread,
    sixty_four_qps_at_once,
    host_slots_name_ports_and_qpns,
    one_channel_reports_each_armed_cq_once,
);
