//! ECE (`ibv_query_ece`, `ibv_set_ece`) as a program that does its own connection exchange
//! uses it: each side reads its QP's offer, hands it to the peer with its QPN, gives the peer's
//! to its own QP before RTR, and the move to RTR applies what both offer. ferroce's ECE is
//! vendor "FRCE" with option bit 0, selective repeat; after RTR, `ibv_query_ece` reports the
//! QP's own flag (`ferroce::QueuePair::selective_repeat`), so what these tests read is what the
//! transport does.
//!
//! The calls are made as a C program makes them: the library's exported functions, linked from
//! the crate's rlib, and the `ctx->ops` calls the inline ones of `<infiniband/verbs.h>` make.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferroce_ibverbs::abi::*;

mod common;

extern "C" {
    fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd;
    fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut libc::c_void, len: usize, access: i32)
        -> *mut ibv_mr;
    fn ibv_query_gid(ctx: *mut ibv_context, port: u8, index: i32, gid: *mut ibv_gid) -> i32;
    fn ibv_create_cq(
        ctx: *mut ibv_context,
        cqe: i32,
        cq_context: *mut libc::c_void,
        channel: *mut ibv_comp_channel,
        comp_vector: i32,
    ) -> *mut ibv_cq;
    fn ibv_create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: i32) -> i32;
    fn ibv_destroy_qp(qp: *mut ibv_qp) -> i32;
    fn ibv_query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> i32;
    fn ibv_set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> i32;
}

/// ferroce's ECE vendor id, "FRCE".
const FRCE: u32 = 0x4652_4345;
/// ECE option bit 0: selective repeat.
const SR: u32 = 1;
/// Mellanox's vendor id (its IEEE OUI), a foreign ECE.
const MELLANOX: u32 = 0x15b3;

/// Whether this process's contexts offer selective repeat: unless `FERROCE_SR=0` (the context
/// option's default), which a run of the suite may set.
fn offered() -> bool {
    std::env::var_os("FERROCE_SR").map_or(true, |v| v != "0")
}

/// One context the tests share (contexts take host slots, which are few), with a PD, a CQ for
/// everything and a registered buffer.
struct Dev {
    pd: usize,
    cq: usize,
    mr: usize,
    buf: usize,
    gid: [u8; 16],
}

const BUF_LEN: usize = 1 << 16;

fn dev() -> &'static Dev {
    static DEV: OnceLock<Dev> = OnceLock::new();
    // SAFETY: the library's calls, with outputs on the stack and the buffer mapped here.
    DEV.get_or_init(|| unsafe {
        let ctx = common::open_loopback_context();
        let pd = ibv_alloc_pd(ctx);
        assert!(!pd.is_null());
        let cq = ibv_create_cq(ctx, 1024, std::ptr::null_mut(), std::ptr::null_mut(), 0);
        assert!(!cq.is_null());
        let buf = common::map_buffer(BUF_LEN);
        let mr = ibv_reg_mr(pd, buf, BUF_LEN, IBV_ACCESS_LOCAL_WRITE as i32);
        assert!(!mr.is_null(), "{}", std::io::Error::last_os_error());
        let mut gid = ibv_gid { raw: [0; 16] };
        assert_eq!(ibv_query_gid(ctx, 1, 0, &mut gid), 0);
        Dev {
            pd: pd as usize,
            cq: cq as usize,
            mr: mr as usize,
            buf: buf as usize,
            gid: gid.raw,
        }
    })
}

/// A new RC QP in RESET on the shared context.
fn create_qp() -> *mut ibv_qp {
    let d = dev();
    let mut init = ibv_qp_init_attr {
        send_cq: d.cq as *mut ibv_cq,
        recv_cq: d.cq as *mut ibv_cq,
        cap: ibv_qp_cap {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        },
        qp_type: IBV_QPT_RC,
        ..Default::default()
    };
    // SAFETY: the shared context's PD and CQ.
    let qp = unsafe { ibv_create_qp(d.pd as *mut ibv_pd, &mut init) };
    assert!(!qp.is_null(), "{}", std::io::Error::last_os_error());
    qp
}

