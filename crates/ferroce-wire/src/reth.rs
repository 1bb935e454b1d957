//! The RDMA Extended Transport Header: where a WRITE or READ goes in the remote memory.
//!
//! ```text
//!  0..8    virtual address
//!  8..12   R_Key
//!  12..16  DMA length (of the whole message)
//! ```

use crate::field::{self, fixed_header_view};
use crate::Result;

/// Encoded length of a RETH.
pub const LEN: usize = 16;

fixed_header_view!(
    /// Zero-copy view of a RETH.
    Reth,
    LEN
);

impl<T: AsRef<[u8]>> Reth<T> {
    /// Remote virtual address.
    pub fn va(&self) -> u64 {
        field::read_u64(self.buffer.as_ref(), 0)
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        field::read_u32(self.buffer.as_ref(), 8)
    }
    /// Length in bytes of the whole WRITE or READ.
    pub fn dma_len(&self) -> u32 {
        field::read_u32(self.buffer.as_ref(), 12)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Reth<T> {
    /// Sets the virtual address.
    pub fn set_va(&mut self, va: u64) {
        field::write_u64(self.buffer.as_mut(), 0, va);
    }
    /// Sets the remote key.
    pub fn set_rkey(&mut self, rkey: u32) {
        field::write_u32(self.buffer.as_mut(), 8, rkey);
    }
    /// Sets the DMA length.
    pub fn set_dma_len(&mut self, len: u32) {
        field::write_u32(self.buffer.as_mut(), 12, len);
    }
}

/// The fields of a RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RethRepr {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// DMA length.
    pub dma_len: u32,
}

impl RethRepr {
    /// Reads a RETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Reth<T>) -> Result<RethRepr> {
        h.check_len()?;
        Ok(RethRepr {
            va: h.va(),
            rkey: h.rkey(),
            dma_len: h.dma_len(),
        })
    }
    /// Writes a RETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Reth<T>) -> Result<()> {
        h.check_len()?;
        h.set_va(self.va);
        h.set_rkey(self.rkey);
        h.set_dma_len(self.dma_len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        // write_lat_8192_mtu1024.pcap frame 23.
        let bytes = [
            0x00, 0x00, 0x55, 0xde, 0x8a, 0x35, 0xd0, 0x00, 0x00, 0x00, 0x07, 0xcd, 0x00, 0x00,
            0x20, 0x00,
        ];
        let r = RethRepr::parse(&Reth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            RethRepr {
                va: 0x0000_55de_8a35_d000,
                rkey: 0x7cd,
                dma_len: 8192
            }
        );
        let mut out = [0u8; LEN];
        r.emit(&mut Reth::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, bytes);
        assert!(Reth::new_checked(&bytes[..15]).is_err());
    }
}
