//! The verbs layer: the objects an application holds, shaped like rdma-core's.
//!
//! | file | objects |
//! |---|---|
//! | `device` | [`Device`](crate::Device), [`Gid`](crate::Gid), device discovery |
//! | `context` | [`Context`](crate::Context) (an opened device) and the state its engine shares |
//! | `counters` | [`ContextCounters`](crate::ContextCounters) |
//! | `pd` | [`ProtectionDomain`](crate::ProtectionDomain): creates regions and QPs |
//! | `mr` | [`MemoryRegion`](crate::MemoryRegion), keys, the region table, the transport's view of memory |
//! | `cq` | [`CompletionQueue`](crate::CompletionQueue) |
//! | `channel` | [`CompletionChannel`](crate::CompletionChannel), and the spin before a wait on one |
//! | `qp` | [`QueuePair`](crate::QueuePair): states, posting, connecting |
//! | `qp_core` | a QP's state as the engine and the providers see it |
//! | `sender` | [`QpSender`](crate::QpSender): posting without the QP's lock |
//! | `srq` | [`SharedReceiveQueue`](crate::SharedReceiveQueue) |
//!
//! This layer checks what the application asks (states, capacities, protection domains) and
//! keeps each object's state; moving bytes is the providers' work. It reaches them only through
//! `crate::provider`, whose module doc is the contract between the two.

pub(crate) mod channel;
pub(crate) mod context;
pub(crate) mod counters;
pub(crate) mod cq;
pub(crate) mod device;
pub(crate) mod mr;
pub(crate) mod pd;
pub(crate) mod qp;
pub(crate) mod qp_core;
pub(crate) mod sender;
pub(crate) mod srq;
pub(crate) mod ud;
