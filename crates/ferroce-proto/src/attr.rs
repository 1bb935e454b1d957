//! Queue-pair attributes: what each state transition takes, validated into typed values.

use core::time::Duration;
use std::net::Ipv6Addr;

use ferroce_wire::Psn;
use thiserror::Error;

use crate::memory::Access;
use crate::qp::QpState;

/// Why a state transition or attribute was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QpError {
    /// The transition is not allowed from the current state.
    #[error("cannot move a QP from {from:?} to {to:?}")]
    InvalidTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// An attribute is out of its range.
    #[error("invalid attribute {name}: {value}")]
    InvalidAttribute {
        /// Attribute name, as rdma-core spells it.
        name: &'static str,
        /// The offending value.
        value: u64,
    },
}

/// Why a work request could not be posted (nothing was queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PostError {
    /// The QP's state does not accept this kind of work request.
    #[error("QP in state {0:?} does not accept this work request")]
    InvalidState(QpState),
    /// The queue is full.
    #[error("work queue full ({0} entries)")]
    QueueFull(u32),
    /// More scatter/gather elements than the QP was created for.
    #[error("{given} scatter/gather elements, the QP allows {max}")]
    TooManySge {
        /// Elements given.
        given: usize,
        /// Maximum.
        max: u32,
    },
    /// Inline data larger than the QP's inline limit, or inline on an operation without data out.
    #[error("inline data of {given} bytes not allowed (limit {max})")]
    InlineNotAllowed {
        /// Bytes given.
        given: usize,
        /// Limit.
        max: u32,
    },
    /// A message longer than 2^31 bytes.
    #[error("message of {0} bytes exceeds 2^31")]
    MessageTooLong(u64),
    /// An atomic whose local buffer is not exactly one 8-byte element.
    #[error("an atomic needs exactly one 8-byte local buffer")]
    BadAtomicBuffer,
    /// An operation the QP's transport service does not carry (READ, atomics and SEND with
    /// invalidate on a UC QP).
    #[error("a {0} QP does not carry this operation")]
    NotOnService(Service),
}

/// The transport service of a connected queue pair (IBTA 9.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Service {
    /// Reliable connection: acknowledged, retried, in order, exactly once; every operation.
    #[default]
    Rc,
    /// Unreliable connection: SEND, WRITE and WRITE with immediate only; nothing is
    /// acknowledged or retried, a send completes once its last packet has left, and a message
    /// that loses a packet is dropped whole at the receiver (see [`crate::uc`]).
    Uc,
}

impl Service {
    /// rdma-core's name for it.
    pub const fn name(self) -> &'static str {
        match self {
            Service::Rc => "RC",
            Service::Uc => "UC",
        }
    }

    /// Whether this service carries `op`.
    pub const fn carries(self, op: crate::wr::SendOp) -> bool {
        match self {
            Service::Rc => true,
            Service::Uc => {
                !op.is_read_or_atomic() && !matches!(op, crate::wr::SendOp::SendWithInvalidate(_))
            }
        }
    }
}

impl core::fmt::Display for Service {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// The largest message the IBTA allows.
pub const MAX_MESSAGE_LEN: u64 = 1 << 31;

/// Path MTU: the largest payload of one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PathMtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes (rxe's default on a 1500-byte link).
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl PathMtu {
    /// Payload bytes per packet.
    pub const fn bytes(self) -> u32 {
        match self {
            PathMtu::Mtu256 => 256,
            PathMtu::Mtu512 => 512,
            PathMtu::Mtu1024 => 1024,
            PathMtu::Mtu2048 => 2048,
            PathMtu::Mtu4096 => 4096,
        }
    }

    /// The MTU for a byte count, if it is one of the five IBTA values.
    pub fn from_bytes(bytes: u32) -> Result<PathMtu, QpError> {
        Ok(match bytes {
            256 => PathMtu::Mtu256,
            512 => PathMtu::Mtu512,
            1024 => PathMtu::Mtu1024,
            2048 => PathMtu::Mtu2048,
            4096 => PathMtu::Mtu4096,
            _ => {
                return Err(QpError::InvalidAttribute {
                    name: "path_mtu",
                    value: bytes.into(),
                })
            }
        })
    }
}

/// Sizes a QP is created with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather elements per send request.
    pub max_send_sge: u32,
    /// Scatter/gather elements per receive request.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> QpCaps {
        QpCaps {
            max_send_wr: 1024,
            max_recv_wr: 1024,
            max_send_sge: 16,
            max_recv_sge: 16,
            max_inline_data: 256,
        }
    }
}

