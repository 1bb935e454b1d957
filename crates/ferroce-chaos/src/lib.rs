//! A chaos relay for RoCE v2 traffic between two ferroce peers.
//!
//! Real networks lose, reorder, duplicate, corrupt and delay packets, and links go dark for a
//! while. The reliable-connection transport must hide all of it — every operation exactly once,
//! data intact — or report a transport error when the network is gone for longer than its retry
//! budget. This crate puts those faults between two real processes on real UDP sockets:
//!
//! ```text
//!  client ──cm/TCP──► relay ──cm/TCP──► server        (endpoint addresses rewritten)
//!  client ◄─RoCE/UDP─► relay ◄─RoCE/UDP─► server      (faults injected both ways)
//! ```
//!
//! The client connects to the relay as if it were the server; nothing else changes on either
//! side. [`Faults`] says what happens to packets (seeded), [`Relay`] runs it, and
//! [`Relay::stats`] tells what was done. `ferroce chaos` runs a relay standalone and
//! `ferroce perf ... --chaos SPEC` puts one between its two peers.
//!
//! ```
//! use ferroce_chaos::{Faults, Relay};
//! let faults: Faults = "loss=0.05,reorder=0.05,duplicate=0.02,corrupt=0.01,seed=7".parse()?;
//! let server = std::net::TcpListener::bind("127.0.0.1:0")?; // a ferroce cm::Listener in practice
//! let relay = Relay::start("127.0.0.1:0".parse()?, server.local_addr()?, faults)?;
//! assert_ne!(relay.cm_addr().port(), 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

mod faults;
mod relay;

pub use faults::{Blackhole, Dice, Fate, Faults, FaultsError};
pub use relay::{DirectionStats, Relay, RelayStats};
