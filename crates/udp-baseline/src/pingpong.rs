//! The ping-pong latency test: two threads bounce one datagram over loopback, both busy-polling.
//!
//! The initiator (the calling thread) stamps the iteration number into the payload, sends it,
//! spins on `recv(MSG_DONTWAIT)` until the echo comes back, and times that round trip with the
//! monotonic clock. The responder (a second thread) spins the same way and echoes each datagram.
//! Warm-up round trips come first and are not timed. Figures are one-way: half a round trip.
//!
//! Spinning is the point (waking a sleeping thread costs tens of microseconds, far more than the
//! network path), but a spinner that has polled for a long while yields its CPU once in a while,
//! so the test still makes progress on a machine whose cores are all busy with something else.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::args::PingPongArgs;
use crate::output::json_num;
use crate::sock;

/// Empty polls between two looks at the clock and two `sched_yield`s. A loopback reply comes
/// within a few dozen polls, so timed round trips on a quiet machine never reach this.
const POLLS_PER_YIELD: u32 = 4096;

/// How long the initiator waits for an echo before giving up (a datagram was lost, or the
/// responder died).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// The figures of one ping-pong run.
#[derive(Debug, Clone, PartialEq)]
pub struct PingPongResult {
    /// Payload bytes per datagram.
    pub size: usize,
    /// Timed round trips.
    pub iterations: u64,
    /// Untimed round trips before them.
    pub warmup: u64,
    /// One-way latency of the fastest round trip, µs.
    pub t_min_us: f64,
    /// One-way latency of the median round trip, µs.
    pub t_typical_us: f64,
    /// Mean one-way latency, µs.
    pub t_avg_us: f64,
    /// One-way latency of the 99th-percentile round trip, µs.
    pub p99_us: f64,
    /// One-way latency of the slowest round trip, µs.
    pub t_max_us: f64,
}

impl PingPongResult {
    /// The result as one JSON object on one line.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"test\":\"pingpong\",\"size\":{},\"iterations\":{},\"warmup\":{},\
             \"t_min_us\":{},\"t_typical_us\":{},\"t_avg_us\":{},\"p99_us\":{},\"t_max_us\":{}}}",
            self.size,
            self.iterations,
            self.warmup,
            json_num(self.t_min_us, 3),
            json_num(self.t_typical_us, 3),
            json_num(self.t_avg_us, 3),
            json_num(self.p99_us, 3),
            json_num(self.t_max_us, 3),
        )
    }

    /// The result as one line for people.
    pub fn to_human(&self) -> String {
        format!(
            "pingpong {} B, busy-poll, {} round trips: one-way min {:.3} us, typical {:.3} us, \
             avg {:.3} us, p99 {:.3} us, max {:.3} us",
            self.size,
            self.iterations,
            self.t_min_us,
            self.t_typical_us,
            self.t_avg_us,
            self.p99_us,
            self.t_max_us,
        )
    }
}

