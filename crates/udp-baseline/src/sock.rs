//! Thin, checked wrappers over the socket calls the tests need beyond `std::net::UdpSocket`:
//! `setsockopt`/`getsockopt`, `recv(MSG_DONTWAIT)`, `sendmmsg` and `recvmmsg`.
//!
//! Sockets are created, bound and connected with `std` (no `unsafe` needed for that); the raw
//! descriptor is only borrowed for the duration of each libc call, while the `UdpSocket` that
//! owns it is borrowed too, so it cannot be closed underneath the call.

use std::io;
use std::mem;
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::AsRawFd;
use std::ptr;

/// Datagrams per `sendmmsg`/`recvmmsg` call.
pub const BATCH: usize = 32;

/// The `setsockopt` level for UDP options (`SOL_UDP`, i.e. `IPPROTO_UDP`).
const SOL_UDP: libc::c_int = 17;

/// The UDP option that turns on generic segmentation offload with a given segment size
/// (Linux ≥ 4.18; `UDP_SEGMENT` in `<linux/udp.h>`).
const UDP_SEGMENT: libc::c_int = 103;

/// Two UDP sockets bound to ephemeral ports on 127.0.0.1 and connected to each other, so each
/// accepts datagrams only from the other.
pub fn loopback_pair() -> io::Result<(UdpSocket, UdpSocket)> {
    let a = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
    let b = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
    a.connect(b.local_addr()?)?;
    b.connect(a.local_addr()?)?;
    Ok((a, b))
}

/// Sets the integer socket option `level`/`name` to `value`.
fn set_int_opt(
    sock: &UdpSocket,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the descriptor belongs to `sock`, which is borrowed for the whole call, so it is
    // open. The option value points to `value`, a live `c_int` on this stack frame, and the length
    // passed is exactly its size; setsockopt only reads that many bytes from it.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            name,
            ptr::addr_of!(value).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads the integer socket option `level`/`name`.
fn get_int_opt(sock: &UdpSocket, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the descriptor belongs to `sock`, borrowed for the call. `value` and `len` are live
    // locals; `len` holds the size of `value`, so getsockopt writes at most that many bytes into
    // `value` and updates `len`, both of which we own exclusively here.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            level,
            name,
            ptr::addr_of_mut!(value).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Asks for a socket buffer of `bytes`: first with `force_name` (beyond `net.core.*mem_max`,
/// needs `CAP_NET_ADMIN`), falling back to `name`. Returns the size the kernel reports afterwards
/// (Linux reports twice the request, the doubling covering its bookkeeping overhead).
fn grow_buffer(
    sock: &UdpSocket,
    force_name: libc::c_int,
    name: libc::c_int,
    bytes: usize,
) -> io::Result<usize> {
    let want = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    if set_int_opt(sock, libc::SOL_SOCKET, force_name, want).is_err() {
        set_int_opt(sock, libc::SOL_SOCKET, name, want)?;
    }
    let got = get_int_opt(sock, libc::SOL_SOCKET, name)?;
    Ok(usize::try_from(got).unwrap_or(0))
}

/// Grows the receive buffer to `bytes` (`SO_RCVBUFFORCE`, else `SO_RCVBUF`); returns the
/// resulting `SO_RCVBUF`.
pub fn grow_rcvbuf(sock: &UdpSocket, bytes: usize) -> io::Result<usize> {
    grow_buffer(sock, libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, bytes)
}

/// Grows the send buffer to `bytes` (`SO_SNDBUFFORCE`, else `SO_SNDBUF`); returns the resulting
/// `SO_SNDBUF`.
pub fn grow_sndbuf(sock: &UdpSocket, bytes: usize) -> io::Result<usize> {
    grow_buffer(sock, libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, bytes)
}

/// Sets (or, with 0, clears) the UDP GSO segment size of `sock`: afterwards each `send` of more
/// than `segment` bytes leaves as consecutive datagrams of `segment` bytes (the last may be
/// shorter).
pub fn set_gso_segment(sock: &UdpSocket, segment: usize) -> io::Result<()> {
    let seg = libc::c_int::try_from(segment)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "GSO segment too large"))?;
    set_int_opt(sock, SOL_UDP, UDP_SEGMENT, seg)
}

/// Receives one datagram into `buf` without blocking (`MSG_DONTWAIT`).
///
/// Returns `Ok(None)` when nothing is waiting (`EAGAIN`) or the call was interrupted, so a caller
/// can simply poll again; otherwise the datagram's length (truncated to `buf.len()`).
pub fn recv_dontwait(sock: &UdpSocket, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: the descriptor belongs to `sock`, borrowed for the call. `buf` is an exclusively
    // borrowed, initialised, writable region of exactly `buf.len()` bytes, and recv writes at most
    // that many bytes into it.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    match usize::try_from(n) {
        Ok(n) => Ok(Some(n)),
        Err(_) => {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(e),
            }
        }
    }
}

