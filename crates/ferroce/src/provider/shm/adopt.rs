//! Caller memory moved onto a memfd in place, so a same-host peer can reach it with no code
//! running here.
//!
//! # Why
//! A program written for libibverbs registers memory it allocated itself (`malloc`,
//! `memalign`) and then, like perftest's `ib_write_lat`, spins on a byte of it until a peer's
//! WRITE lands. A NIC writes such memory by DMA; ferroce's same-host peer can only write pages
//! it can map, and private anonymous pages cannot be mapped by another process. Copying every
//! access through the target's engine (a ring and a wake-up) made an 8-byte WRITE cost ~100 µs
//! instead of ~0.1 µs.
//!
//! # How
//! At registration the **whole pages** inside the range are copied into a fresh memfd, which
//! is then mapped `MAP_SHARED | MAP_FIXED` over those very addresses: the program's pointers
//! stay valid and see the same bytes, now in pages a peer can map too. Partial pages at the
//! ends stay as they were (they hold the program's other objects, which another thread might
//! store to while the copy runs), and accesses touching them take the packet path — unless
//! the mapping holding them lies wholly inside the range's pages: then nothing but the region
//! (and an allocator's header, written when the block is allocated or freed) lives there, so
//! they are adopted too. That is the shape of every large `malloc` block (its own `mmap`), the
//! buffers MPI and UCX move big messages from. Only
//! private anonymous read-write memory (`malloc`, `memalign`, anonymous `mmap`) is adopted: a
//! file mapping, shared memory or huge pages keep their own semantics and the packet path.
//!
//! Deregistration gives the pages back: they are copied into private anonymous memory that is
//! moved over the range with `mremap`, if the range still maps the memfd (a program that
//! unmapped or remapped it itself is left alone). A peer's access still under way lands in the
//! memfd, which the region keeps mapped for ferroce's own late accesses, never in the
//! program's pages.
//!
//! The remappings are made with raw system calls, not libc's `mmap`/`mremap`: UCX (and other
//! registration caches) hook those calls and drop every registration over a range that is
//! remapped, so the adoption made inside `ibv_reg_mr` would cancel the very registration it
//! serves, and each message would register, copy and give back its buffer anew. The program's
//! view of its memory does not change, so there is nothing for such a hook to hear.
//!
//! `fork` keeps its meaning: a child gets private copies of adopted pages (a `pthread_atfork`
//! handler), instead of sharing them with the parent as `MAP_SHARED` would. The child starts
//! with an empty registry: the parent's adoptions are memfds the parent's peers reach, so a
//! registration in the child that found one would give the child's region the parent's pages
//! (the child's writes through it landing in the parent, the parent's peers' in the child's
//! region). The child's handler only sets them aside, since it may not free memory; the next
//! use of the registry drops them (the child's private copies stay where they are).
//!
//! # Revalidation
//! The registry remembers address ranges, and a program may unmap adopted pages without
//! deregistering (free a buffer, then register a new one the allocator put at that address).
//! So an adoption is reused for a new registration only if `/proc/self/maps` (read anyway, once
//! per registration) shows the range still mapping its memfd — same device, inode and offsets;
//! one that does not is dropped from the registry and the new pages are adopted afresh. The
//! region registered over the old pages keeps its own mapping of the old memfd, so its key
//! reaches those, never the new buffer. The fork handler checks the same before copying pages
//! (an unmapped range would fault; a copy mapped in the child would cover the new buffer).
//!
//! # What the program must not do
//! Store into the adopted pages from another thread *while* `ibv_reg_mr` or `ibv_dereg_mr`
//! runs on them: such a store can be lost in the copy. RDMA programs register a buffer before
//! using it and deregister it after; a context opened without
//! [`ContextOptions::adopt_registered_pages`](crate::ContextOptions::adopt_registered_pages)
//! never moves pages.

use std::cell::UnsafeCell;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};

use super::map::SharedMap;

