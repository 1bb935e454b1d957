//! The UDP provider's engine: the part of ferroce that plays the NIC.
//!
//! One pass of [`progress`] reads every datagram waiting on the context's socket (in
//! `recvmmsg` batches), checks its ICRC, hands it to the QP its destination QPN names, runs the
//! QPs' timers, lets every QP transmit what it can (in `sendmmsg` batches from its own socket),
//! and moves completions to their CQs. Passes run on the engine thread, so one-sided operations
//! are served while the application sleeps, and inline on application threads that poll a CQ
//! or post work (whoever holds the engine lock makes progress).
//!
//! The engine thread spins while traffic flows and for [`SPIN`] after, then sleeps in `poll(2)`
//! on the socket and the doorbell eventfd, until the earliest transport timer and at most
//! [`MAX_SLEEP`]: an idle context wakes 250 times a second and otherwise burns no CPU. While an application thread is driving progress itself, the engine
//! thread stays out of its way and only checks in every millisecond.
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
//!
//! # Receive offload
//! With UDP GRO on, the kernel hands over a run of same-size datagrams as one message, and only
//! a control message says where to cut it; reading that takes `recvmsg`, ~70 ns more than
//! `recvfrom` per look on an empty socket, and a busy-polling application looks all the time.
//! So the socket starts without GRO, every look a `recvfrom`, and the engine asks for GRO the
//! first time one read brings a run that GRO would have coalesced (a bulk transfer); from then
//! on every read is a `recvmsg`. Without GRO the kernel cuts a coalesced arrival into datagrams
//! before queueing it, so no read ever needs the control message it did not take.
//!
//! # ICRC of received packets
//! The ICRC covers the IPv4 Identification field, which a UDP socket never shows its reader. A
//! ferroce sender uses an unconnected socket with DF set, for which Linux sends Identification
//! 0; the receiver verifies assuming 0. Packets from senders that vary the field (kernel rxe)
//! fail that check and are counted as ICRC errors.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferroce_proto::{Instant, WcOpcode, WorkCompletion};
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::opcode::{Operation, Position};
use ferroce_wire::{icrc, RocePacket};

use crate::context::ContextShared;
use crate::mr::EngineMemory;
use crate::qp::{QpCore, QpShared};
use crate::sys::{self, RecvBatch, BATCH, MAX_DATAGRAM};

/// How long the engine thread keeps spinning after the last work before it sleeps.
pub(crate) const SPIN: Duration = Duration::from_micros(50);
/// How often the engine thread checks in while an application thread drives progress: each
/// check-in can preempt a spinning application on a small machine (p99 8 B write latency 13 µs
/// at 1 ms, 4.9 µs at 10 ms on 2 cores), and an application that stops polling hands progress
/// back to the engine within this time.
const APP_POLL_GRACE: Duration = Duration::from_millis(4);
/// How long a positive ACK may wait for a data packet to leave with.
pub(crate) const ACK_DEFER: Duration = Duration::from_micros(20);
/// ACKs are held only on a QP that sent a request this recently (it is in a ping-pong).
const PING_PONG_WINDOW: Duration = Duration::from_micros(50);
/// The engine thread never sleeps longer than this, whatever it waits for: an application
/// that drained the socket before the engine woke leaves it nothing to wake on.
const MAX_SLEEP: Duration = Duration::from_millis(4);
/// The shortest run of packets worth one GSO send.
const GSO_MIN_RUN: usize = 3;
/// The smallest packet worth segmentation offload.
const GSO_MIN_SEGMENT: usize = 512;
/// Packets taken from a QP per batch: one slot of the batch stays free for a held ACK.
const TAKE: usize = BATCH - 1;

/// An ACK held back: its unsealed bytes and when it must leave.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeferredAck {
    bytes: [u8; 24],
    len: usize,
    deadline: Instant,
}

