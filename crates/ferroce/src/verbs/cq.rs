//! Completion queues.
//!
//! The engine appends completions; the application polls them. An empty poll drives the engine
//! once inline (receive, timers, transmit), which is how a busy-polling application gets the
//! lowest latency without a second thread spinning. A CQ armed with
//! [`CompletionQueue::req_notify`] fires its [`CompletionChannel`] (see `channel`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferroce_proto::{WcStatus, WorkCompletion};

use super::channel::ChannelInner;
use super::channel::CompletionChannel;
use super::context::ContextInner;
use crate::error::{Error, Result};

const UNARMED: u8 = 0;
const ARMED_ANY: u8 = 1;
const ARMED_SOLICITED: u8 = 2;

#[derive(Debug)]
pub(crate) struct CqInner {
    queue: Mutex<VecDeque<WorkCompletion>>,
    /// The queue's length, kept beside it so an empty poll (a busy-polling loop's usual case)
    /// takes no lock.
    waiting: AtomicUsize,
    capacity: usize,
    overflowed: AtomicBool,
    armed: AtomicU8,
    channel: Option<Arc<ChannelInner>>,
    /// See [`CompletionQueue::event_id`].
    event_id: usize,
    /// Polls in a row that found nothing (see [`POLITE_AFTER_EMPTY_POLLS`]).
    empty_polls: AtomicU32,
}

/// Empty polls in a row after which each further one also yields the CPU (`sched_yield`).
/// A thread that busy-polls for a completion that takes long (a round trip through a loaded
/// link, a peer descheduled on a small machine) holds its CPU for a whole scheduler time
/// slice — 6 to 12 ms on 2 cores — while the thread that would produce the completion (the
/// peer process on the same core, this context's engine thread) waits for it: an 8 B
/// ping-pong beside bulk flows on 2 vCPUs saw p99 round trips of 12 ms so. Yielding lets such
/// a thread run at once; with nobody waiting the call returns at once (a system call, well
/// under a µs). A ping-pong whose answer comes within this many polls never yields.
///
/// "Empty" means no completion and no packet moved by the poll's own pass: a WRITE's data
/// landing over UDP is a packet moved, so a loop that watches memory for it resets the count
/// too. Over shared memory only (no QP of the context on its socket) a peer's WRITE lands
/// with neither, so the count is not kept there. The count is the CQ's, not a thread's: with
/// several threads polling one CQ it is a heuristic (one thread's reset may be overwritten by
/// another's increment), which costs at most a yield too early.
pub(crate) const POLITE_AFTER_EMPTY_POLLS: u32 = 64;

/// The next [`CompletionQueue::event_id`]: ids are never reused, so an event a destroyed CQ
/// left in its channel can never be taken for a later CQ's (an address could be reused).
static NEXT_EVENT_ID: AtomicUsize = AtomicUsize::new(1);

impl CqInner {
    /// See [`CompletionQueue::event_id`].
    fn event_id(&self) -> usize {
        self.event_id
    }

    /// Appends completions (the engine's side) and wakes an armed channel.
    pub(crate) fn push(&self, wcs: &[WorkCompletion]) {
        if wcs.is_empty() {
            return;
        }
        {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.extend(wcs.iter().copied());
            // SeqCst here and for `armed` below, as on the arming side (`req_notify`, then
            // `len`): a completion pushed while the CQ is being armed is either seen waiting by
            // the armer or finds the CQ armed and fires; never neither (a lost wake-up).
            self.waiting.store(q.len(), Ordering::SeqCst);
            if q.len() > self.capacity {
                self.overflowed.store(true, Ordering::Release);
            }
        }
        let Some(ch) = &self.channel else { return };
        let armed = self.armed.load(Ordering::SeqCst);
        let fire = match armed {
            ARMED_ANY => true,
            // Errors always wake, as they would on hardware (they end the QP).
            ARMED_SOLICITED => wcs
                .iter()
                .any(|w| w.solicited || w.status != WcStatus::Success),
            _ => false,
        };
        if fire
            && self
                .armed
                .compare_exchange(armed, UNARMED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            ch.fire(self.event_id());
        }
    }
}

