//! A QP's link to its same-host peer: where it stands (off, pending, linked, broken), the
//! peer's key table and QP page once linked, and the way into the peer's memory that one-sided
//! operations use.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferroce_proto::Access;

use super::admit::admit_one_sided;
use super::direct;
use super::map::SharedMap;
use super::pages::{KeyTable, PublishedRegion, QpPage};
use super::ring::Producer;

/// The peer region a QP used last: what its key-table slot said, under which sequence number,
/// and its mapping.
#[derive(Debug)]
pub(super) struct LastRegion {
    pub(super) region: PublishedRegion,
    pub(super) seq: u64,
    pub(super) map: Arc<SharedMap>,
}

/// A linked QP's view of its peer.
#[derive(Debug)]
pub(crate) struct PeerLink {
    /// The hello connection this side opened (wake-ups go down it).
    pub(super) out: OwnedFd,
    /// Names this link among the QP's links (see [`ShmQp::linked_to`]).
    pub(super) id: u64,
    /// The peer's process, as the kernel reported it for the listener we connected to.
    pub(super) pid: u32,
    pub(super) table: Arc<KeyTable>,
    pub(super) page: Arc<QpPage>,
    /// Our end of the peer's inbound ring, with our position kept here, not in the page.
    pub(super) producer: Producer,
}

/// A linked QP's way into its peer's memory, for one-sided operations done in `post_send`. A QP
/// keeps one under its own lock (beside the transport's QP, see `qp::QpCore`), so such a post
/// takes that one lock and nothing else, and each `QpSender` keeps one of its own, used without
/// any lock. It is made from the [`PeerLink`] and remade when the link's generation moves on.
#[derive(Debug)]
pub(crate) struct PeerMemory {
    /// The `ShmQp::generation` of the link it was made from.
    pub(crate) generation: u64,
    pub(super) pid: u32,
    pub(super) table: Arc<KeyTable>,
    pub(super) page: Arc<QpPage>,
    /// Peer regions mapped so far, by key.
    pub(super) regions: HashMap<u32, Arc<SharedMap>>,
    /// The peer region used last (a stream of operations mostly names one rkey), so the common
    /// case needs no hash lookup.
    pub(super) last_region: Option<LastRegion>,
    /// This side's region used last by a local SGE (see `direct`).
    pub(crate) last_local: Option<direct::CachedLocal>,
}

/// Where a QP stands with the shared-memory provider.
#[derive(Debug, Default)]
pub(crate) enum Link {
    /// Not connected over shm (UDP, or not yet at RTR).
    #[default]
    Off,
    /// Our request went out on `out` to the listener of process `peer_pid` (as the kernel
    /// says); the answer, with the peer's descriptors, has not arrived yet.
    Pending {
        out: OwnedFd,
        peer_qpn: u32,
        peer_pid: u32,
        id: u64,
        /// When the hello went out: a post looks for the peer's at once only for a while (see
        /// `QueuePair::take_waiting_hello`).
        since: std::time::Instant,
    },
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
    /// The consumer's position in this QP's own inbound ring (only the engine reads the ring):
    /// kept here because the page's copy is writable by the peer.
    pub ring_tail: std::sync::atomic::AtomicU64,
    /// Whether the QP reads its inbound ring: from the moment its hello went out (the peer it
    /// went to may link and send before this side has the peer's hello) until the link ends.
    pub receiving: AtomicBool,
}

impl ShmQp {
    pub(crate) fn new() -> io::Result<ShmQp> {
        Ok(ShmQp {
            page: QpPage::create()?,
            link: Mutex::new(Link::Off),
            linked: AtomicBool::new(false),
            generation: std::sync::atomic::AtomicU64::new(0),
            ring_tail: std::sync::atomic::AtomicU64::new(0),
            receiving: AtomicBool::new(false),
        })
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this QP still has the link `id` (a QP reset and connected again may well reach
    /// a peer with its old peer's number, but its link has a new id).
    pub(crate) fn linked_to(&self, id: u64) -> bool {
        matches!(&*self.lock(), Link::Linked(p) if p.id == id)
    }

    /// Ends the link: the QP no longer reads its ring or reaches the peer's memory.
    pub(crate) fn unlink(&self, to: Link) {
        self.linked.store(false, Ordering::Release);
        self.receiving.store(false, Ordering::Release);
        *self.lock() = to;
    }
}

impl PeerLink {
    /// Wakes the peer's engine if it sleeps.
    pub(crate) fn wake(&self) {
        // The ring's head was stored (release) before this load of the flag: without a full
        // fence the load may pass the store (store buffering), and the peer, which stores the
        // flag and then reads the head, could miss both. SeqCst on each access alone does not
        // order a release store before it on every CPU.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
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
        let qp = self.page.words();
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
        let off = admit_one_sided(qp, &l.region.grant(), need, addr, len)?;
        Some((&l.map, (l.region.file_offset + off) as usize))
    }

    /// As [`resolve`](Self::resolve), with a reference to the mapping that keeps it mapped.
    pub(crate) fn resolve_shared(
        &mut self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Option<(Arc<SharedMap>, usize)> {
        let (_, off) = self.resolve(rkey, addr, len, need)?;
        Some((self.last_region.as_ref()?.map.clone(), off))
    }

    /// Reads the slot of `rkey` afresh and makes it the last region, with its mapping (made
    /// now unless an earlier one is of the same region).
    #[cold]
    pub(super) fn look_up(&mut self, rkey: u32) -> Option<()> {
        self.last_region = None;
        let (r, seq) = self.table.lookup(rkey)?;
        if r.fd < 0 {
            return None;
        }
        // The slot's inode and length say whether a mapping made earlier is of this region.
        let needed = r.file_offset.checked_add(r.len)?;
        let current = |m: &SharedMap| m.inode() == r.inode && m.len() as u64 >= needed;
        let map = match self.regions.get(&rkey).filter(|m| current(m)) {
            Some(m) => m.clone(),
            None => {
                let m =
                    Arc::new(SharedMap::open_peer(self.pid, r.fd, r.inode, needed as usize).ok()?);
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
