//! Congestion control at the sender: how many packets a QP may have in flight.
//!
//! RoCE NICs leave congestion to a lossless fabric (PFC) and DCQCN's ECN marks. Over plain
//! Ethernet there is no PFC: a QP that sends its whole window at line rate into a switch (or a
//! `tbf` qdisc) with a 1 ms queue overflows it, and with go-back-N every drop resends everything
//! after it — congestion collapse. So each QP runs a delay-based controller shaped like Swift
//! (Kumar et al., SIGCOMM 2020), which needs nothing from the peer: the requester measures RTT
//! from its own stamps (see [`crate::rtt`]) and the queueing delay is the RTT above the
//! smallest recent one.
//!
//! * Below the target delay the window grows: by one packet per acknowledged packet until the
//!   first sign of congestion (slow start, doubling per round trip), then by one packet per
//!   round trip (additive increase).
//! * Above it the window shrinks, at most once per round trip, in proportion to how far above:
//!   `cwnd · max(1 − β·(delay − target)/delay, 1 − MAX_DECREASE)`.
//! * A loss (a sequence-error NAK, a READ gap) halves it, once per round trip; a retransmission
//!   timeout halves it, and repeated timeouts drop it to the minimum.
//! * The target grows as the window shrinks (Swift's flow scaling): with many flows through one
//!   queue each has a small window, and a higher target lets them share it without each
//!   backing off to nothing — what keeps 16 or 64 flows fair.
//! * Windows below one packet are allowed: the pacer (see [`crate::pacer`]) then spaces single
//!   packets by `srtt / cwnd`.
//!
//! What it costs: a flow holds about `target_delay` of queue at the bottleneck (at 1 Gbit/s the
//! default 300 µs is 37.5 KB; 100 µs kept one stream through a 1 Gbit/s `tbf` at 91 % of
//! TCP's goodput on a 2-core host, where the peer's engine thread is often late by more than
//! that, 300 µs at 97 %), a sender that competes with loss-based TCP (CUBIC fills the whole
//! queue) gets less than its share but is never starved (the window has a floor and the pacer a
//! minimum rate), and on a clean path the window starts at [`INITIAL_WINDOW`] and needs a few
//! round trips of slow start to reach a large bandwidth-delay product. [`CcAlgorithm::Off`]
//! keeps the loss-only window ferroce had before: full speed into a lossless path, collapse
//! behind a bottleneck.

use core::time::Duration;

use crate::time::Instant;

/// Which congestion control a QP runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CcAlgorithm {
    /// Delay-based window with pacing (the default; see the module doc).
    #[default]
    Delay,
    /// None: the window is the full [`crate::requester::MAX_UNACKED_PSNS`], halved by losses
    /// and grown back by acknowledgements, and nothing is paced.
    Off,
}

impl CcAlgorithm {
    /// The name used by knobs and reports (`delay`, `off`).
    pub const fn name(self) -> &'static str {
        match self {
            CcAlgorithm::Delay => "delay",
            CcAlgorithm::Off => "off",
        }
    }

    /// The algorithm a knob names, if any.
    pub fn from_name(name: &str) -> Option<CcAlgorithm> {
        match name.trim().to_ascii_lowercase().as_str() {
            "delay" | "swift" | "on" | "1" => Some(CcAlgorithm::Delay),
            "off" | "none" | "0" => Some(CcAlgorithm::Off),
            _ => None,
        }
    }
}

/// A QP's congestion-control settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CcConfig {
    /// The algorithm.
    pub algorithm: CcAlgorithm,
    /// Queueing delay the delay-based window aims for with a large window (smaller windows
    /// aim higher, see the module doc). Lower keeps queues (and the latency of everything
    /// sharing them) shorter; too low for the host's own scheduling noise and the window
    /// shrinks for delays no queue caused.
    pub target_delay: Duration,
}

/// The default target queueing delay.
pub const DEFAULT_TARGET_DELAY: Duration = Duration::from_micros(300);

impl Default for CcConfig {
    fn default() -> CcConfig {
        CcConfig {
            algorithm: CcAlgorithm::Delay,
            target_delay: DEFAULT_TARGET_DELAY,
        }
    }
}

