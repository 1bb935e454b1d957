//! The target's bounce buffer of one queue: one registered region cut into small slots (one
//! per queue entry, for the 4 KiB-class transfers that make up most I/O) and a few large ones
//! of the largest transfer. A transfer takes the smallest kind of slot it fits; the memory a
//! queue holds is bounded by its entries and a fixed number of large slots, not by entries
//! times the largest transfer.

use ferroce::{Access, MemoryRegion, ProtectionDomain, Sge};

/// Bytes of a small slot.
pub const SMALL_SLOT: usize = 16 * 1024;

/// A queue's bounce buffer.
pub struct Bounce {
    mr: MemoryRegion,
    small: usize,
    large_len: usize,
    free_small: Vec<usize>,
    free_large: Vec<usize>,
}

impl Bounce {
    /// `small` small slots and `large` slots of `large_len` bytes.
    pub fn new(
        pd: &ProtectionDomain,
        small: usize,
        large: usize,
        large_len: usize,
    ) -> ferroce::Result<Bounce> {
        let large_len = large_len.max(SMALL_SLOT);
        let mr = pd.alloc_mr(small * SMALL_SLOT + large * large_len, Access::LOCAL_WRITE)?;
        Ok(Bounce {
            mr,
            small,
            large_len,
            free_small: (0..small).rev().collect(),
            free_large: (small..small + large).rev().collect(),
        })
    }

    /// The largest transfer a slot takes.
    pub fn max_len(&self) -> usize {
        self.large_len
    }

    /// Whether a slot for `len` bytes is free now.
    pub fn has_room(&self, len: usize) -> bool {
        (len <= SMALL_SLOT && !self.free_small.is_empty()) || !self.free_large.is_empty()
    }

    /// Takes a slot for `len` bytes (at most [`Self::max_len`]).
    pub fn take(&mut self, len: usize) -> Option<usize> {
        if len > self.large_len {
            return None;
        }
        if len <= SMALL_SLOT {
            if let Some(s) = self.free_small.pop() {
                return Some(s);
            }
        }
        self.free_large.pop()
    }

    /// Gives a slot back.
    pub fn give(&mut self, slot: usize) {
        if slot < self.small {
            self.free_small.push(slot);
        } else {
            self.free_large.push(slot);
        }
    }

    fn offset(&self, slot: usize) -> usize {
        if slot < self.small {
            slot * SMALL_SLOT
        } else {
            self.small * SMALL_SLOT + (slot - self.small) * self.large_len
        }
    }

    /// The scatter-gather entry of `len` bytes of `slot`.
    pub fn sge(&self, slot: usize, len: usize) -> ferroce::Result<Sge> {
        self.mr.sge(self.offset(slot), len)
    }

    /// Writes `data` into `slot`.
    pub fn write(&self, slot: usize, data: &[u8]) -> ferroce::Result<()> {
        self.mr.write(self.offset(slot), data)
    }

    /// Runs `f` on `len` bytes of `slot` where they lie (a Write's data, on its way to the
    /// namespace without a copy of its own). The slot must be taken, with its READ complete.
    pub fn with_slot<R>(
        &self,
        slot: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> ferroce::Result<R> {
        // SAFETY: nothing writes the slot while `f` runs. The region is registered for local
        // access alone (`alloc_mr(.., Access::LOCAL_WRITE)` above): no peer holds a key that
        // reaches it, whatever it sends. Only this queue's thread posts work into its slots,
        // and the caller's slot is taken and its one READ complete: a late or repeated READ
        // response the host sends after that is outside the requester's window and dropped
        // before it reaches memory (ferroce-proto's "late copy is ignored" tests). The slot is
        // given back, for the next transfer, only after `f` returns.
        unsafe { self.mr.with_slice(self.offset(slot), len, f) }
    }
}
