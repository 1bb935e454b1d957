//! Everything that can go wrong in an exchange, each naming the field, message or step.

use std::fmt;
use std::io;
use std::net::{Ipv6Addr, SocketAddr};
use std::time::Duration;

use ferroce_proto::attr::MAX_RD_ATOMIC;
use thiserror::Error;

use super::MAX_ENDPOINTS;

/// What is wrong with one endpoint record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum EndpointProblem {
    /// The QP number does not fit in 24 bits.
    #[error("QP number {0:#x}, beyond 24 bits")]
    Qpn(u32),
    /// The PSN does not fit in 24 bits.
    #[error("PSN {0:#x}, beyond 24 bits")]
    Psn(u32),
    /// The GID cannot be sent to: unspecified or multicast.
    #[error("GID {0}, which is unspecified or multicast")]
    Gid(Ipv6Addr),
    /// UDP port 0, which nothing can listen on.
    #[error("UDP port 0")]
    UdpPort,
    /// The path MTU is not one of the five IBTA values.
    #[error("path MTU {0}, not one of 256, 512, 1024, 2048, 4096")]
    Mtu(u16),
    /// More READ/atomic depth than a ferroce QP can track.
    #[error("max_rd_atomic {0}, above the limit of {MAX_RD_ATOMIC}")]
    MaxRdAtomic(u8),
    /// Flag bits this version does not define.
    #[error("unknown flags {0:#04x}")]
    Flags(u8),
    /// A reserved byte is not zero.
    #[error("non-zero reserved byte at offset {0} of the record")]
    Reserved(usize),
    /// Region fields are set although the region flag is clear.
    #[error("region fields set without the region flag")]
    StrayRegion,
    /// A record of another length than `ENDPOINT_LEN`.
    #[error("an endpoint record of {0} bytes")]
    Length(usize),
    /// The region runs past the end of the 64-bit address space.
    #[error("region of {len} bytes at {addr:#x}, which runs past 2^64")]
    RegionWraps {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
}

/// The kinds of message the protocol has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// A list of endpoint records.
    Endpoints,
    /// "My QPs are ready to receive."
    Ready,
}

impl MessageKind {
    /// The kind byte on the wire.
    pub const fn code(self) -> u8 {
        match self {
            MessageKind::Endpoints => 1,
            MessageKind::Ready => 2,
        }
    }

    fn from_code(code: u8) -> Option<MessageKind> {
        match code {
            1 => Some(MessageKind::Endpoints),
            2 => Some(MessageKind::Ready),
            _ => None,
        }
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MessageKind::Endpoints => "ENDPOINTS",
            MessageKind::Ready => "READY",
        })
    }
}

/// Which step an error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Sending or receiving endpoint parameters.
    Exchange,
    /// Sending or waiting for the ready signal.
    Sync,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Exchange => "while exchanging endpoint parameters",
            Phase::Sync => "while waiting for the ready signal",
        })
    }
}

