//! Ethernet + IPv4/IPv6 + UDP framing, to read captures and to write our own.
//!
//! Reading: [`parse_ethernet`] walks Ethernet II (with any 802.1Q/802.1ad tags), then IPv4 or
//! IPv6, then UDP, trimming the Ethernet padding by the IP and UDP lengths. Anything else is a
//! [`WireError::NotUdp`], which a decoder counts as skipped rather than as an error.
//!
//! Writing: [`UdpFrameHeaders`] holds what a frame needs besides its payload, builds the IP and
//! UDP headers the ICRC covers ([`UdpFrameHeaders::ip_udp_headers`]) and writes whole frames
//! ([`UdpFrameHeaders::write_frame`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::field;
use crate::{Result, WireError};

/// Ethernet II header length.
pub const ETHERNET_HEADER_LEN: usize = 14;
/// IPv4 header length without options.
pub const IPV4_HEADER_LEN: usize = 20;
/// IPv6 fixed header length.
pub const IPV6_HEADER_LEN: usize = 40;
/// UDP header length.
pub const UDP_HEADER_LEN: usize = 8;

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const ETHERTYPE_VLAN: u16 = 0x8100;
const ETHERTYPE_QINQ: u16 = 0x88a8;
const IP_PROTO_UDP: u8 = 17;

/// The UDP datagram a frame carries, with the IP and UDP headers it came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpFrame<'a> {
    /// Source IP address.
    pub src: IpAddr,
    /// Destination IP address.
    pub dst: IpAddr,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port.
    pub dst_port: u16,
    /// The IP header as on the wire (options included).
    pub ip_header: &'a [u8],
    /// The 8-byte UDP header.
    pub udp_header: &'a [u8],
    /// The UDP payload, trimmed to the UDP length.
    pub payload: &'a [u8],
}

fn bad(layer: &'static str, reason: &'static str) -> WireError {
    WireError::BadHeader { layer, reason }
}

/// Parses an Ethernet frame down to its UDP payload.
pub fn parse_ethernet(frame: &[u8]) -> Result<UdpFrame<'_>> {
    WireError::check_len(ETHERNET_HEADER_LEN, frame.len())
        .map_err(|_| WireError::NotUdp("shorter than an Ethernet header"))?;
    let mut ethertype = field::read_u16(frame, 12);
    let mut off = ETHERNET_HEADER_LEN;
    while ethertype == ETHERTYPE_VLAN || ethertype == ETHERTYPE_QINQ {
        if frame.len() < off + 4 {
            return Err(WireError::NotUdp("truncated VLAN tag"));
        }
        ethertype = field::read_u16(frame, off + 2);
        off += 4;
    }
    match ethertype {
        ETHERTYPE_IPV4 => parse_ipv4(&frame[off..]),
        ETHERTYPE_IPV6 => parse_ipv6(&frame[off..]),
        _ => Err(WireError::NotUdp("not IP")),
    }
}

/// Parses an IPv4 packet down to its UDP payload.
pub fn parse_ipv4(pkt: &[u8]) -> Result<UdpFrame<'_>> {
    if pkt.len() < IPV4_HEADER_LEN {
        return Err(bad("IPv4", "truncated"));
    }
    if pkt[0] >> 4 != 4 {
        return Err(bad("IPv4", "version is not 4"));
    }
    let ihl = usize::from(pkt[0] & 0x0f) * 4;
    let total = usize::from(field::read_u16(pkt, 2));
    if ihl < IPV4_HEADER_LEN || total < ihl || total > pkt.len() {
        return Err(bad("IPv4", "header or total length out of range"));
    }
    if pkt[9] != IP_PROTO_UDP {
        return Err(WireError::NotUdp("IPv4 protocol is not UDP"));
    }
    let frag = field::read_u16(pkt, 6);
    if frag & 0x3fff != 0 {
        return Err(WireError::NotUdp("IPv4 fragment"));
    }
    let src = IpAddr::V4(Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]));
    let dst = IpAddr::V4(Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]));
    parse_udp(src, dst, &pkt[..ihl], &pkt[ihl..total])
}

