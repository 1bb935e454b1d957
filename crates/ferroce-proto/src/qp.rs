//! The reliable-connection queue pair: its state machine and its sans-IO interface.
//!
//! # Driving a queue pair
//! The QP is a value that is driven, like quinn-proto's `Connection`. In a loop:
//! 1. application commands: [`QueuePair::post_send`], [`QueuePair::post_recv`], the `modify_*`
//!    transitions;
//! 2. inputs: [`QueuePair::handle_packet`] (or [`QueuePair::handle_packet_ecn`], which also
//!    says whether the IP header arrived marked Congestion Experienced) for every packet
//!    addressed to the QP, and [`QueuePair::handle_timeout`] once [`QueuePair::next_timeout`]
//!    has passed;
//! 3. outputs: [`QueuePair::poll_transmit`] until it returns `None`, then
//!    [`QueuePair::poll_completion`] until it returns `None`.
//!
//! Nothing inside reads a clock, waits or does I/O. Memory is reached through the [`Memory`]
//! trait, passed into each call that needs it.
//!
//! # Parts
//! The send side is the [`crate::requester`] (segmentation, PSNs, retransmission) and its
//! completer (ACK/NAK and response handling); the receive side is the [`crate::responder`].
//! Congestion notification is DCQCN's ([`crate::dcqcn`]): the QP is the notification point for
//! what it receives (a CE-marked packet owes the peer a CNP, which [`QueuePair::poll_transmit`]
//! sends before anything else) and the reaction point for what it sends (a CNP from the peer
//! cuts the rate [`QueuePair::congestion_rate`] reports).

use std::collections::VecDeque;
use std::net::Ipv6Addr;

use ferroce_wire::opcode::Operation;
use ferroce_wire::{Opcode, PacketRepr, Psn, RocePacket, WireError};

use crate::attr::{
    ack_timeout, InitAttr, PathMtu, PostError, QpCaps, QpError, RtrAttr, RtsAttr, Service,
    MAX_MESSAGE_LEN,
};
use crate::cc::CcConfig;
use crate::completion::{WcOpcode, WcStatus, WorkCompletion};
use crate::counters::Counters;
use crate::dcqcn::{Dcqcn, NotificationPoint, MIN_TIME_BETWEEN_CNPS};
use crate::memory::{Access, Memory};
use crate::reorder::{NotHeld, ReorderBuffer};
use crate::requester::Requester;
use crate::responder::Responder;
use crate::time::Instant;
use crate::uc::UcSender;
use crate::wr::{RecvWr, SendWr};

/// The states of a queue pair (IBTA 10.3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created or reset: nothing is processed.
    Reset,
    /// Receives may be posted; nothing is processed yet.
    Init,
    /// Ready to receive: requests from the peer are served.
    Rtr,
    /// Ready to send: the full RC protocol runs.
    Rts,
    /// Send queue drain: no new send requests start; those under way finish.
    Sqd,
    /// Send queue error (an unreliable-transport state; an RC QP goes to `Error` instead).
    Sqe,
    /// Error: every outstanding request is flushed.
    Error,
}

impl QpState {
    /// rdma-core's name for the state.
    pub const fn name(self) -> &'static str {
        match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Sqd => "SQD",
            QpState::Sqe => "SQE",
            QpState::Error => "ERR",
        }
    }
}

/// The connection's parameters, fixed by the transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    pub qpn: u32,
    pub pd: u32,
    pub access: Access,
    pub pkey: u16,
    pub mtu: u32,
    pub dest_qpn: u32,
    pub dest_gid: Ipv6Addr,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    /// How many unsignaled SEND/WRITE messages in a row may go without asking for an ACK
    /// (0: every message asks), set by [`QueuePair::set_peer_acks_unasked`].
    pub unasked_run: u32,
    /// Congestion control of the requester (see [`crate::cc`]).
    pub cc: crate::cc::CcConfig,
    /// The peer keeps packets that arrive after a gap, and so does this side (negotiated; see
    /// [`QueuePair::set_selective_repeat`]).
    pub selective_repeat: bool,
    /// This side's responder keeps requests that arrive after a gap, whatever the peer does
    /// (see [`QueuePair::set_keep_out_of_order`]).
    pub keep_out_of_order: bool,
    /// RC or UC, fixed at creation.
    pub service: Service,
}

/// What the requester and responder share with the QP during one call.
pub(crate) struct Ctx<'a> {
    pub p: &'a Params,
    pub state: QpState,
    pub counters: &'a mut Counters,
    pub mem: &'a mut dyn Memory,
    /// Set when the call hit an error that moves the QP to `Error`.
    pub fatal: bool,
}

