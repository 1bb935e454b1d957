//! Connected queue pairs of the verbs API: reliable (RC) and unreliable (UC).
//!
//! A [`QueuePair`] wraps the transport's [`ferroce_proto::QueuePair`] behind a lock shared with
//! the engine (see `qp_core`): posting is a call on the transport (so errors come back at once,
//! as from `ibv_post_send`) followed by a doorbell, which transmits inline when the engine is
//! free. A request a same-host peer's memory can take directly is done inside the post
//! (`provider::shm::direct`).

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferroce_proto::{Access, InitAttr, QpCaps, QpState, RecvWr, RtrAttr, RtsAttr, SendWr};

use super::context::ContextInner;
use super::cq::CompletionQueue;
use super::device::ip_of;
use super::qp_core::QpShared;
use super::sender::{QpSender, SendRequest};

/// How long after its hello went out a QP's posts look for the peer's hello themselves.
const HELLO_AWAITED_FOR: std::time::Duration = std::time::Duration::from_secs(1);
use super::srq::SharedReceiveQueue;
use crate::error::{Error, Result};
use crate::provider::{direct, route_completions, Link, Provider};

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

/// A connected queue pair: RC ([`super::ProtectionDomain::create_qp`]) or UC
/// ([`super::ProtectionDomain::create_uc_qp`]).
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
        self.shared.udp.port
    }

    fn with<T>(&self, f: impl FnOnce(&mut ferroce_proto::QueuePair) -> T) -> T {
        let mut q = self.shared.qp.lock();
        let r = f(&mut q);
        self.shared.publish_state(&q);
        r
    }

    /// The provider chosen for this QP's bytes: `Shm` from the moment a link to a same-host
    /// peer is asked for (at RTR, its hello sent) — packets go through the ring only once the
    /// peer's hello is in, and until then (or if the peer's hello is refused) over UDP — and
    /// `Udp` otherwise. Not a sign that the link is up.
    pub fn provider(&self) -> Provider {
        match &self.shared.shm {
            Some(s) if !matches!(*s.lock(), Link::Off) => Provider::Shm,
            _ => Provider::Udp,
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

    /// The rate DCQCN allows this QP to send at now, in bytes per second: `None` for no limit
    /// (no CNP has come from the peer yet, or the rate has recovered to the line rate). See
    /// [`crate::Ecn`] and `ferroce_proto::dcqcn`.
    pub fn congestion_rate(&self) -> Option<u64> {
        let now = self.ctx.shared.now();
        self.with(|q| q.congestion_rate(now))
    }

    /// The next PSN this QP will use (to tell the peer, before RTS it is the initial PSN).
    pub fn next_send_psn(&self) -> ferroce_wire::Psn {
        self.with(|q| q.next_send_psn())
    }

    /// RESET → INIT.
    pub fn modify_to_init(&self, attr: &InitAttr) -> Result<()> {
        Ok(self.with(|q| q.modify_to_init(attr))?)
    }

    /// INIT → RTR, with the peer on the standard RoCE v2 port 4791 — or, for a context opened
    /// with [`crate::ContextOptions::host_slot`] and a peer GID of this host, on the port its
    /// QPN names ([`crate::host_slot::port_of_qpn`]).
    pub fn modify_to_rtr(&self, attr: &RtrAttr) -> Result<()> {
        let port = if self.ctx.shared.slot.is_some() && is_local_address(ip_of(attr.dest_gid)) {
            crate::host_slot::port_of_qpn(attr.dest_qpn)
        } else {
            ferroce_wire::ROCE_V2_UDP_PORT
        };
        self.modify_to_rtr_with_port(attr, port)
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
        // A peer on this host is reached through no shared link (see
        // `ContextOptions::congestion_to_local_peers`).
        let uncontrolled_path = !self.ctx.shared.congestion_to_local_peers
            && (peer_ip == local_ip || is_local_address(peer_ip));
        // The QP's socket stays unconnected, though it sends only to its peer: Linux gives
        // datagrams with DF set from a connected socket an incrementing IPv4 Identification,
        // and the ICRC covers that field — the packets would leave with ICRCs computed for
        // Identification 0 (all ferroce can know), which a real RoCE peer rejects.
        {
            let mut core = self.shared.qp.lock();
            core.modify_to_rtr(attr)?;
            core.peer = Some(dest);
            // Decided per connection: a QP reset and connected again may have another peer.
            let cc = core.congestion_chosen.unwrap_or_else(|| {
                let mut cc = self.ctx.shared.congestion;
                if uncontrolled_path {
                    cc.algorithm = ferroce_proto::CcAlgorithm::Off;
                }
                cc
            });
            if core.congestion_control() != cc {
                core.set_congestion_control(cc);
            }
            self.shared.publish_state(&core);
        }
        if let (Some(host), Some(shm)) = (&self.ctx.shared.shm, &self.shared.shm) {
            let linked = host
                .start_link(shm, self.shared.qpn, dest, attr.dest_qpn)
                .map_err(|e| Error::io(format!("reaching {dest} through shared memory"), e))?;
            if !linked && host.provider == Provider::Shm {
                return Err(Error::InvalidArgument(format!(
                    "no ferroce context at {dest} on this host that this process may link with \
                     through shared memory (none listens there, or it belongs to another user; \
                     provider shm is forced)"
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
        // What already arrived is taken first: a peer's ACK may sit in the socket or the ring
        // while the word to disconnect, which came by another way (the CM), overtook it. On
        // real hardware the NIC processed that ACK long before the program heard of the
        // disconnect, and the send it acknowledges completes with success, not as flushed
        // (measured: libfabric's rdm pingpong on one host failed 1 run in 20 on its final
        // message this way).
        crate::provider::take_arrived(&self.ctx.shared);
        // What this side received and completed is acknowledged before it stops answering.
        crate::provider::send_owed(&self.ctx.shared, &self.shared);
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
            core.path_rtt_shared_at = None;
            self.shared.publish_state(&core);
        }
        // The next peer may be anyone.
        self.set_peer_small_identifications(false);
        self.set_selective_repeat(false);
        self.set_keep_out_of_order(false);
        if let Some(shm) = &self.shared.shm {
            shm.unlink(Link::Off);
        }
    }

    /// Posts a send work request (`wr` or `&wr`, see [`SendRequest`]) and rings the doorbell.
    pub fn post_send<'a>(&self, wr: impl SendRequest<'a>) -> Result<()> {
        self.post_request(wr.into_request())
    }

    pub(super) fn post_request(&self, wr: Cow<'_, SendWr>) -> Result<()> {
        if self.post_one(wr)? {
            self.ctx.shared.doorbell(&self.shared);
        }
        Ok(())
    }

    /// A handle that posts to this QP from one thread at a time (it posts through `&mut`),
    /// and so may skip the QP's lock: see [`QpSender`].
    pub fn sender(&self) -> QpSender<'_> {
        let (caps, service, pd) = self.with(|q| (q.caps(), q.service(), q.pd()));
        QpSender {
            qp: self,
            caps,
            service,
            pd,
            peer: None,
            shortcut: None,
            last_direct: None,
            direct_ops: 0,
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

    /// Tells the QP whether its peer sends every packet with an IPv4 Identification below
    /// [`crate::SENT_IDENTIFICATION_LIMIT`], as ferroce does
    /// ([`crate::cm::EndpointInfo::small_identifications`]; [`QueuePair::connect`] sets it from
    /// the exchange). A UDP socket does not show the Identification the ICRC covers, so the
    /// receive path solves for it; with this on, it believes only a solution below the limit
    /// and counts any other packet as an ICRC error (`icrc_errors`): such a packet is checked
    /// by 26 bits of its ICRC instead of 16. Leave it off (the default, and again after
    /// [`reset`](Self::reset)) for a peer that may number its packets, such as Linux rxe. A
    /// context opened with [`crate::ContextOptions::icrc_strict`] believes no solution at all.
    pub fn set_peer_small_identifications(&self, on: bool) {
        self.shared
            .peer_small_identifications
            .store(on, Ordering::Relaxed);
    }

    /// Turns selective repeat on or off for this QP, both directions
    /// ([`crate::cm::EndpointInfo::selective_repeat`]; [`QueuePair::connect`] turns it on when
    /// both sides offer it). Only toward a peer that does it too: a standard responder (Linux
    /// rxe, a NIC) drops every packet after a gap, and a requester that then sent only the
    /// missing one would wait for its timeout for the rest. Off by default, and again after
    /// [`reset`](Self::reset).
    pub fn set_selective_repeat(&self, on: bool) {
        self.shared.qp.lock().set_selective_repeat(on);
    }

    /// Lets this QP's responder keep requests that arrive after a gap, toward any peer (see
    /// `ferroce_proto::QueuePair::set_keep_out_of_order`).
    pub fn set_keep_out_of_order(&self, on: bool) {
        self.shared.qp.lock().set_keep_out_of_order(on);
    }

    /// Whether selective repeat is on for this QP (see
    /// [`set_selective_repeat`](Self::set_selective_repeat)): what a connection negotiated, for
    /// those that report it (the drop-in libibverbs' `ibv_query_ece`).
    pub fn selective_repeat(&self) -> bool {
        self.shared.qp.lock().selective_repeat()
    }

    /// The congestion window in packets (fractional below one: then paced), while a window
    /// applies: what `ss -i` shows as cwnd for a TCP socket.
    pub fn congestion_window(&self) -> Option<f64> {
        self.shared.qp.lock().congestion_window()
    }

    /// The smoothed and the smallest recent round-trip time, once measured.
    pub fn round_trip(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        let core = self.shared.qp.lock();
        core.smoothed_rtt().zip(core.min_rtt())
    }

    /// The congestion control this QP runs now (decided at RTR unless set; see
    /// [`set_congestion_control`](Self::set_congestion_control)).
    pub fn congestion_control(&self) -> ferroce_proto::CcConfig {
        self.shared.qp.lock().congestion_control()
    }

    /// Sets this QP's congestion control (the context's
    /// [`crate::ContextOptions::congestion`] by default, none toward a peer on this host
    /// unless [`crate::ContextOptions::congestion_to_local_peers`]); the window starts over.
    /// The choice holds whoever the peer turns out to be.
    pub fn set_congestion_control(&self, config: ferroce_proto::CcConfig) {
        let mut core = self.shared.qp.lock();
        core.set_congestion_control(config);
        core.congestion_chosen = Some(config);
    }

    /// Takes the peer's hello now if this QP waits for it: it is most likely in the socket
    /// already (it left before the peer reported RTS), and the next request can then go
    /// straight to the peer's memory rather than wait for the engine's next look.
    ///
    /// Only for a while after the hello went out: a link that has not formed by then may never
    /// form (the peer's hello was refused), and a forced look at every post would cost its
    /// system calls on every request; the engine keeps looking at its own pace.
    fn take_waiting_hello(&self) {
        if let Some(shm) = &self.shared.shm {
            if shm.linked.load(Ordering::Acquire) {
                return;
            }
            let fresh = matches!(&*shm.lock(), Link::Pending { since, .. }
                if since.elapsed() < HELLO_AWAITED_FOR);
            if fresh {
                let shared = &self.ctx.shared;
                shared.poll_shm_host(shared.now(), true, false);
            }
        }
    }

    /// Does `wr` at once in a same-host peer's memory if it can (see `shm::direct`), else
    /// queues it for the transport; returns whether it was queued (a doorbell is due).
    fn post_one(&self, wr: Cow<'_, SendWr>) -> Result<bool> {
        self.take_waiting_hello();
        if let Some(shm) = self.shared.shm_linked() {
            let mut q = self.shared.qp.lock();
            refresh_peer_memory(&mut q, shm);
            if let Some(wc) = direct::execute(&self.ctx.shared, &mut q, &wr) {
                q.direct_ops += 1;
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
                        route_completions(&self.shared, &mut wcs);
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

    /// Maps `len` bytes at `addr` of the region `rkey` of this QP's same-host peer into this
    /// process, so that a protocol can move small amounts with plain loads and stores instead of
    /// posting one-sided operations (NCCL's shared-memory transports do so). The access is
    /// checked as a one-sided operation needing `need` is (the peer QP serves, the key is
    /// current and in its protection domain, has the rights, and the range lies inside).
    /// `None` unless the QP is linked over shared memory (a hello waiting in the socket is
    /// taken first) and every check passes.
    ///
    /// The mapping stays valid while the returned value lives, whatever the peer does; but it
    /// is the peer's memory *as it was registered*: if the peer deregisters the region, stores
    /// through the mapping no longer reach anything it reads, and no error says so (an RDMA
    /// operation would fail). Use it only where the protocol keeps the region registered.
    pub fn map_peer_region(
        &self,
        addr: u64,
        rkey: u32,
        len: usize,
        need: Access,
    ) -> Option<PeerRegionMap> {
        self.take_waiting_hello();
        let shm = self.shared.shm_linked()?;
        let mut q = self.shared.qp.lock();
        refresh_peer_memory(&mut q, shm);
        let (map, offset) = q
            .peer_memory
            .as_mut()?
            .resolve_shared(rkey, addr, len as u64, need)?;
        Some(PeerRegionMap { map, offset, len })
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

/// Whether `ip` is an address of this host (of this network namespace): the kernel routes to
/// it through the loopback device, so a UDP socket connected to it (which sends nothing) takes
/// it as its own source. Not "binding to it works": with `ip_nonlocal_bind` set (common on
/// load balancers and keepalived hosts) every address binds. An IPv6 link-local address
/// without a scope cannot be routed and counts as not local.
pub(crate) fn is_local_address(ip: IpAddr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    let any = match ip {
        IpAddr::V4(_) => IpAddr::from([0u8; 4]),
        IpAddr::V6(_) => IpAddr::from([0u16; 8]),
    };
    std::net::UdpSocket::bind(SocketAddr::new(any, 0)).is_ok_and(|s| {
        s.connect(SocketAddr::new(ip, 9)).is_ok() && s.local_addr().is_ok_and(|a| a.ip() == ip)
    })
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
            gid: super::device::gid_of(self.ctx.shared.local.ip()),
            udp_port: self.ctx.shared.local.port(),
            mtu: self.ctx.shared.device.active_mtu(),
            max_rd_atomic: ferroce_proto::attr::MAX_RD_ATOMIC,
            region,
            acks_unasked: true,
            small_identifications: true,
            selective_repeat: self.ctx.shared.selective_repeat,
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
        self.connect_rtr(local, peer, opts)?;
        self.connect_rts(local, peer, opts)
    }

    /// INIT → RTR towards `peer`, the step of [`connect`](Self::connect) that takes the peer's
    /// endpoint (for callers that move through the states one by one, as pyverbs programs do).
    pub fn connect_rtr(
        &self,
        local: &crate::cm::EndpointInfo,
        peer: &crate::cm::EndpointInfo,
        opts: &ConnectOptions,
    ) -> Result<()> {
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
        self.set_peer_small_identifications(peer.small_identifications);
        self.set_selective_repeat(local.selective_repeat && peer.selective_repeat);
        Ok(())
    }

    /// RTR → RTS, sending from `local`'s PSN: the last step of [`connect`](Self::connect).
    pub fn connect_rts(
        &self,
        local: &crate::cm::EndpointInfo,
        peer: &crate::cm::EndpointInfo,
        opts: &ConnectOptions,
    ) -> Result<()> {
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

/// A same-host peer's registered bytes mapped into this process: see
/// [`QueuePair::map_peer_region`].
#[derive(Debug, Clone)]
pub struct PeerRegionMap {
    map: std::sync::Arc<crate::provider::SharedMap>,
    offset: usize,
    len: usize,
}

impl PeerRegionMap {
    /// The first byte (the peer's `addr`). Loads and stores through it race with the peer's
    /// own accesses and with other initiators' one-sided operations: the caller's protocol must
    /// order them (atomics, or a flag stored last with release ordering).
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: `offset` lies inside the mapping (`resolve` checked `offset + len` does).
        unsafe { self.map.ptr().add(self.offset) }
    }

    /// How many bytes are mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes are mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Makes `q`'s view of its linked peer's memory current with the link's generation.
fn refresh_peer_memory(q: &mut crate::provider::QpCore, shm: &crate::provider::ShmQp) {
    let generation = shm.generation.load(Ordering::Acquire);
    if q.peer_memory.as_ref().map(|m| m.generation) != Some(generation) {
        q.peer_memory = match &*shm.lock() {
            Link::Linked(peer) => Some(peer.memory(generation)),
            _ => None,
        };
    }
}