/// One adoption: whole pages of the program's memory now in `alias`'s memfd.
#[derive(Debug)]
struct Entry {
    /// The program's address of the memfd's first byte (page-aligned).
    start: usize,
    len: usize,
    alias: Arc<SharedMap>,
    /// The memfd's device (major, minor) and inode, as `/proc/self/maps` shows them: what
    /// tells the range still maps it (see the module doc).
    dev: (u32, u32),
    inode: u64,
    /// Regions registered over these pages.
    users: usize,
    /// A private copy of the pages taken as the process forks (0 otherwise): see the fork
    /// handlers.
    snapshot: usize,
}

impl Entry {
    /// Whether `start..end` (inside the entry's range) maps the entry's memfd, read-write and
    /// shared, each page at its own offset: whether the program still has the pages adopted
    /// there, or unmapped or replaced them since (see the module doc).
    fn maps_alias(&self, vmas: &[Vma], start: usize, end: usize) -> bool {
        covered(vmas, start, end, |v| {
            let from = v.start.max(start);
            &v.perms == b"rw-s"
                && v.dev == self.dev
                && v.inode == self.inode
                && v.offset.checked_add((from - v.start) as u64) == Some((from - self.start) as u64)
        })
    }
}

/// The adoptions of the process, under a lock the `fork` handlers can hold across `fork`.
struct Registry {
    busy: AtomicBool,
    entries: UnsafeCell<Vec<Entry>>,
    /// In a forked child, the parent's entries, set aside by the child's handler (which must
    /// not free memory) until the next use of the registry drops them. Always empty in a
    /// process that never forked, and at every fork (the prepare handler empties it).
    inherited: UnsafeCell<Vec<Entry>>,
}

// SAFETY: `entries` and `inherited` are only reached through `with`, which holds `busy` (a spin
// lock) for the whole access, or by the fork handlers, which hold it from `prepare` to
// `parent`/`child`.
unsafe impl Sync for Registry {}

static REGISTRY: Registry = Registry {
    busy: AtomicBool::new(false),
    entries: UnsafeCell::new(Vec::new()),
    inherited: UnsafeCell::new(Vec::new()),
};