/// Pending receive completions of the responder and send completions of the requester are
/// merged in the QP's completion queue in the order they happen.
pub(crate) type CompletionQueue = VecDeque<WorkCompletion>;

/// Most unsignaled messages in a row that go without asking for an ACK when the peer
/// acknowledges unasked requests (see [`QueuePair::set_peer_acks_unasked`]); at most half the
/// send queue, so unacknowledged requests never fill it.
pub const UNASKED_RUN: u32 = 16;

/// A connected queue pair: RC, or UC (see [`crate::uc`]).
#[derive(Debug)]
pub struct QueuePair {
    params: Params,
    caps: QpCaps,
    state: QpState,
    pub(crate) req: Requester,
    /// The send side of a UC QP (an RC QP sends through `req`).
    uc: UcSender,
    pub(crate) resp: Responder,
    /// Requests kept ahead of a gap (selective repeat only).
    reorder: ReorderBuffer,
    /// The responder owes its peer a SACK (selective repeat; see [`crate::sack`]).
    sack_due: bool,
    /// The caller's cap on the sending rate ([`Self::set_rate_cap`]).
    rate_cap: Option<u64>,
    completions: CompletionQueue,
    counters: Counters,
    /// DCQCN's notification point: whether a CNP is owed to the peer.
    np: NotificationPoint,
    /// DCQCN's reaction point: the rate CNPs from the peer allow.
    rp: Dcqcn,
}

impl QueuePair {
    /// A new RC QP in the RESET state.
    pub fn new(qpn: u32, pd: u32, caps: QpCaps) -> QueuePair {
        QueuePair::with_service(qpn, pd, caps, Service::Rc)
    }

    /// A new QP of `service` in the RESET state.
    pub fn with_service(qpn: u32, pd: u32, caps: QpCaps, service: Service) -> QueuePair {
        QueuePair {
            params: Params {
                qpn: qpn & 0x00ff_ffff,
                pd,
                access: Access::NONE,
                pkey: ferroce_wire::bth::DEFAULT_PKEY,
                mtu: 1024,
                dest_qpn: 0,
                dest_gid: Ipv6Addr::UNSPECIFIED,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                unasked_run: 0,
                cc: crate::cc::CcConfig::default(),
                selective_repeat: false,
                keep_out_of_order: false,
                service,
            },
            caps,
            state: QpState::Reset,
            req: Requester::default(),
            uc: UcSender::default(),
            resp: Responder::default(),
            reorder: ReorderBuffer::default(),
            sack_due: false,
            rate_cap: None,
            completions: VecDeque::new(),
            counters: Counters::default(),
            np: NotificationPoint::default(),
            rp: Dcqcn::default(),
        }
    }

    // ---- getters ------------------------------------------------------------------------

    /// What remote peers may do through this QP (set at INIT).
    #[inline]
    pub fn access(&self) -> Access {
        self.params.access
    }

    /// RC or UC.
    #[inline]
    pub fn service(&self) -> Service {
        self.params.service
    }

    /// The QP number.
    #[inline]
    pub fn qpn(&self) -> u32 {
        self.params.qpn
    }
    /// The protection domain.
    #[inline]
    pub fn pd(&self) -> u32 {
        self.params.pd
    }
    /// The current state.
    #[inline]
    pub fn state(&self) -> QpState {
        self.state
    }
    /// The peer's QP number (meaningful from RTR on).
    pub fn dest_qpn(&self) -> u32 {
        self.params.dest_qpn
    }
    /// The peer's GID (meaningful from RTR on).
    pub fn dest_gid(&self) -> Ipv6Addr {
        self.params.dest_gid
    }
    /// Path MTU in bytes.
    pub fn mtu(&self) -> u32 {
        self.params.mtu
    }
    /// Counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
    /// Send requests posted and not yet completed.
    pub fn send_queue_len(&self) -> usize {
        self.req.len() + self.uc.len()
    }
    /// Receive requests posted and not yet consumed.
    pub fn recv_queue_len(&self) -> usize {
        self.resp.rq_len()
    }
    /// The next PSN this QP will give a new request.
    pub fn next_send_psn(&self) -> Psn {
        match self.params.service {
            Service::Rc => self.req.next_psn(),
            Service::Uc => self.uc.next_psn(),
        }
    }
    /// The oldest PSN this QP sent that is not yet acknowledged (UC: the next PSN, since
    /// nothing waits for an acknowledgement).
    pub fn unacked_psn(&self) -> Psn {
        match self.params.service {
            Service::Rc => self.req.una(),
            Service::Uc => self.uc.next_psn(),
        }
    }
    /// The PSN this QP expects next from its peer.
    pub fn expected_psn(&self) -> Psn {
        self.resp.expected_psn()
    }
    /// Whether the send queue is drained: nothing posted is waiting or unacknowledged.
    #[inline]
    pub fn is_send_queue_empty(&self) -> bool {
        self.req.len() == 0 && self.uc.len() == 0
    }

