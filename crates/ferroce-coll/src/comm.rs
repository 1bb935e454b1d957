//! A communicator: the ranks of a job connected pairwise over ferroce, and the engine that moves
//! the collectives' bytes between them.
//!
//! # Set-up
//! Each rank opens one ferroce context (shared memory to ranks on its host, RoCE v2 over UDP to
//! the others: [`ferroce::Provider::Auto`]), creates one RC QP per other rank and registers the
//! regions peers write into: an *inbox* of `slots` slots of `slot_bytes` for each other rank, a
//! *header* word per slot (same-host peers, below) and a *credit* word for each other rank. One
//! exchange (the rendezvous's [`Store::all_gather`], the parent's allgather for a
//! [`split`](Communicator::split), or the caller's for [`Communicator::with_exchange`]) tells
//! every rank every other rank's QP endpoints and region keys, and each pair connects.
//!
//! # Messages and credits
//! Every byte moves the way NCCL's IB transport moves it. A message from rank `a` to rank `b` is
//! an RDMA WRITE of at most one slot into the next of `a`'s slots in `b`'s inbox, then a signal
//! that it is there. `b` reduces or copies the slot where it landed and tells `a` the slot is
//! free by WRITEing its count of consumed messages into `a`'s credit word for `b` (once half the
//! slots are consumed, or when it has waited `CREDIT_IDLE`). `a` sends only while fewer than
//! `slots` of its messages are unconsumed, so no slot is overwritten before it was read, and up
//! to `slots` messages are in flight to each peer.
//!
//! The signal depends on the link:
//! - **UDP**: a WRITE with immediate (zero-byte behind the data, or carrying bytes up to 64 KiB
//!   inline, unsignaled: nothing waits for an inline message's acknowledgement).
//! - **Shared memory**: a WRITE of the slot's header word, which `b` polls. Over shared memory a
//!   WRITE is one copy done in the post, straight into `b`'s memory, as long as nothing is queued
//!   before it; a WRITE with immediate would queue (it needs `b`'s receive and acknowledgement)
//!   and push every later message onto the packet path. Small messages and credits skip the
//!   post altogether: they are stored into `b`'s memory mapped here
//!   ([`ferroce::QueuePair::map_peer_region`]), the header last, with release ordering.
//!
//! The signal carries a 16-bit digest of the call (collective, sizes, type, operator, root) and
//! the message's index: ranks that call different collectives, or the same one with different
//! arguments, fail with [`CollError::Mismatch`] at their first message instead of exchanging
//! garbage.
//!
//! # Memory ordering
//! Two kinds of word carry the protocol between processes: a slot's *header word* (the sender
//! says "message `i` is in this slot") and a *credit word* (the receiver says "I consumed `c`
//! of your messages: their slots are free"). Each is set by one rank and polled by one other,
//! and its value only grows. Every access to one is a 64-bit atomic (`words.rs`); the bytes of
//! the slots are plain copies, ordered by those atomics:
//! - **A message.** The sender copies the bytes into the slot, then stores the header word
//!   with release ordering. The receiver loads the header word with acquire ordering; once it
//!   reads `(i + 1) << 16 | digest`, everything the sender did before its store (the copy) is
//!   visible, so the receiver's plain reads of the slot, in place, see the whole message.
//! - **A credit.** The receiver reduces or copies the slot, then stores its consumed count
//!   with release ordering. The sender loads that count with acquire ordering before it writes
//!   the slot again (`credit_available` before `post_message`): the receiver's reads of the
//!   slot happen before the sender's next writes to it, so a slot is never overwritten while
//!   it is read, and a reader never sees half of the next message.
//! - **Posted WRITEs.** Where the sender does not store itself (a message from a registered
//!   buffer, a link whose peer's regions did not map, every link over UDP), it stores the
//!   header or credit into a staging word with release ordering and posts WRITEs (data, then
//!   header) on the link's RC QP: ferroce places them in order, each word as one aligned
//!   8-byte store, and the receiver's acquire load pairs with that placement (that ferroce
//!   makes one WRITE's bytes visible before the next one's is its RC ordering, not this
//!   module's). Over UDP the
//!   message's signal is the WRITE with immediate, whose completion the CQ hands over after
//!   the data was placed.
//!
//! # Phases
//! A collective is a sequence of [`Phase`]s run by [`Communicator::run`]: sends whose bytes are
//! ready, and receives (each copied or reduced into place, then possibly forwarded to other
//! ranks, the way a ring or a chain passes data on). Every send and receive is cut into
//! messages of one slot; forwarding goes slice by slice, so a ring or a chain is pipelined.
//! A receive that overwrites bytes this rank sends in the phase waits until those sends were
//! posted and, unless their bytes were copied at the post, completed (`after`): a
//! retransmission over UDP reads its source again.
//!
//! # Failure
//! A phase that sees no progress for the communicator's timeout fails with
//! [`CollError::Timeout`]; a peer whose QP fails (it died) fails it with
//! [`CollError::Transfer`]. A rank whose collective fails tells every other rank (a WRITE with
//! an abort immediate) so that theirs fail at once with [`CollError::PeerFailed`], moves its
//! QPs to ERR (nothing is read from the caller's buffers after the call returns), and refuses
//! every later call with [`CollError::Broken`]: after a failure the ranks no longer agree on
//! where they are, as with NCCL's aborted communicators.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferroce::cm::{EndpointInfo, RemoteRegion, ENDPOINT_LEN};
use ferroce::{
    Access, CompletionQueue, ConnectOptions, Context, ContextOptions, MemoryRegion,
    ProtectionDomain, Provider, QpCaps, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, WcOpcode,
    WcStatus, WorkCompletion,
};

use crate::reduce::{reduce_into, DataType, ReduceOp};
use crate::store::{RankInfo, Store, StoreError};
use crate::words::{mapped, WordRegion};

/// How a communicator is made.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// How long a collective may go without progress (no message, no credit, no completion)
    /// before it fails.
    pub timeout: Duration,
    /// Bytes of one inbox slot: the largest message, and the unit of pipelining.
    pub slot_bytes: usize,
    /// Slots per peer: how many messages may be in flight to one peer.
    pub slots: usize,
    /// Allreduces up to this many bytes use recursive doubling (latency: `log2 n` exchanges)
    /// and broadcasts a binomial tree; larger ones a pipelined ring or chain (bandwidth).
    pub small_bytes: usize,
    /// Which provider carries the ranks' QPs (shared memory on one host, UDP between hosts).
    pub provider: Provider,
    /// The ferroce device to open; by default the one holding the address this host reaches
    /// the master from.
    pub device: Option<String>,
}

impl Default for CommOptions {
    fn default() -> CommOptions {
        CommOptions {
            timeout: Duration::from_secs(30),
            slot_bytes: 1 << 20,
            slots: 4,
            small_bytes: 64 << 10,
            provider: Provider::Auto,
            device: None,
        }
    }
}

