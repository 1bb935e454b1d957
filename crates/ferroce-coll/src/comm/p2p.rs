//! Sends and receives in flight together: started without waiting, progressed all at once, each
//! completing on its own — what torch's `isend`/`irecv` and MPI's `Isend`/`Irecv` promise.
//!
//! A blocking [`send`](Communicator::send) waits for the peer's receive once the peer's slots are
//! full, and a blocking receive waits for the peer's send: two ranks that each receive and then
//! send, or each send more than their slots hold, wait for each other for ever. Operations
//! started here progress together instead: every turn posts what credits allow of each peer's
//! first unfinished send and copies out what arrived for each peer's first unfinished receive,
//! so a rank that is owed a message never stops consuming while it waits to send.
//!
//! The messages are those of [`sendrecv`](Communicator::sendrecv) (slices of one slot, the same
//! digest), so a started send meets a blocking receive and the other way round. Sends to one
//! peer leave in the order they started, and receives from one peer take that peer's sends in
//! order, as MPI's matching does for one tag.
//!
//! A tag (torch's, MPI's) is part of the digest, with the length and the direction: a receive
//! meets only a send of its tag, and one whose peer's next send has another fails with
//! [`CollError::Mismatch`] instead of taking bytes meant for another receive. Receives are not
//! matched out of order by tag (MPI and gloo do): a message carries no length or tag to be set
//! aside by, only the 16-bit digest. [`recv_any_tagged`](Communicator::recv_any_tagged) takes
//! the first send of its tag and length from any rank. A collective (or any blocking call) first finishes
//! every operation in flight (`finish_in_flight`): their messages went out before its own, and
//! a link carries one call's messages at a time.

use super::engine::Idler;
use super::*;

/// A started operation's number, which [`Communicator::progress`] reports when it completes.
pub type Ticket = u64;

/// What a call of [`Communicator::progress`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The operations that completed.
    pub completed: Vec<Ticket>,
    /// Whether anything moved (bytes posted or taken), completed or not: a caller that waits
    /// between calls can tell a transfer under way from one that waits for its peer.
    pub moved: bool,
}

/// The digest of a point-to-point message: its length, its direction and its tag (tag 0 leaves
/// the tag out, so untagged sends keep the digest they had before tags).
pub(crate) fn p2p_digest(len: usize, from: usize, to: usize, tag: u32) -> u16 {
    let parts = [len as u64, from as u64, to as u64, u64::from(tag)];
    digest(
        crate::ops::kind::P2P,
        if tag == 0 { &parts[..3] } else { &parts },
    )
}

/// A started send: its source, and how far it got.
pub(super) struct Sending {
    ticket: Ticket,
    /// The caller's bytes, registered (they are read by the posts and, over UDP, again by a
    /// retransmission until the message completes).
    mr: MemoryRegion,
    len: usize,
    digest: u16,
    /// Bytes posted so far.
    posted: usize,
    /// Once all is posted: the link's `reads_until` then (the send completes when the link's
    /// `done` reaches it: no request reads the caller's bytes any more).
    until: Option<u64>,
}

/// A started receive: where its bytes go, and how many came.
pub(super) struct Receiving {
    ticket: Ticket,
    dst: *mut u8,
    len: usize,
    digest: u16,
    taken: usize,
}

// SAFETY: the pointer is the caller's buffer, which `start_recv`'s contract keeps valid and
// unaccessed by anything else until the receive ends, whichever thread then holds the
// communicator; it is written only through the communicator, which one thread uses at a time
// (`&mut self`).
unsafe impl Send for Receiving {}
// SAFETY: through a shared reference nothing reads or writes the bytes the pointer names
// (`recv_queue_turn`, the one writer, runs under `&mut Communicator`).
unsafe impl Sync for Receiving {}

/// Every operation in flight, by peer, and those completed and not yet reported.
#[derive(Default)]
pub(super) struct InFlight {
    next: Ticket,
    sends: Vec<VecDeque<Sending>>,
    recvs: Vec<VecDeque<Receiving>>,
    completed: VecDeque<Ticket>,
    /// When the operations in flight last moved (for the timeout).
    moved: Option<Instant>,
}

