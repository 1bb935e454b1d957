//! The common header of management datagrams (MADs), IBTA §13.4.3.
//!
//! A MAD is 256 bytes carried as the whole payload of a UD SEND to QP0 or QP1; connection
//! management (class 0x07, [`crate::cm`]) is the class ferroce speaks, over QP1 with the GSI
//! Q_Key ([`crate::deth::GSI_QKEY`]).
//!
//! ```text
//!  0      base version (1)
//!  1      management class
//!  2      class version
//!  3      R (bit 7, a response) | method (7 bits)
//!  4..6   status
//!  6..8   class specific
//!  8..16  transaction ID
//! 16..18  attribute ID
//! 18..20  reserved
//! 20..24  attribute modifier
//! ```

use crate::field::{self, fixed_header_view};
use crate::{Result, WireError};

/// Encoded length of the common MAD header.
pub const LEN: usize = 24;

/// Length of every MAD of the classes ferroce speaks (the payload of its UD SEND).
pub const MAD_LEN: usize = 256;

/// The only base version defined.
pub const BASE_VERSION: u8 = 1;

/// The method of every CM message: `Send()`.
pub const METHOD_SEND: u8 = 0x03;

fixed_header_view!(
    /// Zero-copy view of the common MAD header.
    MadHeader,
    LEN
);

impl<T: AsRef<[u8]>> MadHeader<T> {
    /// Base version.
    pub fn base_version(&self) -> u8 {
        self.buffer.as_ref()[0]
    }
    /// Management class.
    pub fn mgmt_class(&self) -> u8 {
        self.buffer.as_ref()[1]
    }
    /// Class version.
    pub fn class_version(&self) -> u8 {
        self.buffer.as_ref()[2]
    }
    /// Method, without the response bit.
    pub fn method(&self) -> u8 {
        self.buffer.as_ref()[3] & 0x7f
    }
    /// Status.
    pub fn status(&self) -> u16 {
        field::read_u16(self.buffer.as_ref(), 4)
    }
    /// Transaction ID.
    pub fn transaction_id(&self) -> u64 {
        field::read_u64(self.buffer.as_ref(), 8)
    }
    /// Attribute ID: which message of the class follows.
    pub fn attribute_id(&self) -> u16 {
        field::read_u16(self.buffer.as_ref(), 16)
    }
    /// Attribute modifier (a CM REQ or REP carries its ECE options here).
    pub fn attribute_modifier(&self) -> u32 {
        field::read_u32(self.buffer.as_ref(), 20)
    }
}

/// The fields of a MAD header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MadHeaderRepr {
    /// Management class (0x07: communication management).
    pub mgmt_class: u8,
    /// Class version (2 for CM).
    pub class_version: u8,
    /// Method (the response bit cleared).
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class-specific word.
    pub class_specific: u16,
    /// Transaction ID: a response carries its request's.
    pub transaction_id: u64,
    /// Attribute ID.
    pub attribute_id: u16,
    /// Attribute modifier.
    pub attribute_modifier: u32,
}

impl MadHeaderRepr {
    /// Reads a MAD header; fails on a base version other than 1.
    pub fn parse<T: AsRef<[u8]>>(h: &MadHeader<T>) -> Result<MadHeaderRepr> {
        h.check_len()?;
        if h.base_version() != BASE_VERSION {
            return Err(WireError::NotCm("base version is not 1"));
        }
        let b = h.buffer.as_ref();
        Ok(MadHeaderRepr {
            mgmt_class: h.mgmt_class(),
            class_version: h.class_version(),
            method: h.method(),
            status: h.status(),
            class_specific: field::read_u16(b, 6),
            transaction_id: h.transaction_id(),
            attribute_id: h.attribute_id(),
            attribute_modifier: h.attribute_modifier(),
        })
    }

    /// Writes a MAD header (base version 1, reserved bytes zero).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut MadHeader<T>) -> Result<()> {
        h.check_len()?;
        if self.method > 0x7f {
            return Err(WireError::FieldOverflow("MAD method"));
        }
        let b = h.buffer.as_mut();
        b[0] = BASE_VERSION;
        b[1] = self.mgmt_class;
        b[2] = self.class_version;
        b[3] = self.method;
        field::write_u16(b, 4, self.status);
        field::write_u16(b, 6, self.class_specific);
        field::write_u64(b, 8, self.transaction_id);
        field::write_u16(b, 16, self.attribute_id);
        field::write_u16(b, 18, 0);
        field::write_u32(b, 20, self.attribute_modifier);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// rping_rdmacm.pcap frame 1: the MAD header of a CM REQ.
    const REQ_HEADER: [u8; LEN] = [
        0x01, 0x07, 0x02, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0xeb, 0x0c, 0xef,
        0x20, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];

    #[test]
    fn parses_and_emits_a_captured_header() {
        let repr = MadHeaderRepr::parse(&MadHeader::new_checked(&REQ_HEADER[..]).unwrap()).unwrap();
        assert_eq!(repr.mgmt_class, 0x07);
        assert_eq!(repr.class_version, 2);
        assert_eq!(repr.method, METHOD_SEND);
        assert_eq!(repr.transaction_id, 0x0000_0002_eb0c_ef20);
        assert_eq!(repr.attribute_id, 0x0010);
        let mut out = [0xaau8; LEN];
        repr.emit(&mut MadHeader::new_unchecked(&mut out[..]))
            .unwrap();
        assert_eq!(out, REQ_HEADER);
    }

    #[test]
    fn refuses_short_buffers_and_other_base_versions() {
        assert!(MadHeader::new_checked(&REQ_HEADER[..23]).is_err());
        let mut other = REQ_HEADER;
        other[0] = 2;
        let view = MadHeader::new_checked(&other[..]).unwrap();
        assert_eq!(
            MadHeaderRepr::parse(&view),
            Err(WireError::NotCm("base version is not 1"))
        );
    }
}