/// Runs the ping-pong test described by `args`.
pub fn run(args: &PingPongArgs) -> Result<PingPongResult, String> {
    let (ping, pong) = sock::loopback_pair().map_err(|e| format!("loopback sockets: {e}"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let responder = {
        let stop = Arc::clone(&stop);
        let size = args.size;
        thread::Builder::new()
            .name("pingpong-responder".into())
            .spawn(move || respond(&pong, size, &stop))
            .map_err(|e| format!("cannot start the responder thread: {e}"))?
    };
    let samples = initiate(&ping, args);
    // Whatever happened, let the responder finish before `ping` (its peer) closes.
    stop.store(true, Ordering::Relaxed);
    let echoed = responder
        .join()
        .map_err(|_| "the responder thread panicked".to_string())?;
    let samples = samples?;
    echoed.map_err(|e| format!("responder: {e}"))?;
    Ok(summarize(args, samples))
}

/// The responder: echoes every datagram on `sock` until `stop` is set and nothing is waiting.
/// Returns the number of datagrams echoed.
fn respond(sock: &UdpSocket, size: usize, stop: &AtomicBool) -> Result<u64, String> {
    let mut buf = vec![0u8; size];
    let mut echoed = 0u64;
    let mut idle = 0u32;
    loop {
        match sock::recv_dontwait(sock, &mut buf) {
            Ok(Some(n)) => {
                idle = 0;
                sock.send(&buf[..n]).map_err(|e| format!("send: {e}"))?;
                echoed += 1;
            }
            Ok(None) => {
                if stop.load(Ordering::Relaxed) {
                    return Ok(echoed);
                }
                idle = idle.wrapping_add(1);
                if idle % POLLS_PER_YIELD == 0 {
                    thread::yield_now();
                }
            }
            Err(e) => return Err(format!("recv: {e}")),
        }
    }
}

/// The initiator: `args.warmup + args.iters` round trips on `sock`; returns the round-trip
/// times of the timed ones, in nanoseconds.
fn initiate(sock: &UdpSocket, args: &PingPongArgs) -> Result<Vec<u64>, String> {
    let mut tx = vec![0x5au8; args.size];
    let mut rx = vec![0u8; args.size];
    // MAX_ITERS bounds `iters`, so this allocation is at most 80 MB.
    let mut samples = Vec::with_capacity(usize::try_from(args.iters).unwrap_or(0));
    let stamp_len = args.size.min(8);
    for i in 0..args.warmup + args.iters {
        // Stamp the iteration so a stale or foreign datagram cannot pass for the echo.
        tx[..stamp_len].copy_from_slice(&i.to_le_bytes()[..stamp_len]);
        let t0 = Instant::now();
        sock.send(&tx)
            .map_err(|e| format!("send (round trip {i}): {e}"))?;
        let mut polls = 0u32;
        let n = loop {
            match sock::recv_dontwait(sock, &mut rx) {
                Ok(Some(n)) => break n,
                Ok(None) => {
                    polls = polls.wrapping_add(1);
                    if polls % POLLS_PER_YIELD == 0 {
                        if t0.elapsed() > REPLY_TIMEOUT {
                            return Err(format!(
                                "no echo within {} s (round trip {i})",
                                REPLY_TIMEOUT.as_secs()
                            ));
                        }
                        thread::yield_now();
                    }
                }
                Err(e) => return Err(format!("recv (round trip {i}): {e}")),
            }
        };
        let rtt = t0.elapsed();
        if n != args.size || rx[..stamp_len] != tx[..stamp_len] {
            return Err(format!(
                "round trip {i}: the echo is not the datagram sent ({n} bytes)"
            ));
        }
        if i >= args.warmup {
            samples.push(u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX));
        }
    }
    Ok(samples)
}

/// Turns round-trip samples (ns) into one-way figures (µs).
fn summarize(args: &PingPongArgs, mut rtt_ns: Vec<u64>) -> PingPongResult {
    rtt_ns.sort_unstable();
    let one_way_us = |ns: f64| ns / 2.0 / 1000.0;
    let n = rtt_ns.len();
    let at = |i: usize| rtt_ns.get(i).copied().unwrap_or(0) as f64;
    let median = if n % 2 == 0 && n > 0 {
        (at(n / 2 - 1) + at(n / 2)) / 2.0
    } else {
        at(n / 2)
    };
    // Nearest-rank percentile: the smallest sample with at least 99% of samples at or below it.
    let p99_rank = (n * 99).div_ceil(100).max(1);
    let sum: u128 = rtt_ns.iter().map(|&x| u128::from(x)).sum();
    let mean = if n > 0 { sum as f64 / n as f64 } else { 0.0 };
    PingPongResult {
        size: args.size,
        iterations: n as u64,
        warmup: args.warmup,
        t_min_us: one_way_us(at(0)),
        t_typical_us: one_way_us(median),
        t_avg_us: one_way_us(mean),
        p99_us: one_way_us(at(p99_rank - 1)),
        t_max_us: one_way_us(at(n.saturating_sub(1))),
    }
}

/// Tests of the statistics and a tiny real run.
#[cfg(test)]
mod tests {
    use super::*;

    /// Arguments with the given iteration count.
    fn args(iters: u64) -> PingPongArgs {
        PingPongArgs {
            size: 8,
            iters,
            warmup: 0,
            json: true,
        }
    }

    /// Minimum, median, mean, nearest-rank p99 and maximum on known samples.
    #[test]
    fn statistics() {
        // Round trips 2, 4, ..., 200 µs: one-way 1..=100 µs.
        let samples: Vec<u64> = (1..=100).rev().map(|k| k * 2000).collect();
        let r = summarize(&args(100), samples);
        assert_eq!(r.iterations, 100);
        assert_eq!(r.t_min_us, 1.0);
        assert_eq!(r.t_typical_us, 50.5);
        assert_eq!(r.t_avg_us, 50.5);
        assert_eq!(r.p99_us, 99.0);
        assert_eq!(r.t_max_us, 100.0);
        let one = summarize(&args(1), vec![6000]);
        assert_eq!(
            (one.t_min_us, one.t_typical_us, one.p99_us),
            (3.0, 3.0, 3.0)
        );
    }

    /// The JSON line has the documented keys in order.
    #[test]
    fn json_shape() {
        let r = summarize(&args(3), vec![2000, 4000, 6000]);
        assert_eq!(
            r.to_json(),
            "{\"test\":\"pingpong\",\"size\":8,\"iterations\":3,\"warmup\":0,\"t_min_us\":1.000,\
             \"t_typical_us\":2.000,\"t_avg_us\":2.000,\"p99_us\":3.000,\"t_max_us\":3.000}"
        );
    }

    /// A short real ping-pong completes with ordered, positive figures.
    #[test]
    fn runs() {
        let r = run(&PingPongArgs {
            size: 1,
            iters: 50,
            warmup: 5,
            json: false,
        })
        .unwrap();
        assert_eq!(r.iterations, 50);
        assert!(r.t_min_us > 0.0 && r.t_min_us <= r.t_typical_us && r.t_typical_us <= r.p99_us);
    }
}
