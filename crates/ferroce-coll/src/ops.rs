//! The collectives, as phases of the communicator's engine (`comm/`).
//!
//! | collective | algorithm |
//! |---|---|
//! | allreduce, up to `small_bytes` | recursive doubling (ranks beyond a power of two fold in first and get the result last) |
//! | allreduce, larger | ring: reduce-scatter then allgather, one pipelined phase, each chunk forwarded slice by slice as soon as it is reduced |
//! | reduce_scatter, allgather | one half of that ring |
//! | broadcast | binomial tree up to `small_bytes`, pipelined chain beyond |
//! | reduce | ring reduce-scatter, then every rank's reduced block to the root |
//! | alltoall | every pair at once, credits pacing each peer |
//! | send, recv, sendrecv, recv_any | messages straight between the two ranks |
//!
//! Each call's messages carry a digest of its arguments (see `comm/phase.rs`), so ranks that disagree
//! fail instead of mixing data. Reductions are deterministic: every rank ends with bit-identical
//! results (the ring reduces each chunk in one order and passes the result round; recursive
//! doubling combines the same two values on both sides with commutative operators).

use crate::comm::{
    digest, messages, p2p_digest, Action, CollError, Communicator, In, Out, Phase, Src,
};
use crate::reduce::{finish_avg, DataType, ReduceError, ReduceOp};

/// Kinds of call, for the digest.
pub(crate) mod kind {
    pub const ALLREDUCE: u8 = 1;
    pub const ALLGATHER: u8 = 2;
    pub const REDUCE_SCATTER: u8 = 3;
    pub const BROADCAST: u8 = 4;
    pub const REDUCE: u8 = 5;
    pub const ALLTOALL: u8 = 6;
    pub const P2P: u8 = 7;
}

fn whole_elements(len: usize, dtype: DataType) -> Result<(), CollError> {
    if len % dtype.size() != 0 {
        return Err(ReduceError::PartialElement { len, dtype }.into());
    }
    Ok(())
}

fn same_len(what: &'static str, got: usize, want: usize) -> Result<(), CollError> {
    if got != want {
        return Err(CollError::Size { what, got, want });
    }
    Ok(())
}

/// Byte range of chunk `i` (mod `n`) when `elems` elements of `es` bytes are cut in `n`.
fn chunk(i: usize, n: usize, elems: usize, es: usize) -> std::ops::Range<usize> {
    let i = i % n;
    (elems * i / n) * es..(elems * (i + 1) / n) * es
}

impl Communicator {
    fn slice_for(&self, es: usize) -> usize {
        (self.opts.slot_bytes / es).max(1) * es
    }

