//! One other rank as this rank sees it: its QP, its regions, and the running phase's queues.

use super::*;

/// One other rank as this rank sees it.
pub(super) struct Link {
    pub(super) qp: QueuePair,
    /// This rank's slots in the peer's inbox.
    pub(super) slots: RemoteRegion,
    /// This rank's credit word in the peer's credit region.
    pub(super) credit: RemoteRegion,
    /// This rank's header words (one per slot) in the peer's header region.
    pub(super) headers: RemoteRegion,
    /// Messages posted to the peer.
    pub(super) sent: u64,
    /// Of those, how many completed (the peer's transport acknowledged them).
    pub(super) done: u64,
    /// How many messages must complete before no request reads a caller's buffer any more
    /// (an inline message was copied at its post, so it needs no waiting for).
    pub(super) reads_until: u64,
    /// Messages from the peer consumed.
    pub(super) consumed: u64,
    /// The consumed count last written to the peer's credit word.
    pub(super) credited: u64,
    /// Immediates of messages arrived with one and not yet consumed, in order.
    pub(super) arrived: VecDeque<u32>,
    /// Receives posted and not yet consumed.
    pub(super) posted: usize,
    /// The status its QP failed with (the peer died or left).
    pub(super) failed: Option<WcStatus>,
    /// A same-host peer's slots, header words and credit word mapped here, once the link
    /// came up over shared memory.
    pub(super) maps: Option<PeerMaps>,
    /// Attempts to map them that failed (after a few, the link keeps to posted WRITEs).
    pub(super) map_failures: u8,
    /// Whether the running phase sends to, receives from or forwards to the peer.
    pub(super) involved: bool,
    /// `sent` when the running phase began.
    pub(super) base: u64,
    /// The running phase's slices still to send to the peer: source (an index into the
    /// phase's sends, or `FORWARDED` and an index into its receives), offset, length.
    pub(super) outq: VecDeque<(u32, usize, usize)>,
    /// The running phase's receives from the peer still to come: index, bytes taken.
    pub(super) inq: VecDeque<(u32, usize)>,
}

/// What a rank stores into directly on a same-host peer: see [`Link::maps`].
pub(super) struct PeerMaps {
    pub(super) slots: ferroce::PeerRegionMap,
    pub(super) headers: ferroce::PeerRegionMap,
    pub(super) credit: ferroce::PeerRegionMap,
}

impl Link {
    /// The peer's mapped words, if the link is over shared memory and they map.
    pub(super) fn maps(&mut self) -> Option<&PeerMaps> {
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
