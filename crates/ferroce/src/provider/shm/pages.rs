//! The two shared pages a context publishes: its key table (one slot per registered region)
//! and, per QP, a QP page (state, access rights, protection domain, inbound packet ring). Their
//! layouts are fixed here; every reader checks the stamp before believing a mapping.

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use ferroce_proto::{Access, QpState};

use super::admit::{Grant, PeerQpWords};
use super::map::SharedMap;
use super::ring::Ring;

// ---- key table layout -------------------------------------------------------------------

pub(super) const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"FRCESHT2");
/// Byte offset of the "engine sleeping" flag in a key table's header.
pub(super) const TABLE_SLEEPING: usize = 8;
/// Where the slots start.
pub(super) const TABLE_HEADER: usize = 4096;
/// Regions a table publishes: keys with a larger index are not reachable over shm (their
/// requests take the packet path, served by the target's engine).
pub(crate) const TABLE_SLOTS: usize = 1 << 16;
pub(super) const SLOT: usize = 64;
pub(super) const TABLE_LEN: usize = TABLE_HEADER + TABLE_SLOTS * SLOT;
// Slot fields (byte offsets in a slot).
pub(super) const S_SEQ: usize = 0;
pub(super) const S_KEY: usize = 8;
pub(super) const S_PD: usize = 12;
pub(super) const S_ACCESS: usize = 16;
pub(super) const S_ADDR: usize = 24;
pub(super) const S_LEN: usize = 32;
pub(super) const S_FD: usize = 40;
pub(super) const S_INODE: usize = 48;
pub(super) const S_FILE_OFFSET: usize = 56;

// ---- QP page layout ---------------------------------------------------------------------

pub(super) const PAGE_MAGIC: u64 = u64::from_le_bytes(*b"FRCESHQ1");
pub(super) const P_STATE: usize = 8;
pub(super) const P_ACCESS: usize = 12;
pub(super) const P_PD: usize = 16;
pub(super) const P_HEAD: usize = 64;
pub(super) const P_TAIL: usize = 128;
pub(super) const P_RING: usize = 4096;
/// Bytes of a QP's inbound packet ring.
pub(super) const RING_BYTES: usize = 1 << 20;
pub(super) const PAGE_LEN: usize = P_RING + RING_BYTES;

pub(super) fn state_code(s: QpState) -> u32 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Error => 6,
    }
}

/// Whether a QP in the state `state_code` names serves requests from its peer (RTR, RTS, SQD).
#[inline]
pub(super) fn state_serves(code: u32) -> bool {
    matches!(code, 2..=4)
}

/// Creates a memfd of `len` bytes stamped with `magic`.
pub(super) fn stamped(name: &str, len: usize, magic: u64) -> io::Result<SharedMap> {
    let map = SharedMap::create(name, len)?;
    map.u64_at(0).store(magic, Ordering::Release);
    Ok(map)
}

/// Accepts a peer's mapping only if it is at least `len` bytes and stamped with `magic`.
pub(super) fn checked(map: SharedMap, len: usize, magic: u64, what: &str) -> io::Result<SharedMap> {
    if map.len() < len || map.u64_at(0).load(Ordering::Acquire) != magic {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a ferroce {what}"),
        ));
    }
    Ok(map)
}

/// What a slot of a key table says about a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PublishedRegion {
    pub key: u32,
    pub pd: u32,
    pub access: Access,
    pub addr: u64,
    pub len: u64,
    pub fd: i32,
    pub inode: u64,
    /// Where `addr` is in the memfd (caller memory adopted for another region may start the
    /// file earlier, see `adopt`).
    pub file_offset: u64,
}

impl PublishedRegion {
    /// What the slot grants (see `admit`).
    #[inline]
    pub(super) fn grant(&self) -> Grant {
        Grant {
            pd: self.pd,
            access: self.access,
            addr: self.addr,
            len: self.len,
        }
    }
}

/// A key table (this context's, or a peer's mapped).
#[derive(Debug)]
pub(crate) struct KeyTable {
    pub(super) map: SharedMap,
}

