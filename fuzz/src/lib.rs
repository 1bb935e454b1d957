//! What the ferroce fuzz targets share: a cursor that turns fuzz bytes into choices, a memory
//! of named regions separated by guard regions that remembers which bytes the driver allowed
//! to change, an auditing [`Memory`] wrapper, and the checks every emitted packet must pass.
//!
//! The targets drive a real [`ferroce_proto::QueuePair`]; nothing here imitates the transport.
//! Every invariant is a panic with a message that says what broke, which is what libFuzzer
//! reports as a crash.

use ferroce_proto::qp::MAX_HEADER_LEN;
use ferroce_proto::{Access, AtomicOp, KeyKind, Memory, MemoryError, VecMemory};
use ferroce_wire::bth::DEFAULT_PKEY;
use ferroce_wire::opcode::Transport;
use ferroce_wire::packet::ICRC_LEN;
use ferroce_wire::{PacketRepr, RocePacket};

/// Reads choices out of the fuzz input; past its end every read yields zeros, so a short input
/// is still a whole scenario.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data, pos: 0 }
    }

    /// Whether every byte has been read.
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    /// The next two bytes, little-endian.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// The next four bytes, little-endian.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// The next eight bytes, little-endian.
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A value in `0..n` from one byte (`n` at most 256; 0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            usize::from(self.u8()) % n
        }
    }

    /// Up to `n` raw bytes, fewer where the input ends.
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let start = self.pos.min(self.data.len());
        let end = start.saturating_add(n).min(self.data.len());
        self.pos = self.pos.saturating_add(n);
        &self.data[start..end]
    }
}

/// One registered region of a [`World`].
#[derive(Debug, Clone)]
pub struct RegionInfo {
    /// Name used in panic messages.
    pub name: &'static str,
    /// Index in the [`VecMemory`].
    pub index: usize,
    /// Virtual address of the first byte.
    pub base: u64,
    /// Length in bytes.
    pub len: usize,
    /// Rights.
    pub access: Access,
    /// Protection domain.
    pub pd: u32,
    /// Whether this is a guard placed around a data region (never granted).
    pub guard: bool,
}

impl RegionInfo {
    /// The byte range `[addr, addr + len)` clipped to this region, as offsets.
    pub fn clip(&self, addr: u64, len: u64) -> Option<(usize, usize)> {
        let end = addr.saturating_add(len);
        let rend = self.base + self.len as u64;
        let s = addr.max(self.base);
        let e = end.min(rend);
        (s < e).then(|| ((s - self.base) as usize, (e - self.base) as usize))
    }
}

/// Bytes of every guard region: 64 on each side of each data region.
pub const GUARD_LEN: usize = 64;

/// A [`VecMemory`] laid out as one address space: data regions back to back, each with a
/// guard region (no rights) right before and after it, so an access that runs past a region's
/// edge by address lands in a guard. It remembers which bytes the driver granted a reason to
/// change and panics, in [`World::check`], on any other change.
#[derive(Debug)]
pub struct World {
    /// The memory handed to the QP.
    pub mem: VecMemory,
    /// Every region, guards included, in registration order (= `VecMemory` index).
    pub regions: Vec<RegionInfo>,
    /// Contents at the last check.
    prev: Vec<Vec<u8>>,
    /// Per region, per byte: whether a change there is explained.
    allowed: Vec<Vec<bool>>,
}

