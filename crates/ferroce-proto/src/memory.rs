//! How the transport reaches memory: a small trait the driver implements.
//!
//! The transport never touches memory directly. It asks the [`Memory`] it is given to check a
//! key, its bounds and access rights, and to copy or apply an atomic. The same transport then
//! serves the simulator (with [`VecMemory`]), the UDP provider and anything later.

use thiserror::Error;

/// A scatter/gather element: `length` bytes at `addr` in the region of `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sge {
    /// Virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region.
    pub lkey: u32,
}

/// Access rights of a memory region (the bits of rdma-core's `ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// Local write (needed to receive into, and for READ/atomic results).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote write.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote read.
    pub const REMOTE_READ: Access = Access(4);
    /// Remote atomic.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// No rights beyond local read.
    pub const NONE: Access = Access(0);
    /// Every right.
    pub const ALL: Access = Access(15);

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Rights from raw bits (unknown bits are dropped).
    pub const fn from_bits(bits: u32) -> Access {
        Access(bits & 15)
    }
    /// Union.
    pub const fn with(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }
    /// Whether every right of `other` is present.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

/// Which kind of key is presented: local keys come from the QP's own work requests, remote keys
/// from packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// An lkey.
    Local,
    /// An rkey.
    Remote,
}

/// Why a memory access was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum MemoryError {
    /// No region has this key (or the key is stale, or belongs to another protection domain).
    #[error("invalid key 0x{0:08x}")]
    InvalidKey(u32),
    /// The range falls outside the region.
    #[error("range 0x{addr:x}+{len} out of bounds")]
    OutOfBounds {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The region lacks the right.
    #[error("access not permitted")]
    AccessDenied,
    /// An atomic's address is not 8-byte aligned.
    #[error("misaligned atomic at 0x{0:x}")]
    Misaligned(u64),
}

/// The atomic operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Store `swap` if the value equals `compare`.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Add `add`.
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

impl AtomicOp {
    /// The value the target word holds after the operation, given the value it held before.
    pub const fn apply(self, old: u64) -> u64 {
        match self {
            AtomicOp::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            AtomicOp::FetchAdd { add } => old.wrapping_add(add),
        }
    }
}

/// Memory as the transport needs it. Every call checks key, protection domain, bounds and the
/// `need`ed access before touching a byte; a refused call changes nothing.
pub trait Memory {
    /// Copies `out.len()` bytes at `addr` of the region of `key` into `out`.
    fn read(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        out: &mut [u8],
        need: Access,
    ) -> Result<(), MemoryError>;
    /// Copies `data` to `addr` of the region of `key`.
    fn write(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        data: &[u8],
        need: Access,
    ) -> Result<(), MemoryError>;
    /// Checks a remote access of `len` bytes without performing it (for a WRITE's RETH, checked
    /// once for the whole message).
    fn check(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(), MemoryError>;
    /// Applies an atomic to the 8 bytes at `addr` (big-endian on the wire, native in memory) and
    /// returns the value found there.
    fn atomic(&mut self, pd: u32, rkey: u32, addr: u64, op: AtomicOp) -> Result<u64, MemoryError>;
    /// Invalidates the remote key (SEND with invalidate).
    fn invalidate(&mut self, pd: u32, rkey: u32) -> Result<(), MemoryError>;
}

/// One region of a [`VecMemory`].
#[derive(Debug, Clone)]
pub struct VecRegion {
    /// Protection domain.
    pub pd: u32,
    /// Virtual address of the first byte.
    pub base: u64,
    /// Contents.
    pub bytes: Vec<u8>,
    /// Rights.
    pub access: Access,
    /// Local key.
    pub lkey: u32,
    /// Remote key (0 when invalidated).
    pub rkey: u32,
}

/// A simple [`Memory`] over owned vectors, for the simulator and tests.
#[derive(Debug, Clone, Default)]
pub struct VecMemory {
    regions: Vec<VecRegion>,
}

impl VecMemory {
    /// An empty memory.
    pub fn new() -> VecMemory {
        VecMemory::default()
    }

    /// Registers a region of `len` zero bytes at `base`; returns its index. Keys are derived from
    /// the index so they are unique: lkey = index << 8 | 0x11, rkey = index << 8 | 0x22.
    pub fn register(&mut self, pd: u32, base: u64, len: usize, access: Access) -> usize {
        let i = self.regions.len();
        let tag = (i as u32) << 8;
        self.regions.push(VecRegion {
            pd,
            base,
            bytes: vec![0; len],
            access,
            lkey: tag | 0x11,
            rkey: tag | 0x22,
        });
        i
    }

    /// Region `i`.
    pub fn region(&self, i: usize) -> &VecRegion {
        &self.regions[i]
    }

    /// Region `i`, writable (the test's own access, as an application's CPU would).
    pub fn region_mut(&mut self, i: usize) -> &mut VecRegion {
        &mut self.regions[i]
    }

    fn find(&mut self, pd: u32, kind: KeyKind, key: u32) -> Result<&mut VecRegion, MemoryError> {
        self.regions
            .iter_mut()
            .find(|r| {
                r.pd == pd
                    && key != 0
                    && (if kind == KeyKind::Local {
                        r.lkey
                    } else {
                        r.rkey
                    }) == key
            })
            .ok_or(MemoryError::InvalidKey(key))
    }

    fn locate(r: &VecRegion, addr: u64, len: u64, need: Access) -> Result<usize, MemoryError> {
        if !r.access.contains(need) {
            return Err(MemoryError::AccessDenied);
        }
        let off = addr
            .checked_sub(r.base)
            .ok_or(MemoryError::OutOfBounds { addr, len })?;
        let end = off
            .checked_add(len)
            .ok_or(MemoryError::OutOfBounds { addr, len })?;
        if end > r.bytes.len() as u64 {
            return Err(MemoryError::OutOfBounds { addr, len });
        }
        Ok(off as usize)
    }
}

impl Memory for VecMemory {
    fn read(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        out: &mut [u8],
        need: Access,
    ) -> Result<(), MemoryError> {
        let r = self.find(pd, kind, key)?;
        let off = Self::locate(r, addr, out.len() as u64, need)?;
        out.copy_from_slice(&r.bytes[off..off + out.len()]);
        Ok(())
    }

    fn write(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        data: &[u8],
        need: Access,
    ) -> Result<(), MemoryError> {
        let r = self.find(pd, kind, key)?;
        let off = Self::locate(r, addr, data.len() as u64, need)?;
        r.bytes[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn check(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(), MemoryError> {
        let r = self.find(pd, kind, key)?;
        Self::locate(r, addr, len, need).map(|_| ())
    }

    fn atomic(&mut self, pd: u32, rkey: u32, addr: u64, op: AtomicOp) -> Result<u64, MemoryError> {
        let r = self.find(pd, KeyKind::Remote, rkey)?;
        let off = Self::locate(r, addr, 8, Access::REMOTE_ATOMIC)?;
        if addr % 8 != 0 {
            return Err(MemoryError::Misaligned(addr));
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(&r.bytes[off..off + 8]);
        let old = u64::from_ne_bytes(w);
        let new = op.apply(old);
        r.bytes[off..off + 8].copy_from_slice(&new.to_ne_bytes());
        Ok(old)
    }

    fn invalidate(&mut self, pd: u32, rkey: u32) -> Result<(), MemoryError> {
        let r = self.find(pd, KeyKind::Remote, rkey)?;
        r.rkey = 0;
        Ok(())
    }
}
