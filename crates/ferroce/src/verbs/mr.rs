//! Memory regions: buffers a peer may read, write or apply atomics to.
//!
//! # Why regions are reached only through copies
//! A remote peer may write a registered region at any moment. Handing the application a
//! `&mut [u8]` (or even `&[u8]`) into it would let another thread or process write bytes that
//! safe Rust believes nobody else touches: undefined behaviour. So a region's bytes are reached
//! only through raw-pointer copies ([`MemoryRegion::read`], [`MemoryRegion::write`] and friends,
//! the engine placing a packet, a same-host peer's one-sided operation), as a NIC's DMA reaches
//! memory, and atomics on them are CPU atomics wherever they come from.
//!
//! # Keys
//! lkey and rkey are equal: a 24-bit table index and an 8-bit generation that rotates each time
//! the slot is reused, so a stale or guessed key does not reach a newer region. Generation 0 is
//! never used, so key 0 is always invalid.
//!
//! # Where the bytes live, and what deregistration waits for
//! Regions ferroce allocates ([`crate::ProtectionDomain::alloc_mr`]) are memfds mapped shared,
//! page-aligned, so a same-host peer can map them and WRITE, READ or apply atomics with no code
//! running here (see `shm`). Their accesses take no lock: the peer's copies could not take it
//! anyway, and the pages stay mapped for as long as anything holds the region, so deregistering
//! only has to make later accesses fail (a flag each access checks first). That keeps a post on
//! the shared-memory fast path and an application's poll of a flag byte free of lock traffic.
//!
//! Caller memory ([`crate::ProtectionDomain::register_raw`]) cannot be mapped by a peer:
//! requests on it are served by this context's engine. Its accesses hold a lock (shared for
//! reading, exclusive for writing), because deregistration must wait for the ones under way:
//! once it returns, the caller may free the memory. A context opened with
//! [`crate::ContextOptions::adopt_registered_pages`] moves the whole pages of caller memory
//! onto a memfd in place (`provider::shm::adopt`): those pages are then reached as regions
//! ferroce allocated are — by a same-host peer directly, here through a second mapping of the
//! memfd that lives as long as the region, with no lock — and only accesses touching the
//! partial pages at the ends take the lock.
//!
//! Dropping a [`MemoryRegion`] removes its key at once, so no new access can find it.

use std::ptr::NonNull;
use std::sync::atomic::{compiler_fence, fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use ferroce_proto::memory::{Access, AtomicOp, KeyKind, Memory, MemoryError};
use ferroce_proto::Sge;

use super::context::ContextInner;
use crate::error::{Error, Result};
use crate::provider::{AdoptedPages, SharedMap};

/// Where a region's bytes come from.
#[derive(Debug)]
enum Backing {
    /// A memfd ferroce created and maps (a same-host peer may map it too); unmapped on drop.
    Shared(SharedMap),
    /// The caller's memory (registered with `unsafe`); not freed by ferroce.
    Borrowed,
    /// The caller's memory whose whole pages were moved onto a memfd in place (see the module
    /// doc); given back to the caller at deregistration, once.
    Adopted {
        pages: AdoptedPages,
        given_back: AtomicBool,
    },
}

/// Where a peer finds a region's bytes: `len` bytes from the region's address `addr` are bytes
/// `file_offset..` of the memfd `fd` (inode `inode`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PublishedFile {
    pub fd: i32,
    pub inode: u64,
    pub addr: u64,
    pub len: u64,
    pub file_offset: u64,
}

/// A registered region's bytes and attributes.
#[derive(Debug)]
pub(crate) struct MrInner {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    pub(crate) access: Access,
    pub(crate) pd: u32,
    /// Set at deregistration: an access that looked the key up just before and checks this
    /// just after touches nothing.
    revoked: AtomicBool,
    /// Held by every access to caller memory, so deregistration can wait for those under way
    /// (unused for shared regions, see the module doc).
    lock: RwLock<()>,
}

