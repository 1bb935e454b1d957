//! DCQCN, RoCE's ECN-based congestion control (Zhu et al., "Congestion Control for Large-Scale
//! RDMA Deployments", SIGCOMM 2015), in its two end-host roles:
//!
//! - the **notification point** ([`NotificationPoint`]), on the receiver of a flow: a packet that
//!   arrives with the IP header's ECN field set to Congestion Experienced (a switch queue on the
//!   path was long) makes the QP owe its peer a CNP (BTH opcode 0x81), at most one every
//!   [`MIN_TIME_BETWEEN_CNPS`] per QP, whatever the number of marked packets;
//! - the **reaction point** ([`Dcqcn`]), on the sender: every CNP cuts the QP's sending rate in
//!   proportion to α, an estimate of how often the path is congested, and the rate climbs back
//!   by itself, driven by a timer and a byte counter.
//!
//! Both are plain values driven in virtual time, like the rest of the transport: nothing here
//! reads a clock, and a test replays minutes of recovery in microseconds. The QP holds one of
//! each; the rate [`Dcqcn::rate_bytes_per_sec`] says is what a pacer may send at (this module
//! only computes it).
//!
//! # The reaction point's rules
//! With Rc the current rate, Rt the target rate, α in [0, 1] and g = 1/256:
//! - **CNP**: Rt = Rc, Rc = Rc·(1 − α/2), α = (1 − g)·α + g; the timer, the byte counter and
//!   both stage counts start again. A CNP within `rate_reduce_monitor_period` of the last cut is
//!   counted by the caller but changes nothing (a NIC cuts at most once per period).
//! - **α decay**: every `alpha_update_period` (K) without a CNP, α = (1 − g)·α.
//! - **Increase events**: every `time_reset` (T) without a CNP the timer stage count goes up,
//!   every `byte_reset` (B) bytes sent the byte stage count goes up, and each such event moves
//!   the rate: while neither count exceeds `threshold` (F) it is *fast recovery*,
//!   Rc = (Rt + Rc)/2; once both exceed F it is *hyper increase*, Rt += i·R_HAI with
//!   i = min(counts) − F, then Rc = (Rt + Rc)/2; in between it is *additive increase*,
//!   Rt += R_AI, then Rc = (Rt + Rc)/2. Rt never exceeds the line rate and Rc never falls below
//!   the minimum rate.
//! - **Recovered**: once Rc is within 1/1024 of the line rate the QP is unlimited again
//!   ([`Dcqcn::rate_bytes_per_sec`] returns `None`), as before its first CNP.
//!
//! # The first CNP
//! A NIC sends at line rate until its first CNP, so its first cut starts from the line rate. A
//! ferroce QP sends at whatever rate the host and the application allow, often far below the
//! configured line rate, and a cut from the line rate would change nothing. So the first cut
//! starts from the rate the QP was measured sending at over the last [`RATE_METER_WINDOW`]
//! (NICs let the first rate be set, `rate_to_set_on_first_cnp`; this measures it), or from the
//! line rate when the QP sent nothing recently.
//!
//! # Defaults
//! The parameter names are those of mlx5's `rpg_*`/`np_*`/`dce_tcp_*` knobs; the NIC column
//! gives NVIDIA's documented firmware default (ConnectX-4 and later) where one was found, and
//! marks with † the values recalled from mlx5's sysfs but not confirmed against a document.
//! Ferroce's values are the paper's or scaled for links of 1 to 10 Gbit/s, its software links
//! (loopback moves 1 to 1.5 GB/s on two cores):
//!
//! | parameter | default | NIC default | why |
//! |---|---|---|---|
//! | line rate (`rpg_max_rate`) | 10 Gbit/s | port speed | the fastest a software path goes |
//! | `rpg_min_rate` | 10 Mbit/s | 1 Mbit/s | under the fair share of 64 flows on 1 Gbit/s, while a 4 KiB packet still leaves every 3.3 ms |
//! | `rpg_ai_rate` (R_AI) | 5 Mbit/s | 5 Mbit/s † | |
//! | `rpg_hai_rate` (R_HAI) | 50 Mbit/s | 50 Mbit/s † | |
//! | `rpg_time_reset` (T) | 300 µs | 300 µs † | several of a loopback round trip with engine wake-ups |
//! | `rpg_byte_reset` (B) | 64 KiB | 32 KiB † | 52 µs at 10 Gbit/s, 520 µs at 1 Gbit/s: bytes drive recovery at high rates, the timer at low ones |
//! | `rpg_threshold` (F) | 5 | 1 † | the paper's F: five fast-recovery steps |
//! | g | 1/256 | 5/1024 (`dce_tcp_g` 1019) | the paper's |
//! | K (`dce_tcp_rtt`) | 55 µs | 1 µs | the paper's: just over the NP's CNP interval, so a steadily congested path keeps α up |
//! | initial α (`initial_alpha_value`) | 1 | 1023/1024 | the first cut halves the rate |
//! | `rate_reduce_monitor_period` | 4 µs | 4 µs | |
//! | `np_min_time_between_cnps` (N) | 50 µs | 0 (mlx5's debugfs knob) | the paper's; a CNP per marked packet would double a congested path's packet count |

