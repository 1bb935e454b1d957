//! Queue pairs and shared receive queues of the verbs API.
//!
//! A [`QueuePair`] wraps the transport's [`ferroce_proto::QueuePair`] behind a mutex shared with
//! the engine: posting is a call on the transport (so errors come back at once, as from
//! `ibv_post_send`) followed by a doorbell, which transmits inline when the engine is free.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferroce_proto::{InitAttr, PostError, QpCaps, QpState, RecvWr, RtrAttr, RtsAttr, SendWr};

use crate::context::ContextInner;
use crate::cq::{CompletionQueue, CqInner};
use crate::device::ip_of;
use crate::error::{Error, Result};

/// How a QP is created.
#[derive(Debug)]
pub struct QpInitAttr<'a> {
    /// Where send completions go.
    pub send_cq: &'a CompletionQueue,
    /// Where receive completions go.
    pub recv_cq: &'a CompletionQueue,
    /// Queue sizes.
    pub caps: QpCaps,
    /// A shared receive queue to take receive requests from instead of the QP's own.
    pub srq: Option<&'a SharedReceiveQueue>,
}

impl<'a> QpInitAttr<'a> {
    /// The common case: one CQ for both send and receive completions, the QP's own receive
    /// queue.
    pub fn new(cq: &'a CompletionQueue, caps: QpCaps) -> QpInitAttr<'a> {
        QpInitAttr {
            send_cq: cq,
            recv_cq: cq,
            caps,
            srq: None,
        }
    }
}

#[derive(Debug)]
pub(crate) struct SrqInner {
    queue: Mutex<VecDeque<RecvWr>>,
    max_wr: usize,
    max_sge: usize,
}

impl SrqInner {
    pub(crate) fn pop(&self) -> Option<RecvWr> {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }
}

/// A shared receive queue: receive requests any attached QP can consume.
#[derive(Debug, Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

impl SharedReceiveQueue {
    pub(crate) fn new(max_wr: usize, max_sge: usize) -> SharedReceiveQueue {
        SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                queue: Mutex::new(VecDeque::new()),
                max_wr,
                max_sge,
            }),
        }
    }

    /// Posts a receive request.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        if wr.sgl.len() > self.inner.max_sge {
            return Err(PostError::TooManySge {
                given: wr.sgl.len(),
                max: self.inner.max_sge as u32,
            }
            .into());
        }
        let mut q = self.inner.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= self.inner.max_wr {
            return Err(PostError::QueueFull(self.inner.max_wr as u32).into());
        }
        q.push_back(wr);
        Ok(())
    }

    /// Receive requests waiting.
    pub fn len(&self) -> usize {
        self.inner
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a QP's lock guards: the transport's QP and, on a QP linked over shared memory, its way
/// into the peer's memory (so a one-sided post takes this one lock). Derefs to the transport's
/// QP.
#[derive(Debug)]
pub(crate) struct QpCore {
    pub proto: ferroce_proto::QueuePair,
    pub peer_memory: Option<crate::shm::PeerMemory>,
    /// The peer's address and UDP port, set at RTR.
    pub peer: Option<SocketAddr>,
    /// A positive ACK held back to leave after the next data packet (see `engine`).
    pub held_ack: Option<crate::engine::DeferredAck>,
    /// The regions the transport used last for this QP.
    pub mr_cache: crate::mr::MrCache,
}

impl QpCore {
    pub(crate) fn new(proto: ferroce_proto::QueuePair) -> QpCore {
        QpCore {
            proto,
            peer_memory: None,
            peer: None,
            held_ack: None,
            mr_cache: crate::mr::MrCache::default(),
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
    lock: crate::spin::SpinLock<QpCore>,
    idle: AtomicBool,
}

impl CoreLock {
    pub(crate) fn new(core: QpCore) -> CoreLock {
        CoreLock {
            lock: crate::spin::SpinLock::new(core),
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
    guard: crate::spin::SpinGuard<'a, QpCore>,
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
    /// This QP's own sending socket: RoCE v2 gives each QP its own UDP source port, so that
    /// routers spread QPs over paths (ECMP).
    pub send_socket: UdpSocket,
    pub src_port: u16,
    /// When this QP last sent a request (ns on the context clock): ACKs are held only on a QP
    /// that is itself sending, i.e. in a ping-pong.
    pub last_request_tx: std::sync::atomic::AtomicU64,
    /// The shared-memory side (absent when the context's provider is UDP).
    pub shm: Option<crate::shm::ShmQp>,
}

impl QpShared {
    pub(crate) fn send_fd(&self) -> std::os::fd::RawFd {
        self.send_socket.as_raw_fd()
    }

    /// The shm side, if this QP is linked to a same-host peer.
    pub(crate) fn shm_linked(&self) -> Option<&crate::shm::ShmQp> {
        self.shm
            .as_ref()
            .filter(|s| s.linked.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Tells a same-host peer this QP's state, access rights and protection domain (what it
    /// checks before reaching memory through this QP).
    pub(crate) fn publish_state(&self, q: &ferroce_proto::QueuePair) {
        if let Some(shm) = &self.shm {
            shm.page.publish(q.state(), Some(q.access()), q.pd());
        }
    }
}

/// A send work request handed to [`QueuePair::post_send`]: by value, or by reference to post
/// the same request again and again without rebuilding it (`ibv_post_send` takes a pointer for
/// the same reason). A request done at once in a same-host peer's memory is never copied; one
/// queued for the transport is copied if it was lent.
pub trait SendRequest<'a> {
    /// The request, owned or borrowed.
    fn into_request(self) -> Cow<'a, SendWr>;
}

impl<'a> SendRequest<'a> for SendWr {
    fn into_request(self) -> Cow<'a, SendWr> {
        Cow::Owned(self)
    }
}

impl<'a> SendRequest<'a> for &'a SendWr {
    fn into_request(self) -> Cow<'a, SendWr> {
        Cow::Borrowed(self)
    }
}

/// Posts send requests to one [`QueuePair`] from one thread at a time: what rdma-core's thread
/// domains promise a provider, here kept by the borrow checker (posting takes `&mut self`).
///
/// A post through it behaves exactly as [`QueuePair::post_send`]: same checks, same statuses,
/// completions in posting order. The difference is the shared-memory fast path: a WRITE, READ
/// or atomic to a same-host peer on an idle QP (in RTS, nothing under way, no completion
/// waiting) is done without taking the QP's lock, because the sender keeps its own way into
/// the peer's memory (its own mappings and cached checks) instead of the one the QP keeps
/// under its lock. That lock's one locked instruction is a sizeable part of an 8-byte WRITE
/// between two processes. Anything else is posted through the QP as usual.
///
/// Several senders may exist for one QP (one per thread, say), beside posts through the QP
/// itself; what is posted concurrently from different threads is ordered as it happens to be,
/// as on any QP. Mappings a sender made live until it is dropped or the QP links anew.
#[derive(Debug)]
pub struct QpSender<'a> {
    qp: &'a QueuePair,
    /// The QP's capacities and protection domain, fixed at its creation.
    caps: QpCaps,
    pd: u32,
    /// This sender's way into the peer's memory, made from the link the QP has.
    peer: Option<crate::shm::PeerMemory>,
    /// What it checked about the WRITE or READ it repeats (see `shm::shortcut`).
    shortcut: Option<crate::shm::shortcut::Shortcut>,
    /// The (lkey, rkey) of the last request done directly without the shortcut: a second one
    /// between the same regions makes the shortcut (a stream alternating between regions
    /// would only remake it every time).
    last_direct: Option<(u32, u32)>,
}

impl QpSender<'_> {
    /// The queue pair this sender posts to.
    pub fn qp(&self) -> &QueuePair {
        self.qp
    }

    /// Posts a send work request (`wr` or `&wr`), as [`QueuePair::post_send`] does.
    #[inline]
    pub fn post_send<'a>(&mut self, wr: impl SendRequest<'a>) -> Result<()> {
        let wr = wr.into_request();
        // The repeated WRITE or READ in straight-line code; everything else out of line, so
        // that the path from the caller's last instruction to the store into the peer's
        // memory stays short (on a ping-pong it is the whole turnaround).
        match self.shortcut.as_ref().and_then(|s| s.run(&wr)) {
            Some(_) if !wr.flags.signaled => Ok(()),
            done => self.post_rest(wr, done),
        }
    }

    /// The rest of [`Self::post_send`]: a signaled request the shortcut did, or one it did
    /// not do (`done` is `None`).
    #[inline(never)]
    fn post_rest(
        &mut self,
        wr: Cow<'_, SendWr>,
        done: Option<ferroce_proto::WcOpcode>,
    ) -> Result<()> {
        match done.or_else(|| self.one_sided(&wr)) {
            Some(opcode) => {
                if wr.flags.signaled {
                    let wc = crate::shm::direct::completion(&wr, opcode, self.qp.shared.qpn);
                    self.qp.shared.send_cq.push(&[wc]);
                }
                Ok(())
            }
            None => self.qp.post_request(wr),
        }
    }

    /// Does `wr` in the peer's memory if the QP is linked over shared memory and idle and every
    /// check admits it; `None` (having touched nothing) otherwise.
    #[inline]
    fn one_sided(&mut self, wr: &SendWr) -> Option<ferroce_proto::WcOpcode> {
        let shared = &self.qp.shared;
        let shm = shared.shm_linked()?;
        if !shared.qp.idle() {
            return None;
        }
        let generation = shm.generation.load(Ordering::Acquire);
        if self.peer.as_ref().map(|m| m.generation) != Some(generation) {
            self.peer = match &*shm.lock() {
                crate::shm::Link::Linked(peer) => Some(peer.memory(generation)),
                _ => None,
            };
        }
        ferroce_proto::qp::check_send_request(QpState::Rts, &self.caps, wr).ok()?;
        let peer = self.peer.as_mut()?;
        let ctx = &self.qp.ctx.shared;
        let opcode = crate::shm::direct::one_sided_op(ctx, peer, self.pd, wr)?;
        if let [sge] = wr.sgl.as_slice() {
            let pair = Some((sge.lkey, wr.rkey));
            if self.last_direct == pair {
                if let Some(s) = crate::shm::shortcut::Shortcut::capture(ctx, shared, peer, wr) {
                    self.shortcut = Some(s);
                }
            }
            self.last_direct = pair;
        }
        Some(opcode)
    }
}