// SAFETY: the region's bytes are only touched through raw-pointer copies and CPU atomics, never
// through references (see the module doc), and the pointer stays valid for the life of the value
// (mapped pages are unmapped in Drop, borrowed memory is valid by the contract of
// `ProtectionDomain::register_raw` until `revoke` returns, after which nothing touches it).
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
            revoked: AtomicBool::new(false),
            lock: RwLock::new(()),
        })
    }

    /// The memfd a peer maps to reach the region's bytes, and which of them: the whole region
    /// if ferroce allocated it, its adopted pages if it has some, nothing for caller memory.
    pub(crate) fn published_file(&self) -> Option<PublishedFile> {
        match &self.backing {
            Backing::Shared(m) => Some(PublishedFile {
                fd: m.fd(),
                inode: m.inode(),
                addr: self.addr(),
                len: self.len as u64,
                file_offset: 0,
            }),
            Backing::Adopted { pages, .. } => Some(PublishedFile {
                fd: pages.alias.fd(),
                inode: pages.alias.inode(),
                addr: pages.start,
                len: pages.len,
                file_offset: pages.file_offset,
            }),
            Backing::Borrowed => None,
        }
    }

    /// The part of the region reached with no lock while it is registered — all of a region
    /// ferroce allocated, the adopted pages of caller memory — as its address, length and where
    /// its first byte is mapped here; such mappings live as long as `self`. `None` for plain
    /// caller memory and once deregistered.
    #[inline]
    pub(crate) fn direct_span(&self) -> Option<(u64, u64, *mut u8)> {
        if self.revoked.load(Ordering::Acquire) {
            return None;
        }
        match &self.backing {
            Backing::Shared(_) => Some((self.addr(), self.len as u64, self.ptr.as_ptr())),
            Backing::Adopted { pages, .. } => {
                Some((pages.start, pages.len, pages.alias_ptr(pages.start)))
            }
            Backing::Borrowed => None,
        }
    }

    /// Where `offset..offset + len` of the region is mapped for a lock-free access, if it lies
    /// in the region's [`direct_span`](Self::direct_span). The caller checked the range lies in
    /// the region.
    #[inline]
    pub(crate) fn direct_ptr(&self, offset: usize, len: usize) -> Option<*mut u8> {
        if self.revoked.load(Ordering::Acquire) {
            return None;
        }
        debug_assert!(offset.saturating_add(len) <= self.len);
        match &self.backing {
            Backing::Shared(_) => Some(self.ptr.as_ptr().wrapping_add(offset)),
            Backing::Adopted { pages, .. } => {
                let addr = self.addr() + offset as u64;
                pages.holds(addr, len as u64).then(|| pages.alias_ptr(addr))
            }
            Backing::Borrowed => None,
        }
    }

    /// Where `offset..offset + len` of a region ferroce allocated starts, for an access through
    /// its [`MemoryRegion`] handle: `None` for caller memory (whose accesses take its lock) and
    /// for a range outside the region. While the handle lives the region is registered (only
    /// dropping the handle revokes it), so such an access needs neither the flag nor a lock.
    #[inline]
    fn handle_ptr(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let inside = offset.checked_add(len).is_some_and(|end| end <= self.len);
        (inside && matches!(self.backing, Backing::Shared(_)))
            .then(|| self.ptr.as_ptr().wrapping_add(offset))
    }

    /// Runs `f` on a pointer to `offset..offset + len` of the region, unless the range is
    /// outside or the region revoked; caller memory is held under its lock meanwhile (shared for
    /// reading, exclusive for writing). `f` must stay inside those `len` bytes and must not keep
    /// the pointer.
    pub(crate) fn with_range<R>(
        &self,
        offset: usize,
        len: usize,
        writing: bool,
        f: impl FnOnce(*mut u8) -> R,
    ) -> Result<R> {
        self.check(offset, len)?;
        if let Backing::Adopted { pages, .. } = &self.backing {
            let addr = self.addr() + offset as u64;
            if pages.holds(addr, len as u64) {
                if self.revoked.load(Ordering::Acquire) {
                    return Err(self.revoked());
                }
                // Through the region's own mapping of the memfd, which lives as long as `self`:
                // as for a region ferroce allocated, no lock.
                return Ok(f(pages.alias_ptr(addr)));
            }
        }
        let (_shared, _exclusive);
        if !matches!(self.backing, Backing::Shared(_)) {
            if writing {
                _exclusive = self.lock.write().unwrap_or_else(|e| e.into_inner());
            } else {
                _shared = self.lock.read().unwrap_or_else(|e| e.into_inner());
            }
        }
        if self.revoked.load(Ordering::Acquire) {
            return Err(self.revoked());
        }
        // SAFETY: `offset + len <= self.len` was checked, so the pointer is inside the region,
        // which is not revoked (caller memory, adopted or not: cannot be while the lock is
        // held; shared regions: stay mapped while `self` lives either way).
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
            revoked: AtomicBool::new(false),
            lock: RwLock::new(()),
        }
    }

    /// Wraps caller memory, moving its whole pages onto a memfd a same-host peer can map when
    /// the memory allows it (see `provider::shm::adopt`; plain caller memory otherwise).
    ///
    /// # Safety
    /// See `ProtectionDomain::register_raw`; besides, no other thread stores to the memory
    /// while this runs.
    pub(crate) unsafe fn adopted(ptr: NonNull<u8>, len: usize, access: Access, pd: u32) -> MrInner {
        // SAFETY: as the caller vouches.
        let mut mr = unsafe { MrInner::borrowed(ptr, len, access, pd) };
        // SAFETY: as the caller vouches.
        if let Some(pages) = unsafe { crate::provider::adopt(ptr.as_ptr(), len) } {
            mr.backing = Backing::Adopted {
                pages,
                given_back: AtomicBool::new(false),
            };
        }
        mr
    }

    /// The region's first byte as the program (and a peer) names it.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The flag deregistration sets (for a cache that keeps a pointer to it).
    pub(crate) fn revoked_flag(&self) -> &AtomicBool {
        &self.revoked
    }

    /// The offset of `addr..addr + len` in the region, if a request under `key` in protection
    /// domain `pd` that needs `need` may touch it there (the checks every access path makes).
    pub(crate) fn admit(
        &self,
        key: u32,
        pd: u32,
        need: Access,
        addr: u64,
        len: u64,
    ) -> std::result::Result<usize, MemoryError> {
        if self.pd != pd {
            return Err(MemoryError::InvalidKey(key));
        }
        if !self.access.contains(need) {
            return Err(MemoryError::AccessDenied);
        }
        let off = addr
            .checked_sub(self.addr())
            .ok_or(MemoryError::OutOfBounds { addr, len })?;
        match off.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(off as usize),
            _ => Err(MemoryError::OutOfBounds { addr, len }),
        }
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

    /// Deregistration: makes every later access fail and, for caller memory, waits for the
    /// accesses under way (they hold the lock). After it returns, caller memory is never
    /// touched again — what `register_raw`'s contract promises the caller, who may free it next.
    pub(crate) fn revoke(&self) {
        let _exclusive = self.lock.write().unwrap_or_else(|e| e.into_inner());
        self.revoked.store(true, Ordering::Release);
        if let Backing::Adopted { pages, given_back } = &self.backing {
            if !given_back.swap(true, Ordering::AcqRel) {
                crate::provider::release_adopted(pages);
            }
        }
    }

    fn revoked(&self) -> Error {
        Error::InvalidArgument("the memory region is deregistered".into())
    }

    pub(crate) fn copy_out(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.with_range(offset, out.len(), false, |src| {
            // SAFETY: `src` covers `out.len()` bytes of the region; `out` is a distinct buffer.
            unsafe { copy_bytes(src, out.as_mut_ptr(), out.len()) }
        })
    }

    pub(crate) fn copy_in(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.with_range(offset, data.len(), true, |dst| {
            // SAFETY: `dst` covers `data.len()` bytes of the region; `data` is a distinct buffer.
            unsafe { copy_bytes(data.as_ptr(), dst, data.len()) }
        })
    }

    pub(crate) fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.with_range(offset, len, true, |dst| {
            // SAFETY: `dst` covers `len` bytes of the region.
            unsafe { std::ptr::write_bytes(dst, byte, len) }
        })
    }

    pub(crate) fn atomic(&self, offset: usize, op: AtomicOp) -> Result<u64> {
        self.with_range(offset, 8, true, |p| {
            if p as usize % 8 == 0 {
                // SAFETY: 8 bytes of the region, 8-aligned; a same-host peer may apply its own
                // CPU atomics to this word concurrently, so this must be one too.
                let word = unsafe { AtomicU64::from_ptr(p.cast()) };
                return apply_atomic(word, op);
            }
            // Only plain caller memory can be misaligned (shared regions and adopted pages are
            // page-aligned, and the transport refuses misaligned remote atomics), and it is
            // held exclusively here.
            // SAFETY: 8 bytes of the region.
            let old = unsafe { std::ptr::read_unaligned(p.cast::<u64>()) };
            // SAFETY: as above.
            unsafe { std::ptr::write_unaligned(p.cast::<u64>(), op.apply(old)) };
            old
        })
    }
}

