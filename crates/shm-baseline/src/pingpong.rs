//! The cache-line ping-pong: the floor under any same-host latency.
//!
//! Two processes share one page ([`SharedPage`]). The initiator (this process) stores the round
//! trip's sequence number in the `Ping` word and spins until the `Pong` word holds the same
//! number; the responder (this binary re-executed as `pingpong-responder`, with the page's
//! memfd as stdin) spins on `Ping` and copies every new value into `Pong`. Each round trip thus
//! moves the two cache lines from one core to the other and back, which is exactly what a
//! shared-memory WRITE and its completion notice cost at the least. The figure is one-way: half
//! a round trip. Warm-up round trips come first and are not timed; nothing is pinned, so both
//! processes go wherever the scheduler puts them, as a provider's processes would.
//!
//! Spinning is the point (waking a sleeping process costs microseconds), but a spinner that has
//! polled for a long while yields its CPU once in a while, so the test still makes progress when
//! both processes share one core (two cores, other work running).

use std::io;
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::clock::{self, Calibration};
use crate::output::round;
use crate::shared::{SharedPage, Word};
use crate::stats::Summary;
use crate::PingPongArgs;

/// Empty polls between two looks at the clock and two `sched_yield`s. A round trip between two
/// running processes takes a few dozen polls, so timed round trips on a quiet machine never
/// reach this.
const POLLS_PER_YIELD: u32 = 4096;

/// How long either side waits for the other before giving up (the peer died or never started).
const PEER_TIMEOUT: Duration = Duration::from_secs(10);

/// What the initiator writes in the handshake word before starting the responder.
const HELLO: u64 = 0x7368_6d2d_6865_6c6f;

/// What the responder writes in the handshake word once it watches `Ping`.
const READY: u64 = 0x7368_6d2d_7265_6479;

/// The `Ping` value that tells the responder to stop (sequence numbers never reach it).
const STOP: u64 = u64::MAX;

/// The figures of one ping-pong run, in nanoseconds, one-way (half a round trip).
#[derive(Debug, Clone, PartialEq)]
pub struct PingPongResult {
    /// Timed round trips.
    pub iterations: u64,
    /// Untimed round trips before them.
    pub warmup: u64,
    /// Pings the responder reports having echoed (warm-up and timed).
    pub responder_echoes: u64,
    /// Nanoseconds per clock tick, as calibrated over the run.
    pub ns_per_tick: f64,
    /// The clock's resolution in ns ([`clock::resolution`]): every round trip is measured to
    /// within this, every one-way figure to within half of it.
    pub clock_resolution_ns: f64,
    /// One-way latency statistics, ns.
    pub one_way: Summary,
}

impl PingPongResult {
    /// The result as one JSON object on one line.
    pub fn to_json(&self) -> String {
        json!({
            "test": "pingpong",
            "iterations": self.iterations,
            "warmup": self.warmup,
            "responder_echoes": self.responder_echoes,
            "clock": clock::NAME,
            "ns_per_tick": round(self.ns_per_tick, 6),
            "clock_resolution_ns": round(self.clock_resolution_ns, 1),
            "t_min_ns": round(self.one_way.min, 1),
            "t_typical_ns": round(self.one_way.median, 1),
            "t_avg_ns": round(self.one_way.mean, 1),
            "p99_ns": round(self.one_way.p99, 1),
            "t_max_ns": round(self.one_way.max, 1),
        })
        .to_string()
    }

    /// The result as one line for people.
    pub fn to_human(&self) -> String {
        let s = &self.one_way;
        format!(
            "pingpong one-way (half round trip), {} round trips, two processes: min {:.1} ns, \
             typical {:.1} ns, avg {:.1} ns, p99 {:.1} ns, max {:.1} ns",
            self.iterations, s.min, s.median, s.mean, s.p99, s.max,
        )
    }
}

/// The responder process, killed and reaped if still running when dropped (on any error path).
struct Responder(Child);

