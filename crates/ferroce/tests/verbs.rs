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
    side_with(ContextOptions {
        provider,
        ..ContextOptions::with_port(0)
    })
}

fn side_with(options: ContextOptions) -> Side {
    let ctx = device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            ..options
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

// ---- caller memory whose pages a context adopts (shared memory only) ------------------------

const PAGE: usize = 4096;

/// Page-aligned memory the test owns (zeroed), reached only through raw copies, as a C program
/// reaches memory a peer may write; freed on drop.
struct Pages {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl Pages {
    fn new(len: usize) -> Pages {
        let layout = std::alloc::Layout::from_size_align(len, PAGE).unwrap();
        // SAFETY: a non-zero size.
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).unwrap();
        Pages { ptr, layout }
    }
    fn at(&self, off: usize) -> std::ptr::NonNull<u8> {
        assert!(off < self.layout.size());
        // SAFETY: inside the allocation (checked).
        unsafe { self.ptr.add(off) }
    }
    fn addr(&self, off: usize) -> u64 {
        self.at(off).as_ptr() as u64
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.layout.size());
        let mut v = vec![0u8; len];
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: inside the allocation; a peer's stores are plain stores, as a NIC's DMA.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(off), v.as_mut_ptr(), len) };
        v
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.layout.size());
        // SAFETY: inside the allocation.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.as_ptr().add(off), data.len()) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
    /// Registers `len` bytes from `off`.
    fn register(&self, s: &Side, off: usize, len: usize, access: Access) -> MemoryRegion {
        assert!(off + len <= self.layout.size());
        // SAFETY: the range is inside the allocation, which outlives the region in every test
        // (regions are dropped first), and is reached only through raw copies meanwhile.
        unsafe { s.pd.register_raw(self.at(off), len, access) }.unwrap()
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// What `/proc/self/maps` names at each page of `addr..addr + len` (the path column).
fn mapping_of_pages(addr: u64, len: usize) -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    (0..len / PAGE)
        .map(|i| {
            let at = addr + (i * PAGE) as u64;
            maps.lines()
                .find_map(|l| {
                    let mut f = l.split_whitespace();
                    let (a, b) = f.next()?.split_once('-')?;
                    let (a, b) = (
                        u64::from_str_radix(a, 16).ok()?,
                        u64::from_str_radix(b, 16).ok()?,
                    );
                    (a <= at && at < b).then(|| f.skip(4).collect::<Vec<_>>().join(" "))
                })
                .unwrap_or_else(|| "unmapped".into())
        })
        .collect()
}

fn adopted(name: &str) -> bool {
    name.contains("ferroce-adopted")
}

fn adopting_pair() -> (Side, Side, QueuePair, QueuePair) {
    let open = || {
        side_with(ContextOptions {
            provider: Provider::Shm,
            adopt_registered_pages: true,
            ..ContextOptions::with_port(0)
        })
    };
    let (a, b) = (open(), open());
    let (qa, qb) = (qp(&a, None), qp(&b, None));
    connect(&qa, &a.ctx, &qb, &b.ctx);
    (a, b, qa, qb)
}

fn direct_ops(s: &Side) -> u64 {
    s.ctx.counters().direct_ops
}

/// Posts `wr` on `q` and checks its completion.
fn run(s: &Side, q: &QueuePair, wr: SendWr, want: (WcStatus, WcOpcode)) {
    let id = wr.wr_id;
    q.post_send(wr).unwrap();
    let wc = s.cq.wait(1, T).unwrap();
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode),
        (id, want.0, want.1),
        "completion of wr {id}"
    );
}

