//! The RoCE connected transports, reliable (RC) and unreliable (UC, see [`uc`]), as a
//! deterministic, sans-IO state machine.
//!
//! A [`QueuePair`] is driven by its caller: work requests and packets go in with the current
//! time, packets and completions come out, and [`QueuePair::next_timeout`] says when to come
//! back. Nothing here reads a clock, touches a socket or starts a thread, so the same code runs
//! under the UDP provider and in the [`sim`] simulator, where thousands of seeded lossy
//! scenarios run in seconds and any failure replays from its seed.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod attr;
pub mod cc;
pub mod completion;
pub mod counters;
pub mod dcqcn;
mod emit;
pub mod memory;
pub mod pacer;
pub mod qp;
pub mod reorder;
pub mod requester;
pub mod responder;
pub mod rtt;
pub mod sack;
pub mod sim;
pub mod time;
pub mod uc;
pub mod wr;

pub use attr::{InitAttr, PathMtu, PostError, QpCaps, QpError, RtrAttr, RtsAttr, Service};
pub use cc::{CcAlgorithm, CcConfig};
pub use completion::{WcOpcode, WcStatus, WorkCompletion};
pub use counters::Counters;
pub use memory::{Access, AtomicOp, KeyKind, Memory, MemoryError, Sge, VecMemory};
pub use qp::{QpState, QueuePair, UNASKED_RUN};
pub use time::Instant;
pub use wr::{RecvWr, SendFlags, SendOp, SendWr};
