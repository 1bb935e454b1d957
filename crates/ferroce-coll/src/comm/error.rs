//! Why a collective or the set-up failed.

use super::*;

/// Why a collective (or the set-up) failed.
#[derive(Debug, thiserror::Error)]
pub enum CollError {
    /// The rendezvous failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The caller's exchange (see [`Communicator::with_exchange`]) failed.
    #[error("the exchange of endpoints failed: {0}")]
    Exchange(String),
    /// A ferroce call failed.
    #[error("ferroce: {0}")]
    Verbs(#[from] ferroce::Error),
    /// No ferroce device fits.
    #[error("no ferroce device for {0}")]
    NoDevice(String),
    /// A rank's card does not parse, or was made with other options.
    #[error("rank {0} sent a card that does not fit: {1}")]
    BadCard(usize, String),
    /// A work request failed (the peer left, or refused the access).
    #[error("rank {rank}: {what} failed: {status:?}")]
    Transfer {
        /// The peer rank of the QP.
        rank: usize,
        /// What was under way.
        what: &'static str,
        /// The completion's status.
        status: WcStatus,
    },
    /// A peer called another collective, or the same one with other sizes, type, operator or
    /// root, or sent a message of another length or tag than this rank's receive.
    #[error(
        "rank {rank} called a different collective, or the same one with another size, type, \
         operator or root, or sent another length or tag than received here (call digest \
         {theirs:#06x}, ours {ours:#06x})"
    )]
    Mismatch {
        /// The peer rank.
        rank: usize,
        /// The digest of this rank's call.
        ours: u16,
        /// The digest the peer's message carried.
        theirs: u16,
    },
    /// A message arrived out of order (a bug, or a peer that is not a ferroce communicator).
    #[error("rank {rank} sent message {got} where {want} was due")]
    OutOfStep {
        /// The peer rank.
        rank: usize,
        /// The index received.
        got: u16,
        /// The index expected.
        want: u16,
    },
    /// Another rank's collective failed, and it said so.
    #[error("rank {rank} failed and aborted the collective")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
    },
    /// A peer stopped answering.
    #[error("no progress with rank {rank} within {timeout:?} ({what})")]
    Timeout {
        /// The peer rank.
        rank: usize,
        /// The deadline.
        timeout: Duration,
        /// What was awaited.
        what: &'static str,
    },
    /// The communicator was aborted ([`AbortHandle::abort`]) from another thread.
    #[error("the communicator was aborted")]
    Aborted,
    /// An earlier collective of this communicator failed.
    #[error("the communicator is broken by an earlier failure: {0}")]
    Broken(String),
    /// Buffers whose sizes do not fit the collective.
    #[error("{what} of {got} bytes, {want} expected")]
    Size {
        /// Which buffer.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The size the collective needs.
        want: usize,
    },
    /// A rank number outside the communicator (a root or a peer).
    #[error("rank {rank} named, but the communicator has {size} ranks")]
    BadRank {
        /// The number given.
        rank: usize,
        /// The communicator's size.
        size: usize,
    },
    /// A buffer that is not a whole number of elements.
    #[error(transparent)]
    Reduce(#[from] crate::reduce::ReduceError),
}
