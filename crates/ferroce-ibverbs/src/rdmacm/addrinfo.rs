//! `rdma_getaddrinfo` and `rdma_freeaddrinfo`: the system's resolution, shaped as rdma_cm
//! addresses.

use super::*;

/// `RAI_*` of `<rdma/rdma_cma.h>` (macros bindgen cannot see).
pub(super) const RAI_PASSIVE: c_int = 1;

pub(super) const RAI_NUMERICHOST: c_int = 2;

/// `rdma_getaddrinfo`: the system's resolution, shaped as RC connection addresses.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard(-1, || {
        if res.is_null() || (node.is_null() && service.is_null()) {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: per the API, NULL or the program's hints.
        let h = unsafe { hints.as_ref() }.copied().unwrap_or_default();
        let passive = h.ai_flags & RAI_PASSIVE != 0;
        let mut sys_hints: libc::addrinfo = unsafe { std::mem::zeroed() };
        sys_hints.ai_family = h.ai_family;
        sys_hints.ai_socktype = libc::SOCK_STREAM;
        sys_hints.ai_flags = if passive { libc::AI_PASSIVE } else { 0 }
            | if h.ai_flags & RAI_NUMERICHOST != 0 {
                libc::AI_NUMERICHOST
            } else {
                0
            };
        let mut found: *mut libc::addrinfo = std::ptr::null_mut();
        // SAFETY: C strings or NULL, a zero-initialised hints structure and an output.
        let rc = unsafe { libc::getaddrinfo(node, service, &sys_hints, &mut found) };
        if rc != 0 || found.is_null() {
            set_errno(libc::EADDRNOTAVAIL);
            return -1;
        }
        // SAFETY: the first entry of the list getaddrinfo returned.
        let first = unsafe { &*found };
        let len = first.ai_addrlen;
        // SAFETY: fresh allocations of the sizes written below, freed in rdma_freeaddrinfo.
        let (ai, addr) = unsafe {
            (
                libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()).cast::<rdma_addrinfo>(),
                libc::calloc(1, len as usize).cast::<sockaddr>(),
            )
        };
        if ai.is_null() || addr.is_null() {
            // SAFETY: freeing what was allocated (free(NULL) is a no-op).
            unsafe {
                libc::free(ai.cast());
                libc::free(addr.cast());
                libc::freeaddrinfo(found);
            }
            set_errno(libc::ENOMEM);
            return -1;
        }
        // SAFETY: `len` bytes from getaddrinfo's address into ours; then its list is freed.
        unsafe {
            std::ptr::copy_nonoverlapping(
                first.ai_addr.cast::<u8>(),
                addr.cast::<u8>(),
                len as usize,
            );
            let family = first.ai_family;
            libc::freeaddrinfo(found);
            let a = &mut *ai;
            a.ai_flags = h.ai_flags;
            a.ai_family = family;
            a.ai_qp_type = if h.ai_qp_type != 0 {
                h.ai_qp_type
            } else {
                IBV_QPT_RC as c_int
            };
            a.ai_port_space = if h.ai_port_space != 0 {
                h.ai_port_space
            } else {
                RDMA_PS_TCP as c_int
            };
            if passive {
                a.ai_src_len = len;
                a.ai_src_addr = addr;
            } else {
                a.ai_dst_len = len;
                a.ai_dst_addr = addr;
            }
            *res = ai;
        }
        0
    })
}

/// `rdma_freeaddrinfo`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut cur = res;
    // SAFETY: a list from rdma_getaddrinfo, freed once, entry by entry.
    while let Some(a) = unsafe { cur.as_mut() } {
        let next = a.ai_next;
        // SAFETY: each pointer is ours or NULL.
        unsafe {
            libc::free(a.ai_src_addr.cast());
            libc::free(a.ai_dst_addr.cast());
            libc::free(a.ai_src_canonname.cast());
            libc::free(a.ai_dst_canonname.cast());
            libc::free(cur.cast());
        }
        cur = next;
    }
}