/// Parses an IPv6 packet (UDP directly after the fixed header) down to its UDP payload.
pub fn parse_ipv6(pkt: &[u8]) -> Result<UdpFrame<'_>> {
    if pkt.len() < IPV6_HEADER_LEN {
        return Err(bad("IPv6", "truncated"));
    }
    if pkt[0] >> 4 != 6 {
        return Err(bad("IPv6", "version is not 6"));
    }
    if pkt[6] != IP_PROTO_UDP {
        return Err(WireError::NotUdp("IPv6 next header is not UDP"));
    }
    let payload_len = usize::from(field::read_u16(pkt, 4));
    if IPV6_HEADER_LEN + payload_len > pkt.len() {
        return Err(bad("IPv6", "payload length beyond the frame"));
    }
    let mut a = [0u8; 16];
    a.copy_from_slice(&pkt[8..24]);
    let src = IpAddr::V6(Ipv6Addr::from(a));
    a.copy_from_slice(&pkt[24..40]);
    let dst = IpAddr::V6(Ipv6Addr::from(a));
    parse_udp(
        src,
        dst,
        &pkt[..IPV6_HEADER_LEN],
        &pkt[IPV6_HEADER_LEN..IPV6_HEADER_LEN + payload_len],
    )
}

fn parse_udp<'a>(
    src: IpAddr,
    dst: IpAddr,
    ip_header: &'a [u8],
    seg: &'a [u8],
) -> Result<UdpFrame<'a>> {
    if seg.len() < UDP_HEADER_LEN {
        return Err(bad("UDP", "truncated"));
    }
    let len = usize::from(field::read_u16(seg, 4));
    if len < UDP_HEADER_LEN || len > seg.len() {
        return Err(bad("UDP", "length out of range"));
    }
    Ok(UdpFrame {
        src,
        dst,
        src_port: field::read_u16(seg, 0),
        dst_port: field::read_u16(seg, 2),
        ip_header,
        udp_header: &seg[..UDP_HEADER_LEN],
        payload: &seg[UDP_HEADER_LEN..len],
    })
}

/// Everything a RoCE v2 frame needs besides its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpFrameHeaders {
    /// Source MAC address.
    pub src_mac: [u8; 6],
    /// Destination MAC address.
    pub dst_mac: [u8; 6],
    /// Source IP address.
    pub src: IpAddr,
    /// Destination IP address (of the same family as `src`).
    pub dst: IpAddr,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port.
    pub dst_port: u16,
    /// IPv4 Identification (ignored for IPv6). Linux sends 0 from an unconnected socket with DF.
    pub ident: u16,
    /// IPv4 don't-fragment flag (ignored for IPv6). RoCE v2 senders set it.
    pub dont_fragment: bool,
    /// TTL or hop limit.
    pub ttl: u8,
    /// IPv4 TOS byte or IPv6 traffic class (DSCP and ECN).
    pub tos: u8,
}

/// The IP and UDP headers of a frame, in one stack buffer.
#[derive(Debug, Clone, Copy)]
pub struct IpUdpHeaders {
    bytes: [u8; IPV6_HEADER_LEN + UDP_HEADER_LEN],
    ip_len: usize,
}

impl IpUdpHeaders {
    /// The IP header.
    pub fn ip(&self) -> &[u8] {
        &self.bytes[..self.ip_len]
    }
    /// The UDP header.
    pub fn udp(&self) -> &[u8] {
        &self.bytes[self.ip_len..self.ip_len + UDP_HEADER_LEN]
    }
    /// Both, as they follow each other on the wire.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.ip_len + UDP_HEADER_LEN]
    }
}

fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for pair in h.chunks(2) {
        sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

impl UdpFrameHeaders {
    /// A RoCE v2 frame between two addresses, as Linux would send it from an unconnected UDP
    /// socket: DF set, Identification 0, TTL 64, TOS 0, destination port 4791.
    pub fn roce(src: IpAddr, src_port: u16, dst: IpAddr) -> UdpFrameHeaders {
        UdpFrameHeaders {
            src_mac: [0x02, 0, 0, 0, 0, 1],
            dst_mac: [0x02, 0, 0, 0, 0, 2],
            src,
            dst,
            src_port,
            dst_port: crate::ROCE_V2_UDP_PORT,
            ident: 0,
            dont_fragment: true,
            ttl: 64,
            tos: 0,
        }
    }

    /// The IP and UDP headers for a UDP payload of `payload_len` bytes (UDP checksum 0, as RoCE
    /// v2 senders leave it).
    pub fn ip_udp_headers(&self, payload_len: usize) -> Result<IpUdpHeaders> {
        self.build_ip_udp_headers(payload_len, true)
    }

    /// The IP and UDP headers as the ICRC sees them, for a UDP payload of `payload_len` bytes:
    /// as [`ip_udp_headers`](Self::ip_udp_headers) but with the IPv4 header checksum left 0,
    /// since the ICRC masks that field (a packet's ICRC is computed, or checked, twice per
    /// message on the latency path, and the checksum is a third of the headers' cost).
    pub fn icrc_headers(&self, payload_len: usize) -> Result<IpUdpHeaders> {
        self.build_ip_udp_headers(payload_len, false)
    }

    fn build_ip_udp_headers(&self, payload_len: usize, checksum: bool) -> Result<IpUdpHeaders> {
        let udp_len = u16::try_from(UDP_HEADER_LEN + payload_len)
            .map_err(|_| WireError::FieldOverflow("UDP length"))?;
        let mut bytes = [0u8; IPV6_HEADER_LEN + UDP_HEADER_LEN];
        let ip_len = match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let total = u16::try_from(IPV4_HEADER_LEN + usize::from(udp_len))
                    .map_err(|_| WireError::FieldOverflow("IPv4 total length"))?;
                let h = &mut bytes[..IPV4_HEADER_LEN];
                h[0] = 0x45;
                h[1] = self.tos;
                field::write_u16(h, 2, total);
                field::write_u16(h, 4, self.ident);
                field::write_u16(h, 6, if self.dont_fragment { 0x4000 } else { 0 });
                h[8] = self.ttl;
                h[9] = IP_PROTO_UDP;
                h[12..16].copy_from_slice(&s.octets());
                h[16..20].copy_from_slice(&d.octets());
                if checksum {
                    let csum = ipv4_checksum(h);
                    field::write_u16(h, 10, csum);
                }
                IPV4_HEADER_LEN
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let h = &mut bytes[..IPV6_HEADER_LEN];
                field::write_u32(h, 0, (6 << 28) | (u32::from(self.tos) << 20));
                field::write_u16(h, 4, udp_len);
                h[6] = IP_PROTO_UDP;
                h[7] = self.ttl;
                h[8..24].copy_from_slice(&s.octets());
                h[24..40].copy_from_slice(&d.octets());
                IPV6_HEADER_LEN
            }
            _ => return Err(bad("IP", "source and destination of different families")),
        };
        let u = &mut bytes[ip_len..ip_len + UDP_HEADER_LEN];
        field::write_u16(u, 0, self.src_port);
        field::write_u16(u, 2, self.dst_port);
        field::write_u16(u, 4, udp_len);
        field::write_u16(u, 6, 0);
        Ok(IpUdpHeaders { bytes, ip_len })
    }

    /// Appends a whole Ethernet frame carrying `payload` to `out`.
    pub fn write_frame(&self, payload: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let hdrs = self.ip_udp_headers(payload.len())?;
        out.extend_from_slice(&self.dst_mac);
        out.extend_from_slice(&self.src_mac);
        let ethertype = if hdrs.ip_len == IPV4_HEADER_LEN {
            ETHERTYPE_IPV4
        } else {
            ETHERTYPE_IPV6
        };
        out.extend_from_slice(&ethertype.to_be_bytes());
        out.extend_from_slice(hdrs.as_bytes());
        out.extend_from_slice(payload);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_round_trip_and_checksum() {
        let h = UdpFrameHeaders::roce(
            "10.0.0.1".parse().unwrap(),
            49152,
            "10.0.0.2".parse().unwrap(),
        );
        let mut f = Vec::new();
        h.write_frame(&[1, 2, 3, 4], &mut f).unwrap();
        let u = parse_ethernet(&f).unwrap();
        assert_eq!(u.src, h.src);
        assert_eq!(u.dst_port, 4791);
        assert_eq!(u.payload, &[1, 2, 3, 4]);
        assert_eq!(
            ipv4_checksum(u.ip_header),
            0,
            "a correct header sums to zero"
        );
    }

    #[test]
    fn ipv6_round_trip_with_vlan_and_padding() {
        let h = UdpFrameHeaders::roce("fd00::1".parse().unwrap(), 1, "fd00::2".parse().unwrap());
        let mut f = Vec::new();
        h.write_frame(&[9; 8], &mut f).unwrap();
        // Insert a VLAN tag and trailing Ethernet padding.
        let mut tagged = f[..12].to_vec();
        tagged.extend_from_slice(&[0x81, 0x00, 0x00, 0x05]);
        tagged.extend_from_slice(&f[12..]);
        tagged.extend_from_slice(&[0; 10]);
        let u = parse_ethernet(&tagged).unwrap();
        assert_eq!(u.payload, &[9; 8]);
        assert_eq!(u.dst, h.dst);
    }

    #[test]
    fn icrc_headers_differ_only_in_the_checksum_the_icrc_masks() {
        let h = UdpFrameHeaders::roce(
            "10.0.0.1".parse().unwrap(),
            49152,
            "10.0.0.2".parse().unwrap(),
        );
        let full = h.ip_udp_headers(40).unwrap();
        let icrc = h.icrc_headers(40).unwrap();
        let (a, b) = (full.as_bytes(), icrc.as_bytes());
        assert_eq!(a.len(), b.len());
        let differing: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
        assert!(!differing.is_empty(), "the full headers carry a checksum");
        assert!(
            differing.iter().all(|&i| i == 10 || i == 11),
            "{differing:?}"
        );
        // A BTH followed by 28 bytes: the same ICRC either way.
        let covered = [0x0au8; 40];
        assert_eq!(
            crate::icrc::compute(full.ip(), full.udp(), &covered).unwrap(),
            crate::icrc::compute(icrc.ip(), icrc.udp(), &covered).unwrap()
        );
    }

    #[test]
    fn ecn_marks_leave_the_icrc_unchanged() {
        // Senders mark ECT(0), switches rewrite it to CE: the ICRC masks the whole TOS byte
        // (IPv4) and traffic class (IPv6), so a mark made on the path never fails the check.
        let covered = [0x0au8; 40];
        for (src, dst) in [("10.0.0.1", "10.0.0.2"), ("fd00::1", "fd00::2")] {
            let mut h = UdpFrameHeaders::roce(src.parse().unwrap(), 49152, dst.parse().unwrap());
            let icrc_with = |h: &UdpFrameHeaders| {
                let hdrs = h.icrc_headers(covered.len() + 4).unwrap();
                crate::icrc::compute(hdrs.ip(), hdrs.udp(), &covered).unwrap()
            };
            let plain = icrc_with(&h);
            for tos in [0x02, 0x01, 0x03, 0xb8, 0xbb] {
                h.tos = tos;
                let mut f = Vec::new();
                h.write_frame(&[0; 44], &mut f).unwrap();
                let u = parse_ethernet(&f).unwrap();
                let on_wire = if h.src.is_ipv4() {
                    u.ip_header[1]
                } else {
                    (u.ip_header[0] << 4) | (u.ip_header[1] >> 4)
                };
                assert_eq!(on_wire, tos, "{src}: the frame carries the TOS");
                assert_eq!(icrc_with(&h), plain, "{src} TOS {tos:#04x}");
            }
        }
    }

    #[test]
    fn non_udp_is_not_an_error_of_the_frame() {
        let mut arp = [0u8; 42];
        arp[12] = 0x08;
        arp[13] = 0x06;
        assert!(matches!(parse_ethernet(&arp), Err(WireError::NotUdp(_))));
        assert!(matches!(
            parse_ethernet(&arp[..5]),
            Err(WireError::NotUdp(_))
        ));
    }
}
