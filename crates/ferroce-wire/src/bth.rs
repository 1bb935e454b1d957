//! The Base Transport Header: 12 bytes that start every IBTA transport packet.
//!
//! ```text
//!  0      opcode
//!  1      SE(1) M(1) PadCnt(2) TVer(4)
//!  2..4   P_Key
//!  4      FECN(1) BECN(1) reserved(6)   (the "resv8a" byte the ICRC masks)
//!  5..8   destination QP
//!  8      AckReq(1) reserved(7)
//!  9..12  PSN
//! ```

use crate::field::{self, fixed_header_view};
use crate::opcode::Opcode;
use crate::psn::Psn;
use crate::{Result, WireError};

/// Encoded length of a BTH.
pub const LEN: usize = 12;

/// The default partition key (full member of the default partition), which RoCE uses.
pub const DEFAULT_PKEY: u16 = 0xffff;

mod fields {
    pub const OPCODE: usize = 0;
    pub const FLAGS: usize = 1;
    pub const PKEY: usize = 2;
    pub const RESV8A: usize = 4;
    pub const DEST_QPN: usize = 5;
    pub const ACK_REQ: usize = 8;
    pub const PSN: usize = 9;
}

fixed_header_view!(
    /// Zero-copy view of a BTH.
    Bth,
    LEN
);

impl<T: AsRef<[u8]>> Bth<T> {
    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode(self.buffer.as_ref()[fields::OPCODE])
    }
    /// Solicited event.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[fields::FLAGS] & 0x80 != 0
    }
    /// Migration request.
    pub fn migreq(&self) -> bool {
        self.buffer.as_ref()[fields::FLAGS] & 0x40 != 0
    }
    /// Pad count: bytes added after the payload to reach a 4-byte boundary.
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[fields::FLAGS] >> 4) & 0x3
    }
    /// Transport header version (0 is the only one defined).
    pub fn tver(&self) -> u8 {
        self.buffer.as_ref()[fields::FLAGS] & 0x0f
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        field::read_u16(self.buffer.as_ref(), fields::PKEY)
    }
    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.buffer.as_ref()[fields::RESV8A] & 0x80 != 0
    }
    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.buffer.as_ref()[fields::RESV8A] & 0x40 != 0
    }
    /// Destination queue pair number (24 bits).
    pub fn dest_qpn(&self) -> u32 {
        field::read_u24(self.buffer.as_ref(), fields::DEST_QPN)
    }
    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[fields::ACK_REQ] & 0x80 != 0
    }
    /// Packet sequence number.
    pub fn psn(&self) -> Psn {
        Psn::new(field::read_u24(self.buffer.as_ref(), fields::PSN))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Bth<T> {
    /// Sets the opcode.
    pub fn set_opcode(&mut self, op: Opcode) {
        self.buffer.as_mut()[fields::OPCODE] = op.0;
    }
    /// Sets SE, M, pad count and TVer in one byte.
    pub fn set_flags(&mut self, solicited: bool, migreq: bool, pad: u8, tver: u8) {
        self.buffer.as_mut()[fields::FLAGS] = (u8::from(solicited) << 7)
            | (u8::from(migreq) << 6)
            | ((pad & 0x3) << 4)
            | (tver & 0x0f);
    }
    /// Sets the pad count, keeping the other bits of its byte.
    pub fn set_pad_count(&mut self, pad: u8) {
        let b = &mut self.buffer.as_mut()[fields::FLAGS];
        *b = (*b & !0x30) | ((pad & 0x3) << 4);
    }
    /// Sets the partition key.
    pub fn set_pkey(&mut self, pkey: u16) {
        field::write_u16(self.buffer.as_mut(), fields::PKEY, pkey);
    }
    /// Sets FECN and BECN; the six reserved bits become zero.
    pub fn set_congestion(&mut self, fecn: bool, becn: bool) {
        self.buffer.as_mut()[fields::RESV8A] = (u8::from(fecn) << 7) | (u8::from(becn) << 6);
    }
    /// Sets the destination QPN (low 24 bits of `qpn`).
    pub fn set_dest_qpn(&mut self, qpn: u32) {
        field::write_u24(self.buffer.as_mut(), fields::DEST_QPN, qpn);
    }
    /// Sets the ack-request bit; the seven reserved bits become zero.
    pub fn set_ack_req(&mut self, ack_req: bool) {
        self.buffer.as_mut()[fields::ACK_REQ] = u8::from(ack_req) << 7;
    }
    /// Sets the PSN.
    pub fn set_psn(&mut self, psn: Psn) {
        field::write_u24(self.buffer.as_mut(), fields::PSN, psn.value());
    }
}

/// The fields of a BTH. Reserved bits are not kept: they are sent as zero and ignored on receipt,
/// as the IBTA asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    /// Opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Migration request.
    pub migreq: bool,
    /// Pad count (0..=3).
    pub pad_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward ECN.
    pub fecn: bool,
    /// Backward ECN.
    pub becn: bool,
    /// Destination QP number (24 bits).
    pub dest_qpn: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
}

