//! Queue pairs and shared receive queues: `ibv_create_qp`, `ibv_modify_qp` through the IBTA
//! state machine, `ibv_query_qp`, and the `post_send`/`post_recv`/`post_srq_recv` operations
//! the inline calls reach. Only reliable-connection QPs exist (ferroce's transport is RC).
//!
//! # ECE: negotiating selective repeat
//! ferroce's selective repeat (`ferroce::QueuePair::set_selective_repeat`) is only for a peer
//! that does it too; toward any other (rxe, a NIC) a QP keeps go-back-N. Programs that do their
//! own connection exchange negotiate such extensions with rdma-core's ECE calls, as UCX does
//! its selective repeat on mlx5: each side reads its QP's offer (`ibv_query_ece`), sends it to
//! the peer with its QPN, hands the peer's to its QP (`ibv_set_ece`) before RTR, and the move
//! to RTR applies what both offer. ferroce's ECE is vendor [`ECE_VENDOR_ID`] with one option,
//! [`ECE_SELECTIVE_REPEAT`]; an ECE of another vendor, or none, leaves go-back-N, so a program
//! that never calls `ibv_set_ece` (perftest without `-R`, toward rxe or anyone) is unaffected.

use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use ferroce_proto::{
    InitAttr, PathMtu, QpCaps, QpState, RecvWr, RtrAttr, RtsAttr, SendFlags, SendOp, SendWr, Sge,
};

use crate::abi::*;
use crate::cq::Cq;
use crate::device::{limits, Context};
use crate::mr::Pd;
use crate::{errno_of, guard, set_errno};

#[repr(C)]
struct Qp {
    c: ibv_qp,
    /// The posting path most posts take (see [`Poster`]); `None` only while the QP is made.
    /// Declared before `inner`, which its sender borrows, so it is dropped first.
    poster: Mutex<Option<Poster>>,
    inner: ferroce::QueuePair,
    /// Signal every send (`sq_sig_all`).
    sig_all: bool,
    caps: QpCaps,
    /// The attributes set so far, for `ibv_query_qp`.
    attr: Mutex<ibv_qp_attr>,
    /// The options of the peer's ECE (`ibv_set_ece`) if it is ferroce's vendor; 0 if none was
    /// set, or another vendor's (whose bits mean something else). Read at the move to RTR.
    peer_ece: AtomicU32,
}

/// ferroce's ECE vendor id, "FRCE" in ASCII. ECE vendor ids are the vendors' IEEE OUIs
/// (0x15b3 for Mellanox), which are 24 bits: one above 0xFFFFFF is no vendor's.
pub(crate) const ECE_VENDOR_ID: u32 = 0x4652_4345;
/// ECE option bit: selective repeat, both directions (`ferroce_proto`'s reorder buffer and
/// the requester resending only the PSN a sequence-error NAK names).
pub(crate) const ECE_SELECTIVE_REPEAT: u32 = 1;

/// A QP's lock-free sender and a work request reused from post to post: a post converts the
/// program's `ibv_send_wr` into `scratch` without allocating, and a WRITE, READ or atomic to a
/// same-host peer is then done by the sender without the QP's lock (ferroce's `QpSender`). The
/// mutex around it is the lock rdma-core's providers take per post (`ibv_post_send` may be
/// called from any thread); a post that finds it taken goes through the QP itself.
struct Poster {
    sender: ferroce::QpSender<'static>,
    scratch: SendWr,
}

#[repr(C)]
struct Srq {
    c: ibv_srq,
    inner: ferroce::SharedReceiveQueue,
    attr: ibv_srq_attr,
}

/// # Safety
/// `qp` must be a QP this library returned and not yet destroyed.
unsafe fn qp_of<'a>(qp: *mut ibv_qp) -> Option<&'a Qp> {
    // SAFETY: the caller's contract; every QP this library makes starts with its `ibv_qp`.
    let c = unsafe { qp.as_ref() }?;
    // SAFETY: `c` is the first field of the repr(C) `Qp` for a QP made as RC or UC.
    (c.qp_type == IBV_QPT_RC || c.qp_type == IBV_QPT_UC).then(|| unsafe { &*qp.cast::<Qp>() })
}

/// # Safety
/// `srq` must be an SRQ this library returned and not yet destroyed.
unsafe fn srq_of<'a>(srq: *mut ibv_srq) -> Option<&'a Srq> {
    // SAFETY: `c` is the first field of the repr(C) `Srq`.
    unsafe { srq.cast::<Srq>().as_ref() }
}