/// Registered caller memory: its whole pages move onto a memfd (same bytes, same addresses), a
/// peer WRITEs, READs and FETCH_ADDs them directly and the program sees every byte at its own
/// pointers; requests touching the partial pages at the ends take the packet path and are just
/// as right; deregistration gives the pages back with their bytes, and the old key then fails.
#[test]
fn adopted_caller_memory_is_reached_directly_and_given_back() {
    let (a, b, qa, _qb) = adopting_pair();
    // Region [100, 100 + 4 pages) of five pages: pages 1-3 whole, pages 0 and 4 partial.
    let (off, len) = (100, 4 * PAGE);
    let target = Pages::new(5 * PAGE);
    let mut model = pattern(1, 5 * PAGE);
    target.write(0, &model);
    let before = mapping_of_pages(target.addr(0), 5 * PAGE);
    assert!(!before.iter().any(|m| adopted(m)), "{before:?}");
    let mr = target.register(&b, off, len, Access::ALL);
    let during = mapping_of_pages(target.addr(0), 5 * PAGE);
    let which: Vec<bool> = during.iter().map(|m| adopted(m)).collect();
    assert_eq!(which, [false, true, true, true, false], "{during:?}");
    assert!(
        target.read(0, 5 * PAGE) == model,
        "registration changed bytes"
    );

    // The initiator's buffers are caller memory too (adopted: whole pages).
    let local = Pages::new(5 * PAGE);
    let lmr = local.register(&a, 0, 5 * PAGE, Access::ALL);
    let rkey = mr.rkey();

    // A WRITE inside the whole pages: direct.
    let data = pattern(2, 8000);
    local.write(0, &data);
    let d0 = direct_ops(&a);
    run(
        &a,
        &qa,
        SendWr::new(1, SendOp::Write, vec![lmr.sge(0, 8000).unwrap()])
            .remote(target.addr(PAGE + 50), rkey),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    assert_eq!(direct_ops(&a), d0 + 1, "the WRITE was not done directly");
    model[PAGE + 50..PAGE + 8050].copy_from_slice(&data);
    assert!(
        target.read(0, 5 * PAGE) == model,
        "direct WRITE: bytes differ"
    );

    // A WRITE over the first partial page and into the next: the packet path, as right.
    let data = pattern(3, PAGE);
    local.write(0, &data);
    run(
        &a,
        &qa,
        SendWr::new(2, SendOp::Write, vec![lmr.sge(0, PAGE).unwrap()])
            .remote(target.addr(off), rkey),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    assert_eq!(
        direct_ops(&a),
        d0 + 1,
        "a request on a partial page went direct"
    );
    model[off..off + PAGE].copy_from_slice(&data);
    assert!(
        target.read(0, 5 * PAGE) == model,
        "packet-path WRITE: bytes differ"
    );

    // The program's own store is what the peer READs.
    let mine = pattern(4, 300);
    target.write(3 * PAGE + 7, &mine);
    model[3 * PAGE + 7..3 * PAGE + 307].copy_from_slice(&mine);
    // READ the whole region back into the local pages.
    local.write(0, &vec![0xEE; 5 * PAGE]);
    run(
        &a,
        &qa,
        SendWr::new(3, SendOp::Read, vec![lmr.sge(0, len).unwrap()]).remote(target.addr(off), rkey),
        (WcStatus::Success, WcOpcode::RdmaRead),
    );
    assert!(
        local.read(0, len) == model[off..off + len],
        "READ: bytes differ"
    );

    // FETCH_ADD on a word of a whole page: direct, and the program sees the sum.
    let word = 2 * PAGE + 64;
    let old = u64::from_ne_bytes(model[word..word + 8].try_into().unwrap());
    let d1 = direct_ops(&a);
    run(
        &a,
        &qa,
        SendWr::new(4, SendOp::FetchAdd { add: 5 }, vec![lmr.sge(0, 8).unwrap()])
            .remote(target.addr(word), rkey),
        (WcStatus::Success, WcOpcode::FetchAdd),
    );
    assert_eq!(
        direct_ops(&a),
        d1 + 1,
        "the FETCH_ADD was not done directly"
    );
    assert_eq!(local.read(0, 8), old.to_ne_bytes(), "FETCH_ADD original");
    model[word..word + 8].copy_from_slice(&old.wrapping_add(5).to_ne_bytes());
    assert!(target.read(0, 5 * PAGE) == model, "FETCH_ADD: bytes differ");

    // Deregistration gives the pages back, bytes and all.
    drop(mr);
    let after = mapping_of_pages(target.addr(0), 5 * PAGE);
    assert!(!after.iter().any(|m| adopted(m)), "{after:?}");
    assert!(
        target.read(0, 5 * PAGE) == model,
        "deregistration changed bytes"
    );
    // The old key reaches nothing: the request fails and touches no byte.
    local.write(0, &[0x55; 64]);
    run(
        &a,
        &qa,
        SendWr::new(5, SendOp::Write, vec![lmr.sge(0, 64).unwrap()])
            .remote(target.addr(PAGE), rkey),
        (WcStatus::RemoteAccessError, WcOpcode::RdmaWrite),
    );
    assert!(
        target.read(0, 5 * PAGE) == model,
        "a WRITE after deregistration landed"
    );
    drop(lmr);
    assert!(!mapping_of_pages(local.addr(0), 5 * PAGE)
        .iter()
        .any(|m| adopted(m)));
}

/// Two regions over the same pages share one memfd; the pages go back when the last goes.
#[test]
fn two_regions_over_the_same_pages_share_one_adoption() {
    let (a, b, qa, _qb) = adopting_pair();
    let target = Pages::new(4 * PAGE);
    let whole = target.register(&b, 0, 4 * PAGE, Access::ALL);
    let inner = target.register(
        &b,
        PAGE,
        2 * PAGE,
        Access::REMOTE_WRITE.with(Access::LOCAL_WRITE),
    );
    let local = Pages::new(PAGE);
    let lmr = local.register(&a, 0, PAGE, Access::ALL);
    let data = pattern(5, 100);
    local.write(0, &data);
    let d0 = direct_ops(&a);
    for (id, rkey, at) in [(1, whole.rkey(), 10), (2, inner.rkey(), PAGE + 500)] {
        run(
            &a,
            &qa,
            SendWr::new(id, SendOp::Write, vec![lmr.sge(0, 100).unwrap()])
                .remote(target.addr(at), rkey),
            (WcStatus::Success, WcOpcode::RdmaWrite),
        );
        assert!(target.read(at, 100) == data, "WRITE {id}: bytes differ");
    }
    assert_eq!(direct_ops(&a), d0 + 2, "both WRITEs direct");
    drop(whole);
    assert!(mapping_of_pages(target.addr(PAGE), PAGE)
        .iter()
        .all(|m| adopted(m)));
    run(
        &a,
        &qa,
        SendWr::new(3, SendOp::Write, vec![lmr.sge(0, 100).unwrap()])
            .remote(target.addr(2 * PAGE), inner.rkey()),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    assert!(target.read(2 * PAGE, 100) == data);
    assert_eq!(direct_ops(&a), d0 + 3);
    drop(inner);
    let after = mapping_of_pages(target.addr(0), 4 * PAGE);
    assert!(!after.iter().any(|m| adopted(m)), "{after:?}");
    let mut model = vec![0u8; 4 * PAGE];
    for at in [10, PAGE + 500, 2 * PAGE] {
        model[at..at + 100].copy_from_slice(&data);
    }
    assert!(target.read(0, 4 * PAGE) == model);
}

/// `fork` gives the child a private copy of adopted pages: the child's stores stay in the
/// child, and a peer's WRITE after the fork lands in the parent only.
#[test]
fn fork_gives_the_child_private_copies_of_adopted_pages() {
    let (a, b, qa, _qb) = adopting_pair();
    let target = Pages::new(2 * PAGE);
    let original = pattern(6, 2 * PAGE);
    target.write(0, &original);
    let mr = target.register(&b, 0, 2 * PAGE, Access::ALL);
    // SAFETY: the child only copies and compares memory, then `_exit`s: no lock, no allocation.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let p = target.ptr.as_ptr();
        let mut code = 0;
        // SAFETY (the block): inside the child's copy of the allocation.
        unsafe {
            for (i, want) in original.iter().enumerate() {
                if *p.add(i) != *want {
                    code = 2;
                }
            }
            std::ptr::write_bytes(p, 0xAB, 2 * PAGE);
            std::thread::sleep(Duration::from_millis(200));
            libc::_exit(code);
        }
    }
    // While the child writes its copy, a peer WRITEs the parent's.
    let local = Pages::new(PAGE);
    let lmr = local.register(&a, 0, PAGE, Access::ALL);
    let data = pattern(7, 256);
    local.write(0, &data);
    run(
        &a,
        &qa,
        SendWr::new(1, SendOp::Write, vec![lmr.sge(0, 256).unwrap()])
            .remote(target.addr(PAGE), mr.rkey()),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    let mut status = 0;
    // SAFETY: waits for the child made above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child saw other bytes than the parent's"
    );
    let mut model = original.clone();
    model[PAGE..PAGE + 256].copy_from_slice(&data);
    assert!(
        target.read(0, 2 * PAGE) == model,
        "the child's stores reached the parent"
    );
    drop(mr);
    assert!(target.read(0, 2 * PAGE) == model);
}

/// The inode `/proc/self/maps` names for the mapping holding `addr` (0 for anonymous memory).
fn inode_at(addr: u64) -> Option<u64> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (a, b) = f.next()?.split_once('-')?;
        let (a, b) = (
            u64::from_str_radix(a, 16).ok()?,
            u64::from_str_radix(b, 16).ok()?,
        );
        (a <= addr && addr < b).then(|| f.nth(3)?.parse().ok())?
    })
}