use core::time::Duration;

use crate::time::Instant;

/// The least time between two CNPs one QP sends (`np_min_time_between_cnps`; the paper's
/// N = 50 µs): marked packets within it owe no further CNP, so a congested path costs its
/// receiver at most 20,000 CNPs a second per QP, and the sender cuts at most that often.
pub const MIN_TIME_BETWEEN_CNPS: Duration = Duration::from_micros(50);

/// How long the reaction point measures the QP's sending rate for, to start its first cut from.
pub const RATE_METER_WINDOW: Duration = Duration::from_micros(100);

/// α's fixed-point one: α is kept in units of 2^-20, fine enough that repeated decay by
/// g = 1/256 takes it down to 0.0002 rather than stalling where a coarser step rounds to zero.
const ALPHA_ONE: u64 = 1 << 20;

/// Most increase events (or α decays) one call applies; past that the controller has been idle
/// long enough to be fully recovered, and is declared so, keeping every call bounded.
const MAX_STEPS_PER_CALL: u32 = 4096;

/// Bytes per second in a bit rate of `mbit` Mbit/s.
const fn mbit(mbit: u64) -> u64 {
    mbit * 1_000_000 / 8
}

/// The reaction point's parameters (see the module doc for what each does and why its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DcqcnConfig {
    /// The rate a QP sends at when unlimited, bytes per second (`rpg_max_rate`).
    pub line_rate: u64,
    /// The least rate a cut leaves, bytes per second (`rpg_min_rate`).
    pub min_rate: u64,
    /// The target rate's step in additive increase, bytes per second (`rpg_ai_rate`, R_AI).
    pub ai_rate: u64,
    /// The target rate's step in hyper increase, bytes per second (`rpg_hai_rate`, R_HAI).
    pub hai_rate: u64,
    /// Time without a CNP between two timer increase events (`rpg_time_reset`, T).
    pub time_reset: Duration,
    /// Bytes sent between two byte-counter increase events (`rpg_byte_reset`, B).
    pub byte_reset: u64,
    /// Increase events of one kind before fast recovery ends (`rpg_threshold`, F).
    pub threshold: u32,
    /// g as a power of two: g = 2^-`g_shift` (8: g = 1/256).
    pub g_shift: u32,
    /// Time without a CNP between two decays of α (`dce_tcp_rtt`, the paper's K).
    pub alpha_update_period: Duration,
    /// CNPs within this time of the last cut do not cut again (`rate_reduce_monitor_period`).
    pub rate_reduce_monitor_period: Duration,
}

impl Default for DcqcnConfig {
    fn default() -> DcqcnConfig {
        DcqcnConfig {
            line_rate: mbit(10_000),
            min_rate: mbit(10),
            ai_rate: mbit(5),
            hai_rate: mbit(50),
            time_reset: Duration::from_micros(300),
            byte_reset: 64 * 1024,
            threshold: 5,
            g_shift: 8,
            alpha_update_period: Duration::from_micros(55),
            rate_reduce_monitor_period: Duration::from_micros(4),
        }
    }
}

