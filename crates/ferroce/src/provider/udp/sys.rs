//! The few system calls the UDP provider needs that std does not offer: batched datagram I/O
//! (`recvfrom`/`recvmsg`/`sendmmsg`), segmentation and receive offload (UDP GSO/GRO), and the
//! IP header's TOS byte of what arrives (for its ECN field). Each `unsafe` block says why it is
//! sound; nothing here keeps raw pointers beyond one call.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;

/// Largest datagram the provider sends: a 4096-byte payload with the largest header stack and
/// ICRC, rounded up.
pub(crate) const MAX_DATAGRAM: usize = 4096 + 128;
/// Receive buffer size: with UDP GRO the kernel hands over up to 64 KiB of coalesced
/// same-size datagrams at once.
pub(crate) const RECV_BUF: usize = 65_536;
/// Most bytes one GSO send may carry (the UDP length field's limit, less headers).
const GSO_MAX_BYTES: usize = 65_000;
/// Most segments one GSO send may carry (the kernel's UDP_MAX_SEGMENTS is 64 or more). It also
/// bounds the IPv4 Identifications ferroce sends (see `SENT_IDENTIFICATION_LIMIT`).
pub(crate) const GSO_MAX_SEGMENTS: usize = 64;
const SOL_UDP: libc::c_int = 17;
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Room for the one control message a GSO send carries (a cmsghdr and its u16, aligned).
const CMSG_SPACE_INT: usize = 32;
/// Room for the control messages one received message may carry: UDP_GRO's segment size (an
/// int) and the TOS byte (IP_TOS, one byte) or traffic class (IPV6_TCLASS, an int), each a
/// cmsghdr and its payload aligned; 24 bytes each on 64-bit Linux, with room to spare.
const RECV_CONTROL_LEN: usize = 64;
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
/// The headers point into the buffers, addresses, control buffers and iovecs, all of which
/// live in heap allocations owned by this value that are never resized, so the pointers stay
/// valid when the value itself moves.
pub(crate) struct RecvBatch {
    bufs: Vec<Vec<u8>>,
    addrs: Vec<libc::sockaddr_storage>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
    cmsgs: Vec<[u8; RECV_CONTROL_LEN]>,
    count: usize,
    /// Whether the socket has UDP GRO on, so that one message may hold several datagrams and
    /// only a control message says how to cut it.
    coalescing: bool,
    /// Whether a single read takes the control messages too (`recvmsg`, not `recvfrom`): for
    /// the TOS byte of every datagram while bulk traffic flows (see [`Self::set_control`]).
    control: bool,
}

// SAFETY: the raw pointers inside `iovs` and `hdrs` point only into this value's own heap
// allocations (see the type's doc), so moving the value to another thread moves their only
// users with them; nothing else refers to those allocations.
unsafe impl Send for RecvBatch {}

impl RecvBatch {
    pub fn new() -> RecvBatch {
        let mut bufs = vec![vec![0u8; RECV_BUF]; BATCH];
        let mut cmsgs = vec![[0u8; RECV_CONTROL_LEN]; BATCH];
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
            .zip(cmsgs.iter_mut())
            .map(|((iov, addr), cmsg)| {
                // SAFETY: plain old data; zero is valid, the fields that matter are set.
                let mut h: libc::mmsghdr = unsafe { zeroed() };
                h.msg_hdr.msg_name = (addr as *mut libc::sockaddr_storage).cast();
                h.msg_hdr.msg_iov = iov;
                h.msg_hdr.msg_iovlen = 1;
                h.msg_hdr.msg_control = cmsg.as_mut_ptr().cast();
                h
            })
            .collect();
        RecvBatch {
            bufs,
            addrs,
            iovs,
            hdrs,
            cmsgs,
            count: 0,
            coalescing: false,
            control: false,
        }
    }

    /// Whether single reads take the control messages too (`recvmsg` rather than
    /// `recvfrom`): on while bulk traffic flows, whose datagrams' TOS bytes (their ECN marks)
    /// matter. `recvmsg` costs more than `recvfrom` on every look (0.3 to 0.6 µs of the
    /// one-way latency of a 4 KiB ping-pong here), so it is kept off while nothing needs it.
    /// Reads of a coalescing socket take them regardless.
    pub fn set_control(&mut self, on: bool) {
        self.control = on;
    }

