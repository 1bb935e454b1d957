//! The phase engine: runs a phase's sends and receives to completion, pipelined slice by slice,
//! and waits the way a rank shares its core.

use super::*;

/// How a rank waits: it spins, and gives the CPU away now and then (at every poll when its
/// host has more ranks than cores, as Open MPI does when oversubscribed), so that ranks and
/// their engines that share a core all make progress. The clock is read once when a wait
/// begins and then every 64 polls, not at every poll.
pub(super) struct Idler {
    pub(super) polls: u32,
    pub(super) since: Option<Instant>,
    pub(super) yield_every: u32,
}

impl Idler {
    pub(super) fn new(oversubscribed: bool) -> Idler {
        Idler {
            polls: 0,
            since: None,
            yield_every: if oversubscribed { 1 } else { 64 },
        }
    }

    /// Something happened: the next wait starts afresh.
    pub(super) fn progressed(&mut self) {
        self.since = None;
    }

    /// One empty poll; returns how long this wait has lasted when it read the clock.
    pub(super) fn idle(&mut self) -> Option<Duration> {
        self.polls = self.polls.wrapping_add(1);
        if self.polls % self.yield_every == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        match self.since {
            None => {
                self.since = Some(Instant::now());
                Some(Duration::ZERO)
            }
            Some(t) if self.polls % 64 == 0 => Some(t.elapsed()),
            Some(_) => None,
        }
    }
}

impl Communicator {
    /// One turn of a wait loop after its look at the links: nothing more when it `progressed`
    /// (the next wait starts afresh), else an idle poll; when that read the clock, an abort
    /// fails the wait, credits owed
    /// for longer than `CREDIT_IDLE` go out and the time waited so far is returned, for the
    /// caller's peer and timeout checks.
    pub(super) fn idle_turn(
        &mut self,
        idler: &mut Idler,
        progressed: bool,
    ) -> Result<Option<Duration>, CollError> {
        if progressed {
            idler.progressed();
            return Ok(None);
        }
        let Some(waited) = idler.idle() else {
            return Ok(None);
        };
        self.check_abort()?;
        if waited > CREDIT_IDLE {
            self.flush_credits()?;
        }
        Ok(Some(waited))
    }

    /// Waits until some other rank's next message carries `digest_of(rank)` and returns that
    /// rank, the lowest if several have one; the message stays to be consumed. Fails as a phase
    /// does: after the timeout without such a message, or when a peer fails with messages of
    /// this rank's unconsumed.
    pub(crate) fn wait_for_sender(
        &mut self,
        digest_of: impl Fn(usize) -> u16,
    ) -> Result<usize, CollError> {
        let mut idler = Idler::new(self.oversubscribed);
        loop {
            let progressed = self.poll()?;
            for p in 0..self.size {
                if p == self.rank || self.links[p].is_none() {
                    continue;
                }
                if let Some(imm) = self.next_arrival(p)? {
                    if (imm >> 16) as u16 == digest_of(p) {
                        return Ok(p);
                    }
                }
            }
            let Some(waited) = self.idle_turn(&mut idler, progressed)? else {
                continue;
            };
            self.check_peers(|_| false)?;
            if waited > self.opts.timeout {
                return Err(CollError::Timeout {
                    rank: self.rank,
                    timeout: self.opts.timeout,
                    what: "a message from any rank",
                });
            }
        }
    }

    /// Runs one phase: see the module doc.
    ///
    /// # Safety
    /// Every `Action` pointer must be valid for writes of its `len` bytes (and reads, for a
    /// reduction) during the call, and nothing else may access those bytes meanwhile except
    /// this phase's sends from them, ordered by `after`; every `Out` and forward source must
    /// hold its bytes until the call returns.
    pub(crate) unsafe fn run(&mut self, digest: u16, phase: Phase<'_>) -> Result<(), CollError> {
        // SAFETY: the same contract.
        unsafe { self.run_with(digest, digest, phase) }
    }

