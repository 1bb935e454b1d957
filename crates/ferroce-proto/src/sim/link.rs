//! A bottleneck link: a FIFO queue drained at a fixed rate, with tail drop and ECN marking.
//!
//! This is the model of a switch egress port or of Linux's `tbf` qdisc on a veth, the
//! bottleneck that congestion control exists for. Datagrams that many queue pairs send share
//! one [`Link`]; each waits behind the bytes already queued, is serialized at `rate_bps`, then
//! travels for `latency`. The link is exact in integer nanoseconds: every datagram's departure
//! is known the moment it arrives (`busy_until`), so the simulator schedules its delivery at
//! once and no per-link timer exists.
//!
//! * **Length on the wire.** The link counts what `tbf` counts: the datagram (BTH to ICRC) plus
//!   `per_packet_overhead_bytes` of Ethernet, IPv4 and UDP headers. A rate of 1 Gbit/s here is
//!   the rate `tbf rate 1gbit` enforces.
//! * **Backlog** is the wire bytes of datagrams that have not finished leaving, the one on the
//!   wire included: what a queue occupancy counter reads.
//! * **Tail drop**: an arrival is refused when `backlog + len > queue_limit_bytes`.
//! * **ECN**: an ECN-capable (ECT) arrival is marked Congestion Experienced when the backlog it
//!   finds is above `ecn_threshold_bytes` (the step marking DCQCN's switches are configured
//!   with: `K_min = K_max`); a non-ECT one is never marked, and is dropped only at the limit.
//! * **Queue delay** of a datagram is the time from its arrival to the start of its own
//!   serialization: zero on an idle link.
//!
//! [`Link::check`] verifies the invariants a FIFO must keep (conservation, the limit, FIFO
//! order, work conservation, exact timing, marking only above the threshold, and never more
//! than the rate); tests call it after every step.

use core::time::Duration;
use std::collections::VecDeque;

use crate::time::Instant;

/// Ethernet (14) + IPv4 (20) + UDP (8) header bytes: what a datagram's RoCE bytes (BTH to ICRC)
/// lack of the length `tbf` counts (the skb's length at a veth's egress; no FCS or preamble).
pub const ETH_IPV4_UDP_OVERHEAD: u64 = 14 + 20 + 8;

/// The parameters of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkConfig {
    /// Rate in bits per second of wire length; must not be 0.
    pub rate_bps: u64,
    /// Most wire bytes the queue holds, the datagram being sent included.
    pub queue_limit_bytes: u64,
    /// Mark ECT datagrams that find more than this many bytes queued; `None` never marks.
    pub ecn_threshold_bytes: Option<u64>,
    /// Bytes each datagram occupies beyond its RoCE bytes (see [`ETH_IPV4_UDP_OVERHEAD`]).
    pub per_packet_overhead_bytes: u64,
    /// Propagation delay after the last bit leaves. It replaces the [`super::NetConfig`]
    /// latency for datagrams that cross this link.
    pub latency: Duration,
}

impl LinkConfig {
    /// The link `tc qdisc add dev X root tbf rate <rate_bps> burst <burst_bytes> latency
    /// <tbf_latency>` makes, with `latency` of propagation. `tbf` sizes its queue as the bytes
    /// the rate sends in `tbf_latency` plus the burst, so that is the limit here. The token
    /// bucket's burst itself is not modelled: after idle, `tbf` lets `burst` bytes through at
    /// the device's own speed, which only makes the first bytes of a busy period earlier.
    pub fn tbf(
        rate_bps: u64,
        burst_bytes: u64,
        tbf_latency: Duration,
        latency: Duration,
    ) -> LinkConfig {
        let per_latency = u128::from(rate_bps) * tbf_latency.as_nanos() / 8 / 1_000_000_000;
        LinkConfig {
            rate_bps,
            queue_limit_bytes: u64::try_from(per_latency)
                .unwrap_or(u64::MAX)
                .saturating_add(burst_bytes),
            ecn_threshold_bytes: None,
            per_packet_overhead_bytes: ETH_IPV4_UDP_OVERHEAD,
            latency,
        }
    }

