//! Unreliable datagram QPs and address handles: `ibv_create_qp` with `IBV_QPT_UD`, its
//! transitions, sends and receives (the QP calls dispatch here on `qp_type`), `ibv_create_ah`,
//! `ibv_destroy_ah`, `ibv_init_ah_from_wc` and `ibv_create_ah_from_wc`. UCX's `ud_verbs`
//! transport (which UCP needs to connect RC endpoints), perftest's `-c UD` and
//! `ibv_ud_pingpong` run on them.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;

use ferroce_proto::{QpCaps, QpState};

use crate::abi::*;
use crate::device::Context;
use crate::mr::Pd;
use crate::qp::{c_caps, new_c_qp, sges, state_code};
use crate::{errno_of, guard, set_errno};

#[repr(C)]
pub(crate) struct UdQp {
    c: ibv_qp,
    pub(crate) inner: ferroce::UdQueuePair,
    sig_all: bool,
    caps: QpCaps,
    /// The attributes set so far, for `ibv_query_qp`.
    attr: Mutex<ibv_qp_attr>,
}

#[repr(C)]
struct Ah {
    c: ibv_ah,
    inner: ferroce::AddressHandle,
}

/// The UD QP behind a program's pointer, if it is one.
///
/// # Safety
/// `qp` must be NULL or a QP this library returned and not yet destroyed.
pub(crate) unsafe fn ud_of<'a>(qp: *mut ibv_qp) -> Option<&'a UdQp> {
    // SAFETY: the caller's contract; every QP this library makes starts with its `ibv_qp`.
    let c = unsafe { qp.as_ref() }?;
    // SAFETY: `c` is the first field of the repr(C) `UdQp` for a QP made as UD.
    (c.qp_type == IBV_QPT_UD).then(|| unsafe { &*qp.cast::<UdQp>() })
}

/// Whether `qp` (NULL or a QP of this library) is a UD QP.
///
/// # Safety
/// As [`ud_of`].
pub(crate) unsafe fn is_ud(qp: *mut ibv_qp) -> bool {
    // SAFETY: the caller's contract.
    unsafe { ud_of(qp) }.is_some()
}

/// `ibv_create_qp` for `IBV_QPT_UD`, once the common checks passed.
pub(crate) fn create(
    p: &Pd,
    pd: *mut ibv_pd,
    init: &mut ibv_qp_init_attr,
    attr: &ferroce::QpInitAttr<'_>,
) -> *mut ibv_qp {
    let inner = match p.inner.create_ud_qp(attr) {
        Ok(q) => q,
        Err(e) => {
            set_errno(errno_of(&e));
            return std::ptr::null_mut();
        }
    };
    let (c, record) = new_c_qp(p, pd, init, &attr.caps, inner.qpn(), IBV_QPT_UD);
    Box::into_raw(Box::new(UdQp {
        c,
        inner,
        sig_all: init.sq_sig_all != 0,
        caps: attr.caps,
        attr: Mutex::new(record),
    }))
    .cast()
}

/// `ibv_destroy_qp` of a UD QP.
///
/// # Safety
/// `qp` is a UD QP of this library, destroyed once.
pub(crate) unsafe fn destroy(qp: *mut ibv_qp) {
    // SAFETY: the caller's contract.
    drop(unsafe { Box::from_raw(qp.cast::<UdQp>()) });
}

/// IBTA's required attributes for UD (what rxe and mlx5 check).
const INIT_NEEDS: u32 = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY;
const RTS_NEEDS: u32 = IBV_QP_STATE | IBV_QP_SQ_PSN;

