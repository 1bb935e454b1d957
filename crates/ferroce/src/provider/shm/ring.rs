//! A single-producer, single-consumer ring of packets in shared memory.
//!
//! The producer is the peer's engine (one at a time: its engine lock), the consumer this
//! context's engine. Each record is a 4-byte length, padding to 8, then the packet padded to 8;
//! a record that would not fit before the end leaves a wrap marker and starts again at 0. The
//! positions only grow (64-bit, never wrap in practice) and are published with release/acquire
//! ordering, so a record's bytes are visible before its position is.
//!
//! The other side is another process that may be buggy or hostile: every length read from the
//! ring is checked before it is believed, and a bad one reports [`RingError`] instead of
//! reading outside the ring.

use std::sync::atomic::{AtomicU64, Ordering};

/// Marks the rest of the ring (to its end) as skipped.
const WRAP: u32 = u32::MAX;
/// Bytes of a record's header.
const HEADER: usize = 8;

/// The peer broke the ring's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingError;

/// A ring's view: where its positions and bytes are. The memory is owned by a `SharedMap`
/// that outlives the view.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ring {
    head: *const AtomicU64,
    tail: *const AtomicU64,
    data: *mut u8,
    size: usize,
}

// SAFETY: the pointers reach shared memory that lives as long as the owning mapping (the
// holder keeps both together); accesses are atomics and raw copies.
unsafe impl Send for Ring {}
// SAFETY: see `Send`.
unsafe impl Sync for Ring {}

fn pad8(n: usize) -> usize {
    (n + 7) & !7
}

impl Ring {
    /// A view of a ring whose producer position is at `head`, consumer position at `tail` and
    /// `size` bytes (a multiple of 8) at `data`.
    ///
    /// # Safety
    /// The three areas must be valid, 8-aligned, disjoint and live for as long as the view is
    /// used.
    pub(crate) unsafe fn new(
        head: *const AtomicU64,
        tail: *const AtomicU64,
        data: *mut u8,
        size: usize,
    ) -> Ring {
        Ring {
            head,
            tail,
            data,
            size,
        }
    }

