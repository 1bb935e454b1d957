//! The shared-memory provider: same-host peers without UDP, and one-sided operations that run
//! no code in the target process.
//!
//! # How it fits the verbs API
//! Every context (unless the provider is forced to UDP) publishes two things on the host:
//! - a **key table** in a memfd: for each registered region its key, protection domain,
//!   access rights, address, length, and the number and inode of the memfd holding its bytes
//!   (regions ferroce allocates live in memfds; see `mr`);
//! - a **listener**: an abstract Unix socket named after the context's RoCE address
//!   (`ferroce-shm/IP/PORT`). Abstract sockets live in the network namespace, so reaching it
//!   proves the peer is on this host and in this network namespace (peers in other namespaces —
//!   other "hosts" — keep using UDP).
//!
//! When a QP moves to RTR, it tries the listener of its destination address. If it answers, the
//! QP sends a hello carrying its QP number, its process id, and — with `SCM_RIGHTS` — the
//! descriptors of its context's key table and of its own **QP page** (its state, access flags,
//! protection domain and an inbound packet ring). The peer does the same from its side; a QP
//! whose own hello went out and whose peer's hello arrived is *linked*. With
//! [`Provider::Auto`] a QP whose destination has no listener uses UDP; [`Provider::Shm`] makes
//! that an error instead. A context that writes a packet capture uses UDP unless shm is forced,
//! since a capture is asked for to see the wire.
//!
//! # What moves how
//! - **WRITE, READ, COMPARE_SWAP, FETCH_ADD** on a linked QP whose send queue is idle are done
//!   by the initiator itself, inside `post_send`: it checks the target QP's state and access
//!   flags, the rkey in the target's key table, its protection domain, rights and bounds, maps
//!   the target region's memfd the first time it uses the rkey (opening
//!   `/proc/PID/fd/N` and checking the inode, so the target runs no code even then, and may be
//!   stopped), and copies, or applies a CPU atomic to the shared page. The completion is
//!   immediate.
//! - Everything else takes the **packet path**: the RC transport runs exactly as over UDP, but
//!   its packets go through the peer's inbound ring instead of a socket: SEND/RECV, WRITE with
//!   immediate, requests on a QP with requests already under way (so completions and execution
//!   stay in posting order), operations on regions the caller registered itself (their bytes
//!   are not in a memfd), and any request a check refuses — the target's own responder then
//!   refuses it with the IBTA status (remote access error, invalid request) and both QPs go to
//!   ERR, exactly as on the wire. A refused request never touches memory.
//! - A peer's engine that sleeps is woken by one byte on the hello connection; a peer process
//!   that dies closes that connection, and the survivor's QP goes to ERR (flushing its work).

pub(crate) mod direct;
pub(crate) mod map;
pub(crate) mod ring;
pub(crate) mod shortcut;

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferroce_proto::{Access, QpState};

use self::map::SharedMap;
use self::ring::Ring;

/// Which provider moves a QP's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Provider {
    /// Shared memory when the peer is on this host (and in this network namespace), UDP
    /// otherwise.
    #[default]
    Auto,
    /// RoCE v2 over UDP always.
    Udp,
    /// Shared memory always: connecting a QP to a peer it cannot reach that way fails.
    Shm,
}

impl Provider {
    /// The provider the `FERROCE_PROVIDER` environment variable names (`auto`, `udp`, `shm`),
    /// [`Provider::Auto`] when it is unset or empty.
    pub fn from_env() -> std::result::Result<Provider, String> {
        match std::env::var("FERROCE_PROVIDER") {
            Ok(v) if !v.is_empty() => v.parse().map_err(|e| format!("FERROCE_PROVIDER: {e}")),
            _ => Ok(Provider::Auto),
        }
    }

    /// The name `FromStr` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Auto => "auto",
            Provider::Udp => "udp",
            Provider::Shm => "shm",
        }
    }
}

impl FromStr for Provider {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Provider, String> {
        match s {
            "auto" => Ok(Provider::Auto),
            "udp" => Ok(Provider::Udp),
            "shm" => Ok(Provider::Shm),
            other => Err(format!("unknown provider {other:?} (auto, udp or shm)")),
        }
    }
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// ---- key table layout -------------------------------------------------------------------

const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"FRCESHT1");
/// Byte offset of the "engine sleeping" flag in a key table's header.
const TABLE_SLEEPING: usize = 8;
/// Where the slots start.
const TABLE_HEADER: usize = 4096;
/// Regions a table publishes: keys with a larger index are not reachable over shm (their
/// requests take the packet path, served by the target's engine).
pub(crate) const TABLE_SLOTS: usize = 1 << 16;
const SLOT: usize = 64;
const TABLE_LEN: usize = TABLE_HEADER + TABLE_SLOTS * SLOT;
// Slot fields (byte offsets in a slot).
const S_SEQ: usize = 0;
const S_KEY: usize = 8;
const S_PD: usize = 12;
const S_ACCESS: usize = 16;
const S_ADDR: usize = 24;
const S_LEN: usize = 32;
const S_FD: usize = 40;
const S_INODE: usize = 48;

