//! Single-thread memcpy bandwidth: the ceiling for a shared-memory WRITE of one size.
//!
//! A shared-memory provider moves a WRITE's payload with one copy, so it cannot beat one thread
//! copying the same number of bytes. Two page-aligned buffers of `size` bytes are filled (the
//! source with a pattern, the destination by a first, untimed copy), then the source is copied
//! onto the destination `iters` times with `copy_from_slice` (the C library's `memcpy`). The
//! same buffers are reused every time, so sizes that fit in the caches are measured in them,
//! just as a benchmark reusing one registered buffer is. The copies run in up to ten rounds,
//! each timed; the figure is all bytes over all the time, and the best round is kept beside it
//! as a hint of how much noise the machine added.

use std::hint::black_box;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::output::round;
use crate::MemcpyArgs;

/// Buffers are aligned to this (a page), as registered memory regions are.
const ALIGN: usize = 4096;

/// The default number of copies moves about this many bytes per size.
const DEFAULT_BYTES_PER_SIZE: u64 = 2 << 30;

/// Fewest copies by default, so the biggest sizes still give several rounds.
const MIN_DEFAULT_ITERS: u64 = 10;

/// Most copies by default, so the smallest sizes do not take forever on call overhead.
const MAX_DEFAULT_ITERS: u64 = 10_000_000;

/// Most rounds the copies are split into.
const MAX_ROUNDS: u64 = 10;

/// Smallest and largest size of `--all`: 4 KiB to 4 MiB.
const ALL_SIZES: (u64, u64) = (4 << 10, 4 << 20);

/// Megabyte as perftest counts it (and ferroce's perf tool): 2^20 bytes.
const MB: f64 = (1u64 << 20) as f64;

/// The figures of one size.
#[derive(Debug, Clone, PartialEq)]
pub struct MemcpyResult {
    /// Bytes per copy.
    pub size: u64,
    /// Timed copies.
    pub iterations: u64,
    /// Rounds the copies were split into.
    pub rounds: u64,
    /// Seconds all timed copies took.
    pub seconds: f64,
    /// Bytes copied per second over all rounds.
    pub bytes_per_s: f64,
    /// Bytes copied per second in the fastest round.
    pub best_bytes_per_s: f64,
}

impl MemcpyResult {
    /// The result as one JSON object on one line: GB is 10^9 bytes, MB is 2^20 bytes.
    pub fn to_json(&self) -> String {
        json!({
            "test": "memcpy",
            "size": self.size,
            "iterations": self.iterations,
            "rounds": self.rounds,
            "seconds": round(self.seconds, 6),
            "gb_s": round(self.bytes_per_s / 1e9, 3),
            "mb_s": round(self.bytes_per_s / MB, 1),
            "best_gb_s": round(self.best_bytes_per_s / 1e9, 3),
            "best_mb_s": round(self.best_bytes_per_s / MB, 1),
        })
        .to_string()
    }

    /// The result as one line for people.
    pub fn to_human(&self) -> String {
        format!(
            "memcpy {} B x {}: {:.2} GB/s ({:.0} MB/s, MB = 2^20 B), best round {:.2} GB/s",
            self.size,
            self.iterations,
            self.bytes_per_s / 1e9,
            self.bytes_per_s / MB,
            self.best_bytes_per_s / 1e9,
        )
    }
}

/// The sizes `args` asks for.
fn sizes(args: &MemcpyArgs) -> Vec<u64> {
    match args.size {
        Some(size) if !args.all => vec![size],
        _ => std::iter::successors(Some(ALL_SIZES.0), |s| Some(s * 2))
            .take_while(|&s| s <= ALL_SIZES.1)
            .collect(),
    }
}

/// Copies to make of `size` bytes when the command line does not say.
fn default_iters(size: u64) -> u64 {
    (DEFAULT_BYTES_PER_SIZE / size.max(1)).clamp(MIN_DEFAULT_ITERS, MAX_DEFAULT_ITERS)
}

/// Splits `iters` copies into at most [`MAX_ROUNDS`] rounds whose sizes differ by one at most.
fn rounds(iters: u64) -> Vec<u64> {
    let n = iters.clamp(1, MAX_ROUNDS);
    (0..n)
        .map(|i| iters / n + u64::from(i < iters % n))
        .collect()
}

/// Runs every size `args` asks for, in increasing order.
pub fn run_all(args: &MemcpyArgs) -> Result<Vec<MemcpyResult>, String> {
    sizes(args)
        .into_iter()
        .map(|size| run(size, args.iters.unwrap_or_else(|| default_iters(size))))
        .collect()
}

