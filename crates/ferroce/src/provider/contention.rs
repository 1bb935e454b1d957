//! Whether the engine thread's spinning takes a CPU that someone else is waiting for.
//!
//! An idle engine thread spins for [`super::engine::SPIN`] before it sleeps, and waits for a
//! near transport timer (a pacing gap, a short retransmission timeout) spinning too: on a host
//! with a core to spare, that saves a wake-up of tens of µs per packet. On a host with more
//! runnable threads than cores it is the opposite. A 1 Gbit/s stream paced every 12 µs kept
//! each engine thread spinning all the time, so a few ferroce processes took both cores of a
//! 2-vCPU machine: an 8 B ping-pong beside four such flows saw a p99 round trip of 12 ms
//! (CFS time slices) against 137 µs with no spinning, and eight senders into one receiver
//! delivered half of what they did without it (`scripts/bench_net.sh`, cases `probe_load`
//! and `incast_8`).
//!
//! The kernel says how long this thread has been runnable but waiting for a CPU: the second
//! field of `/proc/thread-self/schedstat` (its run delay). While the thread spins, that is read
//! every [`CHECK_PERIOD`]; a period in which it waited for at least [`CONTENDED_SHARE`] of the
//! time means the CPUs are oversubscribed, and for the next [`HOLD`] the engine thread sleeps
//! whenever it has nothing to do, timers included (with a timer slack of a few µs). After
//! that it spins again, and looks again. Where the file cannot be read (no `/proc`, a kernel
//! without scheduler statistics), the thread spins as before. Only the engine thread reads
//! it, for itself.
//!
//! That reading only sees contention that preempts the spin itself, and only over a period of
//! [`CHECK_PERIOD`] spent spinning without a sleep. An engine thread that spins [`SPIN`] after
//! each message and then sleeps never spins that long, yet its spins take the CPU from
//! programs that wait on memory: two perftest-style programs spinning on their buffers plus
//! two engine threads spinning 50 µs after every WRITE on 2 vCPUs took 83 µs per one-way
//! WRITE (typical) instead of 29 without the engine's spin. So the thread also reads how many
//! threads the whole host has runnable (`/proc/loadavg`'s fourth field, itself included), at
//! most once per [`CHECK_PERIOD`] of wall time, sleeps or not: more than the host's online
//! CPUs is contention too, with the same [`HOLD`].
//!
//! [`SPIN`]: super::engine::SPIN

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// How often a spinning engine thread reads its run delay.
pub(crate) const CHECK_PERIOD: Duration = Duration::from_millis(1);
/// The share of a period spent waiting for a CPU that makes the CPUs contended: a thread
/// alone on its core waits a few µs per ms at most (interrupts, kernel threads).
pub(crate) const CONTENDED_SHARE: f64 = 0.1;
/// How long the engine thread keeps from spinning once it found the CPUs contended.
pub(crate) const HOLD: Duration = Duration::from_millis(50);

/// The calling thread's run delay. The file is opened for each reading (once per
/// [`CHECK_PERIOD`] of spinning, a few µs) rather than kept: a context's engine thread holds
/// no descriptor of its own, so what a context keeps open is what its owner opened.
#[derive(Debug)]
struct RunDelay;

impl RunDelay {
    /// Whether this kernel keeps scheduler statistics for the calling thread: the file exists,
    /// and the thread's count of times it was put on a CPU (its third field) is counted — a
    /// kernel without them shows "0 0 0". Not its time on a CPU (the first field): a thread
    /// just started may show none yet (a test thread did, in CI), though it is running.
    fn open() -> Option<RunDelay> {
        let (_, switched_in) = Self::fields()?;
        (switched_in > 0).then_some(RunDelay)
    }

    /// The total time the calling thread has waited runnable for a CPU.
    fn read(&mut self) -> Option<Duration> {
        Self::fields().map(|(waited, _)| Duration::from_nanos(waited))
    }