/// Attributes of RESET → INIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttr {
    /// Partition key index (ferroce has one partition, the default, at index 0).
    pub pkey_index: u16,
    /// Port number (1).
    pub port: u8,
    /// What remote peers may do through this QP: remote read, write, atomic.
    pub access: Access,
}

impl Default for InitAttr {
    fn default() -> InitAttr {
        InitAttr {
            pkey_index: 0,
            port: 1,
            access: Access::REMOTE_READ
                .with(Access::REMOTE_WRITE)
                .with(Access::REMOTE_ATOMIC),
        }
    }
}

/// Attributes of INIT → RTR (ready to receive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttr {
    /// Path MTU.
    pub path_mtu: PathMtu,
    /// The peer's QP number (24 bits).
    pub dest_qpn: u32,
    /// The peer's GID (an IPv4-mapped IPv6 address for RoCE v2 over IPv4).
    pub dest_gid: Ipv6Addr,
    /// The first PSN expected from the peer.
    pub rq_psn: Psn,
    /// How many READ/atomic requests the peer may have outstanding here.
    pub max_dest_rd_atomic: u8,
    /// Minimum RNR NAK timer code sent to the peer (0..=31, see the IBTA table).
    pub min_rnr_timer: u8,
}

/// Attributes of RTR → RTS (ready to send).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttr {
    /// The first PSN this QP sends.
    pub sq_psn: Psn,
    /// Local ACK timeout code: 4.096 µs × 2^timeout; 0 means wait forever.
    pub timeout: u8,
    /// Retransmissions after a timeout or sequence NAK before giving up (0..=7).
    pub retry_cnt: u8,
    /// Retries after an RNR NAK (0..=7; 7 means forever).
    pub rnr_retry: u8,
    /// How many READ/atomic requests this QP may have outstanding.
    pub max_rd_atomic: u8,
}

/// Most READ/atomic requests a QP may track in either direction.
pub const MAX_RD_ATOMIC: u8 = 16;

impl RtrAttr {
    pub(crate) fn validate(&self) -> Result<(), QpError> {
        if self.dest_qpn > 0x00ff_ffff {
            return Err(QpError::InvalidAttribute {
                name: "dest_qp_num",
                value: self.dest_qpn.into(),
            });
        }
        if self.max_dest_rd_atomic > MAX_RD_ATOMIC {
            return Err(QpError::InvalidAttribute {
                name: "max_dest_rd_atomic",
                value: self.max_dest_rd_atomic.into(),
            });
        }
        if self.min_rnr_timer > 31 {
            return Err(QpError::InvalidAttribute {
                name: "min_rnr_timer",
                value: self.min_rnr_timer.into(),
            });
        }
        Ok(())
    }
}

impl RtsAttr {
    pub(crate) fn validate(&self) -> Result<(), QpError> {
        if self.timeout > 31 {
            return Err(QpError::InvalidAttribute {
                name: "timeout",
                value: self.timeout.into(),
            });
        }
        if self.retry_cnt > 7 {
            return Err(QpError::InvalidAttribute {
                name: "retry_cnt",
                value: self.retry_cnt.into(),
            });
        }
        if self.rnr_retry > 7 {
            return Err(QpError::InvalidAttribute {
                name: "rnr_retry",
                value: self.rnr_retry.into(),
            });
        }
        if self.max_rd_atomic > MAX_RD_ATOMIC {
            return Err(QpError::InvalidAttribute {
                name: "max_rd_atomic",
                value: self.max_rd_atomic.into(),
            });
        }
        Ok(())
    }
}

/// The local ACK timeout a code stands for, `None` for code 0 (infinite).
pub fn ack_timeout(code: u8) -> Option<Duration> {
    if code == 0 {
        None
    } else {
        Some(Duration::from_nanos(4096u64 << code.min(31)))
    }
}

/// The RNR retry count that means "retry forever".
pub const RNR_RETRY_INFINITE: u8 = 7;
