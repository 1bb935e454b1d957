//! `rpoll` and `rselect`: rsockets and ordinary descriptors in one wait.
//!
//! Each round looks at every entry without waiting (an rsocket's completions are processed, so
//! credits and control messages move even when nothing the caller asked for came); if nothing
//! is ready, every rsocket's CQ is armed and one `poll` waits on the descriptors their events
//! arrive on (the CQ's channel once connected, the id's channel while listening or
//! connecting) beside the caller's own; then the round repeats.

use std::time::{Duration, Instant};

use super::stream::*;
use super::*;

/// The events of `want` an rsocket has now (completions processed, never waiting); a pending
/// completion event is taken first unless `armed_for_wait` (then it must stay for `poll` to
/// see: taking it would disarm the CQ the wait relies on).
fn rsocket_events(sock: &RSocket, want: i16, armed_for_wait: bool) -> i16 {
    let mut g = sock.lock();
    if g.cm_id.is_null() {
        return libc::POLLNVAL;
    }
    if !armed_for_wait {
        g.take_cq_event();
    }
    if g.state & ST_OPENING != 0 {
        if let Err(libc::EINPROGRESS) = do_connect(&mut g) {
            return 0;
        }
    }
    if g.state & (ST_CONNECTED | ST_ERROR) != 0 || g.state == ST_DISCONNECTED {
        g.update_credits();
        let _ = g.poll_cq();
        g.take_cm_event();
        g.update_credits();
        let mut r = 0;
        if want & libc::POLLIN != 0 && (g.have_rdata() || g.state & ST_READABLE == 0) {
            r |= libc::POLLIN;
        }
        if want & libc::POLLOUT != 0 && g.can_send() {
            r |= libc::POLLOUT;
        }
        // A hang-up is reported once the data that came before it has been read (librdmacm
        // reports it at once, beside POLLIN: a program that takes POLLHUP for an error, as
        // rstream's asynchronous mode does, then loses the peer's last message whenever the
        // peer's disconnect arrives before it looks).
        if g.state & ST_CONNECTED == 0 {
            if g.state != ST_DISCONNECTED {
                r |= libc::POLLERR;
            } else if !g.have_rdata() {
                r |= libc::POLLHUP;
            }
        }
        return r;
    }
    if g.state == ST_LISTENING {
        let mut p = libc::pollfd {
            fd: g.wait_fd(),
            events: want,
            revents: 0,
        };
        // SAFETY: one pollfd, not waiting.
        unsafe { libc::poll(&mut p, 1, 0) };
        return p.revents;
    }
    if g.state == ST_CONNECT_ERROR {
        return (want & (libc::POLLIN | libc::POLLOUT)) | libc::POLLERR;
    }
    0
}

/// Arms an rsocket for the wait; the descriptors to wait on (the second, the id's channel
/// while connected, where the peer's DREQ comes; else -1), or `None` if it became ready.
fn arm_rsocket(sock: &RSocket, want: i16) -> Option<[c_int; 2]> {
    {
        let mut g = sock.lock();
        if !g.channel.is_null() && g.state & ST_CONNECTED != 0 && !g.cq_armed {
            g.arm();
        }
    }
    if rsocket_events(sock, want, true) != 0 {
        return None;
    }
    let g = sock.lock();
    let fd = g.wait_fd();
    let id_fd = if g.state & ST_CONNECTED != 0 && fd != g.id_fd() {
        g.id_fd()
    } else {
        -1
    };
    Some([fd, id_fd])
}

