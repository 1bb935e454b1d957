//! Completion channels: how a thread sleeps until an armed CQ gets a completion — and, first,
//! how briefly it does not.
//!
//! A channel is an eventfd in semaphore mode, one notification per fired CQ, so a program may
//! block on it, hand it to epoll or an async runtime, or read events one at a time, as from a
//! kernel completion channel.
//!
//! # Spinning before sleeping
//! Sleeping costs two wake-ups per message: the engine thread's, when the packet arrives, and
//! then the waiting thread's, when the engine thread fires the channel. On a busy 2-vCPU
//! machine each is tens of µs: `ibv_rc_pingpong -e` (a signaled SEND and a RECV per
//! iteration, each side waiting for both) took 165 µs per iteration over shared memory and
//! 170 µs over UDP, against 6 and 29 µs polling. So a thread about to sleep on the channel
//! first drives progress itself for up to the context's
//! [`event_spin`](crate::ContextOptions::event_spin) — the engine thread stays asleep, as for
//! any polling thread — and only sleeps if no event came by then (after ending its
//! hand-over, so that the engine thread takes the socket and rings back). The spin is adaptive,
//! as adaptive mutexes and MPI's and UCX's progress loops are: after
//! [`MISSES_BEFORE_PROBING`] spins in a row that no event ended, only one wait in
//! [`PROBE_EVERY`] spins, so a program whose events are far apart (a server idle between
//! requests) spins at most `event_spin` in that many waits, while one in a conversation never
//! sleeps. (Sleeping for the next few waits after any one miss instead kept both sides of a
//! ping-pong slow: each side's sleeps made the other's spins miss.) After [`YIELD_AFTER`] empty turns each turn also
//! yields the CPU, as a polling thread's does (see the CQ's `POLITE_AFTER_EMPTY_POLLS`).

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::context::ContextShared;
use crate::error::{Error, Result};
use crate::os::{self, EventFd};

/// The longest a thread about to sleep on a channel drives progress first (the context's
/// [`ContextOptions::event_spin`](crate::ContextOptions::event_spin) says how long, up to
/// this).
pub(crate) const SPIN_MAX: Duration = Duration::from_millis(10);
/// Spins in a row that no event ended, after which only every [`PROBE_EVERY`]th wait spins
/// (until a spin is answered again).
pub(crate) const MISSES_BEFORE_PROBING: u32 = 4;
/// While probing, one wait in this many spins.
pub(crate) const PROBE_EVERY: u32 = 8;
/// Empty turns of a spin after which each also yields the CPU.
pub(crate) const YIELD_AFTER: u32 = 64;

#[derive(Debug)]
pub(crate) struct ChannelInner {
    /// One notification per fired CQ (semaphore mode), so the descriptor is readable exactly
    /// while `fired` is not empty.
    efd: EventFd,
    /// The [`CompletionQueue::event_id`](crate::CompletionQueue::event_id)s of the CQs that
    /// fired, oldest first.
    fired: Mutex<VecDeque<usize>>,
    /// `fired`'s length, read by a spinning thread without the lock.
    queued: AtomicUsize,
    /// The context the channel was made on, whose progress a spinning waiter drives (CQs of
    /// other contexts may share the channel; their completions still fire it, through their
    /// own engine threads).
    ctx: Weak<ContextShared>,
    /// How long a waiter spins (the context's `event_spin`, at most [`SPIN_MAX`]).
    spin_for: Duration,
    /// Spins in a row that no event ended (see [`MISSES_BEFORE_PROBING`]).
    misses: AtomicU32,
    /// Waits since the last spin, while probing.
    waits: AtomicU32,
}

impl ChannelInner {
    /// Whether a waiter spins before it sleeps (the context's `event_spin` is not zero).
    pub(crate) fn spins(&self) -> bool {
        !self.spin_for.is_zero()
    }

