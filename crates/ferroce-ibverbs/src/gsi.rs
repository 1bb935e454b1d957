//! QP1 of a context, for the drop-in `librdmacm.so.1`'s connection manager.
//!
//! The kernel's rdma_cm connects QPs with IB CM MADs through QP1; ferroce's librdmacm does the
//! same ([`ferroce::cm::ib`]), and needs QP1 of the very context its ids' QPs live in, which is
//! inside this library. No rdma-core call makes QP1 (the kernel owns it), so this library
//! exports four calls of its own, in the version node `FERROCE_PRIVATE_1`, which librdmacm
//! finds with `dlsym`:
//!
//! - `void *ferroce_gsi_open(struct ibv_context *)`: QP1 of the context, its receives posted
//!   (NULL with `errno` when the context has one already or is not ours);
//! - `int ferroce_gsi_send(void *, const uint8_t gid[16], const uint8_t mad[256])`;
//! - `int ferroce_gsi_recv(void *, int timeout_ms, uint8_t gid[16], uint8_t mad[256])`: 1 with
//!   a MAD and the GID it came from, 0 after the timeout, -1 on an error;
//! - `void ferroce_gsi_close(void *)`.

use std::ffi::{c_int, c_void};
use std::time::Duration;

use ferroce::cm::ib::{GsiPort, MadPort};
use ferroce_wire::mad::MAD_LEN;

use crate::abi::ibv_context;
use crate::device::Context;
use crate::{guard, set_errno};

/// `ferroce_gsi_open`.
///
/// # Safety
/// `ctx` must be a context this library returned and not yet closed; it must outlive the port.
#[no_mangle]
unsafe extern "C" fn ferroce_gsi_open(ctx: *mut ibv_context) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller's contract.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        match GsiPort::open(&c.ctx) {
            Ok(port) => Box::into_raw(Box::new(port)).cast(),
            Err(_) => {
                set_errno(libc::EBUSY);
                std::ptr::null_mut()
            }
        }
    })
}

/// `ferroce_gsi_send`.
///
/// # Safety
/// `port` from `ferroce_gsi_open`, not closed; `gid` 16 bytes and `mad` 256 bytes, readable.
#[no_mangle]
unsafe extern "C" fn ferroce_gsi_send(port: *mut c_void, gid: *const u8, mad: *const u8) -> c_int {
    guard(-1, || {
        if port.is_null() || gid.is_null() || mad.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the caller's contract.
        let (p, g, m) = unsafe {
            (
                &*port.cast::<GsiPort>(),
                *gid.cast::<[u8; 16]>(),
                &*mad.cast::<[u8; MAD_LEN]>(),
            )
        };
        match p.send(g, m) {
            Ok(()) => 0,
            Err(_) => {
                set_errno(libc::EIO);
                -1
            }
        }
    })
}

/// `ferroce_gsi_recv`.
///
/// # Safety
/// `port` from `ferroce_gsi_open`, not closed; `gid` 16 and `mad` 256 writable bytes.
#[no_mangle]
unsafe extern "C" fn ferroce_gsi_recv(
    port: *mut c_void,
    timeout_ms: c_int,
    gid: *mut u8,
    mad: *mut u8,
) -> c_int {
    guard(-1, || {
        if port.is_null() || gid.is_null() || mad.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the caller's contract.
        let p = unsafe { &*port.cast::<GsiPort>() };
        let wait = Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0));
        match p.recv(wait) {
            Ok(Some((from, bytes))) => {
                let n = bytes.len().min(MAD_LEN);
                // SAFETY: the caller's contract: 16 and 256 writable bytes.
                unsafe {
                    gid.copy_from_nonoverlapping(from.as_ptr(), 16);
                    mad.write_bytes(0, MAD_LEN);
                    mad.copy_from_nonoverlapping(bytes.as_ptr(), n);
                }
                1
            }
            Ok(None) => 0,
            Err(_) => {
                set_errno(libc::EIO);
                -1
            }
        }
    })
}

/// `ferroce_gsi_close`.
///
/// # Safety
/// `port` from `ferroce_gsi_open`, closed once, with no call on it running.
#[no_mangle]
unsafe extern "C" fn ferroce_gsi_close(port: *mut c_void) {
    guard((), || {
        if !port.is_null() {
            // SAFETY: the caller's contract.
            drop(unsafe { Box::from_raw(port.cast::<GsiPort>()) });
        }
    })
}