/// `rpoll`.
#[no_mangle]
pub(super) unsafe extern "C" fn rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
) -> c_int {
    guard(-1, || {
        if fds.is_null() && nfds > 0 {
            return fail(libc::EFAULT);
        }
        // SAFETY: the program's `nfds` entries.
        let fds = unsafe { slice_mut_or_empty_pollfd(fds, nfds as usize) };
        let deadline =
            (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
        loop {
            let mut ready = 0;
            for f in fds.iter_mut() {
                f.revents = match lookup(f.fd) {
                    Some(sock) => rsocket_events(&sock, f.events, false),
                    None => {
                        let mut p = *f;
                        // SAFETY: one pollfd, not waiting.
                        unsafe { libc::poll(&mut p, 1, 0) };
                        p.revents
                    }
                };
                if f.revents != 0 {
                    ready += 1;
                }
            }
            if ready > 0 || timeout == 0 {
                return ready;
            }
            let mut waits = Vec::with_capacity(fds.len());
            let mut became_ready = false;
            for f in fds.iter() {
                match lookup(f.fd) {
                    Some(sock) => match arm_rsocket(&sock, f.events) {
                        Some(two) => waits.extend(two.map(|fd| libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        })),
                        None => {
                            became_ready = true;
                            break;
                        }
                    },
                    None => waits.push(libc::pollfd {
                        fd: f.fd,
                        events: f.events,
                        revents: 0,
                    }),
                }
            }
            if became_ready {
                continue;
            }
            let left = match deadline {
                None => -1,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return 0;
                    }
                    (d - now).as_millis().min(c_int::MAX as u128) as c_int
                }
            };
            // SAFETY: our own array of pollfds.
            let n = unsafe { libc::poll(waits.as_mut_ptr(), waits.len() as libc::nfds_t, left) };
            if n < 0 {
                return -1;
            }
            if n == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                for f in fds.iter_mut() {
                    f.revents = 0;
                }
                return 0;
            }
        }
    })
}

/// # Safety
/// `p` points to `n` pollfds nothing else uses, or `n` is 0.
unsafe fn slice_mut_or_empty_pollfd<'a>(p: *mut libc::pollfd, n: usize) -> &'a mut [libc::pollfd] {
    if n == 0 || p.is_null() {
        &mut []
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(p, n) }
    }
}

/// `rselect`: `rpoll` over the sets' descriptors.
#[no_mangle]
pub(super) unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    guard(-1, || {
        let nfds = nfds.clamp(0, libc::FD_SETSIZE as c_int);
        let mut fds = Vec::new();
        for fd in 0..nfds {
            let mut events = 0;
            // SAFETY: the program's sets (or NULL), FD_SETSIZE descriptors each.
            unsafe {
                if !readfds.is_null() && libc::FD_ISSET(fd, readfds) {
                    events |= libc::POLLIN;
                }
                if !writefds.is_null() && libc::FD_ISSET(fd, writefds) {
                    events |= libc::POLLOUT;
                }
                let except = !exceptfds.is_null() && libc::FD_ISSET(fd, exceptfds);
                if events != 0 || except {
                    fds.push(libc::pollfd {
                        fd,
                        events,
                        revents: 0,
                    });
                }
            }
        }
        // SAFETY: the program's timeout (or NULL: forever).
        let ms = match unsafe { timeout.as_ref() } {
            None => -1,
            Some(t) => (t.tv_sec * 1000 + t.tv_usec / 1000).clamp(0, c_int::MAX as i64) as c_int,
        };
        // SAFETY: our own array.
        let ret = unsafe { rpoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        // SAFETY: the program's sets.
        unsafe {
            for set in [readfds, writefds, exceptfds] {
                if !set.is_null() {
                    libc::FD_ZERO(set);
                }
            }
        }
        if ret <= 0 {
            return ret;
        }
        let mut count = 0;
        for f in &fds {
            // SAFETY: the program's sets; each descriptor below FD_SETSIZE.
            unsafe {
                if !readfds.is_null() && f.revents & (libc::POLLIN | libc::POLLHUP) != 0 {
                    libc::FD_SET(f.fd, readfds);
                    count += 1;
                }
                if !writefds.is_null() && f.revents & libc::POLLOUT != 0 {
                    libc::FD_SET(f.fd, writefds);
                    count += 1;
                }
                if !exceptfds.is_null() && f.revents & !(libc::POLLIN | libc::POLLOUT) != 0 {
                    libc::FD_SET(f.fd, exceptfds);
                    count += 1;
                }
            }
        }
        count
    })
}
