//! Work completions: what a queue pair reports back, with the IBTA completion statuses.

use core::fmt;

/// The status of a work completion (names after rdma-core's `ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// The operation completed.
    Success,
    /// A message was longer than the buffers it was to land in, or an SGL exceeds 2^31 bytes.
    LocalLengthError,
    /// A local memory key, bound or access right was violated.
    LocalProtectionError,
    /// A request could not be carried out in the QP's state.
    LocalQpOperationError,
    /// The responder found a remote key, bound or access violation.
    RemoteAccessError,
    /// The responder rejected the request as invalid (bad opcode sequence, length, etc.).
    RemoteInvalidRequestError,
    /// The responder failed on its own.
    RemoteOperationalError,
    /// The responder kept answering "receiver not ready" past the RNR retry count.
    RnrRetryExceeded,
    /// No acknowledgement came back within retry count × local ACK timeout.
    TransportRetryExceeded,
    /// The request was still queued when the QP entered the error state.
    WorkRequestFlushed,
}

impl WcStatus {
    /// rdma-core's name for the status, as `ibv_wc_status_str` prints it.
    pub const fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocalLengthError => "local length error",
            WcStatus::LocalProtectionError => "local protection error",
            WcStatus::LocalQpOperationError => "local QP operation error",
            WcStatus::RemoteAccessError => "remote access error",
            WcStatus::RemoteInvalidRequestError => "invalid request error",
            WcStatus::RemoteOperationalError => "remote operation error",
            WcStatus::RnrRetryExceeded => "RNR retry counter exceeded",
            WcStatus::TransportRetryExceeded => "transport retry counter exceeded",
            WcStatus::WorkRequestFlushed => "Work Request Flushed Error",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What kind of work a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND (any flavour) completed at the initiator.
    Send,
    /// An RDMA WRITE (with or without immediate) completed at the initiator.
    RdmaWrite,
    /// An RDMA READ completed.
    RdmaRead,
    /// A COMPARE_SWAP completed.
    CompareSwap,
    /// A FETCH_ADD completed.
    FetchAdd,
    /// A receive request was consumed by an incoming SEND.
    Recv,
    /// A receive request was consumed by an incoming RDMA WRITE with immediate.
    RecvRdmaWithImm,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The identifier of the work request.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Kind of work.
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred (READ), 0 otherwise.
    pub byte_len: u32,
    /// Immediate data of a SEND or WRITE with immediate.
    pub imm_data: Option<u32>,
    /// The local R_Key a SEND with invalidate revoked.
    pub invalidated_rkey: Option<u32>,
    /// The QP the completion belongs to.
    pub qp_num: u32,
    /// Whether the message asked for a solicited event.
    pub solicited: bool,
    /// The sending QP of a datagram a UD QP received (its DETH's source QPN); `None` on RC.
    pub src_qp: Option<u32>,
}