    /// The second and third fields: nanoseconds waiting for a CPU, and times put on one.
    fn fields() -> Option<(u64, u64)> {
        let mut buf = [0u8; 96];
        let n = File::open("/proc/thread-self/schedstat")
            .ok()?
            .read_at(&mut buf, 0)
            .ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        let mut fields = text.split_ascii_whitespace().map(|f| f.parse::<u64>().ok());
        let _on_cpu = fields.next()??;
        Some((fields.next()??, fields.next()??))
    }
}

/// The host's runnable threads against its CPUs (see the module doc), read at most once per
/// [`CHECK_PERIOD`].
#[derive(Debug)]
struct HostLoad {
    cpus: usize,
    last_read: Option<Instant>,
}

impl HostLoad {
    fn open() -> Option<HostLoad> {
        // SAFETY: sysconf takes no pointers.
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        let load = HostLoad {
            cpus: usize::try_from(cpus).ok().filter(|&n| n > 0)?,
            last_read: None,
        };
        load.runnable().map(|_| load)
    }

    /// Whether, when a reading is due, more threads are runnable than the host has CPUs;
    /// `None` when no reading is due or it failed.
    fn oversubscribed_if_due(&mut self, now: Instant) -> Option<bool> {
        if self
            .last_read
            .is_some_and(|t| now.duration_since(t) < CHECK_PERIOD)
        {
            return None;
        }
        self.last_read = Some(now);
        Some(self.runnable()? > self.cpus)
    }

    /// The runnable threads now: the numerator of `/proc/loadavg`'s fourth field.
    fn runnable(&self) -> Option<usize> {
        let mut buf = [0u8; 128];
        let n = File::open("/proc/loadavg")
            .ok()?
            .read_at(&mut buf, 0)
            .ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        let (running, _) = text.split_ascii_whitespace().nth(3)?.split_once('/')?;
        running.parse().ok()
    }
}

/// The engine thread's view of CPU contention (see the module doc).
#[derive(Debug)]
pub(crate) struct Contention {
    delay: Option<RunDelay>,
    /// The host's runnable threads (`None` without `/proc/loadavg`).
    load: Option<HostLoad>,
    /// When the current period began, and the run delay then.
    period: Option<(Instant, Duration)>,
    /// Until when the thread does not spin.
    contended_until: Option<Instant>,
    /// Periods found contended since the thread started (for tests and reports).
    contended_periods: u64,
}

impl Contention {
    /// A view for the calling thread; it must be the engine thread itself.
    pub(crate) fn for_this_thread() -> Contention {
        Contention {
            delay: RunDelay::open(),
            load: HostLoad::open(),
            period: None,
            contended_until: None,
            contended_periods: 0,
        }
    }

    /// Whether the thread may spin now: called each time it would. Reads the run delay once
    /// per [`CHECK_PERIOD`] of spinning.
    pub(crate) fn may_spin(&mut self, now: Instant) -> bool {
        if self.contended_until.is_some_and(|t| now < t) {
            return false;
        }
        self.contended_until = None;
        let host_busy = self
            .load
            .as_mut()
            .and_then(|l| l.oversubscribed_if_due(now));
        if host_busy == Some(true) {
            self.contended_periods += 1;
            self.contended_until = Some(now + HOLD);
            return false;
        }
        let Some(delay) = &mut self.delay else {
            return true;
        };
        let Some(waited) = delay.read_if_due(now, &mut self.period) else {
            return true;
        };
        if waited {
            self.contended_periods += 1;
            self.contended_until = Some(now + HOLD);
            return false;
        }
        true
    }

    /// A sleep happened: the next spin starts a new period (time asleep is no one's CPU).
    pub(crate) fn slept(&mut self) {
        self.period = None;
    }

    /// Periods found contended so far.
    #[cfg(test)]
    pub(crate) fn contended_periods(&self) -> u64 {
        self.contended_periods
    }
}

