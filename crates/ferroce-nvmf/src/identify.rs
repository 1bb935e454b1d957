//! Identify data structures (NVMe base 2.0 §5.17.2, NVMe-oF 1.1 §4.1): what a host learns of
//! the controller and its namespaces before any I/O. 4096 bytes each, little-endian.

use crate::le;
use crate::namespace::Namespace;

/// An Identify data structure's size.
pub const PAGE: usize = 4096;

/// CNS values.
pub mod cns {
    /// Identify Namespace.
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller.
    pub const CONTROLLER: u8 = 0x01;
    /// Active Namespace ID list.
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    /// Namespace Identification Descriptor list.
    pub const NS_DESCRIPTORS: u8 = 0x03;
}

/// What Identify Controller says of a controller.
#[derive(Debug, Clone)]
pub struct ControllerInfo {
    /// The controller's ID.
    pub cntlid: u16,
    /// Serial number (20 ASCII characters, space padded).
    pub serial: String,
    /// Model number (40).
    pub model: String,
    /// Firmware revision (8).
    pub firmware: String,
    /// The subsystem's NQN.
    pub subnqn: String,
    /// The highest namespace ID.
    pub nn: u32,
    /// A discovery controller (CNTRLTYPE 2), else an I/O controller (1).
    pub discovery: bool,
    /// The largest transfer, as a power of two of 4 KiB pages (MDTS; 0: no limit).
    pub mdts: u8,
    /// The commands an I/O queue may hold (MAXCMD).
    pub max_cmd: u16,
    /// In-capsule data the controller takes after a command, in bytes.
    pub in_capsule_data: u32,
}

fn put_ascii(b: &mut [u8], s: &str) {
    b.fill(b' ');
    let n = s.len().min(b.len());
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Identify Controller.
pub fn controller(info: &ControllerInfo) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    put_ascii(&mut b[4..24], &info.serial);
    put_ascii(&mut b[24..64], &info.model);
    put_ascii(&mut b[64..72], &info.firmware);
    b[72] = 6; // RAB: 64 commands of arbitration burst
    b[76] = 0b011; // CMIC: several ports and several controllers may exist
    b[77] = info.mdts;
    le::put_u16(&mut b, 78, info.cntlid);
    le::put_u32(&mut b, 80, crate::properties::VERSION);
    // OAES: namespace attribute notices; CTRATT: 128-bit host identifier, and traffic-based
    // keep alive (bit 6: any command restarts the Keep Alive Timer, as the kernel's target
    // does; over a lossy fabric a Keep Alive can wait out a retransmission timer while the
    // queues move).
    le::put_u32(&mut b, 92, 1 << 8);
    le::put_u32(&mut b, 96, 1 | 1 << 6);
    b[111] = if info.discovery { 2 } else { 1 };
    b[258] = 3; // ACL: 4 Abort commands
    b[259] = 3; // AERL: 4 Asynchronous Event Requests
    b[261] = 1 << 2; // LPA: extended data for Get Log Page
    b[262] = 0; // ELPE: 1 error log entry
    le::put_u16(&mut b, 320, 1); // KAS: keep-alive granularity 100 ms
    b[512] = 0x66; // SQES: 64 bytes
    b[513] = 0x44; // CQES: 16 bytes
    le::put_u16(&mut b, 514, info.max_cmd);
    le::put_u32(&mut b, 516, info.nn);
    if !info.discovery {
        // ONCS: Dataset Management (bit 2), Write Zeroes (bit 3).
        le::put_u16(&mut b, 520, 1 << 2 | 1 << 3);
        b[525] = 1; // VWC: a volatile write cache (Flush means something for a file)
    }
    // SGLS: SGLs supported (byte aligned), keyed SGL data blocks (bit 2), offsets in the
    // address field (bit 20).
    le::put_u32(&mut b, 536, 0b01 | 1 << 2 | 1 << 20);
    let n = info.subnqn.len().min(255);
    b[768..768 + n].copy_from_slice(&info.subnqn.as_bytes()[..n]);
    // NVMe-oF: IOCCSZ and IORCSZ in 16-byte units (the command capsule is its 64 bytes plus
    // in-capsule data; the response capsule its 16), ICDOFF 0, FCATT 0 (dynamic), MSDBD 1.
    le::put_u32(&mut b, 1792, (64 + info.in_capsule_data) / 16);
    le::put_u32(&mut b, 1796, 1);
    b[1803] = 1;
    b
}

