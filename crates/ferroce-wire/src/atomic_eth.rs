//! The Atomic Extended Transport Header of COMPARE_SWAP and FETCH_ADD.
//!
//! ```text
//!  0..8    virtual address (8-byte aligned)
//!  8..12   R_Key
//!  12..20  swap data (COMPARE_SWAP) or add data (FETCH_ADD)
//!  20..28  compare data (COMPARE_SWAP only)
//! ```

use crate::field::{self, fixed_header_view};
use crate::Result;

/// Encoded length of an AtomicETH.
pub const LEN: usize = 28;

fixed_header_view!(
    /// Zero-copy view of an AtomicETH.
    AtomicEth,
    LEN
);

impl<T: AsRef<[u8]>> AtomicEth<T> {
    /// Remote virtual address of the 8-byte operand.
    pub fn va(&self) -> u64 {
        field::read_u64(self.buffer.as_ref(), 0)
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        field::read_u32(self.buffer.as_ref(), 8)
    }
    /// Swap value (COMPARE_SWAP) or addend (FETCH_ADD).
    pub fn swap_add(&self) -> u64 {
        field::read_u64(self.buffer.as_ref(), 12)
    }
    /// Compare value (COMPARE_SWAP).
    pub fn compare(&self) -> u64 {
        field::read_u64(self.buffer.as_ref(), 20)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicEth<T> {
    /// Sets every field.
    pub fn set_all(&mut self, va: u64, rkey: u32, swap_add: u64, compare: u64) {
        let b = self.buffer.as_mut();
        field::write_u64(b, 0, va);
        field::write_u32(b, 8, rkey);
        field::write_u64(b, 12, swap_add);
        field::write_u64(b, 20, compare);
    }
}

/// The fields of an AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicEthRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value or addend.
    pub swap_add: u64,
    /// Compare value.
    pub compare: u64,
}

impl AtomicEthRepr {
    /// Reads an AtomicETH.
    pub fn parse<T: AsRef<[u8]>>(h: &AtomicEth<T>) -> Result<AtomicEthRepr> {
        h.check_len()?;
        Ok(AtomicEthRepr {
            va: h.va(),
            rkey: h.rkey(),
            swap_add: h.swap_add(),
            compare: h.compare(),
        })
    }
    /// Writes an AtomicETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut AtomicEth<T>) -> Result<()> {
        h.check_len()?;
        h.set_all(self.va, self.rkey, self.swap_add, self.compare);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let r = AtomicEthRepr {
            va: 0x5589_4480_6000,
            rkey: 0xfe7,
            swap_add: 1,
            compare: 0,
        };
        let mut out = [0u8; LEN];
        r.emit(&mut AtomicEth::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(
            &out[..12],
            &[0, 0, 0x55, 0x89, 0x44, 0x80, 0x60, 0, 0, 0, 0x0f, 0xe7]
        );
        assert_eq!(
            AtomicEthRepr::parse(&AtomicEth::new_checked(&out[..]).unwrap()),
            Ok(r)
        );
        assert!(AtomicEth::new_checked(&out[..27]).is_err());
    }
}
