//! The responder: the receive side of an RC queue pair.
//!
//! Each request packet is checked in the order the IBTA gives: its PSN against the expected one
//! (a duplicate is answered again, a packet from the future draws exactly one PSN-sequence-error
//! NAK until the expected PSN arrives), its opcode against the message under way
//! (FIRST/MIDDLE/LAST), then resources (a receive request for a SEND or a WRITE with immediate,
//! else an RNR NAK), then the R_Key, bounds and access rights (else a remote-access-error NAK and
//! the QP goes to ERR), then lengths. Only then does it touch memory.
//!
//! Answers leave in PSN order from one queue: ACKs (coalesced: a new ACK replaces one still
//! queued), NAKs, READ responses cut into path-MTU packets, and atomic ACKs. READs and atomics
//! are remembered in a replay cache of responder resources, so a duplicate READ is executed again
//! and a duplicate atomic is answered with the saved original value, never executed twice. A
//! duplicate READ is answered for exactly the part of the original it asks for, from its PSN
//! and ending with a LAST where it ends: a requester may retry a long READ in pieces (see
//! [`crate::requester`]), and a piece that arrives at the expected PSN is simply a new READ.

use std::collections::VecDeque;

use ferroce_wire::aeth::{AethRepr, NakCode, Syndrome, CREDITS_INVALID};
use ferroce_wire::atomic_ack_eth::AtomicAckEthRepr;
use ferroce_wire::opcode::{Operation, Position};
use ferroce_wire::{ExtHeaders, Opcode, PacketRepr, Psn};

use crate::attr::{Service, MAX_MESSAGE_LEN, MAX_RD_ATOMIC};
use crate::completion::{WcOpcode, WcStatus, WorkCompletion};
use crate::counters::Counters;
use crate::emit;
use crate::memory::{Access, AtomicOp, KeyKind, MemoryError, Sge};
use crate::qp::{CompletionQueue, Ctx, Params, QpState};
use crate::time::Instant;
use crate::wr::RecvWr;

/// A message being received over several packets, with the path MTU of its first packet: the
/// rest is held to that MTU, as the peer cut it (`set_path_mtu` changes new messages only).
#[derive(Debug)]
enum Inbound {
    Send {
        recv: RecvWr,
        offset: u64,
        mtu: u64,
    },
    Write {
        va: u64,
        rkey: u32,
        dma_len: u64,
        offset: u64,
        mtu: u64,
    },
}

/// An answer waiting to be sent.
#[derive(Debug, Clone, Copy)]
enum Response {
    Ack {
        psn: Psn,
        syndrome: Syndrome,
        msn: u32,
    },
    Read {
        next_psn: Psn,
        first_psn: Psn,
        va: u64,
        rkey: u32,
        len: u64,
        offset: u64,
        msn: u32,
        /// An answer to a duplicate request (it holds no new responder resource).
        replay: bool,
        /// Path MTU it is cut at: the one the READ was accepted under, which counted its PSNs.
        mtu: u64,
    },
    Atomic {
        psn: Psn,
        original: u64,
        msn: u32,
        /// An answer to a duplicate request (it holds no new responder resource).
        replay: bool,
    },
}

/// A responder resource: a READ or atomic remembered for duplicates.
#[derive(Debug, Clone, Copy)]
enum Resource {
    Read {
        first_psn: Psn,
        npsn: u32,
        rkey: u32,
        va: u64,
        len: u64,
        mtu: u64,
    },
    Atomic {
        psn: Psn,
        original: u64,
    },
}

/// The receive side of a QP.
#[derive(Debug, Default)]
pub(crate) struct Responder {
    epsn: Psn,
    msn: u32,
    rq: VecDeque<RecvWr>,
    inbound: Option<Inbound>,
    /// A NAK (sequence error or RNR) was sent and the expected PSN has not arrived since.
    nak_sent: bool,
    out: VecDeque<Response>,
    resources: VecDeque<Resource>,
    /// The newest request accepted without an ACK being asked for or sent since, and when one
    /// is due for it (see [`UNASKED_ACK_DELAY`]).
    unasked: Option<(Psn, Instant)>,
    /// UC only: the message under way lost a packet or was refused, and packets are skipped
    /// until one starts a message (see [`crate::uc`]).
    uc_dropping: bool,
}