fn modify(q: &UdQp, a: &ibv_qp_attr, mask: u32) -> Result<(), i32> {
    let current = q.inner.state();
    if mask & IBV_QP_CUR_STATE != 0 && a.cur_qp_state != state_code(current) {
        return Err(libc::EINVAL);
    }
    let err = |e: ferroce::Error| errno_of(&e);
    if mask & (IBV_QP_PORT | IBV_QP_PKEY_INDEX) != 0
        && ((mask & IBV_QP_PORT != 0 && a.port_num != 1)
            || (mask & IBV_QP_PKEY_INDEX != 0 && a.pkey_index != 0))
    {
        return Err(libc::EINVAL);
    }
    if mask & IBV_QP_STATE == 0 {
        // The Q_Key may change in any state that has one; nothing else without a transition.
        if mask & !IBV_QP_QKEY != 0 {
            return Err(libc::EOPNOTSUPP);
        }
        if mask & IBV_QP_QKEY != 0 {
            q.inner.set_qkey(a.qkey).map_err(err)?;
        }
        return Ok(());
    }
    match (current, a.qp_state) {
        (_, IBV_QPS_RESET) => q.inner.reset(),
        (_, IBV_QPS_ERR) => q.inner.modify_to_error(),
        (QpState::Reset, IBV_QPS_INIT) => {
            if mask & INIT_NEEDS != INIT_NEEDS {
                return Err(libc::EINVAL);
            }
            q.inner.modify_to_init(a.qkey).map_err(err)?;
        }
        (QpState::Init, IBV_QPS_INIT) => {
            if mask & IBV_QP_QKEY != 0 {
                q.inner.set_qkey(a.qkey).map_err(err)?;
            }
        }
        (QpState::Init, IBV_QPS_RTR) => {
            q.inner.modify_to_rtr().map_err(err)?;
            if mask & IBV_QP_QKEY != 0 {
                q.inner.set_qkey(a.qkey).map_err(err)?;
            }
        }
        (QpState::Rtr, IBV_QPS_RTS) | (QpState::Sqe | QpState::Rts, IBV_QPS_RTS) => {
            if current == QpState::Rtr && mask & RTS_NEEDS != RTS_NEEDS {
                return Err(libc::EINVAL);
            }
            q.inner
                .modify_to_rts(ferroce_wire::Psn::new(a.sq_psn))
                .map_err(err)?;
            if mask & IBV_QP_QKEY != 0 {
                q.inner.set_qkey(a.qkey).map_err(err)?;
            }
        }
        _ => return Err(libc::EINVAL),
    }
    Ok(())
}

/// `ibv_modify_qp` of a UD QP.
pub(crate) fn modify_qp(qp: *mut ibv_qp, q: &UdQp, a: &ibv_qp_attr, mask: u32) -> libc::c_int {
    if let Err(e) = modify(q, a, mask) {
        return e;
    }
    let mut store = q.attr.lock().unwrap_or_else(|e| e.into_inner());
    if mask & IBV_QP_PKEY_INDEX != 0 {
        store.pkey_index = a.pkey_index;
    }
    if mask & IBV_QP_PORT != 0 {
        store.port_num = a.port_num;
    }
    drop(store);
    // SAFETY: rdma-core's ibv_modify_qp keeps qp->state as the program last set it; `qp` is
    // the program's pointer to this QP.
    unsafe { (*qp).state = state_code(q.inner.state()) };
    0
}

/// `ibv_query_qp` of a UD QP.
pub(crate) fn query_qp(q: &UdQp, out: &mut ibv_qp_attr, init: Option<&mut ibv_qp_init_attr>) {
    let mut a = *q.attr.lock().unwrap_or_else(|e| e.into_inner());
    let state = state_code(q.inner.state());
    a.qp_state = state;
    a.cur_qp_state = state;
    a.qkey = q.inner.qkey();
    a.sq_psn = q.inner.sq_psn().value();
    a.cap = c_caps(&q.caps);
    *out = a;
    if let Some(i) = init {
        *i = ibv_qp_init_attr {
            qp_context: q.c.qp_context,
            send_cq: q.c.send_cq,
            recv_cq: q.c.recv_cq,
            srq: q.c.srq,
            cap: c_caps(&q.caps),
            qp_type: IBV_QPT_UD,
            sq_sig_all: i32::from(q.sig_all),
        };
    }
}

/// One `ibv_send_wr` of a UD QP, posted.
///
/// # Safety
/// `w`'s SGE list, address handle and (for inline sends) buffers must be valid.
pub(crate) unsafe fn post_send(q: &UdQp, w: &ibv_send_wr) -> Result<(), i32> {
    // SAFETY: a union of plain integers and pointers; `ud` is the arm a UD send uses.
    let ud = unsafe { w.wr.ud };
    // SAFETY: the program's address handle, made by `ibv_create_ah` (or NULL).
    let ah = unsafe { ud.ah.cast::<Ah>().as_ref() }.ok_or(libc::EINVAL)?;
    let imm_data = match w.opcode {
        IBV_WR_SEND => None,
        // SAFETY: as above, the immediate arm.
        IBV_WR_SEND_WITH_IMM => Some(u32::from_be(unsafe { w.__bindgen_anon_1.imm_data })),
        _ => return Err(libc::EINVAL),
    };
    // SAFETY: the caller's contract.
    let sgl = unsafe { sges(w.sg_list, w.num_sge) }?;
    let inline_data = if w.send_flags & IBV_SEND_INLINE != 0 {
        let mut data = Vec::new();
        // SAFETY: the caller's contract.
        unsafe { crate::qp::gather_inline(&sgl, q.caps.max_inline_data, &mut data) }?;
        Some(data)
    } else {
        None
    };
    let wr = ferroce::UdSendWr {
        wr_id: w.wr_id,
        ah: ah.inner,
        remote_qpn: ud.remote_qpn,
        remote_qkey: ud.remote_qkey,
        imm_data,
        sgl: if inline_data.is_some() {
            Vec::new()
        } else {
            sgl
        },
        inline_data,
        signaled: q.sig_all || w.send_flags & IBV_SEND_SIGNALED != 0,
        solicited: w.send_flags & IBV_SEND_SOLICITED != 0,
    };
    q.inner.post_send(&wr).map_err(|e| errno_of(&e))
}

