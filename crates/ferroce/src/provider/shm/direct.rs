//! One-sided operations done by the initiator straight in a same-host peer's memory.
//!
//! [`execute`] either does the whole operation and returns its completion, or touches nothing
//! and returns `None`: then the request takes the packet path, where the transport (and the
//! target's responder) deal with it exactly as over UDP — including every refusal, which is how
//! a refused request gets the IBTA status without this module repeating the rules.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use ferroce_proto::memory::AtomicOp;
use ferroce_proto::{Access, QpState, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion};

use super::PeerMemory;
use crate::provider::{apply_atomic, copy_bytes, ContextShared, MrInner, QpCore};

/// The local region a linked QP used last, with the region table's removal count when it was
/// looked up: while that count holds, the key still names this region (`MrTable::removals`), so
/// a post reusing its buffer takes neither the table's lock nor a reference count.
#[derive(Debug)]
pub(crate) struct CachedLocal {
    pub(crate) removals: u64,
    pub(crate) key: u32,
    pub(crate) mr: Arc<MrInner>,
}

impl CachedLocal {
    /// Whether this is still the region of `key`.
    fn holds(&self, shared: &ContextShared, key: u32) -> bool {
        self.key == key && self.removals == shared.mrs.removals()
    }
}

/// A local region found through the cache or the table.
enum LocalMr<'a> {
    Cached(&'a MrInner),
    Looked(Arc<MrInner>),
}

impl std::ops::Deref for LocalMr<'_> {
    type Target = MrInner;
    fn deref(&self) -> &MrInner {
        match self {
            LocalMr::Cached(m) => m,
            LocalMr::Looked(m) => m,
        }
    }
}

fn local_mr<'a>(
    shared: &ContextShared,
    cache: &'a Option<CachedLocal>,
    key: u32,
) -> Option<LocalMr<'a>> {
    match cache {
        Some(c) if c.holds(shared, key) => Some(LocalMr::Cached(&c.mr)),
        _ => shared.mrs.get(key).map(LocalMr::Looked),
    }
}

/// Checks every local SGE of `wr` (key, protection domain, rights, bounds) before anything is
/// touched, remembering the region of the last one.
fn check_locals(
    shared: &ContextShared,
    cache: &mut Option<CachedLocal>,
    pd: u32,
    wr: &SendWr,
    need: Access,
) -> Option<()> {
    for sge in &wr.sgl {
        if !cache.as_ref().is_some_and(|c| c.holds(shared, sge.lkey)) {
            let removals = shared.mrs.removals();
            let mr = shared.mrs.get(sge.lkey)?;
            *cache = Some(CachedLocal {
                removals,
                key: sge.lkey,
                mr,
            });
        }
        let mr = &cache.as_ref()?.mr;
        mr.admit(sge.lkey, pd, need, sge.addr, u64::from(sge.length))
            .ok()?;
    }
    Some(())
}

/// Runs `f` on each local SGE's bytes in order, with the offset of its bytes in the whole
/// transfer (all of them passed `check_locals`).
fn each_local(
    shared: &ContextShared,
    cache: &Option<CachedLocal>,
    wr: &SendWr,
    writing: bool,
    mut f: impl FnMut(*mut u8, usize, usize),
) -> Option<()> {
    let mut at = 0;
    for sge in &wr.sgl {
        let mr = local_mr(shared, cache, sge.lkey)?;
        let offset = sge.addr.checked_sub(mr.addr())? as usize;
        let len = sge.length as usize;
        mr.with_range(offset, len, writing, |p| f(p, at, len))
            .ok()?;
        at += len;
    }
    Some(())
}

/// Does `wr` on `qp`'s linked peer if it is a WRITE, READ or atomic that every check admits and
/// nothing is queued before it; returns its completion (to deliver if signaled).
pub(crate) fn execute(
    shared: &ContextShared,
    core: &mut QpCore,
    wr: &SendWr,
) -> Option<WorkCompletion> {
    let QpCore {
        proto: q,
        peer_memory,
        ..
    } = core;
    if q.state() != QpState::Rts || !q.is_send_queue_empty() || q.check_send(wr).is_err() {
        return None;
    }
    let opcode = one_sided_op(shared, peer_memory.as_mut()?, q.pd(), wr)?;
    Some(completion(wr, opcode, q.qpn()))
}