impl World {
    /// Registers `(name, len, access, pd)` data regions from `base` up, each between guards,
    /// and fills each with a distinct pattern (so a write of any value is likely visible).
    pub fn new(base: u64, layout: &[(&'static str, usize, Access, u32)]) -> World {
        let mut w = World {
            mem: VecMemory::new(),
            regions: Vec::new(),
            prev: Vec::new(),
            allowed: Vec::new(),
        };
        let mut at = base;
        for &(name, len, access, pd) in layout {
            for (n, l, a, g) in [
                ("guard", GUARD_LEN, Access::NONE, true),
                (name, len, access, false),
            ] {
                let index = w.mem.register(pd, at, l, a);
                w.regions.push(RegionInfo {
                    name: n,
                    index,
                    base: at,
                    len: l,
                    access: a,
                    pd,
                    guard: g,
                });
                at += l as u64;
            }
        }
        let index = w.mem.register(1, at, GUARD_LEN, Access::NONE);
        w.regions.push(RegionInfo {
            name: "guard",
            index,
            base: at,
            len: GUARD_LEN,
            access: Access::NONE,
            pd: 1,
            guard: true,
        });
        for r in &w.regions {
            let fill = (r.index as u8).wrapping_mul(37);
            for (i, b) in w.mem.region_mut(r.index).bytes.iter_mut().enumerate() {
                *b = fill.wrapping_add(i as u8);
            }
        }
        w.prev = w
            .regions
            .iter()
            .map(|r| w.mem.region(r.index).bytes.clone())
            .collect();
        w.allowed = w.regions.iter().map(|r| vec![false; r.len]).collect();
        w
    }

    /// The data region called `name`.
    pub fn named(&self, name: &str) -> &RegionInfo {
        self.regions
            .iter()
            .find(|r| r.name == name)
            .expect("a region of the layout")
    }

    /// Data regions (guards left out).
    pub fn data_regions(&self) -> impl Iterator<Item = &RegionInfo> {
        self.regions.iter().filter(|r| !r.guard)
    }

    /// The current remote key of region `index`.
    pub fn rkey(&self, index: usize) -> u32 {
        self.mem.region(index).rkey
    }

    /// The local key of region `index`.
    pub fn lkey(&self, index: usize) -> u32 {
        self.mem.region(index).lkey
    }

    /// Allows the bytes `[addr, addr + len)` of the region found by `key` to change, if that
    /// region is in `pd`, grants `need`, and is not a guard: the driver just handed the QP a
    /// request that may legitimately write there.
    pub fn grant(&mut self, pd: u32, kind: KeyKind, key: u32, addr: u64, len: u64, need: Access) {
        if key == 0 {
            return;
        }
        for (i, r) in self.regions.iter().enumerate() {
            let rr = self.mem.region(r.index);
            let k = match kind {
                KeyKind::Local => rr.lkey,
                KeyKind::Remote => rr.rkey,
            };
            if k != key || r.pd != pd || r.guard || !r.access.contains(need) {
                continue;
            }
            if let Some((s, e)) = r.clip(addr, len) {
                self.allowed[i][s..e].fill(true);
            }
        }
    }

    /// Panics on any byte changed since the last check that no grant explains; returns how
    /// many bytes changed. The current contents become the reference for the next check.
    pub fn check(&mut self, what: &str) -> usize {
        let mut changed = 0;
        for (i, r) in self.regions.iter().enumerate() {
            let now = &self.mem.region(r.index).bytes;
            assert_eq!(now.len(), r.len, "region {} changed size", r.name);
            if now[..] == self.prev[i][..] {
                continue;
            }
            for (off, (a, b)) in now.iter().zip(self.prev[i].iter()).enumerate() {
                if a != b {
                    assert!(
                        self.allowed[i][off],
                        "{what}: byte {off} of region '{}' (access {:#x}, pd {}{}) changed \
                         from {b:#04x} to {a:#04x} though no request granted a write there",
                        r.name,
                        r.access.bits(),
                        r.pd,
                        if r.guard { ", guard" } else { "" },
                    );
                    changed += 1;
                }
            }
            self.prev[i].copy_from_slice(now);
        }
        changed
    }

    /// Takes the current contents as the reference, after the driver's own writes (as the
    /// application's CPU would make them).
    pub fn accept(&mut self) {
        for (i, r) in self.regions.iter().enumerate() {
            self.prev[i].copy_from_slice(&self.mem.region(r.index).bytes);
        }
    }

    /// A copy of every region's bytes (for "this step changed nothing" checks).
    pub fn snapshot(&self) -> Vec<Vec<u8>> {
        self.regions
            .iter()
            .map(|r| self.mem.region(r.index).bytes.clone())
            .collect()
    }

    /// Panics if any byte differs from `snap`.
    pub fn assert_unchanged(&self, snap: &[Vec<u8>], what: &str) {
        for (r, s) in self.regions.iter().zip(snap) {
            assert!(
                self.mem.region(r.index).bytes == *s,
                "{what} changed region '{}'",
                r.name
            );
        }
    }

    /// The 8 bytes at `addr` of the region with remote key `rkey`, if in bounds.
    pub fn word(&self, rkey: u32, addr: u64) -> Option<u64> {
        let r = self
            .regions
            .iter()
            .find(|r| self.mem.region(r.index).rkey == rkey && rkey != 0)?;
        let (s, e) = r.clip(addr, 8)?;
        if e - s != 8 || addr < r.base {
            return None;
        }
        let b = &self.mem.region(r.index).bytes[s..e];
        Some(u64::from_ne_bytes(b.try_into().ok()?))
    }
}

/// A [`Memory`] that checks how the transport asks before passing the call on: always in the
/// QP's protection domain, a remote key only with a remote right, a local write only with
/// local-write. A transport that asked for less than the operation needs would be trusting the
/// memory to refuse what it should have refused itself.
#[derive(Debug)]
pub struct Audited<'a> {
    /// The memory underneath.
    pub mem: &'a mut VecMemory,
    /// The QP's protection domain.
    pub pd: u32,
}

impl Audited<'_> {
    fn pd_ok(&self, pd: u32) {
        assert_eq!(
            pd, self.pd,
            "memory reached through another protection domain"
        );
    }
}