fn modify(qp: *mut ibv_qp, mut a: ibv_qp_attr, mask: u32) {
    // SAFETY: a live QP and attributes on the stack.
    let rc = unsafe { ibv_modify_qp(qp, &mut a, mask as i32) };
    assert_eq!(rc, 0, "ibv_modify_qp to {}", a.qp_state);
}

fn to_init(qp: *mut ibv_qp) {
    let a = ibv_qp_attr {
        qp_state: IBV_QPS_INIT,
        port_num: 1,
        qp_access_flags: IBV_ACCESS_LOCAL_WRITE,
        ..Default::default()
    };
    modify(
        qp,
        a,
        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
    );
}

fn to_rtr(qp: *mut ibv_qp, peer_qpn: u32) {
    let mut a = ibv_qp_attr {
        qp_state: IBV_QPS_RTR,
        path_mtu: IBV_MTU_1024,
        dest_qp_num: peer_qpn,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 1,
        ..Default::default()
    };
    a.ah_attr.is_global = 1;
    a.ah_attr.port_num = 1;
    a.ah_attr.grh.dgid.raw = dev().gid;
    a.ah_attr.grh.hop_limit = 64;
    modify(
        qp,
        a,
        IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER,
    );
}

fn to_rts(qp: *mut ibv_qp) {
    let a = ibv_qp_attr {
        qp_state: IBV_QPS_RTS,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        ..Default::default()
    };
    modify(
        qp,
        a,
        IBV_QP_STATE
            | IBV_QP_SQ_PSN
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_MAX_QP_RD_ATOMIC,
    );
}

fn qpn(qp: *mut ibv_qp) -> u32 {
    // SAFETY: a live QP.
    unsafe { (*qp).qp_num }
}

/// `ibv_query_ece`, which must succeed.
fn query(qp: *mut ibv_qp) -> ibv_ece {
    let mut e = ibv_ece {
        vendor_id: 7,
        options: 7,
        comp_mask: 7,
    };
    // SAFETY: a live QP and a structure on the stack.
    let rc = unsafe { ibv_query_ece(qp, &mut e) };
    assert_eq!(rc, 0, "ibv_query_ece");
    e
}

/// `ibv_set_ece`: its return value and the `errno` it left.
fn set(qp: *mut ibv_qp, mut e: ibv_ece) -> (i32, i32) {
    // SAFETY: the calling thread's errno slot.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: a live QP (or NULL) and a structure on the stack.
    let rc = unsafe { ibv_set_ece(qp, &mut e) };
    // SAFETY: as above.
    (rc, unsafe { *libc::__errno_location() })
}

fn ece(vendor_id: u32, options: u32) -> ibv_ece {
    ibv_ece {
        vendor_id,
        options,
        comp_mask: 0,
    }
}

/// Two QPs of the shared context, `a` and `b`, taken through INIT, with `give_a` and `give_b`
/// (if any) set as their peer's ECE, then RTR and RTS toward each other.
fn pair(give_a: Option<ibv_ece>, give_b: Option<ibv_ece>) -> (*mut ibv_qp, *mut ibv_qp) {
    let (a, b) = (create_qp(), create_qp());
    to_init(a);
    to_init(b);
    for (qp, e) in [(a, give_a), (b, give_b)] {
        if let Some(e) = e {
            assert_eq!(set(qp, e).0, 0, "ibv_set_ece");
        }
    }
    to_rtr(a, qpn(b));
    to_rtr(b, qpn(a));
    to_rts(a);
    to_rts(b);
    (a, b)
}

