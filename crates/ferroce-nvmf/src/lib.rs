//! NVMe over Fabrics over ferroce (issue #33): the RDMA transport of NVMe-oF 1.1 and the
//! NVMe base specification's commands, for a target the Linux kernel's initiator connects to
//! and an initiator that reaches the kernel's target.
//!
//! This crate is built in layers, as the rest of ferroce is; each is sans-IO and tested alone:
//! - the wire: a command capsule's 64-byte submission entry ([`command`]), its data pointer
//!   ([`sgl`]: a keyed SGL data block the controller moves with RDMA READ or WRITE, or data in
//!   the capsule), the 16-byte completion entry ([`completion`]) and its status codes; the
//!   Fabrics commands (Connect, Property Get/Set: [`fabrics`]); the private data rdma_cm
//!   carries when a queue connects ([`cm`]);
//! - the controller's parts: its registers ([`properties`]), Identify ([`identify`]), the
//!   I/O commands ([`io`]) on namespaces over a file, a block device or memory
//!   ([`namespace`]);
//! - a target's controllers ([`controllers`]): Connect, admin commands, keep-alive, the discovery
//!   controller and its log ([`discovery`]);
//! - a queue of the target over RDMA ([`queue`]): what each capsule asks the transport to
//!   move (RDMA READ, RDMA WRITE, the response's SEND with or without Invalidate);
//! - a queue of the host ([`host`]): command IDs, submission queue room, responses matched;
//!   the two queue ends run against each other in seeded simulations (`tests/sim.rs`);
//! - the queues on ferroce's verbs ([`rdma`]): the target's queue threads and the host's
//!   controller and I/O queues, which `ferroce nvmf-target` and `ferroce nvmf-perf` run.
//!
//! Everything read from the wire is checked before use: a malformed capsule or descriptor is
//! an error value (which the controller answers with the status the specification names),
//! never a panic.
#![warn(missing_docs)]

pub mod cm;
pub mod command;
pub mod completion;
pub mod controllers;
pub mod discovery;
pub mod fabrics;
pub mod host;
pub mod identify;
pub mod io;
pub mod namespace;
pub mod properties;
pub mod queue;
pub mod rdma;
pub mod sgl;

/// What a byte string from the wire failed to be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the structure's size.
    #[error("{what}: {got} bytes, {need} needed")]
    Short {
        /// The structure.
        what: &'static str,
        /// Bytes present.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// A field holds a value the specification does not define (or this side does not take).
    #[error("{what}: {value:#x} is not a valid value")]
    Invalid {
        /// The field.
        what: &'static str,
        /// Its value.
        value: u64,
    },
}

/// The little-endian integers NVMe structures are made of.
pub(crate) mod le {
    pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }
    pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
    }
    pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
    }
    pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

/// Checks that `b` holds at least `need` bytes of `what`.
pub(crate) fn need(b: &[u8], need: usize, what: &'static str) -> Result<(), WireError> {
    if b.len() < need {
        Err(WireError::Short {
            what,
            got: b.len(),
            need,
        })
    } else {
        Ok(())
    }
}
