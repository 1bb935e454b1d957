//! How a communicator is made.

use super::*;

/// How a communicator is made.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// How long a collective may go without progress (no message, no credit, no completion)
    /// before it fails.
    pub timeout: Duration,
    /// Bytes of one inbox slot: the largest message, and the unit of pipelining.
    pub slot_bytes: usize,
    /// Slots per peer: how many messages may be in flight to one peer.
    pub slots: usize,
    /// Allreduces up to this many bytes use recursive doubling (latency: `log2 n` exchanges)
    /// and broadcasts a binomial tree; larger ones a pipelined ring or chain (bandwidth).
    pub small_bytes: usize,
    /// Which provider carries the ranks' QPs (shared memory on one host, UDP between hosts).
    pub provider: Provider,
    /// The ferroce device to open; by default the one holding the address this host reaches
    /// the master from.
    pub device: Option<String>,
}

impl Default for CommOptions {
    fn default() -> CommOptions {
        CommOptions {
            timeout: Duration::from_secs(30),
            slot_bytes: 1 << 20,
            slots: 4,
            small_bytes: 64 << 10,
            provider: Provider::Auto,
            device: None,
        }
    }
}