/// How long the responder holds the acknowledgement of a request that did not ask for one
/// (AckReq clear): a requester that leaves the bit clear counts on the responder acknowledging
/// within this time (see `QueuePair::set_peer_acks_unasked`), so an unsignaled last request is
/// never left to its retransmission timer. A later ACK, asked or not, covers it at once.
pub const UNASKED_ACK_DELAY: core::time::Duration = core::time::Duration::from_micros(200);

/// Calls `f(address, lkey, position in the chunk, length)` for each piece of the byte range
/// `[offset, offset + len)` as `sgl` lays it out; fails with `OutOfBounds` if the SGL is
/// shorter.
pub(crate) fn walk_sges(
    sgl: &[Sge],
    offset: u64,
    len: usize,
    mut f: impl FnMut(u64, u32, usize, usize) -> Result<(), MemoryError>,
) -> Result<(), MemoryError> {
    let mut skip = offset;
    let mut done = 0usize;
    for sge in sgl {
        if done == len {
            break;
        }
        let sl = u64::from(sge.length);
        if skip >= sl {
            skip -= sl;
            continue;
        }
        let n = ((sl - skip) as usize).min(len - done);
        f(sge.addr.wrapping_add(skip), sge.lkey, done, n)?;
        done += n;
        skip = 0;
    }
    if done < len {
        return Err(MemoryError::OutOfBounds {
            addr: offset,
            len: len as u64,
        });
    }
    Ok(())
}

/// Whether the QP and the region of `reth`'s key both allow `need` for `len` bytes at its address.
/// A zero-length access touches no memory and needs no valid key (IBTA C9-88).
fn remote_access_allowed(
    ctx: &mut Ctx<'_>,
    reth: ferroce_wire::reth::RethRepr,
    len: u64,
    need: Access,
) -> bool {
    len == 0
        || (ctx.p.access.contains(need)
            && ctx
                .mem
                .check(ctx.p.pd, KeyKind::Remote, reth.rkey, reth.va, len, need)
                .is_ok())
}

fn sgl_len(sgl: &[Sge]) -> u64 {
    sgl.iter().map(|s| u64::from(s.length)).sum()
}

fn recv_completion(p: &Params, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len: 0,
        imm_data: None,
        invalidated_rkey: None,
        qp_num: p.qpn,
        solicited: false,
        src_qp: None,
    }
}

/// What went wrong with a request, and what the QP does about it.
enum Verdict {
    /// Done; acknowledge if asked.
    Ok,
    /// No receive request: RNR NAK, PSN not consumed.
    Rnr,
    /// Fatal: NAK with the code, complete the receive request (if any) with the status, ERR.
    Fatal(NakCode, Option<(RecvWr, WcStatus, WcOpcode)>),
}

impl Responder {
    pub fn start(&mut self, rq_psn: Psn) {
        self.epsn = rq_psn;
        self.msn = 0;
        self.inbound = None;
        self.nak_sent = false;
        self.out.clear();
        self.resources.clear();
        self.unasked = None;
        self.uc_dropping = false;
    }