/// A reliable-connection queue pair.
#[derive(Debug)]
pub struct QueuePair {
    pub(crate) shared: Arc<QpShared>,
    pub(crate) ctx: Arc<ContextInner>,
}

impl QueuePair {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.shared.qpn
    }

    /// The UDP source port this QP sends from.
    pub fn udp_src_port(&self) -> u16 {
        self.shared.src_port
    }

    fn with<T>(&self, f: impl FnOnce(&mut ferroce_proto::QueuePair) -> T) -> T {
        let mut q = self.shared.qp.lock();
        let r = f(&mut q);
        self.shared.publish_state(&q);
        r
    }

    /// The provider moving this QP's bytes: `Shm` once linked to a same-host peer (at RTR).
    pub fn provider(&self) -> crate::Provider {
        match &self.shared.shm {
            Some(s) if !matches!(*s.lock(), crate::shm::Link::Off) => crate::Provider::Shm,
            _ => crate::Provider::Udp,
        }
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.with(|q| q.state())
    }

    /// The transport's counters for this QP.
    pub fn counters(&self) -> ferroce_proto::Counters {
        self.with(|q| *q.counters())
    }

    /// The next PSN this QP will use (to tell the peer, before RTS it is the initial PSN).
    pub fn next_send_psn(&self) -> ferroce_wire::Psn {
        self.with(|q| q.next_send_psn())
    }

    /// RESET → INIT.
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
        Ok(self.with(|q| q.modify_to_init(attr))?)
    }

    /// INIT → RTR, with the peer on the standard RoCE v2 port 4791.
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
        self.modify_to_rtr_with_port(attr, ferroce_wire::ROCE_V2_UDP_PORT)
    }

    /// INIT → RTR, with the peer's RoCE socket on `dest_udp_port` (ferroce lets several
    /// unprivileged processes share a host, each on its own port).
    pub fn modify_to_rtr_with_port(&self, attr: &RtrAttr, dest_udp_port: u16) -> Result<()> {
        let peer_ip = ip_of(attr.dest_gid);
        let local_ip = self.ctx.shared.local.ip();
        if matches!(
            (peer_ip, local_ip),
            (IpAddr::V4(_), IpAddr::V6(_)) | (IpAddr::V6(_), IpAddr::V4(_))
        ) {
            return Err(Error::InvalidArgument(format!(
                "peer GID {} and local address {local_ip} are of different IP families",
                attr.dest_gid
            )));
        }
        let dest = SocketAddr::new(peer_ip, dest_udp_port);
        // The QP's socket stays unconnected, though it sends only to its peer: Linux gives
        // datagrams with DF set from a connected socket an incrementing IPv4 Identification,
        // and the ICRC covers that field — the packets would leave with ICRCs computed for
        // Identification 0 (all ferroce can know), which a real RoCE peer rejects.
        {
            let mut core = self.shared.qp.lock();
            core.modify_to_rtr(attr)?;
            core.peer = Some(dest);
            self.shared.publish_state(&core);
        }
        if let (Some(host), Some(shm)) = (&self.ctx.shared.shm, &self.shared.shm) {
            let linked = host
                .start_link(shm, self.shared.qpn, dest, attr.dest_qpn)
                .map_err(|e| Error::io(format!("reaching {dest} through shared memory"), e))?;
            if !linked && host.provider == crate::Provider::Shm {
                return Err(Error::InvalidArgument(format!(
                    "no ferroce context at {dest} on this host to reach through shared memory \
                     (provider shm is forced)"
                )));
            }
        }
        Ok(())
    }

    /// RTR → RTS.
    pub fn modify_to_rts(&self, attr: &RtsAttr) -> Result<()> {
        self.with(|q| q.modify_to_rts(attr))?;
        Ok(())
    }

    /// Any state → ERR: outstanding work completes with the flush status.
    pub fn modify_to_error(&self) {
        self.with(|q| q.modify_to_error());
        self.ctx.shared.doorbell(&self.shared);
    }

    /// Any state → RESET.
    pub fn reset(&self) {
        {
            let mut core = self.shared.qp.lock();
            core.reset();
            // Let go of the peer's mappings now rather than at the next link.
            core.peer_memory = None;
            core.peer = None;
            core.held_ack = None;
            self.shared.publish_state(&core);
        }
        if let Some(shm) = &self.shared.shm {
            shm.linked
                .store(false, std::sync::atomic::Ordering::Release);
            *shm.lock() = crate::shm::Link::Off;
        }
    }

    /// Posts a send work request (`wr` or `&wr`, see [`SendRequest`]) and rings the doorbell.
    pub fn post_send<'a>(&self, wr: impl SendRequest<'a>) -> Result<()> {
        self.post_request(wr.into_request())
    }

    fn post_request(&self, wr: Cow<'_, SendWr>) -> Result<()> {
        if self.post_one(wr)? {
            self.ctx.shared.doorbell(&self.shared);
        }
        Ok(())
    }

    /// A handle that posts to this QP from one thread at a time (it posts through `&mut`),
    /// and so may skip the QP's lock: see [`QpSender`].
    pub fn sender(&self) -> QpSender<'_> {
        let (caps, pd) = self.with(|q| (q.caps(), q.pd()));
        QpSender {
            qp: self,
            caps,
            pd,
            peer: None,
            shortcut: None,
            last_direct: None,
        }
    }

    /// Posts several send work requests with one doorbell; stops at the first refused one.
    pub fn post_send_batch(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<()> {
        let r = if self.shared.shm_linked().is_some() {
            let mut queued = false;
            let r = wrs
                .into_iter()
                .try_for_each(|wr| self.post_one(Cow::Owned(wr)).map(|q| queued |= q));
            if queued {
                self.ctx.shared.doorbell(&self.shared);
            }
            return r;
        } else {
            self.with(|q| wrs.into_iter().try_for_each(|wr| q.post_send(wr)))
        };
        self.ctx.shared.doorbell(&self.shared);
        Ok(r?)
    }

    /// Tells the QP whether its peer acknowledges requests that do not ask for an ACK, as
    /// ferroce does ([`crate::cm::EndpointInfo::acks_unasked`]; [`QueuePair::connect`] sets it
    /// from the exchange). Then unsignaled SENDs and WRITEs mostly leave the AckReq bit clear
    /// and the peer acknowledges several at once: over UDP, a ping-pong of unsignaled WRITEs
    /// costs one datagram per message instead of two. Leave it off (the default) for a peer
    /// that acknowledges only what asks, such as Linux rxe. See
    /// `ferroce_proto::QueuePair::set_peer_acks_unasked` for what still asks.
    pub fn set_peer_acks_unasked(&self, on: bool) {
        self.shared.qp.lock().set_peer_acks_unasked(on);
    }

    /// Does `wr` at once in a same-host peer's memory if it can (see `shm::direct`), else
    /// queues it for the transport; returns whether it was queued (a doorbell is due).
    fn post_one(&self, wr: Cow<'_, SendWr>) -> Result<bool> {
        if let Some(shm) = &self.shared.shm {
            let linked = shm.linked.load(std::sync::atomic::Ordering::Acquire);
            if !linked && matches!(*shm.lock(), crate::shm::Link::Pending { .. }) {
                // The peer's hello is most likely waiting in the socket already (it left
                // before the peer reported RTS): take it now rather than at the engine's next
                // look, so the request goes straight to the peer's memory.
                let shared = &self.ctx.shared;
                shared.poll_shm_host(shared.now(), true);
            }
        }
        if let Some(shm) = self.shared.shm_linked() {
            let mut q = self.shared.qp.lock();
            let generation = shm.generation.load(std::sync::atomic::Ordering::Acquire);
            if q.peer_memory.as_ref().map(|m| m.generation) != Some(generation) {
                q.peer_memory = match &*shm.lock() {
                    crate::shm::Link::Linked(peer) => Some(peer.memory(generation)),
                    _ => None,
                };
            }
            if let Some(wc) = crate::shm::direct::execute(&self.ctx.shared, &mut q, &wr) {
                // Completions of earlier requests the transport finished but the engine has
                // not delivered yet go first: the CQ sees posting order. All of it under the
                // QP's lock, as the engine delivers.
                match q.poll_completion() {
                    // The common case, without building a list.
                    None => {
                        if wr.flags.signaled {
                            self.shared.send_cq.push(&[wc]);
                        }
                    }
                    Some(first) => {
                        let mut wcs = vec![first];
                        wcs.extend(std::iter::from_fn(|| q.poll_completion()));
                        if wr.flags.signaled {
                            wcs.push(wc);
                        }
                        crate::engine::route_completions(&self.shared, &mut wcs);
                    }
                }
                return Ok(false);
            }
        }
        match wr {
            Cow::Owned(wr) => self.with(|q| q.post_send(wr))?,
            Cow::Borrowed(wr) => self.with(|q| q.post_send_copy(wr))?,
        }
        Ok(true)
    }

    /// Posts a receive work request.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        if self.shared.srq.is_some() {
            return Err(Error::InvalidArgument(
                "this QP takes its receives from a shared receive queue".into(),
            ));
        }
        self.with(|q| q.post_recv(wr))?;
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.ctx.shared.remove_qp(self.shared.qpn);
    }
}

