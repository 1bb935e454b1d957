//! The RoCE v2 invariant CRC.
//!
//! The ICRC is the IEEE CRC-32 (the one Ethernet and zlib use) over, in order:
//! 1. eight bytes of ones, standing for the InfiniBand LRH that RoCE v2 does not carry;
//! 2. the IP header with the fields routers may change masked to ones — IPv4 TOS, TTL and header
//!    checksum; IPv6 traffic class, flow label and hop limit;
//! 3. the UDP header with its checksum masked to ones;
//! 4. the BTH with its `resv8a` byte (FECN, BECN, reserved) masked to ones;
//! 5. everything after the BTH up to the ICRC: extension headers, payload and pad.
//!
//! The CRC's final value travels least-significant byte first, the order the CRC register
//! shifts out. Wireshark prints those four bytes read as a big-endian number, so its "Invariant
//! CRC: 0x..." is [`u32::swap_bytes`] of the value here; see [`wireshark_display`].
//!
//! The IPv4 Identification field is covered, not masked. A receiver that only has a UDP socket
//! does not see it; the UDP provider's module docs say how ferroce copes with that.
//!
//! Speed: the masked headers are copied once into a small stack buffer; the payload is fed to
//! `crc32fast`, which folds with PCLMULQDQ where the CPU has it. Nothing allocates.

use crate::bth;
use crate::{Result, WireError};

const LRH_ONES_LEN: usize = 8;
const UDP_HEADER_LEN: usize = 8;
const MAX_IPV4_HEADER: usize = 60;
const IPV6_HEADER_LEN: usize = 40;

/// Computes the ICRC.
///
/// `ip_header` is the whole IPv4 (with options) or IPv6 header as on the wire, `udp_header` the
/// 8-byte UDP header, and `covered` the transport packet from the BTH up to (not including) the
/// ICRC.
pub fn compute(ip_header: &[u8], udp_header: &[u8], covered: &[u8]) -> Result<u32> {
    // One buffer for everything that is masked, so the CRC sees it in a single update.
    let mut buf = [0xffu8; LRH_ONES_LEN + MAX_IPV4_HEADER + UDP_HEADER_LEN + bth::LEN];
    let masked = &mut buf[LRH_ONES_LEN..];
    let ip_len = ip_header.len();
    let version = ip_header.first().map(|b| b >> 4);
    match version {
        Some(4) if (20..=MAX_IPV4_HEADER).contains(&ip_len) => {
            masked[..ip_len].copy_from_slice(ip_header);
            masked[1] = 0xff; // TOS (DSCP and ECN)
            masked[8] = 0xff; // TTL
            masked[10] = 0xff; // header checksum
            masked[11] = 0xff;
        }
        Some(6) if ip_len == IPV6_HEADER_LEN => {
            masked[..ip_len].copy_from_slice(ip_header);
            masked[0] |= 0x0f; // high half of the traffic class
            masked[1] = 0xff; // low half of the traffic class, flow label
            masked[2] = 0xff;
            masked[3] = 0xff;
            masked[7] = 0xff; // hop limit
        }
        _ => {
            return Err(WireError::BadHeader {
                layer: "IP",
                reason: "not an IPv4 or IPv6 header",
            })
        }
    }
    if udp_header.len() != UDP_HEADER_LEN {
        return Err(WireError::BadHeader {
            layer: "UDP",
            reason: "header is not 8 bytes",
        });
    }
    WireError::check_len(bth::LEN, covered.len())?;
    let mut n = ip_len;
    masked[n..n + UDP_HEADER_LEN].copy_from_slice(udp_header);
    masked[n + 6] = 0xff; // UDP checksum
    masked[n + 7] = 0xff;
    n += UDP_HEADER_LEN;
    masked[n..n + bth::LEN].copy_from_slice(&covered[..bth::LEN]);
    masked[n + 4] = 0xff; // resv8a: FECN, BECN, reserved
    n += bth::LEN;

    let mut h = crc32fast::Hasher::new();
    h.update(&buf[..LRH_ONES_LEN + n]);
    h.update(&covered[bth::LEN..]);
    Ok(h.finalize())
}

/// Whether `icrc` is the right ICRC for these headers and bytes.
pub fn verify(ip_header: &[u8], udp_header: &[u8], covered: &[u8], icrc: u32) -> Result<bool> {
    Ok(compute(ip_header, udp_header, covered)? == icrc)
}

/// The number Wireshark shows as "Invariant CRC" for an ICRC value.
pub const fn wireshark_display(icrc: u32) -> u32 {
    icrc.swap_bytes()
}
