//! A [`crate::QpSender`]'s memory of its last direct WRITE or READ, so that the next one between
//! the same two regions is re-checked with a handful of loads.
//!
//! # Why
//! Over shared memory an 8-byte WRITE ping-pong's turnaround is: see the flag, post, store. The
//! store becomes visible only once every instruction before it has retired, so the checks in
//! front of it are on the critical path of every round trip. Done by [`super::direct`] they
//! walk the QP, both regions and the peer's tables through several pointers each (~150
//! instructions); measured in `ferroce perf write_lat --provider shm`, posting cost 15-20 ns of
//! the one-way latency, where a bare store of the same bytes cost nothing measurable.
//!
//! # What it keeps, and why that is the same check
//! Everything the checks of a WRITE or READ depend on is either fixed while a stamp holds, or
//! read again on every post:
//! - the local region: its key names the same region while the context's removal count holds
//!   (`MrTable::removals`), and a region's address, length, rights and protection domain never
//!   change; its `revoked` flag is read each time;
//! - the peer's region: its key-table slot says the same while the slot's sequence number holds
//!   (every rewrite moves it on), and the mapping is of that region (checked when made);
//! - the peer QP's state, rights and protection domain: read each time from its page;
//! - this QP: idle (RTS, nothing under way), linked, and linked by the same link (generation):
//!   read each time;
//! - the request: opcode, one SGE, no inline data, its keys; bounds and length are checked
//!   each time (the addresses may move within the regions).
//!
//! It is only made after the full checks admitted a request between the same two regions, so
//! what it skips (protection domains, the QP's capacities) was checked with these very values.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use ferroce_proto::attr::MAX_MESSAGE_LEN;
use ferroce_proto::{Access, SendOp, SendWr, WcOpcode};

use super::admit::{admit_one_sided, Grant, PeerQpWords};
use super::map::SharedMap;
use super::{KeyTable, PeerMemory, QpPage};
use crate::provider::{ContextShared, MrInner, QpShared};

/// See the module doc. Its pointers point into objects it keeps alive itself (the regions'
/// mappings, the peer's table and page) or that outlive the sender holding it (the QP and its
/// context, which the sender borrows).
#[derive(Debug)]
pub(crate) struct Shortcut {
    lkey: u32,
    rkey: u32,
    /// The local region: where it starts as SGEs name it, its length, where its bytes are, and
    /// whether it may be written (a READ's destination).
    local_addr: u64,
    local_len: u64,
    local_ptr: *mut u8,
    local_writable: bool,
    /// The peer's region: where it starts as the peer names it, its length, where our mapping
    /// of it is, its protection domain and rights.
    remote: Grant,
    remote_ptr: *mut u8,
    /// Stamps and the words they are read from again on every post.
    removals: u64,
    removals_word: *const AtomicU64,
    revoked: *const AtomicBool,
    seq: u64,
    seq_word: *const AtomicU64,
    peer_state: *const AtomicU32,
    peer_access: *const AtomicU32,
    peer_pd: *const AtomicU32,
    generation: u64,
    generation_word: *const AtomicU64,
    linked: *const AtomicBool,
    idle: *const AtomicBool,
    /// What keeps the pointers above valid (see the type doc).
    _local: Arc<MrInner>,
    _map: Arc<SharedMap>,
    _table: Arc<KeyTable>,
    _page: Arc<QpPage>,
}

// SAFETY: the raw pointers point into memory owned by the `Arc`s held here or by the QP the
// owning sender borrows, and are only used to read atomics (and to copy bytes of regions, as
// every other path does); nothing about them is tied to the thread that made them.
unsafe impl Send for Shortcut {}

