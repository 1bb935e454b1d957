//! Operating-system pieces every layer uses and std does not offer: an eventfd (the doorbell
//! of an engine, the wake-up of a completion channel), `ppoll(2)` on a few descriptors, a
//! thread's timer slack, and the signal mask of ferroce's own threads. Each `unsafe` block says
//! why it is sound.

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
///
/// `ppoll(2)`, not `poll(2)`: its timeout is a `timespec` in nanoseconds, where poll's is in
/// milliseconds (rounded up, so that a 300 µs retransmission timeout or a 20 µs pacing gap
/// would sleep a whole millisecond). The wake-up still comes up to the thread's timer slack
/// late (50 µs by default; see [`set_timer_slack`]).
pub(crate) fn wait_readable(fds: &[RawFd], timeout: Option<Duration>) -> io::Result<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as _,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: the pollfd array is live and its length is passed; the timespec (or null, for
    // no timeout) is live for the call and only read; a null signal mask leaves the thread's
    // mask as it is.
    let n = unsafe {
        libc::ppoll(
            pfds.as_mut_ptr(),
            pfds.len() as libc::nfds_t,
            ts_ptr,
            std::ptr::null(),
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0)
}

/// Sets the calling thread's timer slack: how late the kernel may end its timed sleeps, to
/// batch wake-ups (`prctl(PR_SET_TIMERSLACK)`; 50 µs by default). Returns whether it agreed.
pub(crate) fn set_timer_slack(slack: Duration) -> bool {
    let ns = slack.as_nanos().clamp(1, libc::c_ulong::MAX as u128) as libc::c_ulong;
    // SAFETY: PR_SET_TIMERSLACK takes the slack in ns as its only argument, passes no
    // pointers, and changes only the calling thread.
    unsafe {
        libc::prctl(
            libc::PR_SET_TIMERSLACK,
            ns,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        ) == 0
    }
}

/// The set of asynchronous signals: every signal but the faults (SIGSEGV, SIGBUS, SIGFPE,
/// SIGILL, SIGTRAP, SIGSYS), which belong to the thread that caused them.
fn async_signals() -> libc::sigset_t {
    // SAFETY: a local sigset_t, initialized by sigfillset before any other use.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        for sig in [
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGFPE,
            libc::SIGILL,
            libc::SIGTRAP,
            libc::SIGSYS,
        ] {
            libc::sigdelset(&mut set, sig);
        }
        set
    }
}

/// Spawns one of ferroce's own threads with every asynchronous signal blocked from its first
/// instruction, so that a signal sent to the process reaches one of the application's threads,
/// whose handlers expect to run there (iperf3's SIGTERM handler `siglongjmp`s to its main loop,
/// which from an engine thread would leave that thread running the application). The mask is
/// set on the spawning thread around the spawn, which the new thread inherits, and restored.
pub fn spawn_without_signals<F, T>(
    builder: std::thread::Builder,
    f: F,
) -> io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let set = async_signals();
    // SAFETY: pthread_sigmask on the calling thread with a set we made, saving the old mask
    // into a local that is restored below.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) };
    let r = builder.spawn(f);
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sub_millisecond_timeout_is_not_rounded_up_to_a_millisecond() {
        assert!(set_timer_slack(Duration::from_micros(1)));
        let e = EventFd::new().unwrap();
        let mut best = Duration::MAX;
        // The best of a few: a busy machine may deschedule the thread after any one of them.
        for _ in 0..20 {
            let t0 = std::time::Instant::now();
            assert!(!wait_readable(&[e.fd()], Some(Duration::from_micros(200))).unwrap());
            best = best.min(t0.elapsed());
        }
        assert!(best >= Duration::from_micros(200), "{best:?}");
        assert!(
            best < Duration::from_micros(900),
            "{best:?}: rounded up to a millisecond?"
        );
        e.notify();
        assert!(wait_readable(&[e.fd()], None).unwrap());
        assert!(wait_readable(&[e.fd()], Some(Duration::ZERO)).unwrap());
    }

    #[test]
    fn ferroce_threads_block_asynchronous_signals_and_keep_faults() {
        let mask = || {
            // SAFETY: reads the calling thread's mask into a local set.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut set);
                (
                    libc::sigismember(&set, libc::SIGTERM),
                    libc::sigismember(&set, libc::SIGINT),
                    libc::sigismember(&set, libc::SIGSEGV),
                )
            }
        };
        let before = mask();
        let inside = super::spawn_without_signals(std::thread::Builder::new(), mask)
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(inside, (1, 1, 0));
        // The spawning thread's own mask is as it was.
        assert_eq!(mask(), before);
    }
}