/// Why a collective (or the set-up) failed.
#[derive(Debug, thiserror::Error)]
pub enum CollError {
    /// The rendezvous failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The caller's exchange (see [`Communicator::with_exchange`]) failed.
    #[error("the exchange of endpoints failed: {0}")]
    Exchange(String),
    /// A ferroce call failed.
    #[error("ferroce: {0}")]
    Verbs(#[from] ferroce::Error),
    /// No ferroce device fits.
    #[error("no ferroce device for {0}")]
    NoDevice(String),
    /// A rank's card does not parse, or was made with other options.
    #[error("rank {0} sent a card that does not fit: {1}")]
    BadCard(usize, String),
    /// A work request failed (the peer left, or refused the access).
    #[error("rank {rank}: {what} failed: {status:?}")]
    Transfer {
        /// The peer rank of the QP.
        rank: usize,
        /// What was under way.
        what: &'static str,
        /// The completion's status.
        status: WcStatus,
    },
    /// A peer called another collective, or the same one with other sizes, type, operator or
    /// root.
    #[error(
        "rank {rank} called a different collective, or the same one with another size, type, \
         operator or root (call digest {theirs:#06x}, ours {ours:#06x})"
    )]
    Mismatch {
        /// The peer rank.
        rank: usize,
        /// The digest of this rank's call.
        ours: u16,
        /// The digest the peer's message carried.
        theirs: u16,
    },
    /// A message arrived out of order (a bug, or a peer that is not a ferroce communicator).
    #[error("rank {rank} sent message {got} where {want} was due")]
    OutOfStep {
        /// The peer rank.
        rank: usize,
        /// The index received.
        got: u16,
        /// The index expected.
        want: u16,
    },
    /// Another rank's collective failed, and it said so.
    #[error("rank {rank} failed and aborted the collective")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
    },
    /// A peer stopped answering.
    #[error("no progress with rank {rank} within {timeout:?} ({what})")]
    Timeout {
        /// The peer rank.
        rank: usize,
        /// The deadline.
        timeout: Duration,
        /// What was awaited.
        what: &'static str,
    },
    /// An earlier collective of this communicator failed.
    #[error("the communicator is broken by an earlier failure: {0}")]
    Broken(String),
    /// Buffers whose sizes do not fit the collective.
    #[error("{what} of {got} bytes, {want} expected")]
    Size {
        /// Which buffer.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The size the collective needs.
        want: usize,
    },
    /// A rank number outside the communicator (a root or a peer).
    #[error("rank {rank} named, but the communicator has {size} ranks")]
    BadRank {
        /// The number given.
        rank: usize,
        /// The communicator's size.
        size: usize,
    },
    /// A buffer that is not a whole number of elements.
    #[error(transparent)]
    Reduce(#[from] crate::reduce::ReduceError),
}

/// Receive requests kept posted on each QP (each WRITE with immediate consumes one).
const RECV_DEPTH: usize = 64;
/// The immediate of an abort (its digest, `0xffff`, is never a call's).
const ABORT_IMM: u32 = u32::MAX;
/// Work-request ids: a message's is its index above bit 16 and its peer below; a credit's is
/// its peer with `CREDIT_WR` set; an abort's and a close's are their own.
const ABORT_WR: u64 = u64::MAX;
const PEER_BITS: u64 = 0x7fff;
/// The work-request id of the WRITE that closes a link when the communicator is dropped.
const CLOSE_WR: u64 = u64::MAX - 1;
const CREDIT_WR: u64 = 0x8000;
/// How long a rank waits with nothing to do before it sends the credits it owes (sooner, at
/// half its slots, in `consume`): a latency-bound exchange gets its next message first.
const CREDIT_IDLE: Duration = Duration::from_micros(50);
/// Messages up to this size carry their bytes inline in the WRITE with immediate.
const INLINE_BYTES: usize = 64 << 10;

/// One other rank as this rank sees it.
struct Link {
    qp: QueuePair,
    /// This rank's slots in the peer's inbox.
    slots: RemoteRegion,
    /// This rank's credit word in the peer's credit region.
    credit: RemoteRegion,
    /// This rank's header words (one per slot) in the peer's header region.
    headers: RemoteRegion,
    /// Messages posted to the peer.
    sent: u64,
    /// Of those, how many completed (the peer's transport acknowledged them).
    done: u64,
    /// How many messages must complete before no request reads a caller's buffer any more
    /// (an inline message was copied at its post, so it needs no waiting for).
    reads_until: u64,
    /// Messages from the peer consumed.
    consumed: u64,
    /// The consumed count last written to the peer's credit word.
    credited: u64,
    /// Immediates of messages arrived with one and not yet consumed, in order.
    arrived: VecDeque<u32>,
    /// Receives posted and not yet consumed.
    posted: usize,
    /// The status its QP failed with (the peer died or left).
    failed: Option<WcStatus>,
    /// A same-host peer's slots, header words and credit word mapped here, once the link
    /// came up over shared memory.
    maps: Option<PeerMaps>,
    /// Attempts to map them that failed (after a few, the link keeps to posted WRITEs).
    map_failures: u8,
    /// Whether the running phase sends to, receives from or forwards to the peer.
    involved: bool,
    /// `sent` when the running phase began.
    base: u64,
    /// The running phase's slices still to send to the peer: source (an index into the
    /// phase's sends, or `FORWARDED` and an index into its receives), offset, length.
    outq: VecDeque<(u32, usize, usize)>,
    /// The running phase's receives from the peer still to come: index, bytes taken.
    inq: VecDeque<(u32, usize)>,
}

/// What a rank stores into directly on a same-host peer: see [`Link::maps`].
struct PeerMaps {
    slots: ferroce::PeerRegionMap,
    headers: ferroce::PeerRegionMap,
    credit: ferroce::PeerRegionMap,
}

impl Link {
    /// The peer's mapped words, if the link is over shared memory and they map.
    fn maps(&mut self) -> Option<&PeerMaps> {
        if self.maps.is_none() && self.map_failures < 8 && self.qp.provider() == Provider::Shm {
            let write = Access::REMOTE_WRITE;
            let map = |r: RemoteRegion| {
                self.qp
                    .map_peer_region(r.addr, r.rkey, r.len as usize, write)
            };
            self.maps = map(self.slots)
                .zip(map(self.headers))
                .zip(map(self.credit))
                .map(|((slots, headers), credit)| PeerMaps {
                    slots,
                    headers,
                    credit,
                })
                // Words a peer placed at a misaligned address (its card lied) are not stored
                // into as atomics: the link keeps to posted WRITEs.
                .filter(|m| mapped(&m.headers, 0).is_some() && mapped(&m.credit, 0).is_some());
            self.map_failures += u8::from(self.maps.is_none());
        }
        self.maps.as_ref()
    }
}

/// Where a send's bytes are.
#[derive(Clone, Copy)]
pub(crate) enum Src<'a> {
    /// In a registered region (offsets are into it).
    Mr(&'a MemoryRegion),
    /// At a pointer (offsets are from it), for messages of at most `stage_bytes`: they are
    /// copied at their post (into the request over UDP, into a staging slot over shared
    /// memory), so a small collective registers nothing.
    Ptr(*const u8),
}

impl<'a> From<&'a MemoryRegion> for Src<'a> {
    fn from(mr: &'a MemoryRegion) -> Src<'a> {
        Src::Mr(mr)
    }
}

/// Bytes a phase sends: `len` bytes at `off` of `mr`.
#[derive(Clone, Copy)]
pub(crate) struct Out<'a> {
    pub(crate) peer: usize,
    pub(crate) mr: Src<'a>,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

/// What becomes of received bytes.
#[derive(Clone, Copy)]
pub(crate) enum Action {
    /// Copied to the pointer.
    Copy(*mut u8),
    /// Reduced into the bytes at the pointer.
    Reduce(*mut u8, DataType, ReduceOp),
    /// Reduced with the bytes at the first pointer into the second (out of place: a copy of
    /// each block, still in L1, then the reduction).
    ReduceFrom(*const u8, *mut u8, DataType, ReduceOp),
}

/// Bytes a phase receives from `peer`.
pub(crate) struct In<'a> {
    pub(crate) peer: usize,
    pub(crate) len: usize,
    pub(crate) action: Action,
    /// Ranks to pass the bytes on to once they are in place: they are sent from `src` (the
    /// registered region and offset where the action left them).
    pub(crate) forward: Vec<usize>,
    pub(crate) src: Option<(Src<'a>, usize)>,
    /// Before its action: how many of this phase's messages to a rank must have completed
    /// (the action overwrites bytes those messages were sent from).
    pub(crate) after: Option<(usize, u64)>,
}

