//! The few system calls the UDP provider needs that std does not offer: batched datagram I/O
//! (`recvmmsg`/`sendmmsg`), an eventfd doorbell and epoll. Each `unsafe` block says why it is
//! sound; nothing here keeps raw pointers beyond one call.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Largest datagram the provider receives: a 4096-byte payload with the largest header stack
/// and ICRC, rounded up.
pub(crate) const MAX_DATAGRAM: usize = 4096 + 128;
/// Datagrams read or written per system call.
pub(crate) const BATCH: usize = 32;

fn sockaddr_to_std(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large
            // enough for and aligned for (sockaddr_storage is the most aligned sockaddr).
            let sin =
                unsafe { &*(ss as *const libc::sockaddr_storage as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 =
                unsafe { &*(ss as *const libc::sockaddr_storage as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                0,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn std_to_sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid (unspecified) value.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: the storage is large and aligned enough for a sockaddr_in.
            let sin =
                unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr_in6)
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Buffers and message headers for `recvmmsg`, built once and reused by every call.
///
/// The headers point into the buffers, addresses and iovecs, all of which live in heap
/// allocations owned by this value that are never resized, so the pointers stay valid when the
/// value itself moves.
pub(crate) struct RecvBatch {
    bufs: Vec<[u8; MAX_DATAGRAM]>,
    addrs: Vec<libc::sockaddr_storage>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
    count: usize,
}

// SAFETY: the raw pointers inside `iovs` and `hdrs` point only into this value's own heap
// allocations (see the type's doc), so moving the value to another thread moves their only
// users with them; nothing else refers to those allocations.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    pub fn new() -> RecvBatch {
        let mut bufs = vec![[0u8; MAX_DATAGRAM]; BATCH];
        // SAFETY: plain old data; zero is a valid value.
        let mut addrs: Vec<libc::sockaddr_storage> = vec![unsafe { zeroed() }; BATCH];
        let mut iovs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        let hdrs = iovs
            .iter_mut()
            .zip(addrs.iter_mut())
            .map(|(iov, addr)| {
                // SAFETY: plain old data; zero is valid, the fields that matter are set.
                let mut h: libc::mmsghdr = unsafe { zeroed() };
                h.msg_hdr.msg_name = (addr as *mut libc::sockaddr_storage).cast();
                h.msg_hdr.msg_iov = iov;
                h.msg_hdr.msg_iovlen = 1;
                h
            })
            .collect();
        RecvBatch {
            bufs,
            addrs,
            iovs,
            hdrs,
            count: 0,
        }
    }

    /// Reads up to `BATCH` datagrams without blocking; returns how many arrived.
    pub fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        for h in &mut self.hdrs {
            // The kernel shrinks these to what it wrote; give the full room back each call.
            h.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_len = 0;
        }
        debug_assert_eq!(self.iovs.len(), BATCH);
        // SAFETY: every header points at a live iovec, buffer and address slot owned by `self`
        // (see the type's doc); the kernel writes at most the lengths given. A null timeout
        // with MSG_DONTWAIT makes the call non-blocking.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                self.hdrs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            self.count = 0;
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
                _ => Err(e),
            };
        }
        self.count = n as usize;
        Ok(self.count)
    }

    /// Datagram `i` of the last call: its bytes and sender.
    pub fn get(&self, i: usize) -> Option<(&[u8], SocketAddr)> {
        if i >= self.count {
            return None;
        }
        let from = sockaddr_to_std(&self.addrs[i])?;
        let len = (self.hdrs[i].msg_len as usize).min(MAX_DATAGRAM);
        Some((&self.bufs[i][..len], from))
    }
}

/// Sends `lens[i]` bytes of `bufs[i]`, for every i, to `dest` with as few `sendmmsg` calls as
/// possible; returns how many datagrams were sent.
pub(crate) fn send_batch(
    fd: RawFd,
    bufs: &[Vec<u8>],
    lens: &[usize],
    dest: &SocketAddr,
) -> io::Result<usize> {
    let (ss, sslen) = std_to_sockaddr(dest);
    let n = lens.len().min(bufs.len()).min(BATCH);
    let mut iovs = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; BATCH];
    // SAFETY: plain old data; zero is valid.
    let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { zeroed() };
    for i in 0..n {
        iovs[i] = libc::iovec {
            iov_base: bufs[i].as_ptr() as *mut libc::c_void,
            iov_len: lens[i].min(bufs[i].len()),
        };
        hdrs[i].msg_hdr.msg_name = &ss as *const libc::sockaddr_storage as *mut libc::c_void;
        hdrs[i].msg_hdr.msg_namelen = sslen;
        hdrs[i].msg_hdr.msg_iov = &mut iovs[i];
        hdrs[i].msg_hdr.msg_iovlen = 1;
    }
    let mut done = 0;
    while done < n {
        // SAFETY: the headers point at iovecs, payloads and one address, all alive until the
        // end of this function; the kernel only reads them.
        let r = unsafe {
            libc::sendmmsg(
                fd,
                hdrs[done..n].as_mut_ptr(),
                (n - done) as libc::c_uint,
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return if done > 0 { Ok(done) } else { Err(e) };
        }
        done += r as usize;
    }
    Ok(done)
}

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

    /// Adds one to the counter, waking any waiter.
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local; a full counter (EAGAIN) already wakes.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reads and clears the counter; returns it (0 if nothing was pending).
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
