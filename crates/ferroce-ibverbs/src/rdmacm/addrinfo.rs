//! `rdma_getaddrinfo` and `rdma_freeaddrinfo`: the system's resolution, shaped as rdma_cm
//! addresses.

use super::*;

/// `RAI_*` of `<rdma/rdma_cma.h>` (macros bindgen cannot see).
pub(super) const RAI_PASSIVE: c_int = 1;

pub(super) const RAI_NUMERICHOST: c_int = 2;

/// A `calloc`ed copy of the `len` bytes of the socket address at `addr` (freed by
/// `rdma_freeaddrinfo`), or NULL when out of memory.
///
/// # Safety
/// `addr` points to `len` readable bytes.
unsafe fn copy_addr(addr: *const sockaddr, len: libc::socklen_t) -> *mut sockaddr {
    // SAFETY: a fresh allocation of `len` bytes.
    let out = unsafe { libc::calloc(1, len as usize) }.cast::<sockaddr>();
    if !out.is_null() {
        // SAFETY: the caller's `len` bytes into ours.
        unsafe { std::ptr::copy_nonoverlapping(addr.cast::<u8>(), out.cast::<u8>(), len as usize) };
    }
    out
}

/// The first address the system resolves `node`/`service` to, as a copy for an
/// `rdma_addrinfo` and its family; `None` (errno set) when nothing resolves.
fn system_address(
    node: *const c_char,
    service: *const c_char,
    h: &rdma_addrinfo,
) -> Option<(*mut sockaddr, libc::socklen_t, c_int)> {
    let passive = h.ai_flags & RAI_PASSIVE != 0;
    // SAFETY: an all-zero addrinfo is a valid "no hints" value.
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
    // SAFETY: C strings or NULL, the hints above and an output.
    let rc = unsafe { libc::getaddrinfo(node, service, &sys_hints, &mut found) };
    if rc != 0 || found.is_null() {
        set_errno(libc::EADDRNOTAVAIL);
        return None;
    }
    // SAFETY: the first entry of the list getaddrinfo returned, copied before the list is
    // freed.
    let out = unsafe {
        let first = &*found;
        let copy = copy_addr(first.ai_addr.cast(), first.ai_addrlen);
        let r = (copy, first.ai_addrlen, first.ai_family);
        libc::freeaddrinfo(found);
        r
    };
    if out.0.is_null() {
        set_errno(libc::ENOMEM);
        return None;
    }
    Some(out)
}

/// `rdma_getaddrinfo`, as librdmacm's: `node`/`service` resolved by the system (the source of
/// a passive entry, else the destination); with neither, the addresses `hints` carries (what
/// libfabric's verbs provider passes for a peer it already knows). A source in `hints` is
/// taken where resolution gave none.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard(-1, || {
        if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: per the API, NULL or the program's hints.
        let h = unsafe { hints.as_ref() }.copied().unwrap_or_default();
        let passive = h.ai_flags & RAI_PASSIVE != 0;
        // SAFETY: a fresh allocation, freed in rdma_freeaddrinfo.
        let ai = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }
            .cast::<rdma_addrinfo>();
        // SAFETY: calloc's zeroed entry, ours.
        let Some(a) = (unsafe { ai.as_mut() }) else {
            set_errno(libc::ENOMEM);
            return -1;
        };
        a.ai_flags = h.ai_flags;
        a.ai_family = h.ai_family;
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
        let fail = |ai: *mut rdma_addrinfo| {
            // SAFETY: the entry made above, with only our allocations in it.
            unsafe { rdma_freeaddrinfo(ai) };
            -1
        };
        if !node.is_null() || !service.is_null() {
            let Some((addr, len, family)) = system_address(node, service, &h) else {
                return fail(ai);
            };
            a.ai_family = family;
            if passive {
                (a.ai_src_addr, a.ai_src_len) = (addr, len);
            } else {
                (a.ai_dst_addr, a.ai_dst_len) = (addr, len);
            }
        } else if !h.ai_dst_addr.is_null() && h.ai_dst_len > 0 {
            // SAFETY: the hints' destination, `ai_dst_len` bytes.
            a.ai_dst_addr = unsafe { copy_addr(h.ai_dst_addr, h.ai_dst_len) };
            a.ai_dst_len = h.ai_dst_len;
            if a.ai_dst_addr.is_null() {
                set_errno(libc::ENOMEM);
                return fail(ai);
            }
            // SAFETY: a socket address starts with its family.
            a.ai_family = c_int::from(unsafe { (*h.ai_dst_addr).sa_family });
        }
        if a.ai_src_addr.is_null() && !h.ai_src_addr.is_null() && h.ai_src_len > 0 {
            // SAFETY: the hints' source, `ai_src_len` bytes.
            a.ai_src_addr = unsafe { copy_addr(h.ai_src_addr, h.ai_src_len) };
            a.ai_src_len = h.ai_src_len;
            if a.ai_src_addr.is_null() {
                set_errno(libc::ENOMEM);
                return fail(ai);
            }
            if a.ai_family == 0 {
                // SAFETY: as above.
                a.ai_family = c_int::from(unsafe { (*h.ai_src_addr).sa_family });
            }
        }
        // SAFETY: the program's output.
        unsafe { *res = ai };
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
