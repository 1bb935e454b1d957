//! A context's presence on the host: its listener, the hello exchange that links QPs, and the
//! events (new links, wake-ups, peers gone) the engine acts on.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::link::{Link, PeerLink, ShmQp};
use super::map::SharedMap;
use super::pages::{KeyTable, PublishedRegion, QpPage};
use crate::provider::{ContextShared, MrInner, Provider, QpShared};

/// A hello that arrived before its QP reached RTR.
#[derive(Debug)]
pub(super) struct Offer {
    pub(super) peer_qpn: u32,
    pub(super) pid: u32,
    pub(super) table: SharedMap,
    pub(super) page: SharedMap,
}

/// An accepted hello connection.
#[derive(Debug)]
pub(super) struct Incoming {
    pub(super) fd: OwnedFd,
    /// Our QP and the inode of the peer's QP page, once its hello arrived.
    pub(super) hello: Option<(u32, u64)>,
}

/// What happened on the listener that the context must act on.
#[derive(Debug, Default)]
pub(crate) struct HostEvents {
    /// Our QPs whose peer hung up, each with the inode of the peer QP page its hello carried:
    /// the QP goes to ERR only if it is still linked to that page (see [`ShmQp::linked_to`]).
    pub peers_gone: Vec<(u32, u64)>,
    /// Whether anything arrived at all.
    pub did: bool,
}

/// A context's shared-memory presence on the host.
#[derive(Debug)]
pub(crate) struct ShmHost {
    pub provider: Provider,
    pub table: KeyTable,
    pub(super) listener: OwnedFd,
    pub(super) pid: u32,
    pub(super) incoming: Mutex<Vec<Incoming>>,
    pub(super) offers: Mutex<HashMap<u32, Offer>>,
    /// Peers gone that an application thread saw: the engine, which alone reads the rings,
    /// ends those links on its next pass, after handling what the peer wrote before it went.
    pub(super) gone_pending: Mutex<Vec<(u32, u64)>>,
    /// When (ns on the context clock) the listener was last looked at.
    pub(super) last_poll: std::sync::atomic::AtomicU64,
}

/// How often an engine pass looks at the listener and hello connections. They carry hellos,
/// wake-up bytes and hang-ups, none urgent (a QP whose hello has not been read yet sends by
/// UDP meanwhile); looking costs system calls, which a busy-polling application pays in every
/// empty poll of its CQ.
pub(super) const HOST_POLL_EVERY_NS: u64 = 100_000;

pub(super) fn abstract_name(addr: SocketAddr) -> Vec<u8> {
    let mut v = vec![0u8];
    v.extend_from_slice(format!("ferroce-shm/{}/{}", addr.ip(), addr.port()).as_bytes());
    v
}

pub(super) fn unix_addr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_un is a valid (unnamed) address to fill in.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let n = name.len().min(a.sun_path.len());
    for (d, s) in a.sun_path.iter_mut().zip(&name[..n]) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + n;
    (a, len as libc::socklen_t)
}

pub(super) fn seqpacket_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `bytes` with descriptors attached (`SCM_RIGHTS`).
pub(super) fn send_with_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is valid before its fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer is `space` bytes, enough for one header with `payload`
    // bytes of data, so CMSG_FIRSTHDR is non-null and the copy stays inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
    }
    // SAFETY: `msg` points at live buffers described by their lengths.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one message and up to two descriptors; `Ok(None)` when nothing is waiting,