/// The window a QP starts with, in packets.
pub const INITIAL_WINDOW: f64 = 16.0;
/// The smallest window: one packet per two round trips. (Swift goes down to 0.01 for incasts
/// of thousands of flows; here that floor made a QP through 5 % loss, whose timeouts drove
/// it there, crawl at one packet per hundred round trips.)
pub const MIN_WINDOW: f64 = 0.5;
/// The smallest window a loss found by a NAK leaves: a window of a packet or two has no later
/// packet to reveal the next hole, so every further loss waits for a timeout. Beside TCP
/// filling a drop-tail queue (several per cent of packets dropped), halving to the minimum on
/// each loss left a stream a sixth of what this floor leaves it. Timeouts still go lower.
pub const LOSS_FLOOR: f64 = 4.0;
/// Largest fraction one decrease takes off the window.
pub const MAX_DECREASE: f64 = 0.5;
/// How strongly the window answers delay above target (Swift's β).
const BETA: f64 = 0.8;
/// Packets the window grows by per round trip below target (Swift's additive increment).
const ADDITIVE_INCREASE: f64 = 1.0;
/// Consecutive retransmission timeouts after which the window drops to the minimum.
const TIMEOUTS_TO_MINIMUM: u32 = 5;
/// Flow scaling: windows at or below this many packets get the whole extra target...
const FS_MIN_WINDOW: f64 = MIN_WINDOW;
/// ...and windows at or above this many get none.
const FS_MAX_WINDOW: f64 = 64.0;
/// The extra target at the smallest windows, as a multiple of the target delay.
const FS_RANGE: f64 = 4.0;

/// The congestion window of one QP.
#[derive(Debug, Clone)]
pub struct Controller {
    config: CcConfig,
    /// Packets that may be in flight (may be below one: see the pacer).
    cwnd: f64,
    /// Growing exponentially: no congestion seen yet.
    slow_start: bool,
    /// When the window last shrank (decreases are at most once per round trip).
    last_decrease: Option<Instant>,
    /// Retransmission timeouts since the last acknowledgement.
    timeouts: u32,
    /// Most packets the window may reach.
    max: f64,
    /// The current observation period of the smallest queueing delay (see `competing`).
    period_start: Option<Instant>,
    /// The smallest queueing delay measured in the period.
    period_min_delay: Option<Duration>,
    /// A queue this flow does not control: the delay never came down to the target in a whole
    /// [`COMPETE_PERIOD`], which a delay-based flow alone or among its kind does (it backs off
    /// until it does) and a loss-based competitor (TCP CUBIC, filling the queue to its limit)
    /// prevents. While so, delay is ignored and only losses shrink the window, as TCP's do;
    /// a period whose smallest delay is back under the target ends it. Without this, a flow
    /// beside TCP backs off towards nothing (Copa and Nimbus switch modes the same way).
    competing: bool,
}

/// How long the queueing delay must stay above target, without a dip, before the controller
/// takes the queue for someone else's (see `Controller::competing`).
pub const COMPETE_PERIOD: Duration = Duration::from_millis(50);

impl Controller {
    /// A controller with `config`, whose window never exceeds `max` packets.
    pub fn new(config: CcConfig, max: u32) -> Controller {
        Controller {
            config,
            cwnd: INITIAL_WINDOW.min(f64::from(max)),
            slow_start: true,
            last_decrease: None,
            timeouts: 0,
            max: f64::from(max),
            period_start: None,
            period_min_delay: None,
            competing: false,
        }
    }

    /// Whether the controller takes the queue for a loss-based competitor's (see the field).
    pub fn competing(&self) -> bool {
        self.competing
    }

    /// Tracks the smallest delay per [`COMPETE_PERIOD`] and decides `competing` at each end.
    fn observe(&mut self, now: Instant, delay: Duration) {
        self.period_min_delay = Some(self.period_min_delay.map_or(delay, |m| m.min(delay)));
        let start = *self.period_start.get_or_insert(now);
        if now.saturating_since(start) >= COMPETE_PERIOD {
            self.competing = self.period_min_delay.is_some_and(|m| m > self.target());
            self.period_start = Some(now);
            self.period_min_delay = None;
        }
    }

    /// The settings.
    pub fn config(&self) -> CcConfig {
        self.config
    }

    /// Whether a window applies at all.
    pub fn enabled(&self) -> bool {
        self.config.algorithm != CcAlgorithm::Off
    }

