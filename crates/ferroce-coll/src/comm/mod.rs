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

mod copy;
mod engine;
mod error;
mod link;
mod options;
mod p2p;
mod phase;
mod setup;
mod transport;

pub use error::CollError;
pub use options::CommOptions;
pub(crate) use p2p::p2p_digest;
pub use p2p::{Progress, Ticket};
pub(crate) use phase::{digest, messages, Action, In, Out, Phase, Src};

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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

// The parts of this module share one namespace: each submodule takes `super::*`, and these
// bring their items back into it. They are one module split by idea, not separate APIs.
use copy::*;
use link::*;
use phase::*;
use transport::*;

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
    /// Sends and receives started and not yet complete (`p2p`).
    in_flight: p2p::InFlight,
    /// Raised by an [`AbortHandle`] (from any thread).
    aborted: Arc<AtomicBool>,
}

/// Aborts a communicator from another thread: the call it runs fails with
/// [`CollError::Aborted`] within a moment (its waits look at the flag whenever they read the
/// clock), and so does every later one; the peers hear of it as of any failure, and their
/// calls fail at once with [`CollError::PeerFailed`]. What torch's `ProcessGroup.abort()`
/// asks of a backend.
#[derive(Debug, Clone)]
pub struct AbortHandle(Arc<AtomicBool>);

impl AbortHandle {
    /// Raises the flag; the communicator's thread does the rest.
    pub fn abort(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl Communicator {
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

    /// How long a collective may go without progress before it fails (see
    /// [`CommOptions::timeout`]).
    pub fn timeout(&self) -> Duration {
        self.opts.timeout
    }

    /// Sets that time for the calls that follow (torch's `monitored_barrier` takes its own).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.opts.timeout = timeout;
    }

    /// Refuses a call on a broken communicator, or an aborted one.
    pub(crate) fn usable(&self) -> Result<(), CollError> {
        match &self.broken {
            Some(why) => Err(CollError::Broken(why.clone())),
            None => self.check_abort(),
        }
    }

    /// Fails once an [`AbortHandle`] raised the flag.
    pub(crate) fn check_abort(&self) -> Result<(), CollError> {
        if self.aborted.load(Ordering::Acquire) {
            Err(CollError::Aborted)
        } else {
            Ok(())
        }
    }

    /// A handle that aborts this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle(self.aborted.clone())
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
        self.ready()?;
        // Operations started before this call go first: a link carries one call's messages
        // at a time.
        let r = self.finish_in_flight().and_then(|()| f(self));
        if let Err(e) = &r {
            self.fail(e);
        }
        r
    }

    /// As [`usable`](Self::usable), and an abort raised since the last call breaks the
    /// communicator here (peers told, QPs to ERR, operations in flight ended), as a failure
    /// during a call does.
    pub(crate) fn ready(&mut self) -> Result<(), CollError> {
        let r = self.usable();
        if let Err(e @ CollError::Aborted) = &r {
            self.fail(e);
        }
        r
    }

    /// Breaks the communicator with `e` (unless it is broken already) and then ends every
    /// operation in flight: the QPs are in ERR before the regions of their buffers go.
    pub(crate) fn fail(&mut self, e: &CollError) {
        if self.broken.is_none() {
            self.break_with(e);
        }
        self.abandon_in_flight();
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
}

impl Drop for Communicator {
    /// Closes the links gracefully: a peer still finishing the last collective gets the
    /// credits (and acknowledgements) it waits for before this rank's QPs go away.
    fn drop(&mut self) {
        if self.check_abort().is_err() {
            // Aborted: the peers' calls fail at once, as after any failure.
            self.fail(&CollError::Aborted);
        } else if self.in_flight() > 0 {
            // Operations nobody will finish: the peers are told, and the QPs stop reading
            // their buffers (whose regions go with this communicator) before anything else.
            self.fail(&CollError::Broken(
                "dropped with sends or receives in flight".into(),
            ));
        }
        if self.broken.is_none() {
            let _ = self.flush_credits();
            self.post_last(CLOSE_WR, self.opts.timeout.min(Duration::from_secs(2)));
        }
    }
}
