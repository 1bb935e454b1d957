//! Writing the headers of an outgoing packet; shared by requester and responder.

use ferroce_wire::bth::BthRepr;
use ferroce_wire::{ExtHeaders, Opcode, PacketRepr, Psn};

use crate::qp::Params;

/// The BTH fields that change from packet to packet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bth {
    pub opcode: Opcode,
    pub psn: Psn,
    pub ack_req: bool,
    pub solicited: bool,
}

impl Bth {
    /// A packet with neither the ack-request nor the solicited bit.
    pub fn plain(opcode: Opcode, psn: Psn) -> Bth {
        Bth {
            opcode,
            psn,
            ack_req: false,
            solicited: false,
        }
    }
    /// A request that asks for an acknowledgement.
    pub fn ack_req(opcode: Opcode, psn: Psn) -> Bth {
        Bth {
            opcode,
            psn,
            ack_req: true,
            solicited: false,
        }
    }
}

/// Writes the headers and pad of a packet to the peer into `buf` and returns (payload offset,
/// total length including the ICRC), or `None` if `buf` is too small.
pub(crate) fn headers(
    buf: &mut [u8],
    p: &Params,
    h: Bth,
    ext: ExtHeaders,
    payload_len: usize,
) -> Option<(usize, usize)> {
    let Bth {
        opcode,
        psn,
        ack_req,
        solicited,
    } = h;
    let bth = BthRepr {
        opcode,
        solicited,
        migreq: false,
        pad_count: 0,
        pkey: p.pkey,
        fecn: false,
        becn: false,
        dest_qpn: p.dest_qpn,
        ack_req,
        psn,
    };
    let repr = PacketRepr::new(bth, ext, payload_len);
    let total = repr.emit(buf).ok()?;
    let start = repr.header_len().ok()?;
    buf[total - 4..total].fill(0);
    Some((start, total))
}

/// Writes a RoCE v2 CNP to the peer into `buf` (IBTA Annex A17.9.2: opcode 0x81, the peer's
/// QPN, PSN 0, BECN set, 16 reserved bytes, the ICRC left zero for the caller) and returns its
/// length, or `None` if `buf` is too small.
pub(crate) fn cnp(buf: &mut [u8], p: &Params) -> Option<usize> {
    let bth = BthRepr {
        opcode: Opcode::CNP,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: p.pkey,
        fecn: false,
        becn: true,
        dest_qpn: p.dest_qpn,
        ack_req: false,
        psn: Psn::new(0),
    };
    let total = PacketRepr::new(bth, ExtHeaders::default(), 0)
        .emit(buf)
        .ok()?;
    buf[total - 4..total].fill(0);
    Some(total)
}
