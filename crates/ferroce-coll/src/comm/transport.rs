//! Messages and credits: posting a message into a peer's slot, its arrival and consumption, and
//! the credits that free slots (see the module doc of `comm`).

use super::*;

/// Receive requests kept posted on each QP (each WRITE with immediate consumes one).
pub(super) const RECV_DEPTH: usize = 64;
/// The immediate of an abort (its digest, `0xffff`, is never a call's).
pub(super) const ABORT_IMM: u32 = u32::MAX;
/// Work-request ids: a message's is its index above bit 16 and its peer below; a credit's is
/// its peer with `CREDIT_WR` set; an abort's and a close's are their own.
pub(super) const ABORT_WR: u64 = u64::MAX;
pub(super) const PEER_BITS: u64 = 0x7fff;
/// The work-request id of the WRITE that closes a link when the communicator is dropped.
pub(super) const CLOSE_WR: u64 = u64::MAX - 1;
pub(super) const CREDIT_WR: u64 = 0x8000;
/// How long a rank waits with nothing to do before it sends the credits it owes (sooner, at
/// half its slots, in `consume`): a latency-bound exchange gets its next message first.
pub(super) const CREDIT_IDLE: Duration = Duration::from_micros(50);
/// Messages up to this size carry their bytes inline in the WRITE with immediate.
pub(super) const INLINE_BYTES: usize = 64 << 10;

impl Communicator {
    /// Whether `peer` has a free slot for this rank's next message.
    pub(super) fn credit_available(&self, peer: usize) -> Result<bool, CollError> {
        let l = self.links[peer]
            .as_ref()
            .expect("a link to every other rank");
        // The peer sets its consumed count as one 8-byte word (a release store, or ferroce
        // placing an aligned 8-byte WRITE), loaded here with acquire ordering (see the module
        // doc): no torn value is seen, and the peer's reads of the freed slots are done.
        let freed = self.credits.load(peer)?;
        Ok(l.sent - freed.min(l.sent) < self.opts.slots as u64)
    }