/// A completion queue.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
    pub(crate) ctx: Arc<ContextInner>,
}

impl CompletionQueue {
    pub(crate) fn new(
        ctx: Arc<ContextInner>,
        capacity: usize,
        channel: Option<&CompletionChannel>,
    ) -> CompletionQueue {
        CompletionQueue {
            inner: Arc::new(CqInner {
                queue: Mutex::new(VecDeque::with_capacity(capacity.min(1 << 16))),
                waiting: AtomicUsize::new(0),
                capacity,
                overflowed: AtomicBool::new(false),
                armed: AtomicU8::new(UNARMED),
                channel: channel.map(|c| c.inner.clone()),
                event_id: NEXT_EVENT_ID.fetch_add(1, Ordering::Relaxed),
                empty_polls: AtomicU32::new(0),
            }),
            ctx,
        }
    }

    /// What [`CompletionChannel::next_event`] returns when this CQ fires: a number no other CQ
    /// of the process ever has, so an event left behind by a destroyed CQ names no live one.
    pub fn event_id(&self) -> usize {
        self.inner.event_id()
    }

    /// The capacity the CQ was created with.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    fn take(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        if self.inner.overflowed.load(Ordering::Acquire)
            && self.inner.overflowed.swap(false, Ordering::AcqRel)
        {
            return Err(Error::CqOverflow(self.inner.capacity));
        }
        if self.inner.waiting.load(Ordering::Acquire) == 0 {
            return Ok(0);
        }
        let mut q = self.inner.queue.lock().unwrap_or_else(|e| e.into_inner());
        let n = out.len().min(q.len());
        for slot in out.iter_mut().take(n) {
            if let Some(wc) = q.pop_front() {
                *slot = wc;
            }
        }
        self.inner.waiting.store(q.len(), Ordering::Release);
        Ok(n)
    }

    /// Moves up to `out.len()` completions into `out` and returns how many (as `ibv_poll_cq`).
    /// When none is waiting, drives the engine once inline first. An overflow is reported once
    /// as [`Error::CqOverflow`]; no completion is dropped.
    /// A thread that keeps finding it empty (64 polls in a row with no completion and no packet
    /// moved) yields its CPU after each further poll: a thread busy-polling on a small machine
    /// would otherwise hold a CPU for a whole time slice while the thread that produces its
    /// completion waits for one.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut n = self.take(out)?;
        let mut progressed = false;
        if n == 0 && !out.is_empty() {
            // A poll of an armed CQ drains it before the thread sleeps on the CQ's channel
            // (arm, poll until empty, then `poll(2)` or epoll on the descriptor): it must
            // not keep the engine thread away from the socket meanwhile.
            // Armed for solicited completions only, the CQ stays armed across the others, and
            // a program may poll it busily meanwhile: that one keeps its hand-over.
            progressed = if self.inner.armed.load(Ordering::Relaxed) == ARMED_ANY {
                self.ctx.shared.progress_inline_before_sleep()
            } else {
                self.ctx.shared.progress_inline()
            };
            n = self.take(out)?;
        }
        if n > 0 {
            self.ctx.shared.hand_back();
        }
        // A pass that moved packets counts as news too: a WRITE's data lands with no
        // completion here, and the thread may be waiting for exactly that (a latency test's flag).
        if n > 0 || progressed {
            // Written only when it changes: the line is the CQ's, which the engine writes too.
            if self.inner.empty_polls.load(Ordering::Relaxed) != 0 {
                self.inner.empty_polls.store(0, Ordering::Relaxed);
            }
        } else if !out.is_empty() && self.ctx.shared.socket_in_use.load(Ordering::Relaxed) {
            let empty = self.inner.empty_polls.load(Ordering::Relaxed);
            if empty >= POLITE_AFTER_EMPTY_POLLS {
                std::thread::yield_now();
            } else {
                self.inner.empty_polls.store(empty + 1, Ordering::Relaxed);
            }
        }
        Ok(n)
    }

    /// The next completion, if any.
    pub fn poll_one(&self) -> Result<Option<WorkCompletion>> {
        let mut one = [empty_wc()];
        Ok((self.poll(&mut one)? == 1).then_some(one[0]))
    }

    /// Busy-polls until `n` completions arrived or `timeout` passed; returns them in order.
    pub fn wait(&self, n: usize, timeout: Duration) -> Result<Vec<WorkCompletion>> {
        let deadline = std::time::Instant::now() + timeout;
        let mut got = Vec::with_capacity(n);
        let mut buf = vec![empty_wc(); n.clamp(1, 64)];
        while got.len() < n && std::time::Instant::now() < deadline {
            let k = self.poll(&mut buf[..(n - got.len()).min(64)])?;
            got.extend_from_slice(&buf[..k]);
            if k == 0 {
                std::hint::spin_loop();
            }
        }
        Ok(got)
    }

    /// Arms the CQ: its channel fires once at the next completion (or the next solicited or
    /// error completion when `solicited_only`).
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(Error::InvalidArgument(
                "the CQ has no completion channel".into(),
            ));
        }
        let mode = if solicited_only {
            ARMED_SOLICITED
        } else {
            ARMED_ANY
        };
        // SeqCst: see `CqInner::push`.
        self.inner.armed.store(mode, Ordering::SeqCst);
        // Whoever arms a CQ waits for its event next, not by polling: the engine must read the
        // socket again — at once, or, where hand-backs may be lazy and the channel's waiter
        // spins first (driving progress itself, and ending the hand-over before it sleeps), as
        // after a poll that returned completions. A waiter that does not spin (or sleeps on the
        // descriptor in its own epoll) gets the engine at once.
        let waiter_spins = self.inner.channel.as_ref().is_some_and(|c| c.spins());
        if self.ctx.shared.hand_back_at_completion && waiter_spins {
            self.ctx.shared.hand_back();
        } else {
            self.ctx.shared.end_hand_over();
        }
        Ok(())
    }

    /// Completions waiting now. After [`req_notify`](Self::req_notify), a CQ found empty here
    /// will fire its channel at the next completion.
    pub fn len(&self) -> usize {
        self.inner.waiting.load(Ordering::SeqCst)
    }

    /// Whether no completion is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A placeholder completion for output buffers.
