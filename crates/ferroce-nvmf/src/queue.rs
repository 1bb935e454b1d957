//! One queue of the target over RDMA (NVMe-oF 1.1 §7.3), sans-IO: what the controller's side
//! of an RC queue pair does with each command capsule the host SENDs. It says what to move
//! ([`Action`]): an RDMA READ of a Write's data from the host's keyed buffer, an RDMA WRITE of
//! a Read's data into it, the SEND of the response capsule (with Invalidate of the host's key
//! when the host asked), or the end of the queue. The caller owns the QP and posts them in
//! order (an RDMA WRITE before the SEND of its response on the same QP, as RC keeps them).

use std::collections::HashMap;
use std::time::Instant;

use crate::command::{Command, Direction, SQE_LEN};
use crate::completion::{Completion, Status};
use crate::controllers::{Outcome, QueueBinding, Target};
use crate::fabrics::{fctype, fctype_of};
use crate::io::{self, Response};
use crate::sgl::Sgl;

/// What the transport does next for a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// RDMA READ `len` bytes at `addr` with `key` from the host; report with
    /// [`TargetQueue::read_done`] and `tag`.
    Read {
        /// Which command's data this is.
        tag: u16,
        /// The host's address.
        addr: u64,
        /// The host's key.
        key: u32,
        /// The length.
        len: u32,
    },
    /// RDMA WRITE `data` at `addr` with `key` into the host's buffer.
    Write {
        /// The host's address.
        addr: u64,
        /// The host's key.
        key: u32,
        /// The bytes.
        data: Vec<u8>,
    },
    /// SEND the response capsule, with Invalidate of `invalidate` if the host asked.
    Send {
        /// The completion entry.
        cqe: [u8; 16],
        /// The host's key to invalidate.
        invalidate: Option<u32>,
    },
    /// End the queue (disconnect): the host broke the protocol, or its controller ended.
    Close,
}

struct Waiting {
    cmd: Command,
    sgl: Sgl,
}

/// The target's side of one queue.
pub struct TargetQueue {
    binding: Option<QueueBinding>,
    /// The submission queue head the next response reports.
    sq_head: u16,
    /// Entries of the submission queue (before Connect: the CM request's HSQSIZE + 1).
    sq_entries: u16,
    /// In-capsule data this queue takes after a command.
    in_capsule_max: u32,
    /// The largest data transfer of one command (the controller's MDTS in bytes).
    max_transfer: u32,
    /// Commands whose data is being read from the host, by tag (their command ID).
    reading: HashMap<u16, Waiting>,
}

impl TargetQueue {
    /// A new queue, before its Connect: `sq_entries` from the CM request, `in_capsule_max`
    /// the data a capsule may carry after its command (what the receive buffers hold).
    pub fn new(sq_entries: u16, in_capsule_max: u32) -> TargetQueue {
        TargetQueue {
            binding: None,
            sq_head: 0,
            sq_entries: sq_entries.max(1),
            in_capsule_max,
            max_transfer: u32::MAX,
            reading: HashMap::new(),
        }
    }

    /// Sets the largest transfer one command may ask for (the MDTS the controller announces,
    /// in bytes): a keyed data block beyond it is failed with Invalid Field in Command, as
    /// the base specification's MDTS says, and the queue goes on.
    pub fn set_max_transfer(&mut self, bytes: u32) {
        self.max_transfer = bytes;
    }

    /// The queue's place once connected.
    pub fn binding(&self) -> Option<&QueueBinding> {
        self.binding.as_ref()
    }

    /// A command capsule the host sent (its SEND's bytes).
    pub fn on_capsule(&mut self, now: Instant, target: &mut Target, capsule: &[u8]) -> Vec<Action> {
        // A capsule without a whole command has no command ID to answer: the queue ends, as
        // the kernel's target ends a queue that breaks the transport's framing.
        let Ok(cmd) = Command::parse(capsule) else {
            return vec![Action::Close];
        };
        self.sq_head = (self.sq_head + 1) % self.sq_entries;
        if let Some(b) = &self.binding {
            target.traffic(b.cntlid, now);
        }
        let sgl = match cmd.sgl() {
            Ok(s) => s,
            Err(_) => return self.respond(&cmd, None, Response::fail(Status::SGL_TYPE_INVALID)),
        };
        let in_capsule = &capsule[SQE_LEN..];
        if cmd.direction() != Direction::None
            && matches!(sgl, Sgl::Keyed { len, .. } if len > self.max_transfer)
        {
            return self.respond(&cmd, None, Response::fail(Status::INVALID_FIELD));
        }
        match (cmd.direction(), sgl) {
            (Direction::HostToController, Sgl::InCapsule { offset, len }) => {
                let end = offset.checked_add(u64::from(len));
                if offset != 0 {
                    return self.respond(&cmd, None, Response::fail(Status::SGL_OFFSET_INVALID));
                }
                match end {
                    Some(end) if end <= in_capsule.len() as u64 && len <= self.in_capsule_max => {
                        let data = in_capsule[..len as usize].to_vec();
                        self.execute(now, target, &cmd, sgl, &data)
                    }
                    _ => self.respond(&cmd, None, Response::fail(Status::SGL_LENGTH_INVALID)),
                }
            }
            (Direction::HostToController, Sgl::Keyed { addr, len, key, .. }) if len > 0 => {
                if self.reading.contains_key(&cmd.cid) {
                    // Two commands of one ID in flight: the host broke the protocol.
                    return vec![Action::Close];
                }
                self.reading.insert(cmd.cid, Waiting { cmd, sgl });
                vec![Action::Read {
                    tag: cmd.cid,
                    addr,
                    key,
                    len,
                }]
            }
            (Direction::Both, _) => self.respond(&cmd, None, Response::fail(Status::INVALID_FIELD)),
            _ => self.execute(now, target, &cmd, sgl, &[]),
        }
    }