    // ---- state transitions --------------------------------------------------------------

    fn transition(&self, to: QpState, allowed_from: &[QpState]) -> Result<(), QpError> {
        if allowed_from.contains(&self.state) {
            Ok(())
        } else {
            Err(QpError::InvalidTransition {
                from: self.state,
                to,
            })
        }
    }

    /// RESET → INIT (or INIT → INIT to change the access flags).
    pub fn modify_to_init(&mut self, attr: &InitAttr) -> Result<(), QpError> {
        self.transition(QpState::Init, &[QpState::Reset, QpState::Init])?;
        if attr.pkey_index != 0 {
            return Err(QpError::InvalidAttribute {
                name: "pkey_index",
                value: attr.pkey_index.into(),
            });
        }
        if attr.port != 1 {
            return Err(QpError::InvalidAttribute {
                name: "port_num",
                value: attr.port.into(),
            });
        }
        self.params.access = attr.access;
        self.state = QpState::Init;
        Ok(())
    }

    /// INIT → RTR: the QP starts serving the peer's requests.
    pub fn modify_to_rtr(&mut self, attr: &RtrAttr) -> Result<(), QpError> {
        self.transition(QpState::Rtr, &[QpState::Init])?;
        attr.validate()?;
        self.params.mtu = attr.path_mtu.bytes();
        self.params.dest_qpn = attr.dest_qpn;
        self.params.dest_gid = attr.dest_gid;
        self.params.max_dest_rd_atomic = attr.max_dest_rd_atomic.max(1);
        self.params.min_rnr_timer = attr.min_rnr_timer;
        self.resp.start(attr.rq_psn);
        self.state = QpState::Rtr;
        Ok(())
    }

    /// RTR → RTS: the QP starts sending.
    pub fn modify_to_rts(&mut self, attr: &RtsAttr) -> Result<(), QpError> {
        self.transition(QpState::Rts, &[QpState::Rtr])?;
        attr.validate()?;
        self.params.timeout = attr.timeout;
        self.params.retry_cnt = attr.retry_cnt;
        self.params.rnr_retry = attr.rnr_retry;
        self.params.max_rd_atomic = attr.max_rd_atomic.max(1);
        match self.params.service {
            Service::Rc => self.req.start(attr.sq_psn, &self.params),
            Service::Uc => self.uc.start(attr.sq_psn),
        }
        self.state = QpState::Rts;
        Ok(())
    }

    /// RTS → SQD: stop starting new send requests; those under way complete.
    pub fn modify_to_sqd(&mut self) -> Result<(), QpError> {
        self.transition(QpState::Sqd, &[QpState::Rts, QpState::Sqd])?;
        self.state = QpState::Sqd;
        Ok(())
    }

    /// SQD or SQE → RTS: resume sending.
    pub fn modify_sqd_to_rts(&mut self) -> Result<(), QpError> {
        self.transition(QpState::Rts, &[QpState::Sqd, QpState::Sqe])?;
        self.state = QpState::Rts;
        Ok(())
    }

    /// Any state → ERR: every outstanding work request completes with the flush status.
    pub fn modify_to_error(&mut self) {
        self.enter_error();
    }

    /// Any state → RESET: everything is discarded without completions.
    pub fn reset(&mut self) {
        self.state = QpState::Reset;
        self.req = Requester::default();
        self.uc = UcSender::default();
        self.resp = Responder::default();
        self.reorder.clear();
        self.completions.clear();
        self.np = NotificationPoint::default();
        self.rp = Dcqcn::new(*self.rp.config());
    }