pub fn empty_wc() -> WorkCompletion {
    WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: ferroce_proto::WcOpcode::Send,
        byte_len: 0,
        imm_data: None,
        invalidated_rkey: None,
        qp_num: 0,
        solicited: false,
        src_qp: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{device_by_name, ContextOptions, Provider};

    #[test]
    fn empty_polls_are_counted_up_to_the_yield_and_a_completion_resets_them() {
        let ctx = device_by_name("lo")
            .unwrap()
            .open(&ContextOptions {
                capture: None,
                provider: Provider::Udp,
                ..ContextOptions::with_port(0)
            })
            .unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        let mut out = [empty_wc(); 4];
        let count = || cq.inner.empty_polls.load(Ordering::Relaxed);
        for _ in 0..10 {
            assert_eq!(cq.poll(&mut out).unwrap(), 0);
        }
        assert_eq!(count(), 10);
        // Past the threshold the count stays there (each further empty poll yields).
        for _ in 0..2 * POLITE_AFTER_EMPTY_POLLS {
            assert_eq!(cq.poll(&mut out).unwrap(), 0);
        }
        assert_eq!(count(), POLITE_AFTER_EMPTY_POLLS);
        // A completion is news: the count starts over.
        cq.inner.push(&[WorkCompletion {
            wr_id: 7,
            ..empty_wc()
        }]);
        assert_eq!(cq.poll(&mut out).unwrap(), 1);
        assert_eq!(out[0].wr_id, 7);
        assert_eq!(count(), 0);
        // A poll with no room for a completion counts nothing.
        assert_eq!(cq.poll(&mut []).unwrap(), 0);
        assert_eq!(count(), 0);
    }
}