/// The successful completion of `wr`, done at once on QP `qpn`.
pub(crate) fn completion(wr: &SendWr, opcode: WcOpcode, qpn: u32) -> WorkCompletion {
    WorkCompletion {
        wr_id: wr.wr_id,
        status: WcStatus::Success,
        opcode,
        byte_len: u32::try_from(wr.data_len()).unwrap_or(u32::MAX),
        imm_data: None,
        invalidated_rkey: None,
        qp_num: qpn,
        solicited: false,
        src_qp: None,
    }
}

/// Does `wr`, a request a QP in RTS with an empty send queue admitted, in the peer's memory
/// through `peer` if it is a WRITE, READ or atomic that every check on the memory admits;
/// returns its completion's opcode. `pd` is the posting QP's protection domain.
#[inline]
pub(crate) fn one_sided_op(
    shared: &ContextShared,
    peer: &mut PeerMemory,
    pd: u32,
    wr: &SendWr,
) -> Option<WcOpcode> {
    let (need, opcode) = match wr.op {
        SendOp::Write => (Access::REMOTE_WRITE, WcOpcode::RdmaWrite),
        SendOp::Read => (Access::REMOTE_READ, WcOpcode::RdmaRead),
        SendOp::CompareSwap { .. } => (Access::REMOTE_ATOMIC, WcOpcode::CompareSwap),
        SendOp::FetchAdd { .. } => (Access::REMOTE_ATOMIC, WcOpcode::FetchAdd),
        _ => return None,
    };
    if repeated_one_sided(shared, peer, pd, wr).is_none() {
        // Taken out of the link for the call, so the remote mapping `resolve` lends can live
        // beside it; put back whatever happens.
        let mut cache = peer.last_local.take();
        let done = one_sided(shared, peer, &mut cache, pd, wr, wr.data_len(), need);
        peer.last_local = cache;
        done?;
    }
    Some(opcode)
}

/// Moves the `len` bytes of a WRITE (`writing`: local to remote) or a READ (remote to local).
///
/// # Safety
/// `len` bytes at `local` and at `remote` lie in live mappings of two distinct regions.
#[inline(always)]
pub(crate) unsafe fn move_one_sided(writing: bool, local: *mut u8, remote: *mut u8, len: usize) {
    let (src, dst) = if writing {
        // The bytes of every earlier WRITE (and whatever this process stored before posting)
        // are visible to the peer before this one's, as a responder places them in order: a
        // peer polling a flag this WRITE sets then reads the data earlier ones carried.
        fence(Ordering::Release);
        (local.cast_const(), remote)
    } else {
        (remote.cast_const(), local)
    };
    // SAFETY: as the caller vouches.
    unsafe {
        if len == 8 {
            // A flag word or a counter: the commonest size of a latency-bound WRITE, one load
            // and one store without `copy_bytes`' size dispatch.
            dst.cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned());
        } else {
            copy_bytes(src, dst, len);
        }
    }
    if !writing {
        // A READ completes only after its bytes were taken; what the application reads after
        // the completion is not older than them.
        fence(Ordering::Acquire);
    }
}

/// The common case of [`one_sided`] in straight-line code: a WRITE or READ of one buffer in the
/// local region the previous request used (a ping-pong or a stream reuses its buffers). The
/// same checks in the same order, without the scatter/gather walk; touches nothing and returns
/// `None` unless every one passes, and then `one_sided` decides the request afresh.
#[inline]
fn repeated_one_sided(
    shared: &ContextShared,
    peer: &mut PeerMemory,
    pd: u32,
    wr: &SendWr,
) -> Option<()> {
    let (writing, need_local, need_remote) = match wr.op {
        SendOp::Write => (true, Access::NONE, Access::REMOTE_WRITE),
        SendOp::Read => (false, Access::LOCAL_WRITE, Access::REMOTE_READ),
        _ => return None,
    };
    let [sge] = wr.sgl.as_slice() else {
        return None;
    };
    if wr.inline_data.is_some() {
        return None;
    }
    let len = u64::from(sge.length);
    let local = peer
        .last_local
        .as_ref()
        .filter(|c| c.holds(shared, sge.lkey))?;
    let offset = local
        .mr
        .admit(sge.lkey, pd, need_local, sge.addr, len)
        .ok()?;
    // The region stays alive in `last_local`, which `resolve` leaves alone.
    let local_ptr = local.mr.direct_ptr(offset, len as usize)?;
    let (map, base) = peer.resolve(wr.rkey, wr.remote_addr, len, need_remote)?;
    // SAFETY: `resolve` checked `base..base + len` lies in the peer's region, which `map` keeps
    // mapped.
    let remote_ptr = unsafe { map.ptr().add(base) };
    // SAFETY: `admit` checked `offset..offset + len` lies in the local region, mapped while
    // `last_local` holds it; the remote range is checked above. Two distinct mappings.
    unsafe { move_one_sided(writing, local_ptr, remote_ptr, len as usize) };
    Some(())
}