    /// Tells the requester whether the peer's responder acknowledges requests that do not ask
    /// for it (the AckReq bit clear) within [`crate::responder::UNASKED_ACK_DELAY`], as
    /// ferroce's does. Then an unsignaled SEND or WRITE need not ask: nobody waits for its
    /// completion, and the peer's next ACK covers it. In a ping-pong that saves the responder
    /// an ACK per message — over UDP a datagram through the kernel on each side. Signaled
    /// requests, READs, atomics, retransmissions and every [`UNASKED_RUN`]th message still ask,
    /// and so does everything while the local ACK timeout is shorter than four times the delay
    /// (the retransmission timer must not fire for an ACK the peer merely holds). Off by
    /// default: a responder that acknowledges only what asks (Linux rxe) would leave an
    /// unsignaled last request to the retransmission timer. Allowed in any state.
    pub fn set_peer_acks_unasked(&mut self, on: bool) {
        self.params.unasked_run = if on {
            UNASKED_RUN.min(self.caps.max_send_wr / 2)
        } else {
            0
        };
    }

    /// Changes the path MTU (allowed in RTR, RTS and SQD; takes effect for new messages).
    pub fn set_path_mtu(&mut self, mtu: PathMtu) -> Result<(), QpError> {
        self.transition(self.state, &[QpState::Rtr, QpState::Rts, QpState::Sqd])?;
        self.params.mtu = mtu.bytes();
        Ok(())
    }

    /// Turns selective repeat on or off, for both directions: this side's responder keeps
    /// requests that arrive after a gap (see [`crate::reorder`]), and its requester takes a
    /// sequence-error NAK as one missing packet and sends only it again. Only for a peer that
    /// does the same (ferroce negotiates it in its connection exchange); a standard responder
    /// drops what follows a gap, so toward it a QP must keep go-back-N (the default). Allowed
    /// in any state.
    pub fn set_selective_repeat(&mut self, on: bool) {
        // UC keeps nothing and resends nothing: there is nothing to repeat.
        let on = on && self.params.service == Service::Rc;
        self.params.selective_repeat = on;
        self.req.set_selective_repeat(on);
        if !on && !self.params.keep_out_of_order {
            self.reorder.clear();
        }
    }

    /// Lets this side's responder keep requests that arrive after a gap, toward any peer: the
    /// gap is still NAKed as IBTA's go-back-N has it (a sequence error), and the peer sends
    /// again from the gap, but once the missing packet arrives what was kept is taken at once
    /// and acknowledged with it. To the peer that is indistinguishable from its resends
    /// arriving without loss; it saves a peer whose resend of the packets after the gap is
    /// lost too from waiting out its retransmission timer (a kernel initiator's is about 2 s
    /// over RoCE, and Linux rxe 6.1 was seen not to fire it at all for the packet after a
    /// NAKed gap, stalling an NVMe/RDMA queue until its 30 s I/O timeout). Only SENDs and
    /// WRITEs are kept (a READ or atomic answered early would meet a requester that went
    /// back). Without selective repeat no SACK is sent. Allowed in any state.
    pub fn set_keep_out_of_order(&mut self, on: bool) {
        let on = on && self.params.service == Service::Rc;
        self.params.keep_out_of_order = on;
        if !on && !self.params.selective_repeat {
            self.reorder.clear();
        }
    }

    /// Whether selective repeat is on.
    pub fn selective_repeat(&self) -> bool {
        self.params.selective_repeat
    }

    /// Says whether the path to the peer never loses a packet, as a shared-memory ring does:
    /// then only the IBTA `timeout` resends (no fast retransmission timeout, no tail-loss
    /// probe), since any resend there is spurious — the peer was merely slow, as it is when a
    /// busy host keeps it off the CPU for milliseconds. Off by default.
    pub fn set_lossless_path(&mut self, on: bool) {
        self.req.set_lossless_path(on);
    }

    /// Whether the path is taken to be lossless (see [`Self::set_lossless_path`]).
    pub fn lossless_path(&self) -> bool {
        self.req.lossless_path()
    }

    /// Sets the requester's congestion control (see [`crate::cc`]); the window starts over.
    /// Allowed in any state.
    pub fn set_congestion_control(&mut self, config: CcConfig) {
        self.params.cc = config;
        self.req.set_congestion_control(config);
    }

    /// The congestion control in force.
    pub fn congestion_control(&self) -> CcConfig {
        self.params.cc
    }

    /// The congestion window in packets, once the QP sends and while a controller runs.
    pub fn congestion_window(&self) -> Option<f64> {
        self.req.congestion_window()
    }

    /// The path's smoothed round-trip time, once measured.
    pub fn smoothed_rtt(&self) -> Option<core::time::Duration> {
        self.req.rtt().srtt()
    }

    /// The smallest RTT this QP measured within [`crate::rtt::MIN_RTT_WINDOW`], once measured.
    pub fn min_rtt(&self) -> Option<core::time::Duration> {
        (self.req.rtt().samples() > 0).then(|| self.req.rtt().min_rtt())
    }

