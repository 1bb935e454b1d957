//! The driver of a [`CmManager`]: a thread that owns the clock and a QP1, as the kernel's CM
//! work queue does.
//!
//! The thread waits on the [`MadPort`] for a MAD until the manager's next timeout, hands what
//! came to the manager, runs its timers, sends what it queued and delivers its events to the
//! callback given at start. Application commands run on the caller's thread through
//! [`CmAgent::command`], which sends what they queued before it returns; they never produce
//! events, so every event is delivered by the one thread, in order, with no lock held (the
//! callback may issue commands). An owner whose callback needs the agent itself (to answer a
//! REQ) starts it held ([`CmAgent::start_held`]): the manager keeps what arrives until
//! [`CmAgent::release`], so an event that comes before the owner has stored its agent waits
//! for it instead of finding no one to answer it.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferroce_wire::mad::MAD_LEN;

use super::manager::{CmEvent, CmManager};

/// Longest wait for a MAD before the thread looks at its timers and its stop flag again.
const MAX_WAIT: Duration = Duration::from_millis(50);

/// Where MADs come from and go to: QP1 of one GID.
pub trait MadPort: Send + Sync + 'static {
    /// Sends one MAD to QP1 of `dest_gid`.
    fn send(&self, dest_gid: [u8; 16], mad: &[u8; MAD_LEN]) -> io::Result<()>;
    /// Waits at most `timeout` for one MAD; returns the GID it came from and its bytes.
    fn recv(&self, timeout: Duration) -> io::Result<Option<([u8; 16], Vec<u8>)>>;
}

/// The callback that takes every event.
pub type EventSink = Box<dyn Fn(CmEvent) + Send + Sync>;

struct Inner {
    manager: Mutex<CmManager>,
    port: Box<dyn MadPort>,
    sink: EventSink,
    stop: AtomicBool,
    /// Whether events go to the sink yet (the manager keeps them until then).
    delivering: AtomicBool,
}

/// A running CM: its manager, QP1 and thread. Stops when dropped.
pub struct CmAgent {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CmAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmAgent").finish_non_exhaustive()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, CmManager> {
        self.manager.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends everything the manager queued. A MAD that cannot be sent is left to the CM's
    /// retries, as a lost one would be.
    fn flush(&self, m: &mut CmManager) {
        while let Some(out) = m.poll_transmit() {
            let _ = self.port.send(out.dest_gid, &out.mad);
        }
    }

    fn run(&self) {
        while !self.stop.load(Ordering::Acquire) {
            let wait = {
                let m = self.lock();
                m.poll_timeout()
                    .map(|t| t.saturating_duration_since(Instant::now()))
                    .unwrap_or(MAX_WAIT)
                    .min(MAX_WAIT)
            };
            let got = match self.port.recv(wait) {
                Ok(got) => got,
                Err(_) => {
                    std::thread::sleep(MAX_WAIT);
                    None
                }
            };
            let mut events = Vec::new();
            {
                let mut m = self.lock();
                let now = Instant::now();
                if let Some((from, bytes)) = got {
                    m.handle_mad(now, from, &bytes);
                }
                if m.poll_timeout().is_some_and(|t| t <= now) {
                    m.handle_timeout(now);
                }
                self.flush(&mut m);
                if self.delivering.load(Ordering::Acquire) {
                    while let Some(e) = m.poll_event() {
                        events.push(e);
                    }
                }
            }
            for e in events {
                (self.sink)(e);
            }
        }
    }
}

impl CmAgent {
    /// Starts the thread for `manager` on `port`; every event goes to `sink`.
    pub fn start(
        manager: CmManager,
        port: Box<dyn MadPort>,
        sink: EventSink,
    ) -> io::Result<CmAgent> {
        Self::spawn(manager, port, sink, true)
    }

    /// [`Self::start`], with the events held until [`Self::release`]: MADs are taken, answered
    /// by the manager's own rules and retried meanwhile, and the events they raise wait.
    pub fn start_held(
        manager: CmManager,
        port: Box<dyn MadPort>,
        sink: EventSink,
    ) -> io::Result<CmAgent> {
        Self::spawn(manager, port, sink, false)
    }

    /// Lets the events go to the sink, those held first, in order (within the thread's next
    /// wait, at most 50 ms).
    pub fn release(&self) {
        self.inner.delivering.store(true, Ordering::Release);
    }

    fn spawn(
        manager: CmManager,
        port: Box<dyn MadPort>,
        sink: EventSink,
        delivering: bool,
    ) -> io::Result<CmAgent> {
        let inner = Arc::new(Inner {
            manager: Mutex::new(manager),
            port,
            sink,
            stop: AtomicBool::new(false),
            delivering: AtomicBool::new(delivering),
        });
        let run = inner.clone();
        let thread = crate::os::spawn_without_signals(
            std::thread::Builder::new().name("ferroce-cm".into()),
            move || run.run(),
        )?;
        Ok(CmAgent {
            inner,
            thread: Some(thread),
        })
    }

    /// Runs a command on the manager (with the time now) and sends what it queued.
    pub fn command<R>(&self, f: impl FnOnce(&mut CmManager, Instant) -> R) -> R {
        let mut m = self.inner.lock();
        let r = f(&mut m, Instant::now());
        self.inner.flush(&mut m);
        r
    }

    /// [`Self::command`], unless another thread holds the manager now (`None`): for a caller
    /// that must not wait, such as a process's exit, which may have interrupted that thread.
    pub fn try_command<R>(&self, f: impl FnOnce(&mut CmManager, Instant) -> R) -> Option<R> {
        let mut m = match self.inner.manager.try_lock() {
            Ok(m) => m,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let r = f(&mut m, Instant::now());
        self.inner.flush(&mut m);
        Some(r)
    }
}

impl Drop for CmAgent {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            // The agent may be dropped on its own thread, by a callback holding the last
            // reference to its owner: that thread cannot join itself (EDEADLK, a panic), and
            // it ends by itself once the callback returns and it sees `stop`.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}
