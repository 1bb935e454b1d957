//! The data pointer of a command over RDMA: one SGL descriptor (NVMe base 2.0 §4.1.8, NVMe-oF
//! 1.1 §7.3.2). A host either puts the data in the capsule after the submission entry (a Data
//! Block descriptor whose address is an offset into that data) or names a region of its
//! memory with a key (a Keyed SGL Data Block), which the controller reads with RDMA READ (host
//! to controller) or fills with RDMA WRITE (controller to host). A keyed descriptor of subtype
//! "invalidate" asks the controller to answer with SEND with Invalidate of that key.

use crate::{le, need, WireError};

/// A descriptor's size.
pub const DESCRIPTOR_LEN: usize = 16;

/// Descriptor types (the identifier byte's upper nibble).
const TYPE_DATA_BLOCK: u8 = 0x0;
const TYPE_KEYED_DATA_BLOCK: u8 = 0x4;
/// Subtypes (its lower nibble).
const SUBTYPE_ADDRESS: u8 = 0x0;
const SUBTYPE_OFFSET: u8 = 0x1;
const SUBTYPE_INVALIDATE: u8 = 0xF;

/// The largest length a keyed descriptor can say (its length field has 24 bits).
pub const KEYED_MAX_LEN: u32 = (1 << 24) - 1;

/// One SGL descriptor as an NVMe/RDMA command carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sgl {
    /// Data in the capsule, `offset` bytes after the submission entry's end.
    InCapsule {
        /// Where the data starts in the capsule's data.
        offset: u64,
        /// Its length.
        len: u32,
    },
    /// A region of the host's memory, reached with the host's key.
    Keyed {
        /// The region's address, as the host's RDMA writes name it.
        addr: u64,
        /// Its length (24 bits).
        len: u32,
        /// The host's remote key.
        key: u32,
        /// The host asks for SEND with Invalidate of `key` with the response.
        invalidate: bool,
    },
}

impl Sgl {
    /// Reads a descriptor: a Data Block with an offset, or a Keyed SGL Data Block (address or
    /// invalidate). Any other type or subtype is refused: the controller answers "SGL
    /// Descriptor Type Invalid".
    pub fn parse(b: &[u8]) -> Result<Sgl, WireError> {
        need(b, DESCRIPTOR_LEN, "SGL descriptor")?;
        let id = b[15];
        let (kind, sub) = (id >> 4, id & 0xF);
        match (kind, sub) {
            (TYPE_DATA_BLOCK, SUBTYPE_OFFSET) => Ok(Sgl::InCapsule {
                offset: le::u64_at(b, 0),
                len: le::u32_at(b, 8),
            }),
            (TYPE_KEYED_DATA_BLOCK, SUBTYPE_ADDRESS | SUBTYPE_INVALIDATE) => Ok(Sgl::Keyed {
                addr: le::u64_at(b, 0),
                len: u32::from_le_bytes([b[8], b[9], b[10], 0]),
                key: le::u32_at(b, 11),
                invalidate: sub == SUBTYPE_INVALIDATE,
            }),
            _ => Err(WireError::Invalid {
                what: "SGL descriptor identifier",
                value: u64::from(id),
            }),
        }
    }

    /// Writes the descriptor into `b` (16 bytes). A keyed length past 24 bits is refused.
    pub fn write(&self, b: &mut [u8]) -> Result<(), WireError> {
        need(b, DESCRIPTOR_LEN, "SGL descriptor")?;
        b[..DESCRIPTOR_LEN].fill(0);
        match *self {
            Sgl::InCapsule { offset, len } => {
                le::put_u64(b, 0, offset);
                le::put_u32(b, 8, len);
                b[15] = TYPE_DATA_BLOCK << 4 | SUBTYPE_OFFSET;
            }
            Sgl::Keyed {
                addr,
                len,
                key,
                invalidate,
            } => {
                if len > KEYED_MAX_LEN {
                    return Err(WireError::Invalid {
                        what: "keyed SGL length",
                        value: u64::from(len),
                    });
                }
                le::put_u64(b, 0, addr);
                b[8..11].copy_from_slice(&len.to_le_bytes()[..3]);
                le::put_u32(b, 11, key);
                let sub = if invalidate {
                    SUBTYPE_INVALIDATE
                } else {
                    SUBTYPE_ADDRESS
                };
                b[15] = TYPE_KEYED_DATA_BLOCK << 4 | sub;
            }
        }
        Ok(())
    }

    /// The data's length.
    pub fn len(&self) -> u32 {
        match *self {
            Sgl::InCapsule { len, .. } | Sgl::Keyed { len, .. } => len,
        }
    }

    /// Whether it describes no data.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_keyed_descriptor_as_linux_writes_it() {
        // nvme-rdma's `nvme_rdma_map_sg_single`: address, 24-bit length, key, then the
        // identifier 0x4F (keyed data block, invalidate) — bytes from its layout.
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&0x0000_7f12_3456_7000u64.to_le_bytes());
        b[8..11].copy_from_slice(&[0x00, 0x10, 0x00]); // 4096
        b[11..15].copy_from_slice(&0x1234_5678u32.to_le_bytes());
        b[15] = 0x4F;
        assert_eq!(
            Sgl::parse(&b).unwrap(),
            Sgl::Keyed {
                addr: 0x7f12_3456_7000,
                len: 4096,
                key: 0x1234_5678,
                invalidate: true
            }
        );
        let mut out = [0xAAu8; 16];
        Sgl::parse(&b).unwrap().write(&mut out).unwrap();
        assert_eq!(out, b);
    }

    #[test]
    fn in_capsule_data_is_an_offset_descriptor() {
        let mut b = [0u8; 16];
        Sgl::InCapsule {
            offset: 0,
            len: 8192,
        }
        .write(&mut b)
        .unwrap();
        assert_eq!(b[15], 0x01);
        assert_eq!(&b[8..12], &8192u32.to_le_bytes());
        assert_eq!(
            Sgl::parse(&b).unwrap(),
            Sgl::InCapsule {
                offset: 0,
                len: 8192
            }
        );
    }

    #[test]
    fn other_descriptor_types_and_short_input_are_refused() {
        for id in [0x00u8, 0x02, 0x20, 0x30, 0x41, 0x5F, 0xFF] {
            let mut b = [0u8; 16];
            b[15] = id;
            assert!(
                matches!(Sgl::parse(&b), Err(WireError::Invalid { .. })),
                "{id:#x}"
            );
        }
        assert!(matches!(
            Sgl::parse(&[0u8; 15]),
            Err(WireError::Short { .. })
        ));
        let mut b = [0u8; 16];
        let long = Sgl::Keyed {
            addr: 0,
            len: 1 << 24,
            key: 1,
            invalidate: false,
        };
        assert!(long.write(&mut b).is_err());
    }

    proptest! {
        #[test]
        fn any_sixteen_bytes_parse_or_fail_cleanly(b in proptest::collection::vec(any::<u8>(), 0..24)) {
            if let Ok(s) = Sgl::parse(&b) {
                let mut out = [0u8; 16];
                s.write(&mut out).unwrap();
                prop_assert_eq!(Sgl::parse(&out).unwrap(), s);
            }
        }

        #[test]
        fn keyed_descriptors_round_trip(addr: u64, len in 0u32..=KEYED_MAX_LEN, key: u32, invalidate: bool) {
            let s = Sgl::Keyed { addr, len, key, invalidate };
            let mut b = [0u8; 16];
            s.write(&mut b).unwrap();
            prop_assert_eq!(Sgl::parse(&b).unwrap(), s);
        }
    }
}
