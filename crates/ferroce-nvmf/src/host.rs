//! One queue of a host (initiator) over RDMA, sans-IO: command identifiers, the submission
//! queue's room (the controller's SQ head in each response frees entries), capsules to SEND
//! and responses matched to their commands. A response that names no outstanding command, or
//! another queue, is refused: the caller ends the queue, as Linux's host does.

use std::collections::HashMap;

use crate::command::{Command, SQE_LEN};
use crate::completion::Completion;
use crate::WireError;

/// Why a response was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    /// Not a completion entry.
    #[error("response capsule: {0}")]
    Wire(#[from] WireError),
    /// It answers no command outstanding on this queue.
    #[error("a response for command {cid}, which is not outstanding")]
    Unknown {
        /// The command ID it named.
        cid: u16,
    },
    /// It names another queue.
    #[error("a response for queue {got} on queue {want}")]
    WrongQueue {
        /// The queue it named.
        got: u16,
        /// This queue.
        want: u16,
    },
}

/// The host's side of one queue.
pub struct HostQueue<T> {
    qid: u16,
    sq_entries: u16,
    /// Commands sent and not answered, with the caller's context for each.
    outstanding: HashMap<u16, T>,
    next_cid: u16,
    /// The submission queue tail: where the next command goes.
    sq_tail: u16,
    /// The controller's last reported head.
    sq_head: u16,
}

impl<T> HostQueue<T> {
    /// Queue `qid` with `sq_entries` submission entries.
    pub fn new(qid: u16, sq_entries: u16) -> HostQueue<T> {
        HostQueue {
            qid,
            sq_entries: sq_entries.max(2),
            outstanding: HashMap::new(),
            next_cid: 0,
            sq_tail: 0,
            sq_head: 0,
        }
    }

    /// Commands sent and not answered.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// Whether another command fits: the submission queue is full when its tail is one
    /// behind the controller's head (NVMe's circular queue), and no more commands than
    /// entries may wait for answers.
    pub fn can_submit(&self) -> bool {
        let used = (self.sq_tail + self.sq_entries - self.sq_head) % self.sq_entries;
        used + 1 < self.sq_entries && self.outstanding.len() + 1 < usize::from(self.sq_entries)
    }

    /// The capsule for `cmd` (its command ID assigned here) with `in_capsule` data after it;
    /// `None` when the queue is full. `ctx` comes back with the response.
    pub fn submit(
        &mut self,
        mut cmd: Command,
        in_capsule: &[u8],
        ctx: T,
    ) -> Option<(u16, Vec<u8>)> {
        if !self.can_submit() {
            return None;
        }
        let mut cid = self.next_cid;
        while self.outstanding.contains_key(&cid) {
            cid = cid.wrapping_add(1);
        }
        self.next_cid = cid.wrapping_add(1);
        cmd.cid = cid;
        let mut capsule = Vec::with_capacity(SQE_LEN + in_capsule.len());
        capsule.extend_from_slice(&cmd.encode());
        capsule.extend_from_slice(in_capsule);
        self.outstanding.insert(cid, ctx);
        self.sq_tail = (self.sq_tail + 1) % self.sq_entries;
        Some((cid, capsule))
    }

    /// A response capsule: its completion and the context its command was submitted with.
    pub fn on_response(&mut self, capsule: &[u8]) -> Result<(Completion, T), ResponseError> {
        let c = Completion::parse(capsule)?;
        // Before Connect answers, the queue's ID in responses is the admin queue's 0 for a
        // Connect on any queue; a connected queue's responses name it.
        if c.sq_id != self.qid && c.sq_id != 0 {
            return Err(ResponseError::WrongQueue {
                got: c.sq_id,
                want: self.qid,
            });
        }
        let ctx = self
            .outstanding
            .remove(&c.cid)
            .ok_or(ResponseError::Unknown { cid: c.cid })?;
        if c.sq_head < self.sq_entries {
            self.sq_head = c.sq_head;
        }
        Ok((c, ctx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::io;
    use crate::completion::Status;
    use crate::sgl::Sgl;

    fn read() -> Command {
        Command::new(io::READ, 0, 1, Sgl::InCapsule { offset: 0, len: 0 }).unwrap()
    }

    fn response(cid: u16, qid: u16, head: u16) -> [u8; 16] {
        Completion {
            result: 0,
            sq_head: head,
            sq_id: qid,
            cid,
            status: Status::SUCCESS,
        }
        .encode()
    }

    #[test]
    fn a_full_queue_waits_for_the_controllers_head() {
        let mut q: HostQueue<u32> = HostQueue::new(1, 4);
        let mut cids = Vec::new();
        while let Some((cid, capsule)) = q.submit(read(), &[], 7) {
            assert_eq!(Command::parse(&capsule).unwrap().cid, cid);
            cids.push(cid);
        }
        // Four entries: three commands at most.
        assert_eq!(cids.len(), 3);
        let (c, ctx) = q.on_response(&response(cids[0], 1, 1)).unwrap();
        assert_eq!((c.cid, ctx), (cids[0], 7));
        assert!(q.can_submit());
        assert!(q.submit(read(), &[], 8).is_some());
    }

    #[test]
    fn unknown_duplicate_and_misdirected_responses_are_refused() {
        let mut q: HostQueue<()> = HostQueue::new(2, 8);
        let (cid, _) = q.submit(read(), &[], ()).unwrap();
        assert_eq!(
            q.on_response(&response(cid, 3, 1)).err(),
            Some(ResponseError::WrongQueue { got: 3, want: 2 })
        );
        assert!(q.on_response(&response(cid, 2, 1)).is_ok());
        assert_eq!(
            q.on_response(&response(cid, 2, 1)).err(),
            Some(ResponseError::Unknown { cid })
        );
        assert!(q.on_response(&[0u8; 10]).is_err());
    }
}
