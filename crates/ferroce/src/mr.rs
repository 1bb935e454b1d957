//! Memory regions: buffers a peer may read, write or apply atomics to.
//!
//! # Why regions are reached only through copies
//! A remote peer may write a registered region at any moment. Handing the application a
//! `&mut [u8]` (or even `&[u8]`) into it would let the engine thread write bytes that safe Rust
//! believes nobody else touches: undefined behaviour. So a region's bytes are reached only under
//! its lock, by [`MemoryRegion::read`], [`MemoryRegion::write`] and friends, which copy; the
//! engine takes the same lock for each packet it places. The lock is uncontended in the common
//! case (one acquisition per packet or per application access).
//!
//! # Keys
//! lkey and rkey are equal: a 24-bit table index and an 8-bit generation that rotates each time
//! the slot is reused, so a stale or guessed key does not reach a newer region. Generation 0 is
//! never used, so key 0 is always invalid.
//!
//! # Where the bytes live
//! Regions ferroce allocates ([`crate::ProtectionDomain::alloc_mr`]) are memfds mapped shared,
//! page-aligned, so a same-host peer can map them and WRITE, READ or apply atomics with no code
//! running here (see `shm`). Such a peer's copies do not take this side's lock — like a NIC's
//! DMA — which is why the bytes are never handed out as references, and why atomics here are
//! CPU atomics too. Caller memory ([`crate::ProtectionDomain::register_raw`]) cannot be mapped by
//! a peer: requests on it are served by this context's engine, under the lock.
//!
//! # Deregistration
//! Dropping a [`MemoryRegion`] removes its key at once, so no new access can start; the memory
//! itself lives until the last in-flight access (which holds a reference) finishes.

use std::ptr::NonNull;
use std::sync::{Arc, RwLock};

use ferroce_proto::memory::{Access, AtomicOp, KeyKind, Memory, MemoryError};
use ferroce_proto::Sge;

use crate::context::ContextInner;
use crate::error::{Error, Result};
use crate::shm::map::SharedMap;

/// Where a region's bytes come from.
#[derive(Debug)]
enum Backing {
    /// A memfd ferroce created and maps (a same-host peer may map it too); unmapped on drop.
    Shared(SharedMap),
    /// The caller's memory (registered with `unsafe`); not freed by ferroce.
    Borrowed,
}

/// A registered region's bytes and attributes.
#[derive(Debug)]
pub(crate) struct MrInner {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    pub(crate) access: Access,
    pub(crate) pd: u32,
    /// Serialises every access to the bytes (see the module doc). Holds `true` once the region
    /// is deregistered: an access that looked the key up just before deregistration and takes
    /// the lock just after finds it revoked and touches nothing.
    lock: RwLock<bool>,
}

// SAFETY: the region's bytes are only touched while holding `lock` (readers share it, writers
// exclude), so moving or sharing the handle between threads cannot create a data race; the
// pointer stays valid for the life of the value (mapped pages are unmapped in Drop, borrowed
// memory is valid by the contract of `ProtectionDomain::register_raw`).
unsafe impl Send for MrInner {}
// SAFETY: see `Send`.
unsafe impl Sync for MrInner {}

impl MrInner {
    /// Maps `len` zeroed, page-aligned bytes in a fresh memfd.
    pub(crate) fn map(len: usize, access: Access, pd: u32) -> Result<MrInner> {
        let map = SharedMap::create("ferroce-mr", len)
            .map_err(|e| Error::io(format!("allocating a {len}-byte memory region"), e))?;
        let ptr = NonNull::new(map.ptr())
            .ok_or_else(|| Error::InvalidArgument("mmap returned null".into()))?;
        Ok(MrInner {
            ptr,
            len,
            backing: Backing::Shared(map),
            access,
            pd,
            lock: RwLock::new(false),
        })
    }

    /// The memfd holding the bytes and its inode, for regions ferroce allocated.
    pub(crate) fn shared_file(&self) -> Option<(i32, u64)> {
        match &self.backing {
            Backing::Shared(m) => Some((m.fd(), m.inode())),
            Backing::Borrowed => None,
        }
    }

    /// Runs `f` on a pointer to `offset..offset + len` of the region, under its lock (shared
    /// for reading, exclusive for writing), unless the range is outside or the region revoked.
    /// `f` must stay inside those `len` bytes and must not keep the pointer.
    pub(crate) fn with_range<R>(
        &self,
        offset: usize,
        len: usize,
        writing: bool,
        f: impl FnOnce(*mut u8) -> R,
    ) -> Result<R> {
        self.check(offset, len)?;
        let (r, w);
        let revoked = if writing {
            w = self.lock.write().unwrap_or_else(|e| e.into_inner());
            *w
        } else {
            r = self.lock.read().unwrap_or_else(|e| e.into_inner());
            *r
        };
        if revoked {
            return Err(self.revoked());
        }
        // SAFETY: `offset + len <= self.len` was checked, so the pointer is inside the region.
        Ok(f(unsafe { self.ptr.as_ptr().add(offset) }))
    }