    /// The RDMA READ for `tag` finished: `data` on success. A failed READ (the host's key did
    /// not grant the buffer) leaves the queue pair in error, so no response can follow: the
    /// queue ends.
    pub fn read_done(
        &mut self,
        now: Instant,
        target: &mut Target,
        tag: u16,
        data: Option<&[u8]>,
    ) -> Vec<Action> {
        let Some(w) = self.reading.remove(&tag) else {
            return vec![Action::Close];
        };
        match data {
            Some(d) => self.execute(now, target, &w.cmd, w.sgl, d),
            None => vec![Action::Close],
        }
    }

    fn execute(
        &mut self,
        now: Instant,
        target: &mut Target,
        cmd: &Command,
        sgl: Sgl,
        data: &[u8],
    ) -> Vec<Action> {
        let Some(b) = self.binding.clone() else {
            if fctype_of(cmd) != Some(fctype::CONNECT) {
                return self.respond(
                    cmd,
                    Some(sgl),
                    Response::fail(Status::COMMAND_SEQUENCE_ERROR),
                );
            }
            return match target.connect(now, cmd, data) {
                Ok((binding, r)) => {
                    self.sq_entries = binding.sq_entries;
                    self.binding = Some(binding);
                    self.respond(cmd, Some(sgl), r)
                }
                Err(r) => self.respond(cmd, Some(sgl), r),
            };
        };
        if b.qid == 0 {
            match target.admin(now, b.cntlid, cmd, sgl.len(), data) {
                Outcome::Respond(r) => self.respond(cmd, Some(sgl), r),
                Outcome::Held => Vec::new(),
            }
        } else if fctype_of(cmd).is_some() {
            // Connect again, or properties, on an I/O queue.
            self.respond(
                cmd,
                Some(sgl),
                Response::fail(Status::COMMAND_SEQUENCE_ERROR),
            )
        } else {
            let ns = b.subsystem.as_ref().and_then(|s| s.namespace(cmd.nsid));
            let r = io::execute(ns, cmd, sgl.len(), data);
            self.respond(cmd, Some(sgl), r)
        }
    }

    /// The completion of a held command (an Asynchronous Event Request ending with its
    /// controller).
    pub fn complete_held(&mut self, cid: u16, status: Status) -> Vec<Action> {
        let r = Response::fail(status);
        self.response(cid, None, r)
    }

    fn respond(&mut self, cmd: &Command, sgl: Option<Sgl>, r: Response) -> Vec<Action> {
        self.response(cmd.cid, sgl, r)
    }

    fn response(&mut self, cid: u16, sgl: Option<Sgl>, mut r: Response) -> Vec<Action> {
        let mut actions = Vec::new();
        let mut invalidate = None;
        if let Some(Sgl::Keyed {
            addr,
            len,
            key,
            invalidate: inv,
        }) = sgl
        {
            if inv {
                invalidate = Some(key);
            }
            if !r.data.is_empty() && r.status.is_success() {
                r.data.truncate(len as usize);
                actions.push(Action::Write {
                    addr,
                    key,
                    data: std::mem::take(&mut r.data),
                });
            }
        } else if !r.data.is_empty() && r.status.is_success() {
            // Data for the host with no keyed buffer to put it in.
            r = Response::fail(Status::SGL_TYPE_INVALID);
        }
        let cqe = Completion {
            result: r.result,
            sq_head: self.sq_head,
            sq_id: self.binding.as_ref().map_or(0, |b| b.qid),
            cid,
            status: r.status,
        }
        .encode();
        actions.push(Action::Send { cqe, invalidate });
        actions
    }
}

#[cfg(test)]
mod tests;
