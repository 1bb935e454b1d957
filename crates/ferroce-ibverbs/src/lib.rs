//! A drop-in `libibverbs.so.1` over ferroce.
//!
//! Every RDMA program is written against rdma-core's libibverbs C API. This crate implements that
//! API over ferroce's verbs, so an unmodified binary (`ibv_devinfo`, `ibv_rc_pingpong`,
//! perftest, …) runs on any Linux machine with no RDMA NIC and no kernel module:
//!
//! ```text
//! scripts/build-libibverbs.sh            # → target/ibverbs/libibverbs.so.1
//! LD_LIBRARY_PATH=$PWD/target/ibverbs ibv_devinfo
//! ```
//!
//! # How it is put together
//! - [`abi`] holds rdma-core's structures, generated from the installed headers; the layout
//!   test compiles a C program against those headers and compares every offset that matters.
//! - Each object the library hands out (`ibv_context`, `ibv_pd`, `ibv_mr`, `ibv_cq`, `ibv_qp`,
//!   …) is the first field of a `#[repr(C)]` box that also holds the ferroce handle behind it,
//!   so a pointer the program passes back is turned into the box by a cast.
//! - `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq` and
//!   `ibv_post_srq_recv` are `static inline` in `<infiniband/verbs.h>`: they call through the
//!   context's `ops` table, which `device` fills.
//! - The contexts are opened with [`ferroce::ContextOptions::host_slot`]: programs exchange
//!   only a GID and a QPN and expect the peer at port 4791, so several processes on one host
//!   take ports 4791, 4792, … and a QPN names its port.
//! - The library exports every default symbol of rdma-core 44's libibverbs in its own version
//!   node (`abi/libibverbs.symbols`), as the tools are linked with `BIND_NOW` and pull in
//!   rdma-core's provider libraries, which need the private `IBVERBS_PRIVATE_34` calls. What
//!   ferroce does not do fails with the errno rdma-core gives an unsupported feature
//!   (`unsupported`); the private provider hooks are no-ops, so a foreign provider never
//!   finds a device of its own.
//! - A panic never crosses into C: every entry point runs under `guard`, which turns one into
//!   an error return.
//! - Memory a program registers (`ibv_reg_mr` over its own `malloc`ed buffers) is adopted
//!   ([`ferroce::ContextOptions::adopt_registered_pages`]): its whole pages move onto a memfd in
//!   place, so a same-host peer WRITEs, READs and applies atomics to it directly, as a NIC
//!   would by DMA — `ib_write_lat` spins on such memory.
//! - RC and UD QPs; UD sends name an address handle (`ibv_create_ah`), and receives start with
//!   the 40-byte GRH, as on RoCE hardware. UCP (and so Open MPI over UCX) connects its RC
//!   endpoints over UD.
//!
//! [`symbols`] lists every exported symbol and what ferroce does with it.

/// Every exported symbol of the two libraries, its version node, and whether ferroce
/// implements it (generated from the sources by `scripts/gen-ibverbs-symbol-table.py`; a test
/// checks it is current).
#[doc = include_str!("../SYMBOLS.md")]
pub mod symbols {}

// The shapes of the entry points ferroce does not implement (`unsupported`, and rdma_cm's).
/// Calls returning an `int` errno (also left in `errno`, where some callers look).
macro_rules! returns_errno {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported (EOPNOTSUPP).")]
        #[no_mangle]
        extern "C" fn $name() -> libc::c_int {
            $crate::set_errno(libc::EOPNOTSUPP);
            libc::EOPNOTSUPP
        }
    )*};
}

/// Calls returning a pointer: NULL with `errno` EOPNOTSUPP.
macro_rules! returns_null {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported (NULL, errno EOPNOTSUPP).")]
        #[no_mangle]
        extern "C" fn $name() -> *mut libc::c_void {
            $crate::set_errno(libc::EOPNOTSUPP);
            std::ptr::null_mut()
        }
    )*};
}

/// Calls returning -1 with `errno` EOPNOTSUPP.
macro_rules! returns_minus_one {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported (-1, errno EOPNOTSUPP).")]
        #[no_mangle]
        extern "C" fn $name() -> libc::c_int {
            $crate::set_errno(libc::EOPNOTSUPP);
            -1
        }
    )*};
}

/// Calls with nothing to return whose work never arises here: provider registration (no
/// foreign provider may claim a ferroce device), logging of a provider that never runs,
/// releasing imports that never succeeded, and the conversions of kernel structures, which only
/// a program holding data from the kernel's uverbs device could call.
macro_rules! does_nothing {
    ($($name:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: nothing to do here (see the macro).")]
        #[no_mangle]
        extern "C" fn $name() {}
    )*};
}

pub mod abi;
mod cq;
mod device;
mod gsi;
mod mr;
mod qp;
mod rdmacm;
/// For the fuzz targets in `fuzz/` only (the `fuzzing` feature, off by default): the rdma_cm
/// messages peers exchange over TCP. Not an API: nothing here is stable.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::rdmacm::{Ece, Message};
}
mod strings;
mod ud;
mod unsupported;

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: i32) {
    // SAFETY: __errno_location returns the calling thread's errno slot, always valid.
    unsafe { *libc::__errno_location() = e };
}

/// The errno rdma-core's providers return for what `e` describes.
pub(crate) fn errno_of(e: &ferroce::Error) -> i32 {
    use ferroce::Error as E;
    use ferroce_proto::attr::PostError as P;
    match e {
        E::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        E::NoDevice(_) => libc::ENODEV,
        E::TooManyRegions => libc::ENOMEM,
        E::CqOverflow(_) => libc::EOVERFLOW,
        E::Post(P::QueueFull(_)) => libc::ENOMEM,
        _ => libc::EINVAL,
    }
}

/// The body of an `ibv_destroy_*`: frees the box `ptr` points into (its C object is the box's
/// first field); EINVAL for NULL.
///
/// # Safety
/// `ptr` is NULL or the C object of a box of `T` this library handed out, freed once.
pub(crate) unsafe fn destroy_boxed<T, C>(ptr: *mut C) -> libc::c_int {
    guard(libc::EFAULT, || {
        if ptr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: the caller's contract.
        drop(unsafe { Box::from_raw(ptr.cast::<T>()) });
        0
    })
}

/// An entry point's failure raised from deep inside it (with `std::panic::resume_unwind`,
/// which prints nothing): [`guard`] returns its `on_panic` value with this `errno`.
pub(crate) struct ErrnoUnwind(pub(crate) i32);

/// Runs an entry point's body, turning a panic into `on_panic` with `errno` EFAULT (or an
/// [`ErrnoUnwind`]'s errno): unwinding into C is undefined behaviour, and aborting the program
/// would be a crash.
pub(crate) fn guard<T>(on_panic: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            set_errno(
                payload
                    .downcast_ref::<ErrnoUnwind>()
                    .map_or(libc::EFAULT, |e| e.0),
            );
            on_panic
        }
    }
}

/// Copies `s` into a C string field, NUL-terminated and cut to fit.
pub(crate) fn copy_c_string(dst: &mut [libc::c_char], s: &str) {
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as libc::c_char;
    }
    if let Some(end) = dst.get_mut(n) {
        *end = 0;
    }
}
