//! The Invalidate Extended Transport Header: the R_Key a SEND with invalidate revokes at the
//! receiver.

use crate::field::{self, fixed_header_view};
use crate::Result;

/// Encoded length of an IETH.
pub const LEN: usize = 4;

fixed_header_view!(
    /// Zero-copy view of an IETH.
    Ieth,
    LEN
);

impl<T: AsRef<[u8]>> Ieth<T> {
    /// The R_Key to invalidate.
    pub fn rkey(&self) -> u32 {
        field::read_u32(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ieth<T> {
    /// Sets the R_Key to invalidate.
    pub fn set_rkey(&mut self, rkey: u32) {
        field::write_u32(self.buffer.as_mut(), 0, rkey);
    }
}

/// The fields of an IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IethRepr {
    /// The R_Key to invalidate.
    pub rkey: u32,
}

impl IethRepr {
    /// Reads an IETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Ieth<T>) -> Result<IethRepr> {
        h.check_len()?;
        Ok(IethRepr { rkey: h.rkey() })
    }
    /// Writes an IETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Ieth<T>) -> Result<()> {
        h.check_len()?;
        h.set_rkey(self.rkey);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let r = IethRepr { rkey: 0xdead_0102 };
        let mut out = [0u8; LEN];
        r.emit(&mut Ieth::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, [0xde, 0xad, 0x01, 0x02]);
        assert_eq!(
            IethRepr::parse(&Ieth::new_checked(&out[..]).unwrap()),
            Ok(r)
        );
        assert!(Ieth::new_checked(&out[..2]).is_err());
    }
}