impl Responder {
    /// Starts this binary as `pingpong-responder` with `page_fd` as its stdin.
    fn spawn(page_fd: std::fs::File) -> Result<Responder, String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find this program's own path: {e}"))?;
        Command::new(exe)
            .arg("pingpong-responder")
            .stdin(Stdio::from(page_fd))
            .stdout(Stdio::null())
            .spawn()
            .map(Responder)
            .map_err(|e| format!("cannot start the responder process: {e}"))
    }

    /// Fails if the responder has already exited (it is meant to run until told to stop).
    fn check_alive(&mut self) -> Result<(), String> {
        match self.0.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!("the responder exited early ({status})")),
            Err(e) => Err(format!("cannot check on the responder: {e}")),
        }
    }

    /// Waits up to [`PEER_TIMEOUT`] for the responder to exit successfully.
    fn finish(mut self) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            match self.0.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(format!("the responder failed ({status})")),
                Ok(None) if t0.elapsed() > PEER_TIMEOUT => {
                    return Err("the responder did not stop when told to".to_string())
                }
                Ok(None) => thread::sleep(Duration::from_millis(1)),
                Err(e) => return Err(format!("cannot wait for the responder: {e}")),
            }
        }
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        // After a successful `finish` the child is reaped and these calls do nothing. Otherwise
        // it is our own child, which must not keep spinning on a core after we give up.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spins until `word` holds `want`, yielding now and then; every [`POLLS_PER_YIELD`] polls
/// `check` runs and can abort the wait.
#[inline(always)]
fn spin_until(
    word: &AtomicU64,
    want: u64,
    mut check: impl FnMut() -> Result<(), String>,
) -> Result<(), String> {
    let mut polls = 0u32;
    while word.load(Ordering::Acquire) != want {
        // PAUSE is not only politeness: on the 2-vCPU KVM guest, builds with and without it
        // run alternately six times gave round trips without it that were never faster and
        // often several times slower (a spinner without PAUSE competes for the core with its
        // SMT sibling, which may be the other vCPU, and pays a memory-order flush when the
        // value finally changes). Leaving it out would make the floor worse, not purer.
        std::hint::spin_loop();
        polls = polls.wrapping_add(1);
        if polls % POLLS_PER_YIELD == 0 {
            check()?;
            thread::yield_now();
        }
    }
    Ok(())
}

/// Runs the ping-pong described by `args` (the initiator's side).
pub fn run(args: &PingPongArgs) -> Result<PingPongResult, String> {
    let (page, page_fd) =
        SharedPage::create().map_err(|e| format!("cannot create the shared page: {e}"))?;
    page.word(Word::Handshake).store(HELLO, Ordering::Release);
    let mut responder = Responder::spawn(page_fd)?;

    let t0 = Instant::now();
    spin_until(page.word(Word::Handshake), READY, || {
        responder.check_alive()?;
        if t0.elapsed() > PEER_TIMEOUT {
            return Err(format!(
                "the responder did not start within {PEER_TIMEOUT:?}"
            ));
        }
        Ok(())
    })?;

    let total = args.warmup + args.iters;
    // MAX_PINGPONG_ITERS bounds `iters`, so this is at most 80 MB.
    let mut samples: Vec<u64> = Vec::with_capacity(usize::try_from(args.iters).unwrap_or(0));
    let resolution = clock::resolution();
    let calibration = Calibration::start();
    let (ping, pong) = (page.word(Word::Ping), page.word(Word::Pong));
    for seq in 1..=total {
        let start = clock::ticks();
        ping.store(seq, Ordering::Release);
        let mut waited_since = None;
        spin_until(pong, seq, || {
            // Only slow round trips get here, so reading the clock costs nothing that counts.
            let since = *waited_since.get_or_insert_with(Instant::now);
            if since.elapsed() > PEER_TIMEOUT {
                responder.check_alive()?;
                return Err(format!(
                    "no echo within {PEER_TIMEOUT:?} (round trip {seq})"
                ));
            }
            Ok(())
        })?;
        let end = clock::ticks();
        if seq > args.warmup {
            samples.push(end.wrapping_sub(start));
        }
    }
    let ns_per_tick = calibration
        .finish()
        .ok_or("the clock did not advance during the run")?;

    ping.store(STOP, Ordering::Release);
    responder.finish()?;
    let echoes = page.word(Word::Echoes).load(Ordering::Acquire);
    if echoes != total {
        return Err(format!(
            "the responder echoed {echoes} pings, {total} were sent"
        ));
    }
    let one_way = Summary::of(&mut samples, ns_per_tick / 2.0).ok_or("no round trip was timed")?;
    Ok(PingPongResult {
        iterations: args.iters,
        warmup: args.warmup,
        responder_echoes: echoes,
        ns_per_tick,
        clock_resolution_ns: resolution as f64 * ns_per_tick,
        one_way,
    })
}