/// Sends a few bytes from `from` to `to` and waits for both completions (the QPs work).
fn send_and_receive(from: *mut ibv_qp, to: *mut ibv_qp) {
    // The tests share one CQ and one buffer and run on parallel threads: without this lock one
    // test's poll takes another's completions (CI saw the SEND's completion without the
    // RECV's, which a sibling test had drained).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let d = dev();
    // SAFETY: the shared registered buffer; its second half receives.
    let lkey = unsafe { (*(d.mr as *mut ibv_mr)).lkey };
    let mut rsge = ibv_sge {
        addr: (d.buf + BUF_LEN / 2) as u64,
        length: 64,
        lkey,
    };
    let mut rwr = ibv_recv_wr {
        wr_id: 2,
        sg_list: &mut rsge,
        num_sge: 1,
        ..Default::default()
    };
    let mut bad_r = std::ptr::null_mut();
    // SAFETY: a live QP; the request and its list live across the call.
    let rc = unsafe { ((*(*to).context).ops.post_recv.unwrap())(to, &mut rwr, &mut bad_r) };
    assert_eq!(rc, 0, "post_recv");
    let mut ssge = ibv_sge {
        addr: d.buf as u64,
        length: 16,
        lkey,
    };
    let mut swr = ibv_send_wr {
        wr_id: 1,
        sg_list: &mut ssge,
        num_sge: 1,
        opcode: IBV_WR_SEND,
        send_flags: IBV_SEND_SIGNALED,
        ..Default::default()
    };
    let mut bad_s = std::ptr::null_mut();
    // SAFETY: as above.
    let rc = unsafe { ((*(*from).context).ops.post_send.unwrap())(from, &mut swr, &mut bad_s) };
    assert_eq!(rc, 0, "post_send");
    let cq = d.cq as *mut ibv_cq;
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.len() < 2 {
        assert!(Instant::now() < deadline, "completions seen: {seen:?}");
        let mut wc = [ibv_wc::default(); 4];
        // SAFETY: a live CQ; its context's ops table is the library's.
        let n = unsafe { ((*(*cq).context).ops.poll_cq.unwrap())(cq, 4, wc.as_mut_ptr()) };
        assert!(n >= 0, "poll_cq");
        for w in &wc[..n as usize] {
            assert_eq!(w.status, IBV_WC_SUCCESS, "wr {}", w.wr_id);
            seen.push(w.wr_id);
        }
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        [1, 2],
        "the SEND's and the RECV's completion, once each"
    );
}

fn destroy(qps: &[*mut ibv_qp]) {
    for &qp in qps {
        // SAFETY: QPs of these tests, destroyed once.
        assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
    }
}

#[test]
fn a_new_qp_offers_selective_repeat_under_ferroces_vendor() {
    let qp = create_qp();
    let want = if offered() { SR } else { 0 };
    let e = query(qp);
    assert_eq!(
        (e.vendor_id, e.options, e.comp_mask),
        (FRCE, want, 0),
        "in RESET"
    );
    to_init(qp);
    let e = query(qp);
    assert_eq!((e.vendor_id, e.options), (FRCE, want), "in INIT");
    destroy(&[qp]);
}

#[test]
fn set_ece_refuses_what_rdma_core_refuses() {
    let qp = create_qp();
    let with_mask = ibv_ece {
        comp_mask: 1,
        ..ece(FRCE, SR)
    };
    assert_eq!(
        set(qp, with_mask),
        (libc::EINVAL, libc::EINVAL),
        "comp_mask"
    );
    // libibverbs' own check, before any provider.
    assert_eq!(
        set(qp, ece(0, SR)),
        (libc::EOPNOTSUPP, libc::EOPNOTSUPP),
        "vendor 0"
    );
    assert_eq!(set(std::ptr::null_mut(), ece(FRCE, SR)).0, libc::EINVAL);
    // SAFETY: a live QP; NULL structures.
    unsafe {
        assert_eq!(ibv_set_ece(qp, std::ptr::null_mut()), libc::EINVAL);
        assert_eq!(ibv_query_ece(qp, std::ptr::null_mut()), libc::EINVAL);
        let mut e = ece(0, 0);
        assert_eq!(ibv_query_ece(std::ptr::null_mut(), &mut e), libc::EINVAL);
    }
    // A refused ECE is not kept: RTR toward a peer that said nothing leaves go-back-N.
    let peer = create_qp();
    to_init(qp);
    to_rtr(qp, qpn(peer));
    assert_eq!(query(qp).options, 0);
    destroy(&[qp, peer]);
}