    /// Tells the QP the smallest recent RTT that other QPs to the same peer measured, or
    /// forgets it. The delay-based window measures queueing against the smaller of that and
    /// its own: a QP that starts while others already fill the bottleneck's queue sees only
    /// queued round trips, would take the queue for the path's base delay and never yield it
    /// (TCP Vegas' latecomer problem). The host knows better: the first of them saw the path
    /// empty.
    pub fn set_path_min_rtt(&mut self, rtt: Option<core::time::Duration>) {
        self.req.set_path_min_rtt(rtt);
    }

    /// Caps the rate at which data packets leave (bytes per second), or lifts the cap: the
    /// hook for an ECN reaction point.
    pub fn set_rate_cap(&mut self, cap: Option<u64>) {
        self.rate_cap = cap;
    }

    fn enter_error(&mut self) {
        self.reorder.clear();
        self.state = QpState::Error;
        self.req.flush(&self.params, &mut self.completions);
        self.uc.flush(&self.params, &mut self.completions);
        self.resp.flush(&self.params, &mut self.completions);
    }

    // ---- application commands ----------------------------------------------------------

    /// Posts a send work request (the doorbell). In ERR the request completes at once with
    /// the flush status, as the IBTA requires.
    pub fn post_send(&mut self, wr: SendWr) -> Result<(), PostError> {
        if self.admit_send(&wr)? {
            match self.params.service {
                Service::Rc => self.req.push(wr),
                Service::Uc => self.uc.push(wr, self.params.mtu),
            }
        }
        Ok(())
    }

    /// [`Self::post_send`] of a request the caller keeps: the queue takes a copy, made in
    /// the allocation of a request that already retired (a ping-pong or a stream reposting
    /// one request allocates nothing).
    pub fn post_send_copy(&mut self, wr: &SendWr) -> Result<(), PostError> {
        if self.admit_send(wr)? {
            match self.params.service {
                Service::Rc => self.req.push_copy(wr),
                Service::Uc => self.uc.push_copy(wr, self.params.mtu),
            }
        }
        Ok(())
    }

    /// The checks of a post; `Ok(false)` when the request completed at once (flushed in ERR).
    fn admit_send(&mut self, wr: &SendWr) -> Result<bool, PostError> {
        self.check_send(wr)?;
        if self.send_queue_len() >= self.caps.max_send_wr as usize {
            return Err(PostError::QueueFull(self.caps.max_send_wr));
        }
        if self.state == QpState::Error {
            self.completions
                .push_back(crate::requester::flushed(&self.params, wr));
            return Ok(false);
        }
        Ok(true)
    }

    /// Whether `wr` could be posted now (state, scatter/gather list, inline data, atomic
    /// buffer, length), without posting it: what [`Self::post_send`] checks before queueing,
    /// except the queue's capacity.
    #[inline]
    pub fn check_send(&self, wr: &SendWr) -> Result<(), PostError> {
        check_send_request(self.state, &self.caps, self.params.service, wr)
    }

    /// The capacities the QP was created with (they never change).
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Whether completions are waiting for [`Self::poll_completion`].
    pub fn has_completions(&self) -> bool {
        !self.completions.is_empty()
    }

