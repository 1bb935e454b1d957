//! The smallest round trip each peer's QPs measured, shared by the QPs of a context.
//!
//! The delay-based window (`ferroce_proto::cc`) measures queueing as the RTT above the path's
//! delay without queues, which each QP learns as its smallest recent sample. A QP that starts
//! while others already fill the bottleneck's queue never sees the path empty: it would take
//! the queued round trip for the base, read no queueing and keep its window while the others
//! shrink theirs (TCP Vegas' latecomer problem). The QPs of one context to one peer socket
//! (address and UDP port: the same host's other processes, or the paths ECMP picks by port,
//! may differ) cross the same path, and the first of them to start saw it empty: each busy QP
//! offers its smallest sample here, at most once per [`SHARE_PERIOD`], and the smallest of all
//! comes back for it to measure against (`ferroce_proto::QueuePair::set_path_min_rtt`). An
//! entry is renewed while some QP still measures its figure, and otherwise lasts
//! [`ferroce_proto::rtt::MIN_RTT_WINDOW`], as a QP's own minimum does, so a path that got
//! longer is learnt again; expired entries are dropped once there are more than
//! [`PRUNE_ABOVE`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use ferroce_proto::Instant;

/// How often a QP offers its minimum and takes the path's.
pub(crate) const SHARE_PERIOD: Duration = Duration::from_millis(1);

/// Paths a context remembers before it drops the expired ones.
pub(crate) const PRUNE_ABOVE: usize = 64;

/// Per peer socket: the smallest RTT offered, and when.
#[derive(Debug, Default)]
pub(crate) struct PathRtts(Mutex<HashMap<SocketAddr, (Duration, Instant)>>);

impl PathRtts {
    /// Offers `qp_min`, the smallest recent RTT of a QP to `peer`, and returns the smallest
    /// recent RTT of any QP to `peer`.
    pub(crate) fn share(&self, peer: SocketAddr, qp_min: Duration, now: Instant) -> Duration {
        let window = ferroce_proto::rtt::MIN_RTT_WINDOW;
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() > PRUNE_ABOVE && !map.contains_key(&peer) {
            map.retain(|_, (_, at)| now.saturating_since(*at) <= window);
        }
        let entry = map.entry(peer).or_insert((qp_min, now));
        if qp_min <= entry.0 || now.saturating_since(entry.1) > window {
            *entry = (qp_min, now);
        }
        entry.0
    }

    /// Paths remembered (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn the_smallest_per_peer_wins_and_ages_out() {
        let p = PathRtts::default();
        let a = SocketAddr::from(([10, 0, 0, 1], 4791));
        let b = SocketAddr::from(([10, 0, 0, 1], 4792));
        let t0 = Instant::ZERO;
        assert_eq!(p.share(a, us(40), t0), us(40));
        // A latecomer that saw only queued round trips gets the first one's base.
        assert_eq!(p.share(a, us(900), t0 + us(10)), us(40));
        // Another peer socket is another path (another process, or another ECMP path).
        assert_eq!(p.share(b, us(700), t0), us(700));
        assert_eq!(p.share(a, us(35), t0 + us(20)), us(35));
        // After the window a path's base is learnt anew (it may have got longer).
        let later = t0 + ferroce_proto::rtt::MIN_RTT_WINDOW + us(100);
        assert_eq!(p.share(a, us(120), later), us(120));
        // While some QP still measures the figure, it is renewed and does not expire.
        let much_later = later + ferroce_proto::rtt::MIN_RTT_WINDOW;
        assert_eq!(p.share(a, us(120), later + us(5)), us(120));
        assert_eq!(p.share(a, us(400), much_later), us(120));
    }

    #[test]
    fn expired_paths_are_dropped_when_many_are_remembered() {
        let p = PathRtts::default();
        let t0 = Instant::ZERO;
        for port in 0..=PRUNE_ABOVE as u16 {
            p.share(SocketAddr::from(([10, 0, 0, 1], port)), us(50), t0);
        }
        assert_eq!(p.len(), PRUNE_ABOVE + 1);
        let later = t0 + ferroce_proto::rtt::MIN_RTT_WINDOW + us(1);
        p.share(SocketAddr::from(([10, 0, 0, 9], 1)), us(50), later);
        assert_eq!(p.len(), 1);
    }
}