/// One step of a collective: see the module doc.
#[derive(Default)]
pub(crate) struct Phase<'a> {
    pub(crate) outs: Vec<Out<'a>>,
    pub(crate) ins: Vec<In<'a>>,
    /// Messages are at most this long (a whole number of elements, at most a slot).
    pub(crate) slice: usize,
}

/// How many messages `len` bytes take in slices of `slice`.
pub(crate) fn messages(len: usize, slice: usize) -> u64 {
    len.div_ceil(slice) as u64
}

/// The ranks of a job, connected; see the module doc.
pub struct Communicator {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    store: Option<Store>,
    pub(crate) opts: CommOptions,
    links: Vec<Option<Link>>,
    /// Where peers' messages land: `slots` slots of `slot_bytes` for each rank, by rank.
    inbox: MemoryRegion,
    /// Where each peer writes how many of this rank's messages it consumed, a word by rank.
    credits: WordRegion,
    /// Where the credit WRITEs take their words from, a word by rank.
    credit_src: WordRegion,
    /// Where same-host peers mark their messages arrived: a word per slot, by rank.
    headers: WordRegion,
    /// Where the header WRITEs take their words from, a word per slot, by rank.
    header_src: WordRegion,
    /// Where small messages from a pointer are staged for same-host peers:
    /// `stage_bytes` per slot, by rank.
    stage: MemoryRegion,
    /// Whether this host has more of the communicator's ranks than cores.
    oversubscribed: bool,
    /// The cores this process may run on, read once (the standard library reads cgroup files
    /// to tell).
    cores: usize,
    /// Phases run (when to look at `oversubscribed` again).
    runs: u64,
    /// Completions of sends and receives both: one poll (and one pass over the socket, when
    /// this thread drives progress) sees everything.
    cq: CompletionQueue,
    _pd: ProtectionDomain,
    ctx: Context,
    /// Why the communicator is broken, if it is.
    broken: Option<String>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

/// The ferroce device holding the address this host reaches `master` from.
fn device_for(master: SocketAddr) -> Result<ferroce::Device, CollError> {
    let local: IpAddr = if master.ip().is_loopback() {
        master.ip()
    } else {
        let any = if master.is_ipv4() {
            IpAddr::from([0, 0, 0, 0])
        } else {
            IpAddr::from([0u16; 8])
        };
        UdpSocket::bind(SocketAddr::new(any, 0))
            .and_then(|s| s.connect(master).map(|_| s))
            .and_then(|s| s.local_addr())
            .map_err(|e| CollError::NoDevice(format!("a route to {master}: {e}")))?
            .ip()
    };
    let gid = ferroce::gid_of(local);
    ferroce::devices()?
        .into_iter()
        .find(|d| d.gids().iter().any(|g| g.gid == gid))
        .ok_or_else(|| CollError::NoDevice(local.to_string()))
}

/// How a rank waits: it spins, and gives the CPU away now and then (at every poll when its
/// host has more ranks than cores, as Open MPI does when oversubscribed), so that ranks and
/// their engines that share a core all make progress. The clock is read once when a wait
/// begins and then every 64 polls, not at every poll.
struct Idler {
    polls: u32,
    since: Option<Instant>,
    yield_every: u32,
}

impl Idler {
    fn new(oversubscribed: bool) -> Idler {
        Idler {
            polls: 0,
            since: None,
            yield_every: if oversubscribed { 1 } else { 64 },
        }
    }

    /// Something happened: the next wait starts afresh.
    fn progressed(&mut self) {
        self.since = None;
    }

    /// One empty poll; returns how long this wait has lasted when it read the clock.
    fn idle(&mut self) -> Option<Duration> {
        self.polls = self.polls.wrapping_add(1);
        if self.polls % self.yield_every == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        match self.since {
            None => {
                self.since = Some(Instant::now());
                Some(Duration::ZERO)
            }
            Some(t) if self.polls % 64 == 0 => Some(t.elapsed()),
            Some(_) => None,
        }
    }
}

/// The 16-bit digest of a call that every message of it carries (never `0xffff`).
pub(crate) fn digest(kind: u8, parts: &[u64]) -> u16 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ u64::from(kind);
    for p in parts {
        for b in p.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let d = (h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48)) as u16;
    if d == 0xffff {
        0xfffe
    } else {
        d
    }
}

