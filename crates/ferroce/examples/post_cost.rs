//! Measures what one 8 B RDMA WRITE post costs over the shared-memory provider, with no peer
//! activity (the figure behind the same-host latency: each side of a ping-pong pays it once).
use std::time::Instant;

use ferroce::{
    device_by_name, Access, ContextOptions, InitAttr, Provider, QpCaps, QpInitAttr, RtrAttr,
    RtsAttr, SendFlags, SendOp, SendWr,
};

fn main() {
    let open = || {
        device_by_name("lo")
            .expect("loopback device")
            .open(&ContextOptions {
                capture: None,
                provider: Provider::Shm,
                ..ContextOptions::with_port(0)
            })
            .expect("open")
    };
    let (actx, bctx) = (open(), open());
    let (apd, bpd) = (actx.alloc_pd().unwrap(), bctx.alloc_pd().unwrap());
    let (acq, bcq) = (
        actx.create_cq(64, None).unwrap(),
        bctx.create_cq(64, None).unwrap(),
    );
    let mk = |pd: &ferroce::ProtectionDomain, cq| {
        pd.create_qp(&QpInitAttr::new(cq, QpCaps::default()))
            .unwrap()
    };
    let (a, b) = (mk(&apd, &acq), mk(&bpd, &bcq));
    for (q, peer, pctx) in [(&a, &b, &bctx), (&b, &a, &actx)] {
        q.modify_to_init(&InitAttr::default()).unwrap();
        q.modify_to_rtr_with_port(
            &RtrAttr {
                path_mtu: ferroce::PathMtu::Mtu4096,
                dest_qpn: peer.qpn(),
                dest_gid: pctx.gid(),
                rq_psn: ferroce::Psn::new(1),
                max_dest_rd_atomic: 16,
                min_rnr_timer: 1,
            },
            pctx.local_addr().port(),
        )
        .unwrap();
        q.modify_to_rts(&RtsAttr {
            sq_psn: ferroce::Psn::new(1),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        })
        .unwrap();
    }
    let src = apd.alloc_mr(64, Access::ALL).unwrap();
    let dst = bpd.alloc_mr(64, Access::ALL).unwrap();
    let wr = SendWr::new(0, SendOp::Write, vec![src.sge(0, 8).unwrap()])
        .remote(dst.addr(), dst.rkey())
        .flags(SendFlags::default());
    // Links the QPs (the first posts may take the packet path).
    for _ in 0..1000 {
        a.post_send(&wr).unwrap();
        let _ = acq.poll_one();
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    // N=... sets the posts per figure (callgrind runs take fewer).
    let n: u64 = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    let mut sender = a.sender();
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..n {
            a.post_send(&wr).unwrap();
        }
        let through_qp = t.elapsed().as_nanos() as f64 / n as f64;
        let t = Instant::now();
        for _ in 0..n {
            sender.post_send(&wr).unwrap();
        }
        let through_sender = t.elapsed().as_nanos() as f64 / n as f64;
        println!(
            "post_send 8 B WRITE (provider {:?}): QueuePair {through_qp:.1} ns, QpSender \
             {through_sender:.1} ns",
            a.provider(),
        );
    }
    let mut byte = [0u8];
    let t = Instant::now();
    for _ in 0..n {
        src.write(7, &byte).unwrap();
    }
    println!(
        "mr.write 1 B: {:.1} ns",
        t.elapsed().as_nanos() as f64 / n as f64
    );
    let t = Instant::now();
    for _ in 0..n {
        src.read(7, &mut byte).unwrap();
    }
    println!(
        "mr.read 1 B: {:.1} ns",
        t.elapsed().as_nanos() as f64 / n as f64
    );
}