    fn right(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn left(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// Reduces `buf` (elements of `dtype`) with `op` over every rank, in place: afterwards each
    /// rank's `buf` holds the same, bit-identical reduction.
    pub fn allreduce(
        &mut self,
        buf: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        self.usable()?;
        whole_elements(buf.len(), dtype)?;
        let d = digest(
            kind::ALLREDUCE,
            &[buf.len() as u64, dtype as u64, op as u64],
        );
        if self.size > 1 && !buf.is_empty() {
            let (ptr, len) = (buf.as_mut_ptr(), buf.len());
            // SAFETY: `buf` is borrowed mutably for the call; from here on it is reached only
            // through `ptr`, by the phases below, which own it while they run.
            self.guarded(|c| unsafe {
                if len <= c.opts.small_bytes {
                    c.doubling_allreduce(d, ptr, len, dtype, op)
                } else {
                    c.ring_allreduce(d, None, ptr, len, dtype, op)
                }
            })?;
        }
        if op == ReduceOp::Avg {
            finish_avg(buf, dtype, self.size)?;
        }
        Ok(())
    }

    /// As [`allreduce`](Self::allreduce), out of place: `output` gets the reduction of every
    /// rank's `input`.
    pub fn allreduce_into(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        same_len("allreduce output", output.len(), input.len())?;
        if self.size == 1 || input.len() <= self.opts.small_bytes {
            output.copy_from_slice(input);
            return self.allreduce(output, dtype, op);
        }
        self.usable()?;
        whole_elements(input.len(), dtype)?;
        let d = digest(
            kind::ALLREDUCE,
            &[input.len() as u64, dtype as u64, op as u64],
        );
        let (src, dst, len) = (input.as_ptr(), output.as_mut_ptr(), output.len());
        // SAFETY: `input` is only read and `output` is borrowed mutably for the call, reached
        // only through `dst` meanwhile.
        self.guarded(|c| unsafe { c.ring_allreduce(d, Some(src), dst, len, dtype, op) })?;
        if op == ReduceOp::Avg {
            finish_avg(output, dtype, self.size)?;
        }
        Ok(())
    }

    /// The ring over `ptr..ptr + len`, in place, or out of place from `input` (as long): then
    /// the first send reads the input, and each reduce-scatter step folds the input's chunk
    /// and the arriving one straight into the output, so no copy of the whole input is made.
    ///
    /// # Safety
    /// `ptr..ptr + len` is valid and reached by nothing else during the call; `input`, if
    /// given, is valid for reads of `len` bytes and not written meanwhile.
    unsafe fn ring_allreduce(
        &mut self,
        d: u16,
        input: Option<*const u8>,
        ptr: *mut u8,
        len: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        let (n, r, es) = (self.size, self.rank, dtype.size());
        let elems = len / es;
        let slice = self.slice_for(es);
        let ch = |i: usize| chunk(i, n, elems, es);
        // SAFETY: the caller's contract; sends read only chunks no action writes until `after`.
        let mr = unsafe { self.register(ptr, len) }?.expect("a non-empty buffer");
        let input_mr = match input {
            // SAFETY: the caller's contract: the input is only read.
            Some(p) => unsafe { self.register(p, len) }?,
            None => None,
        };
        let (left, right) = (self.left(), self.right());
        let mut phase = Phase {
            outs: vec![Out {
                peer: right,
                mr: input_mr.as_ref().unwrap_or(&mr).into(),
                off: ch(r).start,
                len: ch(r).len(),
            }],
            ins: Vec::with_capacity(2 * n),
            slice,
        };
        // Reduce-scatter: chunk r - 1 - k arrives, is folded in and passed on; the last one
        // (chunk r + 1) is then complete, and passing it on starts the allgather.
        for k in 0..n - 1 {
            let c = ch(r + 2 * n - k - 1);
            // SAFETY: inside the caller's buffers.
            let action = unsafe {
                match input {
                    Some(p) => Action::ReduceFrom(p.add(c.start), ptr.add(c.start), dtype, op),
                    None => Action::Reduce(ptr.add(c.start), dtype, op),
                }
            };
            phase.ins.push(In {
                peer: left,
                len: c.len(),
                action,
                forward: vec![right],
                src: Some(((&mr).into(), c.start)),
                after: None,
            });
        }
        // Allgather: chunk r - j arrives complete and is passed on but for the last. It
        // overwrites the bytes of chunk r - j this rank sent earlier in the phase (message
        // group j: the first send for j = 0, the forward of reduce-scatter step j - 1 else),
        // which must have completed.
        let mut sent_before = 0;
        for j in 0..n - 1 {
            let c = ch(r + n - j);
            sent_before += messages(c.len(), slice);
            phase.ins.push(In {
                peer: left,
                len: c.len(),
                // SAFETY: inside the caller's buffer.
                action: Action::Copy(unsafe { ptr.add(c.start) }),
                forward: if j < n - 2 { vec![right] } else { vec![] },
                src: Some(((&mr).into(), c.start)),
                after: Some((right, sent_before)),
            });
        }
        // SAFETY: the caller's contract; `after` orders the copies behind the sends.
        unsafe { self.run(d, phase) }
    }

    /// # Safety
    /// As for [`ring_allreduce`](Self::ring_allreduce).
    unsafe fn doubling_allreduce(
        &mut self,
        d: u16,
        ptr: *mut u8,
        len: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        let (n, r) = (self.size, self.rank);
        let slice = self.slice_for(dtype.size());
        // A buffer that fits a message is copied as it is sent: nothing to register.
        let mr = if len <= self.stage_bytes() {
            None
        } else {
            // SAFETY: the caller's contract.
            unsafe { self.register(ptr, len) }?
        };
        let all = messages(len, slice);
        let send = |to: usize| Out {
            peer: to,
            mr: mr.as_ref().map_or(Src::Ptr(ptr), Src::Mr),
            off: 0,
            len,
        };
        let take = |from: usize, action: Action, after: bool| In {
            peer: from,
            len,
            action,
            forward: vec![],
            src: None,
            after: after.then_some((from, all)),
        };
        let pow = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let extra = n - pow;
        // Ranks below 2·extra pair up: the even one hands its buffer to the odd one, which
        // stands for both in the doubling, and gets the result back at the end.
        let me = if r < 2 * extra {
            if r % 2 == 0 {
                // SAFETY (both phases): the caller's contract.
                unsafe {
                    self.run(
                        d,
                        Phase {
                            outs: vec![send(r + 1)],
                            slice,
                            ..Phase::default()
                        },
                    )?;
                    return self.run(
                        d,
                        Phase {
                            ins: vec![take(r + 1, Action::Copy(ptr), false)],
                            slice,
                            ..Phase::default()
                        },
                    );
                }
            }
            // SAFETY: the caller's contract.
            unsafe {
                self.run(
                    d,
                    Phase {
                        ins: vec![take(r - 1, Action::Reduce(ptr, dtype, op), false)],
                        slice,
                        ..Phase::default()
                    },
                )?;
            }
            r / 2
        } else {
            r - extra
        };
        let real = |v: usize| if v < extra { 2 * v + 1 } else { v + extra };
        let mut mask = 1;
        while mask < pow {
            let partner = real(me ^ mask);
            // SAFETY: the caller's contract; the reduction waits for the send of the same
            // bytes (`after`).
            unsafe {
                self.run(
                    d,
                    Phase {
                        outs: vec![send(partner)],
                        ins: vec![take(partner, Action::Reduce(ptr, dtype, op), true)],
                        slice,
                    },
                )?;
            }
            mask <<= 1;
        }
        if r < 2 * extra {
            // SAFETY: the caller's contract.
            unsafe {
                self.run(
                    d,
                    Phase {
                        outs: vec![send(r - 1)],
                        slice,
                        ..Phase::default()
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Waits until every rank called `barrier`.
    pub fn barrier(&mut self) -> Result<(), CollError> {
        let mut b = [0u8];
        self.allreduce(&mut b, DataType::U8, ReduceOp::Max)
    }

    /// Gathers every rank's `input` into `output` (`n` blocks of `input.len()` bytes, block `i`
    /// from rank `i`).
    pub fn allgather(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CollError> {
        let (n, r, block) = (self.size, self.rank, input.len());
        same_len("allgather output", output.len(), block * n)?;
        output[r * block..(r + 1) * block].copy_from_slice(input);
        self.allgather_in_place(output)
    }

    /// As [`allgather`](Self::allgather) with this rank's block already in place in `buf`
    /// (block `rank` of `n` equal blocks).
    pub fn allgather_in_place(&mut self, buf: &mut [u8]) -> Result<(), CollError> {
        self.usable()?;
        let (n, r) = (self.size, self.rank);
        if buf.len() % n != 0 {
            return Err(CollError::Size {
                what: "allgather buffer (not n equal blocks)",
                got: buf.len(),
                want: buf.len() / n * n,
            });
        }
        let block = buf.len() / n;
        let d = digest(kind::ALLGATHER, &[block as u64]);
        if n == 1 || block == 0 {
            return Ok(());
        }
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        let slice = self.slice_for(1);
        let (left, right) = (self.left(), self.right());
        self.guarded(|c| {
            // SAFETY: `buf` is borrowed mutably for the call and reached only through `ptr`;
            // sends read blocks no action writes (each block arrives once, before it is sent).
            unsafe {
                let mr = c.register(ptr, len)?.expect("a non-empty buffer");
                let mut phase = Phase {
                    outs: vec![Out {
                        peer: right,
                        mr: (&mr).into(),
                        off: r * block,
                        len: block,
                    }],
                    ins: Vec::with_capacity(n),
                    slice,
                };
                for j in 0..n - 1 {
                    let b = (r + 2 * n - j - 1) % n;
                    phase.ins.push(In {
                        peer: left,
                        len: block,
                        action: Action::Copy(ptr.add(b * block)),
                        forward: if j < n - 2 { vec![right] } else { vec![] },
                        src: Some(((&mr).into(), b * block)),
                        after: None,
                    });
                }
                c.run(d, phase)
            }
        })
    }

    /// Reduces `input` (`n` blocks of `output.len()` bytes) over every rank with `op` and
    /// leaves block `rank` of the result in `output`.
    pub fn reduce_scatter(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        let (n, r, block) = (self.size, self.rank, output.len());
        same_len("reduce_scatter input", input.len(), block * n)?;
        let mut work = input.to_vec();
        self.reduce_scatter_in_place(&mut work, dtype, op)?;
        output.copy_from_slice(&work[r * block..(r + 1) * block]);
        Ok(())
    }

    /// As [`reduce_scatter`](Self::reduce_scatter) in place: `buf` holds `n` blocks, and block
    /// `rank` gets the result (the others are left as scratch).
    pub fn reduce_scatter_in_place(
        &mut self,
        buf: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        self.usable()?;
        let (n, r) = (self.size, self.rank);
        if buf.len() % n != 0 {
            return Err(CollError::Size {
                what: "reduce_scatter buffer (not n equal blocks)",
                got: buf.len(),
                want: buf.len() / n * n,
            });
        }
        let block = buf.len() / n;
        whole_elements(block, dtype)?;
        let d = digest(
            kind::REDUCE_SCATTER,
            &[block as u64, dtype as u64, op as u64],
        );
        if n > 1 && block > 0 {
            let (ptr, len) = (buf.as_mut_ptr(), buf.len());
            // SAFETY: `buf` is borrowed mutably for the call and reached only through `ptr`.
            self.guarded(|c| unsafe { c.ring_reduce_scatter(d, ptr, len, dtype, op, r) })?;
        }
        if op == ReduceOp::Avg {
            finish_avg(&mut buf[r * block..(r + 1) * block], dtype, n)?;
        }
        Ok(())
    }

    /// The reduce-scatter half of the ring over `n` chunks of `ptr..ptr + len`, leaving chunk
    /// `last` complete here.
    ///
    /// # Safety
    /// As for [`ring_allreduce`](Self::ring_allreduce).
    unsafe fn ring_reduce_scatter(
        &mut self,
        d: u16,
        ptr: *mut u8,
        len: usize,
        dtype: DataType,
        op: ReduceOp,
        last: usize,
    ) -> Result<(), CollError> {
        let (n, es) = (self.size, dtype.size());
        let elems = len / es;
        let slice = self.slice_for(es);
        let ch = |i: usize| chunk(i, n, elems, es);
        // SAFETY: the caller's contract; a chunk is sent only after its last reduction here.
        let mr = unsafe { self.register(ptr, len) }?.expect("a non-empty buffer");
        let (left, right) = (self.left(), self.right());
        let first = last + n - 1;
        let mut phase = Phase {
            outs: vec![Out {
                peer: right,
                mr: (&mr).into(),
                off: ch(first).start,
                len: ch(first).len(),
            }],
            ins: Vec::with_capacity(n),
            slice,
        };
        for k in 0..n - 1 {
            let c = ch(first + 2 * n - k - 1);
            phase.ins.push(In {
                peer: left,
                len: c.len(),
                // SAFETY: inside the caller's buffer.
                action: Action::Reduce(unsafe { ptr.add(c.start) }, dtype, op),
                forward: if k < n - 2 { vec![right] } else { vec![] },
                src: Some(((&mr).into(), c.start)),
                after: None,
            });
        }
        // SAFETY: the caller's contract.
        unsafe { self.run(d, phase) }
    }

    /// Copies `buf` of rank `root` into every rank's `buf`.
    pub fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), CollError> {
        self.usable()?;
        self.check_rank(root)?;
        let (n, r) = (self.size, self.rank);
        let d = digest(kind::BROADCAST, &[buf.len() as u64, root as u64]);
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        let v = (r + n - root) % n;
        let real = |v: usize| (v + root) % n;
        // Parent and children by relative rank: a binomial tree for small buffers, a chain
        // (pipelined slice by slice) for large ones.
        let (parent, children): (Option<usize>, Vec<usize>) = if buf.len() <= self.opts.small_bytes
        {
            let mut mask = 1;
            let mut parent = None;
            while mask < n {
                if v & mask != 0 {
                    parent = Some(real(v - mask));
                    break;
                }
                mask <<= 1;
            }
            let mut children = Vec::new();
            mask >>= 1;
            while mask > 0 {
                if v + mask < n {
                    children.push(real(v + mask));
                }
                mask >>= 1;
            }
            (parent, children)
        } else {
            (
                (v > 0).then(|| real(v - 1)),
                if v + 1 < n { vec![real(v + 1)] } else { vec![] },
            )
        };
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        let slice = self.slice_for(1);
        self.guarded(|c| {
            // SAFETY: `buf` is borrowed mutably for the call and reached only through `ptr`;
            // each slice is sent on only after it arrived.
            unsafe {
                // A buffer that fits a message is copied as it is sent: nothing to register.
                let mr = if len <= c.stage_bytes() {
                    None
                } else {
                    c.register(ptr, len)?
                };
                let src = mr.as_ref().map_or(Src::Ptr(ptr), Src::Mr);
                let phase = match parent {
                    None => Phase {
                        outs: children
                            .iter()
                            .map(|&peer| Out {
                                peer,
                                mr: src,
                                off: 0,
                                len,
                            })
                            .collect(),
                        ins: vec![],
                        slice,
                    },
                    Some(p) => Phase {
                        outs: vec![],
                        ins: vec![In {
                            peer: p,
                            len,
                            action: Action::Copy(ptr),
                            forward: children,
                            src: Some((src, 0)),
                            after: None,
                        }],
                        slice,
                    },
                };
                c.run(d, phase)
            }
        })
    }

    /// As [`broadcast`](Self::broadcast), out of place: `output` gets `input` of rank `root`
    /// (`input` is read on the root only).
    pub fn broadcast_into(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        root: usize,
    ) -> Result<(), CollError> {
        if self.rank == root {
            same_len("broadcast output", output.len(), input.len())?;
            output.copy_from_slice(input);
        }
        self.broadcast(output, root)
    }

    /// Reduces every rank's `input` with `op` into `output` on rank `root` (`output` is left
    /// alone elsewhere, but must have `input`'s length).
    pub fn reduce(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CollError> {
        self.usable()?;
        self.check_rank(root)?;
        same_len("reduce output", output.len(), input.len())?;
        whole_elements(input.len(), dtype)?;
        let (n, r, es) = (self.size, self.rank, dtype.size());
        let d = digest(
            kind::REDUCE,
            &[input.len() as u64, dtype as u64, op as u64, root as u64],
        );
        if n == 1 || input.is_empty() {
            output.copy_from_slice(input);
        } else {
            let mut work = input.to_vec();
            let (ptr, len) = (work.as_mut_ptr(), work.len());
            let out = output.as_mut_ptr();
            let elems = len / es;
            let slice = self.slice_for(es);
            self.guarded(|c| {
                // SAFETY: `work` is this call's own, `output` is borrowed mutably for the call;
                // both are reached only through their pointers meanwhile.
                unsafe {
                    c.ring_reduce_scatter(d, ptr, len, dtype, op, r)?;
                    let mine = chunk(r, n, elems, es);
                    if r == root {
                        let mut phase = Phase {
                            slice,
                            ..Phase::default()
                        };
                        for i in (0..n).filter(|&i| i != root) {
                            let ch = chunk(i, n, elems, es);
                            phase.ins.push(In {
                                peer: i,
                                len: ch.len(),
                                action: Action::Copy(out.add(ch.start)),
                                forward: vec![],
                                src: None,
                                after: None,
                            });
                        }
                        c.run(d, phase)?;
                        std::ptr::copy_nonoverlapping(
                            ptr.add(mine.start),
                            out.add(mine.start),
                            mine.len(),
                        );
                        Ok(())
                    } else {
                        let mr = c.register(ptr, len)?.expect("a non-empty buffer");
                        c.run(
                            d,
                            Phase {
                                outs: vec![Out {
                                    peer: root,
                                    mr: (&mr).into(),
                                    off: mine.start,
                                    len: mine.len(),
                                }],
                                ins: vec![],
                                slice,
                            },
                        )
                    }
                }
            })?;
        }
        if op == ReduceOp::Avg && r == root {
            finish_avg(output, dtype, n)?;
        }
        Ok(())
    }

    /// As [`reduce`](Self::reduce) in place: `buf` is this rank's input, and on rank `root`
    /// it gets the result (elsewhere it is left alone).
    pub fn reduce_in_place(
        &mut self,
        buf: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CollError> {
        // `reduce` works on a copy of its input anyway.
        let input = buf.to_vec();
        self.reduce(&input, buf, dtype, op, root)
    }

    /// As [`alltoall`](Self::alltoall) in place: `buf`'s blocks are sent and replaced by the
    /// blocks received.
    pub fn alltoall_in_place(&mut self, buf: &mut [u8]) -> Result<(), CollError> {
        let input = buf.to_vec();
        self.alltoall(&input, buf)
    }

    /// Sends block `j` of `input` (`n` equal blocks) to rank `j`; block `i` of `output` gets
    /// block `rank` of rank `i`'s input.
    pub fn alltoall(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CollError> {
        self.usable()?;
        let (n, r) = (self.size, self.rank);
        same_len("alltoall output", output.len(), input.len())?;
        if input.len() % n != 0 {
            return Err(CollError::Size {
                what: "alltoall input (not n equal blocks)",
                got: input.len(),
                want: input.len() / n * n,
            });
        }
        let block = input.len() / n;
        let d = digest(kind::ALLTOALL, &[block as u64]);
        output[r * block..(r + 1) * block].copy_from_slice(&input[r * block..(r + 1) * block]);
        if n == 1 || block == 0 {
            return Ok(());
        }
        let (src, len) = (input.as_ptr(), input.len());
        let out = output.as_mut_ptr();
        let slice = self.slice_for(1);
        self.guarded(|c| {
            // SAFETY: `input` is only read, `output` is borrowed mutably for the call and
            // written only through `out`, at blocks of other ranks.
            unsafe {
                let mr = c.register(src, len)?.expect("a non-empty buffer");
                let mut phase = Phase {
                    slice,
                    ..Phase::default()
                };
                for k in 1..n {
                    let to = (r + k) % n;
                    let from = (r + n - k) % n;
                    phase.outs.push(Out {
                        peer: to,
                        mr: (&mr).into(),
                        off: to * block,
                        len: block,
                    });
                    phase.ins.push(In {
                        peer: from,
                        len: block,
                        action: Action::Copy(out.add(from * block)),
                        forward: vec![],
                        src: None,
                        after: None,
                    });
                }
                c.run(d, phase)
            }
        })
    }

    /// Sends `buf` to rank `peer`, which calls [`recv`](Self::recv) with a buffer of the same
    /// length (or [`sendrecv`](Self::sendrecv)). Returns when the bytes have left.
    pub fn send(&mut self, buf: &[u8], peer: usize) -> Result<(), CollError> {
        self.sendrecv(buf, peer, &mut [], usize::MAX)
    }

    /// Receives into `buf` what rank `peer` sends with [`send`](Self::send).
    pub fn recv(&mut self, buf: &mut [u8], peer: usize) -> Result<(), CollError> {
        self.sendrecv(&[], usize::MAX, buf, peer)
    }

    /// Receives into `buf` a [`send`](Self::send) of its length from whichever rank's comes
    /// first (the lowest rank if several are there when it looks), and returns that rank, as
    /// MPI's `MPI_ANY_SOURCE` and torch's `recv` without a source do. A rank whose next message
    /// is anything else (another call, another length) is not taken. An empty `buf` is
    /// refused: an empty send carries no message to find its sender by.
    pub fn recv_any(&mut self, buf: &mut [u8]) -> Result<usize, CollError> {
        self.recv_any_tagged(buf, 0)
    }

    /// As [`recv_any`](Self::recv_any), taking only a send started with `tag`
    /// ([`start_send`](Self::start_send)); tag 0 is that of [`send`](Self::send).
    pub fn recv_any_tagged(&mut self, buf: &mut [u8], tag: u32) -> Result<usize, CollError> {
        self.usable()?;
        if buf.is_empty() {
            return Err(CollError::Size {
                what: "a receive from any rank",
                got: 0,
                want: 1,
            });
        }
        let (me, len) = (self.rank, buf.len());
        let from = self.guarded(|c| c.wait_for_sender(|p| p2p_digest(len, p, me, tag)))?;
        if tag == 0 {
            self.recv(buf, from)?;
        } else {
            self.recv_tagged(buf, from, tag)?;
        }
        Ok(from)
    }

    /// Sends `out` to rank `to` and receives `into` from rank `from` at once (either side may
    /// be skipped with `usize::MAX` as its rank): a pair of ranks exchanging buffers this way
    /// cannot deadlock, whatever their sizes.
    pub fn sendrecv(
        &mut self,
        out: &[u8],
        to: usize,
        into: &mut [u8],
        from: usize,
    ) -> Result<(), CollError> {
        self.usable()?;
        let r = self.rank;
        for p in [to, from].into_iter().filter(|&p| p != usize::MAX) {
            self.check_rank(p)?;
            if p == r {
                return Err(CollError::BadRank {
                    rank: p,
                    size: self.size,
                });
            }
        }
        // The digest of a message names the length and the direction, so the pair agrees.
        let send_d = p2p_digest(out.len(), r, to, 0);
        let recv_d = p2p_digest(into.len(), from, r, 0);
        let (sp, sl) = (out.as_ptr(), out.len());
        let (rp, rl) = (into.as_mut_ptr(), into.len());
        let slice = self.slice_for(1);
        self.guarded(|c| {
            // SAFETY: `out` is only read; `into` is borrowed mutably for the call and written
            // only through `rp`.
            unsafe {
                let mr = if to != usize::MAX {
                    c.register(sp, sl)?
                } else {
                    None
                };
                let mut send = Phase {
                    slice,
                    ..Phase::default()
                };
                if let Some(mr) = &mr {
                    send.outs.push(Out {
                        peer: to,
                        mr: mr.into(),
                        off: 0,
                        len: sl,
                    });
                }
                let mut recv = Phase {
                    slice,
                    ..Phase::default()
                };
                if from != usize::MAX && rl > 0 {
                    recv.ins.push(In {
                        peer: from,
                        len: rl,
                        action: Action::Copy(rp),
                        forward: vec![],
                        src: None,
                        after: None,
                    });
                }
                send.ins.append(&mut recv.ins);
                c.run_with(send_d, recv_d, send)
            }
        })
    }
}
