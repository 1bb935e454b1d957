//! One-sided operations done by the initiator straight in a same-host peer's memory.
//!
//! [`execute`] either does the whole operation and returns its completion, or touches nothing
//! and returns `None`: then the request takes the packet path, where the transport (and the
//! target's responder) deal with it exactly as over UDP — including every refusal, which is how
//! a refused request gets the IBTA status without this module repeating the rules.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use ferroce_proto::memory::AtomicOp;
use ferroce_proto::{Access, QpState, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion};

use crate::context::ContextShared;
use crate::mr::{apply_atomic, MrInner};
use crate::shm::{Link, ShmQp};

/// A local scatter/gather element, checked.
struct Local {
    mr: Arc<MrInner>,
    offset: usize,
    len: usize,
}

fn local_sges(shared: &ContextShared, pd: u32, wr: &SendWr, need: Access) -> Option<Vec<Local>> {
    wr.sgl
        .iter()
        .map(|sge| {
            let mr = shared.mrs.get(sge.lkey)?;
            if mr.pd != pd || !mr.access.contains(need) {
                return None;
            }
            let offset = sge.addr.checked_sub(mr.addr())?;
            let end = offset.checked_add(u64::from(sge.length))?;
            (end <= mr.len() as u64).then_some(Local {
                mr,
                offset: offset as usize,
                len: sge.length as usize,
            })
        })
        .collect()
}

/// Does `wr` on `qp`'s linked peer if it is a WRITE, READ or atomic that every check admits and
/// nothing is queued before it; returns its completion (to deliver if signaled).
pub(crate) fn execute(
    shared: &ContextShared,
    shm: &ShmQp,
    q: &ferroce_proto::QueuePair,
    wr: &SendWr,
) -> Option<WorkCompletion> {
    if q.state() != QpState::Rts || !q.is_send_queue_empty() || q.check_send(wr).is_err() {
        return None;
    }
    let (need, opcode) = match wr.op {
        SendOp::Write => (Access::REMOTE_WRITE, WcOpcode::RdmaWrite),
        SendOp::Read => (Access::REMOTE_READ, WcOpcode::RdmaRead),
        SendOp::CompareSwap { .. } => (Access::REMOTE_ATOMIC, WcOpcode::CompareSwap),
        SendOp::FetchAdd { .. } => (Access::REMOTE_ATOMIC, WcOpcode::FetchAdd),
        _ => return None,
    };
    let mut link = shm.lock();
    let Link::Linked(peer) = &mut *link else {
        return None;
    };
    let pd = q.pd();
    let len: u64 = wr.data_len();
    match wr.op {
        SendOp::Write => {
            let locals = match &wr.inline_data {
                Some(_) => Vec::new(),
                None => local_sges(shared, pd, wr, Access::NONE)?,
            };
            let (map, base) = peer.resolve(wr.rkey, wr.remote_addr, len, need)?;
            if let Some(data) = &wr.inline_data {
                // SAFETY: `resolve` checked `base..base + len` lies in the peer's region,
                // which `map` keeps mapped; the source is a live local buffer of `len` bytes.
                unsafe { std::ptr::copy(data.as_ptr(), map.ptr().add(base), data.len()) };
            } else {
                let mut at = base;
                for l in &locals {
                    l.mr.with_range(l.offset, l.len, false, |src| {
                        // SAFETY: `src` covers `l.len` bytes of the local region (under its
                        // lock); the destination lies inside the checked remote range.
                        unsafe { std::ptr::copy(src, map.ptr().add(at), l.len) }
                    })
                    .ok()?;
                    at += l.len;
                }
            }
        }
        SendOp::Read => {
            let locals = local_sges(shared, pd, wr, Access::LOCAL_WRITE)?;
            let (map, base) = peer.resolve(wr.rkey, wr.remote_addr, len, need)?;
            let mut at = base;
            for l in &locals {
                l.mr.with_range(l.offset, l.len, true, |dst| {
                    // SAFETY: as for WRITE, in the other direction.
                    unsafe { std::ptr::copy(map.ptr().add(at), dst, l.len) }
                })
                .ok()?;
                at += l.len;
            }
        }
        SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
            if wr.remote_addr % 8 != 0 {
                return None;
            }
            let locals = local_sges(shared, pd, wr, Access::LOCAL_WRITE)?;
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
            let local = locals.first()?;
            // Check the local side can take the result before the remote word changes.
            local.mr.with_range(local.offset, 8, false, |_| ()).ok()?;
            let old = apply_atomic(word, op);
            let _ = local.mr.with_range(local.offset, 8, true, |dst| {
                // SAFETY: 8 bytes of the local region under its exclusive lock.
                unsafe { std::ptr::write_unaligned(dst.cast::<u64>(), old) }
            });
        }
        _ => return None,
    }
    Some(WorkCompletion {
        wr_id: wr.wr_id,
        status: WcStatus::Success,
        opcode,
        byte_len: u32::try_from(len).unwrap_or(u32::MAX),
        imm_data: None,
        invalidated_rkey: None,
        qp_num: q.qpn(),
        solicited: false,
    })
}