    /// Wraps caller memory.
    ///
    /// # Safety
    /// See `ProtectionDomain::register_raw`.
    pub(crate) unsafe fn borrowed(
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
        pd: u32,
    ) -> MrInner {
        MrInner {
            ptr,
            len,
            backing: Backing::Borrowed,
            access,
            pd,
            lock: RwLock::new(false),
        }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }

    /// Deregistration: waits for the accesses under way (they hold the lock), then makes every
    /// later one fail. After it returns, the bytes are never touched again — what
    /// `register_raw`'s contract promises the caller, whose memory may be freed next.
    pub(crate) fn revoke(&self) {
        *self.lock.write().unwrap_or_else(|e| e.into_inner()) = true;
    }

    fn revoked(&self) -> Error {
        Error::InvalidArgument("the memory region is deregistered".into())
    }

    pub(crate) fn copy_out(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        let g = self.lock.read().unwrap_or_else(|e| e.into_inner());
        if *g {
            return Err(self.revoked());
        }
        // SAFETY: the range was checked to lie in the region, the lock excludes writers, and
        // `out` is a distinct live buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    pub(crate) fn copy_in(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        let g = self.lock.write().unwrap_or_else(|e| e.into_inner());
        if *g {
            return Err(self.revoked());
        }
        // SAFETY: the range was checked, the write lock excludes every other access, and
        // `data` is a distinct live buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    pub(crate) fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check(offset, len)?;
        let g = self.lock.write().unwrap_or_else(|e| e.into_inner());
        if *g {
            return Err(self.revoked());
        }
        // SAFETY: checked range, exclusive lock.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), byte, len) };
        Ok(())
    }

    pub(crate) fn atomic(&self, offset: usize, op: AtomicOp) -> Result<u64> {
        self.check(offset, 8)?;
        let g = self.lock.write().unwrap_or_else(|e| e.into_inner());
        if *g {
            return Err(self.revoked());
        }
        let p = self.ptr.as_ptr().wrapping_add(offset);
        if p as usize % 8 == 0 {
            // SAFETY: checked range, 8-aligned; a same-host peer may apply its own CPU atomics
            // to this word concurrently, so this must be one too.
            let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(p.cast()) };
            return Ok(apply_atomic(word, op));
        }
        // SAFETY: checked range, exclusive lock; the transport refuses misaligned atomics, so
        // this path serves only local callers.
        let old = unsafe { std::ptr::read_unaligned(p.cast::<u64>()) };
        // SAFETY: as above.
        unsafe { std::ptr::write_unaligned(p.cast::<u64>(), op.apply(old)) };
        Ok(old)
    }
}

/// Applies an IBTA atomic to a word as one CPU atomic; returns the original value.
pub(crate) fn apply_atomic(word: &std::sync::atomic::AtomicU64, op: AtomicOp) -> u64 {
    use std::sync::atomic::Ordering::SeqCst;
    match op {
        AtomicOp::FetchAdd { add } => word.fetch_add(add, SeqCst),
        AtomicOp::CompareSwap { compare, swap } => {
            match word.compare_exchange(compare, swap, SeqCst, SeqCst) {
                Ok(v) | Err(v) => v,
            }
        }
    }
}

#[derive(Debug, Default)]
struct Slot {
    generation: u8,
    mr: Option<Arc<MrInner>>,
}

/// The key → region table of a context.
#[derive(Debug, Default)]
pub(crate) struct MrTable {
    slots: RwLock<Vec<Slot>>,
}

impl MrTable {
    /// Registers `mr` and returns its key.
    pub(crate) fn insert(&self, mr: Arc<MrInner>) -> Result<u32> {
        let mut slots = self.slots.write().unwrap_or_else(|e| e.into_inner());
        let index = match slots.iter().position(|s| s.mr.is_none()) {
            Some(i) => i,
            None => {
                if slots.len() >= 1 << 24 {
                    return Err(Error::TooManyRegions);
                }
                slots.push(Slot::default());
                slots.len() - 1
            }
        };
        let slot = &mut slots[index];
        slot.generation = slot.generation.wrapping_add(1).max(1);
        slot.mr = Some(mr);
        Ok(((index as u32) << 8) | u32::from(slot.generation))
    }

    /// Removes the region of `key`, if the key is current.
    pub(crate) fn remove(&self, key: u32) -> Option<Arc<MrInner>> {
        let mut slots = self.slots.write().unwrap_or_else(|e| e.into_inner());
        let slot = slots.get_mut((key >> 8) as usize)?;
        if u32::from(slot.generation) != key & 0xff {
            return None;
        }
        slot.mr.take()
    }

    /// The region of `key`, if the key is current.
    pub(crate) fn get(&self, key: u32) -> Option<Arc<MrInner>> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        let slot = slots.get((key >> 8) as usize)?;
        if key & 0xff == 0 || u32::from(slot.generation) != key & 0xff {
            return None;
        }
        slot.mr.clone()
    }

    /// Regions registered now.
    pub(crate) fn len(&self) -> usize {
        self.slots
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|s| s.mr.is_some())
            .count()
    }
}