impl RunDelay {
    /// At the end of a period of spinning, whether the thread waited for a CPU for at least
    /// [`CONTENDED_SHARE`] of it (and a new period begins); `None` within a period or when
    /// the statistics cannot be read.
    fn read_if_due(
        &mut self,
        now: Instant,
        period: &mut Option<(Instant, Duration)>,
    ) -> Option<bool> {
        match *period {
            Some((start, _)) if now.duration_since(start) < CHECK_PERIOD => None,
            Some((start, before)) => {
                let after = self.read()?;
                *period = Some((now, after));
                let waited = after.saturating_sub(before).as_secs_f64();
                Some(waited >= CONTENDED_SHARE * now.duration_since(start).as_secs_f64())
            }
            None => {
                *period = Some((now, self.read()?));
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spins `for_` on this thread, checking as the engine thread does; how many periods
    /// were found contended.
    fn spin_checking(c: &mut Contention, for_: Duration) -> u64 {
        let start = Instant::now();
        let before = c.contended_periods();
        while start.elapsed() < for_ {
            let _ = c.may_spin(Instant::now());
            std::hint::spin_loop();
        }
        c.contended_periods() - before
    }

    #[test]
    fn a_thread_among_spinners_on_its_cpu_finds_the_cpu_contended() {
        let mut c = Contention::for_this_thread();
        if c.delay.is_none() {
            // Without scheduler statistics the thread must spin as it always did (the host's
            // load, another signal, is left out: other tests load the host meanwhile).
            c.load = None;
            assert!(c.may_spin(Instant::now()));
            return;
        }
        // Pin this thread and as many spinners as it takes to oversubscribe to one CPU.
        let cpu = first_allowed_cpu();
        pin_to(cpu);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinners: Vec<_> = (0..2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    pin_to(cpu);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let found = spin_checking(&mut c, Duration::from_millis(300));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for s in spinners {
            s.join().unwrap();
        }
        assert!(
            found > 0,
            "three spinners on one CPU: no period found contended"
        );
        assert!(
            !c.may_spin(Instant::now()),
            "the hold must follow a contended period"
        );
    }

    #[test]
    fn more_spinning_threads_than_cpus_make_the_host_oversubscribed() {
        let Some(mut load) = HostLoad::open() else {
            // Without /proc/loadavg only the run delay tells (the test above).
            assert!(std::fs::read("/proc/loadavg").is_err());
            return;
        };
        // A reading at most once per period.
        let t = Instant::now();
        assert!(load.oversubscribed_if_due(t).is_some());
        assert_eq!(load.oversubscribed_if_due(t + CHECK_PERIOD / 2), None);
        // Two more runnable threads than CPUs, besides this one.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinners: Vec<_> = (0..load.cpus + 2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let start = Instant::now();
        let mut seen = false;
        while !seen && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(CHECK_PERIOD);
            seen = load.oversubscribed_if_due(Instant::now()) == Some(true);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for s in spinners {
            s.join().unwrap();
        }
        assert!(
            seen,
            "{} spinners on {} CPUs: never oversubscribed",
            load.cpus + 2,
            load.cpus
        );
        // And the engine thread's view holds off spinning after such a reading.
        let mut c = Contention {
            delay: None,
            load: Some(HostLoad {
                cpus: 0,
                last_read: None,
            }),
            period: None,
            contended_until: None,
            contended_periods: 0,
        };
        assert!(
            !c.may_spin(Instant::now()),
            "a host with more runnable threads than CPUs"
        );
        assert!(!c.may_spin(Instant::now()), "the hold follows");
        assert_eq!(c.contended_periods(), 1);
    }

    fn first_allowed_cpu() -> usize {
        // SAFETY: `set` is a plain bitmask owned by this frame; sched_getaffinity writes at most
        // `size_of::<cpu_set_t>()` bytes into it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &set))
                .unwrap_or(0)
        }
    }

    fn pin_to(cpu: usize) {
        // SAFETY: as above; sched_setaffinity only reads the mask.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
                0
            );
        }
    }
}
