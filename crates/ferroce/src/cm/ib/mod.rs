//! IB connection management on the wire: what the Linux kernel's `ib_cm` and `rdma_cm` speak
//! to connect queue pairs through QP1, so that ferroce connects with kernel peers (rxe, NICs)
//! in both roles.
//!
//! - [`manager`]: the protocol as a sans-IO state machine (REQ/REP/RTU, REJ, MRA, DREQ/DREP,
//!   SIDR), with its retries and duplicate handling; the message formats are
//!   [`ferroce_wire::cm`].
//! - [`ip`]: rdma_cm's service IDs and the IP header it puts in a REQ's private data.
//! - [`agent`]: a thread that drives a manager over any [`agent::MadPort`].
//! - [`gsi`]: a [`agent::MadPort`] on a ferroce [`crate::Context`]'s QP1.
//!
//! The TCP exchange of [`crate::cm`] stays for ferroce peers that cannot be reached as QP1:
//! processes of one host share an IP address, and only the one on port 4791 is QP1 to the
//! world (see [`crate::host_slot`]).

pub mod agent;
pub mod gsi;
pub mod ip;
pub mod manager;
#[cfg(test)]
mod tests;

pub use agent::{CmAgent, EventSink, MadPort};
pub use gsi::GsiPort;
pub use manager::{
    cm_time, AcceptParams, CmEvent, CmManager, CommandError, ConnId, ConnectParams, Outgoing,
};
