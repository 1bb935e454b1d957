//! 24-bit packet sequence numbers.
//!
//! PSNs wrap at 2^24. Two PSNs are ordered by their distance modulo 2^24: `b` is after `a` when
//! `b - a (mod 2^24)` is below 2^23, the half-space rule the IBTA uses to tell a duplicate (behind
//! the expected PSN) from a packet that arrived early (ahead of it).

use core::fmt;

/// Mask of the 24 PSN bits.
pub const PSN_MASK: u32 = 0x00ff_ffff;
/// Half the PSN space: distances below it count as "ahead", others as "behind".
pub const PSN_HALF: u32 = 1 << 23;

/// A 24-bit packet sequence number with wrapping arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// The PSN `value` modulo 2^24.
    pub const fn new(value: u32) -> Psn {
        Psn(value & PSN_MASK)
    }

    /// The 24-bit value.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// `self + n` modulo 2^24.
    pub const fn add(self, n: u32) -> Psn {
        Psn(self.0.wrapping_add(n) & PSN_MASK)
    }

    /// `self - n` modulo 2^24.
    pub const fn sub(self, n: u32) -> Psn {
        Psn(self.0.wrapping_sub(n) & PSN_MASK)
    }

    /// The next PSN.
    pub const fn next(self) -> Psn {
        self.add(1)
    }

    /// How far `self` is ahead of `base`, modulo 2^24 (0 when equal).
    pub const fn distance_from(self, base: Psn) -> u32 {
        self.0.wrapping_sub(base.0) & PSN_MASK
    }

    /// Signed distance from `base` in the half-space rule: positive when `self` is after `base`.
    pub const fn signed_distance_from(self, base: Psn) -> i32 {
        let d = self.distance_from(base);
        if d < PSN_HALF {
            d as i32
        } else {
            d as i32 - (1 << 24)
        }
    }

    /// Whether `self` comes strictly after `other` in the half-space rule.
    pub const fn is_after(self, other: Psn) -> bool {
        self.signed_distance_from(other) > 0
    }

    /// Whether `self` comes strictly before `other` in the half-space rule.
    pub const fn is_before(self, other: Psn) -> bool {
        self.signed_distance_from(other) < 0
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<Psn> for u32 {
    fn from(p: Psn) -> u32 {
        p.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_at_24_bits() {
        let top = Psn::new(PSN_MASK);
        assert_eq!(top.next(), Psn::new(0));
        assert_eq!(Psn::new(0).sub(1), top);
        assert_eq!(Psn::new(1 << 24 | 5).value(), 5);
    }

    #[test]
    fn ordering_across_wrap() {
        let a = Psn::new(PSN_MASK - 2);
        let b = a.add(5);
        assert_eq!(b.value(), 2);
        assert!(b.is_after(a));
        assert!(a.is_before(b));
        assert_eq!(b.signed_distance_from(a), 5);
        assert_eq!(a.signed_distance_from(b), -5);
        assert!(!a.is_after(a));
    }

    #[test]
    fn half_space_boundary() {
        let a = Psn::new(0);
        assert!(Psn::new(PSN_HALF - 1).is_after(a));
        assert!(Psn::new(PSN_HALF).is_before(a));
    }
}