/// The address handle `attr` describes on `p`'s context; errno on failure.
fn make_ah(pd: *mut ibv_pd, p: &Pd, attr: &ibv_ah_attr) -> Result<*mut ibv_ah, i32> {
    // RoCE has no LIDs: a destination is its GID.
    if attr.is_global == 0 || attr.port_num > 1 {
        return Err(libc::EINVAL);
    }
    // SAFETY: the PD's context is a context of this library.
    let ctx = unsafe { Context::from_c(p.c.context) }.ok_or(libc::EINVAL)?;
    if usize::from(attr.grh.sgid_index) != ctx.gid_index {
        return Err(libc::EINVAL);
    }
    // SAFETY: a GID is 16 bytes whichever way the union is read.
    let gid = Ipv6Addr::from(unsafe { attr.grh.dgid.raw });
    let inner = p.inner.create_ah(gid).map_err(|e| errno_of(&e))?;
    let c = ibv_ah {
        context: p.c.context,
        pd,
        handle: 0,
    };
    Ok(Box::into_raw(Box::new(Ah { c, inner })).cast())
}

/// `ibv_create_ah`: an address handle to a GID (RoCE: `is_global` must be set).
#[no_mangle]
unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let (Some(p), Some(a)) = (unsafe { Pd::from_c(pd) }, unsafe { attr.as_ref() }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        make_ah(pd, p, a).unwrap_or_else(|e| {
            set_errno(e);
            std::ptr::null_mut()
        })
    })
}

/// `ibv_destroy_ah`.
#[no_mangle]
unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> libc::c_int {
    // SAFETY: per the API, an address handle from ibv_create_ah (or NULL), destroyed once.
    unsafe { crate::destroy_boxed::<Ah, _>(ah) }
}

/// The sender's GID in a UD receive's GRH: RoCE v2 over IPv4 keeps the IPv4 header in its
/// last 20 bytes (version 4 there), over IPv6 the GRH is the IPv6 header.
fn source_gid(grh: &[u8; 40]) -> Ipv6Addr {
    if grh[20] >> 4 == 4 {
        Ipv4Addr::new(grh[32], grh[33], grh[34], grh[35]).to_ipv6_mapped()
    } else {
        let mut g = [0u8; 16];
        g.copy_from_slice(&grh[8..24]);
        Ipv6Addr::from(g)
    }
}

/// `ibv_init_ah_from_wc`: the attributes of an address handle back to a UD datagram's sender.
#[no_mangle]
unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    ah_attr: *mut ibv_ah_attr,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let (Some(ctx), Some(wc), Some(out)) = (
            unsafe { Context::from_c(context) },
            unsafe { wc.as_ref() },
            unsafe { ah_attr.as_mut() },
        ) else {
            return libc::EINVAL;
        };
        if wc.wc_flags & IBV_WC_GRH == 0 || grh.is_null() {
            // RoCE needs the GRH to name the sender.
            return libc::EINVAL;
        }
        // SAFETY: per the API, the receive buffer's first 40 bytes.
        let bytes = unsafe { &*grh.cast::<[u8; 40]>() };
        let mut a = ibv_ah_attr {
            is_global: 1,
            port_num,
            ..Default::default()
        };
        a.grh.dgid.raw = source_gid(bytes).octets();
        a.grh.sgid_index = ctx.gid_index as u8;
        a.grh.hop_limit = 0xff;
        *out = a;
        0
    })
}

/// `ibv_create_ah_from_wc`: an address handle back to a UD datagram's sender.
#[no_mangle]
unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    port_num: u8,
) -> *mut ibv_ah {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let Some(p) = (unsafe { Pd::from_c(pd) }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let mut a = ibv_ah_attr::default();
        // SAFETY: per the API; the context is the PD's.
        let r = unsafe { ibv_init_ah_from_wc(p.c.context, port_num, wc, grh, &mut a) };
        if r != 0 {
            set_errno(r);
            return std::ptr::null_mut();
        }
        make_ah(pd, p, &a).unwrap_or_else(|e| {
            set_errno(e);
            std::ptr::null_mut()
        })
    })
}