    fn head(&self) -> &AtomicU64 {
        // SAFETY: valid for the view's life (constructor contract).
        unsafe { &*self.head }
    }

    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as for `head`.
        unsafe { &*self.tail }
    }

    /// The largest packet a record can carry.
    pub(crate) fn max_packet(&self) -> usize {
        self.size / 4
    }

    /// Whether a packet of `len` bytes fits now (counting a possible wrap).
    pub(crate) fn has_room(&self, len: usize) -> bool {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        let used = head.wrapping_sub(tail) as usize;
        let need = HEADER + pad8(len);
        let at = (head as usize) % self.size;
        let to_end = self.size - at;
        let need = if to_end < need { to_end + need } else { need };
        used <= self.size && self.size - used >= need
    }

    /// How many more records of up to `max_len` bytes fit now, whatever the wrap costs.
    pub(crate) fn room_for(&self, max_len: usize) -> usize {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        let used = head.wrapping_sub(tail) as usize;
        let record = HEADER + pad8(max_len);
        // One record's worth is kept back for a wrap marker's waste.
        (self.size.saturating_sub(used) / record).saturating_sub(1)
    }

    /// Appends a packet (the producer's side). Returns `false` if there is no room.
    pub(crate) fn push(&self, pkt: &[u8]) -> bool {
        if pkt.len() > self.max_packet() || !self.has_room(pkt.len()) {
            return false;
        }
        let mut head = self.head().load(Ordering::Relaxed);
        let mut at = (head as usize) % self.size;
        let need = HEADER + pad8(pkt.len());
        if self.size - at < need {
            // SAFETY: `at` is 8-aligned and at least 8 bytes remain before the end.
            unsafe { self.data.add(at).cast::<u32>().write_volatile(WRAP) };
            head += (self.size - at) as u64;
            at = 0;
        }
        // SAFETY: `has_room` showed `need` free bytes at `at` (after the wrap), inside the ring;
        // the consumer does not read them before `head` is published below.
        unsafe {
            self.data
                .add(at)
                .cast::<u32>()
                .write_volatile(pkt.len() as u32);
            std::ptr::copy_nonoverlapping(pkt.as_ptr(), self.data.add(at + HEADER), pkt.len());
        }
        self.head().store(head + need as u64, Ordering::Release);
        true
    }

    /// Takes the next packet into `out` and returns its length, `Ok(None)` when empty.
    pub(crate) fn pop(&self, out: &mut [u8]) -> Result<Option<usize>, RingError> {
        let head = self.head().load(Ordering::Acquire);
        let mut tail = self.tail().load(Ordering::Relaxed);
        if head == tail {
            return Ok(None);
        }
        if head.wrapping_sub(tail) as usize > self.size {
            return Err(RingError);
        }
        let mut at = (tail as usize) % self.size;
        // SAFETY: `at` is 8-aligned inside the ring (positions advance in multiples of 8).
        let mut len = unsafe { self.data.add(at).cast::<u32>().read_volatile() };
        if len == WRAP {
            tail += (self.size - at) as u64;
            if tail == head {
                self.tail().store(tail, Ordering::Release);
                return Ok(None);
            }
            at = 0;
            // SAFETY: offset 0 of the ring.
            len = unsafe { self.data.cast::<u32>().read_volatile() };
        }
        let len = len as usize;
        let need = HEADER + pad8(len);
        if len > self.max_packet() || len > out.len() || at + need > self.size {
            return Err(RingError);
        }
        if (head.wrapping_sub(tail) as usize) < need {
            return Err(RingError);
        }
        // SAFETY: the record lies inside the ring (checked) and was published by `head`.
        unsafe { std::ptr::copy_nonoverlapping(self.data.add(at + HEADER), out.as_mut_ptr(), len) };
        self.tail().store(tail + need as u64, Ordering::Release);
        Ok(Some(len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Owned {
        words: Vec<u64>,
    }

    fn ring(o: &mut Owned, size: usize) -> Ring {
        o.words = vec![0; 2 + size / 8];
        let p = o.words.as_mut_ptr();
        // SAFETY: the vector outlives the view in each test and the areas are disjoint.
        unsafe { Ring::new(p.cast(), p.add(1).cast(), p.add(2).cast(), size) }
    }

    #[test]
    fn packets_come_out_in_order_across_wraps() {
        let mut o = Owned { words: vec![] };
        let r = ring(&mut o, 1024);
        let mut out = vec![0u8; 1024];
        let mut next_in = 0u32;
        let mut next_out = 0u32;
        let mut lens = std::collections::VecDeque::new();
        for round in 0..2000 {
            let len = (round * 37) % 200 + 1;
            let pkt: Vec<u8> = (0..len).map(|i| (i as u32 ^ next_in) as u8).collect();
            if r.push(&pkt) {
                next_in += 1;
                lens.push_back(len as usize);
            }
            if round % 3 == 0 {
                while let Some(n) = r.pop(&mut out).unwrap() {
                    assert_eq!(n, lens.pop_front().unwrap());
                    assert!(out[..n]
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == (i as u32 ^ next_out) as u8));
                    next_out += 1;
                }
            }
        }
        while let Some(n) = r.pop(&mut out).unwrap() {
            assert!(out[..n]
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i as u32 ^ next_out) as u8));
            next_out += 1;
        }
        assert_eq!(next_in, next_out);
        assert!(next_in > 1000, "most pushes must fit: {next_in}");
    }

    #[test]
    fn a_full_ring_refuses_and_a_corrupt_length_is_an_error() {
        let mut o = Owned { words: vec![] };
        let r = ring(&mut o, 256);
        assert!(r.push(&[1; 64]));
        assert!(r.push(&[2; 64]));
        assert!(r.push(&[3; 64]));
        assert!(!r.push(&[4; 64]), "no room for a fourth 72-byte record");
        assert!(!r.push(&[5; 65]), "larger than a quarter of the ring");
        let mut out = [0u8; 256];
        assert_eq!(r.pop(&mut out), Ok(Some(64)));
        assert_eq!(out[..64], [1; 64]);
        // The peer scribbles a length larger than the ring into the next record.
        o.words[2 + 9] = 10_000;
        assert_eq!(r.pop(&mut out), Err(RingError));
    }
}