    /// The window in packets, fractional.
    pub fn cwnd(&self) -> f64 {
        self.cwnd
    }

    /// The window in whole packets (at least one: below that, the pacer spaces them).
    pub fn window_packets(&self) -> u32 {
        (self.cwnd.floor() as u32).clamp(1, self.max as u32)
    }

    /// The target queueing delay for the current window (flow scaling included).
    pub fn target(&self) -> Duration {
        let base = self.config.target_delay.as_secs_f64();
        let alpha = FS_RANGE / (1.0 / FS_MIN_WINDOW.sqrt() - 1.0 / FS_MAX_WINDOW.sqrt());
        let beta = alpha / FS_MAX_WINDOW.sqrt();
        let scale = (alpha / self.cwnd.max(FS_MIN_WINDOW).sqrt() - beta).clamp(0.0, FS_RANGE);
        Duration::from_secs_f64(base * (1.0 + scale))
    }

    fn may_decrease(&self, now: Instant, srtt: Duration) -> bool {
        self.last_decrease
            .map_or(true, |t| now.saturating_since(t) >= srtt)
    }

    fn decrease(&mut self, now: Instant, factor: f64) {
        self.cwnd = (self.cwnd * factor).clamp(MIN_WINDOW, self.max);
        self.slow_start = false;
        self.last_decrease = Some(now);
    }

    /// `acked` packets were acknowledged; `delay` is the queueing delay a fresh RTT sample
    /// measured with them (none if they gave no sample), `srtt` the smoothed RTT.
    pub fn on_ack(&mut self, now: Instant, acked: u32, delay: Option<Duration>, srtt: Duration) {
        if !self.enabled() || acked == 0 {
            return;
        }
        self.timeouts = 0;
        let target = self.target();
        if let Some(d) = delay {
            self.observe(now, d);
        }
        match delay {
            Some(d) if d > target && !self.competing => {
                if self.may_decrease(now, srtt) {
                    let over = (d - target).as_secs_f64() / d.as_secs_f64();
                    self.decrease(now, (1.0 - BETA * over).max(1.0 - MAX_DECREASE));
                }
            }
            _ => {
                let acked = f64::from(acked);
                self.cwnd = if self.slow_start {
                    self.cwnd + acked
                } else if self.cwnd >= 1.0 {
                    self.cwnd + ADDITIVE_INCREASE * acked / self.cwnd
                } else {
                    self.cwnd + ADDITIVE_INCREASE * acked
                }
                .min(self.max);
            }
        }
    }

    /// A packet was found lost (a NAK or a gap in READ answers): halve, once per round trip,
    /// but not below [`LOSS_FLOOR`] packets.
    pub fn on_loss(&mut self, now: Instant, srtt: Duration) {
        if self.enabled() && self.may_decrease(now, srtt) && self.cwnd > LOSS_FLOOR {
            let factor = (1.0 - MAX_DECREASE).max(LOSS_FLOOR / self.cwnd);
            self.decrease(now, factor);
        }
    }

