//! The RoCE v2 over UDP provider: real packets on a real network.
//!
//! A context has one socket bound to its RoCE address (port 4791 by default) on which every
//! packet for any of its QPs arrives; each QP sends from a socket of its own, whose port is the
//! QP's UDP source port (RoCE v2's ECMP entropy). The engine hands this provider a batch of one
//! QP's packets to seal and send ([`transmit`]), and calls [`receive`] once per pass to read
//! what arrived and hand it back ([`engine::hand_over`]).
//!
//! # Receive offload
//! With UDP GRO on, the kernel hands over a run of same-size datagrams as one message, and only
//! a control message says where to cut it; reading that takes `recvmsg`, ~70 ns more than
//! `recvfrom` per look on an empty socket, and a busy-polling application looks all the time.
//! So the socket starts without GRO, every look a `recvfrom`, and the provider asks for GRO the
//! first time one read brings a run that GRO would have coalesced (a bulk transfer); from then
//! on every read is a `recvmsg`. Without GRO the kernel cuts a coalesced arrival into datagrams
//! before queueing it, so no read ever needs the control message it did not take.
//!
//! # ECN marks
//! Packets leave ECT(0) (see [`socket`]); a packet whose TOS says Congestion Experienced is
//! handed to its QP as marked, which owes its peer a CNP
//! ([`ferroce_proto::QueuePair::handle_packet_ecn`]). The TOS comes as a control message, once
//! the socket has IP_RECVTOS on, and only to reads that take control messages. Taking them on
//! single reads (`recvmsg` for `recvfrom`, on every look of a busy-polling application) cost
//! 0.3 to 0.6 µs of the one-way latency of a 4 KiB ping-pong (`ferroce perf write_lat
//! --loopback --provider udp`, medians of interleaved runs). So:
//! - IP_RECVTOS is turned on with the first bulk datagram (below), and stays on: until then
//!   the kernel need not put a control message (or its truncation) on every datagram;
//! - batch reads (`recvmmsg`, every read after one that brought something) and every read of a
//!   coalescing socket (`recvmsg`) take the TOS anyway;
//! - single reads take it while bulk traffic flows in: from a datagram of data size (at least
//!   [`GSO_MIN_SEGMENT`] bytes: only WRITE, SEND and READ-response packets are that large)
//!   for a QP that is not in a ping-pong (it sent no request within the engine's
//!   `PING_PONG_WINDOW`), until a datagram that is not;
//! - otherwise a read sees no TOS, and its datagram counts as unmarked.
//!
//! A queue builds only under bulk traffic, which has large packets; it arrives in batches, or,
//! spaced out by a slow bottleneck so that every read finds one datagram alone, as a stream
//! to a QP that sends no requests of its own: either way every datagram that can carry a
//! meaningful mark is read with its TOS after the first. A ping-pong keeps `recvfrom`, at any
//! message size. What goes unread: the first datagram of a stream, and streams in both
//! directions at once spaced out so that no read finds two datagrams (each side sends
//! requests); the notification point answers at most one mark per 50 µs anyway.
//!
//! # Send offload
//! A run of [`GSO_MIN_RUN`] or more equal-size packets of at least [`GSO_MIN_SEGMENT`] bytes
//! (a WRITE or READ stream) leaves with one UDP GSO send; the rest with `sendmmsg`.
//!
//! # ICRC and the IPv4 Identification
//! The ICRC covers the IPv4 Identification field, which a UDP socket never shows its reader.
//! - **Receiving.** A packet is verified assuming Identification 0 (what ferroce and any sender
//!   on an unconnected DF socket use for a lone datagram); one that fails is checked again for
//!   the one Identification that would make it verify, solved from its ICRC
//!   (`ferroce_wire::icrc::verify_any_ipv4_identification`, ~25 ns more, no search). Kernel rxe
//!   numbers its packets, and a GSO segment carries its place in the send: both verify this
//!   way and are counted apart (`icrc_ident_solved`). Such a packet is checked by the 16 bits
//!   of the ICRC that the Identification cannot explain (a random corruption passes with
//!   probability 2^-16, where a packet verified with 0 is checked by all 32); every single-bit
//!   error is still caught, since no Identification explains one within a RoCE packet.
//! - **Sending.** Every packet is sealed for the Identification it will leave with: 0 for a
//!   datagram sent alone, its place in the run for a segment of a GSO send (see [`send_all`]),
//!   so every packet on the wire verifies for any receiver (rxe drops those that do not). A GSO
//!   send carries at most `GSO_MAX_SEGMENTS` (64) segments, so no packet ferroce sends has an
//!   Identification of [`SENT_IDENTIFICATION_LIMIT`] or more.
//! - **Between ferroce peers.** A QP whose peer is known to send that way (the connection
//!   exchange says so: `EndpointInfo::small_identifications`, set on the QP by
//!   `QueuePair::connect`) accepts a solved Identification only below that limit, and counts
//!   any other as an ICRC error. Of the 2^16 Identifications that could explain a difference,
//!   64 are then believed: such a packet is checked by 32 - 6 = 26 bits (a random corruption
//!   passes with probability 2^-26). A QP brought up without the exchange (plain
//!   `modify_to_rtr`, the drop-in libibverbs, a perftest or rxe peer) keeps the 16-bit rule:
//!   nothing says its peer does not number its packets. So does a UD QP, which has no one
//!   peer.
//! - **Strict.** A context opened with `ContextOptions::icrc_strict` (`FERROCE_ICRC_STRICT=1`)
//!   accepts no solved Identification at all: every packet it takes is checked by all 32
//!   bits. It refuses, as ICRC errors, every packet that left with a non-zero Identification:
//!   from Linux rxe (which numbers every packet) and from any sender that uses a connected
//!   socket or cuts GSO sends — including a ferroce peer that is not strict itself, whose GSO
//!   segments after the first of each send are refused (bulk data it sends to a strict
//!   context, its WRITEs and SENDs or its responses to that context's READs, then crawls on
//!   retransmissions). A strict context therefore sends without GSO
//!   (as with `FERROCE_NO_GSO`), so that its own packets all leave with Identification 0 and
//!   two strict contexts talk at full strength, at the price of one system call per 32
//!   packets instead of per 64 KiB on bulk sends.