/// `n` words from the OS's random source (`/dev/urandom`, which the kernel's `getrandom` also
/// draws from); if it cannot be read, from std's `RandomState`, whose keys the standard library
/// draws from the same source.
fn random_words(n: usize) -> Vec<u32> {
    use std::io::Read;
    let mut bytes = vec![0u8; 4 * n];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        use std::hash::{BuildHasher, Hasher};
        let state = std::collections::hash_map::RandomState::new();
        for (i, c) in bytes.chunks_mut(8).enumerate() {
            let mut h = state.build_hasher();
            h.write_usize(i);
            let v = h.finish().to_ne_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

const CARD_HEADER: usize = 8 + 4 + 3 * 20;

fn put_region(card: &mut Vec<u8>, r: RemoteRegion) {
    card.extend_from_slice(&r.addr.to_be_bytes());
    card.extend_from_slice(&r.len.to_be_bytes());
    card.extend_from_slice(&r.rkey.to_be_bytes());
}

fn get_region(b: &[u8]) -> RemoteRegion {
    let word = |r: std::ops::Range<usize>| b[r].iter().fold(0u64, |a, &x| a << 8 | u64::from(x));
    RemoteRegion {
        addr: word(0..8),
        len: word(8..16),
        rkey: word(16..20) as u32,
    }
}

fn region_of(mr: &MemoryRegion) -> RemoteRegion {
    RemoteRegion {
        addr: mr.addr(),
        rkey: mr.rkey(),
        len: mr.len() as u64,
    }
}

impl Communicator {
    /// Joins the job torchrun's environment describes (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; see [`RankInfo::from_env`]).
    pub fn from_env(opts: &CommOptions) -> Result<Communicator, CollError> {
        let info = RankInfo::from_env()?;
        let store = Store::join(&info, opts.timeout)?;
        Communicator::with_store(store, info.master, opts)
    }

    /// Connects the ranks of `store` (whose rendezvous is at `master`).
    pub fn with_store(
        mut store: Store,
        master: SocketAddr,
        opts: &CommOptions,
    ) -> Result<Communicator, CollError> {
        let device = match &opts.device {
            Some(name) => ferroce::device_by_name(name)?,
            None => device_for(master)?,
        };
        let (rank, size) = (store.rank(), store.world_size());
        let mut comm =
            Communicator::build(
                rank,
                size,
                &device,
                opts,
                |card| Ok(store.all_gather(card)?),
            )?;
        // Every rank's QPs are ready before anyone sends.
        store.all_gather(&[])?;
        comm.store = Some(store);
        Ok(comm)
    }

    /// Connects rank `rank` of `size` through an exchange the caller provides (another
    /// framework's key-value store, say: torch.distributed's): `exchange(card)` hands this
    /// rank's bytes to every rank and returns every rank's, in rank order; it is called twice
    /// (the cards, then an empty one that tells every rank all QPs are ready). The device is
    /// `opts.device`, else the one holding the address this host reaches `master` from, else
    /// loopback's.
    pub fn with_exchange(
        rank: usize,
        size: usize,
        master: Option<SocketAddr>,
        opts: &CommOptions,
        mut exchange: impl FnMut(&[u8]) -> Result<Vec<Vec<u8>>, String>,
    ) -> Result<Communicator, CollError> {
        if size == 0 || rank >= size {
            return Err(CollError::BadRank { rank, size });
        }
        let device = match (&opts.device, master) {
            (Some(name), _) => ferroce::device_by_name(name)?,
            (None, Some(m)) => device_for(m)?,
            (None, None) => device_for(SocketAddr::from(([127, 0, 0, 1], 0)))?,
        };
        let comm = Communicator::build(rank, size, &device, opts, |card| {
            exchange(card).map_err(CollError::Exchange)
        })?;
        exchange(&[]).map_err(CollError::Exchange)?;
        Ok(comm)
    }

    /// Opens this rank's context and regions, exchanges cards through `exchange` (which returns
    /// every rank's card in rank order) and connects a QP to every other rank.
    fn build(
        rank: usize,
        size: usize,
        device: &ferroce::Device,
        opts: &CommOptions,
        exchange: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, CollError>,
    ) -> Result<Communicator, CollError> {
        let mut opts = opts.clone();
        opts.slot_bytes = opts.slot_bytes.max(64);
        opts.slots = opts.slots.max(1);
        let ctx = device.open(&ContextOptions {
            provider: opts.provider,
            capture: None,
            ..ContextOptions::with_port(0)
        })?;
        let pd = ctx.alloc_pd()?;
        let per_peer = 2 * opts.slots + 8;
        let cq = ctx.create_cq((per_peer * 4 + RECV_DEPTH + 16) * size.max(1), None)?;
        let remote_write = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE);
        let inbox = pd.alloc_mr(size * opts.slots * opts.slot_bytes, remote_write)?;
        let credits = WordRegion::alloc(&pd, size, remote_write)?;
        let credit_src = WordRegion::alloc(&pd, size, Access::LOCAL_WRITE)?;
        let headers = WordRegion::alloc(&pd, size * opts.slots, remote_write)?;
        let header_src = WordRegion::alloc(&pd, size * opts.slots, Access::LOCAL_WRITE)?;
        let stage = pd.alloc_mr(
            size * opts.slots * opts.slot_bytes.min(INLINE_BYTES),
            Access::LOCAL_WRITE,
        )?;
        let caps = QpCaps {
            max_send_wr: (4 * opts.slots + 64) as u32,
            max_recv_wr: RECV_DEPTH as u32,
            max_inline_data: INLINE_BYTES as u32,
            ..QpCaps::default()
        };
        let mut qps: Vec<Option<QueuePair>> = Vec::with_capacity(size);
        for r in 0..size {
            qps.push(if r == rank {
                None
            } else {
                Some(pd.create_qp(&QpInitAttr {
                    send_cq: &cq,
                    recv_cq: &cq,
                    caps,
                    srq: None,
                })?)
            });
        }
        // The card: the slot geometry, the inbox and credit regions, then one endpoint per rank
        // (a zero record for itself).
        // Initial PSNs come from the OS's random source, as the drop-in's CM chooses them: a
        // stranger who cannot see the traffic cannot guess where a QP's sequence stands (a
        // PSN derived from the QP number would tell it).
        let mut seeds = random_words(size).into_iter();
        let mut psn = || ferroce::Psn::new(seeds.next().unwrap_or_default() & 0xff_ffff);
        let mut card = Vec::with_capacity(CARD_HEADER + size * ENDPOINT_LEN);
        card.extend_from_slice(&(opts.slot_bytes as u64).to_be_bytes());
        card.extend_from_slice(&(opts.slots as u32).to_be_bytes());
        put_region(&mut card, region_of(&inbox));
        put_region(&mut card, region_of(credits.mr()));
        put_region(&mut card, region_of(headers.mr()));
        let mut locals = Vec::with_capacity(size);
        for q in &qps {
            let e = q.as_ref().map(|q| q.endpoint_info(psn(), None));
            match &e {
                Some(e) => card.extend_from_slice(&e.to_bytes()),
                None => card.extend_from_slice(&[0u8; ENDPOINT_LEN]),
            }
            locals.push(e);
        }
        let cards = exchange(&card)?;
        let mut links = Vec::with_capacity(size);
        for (r, (q, local)) in qps.into_iter().zip(locals).enumerate() {
            let (Some(qp), Some(local)) = (q, local) else {
                links.push(None);
                continue;
            };
            let c = cards.get(r).map(Vec::as_slice).unwrap_or_default();
            let want = CARD_HEADER + size * ENDPOINT_LEN;
            if c.len() < want {
                return Err(CollError::BadCard(
                    r,
                    format!("{} bytes, {want} expected", c.len()),
                ));
            }
            let slot_bytes = u64::from_be_bytes(c[0..8].try_into().unwrap_or_default());
            let slots = u32::from_be_bytes([c[8], c[9], c[10], c[11]]);
            if slot_bytes != opts.slot_bytes as u64 || slots as usize != opts.slots {
                return Err(CollError::BadCard(
                    r,
                    format!(
                        "{slots} slots of {slot_bytes} bytes, this rank uses {} of {}",
                        opts.slots, opts.slot_bytes
                    ),
                ));
            }
            let inbox_of = get_region(&c[12..32]);
            let credits_of = get_region(&c[32..52]);
            let headers_of = get_region(&c[52..72]);
            let area = (opts.slots * opts.slot_bytes) as u64;
            let at = CARD_HEADER + rank * ENDPOINT_LEN;
            let peer = EndpointInfo::from_bytes(&c[at..at + ENDPOINT_LEN])
                .map_err(|e| CollError::BadCard(r, e.to_string()))?;
            if inbox_of.len < area * size as u64
                || credits_of.len < 8 * size as u64
                || headers_of.len < 8 * (size * opts.slots) as u64
            {
                return Err(CollError::BadCard(r, "regions too small".into()));
            }
            qp.connect(&local, &peer, &ConnectOptions::default())?;
            for i in 0..RECV_DEPTH {
                qp.post_recv(RecvWr {
                    wr_id: i as u64,
                    sgl: vec![],
                })?;
            }
            links.push(Some(Link {
                qp,
                slots: RemoteRegion {
                    addr: inbox_of.addr + area * rank as u64,
                    len: area,
                    rkey: inbox_of.rkey,
                },
                credit: RemoteRegion {
                    addr: credits_of.addr + 8 * rank as u64,
                    len: 8,
                    rkey: credits_of.rkey,
                },
                headers: RemoteRegion {
                    addr: headers_of.addr + (8 * opts.slots * rank) as u64,
                    len: 8 * opts.slots as u64,
                    rkey: headers_of.rkey,
                },
                sent: 0,
                done: 0,
                reads_until: 0,
                consumed: 0,
                credited: 0,
                arrived: VecDeque::new(),
                posted: RECV_DEPTH,
                failed: None,
                maps: None,
                map_failures: 0,
                involved: false,
                base: 0,
                outq: VecDeque::new(),
                inq: VecDeque::new(),
            }));
        }
        Ok(Communicator {
            rank,
            size,
            store: None,
            opts,
            links,
            inbox,
            credits,
            credit_src,
            headers,
            header_src,
            stage,
            oversubscribed: false,
            cores: std::thread::available_parallelism().map_or(1, |c| c.get()),
            runs: 0,
            cq,
            _pd: pd,
            ctx,
            broken: None,
        })
    }

    /// Splits the communicator by colour, as `MPI_Comm_split` and `ncclCommSplit` do: every
    /// rank calls it; the ranks passing the same `color` form a new communicator, ranked by
    /// `key` (ties by their rank here). A rank passing `None` takes part in the exchange and
    /// gets `None`. The new communicator has its own QPs and regions; this one stays usable.
    pub fn split(
        &mut self,
        color: Option<u32>,
        key: u32,
    ) -> Result<Option<Communicator>, CollError> {
        let n = self.size;
        let mut mine = [0u8; 16];
        mine[..8].copy_from_slice(&color.map_or(u64::MAX, u64::from).to_le_bytes());
        mine[8..12].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; 16 * n];
        self.allgather(&mine, &mut all)?;
        let color_of = |r: usize| u64::from_le_bytes(all[16 * r..16 * r + 8].try_into().unwrap());
        let key_of =
            |r: usize| u32::from_le_bytes(all[16 * r + 8..16 * r + 12].try_into().unwrap());
        let mut group: Vec<usize> = match color {
            Some(_) => (0..n)
                .filter(|&r| color_of(r) == color_of(self.rank))
                .collect(),
            None => Vec::new(),
        };
        group.sort_by_key(|&r| (key_of(r), r));
        // Every rank hands in a card of the largest size, so that one allgather carries them.
        let card_len = 4 + CARD_HEADER + n * ENDPOINT_LEN;
        let device = self.ctx.device().clone();
        let opts = self.opts.clone();
        let new_rank = group.iter().position(|&r| r == self.rank);
        let sub = match new_rank {
            Some(new_rank) => {
                let comm = Communicator::build(new_rank, group.len(), &device, &opts, |card| {
                    let mut padded = vec![0u8; card_len];
                    padded[..4].copy_from_slice(&(card.len() as u32).to_le_bytes());
                    padded[4..4 + card.len()].copy_from_slice(card);
                    let mut cards = vec![0u8; card_len * n];
                    self.allgather(&padded, &mut cards)?;
                    let of = |r: usize| {
                        let c = &cards[card_len * r..card_len * (r + 1)];
                        let len = (u32::from_le_bytes(c[..4].try_into().unwrap()) as usize)
                            .min(card_len - 4);
                        c[4..4 + len].to_vec()
                    };
                    Ok(group.iter().map(|&r| of(r)).collect())
                })?;
                Some(comm)
            }
            None => {
                let mut cards = vec![0u8; card_len * n];
                self.allgather(&vec![0u8; card_len], &mut cards)?;
                None
            }
        };
        // Every new QP is ready before anyone sends on it.
        self.barrier()?;
        Ok(sub)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The rendezvous, for exchanges outside the collectives (`None` for a communicator made
    /// by [`split`](Self::split)).
    pub fn store(&mut self) -> Option<&mut Store> {
        self.store.as_mut()
    }

    /// Which provider carries the QP to `peer` (`None` for this rank itself).
    pub fn provider_to(&self, peer: usize) -> Option<Provider> {
        self.links.get(peer)?.as_ref().map(|l| l.qp.provider())
    }

    /// Refuses a call on a broken communicator.
    pub(crate) fn usable(&self) -> Result<(), CollError> {
        match &self.broken {
            Some(why) => Err(CollError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    /// Checks a rank number.
    pub(crate) fn check_rank(&self, rank: usize) -> Result<(), CollError> {
        if rank < self.size {
            Ok(())
        } else {
            Err(CollError::BadRank {
                rank,
                size: self.size,
            })
        }
    }

    /// Registers `len` bytes at `ptr` as a source of this rank's sends (`None` for none).
    ///
    /// # Safety
    /// The bytes must stay valid for reads until the region is dropped, and while a send from
    /// them is outstanding nothing may write them. The region grants no remote access, so no
    /// peer can write or read it; ferroce reads it only for the sends this communicator posts,
    /// all of which complete (or fail, and the QPs go to ERR) before the collective returns —
    /// which is what lets the caller keep using the buffer between collectives, and this
    /// module write parts of it no outstanding send reads.
    pub(crate) unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
    ) -> Result<Option<MemoryRegion>, CollError> {
        if len == 0 {
            return Ok(None);
        }
        let Some(p) = NonNull::new(ptr.cast_mut()) else {
            return Ok(None);
        };
        // SAFETY: the caller's contract above covers `register_raw`'s: nothing else reads or
        // writes the bytes through the region, since it grants no remote rights and no receive
        // names it.
        Ok(Some(unsafe {
            self._pd.register_raw(p, len, Access::NONE)
        }?))
    }

    /// Runs `f` (a collective's phases), and on failure breaks the communicator (see the
    /// module doc).
    pub(crate) fn guarded<R>(
        &mut self,
        f: impl FnOnce(&mut Communicator) -> Result<R, CollError>,
    ) -> Result<R, CollError> {
        self.usable()?;
        let r = f(self);
        if let Err(e) = &r {
            self.break_with(e);
        }
        r
    }

    /// Tells every peer the collective failed, waits a moment for those messages to leave,
    /// and moves every QP to ERR.
    fn break_with(&mut self, e: &CollError) {
        self.broken = Some(e.to_string());
        self.post_last(ABORT_WR, Duration::from_millis(200));
        for l in self.links.iter().flatten() {
            l.qp.modify_to_error();
        }
    }

    /// Posts a last signaled request to every live peer (an abort, or a zero-byte WRITE that
    /// closes the link) and waits up to `wait` for them all to complete: by RC's ordering,
    /// everything posted before (credits a peer still needs) has then arrived too.
    fn post_last(&mut self, wr_id: u64, wait: Duration) {
        let mut outstanding = 0;
        for l in self.links.iter().flatten().filter(|l| l.failed.is_none()) {
            let op = if wr_id == ABORT_WR {
                SendOp::WriteWithImm(ABORT_IMM)
            } else {
                SendOp::Write
            };
            let wr = SendWr::new(wr_id, op, vec![]).remote(l.slots.addr, l.slots.rkey);
            outstanding += usize::from(l.qp.post_send(wr).is_ok());
        }
        let until = Instant::now() + wait;
        while outstanding > 0 && Instant::now() < until {
            match self.cq.poll_one() {
                Ok(Some(wc)) if wc.wr_id == wr_id => outstanding -= 1,
                Ok(Some(_)) => {}
                Ok(None) => std::thread::yield_now(),
                Err(_) => break,
            }
        }
    }

    /// Runs one phase: see the module doc.
    ///
    /// # Safety
    /// Every `Action` pointer must be valid for writes of its `len` bytes (and reads, for a
    /// reduction) during the call, and nothing else may access those bytes meanwhile except
    /// this phase's sends from them, ordered by `after`; every `Out` and forward source must
    /// hold its bytes until the call returns.
    pub(crate) unsafe fn run(&mut self, digest: u16, phase: Phase<'_>) -> Result<(), CollError> {
        // SAFETY: the same contract.
        unsafe { self.run_with(digest, digest, phase) }
    }

    /// As [`run`](Self::run), with messages sent carrying `out_digest` and those received
    /// expected to carry `in_digest` (a send and a receive of different calls in one phase).
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    pub(crate) unsafe fn run_with(
        &mut self,
        out_digest: u16,
        in_digest: u16,
        phase: Phase<'_>,
    ) -> Result<(), CollError> {
        let n = self.size;
        let slice = phase.slice.clamp(1, self.opts.slot_bytes);
        // Per-link state lives in the links and is reused from phase to phase, so a phase
        // allocates nothing once the queues have grown: a latency-bound exchange is a few
        // hundred nanoseconds, where every allocation shows.
        for l in self.links.iter_mut().flatten() {
            l.involved = false;
            l.base = l.sent;
            l.outq.clear();
            l.inq.clear();
        }
        let bad = |c: &Communicator, p: usize| {
            if p >= n || c.links[p].is_none() {
                Err(CollError::BadRank { rank: p, size: n })
            } else {
                Ok(())
            }
        };
        for (i, o) in phase.outs.iter().enumerate() {
            bad(self, o.peer)?;
            let l = self.links[o.peer].as_mut().expect("checked");
            l.involved = true;
            push_slices(&mut l.outq, i as u32, o.off, o.len, slice);
        }
        for (j, i) in phase.ins.iter().enumerate() {
            bad(self, i.peer)?;
            for &f in &i.forward {
                bad(self, f)?;
                self.links[f].as_mut().expect("checked").involved = true;
            }
            let l = self.links[i.peer].as_mut().expect("checked");
            l.involved = true;
            if i.len > 0 {
                l.inq.push_back((j as u32, 0));
            }
        }
        if self.runs % 64 == 0 {
            // Links come up over shared memory a moment after they connect: look again now
            // and then.
            self.oversubscribed = self.host_oversubscribed();
        }
        self.runs = self.runs.wrapping_add(1);
        let mut idler = Idler::new(self.oversubscribed);
        // Same-host messages arrive in memory (header words), not in the CQ: with only such
        // peers the CQ (send completions, aborts, failures) is looked at every 16th turn, which
        // spares most turns a pass over the context's rings and sockets.
        let cq_every = if self
            .links
            .iter()
            .flatten()
            .any(|l| l.involved && l.qp.provider() != Provider::Shm)
        {
            1
        } else {
            16
        };
        let source = |r: u32| -> Src<'_> {
            if r & FORWARDED != 0 {
                phase.ins[(r & !FORWARDED) as usize]
                    .src
                    .expect("forwarded from a source")
                    .0
            } else {
                phase.outs[r as usize].mr
            }
        };
        let mut turn = 0u32;
        loop {
            let mut progressed = false;
            turn = turn.wrapping_add(1);
            for p in 0..n {
                while let Some(&(r, off, len)) = self.links[p].as_ref().and_then(|l| l.outq.front())
                {
                    if !self.credit_available(p)? {
                        break;
                    }
                    self.links[p].as_mut().expect("a link").outq.pop_front();
                    // SAFETY: the caller's contract covers every source of the phase.
                    unsafe { self.post_message(p, out_digest, source(r), off, len) }?;
                    progressed = true;
                }
            }
            if turn % cq_every == 0 {
                progressed |= self.poll()?;
            }
            for p in 0..n {
                while let Some(&(j, done)) = self.links[p].as_ref().and_then(|l| l.inq.front()) {
                    let item = &phase.ins[j as usize];
                    let Some(imm) = self.next_arrival(p)? else {
                        break;
                    };
                    if let Some((q, count)) = item.after {
                        // The messages must have been posted (an inline one copies its bytes
                        // then), and those that read the buffer later must have completed.
                        let l = self.links[q].as_ref().expect("checked");
                        let upto = l.base + count;
                        if l.sent < upto || l.done < upto.min(l.reads_until) {
                            break;
                        }
                    }
                    let len = slice.min(item.len - done);
                    let at = done;
                    self.consume(p, imm, in_digest, len, |src| {
                        // SAFETY: the caller vouches for the action's pointer over the item's
                        // `len` bytes, of which `at..at + len` is a part.
                        unsafe { apply(item, src, at, len) }
                    })?;
                    if let Some((_, off)) = item.src {
                        for &f in &item.forward {
                            let l = self.links[f].as_mut().expect("checked");
                            l.outq.push_back((FORWARDED | j, off + at, len));
                        }
                    }
                    let l = self.links[p].as_mut().expect("checked");
                    let front = l.inq.front_mut().expect("the item taken");
                    front.1 += len;
                    if front.1 == item.len {
                        l.inq.pop_front();
                    }
                    progressed = true;
                }
            }
            let pending = |l: &Link| !l.outq.is_empty() || !l.inq.is_empty();
            if !self.links.iter().flatten().any(pending) {
                break;
            }
            if progressed {
                idler.progressed();
                continue;
            }
            let Some(waited) = idler.idle() else {
                continue;
            };
            if waited > CREDIT_IDLE {
                self.flush_credits()?;
            }
            let links = &self.links;
            self.check_peers(|p| links[p].as_ref().is_some_and(pending))?;
            if waited > self.opts.timeout {
                let rank = (0..n)
                    .find(|&p| self.links[p].as_ref().is_some_and(pending))
                    .unwrap_or(self.rank);
                let waiting_for_message =
                    self.links[rank].as_ref().is_some_and(|l| !l.inq.is_empty());
                return Err(CollError::Timeout {
                    rank,
                    timeout: self.opts.timeout,
                    what: if waiting_for_message {
                        "a message"
                    } else {
                        "credits to send"
                    },
                });
            }
        }
        // Credits for what this phase consumed go out when this rank next waits (or drops the
        // communicator), off the path of a latency-bound exchange. Every send that reads a
        // caller's buffer has completed before the caller may reuse it; a peer that failed
        // after consuming them all needs no acknowledgement (its QP is in ERR: nothing reads
        // the sources again).
        let drained = |c: &Communicator, p: usize| {
            c.links[p].as_ref().map_or(true, |l| {
                !l.involved
                    || l.done >= l.reads_until
                    || (l.failed.is_some() && c.credits.load(p).is_ok_and(|freed| freed >= l.sent))
            })
        };
        while let Some(p) = (0..n).find(|&p| !drained(self, p)) {
            if self.poll()? {
                idler.progressed();
                continue;
            }
            let Some(waited) = idler.idle() else {
                continue;
            };
            self.check_peers(|_| false)?;
            if waited > self.opts.timeout {
                return Err(CollError::Timeout {
                    rank: p,
                    timeout: self.opts.timeout,
                    what: "the acknowledgement of a send",
                });
            }
        }
        Ok(())
    }

    /// The most bytes a message from a pointer ([`Src::Ptr`]) may carry.
    pub(crate) fn stage_bytes(&self) -> usize {
        self.opts.slot_bytes.min(INLINE_BYTES)
    }

    /// Whether this host runs more of the communicator's ranks (this one and those reached
    /// over shared memory) than it has cores.
    fn host_oversubscribed(&self) -> bool {
        let here = 1 + self
            .links
            .iter()
            .flatten()
            .filter(|l| l.qp.provider() == Provider::Shm)
            .count();
        here > self.cores
    }

    /// Whether `peer` has a free slot for this rank's next message.
    fn credit_available(&self, peer: usize) -> Result<bool, CollError> {
        let l = self.links[peer]
            .as_ref()
            .expect("a link to every other rank");
        // The peer sets its consumed count as one 8-byte word (a release store, or ferroce
        // placing an aligned 8-byte WRITE), loaded here with acquire ordering (see the module
        // doc): no torn value is seen, and the peer's reads of the freed slots are done.
        let freed = self.credits.load(peer)?;
        Ok(l.sent - freed.min(l.sent) < self.opts.slots as u64)
    }

    /// Posts one message to `peer`: `len` bytes of `src` from `off` into the next slot. The
    /// signal depends on the link (see the module doc).
    ///
    /// # Safety
    /// A [`Src::Ptr`] must be valid for reads of `off + len` bytes, and `len` at most
    /// [`stage_bytes`](Self::stage_bytes).
    unsafe fn post_message(
        &mut self,
        peer: usize,
        digest: u16,
        src: Src<'_>,
        off: usize,
        len: usize,
    ) -> Result<(), CollError> {
        let stage_bytes = self.stage_bytes();
        let l = self.links[peer]
            .as_mut()
            .expect("a link to every other rank");
        let index = l.sent;
        let slot = (index % self.opts.slots as u64) as usize;
        let dst = l.slots.addr + (slot * self.opts.slot_bytes) as u64;
        let wr_id = index << 16 | peer as u64;
        // SAFETY: the caller vouches for `off + len` bytes at a pointer source.
        let ptr_bytes = |p: *const u8| unsafe { std::slice::from_raw_parts(p.add(off), len) };
        // Whether some bytes of a caller's buffer are read after this call returns.
        let reads_later;
        if l.qp.provider() == Provider::Shm {
            // A WRITE runs in the post, straight into the peer's memory, as long as nothing is
            // queued before it; a WRITE with immediate would queue (it needs the peer's receive
            // and acknowledgement) and push every later message onto the packet path. So the
            // message is marked arrived by its slot's header word, which the peer polls: data,
            // then header, in order.
            let word = (index + 1) << 16 | u64::from(digest);
            if let (Src::Ptr(p), Some(m)) = (src, l.maps()) {
                if let Some(header) = mapped(&m.headers, slot) {
                    // Small: stored straight into the peer's slot, then the header with release
                    // ordering; no request posted, nothing to complete.
                    // SAFETY: the slot lies in the peer's mapped slots (`len` is at most a
                    // slot, and `maps` mapped `slots` slots), which the peer does not read
                    // until the header says so, and which this rank writes only once the
                    // peer's credit (loaded with acquire ordering) freed it; `p` is the
                    // caller's, for `len` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            ptr_bytes(p).as_ptr(),
                            m.slots.as_ptr().add(slot * self.opts.slot_bytes),
                            len,
                        );
                    }
                    header.store(word, Ordering::Release);
                    l.sent += 1;
                    return Ok(());
                }
            }
            // A message from a pointer is staged in this slot's bytes of `stage`, which are not
            // written again before the peer consumed the message (its credit).
            let (mr, at) = match src {
                Src::Mr(mr) => (mr, off),
                Src::Ptr(p) => {
                    let at = (peer * self.opts.slots + slot) * stage_bytes;
                    self.stage.write(at, ptr_bytes(p))?;
                    (&self.stage, at)
                }
            };
            reads_later = matches!(src, Src::Mr(_));
            let word_at = 8 * (peer * self.opts.slots + slot);
            self.header_src.store(word_at / 8, word)?;
            let mut wrs = Vec::with_capacity(2);
            if len > 0 {
                let mut w = SendWr::new(wr_id, SendOp::Write, vec![mr.sge(at, len)?])
                    .remote(dst, l.slots.rkey);
                w.flags.signaled = false;
                wrs.push(w);
            }
            let mut header = SendWr::new(
                wr_id,
                SendOp::Write,
                vec![self.header_src.mr().sge(word_at, 8)?],
            )
            .remote(l.headers.addr + 8 * slot as u64, l.headers.rkey);
            // Only a message that reads a caller's buffer needs its completion awaited.
            header.flags.signaled = reads_later;
            wrs.push(header);
            l.qp.post_send_batch(wrs)?;
        } else {
            let imm = u32::from(digest) << 16 | (index & 0xffff) as u32;
            let signal = SendWr::new(wr_id, SendOp::WriteWithImm(imm), vec![]);
            match src {
                _ if len <= INLINE_BYTES => {
                    // Copied into the request: nothing waits for its completion, so it need
                    // not ask the peer for an acknowledgement (a ferroce peer's next one
                    // covers it).
                    let data = match src {
                        Src::Ptr(p) => ptr_bytes(p).to_vec(),
                        Src::Mr(mr) => mr.to_vec(off, len)?,
                    };
                    let mut wr = signal.remote(dst, l.slots.rkey);
                    wr.inline_data = Some(data);
                    wr.flags.signaled = false;
                    l.qp.post_send(wr)?;
                    reads_later = false;
                }
                Src::Mr(mr) => {
                    let mut write = SendWr::new(wr_id, SendOp::Write, vec![mr.sge(off, len)?])
                        .remote(dst, l.slots.rkey);
                    write.flags.signaled = false;
                    l.qp.post_send_batch([write, signal.remote(dst, l.slots.rkey)])?;
                    reads_later = true;
                }
                Src::Ptr(_) => {
                    return Err(CollError::Size {
                        what: "a message from a pointer",
                        got: len,
                        want: INLINE_BYTES,
                    })
                }
            }
        }
        l.sent += 1;
        if reads_later {
            l.reads_until = l.sent;
        }
        Ok(())
    }

    /// Takes every completion there is; whether there were any. A peer's abort is reported
    /// before any other failure taken in the same poll (the flush that follows it, say).
    fn poll(&mut self) -> Result<bool, CollError> {
        let mut any = false;
        let mut failure = None;
        while let Some(wc) = self.cq.poll_one()? {
            any = true;
            let taken = if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                self.on_arrival(&wc)
            } else {
                self.on_send(&wc)
            };
            match taken {
                Err(e @ CollError::PeerFailed { .. }) => return Err(e),
                Err(e) => {
                    failure.get_or_insert(e);
                }
                Ok(()) => {}
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(any),
        }
    }

    /// Takes the completion of a send.
    fn on_send(&mut self, wc: &WorkCompletion) -> Result<(), CollError> {
        {
            let peer = (wc.wr_id & PEER_BITS) as usize;
            let Some(l) = self.links.get_mut(peer).and_then(Option::as_mut) else {
                return Ok(());
            };
            if wc.status != WcStatus::Success {
                l.failed.get_or_insert(wc.status);
                let consumed = self.credits.load(peer)?;
                if wc.wr_id & CREDIT_WR != 0 || consumed >= l.sent {
                    // A peer that consumed everything this rank sent it, finished and left
                    // before its acknowledgements came back (the QP is in ERR now, so nothing
                    // reads the sources again): only a phase that needs it fails
                    // (`check_peers`).
                    return Ok(());
                }
                return Err(CollError::Transfer {
                    rank: peer,
                    what: "a send",
                    status: wc.status,
                });
            }
            if wc.wr_id & CREDIT_WR == 0 {
                // Completions come in order; unsignaled messages before this one are done too.
                l.done = l.done.max((wc.wr_id >> 16) + 1);
            }
        }
        Ok(())
    }

    /// Takes an arrived message (or the failure of a peer's QP).
    fn on_arrival(&mut self, wc: &WorkCompletion) -> Result<(), CollError> {
        {
            let Some(peer) = self
                .links
                .iter()
                .position(|l| l.as_ref().is_some_and(|l| l.qp.qpn() == wc.qp_num))
            else {
                return Ok(());
            };
            let l = self.links[peer].as_mut().expect("found");
            if wc.status != WcStatus::Success {
                // A QP no phase uses may fail when its peer leaves: only a phase that needs
                // the peer fails (`check_peers`).
                l.failed.get_or_insert(wc.status);
                return Ok(());
            }
            l.posted -= 1;
            while l.posted < RECV_DEPTH {
                l.qp.post_recv(RecvWr {
                    wr_id: 0,
                    sgl: vec![],
                })?;
                l.posted += 1;
            }
            match (wc.opcode, wc.imm_data) {
                (_, Some(ABORT_IMM)) => {
                    return Err(CollError::PeerFailed { rank: peer });
                }
                (WcOpcode::RecvRdmaWithImm, Some(imm)) => l.arrived.push_back(imm),
                _ => {
                    return Err(CollError::OutOfStep {
                        rank: peer,
                        got: u16::MAX,
                        want: (l.consumed & 0xffff) as u16,
                    })
                }
            }
        }
        Ok(())
    }

    /// Fails if a peer the phase still needs failed (`needed(p)`: bytes to send it or take
    /// from it), or one that has not consumed all this rank sent it.
    fn check_peers(&self, needed: impl Fn(usize) -> bool) -> Result<(), CollError> {
        for (p, l) in self.links.iter().enumerate() {
            if let Some(l) = l {
                let unconsumed = self.credits.load(p)? < l.sent;
                if let (true, Some(status)) = (needed(p) || unconsumed, l.failed) {
                    return Err(CollError::Transfer {
                        rank: p,
                        what: "the QP",
                        status,
                    });
                }
            }
        }
        Ok(())
    }

    /// The immediate of `peer`'s next message if it arrived: with a WRITE with immediate, or
    /// (same-host peers) marked in its slot's header word as `(index + 1) << 16 | digest`.
    fn next_arrival(&self, peer: usize) -> Result<Option<u32>, CollError> {
        let l = self.links[peer]
            .as_ref()
            .expect("a link to every other rank");
        let index = l.consumed;
        if let Some(&imm) = l.arrived.front() {
            if imm as u16 == index as u16 {
                return Ok(Some(imm));
            }
        }
        let slots = self.opts.slots;
        let word = self
            .headers
            .load(peer * slots + (index % slots as u64) as usize)?;
        Ok((word >> 16 == index + 1).then_some((word as u32) << 16 | (index & 0xffff) as u32))
    }

    /// Consumes the next message from `peer` (`len` bytes expected), running `f` on its bytes
    /// where they landed, and frees its slot.
    fn consume(
        &mut self,
        peer: usize,
        imm: u32,
        digest: u16,
        len: usize,
        f: impl FnOnce(&[u8]) -> Result<(), crate::reduce::ReduceError>,
    ) -> Result<(), CollError> {
        let slot_bytes = self.opts.slot_bytes;
        let slots = self.opts.slots;
        let l = self.links[peer]
            .as_mut()
            .expect("a link to every other rank");
        if l.arrived.front() == Some(&imm) {
            l.arrived.pop_front();
        }
        let want = (l.consumed & 0xffff) as u16;
        if (imm >> 16) as u16 != digest {
            return Err(CollError::Mismatch {
                rank: peer,
                ours: digest,
                theirs: (imm >> 16) as u16,
            });
        }
        if imm as u16 != want {
            return Err(CollError::OutOfStep {
                rank: peer,
                got: imm as u16,
                want,
            });
        }
        let at = (peer * slots + (l.consumed % slots as u64) as usize) * slot_bytes;
        l.consumed += 1;
        // SAFETY: the peer wrote this slot before the WRITE with immediate just taken, and
        // writes it again only after the credit below says it was consumed; nothing else
        // writes the inbox.
        unsafe { self.inbox.with_slice(at, len, f) }??;
        let l = self.links[peer]
            .as_ref()
            .expect("a link to every other rank");
        if l.consumed - l.credited >= (self.opts.slots as u64).div_ceil(2) {
            self.send_credit(peer)?;
        }
        Ok(())
    }

    /// Tells every peer about messages consumed and not yet credited.
    fn flush_credits(&mut self) -> Result<(), CollError> {
        for p in 0..self.size {
            if self.links[p]
                .as_ref()
                .is_some_and(|l| l.consumed > l.credited && l.failed.is_none())
            {
                self.send_credit(p)?;
            }
        }
        Ok(())
    }

    fn send_credit(&mut self, peer: usize) -> Result<(), CollError> {
        let l = self.links[peer]
            .as_mut()
            .expect("a link to every other rank");
        let consumed = l.consumed;
        if let Some(credit) = l.maps().and_then(|m| mapped(&m.credit, 0)) {
            // Release: this rank's reads of the slots it frees happen before the peer, having
            // loaded the count with acquire ordering, writes them again.
            credit.store(consumed, Ordering::Release);
            l.credited = consumed;
            return Ok(());
        }
        // The word may be read by the transport later than this post (over UDP): a later,
        // larger count in its place is as true.
        self.credit_src.store(peer, l.consumed)?;
        let mut wr = SendWr::new(
            CREDIT_WR | peer as u64,
            SendOp::Write,
            vec![self.credit_src.mr().sge(8 * peer, 8)?],
        )
        .remote(l.credit.addr, l.credit.rkey);
        wr.flags.signaled = false;
        l.qp.post_send(wr)?;
        l.credited = l.consumed;
        Ok(())
    }
}

impl Drop for Communicator {
    /// Closes the links gracefully: a peer still finishing the last collective gets the
    /// credits (and acknowledgements) it waits for before this rank's QPs go away.
    fn drop(&mut self) {
        if self.broken.is_none() {
            let _ = self.flush_credits();
            self.post_last(CLOSE_WR, self.opts.timeout.min(Duration::from_secs(2)));
        }
    }
}

/// Copies at least this long that nothing reads back soon are streamed past the caches.
const STREAM_MIN: usize = 64 << 10;

/// Copies `len` bytes with non-temporal stores where the CPU has them: the destination lines
/// are written without first being read into the cache (which a plain copy does for each line
/// it writes), so a large final copy costs one pass over memory instead of two. For data the
/// caller will not read again soon (the last step of a collective into the caller's buffer).
///
/// # Safety
/// As for `copy_nonoverlapping`.
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86_64; the caller vouches for both ranges; every 16-byte
    // stream store goes to a 16-aligned address inside `dst..dst + len`; the fence orders the
    // streamed stores before anything this thread stores next (a header, a credit).
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.align_offset(16).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut at = head;
        while at + 64 <= len {
            let s = src.add(at).cast::<__m128i>();
            let d = dst.add(at).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            at += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at);
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}

