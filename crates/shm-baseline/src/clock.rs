//! A clock cheap enough to time one cache-line round trip.
//!
//! A round trip between two cores takes some 50–100 ns; reading the monotonic clock through the
//! vDSO costs 20–40 ns in a KVM guest, which would be a large part of every sample. On x86-64 the
//! time-stamp counter is read instead (one instruction, as `ucx_perftest` does) and converted to
//! nanoseconds with a factor calibrated against [`Instant`] over the same run. Elsewhere the
//! monotonic clock is used directly and the factor is 1.

use std::time::{Duration, Instant};

/// Shortest stretch of time over which the tick rate is calibrated: long enough that the
/// nanosecond granularity of [`Instant`] and the cost of reading both clocks vanish in it.
const MIN_CALIBRATION: Duration = Duration::from_millis(20);

/// The name of the clock [`ticks`] reads, as printed in the results.
#[cfg(target_arch = "x86_64")]
pub const NAME: &str = "tsc";

/// The name of the clock [`ticks`] reads, as printed in the results.
#[cfg(not(target_arch = "x86_64"))]
pub const NAME: &str = "monotonic";

/// The current time in ticks of the fastest clock available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn ticks() -> u64 {
    // SAFETY: RDTSC exists on every x86-64 CPU; it only reads the time-stamp counter and touches
    // no memory. (A process can ask the kernel to make it fault with prctl(PR_SET_TSC); this
    // program never does.)
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// The current time in ticks of the fastest clock available (here: ns since the first call).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn ticks() -> u64 {
    use std::sync::OnceLock;
    /// The moment tick 0 stands for.
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// The clock's effective resolution, in ticks: the median change between two back-to-back reads
/// that saw it change. That is the counter's step where it advances in steps (AMD Zen derives the
/// time-stamp counter from a 100 MHz reference: 26 ticks, 10 ns, on a 2.6 GHz part, with the odd
/// 1-tick correction that a minimum would wrongly pick), and the cost of one read where it
/// advances every cycle. Either way, no sample is finer than this.
pub fn resolution() -> u64 {
    /// Changes of the counter looked at.
    const CHANGES: usize = 201;
    let mut deltas = Vec::with_capacity(CHANGES);
    let mut last = ticks();
    while deltas.len() < CHANGES {
        let now = ticks();
        if now != last {
            deltas.push(now.wrapping_sub(last));
            last = now;
        }
    }
    deltas.sort_unstable();
    deltas[CHANGES / 2]
}

/// Measures the tick rate against the monotonic clock between [`Calibration::start`] and
/// [`Calibration::finish`].
#[derive(Debug, Clone, Copy)]
pub struct Calibration {
    /// The monotonic clock at the start.
    instant: Instant,
    /// The tick counter at the start.
    ticks: u64,
}

impl Calibration {
    /// Starts measuring.
    pub fn start() -> Calibration {
        Calibration {
            instant: Instant::now(),
            ticks: ticks(),
        }
    }

    /// Nanoseconds per tick over the time since [`Calibration::start`], waiting (spinning) until
    /// at least [`MIN_CALIBRATION`] has passed. `None` if the counter did not advance, which
    /// would make every figure meaningless.
    pub fn finish(self) -> Option<f64> {
        while self.instant.elapsed() < MIN_CALIBRATION {
            std::hint::spin_loop();
        }
        let elapsed = self.instant.elapsed();
        let dt = ticks().checked_sub(self.ticks).filter(|&d| d > 0)?;
        Some(elapsed.as_nanos() as f64 / dt as f64)
    }
}

/// Tests of the clock and its calibration.
#[cfg(test)]
mod tests {
    use super::*;

    /// Ticks advance, and a calibrated interval agrees with the monotonic clock's measure of it.
    #[test]
    fn calibrated_ticks_measure_time() {
        let cal = Calibration::start();
        let ns_per_tick = cal.finish().expect("the counter advances");
        // Any real counter ticks between 10 MHz and 100 GHz.
        assert!((0.01..=100.0).contains(&ns_per_tick), "{ns_per_tick}");
        let (i0, t0) = (Instant::now(), ticks());
        std::thread::sleep(Duration::from_millis(5));
        let (t1, i1) = (ticks(), Instant::now());
        let by_ticks = (t1 - t0) as f64 * ns_per_tick;
        let by_instant = (i1 - i0).as_nanos() as f64;
        // Both clocks measured the same stretch; only the order of the reads separates them.
        assert!(
            (by_ticks / by_instant - 1.0).abs() < 0.05,
            "{by_ticks} ns by ticks, {by_instant} ns by Instant"
        );
    }

    /// The resolution is at least one tick and well under a microsecond.
    #[test]
    fn resolution_is_fine() {
        let ns_per_tick = Calibration::start().finish().unwrap();
        let r = resolution();
        assert!(r >= 1);
        assert!((r as f64 * ns_per_tick) < 1000.0, "{r} ticks");
    }
}