fn caps_of(cap: &ibv_qp_cap) -> Result<QpCaps, i32> {
    let fits = cap.max_send_wr <= limits::MAX_QP_WR
        && cap.max_recv_wr <= limits::MAX_QP_WR
        && cap.max_send_sge <= limits::MAX_SGE
        && cap.max_recv_sge <= limits::MAX_SGE
        && cap.max_inline_data <= limits::MAX_INLINE;
    if !fits {
        return Err(libc::EINVAL);
    }
    Ok(QpCaps {
        max_send_wr: cap.max_send_wr.max(1),
        max_recv_wr: cap.max_recv_wr.max(1),
        max_send_sge: cap.max_send_sge.max(1),
        max_recv_sge: cap.max_recv_sge.max(1),
        // As rxe: a send request's room holds its SGEs (16 bytes each) or its inline data, so
        // the inline capacity is at least the SGE list's size (written back to the program,
        // which rdma-core allows; rdma_xclient sends 16 inline bytes on a QP that asked for 0).
        max_inline_data: cap
            .max_inline_data
            .max(cap.max_send_sge.max(1) * 16)
            .min(limits::MAX_INLINE),
    })
}

pub(crate) fn c_caps(caps: &QpCaps) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: caps.max_send_wr,
        max_recv_wr: caps.max_recv_wr,
        max_send_sge: caps.max_send_sge,
        max_recv_sge: caps.max_recv_sge,
        max_inline_data: caps.max_inline_data,
    }
}

/// `ibv_create_qp`: an RC, UC or UD QP in RESET; the caps it got are written back, as
/// rdma-core does.
#[no_mangle]
unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let (Some(p), Some(init)) = (unsafe { Pd::from_c(pd) }, unsafe { init.as_mut() }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        if ![IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD].contains(&init.qp_type) {
            set_errno(libc::EOPNOTSUPP);
            return std::ptr::null_mut();
        }
        // SAFETY: per the API, CQs and SRQ of this context (or NULL).
        let (send_cq, recv_cq, srq) = unsafe {
            (
                Cq::from_c(init.send_cq),
                Cq::from_c(init.recv_cq),
                srq_of(init.srq),
            )
        };
        let (Some(send_cq), Some(recv_cq)) = (send_cq, recv_cq) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let caps = match caps_of(&init.cap) {
            Ok(c) => c,
            Err(e) => {
                set_errno(e);
                return std::ptr::null_mut();
            }
        };
        let attr = ferroce::QpInitAttr {
            send_cq: &send_cq.inner,
            recv_cq: &recv_cq.inner,
            caps,
            srq: srq.map(|s| &s.inner),
        };
        if init.qp_type == IBV_QPT_UD {
            return crate::ud::create(p, pd, init, &attr);
        }
        let made = if init.qp_type == IBV_QPT_UC {
            p.inner.create_uc_qp(&attr)
        } else {
            p.inner.create_qp(&attr)
        };
        let inner = match made {
            Ok(q) => q,
            Err(e) => {
                set_errno(errno_of(&e));
                return std::ptr::null_mut();
            }
        };
        let (c, attr) = new_c_qp(p, pd, init, &caps, inner.qpn(), init.qp_type);
        let q = Box::new(Qp {
            c,
            poster: Mutex::new(None),
            inner,
            sig_all: init.sq_sig_all != 0,
            caps,
            attr: Mutex::new(attr),
            peer_ece: AtomicU32::new(0),
        });
        // SAFETY: `inner` lives in the box's heap allocation, which never moves and is freed
        // only by `ibv_destroy_qp`; nothing moves or replaces `inner` meanwhile, and `poster`,
        // which holds the borrow, is dropped before it (field order). So the reference is
        // valid for as long as anything that holds it.
        let inner: &'static ferroce::QueuePair = unsafe { &*std::ptr::addr_of!(q.inner) };
        *q.poster.lock().unwrap_or_else(|e| e.into_inner()) = Some(Poster {
            sender: inner.sender(),
            scratch: SendWr::new(0, SendOp::Send, Vec::new()),
        });
        Box::into_raw(q).cast()
    })
}

/// The `ibv_qp` a new QP of number `qpn` hands the program (in RESET, with the caps it got
/// written back into `init`, as rdma-core does), and the record `ibv_query_qp` starts from.
pub(crate) fn new_c_qp(
    p: &Pd,
    pd: *mut ibv_pd,
    init: &mut ibv_qp_init_attr,
    caps: &QpCaps,
    qpn: u32,
    qp_type: ibv_qp_type,
) -> (ibv_qp, ibv_qp_attr) {
    init.cap = c_caps(caps);
    let c = ibv_qp {
        context: p.c.context,
        qp_context: init.qp_context,
        pd,
        send_cq: init.send_cq,
        recv_cq: init.recv_cq,
        srq: init.srq,
        qp_num: qpn,
        state: IBV_QPS_RESET,
        qp_type,
        ..Default::default()
    };
    let record = ibv_qp_attr {
        cap: c_caps(caps),
        port_num: 1,
        ..Default::default()
    };
    (c, record)
}

