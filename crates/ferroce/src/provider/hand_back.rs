//! When a polling application thread hands progress back to the engine thread.
//!
//! With [`ContextOptions::hand_back_at_completion`](crate::ContextOptions::hand_back_at_completion)
//! (the drop-in libibverbs sets it) a CQ poll that returns completions may be the program's
//! last for a while, or the first of many. The two kinds want opposite things:
//! - perftest's `ib_write_lat` polls for its WRITE's completion, then spins on memory for the
//!   peer's WRITE, which only the engine thread can land: it must read the socket again, or the
//!   WRITE waits out the hand-over's whole grace period.
//! - `ibv_rc_pingpong` re-posts and polls again within a µs or two. Waking the engine thread
//!   at each of its completions costs an eventfd write and a wake-up per completion, and on a
//!   2-vCPU machine a third runnable thread beside two spinning ones: over shared memory 35 µs
//!   per iteration with that wake-up, 6 µs without.
//!
//! So a hand-back is *lazy* by default: it only records when it happened, and the
//! application's next poll clears that. The engine thread, asleep while handed over, checks in
//! every [`CHECK_IN`] instead of every grace period; one that finds a hand-back no poll followed
//! within [`MISSED_AFTER`] takes the socket back at once, and hand-backs are *immediate* (the
//! engine thread woken at each) for [`IMMEDIATE_FOR`], after which laziness is tried again. A
//! program that waits on memory so pays at most one check-in period per [`IMMEDIATE_FOR`]; one
//! that polls pays nothing per completion. Timing each return with a timer instead (armed at
//! each hand-back, disarmed at the next poll) cost two `timerfd_settime` calls per completion,
//! which in a VM reprogram the CPU's timer: 20 µs per `ibv_rc_pingpong` iteration instead of 6.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often the engine thread looks in while an application thread that may hand back lazily
/// drives progress: the most a wrongly lazy hand-back costs.
pub(crate) const CHECK_IN: Duration = Duration::from_micros(250);
/// A hand-back that no poll followed for this long was missed: the program waits some other way.
pub(crate) const MISSED_AFTER: Duration = Duration::from_micros(150);
/// How long hand-backs stay immediate after a missed one, at first: each miss that follows
/// soon after the last (within four times the hold) doubles it, up to [`IMMEDIATE_MAX`], so a
/// program that always waits on memory pays for a handful of misses and then one every
/// [`IMMEDIATE_MAX`]; a poller whose thread was once descheduled past [`MISSED_AFTER`] is lazy
/// again after this.
pub(crate) const IMMEDIATE_FOR: Duration = Duration::from_millis(20);
/// The longest hold of immediate hand-backs.
pub(crate) const IMMEDIATE_MAX: Duration = Duration::from_secs(2);

/// A context's hand-back state (times in ns since the context's epoch).
#[derive(Debug, Default)]
pub(crate) struct HandBack {
    /// When the last lazy hand-back happened that no poll has followed yet; 0 if none.
    handed_at: AtomicU64,
    /// Until when hand-backs are immediate.
    immediate_until: AtomicU64,
    /// When the last miss was, and the hold it started.
    last_miss: AtomicU64,
    hold: AtomicU64,
    /// Lazy hand-backs that no poll followed (the engine thread took over).
    missed: AtomicU64,
}

impl HandBack {
    /// The application polls: a pending lazy hand-back was not needed. Every poll calls it, so
    /// the common case is one load.
    #[inline]
    pub(crate) fn polled(&self) {
        if self.handed_at.load(Ordering::Relaxed) != 0 {
            self.handed_at.store(0, Ordering::Relaxed);
        }
    }

    /// A poll returned completions at `now_ns`; returns whether the hand-back may be lazy (else
    /// the caller ends the hand-over now).
    pub(crate) fn hand_back(&self, now_ns: u64) -> bool {
        if now_ns < self.immediate_until.load(Ordering::Relaxed) {
            return false;
        }
        self.handed_at.store(now_ns.max(1), Ordering::Relaxed);
        true
    }

