//! A context's presence on the host: its listener, the hello exchange that links QPs, and the
//! events (new links, wake-ups, peers gone) the engine acts on.
//!
//! # Who may link, and how
//! The listener is an abstract Unix socket: it has no file permissions, so anyone in the network
//! namespace can connect. Every decision is therefore taken on what the **kernel** says of the
//! other end (`SO_PEERCRED`: its pid, uid and gid), never on what it writes:
//! - Only peers of our own uid link ([`LinkPolicy`]; `FERROCE_SHM_GROUP=GID` also admits peers
//!   whose primary gid is GID). A peer of another user is refused at once on either end, and its QP
//!   takes the packet path (UDP), where the responder checks everything.
//! - A QP at RTR connects to the listener of its destination address and learns from the
//!   kernel which process holds it. Only if that process may link does it send its **hello**:
//!   its QP number, the QP it wants, and its key table's and QP page's descriptors — to the
//!   process the application named as its peer, and no other.
//! - A hello that arrives on the listener links a QP only if that QP is itself linking to
//!   exactly the hello's QP number **and** the hello's sender (kernel-reported pid) is the
//!   process that its own connection found listening at the QP's destination. So a hello from
//!   any other process, of any uid, links nothing, and nothing re-links a linked QP: this binds
//!   a hello to the QP's own connection as tightly as an answer on that connection would (both
//!   come from the destination's listener process), while a peer that stopped right after
//!   reaching RTR (its hello sent) is still linked without running code — one-sided operations
//!   need no target CPU, from the first.
//! - Hellos wait (parked on their connection) until their QP reaches RTR; at most
//!   [`MAX_WAITING`] connections wait, one that sends no hello within
//!   [`REQUEST_DEADLINE_NS`] is closed, a hello that waits longer than [`PARKED_DEADLINE_NS`]
//!   too, and nothing replaces what a QP already has. Each pass accepts and reads a bounded
//!   number of connections and messages, so a flood delays only itself.
//! - A QP reads its inbound ring from the moment its hello went out, linked or not: if its
//!   own link never forms (its hello refused or dropped), the peer that linked from that hello
//!   still reaches it, and this side sends over UDP.
//! - The descriptors of a hello must be sealed memfds, mapped at exactly the size of a key
//!   table and a QP page ([`SharedMap::from_fd`]).
//!
//! A refusal of any kind counts in `shm_links_refused` and costs the requester nothing but the
//! shared-memory shortcut: its QP keeps using UDP.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::link::{Link, PeerLink, ShmQp};
use super::map::SharedMap;
use super::pages::{KeyTable, PublishedRegion, QpPage, PAGE_LEN, TABLE_LEN};
use crate::provider::{ContextShared, MrInner, Provider, QpShared};

/// What the kernel says of a Unix socket's other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PeerCred {
    pub(super) pid: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
}

/// The credentials of the process at the other end of `sock` (`SO_PEERCRED`: for a connected
/// socket, its peer at `connect`; for an accepted one, the connecting process).
pub(super) fn peer_cred(sock: RawFd) -> io::Result<PeerCred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `c` is a live ucred and `len` its size, as SO_PEERCRED expects.
    let r = unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 || c.pid <= 0 {
        return Err(io::Error::other(
            "no peer credentials on a shared-memory connection",
        ));
    }
    Ok(PeerCred {
        pid: c.pid as u32,
        uid: c.uid,
        gid: c.gid,
    })
}

/// Which processes may link with this context's QPs over shared memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinkPolicy {
    uid: u32,
    /// `FERROCE_SHM_GROUP`: peers whose primary gid is this are admitted too, and trusted as
    /// the same user is: a linked peer maps this context's key table and QP pages writable
    /// (a peer of the same uid could open them through `/proc` anyway; one of the group could
    /// not, and is given that power by this opt-in).
    group: Option<u32>,
}

impl LinkPolicy {
    /// Our own uid, and the group the environment opts in, if any.
    pub(crate) fn from_env() -> LinkPolicy {
        LinkPolicy {
            // SAFETY: geteuid cannot fail.
            uid: unsafe { libc::geteuid() },
            group: std::env::var("FERROCE_SHM_GROUP")
                .ok()
                .and_then(|g| g.trim().parse().ok()),
        }
    }

    /// Whether a process with these credentials may link.
    pub(super) fn admits(&self, c: &PeerCred) -> bool {
        c.uid == self.uid || self.group.is_some_and(|g| g == c.gid)
    }
}