    /// When the acknowledgement of an unasked request is due, if one is held.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.unasked.map(|(_, due)| due)
    }

    /// Sends the held acknowledgement once it is due.
    pub fn handle_timeout(&mut self, counters: &mut Counters, now: Instant) {
        if let Some((psn, due)) = self.unasked {
            if due <= now {
                counters.acks_sent += 1;
                self.queue_ack(psn);
            }
        }
    }

    pub fn expected_psn(&self) -> Psn {
        self.epsn
    }

    /// The message sequence number: messages completed so far (mod 2^24).
    pub fn msn(&self) -> u32 {
        self.msn
    }

    pub fn rq_len(&self) -> usize {
        self.rq.len() + usize::from(matches!(self.inbound, Some(Inbound::Send { .. })))
    }

    pub fn push_recv(&mut self, wr: RecvWr) {
        self.rq.push_back(wr);
    }

    /// Flushes on entering ERR: receive requests complete with the flush status, in order; only
    /// NAKs stay queued, so the peer learns why.
    pub fn flush(&mut self, p: &Params, cq: &mut CompletionQueue) {
        self.unasked = None;
        if let Some(Inbound::Send { recv, .. }) = self.inbound.take() {
            cq.push_back(recv_completion(
                p,
                recv.wr_id,
                WcStatus::WorkRequestFlushed,
                WcOpcode::Recv,
            ));
        }
        for wr in self.rq.drain(..) {
            cq.push_back(recv_completion(
                p,
                wr.wr_id,
                WcStatus::WorkRequestFlushed,
                WcOpcode::Recv,
            ));
        }
        self.out.retain(|r| {
            matches!(
                r,
                Response::Ack {
                    syndrome: Syndrome::Nak(_),
                    ..
                }
            )
        });
    }

    fn queue_ack(&mut self, psn: Psn) {
        // This ACK covers every request accepted so far, the held unasked one included.
        self.unasked = None;
        let msn = self.msn;
        let ack = Syndrome::Ack {
            credits: CREDITS_INVALID,
        };
        if let Some(Response::Ack {
            psn: p,
            syndrome,
            msn: m,
        }) = self.out.back_mut()
        {
            if syndrome.is_ack() {
                *p = psn;
                *m = msn;
                return;
            }
        }
        self.out.push_back(Response::Ack {
            psn,
            syndrome: ack,
            msn,
        });
    }

    /// Reports the gap at the expected PSN with a sequence-error NAK, unless one was sent since
    /// it last moved: selective repeat, after filling one hole, names the next at once.
    pub fn nak_gap(&mut self, counters: &mut Counters) {
        if !self.nak_sent {
            self.nak_sent = true;
            counters.send_seq_nak += 1;
            self.queue_nak(self.epsn, Syndrome::Nak(NakCode::PsnSequenceError));
        }
    }

    fn queue_nak(&mut self, psn: Psn, syndrome: Syndrome) {
        self.out.push_back(Response::Ack {
            psn,
            syndrome,
            msn: self.msn,
        });
    }

    fn remember(&mut self, r: Resource) {
        if self.resources.len() >= usize::from(MAX_RD_ATOMIC) {
            self.resources.pop_front();
        }
        self.resources.push_back(r);
    }

    /// READ/atomic requests accepted whose answers are not sent yet: what `max_dest_rd_atomic`
    /// bounds. Answers to duplicates do not count — they hold no new resource, and at most one
    /// per remembered resource is queued — or a retry racing with its network copy would make
    /// a legitimate request look like one too many.
    fn pending_rd_atomic(&self) -> usize {
        self.out
            .iter()
            .filter(|r| {
                matches!(
                    r,
                    Response::Read { replay: false, .. } | Response::Atomic { replay: false, .. }
                )
            })
            .count()
    }

    /// Handles one request packet.
    pub fn handle_request(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        repr: &PacketRepr,
        payload: &[u8],
        cq: &mut CompletionQueue,
    ) {
        let psn = repr.bth.psn;
        let d = psn.signed_distance_from(self.epsn);
        if d > 0 {
            ctx.counters.out_of_seq_request += 1;
            if !self.nak_sent {
                self.nak_sent = true;
                ctx.counters.send_seq_nak += 1;
                self.queue_nak(self.epsn, Syndrome::Nak(NakCode::PsnSequenceError));
            }
            return;
        }
        if d < 0 {
            ctx.counters.duplicate_request += 1;
            self.duplicate(ctx, repr);
            return;
        }
        self.nak_sent = false;
        let Some(info) = repr.bth.opcode.info() else {
            return;
        };
        let verdict = self.execute(ctx, now, repr, info.operation, info.position, payload, cq);
        match verdict {
            Verdict::Ok => {}
            Verdict::Rnr => {
                ctx.counters.send_rnr_err += 1;
                self.nak_sent = true;
                self.queue_nak(
                    psn,
                    Syndrome::RnrNak {
                        timer: ctx.p.min_rnr_timer,
                    },
                );
            }
            Verdict::Fatal(code, recv) => {
                match code {
                    NakCode::RemoteAccessError => ctx.counters.rkey_violations += 1,
                    NakCode::InvalidRequest => ctx.counters.send_invalid_request += 1,
                    NakCode::RemoteOperationalError => ctx.counters.send_remote_op_err += 1,
                    // The verdicts above are the only fatal ones the responder gives.
                    _ => {}
                }
                if let Some((wr, status, opcode)) = recv {
                    cq.push_back(recv_completion(ctx.p, wr.wr_id, status, opcode));
                }
                self.queue_nak(psn, Syndrome::Nak(code));
                ctx.fatal = true;
            }
        }
    }

    /// Handles one request packet of a UC QP (see [`crate::uc`]): placed as RC places it when
    /// it continues the message under way at the expected PSN; after a gap, or behind a
    /// message that was refused, skipped until a packet starts a message, which takes the PSN
    /// sequence up from its own PSN. Nothing is answered.
    pub fn handle_uc_request(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        repr: &PacketRepr,
        payload: &[u8],
        cq: &mut CompletionQueue,
    ) {
        let psn = repr.bth.psn;
        let Some(info) = repr.bth.opcode.info() else {
            return;
        };
        if self.uc_dropping || psn != self.epsn {
            if psn != self.epsn {
                ctx.counters.out_of_seq_request += 1;
            }
            // The message under way is lost either way; a receive request it had begun to
            // fill serves the next message.
            self.abandon_uc_message();
            if !info.position.starts_message() {
                ctx.counters.uc_dropped_packets += 1;
                self.uc_dropping = true;
                return;
            }
            self.epsn = psn;
            self.uc_dropping = false;
        }
        let verdict = self.execute(ctx, now, repr, info.operation, info.position, payload, cq);
        match verdict {
            Verdict::Ok => {}
            Verdict::Rnr => {
                ctx.counters.send_rnr_err += 1;
                self.abandon_uc_message();
                self.uc_dropping = true;
            }
            Verdict::Fatal(code, recv) => {
                match code {
                    NakCode::RemoteAccessError => ctx.counters.rkey_violations += 1,
                    _ => ctx.counters.send_invalid_request += 1,
                }
                match recv {
                    Some((wr, WcStatus::LocalProtectionError, opcode)) => {
                        // This side's own buffers refused the data: a local error, which
                        // ends the QP as it does on RC.
                        cq.push_back(recv_completion(
                            ctx.p,
                            wr.wr_id,
                            WcStatus::LocalProtectionError,
                            opcode,
                        ));
                        ctx.fatal = true;
                    }
                    Some((wr, ..)) => self.rq.push_front(wr),
                    None => {}
                }
                self.abandon_uc_message();
                self.uc_dropping = true;
            }
        }
    }

    /// Drops the UC message under way; the receive request it had begun to fill goes back to
    /// the head of the queue.
    fn abandon_uc_message(&mut self) {
        if let Some(Inbound::Send { recv, .. }) = self.inbound.take() {
            self.rq.push_front(recv);
        }
    }

    fn duplicate(&mut self, ctx: &mut Ctx<'_>, repr: &PacketRepr) {
        let psn = repr.bth.psn;
        let op = repr.bth.opcode;
        if op == Opcode::RC_RDMA_READ_REQUEST {
            let Some(reth) = repr.ext.reth else { return };
            // Served again only as a requester's retry asks for it: from a PSN inside the
            // original, for a part of its range, answered within its PSNs (rxe drops anything
            // else too). A larger duplicate would answer with PSNs that belong to later
            // requests and read bytes no accepted request asked for.
            let dup_len = u64::from(reth.dma_len);
            let found = self.resources.iter().find_map(|r| match *r {
                Resource::Read {
                    first_psn,
                    npsn,
                    rkey,
                    va,
                    len,
                    mtu,
                } => {
                    let k = psn.distance_from(first_psn);
                    let dup_npsn = dup_len.div_ceil(mtu).max(1);
                    let inside = k < npsn
                        && rkey == reth.rkey
                        && reth.va >= va
                        && reth.va.checked_add(dup_len).is_some_and(|end| {
                            va.checked_add(len).is_some_and(|orig_end| end <= orig_end)
                        })
                        && u64::from(k) + dup_npsn <= u64::from(npsn);
                    inside.then_some(mtu)
                }
                Resource::Atomic { .. } => None,
            });
            if let Some(mtu) = found {
                // Executed again from the PSN asked for; the RETH says where that part starts.
                let again = Response::Read {
                    next_psn: psn,
                    first_psn: psn,
                    va: reth.va,
                    rkey: reth.rkey,
                    len: dup_len,
                    offset: 0,
                    msn: self.msn,
                    replay: true,
                    mtu,
                };
                // If the earlier answer to this READ is still being sent, restart it from here
                // instead of queueing a second one behind it: the requester has everything
                // before `psn` and would throw the rest of the old answer away, and waiting for
                // it to drain first can outlast the requester's ACK timer — which retries, and
                // queues yet another copy. (rxe likewise reuses the READ's resource.)
                let under_way = self.out.iter_mut().find(|r| match **r {
                    Response::Read {
                        first_psn,
                        len,
                        mtu,
                        ..
                    } => {
                        let npsn = len.div_ceil(mtu).max(1);
                        u64::from(psn.distance_from(first_psn)) < npsn
                    }
                    _ => false,
                });
                match under_way {
                    // Keeps the slot's kind: a restarted fresh answer still holds its resource.
                    Some(r) => {
                        let fresh = matches!(*r, Response::Read { replay: false, .. });
                        *r = again;
                        if let Response::Read { replay, .. } = r {
                            *replay = !fresh;
                        }
                    }
                    None => self.out.push_back(again),
                }
            }
            return;
        }
        if op == Opcode::RC_COMPARE_SWAP || op == Opcode::RC_FETCH_ADD {
            let found = self.resources.iter().rev().find_map(|r| match *r {
                Resource::Atomic { psn: p, original } if p == psn => Some(original),
                _ => None,
            });
            // One answer queued per request: a duplicate of a duplicate (the network copied
            // the retry) adds nothing.
            let queued = self
                .out
                .iter()
                .any(|r| matches!(*r, Response::Atomic { psn: p, .. } if p == psn));
            if let (Some(original), false) = (found, queued) {
                self.out.push_back(Response::Atomic {
                    psn,
                    original,
                    msn: self.msn,
                    replay: true,
                });
            }
            return;
        }
        // SEND or WRITE seen before: acknowledge everything received so far again.
        self.queue_ack(self.epsn.sub(1));
        let _ = ctx;
    }

    #[allow(clippy::too_many_arguments)]
    fn execute(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Instant,
        repr: &PacketRepr,
        operation: Operation,
        position: Position,
        payload: &[u8],
        cq: &mut CompletionQueue,
    ) -> Verdict {
        let p = ctx.p;
        let psn = repr.bth.psn;
        let plen = payload.len() as u64;
        let invalid = Verdict::Fatal(NakCode::InvalidRequest, None);
        // Opcode sequence: a message under way takes only its MIDDLE and LAST packets.
        let continues = matches!(position, Position::Middle | Position::Last);
        let mtu = match &self.inbound {
            Some(Inbound::Send { mtu, .. } | Inbound::Write { mtu, .. }) if continues => *mtu,
            _ => u64::from(p.mtu),
        };
        match (&self.inbound, operation, continues) {
            (Some(Inbound::Send { .. }), Operation::Send, true) => {}
            (Some(Inbound::Write { .. }), Operation::RdmaWrite, true) => {}
            (None, _, false) => {}
            _ => {
                // Out of sequence: the receive request under way, if any, fails with the QP.
                let recv = match self.inbound.take() {
                    Some(Inbound::Send { recv, .. }) => {
                        Some((recv, WcStatus::RemoteInvalidRequestError, WcOpcode::Recv))
                    }
                    _ => None,
                };
                return Verdict::Fatal(NakCode::InvalidRequest, recv);
            }
        }
        // Packet lengths: FIRST and MIDDLE carry exactly one MTU, LAST one byte to one MTU.
        let len_ok = match (operation, position) {
            (Operation::Send | Operation::RdmaWrite, Position::First | Position::Middle) => {
                plen == mtu
            }
            (Operation::Send | Operation::RdmaWrite, Position::Last) => plen >= 1 && plen <= mtu,
            (Operation::Send | Operation::RdmaWrite, Position::Only) => plen <= mtu,
            _ => true,
        };
        if !len_ok {
            let recv = match self.inbound.take() {
                Some(Inbound::Send { recv, .. }) => {
                    Some((recv, WcStatus::LocalLengthError, WcOpcode::Recv))
                }
                _ => None,
            };
            return Verdict::Fatal(NakCode::InvalidRequest, recv);
        }
        let verdict = match operation {
            Operation::Send => self.send(ctx, repr, position, payload, cq),
            Operation::RdmaWrite => self.write(ctx, repr, position, payload, cq),
            Operation::RdmaReadRequest => return self.read(ctx, repr),
            Operation::CompareSwap | Operation::FetchAdd => return self.atomic(ctx, repr),
            _ => invalid,
        };
        if matches!(verdict, Verdict::Ok) {
            self.epsn = psn.next();
            if position.ends_message() {
                self.msn = (self.msn + 1) & 0x00ff_ffff;
            }
            if p.service == Service::Uc {
                // UC acknowledges nothing.
            } else if repr.bth.ack_req {
                ctx.counters.acks_sent += 1;
                self.queue_ack(psn);
            } else {
                let due = self.unasked.map_or(now + UNASKED_ACK_DELAY, |(_, due)| due);
                self.unasked = Some((psn, due));
            }
        }
        verdict
    }

    fn send(
        &mut self,
        ctx: &mut Ctx<'_>,
        repr: &PacketRepr,
        position: Position,
        payload: &[u8],
        cq: &mut CompletionQueue,
    ) -> Verdict {
        let p = ctx.p;
        if position.starts_message() {
            let Some(recv) = self.rq.pop_front() else {
                return Verdict::Rnr;
            };
            self.inbound = Some(Inbound::Send {
                recv,
                offset: 0,
                mtu: u64::from(p.mtu),
            });
        }
        let Some(Inbound::Send { recv, offset, .. }) = self.inbound.as_mut() else {
            return Verdict::Fatal(NakCode::InvalidRequest, None);
        };
        let end = *offset + payload.len() as u64;
        if end > sgl_len(&recv.sgl) {
            let Some(Inbound::Send { recv, .. }) = self.inbound.take() else {
                return Verdict::Fatal(NakCode::RemoteOperationalError, None);
            };
            return Verdict::Fatal(
                NakCode::InvalidRequest,
                Some((recv, WcStatus::LocalLengthError, WcOpcode::Recv)),
            );
        }
        let mem = &mut *ctx.mem;
        let wrote = walk_sges(&recv.sgl, *offset, payload.len(), |addr, lkey, at, n| {
            mem.write(
                p.pd,
                KeyKind::Local,
                lkey,
                addr,
                &payload[at..at + n],
                Access::LOCAL_WRITE,
            )
        });
        if wrote.is_err() {
            let Some(Inbound::Send { recv, .. }) = self.inbound.take() else {
                return Verdict::Fatal(NakCode::RemoteOperationalError, None);
            };
            return Verdict::Fatal(
                NakCode::RemoteOperationalError,
                Some((recv, WcStatus::LocalProtectionError, WcOpcode::Recv)),
            );
        }
        *offset = end;
        if position.ends_message() {
            let Some(Inbound::Send { recv, offset, .. }) = self.inbound.take() else {
                return Verdict::Fatal(NakCode::RemoteOperationalError, None);
            };
            let mut wc = recv_completion(p, recv.wr_id, WcStatus::Success, WcOpcode::Recv);
            wc.byte_len = offset as u32;
            wc.solicited = repr.bth.solicited;
            wc.imm_data = repr.ext.immdt.map(|i| i.value);
            if let Some(ieth) = repr.ext.ieth {
                if ctx.mem.invalidate(p.pd, ieth.rkey).is_err() {
                    return Verdict::Fatal(
                        NakCode::InvalidRequest,
                        Some((recv, WcStatus::RemoteInvalidRequestError, WcOpcode::Recv)),
                    );
                }
                wc.invalidated_rkey = Some(ieth.rkey);
            }
            ctx.counters.rdma_recvs += 1;
            cq.push_back(wc);
        }
        Verdict::Ok
    }

    fn write(
        &mut self,
        ctx: &mut Ctx<'_>,
        repr: &PacketRepr,
        position: Position,
        payload: &[u8],
        cq: &mut CompletionQueue,
    ) -> Verdict {
        let p = ctx.p;
        let mtu = u64::from(p.mtu);
        let with_imm = repr.ext.immdt.is_some();
        // A WRITE with immediate needs a receive request before anything is written.
        if with_imm && self.rq.is_empty() {
            return Verdict::Rnr;
        }
        if position.starts_message() {
            let Some(reth) = repr.ext.reth else {
                return Verdict::Fatal(NakCode::InvalidRequest, None);
            };
            let dma_len = u64::from(reth.dma_len);
            let shape_ok = match position {
                Position::Only => payload.len() as u64 == dma_len,
                _ => dma_len > mtu,
            };
            if dma_len > MAX_MESSAGE_LEN || !shape_ok {
                return Verdict::Fatal(NakCode::InvalidRequest, None);
            }
            if !remote_access_allowed(ctx, reth, dma_len, Access::REMOTE_WRITE) {
                return Verdict::Fatal(NakCode::RemoteAccessError, None);
            }
            self.inbound = Some(Inbound::Write {
                va: reth.va,
                rkey: reth.rkey,
                dma_len,
                offset: 0,
                mtu,
            });
        }
        let Some(Inbound::Write {
            va,
            rkey,
            dma_len,
            offset,
            ..
        }) = self.inbound.as_mut()
        else {
            return Verdict::Fatal(NakCode::InvalidRequest, None);
        };
        let end = *offset + payload.len() as u64;
        let fits = if position.ends_message() {
            end == *dma_len
        } else {
            end < *dma_len
        };
        if !fits {
            self.inbound = None;
            return Verdict::Fatal(NakCode::InvalidRequest, None);
        }
        if !payload.is_empty() {
            let at = va.wrapping_add(*offset);
            if ctx
                .mem
                .write(
                    p.pd,
                    KeyKind::Remote,
                    *rkey,
                    at,
                    payload,
                    Access::REMOTE_WRITE,
                )
                .is_err()
            {
                // The region went away mid-message (deregistered): the same verdict as a bad key.
                self.inbound = None;
                return Verdict::Fatal(NakCode::RemoteAccessError, None);
            }
        }
        *offset = end;
        if position.ends_message() {
            let total = *dma_len;
            self.inbound = None;
            if let Some(imm) = repr.ext.immdt {
                let Some(recv) = self.rq.pop_front() else {
                    return Verdict::Rnr;
                };
                let mut wc =
                    recv_completion(p, recv.wr_id, WcStatus::Success, WcOpcode::RecvRdmaWithImm);
                wc.byte_len = total as u32;
                wc.imm_data = Some(imm.value);
                wc.solicited = repr.bth.solicited;
                ctx.counters.rdma_recvs += 1;
                cq.push_back(wc);
            }
        }
        Verdict::Ok
    }

    fn read(&mut self, ctx: &mut Ctx<'_>, repr: &PacketRepr) -> Verdict {
        let p = ctx.p;
        let Some(reth) = repr.ext.reth else {
            return Verdict::Fatal(NakCode::InvalidRequest, None);
        };
        let len = u64::from(reth.dma_len);
        if len > MAX_MESSAGE_LEN || self.pending_rd_atomic() >= usize::from(p.max_dest_rd_atomic) {
            return Verdict::Fatal(NakCode::InvalidRequest, None);
        }
        if !remote_access_allowed(ctx, reth, len, Access::REMOTE_READ) {
            return Verdict::Fatal(NakCode::RemoteAccessError, None);
        }
        let psn = repr.bth.psn;
        let npsn = (len.div_ceil(u64::from(p.mtu))).max(1) as u32;
        self.msn = (self.msn + 1) & 0x00ff_ffff;
        self.remember(Resource::Read {
            first_psn: psn,
            npsn,
            rkey: reth.rkey,
            va: reth.va,
            len,
            mtu: u64::from(p.mtu),
        });
        self.out.push_back(Response::Read {
            next_psn: psn,
            first_psn: psn,
            va: reth.va,
            rkey: reth.rkey,
            len,
            offset: 0,
            msn: self.msn,
            replay: false,
            mtu: u64::from(p.mtu),
        });
        self.epsn = psn.add(npsn);
        Verdict::Ok
    }

    fn atomic(&mut self, ctx: &mut Ctx<'_>, repr: &PacketRepr) -> Verdict {
        let p = ctx.p;
        let Some(a) = repr.ext.atomic_eth else {
            return Verdict::Fatal(NakCode::InvalidRequest, None);
        };
        if a.va % 8 != 0 || self.pending_rd_atomic() >= usize::from(p.max_dest_rd_atomic) {
            return Verdict::Fatal(NakCode::InvalidRequest, None);
        }
        if !p.access.contains(Access::REMOTE_ATOMIC) {
            return Verdict::Fatal(NakCode::RemoteAccessError, None);
        }
        let op = if repr.bth.opcode == Opcode::RC_COMPARE_SWAP {
            AtomicOp::CompareSwap {
                compare: a.compare,
                swap: a.swap_add,
            }
        } else {
            AtomicOp::FetchAdd { add: a.swap_add }
        };
        let original = match ctx.mem.atomic(p.pd, a.rkey, a.va, op) {
            Ok(v) => v,
            Err(MemoryError::Misaligned(_)) => {
                return Verdict::Fatal(NakCode::InvalidRequest, None)
            }
            Err(_) => return Verdict::Fatal(NakCode::RemoteAccessError, None),
        };
        let psn = repr.bth.psn;
        self.msn = (self.msn + 1) & 0x00ff_ffff;
        self.remember(Resource::Atomic { psn, original });
        self.out.push_back(Response::Atomic {
            psn,
            original,
            msn: self.msn,
            replay: false,
        });
        self.epsn = psn.next();
        Verdict::Ok
    }

    /// Writes the next answer into `buf`.
    pub fn poll_transmit(&mut self, ctx: &mut Ctx<'_>, buf: &mut [u8]) -> Option<usize> {
        let p = ctx.p;
        let in_error = ctx.state == QpState::Error;
        let front = *self.out.front()?;
        if in_error
            && !matches!(
                front,
                Response::Ack {
                    syndrome: Syndrome::Nak(_),
                    ..
                }
            )
        {
            self.out.clear();
            return None;
        }
        match front {
            Response::Ack { psn, syndrome, msn } => {
                self.out.pop_front();
                let ext = ExtHeaders {
                    aeth: Some(AethRepr { syndrome, msn }),
                    ..Default::default()
                };
                emit::headers(
                    buf,
                    p,
                    emit::Bth::plain(Opcode::RC_ACKNOWLEDGE, psn),
                    ext,
                    0,
                )
                .map(|(_, n)| n)
            }
            Response::Atomic {
                psn, original, msn, ..
            } => {
                self.out.pop_front();
                let ext = ExtHeaders {
                    aeth: Some(AethRepr {
                        syndrome: Syndrome::Ack {
                            credits: CREDITS_INVALID,
                        },
                        msn,
                    }),
                    atomic_ack_eth: Some(AtomicAckEthRepr { original }),
                    ..Default::default()
                };
                emit::headers(
                    buf,
                    p,
                    emit::Bth::plain(Opcode::RC_ATOMIC_ACKNOWLEDGE, psn),
                    ext,
                    0,
                )
                .map(|(_, n)| n)
            }
            Response::Read {
                next_psn,
                first_psn,
                va,
                rkey,
                len,
                offset,
                msn,
                mtu,
                ..
            } => {
                let plen = (len - offset).min(mtu);
                let first = next_psn == first_psn;
                let last = offset + plen == len;
                let opcode = match (first, last) {
                    (true, true) => Opcode::RC_RDMA_READ_RESPONSE_ONLY,
                    (true, false) => Opcode::RC_RDMA_READ_RESPONSE_FIRST,
                    (false, true) => Opcode::RC_RDMA_READ_RESPONSE_LAST,
                    (false, false) => Opcode::RC_RDMA_READ_RESPONSE_MIDDLE,
                };
                let mut ext = ExtHeaders::default();
                if first || last {
                    ext.aeth = Some(AethRepr {
                        syndrome: Syndrome::Ack {
                            credits: CREDITS_INVALID,
                        },
                        msn,
                    });
                }
                let (start, n) = emit::headers(
                    buf,
                    p,
                    emit::Bth::plain(opcode, next_psn),
                    ext,
                    plen as usize,
                )?;
                if plen > 0 {
                    let at = va.wrapping_add(offset);
                    let read = ctx.mem.read(
                        p.pd,
                        KeyKind::Remote,
                        rkey,
                        at,
                        &mut buf[start..start + plen as usize],
                        Access::REMOTE_READ,
                    );
                    if read.is_err() {
                        // The region went away while the answer was under way.
                        self.out.pop_front();
                        ctx.counters.rkey_violations += 1;
                        ctx.fatal = true;
                        self.out.push_front(Response::Ack {
                            psn: next_psn,
                            syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
                            msn,
                        });
                        return self.poll_transmit(ctx, buf);
                    }
                }
                if last {
                    self.out.pop_front();
                } else if let Some(Response::Read {
                    next_psn, offset, ..
                }) = self.out.front_mut()
                {
                    *next_psn = next_psn.next();
                    *offset += plen;
                }
                Some(n)
            }
        }
    }
}