/// `ibv_destroy_qp`: outstanding work is dropped with the QP.
#[no_mangle]
unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> libc::c_int {
    guard(libc::EFAULT, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: per the API, a QP from ibv_create_qp, destroyed once.
        unsafe {
            if crate::ud::is_ud(qp) {
                crate::ud::destroy(qp);
            } else {
                drop(Box::from_raw(qp.cast::<Qp>()));
            }
        }
        0
    })
}

fn path_mtu_of(code: ibv_mtu) -> Option<PathMtu> {
    Some(match code {
        IBV_MTU_256 => PathMtu::Mtu256,
        IBV_MTU_512 => PathMtu::Mtu512,
        IBV_MTU_1024 => PathMtu::Mtu1024,
        IBV_MTU_2048 => PathMtu::Mtu2048,
        IBV_MTU_4096 => PathMtu::Mtu4096,
        _ => return None,
    })
}

pub(crate) fn state_code(s: QpState) -> ibv_qp_state {
    match s {
        QpState::Reset => IBV_QPS_RESET,
        QpState::Init => IBV_QPS_INIT,
        QpState::Rtr => IBV_QPS_RTR,
        QpState::Rts => IBV_QPS_RTS,
        QpState::Sqd => IBV_QPS_SQD,
        QpState::Sqe => IBV_QPS_SQE,
        QpState::Error => IBV_QPS_ERR,
    }
}

/// What each transition requires of the mask, as IBTA's table for RC (rdma-core's
/// `ibv_modify_qp` passes the mask on unchecked; providers refuse a short one with EINVAL).
pub(crate) const INIT_NEEDS: u32 =
    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
pub(crate) const RTR_NEEDS: u32 = IBV_QP_STATE
    | IBV_QP_AV
    | IBV_QP_PATH_MTU
    | IBV_QP_DEST_QPN
    | IBV_QP_RQ_PSN
    | IBV_QP_MAX_DEST_RD_ATOMIC
    | IBV_QP_MIN_RNR_TIMER;
pub(crate) const RTS_NEEDS: u32 = IBV_QP_STATE
    | IBV_QP_SQ_PSN
    | IBV_QP_TIMEOUT
    | IBV_QP_RETRY_CNT
    | IBV_QP_RNR_RETRY
    | IBV_QP_MAX_QP_RD_ATOMIC;

/// A UC QP's transitions (the kernel's `qp_state_table`): what each requires, and what else
/// it may carry. The RC-only attributes (READ/atomic depths, timeouts, retry counts, the RNR
/// timer) are refused with EINVAL, as the kernel refuses them for UC.
pub(crate) const UC_RTR_NEEDS: u32 =
    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
const UC_RTR_ALLOWS: u32 =
    UC_RTR_NEEDS | IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
pub(crate) const UC_RTS_NEEDS: u32 = IBV_QP_STATE | IBV_QP_SQ_PSN;
const UC_RTS_ALLOWS: u32 =
    UC_RTS_NEEDS | IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PATH_MIG_STATE;

/// Whether `mask` is what a transition of a QP of `qp_type` to `to` requires and allows: RC's
/// requirements (more is taken and ignored, as before), UC's exactly.
fn mask_fits(qp_type: ibv_qp_type, to: ibv_qp_state, mask: u32) -> bool {
    let (needs, allows) = match (qp_type == IBV_QPT_UC, to) {
        (true, IBV_QPS_RTR) => (UC_RTR_NEEDS, UC_RTR_ALLOWS),
        (true, IBV_QPS_RTS) => (UC_RTS_NEEDS, UC_RTS_ALLOWS),
        (_, IBV_QPS_INIT) => (INIT_NEEDS, u32::MAX),
        (_, IBV_QPS_RTR) => (RTR_NEEDS, u32::MAX),
        (_, IBV_QPS_RTS) => (RTS_NEEDS, u32::MAX),
        _ => (IBV_QP_STATE, u32::MAX),
    };
    mask & needs == needs && mask & !allows == 0
}