/// An accepted hello connection.
#[derive(Debug)]
pub(super) struct Incoming {
    pub(super) fd: OwnedFd,
    /// Who connected, as the kernel says.
    pub(super) cred: PeerCred,
    /// When (context clock, ns) it was accepted.
    pub(super) accepted_ns: u64,
    /// Its hello, once read: our QP it asks for, and the requesting QP.
    pub(super) request: Option<(u32, u32)>,
    /// The hello's descriptors (key table, QP page), until a link takes them.
    pub(super) fds: Vec<OwnedFd>,
    /// The id of our QP's link made from it (its hang-up then ends that link).
    pub(super) linked: Option<u64>,
}

/// What happened on the listener that the context must act on.
#[derive(Debug, Default)]
pub(crate) struct HostEvents {
    /// Our QPs whose peer hung up, each with the id of the link the peer's connection was
    /// used for: the QP goes to ERR only if it still has that link (see
    /// [`ShmQp::linked_to`]).
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
    pub(super) policy: LinkPolicy,
    pub(super) incoming: Mutex<Vec<Incoming>>,
    /// Peers gone that an application thread saw: the engine, which alone reads the rings,
    /// ends those links on its next pass, after handling what the peer wrote before it went.
    pub(super) gone_pending: Mutex<Vec<(u32, u64)>>,
    /// When (ns on the context clock) the listener was last looked at.
    pub(super) last_poll: AtomicU64,
    /// Ids for links, unique in this context.
    pub(super) next_link_id: AtomicU64,
    /// Connections and hellos refused (see the module doc).
    pub(crate) links_refused: AtomicU64,
}

