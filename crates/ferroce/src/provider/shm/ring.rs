//! A single-producer, single-consumer ring of packets in shared memory.
//!
//! The producer is the peer's engine (one at a time: its link's lock), the consumer this
//! context's engine. Each record is a 4-byte length, padding to 8, then the packet padded to 8;
//! a record that would not fit before the end leaves a wrap marker and starts again at 0. The
//! positions only grow (64-bit, never wrap in practice) and are published with release/acquire
//! ordering, so a record's bytes are visible before its position is.
//!
//! # The other side lies
//! The ring's page is writable by both processes, and the other one may be buggy or hostile.
//! So each side keeps its **own position privately** ([`Producer::head`], [`Consumer::tail`])
//! and only publishes it; the shared copy of its own position is never read back. The other
//! side's position is read from the page and **validated** before use: 8-aligned, never behind
//! the one it chases nor more than the ring's size ahead of it. Every record length is checked
//! against the ring and the caller's buffer. A lie reports [`RingError`] (the caller ends the
//! link), never a read or write outside the ring, a misaligned access or a panic.

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
        debug_assert!(size % 8 == 0 && size >= 64);
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

    /// Whether `behind..ahead` is a possible span of used ring: both 8-aligned, `ahead` not
    /// behind `behind` and at most the ring's size ahead of it.
    fn plausible(&self, behind: u64, ahead: u64) -> bool {
        (behind | ahead) % 8 == 0 && ahead >= behind && ahead - behind <= self.size as u64
    }

    /// The producer's end, starting from the position the page holds now (checked against
    /// the consumer's).
    pub(crate) fn producer(self) -> Result<Producer, RingError> {
        let head = self.head().load(Ordering::Acquire);
        let tail = self.tail().load(Ordering::Acquire);
        if !self.plausible(tail, head) {
            return Err(RingError);
        }
        Ok(Producer { ring: self, head })
    }

    /// The consumer's end, at position `tail` (kept by the consumer, see [`Consumer::tail`]).
    pub(crate) fn consumer(self, tail: u64) -> Consumer {
        Consumer { ring: self, tail }
    }
}

/// The producer's end of a ring: its own position, and a view of the rest.
#[derive(Debug)]
pub(crate) struct Producer {
    ring: Ring,
    head: u64,
}

impl Producer {
    /// The consumer's position, validated against ours.
    fn tail(&self) -> Result<u64, RingError> {
        let tail = self.ring.tail().load(Ordering::Acquire);
        if self.ring.plausible(tail, self.head) {
            Ok(tail)
        } else {
            Err(RingError)
        }
    }

    /// The largest packet a record can carry.
    pub(crate) fn max_packet(&self) -> usize {
        self.ring.max_packet()
    }

    /// Bytes a record of `len` bytes takes at our position, counting a wrap marker's waste.
    fn need(&self, len: usize) -> usize {
        let need = HEADER + pad8(len);
        let to_end = self.ring.size - (self.head as usize) % self.ring.size;
        if to_end < need {
            to_end + need
        } else {
            need
        }
    }

    /// How many more records of up to `max_len` bytes fit now, whatever the wrap costs.
    pub(crate) fn room_for(&self, max_len: usize) -> Result<usize, RingError> {
        let used = (self.head - self.tail()?) as usize;
        let record = HEADER + pad8(max_len);
        // One record's worth is kept back for a wrap marker's waste.
        Ok(((self.ring.size - used) / record).saturating_sub(1))
    }