/// A zeroed buffer with a page-aligned window of `size` bytes in it.
struct Aligned {
    /// The allocation, [`ALIGN`] bytes larger than the window.
    buf: Vec<u8>,
    /// Where the window starts in `buf`.
    start: usize,
    /// The window's length.
    size: usize,
}

impl Aligned {
    /// Allocates the buffer; an allocation the system refuses becomes an error, not an abort.
    fn new(size: usize) -> Result<Aligned, String> {
        let len = size
            .checked_add(ALIGN)
            .ok_or_else(|| format!("{size} bytes is too large"))?;
        let mut buf = Vec::new();
        buf.try_reserve_exact(len)
            .map_err(|e| format!("cannot allocate {len} bytes: {e}"))?;
        buf.resize(len, 0);
        let start = buf.as_ptr().align_offset(ALIGN);
        Ok(Aligned { buf, start, size })
    }

    /// The aligned window.
    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.size]
    }

    /// The aligned window, writable.
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.size]
    }
}

/// Measures `iters` copies of `size` bytes.
pub fn run(size: u64, iters: u64) -> Result<MemcpyResult, String> {
    let len = usize::try_from(size).map_err(|_| format!("{size} bytes is too large"))?;
    let mut src = Aligned::new(len)?;
    let mut dst = Aligned::new(len)?;
    // A pattern with no period of a power of two, so a copy landing at the wrong offset shows.
    for (i, b) in src.bytes_mut().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    dst.bytes_mut().copy_from_slice(src.bytes());

    let mut total = Duration::ZERO;
    let mut best = 0.0f64;
    let plan = rounds(iters);
    for &n in &plan {
        let t0 = Instant::now();
        for _ in 0..n {
            // black_box: the compiler must assume every copy is read, so none is elided.
            black_box(dst.bytes_mut()).copy_from_slice(black_box(src.bytes()));
        }
        let t = t0.elapsed();
        total += t;
        best = best.max(size as f64 * n as f64 / t.as_secs_f64().max(1e-9));
    }
    if dst.bytes() != src.bytes() {
        return Err(format!(
            "memcpy {size} B: the destination differs from the source"
        ));
    }
    let seconds = total.as_secs_f64().max(1e-9);
    Ok(MemcpyResult {
        size,
        iterations: iters,
        rounds: plan.len() as u64,
        seconds,
        bytes_per_s: size as f64 * iters as f64 / seconds,
        best_bytes_per_s: best,
    })
}

/// Tests of the plan (sizes, rounds) and a small real copy.
#[cfg(test)]
mod tests {
    use super::*;

    /// Arguments for one size or for all.
    fn args(size: Option<u64>, all: bool) -> MemcpyArgs {
        MemcpyArgs {
            size,
            all,
            iters: None,
            json: false,
        }
    }

    /// `--all` is the eleven powers of two from 4 KiB to 4 MiB; `--size` is that size alone.
    #[test]
    fn size_lists() {
        let all = sizes(&args(None, true));
        assert_eq!(all.len(), 11);
        assert_eq!(all.first(), Some(&4096));
        assert_eq!(all.last(), Some(&(4 << 20)));
        assert!(all.windows(2).all(|w| w[1] == 2 * w[0]));
        assert_eq!(sizes(&args(Some(1000), false)), vec![1000]);
    }

    /// Rounds add up to the iterations and differ by at most one.
    #[test]
    fn round_plan() {
        assert_eq!(rounds(1), vec![1]);
        assert_eq!(rounds(3), vec![1, 1, 1]);
        assert_eq!(rounds(25), vec![3, 3, 3, 3, 3, 2, 2, 2, 2, 2]);
        for iters in [1, 9, 10, 11, 999, 1_000_003] {
            let r = rounds(iters);
            assert_eq!(r.iter().sum::<u64>(), iters);
            assert!(r.len() as u64 <= MAX_ROUNDS);
            assert!(r.iter().max().unwrap() - r.iter().min().unwrap() <= 1);
        }
    }

    /// Default iteration counts move about 2 GiB, within the bounds.
    #[test]
    fn default_iteration_counts() {
        assert_eq!(default_iters(4096), 524_288);
        assert_eq!(default_iters(4 << 20), 512);
        assert_eq!(default_iters(1), MAX_DEFAULT_ITERS);
        assert_eq!(default_iters(1 << 30), MIN_DEFAULT_ITERS);
    }

    /// A real copy of an odd size reports consistent figures.
    #[test]
    fn small_copy() {
        let r = run(4099, 50).unwrap();
        assert_eq!((r.size, r.iterations, r.rounds), (4099, 50, 10));
        assert!(r.bytes_per_s > 0.0 && r.best_bytes_per_s >= r.bytes_per_s * 0.999);
        assert!(r.seconds > 0.0);
    }
}