    /// As [`run`](Self::run), with messages sent carrying `out_digest` and those received
    /// expected to carry `in_digest` (a send and a receive of different calls in one phase).
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    pub(crate) unsafe fn run_with(
        &mut self,
        out_digest: u16,
        in_digest: u16,
        phase: Phase<'_>,
    ) -> Result<(), CollError> {
        let n = self.size;
        let slice = phase.slice.clamp(1, self.opts.slot_bytes);
        // Per-link state lives in the links and is reused from phase to phase, so a phase
        // allocates nothing once the queues have grown: a latency-bound exchange is a few
        // hundred nanoseconds, where every allocation shows.
        for l in self.links.iter_mut().flatten() {
            l.involved = false;
            l.base = l.sent;
            l.outq.clear();
            l.inq.clear();
        }
        let bad = |c: &Communicator, p: usize| {
            if p >= n || c.links[p].is_none() {
                Err(CollError::BadRank { rank: p, size: n })
            } else {
                Ok(())
            }
        };
        for (i, o) in phase.outs.iter().enumerate() {
            bad(self, o.peer)?;
            let l = self.links[o.peer].as_mut().expect("checked");
            l.involved = true;
            push_slices(&mut l.outq, i as u32, o.off, o.len, slice);
        }
        for (j, i) in phase.ins.iter().enumerate() {
            bad(self, i.peer)?;
            for &f in &i.forward {
                bad(self, f)?;
                self.links[f].as_mut().expect("checked").involved = true;
            }
            let l = self.links[i.peer].as_mut().expect("checked");
            l.involved = true;
            if i.len > 0 {
                l.inq.push_back((j as u32, 0));
            }
        }
        if self.runs % 64 == 0 {
            // Links come up over shared memory a moment after they connect: look again now
            // and then.
            self.oversubscribed = self.host_oversubscribed();
        }
        self.runs = self.runs.wrapping_add(1);
        let mut idler = Idler::new(self.oversubscribed);
        // Same-host messages arrive in memory (header words), not in the CQ: with only such
        // peers the CQ (send completions, aborts, failures) is looked at every 16th turn, which
        // spares most turns a pass over the context's rings and sockets.
        let cq_every = if self
            .links
            .iter()
            .flatten()
            .any(|l| l.involved && l.qp.provider() != Provider::Shm)
        {
            1
        } else {
            16
        };
        let source = |r: u32| -> Src<'_> {
            if r & FORWARDED != 0 {
                phase.ins[(r & !FORWARDED) as usize]
                    .src
                    .expect("forwarded from a source")
                    .0
            } else {
                phase.outs[r as usize].mr
            }
        };
        let mut turn = 0u32;
        loop {
            let mut progressed = false;
            turn = turn.wrapping_add(1);
            for p in 0..n {
                while let Some(&(r, off, len)) = self.links[p].as_ref().and_then(|l| l.outq.front())
                {
                    if !self.credit_available(p)? {
                        break;
                    }
                    self.links[p].as_mut().expect("a link").outq.pop_front();
                    // SAFETY: the caller's contract covers every source of the phase.
                    unsafe { self.post_message(p, out_digest, source(r), off, len) }?;
                    progressed = true;
                }
            }
            if turn % cq_every == 0 {
                progressed |= self.poll()?;
            }
            for p in 0..n {
                while let Some(&(j, done)) = self.links[p].as_ref().and_then(|l| l.inq.front()) {
                    let item = &phase.ins[j as usize];
                    let Some(imm) = self.next_arrival(p)? else {
                        break;
                    };
                    if let Some((q, count)) = item.after {
                        // The messages must have been posted (an inline one copies its bytes
                        // then), and those that read the buffer later must have completed.
                        let l = self.links[q].as_ref().expect("checked");
                        let upto = l.base + count;
                        if l.sent < upto || l.done < upto.min(l.reads_until) {
                            break;
                        }
                    }
                    let len = slice.min(item.len - done);
                    let at = done;
                    self.consume(p, imm, in_digest, len, |src| {
                        // SAFETY: the caller vouches for the action's pointer over the item's
                        // `len` bytes, of which `at..at + len` is a part.
                        unsafe { apply(item, src, at, len) }
                    })?;
                    if let Some((_, off)) = item.src {
                        for &f in &item.forward {
                            let l = self.links[f].as_mut().expect("checked");
                            l.outq.push_back((FORWARDED | j, off + at, len));
                        }
                    }
                    let l = self.links[p].as_mut().expect("checked");
                    let front = l.inq.front_mut().expect("the item taken");
                    front.1 += len;
                    if front.1 == item.len {
                        l.inq.pop_front();
                    }
                    progressed = true;
                }
            }
            let pending = |l: &Link| !l.outq.is_empty() || !l.inq.is_empty();
            if !self.links.iter().flatten().any(pending) {
                break;
            }
            let Some(waited) = self.idle_turn(&mut idler, progressed)? else {
                continue;
            };
            let links = &self.links;
            self.check_peers(|p| links[p].as_ref().is_some_and(pending))?;
            if waited > self.opts.timeout {
                let rank = (0..n)
                    .find(|&p| self.links[p].as_ref().is_some_and(pending))
                    .unwrap_or(self.rank);
                let waiting_for_message =
                    self.links[rank].as_ref().is_some_and(|l| !l.inq.is_empty());
                return Err(CollError::Timeout {
                    rank,
                    timeout: self.opts.timeout,
                    what: if waiting_for_message {
                        "a message"
                    } else {
                        "credits to send"
                    },
                });
            }
        }
        // Credits for what this phase consumed go out when this rank next waits (or drops the
        // communicator), off the path of a latency-bound exchange. Every send that reads a
        // caller's buffer has completed before the caller may reuse it; a peer that failed
        // after consuming them all needs no acknowledgement (its QP is in ERR: nothing reads
        // the sources again).
        let drained = |c: &Communicator, p: usize| {
            c.links[p].as_ref().map_or(true, |l| {
                !l.involved
                    || l.done >= l.reads_until
                    || (l.failed.is_some() && c.credits.load(p).is_ok_and(|freed| freed >= l.sent))
            })
        };
        while let Some(p) = (0..n).find(|&p| !drained(self, p)) {
            if self.poll()? {
                idler.progressed();
                continue;
            }
            let Some(waited) = idler.idle() else {
                continue;
            };
            self.check_peers(|_| false)?;
            if waited > self.opts.timeout {
                return Err(CollError::Timeout {
                    rank: p,
                    timeout: self.opts.timeout,
                    what: "the acknowledgement of a send",
                });
            }
        }
        Ok(())
    }

    /// The most bytes a message from a pointer ([`Src::Ptr`]) may carry.
    pub(crate) fn stage_bytes(&self) -> usize {
        self.opts.slot_bytes.min(INLINE_BYTES)
    }

    /// Whether this host runs more of the communicator's ranks (this one and those reached
    /// over shared memory) than it has cores.
    pub(super) fn host_oversubscribed(&self) -> bool {
        let here = 1 + self
            .links
            .iter()
            .flatten()
            .filter(|l| l.qp.provider() == Provider::Shm)
            .count();
        here > self.cores
    }
}

pub(super) fn push_slices(
    q: &mut VecDeque<(u32, usize, usize)>,
    mr: u32,
    off: usize,
    len: usize,
    slice: usize,
) {
    let mut at = 0;
    while at < len {
        let l = slice.min(len - at);
        q.push_back((mr, off + at, l));
        at += l;
    }
}
