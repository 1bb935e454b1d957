//! Operating-system pieces every layer uses and std does not offer: an eventfd (the doorbell
//! of an engine, the wake-up of a completion channel) and `poll(2)` on a few descriptors. Each
//! `unsafe` block says why it is sound.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// An eventfd: a counter another thread can bump to wake a sleeper.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// A blocking eventfd in semaphore mode: each read takes one of the notifications, and the
    /// descriptor stays readable while any is left — the shape of a kernel completion channel,
    /// which a program may poll, make non-blocking or read one event at a time.
    pub fn new_semaphore() -> io::Result<EventFd> {
        // SAFETY: as in `new`.
        let fd = unsafe { libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as in `new`.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Takes one notification of a semaphore eventfd if one is there now, without blocking
    /// (the descriptor itself may be blocking: it is read only after `poll` said readable).
    pub fn take_one(&self) -> io::Result<bool> {
        if !wait_readable(&[self.fd()], Some(Duration::ZERO))? {
            return Ok(false);
        }
        Ok(self.drain() > 0)
    }

    /// Adds one to the counter, waking any waiter.
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local; a full counter (EAGAIN) already wakes.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reads and clears the counter (takes one notification in semaphore mode); returns it (0 if
    /// nothing was pending and the descriptor is non-blocking).
    pub fn drain(&self) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live local; non-blocking.
        let n = unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n == 8 {
            v
        } else {
            0
        }
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Waits until one of `fds` is readable or `timeout` passes (`None`: forever). Returns whether
/// any became readable.
pub(crate) fn wait_readable(fds: &[RawFd], timeout: Option<Duration>) -> io::Result<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms: libc::c_int = match timeout {
        None => -1,
        Some(d) => {
            d.as_millis().clamp(0, i32::MAX as u128) as libc::c_int
                + i32::from(d.subsec_nanos() % 1_000_000 != 0)
        }
    };
    // SAFETY: the pollfd array is live and its length is passed.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0)
}
