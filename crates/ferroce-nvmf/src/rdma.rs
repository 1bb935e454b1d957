//! The queues on ferroce's verbs: the sans-IO queue ends ([`crate::queue`], [`crate::host`])
//! bound to RC queue pairs, registered buffers and completion channels.
//!
//! - [`exchange`]: how a ferroce host reaches a ferroce target's queue (over TCP, where the
//!   IB CM on the wire cannot reach: the processes of one host share its address);
//! - [`bounce`]: a target queue's bounce buffer (small slots per entry, a few large ones);
//! - [`target`]: the target's queues, a thread each, over a shared [`crate::controllers::Target`];
//! - [`wire`]: the target's queues connected through IB CM on the wire, as the Linux kernel's
//!   host connects them;
//! - [`initiator`]: the host's controller bring-up and I/O queues;
//! - [`wire_host`]: the host's queues connected through IB CM on the wire (kernel targets).

pub mod bounce;
pub mod exchange;
pub mod initiator;
pub mod target;
pub mod wire;
pub mod wire_host;

/// A starting PSN that a host off the path cannot guess, as rdma_cm draws its own at random:
/// a packet injected with a guessed PSN would otherwise be taken into a queue. From std's
/// `RandomState`, whose keys the standard library draws from the OS's random source.
pub(crate) fn random_psn() -> ferroce::Psn {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    ferroce::Psn::new(h.finish() as u32 & 0x00ff_ffff)
}
