//! Protection domains and memory regions: `ibv_alloc_pd`, `ibv_reg_mr` and its variants.
//!
//! A region registers the program's own memory with ferroce ([`ferroce::ProtectionDomain::
//! register_raw`]): keys and addresses are the program's virtual addresses, as with rxe. Such
//! memory is served by the owning process's ferroce engine, which runs on its own thread, so a
//! WRITE lands while the program only spins on the bytes (as `ib_write_lat` does).

use std::ptr::NonNull;

use ferroce_proto::Access;

use crate::abi::*;
use crate::device::Context;
use crate::{errno_of, guard, set_errno};

#[repr(C)]
pub(crate) struct Pd {
    pub c: ibv_pd,
    pub inner: ferroce::ProtectionDomain,
}

impl Pd {
    /// # Safety
    /// `pd` must be a PD this library returned and not yet deallocated.
    pub(crate) unsafe fn from_c<'a>(pd: *mut ibv_pd) -> Option<&'a Pd> {
        // SAFETY: `c` is the first field of the repr(C) `Pd`.
        unsafe { pd.cast::<Pd>().as_ref() }
    }
}

#[repr(C)]
struct Mr {
    c: ibv_mr,
    inner: ferroce::MemoryRegion,
}

/// `ibv_alloc_pd`.
#[no_mangle]
unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        match c.ctx.alloc_pd() {
            Ok(inner) => {
                let c = ibv_pd {
                    context: ctx,
                    handle: 0,
                };
                Box::into_raw(Box::new(Pd { c, inner })).cast()
            }
            Err(e) => {
                set_errno(errno_of(&e));
                std::ptr::null_mut()
            }
        }
    })
}

/// `ibv_dealloc_pd`.
#[no_mangle]
unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> libc::c_int {
    guard(libc::EFAULT, || {
        if pd.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: per the API, a PD from ibv_alloc_pd, deallocated once. Objects made from it
        // hold their own handles, so they stay sound.
        drop(unsafe { Box::from_raw(pd.cast::<Pd>()) });
        0
    })
}

/// `IBV_ACCESS_OPTIONAL_RANGE` of `<infiniband/verbs.h>` (a macro bindgen cannot see): the
/// ten bits from `IBV_ACCESS_OPTIONAL_FIRST`.
const IBV_ACCESS_OPTIONAL_RANGE: u32 =
    ((IBV_ACCESS_OPTIONAL_FIRST << 10) - 1) & !(IBV_ACCESS_OPTIONAL_FIRST - 1);

/// The access bits ferroce keeps; the optional-range bits (relaxed ordering and the like) may
/// be ignored by any provider; any other bit asks for what ferroce does not do.
fn access_of(bits: u32) -> Result<Access, i32> {
    const BASIC: u32 = IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC;
    let rest = bits & !BASIC & !IBV_ACCESS_OPTIONAL_RANGE;
    if rest != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    // IBTA: a region a peer may write must be locally writable too.
    if bits & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0
        && bits & IBV_ACCESS_LOCAL_WRITE == 0
    {
        return Err(libc::EINVAL);
    }
    Ok(Access::from_bits(bits & BASIC))
}

fn register(
    pd: *mut ibv_pd,
    addr: *mut libc::c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let Some(p) = (unsafe { Pd::from_c(pd) }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let access = match access_of(access) {
            Ok(a) => a,
            Err(e) => {
                set_errno(e);
                return std::ptr::null_mut();
            }
        };
        // ferroce names remote memory by the owner's virtual address.
        if iova != addr as u64 {
            set_errno(libc::EOPNOTSUPP);
            return std::ptr::null_mut();
        }
        let Some(ptr) = NonNull::new(addr.cast::<u8>()) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        // SAFETY: the verbs contract: the program keeps `addr..addr + length` valid until it
        // deregisters, and accesses it only as RDMA memory meanwhile (a peer may write it at
        // any time — exactly what register_raw asks).
        let inner = match unsafe { p.inner.register_raw(ptr, length, access) } {
            Ok(m) => m,
            Err(e) => {
                set_errno(errno_of(&e));
                return std::ptr::null_mut();
            }
        };
        let c = ibv_mr {
            context: p.c.context,
            pd,
            addr,
            length: length as u64,
            handle: 0,
            lkey: inner.lkey(),
            rkey: inner.rkey(),
        };
        Box::into_raw(Box::new(Mr { c, inner })).cast()
    })
}

/// `ibv_reg_mr` (the exported call; the header's macro picks it or `ibv_reg_mr_iova2`).
#[no_mangle]
unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut libc::c_void,
    length: usize,
    access: libc::c_int,
) -> *mut ibv_mr {
    register(pd, addr, length, addr as u64, access as u32)
}

/// `ibv_reg_mr_iova`.
#[no_mangle]
unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut libc::c_void,
    length: usize,
    iova: u64,
    access: libc::c_int,
) -> *mut ibv_mr {
    register(pd, addr, length, iova, access as u32)
}

/// `ibv_reg_mr_iova2`.
#[no_mangle]
unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut libc::c_void,
    length: usize,
    iova: u64,
    access: libc::c_uint,
) -> *mut ibv_mr {
    register(pd, addr, length, iova, access)
}

/// `ibv_dereg_mr`: once it returns, no access to the memory is under way or will start.
#[no_mangle]
unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> libc::c_int {
    guard(libc::EFAULT, || {
        if mr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: per the API, a region from ibv_reg_mr, deregistered once.
        drop(unsafe { Box::from_raw(mr.cast::<Mr>()) });
        0
    })
}

/// `ibv_rereg_mr`: a ferroce region keeps its pages, rights and domain for life; the old region
/// stays valid (`IBV_REREG_MR_ERR_INPUT`, errno EOPNOTSUPP), as rdma-core reports a provider
/// without the call.
#[no_mangle]
unsafe extern "C" fn ibv_rereg_mr(
    _mr: *mut ibv_mr,
    _flags: libc::c_int,
    _pd: *mut ibv_pd,
    _addr: *mut libc::c_void,
    _length: usize,
    _access: libc::c_int,
) -> libc::c_int {
    set_errno(libc::EOPNOTSUPP);
    IBV_REREG_MR_ERR_INPUT
}
