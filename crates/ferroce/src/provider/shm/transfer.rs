//! The packet path over shared memory: the transport's packets go into the peer QP's inbound
//! ring instead of a socket, and come out of this QP's own ring into the engine. The ring is not
//! a network: no ICRC is computed or checked, nothing is lost or reordered.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ferroce_proto::Instant;
use ferroce_wire::RocePacket;

use super::ring::RingError;
use super::{Link, ShmQp};
use crate::provider::engine::hand_over;
use crate::provider::{ContextShared, QpShared};

/// How many packets of `len` bytes the linked peer's ring has room for now (0 when the QP is
/// not linked): the engine makes a packet only when it can go, since one made and then dropped
/// would wait for the retransmission timer. A peer whose ring positions cannot be true ends the
/// link (see [`peer_broke_rules`]).
pub(crate) fn ring_room(shared: &ContextShared, qp: &QpShared, shm: &ShmQp, len: usize) -> usize {
    let room = match &*shm.lock() {
        Link::Linked(p) => p.producer.room_for(len),
        _ => Ok(0),
    };
    room.unwrap_or_else(|RingError| {
        peer_broke_rules(shared, qp);
        0
    })
}

/// Puts packets into a linked peer's ring (room was checked before they were made) and wakes
/// its engine if it sleeps. The ring is not a network: no ICRC is computed or checked.
pub(crate) fn ring_send(
    shared: &ContextShared,
    qp: &QpShared,
    shm: &ShmQp,
    bufs: &[Vec<u8>],
    lens: &[usize],
) {
    let mut link = shm.lock();
    let Link::Linked(peer) = &mut *link else {
        return;
    };
    let mut bytes = 0;
    let mut sent = 0;
    let mut broke = false;
    for (b, &n) in bufs.iter().zip(lens) {
        match peer.producer.push(&b[..n]) {
            Ok(true) => {
                sent += 1;
                bytes += n;
            }
            // Cannot happen (room was checked); the transport's retransmission would cover it.
            Ok(false) => {
                shared.counters.send_errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(RingError) => {
                broke = true;
                break;
            }
        }
    }
    let c = &shared.counters;
    c.tx_packets.fetch_add(sent, Ordering::Relaxed);
    c.tx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    peer.wake();
    drop(link);
    if broke {
        peer_broke_rules(shared, qp);
    }
}

/// The linked peer broke the rules of the shared pages (a ring position or record that cannot
/// be true): nothing more from it can be trusted, so the link ends as if the peer had gone —
/// the QP goes to ERR, flushing its work — and the violation is counted.
pub(crate) fn peer_broke_rules(shared: &ContextShared, qp: &QpShared) {
    shared
        .counters
        .shm_peer_violations
        .fetch_add(1, Ordering::Relaxed);
    peer_gone(qp, true);
}

/// Most packets one pass takes from one QP's ring, so one busy QP cannot starve the rest.
const SHM_RX_PER_QP: usize = 256;

/// Serves the shared-memory side: hello connections (new links, wake-ups, peers that went
/// away) and the inbound rings of linked QPs. Returns whether anything arrived.
pub(crate) fn receive(
    shared: &ContextShared,
    qps: &[Arc<QpShared>],
    buf: &mut [u8],
    now: Instant,
) -> bool {
    let mut did = shared.poll_shm_host(now, false, true);
    for qp in qps {
        did |= drain_ring(shared, qp, buf, now, SHM_RX_PER_QP);
    }
    if did {
        shared.work_pending.store(true, Ordering::Release);
    }
    did
}

/// Hands over up to `limit` packets waiting in the QP's incoming ring; returns whether any
/// came (or the ring broke, which ends the link).
pub(crate) fn drain_ring(
    shared: &ContextShared,
    qp: &Arc<QpShared>,
    buf: &mut [u8],
    now: Instant,
    limit: usize,
) -> bool {
    let Some(s) = qp
        .shm
        .as_ref()
        .filter(|s| s.receiving.load(Ordering::Acquire))
    else {
        return false;
    };
    // Our own position, kept privately (the page's copy is the peer's to scribble on).
    let mut ring = s.page.ring().consumer(s.ring_tail.load(Ordering::Relaxed));
    let mut did = false;
    for _ in 0..limit {
        let popped = ring.pop(buf);
        s.ring_tail.store(ring.tail, Ordering::Relaxed);
        match popped {
            Ok(Some(n)) => {
                did = true;
                let c = &shared.counters;
                c.rx_packets.fetch_add(1, Ordering::Relaxed);
                c.rx_bytes.fetch_add(n as u64, Ordering::Relaxed);
                match RocePacket::new_checked(&buf[..n]) {
                    // A ring has no switch queue to mark anything.
                    Ok(pkt) => hand_over(shared, now, qp, &pkt, &buf[..n], None, false),
                    Err(_) => {
                        c.malformed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Ok(None) => break,
            Err(RingError) => {
                peer_broke_rules(shared, qp);
                return true;
            }
        }
    }
    did
}

/// Ends a link whose peer went away. Whatever the peer wrote into the ring before it went must
/// be handled first by the caller ([`drain_ring`]): a process that ACKed a SEND and exited has
/// delivered that ACK, and the SEND must complete.
///
/// The QP then fails at once (on a fabric work under way would fail after the retry timeouts),
/// unless `fail_idle` is off and it has nothing to send: then it stays as it is, as on a
/// fabric, where it could not tell (see [`crate::ContextOptions::fail_idle_qps_when_peer_goes`]).
pub(crate) fn peer_gone(qp: &QpShared, fail_idle: bool) {
    end_link(qp, None, fail_idle);
}

/// [`peer_gone`] for the link `id` only: a QP reset and linked anew since is left alone (the
/// check and the end are one step under the link's lock).
pub(crate) fn link_gone(qp: &QpShared, id: u64, fail_idle: bool) {
    end_link(qp, Some(id), fail_idle);
}

fn end_link(qp: &QpShared, id: Option<u64>, fail_idle: bool) {
    if let Some(s) = &qp.shm {
        let mut link = s.lock();
        if id.is_some_and(|id| !matches!(&*link, Link::Linked(p) if p.id == id)) {
            return;
        }
        s.linked.store(false, Ordering::Release);
        s.receiving.store(false, Ordering::Release);
        *link = Link::Broken;
    }
    let mut q = qp.qp.lock();
    q.peer_memory = None;
    if fail_idle || !q.is_send_queue_empty() {
        q.modify_to_error();
    }
    qp.publish_state(&q);
}