    /// Whether single reads take the control messages (coalescing on, or
    /// [`Self::set_control`]).
    #[cfg(test)]
    pub fn takes_control(&self) -> bool {
        self.control || self.coalescing
    }

    /// Asks the kernel to coalesce same-size datagrams on `fd` from now on (UDP GRO); returns
    /// whether it agreed. From then on every read takes the control message that says where
    /// to cut: a datagram coalesced after this call must never be read without it.
    pub fn enable_coalescing(&mut self, fd: RawFd) -> bool {
        let ok = set_int(fd, SOL_UDP, UDP_GRO, 1);
        self.coalescing |= ok;
        ok
    }

    /// Reads up to `max` (at most `BATCH`) messages without blocking; returns how many arrived.
    pub fn recv(&mut self, fd: RawFd, max: usize) -> io::Result<usize> {
        let max = max.clamp(1, BATCH);
        for h in &mut self.hdrs[..max] {
            // The kernel shrinks these to what it wrote; give the full room back each call.
            h.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_hdr.msg_controllen = RECV_CONTROL_LEN as _;
            h.msg_len = 0;
        }
        debug_assert_eq!(self.iovs.len(), BATCH);
        // Every header points at a live iovec, buffer, address and control slot owned by `self`
        // (see the type's doc), and the kernel writes at most the lengths given.
        let n = if max == 1 && !self.coalescing && !self.control {
            // One datagram and no control message to read (the usual look of a busy poll):
            // recvfrom skips recvmsg's message header and iovec, ~70 ns of every look
            // (270 against 200 ns for an empty one here). The datagram's TOS byte is not
            // seen (see `enable_control`).
            let mut name_len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            // Straight to the kernel, as below.
            // SAFETY: recvfrom(2) takes (fd, buf, len, flags, addr *, addrlen *): the first
            // buffer with its full length, the first address slot with its size in `name_len`,
            // all owned by `self` and live for the call.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_recvfrom,
                    fd,
                    self.bufs[0].as_mut_ptr(),
                    self.bufs[0].len(),
                    libc::MSG_DONTWAIT,
                    &mut self.addrs[0] as *mut libc::sockaddr_storage,
                    &mut name_len as *mut libc::socklen_t,
                )
            };
            if r >= 0 {
                self.hdrs[0].msg_len = r as libc::c_uint;
                // No control message: `gro_segment` finds none, the datagram is whole.
                self.hdrs[0].msg_hdr.msg_controllen = 0;
                1
            } else {
                -1
            }
        } else if max == 1 {
            // One message with its control messages: recvmsg skips recvmmsg's batch
            // bookkeeping, a measurable part of an empty poll.
            // Straight to the kernel: glibc's recvmsg is a thread-cancellation point and
            // brackets the call with two cancellation-state updates, ~15 ns of an empty poll
            // (ferroce never cancels threads).
            // SAFETY: the first header, as said above; recvmsg(2) takes (fd, msghdr *, flags).
            let r = unsafe {
                libc::syscall(
                    libc::SYS_recvmsg,
                    fd,
                    &mut self.hdrs[0].msg_hdr as *mut libc::msghdr,
                    libc::MSG_DONTWAIT,
                )
            };
            if r >= 0 {
                self.hdrs[0].msg_len = r as libc::c_uint;
                1
            } else {
                -1
            }
        } else {
            // SAFETY: the first `max` headers, as said above; a null timeout with MSG_DONTWAIT
            // makes the call non-blocking.
            unsafe {
                libc::recvmmsg(
                    fd,
                    self.hdrs.as_mut_ptr(),
                    max as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            }
        };
        if n < 0 {
            self.count = 0;
            // The errno itself, not `ErrorKind`: this is every empty poll's way out.
            let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return if errno == libc::EAGAIN || errno == libc::EWOULDBLOCK || errno == libc::EINTR {
                Ok(0)
            } else {
                Err(io::Error::from_raw_os_error(errno))
            };
        }
        self.count = n as usize;
        Ok(self.count)
    }

    /// Message `i` of the last call: its bytes, its sender, and the size of the datagrams GRO
    /// coalesced into it (the whole length when it is one datagram).
    pub fn get(&self, i: usize) -> Option<(&[u8], SocketAddr, usize)> {
        if i >= self.count {
            return None;
        }
        let from = sockaddr_to_std(&self.addrs[i])?;
        let len = (self.hdrs[i].msg_len as usize).min(RECV_BUF);
        let seg = self
            .gro_segment(i)
            .filter(|&s| s > 0 && s < len)
            .unwrap_or(len);
        Some((&self.bufs[i][..len], from, seg))
    }

    /// The TOS byte (IPv4) or traffic class (IPv6) message `i` of the last call arrived with,
    /// if the read took it: the socket must have IP_RECVTOS (IPV6_RECVTCLASS) on, and only
    /// reads that take control messages see it — every read but a single one without
    /// [`Self::set_control`] or coalescing. Its low two bits are the ECN field. GRO
    /// coalesces only datagrams whose IP headers agree but for length and checksum (Linux's
    /// `inet_gro_receive` flushes on a TOS difference), so one value holds for every datagram
    /// of a coalesced message.
    pub fn tos(&self, i: usize) -> Option<u8> {
        if i >= self.count {
            return None;
        }
        self.control_messages(i).tos
    }

    /// The UDP_GRO segment size the kernel reported for message `i`, if any.
    fn gro_segment(&self, i: usize) -> Option<usize> {
        self.control_messages(i).gro_segment
    }

    /// What the control messages of message `i` say. The kernel writes a sequence of cmsghdrs
    /// (`len: size_t, level: int, type: int`, then the payload), each aligned to a `size_t`;
    /// which come and in what order depends on the options on, so every one is looked at.
    fn control_messages(&self, i: usize) -> Control {
        let mut out = Control::default();
        let h = &self.hdrs[i].msg_hdr;
        // msg_controllen is a usize on glibc and a u32 elsewhere.
        #[allow(clippy::unnecessary_cast)]
        let ctl_len = h.msg_controllen as usize;
        let ctl = &self.cmsgs[i][..ctl_len.min(RECV_CONTROL_LEN)];
        let hdr = size_of::<libc::cmsghdr>();
        let w = size_of::<usize>();
        let int = |b: &[u8]| b.get(..4)?.try_into().ok().map(i32::from_ne_bytes);
        let mut at = 0;
        while at + hdr <= ctl.len() {
            let Some(len) = ctl[at..at + w].try_into().ok().map(usize::from_ne_bytes) else {
                break;
            };
            if len < hdr || at + len > ctl.len() {
                break;
            }
            let level = int(&ctl[at + w..]).unwrap_or(-1);
            let kind = int(&ctl[at + w + 4..]).unwrap_or(-1);
            let data = &ctl[at + hdr..at + len];
            match (level, kind) {
                (SOL_UDP, UDP_GRO) => {
                    out.gro_segment = int(data).and_then(|v| usize::try_from(v).ok());
                }
                // IPv4: one byte, the TOS.
                (libc::IPPROTO_IP, libc::IP_TOS) => out.tos = data.first().copied(),
                // IPv6: an int, the traffic class.
                (libc::IPPROTO_IPV6, libc::IPV6_TCLASS) => {
                    out.tos = int(data).map(|v| v as u8);
                }
                _ => {}
            }
            at += (len + w - 1) & !(w - 1);
        }
        out
    }
}