impl Registry {
    fn lock(&self) {
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    fn unlock(&self) {
        self.busy.store(false, Ordering::Release);
    }

    fn with<R>(&self, f: impl FnOnce(&mut Vec<Entry>) -> R) -> R {
        self.lock();
        // SAFETY: `busy` is held, so this is the only reference to the inherited entries.
        let inherited = std::mem::take(unsafe { &mut *self.inherited.get() });
        // SAFETY: `busy` is held, so this is the only reference to the entries.
        let r = f(unsafe { &mut *self.entries.get() });
        self.unlock();
        // The parent's adoptions, in a forked child: dropping them unmaps the child's mappings
        // of the parent's memfds (unless a region inherited from the parent holds one) and
        // nothing else — the child's private copies of the pages are the child's memory.
        drop(inherited);
        r
    }
}

extern "C" fn fork_prepare() {
    REGISTRY.lock();
    // SAFETY: the lock is held (until `parent` or `child`), so these are the only references.
    let (entries, inherited) =
        unsafe { (&mut *REGISTRY.entries.get(), &mut *REGISTRY.inherited.get()) };
    // Freeing is allowed here (before the fork), not in the child's handler: so that handler
    // finds `inherited` empty and can swap the entries into it without freeing anything.
    drop(std::mem::take(inherited));
    if let (Some(lo), Some(hi)) = (
        entries.iter().map(|e| e.start).min(),
        entries.iter().map(|e| e.start + e.len).max(),
    ) {
        // Adoptions whose pages the program unmapped or replaced without deregistering are
        // dropped (see the module doc): copying them could fault, and their copy mapped in the
        // child would cover whatever the program maps there now. If the maps cannot be read,
        // the entries are trusted, as before there was a check.
        if let Ok(vmas) = vmas_over(lo, hi) {
            entries.retain(|e| e.maps_alias(&vmas, e.start, e.start + e.len));
        }
    }
    for e in entries.iter_mut() {
        // The bytes as they are at the fork, in private memory the child inherits: the child's
        // handler maps them over the range. (Copied in the child instead, they would include
        // whatever a peer wrote in between, which a child of a real fork never sees.)
        // SAFETY: a fresh anonymous mapping; checked.
        let snap = unsafe {
            raw_mmap(
                std::ptr::null_mut(),
                e.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
            )
        };
        if snap == libc::MAP_FAILED {
            e.snapshot = 0;
            continue;
        }
        // SAFETY: `e.start..e.start + e.len` is mapped (the adopted pages), the snapshot is a
        // fresh mapping of that length.
        unsafe { std::ptr::copy_nonoverlapping(e.start as *const u8, snap.cast::<u8>(), e.len) };
        e.snapshot = snap as usize;
    }
}

extern "C" fn fork_parent() {
    // SAFETY: `prepare` took the lock.
    let entries = unsafe { &mut *REGISTRY.entries.get() };
    for e in entries.iter_mut() {
        if e.snapshot != 0 {
            // SAFETY: the snapshot `prepare` made; nothing else refers to it.
            unsafe { libc::syscall(libc::SYS_munmap, e.snapshot, e.len) };
            e.snapshot = 0;
        }
    }
    REGISTRY.unlock();
}

extern "C" fn fork_child() {
    // SAFETY: `prepare` took the lock before the fork; this process has one thread now.
    let entries = unsafe { &mut *REGISTRY.entries.get() };
    for e in entries.iter_mut() {
        // The child's copy of the pages must stop being the parent's: the snapshot taken at
        // the fork replaces them, a private copy as `fork` gives of any other private memory.
        // Without one (no memory for it), a copy now is the best left.
        if e.snapshot != 0 {
            // SAFETY: moves the child's inherited snapshot over the range it was taken of.
            unsafe {
                raw_mremap_fixed(
                    e.snapshot as *mut libc::c_void,
                    e.len,
                    e.start as *mut libc::c_void,
                )
            };
            e.snapshot = 0;
        } else {
            // SAFETY: `e.start..e.start + e.len` is mapped (it maps the memfd in the parent,
            // whose mappings the child inherited).
            let _ = unsafe { replace_with_private_copy(e.start, e.len) };
        }
    }
    // The child's registry starts empty (see the module doc). `inherited` is empty (`prepare`
    // emptied it), so the swap frees nothing: dropping the entries waits for the next use of
    // the registry, where freeing is allowed.
    // SAFETY: as above, the lock taken by `prepare` is held.
    std::mem::swap(entries, unsafe { &mut *REGISTRY.inherited.get() });
    REGISTRY.unlock();
}

fn install_fork_handlers() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: three `extern "C"` functions that live for the whole process.
        unsafe {
            libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child));
        }
    });
}

/// `mmap(2)` as a bare system call (see the module doc).
///
/// # Safety
/// As `mmap`.
unsafe fn raw_mmap(
    addr: *mut libc::c_void,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
) -> *mut libc::c_void {
    // SAFETY: the caller's contract; the kernel's mmap takes these six arguments.
    unsafe {
        libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, 0 as libc::off_t)
            as *mut libc::c_void
    }
}

/// `mremap(2)` to a fixed address as a bare system call (see the module doc).
///
/// # Safety
/// As `mremap` with `MREMAP_MAYMOVE | MREMAP_FIXED`.
unsafe fn raw_mremap_fixed(
    old: *mut libc::c_void,
    len: usize,
    new: *mut libc::c_void,
) -> *mut libc::c_void {
    // SAFETY: the caller's contract.
    unsafe {
        libc::syscall(
            libc::SYS_mremap,
            old,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            new,
        ) as *mut libc::c_void
    }
}

