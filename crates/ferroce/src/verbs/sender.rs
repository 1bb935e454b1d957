//! Posting without the QP's lock: [`QpSender`], and the [`SendRequest`] a post takes.

use std::borrow::Cow;
use std::sync::atomic::Ordering;

use ferroce_proto::{QpCaps, QpState, SendWr};

use super::qp::QueuePair;
use crate::error::Result;
use crate::provider::{direct, shortcut, Link, PeerMemory};

/// A send work request handed to [`QueuePair::post_send`]: by value, or by reference to post
/// the same request again and again without rebuilding it (`ibv_post_send` takes a pointer for
/// the same reason). A request done at once in a same-host peer's memory is never copied; one
/// queued for the transport is copied if it was lent.
pub trait SendRequest<'a> {
    /// The request, owned or borrowed.
    fn into_request(self) -> Cow<'a, SendWr>;
}

impl<'a> SendRequest<'a> for SendWr {
    fn into_request(self) -> Cow<'a, SendWr> {
        Cow::Owned(self)
    }
}

impl<'a> SendRequest<'a> for &'a SendWr {
    fn into_request(self) -> Cow<'a, SendWr> {
        Cow::Borrowed(self)
    }
}

/// Posts send requests to one [`QueuePair`] from one thread at a time: what rdma-core's thread
/// domains promise a provider, here kept by the borrow checker (posting takes `&mut self`).
///
/// A post through it behaves exactly as [`QueuePair::post_send`]: same checks, same statuses,
/// completions in posting order. The difference is the shared-memory fast path: a WRITE, READ
/// or atomic to a same-host peer on an idle QP (in RTS, nothing under way, no completion
/// waiting) is done without taking the QP's lock, because the sender keeps its own way into
/// the peer's memory (its own mappings and cached checks) instead of the one the QP keeps
/// under its lock. That lock's one locked instruction is a sizeable part of an 8-byte WRITE
/// between two processes. Anything else is posted through the QP as usual.
///
/// Several senders may exist for one QP (one per thread, say), beside posts through the QP
/// itself; what is posted concurrently from different threads is ordered as it happens to be,
/// as on any QP. Mappings a sender made live until it is dropped or the QP links anew.
#[derive(Debug)]
pub struct QpSender<'a> {
    pub(super) qp: &'a QueuePair,
    /// The QP's capacities and protection domain, fixed at its creation.
    pub(super) caps: QpCaps,
    /// RC or UC (what the QP carries).
    pub(super) service: ferroce_proto::Service,
    pub(super) pd: u32,
    /// This sender's way into the peer's memory, made from the link the QP has.
    pub(super) peer: Option<PeerMemory>,
    /// What it checked about the WRITE or READ it repeats (see `shm::shortcut`).
    pub(super) shortcut: Option<shortcut::Shortcut>,
    /// The (lkey, rkey) of the last request done directly without the shortcut: a second one
    /// between the same regions makes the shortcut (a stream alternating between regions
    /// would only remake it every time).
    pub(super) last_direct: Option<(u32, u32)>,
    /// One-sided operations this sender did in the peer's memory itself, not yet added to the
    /// QP's count (a plain count here: the QP's lock is not taken on this path).
    pub(super) direct_ops: u64,
}

impl Drop for QpSender<'_> {
    fn drop(&mut self) {
        if self.direct_ops > 0 {
            self.qp.shared.qp.lock().direct_ops += self.direct_ops;
        }
    }
}

impl QpSender<'_> {
    /// The queue pair this sender posts to.
    pub fn qp(&self) -> &QueuePair {
        self.qp
    }

    /// Posts a send work request (`wr` or `&wr`), as [`QueuePair::post_send`] does.
    #[inline]
    pub fn post_send<'a>(&mut self, wr: impl SendRequest<'a>) -> Result<()> {
        let wr = wr.into_request();
        // The repeated WRITE or READ in straight-line code; everything else out of line, so
        // that the path from the caller's last instruction to the store into the peer's
        // memory stays short (on a ping-pong it is the whole turnaround).
        match self.shortcut.as_ref().and_then(|s| s.run(&wr)) {
            Some(_) if !wr.flags.signaled => {
                self.direct_ops += 1;
                Ok(())
            }
            done => self.post_rest(wr, done),
        }
    }

    /// The rest of [`Self::post_send`]: a signaled request the shortcut did, or one it did
    /// not do (`done` is `None`).
    #[inline(never)]
    fn post_rest(
        &mut self,
        wr: Cow<'_, SendWr>,
        done: Option<ferroce_proto::WcOpcode>,
    ) -> Result<()> {
        match done.or_else(|| self.one_sided(&wr)) {
            Some(opcode) => {
                self.direct_ops += 1;
                if wr.flags.signaled {
                    let wc = direct::completion(&wr, opcode, self.qp.shared.qpn);
                    self.qp.shared.send_cq.push(&[wc]);
                }
                Ok(())
            }
            None => self.qp.post_request(wr),
        }
    }

    /// Does `wr` in the peer's memory if the QP is linked over shared memory and idle and every
    /// check admits it; `None` (having touched nothing) otherwise.
    #[inline]
    fn one_sided(&mut self, wr: &SendWr) -> Option<ferroce_proto::WcOpcode> {
        let shared = &self.qp.shared;
        let shm = shared.shm_linked()?;
        if !shared.qp.idle() {
            return None;
        }
        let generation = shm.generation.load(Ordering::Acquire);
        if self.peer.as_ref().map(|m| m.generation) != Some(generation) {
            self.peer = match &*shm.lock() {
                Link::Linked(peer) => Some(peer.memory(generation)),
                _ => None,
            };
        }
        ferroce_proto::qp::check_send_request(QpState::Rts, &self.caps, self.service, wr).ok()?;
        let peer = self.peer.as_mut()?;
        let ctx = &self.qp.ctx.shared;
        let opcode = direct::one_sided_op(ctx, peer, self.pd, wr)?;
        if let [sge] = wr.sgl.as_slice() {
            let pair = Some((sge.lkey, wr.rkey));
            if self.last_direct == pair {
                if let Some(s) = shortcut::Shortcut::capture(ctx, shared, peer, wr) {
                    self.shortcut = Some(s);
                }
            }
            self.last_direct = pair;
        }
        Some(opcode)
    }
}
