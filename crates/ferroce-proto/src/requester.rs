//! The requester and its completer: the send side of an RC queue pair.
//!
//! Posted work requests wait in the send queue. When one starts it is given its PSNs: one per
//! packet for SEND and WRITE (the message cut into path-MTU packets), one per expected response
//! packet for READ, one for an atomic. Packets leave while the window of unacknowledged PSNs has
//! room and, for READ and atomics, while fewer than `max_rd_atomic` are outstanding.
//!
//! The completer reads the responses. An ACK retires every request up to its PSN; a READ
//! response or atomic ACK also acknowledges the requests before it. A response that skips
//! ahead (a READ response after a gap, an ACK past an unanswered READ) is an implied NAK. On a
//! PSN-sequence-error NAK, an implied NAK or a local ACK timeout the requester goes back to the
//! first unacknowledged PSN and sends everything again from there (go-back-N; a READ asks for
//! its missing responses in pieces, see below), counting retries against `retry_cnt` (reset
//! whenever an acknowledgement makes progress). An RNR NAK pauses the send queue for the timer
//! it names, counted against `rnr_retry` (7 = forever). Other NAKs complete the request in
//! error and move the QP to ERR.
//!
//! Completions leave in posting order: a request that is done waits until all before it are.
//!
//! # READ retries in pieces
//! One READ request asks for a whole message, so a retry that asks for the whole rest (as rxe
//! and the IBTA example do) escapes the loss window: the responder streams up to the full
//! message at wire speed, a switch (or the chaos relay's socket buffer) drops most of it, and
//! the restarted stream's first packets are lost behind the stale one — at 5% loss a 16 MiB
//! READ saw ~80% effective loss. So a READ *retry* asks for one piece: from the first missing
//! response PSN, at most the loss window's worth of MTU packets; when that piece's responses
//! are all in, it asks for the next. The first transmission stays one request for the whole
//! message, as rxe and perftest peers send it, so a clean path costs nothing; pieces begin only
//! after a loss, which is exactly when the window says the path cannot take a full burst.
//! (Cutting first transmissions too while the window is reduced would make every READ after a
//! loss wait for its pieces' answers one after another and take a responder resource per
//! piece, though the window is back to full within a few round trips; the damage this fixes —
//! a retried stream stacked on a stale one — only happens on retries.)
//!
//! A piece is a READ request of its own, valid for any responder, which treats it one of two
//! ways: if it had executed the original (or an earlier piece covering it), the piece is a
//! duplicate inside that READ's range and is answered exactly as asked (rxe: "the same as the
//! previous one or a subset of it"); if not, the piece arrives at the expected PSN and is
//! executed as a fresh, shorter READ, and the next piece then arrives at the new expected PSN.
//! Three rules keep every piece answerable either way:
//! * a piece starts at the first missing PSN, which only grows (rxe moves its resource's start
//!   to each duplicate it serves and drops a request that starts before it);
//! * a piece never ends past the end of an earlier request for this READ that its answers have
//!   not reached (`read_ends`): the responder may have executed that one fresh, and its
//!   resource ends there, so a longer duplicate would be dropped as not a subset of it, and
//!   retried forever;
//! * pieces begin only when no earlier READ or atomic still waits for its answer, and while a
//!   piece is answered nothing after it is sent: each piece executed fresh takes a responder
//!   resource, and responders keep only `max_dest_rd_atomic` of them (rxe recycles the oldest),
//!   so a stream of pieces could push out the resource an earlier unanswered atomic needs for
//!   its replay. Until then a retry asks for the whole rest (one resource, as before).
//!
//! Once a response has come while the first request was the only one sent, the responder is
//! known to hold the original: every piece is a duplicate inside it, takes no resource, and
//! only the first rule binds.
//!
//! The completer takes a response for any PSN of the READ from any of its requests, the bytes
//! at a response PSN being the same whichever request it answers: a READ_RESPONSE_LAST/ONLY
//! may end a piece, and a response that arrives after a gap is placed at once (within
//! [`READ_AHEAD`] packets of the gap). A piece therefore asks from the first missing packet to
//! the last missing one in reach, and reaches up to four times the window when fewer than
//! `MIN_PIECE_HOLES` packets in it are missing: a round trip that brings nothing new spends
//! the retry budget, and with several holes per piece that stays about as rare as losing the
//! request itself (at 20% loss each way, 0.2 rather than 0.36 per round). 16 MiB READs through
//! the chaos relay at 20% loss ran out of retries (on pieces of one packet) in 1 run of 8 with
//! no reach, 2 of 115 reaching twice the window, 0 of 60 reaching four times. New data placed
//! ahead of a gap restores the retry budget. Since a gap then costs a piece, not a window,
//! gaps in READ answers halve the loss window once per window of progress; timeouts, as for
//! any request, halve it every time.

use std::collections::VecDeque;

use ferroce_wire::aeth::{rnr_timer_micros, NakCode, Syndrome};
use ferroce_wire::atomic_eth::AtomicEthRepr;
use ferroce_wire::ieth::IethRepr;
use ferroce_wire::immdt::ImmDtRepr;
use ferroce_wire::opcode::Position;
use ferroce_wire::reth::RethRepr;
use ferroce_wire::{ExtHeaders, Opcode, PacketRepr, Psn};

use crate::attr::{ack_timeout, RNR_RETRY_INFINITE};
use crate::cc::{CcConfig, Controller};
use crate::completion::{WcOpcode, WcStatus, WorkCompletion};
use crate::counters::Counters;
use crate::emit;
use crate::memory::{Access, KeyKind, Memory, Sge};
use crate::pacer::{window_rate, Pacer};
use crate::qp::{CompletionQueue, Ctx, Params, QpState};
use crate::reorder::REORDER_CAPACITY;
use crate::responder::{walk_sges, UNASKED_ACK_DELAY};
use crate::rtt::RttEstimator;
use crate::sack::{self, MAX_HOLES_PER_SACK};
use crate::time::Instant;
use crate::wr::{SendOp, SendWr};
use core::time::Duration;

/// Most PSNs that may be sent and not yet acknowledged.
pub const MAX_UNACKED_PSNS: u32 = 1024;
/// Smallest send window a loss can shrink it to.
pub const MIN_LOSS_WINDOW: u32 = 16;
/// An ACK is requested at least every this many packets within a long message.
pub const ACK_REQ_INTERVAL: u32 = 32;
/// Under congestion control, an ACK is also requested every this fraction of the window: the
/// window moves, the RTT is sampled and the retransmission timer restarts on every ACK, and an
/// ACK per window would leave the timer to expire for packets sent a whole window after it
/// was armed. More ACKs cost CPU on both sides (1 Gbit/s bottleneck, one 64 KiB WRITE stream:
/// 105–107 MB/s asking four times a window, 109–112 asking once; two is the compromise).
const ACKS_PER_WINDOW: u32 = 2;
/// Most unreached piece ends a READ remembers; past it, a retry asks up to the nearest one.
const MAX_READ_ENDS: usize = 32;
/// Missing packets a READ retry piece reaches for, beyond the window if need be.
const MIN_PIECE_HOLES: usize = 4;
/// READ response packets kept beyond the first missing one: how far ahead of a gap the
/// completer places responses that arrive out of order.
pub const READ_AHEAD: u32 = 4096;

#[derive(Debug)]
struct SendWqe {
    wr: SendWr,
    len: u64,
    started: bool,
    first_psn: Psn,
    /// PSNs the request occupies.
    npsn: u32,
    /// Path MTU when the request started: it is cut at the MTU its PSNs were counted for, so
    /// a later `set_path_mtu` changes new requests only.
    mtu: u32,
    /// PSNs covered by what was transmitted in the current pass (for READ: by the request).
    sent: u32,
    /// Highest `sent` ever, to tell retransmissions from first transmissions.
    high_sent: u32,
    /// PSNs acknowledged (for READ: response packets received).
    acked: u32,
    /// READ only: the ends (relative PSNs, decreasing) of the pieces asked for since the first
    /// transmission that `acked` has not reached. A retry asks for no more than the last.
    read_ends: Vec<u32>,
    /// READ only: which response packets in `(acked, acked + READ_AHEAD)` were placed out of
    /// order (a ring of bits indexed by packet number; allocated at the first gap).
    ahead: Vec<u64>,
    /// READ only: a retry of it has been sent.
    retried: bool,
    /// READ only: a response came while the first request was the only one sent, so the
    /// responder executed that one and holds the whole range: every piece is a duplicate
    /// inside it, and `read_ends` no longer binds.
    original_answered: bool,
    result: Option<WcStatus>,
}

impl SendWqe {
    fn contains(&self, psn: Psn) -> bool {
        self.started && psn.distance_from(self.first_psn) < self.npsn
    }
    fn outstanding(&self) -> bool {
        self.started && self.result.is_none() && self.sent > self.acked
    }
    /// Whether READ response packet `k` (in `[acked, acked + READ_AHEAD)`) was placed ahead of
    /// a gap.
    fn has_ahead(&self, k: u32) -> bool {
        let bit = k % READ_AHEAD;
        k.wrapping_sub(self.acked) < READ_AHEAD
            && self
                .ahead
                .get((bit / 64) as usize)
                .is_some_and(|w| w & (1 << (bit % 64)) != 0)
    }
    /// Flips the mark of READ response packet `k` (in the window ahead of `acked`).
    fn toggle_ahead(&mut self, k: u32) {
        if self.ahead.is_empty() {
            self.ahead = vec![0; (READ_AHEAD / 64) as usize];
        }
        let bit = k % READ_AHEAD;
        self.ahead[(bit / 64) as usize] ^= 1 << (bit % 64);
    }
}

