//! An id's QP: made by `rdma_create_qp` (RC to INIT; UD ready to send, as librdmacm makes it)
//! and brought to RTR and RTS toward the peer when the connection is made.

use super::*;

/// `rdma_create_qp`: an RC QP on the id's device, brought to INIT (a NULL `pd` gets one).
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let (Some(i), Some(a), Some(v)) = (unsafe { id_of(id) }, unsafe { attr.as_mut() }, verbs())
        else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if i.c.verbs.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let mut pd = pd;
        if pd.is_null() {
            // SAFETY: the id's live context.
            pd = unsafe { (v.alloc_pd)(i.c.verbs) };
            if pd.is_null() {
                return -1;
            }
            i.owns_pd = true;
        }
        // The id's port space names the QP type (RC for RDMA_PS_TCP), as in librdmacm.
        a.qp_type = i.c.qp_type;
        if a.send_cq.is_null() || a.recv_cq.is_null() {
            // As librdmacm: a channel and a CQ for each the program left out, sized by the caps.
            i.owns_cqs = true;
            for send in [true, false] {
                let (slot, depth) = if send {
                    (&mut a.send_cq, a.cap.max_send_wr)
                } else {
                    (&mut a.recv_cq, a.cap.max_recv_wr)
                };
                if !slot.is_null() {
                    continue;
                }
                // SAFETY: the id's live context.
                let ch = unsafe { (v.create_comp_channel)(i.c.verbs) };
                let cq = if ch.is_null() {
                    std::ptr::null_mut()
                } else {
                    // SAFETY: the id's live context and the channel just made.
                    unsafe { (v.create_cq)(i.c.verbs, depth.max(1) as c_int, id.cast(), ch, 0) }
                };
                if send {
                    (i.c.send_cq_channel, i.c.send_cq) = (ch, cq);
                } else {
                    (i.c.recv_cq_channel, i.c.recv_cq) = (ch, cq);
                }
                if cq.is_null() {
                    release_cqs(i, v);
                    return -1;
                }
                *slot = cq;
            }
        }
        // SAFETY: libibverbs' call with the program's attributes.
        let qp = unsafe { (v.create_qp)(pd, a) };
        if qp.is_null() {
            release_cqs(i, v);
            return -1;
        }
        let rc = if a.qp_type == IBV_QPT_UD {
            ready_ud_qp(v, qp)
        } else {
            let mut init = ibv_qp_attr {
                qp_state: IBV_QPS_INIT,
                pkey_index: 0,
                port_num: 1,
                qp_access_flags: IBV_ACCESS_REMOTE_READ
                    | IBV_ACCESS_REMOTE_WRITE
                    | IBV_ACCESS_REMOTE_ATOMIC,
                ..Default::default()
            };
            let mask = crate::qp::INIT_NEEDS;
            // SAFETY: the QP just created.
            unsafe { (v.modify_qp)(qp, &mut init, mask as c_int) }
        };
        if rc != 0 {
            // SAFETY: destroyed once, never handed out.
            unsafe { (v.destroy_qp)(qp) };
            set_errno(rc);
            return -1;
        }
        init_ece(i, v, qp);
        i.c.qp = qp;
        *i.shared.qp.lock().unwrap_or_else(|e| e.into_inner()) = qp as usize;
        i.c.pd = pd;
        i.c.send_cq = a.send_cq;
        i.c.recv_cq = a.recv_cq;
        i.c.srq = a.srq;
        0
    })
}