#[test]
fn qps_that_exchange_their_ece_run_selective_repeat() {
    // The exchange a program makes: each side's offer, read before RTR, to the other.
    let (a, b) = (create_qp(), create_qp());
    let (offer_a, offer_b) = (query(a), query(b));
    to_init(a);
    to_init(b);
    assert_eq!(set(a, offer_b), (0, 0));
    assert_eq!(set(b, offer_a), (0, 0));
    // Setting the ECE changes nothing before RTR: the QP still reports its offer.
    assert_eq!(query(a).options, offer_a.options);
    to_rtr(a, qpn(b));
    to_rtr(b, qpn(a));
    to_rts(a);
    to_rts(b);
    let want = if offered() { SR } else { 0 };
    for (name, qp) in [("a", a), ("b", b)] {
        let e = query(qp);
        assert_eq!(
            (e.vendor_id, e.options, e.comp_mask),
            (FRCE, want, 0),
            "{name} after RTS"
        );
    }
    send_and_receive(a, b);
    send_and_receive(b, a);
    destroy(&[a, b]);
}

#[test]
fn only_what_both_offer_is_in_force() {
    // b's peer offers nothing: neither side does selective repeat (a's peer offers it, but b
    // does not, and neither may do it alone).
    let (a, b) = pair(Some(ece(FRCE, 0)), Some(ece(FRCE, SR)));
    assert_eq!(query(a).options, 0);
    assert_eq!(query(b).options, if offered() { SR } else { 0 });
    destroy(&[a, b]);
    // Bits ferroce does not know are not in force, whatever the peer says.
    let (a, b) = pair(Some(ece(FRCE, u32::MAX)), Some(ece(FRCE, u32::MAX)));
    for qp in [a, b] {
        let e = query(qp);
        assert_eq!(
            e.options & !SR,
            0,
            "unknown bits in force: {:#x}",
            e.options
        );
    }
    destroy(&[a, b]);
}

#[test]
fn a_foreign_vendor_or_no_ece_keeps_go_back_n() {
    // Mellanox's ECE with its own bit 0 set: another vendor's bits mean something else.
    let (a, b) = pair(Some(ece(MELLANOX, 0x1000_0001)), None);
    for (name, qp) in [("a (foreign peer ECE)", a), ("b (no peer ECE)", b)] {
        let e = query(qp);
        assert_eq!((e.vendor_id, e.options), (FRCE, 0), "{name}");
    }
    send_and_receive(a, b);
    destroy(&[a, b]);
    // Neither side calls ibv_set_ece, as perftest does: go-back-N, as toward rxe.
    let (a, b) = pair(None, None);
    assert_eq!((query(a).options, query(b).options), (0, 0));
    destroy(&[a, b]);
}

#[test]
fn reset_forgets_the_peer_ece() {
    let (a, b) = pair(Some(ece(FRCE, SR)), Some(ece(FRCE, SR)));
    assert_eq!(query(a).options, if offered() { SR } else { 0 });
    // Back to RESET, and to a new peer that says nothing: go-back-N again.
    modify(
        a,
        ibv_qp_attr {
            qp_state: IBV_QPS_RESET,
            ..Default::default()
        },
        IBV_QP_STATE,
    );
    let e = query(a);
    assert_eq!(e.options, if offered() { SR } else { 0 }, "the offer again");
    let c = create_qp();
    to_init(a);
    to_rtr(a, qpn(c));
    assert_eq!(query(a).options, 0);
    destroy(&[a, b, c]);
}