fn sends(f: &mut InFlight) -> &mut Vec<VecDeque<Sending>> {
    &mut f.sends
}

fn recvs(f: &mut InFlight) -> &mut Vec<VecDeque<Receiving>> {
    &mut f.recvs
}

impl InFlight {
    fn count(&self) -> usize {
        self.sends.iter().map(VecDeque::len).sum::<usize>()
            + self.recvs.iter().map(VecDeque::len).sum::<usize>()
    }

    fn ticket(&mut self) -> Ticket {
        self.next += 1;
        self.next
    }
}

impl Communicator {
    /// Starts sending `len` bytes at `buf` to rank `peer` with `tag`, matched by the peer's
    /// receive of the same length and tag (started, or blocking for tag 0); returns its ticket
    /// at once. The send completes in [`progress`](Self::progress), which reports its ticket.
    ///
    /// # Safety
    /// `buf` is valid for reads of `len` bytes, and nothing writes them, until the ticket is
    /// reported (or a call fails, which breaks the communicator and ends every operation in
    /// flight) or the communicator is dropped.
    pub unsafe fn start_send(
        &mut self,
        buf: *const u8,
        len: usize,
        peer: usize,
        tag: u32,
    ) -> Result<Ticket, CollError> {
        self.check_p2p_start(peer, buf.is_null(), len, "a send from a null buffer")?;
        let digest = p2p_digest(len, self.rank, peer, tag);
        // SAFETY: the caller's contract covers the region's life (it is dropped when the send
        // completes or the communicator goes).
        let mr = unsafe { self.register(buf, len) }?;
        let ticket = self.in_flight.ticket();
        match mr {
            // Nothing to send: a send of no bytes carries no message (as in `sendrecv`).
            None => self.in_flight.completed.push_back(ticket),
            Some(mr) => {
                self.in_flight.moved.get_or_insert_with(Instant::now);
                self.in_flight.sends[peer].push_back(Sending {
                    ticket,
                    mr,
                    len,
                    digest,
                    posted: 0,
                    until: None,
                });
            }
        }
        Ok(ticket)
    }

    /// Starts receiving `len` bytes from rank `peer` into `buf` (the peer's next send to this
    /// rank that no earlier receive takes, which must have the same length and tag); returns
    /// its ticket at once.
    ///
    /// # Safety
    /// `buf` is valid for writes of `len` bytes, and nothing else reads or writes them, until
    /// the ticket is reported (or a call fails) or the communicator is dropped.
    pub unsafe fn start_recv(
        &mut self,
        buf: *mut u8,
        len: usize,
        peer: usize,
        tag: u32,
    ) -> Result<Ticket, CollError> {
        self.check_p2p_start(peer, buf.is_null(), len, "a receive into a null buffer")?;
        let digest = p2p_digest(len, peer, self.rank, tag);
        let ticket = self.in_flight.ticket();
        if len == 0 {
            self.in_flight.completed.push_back(ticket);
        } else {
            self.in_flight.moved.get_or_insert_with(Instant::now);
            self.in_flight.recvs[peer].push_back(Receiving {
                ticket,
                dst: buf,
                len,
                digest,
                taken: 0,
            });
        }
        Ok(ticket)
    }