/// The copy or atomic of `execute`, once the QP admitted the request.
fn one_sided(
    shared: &ContextShared,
    peer: &mut PeerMemory,
    cache: &mut Option<CachedLocal>,
    pd: u32,
    wr: &SendWr,
    len: u64,
    need: Access,
) -> Option<()> {
    match wr.op {
        SendOp::Write => {
            if wr.inline_data.is_none() {
                check_locals(shared, cache, pd, wr, Access::NONE)?;
            }
            let (map, base) = peer.resolve(wr.rkey, wr.remote_addr, len, need)?;
            // SAFETY: `resolve` checked `base..base + len` lies in the peer's region, which
            // `map` keeps mapped.
            let dst = unsafe { map.ptr().add(base) };
            // As in `move_one_sided`: earlier stores are visible before these bytes.
            fence(Ordering::Release);
            if let Some(data) = &wr.inline_data {
                // SAFETY: the source is a live local buffer of `len` bytes; the destination is
                // the checked remote range.
                unsafe { copy_bytes(data.as_ptr(), dst, data.len()) };
            } else {
                each_local(shared, cache, wr, false, |src, at, n| {
                    // SAFETY: `src` covers `n` bytes of a local region; `at + n <= len`, so the
                    // destination lies inside the checked remote range.
                    unsafe { copy_bytes(src, dst.add(at), n) }
                })?;
            }
        }
        SendOp::Read => {
            check_locals(shared, cache, pd, wr, Access::LOCAL_WRITE)?;
            let (map, base) = peer.resolve(wr.rkey, wr.remote_addr, len, need)?;
            // SAFETY: as for WRITE.
            let src = unsafe { map.ptr().add(base) };
            each_local(shared, cache, wr, true, |dst, at, n| {
                // SAFETY: as for WRITE, in the other direction.
                unsafe { copy_bytes(src.add(at), dst, n) }
            })?;
            fence(Ordering::Acquire);
        }
        SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
            if wr.remote_addr % 8 != 0 || wr.sgl.len() != 1 || wr.sgl[0].length < 8 {
                return None;
            }
            check_locals(shared, cache, pd, wr, Access::LOCAL_WRITE)?;
            let (map, base) = peer.resolve(wr.rkey, wr.remote_addr, 8, need)?;
            // The region starts page-aligned in the peer and in our mapping, so the word is as
            // aligned here as `remote_addr` is there.
            let p = map.ptr().wrapping_add(base);
            if p as usize % 8 != 0 {
                return None;
            }
            let op = match wr.op {
                SendOp::CompareSwap { compare, swap } => AtomicOp::CompareSwap { compare, swap },
                SendOp::FetchAdd { add } => AtomicOp::FetchAdd { add },
                _ => return None,
            };
            // SAFETY: 8 bytes inside the checked remote range, 8-aligned, mapped while `map`
            // lives; the target and other initiators only ever apply atomics to it.
            let word = unsafe { AtomicU64::from_ptr(p.cast()) };
            let local = local_mr(shared, cache, wr.sgl[0].lkey)?;
            let offset = wr.sgl[0].addr.checked_sub(local.addr())? as usize;
            // The local side was checked, but may have been deregistered since: make sure it
            // still takes the result before the remote word changes.
            local.with_range(offset, 8, false, |_| ()).ok()?;
            let old = apply_atomic(word, op);
            let _ = local.with_range(offset, 8, true, |dst| {
                // SAFETY: 8 bytes of the local region.
                unsafe { std::ptr::write_unaligned(dst.cast::<u64>(), old) }
            });
        }
        _ => return None,
    }
    Some(())
}