/// The transport's view of a context's memory: every access checks key, protection domain,
/// access rights and bounds before a byte moves.
pub(crate) struct EngineMemory<'a> {
    pub table: &'a MrTable,
}

impl EngineMemory<'_> {
    fn locate(
        &self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<(Arc<MrInner>, usize), MemoryError> {
        let mr = self.table.get(key).ok_or(MemoryError::InvalidKey(key))?;
        if mr.pd != pd {
            return Err(MemoryError::InvalidKey(key));
        }
        if !mr.access.contains(need) {
            return Err(MemoryError::AccessDenied);
        }
        let _ = kind;
        let off = addr
            .checked_sub(mr.addr())
            .ok_or(MemoryError::OutOfBounds { addr, len })?;
        let end = off
            .checked_add(len)
            .ok_or(MemoryError::OutOfBounds { addr, len })?;
        if end > mr.len() as u64 {
            return Err(MemoryError::OutOfBounds { addr, len });
        }
        Ok((mr, off as usize))
    }
}

impl Memory for EngineMemory<'_> {
    fn read(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        out: &mut [u8],
        need: Access,
    ) -> std::result::Result<(), MemoryError> {
        let (mr, off) = self.locate(pd, kind, key, addr, out.len() as u64, need)?;
        mr.copy_out(off, out).map_err(|_| MemoryError::OutOfBounds {
            addr,
            len: out.len() as u64,
        })
    }

    fn write(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        data: &[u8],
        need: Access,
    ) -> std::result::Result<(), MemoryError> {
        let (mr, off) = self.locate(pd, kind, key, addr, data.len() as u64, need)?;
        mr.copy_in(off, data).map_err(|_| MemoryError::OutOfBounds {
            addr,
            len: data.len() as u64,
        })
    }

    fn check(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<(), MemoryError> {
        self.locate(pd, kind, key, addr, len, need).map(|_| ())
    }

    fn atomic(
        &mut self,
        pd: u32,
        rkey: u32,
        addr: u64,
        op: AtomicOp,
    ) -> std::result::Result<u64, MemoryError> {
        let (mr, off) = self.locate(pd, KeyKind::Remote, rkey, addr, 8, Access::REMOTE_ATOMIC)?;
        if addr % 8 != 0 {
            return Err(MemoryError::Misaligned(addr));
        }
        mr.atomic(off, op)
            .map_err(|_| MemoryError::OutOfBounds { addr, len: 8 })
    }

    fn invalidate(&mut self, pd: u32, rkey: u32) -> std::result::Result<(), MemoryError> {
        let mr = self.table.get(rkey).ok_or(MemoryError::InvalidKey(rkey))?;
        if mr.pd != pd {
            return Err(MemoryError::InvalidKey(rkey));
        }
        self.table.remove(rkey);
        Ok(())
    }
}

/// A registered memory region.
///
/// Its bytes are read and written by copying ([`read`](Self::read), [`write`](Self::write)),
/// never by reference, because a remote peer may change them at any moment (see the module
/// doc). Dropping it deregisters it.
#[derive(Debug)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<MrInner>,
    key: u32,
    ctx: Arc<ContextInner>,
}

impl MemoryRegion {
    pub(crate) fn new(inner: MrInner, ctx: Arc<ContextInner>) -> Result<MemoryRegion> {
        let inner = Arc::new(inner);
        let key = ctx.shared.mrs.insert(inner.clone())?;
        ctx.shared.shm_publish(key, &inner);
        Ok(MemoryRegion { inner, key, ctx })
    }

    /// Virtual address of the first byte, as a peer names it in a WRITE, READ or atomic.
    pub fn addr(&self) -> u64 {
        self.inner.addr()
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }
    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }
    /// Local key, for this context's own work requests.
    pub fn lkey(&self) -> u32 {
        self.key
    }
    /// Remote key, to hand to peers.
    pub fn rkey(&self) -> u32 {
        self.key
    }
    /// Access rights.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// A scatter/gather element over `len` bytes from `offset`, for a work request.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge> {
        self.inner.check(offset, len)?;
        let length = u32::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("SGE of {len} bytes exceeds 4 GiB")))?;
        Ok(Sge {
            addr: self.addr() + offset as u64,
            length,
            lkey: self.key,
        })
    }

    /// The whole region as one scatter/gather element.
    pub fn sge_all(&self) -> Result<Sge> {
        self.sge(0, self.len())
    }

    /// Copies bytes out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.inner.copy_out(offset, out)
    }

    /// Copies bytes into the region.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.inner.copy_in(offset, data)
    }

    /// Sets `len` bytes from `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.inner.fill(offset, len, byte)
    }

    /// A copy of `len` bytes from `offset`.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// The native-endian 64-bit word at `offset` (where atomics land).
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Stores a native-endian 64-bit word at `offset`.
    pub fn write_u64(&self, offset: usize, v: u64) -> Result<()> {
        self.write(offset, &v.to_ne_bytes())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.ctx.shared.shm_withdraw(self.key);
        self.ctx.shared.mrs.remove(self.key);
        self.inner.revoke();
    }
}
