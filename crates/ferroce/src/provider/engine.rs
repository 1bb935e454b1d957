//! The engine: the part of ferroce that plays the NIC, for every provider's packet path.
//!
//! One pass of [`progress`] lets each provider take in what arrived (the UDP provider reads the
//! context's socket in batches and checks each ICRC; the shared-memory provider empties its
//! rings) and hand every packet to the QP its destination QPN names ([`hand_over`]), then runs
//! the QPs' timers, lets every QP make what it can send and gives each batch to the provider
//! that carries the QP, and moves completions to their CQs. Passes run on the engine thread,
//! so one-sided operations are served while the application sleeps, and inline on application
//! threads that poll a CQ or post work (whoever holds the engine lock makes progress).
//!
//! The engine thread spins while traffic flows and for [`SPIN`] after, then sleeps in `ppoll(2)`
//! on the socket, the shared-memory listener and the doorbell eventfd, until the earliest
//! transport timer and at most [`MAX_SLEEP`]: an idle context wakes 250 times a second and
//! otherwise burns no CPU. A transport timer due within [`SPIN`] (a short retransmission
//! timeout, a pacing gap) is waited for spinning: a sleep and wake-up costs tens of µs on a
//! busy machine, and the sleep itself ends up to the timer slack late, which the thread sets
//! to [`TIMER_SLACK`] for the timers it does sleep for. Where other threads wait for the CPUs
//! it does not spin at all (see [`super::contention`]). While an application thread is driving
//! progress itself (it polls a CQ: a *hand-over*), the engine thread stays out of its way,
//! asleep on its doorbell, and same-host peers are told not to wake it; it checks in every few
//! milliseconds, or every 250 µs where a poll that returned completions may hand progress back
//! lazily (see [`super::hand_back`]).
//!
//! # Deferred ACKs
//! On a NIC an ACK costs nothing; here every datagram costs a trip through the kernel. In a
//! ping-pong the responder would send its ACK first and its own request a moment later, two
//! sends on the critical path. So while an application thread is busy-polling this context and
//! the QP itself sent a request within [`PING_PONG_WINDOW`] (a reply is likely imminent), a pure
//! positive ACK is held for up to [`ACK_DEFER`] and leaves
//! *after* the next packet of the same QP, in the same `sendmmsg`, or alone when the hold
//! expires. The IBTA lets a responder coalesce ACKs; NAKs are never held, and when nobody polls
//! (a passive target served by the engine thread) ACKs leave at once.
//!
//! Between two ferroce peers most of those ACKs are never made: unsignaled requests leave the
//! AckReq bit clear and the responder acknowledges a run of them with one ACK (see
//! `ferroce_proto::QueuePair::set_peer_acks_unasked`, negotiated by [`crate::cm`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferroce_proto::{CcAlgorithm, CcConfig, Instant, WcOpcode, WorkCompletion};
use ferroce_wire::opcode::{Operation, Position};
use ferroce_wire::RocePacket;

use super::udp::{BATCH, MAX_DATAGRAM};
use super::{shm, udp};
use crate::os;
use crate::provider::{ContextShared, EngineMemory, QpCore, QpShared};

/// How long the engine thread keeps spinning after the last work before it sleeps; it also
/// spins, rather than sleeps, for a timer due sooner than this.
pub(crate) const SPIN: Duration = Duration::from_micros(50);
/// The engine thread's timer slack (the kernel's default is 50 µs): how late its sleeps for
/// transport timers may end.
const TIMER_SLACK: Duration = Duration::from_micros(5);
/// How often the engine thread checks in while an application thread drives progress: each
/// check-in can preempt a spinning application on a small machine (p99 8 B write latency 13 µs
/// at 1 ms, 4.9 µs at 10 ms on 2 cores), and an application that stops polling hands progress
/// back to the engine within this time.
const APP_POLL_GRACE: Duration = Duration::from_millis(4);
/// How long a positive ACK may wait for a data packet to leave with.
pub(crate) const ACK_DEFER: Duration = Duration::from_micros(20);
/// ACKs are held only on a QP that sent a request this recently (it is in a ping-pong).
pub(crate) const PING_PONG_WINDOW: Duration = Duration::from_micros(50);
/// The engine thread never sleeps longer than this, whatever it waits for: an application
/// that drained the socket before the engine woke leaves it nothing to wake on.
const MAX_SLEEP: Duration = Duration::from_millis(4);
/// Packets taken from a QP per batch: one slot of the batch stays free for a held ACK.
const TAKE: usize = BATCH - 1;