    /// `tbf rate 1gbit burst 32kb latency 1ms` (the test bed's bottleneck; tc's `kb` is 1024
    /// bytes): 1 Gbit/s with a queue of 125 000 + 32 768 = 157 768 bytes, and 5 µs of
    /// propagation.
    pub fn gigabit_tbf() -> LinkConfig {
        LinkConfig::tbf(
            1_000_000_000,
            32 * 1024,
            Duration::from_millis(1),
            Duration::from_micros(5),
        )
    }

    /// The same link, marking ECT datagrams above `threshold_bytes`.
    pub fn with_ecn(self, threshold_bytes: u64) -> LinkConfig {
        LinkConfig {
            ecn_threshold_bytes: Some(threshold_bytes),
            ..self
        }
    }

    /// Wire bytes of a datagram of `len` RoCE bytes.
    pub fn wire_len(&self, len: usize) -> u64 {
        len as u64 + self.per_packet_overhead_bytes
    }

    /// Nanoseconds to serialize `wire_bytes`, rounded up so the link never beats its rate.
    pub fn serialization_ns(&self, wire_bytes: u64) -> u64 {
        let bits = u128::from(wire_bytes) * 8 * 1_000_000_000;
        let rate = u128::from(self.rate_bps.max(1));
        u64::try_from(bits.div_ceil(rate)).unwrap_or(u64::MAX)
    }
}

/// What a link did with an arriving datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkVerdict {
    /// Refused: the queue had no room.
    TailDropped,
    /// Queued; it finishes leaving at `departs`.
    Queued {
        /// When its last bit leaves the link (arrival at the far end is `latency` later).
        departs: Instant,
        /// Whether it was marked Congestion Experienced.
        ce: bool,
    },
}

/// Counters of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinkStats {
    /// Datagrams that arrived at the link (queued or tail-dropped).
    pub offered: u64,
    /// Datagrams queued.
    pub enqueued: u64,
    /// Datagrams whose last bit has left, as of the last [`Link::advance`].
    pub departed: u64,
    /// Datagrams refused for lack of room.
    pub tail_drops: u64,
    /// Datagrams marked Congestion Experienced.
    pub ce_marked: u64,
    /// ECT datagrams queued (those that could have been marked).
    pub ect_enqueued: u64,
    /// Wire bytes of the datagrams queued.
    pub bytes_enqueued: u64,
    /// Wire bytes of the datagrams departed.
    pub bytes_departed: u64,
    /// Largest backlog an arrival found, in wire bytes.
    pub max_backlog: u64,
    /// The first arrival, if any.
    pub first_arrival: Option<Instant>,
    /// The last departure so far.
    pub last_departure: Instant,
}

/// Percentiles of the queue delay datagrams saw, over every datagram queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueDelay {
    /// Samples (datagrams queued).
    pub samples: u64,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest.
    pub max: Duration,
}

/// One queued datagram, with what the invariants need to be checked independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    arrival: Instant,
    start: Instant,
    departs: Instant,
    wire_len: u64,
    backlog_seen: u64,
    ect: bool,
    ce: bool,
}

/// A FIFO bottleneck; see the [module documentation](self).
#[derive(Clone)]
pub struct Link {
    cfg: LinkConfig,
    /// Datagrams that have not finished leaving, oldest first.
    queue: VecDeque<Entry>,
    /// Wire bytes in `queue`.
    backlog: u64,
    /// When the last queued datagram finishes leaving (the link is idle from then).
    busy_until: Instant,
    /// The latest time seen; arrivals must not go back in time.
    now: Instant,
    stats: LinkStats,
    /// Queue delay of every datagram queued, in nanoseconds.
    delays: Vec<u64>,
    /// Violations found as datagrams leave (the queue forgets them afterwards).
    retired_violation: Option<String>,
}