/// The state of a QP whose rate a CNP has limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limited {
    /// Rc, the current rate (bytes/s).
    current: u64,
    /// Rt, the target rate (bytes/s).
    target: u64,
    /// α in units of 1/`ALPHA_ONE`.
    alpha: u64,
    /// When α was last updated (by a CNP or a decay).
    alpha_at: Instant,
    /// When the running timer period began.
    timer_at: Instant,
    /// Timer increase events since the last cut.
    time_stage: u32,
    /// Byte-counter increase events since the last cut.
    byte_stage: u32,
    /// Bytes sent towards the next byte-counter event.
    bytes: u64,
    /// When the rate was last cut.
    cut_at: Instant,
}

/// The reaction point of one QP: the rate DCQCN lets it send at (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dcqcn {
    config: DcqcnConfig,
    /// `None` until the first CNP, and again once fully recovered.
    limited: Option<Limited>,
    /// Bytes sent since `meter_at`, to measure the sending rate.
    meter_bytes: u64,
    /// When the rate meter's running window began.
    meter_at: Instant,
    /// The rate measured over the last whole window, and when that window ended.
    measured: Option<(u64, Instant)>,
}

impl Dcqcn {
    /// A controller with `config`, unlimited until its first CNP.
    pub fn new(config: DcqcnConfig) -> Dcqcn {
        Dcqcn {
            config,
            ..Dcqcn::default()
        }
    }

    /// The parameters in force.
    pub fn config(&self) -> &DcqcnConfig {
        &self.config
    }

    /// A CNP arrived at `now`: cut the rate (unless one was cut within the monitor period).
    pub fn on_cnp(&mut self, now: Instant) {
        self.advance(now);
        let c = self.config;
        let l = match &mut self.limited {
            Some(l) => {
                if now.saturating_since(l.cut_at) < c.rate_reduce_monitor_period {
                    return;
                }
                l
            }
            None => {
                let first = self.first_rate(now);
                self.limited.insert(Limited {
                    current: first,
                    target: first,
                    alpha: ALPHA_ONE,
                    alpha_at: now,
                    timer_at: now,
                    time_stage: 0,
                    byte_stage: 0,
                    bytes: 0,
                    cut_at: now,
                })
            }
        };
        l.target = l.current;
        // Rc·(1 − α/2), in integers: α/2 of ALPHA_ONE is alpha / (2·ALPHA_ONE).
        let keep = 2 * ALPHA_ONE - l.alpha;
        let cut = (u128::from(l.current) * u128::from(keep) / u128::from(2 * ALPHA_ONE)) as u64;
        l.current = cut.max(c.min_rate);
        l.alpha = l.alpha - (l.alpha >> c.g_shift) + (ALPHA_ONE >> c.g_shift);
        l.alpha_at = now;
        l.timer_at = now;
        l.time_stage = 0;
        l.byte_stage = 0;
        l.bytes = 0;
        l.cut_at = now;
    }

    /// `bytes` left the QP at `now`: they count towards the byte counter's increase events and
    /// towards the measured sending rate.
    pub fn on_sent(&mut self, bytes: usize, now: Instant) {
        let bytes = bytes as u64;
        self.meter(bytes, now);
        self.advance(now);
        let c = self.config;
        let Some(l) = &mut self.limited else {
            return;
        };
        l.bytes += bytes;
        let mut steps = 0;
        while l.bytes >= c.byte_reset.max(1) {
            l.bytes -= c.byte_reset.max(1);
            l.byte_stage = l.byte_stage.saturating_add(1);
            if increase(&c, l) || steps >= MAX_STEPS_PER_CALL {
                self.limited = None;
                return;
            }
            steps += 1;
        }
    }

    /// The rate DCQCN allows at `now`, bytes per second; `None` for no limit (no CNP yet, or
    /// fully recovered to the line rate). The timer events and α decays due by `now` are
    /// applied to a copy, so this may be asked at any time without changing the controller.
    pub fn rate_bytes_per_sec(&self, now: Instant) -> Option<u64> {
        let mut at = *self;
        at.advance(now);
        at.limited.map(|l| l.current)
    }

    /// α at `now` (0 to 1), 0 while unlimited: how congested the controller believes the path.
    pub fn alpha(&self, now: Instant) -> f64 {
        let mut at = *self;
        at.advance(now);
        at.limited
            .map_or(0.0, |l| l.alpha as f64 / ALPHA_ONE as f64)
    }

