//! The responder's reorder buffer, for selective repeat.
//!
//! An IBTA responder drops every request packet that arrives after a gap and NAKs the gap once,
//! so the requester must send everything from the gap on again (go-back-N): on a lossy path
//! each drop costs a window. Between two ferroce peers that negotiated selective repeat, the
//! responder instead keeps a copy of each packet that arrives ahead of the expected PSN (up to
//! [`REORDER_CAPACITY`] PSNs ahead) and, once the gap is filled, feeds the kept packets through
//! the same in-order path as if they had just arrived. Execution therefore stays in PSN order —
//! opcode sequence, receive requests, MSN, the READ/atomic replay cache and exactly-once
//! atomics are untouched — and only the holes travel twice. The buffer holds raw packets (the
//! ICRC was checked on arrival) and is dropped whole whenever the in-order path stops (an RNR
//! NAK or a fatal error): the requester then goes back as it would anyway.

use ferroce_wire::Psn;

/// How many PSNs past the expected one the buffer reaches. A requester's window is at most
/// [`crate::requester::MAX_UNACKED_PSNS`]; packets beyond this reach are dropped (counted) and
/// come again after the hole is filled.
pub const REORDER_CAPACITY: u32 = 512;

/// Why a packet was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotHeld {
    /// It is not ahead of the expected PSN, or too far ahead.
    OutOfReach,
    /// A copy is already kept.
    Duplicate,
}

/// Packets kept ahead of a gap, by PSN.
#[derive(Debug, Default)]
pub struct ReorderBuffer {
    /// Slot `psn % REORDER_CAPACITY`: the PSN and bytes kept there (allocated at the first
    /// packet kept).
    slots: Vec<Option<(u32, Vec<u8>)>>,
    /// Packets kept.
    held: usize,
    /// Buffers of packets already fed back, for reuse.
    spare: Vec<Vec<u8>>,
}

impl ReorderBuffer {
    /// Keeps a copy of `bytes`, the packet with `psn`, while `expected` is the next PSN in
    /// order.
    pub fn hold(&mut self, expected: Psn, psn: Psn, bytes: &[u8]) -> Result<(), NotHeld> {
        let d = psn.signed_distance_from(expected);
        if d <= 0 || d as u32 >= REORDER_CAPACITY {
            return Err(NotHeld::OutOfReach);
        }
        if self.slots.is_empty() {
            self.slots = (0..REORDER_CAPACITY).map(|_| None).collect();
        }
        let slot = &mut self.slots[(psn.value() % REORDER_CAPACITY) as usize];
        if slot.as_ref().is_some_and(|(p, _)| *p == psn.value()) {
            return Err(NotHeld::Duplicate);
        }
        // A stale packet from before a wrap cannot be there: the buffer is emptied whenever
        // the in-order path stops, and it only reaches less than its capacity ahead.
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(bytes);
        if let Some((_, old)) = slot.replace((psn.value(), buf)) {
            self.spare.push(old);
        } else {
            self.held += 1;
        }
        Ok(())
    }

    /// Takes the packet kept for `psn`, if any. Hand its buffer back with [`Self::recycle`].
    pub fn take(&mut self, psn: Psn) -> Option<Vec<u8>> {
        if self.held == 0 {
            return None;
        }
        let slot = &mut self.slots[(psn.value() % REORDER_CAPACITY) as usize];
        if slot.as_ref().is_some_and(|(p, _)| *p == psn.value()) {
            self.held -= 1;
            return slot.take().map(|(_, b)| b);
        }
        None
    }

    /// Which PSNs after `expected` are kept, as a SACK carries them (see [`crate::sack`]): bit
    /// `i % 8` of byte `i / 8` for `expected + 1 + i`.
    pub fn bitmap(&self, expected: Psn) -> [u8; crate::sack::SACK_BITMAP_BYTES] {
        let mut map = [0u8; crate::sack::SACK_BITMAP_BYTES];
        if self.held == 0 {
            return map;
        }
        for i in 0..REORDER_CAPACITY - 1 {
            let psn = expected.add(1 + i);
            let kept = self.slots[(psn.value() % REORDER_CAPACITY) as usize]
                .as_ref()
                .is_some_and(|(p, _)| *p == psn.value());
            if kept {
                map[i as usize / 8] |= 1 << (i % 8);
            }
        }
        map
    }

