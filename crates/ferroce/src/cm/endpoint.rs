//! What an endpoint is, and its 56-byte record on the wire (the layout is in the module doc of
//! [`crate::cm`]): encoding, and decoding that checks every field before it is believed.

use std::net::Ipv6Addr;

use ferroce_proto::attr::MAX_RD_ATOMIC;
use ferroce_proto::PathMtu;
use ferroce_wire::psn::PSN_MASK;
use ferroce_wire::Psn;

use super::error::{EndpointProblem, MessageKind};
use super::{
    ENDPOINT_LEN, FLAG_ACKS_UNASKED, FLAG_REGION, FLAG_SELECTIVE_REPEAT,
    FLAG_SMALL_IDENTIFICATIONS, HEADER_LEN, MAGIC, MAX_ENDPOINTS, QPN_MASK, VERSION,
};

/// A memory region the peer may access with RDMA READ, WRITE or atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Virtual address of the region's first byte, as the peer must put it in a RETH.
    pub addr: u64,
    /// Remote key of the region.
    pub rkey: u32,
    /// Length of the region in bytes.
    pub len: u64,
}

/// What one side tells the other about one of its queue pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EndpointInfo {
    /// QP number (24 bits).
    pub qpn: u32,
    /// The first PSN this side will send: the peer's `rq_psn`.
    pub psn: Psn,
    /// RoCE v2 GID of this side (IPv4-mapped for IPv4).
    pub gid: Ipv6Addr,
    /// The UDP port this side's RoCE socket listens on (4791 by default; other ports let several
    /// unprivileged processes share a host).
    pub udp_port: u16,
    /// The largest path MTU this side supports.
    pub mtu: PathMtu,
    /// How many READ/atomic requests this side can serve at once as responder: the peer's
    /// `max_rd_atomic` should not exceed it.
    pub max_rd_atomic: u8,
    /// A memory region the peer may access, if any.
    pub region: Option<RemoteRegion>,
    /// This side's responder acknowledges requests that do not ask for an ACK (AckReq clear)
    /// within `ferroce_proto::responder::UNASKED_ACK_DELAY`, as ferroce's does: the peer's
    /// unsignaled requests then need not ask (see `QueuePair::set_peer_acks_unasked`).
    pub acks_unasked: bool,
    /// Every packet this side sends over UDP carries an IPv4 Identification below
    /// [`crate::SENT_IDENTIFICATION_LIMIT`], as ferroce's do: the peer then accepts a packet
    /// whose ICRC verifies only for a solved Identification just when that one is below the
    /// limit, a 26-bit check instead of 16 (see `QueuePair::set_peer_small_identifications`).
    /// Claim it only for a sender that keeps it: its other packets would be refused.
    pub small_identifications: bool,
    /// This side keeps request packets that arrive after a gap and, as requester, sends again
    /// only the PSN a sequence-error NAK names (`QueuePair::set_selective_repeat`). Used only
    /// when both sides claim it; a standard responder drops what follows a gap.
    pub selective_repeat: bool,
}

impl EndpointInfo {
    /// The record the connection exchange sends ([`ENDPOINT_LEN`](super::ENDPOINT_LEN)
    /// bytes), for a program that carries endpoints over a channel of its own (a collective
    /// library's rendezvous, say).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(super::ENDPOINT_LEN);
        encode_endpoint(self, &mut out);
        out
    }

    /// Reads a record [`to_bytes`](Self::to_bytes) made, checking every field as the
    /// connection exchange does.
    pub fn from_bytes(bytes: &[u8]) -> std::result::Result<EndpointInfo, EndpointProblem> {
        if bytes.len() != super::ENDPOINT_LEN {
            return Err(EndpointProblem::Length(bytes.len()));
        }
        let e = decode_endpoint(bytes)?;
        e.validate()?;
        Ok(e)
    }

    /// Checks every field against the range the protocol allows.
    pub fn validate(&self) -> std::result::Result<(), EndpointProblem> {
        if self.qpn > QPN_MASK {
            return Err(EndpointProblem::Qpn(self.qpn));
        }
        if !gid_is_addressable(self.gid) {
            return Err(EndpointProblem::Gid(self.gid));
        }
        if self.udp_port == 0 {
            return Err(EndpointProblem::UdpPort);
        }
        if self.max_rd_atomic > MAX_RD_ATOMIC {
            return Err(EndpointProblem::MaxRdAtomic(self.max_rd_atomic));
        }
        if let Some(r) = self.region {
            if !region_fits(r.addr, r.len) {
                return Err(EndpointProblem::RegionWraps {
                    addr: r.addr,
                    len: r.len,
                });
            }
        }
        Ok(())
    }
}

pub(super) fn header(kind: MessageKind, count: u16, len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = kind.code();
    h[6..8].copy_from_slice(&count.to_be_bytes());
    h[8..12].copy_from_slice(&len.to_be_bytes());
    h
}