/// Copies `len` bytes from `src` to `dst`, which may overlap (the same region on both sides).
/// The sizes of flags and small messages are single loads and stores instead of a call into
/// `memmove`: on the shared-memory fast path that call is a measurable part of an 8-byte WRITE.
///
/// # Safety
/// As `std::ptr::copy`: `src` readable and `dst` writable for `len` bytes.
#[inline]
pub(crate) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY (each arm): the caller vouches for `len` bytes at both pointers; each arm reads
    // all of its bytes before writing any, so overlap is harmless.
    unsafe {
        match len {
            1 => dst.write(src.read()),
            2 => dst
                .cast::<u16>()
                .write_unaligned(src.cast::<u16>().read_unaligned()),
            4 => dst
                .cast::<u32>()
                .write_unaligned(src.cast::<u32>().read_unaligned()),
            8 => dst
                .cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned()),
            16 => dst
                .cast::<u128>()
                .write_unaligned(src.cast::<u128>().read_unaligned()),
            _ => std::ptr::copy(src, dst, len),
        }
    }
}

/// Applies an IBTA atomic to a word as one CPU atomic; returns the original value.
pub(crate) fn apply_atomic(word: &AtomicU64, op: AtomicOp) -> u64 {
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
    /// How many keys were removed so far: a key looked up while this had some value still
    /// names the same region while it has that value (a slot is only reused after a removal),
    /// so a cache of lookups checks one counter instead of taking the lock.
    removals: AtomicU64,
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
        self.removals.fetch_add(1, Ordering::Release);
        slot.mr.take()
    }

    /// The removal count's word, for a cache that keeps a pointer to it (see `shm::shortcut`).
    pub(crate) fn removals_word(&self) -> &AtomicU64 {
        &self.removals
    }

    /// The removal count (see the field), to stamp a cached lookup with before making it.
    pub(crate) fn removals(&self) -> u64 {
        self.removals.load(Ordering::Acquire)
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

/// The regions a QP's transport used last, with the region table's removal count when they
/// were looked up: while that count holds, their keys still name them (`MrTable::removals`),
/// so a packet for one of them takes neither the table's lock nor a reference count. Two
/// entries: a QP's traffic mostly reads one buffer and writes another.
#[derive(Debug, Default)]
pub(crate) struct MrCache {
    removals: u64,
    entries: [Option<(u32, Arc<MrInner>)>; 2],
    /// The entry the next miss replaces.
    next: usize,
}

impl MrCache {
    /// The region of `key`, from the cache or (remembered) from `table`.
    fn get(&mut self, table: &MrTable, key: u32) -> Option<&MrInner> {
        let removals = table.removals();
        if removals != self.removals {
            self.entries = [None, None];
            self.removals = removals;
        }
        let hit = self
            .entries
            .iter()
            .position(|e| e.as_ref().is_some_and(|(k, _)| *k == key));
        let i = match hit {
            Some(i) => i,
            None => {
                // Looked up after reading the count: a removal racing with the lookup moves
                // the count on, and the next use looks again.
                let mr = table.get(key)?;
                let i = self.next;
                self.next = (i + 1) % self.entries.len();
                self.entries[i] = Some((key, mr));
                i
            }
        };
        self.entries[i].as_ref().map(|(_, mr)| &**mr)
    }
}

/// The transport's view of a context's memory: every access checks key, protection domain,
/// access rights and bounds before a byte moves.
pub(crate) struct EngineMemory<'a> {
    pub table: &'a MrTable,
    /// The QP's recent regions (see [`MrCache`]).
    pub cache: &'a mut MrCache,
}