fn page_size() -> usize {
    // SAFETY: a plain query.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// One line of `/proc/self/maps`.
struct Vma {
    start: usize,
    end: usize,
    perms: [u8; 4],
    offset: u64,
    /// Major and minor device numbers.
    dev: (u32, u32),
    inode: u64,
    path: String,
}

/// The device and inode of an open file, as `/proc/self/maps` shows them for its mappings.
fn dev_inode(fd: libc::c_int) -> Option<((u32, u32), u64)> {
    // SAFETY: an all-zero `stat` is a valid value of the plain C struct fstat fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable stat buffer; the result is checked.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some(((libc::major(st.st_dev), libc::minor(st.st_dev)), st.st_ino))
}

fn vmas_over(start: usize, end: usize) -> io::Result<Vec<Vma>> {
    let text = std::fs::read_to_string("/proc/self/maps")?;
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(offset), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        if b <= start || a >= end {
            continue;
        }
        let p = perms.as_bytes();
        if p.len() < 4 {
            continue;
        }
        let dev = dev
            .split_once(':')
            .and_then(|(a, b)| {
                Some((
                    u32::from_str_radix(a, 16).ok()?,
                    u32::from_str_radix(b, 16).ok()?,
                ))
            })
            .unwrap_or((u32::MAX, u32::MAX));
        out.push(Vma {
            start: a,
            end: b,
            perms: [p[0], p[1], p[2], p[3]],
            offset: u64::from_str_radix(offset, 16).unwrap_or(u64::MAX),
            dev,
            inode: inode.parse().unwrap_or(u64::MAX),
            path: f.collect::<Vec<_>>().join(" "),
        });
    }
    Ok(out)
}

/// Whether `vmas` cover `start..end` without a gap and each of them overlapping that range
/// satisfies `ok`.
fn covered(vmas: &[Vma], start: usize, end: usize, ok: impl Fn(&Vma) -> bool) -> bool {
    let mut at = start;
    for v in vmas.iter().filter(|v| v.end > start && v.start < end) {
        if v.start > at || !ok(v) {
            return false;
        }
        at = at.max(v.end);
    }
    at >= end
}

/// Maps private anonymous pages holding a copy of `start..start + len` over that range.
///
/// # Safety
/// `start..start + len` is mapped readable, page-aligned, and nothing else in this process
/// relies on its pages being the ones mapped there now (the bytes stay the same).
unsafe fn replace_with_private_copy(start: usize, len: usize) -> io::Result<()> {
    // SAFETY: a fresh anonymous mapping; checked below.
    let tmp = unsafe {
        raw_mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
        )
    };
    if tmp == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both ranges are `len` mapped bytes (the caller's and the fresh one), distinct.
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, tmp.cast::<u8>(), len) };
    // SAFETY: moves the fresh pages over the range, replacing what was mapped there (the caller
    // vouches that is fine); the fresh mapping's old address is gone afterwards.
    let moved = unsafe { raw_mremap_fixed(tmp, len, start as *mut libc::c_void) };
    if moved == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        // SAFETY: the fresh mapping is still ours.
        unsafe { libc::syscall(libc::SYS_munmap, tmp, len) };
        return Err(e);
    }
    Ok(())
}

/// The pages of a registered region that a peer can map: `len` bytes from the program's
/// address `start` are bytes `file_offset..` of `alias`'s memfd (which `alias` maps too).
#[derive(Debug, Clone)]
pub(crate) struct AdoptedPages {
    pub(crate) start: u64,
    pub(crate) len: u64,
    pub(crate) file_offset: u64,
    pub(crate) alias: Arc<SharedMap>,
}

impl AdoptedPages {
    /// Where the program's address `addr` (inside `start..start + len`) is in `alias`.
    #[inline]
    pub(crate) fn alias_ptr(&self, addr: u64) -> *mut u8 {
        self.alias
            .ptr()
            .wrapping_add((self.file_offset + (addr - self.start)) as usize)
    }

    /// Whether `addr..addr + len` lies in the adopted pages.
    #[inline]
    pub(crate) fn holds(&self, addr: u64, len: u64) -> bool {
        addr >= self.start
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.start + self.len)
    }
}