/// Sends up to [`BATCH`] datagrams with one `sendmmsg` call on the connected socket `sock`:
/// datagram `i` is the first `lens[i]` bytes of `payload` (clamped to its length).
///
/// Returns how many datagrams the kernel took, which may be fewer than asked.
pub fn send_batch(sock: &UdpSocket, payload: &[u8], lens: &[usize]) -> io::Result<usize> {
    let count = lens.len().min(BATCH);
    // SAFETY: `iovec` is a plain C struct of a pointer and a length; all-zero bits (null pointer,
    // zero length) are a valid value of it.
    let mut iov: [libc::iovec; BATCH] = unsafe { mem::zeroed() };
    for (v, &len) in iov.iter_mut().zip(&lens[..count]) {
        // sendmmsg only reads through iov_base; the `*mut` is what the C struct's type demands.
        v.iov_base = payload.as_ptr().cast_mut().cast();
        v.iov_len = len.min(payload.len());
    }
    // SAFETY: `mmsghdr` is a plain C struct of pointers and integers (plus padding); all-zero bits
    // are a valid value: no address, no control data, no iovecs, zero lengths and flags.
    let mut msgs: [libc::mmsghdr; BATCH] = unsafe { mem::zeroed() };
    let base = iov.as_mut_ptr();
    for (i, m) in msgs.iter_mut().enumerate().take(count) {
        m.msg_hdr.msg_iov = base.wrapping_add(i);
        m.msg_hdr.msg_iovlen = 1;
    }
    // SAFETY: the descriptor belongs to `sock`, borrowed for the call. `msgs[..count]` are
    // initialised headers, each with a null address (the socket is connected) and one iovec
    // pointing into `iov`, which lives on this frame until after the call. Every iovec describes
    // a prefix of `payload` (length clamped above), a live shared borrow; the kernel only reads
    // the payload and writes only the `msg_len` fields of `msgs`, which we own exclusively.
    // `count` ≤ BATCH fits in c_uint.
    let n = unsafe {
        libc::sendmmsg(
            sock.as_raw_fd(),
            msgs.as_mut_ptr(),
            count as libc::c_uint,
            0,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Receive buffers for [`BATCH`] datagrams of up to `size` bytes, filled by `recvmmsg`.
pub struct RecvBatch {
    /// `BATCH` consecutive slots of `size` bytes.
    buf: Vec<u8>,
    /// Bytes per slot: the largest datagram expected.
    size: usize,
}

/// What one successful [`RecvBatch::recv`] call delivered.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    /// Datagrams received.
    pub datagrams: usize,
    /// Payload bytes received, summed over those datagrams.
    pub bytes: u64,
}

impl RecvBatch {
    /// Buffers for datagrams of up to `size` bytes (at least 1).
    pub fn new(size: usize) -> RecvBatch {
        let size = size.max(1);
        RecvBatch {
            buf: vec![0; size * BATCH],
            size,
        }
    }

    /// Receives between 1 and [`BATCH`] datagrams with one `recvmmsg(MSG_WAITFORONE)` call:
    /// waits (within the socket's `SO_RCVTIMEO`) for the first one, then takes whatever else is
    /// already queued.
    ///
    /// Returns `Ok(None)` if the receive timeout expired with nothing received or the call was
    /// interrupted.
    pub fn recv(&mut self, sock: &UdpSocket) -> io::Result<Option<Received>> {
        // SAFETY: as in `send_batch`, all-zero bits are a valid `iovec`.
        let mut iov: [libc::iovec; BATCH] = unsafe { mem::zeroed() };
        for (v, slot) in iov.iter_mut().zip(self.buf.chunks_exact_mut(self.size)) {
            v.iov_base = slot.as_mut_ptr().cast();
            v.iov_len = slot.len();
        }
        // SAFETY: as in `send_batch`, all-zero bits are a valid `mmsghdr`.
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { mem::zeroed() };
        let base = iov.as_mut_ptr();
        for (i, m) in msgs.iter_mut().enumerate() {
            m.msg_hdr.msg_iov = base.wrapping_add(i);
            m.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: the descriptor belongs to `sock`, borrowed for the call. Each of the BATCH
        // headers has no address or control buffer and one iovec in `iov` (alive on this frame
        // until after the call) describing a distinct `size`-byte slot of `self.buf`, which we
        // borrow exclusively through `&mut self` and do not touch during the call; `buf` holds
        // exactly BATCH slots, so every iovec is in bounds. The kernel writes at most `iov_len`
        // bytes into each slot and fills in `msg_len`/`msg_flags` of `msgs`, owned here. A null
        // timeout pointer is allowed. BATCH fits in c_uint.
        let n = unsafe {
            libc::recvmmsg(
                sock.as_raw_fd(),
                msgs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_WAITFORONE,
                ptr::null_mut(),
            )
        };
        match usize::try_from(n) {
            Ok(datagrams) => {
                let datagrams = datagrams.min(BATCH);
                let bytes = msgs[..datagrams].iter().map(|m| u64::from(m.msg_len)).sum();
                Ok(Some(Received { datagrams, bytes }))
            }
            Err(_) => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                    _ => Err(e),
                }
            }
        }
    }
}

/// Tests of the socket wrappers over real loopback sockets.
#[cfg(test)]
mod tests {
    use super::*;

    /// `send_batch` datagrams arrive whole through `RecvBatch`; an empty socket does not block.
    #[test]
    fn batch_round_trip() {
        let (a, b) = loopback_pair().unwrap();
        let payload = [7u8; 100];
        assert_eq!(send_batch(&a, &payload, &[100, 50, 1]).unwrap(), 3);
        let mut rb = RecvBatch::new(100);
        let mut got = (0, 0);
        while got.0 < 3 {
            if let Some(r) = rb.recv(&b).unwrap() {
                got = (got.0 + r.datagrams, got.1 + r.bytes);
            }
        }
        assert_eq!(got, (3, 151));
        let mut buf = [0u8; 8];
        assert_eq!(recv_dontwait(&b, &mut buf).unwrap(), None);
    }

    /// Growing the buffers succeeds with or without privileges.
    #[test]
    fn buffers_grow() {
        let (a, _b) = loopback_pair().unwrap();
        // Whatever the limits, the kernel reports a positive size.
        assert!(grow_rcvbuf(&a, 1 << 20).unwrap() > 0);
        assert!(grow_sndbuf(&a, 1 << 20).unwrap() > 0);
    }
}
