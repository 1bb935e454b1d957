//! The Atomic ACK Extended Transport Header: the original value an atomic found.

use crate::field::{self, fixed_header_view};
use crate::Result;

/// Encoded length of an AtomicAckETH.
pub const LEN: usize = 8;

fixed_header_view!(
    /// Zero-copy view of an AtomicAckETH.
    AtomicAckEth,
    LEN
);

impl<T: AsRef<[u8]>> AtomicAckEth<T> {
    /// The value at the target before the atomic operation.
    pub fn original(&self) -> u64 {
        field::read_u64(self.buffer.as_ref(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicAckEth<T> {
    /// Sets the original value.
    pub fn set_original(&mut self, v: u64) {
        field::write_u64(self.buffer.as_mut(), 0, v);
    }
}

/// The fields of an AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AtomicAckEthRepr {
    /// The value at the target before the operation.
    pub original: u64,
}

impl AtomicAckEthRepr {
    /// Reads an AtomicAckETH.
    pub fn parse<T: AsRef<[u8]>>(h: &AtomicAckEth<T>) -> Result<AtomicAckEthRepr> {
        h.check_len()?;
        Ok(AtomicAckEthRepr {
            original: h.original(),
        })
    }
    /// Writes an AtomicAckETH.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut AtomicAckEth<T>) -> Result<()> {
        h.check_len()?;
        h.set_original(self.original);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        // atomic_lat_fetch_add.pcap frame 24: original remote data 3961190232460429053.
        let r = AtomicAckEthRepr {
            original: 3_961_190_232_460_429_053,
        };
        let mut out = [0u8; LEN];
        r.emit(&mut AtomicAckEth::new_unchecked(&mut out[..]))
            .unwrap();
        assert_eq!(out, 3_961_190_232_460_429_053u64.to_be_bytes());
        assert_eq!(
            AtomicAckEthRepr::parse(&AtomicAckEth::new_checked(&out[..]).unwrap()),
            Ok(r)
        );
        assert!(AtomicAckEth::new_checked(&out[..7]).is_err());
    }
}