// ---- QP page layout ---------------------------------------------------------------------

const PAGE_MAGIC: u64 = u64::from_le_bytes(*b"FRCESHQ1");
const P_STATE: usize = 8;
const P_ACCESS: usize = 12;
const P_PD: usize = 16;
const P_HEAD: usize = 64;
const P_TAIL: usize = 128;
const P_RING: usize = 4096;
/// Bytes of a QP's inbound packet ring.
const RING_BYTES: usize = 1 << 20;
const PAGE_LEN: usize = P_RING + RING_BYTES;

const HELLO_MAGIC: [u8; 4] = *b"FRSH";
const HELLO_VERSION: u8 = 1;
const HELLO_LEN: usize = 16;

fn state_code(s: QpState) -> u32 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Error => 6,
    }
}

/// Whether a QP in the state `state_code` names serves requests from its peer (RTR, RTS, SQD).
#[inline]
fn state_serves(code: u32) -> bool {
    matches!(code, 2..=4)
}

/// Creates a memfd of `len` bytes stamped with `magic`.
fn stamped(name: &str, len: usize, magic: u64) -> io::Result<SharedMap> {
    let map = SharedMap::create(name, len)?;
    map.u64_at(0).store(magic, Ordering::Release);
    Ok(map)
}

/// Accepts a peer's mapping only if it is at least `len` bytes and stamped with `magic`.
fn checked(map: SharedMap, len: usize, magic: u64, what: &str) -> io::Result<SharedMap> {
    if map.len() < len || map.u64_at(0).load(Ordering::Acquire) != magic {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a ferroce {what}"),
        ));
    }
    Ok(map)
}

/// What a slot of a key table says about a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PublishedRegion {
    pub key: u32,
    pub pd: u32,
    pub access: Access,
    pub addr: u64,
    pub len: u64,
    pub fd: i32,
    pub inode: u64,
}

impl PublishedRegion {
    /// The offset of `addr..addr + len` in the region, if an access through a peer QP in
    /// protection domain `pd` that needs `need` may touch it (and the region's bytes are in a
    /// memfd a peer can map).
    #[inline]
    fn admit(&self, pd: u32, need: Access, addr: u64, len: u64) -> Option<usize> {
        if self.pd != pd || !self.access.contains(need) || self.fd < 0 {
            return None;
        }
        let off = addr.checked_sub(self.addr)?;
        (off.checked_add(len)? <= self.len).then_some(off as usize)
    }
}

/// A key table (this context's, or a peer's mapped).
#[derive(Debug)]
pub(crate) struct KeyTable {
    map: SharedMap,
}

impl KeyTable {
    fn create() -> io::Result<KeyTable> {
        Ok(KeyTable {
            map: stamped("ferroce-keys", TABLE_LEN, TABLE_MAGIC)?,
        })
    }

    fn from_map(map: SharedMap) -> io::Result<KeyTable> {
        Ok(KeyTable {
            map: checked(map, TABLE_LEN, TABLE_MAGIC, "key table")?,
        })
    }

    fn slot(&self, index: usize) -> usize {
        TABLE_HEADER + index * SLOT
    }

    /// Publishes a region under `key` (only the owning context writes its table, under its
    /// region-table lock, so there is one writer per slot).
    pub(crate) fn publish(&self, r: &PublishedRegion) {
        self.write_slot(r.key, |s| {
            self.map.u32_at(s + S_KEY).store(r.key, Ordering::Relaxed);
            self.map.u32_at(s + S_PD).store(r.pd, Ordering::Relaxed);
            self.map
                .u32_at(s + S_ACCESS)
                .store(r.access.bits(), Ordering::Relaxed);
            self.map.u64_at(s + S_ADDR).store(r.addr, Ordering::Relaxed);
            self.map.u64_at(s + S_LEN).store(r.len, Ordering::Relaxed);
            self.map
                .u32_at(s + S_FD)
                .store(r.fd as u32, Ordering::Relaxed);
            self.map
                .u64_at(s + S_INODE)
                .store(r.inode, Ordering::Relaxed);
        });
    }