    /// Posts one message to `peer`: `len` bytes of `src` from `off` into the next slot. The
    /// signal depends on the link (see the module doc).
    ///
    /// # Safety
    /// A [`Src::Ptr`] must be valid for reads of `off + len` bytes, and `len` at most
    /// [`stage_bytes`](Self::stage_bytes).
    pub(super) unsafe fn post_message(
        &mut self,
        peer: usize,
        digest: u16,
        src: Src<'_>,
        off: usize,
        len: usize,
    ) -> Result<(), CollError> {
        let stage_bytes = self.stage_bytes();
        let l = self.links[peer]
            .as_mut()
            .expect("a link to every other rank");
        let index = l.sent;
        let slot = (index % self.opts.slots as u64) as usize;
        let dst = l.slots.addr + (slot * self.opts.slot_bytes) as u64;
        let wr_id = index << 16 | peer as u64;
        // SAFETY: the caller vouches for `off + len` bytes at a pointer source.
        let ptr_bytes = |p: *const u8| unsafe { std::slice::from_raw_parts(p.add(off), len) };
        // Whether some bytes of a caller's buffer are read after this call returns.
        let reads_later;
        if l.qp.provider() == Provider::Shm {
            // A WRITE runs in the post, straight into the peer's memory, as long as nothing is
            // queued before it; a WRITE with immediate would queue (it needs the peer's receive
            // and acknowledgement) and push every later message onto the packet path. So the
            // message is marked arrived by its slot's header word, which the peer polls: data,
            // then header, in order.
            let word = (index + 1) << 16 | u64::from(digest);
            if let (Src::Ptr(p), Some(m)) = (src, l.maps()) {
                if let Some(header) = mapped(&m.headers, slot) {
                    // Small: stored straight into the peer's slot, then the header with release
                    // ordering; no request posted, nothing to complete.
                    // SAFETY: the slot lies in the peer's mapped slots (`len` is at most a
                    // slot, and `maps` mapped `slots` slots), which the peer does not read
                    // until the header says so, and which this rank writes only once the
                    // peer's credit (loaded with acquire ordering) freed it; `p` is the
                    // caller's, for `len` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            ptr_bytes(p).as_ptr(),
                            m.slots.as_ptr().add(slot * self.opts.slot_bytes),
                            len,
                        );
                    }
                    header.store(word, Ordering::Release);
                    l.sent += 1;
                    return Ok(());
                }
            }
            // A message from a pointer is staged in this slot's bytes of `stage`, which are not
            // written again before the peer consumed the message (its credit).
            let (mr, at) = match src {
                Src::Mr(mr) => (mr, off),
                Src::Ptr(p) => {
                    let at = (peer * self.opts.slots + slot) * stage_bytes;
                    self.stage.write(at, ptr_bytes(p))?;
                    (&self.stage, at)
                }
            };
            reads_later = matches!(src, Src::Mr(_));
            let word_at = 8 * (peer * self.opts.slots + slot);
            self.header_src.store(word_at / 8, word)?;
            let mut wrs = Vec::with_capacity(2);
            if len > 0 {
                let mut w = SendWr::new(wr_id, SendOp::Write, vec![mr.sge(at, len)?])
                    .remote(dst, l.slots.rkey);
                w.flags.signaled = false;
                wrs.push(w);
            }
            let mut header = SendWr::new(
                wr_id,
                SendOp::Write,
                vec![self.header_src.mr().sge(word_at, 8)?],
            )
            .remote(l.headers.addr + 8 * slot as u64, l.headers.rkey);
            // Only a message that reads a caller's buffer needs its completion awaited.
            header.flags.signaled = reads_later;
            wrs.push(header);
            l.qp.post_send_batch(wrs)?;
        } else {
            let imm = u32::from(digest) << 16 | (index & 0xffff) as u32;
            let signal = SendWr::new(wr_id, SendOp::WriteWithImm(imm), vec![]);
            match src {
                _ if len <= INLINE_BYTES => {
                    // Copied into the request: nothing waits for its completion, so it need
                    // not ask the peer for an acknowledgement (a ferroce peer's next one
                    // covers it).
                    let data = match src {
                        Src::Ptr(p) => ptr_bytes(p).to_vec(),
                        Src::Mr(mr) => mr.to_vec(off, len)?,
                    };
                    let mut wr = signal.remote(dst, l.slots.rkey);
                    wr.inline_data = Some(data);
                    wr.flags.signaled = false;
                    l.qp.post_send(wr)?;
                    reads_later = false;
                }
                Src::Mr(mr) => {
                    let mut write = SendWr::new(wr_id, SendOp::Write, vec![mr.sge(off, len)?])
                        .remote(dst, l.slots.rkey);
                    write.flags.signaled = false;
                    l.qp.post_send_batch([write, signal.remote(dst, l.slots.rkey)])?;
                    reads_later = true;
                }
                Src::Ptr(_) => {
                    return Err(CollError::Size {
                        what: "a message from a pointer",
                        got: len,
                        want: INLINE_BYTES,
                    })
                }
            }
        }
        l.sent += 1;
        if reads_later {
            l.reads_until = l.sent;
        }
        Ok(())
    }

    /// Takes every completion there is; whether there were any. A peer's abort is reported
    /// before any other failure taken in the same poll (the flush that follows it, say).
    pub(super) fn poll(&mut self) -> Result<bool, CollError> {
        let mut any = false;
        let mut failure = None;
        while let Some(wc) = self.cq.poll_one()? {
            any = true;
            let taken = if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                self.on_arrival(&wc)
            } else {
                self.on_send(&wc)
            };
            match taken {
                Err(e @ CollError::PeerFailed { .. }) => return Err(e),
                Err(e) => {
                    failure.get_or_insert(e);
                }
                Ok(()) => {}
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(any),
        }
    }

    /// Takes the completion of a send.
    pub(super) fn on_send(&mut self, wc: &WorkCompletion) -> Result<(), CollError> {
        {
            let peer = (wc.wr_id & PEER_BITS) as usize;
            let Some(l) = self.links.get_mut(peer).and_then(Option::as_mut) else {
                return Ok(());
            };
            if wc.status != WcStatus::Success {
                l.failed.get_or_insert(wc.status);
                let consumed = self.credits.load(peer)?;
                if wc.wr_id & CREDIT_WR != 0 || consumed >= l.sent {
                    // A peer that consumed everything this rank sent it, finished and left
                    // before its acknowledgements came back (the QP is in ERR now, so nothing
                    // reads the sources again): only a phase that needs it fails
                    // (`check_peers`).
                    return Ok(());
                }
                return Err(CollError::Transfer {
                    rank: peer,
                    what: "a send",
                    status: wc.status,
                });
            }
            if wc.wr_id & CREDIT_WR == 0 {
                // Completions come in order; unsignaled messages before this one are done too.
                l.done = l.done.max((wc.wr_id >> 16) + 1);
            }
        }
        Ok(())
    }

    /// Takes an arrived message (or the failure of a peer's QP).
    pub(super) fn on_arrival(&mut self, wc: &WorkCompletion) -> Result<(), CollError> {
        {
            let Some(peer) = self
                .links
                .iter()
                .position(|l| l.as_ref().is_some_and(|l| l.qp.qpn() == wc.qp_num))
            else {
                return Ok(());
            };
            let l = self.links[peer].as_mut().expect("found");
            if wc.status != WcStatus::Success {
                // A QP no phase uses may fail when its peer leaves: only a phase that needs
                // the peer fails (`check_peers`).
                l.failed.get_or_insert(wc.status);
                return Ok(());
            }
            l.posted -= 1;
            while l.posted < RECV_DEPTH {
                l.qp.post_recv(RecvWr {
                    wr_id: 0,
                    sgl: vec![],
                })?;
                l.posted += 1;
            }
            match (wc.opcode, wc.imm_data) {
                (_, Some(ABORT_IMM)) => {
                    return Err(CollError::PeerFailed { rank: peer });
                }
                (WcOpcode::RecvRdmaWithImm, Some(imm)) => l.arrived.push_back(imm),
                _ => {
                    return Err(CollError::OutOfStep {
                        rank: peer,
                        got: u16::MAX,
                        want: (l.consumed & 0xffff) as u16,
                    })
                }
            }
        }
        Ok(())
    }

    /// Fails if a peer the phase still needs failed (`needed(p)`: bytes to send it or take
    /// from it), or one that has not consumed all this rank sent it.
    pub(super) fn check_peers(&self, needed: impl Fn(usize) -> bool) -> Result<(), CollError> {
        for (p, l) in self.links.iter().enumerate() {
            if let Some(l) = l {
                let unconsumed = self.credits.load(p)? < l.sent;
                if let (true, Some(status)) = (needed(p) || unconsumed, l.failed) {
                    return Err(CollError::Transfer {
                        rank: p,
                        what: "the QP",
                        status,
                    });
                }
            }
        }
        Ok(())
    }

    /// The immediate of `peer`'s next message if it arrived: with a WRITE with immediate, or
    /// (same-host peers) marked in its slot's header word as `(index + 1) << 16 | digest`.
    pub(super) fn next_arrival(&self, peer: usize) -> Result<Option<u32>, CollError> {
        let l = self.links[peer]
            .as_ref()
            .expect("a link to every other rank");
        let index = l.consumed;
        if let Some(&imm) = l.arrived.front() {
            if imm as u16 == index as u16 {
                return Ok(Some(imm));
            }
        }
        let slots = self.opts.slots;
        let word = self
            .headers
            .load(peer * slots + (index % slots as u64) as usize)?;
        Ok((word >> 16 == index + 1).then_some((word as u32) << 16 | (index & 0xffff) as u32))
    }

    /// Consumes the next message from `peer` (`len` bytes expected), running `f` on its bytes
    /// where they landed, and frees its slot.
    pub(super) fn consume(
        &mut self,
        peer: usize,
        imm: u32,
        digest: u16,
        len: usize,
        f: impl FnOnce(&[u8]) -> Result<(), crate::reduce::ReduceError>,
    ) -> Result<(), CollError> {
        let slot_bytes = self.opts.slot_bytes;
        let slots = self.opts.slots;
        let l = self.links[peer]
            .as_mut()
            .expect("a link to every other rank");
        if l.arrived.front() == Some(&imm) {
            l.arrived.pop_front();
        }
        let want = (l.consumed & 0xffff) as u16;
        if (imm >> 16) as u16 != digest {
            return Err(CollError::Mismatch {
                rank: peer,
                ours: digest,
                theirs: (imm >> 16) as u16,
            });
        }
        if imm as u16 != want {
            return Err(CollError::OutOfStep {
                rank: peer,
                got: imm as u16,
                want,
            });
        }
        let at = (peer * slots + (l.consumed % slots as u64) as usize) * slot_bytes;
        l.consumed += 1;
        // SAFETY: the peer wrote this slot before the WRITE with immediate just taken, and
        // writes it again only after the credit below says it was consumed; nothing else
        // writes the inbox.
        unsafe { self.inbox.with_slice(at, len, f) }??;
        let l = self.links[peer]
            .as_ref()
            .expect("a link to every other rank");
        if l.consumed - l.credited >= (self.opts.slots as u64).div_ceil(2) {
            self.send_credit(peer)?;
        }
        Ok(())
    }

    /// Tells every peer about messages consumed and not yet credited.
    pub(super) fn flush_credits(&mut self) -> Result<(), CollError> {
        for p in 0..self.size {
            if self.links[p]
                .as_ref()
                .is_some_and(|l| l.consumed > l.credited && l.failed.is_none())
            {
                self.send_credit(p)?;
            }
        }
        Ok(())
    }

    pub(super) fn send_credit(&mut self, peer: usize) -> Result<(), CollError> {
        let l = self.links[peer]
            .as_mut()
            .expect("a link to every other rank");
        let consumed = l.consumed;
        if let Some(credit) = l.maps().and_then(|m| mapped(&m.credit, 0)) {
            // Release: this rank's reads of the slots it frees happen before the peer, having
            // loaded the count with acquire ordering, writes them again.
            credit.store(consumed, Ordering::Release);
            l.credited = consumed;
            return Ok(());
        }
        // The word may be read by the transport later than this post (over UDP): a later,
        // larger count in its place is as true.
        self.credit_src.store(peer, l.consumed)?;
        let mut wr = SendWr::new(
            CREDIT_WR | peer as u64,
            SendOp::Write,
            vec![self.credit_src.mr().sge(8 * peer, 8)?],
        )
        .remote(l.credit.addr, l.credit.rkey);
        wr.flags.signaled = false;
        l.qp.post_send(wr)?;
        l.credited = l.consumed;
        Ok(())
    }
}
