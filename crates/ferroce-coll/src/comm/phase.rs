//! A collective's step as the engine runs it: what it sends, what it receives and what becomes
//! of received bytes, and the digest every message of a call carries.

use super::*;

/// Where a send's bytes are.
#[derive(Clone, Copy)]
pub(crate) enum Src<'a> {
    /// In a registered region (offsets are into it).
    Mr(&'a MemoryRegion),
    /// At a pointer (offsets are from it), for messages of at most `stage_bytes`: they are
    /// copied at their post (into the request over UDP, into a staging slot over shared
    /// memory), so a small collective registers nothing.
    Ptr(*const u8),
}

impl<'a> From<&'a MemoryRegion> for Src<'a> {
    fn from(mr: &'a MemoryRegion) -> Src<'a> {
        Src::Mr(mr)
    }
}

/// Bytes a phase sends: `len` bytes at `off` of `mr`.
#[derive(Clone, Copy)]
pub(crate) struct Out<'a> {
    pub(crate) peer: usize,
    pub(crate) mr: Src<'a>,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

/// What becomes of received bytes.
#[derive(Clone, Copy)]
pub(crate) enum Action {
    /// Copied to the pointer.
    Copy(*mut u8),
    /// Reduced into the bytes at the pointer.
    Reduce(*mut u8, DataType, ReduceOp),
    /// Reduced with the bytes at the first pointer into the second (out of place: a copy of
    /// each block, still in L1, then the reduction).
    ReduceFrom(*const u8, *mut u8, DataType, ReduceOp),
}

/// Bytes a phase receives from `peer`.
pub(crate) struct In<'a> {
    pub(crate) peer: usize,
    pub(crate) len: usize,
    pub(crate) action: Action,
    /// Ranks to pass the bytes on to once they are in place: they are sent from `src` (the
    /// registered region and offset where the action left them).
    pub(crate) forward: Vec<usize>,
    pub(crate) src: Option<(Src<'a>, usize)>,
    /// Before its action: how many of this phase's messages to a rank must have completed
    /// (the action overwrites bytes those messages were sent from).
    pub(crate) after: Option<(usize, u64)>,
}

/// One step of a collective: see the module doc.
#[derive(Default)]
pub(crate) struct Phase<'a> {
    pub(crate) outs: Vec<Out<'a>>,
    pub(crate) ins: Vec<In<'a>>,
    /// Messages are at most this long (a whole number of elements, at most a slot).
    pub(crate) slice: usize,
}

/// How many messages `len` bytes take in slices of `slice`.
pub(crate) fn messages(len: usize, slice: usize) -> u64 {
    len.div_ceil(slice) as u64
}

/// The 16-bit digest of a call that every message of it carries (never `0xffff`).
pub(crate) fn digest(kind: u8, parts: &[u64]) -> u16 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ u64::from(kind);
    for p in parts {
        for b in p.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let d = (h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48)) as u16;
    if d == 0xffff {
        0xfffe
    } else {
        d
    }
}

/// Marks a queued slice's source as a receive's (`In::src`) rather than a send's.
pub(super) const FORWARDED: u32 = 1 << 31;

/// Applies `item`'s action to `len` received bytes `src`, `at` bytes into the item.
///
/// # Safety
/// The action's pointers are valid for the item's bytes, which nothing else accesses.
pub(super) unsafe fn apply(
    item: &In<'_>,
    src: &[u8],
    at: usize,
    len: usize,
) -> Result<(), crate::reduce::ReduceError> {
    // SAFETY (each arm): the caller's contract; `at..at + len` lies inside the item.
    match item.action {
        Action::Copy(dst) => unsafe {
            if item.forward.is_empty() && len >= STREAM_MIN {
                copy_streaming(src.as_ptr(), dst.add(at), len);
            } else {
                std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(at), len);
            }
            Ok(())
        },
        Action::Reduce(dst, dtype, op) => unsafe {
            let dst = std::slice::from_raw_parts_mut(dst.add(at), len);
            reduce_into(dst, src, dtype, op)
        },
        Action::ReduceFrom(from, dst, dtype, op) => unsafe {
            // A block at a time, so the copy is still in L1 when the reduction reads it back.
            const BLOCK: usize = 16 << 10;
            let mut b = 0;
            while b < len {
                let l = BLOCK.min(len - b);
                let d = dst.add(at + b);
                std::ptr::copy_nonoverlapping(from.add(at + b), d, l);
                let d = std::slice::from_raw_parts_mut(d, l);
                reduce_into(d, &src[b..b + l], dtype, op)?;
                b += l;
            }
            Ok(())
        },
    }
}