/// The payload of SEND or WRITE packet `k` of `w`, for pacing; `None` for READ and atomic
/// requests, which carry none and are not paced.
fn paced_len(w: &SendWqe, k: u32) -> Option<u64> {
    if w.wr.op.is_read_or_atomic() {
        return None;
    }
    let mtu = u64::from(if w.started { w.mtu } else { 0 }.max(1));
    Some((w.len - (u64::from(k) * mtu).min(w.len)).min(mtu))
}

pub(crate) fn packets_for(len: u64, mtu: u32) -> u32 {
    (len.div_ceil(u64::from(mtu))).max(1) as u32
}

fn wc_opcode(op: SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm(_) | SendOp::SendWithInvalidate(_) => WcOpcode::Send,
        SendOp::Write | SendOp::WriteWithImm(_) => WcOpcode::RdmaWrite,
        SendOp::Read => WcOpcode::RdmaRead,
        SendOp::CompareSwap { .. } => WcOpcode::CompareSwap,
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
    }
}

/// The completion of a request flushed without being started.
pub(crate) fn flushed(p: &Params, wr: &SendWr) -> WorkCompletion {
    completion(p, wr, WcStatus::WorkRequestFlushed, 0)
}

pub(crate) fn completion(
    p: &Params,
    wr: &SendWr,
    status: WcStatus,
    byte_len: u64,
) -> WorkCompletion {
    WorkCompletion {
        wr_id: wr.wr_id,
        status,
        opcode: wc_opcode(wr.op),
        byte_len: if status == WcStatus::Success {
            byte_len as u32
        } else {
            0
        },
        imm_data: None,
        invalidated_rkey: None,
        qp_num: p.qpn,
        solicited: false,
        src_qp: None,
    }
}

/// What the requester remembers of one PSN it sent: for RTT samples (Karn's rule) and to tell
/// a NAK for a hole it already refilled from news.
#[derive(Debug, Clone, Copy, Default)]
struct Stamp {
    psn: u32,
    /// The slot holds a stamp (`Instant::ZERO` is a time like any other).
    valid: bool,
    /// When it last left.
    at: Instant,
    /// It asked for an acknowledgement (only those answer without delay).
    asked: bool,
    /// It left more than once.
    resent: bool,
}

/// Smallest fast retransmission timeout, toward a peer that keeps out-of-order packets (a
/// spurious timeout costs one packet there; toward any other peer, where it would cost a
/// window, only the IBTA timeout retransmits).
pub const RTO_MIN_SELECTIVE: Duration = Duration::from_micros(500);
/// Most the fast timeout's floor grows to after spurious timeouts.
const MAX_RTO_FLOOR: Duration = Duration::from_millis(16);
/// How long without a spurious timeout halves the learnt floor.
const RTO_FLOOR_DECAY: Duration = Duration::from_secs(1);
/// The clock granularity term of the RTO (RFC 6298's G): engine wake-ups are this coarse.
const RTO_GRANULARITY: Duration = Duration::from_micros(100);
/// Bytes a data packet costs on the wire beyond its payload, for pacing: Ethernet, IPv4, UDP,
/// BTH, RETH and ICRC.
const WIRE_OVERHEAD: u64 = 14 + 20 + 8 + 12 + 16 + 4;

/// The send side of a QP.
#[derive(Debug, Default)]
pub(crate) struct Requester {
    sq: VecDeque<SendWqe>,
    /// PSN the next request to start gets.
    next_psn: Psn,
    /// Index in `sq` of the first request with packets left to send.
    cursor: usize,
    /// Oldest PSN not yet acknowledged.
    una: Psn,
    retry_left: u8,
    rnr_retry_left: u8,
    /// Local ACK timeout deadline while requests are outstanding.
    timer: Option<Instant>,
    /// End of an RNR back-off.
    rnr_until: Option<Instant>,
    /// Packets sent since the last one that asked for an ACK.
    since_ack_req: u32,
    /// Messages sent in a row without asking for an ACK (see `Params::unasked_run`).
    unasked_messages: u32,
    /// PSN of the last go-back, until progress is made: a second trigger for the same gap is
    /// ignored, so one loss costs one retransmission pass, not one per later packet.
    gone_back_to: Option<Psn>,
    /// The send window after losses (0: the full [`MAX_UNACKED_PSNS`]). Go-back-N resends
    /// everything after a loss, so on a lossy or slow path a full window of a thousand packets
    /// per loss is mostly waste, and resent windows queue up behind each other until ACKs come
    /// later than the ACK timeout — congestion collapse. Each go-back halves the window (down to
    /// [`MIN_LOSS_WINDOW`]); acknowledged PSNs grow it back by as many (doubling per round
    /// trip), so a clean path returns to the full window within a few round trips. RoCE NICs
    /// rely on a lossless fabric and DCQCN instead; over plain UDP, loss is the only signal.
    loss_window: u32,
    /// `una` when the window last changed (growth counts PSNs acknowledged since).
    window_una: Psn,
    /// After a READ's gap halved the window: the PSN a window past that gap. Further gaps in
    /// READ answers halve it again only once `una` is there (and a timeout always does): the
    /// completer keeps responses that arrive after a gap, so each gap costs a piece, not a
    /// window, and random loss would otherwise hold the pieces at the minimum.
    read_recover: Option<Psn>,
    /// Scatter/gather lists of retired requests, kept for [`Self::push_copy`]: a request
    /// posted by reference is copied into one of these, so posting and retiring a request
    /// allocates and frees nothing once a few have gone through.
    spare_sgls: Vec<Vec<Sge>>,
    /// RTT of the path, from this side's own stamps.
    rtt: RttEstimator,
    /// The congestion window (see [`crate::cc`]); `None` until the QP starts sending.
    cc: Option<Controller>,
    /// Spreads data packets over the round trip (see [`crate::pacer`]).
    pacer: Pacer,
    /// When the pacer lets the next data packet leave, while one waits.
    paced_until: Option<Instant>,
    /// A rate cap in bytes per second from an ECN reaction point, if one applies.
    rate_cap: Option<u64>,
    /// The last transmission of each PSN in flight, indexed by PSN modulo
    /// [`MAX_UNACKED_PSNS`] (allocated at the first send).
    stamps: Vec<Stamp>,
    /// A queueing delay measured since the last acknowledgement was counted.
    fresh_delay: Option<Duration>,
    /// Fast retransmission deadline, from the measured RTT: it resends without spending the
    /// IBTA retry budget, which only `timer` (the QP's `timeout` attribute) spends.
    rto_timer: Option<Instant>,
    /// Consecutive fast retransmission timeouts (each doubles the next).
    rto_backoff: u32,
    /// When the last fast retransmission timeout fired, and the window before it: if an
    /// acknowledgement then comes for a packet last sent before that moment, the original got
    /// through and the timeout was spurious (a peer descheduled for a few milliseconds on a
    /// busy host, not a loss), and the window is given back (as Linux TCP's spurious-RTO
    /// undo does).
    rto_undo: Option<(Instant, Controller)>,
    /// Extra floor of the fast timeout learnt from spurious ones: a timeout found spurious
    /// doubles it, a second without one halves it. On a host where
    /// the peer's engine can be off the CPU for milliseconds (two cores, busy), a fixed
    /// sub-millisecond floor would resend a window at every such stall; the RTT samples
    /// cannot learn it, since the resend hides the stall from them (Karn's rule). At most
    /// [`MAX_RTO_FLOOR`].
    rto_floor: Duration,
    /// When `rto_floor` last changed.
    rto_floor_at: Instant,
    /// The last packet sent did not ask for an acknowledgement (its ACK may be held).
    last_unasked: bool,
    /// The peer keeps packets that arrive after a gap (negotiated): a sequence-error NAK then
    /// means "this PSN is missing", and only it is sent again.
    selective: bool,
    /// PSNs to send again one by one (selective repeat), before new packets, each when it is
    /// due.
    resend: VecDeque<Resend>,
    /// When to send a tail-loss probe (selective repeat): two round trips after the last
    /// progress or first send, if no acknowledgement came meanwhile.
    tlp_timer: Option<Instant>,
    /// A tail-loss probe has been sent since the last progress (one per episode).
    tlp_sent: bool,
    /// The path never loses a packet (a shared-memory ring): only the IBTA timeout resends.
    lossless: bool,
    /// The smallest RTT other QPs on the same path measured (see `set_path_min_rtt`).
    path_min_rtt: Option<Duration>,
    /// How many PSNs after `sacked_from` the last SACK said the peer keeps (packets that
    /// left the network): while `una` is still `sacked_from`, the window counts only what is
    /// in flight, so new packets keep leaving while the holes are resent (TCP's "pipe").
    sacked: u32,
    /// The gap the last SACK named (its expected PSN).
    sacked_from: Psn,
    /// The next packet built asks for an acknowledgement whatever the rules say.
    force_ack_req: bool,
    /// One packet may leave past the window, asking (see `nudge_if_stalled`).
    window_probe: bool,
    /// The newest PSN sent asking for an acknowledgement (a data packet with AckReq, a READ
    /// or atomic request): while it is unacknowledged an answer is on its way, so a packet
    /// at the window's end need not ask again (see `ack_req_pending`).
    last_ack_req: Option<Psn>,
}