/// Names the scenario a re-executed copy of this binary runs (see [`in_a_fresh_process`]).
const SCENARIO_ENV: &str = "FERROCE_VERBS_SCENARIO";

/// Runs the test `name` alone in a fresh copy of this binary, with [`SCENARIO_ENV`] naming it
/// (without it, that test returns at once). For scenarios that `fork` and do more in the child
/// than copy bytes: forking this process would give the child whatever lock one of the other
/// tests' threads held at that moment, held forever.
fn in_a_fresh_process(name: &str) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(SCENARIO_ENV, name)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + 3 * T;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name}: {}\n{stdout}\n{stderr}",
        out.status
    );
}

/// A child forked after the parent adopted pages, registering those same addresses, gets pages
/// of its own: a fresh memfd holding the child's bytes, not the parent's (the child's registry
/// starts empty). A peer's WRITE into the parent's region does not show in the child's region,
/// and the child's writes through its region reach the child's pointers, not the parent's.
#[test]
fn a_forked_child_registering_adopted_addresses_gets_its_own_pages() {
    in_a_fresh_process("scenario_forked_child_registers_adopted_addresses");
}

/// The scenario of [`a_forked_child_registering_adopted_addresses_gets_its_own_pages`].
#[test]
fn scenario_forked_child_registers_adopted_addresses() {
    if std::env::var(SCENARIO_ENV).as_deref()
        != Ok("scenario_forked_child_registers_adopted_addresses")
    {
        return;
    }
    let (a, b, qa, _qb) = adopting_pair();
    let len = 2 * PAGE;
    let target = Pages::new(len);
    let original = pattern(20, len);
    target.write(0, &original);
    let mr = target.register(&b, 0, len, Access::ALL);
    assert!(mapping_of_pages(target.addr(0), len)
        .iter()
        .all(|m| adopted(m)));
    let parents = inode_at(target.addr(0)).unwrap();
    let (mut to_child, mut to_parent) = ([0i32; 2], [0i32; 2]);
    // SAFETY: two-element arrays, as pipe(2) fills in.
    assert_eq!(unsafe { libc::pipe(to_child.as_mut_ptr()) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::pipe(to_parent.as_mut_ptr()) }, 0);
    // SAFETY: this process runs this test alone (see `in_a_fresh_process`); the child opens
    // its own context and leaves with `_exit`, never touching the parent's contexts.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = forked_child(&target, &original, parents, to_child[0], to_parent[1]);
        // SAFETY: ends the child without running the destructors of the parent's objects.
        unsafe { libc::_exit(code) };
    }
    // The parent: a peer WRITEs its region while the child holds its copy.
    let local = Pages::new(len);
    let lmr = local.register(&a, 0, len, Access::ALL);
    let data = pattern(21, 512);
    local.write(0, &data);
    run(
        &a,
        &qa,
        SendWr::new(1, SendOp::Write, vec![lmr.sge(0, 512).unwrap()])
            .remote(target.addr(PAGE + 8), mr.rkey()),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    let mut model = original.clone();
    model[PAGE + 8..PAGE + 520].copy_from_slice(&data);
    assert!(
        target.read(0, len) == model,
        "the peer's WRITE did not land"
    );
    // SAFETY: one byte from a live buffer into the pipe made above.
    assert_eq!(
        unsafe { libc::write(to_child[1], [1u8].as_ptr().cast(), 1) },
        1
    );
    let mut status = 0;
    // SAFETY: waits for the child made above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's check {} failed",
        libc::WEXITSTATUS(status)
    );
    // The child's writes through its own region did not reach the parent.
    assert!(
        target.read(0, len) == model,
        "the child's region wrote the parent's pages"
    );
    local.write(0, &vec![0xEE; len]);
    run(
        &a,
        &qa,
        SendWr::new(2, SendOp::Read, vec![lmr.sge(0, len).unwrap()])
            .remote(target.addr(0), mr.rkey()),
        (WcStatus::Success, WcOpcode::RdmaRead),
    );
    assert!(local.read(0, len) == model, "READ of the parent's region");
    drop(mr);
    assert!(target.read(0, len) == model);
}