/// The responder's side: maps the page given as stdin, then echoes every new `Ping` value into
/// `Pong` until it reads [`STOP`] (or hears nothing for [`PEER_TIMEOUT`]).
pub fn respond() -> Result<(), String> {
    let stdin = io::stdin();
    let page = SharedPage::open(stdin.as_fd())?;
    if page
        .word(Word::Handshake)
        .compare_exchange(HELLO, READY, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Err("the shared page carries no greeting from `shm-baseline pingpong`".to_string());
    }
    let (ping, pong) = (page.word(Word::Ping), page.word(Word::Pong));
    let mut last = 0u64;
    let mut echoes = 0u64;
    let mut polls = 0u32;
    let mut idle_since = None;
    loop {
        let v = ping.load(Ordering::Acquire);
        if v == last {
            // PAUSE for the reason given in `spin_until`.
            std::hint::spin_loop();
            polls = polls.wrapping_add(1);
            if polls % POLLS_PER_YIELD == 0 {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() > PEER_TIMEOUT {
                    return Err(format!(
                        "responder: no ping for {PEER_TIMEOUT:?} after {echoes} echoes"
                    ));
                }
                thread::yield_now();
            }
            continue;
        }
        if v == STOP {
            page.word(Word::Echoes).store(echoes, Ordering::Release);
            return Ok(());
        }
        pong.store(v, Ordering::Release);
        last = v;
        echoes += 1;
        idle_since = None;
    }
}

/// Tests of the output shapes (the real two-process run is exercised by `tests/cli.rs`, which
/// has the binary to re-execute).
#[cfg(test)]
mod tests {
    use super::*;

    /// A result with round figures.
    fn result() -> PingPongResult {
        PingPongResult {
            iterations: 3,
            warmup: 1,
            responder_echoes: 4,
            ns_per_tick: 0.25,
            clock_resolution_ns: 10.0,
            one_way: Summary::of(&mut [200, 400, 600], 0.125).unwrap(),
        }
    }

    /// The JSON line has the documented keys and values.
    #[test]
    fn json_shape() {
        let v: serde_json::Value = serde_json::from_str(&result().to_json()).unwrap();
        assert_eq!(v["test"], "pingpong");
        assert_eq!(v["iterations"], 3);
        assert_eq!(v["responder_echoes"], 4);
        assert_eq!(v["t_min_ns"], 25.0);
        assert_eq!(v["t_typical_ns"], 50.0);
        assert_eq!(v["t_avg_ns"], 50.0);
        assert_eq!(v["p99_ns"], 75.0);
        assert_eq!(v["t_max_ns"], 75.0);
        assert!(!result().to_json().contains('\n'));
    }

    /// The human line says what the figure is.
    #[test]
    fn human_line() {
        let line = result().to_human();
        assert!(line.starts_with("pingpong one-way (half round trip), 3 round trips"));
        assert!(line.contains("typical 50.0 ns"), "{line}");
    }
}