impl Shortcut {
    /// Remembers the regions `wr` (a WRITE or READ of one SGE, no inline data, just done
    /// directly through `peer`) used: the ones `peer` cached while doing it.
    pub(crate) fn capture(
        shared: &ContextShared,
        qp: &QpShared,
        peer: &PeerMemory,
        wr: &SendWr,
    ) -> Option<Shortcut> {
        if !matches!(wr.op, SendOp::Write | SendOp::Read) || wr.inline_data.is_some() {
            return None;
        }
        let [sge] = wr.sgl.as_slice() else {
            return None;
        };
        let local = peer.last_local.as_ref()?;
        let remote = peer.last_region.as_ref()?;
        if local.key != sge.lkey || remote.region.key != wr.rkey {
            return None;
        }
        let shm = qp.shm.as_ref()?;
        let mr = &local.mr;
        let (local_addr, local_len, local_ptr) = mr.direct_span()?;
        Some(Shortcut {
            lkey: sge.lkey,
            rkey: wr.rkey,
            local_addr,
            local_len,
            local_ptr,
            local_writable: mr.access.contains(Access::LOCAL_WRITE),
            remote: remote.region.grant(),
            remote_ptr: remote
                .map
                .ptr()
                .wrapping_add(remote.region.file_offset as usize),
            removals: local.removals,
            removals_word: shared.mrs.removals_word(),
            revoked: mr.revoked_flag(),
            seq: remote.seq,
            seq_word: peer.table.seq_word(wr.rkey)?,
            peer_state: peer.page.state_word(),
            peer_access: peer.page.access_word(),
            peer_pd: peer.page.pd_word(),
            generation: peer.generation,
            generation_word: &shm.generation,
            linked: &shm.linked,
            idle: qp.qp.idle_flag(),
            _local: mr.clone(),
            _map: remote.map.clone(),
            _table: peer.table.clone(),
            _page: peer.page.clone(),
        })
    }

    /// Does `wr` if it is a WRITE or READ between the remembered regions and every re-check
    /// passes; returns its completion's opcode, or `None` having touched nothing.
    #[inline(always)]
    pub(crate) fn run(&self, wr: &SendWr) -> Option<WcOpcode> {
        let (writing, need, opcode) = match wr.op {
            SendOp::Write => (true, Access::REMOTE_WRITE, WcOpcode::RdmaWrite),
            SendOp::Read => (false, Access::REMOTE_READ, WcOpcode::RdmaRead),
            _ => return None,
        };
        let [sge] = wr.sgl.as_slice() else {
            return None;
        };
        if wr.inline_data.is_some()
            || sge.lkey != self.lkey
            || wr.rkey != self.rkey
            || !(writing || self.local_writable)
        {
            return None;
        }
        // SAFETY: every pointer points into an object kept alive by `self` or by the QP the
        // sender holding `self` borrows (see the type doc); all are atomics.
        let (fresh, peer_qp) = unsafe {
            let fresh = (*self.idle).load(Ordering::Acquire)
                && (*self.linked).load(Ordering::Acquire)
                && (*self.generation_word).load(Ordering::Acquire) == self.generation
                && (*self.removals_word).load(Ordering::Acquire) == self.removals
                && !(*self.revoked).load(Ordering::Acquire)
                && (*self.seq_word).load(Ordering::Acquire) == self.seq;
            let peer_qp = PeerQpWords {
                state: (*self.peer_state).load(Ordering::Acquire),
                access: (*self.peer_access).load(Ordering::Acquire),
                pd: (*self.peer_pd).load(Ordering::Acquire),
            };
            (fresh, peer_qp)
        };
        let len = u64::from(sge.length);
        if !fresh || len > MAX_MESSAGE_LEN {
            return None;
        }
        let local_off = sge.addr.checked_sub(self.local_addr)?;
        if local_off.checked_add(len)? > self.local_len {
            return None;
        }
        let remote_off = admit_one_sided(peer_qp, &self.remote, need, wr.remote_addr, len)?;
        // Both offsets are within their regions (checked just above), whose mappings `self`
        // keeps.
        let local = self.local_ptr.wrapping_add(local_off as usize);
        let remote = self.remote_ptr.wrapping_add(remote_off as usize);
        // SAFETY: `len` bytes at each end lie inside a live mapping of its region (checked
        // above); the two regions are distinct mappings.
        unsafe { super::direct::move_one_sided(writing, local, remote, len as usize) };
        Some(opcode)
    }
}
