//! The unreliable connection (UC): the send side, and the rules the receive side follows.
//!
//! A UC QP is connected like an RC QP (one peer, PSNs, the same SEND and WRITE packets with
//! UC's opcodes) but nothing is acknowledged and nothing is sent twice (IBTA 9.7.x, 9.8.2):
//!
//! * **Send side** ([`UcSender`]): a request is cut into path-MTU packets with consecutive PSNs
//!   and completes, successfully, once its last packet has left. No window, no timer, no
//!   retransmission, the AckReq bit always clear. Only SEND, SEND with immediate, WRITE and
//!   WRITE with immediate are carried ([`crate::attr::Service::carries`]).
//! * **Receive side** (the RC responder with its UC rules, `Responder::handle_uc_request`):
//!   a packet at the expected PSN is placed as RC places it. A gap — a packet whose PSN is not
//!   the expected one — drops the message under way: the responder skips packets until one
//!   that starts a message (FIRST or ONLY, at whatever PSN) and takes the PSN sequence up from
//!   there, and a receive request the dropped SEND had begun to fill is used again for the
//!   next message, as rxe does. A message the responder cannot take (no receive request, a bad
//!   R_Key, a length that does not fit) is dropped the same way, silently: the sender never
//!   learns of it and the QP stays up (class D errors). Only a local fault (the receive
//!   request's own buffers refuse the data) completes in error and moves the QP to ERR.
//!
//! Every dropped packet is counted: `uc_dropped_packets` for those skipped after a gap or
//! behind a refused message's first packet, and the refusal's own counter (`send_rnr_err`,
//! `rkey_violations`, `send_invalid_request`) for the packet that was refused.

use std::collections::VecDeque;

use ferroce_wire::immdt::ImmDtRepr;
use ferroce_wire::opcode::Position;
use ferroce_wire::reth::RethRepr;
use ferroce_wire::{ExtHeaders, Opcode, Psn};

use crate::completion::WcStatus;
use crate::emit;
use crate::qp::{CompletionQueue, Ctx, Params};
use crate::requester::{completion, gather, packets_for, SPARE_SGLS};
use crate::wr::{SendOp, SendWr};

/// A send request under way: the packets of it already sent.
#[derive(Debug)]
struct UcWqe {
    wr: SendWr,
    len: u64,
    /// Path MTU when it started (a later `set_path_mtu` changes new requests only).
    mtu: u32,
    npkts: u32,
    sent: u32,
}

/// The send side of a UC QP.
#[derive(Debug, Default)]
pub(crate) struct UcSender {
    sq: VecDeque<UcWqe>,
    next_psn: Psn,
    /// Retired requests whose allocations a later post may reuse (at most `SPARE_SGLS`, as
    /// the RC requester keeps: requests posted by value retire too, and must not pile up).
    spare: Vec<SendWr>,
}

impl UcSender {
    /// Starts sending at `sq_psn` (RTR → RTS).
    pub fn start(&mut self, sq_psn: Psn) {
        self.next_psn = sq_psn;
    }

    /// Requests posted and not yet completed.
    pub fn len(&self) -> usize {
        self.sq.len()
    }

    /// The PSN the next packet will carry.
    pub fn next_psn(&self) -> Psn {
        self.next_psn
    }

    /// Queues a request the post checks admitted.
    pub fn push(&mut self, wr: SendWr, mtu: u32) {
        let len = wr.data_len();
        self.sq.push_back(UcWqe {
            npkts: packets_for(len, mtu),
            wr,
            len,
            mtu,
            sent: 0,
        });
    }

    /// Queues a copy of `wr`, made in a retired request's allocation when there is one.
    pub fn push_copy(&mut self, wr: &SendWr, mtu: u32) {
        let copy = match self.spare.pop() {
            Some(mut old) => {
                old.clone_from(wr);
                old
            }
            None => wr.clone(),
        };
        self.push(copy, mtu);
    }

    /// Every request not yet completed completes with the flush status (entering ERR).
    pub fn flush(&mut self, p: &Params, cq: &mut CompletionQueue) {
        for w in self.sq.drain(..) {
            cq.push_back(crate::requester::flushed(p, &w.wr));
        }
    }