/// `Ok(Some((0, _)))` at end of stream.
pub(super) fn recv_with_fds(
    sock: RawFd,
    buf: &mut [u8],
) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 16];
    // SAFETY: an all-zero msghdr is valid before its fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: `msg` points at live buffers described by their lengths.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock => Ok(None),
            io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_control` with well-formed headers within
    // `msg_controllen`; CMSG_FIRSTHDR/NXTHDR walk only those, and each SCM_RIGHTS payload holds
    // `(cmsg_len - CMSG_LEN(0)) / 4` descriptors now owned by this process.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Some((n as usize, fds)))
}

impl ShmHost {
    /// Publishes this context on the host under its RoCE address.
    pub(crate) fn open(provider: Provider, local: SocketAddr) -> io::Result<ShmHost> {
        let table = KeyTable::create()?;
        let listener = seqpacket_socket()?;
        let (addr, len) = unix_addr(&abstract_name(local));
        // SAFETY: `addr` is a live sockaddr_un of `len` bytes.
        let r = unsafe {
            libc::bind(
                listener.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        // SAFETY: plain listen(2) on our socket.
        if r != 0 || unsafe { libc::listen(listener.as_raw_fd(), 128) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ShmHost {
            provider,
            table,
            listener,
            pid: std::process::id(),
            incoming: Mutex::new(Vec::new()),
            offers: Mutex::new(HashMap::new()),
            gone_pending: Mutex::new(Vec::new()),
            last_poll: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Descriptors the engine sleeps on: the listener and every hello connection.
    pub(crate) fn wait_fds(&self, out: &mut Vec<RawFd>) {
        out.push(self.listener.as_raw_fd());
        let inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
        out.extend(inc.iter().map(|i| i.fd.as_raw_fd()));
    }

    /// Starts linking `qp` (now at RTR) to the QP `peer_qpn` of the context at `dest`:
    /// `Ok(false)` when no ferroce context listens there (use UDP).
    pub(crate) fn start_link(
        &self,
        qp: &ShmQp,
        qpn: u32,
        dest: SocketAddr,
        peer_qpn: u32,
    ) -> io::Result<bool> {
        let sock = seqpacket_socket()?;
        let (addr, len) = unix_addr(&abstract_name(dest));
        // SAFETY: `addr` is a live sockaddr_un of `len` bytes.
        let r = unsafe {
            libc::connect(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => Ok(false),
                _ => Err(e),
            };
        }
        let mut hello = [0u8; HELLO_LEN];
        hello[0..4].copy_from_slice(&HELLO_MAGIC);
        hello[4] = HELLO_VERSION;
        hello[8..12].copy_from_slice(&qpn.to_ne_bytes());
        hello[12..16].copy_from_slice(&peer_qpn.to_ne_bytes());
        let mut with_pid = hello.to_vec();
        with_pid.extend_from_slice(&self.pid.to_ne_bytes());
        send_with_fds(
            sock.as_raw_fd(),
            &with_pid,
            &[self.table.map.fd(), qp.page.map.fd()],
        )?;
        // The peer's hello may be read at any moment by another thread (`take_hello`), which
        // under this QP's link lock either completes a pending link or parks the hello as an
        // offer. So the link turns pending and the parked offer is looked for under that same
        // lock: the hello is then seen by exactly one of the two. (Looking for the offer first
        // and taking the lock after let a hello parked in between wait forever, with this side
        // pending and the peer linked, its packets going to a ring nobody read.)
        let mut link = qp.lock();
        *link = Link::Pending {
            out: sock,
            peer_qpn,
        };
        let offer = self
            .offers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qpn)
            .filter(|o| o.peer_qpn == peer_qpn);
        if let Some(o) = offer {
            complete(qp, &mut link, o)?;
        }
        Ok(true)
    }

    /// Accepts hello connections, reads hellos and wake-up bytes, and notices peers that hung
    /// up. `find` gives the shm side of one of our QPs by number.
    pub(crate) fn poll(
        &self,
        now_ns: u64,
        force: bool,
        find: &dyn Fn(u32) -> Option<Arc<QpShared>>,
    ) -> HostEvents {
        let mut ev = HostEvents::default();
        let last = self.last_poll.load(Ordering::Relaxed);
        if !force && now_ns.saturating_sub(last) < HOST_POLL_EVERY_NS && last != 0 {
            return ev;
        }
        self.last_poll.store(now_ns.max(1), Ordering::Relaxed);
        let mut inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // SAFETY: accept4 on our listening socket, no address wanted; result checked.
            let fd = unsafe {
                libc::accept4(
                    self.listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if fd < 0 {
                break;
            }
            ev.did = true;
            inc.push(Incoming {
                // SAFETY: a fresh descriptor from accept4.
                fd: unsafe { OwnedFd::from_raw_fd(fd) },
                hello: None,
            });
        }
        let mut i = 0;
        while i < inc.len() {
            let mut closed = false;
            loop {
                let mut buf = [0u8; 64];
                match recv_with_fds(inc[i].fd.as_raw_fd(), &mut buf) {
                    Ok(None) => break,
                    Ok(Some((0, _))) | Err(_) => {
                        closed = true;
                        break;
                    }
                    Ok(Some((n, fds))) => {
                        ev.did = true;
                        if inc[i].hello.is_none() {
                            match self.take_hello(&buf[..n], fds, find) {
                                Some(hello) => inc[i].hello = Some(hello),
                                None => {
                                    closed = true;
                                    break;
                                }
                            }
                        }
                        // Later messages are wake-up bytes: reading them was the point.
                    }
                }
            }
            if closed {
                let gone = inc.swap_remove(i);
                if let Some((ours, page)) = gone.hello {
                    // A hello parked for a QP that never linked to it is of no use now.
                    let mut offers = self.offers.lock().unwrap_or_else(|e| e.into_inner());
                    if offers.get(&ours).is_some_and(|o| o.page.inode() == page) {
                        offers.remove(&ours);
                    }
                    ev.peers_gone.push((ours, page));
                }
                ev.did = true;
            } else {
                i += 1;
            }
        }
        ev
    }

    /// Checks a hello and links (or parks) it; returns the QP it is for and the inode of the
    /// peer's QP page, `None` if it is not a valid hello.
    pub(super) fn take_hello(
        &self,
        msg: &[u8],
        fds: Vec<OwnedFd>,
        find: &dyn Fn(u32) -> Option<Arc<QpShared>>,
    ) -> Option<(u32, u64)> {
        if msg.len() != HELLO_LEN + 4 || msg[0..4] != HELLO_MAGIC || msg[4] != HELLO_VERSION {
            return None;
        }
        let word = |at: usize| u32::from_ne_bytes([msg[at], msg[at + 1], msg[at + 2], msg[at + 3]]);
        let (peer_qpn, ours, pid) = (word(8), word(12), word(16));
        let mut fds = fds.into_iter();
        let (table, page) = (fds.next()?, fds.next()?);
        let offer = Offer {
            peer_qpn,
            pid,
            table: SharedMap::from_fd(table).ok()?,
            page: SharedMap::from_fd(page).ok()?,
        };
        let page_inode = offer.page.inode();
        let qp = find(ours)?;
        let shm = qp.shm.as_ref()?;
        let mut link = shm.lock();
        match &*link {
            Link::Pending { peer_qpn: p, .. } if *p == peer_qpn => {
                complete(shm, &mut link, offer).ok()?;
            }
            Link::Linked(_) | Link::Broken => return None,
            _ => {
                self.offers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(ours, offer);
            }
        }
        Some((ours, page_inode))
    }
}

/// Turns a pending link and the peer's hello into a linked QP.
pub(super) fn complete(qp: &ShmQp, link: &mut Link, offer: Offer) -> io::Result<()> {
    let Link::Pending { out, peer_qpn } = std::mem::take(link) else {
        return Ok(());
    };
    let table = KeyTable::from_map(offer.table)?;
    let page = QpPage::from_map(offer.page)?;
    let _ = peer_qpn;
    *link = Link::Linked(Box::new(PeerLink {
        out,
        pid: offer.pid,
        table: Arc::new(table),
        page: Arc::new(page),
    }));
    qp.generation.fetch_add(1, Ordering::AcqRel);
    qp.linked.store(true, Ordering::Release);
    Ok(())
}

pub(super) const HELLO_MAGIC: [u8; 4] = *b"FRSH";
pub(super) const HELLO_VERSION: u8 = 1;
pub(super) const HELLO_LEN: usize = 16;

/// The shared-memory provider's part of a context's calls (on its key table and listener); each
/// does nothing on a context without shared memory.
impl ContextShared {
    /// Makes a newly registered region reachable by same-host peers.
    pub(crate) fn shm_publish(&self, key: u32, mr: &MrInner) {
        let (Some(host), Some(file)) = (&self.shm, mr.published_file()) else {
            return;
        };
        host.table.publish(&PublishedRegion {
            key,
            pd: mr.pd,
            access: mr.access,
            addr: file.addr,
            len: file.len,
            fd: file.fd,
            inode: file.inode,
            file_offset: file.file_offset,
        });
    }

    /// Withdraws a region from same-host peers.
    pub(crate) fn shm_withdraw(&self, key: u32) {
        if let Some(host) = &self.shm {
            host.table.withdraw(key);
        }
    }

    /// Looks at the shared-memory listener (hellos, wake-ups, peers gone) — at most every so
    /// often unless `force` — and moves QPs whose peer went away to ERR. Returns whether
    /// anything arrived. Only the engine (`in_engine`, holding its lock) reads the rings: a
    /// peer gone seen from an application thread is left to the engine's next pass.
    pub(crate) fn poll_shm_host(
        &self,
        now: ferroce_proto::Instant,
        force: bool,
        in_engine: bool,
    ) -> bool {
        let Some(host) = &self.shm else {
            return false;
        };
        let ev = host.poll(now.as_nanos(), force, &|qpn| self.qp(qpn));
        let mut gone = host.gone_pending.lock().unwrap_or_else(|e| e.into_inner());
        gone.extend_from_slice(&ev.peers_gone);
        if !in_engine || gone.is_empty() {
            return ev.did || !gone.is_empty();
        }
        let gone = std::mem::take(&mut *gone);
        let mut buf = vec![0u8; crate::provider::udp::MAX_DATAGRAM];
        for (qpn, page) in gone {
            // The hello connection of a link since replaced (the QP was reset, and maybe
            // connected anew) says nothing about the QP now.
            if let Some(qp) = self
                .qp(qpn)
                .filter(|q| q.shm.as_ref().is_some_and(|s| s.linked_to(page)))
            {
                // What the peer wrote before it went (the ACK of our last SEND, say) counts.
                super::transfer::drain_ring(self, &qp, &mut buf, now, usize::MAX);
                super::transfer::peer_gone(&qp, self.fail_idle_qps_when_peer_goes);
            }
        }
        true
    }
}