    /// The target rate Rt at `now`, bytes per second; `None` while unlimited.
    pub fn target_rate(&self, now: Instant) -> Option<u64> {
        let mut at = *self;
        at.advance(now);
        at.limited.map(|l| l.target)
    }

    /// Applies the α decays and timer increase events due by `now`.
    fn advance(&mut self, now: Instant) {
        let c = self.config;
        let Some(l) = &mut self.limited else {
            return;
        };
        let k = c.alpha_update_period.as_nanos().max(1) as u64;
        let periods = now.as_nanos().saturating_sub(l.alpha_at.as_nanos()) / k;
        if periods > 0 {
            if periods > u64::from(MAX_STEPS_PER_CALL) {
                l.alpha = 0;
            } else {
                for _ in 0..periods {
                    l.alpha -= l.alpha >> c.g_shift;
                }
            }
            l.alpha_at = Instant::from_nanos(l.alpha_at.as_nanos() + periods * k);
        }
        let t = c.time_reset.as_nanos().max(1) as u64;
        let mut steps = 0;
        while now.as_nanos().saturating_sub(l.timer_at.as_nanos()) >= t {
            l.timer_at = Instant::from_nanos(l.timer_at.as_nanos() + t);
            l.time_stage = l.time_stage.saturating_add(1);
            if increase(&c, l) || steps >= MAX_STEPS_PER_CALL {
                self.limited = None;
                return;
            }
            steps += 1;
        }
    }

    /// Adds `bytes` sent at `now` to the rate meter, closing its window when it is full.
    fn meter(&mut self, bytes: u64, now: Instant) {
        self.meter_bytes += bytes;
        let elapsed = now.saturating_since(self.meter_at);
        if elapsed >= RATE_METER_WINDOW {
            let rate = u128::from(self.meter_bytes) * 1_000_000_000 / elapsed.as_nanos();
            self.measured = Some((u64::try_from(rate).unwrap_or(u64::MAX), now));
            self.meter_bytes = 0;
            self.meter_at = now;
        }
    }

    /// The rate the first cut starts from: the measured sending rate if it is recent, else the
    /// line rate; within [min rate, line rate].
    fn first_rate(&self, now: Instant) -> u64 {
        let c = self.config;
        let recent = self
            .measured
            .filter(|&(_, at)| now.saturating_since(at) <= 2 * RATE_METER_WINDOW)
            .map(|(rate, _)| rate);
        recent
            .unwrap_or(c.line_rate)
            .clamp(c.min_rate, c.line_rate.max(c.min_rate))
    }
}

/// One increase event (the stage counts already moved): fast recovery, additive or hyper
/// increase. Returns whether the rate is back at the line rate.
fn increase(c: &DcqcnConfig, l: &mut Limited) -> bool {
    let f = c.threshold;
    if l.time_stage.max(l.byte_stage) <= f {
        // Fast recovery: halve the distance to the rate before the cut.
    } else if l.time_stage.min(l.byte_stage) > f {
        let i = u64::from(l.time_stage.min(l.byte_stage) - f);
        l.target = l.target.saturating_add(i.saturating_mul(c.hai_rate));
    } else {
        l.target = l.target.saturating_add(c.ai_rate);
    }
    l.target = l.target.min(c.line_rate);
    l.current = ((u128::from(l.target) + u128::from(l.current)) / 2) as u64;
    l.current >= c.line_rate - c.line_rate / 1024
}

/// The notification point of one QP: whether it owes its peer a CNP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NotificationPoint {
    /// A CNP is owed and not yet sent.
    due: bool,
    /// When the last CNP was owed.
    last: Option<Instant>,
}

impl NotificationPoint {
    /// A packet marked Congestion Experienced arrived at `now`: a CNP is owed unless one was
    /// owed within `interval` ([`MIN_TIME_BETWEEN_CNPS`]). Returns whether this one is owed.
    pub fn on_marked(&mut self, now: Instant, interval: Duration) -> bool {
        if self.due
            || self
                .last
                .is_some_and(|t| now.saturating_since(t) < interval)
        {
            return false;
        }
        self.due = true;
        self.last = Some(now);
        true
    }

    /// Whether a CNP is owed.
    pub fn is_due(&self) -> bool {
        self.due
    }

