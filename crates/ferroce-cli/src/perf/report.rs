//! perftest-shaped statistics and output.

use serde_json::json;

/// Latency statistics of one message size, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatStats {
    pub bytes: u64,
    pub iterations: u64,
    pub t_min: f64,
    pub t_max: f64,
    pub t_typical: f64,
    pub t_avg: f64,
    pub t_stdev: f64,
    pub p99: f64,
    pub p999: f64,
}

impl LatStats {
    /// Statistics of samples given in nanoseconds, divided by `divisor` (2 for a half round trip).
    pub fn from_samples(bytes: u64, samples: &mut [u64], divisor: f64) -> LatStats {
        samples.sort_unstable();
        let us: Vec<f64> = samples
            .iter()
            .map(|&ns| ns as f64 / 1000.0 / divisor)
            .collect();
        let n = us.len().max(1) as f64;
        let avg = us.iter().sum::<f64>() / n;
        let var = us.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n;
        let pct = |p: f64| -> f64 {
            if us.is_empty() {
                return 0.0;
            }
            let i = ((p * us.len() as f64).ceil() as usize).clamp(1, us.len()) - 1;
            us[i]
        };
        LatStats {
            bytes,
            iterations: us.len() as u64,
            t_min: us.first().copied().unwrap_or(0.0),
            t_max: us.last().copied().unwrap_or(0.0),
            t_typical: pct(0.5),
            t_avg: avg,
            t_stdev: var.sqrt(),
            p99: pct(0.99),
            p999: pct(0.999),
        }
    }

    pub const HEADER: &'static str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

    pub fn line(&self) -> String {
        format!(
            " {:<6} {:<10}   {:<13.2}  {:<13.2}  {:<15.2}  {:<13.2}  {:<14.2}  {:<21.2}  {:<.2}",
            self.bytes,
            self.iterations,
            self.t_min,
            self.t_max,
            self.t_typical,
            self.t_avg,
            self.t_stdev,
            self.p99,
            self.p999
        )
    }

    pub fn json(&self) -> serde_json::Value {
        json!({
            "bytes": self.bytes, "iterations": self.iterations,
            "t_min_us": self.t_min, "t_max_us": self.t_max, "t_typical_us": self.t_typical,
            "t_avg_us": self.t_avg, "t_stdev_us": self.t_stdev, "p99_us": self.p99, "p999_us": self.p999,
        })
    }
}

/// Bandwidth statistics of one message size. MB is 2^20 bytes, as perftest counts it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwStats {
    pub bytes: u64,
    pub iterations: u64,
    pub bw_peak: f64,
    pub bw_avg: f64,
    pub msg_rate: f64,
}

const MB: f64 = (1u64 << 20) as f64;

impl BwStats {
    /// From the completion times (ns since the first post) of every message, in order.
    pub fn from_completions(bytes: u64, completions_ns: &[u64]) -> BwStats {
        let total_ns = completions_ns.last().copied().unwrap_or(0);
        BwStats::over(bytes, completions_ns, total_ns)
    }

    /// From the completion times (ns since the first post) of the messages that completed
    /// within a timed run of `window_ns`: the average is over the whole window, so a stalled
    /// tail counts against it.
    pub fn over(bytes: u64, completions_ns: &[u64], window_ns: u64) -> BwStats {
        let n = completions_ns.len() as u64;
        let total_ns = window_ns.max(1);
        let secs = total_ns as f64 / 1e9;
        let bw_avg = (bytes * n) as f64 / MB / secs;
        // Peak: the best of twenty equal stretches of time. (Completions arrive in batches
        // with one timestamp, so slicing by count would divide by nearly nothing.)
        const SLICES: u64 = 20;
        let mut per_slice = [0u64; SLICES as usize];
        for &t in completions_ns {
            let i = (t.saturating_sub(1) * SLICES / total_ns).min(SLICES - 1);
            per_slice[i as usize] += 1;
        }
        let slice_secs = secs / SLICES as f64;
        let best = per_slice.iter().copied().max().unwrap_or(0);
        let bw_peak = if n >= SLICES {
            ((bytes * best) as f64 / MB / slice_secs).max(bw_avg)
        } else {
            bw_avg
        };
        BwStats {
            bytes,
            iterations: n,
            bw_peak,
            bw_avg,
            msg_rate: n as f64 / secs / 1e6,
        }
    }

    pub const HEADER: &'static str =
        " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";

    pub fn line(&self) -> String {
        format!(
            " {:<10} {:<10}       {:<16.2}   {:<18.2}   {:.6}",
            self.bytes, self.iterations, self.bw_peak, self.bw_avg, self.msg_rate
        )
    }

    pub fn json(&self) -> serde_json::Value {
        json!({
            "bytes": self.bytes, "iterations": self.iterations,
            "bw_peak_mb_s": self.bw_peak, "bw_avg_mb_s": self.bw_avg, "msg_rate_mpps": self.msg_rate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles() {
        let mut s: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let l = LatStats::from_samples(8, &mut s, 1.0);
        assert_eq!(
            (l.t_min, l.t_max, l.t_typical, l.p99, l.p999),
            (1.0, 1000.0, 500.0, 990.0, 999.0)
        );
        assert!((l.t_avg - 500.5).abs() < 1e-9);
        let h = LatStats::from_samples(8, &mut [4000, 4000], 2.0);
        assert_eq!(h.t_avg, 2.0);
    }

    #[test]
    fn bandwidth_average_and_peak() {
        // 100 messages of 1 MiB, one per millisecond: 1000 MB/s.
        let t: Vec<u64> = (1..=100).map(|i| i * 1_000_000).collect();
        let b = BwStats::from_completions(1 << 20, &t);
        assert!((b.bw_avg - 1000.0).abs() < 1e-6);
        assert!((b.bw_peak - 1000.0).abs() < 1e-6);
        assert!((b.msg_rate - 0.001).abs() < 1e-9);
    }

    #[test]
    fn a_timed_run_averages_over_its_whole_window() {
        // 100 messages of 1 MiB in the first 100 ms of a one-second window, then nothing.
        let t: Vec<u64> = (1..=100).map(|i| i * 1_000_000).collect();
        let b = BwStats::over(1 << 20, &t, 1_000_000_000);
        assert!((b.bw_avg - 100.0).abs() < 1e-6);
        assert!((b.bw_peak - 1000.0).abs() < 1e-6, "{}", b.bw_peak);
        let none = BwStats::over(1 << 20, &[], 1_000_000_000);
        assert_eq!((none.bw_avg, none.bw_peak, none.iterations), (0.0, 0.0, 0));
    }
}