mod capture;
mod socket;
mod sys;

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferroce_proto::Instant;
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::icrc::{self, IcrcCheck};
use ferroce_wire::RocePacket;

use self::capture::Capture;
use self::sys::RecvBatch;
pub(crate) use self::sys::{BATCH, MAX_DATAGRAM};
use super::engine::hand_over;
use super::Ecn;
use crate::error::{Error, Result};
use crate::provider::{ContextShared, QpShared};

/// Every IPv4 Identification a packet sent by ferroce leaves with is below this: 0 for a
/// datagram sent alone, its place in the run (below `GSO_MAX_SEGMENTS`) for a segment of a GSO
/// send. A receiver that knows its peer is ferroce believes no other solved Identification
/// (see "ICRC and the IPv4 Identification").
pub const SENT_IDENTIFICATION_LIMIT: u16 = sys::GSO_MAX_SEGMENTS as u16;
const _: () = assert!(sys::GSO_MAX_SEGMENTS <= u16::MAX as usize);

/// A context's side of the UDP provider: the socket every packet arrives on, and how sending
/// goes.
#[derive(Debug)]
pub(crate) struct UdpPort {
    pub socket: UdpSocket,
    /// `FERROCE_PCAP`: every packet sent or received, as frames.
    pub capture: Option<Capture>,
    /// Whether UDP segmentation offload works for sending (cleared on the first refusal).
    pub gso: AtomicBool,
    /// Whether the receiver may ask for UDP GRO once bulk traffic arrives (see "Receive
    /// offload"); `FERROCE_NO_GRO` says no.
    pub gro_allowed: bool,
    /// The TOS byte every packet of the context leaves with (its QPs' sockets are bound
    /// with it; see [`Ecn::tos`]).
    pub tos: u8,
    /// Whether the ECN marks of arriving packets are read (see "ECN marks").
    pub reads_marks: bool,
}

impl UdpPort {
    /// Binds the context's RoCE socket to `addr` (port 0: any free one), non-blocking, with
    /// ECN as `ecn` says, and opens the capture file if one is asked for.
    pub(crate) fn open(addr: SocketAddr, capture: Option<&Path>, ecn: Ecn) -> Result<UdpPort> {
        let socket = socket::bind(addr, 8 << 20, ecn.tos())
            .map_err(|e| Error::io(format!("binding the RoCE socket to {addr}"), e))?;
        socket
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the RoCE socket non-blocking", e))?;
        Ok(UdpPort {
            socket,
            capture: capture.map(Capture::create).transpose()?,
            gso: AtomicBool::new(std::env::var_os("FERROCE_NO_GSO").is_none()),
            gro_allowed: std::env::var_os("FERROCE_NO_GRO").is_none(),
            tos: ecn.tos(),
            reads_marks: ecn.reads_marks(),
        })
    }

