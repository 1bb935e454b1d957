//! For the fuzz targets in `fuzz/` only (the `fuzzing` feature, off by default): thin public
//! wrappers around the rendezvous' crate-private readers of what a connection sends — rank 0's
//! reading of a hello, the length-prefixed message reader, and a rank's reading of rank 0's
//! table. Not an API: nothing here is stable, and nothing but the fuzz targets should use it.
//! Each wrapper only forwards; the behaviour is the crate's own.

use std::io::Read;

use crate::store::{self, RendezvousStats, Step, StoreError};

/// What rank 0 made of a connection's bytes after one read step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelloStep {
    /// More bytes are due.
    Wait,
    /// Closed: the counter it went to, as the one field set to 1.
    Drop(RendezvousStats),
    /// A whole hello: rank, world size, token.
    Hello(usize, usize, Vec<u8>),
}

/// Rank 0's step on a pending connection: reads what `r` has (until it would block) into
/// `buf`, the hello's bytes so far, and judges them.
pub fn hello_step(buf: &mut Vec<u8>, r: &mut impl Read) -> HelloStep {
    match store::step_hello(buf, r) {
        Step::Wait => HelloStep::Wait,
        Step::Drop(counter) => {
            let mut stats = RendezvousStats::default();
            *counter(&mut stats) += 1;
            HelloStep::Drop(stats)
        }
        Step::Hello(rank, size, token) => HelloStep::Hello(rank, size, token),
    }
}

/// A rank's hello as it sends it.
pub fn hello(rank: u32, world_size: u32, token: &[u8]) -> Vec<u8> {
    store::hello(rank, world_size, token)
}

/// Reads one length-prefixed message of at most `max` bytes.
pub fn read_msg(r: &mut impl Read, max: usize) -> std::io::Result<Vec<u8>> {
    store::read_msg(r, max)
}

/// A rank's reading of rank 0's table for exchange `round` in a world of `n`.
pub fn parse_table(t: &[u8], round: &[u8; 8], n: usize) -> Result<Vec<Vec<u8>>, StoreError> {
    store::parse_table(t, round, n)
}