/// What a received message's control messages said.
#[derive(Debug, Default, Clone, Copy)]
struct Control {
    /// UDP_GRO: the size of the datagrams coalesced into the message.
    gro_segment: Option<usize>,
    /// IP_TOS or IPV6_TCLASS: the TOS byte or traffic class.
    tos: Option<u8>,
}

/// Sets an integer socket option on `fd`; returns whether the kernel accepted it.
pub(super) fn set_int(fd: RawFd, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> bool {
    // SAFETY: passes a pointer to a live c_int and its size, as integer options expect.
    unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

/// How many of the packets from the first can go in one GSO send: a run of equal lengths, the
/// last possibly shorter, within the kernel's limits. 1 means "send it on its own".
pub(crate) fn gso_run(lens: &[usize]) -> usize {
    let Some(&seg) = lens.first() else { return 0 };
    let mut n = 1;
    let mut total = seg;
    while n < lens.len() && n < GSO_MAX_SEGMENTS && total + lens[n] <= GSO_MAX_BYTES {
        if lens[n] > seg {
            break;
        }
        total += lens[n];
        n += 1;
        if lens[n - 1] < seg {
            break;
        }
    }
    n
}

/// Sends `bufs[i][..lens[i]]` for every i as ONE send with UDP segmentation offload: the kernel
/// cuts it into datagrams of `lens[0]` bytes (the last may be shorter). `lens` must be a run as
/// [`gso_run`] finds. Returns the number of datagrams sent to `dest`.
pub(crate) fn send_gso(
    fd: RawFd,
    bufs: &[Vec<u8>],
    lens: &[usize],
    dest: &SocketAddr,
) -> io::Result<usize> {
    let n = lens.len().min(bufs.len());
    if n < 2 || gso_run(&lens[..n]) != n {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a GSO run"));
    }
    let seg = lens[0];
    let (ss, sslen) = std_to_sockaddr(dest);
    let mut iovs = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; GSO_MAX_SEGMENTS];
    for i in 0..n {
        iovs[i] = libc::iovec {
            iov_base: bufs[i].as_ptr() as *mut libc::c_void,
            iov_len: lens[i],
        };
    }
    // One cmsghdr carrying the u16 segment size, padded to the control alignment.
    let mut ctl = [0u8; CMSG_SPACE_INT];
    let hdr = size_of::<libc::cmsghdr>();
    let w = size_of::<usize>();
    let cmsg_len = hdr + 2;
    ctl[..w].copy_from_slice(&cmsg_len.to_ne_bytes());
    ctl[w..w + 4].copy_from_slice(&SOL_UDP.to_ne_bytes());
    ctl[w + 4..w + 8].copy_from_slice(&UDP_SEGMENT.to_ne_bytes());
    ctl[hdr..hdr + 2].copy_from_slice(&(seg as u16).to_ne_bytes());
    // SAFETY: plain old data; zero is valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_name = &ss as *const libc::sockaddr_storage as *mut libc::c_void;
    msg.msg_namelen = sslen;
    msg.msg_iov = iovs.as_mut_ptr();
    msg.msg_iovlen = n as _;
    msg.msg_control = ctl.as_mut_ptr().cast();
    msg.msg_controllen = ((cmsg_len + 7) & !7) as _;
    loop {
        // SAFETY: the message points at live iovecs, payloads, address and control buffer, all
        // alive until this function returns; the kernel only reads them.
        let r = unsafe { libc::sendmsg(fd, &msg, 0) };
        if r >= 0 {
            return Ok(n);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends `lens[i]` bytes of `bufs[i]`, for every i, to `dest`
/// with as few `sendmmsg` calls as possible; returns how many datagrams were sent.
pub(crate) fn send_batch(
    fd: RawFd,
    bufs: &[Vec<u8>],
    lens: &[usize],
    dest: &SocketAddr,
) -> io::Result<usize> {
    let (ss, sslen) = std_to_sockaddr(dest);
    let n = lens.len().min(bufs.len()).min(BATCH);
    if n == 1 {
        // One datagram (every message of a ping-pong): sendto skips sendmmsg's per-message
        // header copies, about 0.1 µs of the one-way latency on loopback.
        return send_one(fd, &bufs[0][..lens[0].min(bufs[0].len())], &ss, sslen).map(|()| 1);
    }
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

/// Sends one datagram to the address `ss` holds.
fn send_one(
    fd: RawFd,
    bytes: &[u8],
    ss: &libc::sockaddr_storage,
    sslen: libc::socklen_t,
) -> io::Result<()> {
    loop {
        // Straight to the kernel, not through glibc's cancellation point (see `recv`).
        // SAFETY: `bytes` and `ss` are live for the call and the kernel only reads them;
        // `sslen` is the length `std_to_sockaddr` filled in; sendto(2) takes (fd, buf, len,
        // flags, addr, addrlen).
        let r = unsafe {
            libc::syscall(
                libc::SYS_sendto,
                fd,
                bytes.as_ptr(),
                bytes.len(),
                0,
                ss as *const libc::sockaddr_storage,
                sslen,
            )
        };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    /// Sends three 1000-byte datagrams, bytes `first..`, as one GSO send; false where the
    /// kernel has no UDP segmentation offload.
    fn send_three(from: &UdpSocket, to: SocketAddr, first: u8) -> bool {
        let bufs: Vec<Vec<u8>> = (0..3).map(|k| vec![first + k; 1000]).collect();
        send_gso(from.as_raw_fd(), &bufs, &[1000; 3], &to).is_ok_and(|n| n == 3)
    }

    /// Reads one message, waiting up to a second for it.
    fn read_one(rx: &mut RecvBatch, fd: RawFd) -> (Vec<u8>, SocketAddr, usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while rx.recv(fd, 1).unwrap() == 0 {
            assert!(std::time::Instant::now() < deadline, "nothing arrived");
        }
        let (bytes, from, seg) = rx.get(0).unwrap();
        (bytes.to_vec(), from, seg)
    }

    #[test]
    fn single_reads_take_whole_datagrams_before_and_after_coalescing_is_on() {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        receiver.set_nonblocking(true).unwrap();
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = receiver.local_addr().unwrap();
        let fd = receiver.as_raw_fd();
        let mut rx = RecvBatch::new();
        if !send_three(&sender, to, 1) {
            return; // no GSO: nothing arrives coalesced either
        }
        // GRO off: the kernel cut the GSO send into datagrams, and each single read (recvfrom)
        // takes exactly one, with its sender.
        for k in 0..3u8 {
            let (bytes, from, seg) = read_one(&mut rx, fd);
            assert_eq!(bytes, vec![1 + k; 1000]);
            assert_eq!(seg, 1000);
            assert_eq!(from, sender.local_addr().unwrap());
        }
        assert_eq!(rx.recv(fd, 1).unwrap(), 0);
        if !rx.enable_coalescing(fd) {
            return; // no GRO here
        }
        // GRO on: the three arrive as one message, and the single read (recvmsg) says where
        // to cut it.
        assert!(send_three(&sender, to, 10));
        let (bytes, _, seg) = read_one(&mut rx, fd);
        assert_eq!(seg, 1000);
        let expected: Vec<u8> = (10..13u8).flat_map(|b| vec![b; 1000]).collect();
        assert_eq!(bytes, expected);
    }

    /// Sets the TOS byte (IPv6: traffic class) `sock` sends with.
    fn send_with_tos(sock: &UdpSocket, tos: u8) {
        let v6 = sock.local_addr().unwrap().is_ipv6();
        let (level, name) = if v6 {
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS)
        } else {
            (libc::IPPROTO_IP, libc::IP_TOS)
        };
        assert!(set_int(sock.as_raw_fd(), level, name, tos.into()));
    }

    /// Reads up to `max` messages, waiting up to a second for the first.
    fn read_some(rx: &mut RecvBatch, fd: RawFd, max: usize) -> usize {
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        loop {
            let n = rx.recv(fd, max).unwrap();
            if n > 0 {
                return n;
            }
            assert!(std::time::Instant::now() < deadline, "nothing arrived");
        }
    }

    #[test]
    fn congestion_experienced_is_read_from_the_tos_of_each_datagram() {
        for local in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(receiver) = UdpSocket::bind(local) else {
                continue; // no IPv6 loopback here
            };
            receiver.set_nonblocking(true).unwrap();
            let v6 = receiver.local_addr().unwrap().is_ipv6();
            assert!(
                super::super::socket::receive_tos(receiver.as_raw_fd(), v6),
                "{local}"
            );
            let sender = UdpSocket::bind(local).unwrap();
            let to = receiver.local_addr().unwrap();
            let fd = receiver.as_raw_fd();
            let mut rx = RecvBatch::new();
            // CE (0x03), as a congested switch leaves it.
            send_with_tos(&sender, 0x03);
            // A single read while no bulk traffic flows: recvfrom, which takes no control
            // message.
            sender.send_to(&[1; 8], to).unwrap();
            assert_eq!(read_some(&mut rx, fd, 1), 1);
            assert_eq!(rx.tos(0), None, "{local}: recvfrom sees no TOS");
            // With `set_control`, a single read is a recvmsg and sees it.
            rx.set_control(true);
            assert!(rx.takes_control());
            sender.send_to(&[2; 8], to).unwrap();
            assert_eq!(read_some(&mut rx, fd, 1), 1);
            assert_eq!(rx.tos(0), Some(0x03), "{local}: single read");
            assert_eq!(rx.get(0).unwrap().0, &[2; 8]);
            // A batch read (recvmmsg) sees each datagram's own.
            for (k, tos) in [0x02u8, 0x03, 0x00, 0xb9].into_iter().enumerate() {
                send_with_tos(&sender, tos);
                sender.send_to(&[k as u8; 16], to).unwrap();
            }
            let mut got = Vec::new();
            while got.len() < 4 {
                let n = read_some(&mut rx, fd, BATCH);
                got.extend((0..n).map(|i| rx.tos(i)));
            }
            assert_eq!(
                got,
                [Some(0x02), Some(0x03), Some(0x00), Some(0xb9)],
                "{local}: batch read"
            );
            assert_eq!(rx.tos(4), None, "past the last message");
            // With GRO on, a coalesced message carries the segment size and the TOS: both
            // control messages are found.
            if !rx.enable_coalescing(fd) {
                continue;
            }
            send_with_tos(&sender, 0x03);
            if !send_three(&sender, to, 20) {
                continue;
            }
            let mut datagrams = 0;
            while datagrams < 3 {
                let n = read_some(&mut rx, fd, 1);
                assert_eq!(n, 1);
                let (bytes, _, seg) = rx.get(0).unwrap();
                assert_eq!(seg, 1000);
                datagrams += bytes.len() / seg;
                assert_eq!(rx.tos(0), Some(0x03), "{local}: coalesced");
            }
        }
    }

    #[test]
    fn a_socket_bound_with_a_tos_sends_with_it_on_either_family() {
        // What every ferroce socket is bound with: ECT(0), Not-ECT with ECN off, CE to mark.
        for local in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(receiver) = UdpSocket::bind(local) else {
                continue; // no IPv6 loopback here
            };
            receiver.set_nonblocking(true).unwrap();
            let v6 = receiver.local_addr().unwrap().is_ipv6();
            assert!(super::super::socket::receive_tos(receiver.as_raw_fd(), v6));
            let to = receiver.local_addr().unwrap();
            let mut rx = RecvBatch::new();
            rx.set_control(true);
            for tos in [0x02, 0x00, 0x03] {
                let any = SocketAddr::new(to.ip(), 0);
                let sender = super::super::socket::bind(any, 1 << 16, tos).unwrap();
                sender.send_to(&[tos; 8], to).unwrap();
                assert_eq!(read_some(&mut rx, receiver.as_raw_fd(), 1), 1);
                assert_eq!(rx.tos(0), Some(tos), "{local}");
            }
        }
    }

    #[test]
    fn gso_runs() {
        assert_eq!(gso_run(&[]), 0);
        assert_eq!(gso_run(&[100]), 1);
        assert_eq!(
            gso_run(&[100, 100, 100, 40, 100]),
            4,
            "a shorter packet ends the run"
        );
        assert_eq!(gso_run(&[40, 100]), 1, "a longer packet cannot follow");
        assert_eq!(gso_run(&[4124; 40]), 15, "64 KiB at most");
        assert_eq!(gso_run(&[1000; 100]), 64, "64 segments at most");
    }
}