    /// A CQ fired: queue its event and wake the waiter (the engine's side).
    pub(crate) fn fire(&self, event_id: usize) {
        let mut fired = self.fired.lock().unwrap_or_else(|e| e.into_inner());
        fired.push_back(event_id);
        self.queued.store(fired.len(), Ordering::Release);
        drop(fired);
        self.efd.notify();
    }
}

/// A completion channel: wakes a waiting thread when an armed CQ gets a completion.
///
/// Each firing of an armed CQ is one event, read once, in order, as from a kernel completion
/// channel; the descriptor is readable while an event is waiting. One thread at a time should
/// wait on a channel (as with `ibv_get_cq_event`).
#[derive(Debug, Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl CompletionChannel {
    pub(crate) fn new(ctx: &Arc<ContextShared>) -> Result<CompletionChannel> {
        let efd =
            EventFd::new_semaphore().map_err(|e| Error::io("creating a completion channel", e))?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                efd,
                fired: Mutex::new(VecDeque::new()),
                queued: AtomicUsize::new(0),
                ctx: Arc::downgrade(ctx),
                spin_for: ctx.event_spin.min(SPIN_MAX),
                misses: AtomicU32::new(0),
                waits: AtomicU32::new(0),
            }),
        })
    }

    /// Blocks until an armed CQ of this channel gets a completion, or `timeout` passes
    /// (`None`: forever). Returns whether an event arrived (and takes it). Re-arm the CQ before
    /// polling it empty, as with `ibv_get_cq_event`.
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<bool> {
        Ok(self.next_event(timeout)?.is_some())
    }

    /// Like [`Self::get_event`], but says which CQ fired: its
    /// [`CompletionQueue::event_id`](crate::CompletionQueue::event_id).
    pub fn next_event(&self, timeout: Option<Duration>) -> Result<Option<usize>> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        if timeout != Some(Duration::ZERO) {
            // Spins if the context says so; either way the hand-over has ended if this thread
            // is about to sleep.
            self.spin_for_event(timeout.unwrap_or(Duration::MAX));
        }
        loop {
            if let Some(id) = self.try_next_event()? {
                return Ok(Some(id));
            }
            let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            os::wait_readable(&[self.inner.efd.fd()], left)
                .map_err(|e| Error::io("waiting for a completion event", e))?;
        }
    }

    /// What a thread about to block on this channel does first (see the module doc): drives
    /// its context's progress for up to `at_most` (and the context's
    /// [`event_spin`](crate::ContextOptions::event_spin)) unless recent spins went unanswered,
    /// and returns whether an event is waiting. When it returns `false` it has handed progress
    /// back to the engine thread, so the caller may block. [`Self::next_event`] calls it; a
    /// program that blocks on [`Self::as_raw_fd`] itself may call it before.
    pub fn spin_for_event(&self, at_most: Duration) -> bool {
        let ch = &self.inner;
        if ch.queued.load(Ordering::Acquire) > 0 {
            return true;
        }
        let Some(ctx) = ch.ctx.upgrade() else {
            return false;
        };
        if ch.spin_for.is_zero() || at_most.is_zero() {
            // About to sleep: progress is the engine thread's again.
            ctx.end_hand_over();
            return false;
        }
        if ch.misses.load(Ordering::Relaxed) >= MISSES_BEFORE_PROBING {
            let waits = ch.waits.load(Ordering::Relaxed) + 1;
            if waits < PROBE_EVERY {
                ch.waits.store(waits, Ordering::Relaxed);
                // About to sleep: progress is the engine thread's again.
                ctx.end_hand_over();
                return false;
            }
            ch.waits.store(0, Ordering::Relaxed);
        }
        let until = std::time::Instant::now() + at_most.min(ch.spin_for);
        let mut empty = 0u32;
        let got = loop {
            if ch.queued.load(Ordering::Acquire) > 0 {
                break true;
            }
            if std::time::Instant::now() >= until {
                break false;
            }
            if ctx.progress_inline() {
                empty = 0;
            } else {
                empty += 1;
                if empty >= YIELD_AFTER {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        };
        if got {
            ch.misses.store(0, Ordering::Relaxed);
        } else {
            let misses = ch.misses.load(Ordering::Relaxed);
            ch.misses.store(misses.saturating_add(1), Ordering::Relaxed);
            // About to sleep: progress is the engine thread's again. (With an event, the
            // thread polls its CQ next and keeps driving.)
            ctx.end_hand_over();
        }
        got
    }

    /// The next event if one is waiting now (never blocks): the firing CQ's
    /// [`CompletionQueue::event_id`](crate::CompletionQueue::event_id).
    pub fn try_next_event(&self) -> Result<Option<usize>> {
        let taken = self
            .inner
            .efd
            .take_one()
            .map_err(|e| Error::io("reading a completion event", e))?;
        if !taken {
            return Ok(None);
        }
        let mut fired = self.inner.fired.lock().unwrap_or_else(|e| e.into_inner());
        let id = fired.pop_front();
        self.inner.queued.store(fired.len(), Ordering::Release);
        Ok(id)
    }

    /// The descriptor that is readable while an event is waiting, for epoll or an async
    /// runtime; take events with [`Self::try_next_event`]. It is a blocking descriptor: a
    /// program may read it only through this type.
    pub fn as_raw_fd(&self) -> RawFd {
        self.inner.efd.fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{device_by_name, ContextOptions, Provider};

    const SPIN_FOR: Duration = Duration::from_micros(50);

    fn context() -> crate::Context {
        device_by_name("lo")
            .unwrap()
            .open(&ContextOptions {
                capture: None,
                provider: Provider::Udp,
                event_spin: SPIN_FOR,
                ..ContextOptions::with_port(0)
            })
            .unwrap()
    }

    #[test]
    fn unanswered_spins_turn_into_probes_and_an_answered_one_ends_that() {
        let ctx = context();
        let ch = ctx.create_comp_channel().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..MISSES_BEFORE_PROBING {
            assert!(!ch.spin_for_event(SPIN_FOR));
        }
        // Each of those spun its whole time.
        assert!(t0.elapsed() >= SPIN_FOR * MISSES_BEFORE_PROBING);
        // Now only one wait in PROBE_EVERY spins.
        let spun = (0..PROBE_EVERY * 4)
            .filter(|_| {
                let t = std::time::Instant::now();
                ch.spin_for_event(SPIN_FOR);
                t.elapsed() >= SPIN_FOR
            })
            .count();
        // (A skipped wait that was descheduled for SPIN_FOR would count too: a little slack.)
        assert!(
            (4..=8).contains(&spun),
            "{spun} of {} waits spun",
            PROBE_EVERY * 4
        );
        // An event waiting is found at once, without spinning, and taken once.
        ch.inner.fire(42);
        assert!(ch.spin_for_event(SPIN_FOR));
        assert_eq!(ch.try_next_event().unwrap(), Some(42));
        assert_eq!(ch.try_next_event().unwrap(), None);
        // A spin that an event ends (here: one fired from another thread meanwhile) makes the
        // next waits spin again.
        let probe = loop {
            let inner = ch.inner.clone();
            let firer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_micros(10));
                inner.fire(7);
            });
            let got = ch.spin_for_event(SPIN_FOR);
            firer.join().unwrap();
            assert_eq!(ch.try_next_event().unwrap(), Some(7));
            // (An event already waiting when the wait began answers no spin: then, or when
            // this one was a skipped wait, try again.)
            if got && ch.inner.misses.load(Ordering::Relaxed) == 0 {
                break true;
            }
        };
        assert!(probe);
        let t = std::time::Instant::now();
        assert!(!ch.spin_for_event(SPIN_FOR));
        assert!(
            t.elapsed() >= SPIN_FOR,
            "spins again after an answered spin"
        );
    }
}
