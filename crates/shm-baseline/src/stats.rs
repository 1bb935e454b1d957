//! Order statistics of latency samples.

/// Minimum, median, mean, 99th percentile and maximum of a set of samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// The smallest sample.
    pub min: f64,
    /// The median (the mean of the two middle samples when their number is even).
    pub median: f64,
    /// The arithmetic mean.
    pub mean: f64,
    /// Nearest-rank 99th percentile: the smallest sample with at least 99% of the samples at or
    /// below it.
    pub p99: f64,
    /// The largest sample.
    pub max: f64,
}

impl Summary {
    /// Summarizes `samples` (sorted in place), each multiplied by `scale` (for instance ns per
    /// clock tick, halved for a one-way figure). `None` when there are no samples.
    pub fn of(samples: &mut [u64], scale: f64) -> Option<Summary> {
        samples.sort_unstable();
        let n = samples.len();
        let at = |i: usize| samples.get(i).map(|&x| x as f64 * scale);
        let min = at(0)?;
        let max = at(n - 1)?;
        let median = if n % 2 == 0 {
            (at(n / 2 - 1)? + at(n / 2)?) / 2.0
        } else {
            at(n / 2)?
        };
        let p99 = at((n * 99).div_ceil(100).max(1) - 1)?;
        let sum: u128 = samples.iter().map(|&x| u128::from(x)).sum();
        let mean = sum as f64 / n as f64 * scale;
        Some(Summary {
            count: n,
            min,
            median,
            mean,
            p99,
            max,
        })
    }
}

/// Tests of the statistics on known samples.
#[cfg(test)]
mod tests {
    use super::*;

    /// 1..=100 shuffled: every statistic lands on its textbook value.
    #[test]
    fn known_samples() {
        let mut s: Vec<u64> = (1..=100).map(|k| (k * 37) % 101).collect();
        let r = Summary::of(&mut s, 1.0).unwrap();
        assert_eq!(r.count, 100);
        assert_eq!(
            (r.min, r.median, r.mean, r.p99, r.max),
            (1.0, 50.5, 50.5, 99.0, 100.0)
        );
    }

    /// The scale applies to every figure; an odd count has a middle sample.
    #[test]
    fn scaled_odd_count() {
        let mut s = vec![30, 10, 20];
        let r = Summary::of(&mut s, 0.5).unwrap();
        assert_eq!(
            (r.min, r.median, r.mean, r.p99, r.max),
            (5.0, 10.0, 10.0, 15.0, 15.0)
        );
        let mut one = vec![8];
        let r = Summary::of(&mut one, 0.5).unwrap();
        assert_eq!((r.min, r.median, r.p99, r.max), (4.0, 4.0, 4.0, 4.0));
    }

    /// No samples, no summary (rather than a division by zero).
    #[test]
    fn empty() {
        assert_eq!(Summary::of(&mut [], 1.0), None);
    }
}