    /// The address the socket is bound to.
    pub(crate) fn local_addr(&self) -> Result<SocketAddr> {
        self.socket
            .local_addr()
            .map_err(|e| Error::io("reading the RoCE socket's address", e))
    }

    /// The descriptor the engine thread sleeps on.
    pub(crate) fn fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    /// Writes out what the capture holds.
    pub(crate) fn flush(&self) {
        if let Some(c) = &self.capture {
            c.flush();
        }
    }
}

/// A QP's side of the UDP provider: the socket it sends from, so each QP has its own UDP
/// source port.
#[derive(Debug)]
pub(crate) struct QpSocket {
    socket: UdpSocket,
    /// The socket's port: the QP's UDP source port.
    pub port: u16,
}

impl QpSocket {
    /// Binds a sending socket on `ip`, any free port, whose datagrams leave with the TOS byte
    /// `tos` (the context's, [`UdpPort::tos`]). It stays unconnected, though it sends only to
    /// the QP's peer: Linux gives datagrams with DF set from a connected socket an incrementing
    /// IPv4 Identification, and the ICRC covers that field.
    pub(crate) fn open(ip: IpAddr, tos: u8) -> Result<QpSocket> {
        let socket = socket::bind(SocketAddr::new(ip, 0), 4 << 20, tos)
            .map_err(|e| Error::io("binding the QP's sending socket", e))?;
        let port = socket
            .local_addr()
            .map_err(|e| Error::io("reading the QP's port", e))?
            .port();
        Ok(QpSocket { socket, port })
    }

    fn fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

/// How often the socket is read while every QP of the context is linked over shared memory.
const SHM_ONLY_UDP_POLL: Duration = Duration::from_micros(100);

/// Most receive batches one engine pass takes before it serves the QPs.
const MAX_RECV_BATCHES_PER_PASS: usize = 16;

/// The receive side's buffers and memory across passes (the engine keeps it).
pub(crate) struct UdpReceiver {
    rx: RecvBatch,
    /// When the socket was last read (ns on the context clock).
    polled: u64,
    /// Whether the last read of the socket got anything (the next reads a whole batch).
    more: bool,
    /// The QP the last datagram went to.
    last_qp: LastQp,
    /// Whether UDP GRO was asked for (see "Receive offload").
    gro_asked: bool,
    /// Whether IP_RECVTOS was asked for (see "ECN marks").
    tos_asked: bool,
}

/// Whether a TOS byte's ECN field says Congestion Experienced.
fn congestion_experienced(tos: Option<u8>) -> bool {
    tos.is_some_and(|t| t & 0b11 == 0b11)
}

impl UdpReceiver {
    pub(crate) fn new() -> UdpReceiver {
        UdpReceiver {
            rx: RecvBatch::new(),
            polled: 0,
            more: false,
            last_qp: LastQp::default(),
            gro_asked: false,
            tos_asked: false,
        }
    }