fn modify(q: &Qp, a: &ibv_qp_attr, mask: u32) -> Result<(), i32> {
    let current = q.inner.state();
    if mask & IBV_QP_CUR_STATE != 0 && a.cur_qp_state != state_code(current) {
        return Err(libc::EINVAL);
    }
    if mask & IBV_QP_STATE == 0 {
        // Changing attributes within a state (timeouts in RTS, say) is not something ferroce's
        // QPs take after the fact.
        return if mask == 0 {
            Ok(())
        } else {
            Err(libc::EOPNOTSUPP)
        };
    }
    let err = |e: ferroce::Error| errno_of(&e);
    match (current, a.qp_state) {
        (_, IBV_QPS_RESET) => {
            // The next connection is to a peer that has yet to say what it offers (and
            // ferroce's reset turns selective repeat off).
            q.peer_ece.store(0, Ordering::Relaxed);
            q.inner.reset();
        }
        (_, IBV_QPS_ERR) => q.inner.modify_to_error(),
        (QpState::Reset, IBV_QPS_INIT) => {
            if !mask_fits(q.c.qp_type, IBV_QPS_INIT, mask) {
                return Err(libc::EINVAL);
            }
            if a.port_num != 1 || a.pkey_index != 0 {
                return Err(libc::EINVAL);
            }
            let access = ferroce_proto::Access::from_bits(a.qp_access_flags);
            q.inner
                .modify_to_init(&InitAttr {
                    pkey_index: 0,
                    port: 1,
                    access,
                })
                .map_err(err)?;
        }
        (QpState::Init, IBV_QPS_RTR) => {
            if !mask_fits(q.c.qp_type, IBV_QPS_RTR, mask) {
                return Err(libc::EINVAL);
            }
            // RoCE has no LIDs: the peer is named by its GID, so the address must be global.
            if a.ah_attr.is_global == 0 || a.ah_attr.port_num > 1 {
                return Err(libc::EINVAL);
            }
            // SAFETY: the program passed its context's QP.
            let ctx = unsafe { Context::from_c(q.c.context) }.ok_or(libc::EINVAL)?;
            // The context's socket is bound to one GID: the source GID must be that one.
            if usize::from(a.ah_attr.grh.sgid_index) != ctx.gid_index {
                return Err(libc::EINVAL);
            }
            let path_mtu = path_mtu_of(a.path_mtu).ok_or(libc::EINVAL)?;
            if u32::from(a.max_dest_rd_atomic) > limits::MAX_RD_ATOMIC {
                return Err(libc::EINVAL);
            }
            // SAFETY: a GID is 16 bytes whichever way the union is read.
            let dgid = Ipv6Addr::from(unsafe { a.ah_attr.grh.dgid.raw });
            q.inner
                .modify_to_rtr(&RtrAttr {
                    path_mtu,
                    dest_qpn: a.dest_qp_num,
                    dest_gid: dgid,
                    rq_psn: ferroce_wire::Psn::new(a.rq_psn),
                    max_dest_rd_atomic: a.max_dest_rd_atomic.max(1),
                    min_rnr_timer: a.min_rnr_timer,
                })
                .map_err(err)?;
            // What both sides' ECE offer, as ferroce's own exchange applies it: at RTR,
            // before this side's RTS starts its requester.
            let both = ece_offer(ctx) & q.peer_ece.load(Ordering::Relaxed);
            q.inner
                .set_selective_repeat(both & ECE_SELECTIVE_REPEAT != 0);
        }
        (QpState::Rtr, IBV_QPS_RTS) => {
            if !mask_fits(q.c.qp_type, IBV_QPS_RTS, mask) {
                return Err(libc::EINVAL);
            }
            // An initiator depth above ferroce's is served with ferroce's: the requester keeps
            // fewer READs and atomics in flight, which changes nothing for the peer. perftest
            // asks for the *peer's* depth here (rxe's is 128), so refusing would stop it.
            let depth = a.max_rd_atomic.min(limits::MAX_RD_ATOMIC as u8).max(1);
            q.inner
                .modify_to_rts(&RtsAttr {
                    sq_psn: ferroce_wire::Psn::new(a.sq_psn),
                    timeout: a.timeout,
                    retry_cnt: a.retry_cnt,
                    rnr_retry: a.rnr_retry,
                    max_rd_atomic: depth,
                })
                .map_err(err)?;
        }
        _ => return Err(libc::EINVAL),
    }
    Ok(())
}

