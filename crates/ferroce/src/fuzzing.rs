//! For the fuzz targets in `fuzz/` only (the `fuzzing` feature, off by default): thin public
//! wrappers around the crate-private code that reads what peers control — the shared-memory
//! ring, the shared-memory hello, and the connection exchange's message decoder. Not an API:
//! nothing here is stable, and nothing but the fuzz targets should use it. Each wrapper only
//! forwards; the behaviour is the crate's own.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use crate::cm::{CmError, EndpointInfo, MessageKind, Phase};
use crate::provider::shm;

/// The peer broke a ring's format (the crate's `RingError`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingError;

/// A view of a single-producer, single-consumer ring of packets (see `provider::shm::ring`).
#[derive(Debug, Clone, Copy)]
pub struct Ring(shm::ring::Ring);

impl Ring {
    /// A view of a ring whose producer position is at `head`, consumer position at `tail` and
    /// `size` bytes (a multiple of 8, at least 64) at `data`.
    ///
    /// # Safety
    /// As the crate's `Ring::new`: the three areas must be valid, 8-aligned, disjoint and live
    /// for as long as the view (and every end made from it) is used.
    pub unsafe fn new(
        head: *const std::sync::atomic::AtomicU64,
        tail: *const std::sync::atomic::AtomicU64,
        data: *mut u8,
        size: usize,
    ) -> Ring {
        // SAFETY: the caller upholds the same contract.
        Ring(unsafe { shm::ring::Ring::new(head, tail, data, size) })
    }

    /// The largest packet a record can carry.
    pub fn max_packet(&self) -> usize {
        self.0.max_packet()
    }

    /// The producer's end, from the positions the page holds now.
    pub fn producer(self) -> Result<Producer, RingError> {
        self.0.producer().map(Producer).map_err(|_| RingError)
    }

    /// The consumer's end at position `tail`.
    pub fn consumer(self, tail: u64) -> Consumer {
        Consumer(self.0.consumer(tail))
    }
}

/// The producer's end of a [`Ring`].
#[derive(Debug)]
pub struct Producer(shm::ring::Producer);

impl Producer {
    /// Appends a packet; `Ok(false)` when there is no room.
    pub fn push(&mut self, pkt: &[u8]) -> Result<bool, RingError> {
        self.0.push(pkt).map_err(|_| RingError)
    }

    /// How many more records of up to `max_len` bytes fit now.
    pub fn room_for(&self, max_len: usize) -> Result<usize, RingError> {
        self.0.room_for(max_len).map_err(|_| RingError)
    }
}

/// The consumer's end of a [`Ring`].
#[derive(Debug)]
pub struct Consumer(shm::ring::Consumer);

impl Consumer {
    /// Takes the next packet into `out`: its length, `Ok(None)` when empty.
    pub fn pop(&mut self, out: &mut [u8]) -> Result<Option<usize>, RingError> {
        self.0.pop(out).map_err(|_| RingError)
    }

    /// The consumer's own (private) position.
    pub fn tail(&self) -> u64 {
        self.0.tail
    }
}

/// `(to, from)` of a shared-memory hello, or `None` (the crate's `parse_hello`).
pub fn shm_parse_hello(msg: &[u8]) -> Option<(u32, u32)> {
    shm::parse_hello(msg)
}

/// The shared-memory hello of QP `from` linking to QP `to` (the crate's `hello`).
pub fn shm_hello(from: u32, to: u32) -> [u8; 16] {
    shm::hello(from, to)
}

/// The connection exchange's `ENDPOINTS` message for `list` (1..=`MAX_ENDPOINTS` entries).
pub fn cm_encode_endpoints(list: &[EndpointInfo]) -> Vec<u8> {
    crate::cm::encode_endpoints(list)
}

/// Decodes one connection-exchange message of kind `expected` from `bytes`, as a connection
/// reads it from its stream: `Err(CmError::Closed)` where the bytes end before the message.
/// Also returns how many bytes the decoder consumed.
pub fn cm_read_message(
    bytes: &[u8],
    expected: MessageKind,
) -> (Result<Vec<EndpointInfo>, CmError>, usize) {
    let peer = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1));
    let mut at = 0;
    let r = crate::cm::read_message(peer, expected, &mut |buf: &mut [u8]| {
        let end = at + buf.len();
        if end > bytes.len() {
            return Err(CmError::Closed {
                peer,
                phase: Phase::Exchange,
            });
        }
        buf.copy_from_slice(&bytes[at..end]);
        at = end;
        Ok(())
    });
    (r, at)
}