/// A packet queued to be sent again alone (selective repeat).
#[derive(Debug, Clone, Copy)]
struct Resend {
    psn: Psn,
    /// When it may leave: after RACK's reordering wait for a reported hole, at once for a probe.
    due: Instant,
    /// A tail-loss probe (news wanted, no loss known), not a hole the peer reported.
    probe: bool,
    /// Due, and a timeout has said so: it waits for `poll_transmit`, not for a timer.
    ready: bool,
}

/// Smallest wait before a tail-loss probe: below it, an ACK the peer's engine has not yet
/// sent (it batches its answers) would look lost.
const TLP_MIN: Duration = Duration::from_micros(200);

/// How many retired scatter/gather lists a requester keeps for reuse.
pub(crate) const SPARE_SGLS: usize = 16;

impl Requester {
    pub fn start(&mut self, sq_psn: Psn, p: &Params) {
        self.next_psn = sq_psn;
        self.una = sq_psn;
        self.window_una = sq_psn;
        self.last_ack_req = None;
        self.window_probe = false;
        self.retry_left = p.retry_cnt;
        self.rnr_retry_left = p.rnr_retry;
        self.cc = Some(Controller::new(p.cc, MAX_UNACKED_PSNS));
        self.selective = p.selective_repeat;
    }

    /// Changes the congestion control (the window starts over).
    pub fn set_congestion_control(&mut self, config: CcConfig) {
        self.rto_undo = None;
        if self.cc.is_some() {
            self.cc = Some(Controller::new(config, MAX_UNACKED_PSNS));
        }
    }

    /// Tells the requester whether the peer keeps packets that arrive after a gap.
    pub fn set_selective_repeat(&mut self, on: bool) {
        self.selective = on;
        if !on {
            self.resend.clear();
            self.tlp_timer = None;
        }
    }

    /// Says whether the path never loses a packet (see `QueuePair::set_lossless_path`).
    pub fn set_lossless_path(&mut self, on: bool) {
        self.lossless = on;
        if on {
            self.tlp_timer = None;
        }
    }

    /// Whether the path is taken to be lossless.
    pub fn lossless_path(&self) -> bool {
        self.lossless
    }

    /// Tells the requester the smallest recent RTT of other QPs on the same path (see
    /// `QueuePair::set_path_min_rtt`).
    pub fn set_path_min_rtt(&mut self, rtt: Option<Duration>) {
        self.path_min_rtt = rtt;
    }

    /// The delay without queues that queueing delay is measured against: this QP's smallest
    /// recent RTT, or the path's where that is smaller.
    fn base_rtt(&self) -> Duration {
        let own = self.rtt.min_rtt();
        self.path_min_rtt.map_or(own, |p| p.min(own))
    }

    /// Caps the pacing rate (bytes per second), or lifts the cap.
    pub fn set_rate_cap(&mut self, cap: Option<u64>) {
        self.rate_cap = cap;
    }

    /// The RTT estimator.
    pub fn rtt(&self) -> &RttEstimator {
        &self.rtt
    }

    /// The congestion window in packets, if a controller runs.
    pub fn congestion_window(&self) -> Option<f64> {
        self.cc
            .as_ref()
            .filter(|c| c.enabled())
            .map(Controller::cwnd)
    }

    pub fn len(&self) -> usize {
        self.sq.len()
    }

    pub fn next_psn(&self) -> Psn {
        self.next_psn
    }

    /// Queues a copy of `wr`, its scatter/gather list in a recycled allocation.
    pub fn push_copy(&mut self, wr: &SendWr) {
        let mut sgl = self.spare_sgls.pop().unwrap_or_default();
        sgl.clear();
        sgl.extend_from_slice(&wr.sgl);
        self.push(SendWr {
            wr_id: wr.wr_id,
            op: wr.op,
            sgl,
            inline_data: wr.inline_data.clone(),
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            flags: wr.flags,
        });
    }

    pub fn push(&mut self, wr: SendWr) {
        let len = wr.data_len();
        self.sq.push_back(SendWqe {
            wr,
            len,
            started: false,
            first_psn: Psn::new(0),
            npsn: 0,
            mtu: 0,
            sent: 0,
            high_sent: 0,
            acked: 0,
            read_ends: Vec::new(),
            ahead: Vec::new(),
            retried: false,
            original_answered: false,
            result: None,
        });
    }