    /// The retransmission timer fired.
    pub fn on_timeout(&mut self, now: Instant) {
        if !self.enabled() {
            return;
        }
        self.timeouts += 1;
        if self.timeouts >= TIMEOUTS_TO_MINIMUM {
            self.cwnd = MIN_WINDOW;
            self.slow_start = false;
            self.last_decrease = Some(now);
        } else {
            self.decrease(now, 1.0 - MAX_DECREASE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    fn at(n: u64) -> Instant {
        Instant::ZERO + us(n)
    }

    #[test]
    fn slow_start_doubles_per_window_until_delay_rises() {
        let mut c = Controller::new(CcConfig::default(), 1024);
        assert_eq!(c.window_packets(), 16);
        c.on_ack(at(100), 16, Some(us(0)), us(100));
        assert_eq!(c.window_packets(), 32);
        // Delay above target: a proportional cut, and slow start ends.
        let target = c.target();
        let d = target * 2;
        c.on_ack(at(200), 1, Some(d), us(100));
        let over = (d - target).as_secs_f64() / d.as_secs_f64();
        assert!((c.cwnd() - 32.0 * (1.0 - BETA * over)).abs() < 1e-9);
        // Then additive: one packet per window of acknowledgements.
        let before = c.cwnd();
        c.on_ack(at(400), before.round() as u32, Some(us(0)), us(100));
        assert!((c.cwnd() - before - 1.0).abs() < 0.1, "{}", c.cwnd());
    }

    #[test]
    fn decreases_come_at_most_once_per_round_trip() {
        let mut c = Controller::new(CcConfig::default(), 1024);
        c.on_loss(at(0), us(100));
        assert_eq!(c.cwnd(), 8.0);
        c.on_loss(at(50), us(100));
        assert_eq!(c.cwnd(), 8.0);
        c.on_ack(at(60), 1, Some(us(10_000)), us(100));
        assert_eq!(c.cwnd(), 8.0);
        c.on_loss(at(100), us(100));
        assert_eq!(c.cwnd(), 4.0);
        // Losses stop at the floor; timeouts go lower.
        c.on_loss(at(200), us(100));
        assert_eq!(c.cwnd(), LOSS_FLOOR);
        c.on_timeout(at(300));
        assert_eq!(c.cwnd(), LOSS_FLOOR / 2.0);
    }

    #[test]
    fn timeouts_halve_and_repeated_ones_reach_the_minimum() {
        let mut c = Controller::new(CcConfig::default(), 1024);
        c.on_timeout(at(0));
        assert_eq!(c.cwnd(), 8.0);
        for i in 1..TIMEOUTS_TO_MINIMUM {
            c.on_timeout(at(u64::from(i)));
        }
        assert_eq!(c.cwnd(), MIN_WINDOW);
        assert_eq!(c.window_packets(), 1);
        // Below one packet the window grows by a packet per acknowledged packet.
        c.on_ack(at(10), 1, Some(us(0)), us(100));
        assert!((c.cwnd() - (MIN_WINDOW + 1.0)).abs() < 1e-9);
    }

    #[test]
    fn small_windows_aim_at_a_higher_delay() {
        let mut big = Controller::new(CcConfig::default(), 1024);
        big.cwnd = 100.0;
        assert_eq!(big.target(), DEFAULT_TARGET_DELAY);
        let mut small = Controller::new(CcConfig::default(), 1024);
        small.cwnd = 1.0;
        assert!(small.target() > DEFAULT_TARGET_DELAY * 2);
        small.cwnd = MIN_WINDOW;
        let top = DEFAULT_TARGET_DELAY.as_secs_f64() * (1.0 + FS_RANGE);
        assert!((small.target().as_secs_f64() - top).abs() < 1e-9);
    }

    #[test]
    fn a_queue_that_never_drains_is_a_competitor_s_and_delay_is_ignored_until_it_does() {
        let mut c = Controller::new(CcConfig::default(), 1024);
        let high = c.target() * 10;
        let mut t = 0;
        // A whole period of high delay: the window shrinks meanwhile...
        while t <= COMPETE_PERIOD.as_micros() as u64 {
            c.on_ack(at(t), 1, Some(high), us(100));
            t += 100;
        }
        assert!(c.competing());
        let shrunk = c.cwnd();
        // ...then grows despite the delay; a loss still halves it.
        for _ in 0..100 {
            c.on_ack(at(t), 1, Some(high), us(100));
            t += 100;
        }
        assert!(c.cwnd() > shrunk, "{} vs {shrunk}", c.cwnd());
        let before = c.cwnd();
        c.on_loss(at(t), us(100));
        assert_eq!(c.cwnd(), before / 2.0);
        // A period with a dip under the target ends it.
        let end = t + COMPETE_PERIOD.as_micros() as u64 + 200;
        while t <= end {
            c.on_ack(at(t), 1, Some(us(0)), us(100));
            t += 100;
        }
        assert!(!c.competing());
    }

    #[test]
    fn off_never_changes_the_window() {
        let cfg = CcConfig {
            algorithm: CcAlgorithm::Off,
            ..CcConfig::default()
        };
        let mut c = Controller::new(cfg, 1024);
        let w = c.cwnd();
        c.on_loss(at(0), us(1));
        c.on_timeout(at(1));
        c.on_ack(at(2), 5, Some(us(0)), us(1));
        assert_eq!(c.cwnd(), w);
        assert_eq!(CcAlgorithm::from_name("OFF"), Some(CcAlgorithm::Off));
        assert_eq!(CcAlgorithm::from_name("delay"), Some(CcAlgorithm::Delay));
        assert_eq!(CcAlgorithm::from_name("cubic"), None);
    }
}