/// Why a connection-management operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CmError {
    /// The listening socket could not be created or failed while accepting (address in use,
    /// not a local address, out of file descriptors).
    #[error("listening on {addr} failed: {source}")]
    Listen {
        /// The address listened on.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// Nothing listens at the address: the peer is not running yet, or the port is wrong.
    #[error("connection to {addr} refused: is the peer listening there?")]
    Refused {
        /// The address connected to.
        addr: SocketAddr,
    },
    /// The TCP connection was not established in time (host down, SYNs dropped).
    #[error("could not connect to {addr} within {timeout:?}")]
    ConnectTimeout {
        /// The address connected to.
        addr: SocketAddr,
        /// The caller's timeout.
        timeout: Duration,
    },
    /// The TCP connection failed for another reason (network unreachable, ...).
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address connected to.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// No peer connected before the timeout.
    #[error("no peer connected to {local} within {timeout:?}")]
    AcceptTimeout {
        /// The address listened on.
        local: SocketAddr,
        /// The caller's timeout.
        timeout: Duration,
    },
    /// The peer is connected but did not send (or did not take) a whole message in time.
    #[error("peer {peer} did not answer within {timeout:?} {phase}")]
    Timeout {
        /// The peer.
        peer: SocketAddr,
        /// The caller's timeout.
        timeout: Duration,
        /// What was going on.
        phase: Phase,
    },
    /// The peer closed or reset the connection, typically because it failed or gave up.
    #[error("peer {peer} closed the connection {phase}")]
    Closed {
        /// The peer.
        peer: SocketAddr,
        /// What was going on.
        phase: Phase,
    },
    /// Another socket error.
    #[error("network error with peer {peer} {phase}: {source}")]
    Io {
        /// The peer.
        peer: SocketAddr,
        /// What was going on.
        phase: Phase,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// The peer does not speak this protocol at all.
    #[error(
        "peer {peer} does not speak ferroce CM: it sent {got:02x?} where \"FRCE\" was expected"
    )]
    BadMagic {
        /// The peer.
        peer: SocketAddr,
        /// The four bytes received instead of the magic.
        got: [u8; 4],
    },
    /// The peer speaks another version of this protocol.
    #[error("peer {peer} speaks ferroce CM version {got}, this is version {supported}")]
    Version {
        /// The peer.
        peer: SocketAddr,
        /// The peer's version.
        got: u8,
        /// The version this side speaks.
        supported: u8,
    },
    /// The peer sent a different kind of message than this step expects (for example one side
    /// called `sync` while the other called `exchange`), or an unknown kind.
    #[error("peer {peer} sent a message of kind {got} ({}), expected {expected}", kind_name(*.got))]
    UnexpectedMessage {
        /// The peer.
        peer: SocketAddr,
        /// The kind byte received.
        got: u8,
        /// The kind expected.
        expected: MessageKind,
    },
    /// The header's entry count is out of range for its kind.
    #[error("peer {peer} sent a {kind} message with {got} entries; allowed: {}", count_rule(*.kind))]
    BadCount {
        /// The peer.
        peer: SocketAddr,
        /// The message kind.
        kind: MessageKind,
        /// The count received.
        got: u16,
    },
    /// The header's body length does not match its count.
    #[error("peer {peer} sent a {kind} message with a {got}-byte body, expected {expected} bytes")]
    BadLength {
        /// The peer.
        peer: SocketAddr,
        /// The message kind.
        kind: MessageKind,
        /// The length received.
        got: u32,
        /// The length its count implies.
        expected: u32,
    },
    /// The two sides sent different numbers of endpoints.
    #[error(
        "peer {peer} sent {remote} endpoints but this side sent {local}; both must send the same number"
    )]
    CountMismatch {
        /// The peer.
        peer: SocketAddr,
        /// Endpoints this side sent.
        local: usize,
        /// Endpoints the peer sent.
        remote: usize,
    },
    /// One of the peer's endpoint records is invalid.
    #[error("peer {peer} sent an invalid endpoint #{index}: {problem}")]
    InvalidPeerEndpoint {
        /// The peer.
        peer: SocketAddr,
        /// Position of the record in the message, from 0.
        index: usize,
        /// What is wrong with it.
        problem: EndpointProblem,
    },
    /// One of the caller's own endpoints is invalid; nothing was sent.
    #[error("local endpoint #{index} is invalid: {problem}")]
    InvalidLocalEndpoint {
        /// Position in the caller's slice.
        index: usize,
        /// What is wrong with it.
        problem: EndpointProblem,
    },
    /// The caller passed no endpoints or more than [`MAX_ENDPOINTS`]; nothing was sent.
    #[error("{count} local endpoints given; 1 to {MAX_ENDPOINTS} can be exchanged")]
    LocalCount {
        /// The number given.
        count: usize,
    },
}

pub(super) fn kind_name(code: u8) -> &'static str {
    match MessageKind::from_code(code) {
        Some(MessageKind::Endpoints) => "ENDPOINTS",
        Some(MessageKind::Ready) => "READY",
        None => "unknown",
    }
}

pub(super) fn count_rule(kind: MessageKind) -> &'static str {
    match kind {
        MessageKind::Endpoints => "1 to 1024",
        MessageKind::Ready => "0",
    }
}
