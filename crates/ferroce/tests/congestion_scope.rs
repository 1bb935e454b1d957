//! Which QPs run congestion control: toward a peer on this host none by default (the path
//! crosses no shared link, and the delay-based window would read the CPUs' scheduling as
//! queueing), toward any other peer the context's; `ContextOptions::congestion_to_local_peers`
//! and a QP's own `set_congestion_control` override that. Decided again at each RTR, so a QP
//! reset and connected elsewhere gets what its new peer calls for.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use ferroce::{
    device_by_name, gid_of, Access, CcAlgorithm, CcConfig, CompletionQueue, ContextOptions,
    InitAttr, ProtectionDomain, Provider, QpCaps, QpInitAttr, QueuePair, RtrAttr, RtsAttr, SendOp,
    SendWr, WcStatus,
};

const T: Duration = Duration::from_secs(20);

struct Side {
    ctx: ferroce::Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

/// A UDP context on loopback running the default delay-based control, whatever the
/// environment says.
fn side(congestion_to_local_peers: bool) -> Side {
    let ctx = device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            provider: Provider::Udp,
            congestion: CcConfig::default(),
            congestion_to_local_peers,
            ..ContextOptions::with_port(0)
        })
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024, None).unwrap();
    Side { ctx, pd, cq }
}

fn qp(s: &Side) -> QueuePair {
    s.pd.create_qp(&QpInitAttr {
        send_cq: &s.cq,
        recv_cq: &s.cq,
        caps: QpCaps::default(),
        srq: None,
    })
    .unwrap()
}

fn rtr_to(q: &QueuePair, gid: std::net::Ipv6Addr, qpn: u32, port: u16) {
    q.modify_to_init(&InitAttr::default()).unwrap();
    let rtr = RtrAttr {
        path_mtu: ferroce::PathMtu::Mtu1024,
        dest_qpn: qpn,
        dest_gid: gid,
        rq_psn: ferroce::Psn::new(0),
        max_dest_rd_atomic: 16,
        min_rnr_timer: 1,
    };
    q.modify_to_rtr_with_port(&rtr, port).unwrap();
}

fn connect(a: (&QueuePair, &Side), b: (&QueuePair, &Side)) {
    for ((q, _), (peer, pside)) in [(a, b), (b, a)] {
        rtr_to(
            q,
            pside.ctx.gid(),
            peer.qpn(),
            pside.ctx.local_addr().port(),
        );
        q.modify_to_rts(&RtsAttr {
            sq_psn: ferroce::Psn::new(0),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        })
        .unwrap();
    }
}

/// 64 WRITEs of 16 KiB from `qa` land byte for byte, completing in order.
fn writes_land(a: &Side, qa: &QueuePair, b: &Side) {
    const LEN: usize = 16 << 10;
    let src = a.pd.alloc_mr(64 * LEN, Access::ALL).unwrap();
    let dst = b.pd.alloc_mr(64 * LEN, Access::ALL).unwrap();
    let data: Vec<u8> = (0..64 * LEN).map(|i| (i * 7 + i / 251) as u8).collect();
    src.write(0, &data).unwrap();
    for i in 0..64u64 {
        let off = i as usize * LEN;
        let wr = SendWr::new(i, SendOp::Write, vec![src.sge(off, LEN).unwrap()])
            .remote(dst.addr() + off as u64, dst.rkey());
        qa.post_send(wr).unwrap();
    }
    let mut next = 0;
    while next < 64 {
        for wc in a.cq.wait(1, T).unwrap() {
            assert_eq!((wc.status, wc.wr_id), (WcStatus::Success, next));
            next += 1;
        }
    }
    assert!(dst.to_vec(0, 64 * LEN).unwrap() == data);
}

#[test]
fn a_peer_on_this_host_gets_no_window_by_default() {
    let (a, b) = (side(false), side(false));
    let (qa, qb) = (qp(&a), qp(&b));
    // Before RTR a QP holds the context's setting.
    assert_eq!(qa.congestion_control().algorithm, CcAlgorithm::Delay);
    connect((&qa, &a), (&qb, &b));
    for q in [&qa, &qb] {
        let cc = q.congestion_control();
        assert_eq!(cc.algorithm, CcAlgorithm::Off);
        // Only the algorithm changes: the target stays the context's for a later peer.
        assert_eq!(cc.target_delay, CcConfig::default().target_delay);
    }
    writes_land(&a, &qa, &b);
    // And no window applied to what was sent.
    assert_eq!(qa.congestion_window(), None);
}

#[test]
fn congestion_to_local_peers_keeps_the_window_on_loopback() {
    let (a, b) = (side(true), side(true));
    let (qa, qb) = (qp(&a), qp(&b));
    connect((&qa, &a), (&qb, &b));
    assert_eq!(qa.congestion_control().algorithm, CcAlgorithm::Delay);
    assert_eq!(qb.congestion_control().algorithm, CcAlgorithm::Delay);
    writes_land(&a, &qa, &b);
    assert!(qa.congestion_window().is_some_and(|w| w > 0.0));
    // The window measured the path: a round trip is known.
    assert!(qa.round_trip().is_some());
}

#[test]
fn a_qp_s_own_choice_holds_whoever_the_peer_is() {
    let (a, b) = (side(false), side(false));
    let (qa, qb) = (qp(&a), qp(&b));
    let mine = CcConfig {
        algorithm: CcAlgorithm::Delay,
        target_delay: Duration::from_micros(700),
    };
    qa.set_congestion_control(mine);
    connect((&qa, &a), (&qb, &b));
    assert_eq!(qa.congestion_control(), mine);
    assert_eq!(qb.congestion_control().algorithm, CcAlgorithm::Off);
    writes_land(&a, &qa, &b);
    // Reset and connected elsewhere, it still runs what it was given.
    qa.reset();
    let far = gid_of(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)));
    rtr_to(&qa, far, 0x11, 4791);
    assert_eq!(qa.congestion_control(), mine);
}

#[test]
fn rtr_decides_again_for_each_peer() {
    let a = side(false);
    let q = qp(&a);
    // TEST-NET-1: no address of this host's, so a path that may cross shared links (RTR needs
    // no answer from the peer).
    let far = gid_of(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)));
    rtr_to(&q, far, 0x11, 4791);
    assert_eq!(q.congestion_control(), CcConfig::default());
    q.reset();
    rtr_to(&q, a.ctx.gid(), 0x12, a.ctx.local_addr().port());
    assert_eq!(q.congestion_control().algorithm, CcAlgorithm::Off);
    q.reset();
    rtr_to(&q, far, 0x13, 4791);
    assert_eq!(q.congestion_control(), CcConfig::default());
}