/// Copies the attributes `mask` names into the record `ibv_query_qp` reads.
fn record(store: &mut ibv_qp_attr, a: &ibv_qp_attr, mask: u32) {
    let pick = |bit: u32| mask & bit != 0;
    if pick(IBV_QP_ACCESS_FLAGS) {
        store.qp_access_flags = a.qp_access_flags;
    }
    if pick(IBV_QP_PKEY_INDEX) {
        store.pkey_index = a.pkey_index;
    }
    if pick(IBV_QP_PORT) {
        store.port_num = a.port_num;
    }
    if pick(IBV_QP_AV) {
        store.ah_attr = a.ah_attr;
    }
    if pick(IBV_QP_PATH_MTU) {
        store.path_mtu = a.path_mtu;
    }
    if pick(IBV_QP_DEST_QPN) {
        store.dest_qp_num = a.dest_qp_num;
    }
    if pick(IBV_QP_RQ_PSN) {
        store.rq_psn = a.rq_psn;
    }
    if pick(IBV_QP_MAX_DEST_RD_ATOMIC) {
        store.max_dest_rd_atomic = a.max_dest_rd_atomic;
    }
    if pick(IBV_QP_MIN_RNR_TIMER) {
        store.min_rnr_timer = a.min_rnr_timer;
    }
    if pick(IBV_QP_SQ_PSN) {
        store.sq_psn = a.sq_psn;
    }
    if pick(IBV_QP_TIMEOUT) {
        store.timeout = a.timeout;
    }
    if pick(IBV_QP_RETRY_CNT) {
        store.retry_cnt = a.retry_cnt;
    }
    if pick(IBV_QP_RNR_RETRY) {
        store.rnr_retry = a.rnr_retry;
    }
    if pick(IBV_QP_MAX_QP_RD_ATOMIC) {
        store.max_rd_atomic = a.max_rd_atomic.min(limits::MAX_RD_ATOMIC as u8);
    }
}

/// `ibv_modify_qp`.
#[no_mangle]
unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: libc::c_int,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        let qp_mut = qp;
        let mask = mask as u32;
        // SAFETY: per the API.
        if let (Some(q), Some(a)) = (unsafe { crate::ud::ud_of(qp) }, unsafe { attr.as_ref() }) {
            return crate::ud::modify_qp(qp, q, a, mask);
        }
        // SAFETY: per the API.
        let (Some(q), Some(a)) = (unsafe { qp_of(qp) }, unsafe { attr.as_ref() }) else {
            return libc::EINVAL;
        };
        if let Err(e) = modify(q, a, mask) {
            return e;
        }
        record(
            &mut q.attr.lock().unwrap_or_else(|e| e.into_inner()),
            a,
            mask,
        );
        // SAFETY: rdma-core's ibv_modify_qp keeps qp->state as the program last set it.
        unsafe { (*qp_mut).state = state_code(q.inner.state()) };
        0
    })
}

/// `ibv_query_qp`: the attributes set so far and the current state.
#[no_mangle]
unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: libc::c_int,
    init: *mut ibv_qp_init_attr,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        if let (Some(q), Some(out)) = (unsafe { crate::ud::ud_of(qp) }, unsafe { attr.as_mut() }) {
            // SAFETY: per the API, NULL or the caller's structure.
            crate::ud::query_qp(q, out, unsafe { init.as_mut() });
            return 0;
        }
        // SAFETY: per the API.
        let (Some(q), Some(out)) = (unsafe { qp_of(qp) }, unsafe { attr.as_mut() }) else {
            return libc::EINVAL;
        };
        let mut a = *q.attr.lock().unwrap_or_else(|e| e.into_inner());
        let state = state_code(q.inner.state());
        a.qp_state = state;
        a.cur_qp_state = state;
        a.cap = c_caps(&q.caps);
        *out = a;
        // SAFETY: per the API, NULL or the caller's structure.
        if let Some(i) = unsafe { init.as_mut() } {
            *i = ibv_qp_init_attr {
                qp_context: q.c.qp_context,
                send_cq: q.c.send_cq,
                recv_cq: q.c.recv_cq,
                srq: q.c.srq,
                cap: c_caps(&q.caps),
                qp_type: q.c.qp_type,
                sq_sig_all: i32::from(q.sig_all),
            };
        }
        0
    })
}

/// The ECE options a QP of `ctx` offers.
fn ece_offer(ctx: &Context) -> u32 {
    if ctx.selective_repeat {
        ECE_SELECTIVE_REPEAT
    } else {
        0
    }
}

/// Sets `errno` to `e` and returns it, as rdma-core's ECE calls report a failure.
fn ece_error(e: i32) -> libc::c_int {
    set_errno(e);
    e
}

