//! Shared mappings: memfd-backed memory another process on the host can map too.
//!
//! Bytes in a shared mapping may be changed by another process at any moment, so they are only
//! ever reached through raw-pointer copies and atomics (never through Rust references), just as
//! a NIC's DMA reaches registered memory behind the CPU's back.
//!
//! # Sealing
//! A process that maps a file another process holds is at that process's mercy if the file can
//! shrink: touching a page past the new end raises SIGBUS, which kills the victim. So every
//! memfd ferroce makes is sealed against shrinking and growing as soon as it has its size
//! (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`), and a descriptor from a peer is mapped only if
//! it is a memfd carrying those seals ([`require_sealed`]); only the length the caller needs is
//! mapped, never what the file says its size is.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// A `MAP_SHARED` mapping of a whole memfd (or of a file opened from another process's memfd).
#[derive(Debug)]
pub(crate) struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
    mapped: usize,
    fd: OwnedFd,
    inode: u64,
}

// SAFETY: the mapping is plain shared memory; every access goes through raw-pointer copies or
// atomics whose callers argue their own bounds, so sharing the handle between threads adds no
// hazard beyond what another process sharing the same pages already implies.
unsafe impl Send for SharedMap {}
// SAFETY: see `Send`.
unsafe impl Sync for SharedMap {}

fn last_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of the plain C struct fstat fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable stat buffer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(last_error("fstat"));
    }
    Ok(st)
}

/// Accepts `fd` only as a shmem memfd sealed against shrinking and growing (what every memfd
/// ferroce makes is), so that no page of a mapping of it can ever lie past the file's end: a peer that
/// kept the power to truncate could kill whoever maps it with SIGBUS. Returns its `fstat`.
pub(crate) fn require_sealed(fd: RawFd) -> io::Result<libc::stat> {
    let st = fstat(fd)?;
    // SAFETY: plain fcntl(2) query; the result is checked. It fails (EINVAL) for anything but
    // a shmem/hugetlbfs file, which is how a regular file or a socket is refused.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    // SAFETY: an all-zero statfs is a valid value of the plain C struct fstatfs fills in.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fs` is a live, writable statfs buffer.
    let on_shmem =
        unsafe { libc::fstatfs(fd, &mut fs) } == 0 && fs.f_type == libc::TMPFS_MAGIC as _;
    // Only shmem: a hugetlbfs memfd can be sealed too, but a hole punched in it gives back its
    // huge pages, and a later fault with the pool empty raises SIGBUS in whoever maps it.
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || !on_shmem || seals < 0 || seals & need != need
    {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the peer's descriptor is not a memfd sealed against resizing",
        ));
    }
    Ok(st)
}

impl SharedMap {
    /// Creates a zeroed memfd of `len` bytes (at least one page is mapped) and maps it.
    pub(crate) fn create(name: &str, len: usize) -> io::Result<SharedMap> {
        let cname = CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: `cname` is a live NUL-terminated string; the result is checked.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(last_error("memfd_create"));
        }
        // SAFETY: `raw` was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = len.max(1);
        // SAFETY: plain syscall on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(last_error("ftruncate of a memfd"));
        }
        // SAFETY: plain fcntl(2) on a descriptor we own; the result is checked.
        let sealed = unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if sealed != 0 {
            return Err(last_error("sealing a memfd"));
        }
        Self::map_fd(fd, size, len)
    }

    /// Maps the first `len` bytes of a memfd received from a peer, which must be a sealed memfd
    /// (see [`require_sealed`]) of at least that size.
    pub(crate) fn from_fd(fd: OwnedFd, len: usize) -> io::Result<SharedMap> {
        let st = require_sealed(fd.as_raw_fd())?;
        if len == 0 || (st.st_size as u64) < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer's memory file is smaller than its kind is",
            ));
        }
        Self::map_fd(fd, len, len)
    }

    /// Opens another process's memfd by its descriptor number, one-sidedly (the owner runs no
    /// code, so this works while it is stopped), and checks it is the file the owner published
    /// (`inode`): a descriptor number may have been closed and reused since.
    pub(crate) fn open_peer(pid: u32, fd: i32, inode: u64, len: usize) -> io::Result<SharedMap> {
        let gone = || {
            io::Error::new(
                io::ErrorKind::NotFound,
                "the peer's descriptor no longer names the published region",
            )
        };
        // First only a path reference (O_PATH opens nothing: no FUSE request, no device open,
        // no controlling terminal), to see what the number names; then the file itself, once
        // it is known to be the published regular file.
        let path = CString::new(format!("/proc/{pid}/fd/{fd}"))
            .map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: `path` is a live NUL-terminated string; the result is checked.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(last_error("opening a peer's memory region"));
        }
        // SAFETY: `raw` was just returned by open and is owned by nobody else.
        let reference = unsafe { OwnedFd::from_raw_fd(raw) };
        let st = fstat(reference.as_raw_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_ino != inode {
            return Err(gone());
        }
        let again = CString::new(format!("/proc/self/fd/{}", reference.as_raw_fd()))
            .map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: as above.
        let raw = unsafe {
            libc::open(
                again.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK,
            )
        };
        if raw < 0 {
            return Err(last_error("opening a peer's memory region"));
        }
        // SAFETY: as above.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let st = require_sealed(fd.as_raw_fd())?;
        if st.st_ino != inode || (st.st_size as u64) < len.max(1) as u64 {
            return Err(gone());
        }
        Self::map_fd(fd, len.max(1), len)
    }

    fn map_fd(fd: OwnedFd, size: usize, len: usize) -> io::Result<SharedMap> {
        // SAFETY: a fresh shared mapping of a descriptor we own; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_error("mapping shared memory"));
        }
        let inode = fstat(fd.as_raw_fd())?.st_ino;
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(SharedMap {
            ptr,
            len: len.min(size),
            mapped: size,
            fd,
            inode,
        })
    }

    /// The first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Usable length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The memfd.
    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The memfd's inode number (what a peer checks after opening it by number).
    pub(crate) fn inode(&self) -> u64 {
        self.inode
    }

    /// The 64-bit atomic at byte `offset` (8-aligned, inside the mapping).
    pub(crate) fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset % 8 == 0 && offset + 8 <= self.len,
            "atomic outside a shared mapping"
        );
        // SAFETY: in bounds and aligned (checked above; the mapping is page-aligned); the
        // mapping lives as long as `self`, and AtomicU64 tolerates concurrent access from any
        // thread or process.
        unsafe { AtomicU64::from_ptr(self.ptr().add(offset).cast()) }
    }

    /// The 32-bit atomic at byte `offset` (4-aligned, inside the mapping).
    pub(crate) fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len,
            "atomic outside a shared mapping"
        );
        // SAFETY: as for `u64_at`.
        unsafe { AtomicU32::from_ptr(self.ptr().add(offset).cast()) }
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `map_fd`; nothing borrowed from it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.mapped);
        }
    }
}
