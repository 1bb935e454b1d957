//! ECN between two contexts over UDP, as RoCE does it (DCQCN): packets leave ECT(0), a packet
//! marked Congestion Experienced on the path makes the receiving QP answer with CNPs (counted
//! `np_ecn_marked_roce_packets`, `np_cnp_sent`), and the CNPs cut the sender's rate
//! (`rp_cnp_handled`, `QueuePair::congestion_rate`).
//!
//! The marks come two ways: from nftables in a network namespace of the test's own
//! (`ip ecn ect0 ip ecn set ce` on the path's output hook, which marks only packets that left
//! ECT(0), so the test also shows that they do; needs root), or from a sender told to mark
//! everything itself ([`Ecn::MarkCe`], no privileges).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use ferroce::{
    device_by_name, Access, CompletionQueue, Context, ContextCounters, ContextOptions, Ecn,
    InitAttr, ProtectionDomain, Provider, QpCaps, QpInitAttr, QueuePair, RtrAttr, RtsAttr, SendOp,
    SendWr, WcStatus,
};

const T: Duration = Duration::from_secs(20);

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

fn side(ecn: Ecn) -> Side {
    let ctx = device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            provider: Provider::Udp,
            ecn,
            ..ContextOptions::with_port(0)
        })
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096, None).unwrap();
    Side { ctx, pd, cq }
}

fn qp(s: &Side) -> QueuePair {
    s.pd.create_qp(&QpInitAttr {
        send_cq: &s.cq,
        recv_cq: &s.cq,
        caps: QpCaps {
            max_send_wr: 512,
            max_recv_wr: 512,
            ..QpCaps::default()
        },
        srq: None,
    })
    .unwrap()
}

fn connect(a: &QueuePair, actx: &Context, b: &QueuePair, bctx: &Context) {
    for (q, peer, pctx) in [(a, b, bctx), (b, a, actx)] {
        q.modify_to_init(&InitAttr::default()).unwrap();
        let rtr = RtrAttr {
            path_mtu: ferroce::PathMtu::Mtu4096,
            dest_qpn: peer.qpn(),
            dest_gid: pctx.gid(),
            rq_psn: ferroce::Psn::new(0),
            max_dest_rd_atomic: 16,
            min_rnr_timer: 1,
        };
        q.modify_to_rtr_with_port(&rtr, pctx.local_addr().port())
            .unwrap();
        let rts = RtsAttr {
            sq_psn: ferroce::Psn::new(0),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        };
        q.modify_to_rts(&rts).unwrap();
    }
}

/// What the two sides counted and the sender's rate after a bulk transfer from A to B.
struct Outcome {
    a: ContextCounters,
    b: ContextCounters,
    a_rate: Option<u64>,
}

/// 16 MiB of 64-KiB WRITEs from a sender with `a_ecn` to a receiver with `b_ecn`; `path`
/// is called with B's port before the transfer starts (to mark the path).
fn bulk_transfer(a_ecn: Ecn, b_ecn: Ecn, path: impl FnOnce(u16)) -> Outcome {
    let (a, b) = (side(a_ecn), side(b_ecn));
    let (qa, qb) = (qp(&a), qp(&b));
    connect(&qa, &a.ctx, &qb, &b.ctx);
    path(b.ctx.local_addr().port());
    const LEN: usize = 64 << 10;
    const N: u64 = 256;
    let src = a.pd.alloc_mr(LEN, Access::ALL).unwrap();
    let dst = b.pd.alloc_mr(LEN, Access::ALL).unwrap();
    src.write(0, &vec![0x5a; LEN]).unwrap();
    let mut done = 0;
    let mut posted = 0;
    while done < N {
        // Up to 64 WRITEs in flight: a stream, not a ping-pong.
        while posted < N && posted - done < 64 {
            let wr = SendWr::new(posted, SendOp::Write, vec![src.sge(0, LEN).unwrap()])
                .remote(dst.addr(), dst.rkey());
            qa.post_send(wr).unwrap();
            posted += 1;
        }
        for wc in a.cq.wait(1, T).unwrap() {
            assert_eq!(wc.status, WcStatus::Success);
            done += 1;
        }
    }
    assert!(dst.to_vec(0, LEN).unwrap().iter().all(|&x| x == 0x5a));
    let a_rate = qa.congestion_rate();
    // Per QP and per context alike.
    assert_eq!(qb.counters().np_cnp_sent, b.ctx.counters().qps.np_cnp_sent);
    assert_eq!(
        qa.counters().rp_cnp_handled,
        a.ctx.counters().qps.rp_cnp_handled
    );
    Outcome {
        a: a.ctx.counters(),
        b: b.ctx.counters(),
        a_rate,
    }
}