    /// Appends a packet. Returns `Ok(false)` if there is no room.
    pub(crate) fn push(&mut self, pkt: &[u8]) -> Result<bool, RingError> {
        let used = (self.head - self.tail()?) as usize;
        if pkt.len() > self.max_packet() || self.ring.size - used < self.need(pkt.len()) {
            return Ok(false);
        }
        // A position about to pass 2^64 comes from a page that lied when the producer was
        // made (a real ring never gets there): refuse it, never wrap or overflow.
        if self.head.checked_add(self.need(pkt.len()) as u64).is_none() {
            return Err(RingError);
        }
        let size = self.ring.size;
        let mut at = (self.head as usize) % size;
        let need = HEADER + pad8(pkt.len());
        if size - at < need {
            // SAFETY: `at` is 8-aligned (our own position, only ever moved by multiples of 8)
            // and below `size`, so at least 8 bytes remain before the end.
            unsafe { self.ring.data.add(at).cast::<u32>().write_volatile(WRAP) };
            self.head += (size - at) as u64;
            at = 0;
        }
        // SAFETY: the room check showed `need` free bytes at `at` (after the wrap), inside the
        // ring; the consumer does not read them before `head` is published below.
        unsafe {
            self.ring
                .data
                .add(at)
                .cast::<u32>()
                .write_volatile(pkt.len() as u32);
            std::ptr::copy_nonoverlapping(pkt.as_ptr(), self.ring.data.add(at + HEADER), pkt.len());
        }
        self.head += need as u64;
        self.ring.head().store(self.head, Ordering::Release);
        Ok(true)
    }
}

/// The consumer's end of a ring: its own position, and a view of the rest.
#[derive(Debug)]
pub(crate) struct Consumer {
    ring: Ring,
    /// Our position: published after each record, never read back from the page.
    pub(crate) tail: u64,
}

impl Consumer {
    /// Takes the next packet into `out` and returns its length, `Ok(None)` when empty.
    pub(crate) fn pop(&mut self, out: &mut [u8]) -> Result<Option<usize>, RingError> {
        let size = self.ring.size;
        let head = self.ring.head().load(Ordering::Acquire);
        if !self.ring.plausible(self.tail, head) {
            return Err(RingError);
        }
        if head == self.tail {
            return Ok(None);
        }
        let mut tail = self.tail;
        let mut at = (tail as usize) % size;
        // SAFETY: `at` is 8-aligned (our own position) and below `size`.
        let mut len = unsafe { self.ring.data.add(at).cast::<u32>().read_volatile() };
        if len == WRAP {
            // The marker skips to the ring's end, which must be published (and not past 2^64).
            tail = match tail.checked_add((size - at) as u64) {
                Some(t) if t <= head => t,
                _ => return Err(RingError),
            };
            self.tail = tail;
            if tail == head {
                self.ring.tail().store(tail, Ordering::Release);
                return Ok(None);
            }
            at = 0;
            // SAFETY: offset 0 of the ring.
            len = unsafe { self.ring.data.cast::<u32>().read_volatile() };
        }
        let len = len as usize;
        let need = HEADER + pad8(len);
        if len > self.ring.max_packet()
            || len > out.len()
            || at + need > size
            || ((head - tail) as usize) < need
        {
            return Err(RingError);
        }
        // SAFETY: the record lies inside the ring (checked) and was published by `head`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ring.data.add(at + HEADER), out.as_mut_ptr(), len)
        };
        self.tail = tail + need as u64;
        self.ring.tail().store(self.tail, Ordering::Release);
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

    /// Writes `value` into word `index` of the ring's memory, as a lying peer would.
    fn poke(o: &mut Owned, index: usize, value: u64) {
        // SAFETY: inside the vector; the tests are single-threaded.
        unsafe { o.words.as_mut_ptr().add(index).write_volatile(value) }
    }

