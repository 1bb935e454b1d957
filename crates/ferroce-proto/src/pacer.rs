//! Pacing: a token bucket that spreads a QP's data packets over the round trip.
//!
//! A window says how much may be in flight, not how fast it leaves. Without pacing a QP hands a
//! whole window to the socket at once (the UDP provider sends runs of packets as one GSO
//! burst), which arrives at a bottleneck as a line-rate burst and overflows short queues even
//! when the window is right. The bucket fills at the rate the window allows
//! (`PACING_GAIN · cwnd · packet / srtt`, capped by an ECN reaction rate where one applies) and
//! holds at most a quantum of about [`QUANTUM_TIME`] of that rate (between two and
//! [`MAX_QUANTUM_PACKETS`] packets), so no burst the QP makes is longer than that. A packet that
//! finds too few tokens waits: the requester reports the release time through
//! `QueuePair::next_timeout`, so drivers need nothing new.
//!
//! Only data-bearing requests are paced; ACKs, NAKs and READ responses never wait here.

use core::time::Duration;

use crate::time::Instant;

/// How far ahead of the window's average rate the pacer lets packets leave: above one, so the
/// window (ACK clocking) binds in steady state and the pacer only breaks up bursts.
pub const PACING_GAIN: f64 = 2.0;
/// The burst the bucket holds, in time at the pacing rate.
pub const QUANTUM_TIME: Duration = Duration::from_micros(100);
/// The largest burst in packets, whatever the rate.
pub const MAX_QUANTUM_PACKETS: u64 = 32;

/// A token bucket in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pacer {
    /// Bytes that may leave now.
    tokens: u64,
    /// When `tokens` was last brought up to date.
    at: Instant,
    /// Whether the bucket has been filled once (it starts full).
    started: bool,
}

impl Pacer {
    /// Whether a packet of `len` bytes may leave at `now` at `rate` bytes per second, given
    /// packets of `packet` bytes; if not, when it may. Leaving takes the tokens.
    pub fn take(&mut self, now: Instant, rate: u64, packet: u64, len: u64) -> Result<(), Instant> {
        let rate = rate.max(1);
        let capacity = ((rate as u128 * QUANTUM_TIME.as_nanos() / 1_000_000_000) as u64)
            .clamp(2 * packet, MAX_QUANTUM_PACKETS * packet);
        if !self.started {
            self.started = true;
            self.tokens = capacity;
        } else {
            let elapsed = now.saturating_since(self.at).as_nanos();
            let earned = (elapsed.saturating_mul(rate as u128) / 1_000_000_000) as u64;
            self.tokens = self.tokens.saturating_add(earned).min(capacity);
        }
        self.at = now;
        if self.tokens >= len {
            self.tokens -= len;
            return Ok(());
        }
        let missing = (len - self.tokens) as u128;
        let wait = (missing * 1_000_000_000).div_ceil(rate as u128);
        Err(now + Duration::from_nanos(wait as u64))
    }
}

/// The pacing rate in bytes per second for a window of `cwnd` packets of `packet` bytes over a
/// round trip of `srtt`.
pub fn window_rate(cwnd: f64, packet: u64, srtt: Duration) -> u64 {
    let srtt = srtt.as_secs_f64().max(1e-6);
    let gain = if cwnd < 1.0 { 1.0 } else { PACING_GAIN };
    (gain * cwnd * packet as f64 / srtt).max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_bucket_releases_a_quantum_then_spaces_packets_at_the_rate() {
        let mut p = Pacer::default();
        let t0 = Instant::ZERO;
        // 125 MB/s (1 Gbit/s): 100 µs holds 12,500 bytes, 12 packets of 1,000.
        let rate = 125_000_000;
        for _ in 0..12 {
            assert_eq!(p.take(t0, rate, 1000, 1000), Ok(()));
        }
        let Err(at) = p.take(t0, rate, 1000, 1000) else {
            panic!("a 13th packet left at once")
        };
        // 500 bytes were left: 500 more take 4 µs.
        assert_eq!(at, t0 + Duration::from_micros(4));
        assert_eq!(p.take(at, rate, 1000, 1000), Ok(()));
        // The next one 8 µs later.
        assert_eq!(
            p.take(at, rate, 1000, 1000),
            Err(at + Duration::from_micros(8))
        );
    }

    #[test]
    fn the_quantum_is_at_least_two_packets_and_at_most_the_cap() {
        let mut slow = Pacer::default();
        assert!(slow.take(Instant::ZERO, 1000, 1500, 1500).is_ok());
        assert!(slow.take(Instant::ZERO, 1000, 1500, 1500).is_ok());
        assert!(slow.take(Instant::ZERO, 1000, 1500, 1500).is_err());
        let mut fast = Pacer::default();
        let n = (0..1000)
            .take_while(|_| fast.take(Instant::ZERO, u64::MAX / 2, 4096, 4096).is_ok())
            .count();
        assert_eq!(n as u64, MAX_QUANTUM_PACKETS);
    }

    #[test]
    fn window_rate_is_the_window_per_round_trip_with_gain() {
        let r = window_rate(10.0, 1000, Duration::from_micros(100));
        assert_eq!(r, (PACING_GAIN * 100_000_000.0) as u64);
        // Under a packet, no gain: one packet per srtt/cwnd.
        assert_eq!(window_rate(0.5, 1000, Duration::from_millis(1)), 500_000);
    }
}