impl Memory for Audited<'_> {
    fn read(
        &mut self,
        pd: u32,
        kind: KeyKind,
        key: u32,
        addr: u64,
        out: &mut [u8],
        need: Access,
    ) -> Result<(), MemoryError> {
        self.pd_ok(pd);
        if kind == KeyKind::Remote {
            assert!(
                need.contains(Access::REMOTE_READ),
                "remote read asked without REMOTE_READ"
            );
        }
        self.mem.read(pd, kind, key, addr, out, need)
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
        self.pd_ok(pd);
        let right = match kind {
            KeyKind::Remote => Access::REMOTE_WRITE,
            KeyKind::Local => Access::LOCAL_WRITE,
        };
        assert!(
            need.contains(right),
            "{kind:?} write asked without {right:?}"
        );
        self.mem.write(pd, kind, key, addr, data, need)
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
        self.pd_ok(pd);
        if kind == KeyKind::Remote {
            let remote = Access::REMOTE_READ
                .with(Access::REMOTE_WRITE)
                .with(Access::REMOTE_ATOMIC);
            assert!(
                need.bits() & remote.bits() != 0,
                "remote key checked without a remote right"
            );
        }
        self.mem.check(pd, kind, key, addr, len, need)
    }

    fn atomic(&mut self, pd: u32, rkey: u32, addr: u64, op: AtomicOp) -> Result<u64, MemoryError> {
        self.pd_ok(pd);
        self.mem.atomic(pd, rkey, addr, op)
    }

    fn invalidate(&mut self, pd: u32, rkey: u32) -> Result<(), MemoryError> {
        self.pd_ok(pd);
        self.mem.invalidate(pd, rkey)
    }
}

