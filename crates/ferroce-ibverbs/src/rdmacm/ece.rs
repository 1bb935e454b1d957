//! Enhanced connection establishment (ECE): what an id's QP offers in its REQ or REP, what the
//! peer's brings to the QP before RTR, and the calls that set and read them.

use super::*;

/// An ECE as a REQ or REP carries it: `struct ibv_ece` without its `comp_mask`. Vendor 0 is
/// none (what librdmacm reports of a peer that sent none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ece {
    /// The vendor whose options these are (an IEEE OUI, or ferroce's id above 24 bits).
    pub vendor_id: u32,
    /// The options, in the vendor's meaning.
    pub options: u32,
}

impl From<ibv_ece> for Ece {
    fn from(e: ibv_ece) -> Ece {
        Ece {
            vendor_id: e.vendor_id,
            options: e.options,
        }
    }
}

impl From<Ece> for ibv_ece {
    fn from(e: Ece) -> ibv_ece {
        ibv_ece {
            vendor_id: e.vendor_id,
            options: e.options,
            comp_mask: 0,
        }
    }
}

/// As librdmacm when it makes an id's QP: the QP's ECE (what it offers) becomes the id's local
/// one, which its REQ carries. On a passive id the request's ECE is known already and goes to
/// the QP for its RTR: as it is if of the same vendor, else as this side's vendor with no
/// options (the peer's bits mean something else). A QP without ECE is left as it is.
pub(super) fn init_ece(i: &mut CmId, v: &Verbs, qp: *mut ibv_qp) {
    let mut mine = ibv_ece::default();
    // SAFETY: a live QP and a full structure.
    i.local_ece = if unsafe { (v.query_ece)(qp, &mut mine) } == 0 {
        mine.into()
    } else {
        Ece::default()
    };
    let remote = *i
        .shared
        .remote_ece
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if remote.vendor_id == 0 {
        return;
    }
    set_peer_ece(v, qp, i.local_ece, remote);
}

/// Hands the peer's ECE to `qp` before its RTR (`ibv_set_ece`): another vendor's, or none (a
/// peer without ECE), as this side's vendor with no options, as librdmacm does. A failure (a
/// QP without ECE) leaves the QP as it is, as librdmacm ignores it too.
pub(super) fn set_peer_ece(v: &Verbs, qp: *mut ibv_qp, local: Ece, remote: Ece) {
    let given = if remote.vendor_id == local.vendor_id {
        remote
    } else {
        Ece {
            vendor_id: local.vendor_id,
            options: 0,
        }
    };
    let mut e = ibv_ece::from(given);
    // SAFETY: a live QP of the id (the caller holds it) and a full structure.
    unsafe { (v.set_ece)(qp, &mut e) };
}

/// The ECE in force on `qp` (after its RTR), which a REP carries; vendor 0 if it has none.
pub(super) fn ece_in_force(v: &Verbs, qp: *mut ibv_qp) -> Ece {
    let mut e = ibv_ece::default();
    // SAFETY: a live QP of the id and a full structure.
    if qp.is_null() || unsafe { (v.query_ece)(qp, &mut e) } != 0 {
        return Ece::default();
    }
    e.into()
}

/// `rdma_set_local_ece`: the ECE an id without a QP offers in its REQ or REP, as librdmacm
/// (for a program's own QP, which ferroce's librdmacm does not connect: `rdma_create_qp`
/// replaces it with its QP's). EINVAL for an id with a QP, vendor 0 or a `comp_mask`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_set_local_ece(
    id: *mut rdma_cm_id,
    ece: *mut ibv_ece,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API, an id of ours and the caller's structure.
        let (Some(i), Some(e)) = (unsafe { id_of(id) }, unsafe { ece.as_ref() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if !i.c.qp.is_null() || e.vendor_id == 0 || e.comp_mask != 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        i.local_ece = (*e).into();
        0
    })
}

/// `rdma_get_remote_ece`: the ECE the peer's REQ (on a passive id, from its
/// `CONNECT_REQUEST`) or REP carried; vendor 0 if it carried none. As librdmacm, only for an id
/// without a QP (EINVAL otherwise): a passive side reads the request's before `rdma_create_qp`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_get_remote_ece(
    id: *mut rdma_cm_id,
    ece: *mut ibv_ece,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API, an id of ours and the caller's structure.
        let (Some(i), Some(out)) = (unsafe { id_of(id) }, unsafe { ece.as_mut() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if !i.c.qp.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let remote = *i
            .shared
            .remote_ece
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *out = remote.into();
        0
    })
}