/// Destroys the CQs and channels `rdma_create_qp` made for the id, if it made them.
/// A UD QP of rdma_cm's UDP port space is ready to send as soon as it is made, as librdmacm
/// makes it: INIT with rdma_cm's Q_Key (`RDMA_UDP_QKEY`), RTR, RTS.
pub(super) fn ready_ud_qp(v: &Verbs, qp: *mut ibv_qp) -> c_int {
    let steps = [
        (
            ibv_qp_attr {
                qp_state: IBV_QPS_INIT,
                port_num: 1,
                qkey: RDMA_UDP_QKEY,
                ..Default::default()
            },
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
        ),
        (
            ibv_qp_attr {
                qp_state: IBV_QPS_RTR,
                ..Default::default()
            },
            IBV_QP_STATE,
        ),
        (
            ibv_qp_attr {
                qp_state: IBV_QPS_RTS,
                ..Default::default()
            },
            IBV_QP_STATE | IBV_QP_SQ_PSN,
        ),
    ];
    for (mut attr, mask) in steps {
        // SAFETY: the QP the caller just created.
        let rc = unsafe { (v.modify_qp)(qp, &mut attr, mask as c_int) };
        if rc != 0 {
            return rc;
        }
    }
    0
}

pub(super) fn release_cqs(i: &mut CmId, v: &Verbs) {
    if !i.owns_cqs {
        return;
    }
    i.owns_cqs = false;
    let cqs = [
        (&mut i.c.send_cq, &mut i.c.send_cq_channel),
        (&mut i.c.recv_cq, &mut i.c.recv_cq_channel),
    ];
    for (cq, ch) in cqs {
        // SAFETY: objects this library made for the id, destroyed once (then cleared).
        unsafe {
            if !cq.is_null() {
                (v.destroy_cq)(*cq);
            }
            if !ch.is_null() {
                (v.destroy_comp_channel)(*ch);
            }
        }
        *cq = std::ptr::null_mut();
        *ch = std::ptr::null_mut();
    }
}

/// `rdma_create_qp_ex`: the basic attributes of an extended request (a PD is required there).
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    // SAFETY: per the API.
    let Some(a) = (unsafe { attr.as_ref() }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    // Only the fields the basic call knows: anything more is asked for by comp_mask bits
    // beyond the PD.
    if a.comp_mask & !IBV_QP_INIT_ATTR_PD != 0 {
        set_errno(libc::EOPNOTSUPP);
        return -1;
    }
    let mut basic = ibv_qp_init_attr {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    // SAFETY: as rdma_create_qp, with the same id and PD.
    let rc = unsafe { rdma_create_qp(id, a.pd, &mut basic) };
    if rc == 0 {
        // SAFETY: the caller's attributes get the caps the QP has, as in the basic call.
        unsafe { (*attr).cap = basic.cap };
    }
    rc
}

/// `rdma_destroy_qp`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    guard((), || {
        // SAFETY: per the API.
        let (Some(i), Some(v)) = (unsafe { id_of(id) }, verbs()) else {
            return;
        };
        if !i.c.qp.is_null() {
            // Under the lock, so that no connection thread is moving the QP meanwhile.
            let mut held = i.shared.qp.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the id's QP, destroyed once.
            unsafe { (v.destroy_qp)(i.c.qp) };
            *held = 0;
            i.c.qp = std::ptr::null_mut();
        }
        release_cqs(i, v);
        if i.owns_pd && !i.c.pd.is_null() {
            // SAFETY: the PD this library allocated for the id.
            unsafe { (v.dealloc_pd)(i.c.pd) };
            i.c.pd = std::ptr::null_mut();
            i.owns_pd = false;
        }
    })
}

/// This side's connection parameters, without the private data (so a thread may keep them).
#[derive(Clone, Copy)]
pub(super) struct Params {
    pub(super) responder_resources: u8,
    pub(super) initiator_depth: u8,
    pub(super) retry_count: u8,
    pub(super) rnr_retry_count: u8,
}

impl From<&rdma_conn_param> for Params {
    fn from(p: &rdma_conn_param) -> Params {
        Params {
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            retry_count: p.retry_count,
            rnr_retry_count: p.rnr_retry_count,
        }
    }
}