/// A summary: the queue and the delay samples can be hundreds of thousands of entries, too
/// many for a `{:?}` of a whole [`super::Sim`] or a failed assertion.
impl core::fmt::Debug for Link {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Link")
            .field("cfg", &self.cfg)
            .field("queued", &self.queue.len())
            .field("backlog", &self.backlog)
            .field("busy_until", &self.busy_until)
            .field("now", &self.now)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// An idle link.
    ///
    /// # Panics
    /// If `cfg.rate_bps` is 0: such a link could never send, so it is a mistake in the caller.
    pub fn new(cfg: LinkConfig) -> Link {
        assert!(cfg.rate_bps > 0, "a link needs a rate");
        Link {
            cfg,
            queue: VecDeque::new(),
            backlog: 0,
            busy_until: Instant::ZERO,
            now: Instant::ZERO,
            stats: LinkStats::default(),
            delays: Vec::new(),
            retired_violation: None,
        }
    }

    /// The link's parameters.
    pub fn config(&self) -> &LinkConfig {
        &self.cfg
    }

    /// Its counters.
    pub fn stats(&self) -> &LinkStats {
        &self.stats
    }

    /// Wire bytes not yet departed, as of the last [`Self::advance`] or arrival.
    pub fn backlog(&self) -> u64 {
        self.backlog
    }

    /// Datagrams not yet departed, as of the last [`Self::advance`] or arrival.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// When the link is next idle (now or earlier if it is idle).
    pub fn busy_until(&self) -> Instant {
        self.busy_until
    }

    /// Retires every datagram that has finished leaving by `now`.
    pub fn advance(&mut self, now: Instant) {
        debug_assert!(now >= self.now, "link time went back: {now} < {}", self.now);
        self.now = self.now.max(now);
        while let Some(e) = self.queue.front().copied() {
            if e.departs > self.now {
                break;
            }
            self.queue.pop_front();
            if e.departs < self.stats.last_departure && self.retired_violation.is_none() {
                self.retired_violation = Some(format!(
                    "departure at {} after one at {}: not FIFO",
                    e.departs, self.stats.last_departure
                ));
            }
            self.backlog -= e.wire_len;
            self.stats.departed += 1;
            self.stats.bytes_departed += e.wire_len;
            self.stats.last_departure = e.departs;
        }
    }

    /// A datagram of `len` RoCE bytes arrives at `now`; `ect` says whether it is ECN-capable.
    /// Arrivals must come in time order.
    pub fn enqueue(&mut self, now: Instant, len: usize, ect: bool) -> LinkVerdict {
        self.advance(now);
        let wire_len = self.cfg.wire_len(len);
        self.stats.offered += 1;
        self.stats.first_arrival.get_or_insert(now);
        let backlog_seen = self.backlog;
        self.stats.max_backlog = self.stats.max_backlog.max(backlog_seen);
        if backlog_seen + wire_len > self.cfg.queue_limit_bytes {
            self.stats.tail_drops += 1;
            return LinkVerdict::TailDropped;
        }
        let ce = ect
            && self
                .cfg
                .ecn_threshold_bytes
                .is_some_and(|k| backlog_seen > k);
        let start = self.now.max(self.busy_until);
        let departs = start + Duration::from_nanos(self.cfg.serialization_ns(wire_len));
        self.busy_until = departs;
        self.backlog += wire_len;
        self.queue.push_back(Entry {
            arrival: now,
            start,
            departs,
            wire_len,
            backlog_seen,
            ect,
            ce,
        });
        self.delays.push(start.as_nanos() - now.as_nanos());
        self.stats.enqueued += 1;
        self.stats.bytes_enqueued += wire_len;
        self.stats.ect_enqueued += u64::from(ect);
        self.stats.ce_marked += u64::from(ce);
        debug_assert!(self.backlog <= self.cfg.queue_limit_bytes);
        LinkVerdict::Queued { departs, ce }
    }

    /// Percentiles of the queue delay of every datagram queued so far (nearest rank).
    pub fn queue_delay(&self) -> QueueDelay {
        let mut d = self.delays.clone();
        d.sort_unstable();
        let rank = |p: u64| -> Duration {
            if d.is_empty() {
                return Duration::ZERO;
            }
            // Nearest rank: the smallest sample with at least p % of the samples at or below.
            let n = d.len() as u64;
            let i = (p * n).div_ceil(100).max(1) - 1;
            Duration::from_nanos(d[i as usize])
        };
        QueueDelay {
            samples: d.len() as u64,
            p50: rank(50),
            p99: rank(99),
            max: Duration::from_nanos(d.last().copied().unwrap_or(0)),
        }
    }

