//! Direct writes: `riomap` makes a buffer of this side writable by the peer (announced in the
//! peer's iomap table), `riowrite` writes into a buffer the peer mapped, `riounmap` ends a
//! mapping.

use super::stream::{IomapMr, OLAP_START_SIZE};
use super::*;

/// Announces the mappings not yet sent (waiting for room to send unless non-blocking).
pub(super) fn send_pending<'a>(
    sock: &'a RSocket,
    mut g: Held<'a>,
    flags: c_int,
) -> (Held<'a>, Result<(), c_int>) {
    while let Some(i) = g.iomaps.iter().position(|m| m.index.is_some() && !m.sent) {
        let (ng, r) = wait_writable(sock, g, flags);
        g = ng;
        if let Err(e) = r {
            return (g, Err(e));
        }
        if let Err(e) = g.send_iomap(i) {
            return (g, Err(e));
        }
    }
    (g, Ok(()))
}

/// `riomap`: registers `len` bytes at `buf` for the peer's direct writes (`PROT_WRITE`, given a
/// free slot in the peer's iomap table) or for this side only (`PROT_NONE`); returns the
/// offset the peer writes at (`offset`, or `buf`'s address for -1).
#[no_mangle]
pub(super) unsafe extern "C" fn riomap(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    _flags: c_int,
    offset: libc::off_t,
) -> libc::off_t {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let Some(v) = verbs() else {
            return fail(libc::ENODEV);
        };
        let mut g = sock.lock();
        // SAFETY: our live id.
        let pd = unsafe { (*g.cm_id).pd };
        if pd.is_null() || prot & !(libc::PROT_WRITE | libc::PROT_NONE) != 0 || buf.is_null() {
            return fail(libc::EINVAL);
        }
        let writable = prot & libc::PROT_WRITE != 0;
        let index = if writable {
            let slots = g.remote_iomap.length as usize;
            let Some(i) = (0..slots).find(|i| !g.iomaps.iter().any(|m| m.index == Some(*i))) else {
                return fail(libc::ENOMEM);
            };
            Some(i)
        } else {
            None
        };
        let access = IBV_ACCESS_LOCAL_WRITE | if writable { IBV_ACCESS_REMOTE_WRITE } else { 0 };
        // SAFETY: the program's buffer of `len` bytes, registered on the socket's PD.
        let mr = unsafe { (v.reg_mr)(pd, buf, len, access as c_int) };
        if mr.is_null() {
            return -1;
        }
        let offset = if offset == -1 {
            buf as libc::off_t
        } else {
            offset
        };
        g.iomaps.push(IomapMr {
            offset: offset as u64,
            mr,
            index,
            sent: false,
        });
        offset
    })
}

/// `riounmap`: ends the mapping of exactly `buf`/`len`.
#[no_mangle]
pub(super) unsafe extern "C" fn riounmap(socket: c_int, buf: *mut c_void, len: usize) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let Some(v) = verbs() else {
            return fail(libc::ENODEV);
        };
        let mut g = sock.lock();
        // SAFETY: each mapping's MR is live.
        let found = g
            .iomaps
            .iter()
            .position(|m| unsafe { (*m.mr).addr == buf && (*m.mr).length as usize == len });
        let Some(i) = found else {
            return fail(libc::EINVAL);
        };
        let m = g.iomaps.remove(i);
        // SAFETY: its MR, deregistered once.
        unsafe { (v.dereg_mr)(m.mr) };
        0
    })
}

/// `riowrite`: writes `count` bytes at `offset` of what the peer mapped; returns the bytes
/// written (fewer where no mapping covers the rest), or -1 when none.
#[no_mangle]
pub(super) unsafe extern "C" fn riowrite(
    socket: c_int,
    buf: *const c_void,
    count: usize,
    offset: libc::off_t,
    flags: c_int,
) -> usize {
    guard(usize::MAX, || {
        let Some(sock) = lookup(socket) else {
            set_errno(libc::EBADF);
            return usize::MAX;
        };
        if buf.is_null() && count > 0 {
            set_errno(libc::EFAULT);
            return usize::MAX;
        }
        // SAFETY: the program's `count` bytes.
        let data = unsafe { slice_or_empty(buf.cast(), count) };
        let g = sock.lock();
        let (mut g, r) = send_pending(&sock, g, flags);
        if let Err(e) = r {
            set_errno(e);
            return usize::MAX;
        }
        let mut done = 0usize;
        let mut olen = OLAP_START_SIZE;
        let mut err = 0;
        let mut at = offset as u64;
        while done < count {
            let slots = usize::from(g.target_iomap_size);
            let Some((base, sge)) = (0..slots).map(|i| g.target_iomap(i)).find(|(o, s)| {
                at >= *o && at < o.saturating_add(u64::from(s.length)) && s.length > 0
            }) else {
                break;
            };
            let (ng, r) = wait_writable(&sock, g, flags);
            g = ng;
            if let Err(e) = r {
                err = e;
                break;
            }
            let room = base
                .saturating_add(u64::from(sge.length))
                .saturating_sub(at)
                .min(count as u64) as usize;
            let end = (done + room).min(count);
            let addr = sge.addr.wrapping_add(at - base);
            match g.write_direct(&data[done..end], addr, sge.key, &mut olen) {
                Ok(n) => {
                    done += n;
                    at += n as u64;
                }
                Err(e) => {
                    err = e;
                    break;
                }
            }
        }
        if err != 0 && done == 0 {
            set_errno(err);
            return usize::MAX;
        }
        done
    })
}