/// The attributes a connection fixes beyond what the peers exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// What the peer may do through this QP.
    pub access: ferroce_proto::Access,
    /// Local ACK timeout code (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer code this side asks the peer to wait.
    pub min_rnr_timer: u8,
    /// READ/atomic requests this side keeps outstanding (capped by what the peer serves).
    pub max_rd_atomic: u8,
}

impl Default for ConnectOptions {
    fn default() -> ConnectOptions {
        ConnectOptions {
            access: ferroce_proto::Access::REMOTE_READ
                .with(ferroce_proto::Access::REMOTE_WRITE)
                .with(ferroce_proto::Access::REMOTE_ATOMIC),
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
        }
    }
}

impl QueuePair {
    /// This QP's side of a connection exchange: its number, first PSN, the context's GID and
    /// UDP port, the device's path MTU and what it serves, and optionally a region for the peer.
    pub fn endpoint_info(
        &self,
        psn: ferroce_wire::Psn,
        region: Option<crate::cm::RemoteRegion>,
    ) -> crate::cm::EndpointInfo {
        crate::cm::EndpointInfo {
            qpn: self.qpn(),
            psn,
            gid: crate::device::gid_of(self.ctx.shared.local.ip()),
            udp_port: self.ctx.shared.local.port(),
            mtu: self.ctx.shared.device.active_mtu(),
            max_rd_atomic: ferroce_proto::attr::MAX_RD_ATOMIC,
            region,
            acks_unasked: true,
        }
    }

    /// Brings a QP in RESET (or INIT) to RTS, connected to `peer` as exchanged with [`crate::cm`]:
    /// the path MTU is the smaller of both sides', the PSNs are the exchanged ones.
    pub fn connect(
        &self,
        local: &crate::cm::EndpointInfo,
        peer: &crate::cm::EndpointInfo,
        opts: &ConnectOptions,
    ) -> Result<()> {
        if self.state() == QpState::Reset {
            self.modify_to_init(&InitAttr {
                access: opts.access,
                ..InitAttr::default()
            })?;
        }
        let rtr = RtrAttr {
            path_mtu: local.mtu.min(peer.mtu),
            dest_qpn: peer.qpn,
            dest_gid: peer.gid,
            rq_psn: peer.psn,
            max_dest_rd_atomic: local.max_rd_atomic,
            min_rnr_timer: opts.min_rnr_timer,
        };
        self.modify_to_rtr_with_port(&rtr, peer.udp_port)?;
        self.set_peer_acks_unasked(peer.acks_unasked);
        let rts = RtsAttr {
            sq_psn: local.psn,
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            max_rd_atomic: opts.max_rd_atomic.min(peer.max_rd_atomic).max(1),
        };
        self.modify_to_rts(&rts)
    }
}