/// An ACK held back: its unsealed bytes and when it must leave.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeferredAck {
    bytes: [u8; 24],
    len: usize,
    deadline: Instant,
}

/// Whether a packet is a request (SEND, WRITE, READ request, atomic), not an answer.
fn is_request(pkt: &[u8]) -> bool {
    use ferroce_wire::opcode::Operation;
    pkt.first()
        .and_then(|&op| ferroce_wire::Opcode(op).info())
        .is_some_and(|i| {
            matches!(
                i.operation,
                Operation::Send
                    | Operation::RdmaWrite
                    | Operation::RdmaReadRequest
                    | Operation::CompareSwap
                    | Operation::FetchAdd
            )
        })
}

/// Whether a packet is a pure positive ACKNOWLEDGE (not a NAK, not an atomic or READ answer).
fn is_plain_ack(pkt: &[u8]) -> bool {
    pkt.len() <= 24
        && pkt.first() == Some(&ferroce_wire::Opcode::RC_ACKNOWLEDGE.0)
        && pkt
            .get(12)
            .is_some_and(|syndrome| (syndrome >> 5) & 0x3 == 0)
}

/// The engine's reusable buffers.
pub(crate) struct EngineState {
    tx: Vec<Vec<u8>>,
    tx_lens: Vec<usize>,
    qps: Vec<Arc<QpShared>>,
    qps_generation: u64,
    wcs: Vec<WorkCompletion>,
    /// The earliest deadline seen in the last pass: a transport timer, a held ACK, a retry
    /// of a full ring.
    next_deadline: Option<Instant>,
    /// The earliest transport timer seen in the last pass (retransmission, pacing, unasked
    /// ACK): the engine thread spins for one due within [`SPIN`]. Not a full ring's retry,
    /// which waits for another process: spinning for it would take the CPU from that process.
    next_timer: Option<Instant>,
    /// The UDP provider's receive side.
    udp: udp::UdpReceiver,
    /// Where a packet from a shared-memory ring is copied to be handled.
    shm_rx: Vec<u8>,
}

impl std::fmt::Debug for EngineState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineState")
            .field("qps", &self.qps.len())
            .finish()
    }
}

impl EngineState {
    pub(crate) fn new() -> EngineState {
        EngineState {
            tx: (0..BATCH).map(|_| vec![0u8; MAX_DATAGRAM]).collect(),
            tx_lens: vec![0; BATCH],
            qps: Vec::new(),
            qps_generation: u64::MAX,
            wcs: Vec::new(),
            next_deadline: None,
            next_timer: None,
            udp: udp::UdpReceiver::new(),
            shm_rx: vec![0u8; MAX_DATAGRAM],
        }
    }
}

impl ContextShared {
    /// Records whether the engine thread sleeps, for this process, and for same-host peers
    /// whether a write into one of this context's rings must wake it: not while an application
    /// thread drives progress (`app_driving`), whose next poll drains the rings anyway — a wake
    /// byte would cost the peer a system call per packet and wake nobody.
    pub(crate) fn set_sleeping(&self, sleeping: bool, app_driving: bool) {
        self.sleeping.store(sleeping, Ordering::SeqCst);
        if let Some(host) = &self.shm {
            host.table.set_sleeping(sleeping && !app_driving);
        }
    }

