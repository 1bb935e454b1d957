//! Immediate data: 4 bytes carried by the last packet of a SEND or WRITE with immediate, handed
//! to the receiver in its completion.

use crate::field::{self, fixed_header_view};
use crate::Result;

/// Encoded length of an ImmDt.
pub const LEN: usize = 4;

fixed_header_view!(
    /// Zero-copy view of an ImmDt.
    ImmDt,
    LEN
);

impl<T: AsRef<[u8]>> ImmDt<T> {
    /// The immediate value, as the bytes read in network order.
    pub fn value(&self) -> u32 {
        field::read_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmDt<T> {
    /// Sets the immediate value.
    pub fn set_value(&mut self, v: u32) {
        field::write_u32(self.buffer.as_mut(), 0, v);
    }
}

/// The immediate value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImmDtRepr {
    /// The value (network byte order read as a big-endian integer).
    pub value: u32,
}

impl ImmDtRepr {
    /// Reads an ImmDt.
    pub fn parse<T: AsRef<[u8]>>(h: &ImmDt<T>) -> Result<ImmDtRepr> {
        h.check_len()?;
        Ok(ImmDtRepr { value: h.value() })
    }
    /// Writes an ImmDt.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut ImmDt<T>) -> Result<()> {
        h.check_len()?;
        h.set_value(self.value);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let bytes = [0x11, 0x22, 0x33, 0x44];
        let r = ImmDtRepr::parse(&ImmDt::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(r.value, 0x1122_3344);
        let mut out = [0u8; 4];
        r.emit(&mut ImmDt::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, bytes);
        assert!(ImmDt::new_checked(&bytes[..3]).is_err());
    }
}