    pub fn next_timeout(&self) -> Option<Instant> {
        // A resend waits out an RNR back-off like everything else (its end is named already).
        // A resend a timeout found due (a probe is, the moment it is queued) waits for the
        // `poll_transmit` that follows the timeout: no timer for it.
        let resend = self
            .resend
            .iter()
            .find(|r| !r.ready)
            .map(|r| r.due)
            .filter(|_| self.rnr_until.is_none())
            // A resend due while the pacer holds it leaves when the pacer lets it.
            .map(|due| self.paced_until.map_or(due, |p| due.max(p)));
        [
            self.timer,
            self.rnr_until,
            self.rto_timer,
            self.tlp_timer,
            self.paced_until,
            resend,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn srtt(&self) -> Duration {
        self.rtt.srtt().unwrap_or(RTO_GRANULARITY)
    }

    /// The fast retransmission timeout now.
    fn rto(&self, p: &Params) -> Option<Duration> {
        let ceiling = ack_timeout(p.timeout)?;
        if !self.selective || self.lossless {
            // Toward a go-back-N peer (rxe, a NIC) a spurious resend costs a window and shows
            // in the peer's `duplicate_request`: the live rxe suite, guests under emulation,
            // saw 3,608 with a 1 ms floor. There the IBTA timeout alone retransmits.
            return Some(ceiling);
        }
        let floor = RTO_MIN_SELECTIVE.max(self.rto_floor);
        let mut rto = self.rtt.rto(RTO_GRANULARITY, floor, ceiling);
        if self.last_unasked {
            rto += UNASKED_ACK_DELAY;
        }
        Some((rto * (1u32 << self.rto_backoff.min(16))).min(ceiling))
    }

    fn arm_rto(&mut self, p: &Params, now: Instant) {
        self.rto_timer = self.rto(p).map(|d| now + d);
    }

    fn stamp(&mut self, psn: Psn, now: Instant, asked: bool) {
        if self.stamps.is_empty() {
            self.stamps = vec![Stamp::default(); MAX_UNACKED_PSNS as usize];
        }
        let s = &mut self.stamps[(psn.value() % MAX_UNACKED_PSNS) as usize];
        let resent = s.valid && s.psn == psn.value();
        *s = Stamp {
            psn: psn.value(),
            valid: true,
            at: now,
            asked,
            resent,
        };
    }

    fn stamp_of(&self, psn: Psn) -> Option<Stamp> {
        self.stamps
            .get((psn.value() % MAX_UNACKED_PSNS) as usize)
            .filter(|s| s.valid && s.psn == psn.value())
            .copied()
    }

    /// After a fast retransmission timeout, the first acknowledgement of news (for `psn`) tells
    /// whether it was spurious: it was if `psn` was last sent before the timeout fired, so the
    /// original arrived. Then the window before the timeout is restored.
    fn undo_spurious_timeout(&mut self, counters: &mut Counters, now: Instant, psn: Psn) {
        if psn.is_before(self.una) {
            return;
        }
        let Some((fired, _)) = &self.rto_undo else {
            return;
        };
        // Judged by the oldest PSN this acknowledges (`una`, which the timeout resent at
        // once): the original got through if `una` was not resent yet, or if this comes too
        // soon after the resend to answer it (under half the minimum RTT). The PSN the ACK
        // names may be a kept packet's, drained once the resend filled the hole.
        let min_rtt = self.rtt.min_rtt();
        let original = self.stamp_of(self.una).is_some_and(|s| {
            s.at < *fired || (s.resent && now.saturating_since(s.at) < min_rtt / 2)
        });
        let Some((_, saved)) = self.rto_undo.take() else {
            return;
        };
        if original {
            counters.spurious_rto += 1;
            self.cc = Some(saved);
            self.rto_backoff = 0;
            self.rto_floor = (self.rto_floor * 2).clamp(RTO_MIN_SELECTIVE, MAX_RTO_FLOOR);
            self.rto_floor_at = now;
        }
    }

    /// Takes an RTT sample from the answer to `psn`, if it is a clean one: the packet asked for
    /// its answer and left once, and is still unacknowledged (the answer is news).
    fn sample(&mut self, now: Instant, psn: Psn) {
        if psn.is_before(self.una) {
            return;
        }
        let Some(s) = self.stamp_of(psn) else { return };
        if !s.asked || s.resent {
            return;
        }
        let rtt = now.saturating_since(s.at);
        self.rtt.on_sample(now, rtt);
        self.fresh_delay = Some(rtt.saturating_sub(self.base_rtt()));
    }

    fn arm(&mut self, p: &Params, now: Instant) {
        self.timer = ack_timeout(p.timeout).map(|d| now + d);
        self.arm_rto(p, now);
        self.arm_tlp(now);
    }

    /// Arms the tail-loss probe (RACK-TLP, RFC 8985): toward a selective-repeat peer, once
    /// the RTT is known and no probe was sent since the last progress, two smoothed round
    /// trips from now (plus the peer's delay for an unasked acknowledgement).
    fn arm_tlp(&mut self, now: Instant) {
        self.tlp_timer = None;
        if !self.selective || self.tlp_sent || self.lossless {
            return;
        }
        let Some(srtt) = self.rtt.srtt() else { return };
        let mut pto = (2 * srtt).max(TLP_MIN);
        if self.last_unasked {
            pto += UNASKED_ACK_DELAY;
        }
        // The probe comes no later than the retransmission timeout would (which it then
        // pushes back): a timeout resends a window, a probe one packet.
        let at = now + pto;
        self.tlp_timer = Some(self.rto_timer.map_or(at, |rto| at.min(rto)));
    }

    /// The newest packet sent that a probe may repeat: the last sent PSN of the newest SEND or
    /// WRITE under way, if that is the newest request under way (a READ or atomic after it is
    /// left to the retransmission timeout).
    fn probe_psn(&self) -> Option<Psn> {
        let w = self
            .sq
            .iter()
            .rev()
            .find(|w| w.started && w.result.is_none())?;
        if w.wr.op.is_read_or_atomic() || w.high_sent <= w.acked {
            return None;
        }
        let mut psn = w.first_psn.add(w.high_sent - 1);
        // A packet beyond the peer's reorder buffer would be dropped unseen: the newest one
        // within its reach instead.
        let reach = self.una.add(REORDER_CAPACITY - 2);
        if reach.is_before(psn) {
            psn = reach;
        }
        self.resendable(psn).map(|_| psn)
    }

    fn any_outstanding(&self) -> bool {
        self.sq.iter().any(SendWqe::outstanding)
    }

    /// Completes every request at the front that is done, in posting order.
    fn retire(&mut self, p: &Params, counters: &mut Counters, cq: &mut CompletionQueue) {
        while let Some(w) = self.sq.front() {
            let Some(status) = w.result else { break };
            if matches!(wc_opcode(w.wr.op), WcOpcode::Send) {
                counters.rdma_sends += 1;
            }
            if status != WcStatus::Success || w.wr.flags.signaled {
                cq.push_back(completion(p, &w.wr, status, w.len));
            }
            if let Some(w) = self.sq.pop_front() {
                if self.spare_sgls.len() < SPARE_SGLS {
                    self.spare_sgls.push(w.wr.sgl);
                }
            }
            self.cursor = self.cursor.saturating_sub(1);
        }
    }

    /// Flushes the queue on entering ERR: requests that failed keep their status, the rest
    /// complete with the flush status, in posting order.
    pub fn flush(&mut self, p: &Params, cq: &mut CompletionQueue) {
        for w in self.sq.drain(..) {
            let status = w.result.unwrap_or(WcStatus::WorkRequestFlushed);
            if status != WcStatus::Success || w.wr.flags.signaled {
                cq.push_back(completion(p, &w.wr, status, w.len));
            }
        }
        self.cursor = 0;
        self.timer = None;
        self.rnr_until = None;
        self.rto_timer = None;
        self.tlp_timer = None;
        self.paced_until = None;
        self.resend.clear();
    }

    /// Marks the request holding `psn` (or the oldest unfinished one) as failed.
    fn fail_at(&mut self, psn: Psn, status: WcStatus) {
        let idx = self
            .sq
            .iter()
            .position(|w| w.result.is_none() && w.contains(psn))
            .or_else(|| self.sq.iter().position(|w| w.result.is_none()));
        if let Some(i) = idx {
            self.sq[i].result = Some(status);
        }
    }

    /// Rewinds transmission to `psn`: the request holding it resends from there (a READ or
    /// atomic from its first unanswered PSN), every later started request from its start.
    fn go_back(&mut self, psn: Psn) {
        let mut first = None;
        for (i, w) in self.sq.iter_mut().enumerate() {
            if w.result.is_some() || !w.started {
                continue;
            }
            let resume = if !w.wr.op.is_read_or_atomic() && w.contains(psn) {
                psn.distance_from(w.first_psn).max(w.acked)
            } else {
                w.acked
            };
            w.sent = w.sent.min(resume);
            if w.sent < w.npsn && first.is_none() {
                first = Some(i);
            }
        }
        if let Some(i) = first {
            self.cursor = self.cursor.min(i);
        }
        // Everything from `psn` on goes again anyway, and what asked may have been lost.
        self.last_ack_req = None;
        self.window_probe = false;
        self.resend.clear();
        self.sacked = 0;
        self.gone_back_to = Some(psn);
    }

    /// Whether a NAK or implied NAK for `psn` only repeats news a go-back already acted on.
    fn is_echo(&self, psn: Psn) -> bool {
        self.gone_back_to == Some(psn)
    }

    /// Retries from `psn` after a sequence-error NAK, an implied NAK or a timeout. Returns
    /// `true` when the retry budget is spent (the request failed, the QP must go to ERR).
    fn retry(&mut self, counters: &mut Counters, now: Instant, psn: Psn) -> bool {
        self.retry_after(counters, now, psn, false)
    }

    /// [`Self::retry`], after a local ACK timeout if `timed_out`.
    fn retry_after(
        &mut self,
        counters: &mut Counters,
        now: Instant,
        psn: Psn,
        timed_out: bool,
    ) -> bool {
        if self.is_echo(psn) {
            return false;
        }
        self.note_loss(now, psn, timed_out);
        if self.retry_left == 0 {
            counters.retry_exceeded_err += 1;
            self.fail_at(psn, WcStatus::TransportRetryExceeded);
            return true;
        }
        self.retry_left -= 1;
        self.go_back(psn);
        false
    }

    /// Shrinks the window for a loss at `psn` (a timeout if `timed_out`): the congestion
    /// controller's, or without one the loss window.
    fn note_loss(&mut self, now: Instant, psn: Psn, timed_out: bool) {
        let read = self
            .sq
            .iter()
            .find(|w| w.result.is_none() && w.contains(psn))
            .is_some_and(|w| w.wr.op == SendOp::Read);
        let recovering = read && self.read_recover.is_some_and(|r| self.una.is_before(r));
        if timed_out || !recovering {
            let srtt = self.srtt();
            match self.cc.as_mut().filter(|c| c.enabled()) {
                Some(cc) if timed_out => cc.on_timeout(now),
                Some(cc) => cc.on_loss(now, srtt),
                None => self.loss_window = (self.window() / 2).max(MIN_LOSS_WINDOW),
            }
            self.window_una = self.una;
            self.read_recover = read.then(|| psn.add(self.window()));
        }
    }

    /// Whether a packet that asked for an acknowledgement is still unacknowledged, so an
    /// answer is on its way without asking again.
    fn ack_req_pending(&self) -> bool {
        self.last_ack_req
            .is_some_and(|p| !p.is_before(self.una) && p.is_before(self.next_psn))
    }

    /// Whether the next packet to send is held back by the window (not by anything else).
    fn window_blocks_next(&self, p: &Params) -> bool {
        self.sq
            .iter()
            .skip(self.cursor)
            .find(|w| w.result.is_none() && !(w.started && w.sent >= w.npsn))
            .is_some_and(|w| self.window_holds(w, p.mtu))
    }

    /// Whether the window holds back `w`'s next packet. A request not started yet starts only
    /// if all its packets fit (up to a whole window, so that one larger than the window still
    /// starts once the window is empty).
    fn window_holds(&self, w: &SendWqe, mtu: u32) -> bool {
        let limit = self.send_limit();
        if w.started {
            w.first_psn.add(w.sent).distance_from(self.una) >= limit
        } else {
            self.next_psn.distance_from(self.una) + packets_of(w, mtu).min(limit) > limit
        }
    }

    /// A packet that fills the window asks for an ACK only when no earlier one's is on its
    /// way (see `build`). If that answer came and the window, shrunk meanwhile, still holds
    /// the next packet back, nothing in flight asked and nothing new may leave: the next new
    /// packet goes anyway, one past the window, asking (RACK-TLP's probe with new data, RFC
    /// 8985 7.3: a copy of an old one would be a duplicate to the peer), or the sender would
    /// wait for its retransmission timer.
    fn nudge_if_stalled(&mut self, p: &Params) {
        // Cheapest first: this runs on every ACK that moves the window.
        if !self.ack_req_pending() && self.any_outstanding() && self.window_blocks_next(p) {
            self.window_probe = true;
        }
    }

    /// How far past `una` packets may be sent now: the window, plus what the peer reported it
    /// keeps past the gap at `una` (those packets are out of the network), but never beyond the
    /// peer's reorder buffer.
    fn send_limit(&self) -> u32 {
        let window = self.window();
        if self.selective && self.sacked > 0 && self.sacked_from == self.una {
            (window + self.sacked).min(REORDER_CAPACITY - 1).max(window)
        } else {
            window
        }
    }

    /// PSNs that may be outstanding now.
    fn window(&self) -> u32 {
        if let Some(cc) = self.cc.as_ref().filter(|c| c.enabled()) {
            return cc.window_packets().min(MAX_UNACKED_PSNS);
        }
        if self.loss_window == 0 {
            MAX_UNACKED_PSNS
        } else {
            self.loss_window
        }
    }

    fn progress(&mut self, p: &Params, now: Instant) {
        let acked = self.una.distance_from(self.window_una);
        let srtt = self.srtt();
        let delay = self.fresh_delay.take();
        match self.cc.as_mut().filter(|c| c.enabled()) {
            Some(cc) => cc.on_ack(now, acked, delay, srtt),
            None if self.loss_window != 0 => {
                let grown = self.loss_window + acked;
                self.loss_window = if grown >= MAX_UNACKED_PSNS { 0 } else { grown };
            }
            None => {}
        }
        self.rto_backoff = 0;
        if self.rto_floor > Duration::ZERO
            && now.saturating_since(self.rto_floor_at) >= RTO_FLOOR_DECAY
        {
            self.rto_floor /= 2;
            self.rto_floor_at = now;
        }
        self.window_una = self.una;
        self.nudge_if_stalled(p);
        self.tlp_sent = false;
        self.retry_left = p.retry_cnt;
        self.rnr_retry_left = p.rnr_retry;
        self.gone_back_to = None;
        if self.any_outstanding() {
            self.arm(p, now);
        } else {
            self.timer = None;
            self.rto_timer = None;
            self.tlp_timer = None;
        }
    }

    /// Acknowledges every PSN before `end` (exclusive). Returns `false` if a READ or atomic
    /// before `end` is still unanswered: its answer was lost (an implied NAK), and transmission
    /// has been rewound to it.
    fn ack_before(&mut self, ctx: &mut Ctx<'_>, now: Instant, end: Psn) -> bool {
        let mut moved = false;
        let mut implied_nak = None;
        for w in self.sq.iter_mut() {
            if w.result.is_some() {
                continue;
            }
            if !w.started || !w.first_psn.is_before(end) {
                break;
            }
            if w.wr.op.is_read_or_atomic() {
                // An acknowledgement beyond an unanswered READ/atomic PSN: that answer was lost.
                let unanswered = w.first_psn.add(w.acked);
                if unanswered.is_before(end) {
                    implied_nak = Some(unanswered);
                }
                break;
            }
            let covered = end.distance_from(w.first_psn).min(w.npsn);
            if covered > w.acked {
                w.acked = covered;
                // An ACK from before a rewind may cover packets the rewind meant to resend.
                w.sent = w.sent.max(w.acked);
                moved = true;
            }
            if w.acked == w.npsn {
                w.result = Some(WcStatus::Success);
            }
        }
        let new_una = match implied_nak {
            Some(p) => p,
            None => end,
        };
        if new_una.is_after(self.una) {
            self.una = new_una;
            moved = true;
        }
        if moved {
            self.progress(ctx.p, now);
        }
        if let Some(psn) = implied_nak {
            if !self.is_echo(psn) {
                ctx.counters.implied_nak_seq_err += 1;
            }
            if self.retry(ctx.counters, now, psn) {
                ctx.fatal = true;
            }
            return false;
        }
        true
    }

    /// Handles an ACKNOWLEDGE, ATOMIC ACKNOWLEDGE or READ response.
    pub fn handle_response(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        repr: &PacketRepr,
        payload: &[u8],
        cq: &mut CompletionQueue,
    ) {
        if repr.bth.opcode == Opcode::FERROCE_SACK {
            // Its PSN is the last one received in order, which may be just before `una`.
            self.sack(ctx, now, repr, payload);
            self.retire(ctx.p, ctx.counters, cq);
            return;
        }
        let psn = repr.bth.psn;
        // Only PSNs in [una, next_psn) can be answered.
        if psn.is_before(self.una) || !psn.is_before(self.next_psn) {
            ctx.counters.duplicate_response += 1;
            return;
        }
        let op = repr.bth.opcode;
        if op == Opcode::RC_ACKNOWLEDGE {
            let Some(aeth) = repr.ext.aeth else { return };
            match aeth.syndrome {
                Syndrome::Ack { .. } => {
                    self.undo_spurious_timeout(ctx.counters, now, psn);
                    self.sample(now, psn);
                    self.ack_before(ctx, now, psn.next());
                }
                Syndrome::RnrNak { timer } => {
                    ctx.counters.rcvd_rnr_err += 1;
                    if self.ack_before(ctx, now, psn) {
                        if self.rnr_retry_left == 0 {
                            ctx.counters.retry_rnr_exceeded_err += 1;
                            self.fail_at(psn, WcStatus::RnrRetryExceeded);
                            ctx.fatal = true;
                        } else {
                            if ctx.p.rnr_retry != RNR_RETRY_INFINITE {
                                self.rnr_retry_left -= 1;
                            }
                            let wait = Duration::from_micros(rnr_timer_micros(timer).into());
                            self.rnr_until = Some(now + wait);
                            self.timer = None;
                            self.rto_timer = None;
                            self.tlp_timer = None;
                            self.resend.clear();
                            self.go_back(psn);
                            self.gone_back_to = None;
                        }
                    }
                }
                Syndrome::Nak(NakCode::PsnSequenceError) => {
                    ctx.counters.rcvd_seq_err += 1;
                    if self.ack_before(ctx, now, psn)
                        && !self.resend_one(ctx, now, psn)
                        && self.retry(ctx.counters, now, psn)
                    {
                        ctx.fatal = true;
                    }
                }
                Syndrome::Nak(code) => {
                    match code {
                        NakCode::RemoteAccessError => ctx.counters.req_remote_access_errors += 1,
                        NakCode::RemoteOperationalError => ctx.counters.remote_op_err += 1,
                        _ => ctx.counters.req_remote_invalid_request += 1,
                    }
                    if self.ack_before(ctx, now, psn) {
                        let status = match code {
                            NakCode::RemoteAccessError => WcStatus::RemoteAccessError,
                            NakCode::RemoteOperationalError => WcStatus::RemoteOperationalError,
                            _ => WcStatus::RemoteInvalidRequestError,
                        };
                        self.fail_at(psn, status);
                        ctx.fatal = true;
                    }
                }
                Syndrome::Reserved(_) => ctx.counters.duplicate_response += 1,
            }
        } else if op == Opcode::RC_ATOMIC_ACKNOWLEDGE {
            self.atomic_ack(ctx, now, repr);
        } else {
            self.read_response(ctx, now, repr, payload);
        }
        self.retire(ctx.p, ctx.counters, cq);
    }

    fn atomic_ack(&mut self, ctx: &mut Ctx<'_>, now: Instant, repr: &PacketRepr) {
        let psn = repr.bth.psn;
        let (Some(orig), Some(aeth)) = (repr.ext.atomic_ack_eth, repr.ext.aeth) else {
            return;
        };
        if !aeth.syndrome.is_ack() {
            ctx.counters.duplicate_response += 1;
            return;
        }
        self.sample(now, psn);
        if !self.ack_before(ctx, now, psn) {
            return;
        }
        let Some(w) = self
            .sq
            .iter_mut()
            .find(|w| w.result.is_none() && w.contains(psn))
        else {
            ctx.counters.duplicate_response += 1;
            return;
        };
        if !w.wr.op.is_atomic() || w.acked != 0 {
            ctx.counters.duplicate_response += 1;
            return;
        }
        let sge = w.wr.sgl[0];
        let value = orig.original.to_ne_bytes();
        w.acked = 1;
        w.sent = 1;
        w.result = Some(
            match ctx.mem.write(
                ctx.p.pd,
                KeyKind::Local,
                sge.lkey,
                sge.addr,
                &value,
                Access::LOCAL_WRITE,
            ) {
                Ok(()) => WcStatus::Success,
                Err(_) => {
                    ctx.fatal = true;
                    WcStatus::LocalProtectionError
                }
            },
        );
        self.una = psn.next();
        self.progress(ctx.p, now);
    }

    fn read_response(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        repr: &PacketRepr,
        payload: &[u8],
    ) {
        let psn = repr.bth.psn;
        // The first answer to a READ sent once times the round trip of its request.
        if let Some(first) = self
            .sq
            .iter()
            .find(|w| w.result.is_none() && w.contains(psn))
            .filter(|w| w.wr.op == SendOp::Read && !w.retried && w.acked == 0)
            .map(|w| w.first_psn)
        {
            if first == psn {
                self.sample(now, first);
            }
        }
        if !self.place_ahead(ctx, repr, payload) {
            return;
        }
        if !self.ack_before(ctx, now, psn) {
            return;
        }
        let Some(w) = self
            .sq
            .iter_mut()
            .find(|w| w.result.is_none() && w.contains(psn))
        else {
            ctx.counters.duplicate_response += 1;
            return;
        };
        if w.wr.op != SendOp::Read {
            ctx.counters.duplicate_response += 1;
            return;
        }
        let k = psn.distance_from(w.first_psn);
        // ack_before took any later response as an implied NAK, so this one is at or before
        // the first missing.
        if k != w.acked || !read_response_fits(w, k, repr, payload) {
            ctx.counters.duplicate_response += 1;
            return;
        }
        if !place_read_response(ctx, w, k, payload) {
            return;
        }
        w.original_answered |= !w.retried;
        w.acked += 1;
        // Responses placed ahead of the gap this one filled.
        while w.acked < w.npsn && w.has_ahead(w.acked) {
            let a = w.acked;
            w.toggle_ahead(a);
            w.acked += 1;
        }
        w.sent = w.sent.max(w.acked);
        if w.acked == w.npsn {
            w.result = Some(WcStatus::Success);
        }
        self.una = w.first_psn.add(w.acked);
        self.progress(ctx.p, now);
    }

    /// Places a READ response that arrived after a gap (ahead of the first missing packet,
    /// within [`READ_AHEAD`]) into the local buffer right away: the bytes at a response PSN are
    /// the same in every answer, so once the gap is filled the READ need not ask for them
    /// again, and a piece of a retry that fills some holes is progress. Such new data restores
    /// the retry budget (it is progress) but not the ACK timer (the gap still needs filling).
    /// Only for the oldest READ/atomic still waiting, into a single SGE: local results then land
    /// in the order in-order answers would put them, which decides the bytes where buffers
    /// overlap (the later wins). Returns `false` if the QP must stop (a local protection error).
    fn place_ahead(&mut self, ctx: &mut Ctx<'_>, repr: &PacketRepr, payload: &[u8]) -> bool {
        let psn = repr.bth.psn;
        let Some(i) = self
            .sq
            .iter()
            .position(|w| w.result.is_none() && w.contains(psn))
        else {
            return true;
        };
        if self.outstanding_rd_atomic(i) > 0 {
            return true;
        }
        let w = &mut self.sq[i];
        let k = psn.distance_from(w.first_psn);
        if w.wr.op != SendOp::Read
            || w.wr.sgl.len() != 1
            || k <= w.acked
            || k - w.acked >= READ_AHEAD
            || w.has_ahead(k)
            || !read_response_fits(w, k, repr, payload)
        {
            return true;
        }
        if !place_read_response(ctx, w, k, payload) {
            return false;
        }
        w.toggle_ahead(k);
        w.original_answered |= !w.retried;
        self.retry_left = ctx.p.retry_cnt;
        true
    }

    /// Handles the ACK timer and the end of an RNR back-off. Returns `true` if the retry budget
    /// ran out and the QP must go to ERR.
    pub fn handle_timeout(&mut self, p: &Params, counters: &mut Counters, now: Instant) -> bool {
        if self.rnr_until.is_some_and(|t| t <= now) {
            self.rnr_until = None;
        }
        if self.paced_until.is_some_and(|t| t <= now) {
            self.paced_until = None;
        }
        for r in self.resend.iter_mut().filter(|r| r.due <= now) {
            r.ready = true;
        }
        if self.tlp_timer.is_some_and(|t| t <= now) {
            self.tlp_timer = None;
            let psn = self.probe_psn().filter(|_| self.rnr_until.is_none());
            if let Some(psn) = psn.filter(|_| !self.tlp_sent) {
                // The newest packet again: if anything before it was lost, the peer keeps it
                // (or has it) and its SACK names every hole; if only the ACK was lost, the
                // duplicate is acknowledged again. The retransmission timeout starts over
                // from the probe (RFC 8985 7.3), or it would cut across the recovery.
                self.tlp_sent = true;
                self.arm_rto(p, now);
                if !self.resend.iter().any(|r| r.psn == psn) {
                    self.resend.push_front(Resend {
                        psn,
                        due: now,
                        probe: true,
                        ready: true,
                    });
                }
            }
        }
        if self.timer.is_some_and(|t| t <= now) {
            self.tlp_timer = None;
            self.timer = None;
            if !self.any_outstanding() {
                self.rto_timer = None;
                return false;
            }
            counters.completer_retry_err += 1;
            let una = self.una;
            // A timeout always rewinds, even to a PSN a NAK already rewound to.
            self.gone_back_to = None;
            self.resend.clear();
            self.rto_backoff = self.rto_backoff.saturating_add(1);
            self.rto_timer = None;
            if self.retry_after(counters, now, una, true) {
                return true;
            }
        } else if self.rto_timer.is_some_and(|t| t <= now) {
            // The fast timeout: resend from the oldest unacknowledged PSN, as the IBTA
            // timeout does, without spending the retry budget (the IBTA timer above still
            // runs from the last progress and spends it).
            self.rto_timer = None;
            self.tlp_timer = None;
            if self.any_outstanding() && self.rnr_until.is_none() {
                counters.rto_fired += 1;
                self.rto_backoff = self.rto_backoff.saturating_add(1);
                if self.rto_undo.is_none() {
                    self.rto_undo = self.cc.clone().map(|c| (now, c));
                }
                let una = self.una;
                self.note_loss(now, una, true);
                self.gone_back_to = None;
                self.resend.clear();
                self.go_back(una);
                self.arm_rto(p, now);
            }
        }
        false
    }

    fn outstanding_rd_atomic(&self, before: usize) -> usize {
        self.sq
            .iter()
            .take(before)
            .filter(|w| w.started && w.result.is_none() && w.wr.op.is_read_or_atomic())
            .count()
    }

    /// Writes the next request packet, if one may be sent now.
    pub fn poll_transmit(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        buf: &mut [u8],
        cq: &mut CompletionQueue,
    ) -> Option<usize> {
        if self.rnr_until.is_some() {
            return None;
        }
        self.paced_until = None;
        let p = ctx.p;
        let mtu = p.mtu;
        // Selective repeat: the holes the peer reported go first, one packet each.
        while let Some(&Resend {
            psn, due, probe, ..
        }) = self.resend.front()
        {
            let Some((i, k)) = self.resendable(psn) else {
                // Acknowledged meanwhile: it was late (reordered), not lost.
                self.resend.pop_front();
                continue;
            };
            if due > now {
                // Not yet (`next_timeout` names the moment); new packets may go meanwhile.
                break;
            }
            if !probe && !self.stamp_of(psn).is_some_and(|s| s.resent) {
                // Lost for certain now: the window answers once per round trip.
                let srtt = self.srtt();
                if let Some(cc) = self.cc.as_mut() {
                    cc.on_loss(now, srtt);
                }
            }
            let len = paced_len(&self.sq[i], k).unwrap_or(0);
            if let Err(at) = self.pace(p, now, len) {
                self.paced_until = Some(at);
                return None;
            }
            self.resend.pop_front();
            let saved = (self.sq[i].sent, self.since_ack_req, self.unasked_messages);
            self.sq[i].sent = k;
            self.force_ack_req = true;
            let res = self.build(ctx, now, i, buf);
            self.force_ack_req = false;
            self.sq[i].sent = saved.0;
            (self.since_ack_req, self.unasked_messages) = (saved.1, saved.2);
            if res.is_ok() {
                if probe {
                    ctx.counters.tail_loss_probes += 1;
                } else {
                    ctx.counters.sr_retransmits += 1;
                }
            }
            return self.sent_or_failed(ctx, now, i, res, cq);
        }
        loop {
            let i = self.cursor;
            let w = self.sq.get(i)?;
            if w.result.is_some() || (w.started && w.sent >= w.npsn) {
                self.cursor += 1;
                continue;
            }
            if w.started && w.wr.op == SendOp::Read && w.acked < w.sent {
                // A piece of a READ retry is being answered: the next piece, and everything
                // after the READ, waits for it (see the module doc).
                return None;
            }
            if !w.started {
                // New requests start only in RTS.
                if ctx.state != QpState::Rts {
                    return None;
                }
                let rd_atomic = w.wr.op.is_read_or_atomic();
                let outstanding = self.outstanding_rd_atomic(i);
                if w.wr.flags.fence && outstanding > 0 {
                    return None;
                }
                if rd_atomic && outstanding >= usize::from(p.max_rd_atomic) {
                    return None;
                }
                if self.window_holds(w, mtu) && !self.window_probe {
                    return None;
                }
                let npsn = packets_of(w, mtu);
                let next = self.next_psn;
                let w = &mut self.sq[i];
                w.started = true;
                w.first_psn = next;
                w.npsn = npsn;
                w.mtu = mtu;
                self.next_psn = next.add(npsn);
            }
            let w = &self.sq[i];
            let beyond = self.window_holds(w, mtu);
            if beyond && !self.window_probe {
                return None;
            }
            if let Some(len) = paced_len(w, w.sent) {
                if let Err(at) = self.pace(p, now, len) {
                    self.paced_until = Some(at);
                    return None;
                }
            }
            // The probe past the window asks; one within it (the window opened meanwhile)
            // follows the usual rules.
            self.force_ack_req = beyond;
            self.window_probe = false;
            let res = self.build(ctx, now, i, buf);
            self.force_ack_req = false;
            return self.sent_or_failed(ctx, now, i, res, cq);
        }
    }

    /// What `poll_transmit` returns for request `i`'s packet built as `res`: its length (the
    /// timers armed if they were not), or nothing when the request failed to build (it
    /// completes in error, and the QP goes to ERR).
    fn sent_or_failed(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        i: usize,
        res: Result<usize, WcStatus>,
        cq: &mut CompletionQueue,
    ) -> Option<usize> {
        match res {
            Ok(n) => {
                if self.timer.is_none() {
                    self.arm(ctx.p, now);
                } else {
                    // The probe waits for two round trips after the newest packet (RFC 8985).
                    self.arm_tlp(now);
                }
                Some(n)
            }
            Err(status) => {
                self.sq[i].result = Some(status);
                ctx.fatal = true;
                self.retire(ctx.p, ctx.counters, cq);
                None
            }
        }
    }

    /// Where a selective resend of `psn` is: `(request index, packet number)`, if `psn` is a
    /// SEND or WRITE packet that was sent and is not acknowledged. READ and atomic requests are
    /// never resent one PSN at a time (a NAK for them goes back as in go-back-N).
    fn resendable(&self, psn: Psn) -> Option<(usize, u32)> {
        let i = self
            .sq
            .iter()
            .position(|w| w.result.is_none() && w.contains(psn))?;
        let w = &self.sq[i];
        let k = psn.distance_from(w.first_psn);
        (!w.wr.op.is_read_or_atomic() && k >= w.acked && k < w.high_sent).then_some((i, k))
    }

    /// Takes a sequence-error NAK for `psn` as one lost packet when the peer keeps what
    /// arrived after it (selective repeat): queues `psn` alone to be sent again. Returns
    /// `false` when go-back-N must handle it instead (no selective repeat, or a READ or atomic).
    /// A NAK for a hole refilled less than a round trip ago is news already acted on. Each
    /// resend a NAK asks for spends the retry budget, as a go-back would (SACKs do not: the
    /// IBTA timer, which runs from the last progress, bounds a peer that reports holes forever).
    fn resend_one(&mut self, ctx: &mut Ctx<'_>, now: Instant, psn: Psn) -> bool {
        if !self.selective || self.rnr_until.is_some() || self.resendable(psn).is_none() {
            return false;
        }
        if self.resend_pending(now, psn) {
            return true;
        }
        if self.retry_left == 0 {
            ctx.counters.retry_exceeded_err += 1;
            self.fail_at(psn, WcStatus::TransportRetryExceeded);
            ctx.fatal = true;
            return true;
        }
        self.retry_left -= 1;
        self.queue_hole(now, psn);
        true
    }

    /// Whether a resend of `psn` is queued already, or left less than a round trip ago (so a
    /// report of the hole is news already acted on).
    fn resend_pending(&self, now: Instant, psn: Psn) -> bool {
        let srtt = self.srtt();
        let recent = self
            .stamp_of(psn)
            .is_some_and(|s| s.resent && now.saturating_since(s.at) < srtt);
        recent || self.resend.iter().any(|r| r.psn == psn)
    }

    /// Queues the hole `psn` for one resend. A packet that arrived out of order looks lost to
    /// the responder the moment a later one arrives: the resend waits a quarter of the path's
    /// minimum RTT (RACK's reordering window), and is dropped if the packet's acknowledgement
    /// comes first.
    fn queue_hole(&mut self, now: Instant, psn: Psn) {
        // Before the first sample, the timer granularity stands in for the minimum RTT (a
        // SACK that overtook the ACK covering its holes must not resend them at once).
        let min_rtt = if self.rtt.samples() == 0 {
            RTO_GRANULARITY
        } else {
            self.rtt.min_rtt()
        };
        let due = now + min_rtt / 4;
        self.resend.push_back(Resend {
            psn,
            due,
            probe: false,
            ready: false,
        });
    }

    /// Handles a SACK (see [`crate::sack`]): its cumulative part as an ACK, then every hole it
    /// names (up to [`MAX_HOLES_PER_SACK`]) queued for one resend.
    fn sack(&mut self, ctx: &mut Ctx<'_>, now: Instant, repr: &PacketRepr, bitmap: &[u8]) {
        let last = repr.bth.psn;
        let end = last.next();
        // The responder's expected PSN lies in [una, next_psn]; anything else is stale (an
        // older SACK overtaken) or not a SACK this requester could have caused.
        if !self.selective || end.is_before(self.una) || end.is_after(self.next_psn) {
            ctx.counters.duplicate_response += 1;
            return;
        }
        ctx.counters.sacks_rcvd += 1;
        if end.is_after(self.una) {
            self.undo_spurious_timeout(ctx.counters, now, last);
            if !self.ack_before(ctx, now, end) {
                // A READ or atomic before `end` lost its answer: gone back to it already.
                return;
            }
        }
        if self.rnr_until.is_some() {
            return;
        }
        if end == self.una {
            // Kept packets among those sent (bit i: `end + 1 + i`).
            let reach = self.next_psn.distance_from(end).saturating_sub(1);
            let bits = (reach as usize).min(bitmap.len().min(sack::SACK_BITMAP_BYTES) * 8);
            self.sacked = (0..bits)
                .filter(|&i| bitmap[i / 8] & (1 << (i % 8)) != 0)
                .count() as u32;
            self.sacked_from = end;
        }
        // Holes come oldest first, as the requests do: one walk of the send queue finds each
        // hole's request. A READ's or atomic's PSNs are never requests the peer keeps (only
        // the first one is a request at all), so they are skipped, not counted.
        let mut queued = 0;
        let mut j = 0;
        for hole in sack::holes(last, bitmap) {
            if queued == MAX_HOLES_PER_SACK || !hole.is_before(self.next_psn) {
                break;
            }
            while self
                .sq
                .get(j)
                .is_some_and(|w| w.started && !hole.is_before(w.first_psn.add(w.npsn)))
            {
                j += 1;
            }
            let Some(w) = self.sq.get(j).filter(|w| w.started && w.contains(hole)) else {
                continue;
            };
            let k = hole.distance_from(w.first_psn);
            let resendable = w.result.is_none()
                && !w.wr.op.is_read_or_atomic()
                && k >= w.acked
                && k < w.high_sent;
            if resendable && !self.resend_pending(now, hole) {
                self.queue_hole(now, hole);
                queued += 1;
            }
        }
    }

    /// Whether a data packet of `len` bytes may leave now (see [`crate::pacer`]); if not, when.
    fn pace(&mut self, p: &Params, now: Instant, len: u64) -> Result<(), Instant> {
        let packet = u64::from(p.mtu) + WIRE_OVERHEAD;
        let window = self
            .cc
            .as_ref()
            .filter(|c| c.enabled())
            .zip(self.rtt.srtt())
            .map(|(cc, srtt)| window_rate(cc.cwnd(), packet, srtt));
        let Some(rate) = window.into_iter().chain(self.rate_cap).min() else {
            return Ok(());
        };
        self.pacer.take(now, rate, packet, len + WIRE_OVERHEAD)
    }

    /// Builds the packet at `sent` of request `i` and advances it.
    fn build(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        i: usize,
        buf: &mut [u8],
    ) -> Result<usize, WcStatus> {
        let p = ctx.p;
        let window_end = self.una.add(self.send_limit() - 1);
        let ack_every = if self.cc.as_ref().is_some_and(Controller::enabled) {
            (self.window() / ACKS_PER_WINDOW).clamp(1, ACK_REQ_INTERVAL)
        } else {
            ACK_REQ_INTERVAL
        };
        let pending_ack = self.ack_req_pending();
        let pieces_allowed = self.outstanding_rd_atomic(i) == 0;
        let una = self.una;
        let window = self.window();
        let w = &mut self.sq[i];
        let mtu = u64::from(w.mtu);
        let psn = w.first_psn.add(w.sent);
        let retransmit = w.sent < w.high_sent;
        let overflow = WcStatus::LocalLengthError;
        let n = match w.wr.op {
            SendOp::Read => {
                let k = w.sent;
                let end = if retransmit {
                    read_piece_end(
                        w,
                        pieces_allowed,
                        window.saturating_sub(psn.distance_from(una)),
                    )
                } else {
                    w.npsn
                };
                let offset = u64::from(k) * mtu;
                let rest = w.len - offset.min(w.len);
                let reth = RethRepr {
                    va: w.wr.remote_addr.wrapping_add(offset),
                    rkey: w.wr.rkey,
                    dma_len: rest.min(u64::from(end - k) * mtu) as u32,
                };
                let ext = ExtHeaders {
                    reth: Some(reth),
                    ..Default::default()
                };
                let (_, n) = emit::headers(
                    buf,
                    p,
                    emit::Bth::ack_req(Opcode::RC_RDMA_READ_REQUEST, psn),
                    ext,
                    0,
                )
                .ok_or(overflow)?;
                self.last_ack_req = Some(psn.add(end - k - 1));
                w.sent = end;
                n
            }
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                let (opcode, swap_add, compare) = match w.wr.op {
                    SendOp::CompareSwap { compare, swap } => {
                        (Opcode::RC_COMPARE_SWAP, swap, compare)
                    }
                    SendOp::FetchAdd { add } => (Opcode::RC_FETCH_ADD, add, 0),
                    _ => return Err(WcStatus::LocalQpOperationError),
                };
                let a = AtomicEthRepr {
                    va: w.wr.remote_addr,
                    rkey: w.wr.rkey,
                    swap_add,
                    compare,
                };
                let ext = ExtHeaders {
                    atomic_eth: Some(a),
                    ..Default::default()
                };
                let (_, n) = emit::headers(buf, p, emit::Bth::ack_req(opcode, psn), ext, 0)
                    .ok_or(overflow)?;
                self.last_ack_req = Some(psn);
                w.sent = 1;
                n
            }
            _ => {
                let k = w.sent;
                let offset = u64::from(k) * mtu;
                let plen = (w.len - offset.min(w.len)).min(mtu) as usize;
                let position = match (k == 0, k + 1 == w.npsn) {
                    (true, true) => Position::Only,
                    (true, false) => Position::First,
                    (false, true) => Position::Last,
                    (false, false) => Position::Middle,
                };
                let mut ext = ExtHeaders::default();
                let write = matches!(w.wr.op, SendOp::Write | SendOp::WriteWithImm(_));
                if write && position.starts_message() {
                    ext.reth = Some(RethRepr {
                        va: w.wr.remote_addr,
                        rkey: w.wr.rkey,
                        dma_len: w.len as u32,
                    });
                }
                if position.ends_message() {
                    match w.wr.op {
                        SendOp::SendWithImm(v) | SendOp::WriteWithImm(v) => {
                            ext.immdt = Some(ImmDtRepr { value: v })
                        }
                        SendOp::SendWithInvalidate(r) => ext.ieth = Some(IethRepr { rkey: r }),
                        _ => {}
                    }
                }
                let opcode = data_opcode(w.wr.op, position);
                let last = position.ends_message();
                self.since_ack_req += 1;
                // The last packet of a message asks for its ACK, unless the peer acknowledges
                // unasked requests and nobody waits for this one (see
                // `QueuePair::set_peer_acks_unasked`).
                let unasked = last
                    && !retransmit
                    && !w.wr.flags.signaled
                    && self.unasked_messages < p.unasked_run
                    && ack_timeout(p.timeout).is_some_and(|t| t >= 4 * UNASKED_ACK_DELAY);
                // The packet that fills the window asks too, so that the ACK which opens it
                // again is sure to come; unless an earlier one's is still on its way. (Asking
                // at every window end made a window-limited sender, whose window slides one
                // packet per ACK, ask on every packet: an ACK per packet, which halved what a
                // Linux rxe peer in an emulated guest could take.)
                let ack_req = (last && !unasked)
                    || self.since_ack_req >= ack_every
                    || (psn == window_end && (retransmit || !pending_ack))
                    || self.force_ack_req;
                if ack_req {
                    self.last_ack_req = Some(psn);
                    self.since_ack_req = 0;
                }
                if last {
                    self.unasked_messages = if ack_req {
                        0
                    } else {
                        self.unasked_messages + 1
                    };
                }
                let solicited = last && w.wr.flags.solicited;
                let (start, n) = emit::headers(
                    buf,
                    p,
                    emit::Bth {
                        opcode,
                        psn,
                        ack_req,
                        solicited,
                    },
                    ext,
                    plen,
                )
                .ok_or(overflow)?;
                gather(ctx.mem, p.pd, &w.wr, offset, &mut buf[start..start + plen])?;
                w.sent += 1;
                n
            }
        };
        if matches!(w.wr.op, SendOp::Read) || w.wr.op.is_atomic() || w.sent == w.npsn {
            self.since_ack_req = 0;
        }
        if retransmit {
            ctx.counters.retransmits += 1;
        }
        w.high_sent = w.high_sent.max(w.sent);
        // Every request asks for its answer except data packets that leave the bit clear.
        let asked = buf.get(8).is_some_and(|b| b & 0x80 != 0);
        self.last_unasked = !asked;
        self.stamp(psn, now, asked);
        Ok(n)
    }

    /// PSN of the oldest unacknowledged packet.
    pub fn una(&self) -> Psn {
        self.una
    }
}

/// Whether `payload` under `repr`'s opcode is what READ `w`'s response packet `k` must be: a
/// full MTU (a short one only at the message's end), and FIRST/MIDDLE only before the last
/// packet. LAST/ONLY may end the message or any piece a retry asked for.
fn read_response_fits(w: &SendWqe, k: u32, repr: &PacketRepr, payload: &[u8]) -> bool {
    let mtu = u64::from(w.mtu);
    let offset = u64::from(k) * mtu;
    let want = (w.len - offset.min(w.len)).min(mtu);
    let position_ok = match repr.bth.opcode.info().map(|i| i.position) {
        Some(Position::First | Position::Middle) => k + 1 < w.npsn,
        Some(Position::Last | Position::Only) => true,
        None => false,
    };
    position_ok && payload.len() as u64 == want
}

/// Where a READ retry from response packet `w.sent` (its first missing) ends: the whole rest
/// unless `pieces` are allowed, else about `room` packets (the loss window left), and never
/// past an earlier request's end that the answers have not reached (see the module doc).
fn read_piece_end(w: &mut SendWqe, pieces: bool, room: u32) -> u32 {
    let k = w.sent;
    w.retried = true;
    if w.original_answered {
        w.read_ends.clear();
    }
    while w.read_ends.last().is_some_and(|&e| e <= k) {
        w.read_ends.pop();
    }
    let limit = w.read_ends.last().copied().unwrap_or(w.npsn);
    if !(pieces || w.original_answered) || w.read_ends.len() >= MAX_READ_ENDS {
        return limit;
    }
    let room = room.max(1);
    let mut end = limit.min(k.saturating_add(room));
    // Few holes in reach: reach further for more (see the module doc).
    let far = limit.min(k.saturating_add(room.saturating_mul(4)));
    let mut holes = (k..end).filter(|&j| !w.has_ahead(j)).count();
    while end < far && holes < MIN_PIECE_HOLES {
        if !w.has_ahead(end) {
            holes += 1;
        }
        end += 1;
    }
    // Packets at the piece's end that arrived ahead of the gap need not come again.
    while end > k + 1 && w.has_ahead(end - 1) {
        end -= 1;
    }
    if end < limit && !w.original_answered {
        w.read_ends.push(end);
    }
    end
}

fn data_opcode(op: SendOp, pos: Position) -> Opcode {
    use Position::*;
    match (op, pos) {
        (_, First) if matches!(op, SendOp::Write | SendOp::WriteWithImm(_)) => {
            Opcode::RC_RDMA_WRITE_FIRST
        }
        (_, Middle) if matches!(op, SendOp::Write | SendOp::WriteWithImm(_)) => {
            Opcode::RC_RDMA_WRITE_MIDDLE
        }
        (SendOp::Write, Last) => Opcode::RC_RDMA_WRITE_LAST,
        (SendOp::Write, Only) => Opcode::RC_RDMA_WRITE_ONLY,
        (SendOp::WriteWithImm(_), Last) => Opcode::RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
        (SendOp::WriteWithImm(_), Only) => Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        (_, First) => Opcode::RC_SEND_FIRST,
        (_, Middle) => Opcode::RC_SEND_MIDDLE,
        (SendOp::SendWithImm(_), Last) => Opcode::RC_SEND_LAST_WITH_IMMEDIATE,
        (SendOp::SendWithImm(_), Only) => Opcode::RC_SEND_ONLY_WITH_IMMEDIATE,
        (SendOp::SendWithInvalidate(_), Last) => Opcode::RC_SEND_LAST_WITH_INVALIDATE,
        (SendOp::SendWithInvalidate(_), Only) => Opcode::RC_SEND_ONLY_WITH_INVALIDATE,
        (_, Last) => Opcode::RC_SEND_LAST,
        (_, Only) => Opcode::RC_SEND_ONLY,
    }
}

/// Copies `out.len()` bytes of the message, from byte `offset`, out of the request's inline
/// data or local buffers.
pub(crate) fn gather(
    mem: &mut dyn Memory,
    pd: u32,
    wr: &SendWr,
    offset: u64,
    out: &mut [u8],
) -> Result<(), WcStatus> {
    if let Some(d) = &wr.inline_data {
        let start = offset as usize;
        out.copy_from_slice(&d[start..start + out.len()]);
        return Ok(());
    }
    walk_sges(&wr.sgl, offset, out.len(), |sge_addr, lkey, at, n| {
        mem.read(
            pd,
            KeyKind::Local,
            lkey,
            sge_addr,
            &mut out[at..at + n],
            Access::NONE,
        )
    })
    .map_err(|_| WcStatus::LocalProtectionError)
}

/// Writes the READ response packet `k` of `w` into its local buffers; if they refuse it, the
/// request fails with a local protection error and the QP goes to ERR. Returns whether the
/// payload was placed.
fn place_read_response(ctx: &mut Ctx<'_>, w: &mut SendWqe, k: u32, payload: &[u8]) -> bool {
    let offset = u64::from(k) * u64::from(w.mtu);
    if scatter(ctx.mem, ctx.p.pd, &w.wr, offset, payload).is_ok() {
        return true;
    }
    w.result = Some(WcStatus::LocalProtectionError);
    ctx.fatal = true;
    false
}

/// Copies `data` into the request's local buffers at message byte `offset`.
fn scatter(mem: &mut dyn Memory, pd: u32, wr: &SendWr, offset: u64, data: &[u8]) -> Result<(), ()> {
    walk_sges(&wr.sgl, offset, data.len(), |addr, lkey, at, n| {
        mem.write(
            pd,
            KeyKind::Local,
            lkey,
            addr,
            &data[at..at + n],
            Access::LOCAL_WRITE,
        )
    })
    .map_err(|_| ())
}

/// Packets a request takes: one for an atomic, else its length in packets of `mtu`.
fn packets_of(w: &SendWqe, mtu: u32) -> u32 {
    if w.wr.op.is_atomic() {
        1
    } else {
        packets_for(w.len, mtu)
    }
}

#[cfg(test)]
mod tests;