/// `ibv_query_ece`: vendor [`ECE_VENDOR_ID`]; before RTR (RESET, INIT) the options this QP
/// offers (selective repeat unless the context's option is off, `FERROCE_SR=0`), from RTR on
/// the options in force. UD QPs have no ECE (EOPNOTSUPP, as rdma-core's providers without it).
#[no_mangle]
unsafe extern "C" fn ibv_query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API, a QP of ours and the caller's structure.
        let (q, out) = unsafe { (qp_of(qp), ece.as_mut()) };
        let (Some(q), Some(out)) = (q, out) else {
            // SAFETY: per the API.
            let ud = unsafe { crate::ud::is_ud(qp) };
            return ece_error(if ud { libc::EOPNOTSUPP } else { libc::EINVAL });
        };
        // SAFETY: the program's QP names its context.
        let Some(ctx) = (unsafe { Context::from_c(q.c.context) }) else {
            return ece_error(libc::EINVAL);
        };
        let options = match q.inner.state() {
            QpState::Reset | QpState::Init => ece_offer(ctx),
            _ if q.inner.selective_repeat() => ECE_SELECTIVE_REPEAT,
            _ => 0,
        };
        *out = ibv_ece {
            vendor_id: ECE_VENDOR_ID,
            options,
            comp_mask: 0,
        };
        0
    })
}

/// `ibv_set_ece`: the peer's ECE, applied at the QP's next move to RTR (see the module doc):
/// selective repeat then if both offer it. Another vendor's ECE is accepted and taken as
/// offering nothing (its bits mean something else). Errors as rdma-core's: vendor 0 is
/// EOPNOTSUPP (libibverbs' own check), a `comp_mask` (no extension is defined) EINVAL, a UD
/// QP EOPNOTSUPP; each returned and left in `errno`.
#[no_mangle]
unsafe extern "C" fn ibv_set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API, the caller's structure.
        let Some(e) = (unsafe { ece.as_ref() }) else {
            return ece_error(libc::EINVAL);
        };
        if e.vendor_id == 0 {
            return ece_error(libc::EOPNOTSUPP);
        }
        // SAFETY: per the API, a QP of ours.
        let Some(q) = (unsafe { qp_of(qp) }) else {
            // SAFETY: as above.
            let ud = unsafe { crate::ud::is_ud(qp) };
            return ece_error(if ud { libc::EOPNOTSUPP } else { libc::EINVAL });
        };
        if e.comp_mask != 0 {
            return ece_error(libc::EINVAL);
        }
        let options = if e.vendor_id == ECE_VENDOR_ID {
            e.options
        } else {
            0
        };
        q.peer_ece.store(options, Ordering::Relaxed);
        0
    })
}

/// The program's scatter/gather list, into `out` (whose allocation is reused).
///
/// # Safety
/// `list` must point to `n` SGEs (the verbs contract of a posted work request).
unsafe fn sges_into(list: *const ibv_sge, n: libc::c_int, out: &mut Vec<Sge>) -> Result<(), i32> {
    out.clear();
    let n = usize::try_from(n).map_err(|_| libc::EINVAL)?;
    if n == 0 {
        return Ok(());
    }
    if list.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller's contract.
    let raw = unsafe { std::slice::from_raw_parts(list, n) };
    out.extend(raw.iter().map(|s| Sge {
        addr: s.addr,
        length: s.length,
        lkey: s.lkey,
    }));
    Ok(())
}

/// The program's scatter/gather list.
///
/// # Safety
/// As [`sges_into`].
pub(crate) unsafe fn sges(list: *const ibv_sge, n: libc::c_int) -> Result<Vec<Sge>, i32> {
    let mut v = Vec::new();
    // SAFETY: the caller's contract.
    unsafe { sges_into(list, n, &mut v) }?;
    Ok(v)
}

/// The bytes an inline request carries, gathered now (the program may reuse its buffers as
/// soon as the post returns).
///
/// # Safety
/// Each SGE must name `length` readable bytes at `addr` (the verbs contract for inline data).
pub(crate) unsafe fn gather_inline(sgl: &[Sge], max: u32, data: &mut Vec<u8>) -> Result<(), i32> {
    let total: u64 = sgl.iter().map(|s| u64::from(s.length)).sum();
    if total > u64::from(max) {
        return Err(libc::EINVAL);
    }
    data.clear();
    data.reserve(total as usize);
    for s in sgl {
        if s.length == 0 {
            continue;
        }
        if s.addr == 0 {
            return Err(libc::EFAULT);
        }
        // SAFETY: the caller's contract.
        data.extend_from_slice(unsafe {
            std::slice::from_raw_parts(s.addr as *const u8, s.length as usize)
        });
    }
    Ok(())
}