    #[test]
    fn packets_come_out_in_order_across_wraps() {
        let mut o = Owned { words: vec![] };
        let r = ring(&mut o, 1024);
        let mut prod = r.producer().unwrap();
        let mut cons = r.consumer(0);
        let mut out = vec![0u8; 1024];
        let mut next_in = 0u32;
        let mut next_out = 0u32;
        let mut lens = std::collections::VecDeque::new();
        for round in 0..2000 {
            let len = (round * 37) % 200 + 1;
            let pkt: Vec<u8> = (0..len).map(|i| (i as u32 ^ next_in) as u8).collect();
            if prod.push(&pkt).unwrap() {
                next_in += 1;
                lens.push_back(len as usize);
            }
            if round % 3 == 0 {
                while let Some(n) = cons.pop(&mut out).unwrap() {
                    assert_eq!(n, lens.pop_front().unwrap());
                    assert!(out[..n]
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == (i as u32 ^ next_out) as u8));
                    next_out += 1;
                }
            }
        }
        while let Some(n) = cons.pop(&mut out).unwrap() {
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
        let mut prod = r.producer().unwrap();
        let mut cons = r.consumer(0);
        assert_eq!(prod.push(&[1; 64]), Ok(true));
        assert_eq!(prod.push(&[2; 64]), Ok(true));
        assert_eq!(prod.push(&[3; 64]), Ok(true));
        assert_eq!(
            prod.push(&[4; 64]),
            Ok(false),
            "no room for a fourth 72-byte record"
        );
        assert_eq!(
            prod.push(&[5; 65]),
            Ok(false),
            "larger than a quarter of the ring"
        );
        let mut out = [0u8; 256];
        assert_eq!(cons.pop(&mut out), Ok(Some(64)));
        assert_eq!(out[..64], [1; 64]);
        // The peer scribbles a length larger than the ring into the next record.
        poke(&mut o, 2 + 9, 10_000);
        assert_eq!(cons.pop(&mut out), Err(RingError));
    }

    #[test]
    fn a_consumer_refuses_every_lying_head() {
        // Each lie the producer's page word can tell, after one good record at 0..72.
        let lies: [fn(u64) -> u64; 4] = [
            |_| 75,                // misaligned
            |_| 1 << 40,           // far beyond the ring's size ahead
            |t| t.wrapping_sub(8), // behind the consumer
            |_| !7,                // wrapped-around nonsense
        ];
        for lie in lies {
            let mut o = Owned { words: vec![] };
            let r = ring(&mut o, 1024);
            let mut prod = r.producer().unwrap();
            let mut cons = r.consumer(0);
            prod.push(&[7; 64]).unwrap();
            let mut out = [0u8; 1024];
            assert_eq!(cons.pop(&mut out), Ok(Some(64)));
            poke(&mut o, 0, lie(cons.tail));
            assert_eq!(cons.pop(&mut out), Err(RingError));
            assert_eq!(cons.tail, 72, "a lie moves nothing");
        }
    }

    #[test]
    fn the_consumers_own_tail_is_never_read_back() {
        let mut o = Owned { words: vec![] };
        let r = ring(&mut o, 1024);
        let mut prod = r.producer().unwrap();
        let mut cons = r.consumer(0);
        for b in 0..3u8 {
            prod.push(&[b; 16]).unwrap();
        }
        let mut out = [0u8; 64];
        assert_eq!(cons.pop(&mut out), Ok(Some(16)));
        // The peer rewrites the published tail to a misaligned spot inside a record.
        poke(&mut o, 1, 13);
        assert_eq!(cons.pop(&mut out), Ok(Some(16)));
        assert_eq!(out[..16], [1; 16]);
        assert_eq!(cons.pop(&mut out), Ok(Some(16)));
        assert_eq!(out[..16], [2; 16]);
        assert_eq!(cons.pop(&mut out), Ok(None));
    }

