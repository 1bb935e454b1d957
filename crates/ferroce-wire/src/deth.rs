//! The Datagram Extended Transport Header of UD packets.
//!
//! ```text
//!  0..4   Q_Key
//!  4      reserved
//!  5..8   source QP
//! ```

use crate::field::{self, fixed_header_view};
use crate::{Result, WireError};

/// Encoded length of a DETH.
pub const LEN: usize = 8;

/// The well-known Q_Key of the general services interface (QP1), used by connection management.
pub const GSI_QKEY: u32 = 0x8001_0000;

fixed_header_view!(
    /// Zero-copy view of a DETH.
    Deth,
    LEN
);

impl<T: AsRef<[u8]>> Deth<T> {
    /// Queue key.
    pub fn qkey(&self) -> u32 {
        field::read_u32(self.buffer.as_ref(), 0)
    }
    /// Source QP number.
    pub fn src_qpn(&self) -> u32 {
        field::read_u24(self.buffer.as_ref(), 5)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Deth<T> {
    /// Sets the Q_Key and source QPN; the reserved byte becomes zero.
    pub fn set_all(&mut self, qkey: u32, src_qpn: u32) {
        let b = self.buffer.as_mut();
        field::write_u32(b, 0, qkey);
        b[4] = 0;
        field::write_u24(b, 5, src_qpn);
    }
}

/// The fields of a DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DethRepr {
    /// Queue key.
    pub qkey: u32,
    /// Source QP number (24 bits).
    pub src_qpn: u32,
}

impl DethRepr {
    /// Reads a DETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Deth<T>) -> Result<DethRepr> {
        h.check_len()?;
        Ok(DethRepr {
            qkey: h.qkey(),
            src_qpn: h.src_qpn(),
        })
    }
    /// Writes a DETH. Fails if the source QPN does not fit 24 bits.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Deth<T>) -> Result<()> {
        h.check_len()?;
        if self.src_qpn > 0x00ff_ffff {
            return Err(WireError::FieldOverflow("source QPN"));
        }
        h.set_all(self.qkey, self.src_qpn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        // rping_rdmacm.pcap frame 1: a CM MAD to QP1 from QP1 with the GSI Q_Key.
        let bytes = [0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];
        let r = DethRepr::parse(&Deth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            DethRepr {
                qkey: GSI_QKEY,
                src_qpn: 1
            }
        );
        let mut out = [0u8; LEN];
        r.emit(&mut Deth::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, bytes);
        assert!(Deth::new_checked(&bytes[..7]).is_err());
    }
}