/// Encodes a validated list (1..=MAX_ENDPOINTS entries, so the count fits in 16 bits and the
/// length in 32).
pub(crate) fn encode_endpoints(local: &[EndpointInfo]) -> Vec<u8> {
    let count = local.len().min(MAX_ENDPOINTS);
    let body_len = count * ENDPOINT_LEN;
    let mut out = Vec::with_capacity(HEADER_LEN + body_len);
    out.extend_from_slice(&header(
        MessageKind::Endpoints,
        count as u16,
        body_len as u32,
    ));
    for e in &local[..count] {
        encode_endpoint(e, &mut out);
    }
    out
}

pub(super) fn encode_endpoint(e: &EndpointInfo, out: &mut Vec<u8>) {
    let region = e.region.unwrap_or(RemoteRegion {
        addr: 0,
        rkey: 0,
        len: 0,
    });
    let mut flags = if e.region.is_some() { FLAG_REGION } else { 0 };
    if e.acks_unasked {
        flags |= FLAG_ACKS_UNASKED;
    }
    if e.small_identifications {
        flags |= FLAG_SMALL_IDENTIFICATIONS;
    }
    if e.selective_repeat {
        flags |= FLAG_SELECTIVE_REPEAT;
    }
    out.extend_from_slice(&e.qpn.to_be_bytes());
    out.extend_from_slice(&e.psn.value().to_be_bytes());
    out.extend_from_slice(&e.gid.octets());
    out.extend_from_slice(&e.udp_port.to_be_bytes());
    // Every PathMtu is at most 4096, so the byte count fits in 16 bits.
    out.extend_from_slice(&(e.mtu.bytes() as u16).to_be_bytes());
    out.push(e.max_rd_atomic);
    out.push(flags);
    out.extend_from_slice(&[0; 2]);
    out.extend_from_slice(&region.addr.to_be_bytes());
    out.extend_from_slice(&region.len.to_be_bytes());
    out.extend_from_slice(&region.rkey.to_be_bytes());
    out.extend_from_slice(&[0; 4]);
}

pub(super) fn be16(r: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([r[at], r[at + 1]])
}

pub(super) fn be32(r: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]])
}

pub(super) fn be64(r: &[u8], at: usize) -> u64 {
    (u64::from(be32(r, at)) << 32) | u64::from(be32(r, at + 4))
}

/// Decodes one record; `r` is exactly [`ENDPOINT_LEN`] bytes (from `chunks_exact`).
pub(super) fn decode_endpoint(r: &[u8]) -> std::result::Result<EndpointInfo, EndpointProblem> {
    let qpn = be32(r, 0);
    let psn = be32(r, 4);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&r[8..24]);
    let gid = Ipv6Addr::from(gid);
    let udp_port = be16(r, 24);
    let mtu = be16(r, 26);
    let max_rd_atomic = r[28];
    let flags = r[29];
    let (addr, len, rkey) = (be64(r, 32), be64(r, 40), be32(r, 48));

    if psn > PSN_MASK {
        return Err(EndpointProblem::Psn(psn));
    }
    let mtu = PathMtu::from_bytes(u32::from(mtu)).map_err(|_| EndpointProblem::Mtu(mtu))?;
    let known =
        FLAG_REGION | FLAG_ACKS_UNASKED | FLAG_SMALL_IDENTIFICATIONS | FLAG_SELECTIVE_REPEAT;
    if flags & !known != 0 {
        return Err(EndpointProblem::Flags(flags));
    }
    if let Some(offset) = [30, 31, 52, 53, 54, 55].into_iter().find(|&o| r[o] != 0) {
        return Err(EndpointProblem::Reserved(offset));
    }
    let region = if flags & FLAG_REGION != 0 {
        Some(RemoteRegion { addr, rkey, len })
    } else if addr != 0 || len != 0 || rkey != 0 {
        return Err(EndpointProblem::StrayRegion);
    } else {
        None
    };
    let info = EndpointInfo {
        qpn,
        psn: Psn::new(psn),
        gid,
        udp_port,
        mtu,
        max_rd_atomic,
        region,
        acks_unasked: flags & FLAG_ACKS_UNASKED != 0,
        small_identifications: flags & FLAG_SMALL_IDENTIFICATIONS != 0,
        selective_repeat: flags & FLAG_SELECTIVE_REPEAT != 0,
    };
    // The remaining range checks are the same ones the sender applies to itself.
    info.validate()?;
    Ok(info)
}

pub(super) fn gid_is_addressable(gid: Ipv6Addr) -> bool {
    match gid.to_ipv4_mapped() {
        Some(v4) => !v4.is_unspecified() && !v4.is_multicast() && !v4.is_broadcast(),
        None => !gid.is_unspecified() && !gid.is_multicast(),
    }
}

pub(super) fn region_fits(addr: u64, len: u64) -> bool {
    len == 0 || addr.checked_add(len - 1).is_some()
}