/// Identify Namespace.
pub fn namespace(ns: &Namespace) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    let blocks = ns.blocks();
    le::put_u64(&mut b, 0, blocks); // NSZE
    le::put_u64(&mut b, 8, blocks); // NCAP
    le::put_u64(&mut b, 16, blocks); // NUSE
    b[24] = 1 << 2; // NSFEAT: deallocated blocks read as zeroes (DLFEAT below)
    b[25] = 0; // NLBAF: one format
    b[26] = 0; // FLBAS: format 0
    b[33] = 1 << 3 | 0b001; // DLFEAT: Write Zeroes deallocates; deallocated reads zeroes
    b[104..120].copy_from_slice(&ns.nguid);
    // LBAF0: no metadata, LBADS = block shift, relative performance best.
    le::put_u32(&mut b, 128, u32::from(ns.block_shift) << 16);
    b
}

/// The active namespace IDs above `after`, in order, up to 1024 of them.
pub fn active_namespaces(nsids: impl Iterator<Item = u32>, after: u32) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    let mut ids: Vec<u32> = nsids.filter(|&n| n > after).collect();
    ids.sort_unstable();
    for (i, id) in ids.into_iter().take(PAGE / 4).enumerate() {
        le::put_u32(&mut b, i * 4, id);
    }
    b
}

/// The namespace identification descriptors: its NGUID (type 2).
pub fn ns_descriptors(ns: &Namespace) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    b[0] = 2; // NIDT: NGUID
    b[1] = 16; // NIDL
    b[4..20].copy_from_slice(&ns.nguid);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::namespace::MemoryBacking;

    fn ns() -> Namespace {
        Namespace {
            nsid: 1,
            block_shift: 12,
            backing: Box::new(MemoryBacking::new(1 << 20)),
            nguid: [0xAB; 16],
        }
    }

    #[test]
    fn the_controller_page_says_what_a_linux_host_reads() {
        let b = controller(&ControllerInfo {
            cntlid: 3,
            serial: "ferroce0001".into(),
            model: "ferroce".into(),
            firmware: "0.1".into(),
            subnqn: "nqn.2026-11.io.ferroce:t".into(),
            nn: 2,
            discovery: false,
            mdts: 5,
            max_cmd: 128,
            in_capsule_data: 8192,
        });
        assert_eq!(&b[4..15], b"ferroce0001");
        assert_eq!(b[15], b' ');
        assert_eq!(le::u16_at(&b, 78), 3);
        assert_eq!(b[111], 1);
        assert_eq!(b[512], 0x66);
        assert_eq!(le::u32_at(&b, 516), 2);
        assert_eq!(le::u32_at(&b, 536) & 0b111, 0b101);
        assert_eq!(&b[768..792], b"nqn.2026-11.io.ferroce:t");
        assert_eq!(le::u32_at(&b, 1792), (64 + 8192) / 16);
    }

    #[test]
    fn the_namespace_pages_say_its_size_and_identity() {
        let n = ns();
        let b = namespace(&n);
        assert_eq!(le::u64_at(&b, 0), 256);
        assert_eq!((le::u32_at(&b, 128) >> 16) & 0xFF, 12);
        let d = ns_descriptors(&n);
        assert_eq!((d[0], d[1]), (2, 16));
        assert_eq!(&d[4..20], &[0xAB; 16]);
        let a = active_namespaces([3u32, 1, 2].into_iter(), 1);
        assert_eq!(
            (le::u32_at(&a, 0), le::u32_at(&a, 4), le::u32_at(&a, 8)),
            (2, 3, 0)
        );
    }
}