/// Checks a packet a QP wrote into its transmit buffer and returns its plain form: it parses
/// with `ferroce_wire`, is an RC packet (or ferroce's SACK) addressed to `dest_qpn` in the default partition, its
/// pad bytes are zero, it fits the buffer the QP was promised (path MTU plus headers), and its
/// ICRC is left zero for the caller to fill, as `poll_transmit` documents.
pub fn check_emitted(bytes: &[u8], max_mtu: usize, dest_qpn: u32) -> PacketRepr {
    assert!(
        bytes.len() <= max_mtu + MAX_HEADER_LEN,
        "emitted {} bytes, more than path MTU {max_mtu} plus headers",
        bytes.len()
    );
    let pkt = match RocePacket::new_checked(bytes) {
        Ok(p) => p,
        Err(e) => panic!("the QP emitted a packet ferroce-wire rejects: {e:?}: {bytes:02x?}"),
    };
    let repr = match PacketRepr::parse(&pkt) {
        Ok(r) => r,
        Err(e) => panic!("the QP emitted a packet that does not parse: {e:?}"),
    };
    let info = repr.info().expect("checked packet has a known opcode");
    // ferroce's SACK is the one non-RC packet a QP sends (to a selective-repeat peer; the
    // targets check that the QP runs selective repeat when they see one).
    assert!(
        info.transport == Transport::Rc || repr.bth.opcode == ferroce_wire::Opcode::FERROCE_SACK,
        "non-RC packet {repr:?}"
    );
    assert_eq!(repr.bth.dest_qpn, dest_qpn, "packet to the wrong QP");
    assert_eq!(repr.bth.pkey, DEFAULT_PKEY, "packet in another partition");
    assert!(
        repr.payload_len <= max_mtu,
        "payload {} over the MTU",
        repr.payload_len
    );
    let icrc_at = bytes.len() - ICRC_LEN;
    assert_eq!(&bytes[icrc_at..], &[0; 4], "ICRC bytes not left zero");
    let pad_at = pkt.payload_offset() + repr.payload_len;
    assert!(
        bytes[pad_at..icrc_at].iter().all(|&b| b == 0),
        "nonzero pad bytes"
    );
    // What the QP emits re-emits to the same headers.
    let mut again = vec![0u8; bytes.len()];
    let n = repr.emit(&mut again).expect("a parsed packet emits");
    assert_eq!(n, bytes.len());
    assert_eq!(
        again[..pkt.payload_offset()],
        bytes[..pkt.payload_offset()],
        "headers do not round-trip"
    );
    repr
}

/// Whether `FERROCE_FUZZ_TRACE` is set: the targets then print every step, packet in and out
/// and completion to stderr, to read a crash's story when it is replayed.
pub fn trace() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FERROCE_FUZZ_TRACE").is_some())
}

/// One line for a packet: opcode, PSN, the extension headers and the payload length.
pub fn describe(bytes: &[u8]) -> String {
    match RocePacket::new_checked(bytes).map(|p| PacketRepr::parse(&p)) {
        Ok(Ok(r)) => {
            let mut s = format!("{:?} psn={}", r.bth.opcode, r.bth.psn.value());
            let e = r.ext;
            if let Some(h) = e.reth {
                s += &format!(" reth(va={:#x} rkey={:#x} len={})", h.va, h.rkey, h.dma_len);
            }
            if let Some(h) = e.atomic_eth {
                s += &format!(
                    " atomic(va={:#x} rkey={:#x} swap_add={:#x} cmp={:#x})",
                    h.va, h.rkey, h.swap_add, h.compare
                );
            }
            if let Some(h) = e.aeth {
                s += &format!(" aeth({} msn={})", h.syndrome, h.msn);
            }
            if let Some(h) = e.atomic_ack_eth {
                s += &format!(" orig={:#x}", h.original);
            }
            if let Some(h) = e.immdt {
                s += &format!(" imm={:#x}", h.value);
            }
            if let Some(h) = e.ieth {
                s += &format!(" ieth={:#x}", h.rkey);
            }
            s + &format!(" ack_req={} payload={}", r.bth.ack_req, r.payload_len)
        }
        _ => format!("unparsable {} bytes", bytes.len()),
    }
}