/// Most connections that may wait for their QP at once (connections that linked a QP do not
/// count): beyond it new ones are refused (their QPs use UDP).
pub(super) const MAX_WAITING: usize = 256;
/// How long a connection may stay without sending its hello.
pub(super) const REQUEST_DEADLINE_NS: u64 = 2_000_000_000;
/// How long a hello may wait for its QP to reach RTR (linked to it) before it is dropped: the
/// peer then stays on UDP, reading its ring if our QP links from its side later.
pub(super) const PARKED_DEADLINE_NS: u64 = 60_000_000_000;
/// Connections accepted in one pass.
const ACCEPTS_PER_POLL: usize = 32;
/// How long a link waits for a listener whose backlog is full before it gives up the shortcut.
const LISTENER_BUSY_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);
/// Messages (hellos, wake-up bytes) read from one connection in one pass.
const MESSAGES_PER_POLL: usize = 64;

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
            policy: LinkPolicy::from_env(),
            incoming: Mutex::new(Vec::new()),
            gone_pending: Mutex::new(Vec::new()),
            last_poll: AtomicU64::new(0),
            next_link_id: AtomicU64::new(1),
            links_refused: AtomicU64::new(0),
        })
    }

    fn refused(&self) {
        self.links_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Descriptors the engine sleeps on: the listener and every accepted connection.
    pub(crate) fn wait_fds(&self, out: &mut Vec<RawFd>) {
        out.push(self.listener.as_raw_fd());
        let inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
        out.extend(inc.iter().map(|i| i.fd.as_raw_fd()));
    }

    /// Starts linking `qp` (now at RTR) to the QP `peer_qpn` of the context at `dest`:
    /// `Ok(false)` when no ferroce context of a process this context may link with listens
    /// there (use UDP).
    pub(crate) fn start_link(
        &self,
        qp: &ShmQp,
        qpn: u32,
        dest: SocketAddr,
        peer_qpn: u32,
    ) -> io::Result<bool> {
        let sock = seqpacket_socket()?;
        let (addr, len) = unix_addr(&abstract_name(dest));
        // A listener whose backlog is full (EAGAIN) is alive but busy — a flood of hellos, or
        // many QPs linking at once: it is tried again for a while before the shortcut is given
        // up, so that a forced shm provider does not fail a connection for a moment's load.
        let busy_until = std::time::Instant::now() + LISTENER_BUSY_PATIENCE;
        loop {
            // SAFETY: `addr` is a live sockaddr_un of `len` bytes.
            let r = unsafe {
                libc::connect(
                    sock.as_raw_fd(),
                    (&addr as *const libc::sockaddr_un).cast(),
                    len,
                )
            };
            if r == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) if std::time::Instant::now() < busy_until => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Some(libc::ECONNREFUSED) | Some(libc::ENOENT) | Some(libc::EAGAIN) => {
                    return Ok(false)
                }
                _ => return Err(e),
            }
        }
        // The process that bound the destination's name, as the kernel says: it is the one
        // our QP links with, or none. A peer whose pid this namespace cannot see (pid 0), of
        // another user, or that closed on us (it refused us) is reached over UDP.
        let cred = match peer_cred(sock.as_raw_fd()) {
            Ok(c) if self.policy.admits(&c) => c,
            _ => {
                self.refused();
                return Ok(false);
            }
        };
        // The ring starts empty for the new peer, whatever an earlier one left in the page.
        qp.page.reset_ring(qp.ring_tail.load(Ordering::Relaxed));
        let hello = hello(qpn, peer_qpn);
        let fds = [self.table.map.fd(), qp.page.map.fd()];
        match send_with_fds(sock.as_raw_fd(), &hello, &fds) {
            Ok(()) => {}
            // The listener took the connection and closed it before our hello went out: it
            // refused us (its list of waiting hellos is full). That is the refusal that comes
            // after a hello, only sooner: the peer may still link to us from its side, so the
            // link stays pending on the closed socket exactly as if the hello had gone out.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => {}
            Err(_) => {
                self.refused();
                return Ok(false);
            }
        }
        let id = self.next_link_id.fetch_add(1, Ordering::Relaxed);
        // The peer may link and send before its hello reaches us: read the ring from now on.
        qp.receiving.store(true, Ordering::Release);
        *qp.lock() = Link::Pending {
            out: sock,
            peer_qpn,
            peer_pid: cred.pid,
            id,
            since: std::time::Instant::now(),
        };
        // The peer's hello may be parked already (it reached RTR first): link from it now.
        // Lock order: the incoming list, then the QP's link (as `poll` takes them).
        let mut inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = inc.iter().position(|i| {
            i.linked.is_none() && i.request == Some((qpn, peer_qpn)) && i.cred.pid == cred.pid
        }) {
            if !self.link_from(qp, &mut inc[at]) {
                inc.swap_remove(at);
            }
        }
        Ok(true)
    }

    /// Links `qp` from the hello `i` if `qp` is linking to exactly the QP and the process that
    /// sent it; returns `false` if the hello's descriptors were refused (the connection is
    /// then to be closed). Lock order: the incoming list (held by the caller), then the link.
    fn link_from(&self, qp: &ShmQp, i: &mut Incoming) -> bool {
        let Some((_, theirs)) = i.request else {
            return true;
        };
        let mut link = qp.lock();
        let id = match &*link {
            Link::Pending {
                peer_qpn,
                peer_pid,
                id,
                ..
            } if *peer_qpn == theirs && *peer_pid == i.cred.pid => *id,
            _ => return true,
        };
        match self.complete(qp, &mut link, std::mem::take(&mut i.fds)) {
            Ok(()) => {
                i.linked = Some(id);
                true
            }
            Err(_) => {
                self.refused();
                false
            }
        }
    }

    /// Accepts hello connections, reads hellos and wake-up bytes, and notices peers
    /// that hung up. `find` gives one of our QPs by number.
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
        self.poll_incoming(now_ns, find, &mut ev);
        ev
    }

    fn poll_incoming(
        &self,
        now_ns: u64,
        find: &dyn Fn(u32) -> Option<Arc<QpShared>>,
        ev: &mut HostEvents,
    ) {
        let mut inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
        // Only connections that linked nothing yet count against the bound: a context may
        // have any number of linked QPs.
        let mut waiting = inc.iter().filter(|i| i.linked.is_none()).count();
        // A bounded amount of work per pass, whatever a flood of connections or messages does:
        // the rest waits for the next pass, and the engine keeps serving its QPs meanwhile.
        for _ in 0..ACCEPTS_PER_POLL {
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
            // SAFETY: a fresh descriptor from accept4.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            match peer_cred(fd.as_raw_fd()) {
                Ok(cred) if self.policy.admits(&cred) && waiting < MAX_WAITING => {
                    waiting += 1;
                    inc.push(Incoming {
                        fd,
                        cred,
                        accepted_ns: now_ns,
                        request: None,
                        fds: Vec::new(),
                        linked: None,
                    })
                }
                // Another user, or too many waiting: closing it tells the other end to use UDP.
                _ => self.refused(),
            }
        }
        let mut i = 0;
        while i < inc.len() {
            let mut closed = false;
            for _ in 0..MESSAGES_PER_POLL {
                let mut buf = [0u8; 64];
                match recv_with_fds(inc[i].fd.as_raw_fd(), &mut buf) {
                    Ok(None) => {
                        let age = now_ns.saturating_sub(inc[i].accepted_ns);
                        let expired = match (&inc[i].request, inc[i].linked) {
                            (None, _) => age > REQUEST_DEADLINE_NS,
                            (Some(_), None) => age > PARKED_DEADLINE_NS,
                            (Some(_), Some(_)) => false,
                        };
                        if expired {
                            self.refused();
                            closed = true;
                        }
                        break;
                    }
                    Ok(Some((0, _))) | Err(_) => {
                        closed = true;
                        break;
                    }
                    Ok(Some((n, fds))) => {
                        ev.did = true;
                        if inc[i].request.is_some() {
                            // Later messages are wake-up bytes: reading them was the point.
                            continue;
                        }
                        match parse_hello(&buf[..n]) {
                            Some(r) if fds_fit(&fds) => {
                                inc[i].request = Some(r);
                                inc[i].fds = fds;
                                let qp = find(r.0);
                                if let Some(shm) = qp.as_ref().and_then(|q| q.shm.as_ref()) {
                                    if !self.link_from(shm, &mut inc[i]) {
                                        closed = true;
                                        break;
                                    }
                                }
                            }
                            _ => {
                                self.refused();
                                closed = true;
                                break;
                            }
                        }
                    }
                }
            }
            if closed {
                let gone = inc.swap_remove(i);
                if let (Some((ours, _)), Some(id)) = (gone.request, gone.linked) {
                    ev.peers_gone.push((ours, id));
                }
                ev.did = true;
            } else {
                i += 1;
            }
        }
    }

    /// Turns a pending link and the peer's hello into a linked QP. The descriptors must be a
    /// key table and a QP page: sealed memfds, mapped at exactly their kinds' sizes, stamped,
    /// with ring positions that agree.
    fn complete(&self, qp: &ShmQp, link: &mut Link, fds: Vec<OwnedFd>) -> io::Result<()> {
        let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
        let [table, page]: [OwnedFd; 2] = fds
            .try_into()
            .map_err(|_| invalid("a hello carries exactly two descriptors"))?;
        let table = KeyTable::from_map(SharedMap::from_fd(table, TABLE_LEN)?)?;
        let page = QpPage::from_map(SharedMap::from_fd(page, PAGE_LEN)?)?;
        let producer = page
            .ring()
            .producer()
            .map_err(|_| invalid("the peer's ring positions disagree"))?;
        let Link::Pending {
            out, peer_pid, id, ..
        } = std::mem::take(link)
        else {
            return Err(invalid("the QP is not linking"));
        };
        *link = Link::Linked(Box::new(PeerLink {
            out,
            pid: peer_pid,
            id,
            table: Arc::new(table),
            page: Arc::new(page),
            producer,
        }));
        qp.generation.fetch_add(1, Ordering::AcqRel);
        qp.linked.store(true, Ordering::Release);
        Ok(())
    }
}

