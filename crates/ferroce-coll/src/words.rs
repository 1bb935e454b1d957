//! The words ranks signal each other with: slot header words and credit words, which one
//! process stores into and another polls (see `comm/mod.rs`'s module doc, "Memory ordering", for
//! the protocol and why it is ordered).
//!
//! Every access to such a word here is a 64-bit atomic: a load with acquire ordering by the
//! rank that polls it, a store with release ordering by the rank that sets it, whether the word
//! is in this rank's own region ([`WordRegion`]) or in a same-host peer's mapped here
//! ([`mapped`]). The bulk bytes the words announce (a slot's message) are plain copies: the
//! release store that follows them and the acquire load that precedes their use order them.

use std::sync::atomic::{AtomicU64, Ordering};

use ferroce::{Access, MemoryRegion, PeerRegionMap, ProtectionDomain};

/// A region of 8-byte words that ferroce allocated ([`ProtectionDomain::alloc_mr`]): a memfd
/// mapped shared, page-aligned, at its [`addr`](MemoryRegion::addr) in this process, for as long
/// as the region lives. Peers (and ferroce's engine, placing their WRITEs) store into its words;
/// this rank loads them as atomics. Made only by [`alloc`](Self::alloc), so the mapping is
/// known to be there.
pub(crate) struct WordRegion {
    mr: MemoryRegion,
}

impl WordRegion {
    /// `words` zeroed words with `access`.
    pub(crate) fn alloc(
        pd: &ProtectionDomain,
        words: usize,
        access: Access,
    ) -> Result<WordRegion, ferroce::Error> {
        let mr = pd.alloc_mr(8 * words, access)?;
        if mr.addr() % 8 != 0 {
            return Err(ferroce::Error::InvalidArgument(
                "a region for words is not 8-aligned".into(),
            ));
        }
        Ok(WordRegion { mr })
    }

    /// The region, to hand to peers and to name in work requests.
    pub(crate) fn mr(&self) -> &MemoryRegion {
        &self.mr
    }

    /// Word `i`, if the region has it.
    fn word(&self, i: usize) -> Option<&AtomicU64> {
        if i >= self.mr.len() / 8 {
            return None;
        }
        let p = (self.mr.addr() as usize + 8 * i) as *mut u64;
        // SAFETY: the region was allocated by ferroce (`alloc`), so its bytes are mapped at
        // `addr()` in this process while `self.mr` lives, which the returned reference's
        // lifetime (that of `&self`) does not outlast; word `i` lies inside them (checked) and
        // is 8-aligned (`addr()` is, checked in `alloc`, and the offset is a multiple of 8).
        // Nothing in this process makes a reference to these bytes; every other access is an
        // 8-byte store of a whole word: a peer's atomic store through its mapping, or ferroce
        // placing an aligned 8-byte WRITE, whatever value a peer chose (any u64 is valid).
        Some(unsafe { AtomicU64::from_ptr(p) })
    }

    /// Loads word `i` with acquire ordering: what its writer stored before the word (the
    /// message a header announces, the reads of a slot a credit frees) happened before
    /// anything this rank does after the load.
    pub(crate) fn load(&self, i: usize) -> Result<u64, ferroce::Error> {
        self.word(i)
            .map(|w| w.load(Ordering::Acquire))
            .ok_or_else(|| out_of_range(i))
    }

    /// Stores word `i` with release ordering (a staging word a posted WRITE sends from: the
    /// store is done, and ordered after everything before it, when the post reads it).
    pub(crate) fn store(&self, i: usize, v: u64) -> Result<(), ferroce::Error> {
        self.word(i)
            .map(|w| w.store(v, Ordering::Release))
            .ok_or_else(|| out_of_range(i))
    }
}

fn out_of_range(i: usize) -> ferroce::Error {
    ferroce::Error::InvalidArgument(format!("word {i} is outside its region"))
}

/// Word `i` of a same-host peer's region mapped here, if the mapping has it and it is
/// 8-aligned (a peer that lied about its region's address in its card gets `None`, and no
/// atomic is made over a misaligned word).
pub(crate) fn mapped(map: &PeerRegionMap, i: usize) -> Option<&AtomicU64> {
    let end = 8 * i + 8;
    let p = map.as_ptr().wrapping_add(8 * i);
    if end > map.len() || p as usize % 8 != 0 {
        return None;
    }
    // SAFETY: `p` lies inside the mapping (checked against `len()`), which stays mapped while
    // `map` lives (the reference's lifetime is `map`'s borrow), and is 8-aligned (checked).
    // The peer accesses the word only as an atomic (or through ferroce placing whole aligned
    // words), and nothing here makes a reference to it; any u64 a peer leaves there is valid.
    Some(unsafe { AtomicU64::from_ptr(p.cast()) })
}