/// What a connection's thread needs of its id, copied so that it never reads the id itself.
#[derive(Clone, Copy)]
pub(super) struct Local {
    pub(super) device: Device,
    pub(super) psn: u32,
    pub(super) ack_timeout: u8,
    pub(super) ece: Ece,
}

/// The deepest READ/atomic queue a ferroce QP serves or keeps: a request that asks for more
/// (the kernel's rdma_cm asks for its device's maximum, 128 on rxe, when the program passes no
/// parameters) gets this, as librdmacm caps the request's values by the device's.
pub(super) const MAX_DEPTH: u8 = ferroce_proto::attr::MAX_RD_ATOMIC;

/// Brings `qp` to RTR and RTS toward `peer`.
pub(super) fn connect_qp(
    qp: *mut ibv_qp,
    local: &Local,
    peer: &Peer,
    mine: &Params,
) -> Result<(), c_int> {
    let v = verbs().ok_or(libc::ENOSYS)?;
    let dev = local.device;
    if qp.is_null() {
        // A QP the program made itself (conn_param.qp_num) is not reachable from here.
        return Err(libc::EOPNOTSUPP);
    }
    let mut ah = ibv_ah_attr {
        is_global: 1,
        port_num: 1,
        ..Default::default()
    };
    ah.grh.dgid = ibv_gid { raw: peer.gid };
    ah.grh.sgid_index = dev.gid_index;
    ah.grh.hop_limit = 64;
    let mut rtr = ibv_qp_attr {
        qp_state: IBV_QPS_RTR,
        path_mtu: (dev.mtu).min(ibv_mtu::from(peer.mtu)).max(IBV_MTU_256),
        dest_qp_num: peer.qpn,
        rq_psn: peer.psn,
        max_dest_rd_atomic: mine.responder_resources.clamp(1, MAX_DEPTH),
        min_rnr_timer: 12,
        ah_attr: ah,
        ..Default::default()
    };
    // SAFETY: the id's live QP.
    let uc = unsafe { (*qp).qp_type } == IBV_QPT_UC;
    let mask = if uc {
        crate::qp::UC_RTR_NEEDS
    } else {
        crate::qp::RTR_NEEDS
    };
    // SAFETY: the id's live QP.
    let rc = unsafe { (v.modify_qp)(qp, &mut rtr, mask as c_int) };
    if rc != 0 {
        return Err(rc);
    }
    let mut rts = ibv_qp_attr {
        qp_state: IBV_QPS_RTS,
        sq_psn: local.psn,
        timeout: local.ack_timeout,
        retry_cnt: mine.retry_count.min(7),
        rnr_retry: mine.rnr_retry_count.min(7),
        max_rd_atomic: mine
            .initiator_depth
            .min(peer.responder_resources)
            .clamp(1, MAX_DEPTH),
        ..Default::default()
    };
    let mask = if uc {
        crate::qp::UC_RTS_NEEDS
    } else {
        crate::qp::RTS_NEEDS
    };
    // SAFETY: the id's live QP.
    let rc = unsafe { (v.modify_qp)(qp, &mut rts, mask as c_int) };
    if rc != 0 {
        return Err(rc);
    }
    Ok(())
}

pub(super) fn move_qp_to_error(qp: *mut ibv_qp) {
    if let (false, Some(v)) = (qp.is_null(), verbs()) {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: a QP of an id; ERR is reachable from any state.
        unsafe { (v.modify_qp)(qp, &mut a, IBV_QP_STATE as c_int) };
    }
}

/// The private data a connection parameter names.
///
/// # Safety
/// `p.private_data` must point to `private_data_len` bytes (or be NULL).
pub(super) unsafe fn private_of(p: &rdma_conn_param) -> Vec<u8> {
    if p.private_data.is_null() || p.private_data_len == 0 {
        return Vec::new();
    }
    // SAFETY: the caller's contract.
    unsafe {
        std::slice::from_raw_parts(p.private_data.cast::<u8>(), usize::from(p.private_data_len))
    }
    .to_vec()
}