pub(super) const HELLO_MAGIC: [u8; 4] = *b"FRSH";
pub(super) const HELLO_VERSION: u8 = 2;
pub(super) const HELLO_LEN: usize = 16;

/// Whether a hello's descriptors can be a key table and a QP page: two sealed memfds at least
/// as large as those (checked on arrival, so that nothing unfit is held while it waits).
fn fds_fit(fds: &[OwnedFd]) -> bool {
    let fits = |fd: &OwnedFd, len: usize| {
        super::map::require_sealed(fd.as_raw_fd()).is_ok_and(|st| st.st_size as u64 >= len as u64)
    };
    matches!(fds, [table, page] if fits(table, TABLE_LEN) && fits(page, PAGE_LEN))
}

/// The hello of QP `from`, linking to QP `to`.
pub(crate) fn hello(from: u32, to: u32) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..4].copy_from_slice(&HELLO_MAGIC);
    h[4] = HELLO_VERSION;
    h[8..12].copy_from_slice(&from.to_le_bytes());
    h[12..16].copy_from_slice(&to.to_le_bytes());
    h
}

/// `(to, from)` of a hello — our QP it is for, and the sending QP — or `None` for anything else
/// (another length, magic or version, or reserved bytes set).
pub(crate) fn parse_hello(msg: &[u8]) -> Option<(u32, u32)> {
    let h: &[u8; HELLO_LEN] = msg.try_into().ok()?;
    if h[0..4] != HELLO_MAGIC || h[4] != HELLO_VERSION || h[5..8] != [0, 0, 0] {
        return None;
    }
    let word = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
    Some((word(12), word(8)))
}

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
        let taken = std::mem::take(&mut *gone);
        drop(gone);
        let mut buf = vec![0u8; crate::provider::udp::MAX_DATAGRAM];
        for (qpn, id) in taken {
            // The hello connection of a link since replaced (the QP was reset, and maybe
            // connected anew) says nothing about the QP now.
            if let Some(qp) = self
                .qp(qpn)
                .filter(|q| q.shm.as_ref().is_some_and(|s| s.linked_to(id)))
            {
                // What the peer wrote before it went (the ACK of our last SEND, say) counts.
                super::transfer::drain_ring(self, &qp, &mut buf, now, usize::MAX);
                super::transfer::link_gone(&qp, id, self.fail_idle_qps_when_peer_goes);
            }
        }
        true
    }
}