/// One `ibv_send_wr` as a ferroce request, written over `out` (whose allocations are reused).
///
/// # Safety
/// `w`'s SGE list (and, for inline requests, the memory it names) must be valid.
unsafe fn send_wr_into(q: &Qp, w: &ibv_send_wr, out: &mut SendWr) -> Result<(), i32> {
    // SAFETY: the caller's contract.
    unsafe { sges_into(w.sg_list, w.num_sge, &mut out.sgl) }?;
    // SAFETY: each union arm is plain integers; which one the opcode names is read.
    let (imm, rdma, atomic) = unsafe {
        (
            u32::from_be(w.__bindgen_anon_1.imm_data),
            w.wr.rdma,
            w.wr.atomic,
        )
    };
    let op = match w.opcode {
        IBV_WR_RDMA_WRITE => SendOp::Write,
        IBV_WR_RDMA_WRITE_WITH_IMM => SendOp::WriteWithImm(imm),
        IBV_WR_SEND => SendOp::Send,
        IBV_WR_SEND_WITH_IMM => SendOp::SendWithImm(imm),
        // SAFETY: as above.
        IBV_WR_SEND_WITH_INV => {
            SendOp::SendWithInvalidate(unsafe { w.__bindgen_anon_1.invalidate_rkey })
        }
        IBV_WR_RDMA_READ => SendOp::Read,
        IBV_WR_ATOMIC_CMP_AND_SWP => SendOp::CompareSwap {
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        IBV_WR_ATOMIC_FETCH_AND_ADD => SendOp::FetchAdd {
            add: atomic.compare_add,
        },
        _ => return Err(libc::EOPNOTSUPP),
    };
    let (remote_addr, rkey) = if op.is_atomic() {
        (atomic.remote_addr, atomic.rkey)
    } else {
        (rdma.remote_addr, rdma.rkey)
    };
    let flags = w.send_flags;
    let inline = flags & IBV_SEND_INLINE != 0
        && matches!(
            op,
            SendOp::Send | SendOp::SendWithImm(_) | SendOp::Write | SendOp::WriteWithImm(_)
        );
    if inline {
        let mut data = out.inline_data.take().unwrap_or_default();
        // SAFETY: the caller's contract.
        unsafe { gather_inline(&out.sgl, q.caps.max_inline_data, &mut data) }?;
        out.inline_data = Some(data);
        out.sgl.clear();
    } else {
        out.inline_data = None;
    }
    out.wr_id = w.wr_id;
    out.op = op;
    out.remote_addr = if op.is_rdma() { remote_addr } else { 0 };
    out.rkey = if op.is_rdma() { rkey } else { 0 };
    out.flags = SendFlags {
        signaled: q.sig_all || flags & IBV_SEND_SIGNALED != 0,
        fence: flags & IBV_SEND_FENCE != 0,
        solicited: flags & IBV_SEND_SOLICITED != 0,
    };
    Ok(())
}

/// Posts one `ibv_send_wr`: through the QP's [`Poster`] unless another thread holds it.
///
/// # Safety
/// As [`send_wr_into`].
unsafe fn post_one_send(q: &Qp, w: &ibv_send_wr) -> Result<(), i32> {
    if let Ok(mut guard) = q.poster.try_lock() {
        if let Some(p) = guard.as_mut() {
            // SAFETY: the caller's contract.
            unsafe { send_wr_into(q, w, &mut p.scratch) }?;
            return p.sender.post_send(&p.scratch).map_err(|e| errno_of(&e));
        }
    }
    let mut req = SendWr::new(0, SendOp::Send, Vec::new());
    // SAFETY: the caller's contract.
    unsafe { send_wr_into(q, w, &mut req) }?;
    q.inner.post_send(req).map_err(|e| errno_of(&e))
}

/// Walks a C list of work requests, posting each with `post`; on the first failure points
/// `bad` at it and returns its errno, as rdma-core's providers do.
///
/// # Safety
/// `first` must be NULL or a valid list; `bad` NULL or writable.
unsafe fn post_list<W>(
    first: *mut W,
    bad: *mut *mut W,
    next: impl Fn(&W) -> *mut W,
    mut post: impl FnMut(&W) -> Result<(), i32>,
) -> libc::c_int {
    let mut cur = first;
    // SAFETY: the caller's contract: each node is valid until its `next` is NULL.
    while let Some(w) = unsafe { cur.as_ref() } {
        if let Err(e) = post(w) {
            if !bad.is_null() {
                // SAFETY: the caller's contract.
                unsafe { *bad = cur };
            }
            return e;
        }
        cur = next(w);
    }
    0
}

/// `ctx->ops.post_send`.
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        if let Some(q) = unsafe { crate::ud::ud_of(qp) } {
            // SAFETY: per the API, a valid list and output.
            return unsafe { post_list(wr, bad, |w| w.next, |w| crate::ud::post_send(q, w)) };
        }
        // SAFETY: per the API.
        let Some(q) = (unsafe { qp_of(qp) }) else {
            return libc::EINVAL;
        };
        // SAFETY: per the API, a valid list and output.
        unsafe { post_list(wr, bad, |w| w.next, |w| post_one_send(q, w)) }
    })
}