    /// Posts a receive work request. In ERR it completes at once with the flush status.
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        if self.state == QpState::Reset {
            return Err(PostError::InvalidState(self.state));
        }
        if self.resp.rq_len() >= self.caps.max_recv_wr as usize {
            return Err(PostError::QueueFull(self.caps.max_recv_wr));
        }
        if wr.sgl.len() > self.caps.max_recv_sge as usize {
            return Err(PostError::TooManySge {
                given: wr.sgl.len(),
                max: self.caps.max_recv_sge,
            });
        }
        if self.state == QpState::Error {
            self.completions.push_back(WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::WorkRequestFlushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm_data: None,
                invalidated_rkey: None,
                qp_num: self.params.qpn,
                solicited: false,
                src_qp: None,
            });
            return Ok(());
        }
        self.resp.push_recv(wr);
        Ok(())
    }

    // ---- inputs -----------------------------------------------------------------------

    /// Handles a transport packet (BTH to ICRC) addressed to this QP. The ICRC must already
    /// have been checked by the caller, which knows the IP and UDP headers. The same as
    /// [`Self::handle_packet_ecn`] for a packet not marked Congestion Experienced.
    #[inline]
    pub fn handle_packet(
        &mut self,
        now: Instant,
        mem: &mut dyn Memory,
        bytes: &[u8],
    ) -> Result<(), WireError> {
        self.handle_packet_ecn(now, mem, bytes, false)
    }

    /// Handles a transport packet (BTH to ICRC) addressed to this QP, as
    /// [`Self::handle_packet`], with `ce` saying whether its IP header arrived with the ECN
    /// field set to Congestion Experienced (the caller read it from the socket).
    ///
    /// A marked packet is counted (`np_ecn_marked_roce_packets`) and, for an RC packet while
    /// the QP serves its peer (RTR, RTS, SQD, SQE), owes the peer a CNP, at most one per
    /// [`MIN_TIME_BETWEEN_CNPS`]; [`Self::poll_transmit`] sends it first. A CNP from the peer
    /// cuts this QP's sending rate while it sends (RTS, SQD: `rp_cnp_handled`) and is ignored
    /// otherwise (`rp_cnp_ignored`); it is never handed to the requester or responder.
    pub fn handle_packet_ecn(
        &mut self,
        now: Instant,
        mem: &mut dyn Memory,
        bytes: &[u8],
        ce: bool,
    ) -> Result<(), WireError> {
        let expected = self.resp.expected_psn();
        let at_expected = self.handle_one(now, mem, bytes, ce, false)?;
        if !(self.params.selective_repeat || self.params.keep_out_of_order)
            || self.reorder.is_empty()
        {
            return Ok(());
        }
        if at_expected && self.resp.expected_psn() == expected {
            // The in-order path stopped (RNR or an error): the requester goes back anyway.
            self.reorder.clear();
            return Ok(());
        }
        // Feed what was kept behind the gap through the in-order path.
        while self.serves_requests() {
            let next = self.resp.expected_psn();
            let Some(kept) = self.reorder.take(next) else {
                break;
            };
            let r = self.handle_one(now, mem, &kept, false, true);
            self.reorder.recycle(kept);
            if r.is_err() || self.resp.expected_psn() == next {
                self.reorder.clear();
                break;
            }
        }
        // A READ moves the expected PSN past all its response PSNs: anything kept there is
        // no request of the peer's and would otherwise stay (and come back after a wrap).
        self.reorder.drop_before(self.resp.expected_psn());
        if !self.serves_requests() {
            self.reorder.clear();
        } else if !self.reorder.is_empty() {
            // Another hole: report it now rather than when the next packet arrives, and what
            // is kept past it.
            self.resp.nak_gap(&mut self.counters);
            self.sack_due = self.params.selective_repeat;
        }
        Ok(())
    }

    /// Handles one packet (marked CE if `ce`; one kept in the reorder buffer and fed back now
    /// if `kept`, counted when it arrived); returns whether it was a request at the expected
    /// PSN.
    fn handle_one(
        &mut self,
        now: Instant,
        mem: &mut dyn Memory,
        bytes: &[u8],
        ce: bool,
        kept: bool,
    ) -> Result<bool, WireError> {
        let pkt = RocePacket::new_checked(bytes)?;
        let repr = PacketRepr::parse(&pkt)?;
        let info = repr.info()?;
        if info.transport == ferroce_wire::opcode::Transport::Cnp {
            // A CNP answers this QP's own packets, whatever marks it carries itself.
            if matches!(self.state, QpState::Rts | QpState::Sqd) {
                self.counters.rp_cnp_handled += 1;
                self.rp.on_cnp(now);
            } else {
                self.counters.rp_cnp_ignored += 1;
            }
            return Ok(false);
        }
        if ce {
            self.counters.np_ecn_marked_roce_packets += 1;
            if info.transport == ferroce_wire::opcode::Transport::Rc && self.serves_requests() {
                self.np.on_marked(now, MIN_TIME_BETWEEN_CNPS);
            }
        }
        let is_response = matches!(
            info.operation,
            Operation::Acknowledge
                | Operation::AtomicAcknowledge
                | Operation::RdmaReadResponse
                | Operation::SelectiveAck
        );
        // ferroce's SACK is taken only from a peer that negotiated selective repeat; a UC QP
        // takes UC requests and nothing else (no response is ever owed to it).
        let transport_ok = match self.params.service {
            Service::Rc => {
                info.transport == ferroce_wire::opcode::Transport::Rc
                    || (info.operation == Operation::SelectiveAck && self.params.selective_repeat)
            }
            Service::Uc => info.transport == ferroce_wire::opcode::Transport::Uc && !is_response,
        };
        let serves = if is_response {
            matches!(self.state, QpState::Rts | QpState::Sqd | QpState::Sqe)
        } else {
            matches!(
                self.state,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
            )
        };
        if !serves || !transport_ok {
            self.counters.dropped_bad_state += 1;
            return Ok(false);
        }
        let ahead = repr.bth.psn.signed_distance_from(self.resp.expected_psn());
        // Only what could be a packet of this path is kept: the buffer is bounded in bytes too.
        let fits = repr.payload_len <= self.params.mtu as usize;
        // Toward a go-back-N requester only SENDs and WRITEs are kept: a READ or atomic answered
        // from the buffer would reach a requester that went back and drops responses it has
        // not asked for again, and the ACKs after it would then pass an unanswered READ.
        let keeps = self.params.selective_repeat
            || (self.params.keep_out_of_order
                && matches!(info.operation, Operation::Send | Operation::RdmaWrite));
        if !is_response && ahead > 0 && keeps && fits && !kept {
            match self
                .reorder
                .hold(self.resp.expected_psn(), repr.bth.psn, bytes)
            {
                Ok(()) => {
                    self.counters.ooo_held += 1;
                    self.sack_due = self.params.selective_repeat;
                }
                Err(NotHeld::Duplicate) => {
                    // Sent again (a resend or a probe): the requester wants the news.
                    self.counters.ooo_dropped += 1;
                    self.sack_due = self.params.selective_repeat;
                }
                Err(NotHeld::OutOfReach) => self.counters.ooo_dropped += 1,
            }
        }
        if !kept {
            self.counters.rcvd_pkts += 1;
            if info.operation != Operation::SelectiveAck {
                self.counters.rcvd_bytes += repr.payload_len as u64;
            }
        }
        let mut ctx = Ctx {
            p: &self.params,
            state: self.state,
            counters: &mut self.counters,
            mem,
            fatal: false,
        };
        if is_response {
            self.req
                .handle_response(&mut ctx, now, &repr, pkt.payload(), &mut self.completions);
        } else if self.params.service == Service::Uc {
            self.resp
                .handle_uc_request(&mut ctx, now, &repr, pkt.payload(), &mut self.completions);
        } else {
            self.resp
                .handle_request(&mut ctx, now, &repr, pkt.payload(), &mut self.completions);
        }
        if ctx.fatal {
            self.enter_error();
        }
        Ok(!is_response && ahead == 0)
    }

    /// Handles the expiry of the timers [`Self::next_timeout`] announced.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.serves_requests() {
            self.resp.handle_timeout(&mut self.counters, now);
        }
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return;
        }
        if self
            .req
            .handle_timeout(&self.params, &mut self.counters, now)
        {
            self.enter_error();
        }
    }

    // ---- outputs ------------------------------------------------------------------------

    /// When [`Self::handle_timeout`] should be called next, if ever.
    pub fn next_timeout(&self) -> Option<Instant> {
        let unasked = self.resp.next_timeout().filter(|_| self.serves_requests());
        let requester = self
            .req
            .next_timeout()
            .filter(|_| matches!(self.state, QpState::Rts | QpState::Sqd));
        unasked.into_iter().chain(requester).min()
    }

    /// Whether the QP's state lets its responder serve (and acknowledge) requests.
    fn serves_requests(&self) -> bool {
        matches!(
            self.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }

    /// Writes the next packet to send into `buf` (BTH to ICRC; the ICRC bytes are left zero
    /// for the caller, which knows the IP and UDP headers it covers) and returns its length.
    /// `buf` must hold the path MTU plus [`MAX_HEADER_LEN`].
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        mem: &mut dyn Memory,
        buf: &mut [u8],
    ) -> Option<usize> {
        if self.np.is_due() {
            // A CNP before anything else: the longer the peer's sender goes uncut, the longer
            // the queue on the path grows. Owed only while the QP serves its peer (it knows the
            // peer's QPN); one that can no longer leave is forgotten.
            self.np.sent();
            if self.serves_requests() {
                if let Some(n) = crate::emit::cnp(buf, &self.params) {
                    self.counters.np_cnp_sent += 1;
                    self.counters.sent_pkts += 1;
                    self.rp.on_sent(n, now);
                    return Some(n);
                }
            }
        }
        let mut ctx = Ctx {
            p: &self.params,
            state: self.state,
            counters: &mut self.counters,
            mem,
            fatal: false,
        };
        // Responses first: they free the peer's resources and carry its completions.
        let mut out = self.resp.poll_transmit(&mut ctx, buf);
        if out.is_none() && self.sack_due {
            // Built now, so it names everything kept up to this moment.
            self.sack_due = false;
            let serves = matches!(
                self.state,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
            );
            if self.params.selective_repeat && serves && !self.reorder.is_empty() {
                let expected = self.resp.expected_psn();
                let map = self.reorder.bitmap(expected);
                out = crate::sack::emit(
                    buf,
                    &self.params,
                    expected,
                    self.resp.msn(),
                    crate::sack::trimmed(&map),
                );
                if out.is_some() {
                    ctx.counters.sacks_sent += 1;
                }
            }
        }
        // DCQCN's rate and the caller's cap bound the requester's pacer (the window's own rate
        // may be lower).
        let cap = [self.rp.rate_bytes_per_sec(now), self.rate_cap]
            .into_iter()
            .flatten()
            .min();
        self.req.set_rate_cap(cap);
        if out.is_none() && matches!(self.state, QpState::Rts | QpState::Sqd) {
            out = match self.params.service {
                Service::Rc => self
                    .req
                    .poll_transmit(&mut ctx, now, buf, &mut self.completions),
                Service::Uc => self.uc.poll_transmit(&mut ctx, buf, &mut self.completions),
            };
        }
        let fatal = ctx.fatal;
        if let Some(n) = out {
            self.rp.on_sent(n, now);
            self.counters.sent_pkts += 1;
            // Made just now by this QP, so well formed: no second validation, only the
            // header length its opcode implies.
            let p = RocePacket::new_unchecked(&buf[..n]);
            if p.opcode() != Opcode::FERROCE_SACK {
                // A SACK's bitmap is no payload of the peer's.
                self.counters.sent_bytes += p.payload_len() as u64;
            }
        }
        if fatal {
            self.enter_error();
        }
        out
    }

    /// The next work completion, in the order the IBTA requires (posting order per queue).
    #[inline]
    pub fn poll_completion(&mut self) -> Option<WorkCompletion> {
        self.completions.pop_front()
    }

    /// The local ACK timeout in force.
    pub fn ack_timeout(&self) -> Option<core::time::Duration> {
        ack_timeout(self.params.timeout)
    }

    /// The rate DCQCN allows this QP to send at, at `now`, in bytes per second: `None` for no
    /// limit (no CNP has come from the peer yet, or the rate has recovered to the line rate).
    pub fn congestion_rate(&self, now: Instant) -> Option<u64> {
        self.rp.rate_bytes_per_sec(now)
    }

    /// The DCQCN reaction point, to read its state (α, target rate) or parameters.
    pub fn dcqcn(&self) -> &Dcqcn {
        &self.rp
    }

    /// Sets the DCQCN reaction point's parameters; the controller starts over, unlimited.
    pub fn set_dcqcn_config(&mut self, config: crate::dcqcn::DcqcnConfig) {
        self.rp = Dcqcn::new(config);
    }
}