    /// The owed CNP left (or can no longer leave).
    pub fn sent(&mut self) {
        self.due = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Instant {
        Instant::from_nanos(n * 1000)
    }

    /// A controller that was measured sending at 1 Gbit/s until `now`.
    fn sending_at_1g(now: Instant) -> Dcqcn {
        let mut d = Dcqcn::default();
        // 125 bytes per µs, one 12,500-byte burst per 100 µs.
        let mut t = 0;
        while t <= now.as_nanos() / 1000 {
            d.on_sent(12_500, us(t));
            t += 100;
        }
        assert_eq!(d.rate_bytes_per_sec(now), None, "unlimited before any CNP");
        d
    }

    #[test]
    fn unlimited_until_the_first_cnp() {
        let mut d = Dcqcn::default();
        assert_eq!(d.rate_bytes_per_sec(us(0)), None);
        d.on_sent(1 << 20, us(10));
        assert_eq!(d.rate_bytes_per_sec(us(1_000_000)), None);
        assert_eq!(d.alpha(us(0)), 0.0);
    }

    #[test]
    fn the_first_cnp_halves_the_measured_rate() {
        let mut d = sending_at_1g(us(1000));
        d.on_cnp(us(1000));
        let g1 = mbit(1000);
        let r = d.rate_bytes_per_sec(us(1000)).unwrap();
        assert!(r.abs_diff(g1 / 2) <= g1 / 100, "{r} is not half of {g1}");
        assert_eq!(d.target_rate(us(1000)), Some(d.limited.unwrap().target));
        // α started at 1 and moved towards 1 (it stays 1).
        assert_eq!(d.alpha(us(1000)), 1.0);
    }

    #[test]
    fn the_first_cnp_without_recent_traffic_starts_from_the_line_rate() {
        let mut d = Dcqcn::default();
        d.on_cnp(us(5));
        assert_eq!(
            d.rate_bytes_per_sec(us(5)),
            Some(DcqcnConfig::default().line_rate / 2)
        );
    }

    #[test]
    fn each_cnp_cuts_by_alpha_over_two_and_raises_alpha() {
        let mut d = sending_at_1g(us(1000));
        d.on_cnp(us(1000));
        let l = d.limited.unwrap();
        // A second CNP 50 µs later (no α decay yet: K = 55 µs).
        d.on_cnp(us(1050));
        let m = d.limited.unwrap();
        assert_eq!(m.target, l.current, "Rt = Rc before the cut");
        let want = (u128::from(l.current) * u128::from(2 * ALPHA_ONE - l.alpha)
            / u128::from(2 * ALPHA_ONE)) as u64;
        assert_eq!(m.current, want);
        let g = ALPHA_ONE >> 8;
        assert_eq!(m.alpha, l.alpha - (l.alpha >> 8) + g);
    }

    #[test]
    fn a_cnp_within_the_monitor_period_changes_nothing() {
        let mut d = sending_at_1g(us(1000));
        d.on_cnp(us(1000));
        let before = d;
        d.on_cnp(us(1002));
        assert_eq!(d, before);
    }

    #[test]
    fn alpha_decays_by_g_every_k_without_a_cnp() {
        let mut d = Dcqcn::default();
        d.on_cnp(us(0));
        let a0 = d.limited.unwrap().alpha;
        // Just before K, nothing; at K one decay; at 10 K ten.
        assert_eq!(d.alpha(us(54)), a0 as f64 / ALPHA_ONE as f64);
        let one = a0 - (a0 >> 8);
        assert_eq!(d.alpha(us(55)), one as f64 / ALPHA_ONE as f64);
        let mut ten = a0;
        for _ in 0..10 {
            ten -= ten >> 8;
        }
        assert_eq!(d.alpha(us(550)), ten as f64 / ALPHA_ONE as f64);
        // A long quiet spell takes α to nothing, in bounded work.
        assert!(d.alpha(us(10_000)) < 0.01);
        // Asking did not change the controller.
        assert_eq!(d.limited.unwrap().alpha, a0);
    }

    #[test]
    fn timer_events_recover_fast_then_additively() {
        let c = DcqcnConfig::default();
        let mut d = sending_at_1g(us(1000));
        d.on_cnp(us(1000));
        let l0 = d.limited.unwrap();
        let (rt, mut rc) = (l0.target, l0.current);
        let t = 300;
        // Five fast-recovery steps: Rt stays, Rc halves the distance to it.
        for k in 1..=5u64 {
            rc = (rt + rc) / 2;
            let at = us(1000 + k * t);
            assert_eq!(d.target_rate(at), Some(rt), "step {k}");
            assert_eq!(d.rate_bytes_per_sec(at), Some(rc), "step {k}");
            assert_ne!(d.rate_bytes_per_sec(us(1000 + k * t - 1)), Some(rc));
        }
        // The byte stage is 0: timer events past F are additive increase.
        let at = us(1000 + 6 * t);
        assert_eq!(d.target_rate(at), Some(rt + c.ai_rate));
        assert_eq!(d.rate_bytes_per_sec(at), Some((rt + c.ai_rate + rc) / 2));
    }

    #[test]
    fn additive_and_hyper_increase_raise_the_target() {
        let c = DcqcnConfig::default();
        let mut d = sending_at_1g(us(1000));
        d.on_cnp(us(1000));
        let rt = d.limited.unwrap().target;
        // Six timer events (one past F) and no bytes: one additive increase.
        let now = us(1000 + 6 * 300);
        d.advance(now);
        assert_eq!(d.limited.unwrap().target, rt + c.ai_rate);
        // Six byte events: the first five find the time stage past F and the byte stage not,
        // additive increase; the sixth finds both past F, hyper increase with i = 1.
        d.on_sent(6 * c.byte_reset as usize, now);
        let l = d.limited.unwrap();
        assert_eq!(l.byte_stage, 6);
        assert_eq!(l.target, rt + 6 * c.ai_rate + c.hai_rate);
        // The next timer event: stages 7 and 6, hyper increase with i = 6 - F = 1 again.
        d.advance(us(1000 + 7 * 300));
        assert_eq!(
            d.limited.unwrap().target,
            rt + 6 * c.ai_rate + 2 * c.hai_rate
        );
    }

    #[test]
    fn recovery_ends_unlimited_at_the_line_rate() {
        let mut d = Dcqcn::default();
        d.on_cnp(us(0));
        let mut now = 0;
        while d.rate_bytes_per_sec(us(now)).is_some() {
            now += 300;
            assert!(now < 10_000_000, "never recovered");
        }
        // Recovered within a few tens of milliseconds of quiet (hyper increase).
        assert!(now < 100_000, "took {now} µs");
        d.advance(us(now));
        assert_eq!(d.limited, None);
        // A later CNP starts again from the measured (here: line) rate.
        d.on_cnp(us(now + 1));
        assert!(d.rate_bytes_per_sec(us(now + 1)).is_some());
    }

    #[test]
    fn cuts_stop_at_the_minimum_rate() {
        let mut d = Dcqcn::default();
        for k in 0..200 {
            d.on_cnp(us(k * 50));
        }
        assert_eq!(
            d.rate_bytes_per_sec(us(199 * 50)),
            Some(DcqcnConfig::default().min_rate)
        );
    }

    #[test]
    fn a_cnp_resets_the_recovery_stages() {
        let mut d = sending_at_1g(us(1000));
        d.on_cnp(us(1000));
        d.on_sent(1000, us(4000));
        let l = d.limited.unwrap();
        assert_eq!((l.time_stage, l.bytes), (10, 1000));
        d.on_cnp(us(4000));
        let l = d.limited.unwrap();
        assert_eq!((l.time_stage, l.byte_stage, l.bytes), (0, 0, 0));
        assert_eq!(l.timer_at, us(4000));
    }

    #[test]
    fn one_cnp_per_interval_is_owed() {
        let mut np = NotificationPoint::default();
        assert!(np.on_marked(us(0), MIN_TIME_BETWEEN_CNPS));
        assert!(np.is_due());
        // Owed already: a second mark owes nothing more.
        assert!(!np.on_marked(us(1), MIN_TIME_BETWEEN_CNPS));
        np.sent();
        assert!(!np.is_due());
        assert!(!np.on_marked(us(49), MIN_TIME_BETWEEN_CNPS));
        assert!(np.on_marked(us(50), MIN_TIME_BETWEEN_CNPS));
    }
}