impl KeyTable {
    pub(super) fn create() -> io::Result<KeyTable> {
        Ok(KeyTable {
            map: stamped("ferroce-keys", TABLE_LEN, TABLE_MAGIC)?,
        })
    }

    pub(super) fn from_map(map: SharedMap) -> io::Result<KeyTable> {
        Ok(KeyTable {
            map: checked(map, TABLE_LEN, TABLE_MAGIC, "key table")?,
        })
    }

    pub(super) fn slot(&self, index: usize) -> usize {
        TABLE_HEADER + index * SLOT
    }

    /// Publishes a region under `key` (only the owning context writes its table, under its
    /// region-table lock, so there is one writer per slot).
    pub(crate) fn publish(&self, r: &PublishedRegion) {
        self.write_slot(r.key, |s| {
            self.map.u32_at(s + S_KEY).store(r.key, Ordering::Relaxed);
            self.map.u32_at(s + S_PD).store(r.pd, Ordering::Relaxed);
            self.map
                .u32_at(s + S_ACCESS)
                .store(r.access.bits(), Ordering::Relaxed);
            self.map.u64_at(s + S_ADDR).store(r.addr, Ordering::Relaxed);
            self.map.u64_at(s + S_LEN).store(r.len, Ordering::Relaxed);
            self.map
                .u32_at(s + S_FD)
                .store(r.fd as u32, Ordering::Relaxed);
            self.map
                .u64_at(s + S_INODE)
                .store(r.inode, Ordering::Relaxed);
            self.map
                .u64_at(s + S_FILE_OFFSET)
                .store(r.file_offset, Ordering::Relaxed);
        });
    }

    /// Withdraws `key`: no new access finds it (one under way may still complete, into pages
    /// the memfd keeps alive for as long as the accessor maps them).
    pub(crate) fn withdraw(&self, key: u32) {
        self.write_slot(key, |s| {
            self.map.u32_at(s + S_KEY).store(0, Ordering::Relaxed);
        });
    }