    /// Found by the `shm_ring` fuzz target (input `ff 06 00 00 00 02`, kept as
    /// `fuzz/corpus/shm_ring/regression-producer-head-past-2-pow-64`: a ring of 280 bytes whose
    /// page holds head = tail = 2^64 - 8, then a push of 0 bytes). A peer's QP page whose
    /// positions sit just below 2^64 (plausible: equal and 8-aligned) gave a producer whose
    /// first push moved its position past 2^64: a panic with overflow checks, a silent wrap
    /// without. The peer chooses that page when it sends its hello.
    #[test]
    fn fuzz_shm_ring_a_head_near_2_pow_64_is_refused_not_overflowed() {
        let mut o = Owned { words: vec![] };
        let r = ring(&mut o, 280);
        let p = u64::MAX - 7;
        poke(&mut o, 0, p);
        poke(&mut o, 1, p);
        let mut prod = r.producer().unwrap();
        assert_eq!(prod.push(&[]), Err(RingError), "a record past 2^64");
        assert_eq!(
            prod.push(&[1; 64]),
            Err(RingError),
            "a 64-byte record past 2^64"
        );
        assert_eq!(o.words[0], p, "the head word is left alone");
        assert!(o.words[2..].iter().all(|&w| w == 0), "nothing written");
    }

    /// Found by the `shm_ring` fuzz target (an 88-byte input, kept as
    /// `fuzz/corpus/shm_ring/regression-consumer-wrap-past-2-pow-64`): a consumer whose position
    /// sits just below 2^64 overflowed skipping a wrap marker (a panic with overflow checks).
    /// A consumer starts at 0, so only a position 2^64 bytes on gets there; refused all the
    /// same, as the module doc promises of every lie. Here: a ring of 64 bytes, the consumer at
    /// 2^64 - 16, the head word at 2^64 - 8, a wrap marker at offset 48.
    #[test]
    fn fuzz_shm_ring_a_wrap_past_2_pow_64_is_refused_not_overflowed() {
        let mut o = Owned { words: vec![] };
        let r = ring(&mut o, 64);
        poke(&mut o, 0, u64::MAX - 7);
        poke(&mut o, 2 + 6, u64::from(WRAP));
        let mut cons = r.consumer(u64::MAX - 15);
        let mut out = [0u8; 64];
        assert_eq!(cons.pop(&mut out), Err(RingError));
        assert_eq!(cons.tail, u64::MAX - 15, "a refused wrap moves nothing");
    }

    #[test]
    fn a_producer_refuses_every_lying_tail_and_writes_only_inside() {
        for lie in [13u64, 1 << 40, 4096, !7] {
            let mut o = Owned { words: vec![] };
            let r = ring(&mut o, 1024);
            let mut prod = r.producer().unwrap();
            prod.push(&[9; 64]).unwrap();
            poke(&mut o, 1, lie);
            assert_eq!(prod.push(&[9; 64]), Err(RingError), "tail {lie}");
            assert_eq!(prod.room_for(64), Err(RingError), "tail {lie}");
        }
        // A page whose positions already disagree gives no producer at all.
        let mut o = Owned { words: vec![] };
        let r = ring(&mut o, 1024);
        poke(&mut o, 0, 8);
        poke(&mut o, 1, 16);
        assert!(r.producer().is_err());
        // A head the consumer forged to one byte before the end cannot make the producer write
        // its wrap marker past the ring: the producer never reads its own head back.
        let mut o = Owned {
            words: vec![0; 2 + 1024 / 8 + 1],
        };
        let guard = 0xfeed_f00d_dead_beef;
        o.words[2 + 128] = guard;
        o.words.truncate(2 + 128);
        // SAFETY: as in `ring`; the guard word stays allocated right after the ring.
        let r = unsafe {
            let p = o.words.as_mut_ptr();
            Ring::new(p.cast(), p.add(1).cast(), p.add(2).cast(), 1024)
        };
        let mut prod = r.producer().unwrap();
        let mut cons = r.consumer(0);
        let mut out = [0u8; 1024];
        for i in 0..200u32 {
            poke(&mut o, 0, 1021);
            let _ = prod.push(&[i as u8; 200]);
            while let Ok(Some(_)) = cons.pop(&mut out) {}
        }
        // SAFETY: the word after the ring, still inside the allocation (capacity kept).
        assert_eq!(unsafe { o.words.as_ptr().add(2 + 128).read() }, guard);
    }
}