/// Marks a queued slice's source as a receive's (`In::src`) rather than a send's.
const FORWARDED: u32 = 1 << 31;

/// Applies `item`'s action to `len` received bytes `src`, `at` bytes into the item.
///
/// # Safety
/// The action's pointers are valid for the item's bytes, which nothing else accesses.
unsafe fn apply(
    item: &In<'_>,
    src: &[u8],
    at: usize,
    len: usize,
) -> Result<(), crate::reduce::ReduceError> {
    // SAFETY (each arm): the caller's contract; `at..at + len` lies inside the item.
    match item.action {
        Action::Copy(dst) => unsafe {
            if item.forward.is_empty() && len >= STREAM_MIN {
                copy_streaming(src.as_ptr(), dst.add(at), len);
            } else {
                std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(at), len);
            }
            Ok(())
        },
        Action::Reduce(dst, dtype, op) => unsafe {
            let dst = std::slice::from_raw_parts_mut(dst.add(at), len);
            reduce_into(dst, src, dtype, op)
        },
        Action::ReduceFrom(from, dst, dtype, op) => unsafe {
            // A block at a time, so the copy is still in L1 when the reduction reads it back.
            const BLOCK: usize = 16 << 10;
            let mut b = 0;
            while b < len {
                let l = BLOCK.min(len - b);
                let d = dst.add(at + b);
                std::ptr::copy_nonoverlapping(from.add(at + b), d, l);
                let d = std::slice::from_raw_parts_mut(d, l);
                reduce_into(d, &src[b..b + l], dtype, op)?;
                b += l;
            }
            Ok(())
        },
    }
}

fn push_slices(
    q: &mut VecDeque<(u32, usize, usize)>,
    mr: u32,
    off: usize,
    len: usize,
    slice: usize,
) {
    let mut at = 0;
    while at < len {
        let l = slice.min(len - at);
        q.push_back((mr, off + at, l));
        at += l;
    }
}

#[cfg(test)]
mod tests {
    use super::random_words;

    #[test]
    fn initial_psns_are_random_not_derived_from_the_qp_number() {
        // Two draws of 8 words agree with probability 2^-256; the old PSNs were a function of
        // the QP number, the same in every job.
        let (a, b) = (random_words(8), random_words(8));
        assert_eq!((a.len(), b.len()), (8, 8));
        assert_ne!(a, b);
        assert!(a.iter().any(|&w| w & 0xff_ffff != a[0] & 0xff_ffff));
    }
}
