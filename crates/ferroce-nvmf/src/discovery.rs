//! The discovery log page (NVMe-oF 1.1 §5.3, log identifier 0x70): what `nvme discover` reads
//! from a discovery controller, one 1024-byte entry per subsystem and port, after a 1024-byte
//! header.

use crate::le;

/// The well-known NQN of the discovery subsystem.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// The log identifier.
pub const LID: u8 = 0x70;

/// One subsystem as the discovery log lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The subsystem's NQN.
    pub subnqn: String,
    /// Its transport address (an IPv4 or IPv6 address, as text).
    pub traddr: String,
    /// Its transport service (the port, as text: "4420").
    pub trsvcid: String,
    /// Whether `traddr` is IPv6.
    pub ipv6: bool,
    /// The port ID.
    pub portid: u16,
}

/// Transport type RDMA.
const TRTYPE_RDMA: u8 = 1;
/// Subsystem type: an NVM subsystem.
const SUBTYPE_NVM: u8 = 2;

fn put_text(b: &mut [u8], s: &str) {
    let n = s.len().min(b.len() - 1);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// The whole log: header and entries, `generation` the change counter.
pub fn log_page(entries: &[Entry], generation: u64) -> Vec<u8> {
    let mut b = vec![0u8; 1024 * (1 + entries.len())];
    le::put_u64(&mut b, 0, generation);
    le::put_u64(&mut b, 8, entries.len() as u64);
    for (i, e) in entries.iter().enumerate() {
        let r = &mut b[1024 * (i + 1)..1024 * (i + 2)];
        r[0] = TRTYPE_RDMA;
        r[1] = if e.ipv6 { 2 } else { 1 };
        r[2] = SUBTYPE_NVM;
        r[3] = 0; // TREQ: not specified
        le::put_u16(r, 4, e.portid);
        le::put_u16(r, 6, 0xFFFF); // CNTLID: dynamic
        le::put_u16(r, 8, 32); // ASQSZ
        put_text(&mut r[32..64], &e.trsvcid);
        put_text(&mut r[256..512], &e.subnqn);
        put_text(&mut r[512..768], &e.traddr);
        // TSAS for RDMA: reliable connected QPs, no provider type, rdma_cm.
        r[768] = 1;
        r[769] = 1;
        r[770] = 2;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_where_nvme_cli_reads_it() {
        let b = log_page(
            &[Entry {
                subnqn: "nqn.2026-11.io.ferroce:a".into(),
                traddr: "192.168.77.1".into(),
                trsvcid: "4420".into(),
                ipv6: false,
                portid: 1,
            }],
            7,
        );
        assert_eq!(b.len(), 2048);
        assert_eq!(le::u64_at(&b, 0), 7);
        assert_eq!(le::u64_at(&b, 8), 1);
        let e = &b[1024..];
        assert_eq!((e[0], e[1], e[2]), (1, 1, 2));
        assert_eq!(&e[32..36], b"4420");
        assert_eq!(e[36], 0);
        assert_eq!(&e[256..280], b"nqn.2026-11.io.ferroce:a");
        assert_eq!(&e[512..524], b"192.168.77.1");
        assert_eq!((e[768], e[769], e[770]), (1, 1, 2));
    }
}