    /// Rewrites the slot of `key` under its sequence number (odd while the fields change), so
    /// a reader never takes a half-written slot.
    pub(super) fn write_slot(&self, key: u32, fill: impl FnOnce(usize)) {
        let index = (key >> 8) as usize;
        if index >= TABLE_SLOTS {
            return;
        }
        let s = self.slot(index);
        let seq = self.map.u64_at(s + S_SEQ);
        let start = seq.load(Ordering::Relaxed) | 1;
        seq.store(start, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        fill(s);
        seq.store(start + 1, Ordering::Release);
    }

    /// The sequence number of the slot `key` names, if it is at rest (not being rewritten):
    /// while it stays the same, so does the slot (every rewrite moves it on), so a reader that
    /// keeps what it read under a number need not read the slot again.
    #[inline]
    pub(super) fn seq_at_rest(&self, key: u32) -> Option<u64> {
        let seq = self.seq_word(key)?.load(Ordering::Acquire);
        (seq & 1 == 0).then_some(seq)
    }

    /// The sequence number word of the slot `key` names (see `seq_at_rest`).
    #[inline]
    pub(super) fn seq_word(&self, key: u32) -> Option<&AtomicU64> {
        let index = (key >> 8) as usize;
        (index < TABLE_SLOTS).then(|| self.map.u64_at(self.slot(index) + S_SEQ))
    }

    /// A consistent read of the slot `key` names, if it holds that key, with the slot's
    /// sequence number at the time.
    pub(super) fn lookup(&self, key: u32) -> Option<(PublishedRegion, u64)> {
        let index = (key >> 8) as usize;
        if index >= TABLE_SLOTS || key & 0xff == 0 {
            return None;
        }
        let s = self.slot(index);
        let seq = self.map.u64_at(s + S_SEQ);
        for _ in 0..1000 {
            let before = seq.load(Ordering::Acquire);
            if before & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let r = PublishedRegion {
                key: self.map.u32_at(s + S_KEY).load(Ordering::Relaxed),
                pd: self.map.u32_at(s + S_PD).load(Ordering::Relaxed),
                access: Access::from_bits(self.map.u32_at(s + S_ACCESS).load(Ordering::Relaxed)),
                addr: self.map.u64_at(s + S_ADDR).load(Ordering::Relaxed),
                len: self.map.u64_at(s + S_LEN).load(Ordering::Relaxed),
                fd: self.map.u32_at(s + S_FD).load(Ordering::Relaxed) as i32,
                inode: self.map.u64_at(s + S_INODE).load(Ordering::Relaxed),
                file_offset: self.map.u64_at(s + S_FILE_OFFSET).load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == before {
                return (r.key == key).then_some((r, before));
            }
        }
        None
    }

    /// Tells peers whether this context's engine sleeps (and must be woken by a byte).
    pub(crate) fn set_sleeping(&self, sleeping: bool) {
        self.map
            .u32_at(TABLE_SLEEPING)
            .store(u32::from(sleeping), Ordering::SeqCst);
        // The other half of `PeerLink::wake`'s fence: the engine reads the rings' heads after
        // this store (acquire loads, which may pass it without a full fence).
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    pub(super) fn sleeping(&self) -> bool {
        self.map.u32_at(TABLE_SLEEPING).load(Ordering::SeqCst) != 0
    }
}

/// A QP page: this QP's published state and its inbound packet ring.
#[derive(Debug)]
pub(crate) struct QpPage {
    pub(super) map: SharedMap,
}

impl QpPage {
    pub(crate) fn create() -> io::Result<QpPage> {
        Ok(QpPage {
            map: stamped("ferroce-qp", PAGE_LEN, PAGE_MAGIC)?,
        })
    }

    pub(super) fn from_map(map: SharedMap) -> io::Result<QpPage> {
        Ok(QpPage {
            map: checked(map, PAGE_LEN, PAGE_MAGIC, "QP page")?,
        })
    }

    pub(crate) fn ring(&self) -> Ring {
        let p = self.map.ptr();
        // SAFETY: the three areas lie inside the mapping (PAGE_LEN checked or created), are
        // 8-aligned and disjoint, and the view is used only while `self` lives.
        unsafe {
            Ring::new(
                p.add(P_HEAD).cast(),
                p.add(P_TAIL).cast(),
                p.add(P_RING),
                RING_BYTES,
            )
        }
    }

    /// Sets both ring positions to `at` (the consumer's own position), for a new producer:
    /// nothing an earlier peer left in the page carries over.
    pub(crate) fn reset_ring(&self, at: u64) {
        self.map.u64_at(P_TAIL).store(at, Ordering::Release);
        self.map.u64_at(P_HEAD).store(at, Ordering::Release);
    }

    /// Publishes what a peer checks before it reaches memory through this QP.
    pub(crate) fn publish(&self, state: QpState, access: Option<Access>, pd: u32) {
        if let Some(a) = access {
            self.map.u32_at(P_ACCESS).store(a.bits(), Ordering::Release);
        }
        self.map.u32_at(P_PD).store(pd, Ordering::Release);
        self.map
            .u32_at(P_STATE)
            .store(state_code(state), Ordering::Release);
    }

    /// The words `publish` writes (state code, access bits, protection domain).
    #[inline]
    pub(super) fn state_word(&self) -> &AtomicU32 {
        self.map.u32_at(P_STATE)
    }
    #[inline]
    pub(super) fn access_word(&self) -> &AtomicU32 {
        self.map.u32_at(P_ACCESS)
    }
    #[inline]
    pub(super) fn pd_word(&self) -> &AtomicU32 {
        self.map.u32_at(P_PD)
    }

    /// What the page says now, for `admit`.
    #[inline]
    pub(super) fn words(&self) -> PeerQpWords {
        PeerQpWords {
            state: self.state_word().load(Ordering::Acquire),
            access: self.access_word().load(Ordering::Acquire),
            pd: self.pd_word().load(Ordering::Acquire),
        }
    }
}