/// The forked child's side of `scenario_forked_child_registers_adopted_addresses`: returns 0,
/// or the number of the check that failed (no panics: this is a forked child).
fn forked_child(target: &Pages, original: &[u8], parents: u64, rx: i32, tx: i32) -> i32 {
    let len = original.len();
    let mut byte = [0u8];
    // SAFETY: one byte into a live buffer from the pipe made before the fork.
    if unsafe { libc::read(rx, byte.as_mut_ptr().cast(), 1) } != 1 {
        return 1;
    }
    // The parent's peer WRITE has landed (in the parent's pages only).
    if target.read(0, len) != original {
        return 2;
    }
    let Ok(dev) = device_by_name("lo") else {
        return 3;
    };
    let Ok(ctx) = dev.open(&ContextOptions {
        provider: Provider::Shm,
        adopt_registered_pages: true,
        capture: None,
        ..ContextOptions::with_port(0)
    }) else {
        return 3;
    };
    let Ok(pd) = ctx.alloc_pd() else {
        return 3;
    };
    // SAFETY: the child's copy of the allocation, which outlives the region (the child ends
    // with `_exit`), reached only through raw copies.
    let Ok(mr) = (unsafe { pd.register_raw(target.at(0), len, Access::ALL) }) else {
        return 4;
    };
    // The child's registration adopted the child's pages: a memfd of its own.
    if !mapping_of_pages(target.addr(0), len)
        .iter()
        .all(|m| adopted(m))
    {
        return 5;
    }
    if !inode_at(target.addr(0)).is_some_and(|i| i != parents) {
        return 6;
    }
    // The region holds the child's bytes, not the parent's (which the peer's WRITE changed).
    let mut got = vec![0u8; len];
    if mr.read(0, &mut got).is_err() || got != original {
        return 7;
    }
    // Writes through the region reach the child's pointers (and so not the parent's pages,
    // which the parent checks).
    let mine = pattern(22, len);
    if mr.write(0, &mine).is_err() || target.read(0, len) != mine {
        return 8;
    }
    drop(mr);
    if target.read(0, len) != mine {
        return 9;
    }
    // SAFETY: one byte from a live buffer into the pipe made before the fork.
    let _ = unsafe { libc::write(tx, byte.as_ptr().cast(), 1) };
    0
}

/// `fork` after the program unmapped adopted pages without deregistering and put an
/// inaccessible mapping at that address: the fork handlers leave the stale adoption alone
/// (copying it would fault and kill the process; mapping the copy in the child would cover
/// the program's mapping), and the child sees the program's mapping, not a copy.
#[test]
fn fork_after_adopted_pages_were_unmapped_leaves_them_alone() {
    in_a_fresh_process("scenario_fork_after_adopted_pages_were_unmapped");
}

/// The scenario of [`fork_after_adopted_pages_were_unmapped_leaves_them_alone`].
#[test]
fn scenario_fork_after_adopted_pages_were_unmapped() {
    if std::env::var(SCENARIO_ENV).as_deref()
        != Ok("scenario_fork_after_adopted_pages_were_unmapped")
    {
        return;
    }
    let (_a, b, _qa, _qb) = adopting_pair();
    let len = 2 * PAGE;
    // SAFETY: a fresh private anonymous mapping; checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let ptr = std::ptr::NonNull::new(p.cast::<u8>()).unwrap();
    // SAFETY: reached only by raw copies (none); unmapped below while the region lives, the
    // program error under test.
    let old = unsafe { b.pd.register_raw(ptr, len, Access::ALL) }.unwrap();
    assert!(mapping_of_pages(p as u64, len).iter().all(|m| adopted(m)));
    // SAFETY: the mapping made above.
    assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    // SAFETY: an inaccessible mapping where the buffer was (fails rather than replace).
    let guard = unsafe {
        libc::mmap(
            p,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    assert_eq!(guard, p);
    let perms_at = |addr: u64| {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                let (a, b) = f.next()?.split_once('-')?;
                let (a, b) = (
                    u64::from_str_radix(a, 16).ok()?,
                    u64::from_str_radix(b, 16).ok()?,
                );
                (a <= addr && addr < b).then(|| f.next().map(str::to_owned))?
            })
            .unwrap_or_default()
    };
    assert_eq!(perms_at(p as u64), "---p");
    // SAFETY: this process runs this test alone (see `in_a_fresh_process`); the child only
    // reads /proc/self/maps and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = if perms_at(p as u64) == "---p" && perms_at(p as u64 + PAGE as u64) == "---p" {
            0
        } else {
            2
        };
        // SAFETY: ends the child without running the destructors of the parent's objects.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child made above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's mapping was replaced"
    );
    // The parent's mapping too is the program's, and dropping the old region leaves it alone.
    assert_eq!(perms_at(p as u64), "---p");
    drop(old);
    assert_eq!(perms_at(p as u64), "---p");
    // SAFETY: the guard mapping made above.
    unsafe { libc::munmap(p, len) };
}