    /// Writes the next packet into `buf` and returns its length; a request whose last packet
    /// this was completes. A request whose local buffers refuse to be read completes with a
    /// local protection error and the QP goes to ERR (`ctx.fatal`).
    pub fn poll_transmit(
        &mut self,
        ctx: &mut Ctx<'_>,
        buf: &mut [u8],
        cq: &mut CompletionQueue,
    ) -> Option<usize> {
        let p = ctx.p;
        let psn = self.next_psn;
        let w = self.sq.front_mut()?;
        let k = w.sent;
        let mtu = u64::from(w.mtu);
        let offset = u64::from(k) * mtu;
        let plen = (w.len - offset.min(w.len)).min(mtu) as usize;
        let position = match (k == 0, k + 1 == w.npkts) {
            (true, true) => Position::Only,
            (true, false) => Position::First,
            (false, true) => Position::Last,
            (false, false) => Position::Middle,
        };
        let write = matches!(w.wr.op, SendOp::Write | SendOp::WriteWithImm(_));
        let mut ext = ExtHeaders::default();
        if write && position.starts_message() {
            ext.reth = Some(RethRepr {
                va: w.wr.remote_addr,
                rkey: w.wr.rkey,
                dma_len: w.len as u32,
            });
        }
        if position.ends_message() {
            if let SendOp::SendWithImm(v) | SendOp::WriteWithImm(v) = w.wr.op {
                ext.immdt = Some(ImmDtRepr { value: v });
            }
        }
        let last = position.ends_message();
        let header = emit::Bth {
            opcode: uc_opcode(w.wr.op, position),
            psn,
            ack_req: false,
            solicited: last && w.wr.flags.solicited,
        };
        let built = emit::headers(buf, p, header, ext, plen)
            .ok_or(WcStatus::LocalLengthError)
            .and_then(|(start, n)| {
                gather(ctx.mem, p.pd, &w.wr, offset, &mut buf[start..start + plen]).map(|()| n)
            });
        match built {
            Ok(n) => {
                w.sent += 1;
                self.next_psn = psn.next();
                if last {
                    let w = self.sq.pop_front()?;
                    if w.wr.flags.signaled {
                        cq.push_back(completion(p, &w.wr, WcStatus::Success, w.len));
                    }
                    if matches!(w.wr.op, SendOp::Send | SendOp::SendWithImm(_)) {
                        ctx.counters.rdma_sends += 1;
                    }
                    if self.spare.len() < SPARE_SGLS {
                        self.spare.push(w.wr);
                    }
                }
                Some(n)
            }
            Err(status) => {
                let w = self.sq.pop_front()?;
                cq.push_back(completion(p, &w.wr, status, 0));
                ctx.fatal = true;
                None
            }
        }
    }
}

/// The UC opcode of a packet of `op` at `position` (the caller admitted only what UC carries).
fn uc_opcode(op: SendOp, position: Position) -> Opcode {
    use Position::*;
    let write = matches!(op, SendOp::Write | SendOp::WriteWithImm(_));
    let imm = matches!(op, SendOp::SendWithImm(_) | SendOp::WriteWithImm(_));
    match (write, position, imm) {
        (true, First, _) => Opcode::UC_RDMA_WRITE_FIRST,
        (true, Middle, _) => Opcode::UC_RDMA_WRITE_MIDDLE,
        (true, Last, false) => Opcode::UC_RDMA_WRITE_LAST,
        (true, Last, true) => Opcode::UC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
        (true, Only, false) => Opcode::UC_RDMA_WRITE_ONLY,
        (true, Only, true) => Opcode::UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        (false, First, _) => Opcode::UC_SEND_FIRST,
        (false, Middle, _) => Opcode::UC_SEND_MIDDLE,
        (false, Last, false) => Opcode::UC_SEND_LAST,
        (false, Last, true) => Opcode::UC_SEND_LAST_WITH_IMMEDIATE,
        (false, Only, false) => Opcode::UC_SEND_ONLY,
        (false, Only, true) => Opcode::UC_SEND_ONLY_WITH_IMMEDIATE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Access, Sge, VecMemory};
    use crate::qp::Params;
    use crate::wr::SendWr;

    /// Requests posted by value retire into the spare pool too; it stays bounded however many
    /// go through.
    #[test]
    fn the_spare_pool_stays_bounded() {
        let mut mem = VecMemory::new();
        let r = mem.register(1, 0x1000, 4096, Access::ALL.with(Access::LOCAL_WRITE));
        let lkey = mem.region(r).lkey;
        let p = Params {
            qpn: 0x21,
            pd: 1,
            access: Access::NONE,
            pkey: ferroce_wire::bth::DEFAULT_PKEY,
            mtu: 1024,
            dest_qpn: 0x22,
            dest_gid: std::net::Ipv6Addr::LOCALHOST,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            unasked_run: 0,
            cc: crate::cc::CcConfig::default(),
            selective_repeat: false,
            keep_out_of_order: false,
            service: crate::attr::Service::Uc,
        };
        let mut counters = crate::counters::Counters::default();
        let mut s = UcSender::default();
        let mut cq = CompletionQueue::new();
        let mut buf = vec![0u8; 4096 + 64];
        for i in 0..200 {
            let sge = Sge {
                addr: 0x1000,
                length: 64,
                lkey,
            };
            s.push(SendWr::new(i, SendOp::Send, vec![sge]), 1024);
            let mut ctx = Ctx {
                p: &p,
                state: crate::qp::QpState::Rts,
                counters: &mut counters,
                mem: &mut mem,
                fatal: false,
            };
            assert!(s.poll_transmit(&mut ctx, &mut buf, &mut cq).is_some());
        }
        assert_eq!(cq.len(), 200);
        assert!(
            s.spare.len() <= SPARE_SGLS,
            "{} spare requests",
            s.spare.len()
        );
    }
}
