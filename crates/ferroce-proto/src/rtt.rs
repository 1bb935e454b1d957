//! Round-trip time, measured by the requester alone.
//!
//! The requester stamps each packet it sends (see `Requester::sent_at`) and takes a sample when
//! an acknowledgement covers a packet that asked for it and was sent only once (Karn's rule: an
//! answer to a retransmitted packet may answer either copy). Packets that did not ask are not
//! sampled: a ferroce responder holds their acknowledgement for up to
//! [`crate::responder::UNASKED_ACK_DELAY`], which is not path delay. No help from the peer is
//! needed, so this works the same against rxe or a NIC.
//!
//! From the samples: the smoothed RTT and its variation (RFC 6298), which give the
//! retransmission timeout, and the minimum RTT over a window of [`MIN_RTT_WINDOW`], which is the
//! path's delay without queues: what the delay-based congestion control measures queueing
//! against.

use core::time::Duration;

use crate::time::Instant;

/// How long a minimum RTT stays valid: a path that changed (a longer route) is learnt within
/// this, and a queue that never drains cannot hide the base delay for longer.
pub const MIN_RTT_WINDOW: Duration = Duration::from_secs(10);

/// The RTT estimator of one QP.
#[derive(Debug, Clone, Copy, Default)]
pub struct RttEstimator {
    /// Smoothed RTT, once a sample was taken.
    srtt: Option<Duration>,
    /// RTT variation (RFC 6298's RTTVAR).
    rttvar: Duration,
    /// Smallest sample within [`MIN_RTT_WINDOW`] of `min_rtt_at`.
    min_rtt: Duration,
    /// When `min_rtt` was taken.
    min_rtt_at: Instant,
    /// The last sample.
    latest: Duration,
    /// Samples taken.
    samples: u64,
}

impl RttEstimator {
    /// Takes one RTT sample.
    pub fn on_sample(&mut self, now: Instant, rtt: Duration) {
        self.latest = rtt;
        self.samples += 1;
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
                self.min_rtt = rtt;
                self.min_rtt_at = now;
            }
            Some(srtt) => {
                let diff = if srtt > rtt { srtt - rtt } else { rtt - srtt };
                self.rttvar = (self.rttvar * 3 + diff) / 4;
                self.srtt = Some((srtt * 7 + rtt) / 8);
                if rtt <= self.min_rtt || now.saturating_since(self.min_rtt_at) > MIN_RTT_WINDOW {
                    self.min_rtt = rtt;
                    self.min_rtt_at = now;
                }
            }
        }
    }

    /// The smoothed RTT, if any sample was taken.
    pub fn srtt(&self) -> Option<Duration> {
        self.srtt
    }

    /// The RTT variation.
    pub fn rttvar(&self) -> Duration {
        self.rttvar
    }

    /// The smallest recent sample (zero before the first).
    pub fn min_rtt(&self) -> Duration {
        self.min_rtt
    }

    /// The last sample (zero before the first).
    pub fn latest(&self) -> Duration {
        self.latest
    }

    /// How many samples were taken.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// RFC 6298's retransmission timeout, `srtt + max(4·rttvar, granularity)`, within
    /// `[floor, ceiling]`; `ceiling` before the first sample.
    pub fn rto(&self, granularity: Duration, floor: Duration, ceiling: Duration) -> Duration {
        match self.srtt {
            None => ceiling,
            Some(srtt) => (srtt + (self.rttvar * 4).max(granularity))
                .max(floor)
                .min(ceiling),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn the_first_sample_sets_srtt_and_half_of_it_as_variation() {
        let mut r = RttEstimator::default();
        assert_eq!(r.srtt(), None);
        assert_eq!(r.rto(us(10), us(300), us(67_000)), us(67_000));
        r.on_sample(Instant::ZERO, us(100));
        assert_eq!(r.srtt(), Some(us(100)));
        assert_eq!(r.rttvar(), us(50));
        assert_eq!(r.min_rtt(), us(100));
        // 100 + 4·50 = 300.
        assert_eq!(r.rto(us(10), us(1), us(67_000)), us(300));
    }

    #[test]
    fn later_samples_smooth_by_an_eighth_and_a_quarter() {
        let mut r = RttEstimator::default();
        r.on_sample(Instant::ZERO, us(100));
        r.on_sample(Instant::from_nanos(1), us(180));
        // srtt = (7·100 + 180)/8 = 110; rttvar = (3·50 + 80)/4 = 57.5.
        assert_eq!(r.srtt(), Some(us(110)));
        assert_eq!(r.rttvar(), Duration::from_nanos(57_500));
        assert_eq!(r.min_rtt(), us(100));
        assert_eq!(r.latest(), us(180));
        assert_eq!(r.samples(), 2);
    }

    #[test]
    fn the_timeout_stays_within_its_floor_and_ceiling() {
        let mut r = RttEstimator::default();
        for i in 0..50 {
            r.on_sample(Instant::from_nanos(i), us(20));
        }
        assert_eq!(r.rto(us(10), us(300), us(67_000)), us(300));
        let mut slow = RttEstimator::default();
        slow.on_sample(Instant::ZERO, Duration::from_millis(100));
        assert_eq!(slow.rto(us(10), us(300), us(67_000)), us(67_000));
    }

    #[test]
    fn the_minimum_expires_after_its_window() {
        let mut r = RttEstimator::default();
        r.on_sample(Instant::ZERO, us(50));
        r.on_sample(Instant::ZERO + Duration::from_secs(1), us(80));
        assert_eq!(r.min_rtt(), us(50));
        r.on_sample(Instant::ZERO + Duration::from_secs(11), us(90));
        assert_eq!(r.min_rtt(), us(90));
    }
}