/// A buffer the program unmapped without deregistering, and a new one mapped at the same
/// address: registering the new one adopts its pages afresh instead of reusing the stale
/// adoption (whose memfd the new buffer does not map). A peer READs the new buffer's bytes, a
/// WRITE under the old region's key does not reach them, and dropping the old region leaves
/// the new one's pages alone.
#[test]
fn a_buffer_unmapped_without_deregistration_is_not_reused() {
    let (a, b, qa, _qb) = adopting_pair();
    let len = 2 * PAGE;
    let map_at = |at: *mut libc::c_void, flags: libc::c_int| {
        // SAFETY: a fresh private anonymous mapping (at `at` only with MAP_FIXED_NOREPLACE,
        // which fails rather than replace anything); checked, unmapped at the end.
        let p = unsafe {
            libc::mmap(
                at,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        p
    };
    let store = |p: *mut libc::c_void, data: &[u8]| {
        // SAFETY: inside the `len`-byte mapping at `p`.
        unsafe { std::ptr::copy(data.as_ptr(), p.cast::<u8>(), data.len()) };
    };
    let load = |p: *mut libc::c_void| {
        let mut v = vec![0u8; len];
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: inside the `len`-byte mapping at `p`.
        unsafe { std::ptr::copy(p.cast::<u8>(), v.as_mut_ptr(), len) };
        v
    };
    let p = map_at(std::ptr::null_mut(), 0);
    let ptr = std::ptr::NonNull::new(p.cast::<u8>()).unwrap();
    store(p, &pattern(30, len));
    // SAFETY: the mapping is reached only by raw copies; it is unmapped below while the region
    // lives, which is the program error under test (the region is never used to reach it).
    let old = unsafe { b.pd.register_raw(ptr, len, Access::ALL) }.unwrap();
    assert!(mapping_of_pages(p as u64, len).iter().all(|m| adopted(m)));
    let old_inode = inode_at(p as u64).unwrap();

    // The program frees the buffer without deregistering, and gets a new one at that address.
    // SAFETY: the mapping made above (now the old region's adopted pages).
    assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    assert_eq!(map_at(p, libc::MAP_FIXED_NOREPLACE), p);
    let fresh = pattern(31, len);
    store(p, &fresh);
    // SAFETY: the new mapping outlives the region and is reached only by raw copies.
    let new = unsafe { b.pd.register_raw(ptr, len, Access::ALL) }.unwrap();
    assert!(mapping_of_pages(p as u64, len).iter().all(|m| adopted(m)));
    assert_ne!(
        inode_at(p as u64),
        Some(old_inode),
        "the stale memfd was reused"
    );
    assert!(
        load(p) == fresh,
        "registration changed the new buffer's bytes"
    );

    // A peer READs the new buffer's bytes, directly.
    let local = Pages::new(len);
    let lmr = local.register(&a, 0, len, Access::ALL);
    let read_new = |id: u64| {
        local.write(0, &vec![0xEE; len]);
        run(
            &a,
            &qa,
            SendWr::new(id, SendOp::Read, vec![lmr.sge(0, len).unwrap()])
                .remote(p as u64, new.rkey()),
            (WcStatus::Success, WcOpcode::RdmaRead),
        );
        local.read(0, len)
    };
    let d0 = direct_ops(&a);
    assert!(read_new(1) == fresh, "READ: not the new buffer's bytes");
    assert_eq!(direct_ops(&a), d0 + 1, "the READ was not done directly");

    // A WRITE under the old key completes (the old region is still registered, its memfd still
    // exists) but lands in the old pages, not in the new buffer.
    local.write(0, &[0x5A; 256]);
    run(
        &a,
        &qa,
        SendWr::new(2, SendOp::Write, vec![lmr.sge(0, 256).unwrap()])
            .remote(p as u64 + 100, old.rkey()),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    assert!(load(p) == fresh, "the old key reached the new buffer");
    assert!(read_new(3) == fresh, "the old key reached the new region");

    // The program's stores are what the peer sees.
    let mine = pattern(32, len);
    store(p, &mine);
    assert!(read_new(4) == mine, "READ after the program's stores");

    // Dropping the old region leaves the new one's pages alone.
    drop(old);
    assert!(mapping_of_pages(p as u64, len).iter().all(|m| adopted(m)));
    assert!(load(p) == mine);
    assert!(read_new(5) == mine, "READ after the old region's drop");
    drop(new);
    assert!(!mapping_of_pages(p as u64, len).iter().any(|m| adopted(m)));
    assert!(load(p) == mine, "deregistration changed the bytes");
    drop(lmr);
    // SAFETY: the mapping made above; nothing uses it any more.
    unsafe { libc::munmap(p, len) };
}

/// Memory that is not private and anonymous (here shared anonymous memory, whose sharing the
/// program may rely on) keeps its pages: requests on it take the packet path, as right.
#[test]
fn shared_mappings_are_not_adopted() {
    let (a, b, qa, _qb) = adopting_pair();
    // SAFETY: a fresh shared anonymous mapping, unmapped at the end.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let ptr = std::ptr::NonNull::new(p.cast::<u8>()).unwrap();
    let before = mapping_of_pages(p as u64, 2 * PAGE);
    // SAFETY: the mapping outlives the region and is reached only by raw copies.
    let mr = unsafe { b.pd.register_raw(ptr, 2 * PAGE, Access::ALL) }.unwrap();
    assert_eq!(mapping_of_pages(p as u64, 2 * PAGE), before);
    let local = Pages::new(PAGE);
    let lmr = local.register(&a, 0, PAGE, Access::ALL);
    let data = pattern(8, 1000);
    local.write(0, &data);
    let d0 = direct_ops(&a);
    run(
        &a,
        &qa,
        SendWr::new(1, SendOp::Write, vec![lmr.sge(0, 1000).unwrap()])
            .remote(p as u64 + 3000, mr.rkey()),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    assert_eq!(direct_ops(&a), d0, "shared memory was written directly");
    let mut got = vec![0u8; 1000];
    // SAFETY: inside the mapping.
    unsafe { std::ptr::copy(p.cast::<u8>().add(3000), got.as_mut_ptr(), 1000) };
    assert!(got == data);
    drop(mr);
    // SAFETY: the mapping made above; nothing uses it any more.
    unsafe { libc::munmap(p, 2 * PAGE) };
}

// ---- unreliable datagram QPs ------------------------------------------------------------------

fn ud_qp(s: &Side, qkey: u32) -> ferroce::UdQueuePair {
    let q =
        s.pd.create_ud_qp(&QpInitAttr::new(
            &s.cq,
            QpCaps {
                max_send_wr: 64,
                max_recv_wr: 64,
                ..QpCaps::default()
            },
        ))
        .unwrap();
    q.modify_to_init(qkey).unwrap();
    q.modify_to_rtr().unwrap();
    q.modify_to_rts(ferroce::Psn::new(7)).unwrap();
    q
}

/// UD datagrams between two contexts: every size up to the MTU arrives byte for byte after a
/// GRH naming the sender's address, with the sender's QPN and immediate data; what IBTA says
/// to drop (wrong Q_Key, no receive posted) is dropped and counted; a receive too small
/// completes with a length error; a bad local key fails the send and stops the send queue
/// (SQE) until RTS again; ERR flushes receives.
#[test]
fn ud_datagrams_arrive_whole_or_are_dropped_as_ibta_says() {
    let (a, b) = (side(Provider::Udp), side(Provider::Udp));
    let (qa, qb) = (ud_qp(&a, 0x1111), ud_qp(&b, 0x2222));
    let ah =
        a.pd.create_ah_with_port(b.ctx.gid(), b.ctx.local_addr().port())
            .unwrap();
    let src = mr(&a, ferroce::UD_MTU);
    let dst = mr(&b, ferroce::GRH_LEN + ferroce::UD_MTU);
    let send = |id: u64, len: usize, qkey: u32, imm: Option<u32>| ferroce::UdSendWr {
        wr_id: id,
        ah,
        remote_qpn: qb.qpn(),
        remote_qkey: qkey,
        imm_data: imm,
        sgl: sgl(&src, len),
        inline_data: None,
        signaled: true,
        solicited: false,
    };
    let recv = |id: u64| {
        qb.post_recv(RecvWr {
            wr_id: id,
            sgl: vec![dst.sge_all().unwrap()],
        })
        .unwrap()
    };
    for (i, len) in [0usize, 1, 100, 1023, ferroce::UD_MTU]
        .into_iter()
        .enumerate()
    {
        let data = pattern(i, len);
        src.write(0, &data).unwrap();
        dst.fill(0, dst.len(), 0xEE).unwrap();
        recv(i as u64);
        let imm = (i % 2 == 1).then_some(0xabc0 + i as u32);
        qa.post_send(&send(i as u64, len, 0x2222, imm)).unwrap();
        let wc = a.cq.wait(1, T).unwrap()[0];
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
            (i as u64, WcStatus::Success, WcOpcode::Send, len as u32)
        );
        let wc = b.cq.wait(1, T).unwrap()[0];
        assert_eq!(
            (
                wc.wr_id,
                wc.status,
                wc.opcode,
                wc.byte_len,
                wc.src_qp,
                wc.imm_data
            ),
            (
                i as u64,
                WcStatus::Success,
                WcOpcode::Recv,
                (ferroce::GRH_LEN + len) as u32,
                Some(qa.qpn()),
                imm
            ),
            "datagram of {len} bytes"
        );
        let got = dst.to_vec(0, ferroce::GRH_LEN + len).unwrap();
        // The GRH's last 20 bytes are the IPv4 header: version 4, UDP, from A to B.
        let ip = &got[20..40];
        assert_eq!((ip[0], ip[9]), (0x45, 17));
        assert_eq!(ip[12..16], [127, 0, 0, 1]);
        assert!(got[ferroce::GRH_LEN..] == data, "{len} bytes differ");
    }
    // The wrong Q_Key, and no receive posted: both dropped and counted.
    let dropped = b.ctx.counters().ud_dropped;
    recv(100);
    qa.post_send(&send(100, 8, 0x3333, None)).unwrap();
    assert_eq!(a.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        b.cq.poll_one().unwrap().is_none(),
        "a wrong Q_Key was received"
    );
    assert_eq!(b.ctx.counters().ud_dropped, dropped + 1);
    // A Q_Key with its top bit set means the sender's own: 0x1111, not B's.
    qa.post_send(&send(101, 8, 0x8000_0000, None)).unwrap();
    a.cq.wait(1, T).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(b.ctx.counters().ud_dropped, dropped + 2);
    // The receive posted above takes the next right one.
    qa.post_send(&send(102, 8, 0x2222, None)).unwrap();
    a.cq.wait(1, T).unwrap();
    assert_eq!(b.cq.wait(1, T).unwrap()[0].wr_id, 100);
    qa.post_send(&send(103, 8, 0x2222, None)).unwrap();
    a.cq.wait(1, T).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        b.ctx.counters().ud_dropped,
        dropped + 3,
        "no receive posted"
    );
    // A receive too small for GRH + datagram.
    qb.post_recv(RecvWr {
        wr_id: 200,
        sgl: vec![dst.sge(0, ferroce::GRH_LEN + 4).unwrap()],
    })
    .unwrap();
    qa.post_send(&send(104, 8, 0x2222, None)).unwrap();
    a.cq.wait(1, T).unwrap();
    let wc = b.cq.wait(1, T).unwrap()[0];
    assert_eq!((wc.wr_id, wc.status), (200, WcStatus::LocalLengthError));
    // More than the MTU is refused at the post.
    let big = mr(&a, ferroce::UD_MTU + 1);
    let mut too_big = send(105, 0, 0x2222, None);
    too_big.sgl = vec![big.sge_all().unwrap()];
    assert!(qa.post_send(&too_big).is_err());
    // A bad local key: a local protection error, the send queue stops (SQE) until RTS.
    let mut bad = send(106, 8, 0x2222, None);
    bad.sgl[0].lkey ^= 0x100;
    qa.post_send(&bad).unwrap();
    let wc = a.cq.wait(1, T).unwrap()[0];
    assert_eq!((wc.wr_id, wc.status), (106, WcStatus::LocalProtectionError));
    assert_eq!(qa.state(), ferroce::QpState::Sqe);
    assert!(qa.post_send(&send(107, 8, 0x2222, None)).is_err());
    qa.modify_to_rts(ferroce::Psn::new(0)).unwrap();
    recv(300);
    qa.post_send(&send(108, 8, 0x2222, None)).unwrap();
    a.cq.wait(1, T).unwrap();
    assert_eq!(b.cq.wait(1, T).unwrap()[0].wr_id, 300);
    // ERR flushes the receives still posted, in order.
    recv(400);
    recv(401);
    qb.modify_to_error();
    let wcs = b.cq.wait(2, T).unwrap();
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [
            (400, WcStatus::WorkRequestFlushed),
            (401, WcStatus::WorkRequestFlushed)
        ]
    );
}

/// A mapping that lies wholly inside a region's pages (a large `malloc` block is one) is
/// adopted whole, its partial end pages too: a WRITE at the region's first and last bytes is
/// done directly.
#[test]
fn a_mapping_wholly_inside_the_region_is_adopted_with_its_partial_pages() {
    let (a, b, qa, _qb) = adopting_pair();
    let len = 3 * PAGE;
    // Three read-write pages between two inaccessible ones, so that the kernel cannot merge
    // them with a neighbouring mapping: their mapping is exactly theirs, as a malloc block's.
    // SAFETY: a fresh private anonymous mapping, unmapped at the end.
    let guarded = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len + 2 * PAGE,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(guarded, libc::MAP_FAILED);
    // SAFETY: inside the mapping just made.
    let p = unsafe { guarded.cast::<u8>().add(PAGE).cast::<libc::c_void>() };
    // SAFETY: the middle pages of that mapping.
    assert_eq!(
        unsafe { libc::mprotect(p, len, libc::PROT_READ | libc::PROT_WRITE) },
        0
    );
    let base = p as u64;
    // As malloc hands out a large block: a 16-byte header before it.
    let (off, rlen) = (16usize, len - 32);
    let ptr = std::ptr::NonNull::new(p.cast::<u8>()).unwrap();
    // SAFETY: inside the mapping, which outlives the region; reached only by raw copies.
    let mr = unsafe { b.pd.register_raw(ptr.add(off), rlen, Access::ALL) }.unwrap();
    assert!(mapping_of_pages(base, len).iter().all(|m| adopted(m)));
    let local = Pages::new(PAGE);
    let lmr = local.register(&a, 0, PAGE, Access::ALL);
    let data = pattern(9, 64);
    local.write(0, &data);
    let d0 = direct_ops(&a);
    for (id, at) in [(1, base + off as u64), (2, base + (off + rlen - 64) as u64)] {
        run(
            &a,
            &qa,
            SendWr::new(id, SendOp::Write, vec![lmr.sge(0, 64).unwrap()]).remote(at, mr.rkey()),
            (WcStatus::Success, WcOpcode::RdmaWrite),
        );
        let mut got = vec![0u8; 64];
        // SAFETY: inside the mapping.
        unsafe { std::ptr::copy(at as *const u8, got.as_mut_ptr(), 64) };
        assert!(got == data, "WRITE {id}: bytes differ");
    }
    assert_eq!(
        direct_ops(&a),
        d0 + 2,
        "the end pages were not reached directly"
    );
    drop(mr);
    assert!(!mapping_of_pages(base, len).iter().any(|m| adopted(m)));
    // SAFETY: the mapping made above; nothing uses it any more.
    unsafe { libc::munmap(guarded, len + 2 * PAGE) };
}

/// READ, WRITE and SEND of 4 MiB, more than a shared-memory ring holds, between plain caller
/// memory (not adopted: every byte takes the packet path) on both providers.
fn four_mib_through_the_packet_path_between_caller_memory(p: Provider) {
    let (a, b, qa, qb) = pair(p);
    const LEN: usize = 4 << 20;
    let (src, dst, back) = (Pages::new(LEN), Pages::new(LEN), Pages::new(LEN));
    let data = pattern(10, LEN);
    src.write(0, &data);
    let (ms, md, mb) = (
        src.register(&a, 0, LEN, Access::ALL),
        dst.register(&b, 0, LEN, Access::ALL),
        back.register(&a, 0, LEN, Access::ALL),
    );
    run(
        &a,
        &qa,
        SendWr::new(1, SendOp::Write, vec![ms.sge_all().unwrap()]).remote(md.addr(), md.rkey()),
        (WcStatus::Success, WcOpcode::RdmaWrite),
    );
    assert!(dst.read(0, LEN) == data, "WRITE: bytes differ");
    run(
        &a,
        &qa,
        SendWr::new(2, SendOp::Read, vec![mb.sge_all().unwrap()]).remote(md.addr(), md.rkey()),
        (WcStatus::Success, WcOpcode::RdmaRead),
    );
    assert!(back.read(0, LEN) == data, "READ: bytes differ");
    dst.write(0, &vec![0u8; LEN]);
    qb.post_recv(RecvWr {
        wr_id: 3,
        sgl: vec![md.sge_all().unwrap()],
    })
    .unwrap();
    run(
        &a,
        &qa,
        SendWr::new(4, SendOp::Send, vec![ms.sge_all().unwrap()]),
        (WcStatus::Success, WcOpcode::Send),
    );
    let wc = b.cq.wait(1, T).unwrap()[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (3, WcStatus::Success, LEN as u32)
    );
    assert!(dst.read(0, LEN) == data, "SEND: bytes differ");
}

mod packet_path {
    #[test]
    fn four_mib_over_udp() {
        super::four_mib_through_the_packet_path_between_caller_memory(ferroce::Provider::Udp)
    }
    #[test]
    fn four_mib_over_shm() {
        super::four_mib_through_the_packet_path_between_caller_memory(ferroce::Provider::Shm)
    }
}

/// `map_peer_region` maps a same-host peer's registered bytes as a one-sided access would reach
/// them: stores through the mapping are the peer's bytes, and every refusal a WRITE would meet
/// (bad key, missing right, out of bounds, a QP that is not linked over shared memory) is `None`.
#[test]
fn a_peer_region_maps_only_where_a_write_would_be_admitted() {
    let (_a, b, qa, _qb) = pair(Provider::Shm);
    let target = mr(&b, 4096);
    let read_only = b.pd.alloc_mr(4096, Access::REMOTE_READ).unwrap();
    let map = qa
        .map_peer_region(
            target.addr() + 100,
            target.rkey(),
            200,
            Access::REMOTE_WRITE,
        )
        .expect("an admitted range maps");
    assert_eq!(map.len(), 200);
    let data = pattern(9, 200);
    // SAFETY: 200 bytes of the peer's region, mapped while `map` lives; nothing else touches
    // them in this test.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), map.as_ptr(), 200) };
    assert!(
        target.to_vec(100, 200).unwrap() == data,
        "the peer sees the stores"
    );
    target.write(100, &[7u8; 4]).unwrap();
    // SAFETY: as above, a load.
    assert_eq!(
        unsafe { map.as_ptr().read() },
        7,
        "and the mapping sees the peer's"
    );
    let refused = [
        qa.map_peer_region(
            target.addr(),
            target.rkey() ^ 0x100,
            8,
            Access::REMOTE_WRITE,
        ),
        qa.map_peer_region(read_only.addr(), read_only.rkey(), 8, Access::REMOTE_WRITE),
        qa.map_peer_region(
            target.addr() + 4000,
            target.rkey(),
            200,
            Access::REMOTE_WRITE,
        ),
        qa.map_peer_region(target.addr() - 8, target.rkey(), 8, Access::REMOTE_WRITE),
    ];
    assert!(refused.iter().all(Option::is_none), "{refused:?}");
    assert!(qa
        .map_peer_region(read_only.addr(), read_only.rkey(), 8, Access::REMOTE_READ)
        .is_some());
    let (_c, d, qc, _qd) = pair(Provider::Udp);
    let remote = mr(&d, 64);
    assert!(qc
        .map_peer_region(remote.addr(), remote.rkey(), 8, Access::REMOTE_WRITE)
        .is_none());
}