    /// Checks the link's invariants from its recorded state; the first broken one is the
    /// error. O(queued datagrams).
    ///
    /// * conservation: offered = queued + tail-dropped, queued = departed + still queued, and
    ///   the same for bytes;
    /// * the backlog is the sum of the queued lengths and within the limit, and so was every
    ///   arrival's backlog plus its length;
    /// * FIFO: departures strictly increase, after every departure already retired;
    /// * work conservation: each datagram starts the moment it arrived or the one before it
    ///   left, whichever is later; the link is busy until the last one leaves;
    /// * timing: each takes exactly its serialization time;
    /// * ECN: a datagram is marked exactly when it is ECT and found more than the threshold;
    /// * rate: the bits departed fit in the time since the first arrival at the rate.
    pub fn check(&self) -> Result<(), String> {
        if let Some(v) = &self.retired_violation {
            return Err(v.clone());
        }
        let s = &self.stats;
        if s.offered != s.enqueued + s.tail_drops {
            return Err(format!(
                "offered {} != enqueued {} + tail drops {}",
                s.offered, s.enqueued, s.tail_drops
            ));
        }
        if s.enqueued != s.departed + self.queue.len() as u64 {
            return Err(format!(
                "enqueued {} != departed {} + queued {}",
                s.enqueued,
                s.departed,
                self.queue.len()
            ));
        }
        if s.bytes_enqueued != s.bytes_departed + self.backlog {
            return Err(format!(
                "bytes enqueued {} != departed {} + backlog {}",
                s.bytes_enqueued, s.bytes_departed, self.backlog
            ));
        }
        let sum: u64 = self.queue.iter().map(|e| e.wire_len).sum();
        if sum != self.backlog {
            return Err(format!("backlog {} but {} bytes queued", self.backlog, sum));
        }
        if self.backlog > self.cfg.queue_limit_bytes {
            return Err(format!(
                "backlog {} over the limit {}",
                self.backlog, self.cfg.queue_limit_bytes
            ));
        }
        if self.delays.len() as u64 != s.enqueued {
            return Err("a queue-delay sample per queued datagram".into());
        }
        let mut prev = s.last_departure;
        let mut marked = 0u64;
        for e in &self.queue {
            if e.departs <= self.now {
                return Err(format!("departed at {} but still queued", e.departs));
            }
            if e.departs <= prev {
                return Err(format!(
                    "departure at {} not after {}: not FIFO",
                    e.departs, prev
                ));
            }
            if e.start != e.arrival.max(prev) {
                return Err(format!(
                    "arrived at {}, the one before left at {}, but started at {}: not work-conserving",
                    e.arrival, prev, e.start
                ));
            }
            let ser = self.cfg.serialization_ns(e.wire_len);
            if e.departs.as_nanos() - e.start.as_nanos() != ser {
                return Err(format!(
                    "{} wire bytes took {} ns, not {ser}",
                    e.wire_len,
                    e.departs.as_nanos() - e.start.as_nanos()
                ));
            }
            if e.backlog_seen + e.wire_len > self.cfg.queue_limit_bytes {
                return Err(format!(
                    "queued {} bytes onto {}: over the limit {}",
                    e.wire_len, e.backlog_seen, self.cfg.queue_limit_bytes
                ));
            }
            let above = self
                .cfg
                .ecn_threshold_bytes
                .is_some_and(|k| e.backlog_seen > k);
            if e.ce != (e.ect && above) {
                return Err(format!(
                    "CE {} for ECT {} at backlog {} (threshold {:?})",
                    e.ce, e.ect, e.backlog_seen, self.cfg.ecn_threshold_bytes
                ));
            }
            marked += u64::from(e.ce);
            prev = e.departs;
        }
        if marked > s.ce_marked || s.ce_marked > s.ect_enqueued {
            return Err(format!(
                "{} marks counted, {} among the queued, {} ECT queued",
                s.ce_marked, marked, s.ect_enqueued
            ));
        }
        if self.busy_until != prev {
            return Err(format!(
                "busy until {} but the last datagram leaves at {}",
                self.busy_until, prev
            ));
        }
        if let Some(first) = s.first_arrival {
            let span = u128::from(s.last_departure.as_nanos().saturating_sub(first.as_nanos()));
            let bits = u128::from(s.bytes_departed) * 8 * 1_000_000_000;
            if bits > span * u128::from(self.cfg.rate_bps) {
                return Err(format!(
                    "{} bytes departed in {span} ns: faster than {} bit/s",
                    s.bytes_departed, self.cfg.rate_bps
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ns: u64) -> Instant {
        Instant::from_nanos(ns)
    }

    /// 1 Gbit/s, so a byte takes exactly 8 ns; overhead 42, so 958 RoCE bytes are 1000 on the
    /// wire and take 8000 ns.
    fn gig(limit: u64, ecn: Option<u64>) -> Link {
        Link::new(LinkConfig {
            rate_bps: 1_000_000_000,
            queue_limit_bytes: limit,
            ecn_threshold_bytes: ecn,
            per_packet_overhead_bytes: ETH_IPV4_UDP_OVERHEAD,
            latency: Duration::from_micros(5),
        })
    }

    fn departs(v: LinkVerdict) -> Instant {
        match v {
            LinkVerdict::Queued { departs, .. } => departs,
            LinkVerdict::TailDropped => panic!("dropped"),
        }
    }

    #[test]
    fn the_gigabit_tbf_queue_is_157768_bytes() {
        let c = LinkConfig::gigabit_tbf();
        assert_eq!(c.queue_limit_bytes, 125_000 + 32_768);
        assert_eq!(c.rate_bps, 1_000_000_000);
        assert_eq!(c.per_packet_overhead_bytes, 42);
    }

    #[test]
    fn serialization_is_exact_in_nanoseconds_and_rounds_up() {
        let mut l = gig(1_000_000, None);
        assert_eq!(departs(l.enqueue(at(100), 958, false)), at(8_100));
        // Back to back: the second starts when the first has left.
        assert_eq!(departs(l.enqueue(at(100), 958, false)), at(16_100));
        // 3 Gbit/s: 1000 wire bytes are 2666.67 ns, sent in 2667.
        let c = LinkConfig {
            rate_bps: 3_000_000_000,
            ..*l.config()
        };
        assert_eq!(c.serialization_ns(1000), 2667);
        assert_eq!(c.serialization_ns(3), 8);
        l.check().unwrap();
    }

    #[test]
    fn an_idle_link_starts_at_once_and_a_busy_one_queues_in_order() {
        let mut l = gig(1_000_000, None);
        let a = departs(l.enqueue(at(0), 958, false));
        let b = departs(l.enqueue(at(1_000), 458, false)); // 500 wire bytes: 4000 ns
        let c = departs(l.enqueue(at(50_000), 958, false)); // after idle: starts on arrival
        assert_eq!((a, b, c), (at(8_000), at(12_000), at(58_000)));
        let d = l.queue_delay();
        assert_eq!(d.samples, 3);
        // Delays 0, 7000, 0: the median is 0, the max 7000.
        assert_eq!(d.p50, Duration::ZERO);
        assert_eq!(d.max, Duration::from_nanos(7_000));
        // The third arrival retired the first two.
        assert_eq!(l.stats().departed, 2);
        assert_eq!(l.backlog(), 1000);
        l.check().unwrap();
        l.advance(at(58_000));
        assert_eq!((l.stats().departed, l.backlog()), (3, 0));
        l.check().unwrap();
    }

    #[test]
    fn tail_drop_happens_exactly_at_the_limit() {
        // Room for exactly three 1000-byte datagrams.
        let mut l = gig(3_000, None);
        for _ in 0..3 {
            departs(l.enqueue(at(0), 958, false));
        }
        assert_eq!(l.backlog(), 3_000);
        assert_eq!(l.enqueue(at(0), 958, false), LinkVerdict::TailDropped);
        // Even an empty datagram is refused: its 42 header bytes do not fit.
        assert_eq!(l.enqueue(at(0), 0, false), LinkVerdict::TailDropped);
        // The instant the first leaves, there is room again for exactly one.
        l.advance(at(7_999));
        assert_eq!(l.enqueue(at(7_999), 958, false), LinkVerdict::TailDropped);
        assert_eq!(departs(l.enqueue(at(8_000), 958, false)), at(32_000));
        assert_eq!(l.enqueue(at(8_000), 0, false), LinkVerdict::TailDropped);
        let s = *l.stats();
        assert_eq!(
            (s.offered, s.enqueued, s.tail_drops, s.departed),
            (8, 4, 4, 1)
        );
        l.check().unwrap();
    }

    #[test]
    fn a_datagram_larger_than_the_room_left_is_dropped_a_smaller_one_fits() {
        let mut l = gig(2_500, None);
        departs(l.enqueue(at(0), 958, false));
        departs(l.enqueue(at(0), 958, false));
        assert_eq!(l.enqueue(at(0), 459, false), LinkVerdict::TailDropped); // 501 > 500
        departs(l.enqueue(at(0), 458, false)); // exactly 500
        assert_eq!(l.backlog(), 2_500);
        l.check().unwrap();
    }

    #[test]
    fn ce_marks_only_ect_datagrams_that_find_more_than_the_threshold() {
        let mut l = gig(100_000, Some(2_000));
        let ce = |v: LinkVerdict| matches!(v, LinkVerdict::Queued { ce: true, .. });
        assert!(!ce(l.enqueue(at(0), 958, true))); // finds 0
        assert!(!ce(l.enqueue(at(0), 958, true))); // finds 1000
        assert!(!ce(l.enqueue(at(0), 958, true))); // finds 2000: not above
        assert!(ce(l.enqueue(at(0), 958, true))); // finds 3000
        assert!(!ce(l.enqueue(at(0), 958, false))); // not ECT: never marked
        assert!(ce(l.enqueue(at(0), 958, true)));
        // 6000 bytes queued at 0 leave every 8000 ns: at 32 000 ns two are left, not above.
        l.advance(at(32_000));
        assert_eq!(l.backlog(), 2_000);
        assert!(!ce(l.enqueue(at(32_000), 958, true)));
        assert_eq!(l.stats().ce_marked, 2);
        assert_eq!(l.stats().ect_enqueued, 6);
        l.check().unwrap();
        // Without a threshold nothing is marked.
        let mut m = gig(100_000, None);
        for _ in 0..10 {
            assert!(!ce(m.enqueue(at(0), 958, true)));
        }
        assert_eq!(m.stats().ce_marked, 0);
    }

    #[test]
    fn conservation_and_the_rate_hold_through_a_busy_period() {
        let mut l = gig(20_000, Some(5_000));
        let mut now = 0;
        for i in 0..2_000u64 {
            // Bursts of 7 every 40 µs: more than the link takes, so it drops and marks.
            if i % 7 == 0 {
                now += 40_000;
            }
            l.enqueue(at(now), 958 - (i % 5) as usize * 100, i % 2 == 0);
            l.check().unwrap();
        }
        let s = *l.stats();
        assert!(s.tail_drops > 0 && s.ce_marked > 0, "{s:?}");
        l.advance(at(u64::MAX / 2));
        l.check().unwrap();
        assert_eq!(l.stats().departed, s.enqueued);
        assert_eq!(l.backlog(), 0);
    }

    #[test]
    fn the_check_catches_a_broken_queue() {
        let mut l = gig(10_000, Some(1_000));
        departs(l.enqueue(at(0), 958, true));
        departs(l.enqueue(at(0), 958, true));
        let good = l.clone();
        // The second found 1000 bytes, not above the threshold: a mark there is wrong.
        l.queue[1].ce = true;
        assert!(l.check().unwrap_err().contains("CE"));
        let mut l = good.clone();
        l.queue[1].start = at(9_000);
        assert!(l.check().is_err());
        let mut l = good.clone();
        l.stats.tail_drops += 1;
        assert!(l.check().unwrap_err().contains("offered"));
        let mut l = good;
        l.queue.swap(0, 1);
        assert!(l.check().is_err());
    }
}