    pub(crate) fn now(&self) -> Instant {
        Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    /// Drives progress from an application thread if the engine is free.
    pub(crate) fn progress_inline(&self) -> bool {
        let now = self.now();
        // The hand-over keeps the engine thread and a polling thread from taking turns at one
        // socket, and from both spinning over rings: on a small machine a second spinning
        // thread per process takes the CPU the peer process needs to answer.
        if self.hand_over_to_polling_app {
            if self.hand_back_at_completion {
                self.hand_back.polled();
            }
            self.app_polling_until
                .store((now + APP_POLL_GRACE).as_nanos(), Ordering::Release);
        }
        match self.engine.try_lock() {
            Ok(mut st) => progress_at(self, &mut st, now),
            Err(_) => false,
        }
    }

    /// Drives progress from an application thread that polls an armed CQ, if the engine is
    /// free. Such a thread drains the CQ before it sleeps on the CQ's channel, so it takes no
    /// hand-over, and ends one it held: while it sleeps the engine thread must read the socket
    /// and be woken by same-host peers, or each wake-up waits out [`APP_POLL_GRACE`]
    /// (measured: 4 ms per `rpoll` of an rsocket carrying iperf3, 32 MB/s instead of GB/s).
    pub(crate) fn progress_inline_before_sleep(&self) -> bool {
        self.end_hand_over();
        match self.engine.try_lock() {
            Ok(mut st) => progress_at(self, &mut st, self.now()),
            Err(_) => false,
        }
    }

    /// Ends an application thread's hand-over after its poll returned completions, if the
    /// context asks for that (see [`crate::ContextOptions::hand_back_at_completion`]): at once
    /// (the engine thread, asleep on its doorbell alone meanwhile, is woken to read the socket),
    /// or lazily, for a program that polls again anyway (see `hand_back`).
    #[inline]
    pub(crate) fn hand_back(&self) {
        if self.hand_back_at_completion && !self.hand_back.hand_back(self.now().as_nanos()) {
            self.end_hand_over();
        }
    }

    /// Ends an application thread's hand-over now: it is about to wait for a completion
    /// event (it armed a CQ), so nobody would read the socket until the grace period ran out.
    #[inline]
    pub(crate) fn end_hand_over(&self) {
        if self.app_polling_until.load(Ordering::Acquire) != 0
            && self.app_polling_until.swap(0, Ordering::SeqCst) != 0
            && self.sleeping.load(Ordering::SeqCst)
        {
            self.doorbell_fd.notify();
        }
    }

    /// After a post: transmit now if the engine is free, else make sure it wakes.
    pub(crate) fn doorbell(&self, qp: &Arc<QpShared>) {
        match self.engine.try_lock() {
            Ok(mut st) => {
                let now = self.now();
                transmit_qp(self, &mut st, qp, now);
            }
            Err(_) => {
                self.work_pending.store(true, Ordering::SeqCst);
                if self.sleeping.load(Ordering::SeqCst) {
                    self.doorbell_fd.notify();
                }
            }
        }
    }
}

/// One pass of the engine. Returns whether anything happened.
pub(crate) fn progress(shared: &ContextShared, st: &mut EngineState) -> bool {
    progress_at(shared, st, shared.now())
}

/// One pass of the engine at `now` (a caller that just read the clock saves a second read).
fn progress_at(shared: &ContextShared, st: &mut EngineState, now: Instant) -> bool {
    // Whether a QP uses the socket: it is read in every pass then (else only now and then), and
    // a thread polling an empty CQ yields its CPU only then.
    let socket_in_use =
        st.qps.is_empty() || shared.has_ud_qps() || st.qps.iter().any(|q| q.shm_linked().is_none());
    if shared.socket_in_use.load(Ordering::Relaxed) != socket_in_use {
        shared.socket_in_use.store(socket_in_use, Ordering::Relaxed);
    }
    let mut did = udp::receive(shared, &mut st.udp, socket_in_use, now);
    let generation = shared.qps_generation.load(Ordering::Acquire);
    if generation != st.qps_generation {
        st.qps = shared.live_qps();
        st.qps_generation = generation;
        // Let go of a destroyed QP now (its socket and memory), not at the next datagram.
        st.udp.forget_qps();
        // The new QPs have not been looked at yet.
        shared.work_pending.store(true, Ordering::Release);
    }
    if shared.shm.is_some() {
        did |= shm::receive(shared, &st.qps, &mut st.shm_rx, now);
    }
    // An idle pass (nothing received, posted, or due) need not visit the QPs: that keeps a
    // busy-polling application's loop to one system call.
    // Read before it is cleared: most passes find it clear, and a load is not a locked
    // instruction.
    let pending = shared.work_pending.load(Ordering::Acquire)
        && shared.work_pending.swap(false, Ordering::AcqRel);
    let due = st.next_deadline.is_some_and(|d| d <= now);
    if !did && !pending && !due {
        return false;
    }
    st.next_deadline = None;
    st.next_timer = None;
    let qps = std::mem::take(&mut st.qps);
    // The clock is read again after every step that did work: what the receive and the QPs
    // before one took (a GSO send is tens of µs) would otherwise be counted into its round
    // trips (its packets stamped earlier than they leave), and the delay-based window of a QP
    // late in the order would read the host's work as queueing. Sixteen QPs of one context
    // through one bottleneck got shares from 4 to 13 MB/s so, each by its place.
    let mut now = if did { shared.now() } else { now };
    for qp in &qps {
        if transmit_qp(shared, st, qp, now) {
            did = true;
            now = shared.now();
        }
    }
    st.qps = qps;
    did
}

/// Runs `qp`'s timer if it is due, sends everything `qp` can send now, moves its completions
/// to their CQs, and folds its next deadline (retransmission timer or held ACK) into the
/// engine's. Everything it needs of the QP it takes under the QP's lock, once per batch.
fn transmit_qp(
    shared: &ContextShared,
    st: &mut EngineState,
    qp: &Arc<QpShared>,
    now: Instant,
) -> bool {
    let shm = qp.shm_linked();
    let mut did = false;
    loop {
        let mut k = 0;
        // Over shared memory a packet is only made when the peer's ring has room for it: a
        // packet made and then dropped would wait for the retransmission timer.
        let take = match shm {
            Some(s) => shm::ring_room(shared, qp, s, MAX_DATAGRAM).min(TAKE),
            None => TAKE,
        };
        let app_driving = shared.app_polling_until.load(Ordering::Acquire) > now.as_nanos();
        let recent_request = now
            .as_nanos()
            .saturating_sub(qp.last_request_tx.load(Ordering::Relaxed))
            < PING_PONG_WINDOW.as_nanos() as u64;
        let peer = {
            let mut core = qp.qp.lock();
            let QpCore {
                proto: q,
                peer,
                held_ack,
                mr_cache,
                retired,
                path_rtt_shared_at,
                ..
            } = &mut *core;
            if shm.is_some() && q.congestion_control().algorithm != CcAlgorithm::Off {
                // A ring is this QP's own, lossless, and says when it is full: nothing to
                // share, so no window or pacing (see `ContextOptions::congestion`).
                q.set_congestion_control(CcConfig {
                    algorithm: CcAlgorithm::Off,
                    ..q.congestion_control()
                });
            }
            if shm.is_some() && !q.lossless_path() {
                // Nor does it lose anything: a fast timeout or a tail-loss probe there only
                // resends what a descheduled peer has yet to read.
                q.set_lossless_path(true);
            }
            // QPs to one peer measure queueing against the smallest round trip any of them saw
            // (see `path_rtt`), while they have work in flight.
            if let (Some(min_rtt), Some(p), None) = (q.min_rtt(), *peer, shm) {
                if q.send_queue_len() > 0
                    && path_rtt_shared_at.map_or(true, |t| {
                        now.saturating_since(t) >= super::path_rtt::SHARE_PERIOD
                    })
                {
                    *path_rtt_shared_at = Some(now);
                    let base = shared.path_rtts.share(p, min_rtt, now);
                    q.set_path_min_rtt(Some(base));
                }
            }
            if q.next_timeout().is_some_and(|t| t <= now) {
                q.handle_timeout(now);
            }
            let mut mem = EngineMemory {
                table: &shared.mrs,
                cache: mr_cache,
            };
            while k < take {
                let Some(n) = q.poll_transmit(now, &mut mem, &mut st.tx[k]) else {
                    break;
                };
                st.tx_lens[k] = n;
                k += 1;
            }
            while let Some(wc) = q.poll_completion() {
                st.wcs.push(wc);
            }
            qp.publish_state(q);
            if !st.wcs.is_empty() {
                did = true;
                // Under the QP's lock: a same-host direct operation completes under it too,
                // so completions reach the CQ in posting order.
                route_completions(qp, &mut st.wcs);
            }
            if k == 1
                && shm.is_none()
                && !*retired
                && app_driving
                && recent_request
                && is_plain_ack(&st.tx[0][..st.tx_lens[0]])
            {
                // Hold it; a newer ACK replaces an older one (it acknowledges more).
                let n = st.tx_lens[0];
                let mut bytes = [0u8; 24];
                bytes[..n].copy_from_slice(&st.tx[0][..n]);
                let deadline = held_ack.map_or(now + ACK_DEFER, |h| h.deadline);
                *held_ack = Some(DeferredAck {
                    bytes,
                    len: n,
                    deadline,
                });
                k = 0;
            } else if let Some(h) = *held_ack {
                if (0..k).any(|i| is_plain_ack(&st.tx[i][..st.tx_lens[i]])) {
                    // A newer ACK is in the batch: the held one is redundant.
                    *held_ack = None;
                } else if k > 0 || h.deadline <= now || !app_driving {
                    st.tx[k][..h.len].copy_from_slice(&h.bytes[..h.len]);
                    st.tx_lens[k] = h.len;
                    k += 1;
                    *held_ack = None;
                }
            }
            // What was just made may have armed the retransmission timer; idle passes only
            // look at the QPs when a deadline they know of is due, so make it known.
            // A full ring stops this QP's packets until the peer drains it, and the peer does
            // not say when: look again soon (a READ response or a SEND longer than the ring
            // would otherwise wait for the next unrelated event, or a retransmission timer).
            let ring_full = shm.is_some() && take == 0;
            let timer = q.next_timeout();
            st.next_timer = st.next_timer.into_iter().chain(timer).min();
            st.next_deadline = [
                st.next_deadline,
                timer,
                held_ack.map(|h| h.deadline),
                ring_full.then(|| now + RING_FULL_RETRY),
            ]
            .into_iter()
            .flatten()
            .min();
            *peer
        };
        if k == 0 {
            break;
        }
        did = true;
        let Some(peer) = peer else {
            // A QP sends only after RTR, which sets the peer; nothing to do otherwise.
            break;
        };
        if (0..k).any(|i| is_request(&st.tx[i][..st.tx_lens[i]])) {
            qp.last_request_tx.store(now.as_nanos(), Ordering::Relaxed);
        }
        if let Some(s) = shm {
            shm::ring_send(shared, qp, s, &st.tx[..k], &st.tx_lens[..k]);
            if k < take {
                break;
            }
            continue;
        }
        udp::transmit(shared, qp, peer, &mut st.tx[..k], &st.tx_lens[..k]);
        if k < TAKE {
            break;
        }
    }
    did
}

/// Sends a QP's held ACK now: the QP is being destroyed, and a held ACK left behind would
/// never leave, so the peer would retransmit what this side already took, and fail its request
/// once its retries ran out (an `ibv_rc_pingpong`-style peer whose last SEND is answered just
/// before this side exits).
pub(crate) fn flush_held_ack(shared: &ContextShared, qp: &QpShared) {
    // A pass already under way may still make this QP an ACK: it must not hold it.
    qp.qp.lock().retired = true;
    send_held_ack(shared, qp);
}

/// Runs one engine pass now, waiting for the engine if another thread holds it: what has
/// arrived in the socket and the rings is processed before a QP is moved to ERR.
pub(crate) fn take_arrived(shared: &ContextShared) {
    let mut st = shared.engine.lock().unwrap_or_else(|e| e.into_inner());
    progress(shared, &mut st);
}

/// Sends now what the QP owes its peer — responses and ACKs its transport has made but no
/// pass has sent yet, and a held ACK — before it stops answering (destroyed, or moved to
/// ERR): a program that read a receive completion and then tore its QP down has, on real
/// hardware, long acknowledged that message, and its peer's send must complete.
pub(crate) fn send_owed(shared: &ContextShared, qp: &Arc<QpShared>) {
    {
        let mut st = shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        transmit_qp(shared, &mut st, qp, shared.now());
    }
    send_held_ack(shared, qp);
}

/// Sends the ACK the QP holds back for a response to carry, if any: before the QP goes to ERR,
/// whose peer saw its message complete here and must see it acknowledged too (the program
/// that read the completion and then disconnected has, on real hardware, long ACKed it).
pub(crate) fn send_held_ack(shared: &ContextShared, qp: &QpShared) {
    let (held, peer) = {
        let mut core = qp.qp.lock();
        (core.held_ack.take(), core.peer)
    };
    let (Some(h), Some(peer)) = (held, peer) else {
        return;
    };
    // Only the UDP path holds ACKs; a rare path, so a small allocation is fine.
    let mut bufs = vec![h.bytes[..h.len].to_vec()];
    udp::transmit(shared, qp, peer, &mut bufs, &[h.len]);
}

pub(crate) fn route_completions(qp: &QpShared, wcs: &mut Vec<WorkCompletion>) {
    let is_recv =
        |w: &WorkCompletion| matches!(w.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
    if wcs.iter().all(|w| !is_recv(w)) {
        qp.send_cq.push(wcs);
    } else if wcs.iter().all(is_recv) {
        qp.recv_cq.push(wcs);
    } else {
        let (recv, send): (Vec<WorkCompletion>, Vec<WorkCompletion>) =
            wcs.iter().partition(|w| is_recv(w));
        qp.send_cq.push(&send);
        qp.recv_cq.push(&recv);
    }
    wcs.clear();
}

/// Hands a checked packet to its QP (taking a receive request from the SRQ if it needs one).
/// `from` is the sender's address when the packet came over the network: a connected QP
/// takes packets from its peer's address only (the port may differ: every peer QP sends from
/// its own port). `ce`: the packet arrived marked Congestion Experienced (the QP owes its
/// peer a CNP; see `ferroce_proto::dcqcn`).
pub(crate) fn hand_over(
    shared: &ContextShared,
    now: Instant,
    qp: &QpShared,
    pkt: &RocePacket<&[u8]>,
    bytes: &[u8],
    from: Option<std::net::IpAddr>,
    ce: bool,
) {
    let c = &shared.counters;
    let mut core = qp.qp.lock();
    if let (Some(from), Some(peer)) = (from, core.peer) {
        if peer.ip() != from {
            c.wrong_source.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    let QpCore {
        proto: q, mr_cache, ..
    } = &mut *core;
    if let Some(srq) = &qp.srq {
        // A message that needs a receive request takes one from the SRQ at the moment it is
        // due, so requests are not parked on QPs that do not need them.
        let needs_recv = pkt.info().is_some_and(|i| {
            (i.operation == Operation::Send && i.position.starts_message())
                || (pkt.immdt().is_some()
                    && i.operation == Operation::RdmaWrite
                    && i.position != Position::First)
        });
        if needs_recv && q.recv_queue_len() == 0 && pkt.bth().psn() == q.expected_psn() {
            if let Some(wr) = srq.pop() {
                let _ = q.post_recv(wr);
            }
        }
    }
    let mut mem = EngineMemory {
        table: &shared.mrs,
        cache: mr_cache,
    };
    // The packet was validated above, so the QP parses it; should it not, it is malformed.
    // Every refusal past this point is counted by the QP itself.
    let r = q.handle_packet_ecn(now, &mut mem, bytes, ce);
    if r.is_err() {
        c.malformed.fetch_add(1, Ordering::Relaxed);
    }
    qp.publish_state(q);
}

/// One pass of the engine thread: `(did anything, next deadline, next transport timer)`.
fn engine_pass(shared: &ContextShared) -> (bool, Option<Instant>, Option<Instant>) {
    // The lock may be held by an application thread (a post transmitting inline, a poll):
    // wait for it rather than look again later. Its hold is short (one pass), and the engine
    // thread has nothing else to do: it was woken because the socket or its doorbell has
    // something, and while the lock is held the socket stays readable, so a sleep on it would
    // return at once, again and again — a thread spinning through `ppoll` on a small machine
    // takes the CPU the lock's holder needs to let go (measured: ~20 `ppoll` per message of a
    // WRITE ping-pong whose programs wait on memory, 2 vCPUs).
    let mut st = shared.engine.lock().unwrap_or_else(|e| e.into_inner());
    let did = progress(shared, &mut st);
    (did, st.next_deadline, st.next_timer)
}

/// How soon a QP whose peer's ring was full tries again.
const RING_FULL_RETRY: Duration = Duration::from_micros(20);

/// The engine thread.
pub(crate) fn run(shared: Arc<ContextShared>) {
    let mut last_work = std::time::Instant::now();
    let sock = shared.udp.fd();
    let bell = shared.doorbell_fd.fd();
    let mut fds = Vec::new();
    let mut contention = super::contention::Contention::for_this_thread();
    // Best effort: without it, sleeps for timers end up to 50 µs late.
    os::set_timer_slack(TIMER_SLACK);
    while !shared.shutdown.load(Ordering::Acquire) {
        let now = shared.now();
        if shared.app_polling_until.load(Ordering::Acquire) > now.as_nanos() {
            if shared.hand_back_at_completion && shared.hand_back.missed(now.as_nanos()) {
                // The application got completions and has not polled since: it waits some
                // other way (on memory a peer writes), so this thread takes progress back now.
                shared.app_polling_until.store(0, Ordering::SeqCst);
            } else {
                // Handed over: the application's passes do everything (socket, rings, timers);
                // this thread sleeps on its doorbell and only checks in. It takes no engine
                // lock meanwhile (a poll meeting it would find the engine busy), and peers are
                // not asked to wake it (see `set_sleeping`).
                shared.set_sleeping(true, true);
                // SeqCst, as the store in `set_sleeping` and the swap in `end_hand_over`: an
                // application that ends its hand-over (it armed a CQ to sleep on its channel)
                // either sees this thread asleep and rings, or this load sees the end.
                let until = shared.app_polling_until.load(Ordering::SeqCst);
                let now = shared.now().as_nanos();
                if until > now {
                    // Until the hand-over runs out (a poll extends it; this thread then sleeps
                    // again), and no later than a check-in is due.
                    let left = Duration::from_nanos(until - now).min(APP_POLL_GRACE);
                    let timeout = if shared.hand_back_at_completion {
                        shared.hand_back.check_in_after(now, left)
                    } else {
                        left
                    };
                    let _ = os::wait_readable(&[bell], Some(timeout));
                    contention.slept();
                    shared.set_sleeping(false, false);
                    shared.doorbell_fd.drain();
                    continue;
                }
                shared.set_sleeping(false, false);
            }
        }
        let (did, _, timer) = engine_pass(&shared);
        if did {
            last_work = std::time::Instant::now();
            continue;
        }
        // A transport timer due within SPIN is waited for here, unless others wait for the CPU.
        let timer_near = timer.is_some_and(|d| d.saturating_since(now) < SPIN);
        if (last_work.elapsed() < SPIN || timer_near)
            && contention.may_spin(std::time::Instant::now())
        {
            std::hint::spin_loop();
            continue;
        }
        // About to sleep: announce it, then look once more so that a post racing with the
        // announcement is either seen here or rings the doorbell. A hand-over that begins
        // meanwhile is the application's next poll's to use (it reads the socket itself);
        // sleeping on the socket too costs nothing then, while sleeping without it would stall
        // an application that polls only now and then (one that waits on memory, as perftest
        // does).
        shared.set_sleeping(true, false);
        let (did, deadline, _) = engine_pass(&shared);
        if did {
            shared.set_sleeping(false, false);
            last_work = std::time::Instant::now();
            continue;
        }
        let now = shared.now();
        let timeout = deadline
            .map(|d| d.saturating_since(now))
            .map_or(MAX_SLEEP, |t| t.min(MAX_SLEEP));
        fds.clear();
        fds.push(bell);
        fds.push(sock);
        if let Some(host) = &shared.shm {
            host.wait_fds(&mut fds);
        }
        let _ = os::wait_readable(&fds, Some(timeout));
        contention.slept();
        shared.set_sleeping(false, false);
        shared.doorbell_fd.drain();
    }
}