/// Moves the whole pages inside `ptr..ptr + len` onto a memfd in place (see the module doc), or
/// finds them already moved for another region; `None` if there are none or they are not
/// private anonymous read-write memory (the region then stays plain caller memory).
///
/// # Safety
/// `ptr..ptr + len` is memory the caller registers: valid, and not stored to by another thread
/// while this runs.
pub(crate) unsafe fn adopt(ptr: *mut u8, len: usize) -> Option<AdoptedPages> {
    let page = page_size();
    let floor = ptr as usize & !(page - 1);
    let ceil = (ptr as usize).checked_add(len)?.checked_add(page - 1)? & !(page - 1);
    let (mut first, mut end) = (
        (ptr as usize).checked_add(page - 1)? & !(page - 1),
        (ptr as usize + len) & !(page - 1),
    );
    let private_anonymous =
        |v: &Vma| &v.perms == b"rw-p" && v.inode == 0 && (v.path.is_empty() || v.path == "[heap]");
    install_fork_handlers();
    REGISTRY.with(|entries| {
        // Read under the lock: the registry's entries must agree with what is read (another
        // thread's adoption of these pages maps a memfd over them).
        let whole = vmas_over(floor, ceil).ok()?;
        if whole.first().is_some_and(|v| v.start >= floor)
            && whole.last().is_some_and(|v| v.end <= ceil)
            && covered(&whole, floor, ceil, private_anonymous)
        {
            // The mappings lie wholly inside the range's pages: the partial pages hold nothing
            // of anybody else's (see the module doc).
            (first, end) = (floor, ceil);
        }
        if end <= first {
            return None;
        }
        // An adoption over these pages is only still one if they map its memfd: the program
        // may have unmapped them without deregistering and mapped a new buffer there (see the
        // module doc). A stale one is forgotten; its regions keep their own mapping of it.
        entries.retain(|e| {
            let (s, t) = (e.start.max(first), (e.start + e.len).min(end));
            s >= t || e.maps_alias(&whole, s, t)
        });
        if let Some(e) = entries
            .iter_mut()
            .find(|e| e.start <= first && end <= e.start + e.len)
        {
            e.users += 1;
            return Some(AdoptedPages {
                start: first as u64,
                len: (end - first) as u64,
                file_offset: (first - e.start) as u64,
                alias: e.alias.clone(),
            });
        }
        if entries
            .iter()
            .any(|e| e.start < end && first < e.start + e.len)
        {
            // Overlaps an adoption without lying inside it: two memfds cannot both be it.
            return None;
        }
        // The mappings read above cover `first..end` too.
        if !covered(&whole, first, end, private_anonymous) {
            return None;
        }
        let n = end - first;
        let alias = SharedMap::create("ferroce-adopted", n).ok()?;
        let (dev, inode) = dev_inode(alias.fd())?;
        // SAFETY: `first..end` lies in the caller's registered range (valid, see the contract);
        // the alias is a fresh mapping of `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(first as *const u8, alias.ptr(), n) };
        // SAFETY: maps the memfd, now holding the same bytes, over whole pages of the caller's
        // private anonymous memory: its pointers stay valid and read what they read before.
        let p = unsafe {
            raw_mmap(
                first as *mut libc::c_void,
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                alias.fd(),
            )
        };
        if p == libc::MAP_FAILED || p as usize != first {
            return None;
        }
        let alias = Arc::new(alias);
        entries.push(Entry {
            start: first,
            len: n,
            dev,
            inode,
            alias: alias.clone(),
            users: 1,
            snapshot: 0,
        });
        Some(AdoptedPages {
            start: first as u64,
            len: n as u64,
            file_offset: 0,
            alias,
        })
    })
}

/// Ends one region's use of adopted pages; the last gives the pages back to the program as
/// private memory (see the module doc).
pub(crate) fn release(pages: &AdoptedPages) {
    REGISTRY.with(|entries| {
        let Some(i) = entries
            .iter()
            .position(|e| Arc::ptr_eq(&e.alias, &pages.alias))
        else {
            return;
        };
        entries[i].users -= 1;
        if entries[i].users > 0 {
            return;
        }
        let e = entries.swap_remove(i);
        let (start, end) = (e.start, e.start + e.len);
        let still_ours = vmas_over(start, end).is_ok_and(|vmas| e.maps_alias(&vmas, start, end));
        if still_ours {
            // SAFETY: the range maps the memfd (checked just above), whose pages nothing in
            // the program tells apart from private ones.
            let _ = unsafe { replace_with_private_copy(start, e.len) };
        }
    });
}
