//! A QP's state as the engine and the providers see it: the transport's QP with what rides
//! with it under one lock ([`QpCore`]), the lock that publishes whether the QP is idle
//! ([`CoreLock`]), and everything else a QP handle shares with them ([`QpShared`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use ferroce_proto::QpState;

use super::cq::CqInner;
use super::mr::MrCache;
use super::srq::SrqInner;
use crate::provider::{DeferredAck, PeerMemory, QpSocket, ShmQp};
use crate::spin::{SpinGuard, SpinLock};

/// What a QP's lock guards: the transport's QP and, on a QP linked over shared memory, its way
/// into the peer's memory (so a one-sided post takes this one lock). Derefs to the transport's
/// QP.
#[derive(Debug)]
pub(crate) struct QpCore {
    pub proto: ferroce_proto::QueuePair,
    pub peer_memory: Option<PeerMemory>,
    /// The peer's address and UDP port, set at RTR.
    pub peer: Option<SocketAddr>,
    /// A positive ACK held back to leave after the next data packet (see `engine`).
    pub held_ack: Option<DeferredAck>,
    /// The regions the transport used last for this QP.
    pub mr_cache: MrCache,
    /// One-sided operations done directly in a same-host peer's memory (no packet) through
    /// this QP: by its posts, and by its senders once they are dropped.
    pub direct_ops: u64,
    /// Set when the QP is destroyed: from then on no ACK is held back (nobody would send it).
    pub retired: bool,
    /// The congestion control the application chose for this QP, if it did: each RTR applies
    /// it whoever the peer is (see `ContextOptions::congestion_to_local_peers`), even after a
    /// shared-memory link turned the window off for its peer.
    pub congestion_chosen: Option<ferroce_proto::CcConfig>,
    /// When this QP last offered its smallest RTT to the context's paths (see `path_rtt`).
    pub path_rtt_shared_at: Option<ferroce_proto::Instant>,
}

impl QpCore {
    pub(crate) fn new(proto: ferroce_proto::QueuePair) -> QpCore {
        QpCore {
            proto,
            peer_memory: None,
            peer: None,
            held_ack: None,
            mr_cache: MrCache::default(),
            direct_ops: 0,
            retired: false,
            congestion_chosen: None,
            path_rtt_shared_at: None,
        }
    }
}

impl std::ops::Deref for QpCore {
    type Target = ferroce_proto::QueuePair;
    fn deref(&self) -> &ferroce_proto::QueuePair {
        &self.proto
    }
}

impl std::ops::DerefMut for QpCore {
    fn deref_mut(&mut self) -> &mut ferroce_proto::QueuePair {
        &mut self.proto
    }
}

/// The lock around a QP's [`QpCore`]. Whoever lets go of it also publishes whether the QP is
/// *idle* — in RTS, with no send request under way and no completion waiting — which is when a
/// [`QpSender`] may do a one-sided operation in a same-host peer's memory without taking it.
#[derive(Debug)]
pub(crate) struct CoreLock {
    lock: SpinLock<QpCore>,
    idle: AtomicBool,
}

impl CoreLock {
    pub(crate) fn new(core: QpCore) -> CoreLock {
        CoreLock {
            lock: SpinLock::new(core),
            idle: AtomicBool::new(false),
        }
    }

    /// Takes the lock.
    #[inline]
    pub(crate) fn lock(&self) -> CoreGuard<'_> {
        CoreGuard {
            guard: self.lock.lock(),
            idle: &self.idle,
        }
    }

    /// Whether the QP was idle when its lock was last let go (see the type's doc). Every change
    /// of state, send queue or completions happens under the lock, and is published before the
    /// lock is free again, so a thread that reads `true` here after its own last post is
    /// ordered after everything that post queued.
    #[inline]
    pub(crate) fn idle(&self) -> bool {
        self.idle.load(Ordering::Acquire)
    }

    /// The word behind [`Self::idle`] (for a cache that keeps a pointer to it).
    pub(crate) fn idle_flag(&self) -> &AtomicBool {
        &self.idle
    }
}

/// Access to a QP's [`QpCore`]; dropping it publishes whether the QP is idle, then lets go.
pub(crate) struct CoreGuard<'a> {
    guard: SpinGuard<'a, QpCore>,
    idle: &'a AtomicBool,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = QpCore;
    #[inline]
    fn deref(&self) -> &QpCore {
        &self.guard
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut QpCore {
        &mut self.guard
    }
}

impl Drop for CoreGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        let q = &self.guard.proto;
        let idle = q.state() == QpState::Rts && q.is_send_queue_empty() && !q.has_completions();
        // Written only when it changes: a sender on another core reads it on every post.
        if self.idle.load(Ordering::Relaxed) != idle {
            self.idle.store(idle, Ordering::Release);
        }
        // `guard` drops after this, releasing the lock.
    }
}

/// What the engine shares with a QP handle. What the engine needs of a QP on every packet
/// lives in its [`QpCore`], under the one lock: a packet in or out takes that lock once.
#[derive(Debug)]
pub(crate) struct QpShared {
    pub qpn: u32,
    pub qp: CoreLock,
    pub send_cq: Arc<CqInner>,
    pub recv_cq: Arc<CqInner>,
    pub srq: Option<Arc<SrqInner>>,
    /// The UDP provider's side: this QP's own sending socket (RoCE v2 gives each QP its own
    /// UDP source port, so that routers spread QPs over paths: ECMP).
    pub udp: QpSocket,
    /// When this QP last sent a request (ns on the context clock): ACKs are held only on a QP
    /// that is itself sending, i.e. in a ping-pong.
    pub last_request_tx: AtomicU64,
    /// Whether the peer sends every packet with an IPv4 Identification below
    /// `SENT_IDENTIFICATION_LIMIT`, as ferroce does (`QueuePair::set_peer_small_identifications`):
    /// the receive path then believes no other Identification it solves for. Read without the
    /// QP's lock, before the packet is handed over.
    pub peer_small_identifications: AtomicBool,
    /// The shared-memory side (absent when the context's provider is UDP).
    pub shm: Option<ShmQp>,
}

impl QpShared {
    /// The shm side, if this QP is linked to a same-host peer.
    pub(crate) fn shm_linked(&self) -> Option<&ShmQp> {
        self.shm
            .as_ref()
            .filter(|s| s.linked.load(Ordering::Acquire))
    }

    /// Tells a same-host peer this QP's state, access rights and protection domain (what it
    /// checks before reaching memory through this QP).
    pub(crate) fn publish_state(&self, q: &ferroce_proto::QueuePair) {
        if let Some(shm) = &self.shm {
            shm.page.publish(q.state(), Some(q.access()), q.pd());
        }
    }
}