    /// How many started operations have not completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.count()
    }

    /// Moves every started operation on, for up to `wait`, and returns the tickets of those
    /// that completed (at most `max`; the rest come with the next call), as soon as there are
    /// any. Operations that see no progress for the communicator's timeout fail it with
    /// [`CollError::Timeout`] (one clock for all of them, which runs between calls too); a
    /// failure, or an abort, breaks the communicator (see the module doc of `comm`) and ends
    /// every operation in flight, none of which completes.
    pub fn progress(&mut self, wait: Duration, max: usize) -> Result<Progress, CollError> {
        self.ready()?;
        let moved = self.in_flight.moved;
        let r = self.progress_for(wait);
        if let Err(e) = &r {
            self.fail(e);
        }
        r?;
        let n = max.min(self.in_flight.completed.len());
        Ok(Progress {
            completed: self.in_flight.completed.drain(..n).collect(),
            moved: self.in_flight.moved != moved,
        })
    }

    /// Receives `buf` from `from` with `tag`, blocking (a started receive, run to its end; its
    /// ticket is not reported).
    pub(crate) fn recv_tagged(
        &mut self,
        buf: &mut [u8],
        from: usize,
        tag: u32,
    ) -> Result<(), CollError> {
        // SAFETY: `buf` is borrowed mutably until the receive ends below (or the call fails,
        // which ends it: `abandon_in_flight`).
        let ticket = unsafe { self.start_recv(buf.as_mut_ptr(), buf.len(), from, tag) }?;
        self.guarded(|c| {
            while !c.in_flight.completed.contains(&ticket) {
                c.progress_for(Duration::from_secs(1))?;
            }
            c.in_flight.completed.retain(|&t| t != ticket);
            Ok(())
        })
    }

    /// Runs every operation in flight to completion (their tickets are reported by the next
    /// [`progress`](Self::progress)): a blocking call's messages go after theirs.
    pub(super) fn finish_in_flight(&mut self) -> Result<(), CollError> {
        while self.in_flight() > 0 {
            self.progress_for(Duration::from_secs(1))?;
        }
        Ok(())
    }

    /// Drops every operation in flight (a failure ended them; their regions go, and the QPs,
    /// moved to ERR by the failure, read no caller's bytes again).
    pub(super) fn abandon_in_flight(&mut self) {
        for q in &mut self.in_flight.sends {
            q.clear();
        }
        for q in &mut self.in_flight.recvs {
            q.clear();
        }
        self.in_flight.moved = None;
    }

    /// Checks a start: the communicator usable, `peer` another rank, bytes at a pointer.
    fn check_p2p_start(
        &mut self,
        peer: usize,
        null: bool,
        len: usize,
        what: &'static str,
    ) -> Result<(), CollError> {
        if len > 0 && null {
            return Err(CollError::Size {
                what,
                got: len,
                want: 0,
            });
        }
        self.ready()?;
        self.check_rank(peer)?;
        if peer == self.rank {
            return Err(CollError::BadRank {
                rank: peer,
                size: self.size,
            });
        }
        if self.in_flight.sends.len() < self.size {
            self.in_flight.sends.resize_with(self.size, VecDeque::new);
            self.in_flight.recvs.resize_with(self.size, VecDeque::new);
        }
        Ok(())
    }

    /// The loop of [`progress`](Self::progress): returns once something completed, or after
    /// `wait`, or when nothing is in flight.
    fn progress_for(&mut self, wait: Duration) -> Result<(), CollError> {
        let start = Instant::now();
        let slice = self.opts.slot_bytes;
        let mut idler = Idler::new(self.oversubscribed);
        loop {
            let before = self.in_flight.completed.len();
            let mut progressed = false;
            for p in 0..self.in_flight.sends.len() {
                if !self.in_flight.sends[p].is_empty() {
                    progressed |=
                        self.with_queue(sends, p, |c, q| c.send_queue_turn(p, slice, q))?;
                }
            }
            progressed |= self.poll()?;
            for p in 0..self.in_flight.recvs.len() {
                if !self.in_flight.recvs[p].is_empty() {
                    progressed |=
                        self.with_queue(recvs, p, |c, q| c.recv_queue_turn(p, slice, q))?;
                }
            }
            if progressed {
                self.in_flight.moved = Some(Instant::now());
            }
            if self.in_flight.completed.len() > before || self.in_flight() == 0 {
                if self.in_flight() == 0 {
                    self.in_flight.moved = None;
                }
                return Ok(());
            }
            let Some(_) = self.idle_turn(&mut idler, progressed)? else {
                continue;
            };
            let flight = &self.in_flight;
            let pending = |p: usize| {
                flight.sends.get(p).is_some_and(|q| !q.is_empty())
                    || flight.recvs.get(p).is_some_and(|q| !q.is_empty())
            };
            self.check_peers(pending)?;
            if let Some(moved) = self.in_flight.moved {
                if moved.elapsed() > self.opts.timeout {
                    let rank = (0..self.size).find(|&p| pending(p)).unwrap_or(self.rank);
                    let receiving = flight.recvs.get(rank).is_some_and(|q| !q.is_empty());
                    return Err(CollError::Timeout {
                        rank,
                        timeout: self.opts.timeout,
                        what: if receiving {
                            "a message"
                        } else {
                            "credits to send"
                        },
                    });
                }
            }
            if start.elapsed() >= wait {
                // A caller that comes back now and then (sleeping between calls) gets its
                // credits out here: no wait in the loop lasts long enough to send them.
                self.flush_credits()?;
                return Ok(());
            }
        }
    }

    /// Runs `turn` on `peer`'s queue of `queues`, taken out of the communicator meanwhile
    /// (the turn posts and consumes through `self`).
    fn with_queue<T>(
        &mut self,
        queues: fn(&mut InFlight) -> &mut Vec<VecDeque<T>>,
        peer: usize,
        turn: impl FnOnce(&mut Self, &mut VecDeque<T>) -> Result<bool, CollError>,
    ) -> Result<bool, CollError> {
        let mut q = std::mem::take(&mut queues(&mut self.in_flight)[peer]);
        let r = turn(self, &mut q);
        queues(&mut self.in_flight)[peer] = q;
        r
    }

    /// Posts what credits allow of the sends to `peer`, in order, and completes those whose
    /// messages all completed; whether anything happened.
    fn send_queue_turn(
        &mut self,
        peer: usize,
        slice: usize,
        q: &mut VecDeque<Sending>,
    ) -> Result<bool, CollError> {
        let mut progressed = false;
        for s in q.iter_mut() {
            while s.posted < s.len {
                if !self.credit_available(peer)? {
                    break;
                }
                let len = slice.min(s.len - s.posted);
                // SAFETY: a registered region's bytes, which the caller of `start_send`
                // keeps valid and unwritten until the send completes.
                unsafe { self.post_message(peer, s.digest, Src::Mr(&s.mr), s.posted, len) }?;
                s.posted += len;
                progressed = true;
            }
            if s.posted < s.len {
                // Later sends to the peer wait their turn.
                break;
            }
            if s.until.is_none() {
                s.until = Some(self.links[peer].as_ref().expect("a link").reads_until);
            }
        }
        let done = self.links[peer].as_ref().expect("a link").done;
        while let Some(s) = q.front() {
            match s.until {
                Some(until) if done >= until => {
                    self.in_flight.completed.push_back(s.ticket);
                    q.pop_front();
                    progressed = true;
                }
                _ => break,
            }
        }
        Ok(progressed)
    }

    /// Copies out what arrived for the receives from `peer`, in order; whether anything
    /// happened.
    fn recv_queue_turn(
        &mut self,
        peer: usize,
        slice: usize,
        q: &mut VecDeque<Receiving>,
    ) -> Result<bool, CollError> {
        let mut progressed = false;
        while let Some(r) = q.front_mut() {
            let Some(imm) = self.next_arrival(peer)? else {
                break;
            };
            let len = slice.min(r.len - r.taken);
            let (dst, at) = (r.dst, r.taken);
            self.consume(peer, imm, r.digest, len, |src| {
                // SAFETY: the caller of `start_recv` keeps `len` bytes at `dst` writable and
                // unaccessed until the receive completes; `at + len` lies within them.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.add(at), len) };
                Ok(())
            })?;
            r.taken += len;
            progressed = true;
            if r.taken == r.len {
                let t = r.ticket;
                q.pop_front();
                self.in_flight.completed.push_back(t);
            }
        }
        Ok(progressed)
    }
}