impl EngineMemory<'_> {
    fn locate(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<(&MrInner, usize), MemoryError> {
        let _ = kind;
        let mr = self
            .cache
            .get(self.table, key)
            .ok_or(MemoryError::InvalidKey(key))?;
        let off = mr.admit(key, pd, need, addr, len)?;
        Ok((mr, off))
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
    ///
    /// Every call reads memory afresh, so polling a flag byte a peer sets with an RDMA WRITE is
    /// a loop of `read`s (the way perftest's latency tests wait). On a region ferroce allocated
    /// a small read is a bounds check and a load, inlined into the caller.
    #[inline]
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        match self.inner.handle_ptr(offset, out.len()) {
            Some(src) => {
                // A peer or the engine may change the bytes between two calls: no load here may
                // be merged with an earlier one or hoisted out of the caller's loop.
                compiler_fence(Ordering::Acquire);
                // SAFETY: `handle_ptr` checked the range lies in the region, which stays mapped
                // and registered while `self` lives; `out` is a distinct buffer of that length.
                unsafe { copy_bytes(src, out.as_mut_ptr(), out.len()) };
                // Data-then-flag: whoever reads a flag here and then the data it announces
                // must see the data the peer wrote before the flag (the peer's side is the
                // release fence in `write`, or in a direct WRITE). Free on x86-64 (a compiler
                // barrier), a barrier instruction on weakly ordered CPUs.
                fence(Ordering::Acquire);
                Ok(())
            }
            None => self.inner.copy_out(offset, out),
        }
    }

    /// Copies bytes into the region (on a region ferroce allocated, a small write is a bounds
    /// check and a store, inlined into the caller).
    #[inline]
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        match self.inner.handle_ptr(offset, data.len()) {
            Some(dst) => {
                // Everything stored before (the data a flag written now announces) is visible
                // before these bytes are; see `read`.
                fence(Ordering::Release);
                // SAFETY: as in `read`, in the other direction.
                unsafe { copy_bytes(data.as_ptr(), dst, data.len()) };
                // The store must happen here, where the caller put it (before a post that
                // sends these bytes, say), not be merged with a later one.
                compiler_fence(Ordering::Release);
                Ok(())
            }
            None => self.inner.copy_in(offset, data),
        }
    }

    /// Sets `len` bytes from `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.inner.fill(offset, len, byte)
    }

    /// Runs `f` on `len` bytes from `offset` as a slice: in place for a region ferroce
    /// allocated, on a copy for caller memory. For code whose own protocol keeps writers away
    /// (a collective reducing a chunk a peer wrote and announced): it saves the copy `read`
    /// makes.
    ///
    /// # Safety
    /// Nothing may write those bytes while `f` runs — no peer (a WRITE, an atomic, a SEND
    /// landing there) and no other thread — since `f` holds a shared reference to them.
    pub unsafe fn with_slice<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        match self.inner.handle_ptr(offset, len) {
            Some(p) => {
                // As after `read`'s copy: the caller read the flag that announced these bytes.
                fence(Ordering::Acquire);
                // SAFETY: `handle_ptr` checked the range lies in the region, mapped while
                // `self` lives; the caller vouches nothing writes it while `f` runs.
                Ok(f(unsafe { std::slice::from_raw_parts(p, len) }))
            }
            None => {
                let v = self.to_vec(offset, len)?;
                Ok(f(&v))
            }
        }
    }

    /// A copy of `len` bytes from `offset`.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// The native-endian 64-bit word at `offset` (where atomics land).
    #[inline]
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Stores a native-endian 64-bit word at `offset`.
    #[inline]
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