/// Whether the last read brought a run of datagrams that receive offload would have
/// coalesced: [`GSO_MIN_RUN`] or more in a row of one length, at least [`GSO_MIN_SEGMENT`].
fn bulk_arrived(rx: &RecvBatch, n: usize) -> bool {
    let mut run = 0;
    let mut last = 0;
    for i in 0..n {
        let Some((bytes, _, seg)) = rx.get(i) else {
            run = 0;
            continue;
        };
        let len = bytes.len().min(seg);
        run = if len == last { run + 1 } else { 1 };
        last = len;
        if len >= GSO_MIN_SEGMENT && run >= GSO_MIN_RUN {
            return true;
        }
    }
    false
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
    rx: RecvBatch,
    tx: Vec<Vec<u8>>,
    tx_lens: Vec<usize>,
    qps: Vec<Arc<QpShared>>,
    qps_generation: u64,
    wcs: Vec<WorkCompletion>,
    /// The earliest transport timer seen in the last pass.
    next_deadline: Option<Instant>,
    /// Where a packet from a shared-memory ring is copied to be handled.
    shm_rx: Vec<u8>,
    /// When the UDP socket was last read (ns on the context clock).
    udp_polled: u64,
    /// Whether the last read of the socket got anything (the next reads a whole batch).
    rx_more: bool,
    /// The QP the last datagram went to.
    last_qp: LastQp,
    /// Whether UDP GRO was asked for (see "Receive offload" in the module doc).
    gro_asked: bool,
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
            rx: RecvBatch::new(),
            tx: (0..BATCH).map(|_| vec![0u8; MAX_DATAGRAM]).collect(),
            tx_lens: vec![0; BATCH],
            qps: Vec::new(),
            qps_generation: u64::MAX,
            wcs: Vec::new(),
            next_deadline: None,
            shm_rx: vec![0u8; MAX_DATAGRAM],
            udp_polled: 0,
            rx_more: false,
            last_qp: LastQp::default(),
            gro_asked: false,
        }
    }
}