impl BthRepr {
    /// Encoded length.
    pub const LEN: usize = LEN;

    /// Reads a BTH. Fails on a transport header version other than 0.
    pub fn parse<T: AsRef<[u8]>>(bth: &Bth<T>) -> Result<BthRepr> {
        bth.check_len()?;
        if bth.tver() != 0 {
            return Err(WireError::UnsupportedVersion(bth.tver()));
        }
        Ok(BthRepr {
            opcode: bth.opcode(),
            solicited: bth.solicited(),
            migreq: bth.migreq(),
            pad_count: bth.pad_count(),
            pkey: bth.pkey(),
            fecn: bth.fecn(),
            becn: bth.becn(),
            dest_qpn: bth.dest_qpn(),
            ack_req: bth.ack_req(),
            psn: bth.psn(),
        })
    }

    /// Writes the BTH. Fails if the QPN does not fit 24 bits or the pad count 2 bits.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, bth: &mut Bth<T>) -> Result<()> {
        bth.check_len()?;
        if self.dest_qpn > 0x00ff_ffff {
            return Err(WireError::FieldOverflow("destination QPN"));
        }
        if self.pad_count > 3 {
            return Err(WireError::FieldOverflow("pad count"));
        }
        bth.set_opcode(self.opcode);
        bth.set_flags(self.solicited, self.migreq, self.pad_count, 0);
        bth.set_pkey(self.pkey);
        bth.set_congestion(self.fecn, self.becn);
        bth.set_dest_qpn(self.dest_qpn);
        bth.set_ack_req(self.ack_req);
        bth.set_psn(self.psn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // First BTH of imm_send_write.pcap frame 11: SEND_ONLY_WITH_IMMEDIATE, QP 0x23, PSN 5281973.
    const SEND_ONLY_IMM: [u8; 12] = [
        0x05, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x23, 0x80, 0x50, 0x98, 0xb5,
    ];

    #[test]
    fn parse_real_bth() {
        let repr = BthRepr::parse(&Bth::new_checked(&SEND_ONLY_IMM[..]).unwrap()).unwrap();
        assert_eq!(repr.opcode, Opcode::RC_SEND_ONLY_WITH_IMMEDIATE);
        assert_eq!(repr.dest_qpn, 0x23);
        assert_eq!(repr.psn.value(), 5_281_973);
        assert!(repr.ack_req);
        assert_eq!(repr.pkey, DEFAULT_PKEY);
        let mut out = [0u8; 12];
        repr.emit(&mut Bth::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, SEND_ONLY_IMM);
    }

    #[test]
    fn impossible_len() {
        assert_eq!(
            Bth::new_checked(&SEND_ONLY_IMM[..11]),
            Err(WireError::Truncated {
                needed: 12,
                available: 11
            })
        );
    }

    #[test]
    fn rejects_other_versions_and_overflows() {
        let mut b = SEND_ONLY_IMM;
        b[1] |= 0x01;
        assert_eq!(
            BthRepr::parse(&Bth::new_unchecked(&b[..])),
            Err(WireError::UnsupportedVersion(1))
        );
        let mut repr = BthRepr::parse(&Bth::new_unchecked(&SEND_ONLY_IMM[..])).unwrap();
        repr.dest_qpn = 1 << 24;
        let mut out = [0u8; 12];
        assert!(repr.emit(&mut Bth::new_unchecked(&mut out[..])).is_err());
    }
}