    /// Returns a buffer from [`Self::take`] for reuse.
    pub fn recycle(&mut self, buf: Vec<u8>) {
        if self.spare.len() < 64 {
            self.spare.push(buf);
        }
    }

    /// Drops every packet kept for a PSN before `expected` (skipped over, never to be taken).
    pub fn drop_before(&mut self, expected: Psn) {
        if self.held == 0 {
            return;
        }
        for slot in &mut self.slots {
            let stale = slot
                .as_ref()
                .is_some_and(|(p, _)| Psn::new(*p).signed_distance_from(expected) < 0);
            if stale {
                if let Some((_, b)) = slot.take() {
                    self.held -= 1;
                    if self.spare.len() < 64 {
                        self.spare.push(b);
                    }
                }
            }
        }
    }

    /// Drops every packet kept.
    pub fn clear(&mut self) {
        if self.held == 0 {
            return;
        }
        for slot in &mut self.slots {
            if let Some((_, b)) = slot.take() {
                if self.spare.len() < 64 {
                    self.spare.push(b);
                }
            }
        }
        self.held = 0;
    }

    /// How many packets are kept.
    pub fn len(&self) -> usize {
        self.held
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.held == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_packets_ahead_within_reach_and_each_once() {
        let mut b = ReorderBuffer::default();
        let e = Psn::new(0xff_fff0);
        assert_eq!(b.hold(e, e, b"x"), Err(NotHeld::OutOfReach));
        assert_eq!(b.hold(e, e.sub(1), b"x"), Err(NotHeld::OutOfReach));
        assert_eq!(
            b.hold(e, e.add(REORDER_CAPACITY), b"x"),
            Err(NotHeld::OutOfReach)
        );
        // Across the 24-bit wrap.
        assert_eq!(b.hold(e, e.add(20), b"twenty"), Ok(()));
        assert_eq!(b.hold(e, e.add(20), b"again"), Err(NotHeld::Duplicate));
        assert_eq!(b.hold(e, e.add(1), b"one"), Ok(()));
        assert_eq!(b.len(), 2);
        assert_eq!(b.take(e), None);
        assert_eq!(b.take(e.add(1)).as_deref(), Some(&b"one"[..]));
        assert_eq!(b.take(e.add(1)), None);
        assert_eq!(b.take(e.add(20)).as_deref(), Some(&b"twenty"[..]));
        assert!(b.is_empty());
    }

    #[test]
    fn the_bitmap_marks_what_is_kept_after_the_expected_psn() {
        let mut b = ReorderBuffer::default();
        let e = Psn::new(0xff_fffa);
        assert_eq!(b.bitmap(e), [0; crate::sack::SACK_BITMAP_BYTES]);
        for k in [1, 3, 9, REORDER_CAPACITY - 1] {
            b.hold(e, e.add(k), b"x").unwrap();
        }
        let map = b.bitmap(e);
        let set: Vec<u32> = (0..REORDER_CAPACITY)
            .filter(|&i| map[i as usize / 8] & (1 << (i % 8)) != 0)
            .collect();
        assert_eq!(set, [0, 2, 8, REORDER_CAPACITY - 2]);
        let holes: Vec<Psn> = crate::sack::holes(e.sub(1), crate::sack::trimmed(&map)).collect();
        let mut want = vec![e, e.add(2)];
        want.extend((4..9).chain(10..REORDER_CAPACITY - 1).map(|k| e.add(k)));
        assert_eq!(holes, want);
    }

    #[test]
    fn packets_skipped_over_are_dropped() {
        let mut b = ReorderBuffer::default();
        let e = Psn::new(10);
        for k in [2, 3, 9] {
            b.hold(e, e.add(k), &[k as u8]).unwrap();
        }
        b.drop_before(e.add(4));
        assert_eq!(b.len(), 1);
        assert_eq!(b.take(e.add(9)).as_deref(), Some(&[9u8][..]));
    }

    #[test]
    fn clear_drops_everything() {
        let mut b = ReorderBuffer::default();
        let e = Psn::new(5);
        for k in 1..10 {
            b.hold(e, e.add(k), &[k as u8]).unwrap();
        }
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.take(e.add(3)), None);
        b.hold(e, e.add(3), b"3").unwrap();
        assert_eq!(b.take(e.add(3)).as_deref(), Some(&b"3"[..]));
    }
}