/// One `ibv_recv_wr` as a ferroce request.
///
/// # Safety
/// `w`'s SGE list must be valid.
unsafe fn recv_wr_of(w: &ibv_recv_wr) -> Result<RecvWr, i32> {
    Ok(RecvWr {
        wr_id: w.wr_id,
        // SAFETY: the caller's contract.
        sgl: unsafe { sges(w.sg_list, w.num_sge) }?,
    })
}

/// Posts a C list of receive requests with `post` (a QP's or an SRQ's), as `post_list` does.
///
/// # Safety
/// `wr` must be NULL or a valid list, `bad` NULL or writable.
unsafe fn post_recv_list(
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    post: impl Fn(RecvWr) -> ferroce::Result<()>,
) -> libc::c_int {
    // SAFETY: the caller's contract.
    unsafe {
        post_list(
            wr,
            bad,
            |w| w.next,
            |w| post(recv_wr_of(w)?).map_err(|e| errno_of(&e)),
        )
    }
}

/// `ctx->ops.post_recv`.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API: a QP of ours, a valid list and output.
        if let Some(u) = unsafe { crate::ud::ud_of(qp) } {
            // SAFETY: as above.
            return unsafe { post_recv_list(wr, bad, |r| u.inner.post_recv(r)) };
        }
        // SAFETY: per the API: a QP of ours, a valid list and output.
        match unsafe { qp_of(qp) } {
            Some(q) => unsafe { post_recv_list(wr, bad, |r| q.inner.post_recv(r)) },
            None => libc::EINVAL,
        }
    })
}

/// `ctx->ops.post_srq_recv`.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API: an SRQ of ours, a valid list and output.
        match unsafe { srq_of(srq) } {
            Some(s) => unsafe { post_recv_list(wr, bad, |r| s.inner.post_recv(r)) },
            None => libc::EINVAL,
        }
    })
}

/// `ibv_create_srq`.
#[no_mangle]
unsafe extern "C" fn ibv_create_srq(pd: *mut ibv_pd, init: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let (Some(p), Some(init)) = (unsafe { Pd::from_c(pd) }, unsafe { init.as_mut() }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let a = init.attr;
        if a.max_wr == 0 || a.max_wr > limits::MAX_QP_WR || a.max_sge > limits::MAX_SGE {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
        let inner = match p
            .inner
            .create_srq(a.max_wr as usize, a.max_sge.max(1) as usize)
        {
            Ok(s) => s,
            Err(e) => {
                set_errno(errno_of(&e));
                return std::ptr::null_mut();
            }
        };
        let c = ibv_srq {
            context: p.c.context,
            srq_context: init.srq_context,
            pd,
            ..Default::default()
        };
        let attr = ibv_srq_attr {
            max_wr: a.max_wr,
            max_sge: a.max_sge.max(1),
            srq_limit: 0,
        };
        init.attr = attr;
        Box::into_raw(Box::new(Srq { c, inner, attr })).cast()
    })
}

/// `ibv_modify_srq`: ferroce's SRQs have no limit event and keep their size.
#[no_mangle]
unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    _attr: *mut ibv_srq_attr,
    mask: libc::c_int,
) -> libc::c_int {
    // SAFETY: per the API.
    if unsafe { srq_of(srq) }.is_none() {
        return libc::EINVAL;
    }
    if mask == 0 {
        0
    } else {
        libc::EOPNOTSUPP
    }
}

/// `ibv_query_srq`.
#[no_mangle]
unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> libc::c_int {
    // SAFETY: per the API.
    match (unsafe { srq_of(srq) }, unsafe { attr.as_mut() }) {
        (Some(s), Some(out)) => {
            *out = s.attr;
            0
        }
        _ => libc::EINVAL,
    }
}

/// `ibv_destroy_srq`.
#[no_mangle]
unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> libc::c_int {
    // SAFETY: per the API, an SRQ from ibv_create_srq (or NULL), destroyed once.
    unsafe { crate::destroy_boxed::<Srq, _>(srq) }
}
