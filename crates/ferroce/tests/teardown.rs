//! Teardown leaves nothing behind: regions, QPs, sockets and the engine thread all go. (Alone in
//! its own test binary, so the thread count is this test's alone.)

use std::time::Duration;

use ferroce::{
    device_by_name, Access, ContextOptions, InitAttr, QpCaps, QpInitAttr, RtrAttr, RtsAttr, SendOp,
    SendWr, WcStatus,
};

/// Engine threads alive, once the count has settled at `want` (a new thread names itself a
/// moment after it starts), or the count after a second of waiting.
fn engine_threads_settled(want: usize) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    loop {
        let n = engine_threads();
        if n == want || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn engine_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("ferroce-engine"))
        .count()
}

/// The process's open descriptors, but for files under /proc: the engine thread opens
/// `/proc/loadavg` and its schedstat for each reading (see `provider::contention`), so one may
/// be open for a moment whenever the count is taken (the listing's own descriptor is one too).
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| !target.starts_with("/proc"))
        .count()
}

#[test]
fn dropping_every_handle_releases_everything() {
    for provider in [ferroce::Provider::Udp, ferroce::Provider::Shm] {
        releases_everything_over(provider);
    }
}

fn releases_everything_over(provider: ferroce::Provider) {
    let fds_before = open_fds();
    assert_eq!(engine_threads(), 0);
    {
        let lo = device_by_name("lo").unwrap();
        let opts = ContextOptions {
            capture: None,
            provider,
            ..ContextOptions::with_port(0)
        };
        let (a, b) = (lo.open(&opts).unwrap(), lo.open(&opts).unwrap());
        assert_eq!(engine_threads_settled(2), 2);
        let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
        let (ca, cb) = (
            a.create_cq(64, None).unwrap(),
            b.create_cq(64, None).unwrap(),
        );
        let fds_without_qps = open_fds();
        let qa = pa
            .create_qp(&QpInitAttr::new(&ca, QpCaps::default()))
            .unwrap();
        let qb = pb
            .create_qp(&QpInitAttr::new(&cb, QpCaps::default()))
            .unwrap();
        for (q, peer, pctx) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
            q.modify_to_init(&InitAttr::default()).unwrap();
            let rtr = RtrAttr {
                path_mtu: ferroce::PathMtu::Mtu1024,
                dest_qpn: peer.qpn(),
                dest_gid: pctx.gid(),
                rq_psn: ferroce::Psn::new(0),
                max_dest_rd_atomic: 4,
                min_rnr_timer: 1,
            };
            q.modify_to_rtr_with_port(&rtr, pctx.local_addr().port())
                .unwrap();
            q.modify_to_rts(&RtsAttr {
                sq_psn: ferroce::Psn::new(0),
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 4,
            })
            .unwrap();
        }
        let m = pb.alloc_mr(1 << 20, Access::ALL).unwrap();
        let src = pa.alloc_mr(4096, Access::ALL).unwrap();
        qa.post_send(
            SendWr::new(1, SendOp::Write, vec![src.sge(0, 4096).unwrap()])
                .remote(m.addr(), m.rkey()),
        )
        .unwrap();
        assert_eq!(
            ca.wait(1, Duration::from_secs(10)).unwrap()[0].status,
            WcStatus::Success
        );
        assert_eq!(b.memory_region_count(), 1);
        let key = m.rkey();
        drop(m);
        assert_eq!(
            b.memory_region_count(),
            0,
            "dropping a region deregisters it"
        );
        // The stale key reaches nothing.
        qa.post_send(
            SendWr::new(2, SendOp::Write, vec![src.sge(0, 8).unwrap()]).remote(0x1000, key),
        )
        .unwrap();
        assert_eq!(
            ca.wait(1, Duration::from_secs(10)).unwrap()[0].status,
            WcStatus::RemoteAccessError
        );
        drop(src);
        drop((qa, qb));
        assert_eq!(a.queue_pair_count(), 0);
        // What the QPs opened (sockets, shared pages, links) is closed within an engine pass
        // or two, while the contexts live on.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while open_fds() > fds_without_qps && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            open_fds(),
            fds_without_qps,
            "destroyed QPs keep nothing open"
        );
        // Contexts are dropped last here, but any order works: the engine runs while any
        // handle (PD, CQ, MR, QP) holds the context.
        drop((a, b));
        assert_eq!(
            engine_threads_settled(2),
            2,
            "PDs and CQs still hold their contexts"
        );
    }
    assert_eq!(engine_threads(), 0, "the engine threads stopped");
    assert_eq!(
        open_fds(),
        fds_before,
        "every socket and eventfd was closed"
    );
}
