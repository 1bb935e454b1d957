//! One-line summaries of captured frames: what `ferroce decode` prints.
//!
//! [`decode_frame`] sorts a frame into one of three outcomes: not RoCE (skipped, never an error),
//! a RoCE packet (with its parsed form and whether its ICRC is right), or a RoCE packet that does
//! not parse (with the reason).

use core::fmt;
use std::net::IpAddr;

use crate::frame::{self, UdpFrame};
use crate::icrc;
use crate::packet::{PacketRepr, RocePacket};
use crate::{WireError, ROCE_V2_UDP_PORT};

/// A RoCE v2 packet that parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoceSummary {
    /// Source IP.
    pub src: IpAddr,
    /// Destination IP.
    pub dst: IpAddr,
    /// UDP source port.
    pub src_port: u16,
    /// The parsed packet.
    pub repr: PacketRepr,
    /// The ICRC the packet carries.
    pub icrc: u32,
    /// Whether that ICRC is right.
    pub icrc_ok: bool,
}

/// What a frame turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// Not a RoCE v2 packet (other traffic, such as the TCP out-of-band exchange).
    Skipped,
    /// A RoCE v2 packet.
    Roce(RoceSummary),
    /// A UDP datagram to port 4791 that is not a valid RoCE v2 packet.
    Malformed {
        /// Source IP.
        src: IpAddr,
        /// Destination IP.
        dst: IpAddr,
        /// Why it does not parse.
        reason: WireError,
    },
}

/// Decodes an Ethernet frame; UDP to or from port 4791 is RoCE v2.
pub fn decode_frame(frame_bytes: &[u8]) -> Decoded {
    decode_frame_ports(frame_bytes, &[ROCE_V2_UDP_PORT])
}

/// Decodes an Ethernet frame, taking UDP to or from any of `ports` as RoCE v2 (Wireshark's rule
/// for a port: either end). ferroce processes sharing a host listen on other ports than 4791.
pub fn decode_frame_ports(frame_bytes: &[u8], ports: &[u16]) -> Decoded {
    match frame::parse_ethernet(frame_bytes) {
        Ok(udp) if ports.contains(&udp.dst_port) || ports.contains(&udp.src_port) => {
            decode_udp(&udp)
        }
        Ok(_) | Err(WireError::NotUdp(_)) => Decoded::Skipped,
        // A broken IP or UDP header: not something we can call RoCE.
        Err(_) => Decoded::Skipped,
    }
}

/// Decodes the RoCE v2 packet a UDP datagram to port 4791 carries.
pub fn decode_udp(udp: &UdpFrame<'_>) -> Decoded {
    let malformed = |reason| Decoded::Malformed {
        src: udp.src,
        dst: udp.dst,
        reason,
    };
    let pkt = match RocePacket::new_checked(udp.payload) {
        Ok(p) => p,
        Err(e) => return malformed(e),
    };
    let repr = match PacketRepr::parse(&pkt) {
        Ok(r) => r,
        Err(e) => return malformed(e),
    };
    let icrc_ok = match icrc::verify(udp.ip_header, udp.udp_header, pkt.covered(), pkt.icrc()) {
        Ok(ok) => ok,
        Err(e) => return malformed(e),
    };
    Decoded::Roce(RoceSummary {
        src: udp.src,
        dst: udp.dst,
        src_port: udp.src_port,
        repr,
        icrc: pkt.icrc(),
        icrc_ok,
    })
}

impl fmt::Display for RoceSummary {
    /// `SRC -> DST OPCODE qpn=0x.. psn=.. ack_req=.. [ext headers] payload=N icrc=ok|BAD`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.repr;
        write!(
            f,
            "{} -> {} {} qpn=0x{:06x} psn={} ack_req={}",
            self.src,
            self.dst,
            r.bth.opcode,
            r.bth.dest_qpn,
            r.bth.psn,
            u8::from(r.bth.ack_req)
        )?;
        if r.bth.solicited {
            f.write_str(" se=1")?;
        }
        if r.bth.fecn || r.bth.becn {
            write!(
                f,
                " fecn={} becn={}",
                u8::from(r.bth.fecn),
                u8::from(r.bth.becn)
            )?;
        }
        let e = &r.ext;
        if let Some(h) = e.deth {
            write!(f, " qkey=0x{:08x} src_qpn=0x{:06x}", h.qkey, h.src_qpn)?;
        }
        if let Some(h) = e.reth {
            write!(
                f,
                " va=0x{:016x} rkey=0x{:08x} dma_len={}",
                h.va, h.rkey, h.dma_len
            )?;
        }
        if let Some(h) = e.atomic_eth {
            write!(
                f,
                " va=0x{:016x} rkey=0x{:08x} swap_add={} compare={}",
                h.va, h.rkey, h.swap_add, h.compare
            )?;
        }
        if let Some(h) = e.aeth {
            write!(f, " aeth={} msn={}", h.syndrome, h.msn)?;
        }
        if let Some(h) = e.atomic_ack_eth {
            write!(f, " orig={}", h.original)?;
        }
        if let Some(h) = e.immdt {
            write!(f, " imm=0x{:08x}", h.value)?;
        }
        if let Some(h) = e.ieth {
            write!(f, " inv_rkey=0x{:08x}", h.rkey)?;
        }
        write!(
            f,
            " payload={} icrc_value=0x{:08x} icrc={}",
            r.payload_len,
            icrc::wireshark_display(self.icrc),
            if self.icrc_ok { "ok" } else { "BAD" }
        )
    }
}