/// The rate a QP runs at when DCQCN does not limit it, bytes per second.
fn line_rate() -> u64 {
    ferroce_proto::dcqcn::DcqcnConfig::default().line_rate
}

/// Checks that marked traffic was answered with CNPs and cut the sender's rate.
fn assert_marks_answered(o: &Outcome) {
    let (a, b) = (&o.a.qps, &o.b.qps);
    assert!(
        b.np_ecn_marked_roce_packets > 0,
        "the receiver saw no marks: {b:?}"
    );
    assert!(b.np_cnp_sent > 0, "the receiver sent no CNP: {b:?}");
    assert!(
        b.np_cnp_sent <= b.np_ecn_marked_roce_packets,
        "at most one CNP per marked packet: {b:?}"
    );
    assert!(a.rp_cnp_handled > 0, "the sender handled no CNP: {a:?}");
    assert_eq!(a.rp_cnp_ignored, 0);
    // CNPs are not dropped on the way (loopback): every one the receiver sent was handled.
    assert_eq!(a.rp_cnp_handled, b.np_cnp_sent);
    assert_eq!(a.dropped_bad_state, 0, "a CNP is not a bad-state drop");
    let rate = o.a_rate.expect("the sender's rate is limited");
    assert!(rate < line_rate(), "{rate} is not below the line rate");
    // The sender's own reverse traffic (ACKs) was not marked and owed nothing.
    assert_eq!((a.np_ecn_marked_roce_packets, a.np_cnp_sent), (0, 0));
}

#[test]
fn a_sender_marking_every_packet_gets_cnps_that_cut_its_rate() {
    let o = bulk_transfer(Ecn::MarkCe, Ecn::Ect0, |_| {});
    assert_marks_answered(&o);
}

#[test]
fn a_stream_spaced_out_to_one_datagram_per_read_is_read_with_its_marks() {
    // One 4-KiB WRITE (one datagram) every 300 µs: every read at the receiver finds one
    // datagram alone, as behind a slow bottleneck. A single read takes the TOS only once bulk
    // traffic flows in to a QP that is not in a ping-pong (see the UDP provider's "ECN
    // marks"): all but the first datagram are read with their marks.
    let (a, b) = (side(Ecn::MarkCe), side(Ecn::Ect0));
    let (qa, qb) = (qp(&a), qp(&b));
    connect(&qa, &a.ctx, &qb, &b.ctx);
    const LEN: usize = 4096;
    const N: u64 = 40;
    let src = a.pd.alloc_mr(LEN, Access::ALL).unwrap();
    let dst = b.pd.alloc_mr(LEN, Access::ALL).unwrap();
    for id in 0..N {
        let wr = SendWr::new(id, SendOp::Write, vec![src.sge(0, LEN).unwrap()])
            .remote(dst.addr(), dst.rkey());
        qa.post_send(wr).unwrap();
        let wc = a.cq.wait(1, T).unwrap();
        assert_eq!(wc[0].status, WcStatus::Success);
        std::thread::sleep(Duration::from_micros(300));
    }
    let c = qb.counters();
    // Every WRITE arrived once as news; spurious fast retransmissions (the sender's timer
    // firing while this side's engine was off the CPU) add duplicates, nothing else.
    assert_eq!(c.rcvd_pkts - c.duplicate_request, N, "{c:?}");
    assert!(
        c.np_ecn_marked_roce_packets >= N - 2,
        "{} of {N} read as marked",
        c.np_ecn_marked_roce_packets
    );
    assert!(c.np_cnp_sent > 0 && qa.counters().rp_cnp_handled == c.np_cnp_sent);
}