/// Whether `wr` could be posted to a QP in `state` created with `caps` (what
/// [`QueuePair::check_send`] checks, for a caller that knows both without holding the QP).
#[inline]
pub fn check_send_request(
    state: QpState,
    caps: &QpCaps,
    service: Service,
    wr: &SendWr,
) -> Result<(), PostError> {
    match state {
        QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Error => {}
        s => return Err(PostError::InvalidState(s)),
    }
    if !service.carries(wr.op) {
        return Err(PostError::NotOnService(service));
    }
    if wr.sgl.len() > caps.max_send_sge as usize {
        return Err(PostError::TooManySge {
            given: wr.sgl.len(),
            max: caps.max_send_sge,
        });
    }
    if let Some(d) = &wr.inline_data {
        let allowed = !wr.op.is_read_or_atomic() && d.len() <= caps.max_inline_data as usize;
        if !allowed {
            return Err(PostError::InlineNotAllowed {
                given: d.len(),
                max: caps.max_inline_data,
            });
        }
    }
    if wr.op.is_atomic() && (wr.sgl.len() != 1 || wr.sgl[0].length != 8) {
        return Err(PostError::BadAtomicBuffer);
    }
    if wr.data_len() > MAX_MESSAGE_LEN {
        return Err(PostError::MessageTooLong(wr.data_len()));
    }
    Ok(())
}

/// Room for the largest header stack a QP emits (BTH + RETH + ImmDt, or BTH + AtomicETH) and
/// the ICRC, beyond the path MTU of payload.
pub const MAX_HEADER_LEN: usize = 12 + 28 + 4 + 4;
