//! Endpoints (`rdma_create_ep`, `rdma_destroy_ep`): an id with its QP in one call, as
//! librdmacm's synchronous examples use.

use super::*;

/// `rdma_create_ep`: a synchronous id for `res`: bound (passive) or resolved to its
/// destination (active), with a QP made from `qp_attr` if given (for a passive endpoint, each
/// request's id gets one in `rdma_get_request`).
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_create_ep(
    out: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(r) = (unsafe { res.as_ref() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if out.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let ps = if r.ai_port_space != 0 {
            r.ai_port_space as rdma_port_space
        } else {
            RDMA_PS_TCP
        };
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: a NULL channel makes a synchronous id; the output is a local.
        if unsafe { rdma_create_id(std::ptr::null_mut(), &mut id, std::ptr::null_mut(), ps) } != 0 {
            return -1;
        }
        let fail = |id: *mut rdma_cm_id| {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            // SAFETY: the id made above, never handed out.
            unsafe { rdma_destroy_id(id) };
            set_errno(e);
            -1
        };
        // SAFETY: our id and the program's addresses.
        let rc = unsafe {
            if r.ai_flags & RAI_PASSIVE != 0 {
                rdma_bind_addr(id, r.ai_src_addr)
            } else {
                match rdma_resolve_addr(id, r.ai_src_addr, r.ai_dst_addr, 2000) {
                    0 => rdma_resolve_route(id, 2000),
                    e => e,
                }
            }
        };
        if rc != 0 {
            return fail(id);
        }
        // SAFETY: per the API, NULL or the program's attributes.
        if let Some(a) = unsafe { qp_attr.as_mut() } {
            if r.ai_flags & RAI_PASSIVE != 0 {
                // SAFETY: our id.
                if let Some(i) = unsafe { id_of(id) } {
                    i.ep_qp = Some((pd as usize, *a));
                }
            // SAFETY: our resolved id and the program's attributes.
            } else if unsafe { rdma_create_qp(id, pd, a) } != 0 {
                return fail(id);
            }
        }
        // SAFETY: checked non-null; the caller's output.
        unsafe { *out = id };
        0
    })
}

/// `rdma_destroy_ep`: the endpoint's QP (and the CQs made for it), then the id.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    // SAFETY: per the API, an endpoint of ours, destroyed once.
    unsafe {
        rdma_destroy_qp(id);
        rdma_destroy_id(id);
    }
}
