//! The errors of the verbs API.

use std::io;

use ferroce_proto::{PostError, QpError};
use thiserror::Error;

/// Why a verbs call failed.
#[derive(Debug, Error)]
pub enum Error {
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// No device with that name, or no address at that GID index.
    #[error("no such device: {0}")]
    NoDevice(String),
    /// An argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A queue-pair transition or attribute was refused.
    #[error(transparent)]
    Qp(#[from] QpError),
    /// A work request could not be posted.
    #[error(transparent)]
    Post(#[from] PostError),
    /// A range outside a memory region.
    #[error("range {offset}+{len} is outside the {region_len}-byte memory region")]
    OutOfBounds {
        /// Start of the range.
        offset: usize,
        /// Its length.
        len: usize,
        /// The region's length.
        region_len: usize,
    },
    /// The memory-region table is full (2^24 regions).
    #[error("too many memory regions")]
    TooManyRegions,
    /// More completions arrived than the completion queue holds; none were lost, but the
    /// application must poll more often or size the queue larger.
    #[error("completion queue overflow: more than {0} completions were waiting")]
    CqOverflow(usize),
    /// An object from another context or protection domain was used.
    #[error("{0} belongs to another context or protection domain")]
    Mismatch(&'static str),
}

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

/// Result type of the verbs API.
pub type Result<T> = std::result::Result<T, Error>;