    /// The engine thread checks in at `now_ns`: whether a lazy hand-back went unfollowed for
    /// [`MISSED_AFTER`], in which case the engine must take progress back now (and hand-backs
    /// turn immediate for a while).
    pub(crate) fn missed(&self, now_ns: u64) -> bool {
        let at = self.handed_at.load(Ordering::Relaxed);
        if at == 0 || now_ns.saturating_sub(at) < MISSED_AFTER.as_nanos() as u64 {
            return false;
        }
        self.handed_at.store(0, Ordering::Relaxed);
        let (last, hold) = (
            self.last_miss.load(Ordering::Relaxed),
            self.hold.load(Ordering::Relaxed),
        );
        let hold = if last != 0 && now_ns.saturating_sub(last) < hold.saturating_mul(4) {
            hold.saturating_mul(2).min(IMMEDIATE_MAX.as_nanos() as u64)
        } else {
            IMMEDIATE_FOR.as_nanos() as u64
        };
        self.hold.store(hold, Ordering::Relaxed);
        self.last_miss.store(now_ns, Ordering::Relaxed);
        self.immediate_until.store(now_ns + hold, Ordering::Relaxed);
        self.missed.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// How long the engine thread may sleep while handed over before it must check in: until
    /// a pending hand-back would count as missed, and at most [`CHECK_IN`]. While hand-backs
    /// are immediate nothing can be missed, and each check-in would only preempt a spinning
    /// application: then until the hold ends, and at most `grace`.
    pub(crate) fn check_in_after(&self, now_ns: u64, grace: Duration) -> Duration {
        let immediate_until = self.immediate_until.load(Ordering::Relaxed);
        if now_ns < immediate_until {
            return Duration::from_nanos(immediate_until - now_ns).min(grace);
        }
        let at = self.handed_at.load(Ordering::Relaxed);
        if at == 0 {
            return CHECK_IN.min(grace);
        }
        let due = at + MISSED_AFTER.as_nanos() as u64;
        Duration::from_nanos(due.saturating_sub(now_ns))
            .min(CHECK_IN)
            .min(grace)
    }

    /// Lazy hand-backs that went unfollowed so far.
    pub(crate) fn missed_count(&self) -> u64 {
        self.missed.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    #[test]
    fn a_followed_hand_back_is_never_missed() {
        let hb = HandBack::default();
        let mut t = 1_000 * US;
        for _ in 0..100 {
            assert!(hb.hand_back(t));
            t += 2 * US;
            hb.polled();
            t += 1_000 * US;
            assert!(!hb.missed(t));
        }
        assert_eq!(hb.missed_count(), 0);
        assert_eq!(hb.check_in_after(t, Duration::from_millis(4)), CHECK_IN);
    }

    #[test]
    fn an_unfollowed_hand_back_is_missed_once_and_turns_hand_backs_immediate_for_a_while() {
        let hb = HandBack::default();
        let t = 1_000 * US;
        assert!(hb.hand_back(t));
        // The engine thread is told to look in when the hand-back would count as missed.
        let grace = Duration::from_millis(4);
        assert_eq!(
            hb.check_in_after(t + 10 * US, grace),
            MISSED_AFTER - Duration::from_micros(10)
        );
        assert!(!hb.missed(t + 10 * US));
        assert!(hb.missed(t + MISSED_AFTER.as_nanos() as u64));
        assert!(
            !hb.missed(t + 2 * MISSED_AFTER.as_nanos() as u64),
            "missed twice"
        );
        assert_eq!(hb.missed_count(), 1);
        let later = t + MISSED_AFTER.as_nanos() as u64;
        // While hand-backs are immediate the engine thread need not check in.
        assert_eq!(hb.check_in_after(later, grace), grace);
        assert_eq!(
            hb.check_in_after(later + IMMEDIATE_FOR.as_nanos() as u64 - US, grace),
            Duration::from_micros(1)
        );
        assert!(!hb.hand_back(later + US));
        assert!(!hb.hand_back(later + IMMEDIATE_FOR.as_nanos() as u64 - US));
        // Then laziness is tried again.
        assert!(hb.hand_back(later + IMMEDIATE_FOR.as_nanos() as u64));
    }

    #[test]
    fn misses_in_a_row_hold_immediate_hand_backs_longer_up_to_the_most() {
        let hb = HandBack::default();
        let mut t = 1_000 * US;
        let mut holds = Vec::new();
        // A program that always waits on memory: each lazy try is missed.
        for _ in 0..12 {
            while !hb.hand_back(t) {
                t += 1_000 * US;
            }
            let handed = t;
            t += MISSED_AFTER.as_nanos() as u64;
            assert!(hb.missed(t));
            let mut free = t;
            while !hb.hand_back(free) {
                free += 1_000 * US;
            }
            hb.polled();
            holds.push((free - t) / 1_000_000);
            t = free.max(handed);
        }
        assert_eq!(&holds[..4], &[20, 40, 80, 160], "{holds:?}");
        assert_eq!(*holds.last().unwrap(), IMMEDIATE_MAX.as_millis() as u64);
        // A miss long after the last one starts over.
        t += 10 * IMMEDIATE_MAX.as_nanos() as u64;
        assert!(hb.hand_back(t));
        assert!(hb.missed(t + MISSED_AFTER.as_nanos() as u64));
        assert!(hb.hand_back(t + MISSED_AFTER.as_nanos() as u64 + IMMEDIATE_FOR.as_nanos() as u64));
    }
}