impl ContextShared {
    pub(crate) fn now(&self) -> Instant {
        Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    /// Drives progress from an application thread if the engine is free.
    pub(crate) fn progress_inline(&self) -> bool {
        let now = self.now();
        self.app_polling_until
            .store((now + APP_POLL_GRACE).as_nanos(), Ordering::Release);
        match self.engine.try_lock() {
            Ok(mut st) => progress_at(self, &mut st, now),
            Err(_) => false,
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

/// How often the UDP socket is read while every QP of the context is linked over shared memory.
const SHM_ONLY_UDP_POLL: Duration = Duration::from_micros(100);

/// Most receive batches one engine pass takes before it serves the QPs.
const MAX_RECV_BATCHES_PER_PASS: usize = 16;

/// One pass of the engine. Returns whether anything happened.
pub(crate) fn progress(shared: &ContextShared, st: &mut EngineState) -> bool {
    progress_at(shared, st, shared.now())
}

/// One pass of the engine at `now` (a caller that just read the clock saves a second read).
fn progress_at(shared: &ContextShared, st: &mut EngineState, now: Instant) -> bool {
    let mut did = false;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&shared.socket);
    // When every QP is linked over shared memory, the socket carries only strays: look at it
    // every SHM_ONLY_UDP_POLL, not in every pass (each look is a system call, paid in every
    // empty CQ poll of a busy-polling application).
    let udp_due = st.qps.is_empty()
        || st.qps.iter().any(|q| q.shm_linked().is_none())
        || now.as_nanos().saturating_sub(st.udp_polled) >= SHM_ONLY_UDP_POLL.as_nanos() as u64;
    let batches = if udp_due {
        st.udp_polled = now.as_nanos();
        MAX_RECV_BATCHES_PER_PASS
    } else {
        0
    };
    // A flood (or a hostile sender) must not keep a pass receiving forever: after this many
    // batches the QPs get their turn (timers, sends, ACKs), and the next pass reads on.
    for _batch in 0..batches {
        // A receive error on a UDP socket (an ICMP error from an earlier send) is not ours
        // to handle: the transport's retransmission covers whatever it cost.
        // A socket that was empty at the last look most likely holds one datagram now (a
        // ping-pong's): asking for one returns with it at once, where a batch read would first
        // try for a second and find the queue empty. After a datagram, read whole batches.
        let asked = if st.rx_more { BATCH } else { 1 };
        let n = st.rx.recv(fd, asked).unwrap_or_default();
        st.rx_more = n > 0;
        if n == 0 {
            break;
        }
        did = true;
        for i in 0..n {
            if let Some((bytes, from, seg)) = st.rx.get(i) {
                if bytes.is_empty() {
                    // An empty datagram: `chunks` would yield nothing, leaving it uncounted.
                    deliver(shared, &mut st.last_qp, now, bytes, from);
                }
                // GRO hands several same-size datagrams over as one message.
                for datagram in bytes.chunks(seg.max(1)) {
                    deliver(shared, &mut st.last_qp, now, datagram, from);
                }
            } else {
                // A sender address of a family the socket cannot have: nothing to answer.
                let c = &shared.counters;
                c.rx_packets.fetch_add(1, Ordering::Relaxed);
                c.malformed.fetch_add(1, Ordering::Relaxed);
            }
        }
        if n > 1 && !st.gro_asked && shared.gro_allowed && bulk_arrived(&st.rx, n) {
            st.gro_asked = true;
            st.rx.enable_coalescing(fd);
        }
        // A lone datagram taken after an empty look is most likely what an application
        // waits for: it goes to its QP now, and the batch read that follows waits for the
        // next pass (here it cost a system call between the arrival and the application).
        if n < asked || asked == 1 {
            break;
        }
    }
    let generation = shared.qps_generation.load(Ordering::Acquire);
    if generation != st.qps_generation {
        st.qps = shared.live_qps();
        st.qps_generation = generation;
        // Let go of a destroyed QP now (its socket and memory), not at the next datagram.
        st.last_qp = LastQp::default();
        // The new QPs have not been looked at yet.
        shared.work_pending.store(true, Ordering::Release);
    }
    if shared.shm.is_some() {
        did |= shm_receive(shared, st, now);
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
    let qps = std::mem::take(&mut st.qps);
    for qp in &qps {
        did |= transmit_qp(shared, st, qp, now);
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
            Some(s) => match &*s.lock() {
                crate::shm::Link::Linked(p) => p.ring().room_for(MAX_DATAGRAM).min(TAKE),
                _ => 0,
            },
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
                ..
            } = &mut *core;
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
            st.next_deadline = [
                st.next_deadline,
                q.next_timeout(),
                held_ack.map(|h| h.deadline),
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
            ring_send(shared, s, &st.tx[..k], &st.tx_lens[..k]);
            if k < take {
                break;
            }
            continue;
        }
        let src = SocketAddr::new(shared.local.ip(), qp.src_port);
        let mut h = UdpFrameHeaders::roce(src.ip(), src.port(), peer.ip());
        h.dst_port = peer.port();
        for i in 0..k {
            let n = st.tx_lens[i];
            let buf = &mut st.tx[i][..n];
            if let Ok(hdrs) = h.icrc_headers(n) {
                if let Ok(crc) = icrc::compute(hdrs.ip(), hdrs.udp(), &buf[..n - 4]) {
                    RocePacket::new_unchecked(&mut buf[..]).set_icrc(crc);
                }
            }
            if let Some(c) = &shared.capture {
                c.record(src, peer, buf);
            }
        }
        let bytes: usize = st.tx_lens[..k].iter().sum();
        match send_all(shared, qp.send_fd(), &peer, &st.tx[..k], &st.tx_lens[..k]) {
            Ok(sent) => {
                shared
                    .counters
                    .tx_packets
                    .fetch_add(sent as u64, Ordering::Relaxed);
                shared
                    .counters
                    .tx_bytes
                    .fetch_add(bytes as u64, Ordering::Relaxed);
                if sent < k {
                    // The rest is recovered by the transport's retransmission, like a drop.
                    shared.counters.send_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(_) => {
                shared.counters.send_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        if k < TAKE {
            break;
        }
    }
    did
}

/// Puts packets into a linked peer's ring (room was checked before they were made) and wakes
/// its engine if it sleeps. The ring is not a network: no ICRC is computed or checked.
fn ring_send(shared: &ContextShared, shm: &crate::shm::ShmQp, bufs: &[Vec<u8>], lens: &[usize]) {
    let link = shm.lock();
    let crate::shm::Link::Linked(peer) = &*link else {
        return;
    };
    let ring = peer.ring();
    let mut bytes = 0;
    let mut sent = 0;
    for (b, &n) in bufs.iter().zip(lens) {
        if ring.push(&b[..n]) {
            sent += 1;
            bytes += n;
        } else {
            // Cannot happen (room was checked); the transport's retransmission would cover it.
            shared.counters.send_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    let c = &shared.counters;
    c.tx_packets.fetch_add(sent, Ordering::Relaxed);
    c.tx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    peer.wake();
}

/// Most packets one pass takes from one QP's ring, so one busy QP cannot starve the rest.
const SHM_RX_PER_QP: usize = 256;

/// Serves the shared-memory side: hello connections (new links, wake-ups, peers that went
/// away) and the inbound rings of linked QPs. Returns whether anything arrived.
fn shm_receive(shared: &ContextShared, st: &mut EngineState, now: Instant) -> bool {
    let mut did = shared.poll_shm_host(now, false);
    for qp in &st.qps {
        let Some(s) = qp.shm_linked() else { continue };
        let ring = s.page.ring();
        for _ in 0..SHM_RX_PER_QP {
            match ring.pop(&mut st.shm_rx) {
                Ok(Some(n)) => {
                    did = true;
                    let c = &shared.counters;
                    c.rx_packets.fetch_add(1, Ordering::Relaxed);
                    c.rx_bytes.fetch_add(n as u64, Ordering::Relaxed);
                    match RocePacket::new_checked(&st.shm_rx[..n]) {
                        Ok(pkt) => hand_over(shared, now, qp, &pkt, &st.shm_rx[..n], None),
                        Err(_) => {
                            c.malformed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    // The peer broke the ring: nothing more from it can be trusted.
                    shared.counters.malformed.fetch_add(1, Ordering::Relaxed);
                    peer_gone(qp);
                    did = true;
                    break;
                }
            }
        }
    }
    if did {
        shared.work_pending.store(true, Ordering::Release);
    }
    did
}

/// A linked peer went away (or broke the ring): the QP goes to ERR, flushing its work; the
/// completions leave in this pass's transmit step.
pub(crate) fn peer_gone(qp: &QpShared) {
    if let Some(s) = &qp.shm {
        s.linked.store(false, Ordering::Release);
        *s.lock() = crate::shm::Link::Broken;
    }
    let mut q = qp.qp.lock();
    q.modify_to_error();
    q.peer_memory = None;
    qp.publish_state(&q);
}

/// Sends the packets in order to `dest`: runs of equal-size packets with one GSO send each
/// (where the kernel has UDP segmentation offload), the others with `sendmmsg`.
fn send_all(
    shared: &ContextShared,
    fd: std::os::fd::RawFd,
    dest: &SocketAddr,
    bufs: &[Vec<u8>],
    lens: &[usize],
) -> std::io::Result<usize> {
    let k = lens.len();
    if !shared.gso.load(Ordering::Relaxed) {
        return sys::send_batch(fd, bufs, lens, dest);
    }
    let mut i = 0;
    let mut sent = 0;
    while i < k {
        // Segmentation offload pays for runs of large packets (a WRITE or READ stream); a few
        // small ones (a ping-pong's request and ACK) go faster through sendmmsg.
        let run = sys::gso_run(&lens[i..k]);
        if run >= GSO_MIN_RUN && lens[i] >= GSO_MIN_SEGMENT {
            match sys::send_gso(fd, &bufs[i..i + run], &lens[i..i + run], dest) {
                Ok(n) => sent += n,
                Err(e) => {
                    // No GSO here (or not for this socket): fall back for good. A passing
                    // condition (no route during a link flap, a full queue) is no reason to.
                    let unsupported = matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL | libc::EIO | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                    );
                    if unsupported {
                        shared.gso.store(false, Ordering::Relaxed);
                    }
                    sent += sys::send_batch(fd, &bufs[i..i + run], &lens[i..i + run], dest)?;
                }
            }
            i += run;
        } else {
            let mut j = i + 1;
            while j < k && !(sys::gso_run(&lens[j..k]) >= GSO_MIN_RUN && lens[j] >= GSO_MIN_SEGMENT)
            {
                j += 1;
            }
            sent += sys::send_batch(fd, &bufs[i..j], &lens[i..j], dest)?;
            i = j;
        }
    }
    Ok(sent)
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

/// Checks one datagram and hands it to its QP.
fn deliver(
    shared: &ContextShared,
    last_qp: &mut LastQp,
    now: Instant,
    bytes: &[u8],
    from: SocketAddr,
) {
    let c = &shared.counters;
    c.rx_packets.fetch_add(1, Ordering::Relaxed);
    c.rx_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    let Ok(pkt) = RocePacket::new_checked(bytes) else {
        c.malformed.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let mut h = UdpFrameHeaders::roce(from.ip(), from.port(), shared.local.ip());
    h.dst_port = shared.local.port();
    let ok = h
        .icrc_headers(bytes.len())
        .ok()
        .and_then(|hdrs| icrc::verify(hdrs.ip(), hdrs.udp(), pkt.covered(), pkt.icrc()).ok())
        .unwrap_or(false);
    if let Some(cap) = &shared.capture {
        cap.record(from, shared.local, bytes);
    }
    if !ok {
        c.icrc_errors.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let qpn = pkt.bth().dest_qpn();
    let Some(qp) = last_qp.get(shared, qpn) else {
        c.unknown_qpn.fetch_add(1, Ordering::Relaxed);
        return;
    };
    hand_over(shared, now, qp, &pkt, bytes, Some(from.ip()));
}

/// The QP the last datagram went to, kept while the context's set of QPs is unchanged: a
/// stream or a ping-pong finds its QP without the table's lock or a reference count.
#[derive(Debug, Default)]
pub(crate) struct LastQp {
    /// `qps_generation` when `qp` was looked up.
    generation: u64,
    qp: Option<Arc<QpShared>>,
}

impl LastQp {
    fn get(&mut self, shared: &ContextShared, qpn: u32) -> Option<&Arc<QpShared>> {
        let generation = shared.qps_generation.load(Ordering::Acquire);
        let hit = generation == self.generation && self.qp.as_ref().is_some_and(|q| q.qpn == qpn);
        if !hit {
            // The generation is read before the lookup: a QP destroyed after it moves the
            // generation on, and the next packet looks again.
            self.qp = shared.qp(qpn);
            self.generation = generation;
        }
        self.qp.as_ref()
    }
}

/// Hands a checked packet to its QP (taking a receive request from the SRQ if it needs one).
/// `from` is the sender's address when the packet came over the network: a connected QP
/// takes packets from its peer's address only (the port may differ: every peer QP sends from
/// its own port).
fn hand_over(
    shared: &ContextShared,
    now: Instant,
    qp: &QpShared,
    pkt: &RocePacket<&[u8]>,
    bytes: &[u8],
    from: Option<std::net::IpAddr>,
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
    let r = q.handle_packet(now, &mut mem, bytes);
    if r.is_err() {
        c.malformed.fetch_add(1, Ordering::Relaxed);
    }
    qp.publish_state(q);
}

/// One pass if the engine is free and no application thread is driving progress (its own
/// passes run the timers and release held ACKs; the engine steps in [`APP_POLL_GRACE`] after it
/// stops); `(did anything, next deadline)`. A busy engine lock means someone else is making
/// progress: look again shortly.
fn engine_pass(shared: &ContextShared, app_driving: bool) -> (bool, Option<Instant>) {
    let now = shared.now();
    match shared.engine.try_lock() {
        Ok(mut st) => {
            let did = !app_driving && progress(shared, &mut st);
            (did, st.next_deadline)
        }
        Err(_) => (false, Some(now + BUSY_RECHECK)),
    }
}

/// How soon the engine thread looks again when it found the engine lock taken.
const BUSY_RECHECK: Duration = Duration::from_micros(100);

/// The engine thread.
pub(crate) fn run(shared: Arc<ContextShared>) {
    let mut last_work = std::time::Instant::now();
    let sock = std::os::fd::AsRawFd::as_raw_fd(&shared.socket);
    let bell = shared.doorbell_fd.fd();
    let mut fds = Vec::new();
    while !shared.shutdown.load(Ordering::Acquire) {
        let app_driving =
            shared.app_polling_until.load(Ordering::Acquire) > shared.now().as_nanos();
        let (did, _) = engine_pass(&shared, app_driving);
        if did {
            last_work = std::time::Instant::now();
            continue;
        }
        if !app_driving && last_work.elapsed() < SPIN {
            std::hint::spin_loop();
            continue;
        }
        // About to sleep: announce it, then look once more so that a post racing with the
        // announcement is either seen here or rings the doorbell.
        shared.set_sleeping(true);
        let (did, deadline) = engine_pass(&shared, app_driving);
        if did {
            shared.set_sleeping(false);
            last_work = std::time::Instant::now();
            continue;
        }
        let now = shared.now();
        let until_deadline = deadline.map(|d| d.saturating_since(now));
        // While an application drives progress, its passes handle deadlines; waking for them
        // here would only preempt it.
        let timeout = Some(if app_driving {
            APP_POLL_GRACE
        } else {
            until_deadline.map_or(MAX_SLEEP, |t| t.min(MAX_SLEEP))
        });
        fds.clear();
        fds.push(bell);
        if !app_driving {
            fds.push(sock);
            if let Some(host) = &shared.shm {
                host.wait_fds(&mut fds);
            }
        }
        let _ = sys::wait_readable(&fds, timeout);
        shared.set_sleeping(false);
        shared.doorbell_fd.drain();
    }
}