#[test]
fn a_receiver_with_ecn_off_reads_no_marks_and_sends_no_cnp() {
    let o = bulk_transfer(Ecn::MarkCe, Ecn::Off, |_| {});
    let b = &o.b.qps;
    assert_eq!((b.np_ecn_marked_roce_packets, b.np_cnp_sent), (0, 0));
    assert_eq!(o.a.qps.rp_cnp_handled, 0);
    assert_eq!(o.a_rate, None);
}

#[test]
fn unmarked_ect0_traffic_is_not_slowed() {
    let o = bulk_transfer(Ecn::Ect0, Ecn::Ect0, |_| {});
    assert_eq!(o.b.qps.np_ecn_marked_roce_packets, 0);
    assert_eq!(o.a.qps.rp_cnp_handled, 0);
    assert_eq!(o.a_rate, None);
}

/// Runs `f` on a thread of its own in a fresh network namespace with loopback up (the test
/// binary's other threads stay where they are; sockets and child processes the thread makes
/// are in the new namespace, which goes when the thread ends). `None` without root.
fn in_own_netns<R: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> Option<R> {
    if !ferroce_test_support::require_root(name, "a network namespace with nftables") {
        return None;
    }
    let r = std::thread::spawn(move || {
        // SAFETY: unshare takes no pointers; CLONE_NEWNET moves only the calling thread.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "unshare: {}", std::io::Error::last_os_error());
        run(Command::new("ip").args(["link", "set", "lo", "up"]), "");
        f()
    })
    .join();
    match r {
        Ok(v) => Some(v),
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Runs a command with `input` on its stdin; panics unless it succeeds.
fn run(cmd: &mut Command, input: &str) -> String {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Marks Congestion Experienced every ECT(0) packet to UDP port `port`, as a congested switch
/// on the path to it would (nftables, in the calling thread's network namespace).
fn mark_path_to(port: u16) {
    let rules = format!(
        "table ip ferroce_ecn {{
            chain out {{
                type filter hook output priority 0; policy accept;
                udp dport {port} ip ecn ect0 counter ip ecn set ce
            }}
        }}"
    );
    run(Command::new("nft").args(["-f", "-"]), &rules);
}

/// How many packets the rule of [`mark_path_to`] marked.
fn marked_by_the_path() -> u64 {
    let out = run(
        Command::new("nft").args(["list", "chain", "ip", "ferroce_ecn", "out"]),
        "",
    );
    out.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in {out}"))
}

#[test]
fn ect0_packets_marked_on_the_path_get_cnps_that_cut_the_senders_rate() {
    let Some((o, marked)) = in_own_netns(
        "ect0_packets_marked_on_the_path_get_cnps_that_cut_the_senders_rate",
        || {
            let o = bulk_transfer(Ecn::Ect0, Ecn::Ect0, mark_path_to);
            (o, marked_by_the_path())
        },
    ) else {
        return;
    };
    // The rule marks only ECT(0) packets: that it marked any shows they left ECT(0).
    assert!(marked > 0, "no packet left ECT(0)");
    assert_marks_answered(&o);
    // Every packet to the receiver's socket was marked (nftables counts a GSO send once; its
    // segments share the marked header), and the receiver read the mark of (nearly) every
    // data-size one: 4096 WRITE packets of 4 KiB (see the UDP provider's "ECN marks").
    let b = &o.b;
    assert!(b.qps.np_ecn_marked_roce_packets <= b.rx_packets);
    assert!(
        b.qps.np_ecn_marked_roce_packets >= 4000,
        "{} of {} packets read as marked",
        b.qps.np_ecn_marked_roce_packets,
        b.rx_packets
    );
}

#[test]
fn with_ecn_off_packets_leave_not_ect_and_nothing_is_marked() {
    let Some((o, marked)) = in_own_netns(
        "with_ecn_off_packets_leave_not_ect_and_nothing_is_marked",
        || {
            let o = bulk_transfer(Ecn::Off, Ecn::Ect0, mark_path_to);
            (o, marked_by_the_path())
        },
    ) else {
        return;
    };
    assert_eq!(marked, 0, "a Not-ECT packet was marked");
    assert_eq!(o.b.qps.np_ecn_marked_roce_packets, 0);
    assert_eq!(o.a_rate, None);
}