    /// Withdraws `key`: no new access finds it (one under way may still complete, into pages
    /// the memfd keeps alive for as long as the accessor maps them).
    pub(crate) fn withdraw(&self, key: u32) {
        self.write_slot(key, |s| {
            self.map.u32_at(s + S_KEY).store(0, Ordering::Relaxed);
        });
    }

    /// Rewrites the slot of `key` under its sequence number (odd while the fields change), so
    /// a reader never takes a half-written slot.
    fn write_slot(&self, key: u32, fill: impl FnOnce(usize)) {
        let index = (key >> 8) as usize;
        if index >= TABLE_SLOTS {
            return;
        }
        let s = self.slot(index);
        let seq = self.map.u64_at(s + S_SEQ);
        let start = seq.load(Ordering::Relaxed) | 1;
        seq.store(start, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        fill(s);
        seq.store(start + 1, Ordering::Release);
    }

    /// The sequence number of the slot `key` names, if it is at rest (not being rewritten):
    /// while it stays the same, so does the slot (every rewrite moves it on), so a reader that
    /// keeps what it read under a number need not read the slot again.
    #[inline]
    fn seq_at_rest(&self, key: u32) -> Option<u64> {
        let seq = self.seq_word(key)?.load(Ordering::Acquire);
        (seq & 1 == 0).then_some(seq)
    }

    /// The sequence number word of the slot `key` names (see `seq_at_rest`).
    #[inline]
    fn seq_word(&self, key: u32) -> Option<&AtomicU64> {
        let index = (key >> 8) as usize;
        (index < TABLE_SLOTS).then(|| self.map.u64_at(self.slot(index) + S_SEQ))
    }

    /// A consistent read of the slot `key` names, if it holds that key, with the slot's
    /// sequence number at the time.
    fn lookup(&self, key: u32) -> Option<(PublishedRegion, u64)> {
        let index = (key >> 8) as usize;
        if index >= TABLE_SLOTS || key & 0xff == 0 {
            return None;
        }
        let s = self.slot(index);
        let seq = self.map.u64_at(s + S_SEQ);
        for _ in 0..1000 {
            let before = seq.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let r = PublishedRegion {
                key: self.map.u32_at(s + S_KEY).load(Ordering::Relaxed),
                pd: self.map.u32_at(s + S_PD).load(Ordering::Relaxed),
                access: Access::from_bits(self.map.u32_at(s + S_ACCESS).load(Ordering::Relaxed)),
                addr: self.map.u64_at(s + S_ADDR).load(Ordering::Relaxed),
                len: self.map.u64_at(s + S_LEN).load(Ordering::Relaxed),
                fd: self.map.u32_at(s + S_FD).load(Ordering::Relaxed) as i32,
                inode: self.map.u64_at(s + S_INODE).load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == before {
                return (r.key == key).then_some((r, before));
            }
        }
        None
    }

    /// Tells peers whether this context's engine sleeps (and must be woken by a byte).
    pub(crate) fn set_sleeping(&self, sleeping: bool) {
        self.map
            .u32_at(TABLE_SLEEPING)
            .store(u32::from(sleeping), Ordering::SeqCst);
    }

    fn sleeping(&self) -> bool {
        self.map.u32_at(TABLE_SLEEPING).load(Ordering::SeqCst) != 0
    }
}

/// A QP page: this QP's published state and its inbound packet ring.
#[derive(Debug)]
pub(crate) struct QpPage {
    map: SharedMap,
}

impl QpPage {
    pub(crate) fn create() -> io::Result<QpPage> {
        Ok(QpPage {
            map: stamped("ferroce-qp", PAGE_LEN, PAGE_MAGIC)?,
        })
    }

    fn from_map(map: SharedMap) -> io::Result<QpPage> {
        Ok(QpPage {
            map: checked(map, PAGE_LEN, PAGE_MAGIC, "QP page")?,
        })
    }

    pub(crate) fn ring(&self) -> Ring {
        let p = self.map.ptr();
        // SAFETY: the three areas lie inside the mapping (PAGE_LEN checked or created), are
        // 8-aligned and disjoint, and the view is used only while `self` lives.
        unsafe {
            Ring::new(
                p.add(P_HEAD).cast(),
                p.add(P_TAIL).cast(),
                p.add(P_RING),
                RING_BYTES,
            )
        }
    }

    /// Publishes what a peer checks before it reaches memory through this QP.
    pub(crate) fn publish(&self, state: QpState, access: Option<Access>, pd: u32) {
        if let Some(a) = access {
            self.map.u32_at(P_ACCESS).store(a.bits(), Ordering::Release);
        }
        self.map.u32_at(P_PD).store(pd, Ordering::Release);
        self.map
            .u32_at(P_STATE)
            .store(state_code(state), Ordering::Release);
    }

    /// The words `publish` writes (state code, access bits, protection domain).
    #[inline]
    fn state_word(&self) -> &AtomicU32 {
        self.map.u32_at(P_STATE)
    }
    #[inline]
    fn access_word(&self) -> &AtomicU32 {
        self.map.u32_at(P_ACCESS)
    }
    #[inline]
    fn pd_word(&self) -> &AtomicU32 {
        self.map.u32_at(P_PD)
    }

    #[inline]
    fn serves(&self, need: Access) -> Option<u32> {
        let state = self.state_word().load(Ordering::Acquire);
        let access = Access::from_bits(self.access_word().load(Ordering::Acquire));
        let ok = state_serves(state) && access.contains(need);
        ok.then(|| self.pd_word().load(Ordering::Acquire))
    }
}

/// The peer region a QP used last: what its key-table slot said, under which sequence number,
/// and its mapping.
#[derive(Debug)]
struct LastRegion {
    region: PublishedRegion,
    seq: u64,
    map: Arc<SharedMap>,
}

/// A linked QP's view of its peer.
#[derive(Debug)]
pub(crate) struct PeerLink {
    /// The hello connection this side opened (wake-ups go down it).
    out: OwnedFd,
    pid: u32,
    table: Arc<KeyTable>,
    page: Arc<QpPage>,
}

/// A linked QP's way into its peer's memory, for one-sided operations done in `post_send`. A QP
/// keeps one under its own lock (beside the transport's QP, see `qp::QpCore`), so such a post
/// takes that one lock and nothing else, and each `QpSender` keeps one of its own, used without
/// any lock. It is made from the [`PeerLink`] and remade when the link's generation moves on.
#[derive(Debug)]
pub(crate) struct PeerMemory {
    /// The `ShmQp::generation` of the link it was made from.
    pub(crate) generation: u64,
    pid: u32,
    table: Arc<KeyTable>,
    page: Arc<QpPage>,
    /// Peer regions mapped so far, by key.
    regions: HashMap<u32, Arc<SharedMap>>,
    /// The peer region used last (a stream of operations mostly names one rkey), so the common
    /// case needs no hash lookup.
    last_region: Option<LastRegion>,
    /// This side's region used last by a local SGE (see `direct`).
    pub(crate) last_local: Option<direct::CachedLocal>,
}

/// Where a QP stands with the shared-memory provider.
#[derive(Debug, Default)]
pub(crate) enum Link {
    /// Not connected over shm (UDP, or not yet at RTR).
    #[default]
    Off,
    /// Our hello went out; the peer's has not arrived yet.
    Pending { out: OwnedFd, peer_qpn: u32 },
    /// Both hellos exchanged: packets go through rings, one-sided operations straight to memory.
    Linked(Box<PeerLink>),
    /// The peer went away: the QP was moved to ERR.
    Broken,
}

/// The shm side of one QP.
#[derive(Debug)]
pub(crate) struct ShmQp {
    pub page: QpPage,
    pub link: Mutex<Link>,
    /// Whether `link` is `Linked` (read without the lock on hot paths).
    pub linked: AtomicBool,
    /// Counts the links made, so a [`PeerMemory`] made from an earlier one is not used.
    pub generation: std::sync::atomic::AtomicU64,
}

impl ShmQp {
    pub(crate) fn new() -> io::Result<ShmQp> {
        Ok(ShmQp {
            page: QpPage::create()?,
            link: Mutex::new(Link::Off),
            linked: AtomicBool::new(false),
            generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this QP is linked to the peer QP whose page has inode `page` (each QP's page is
    /// a memfd of its own, so the inode names one peer QP, whatever its number: a QP reset and
    /// connected again may well reach a peer with its old peer's number).
    pub(crate) fn linked_to(&self, page: u64) -> bool {
        matches!(&*self.lock(), Link::Linked(p) if p.page.map.inode() == page)
    }
}

/// A hello that arrived before its QP reached RTR.
#[derive(Debug)]
struct Offer {
    peer_qpn: u32,
    pid: u32,
    table: SharedMap,
    page: SharedMap,
}

/// An accepted hello connection.
#[derive(Debug)]
struct Incoming {
    fd: OwnedFd,
    /// Our QP and the inode of the peer's QP page, once its hello arrived.
    hello: Option<(u32, u64)>,
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
    listener: OwnedFd,
    pid: u32,
    incoming: Mutex<Vec<Incoming>>,
    offers: Mutex<HashMap<u32, Offer>>,
    /// When (ns on the context clock) the listener was last looked at.
    last_poll: std::sync::atomic::AtomicU64,
}

/// How often an engine pass looks at the listener and hello connections. They carry hellos,
/// wake-up bytes and hang-ups, none urgent (a QP whose hello has not been read yet sends by
/// UDP meanwhile); looking costs system calls, which a busy-polling application pays in every
/// empty poll of its CQ.
const HOST_POLL_EVERY_NS: u64 = 100_000;

fn abstract_name(addr: SocketAddr) -> Vec<u8> {
    let mut v = vec![0u8];
    v.extend_from_slice(format!("ferroce-shm/{}/{}", addr.ip(), addr.port()).as_bytes());
    v
}

fn unix_addr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
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

fn seqpacket_socket() -> io::Result<OwnedFd> {
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
fn send_with_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
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
fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
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
        find: &dyn Fn(u32) -> Option<Arc<crate::qp::QpShared>>,
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
    fn take_hello(
        &self,
        msg: &[u8],
        fds: Vec<OwnedFd>,
        find: &dyn Fn(u32) -> Option<Arc<crate::qp::QpShared>>,
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
fn complete(qp: &ShmQp, link: &mut Link, offer: Offer) -> io::Result<()> {
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

impl PeerLink {
    /// The peer's inbound ring (where our packets go).
    pub(crate) fn ring(&self) -> Ring {
        self.page.ring()
    }

    /// Wakes the peer's engine if it sleeps.
    pub(crate) fn wake(&self) {
        if self.table.sleeping() {
            let b = [1u8];
            // SAFETY: sends one byte from a live buffer; a full socket already has wake-ups
            // queued, so EAGAIN is fine.
            let _ = unsafe {
                libc::send(
                    self.out.as_raw_fd(),
                    b.as_ptr().cast(),
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
        }
    }

    /// A fresh way into the peer's memory, stamped with the link's `generation`.
    pub(crate) fn memory(&self, generation: u64) -> PeerMemory {
        PeerMemory {
            generation,
            pid: self.pid,
            table: self.table.clone(),
            page: self.page.clone(),
            regions: HashMap::new(),
            last_region: None,
            last_local: None,
        }
    }
}

impl PeerMemory {
    /// The peer's region for `rkey`, checked against what an access through the peer QP needs:
    /// the QP serves (RTR/RTS/SQD, with the right enabled), the key is current, in the QP's
    /// protection domain, has the rights, and `addr..addr+len` lies inside it. Returns the
    /// region's mapping and the offset of `addr` in it.
    #[inline]
    pub(crate) fn resolve(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Option<(&SharedMap, usize)> {
        let pd = self.page.serves(need)?;
        // The common case: the key used last, its slot unchanged since (one load, where a
        // full read of the slot is eight and a check of the number after them).
        let current = self
            .last_region
            .as_ref()
            .is_some_and(|l| l.region.key == rkey && self.table.seq_at_rest(rkey) == Some(l.seq));
        if !current {
            self.look_up(rkey)?;
        }
        let l = self.last_region.as_ref()?;
        let off = l.region.admit(pd, need, addr, len)?;
        Some((&l.map, off))
    }

    /// Reads the slot of `rkey` afresh and makes it the last region, with its mapping (made
    /// now unless an earlier one is of the same region).
    #[cold]
    fn look_up(&mut self, rkey: u32) -> Option<()> {
        self.last_region = None;
        let (r, seq) = self.table.lookup(rkey)?;
        if r.fd < 0 {
            return None;
        }
        // The slot's inode and length say whether a mapping made earlier is of this region.
        let current = |m: &SharedMap| m.inode() == r.inode && m.len() as u64 >= r.len;
        let map = match self.regions.get(&rkey).filter(|m| current(m)) {
            Some(m) => m.clone(),
            None => {
                let m =
                    Arc::new(SharedMap::open_peer(self.pid, r.fd, r.inode, r.len as usize).ok()?);
                if self.regions.len() > 4096 {
                    self.regions.clear();
                }
                self.regions.insert(rkey, m.clone());
                m
            }
        };
        self.last_region = Some(LastRegion {
            region: r,
            seq,
            map,
        });
        Some(())
    }
}
