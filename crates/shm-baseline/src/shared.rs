//! One page of memory shared between two processes: a sealed memfd mapped `MAP_SHARED` by both.
//!
//! The creator makes the memfd, sizes it to one page and seals its size (`F_SEAL_SHRINK`,
//! `F_SEAL_GROW`, then `F_SEAL_SEAL`), so no one can ever truncate it under a mapping (which
//! would turn loads into `SIGBUS`). The second process gets the descriptor as its stdin and
//! checks those seals before mapping it: a sealed memfd is something only `pingpong` hands out,
//! so the responder run by hand with an ordinary file as stdin refuses instead of scribbling on
//! the file.
//!
//! The page is only ever accessed as a few [`AtomicU64`] words, one per [`Word`], each on its
//! own pair of cache lines so that the two spinning processes never share a line by accident
//! (adjacent-line prefetchers pull lines in pairs).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// Bytes in the shared mapping (one page on every Linux target this runs on, and a multiple of
/// the page size everywhere).
pub const PAGE_BYTES: usize = 4096;

/// Bytes between two words: two 64-byte cache lines.
const WORD_STRIDE: usize = 128;

/// The seals a page made by [`SharedPage::create`] carries.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// The words in the shared page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Word {
    /// Written by the initiator, watched by the responder.
    Ping,
    /// Written by the responder, watched by the initiator.
    Pong,
    /// The start-up handshake: the initiator writes a greeting before starting the responder,
    /// which answers by overwriting it.
    Handshake,
    /// The number of pings the responder echoed, written once as it stops.
    Echoes,
}

impl Word {
    /// Byte offset of the word in the page.
    fn offset(self) -> usize {
        WORD_STRIDE
            * match self {
                Word::Ping => 0,
                Word::Pong => 1,
                Word::Handshake => 2,
                Word::Echoes => 3,
            }
    }
}

/// A shared page mapped into this process; unmapped on drop.
#[derive(Debug)]
pub struct SharedPage {
    /// Start of the mapping: page-aligned and [`PAGE_BYTES`] long, valid until drop.
    base: NonNull<u8>,
}

impl SharedPage {
    /// Creates a new zero-filled page; returns its mapping here and the memfd to hand to the
    /// other process.
    pub fn create() -> io::Result<(SharedPage, File)> {
        // SAFETY: the name is a NUL-terminated string literal that outlives the call; the flags
        // are valid memfd_create flags. The call only creates a new descriptor.
        let fd = unsafe {
            libc::memfd_create(
                c"shm-baseline".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create, is open, and nothing else owns it.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // usize -> u64 is lossless on every target Rust supports.
        file.set_len(PAGE_BYTES as u64)?;
        // SAFETY: F_ADD_SEALS takes an int argument; `file` is borrowed, so its descriptor is open.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let page = SharedPage::map(&file)?;
        Ok((page, file))
    }

    /// Maps the page of a memfd made by [`SharedPage::create`] (in this or another process).
    /// Anything else — a file without exactly those seals, or of another size — is refused.
    pub fn open(fd: BorrowedFd<'_>) -> Result<SharedPage, String> {
        // SAFETY: F_GET_SEALS takes no argument; `fd` is borrowed, so it stays open for the call.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals != SEALS {
            return Err(
                "the descriptor is not a page made by `shm-baseline pingpong` \
                        (no sealed memfd; this command is not meant to be run by hand)"
                    .to_string(),
            );
        }
        let file = File::from(
            fd.try_clone_to_owned()
                .map_err(|e| format!("cannot duplicate the page's descriptor: {e}"))?,
        );
        let len = file
            .metadata()
            .map_err(|e| format!("cannot stat the page: {e}"))?
            .len();
        if len != PAGE_BYTES as u64 {
            return Err(format!("the page is {len} bytes, expected {PAGE_BYTES}"));
        }
        SharedPage::map(&file).map_err(|e| format!("cannot map the page: {e}"))
    }

    /// Maps the first [`PAGE_BYTES`] of `file`, shared and writable.
    fn map(file: &File) -> io::Result<SharedPage> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing (no MAP_FIXED), so no
        // existing memory is affected. The file is at least PAGE_BYTES long and sealed against
        // shrinking, so every byte of the mapping stays backed (no SIGBUS) for its lifetime.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(SharedPage { base })
    }

    /// The atomic word `w` of the page.
    pub fn word(&self, w: Word) -> &AtomicU64 {
        // SAFETY: the offset plus 8 bytes lies inside the PAGE_BYTES mapping, which is valid for
        // reads and writes until `self` is dropped (the returned reference borrows `self`). The
        // mapping is page-aligned and offsets are multiples of 128, so the address is aligned
        // for AtomicU64. Every access to these bytes, in this process and the other one, goes
        // through atomic operations (AtomicU64 is lock-free and address-free on every 64-bit
        // Linux target, so atomics in two processes on the same physical memory synchronize
        // as they would in one), and no non-atomic reference to the page is ever created.
        unsafe { &*self.base.as_ptr().add(w.offset()).cast::<AtomicU64>() }
    }
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        // SAFETY: `base` and PAGE_BYTES describe exactly the mapping made in `map`, unmapped
        // only here; every reference into it borrowed `self`, so none outlives this call.
        // munmap can only fail on bad arguments, which these are not.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), PAGE_BYTES);
        }
    }
}

/// Tests of the page: sharing, zero fill and the refusal of foreign descriptors.
#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering;

    /// Two mappings of one memfd see each other's stores, and a new page reads as zeros.
    #[test]
    fn two_mappings_share_the_words() {
        let (a, file) = SharedPage::create().unwrap();
        let b = SharedPage::open(file.as_fd()).unwrap();
        assert_ne!(a.base, b.base, "two distinct mappings");
        for w in [Word::Ping, Word::Pong, Word::Handshake, Word::Echoes] {
            assert_eq!(b.word(w).load(Ordering::Relaxed), 0, "{w:?}");
        }
        a.word(Word::Ping).store(0xfeed_beef, Ordering::Release);
        b.word(Word::Echoes).store(42, Ordering::Release);
        assert_eq!(b.word(Word::Ping).load(Ordering::Acquire), 0xfeed_beef);
        assert_eq!(a.word(Word::Echoes).load(Ordering::Acquire), 42);
        assert_eq!(a.word(Word::Pong).load(Ordering::Acquire), 0);
    }

    /// The words sit on distinct pairs of cache lines inside the page.
    #[test]
    fn words_do_not_share_lines() {
        let offsets: Vec<usize> = [Word::Ping, Word::Pong, Word::Handshake, Word::Echoes]
            .iter()
            .map(|w| w.offset())
            .collect();
        for (i, a) in offsets.iter().enumerate() {
            assert!(a + 8 <= PAGE_BYTES);
            for b in &offsets[i + 1..] {
                assert!(a.abs_diff(*b) >= 128, "{offsets:?}");
            }
        }
    }

    /// An ordinary file of the right size is refused and left untouched.
    #[test]
    fn ordinary_file_is_refused() {
        let path = std::env::temp_dir().join(format!("shm-baseline-test-{}", std::process::id()));
        let mut f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.write_all(&[7u8; PAGE_BYTES]).unwrap();
        let err = SharedPage::open(f.as_fd()).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(err.contains("not a page made by"), "{err}");
    }
}