    /// Lets go of the QP it remembers (the context's set of QPs changed): a destroyed QP's
    /// socket and memory go now, not at the next datagram.
    pub(crate) fn forget_qps(&mut self) {
        self.last_qp = LastQp::default();
    }
}

/// Reads what waits on the context's socket and hands every packet that checks out to its QP
/// (in every pass while `socket_in_use`: some QP of the context is on UDP, see `progress_at`).
/// Returns whether anything arrived.
pub(crate) fn receive(
    shared: &ContextShared,
    r: &mut UdpReceiver,
    socket_in_use: bool,
    now: Instant,
) -> bool {
    let mut did = false;
    let fd = shared.udp.fd();
    // When every QP is linked over shared memory, the socket carries only strays: look at it
    // every SHM_ONLY_UDP_POLL, not in every pass (each look is a system call, paid in every
    // empty CQ poll of a busy-polling application).
    let due = socket_in_use
        || now.as_nanos().saturating_sub(r.polled) >= SHM_ONLY_UDP_POLL.as_nanos() as u64;
    if !due {
        return false;
    }
    r.polled = now.as_nanos();
    // A flood (or a hostile sender) must not keep a pass receiving forever: after this many
    // batches the QPs get their turn (timers, sends, ACKs), and the next pass reads on.
    for batch in 0..MAX_RECV_BATCHES_PER_PASS {
        // Each batch at the time it is read: the time an ACK is handled ends a round trip.
        let now = if batch == 0 { now } else { shared.now() };
        // A receive error on a UDP socket (an ICMP error from an earlier send) is not ours
        // to handle: the transport's retransmission covers whatever it cost.
        // A socket that was empty at the last look most likely holds one datagram now (a
        // ping-pong's): asking for one returns with it at once, where a batch read would first
        // try for a second and find the queue empty. After a datagram, read whole batches.
        let asked = if r.more { BATCH } else { 1 };
        let n = r.rx.recv(fd, asked).unwrap_or_default();
        r.more = n > 0;
        if n == 0 {
            break;
        }
        did = true;
        for i in 0..n {
            if let Some((bytes, from, seg)) = r.rx.get(i) {
                // One TOS for every datagram of a coalesced message: GRO merges only datagrams
                // whose TOS agree.
                let tos = r.rx.tos(i);
                if bytes.is_empty() {
                    // An empty datagram: `chunks` would yield nothing, leaving it uncounted.
                    deliver(shared, &mut r.last_qp, now, bytes, from, tos);
                }
                // GRO hands several same-size datagrams over as one message.
                for datagram in bytes.chunks(seg.max(1)) {
                    deliver(shared, &mut r.last_qp, now, datagram, from, tos);
                }
                if shared.udp.reads_marks {
                    // Bulk traffic flows in: reads take the TOS (see "ECN marks").
                    let bulk = seg >= GSO_MIN_SEGMENT && !r.last_qp.in_ping_pong(now);
                    if bulk && !r.tos_asked {
                        r.tos_asked = true;
                        // A kernel that refuses leaves every packet unmarked.
                        socket::receive_tos(fd, shared.local.is_ipv6());
                    }
                    r.rx.set_control(bulk);
                }
            } else {
                // A sender address of a family the socket cannot have: nothing to answer.
                let c = &shared.counters;
                c.rx_packets.fetch_add(1, Ordering::Relaxed);
                c.malformed.fetch_add(1, Ordering::Relaxed);
            }
        }
        if n > 1 && !r.gro_asked && shared.udp.gro_allowed && bulk_arrived(&r.rx, n) {
            r.gro_asked = true;
            r.rx.enable_coalescing(fd);
        }
        // A lone datagram taken after an empty look is most likely what an application
        // waits for: it goes to its QP now, and the batch read that follows waits for the
        // next pass (here it cost a system call between the arrival and the application).
        if n < asked || asked == 1 {
            break;
        }
    }
    did
}

/// Sends `k` packets of `qp` in order to `peer` from the QP's own socket, each sealed (its ICRC
/// computed) for the IPv4 Identification it leaves with, records them in the capture as they
/// left, and counts what left.
pub(crate) fn transmit(
    shared: &ContextShared,
    qp: &QpShared,
    peer: SocketAddr,
    bufs: &mut [Vec<u8>],
    lens: &[usize],
) {
    let src = SocketAddr::new(shared.local.ip(), qp.udp.port);
    let mut h = UdpFrameHeaders::roce(src.ip(), src.port(), peer.ip());
    h.dst_port = peer.port();
    h.tos = shared.udp.tos;
    let k = lens.len();
    let bytes: usize = lens.iter().sum();
    let c = &shared.counters;
    match send_all(shared, qp.udp.fd(), &mut h, bufs, lens) {
        Ok(sent) => {
            c.tx_packets.fetch_add(sent as u64, Ordering::Relaxed);
            c.tx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            if sent < k {
                // The rest is recovered by the transport's retransmission, like a drop.
                c.send_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        Err(_) => {
            c.send_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Sends one packet of a UD QP from its socket `from` to `peer`: sealed, recorded in the
/// capture, counted. A datagram that cannot leave is lost, as UD allows (counted as a send
/// error).
pub(crate) fn send_datagram(
    shared: &ContextShared,
    from: &QpSocket,
    peer: SocketAddr,
    buf: &mut Vec<u8>,
) {
    let mut h = UdpFrameHeaders::roce(shared.local.ip(), from.port, peer.ip());
    h.dst_port = peer.port();
    h.tos = shared.udp.tos;
    let lens = [buf.len()];
    let bufs = std::slice::from_mut(buf);
    seal(&mut h, bufs, &lens, false);
    record(shared, &mut h, bufs, &lens, false);
    let c = &shared.counters;
    match sys::send_batch(from.fd(), bufs, &lens, &peer) {
        Ok(1) => {
            c.tx_packets.fetch_add(1, Ordering::Relaxed);
            c.tx_bytes.fetch_add(lens[0] as u64, Ordering::Relaxed);
        }
        _ => {
            c.send_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Checks one datagram and hands it to its QP; `tos` is the TOS byte it arrived with, if the
/// read took it.
fn deliver(
    shared: &ContextShared,
    last_qp: &mut LastQp,
    now: Instant,
    bytes: &[u8],
    from: SocketAddr,
    tos: Option<u8>,
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
    // The capture shows the TOS it arrived with where the read took it (else 0); the ICRC
    // masks it either way.
    h.tos = tos.unwrap_or(0);
    let check = h
        .icrc_headers(bytes.len())
        .ok()
        .and_then(|hdrs| {
            icrc::verify_any_ipv4_identification(hdrs.ip(), hdrs.udp(), pkt.covered(), pkt.icrc())
                .ok()
        })
        .unwrap_or(IcrcCheck::Bad);
    let qpn = pkt.bth().dest_qpn();
    let ud = pkt.opcode().transport_bits() == ferroce_wire::opcode::Transport::Ud;
    let ok = match check {
        IcrcCheck::Verified => true,
        IcrcCheck::VerifiedWithIdentification(ident) => {
            h.ident = ident;
            // Which solutions are believed (see "ICRC and the IPv4 Identification"). The QP
            // is looked up only for an Identification no ferroce sender uses, and then it is
            // the lookup delivery makes anyway (`last_qp` keeps it). A UD QP has no one peer.
            let believed = !shared.icrc_strict
                && (ident < SENT_IDENTIFICATION_LIMIT
                    || ud
                    || !last_qp
                        .get(shared, qpn)
                        .is_some_and(|qp| qp.peer_small_identifications.load(Ordering::Relaxed)));
            if believed {
                c.icrc_ident_solved.fetch_add(1, Ordering::Relaxed);
            }
            believed
        }
        IcrcCheck::Bad => false,
    };
    if !ok {
        c.icrc_errors.fetch_add(1, Ordering::Relaxed);
    }
    if let Some(cap) = &shared.udp.capture {
        cap.record(&h, bytes);
    }
    if !ok {
        return;
    }
    if ud {
        if !crate::provider::receive_datagram(shared, &pkt, from.ip()) {
            c.unknown_qpn.fetch_add(1, Ordering::Relaxed);
        }
        return;
    }
    let Some(qp) = last_qp.get(shared, qpn) else {
        c.unknown_qpn.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let ce = shared.udp.reads_marks && congestion_experienced(tos);
    hand_over(shared, now, qp, &pkt, bytes, Some(from.ip()), ce);
}

/// The QP the last datagram went to, kept while the context's set of QPs is unchanged: a
/// stream or a ping-pong finds its QP without the table's lock or a reference count.
#[derive(Debug, Default)]
struct LastQp {
    /// `qps_generation` when `qp` was looked up.
    generation: u64,
    qp: Option<Arc<QpShared>>,
}

impl LastQp {
    /// Whether the QP the last datagram went to is in a ping-pong: it sent a request within
    /// the engine's `PING_PONG_WINDOW`, so the datagram is likely the answer it waits for.
    fn in_ping_pong(&self, now: Instant) -> bool {
        self.qp.as_ref().is_some_and(|q| {
            now.as_nanos()
                .saturating_sub(q.last_request_tx.load(Ordering::Relaxed))
                < super::engine::PING_PONG_WINDOW.as_nanos() as u64
        })
    }

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
/// Computes the ICRC of each packet for the frame `h` describes, with the IPv4 Identification
/// the packet will leave with: its place in the run (0, 1, 2, ...) when `numbered` (the
/// segments of one GSO send), else 0.
///
/// A numbered run longer than `GSO_MAX_SEGMENTS` would be sealed for Identifications of
/// [`SENT_IDENTIFICATION_LIMIT`] and more, but never leaves so: `send_gso` refuses it, and the
/// fallback seals it again unnumbered.
fn seal(h: &mut UdpFrameHeaders, bufs: &mut [Vec<u8>], lens: &[usize], numbered: bool) {
    debug_assert!(!numbered || lens.len() <= sys::GSO_MAX_SEGMENTS);
    for (i, (buf, &n)) in bufs.iter_mut().zip(lens).enumerate() {
        h.ident = if numbered { i as u16 } else { 0 };
        let buf = &mut buf[..n];
        if let Ok(hdrs) = h.icrc_headers(n) {
            if let Ok(crc) = icrc::compute(hdrs.ip(), hdrs.udp(), &buf[..n - 4]) {
                RocePacket::new_unchecked(&mut buf[..]).set_icrc(crc);
            }
        }
    }
    h.ident = 0;
}

/// Records packets in the capture (if one is written) as they left: sealed as `seal` did.
fn record(
    shared: &ContextShared,
    h: &mut UdpFrameHeaders,
    bufs: &[Vec<u8>],
    lens: &[usize],
    numbered: bool,
) {
    let Some(c) = &shared.udp.capture else {
        return;
    };
    for (i, (buf, &n)) in bufs.iter().zip(lens).enumerate() {
        h.ident = if numbered { i as u16 } else { 0 };
        c.record(h, &buf[..n]);
    }
    h.ident = 0;
}

/// Whether the run of packets starting at `lens[0]` is worth one GSO send; its length if so.
/// Segmentation offload pays for runs of large packets (a WRITE or READ stream); a few small
/// ones (a ping-pong's request and ACK) go faster through sendmmsg.
fn gso_worthy(lens: &[usize]) -> Option<usize> {
    let run = sys::gso_run(lens);
    (run >= GSO_MIN_RUN && lens[0] >= GSO_MIN_SEGMENT).then_some(run)
}

/// Seals and sends the packets in order to `h.dst`: runs of equal-size packets with one GSO
/// send each (where the kernel has UDP segmentation offload), the others with `sendmmsg`.
///
/// The socket is unconnected with DF set, so Linux sends a datagram with IPv4 Identification 0,
/// and when it cuts a GSO send into segments (on a NIC, a bridge, a veth without offload, or at
/// the receiving socket) it numbers them 0, 1, 2, ...: each packet of a GSO run is sealed for
/// its place in the run, so every ICRC verifies for whoever receives it (rxe drops a packet
/// whose ICRC does not).
fn send_all(
    shared: &ContextShared,
    fd: RawFd,
    h: &mut UdpFrameHeaders,
    bufs: &mut [Vec<u8>],
    lens: &[usize],
) -> std::io::Result<usize> {
    let dest = SocketAddr::new(h.dst, h.dst_port);
    let k = lens.len();
    if !shared.udp.gso.load(Ordering::Relaxed) {
        seal(h, bufs, lens, false);
        record(shared, h, bufs, lens, false);
        return sys::send_batch(fd, bufs, lens, &dest);
    }
    let mut i = 0;
    let mut sent = 0;
    while i < k {
        if let Some(run) = gso_worthy(&lens[i..k]) {
            let (b, l) = (&mut bufs[i..i + run], &lens[i..i + run]);
            seal(h, b, l, true);
            match sys::send_gso(fd, b, l, &dest) {
                Ok(n) => {
                    record(shared, h, b, l, true);
                    sent += n;
                }
                Err(e) => {
                    // No GSO here (or not for this socket): fall back for good. A passing
                    // condition (no route during a link flap, a full queue) is no reason to.
                    let unsupported = matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL | libc::EIO | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                    );
                    if unsupported {
                        shared.udp.gso.store(false, Ordering::Relaxed);
                    }
                    // Sent one by one, every packet leaves with Identification 0.
                    seal(h, b, l, false);
                    record(shared, h, b, l, false);
                    sent += sys::send_batch(fd, b, l, &dest)?;
                }
            }
            i += run;
        } else {
            let mut j = i + 1;
            while j < k && gso_worthy(&lens[j..k]).is_none() {
                j += 1;
            }
            seal(h, &mut bufs[i..j], &lens[i..j], false);
            record(shared, h, &bufs[i..j], &lens[i..j], false);
            sent += sys::send_batch(fd, &bufs[i..j], &lens[i..j], &dest)?;
            i = j;
        }
    }
    Ok(sent)
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
/// The shortest run of packets worth one GSO send.
const GSO_MIN_RUN: usize = 3;
/// The smallest packet worth segmentation offload.
const GSO_MIN_SEGMENT: usize = 512;
