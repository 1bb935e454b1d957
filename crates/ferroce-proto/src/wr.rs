//! Work requests: what an application posts to a queue pair.

use crate::memory::Sge;

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendOp {
    /// SEND.
    Send,
    /// SEND with 32-bit immediate data.
    SendWithImm(u32),
    /// SEND that invalidates a remote key at the receiver.
    SendWithInvalidate(u32),
    /// RDMA WRITE.
    Write,
    /// RDMA WRITE with 32-bit immediate data (consumes a receive request at the target).
    WriteWithImm(u32),
    /// RDMA READ.
    Read,
    /// 64-bit compare-and-swap at the remote address.
    CompareSwap {
        /// Value expected at the target.
        compare: u64,
        /// Value stored if it matches.
        swap: u64,
    },
    /// 64-bit fetch-and-add at the remote address.
    FetchAdd {
        /// Value added.
        add: u64,
    },
}

impl SendOp {
    /// Whether the operation needs a remote address and key.
    pub const fn is_rdma(self) -> bool {
        matches!(
            self,
            SendOp::Write
                | SendOp::WriteWithImm(_)
                | SendOp::Read
                | SendOp::CompareSwap { .. }
                | SendOp::FetchAdd { .. }
        )
    }

    /// Whether the operation is an atomic.
    pub const fn is_atomic(self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. })
    }

    /// Whether the responder answers with data (READ and atomics), so that the initiator must
    /// hold a responder resource for it.
    pub const fn is_read_or_atomic(self) -> bool {
        matches!(
            self,
            SendOp::Read | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
        )
    }
}

/// Flags of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags {
    /// Generate a completion on success (errors always complete).
    pub signaled: bool,
    /// Wait for every earlier READ and atomic to complete before starting.
    pub fence: bool,
    /// Ask the receiver's completion channel to wake on this message.
    pub solicited: bool,
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWr {
    /// The application's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local buffers: gathered from for SEND/WRITE, scattered into for READ, the 8-byte result
    /// buffer for atomics.
    pub sgl: Vec<Sge>,
    /// Data carried in the request itself instead of `sgl` (SEND/WRITE only).
    pub inline_data: Option<Vec<u8>>,
    /// Remote virtual address (RDMA operations).
    pub remote_addr: u64,
    /// Remote key (RDMA operations).
    pub rkey: u32,
    /// Flags.
    pub flags: SendFlags,
}

impl SendWr {
    /// A signaled request of `op` over `sgl`, with no remote address.
    pub fn new(wr_id: u64, op: SendOp, sgl: Vec<Sge>) -> SendWr {
        SendWr {
            wr_id,
            op,
            sgl,
            inline_data: None,
            remote_addr: 0,
            rkey: 0,
            flags: SendFlags {
                signaled: true,
                ..SendFlags::default()
            },
        }
    }

    /// Sets the remote address and key.
    pub fn remote(mut self, addr: u64, rkey: u32) -> SendWr {
        self.remote_addr = addr;
        self.rkey = rkey;
        self
    }

    /// Carries `data` inline instead of gathering from the SGL.
    pub fn inline(mut self, data: Vec<u8>) -> SendWr {
        self.inline_data = Some(data);
        self
    }

    /// Sets the flags.
    pub fn flags(mut self, flags: SendFlags) -> SendWr {
        self.flags = flags;
        self
    }

    /// Total bytes the SGL (or inline data) describes.
    #[inline]
    pub fn data_len(&self) -> u64 {
        match &self.inline_data {
            Some(d) => d.len() as u64,
            // One buffer is the common case, and worth no loop.
            None => match self.sgl.as_slice() {
                [one] => u64::from(one.length),
                sgl => sgl.iter().map(|s| u64::from(s.length)).sum(),
            },
        }
    }
}

/// A receive work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    /// The application's identifier, returned in the completion.
    pub wr_id: u64,
    /// Buffers an incoming SEND is scattered into.
    pub sgl: Vec<Sge>,
}
