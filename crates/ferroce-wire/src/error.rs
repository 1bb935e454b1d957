use thiserror::Error;

/// Why bytes could not be read or written as a RoCE v2 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum WireError {
    /// The buffer is shorter than the structure it should hold.
    #[error("truncated: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes the structure needs.
        needed: usize,
        /// Bytes that were there.
        available: usize,
    },
    /// The BTH opcode is reserved or belongs to a transport ferroce does not speak (RD).
    #[error("unsupported opcode 0x{0:02x}")]
    UnsupportedOpcode(u8),
    /// The BTH transport header version is not 0, the only one defined.
    #[error("unsupported transport header version {0}")]
    UnsupportedVersion(u8),
    /// Payload plus pad is not a multiple of four bytes, as IBTA requires.
    #[error("payload of {payload_len} bytes with pad count {pad} is not 4-byte aligned")]
    Misaligned {
        /// Payload bytes (without pad).
        payload_len: usize,
        /// The BTH pad count.
        pad: u8,
    },
    /// An opcode that carries no payload came with payload or pad bytes.
    #[error("opcode 0x{opcode:02x} carries no payload, found {extra} extra bytes")]
    UnexpectedPayload {
        /// The BTH opcode.
        opcode: u8,
        /// Bytes between the last header and the ICRC.
        extra: usize,
    },
    /// A [`crate::PacketRepr`] does not carry exactly the extension headers its opcode requires.
    #[error("extension headers do not match opcode 0x{0:02x}")]
    HeaderMismatch(u8),
    /// The BTH pad count does not match the payload length of a [`crate::PacketRepr`].
    #[error("pad count {pad} does not fit a payload of {payload_len} bytes")]
    BadPadCount {
        /// The pad count in the BTH.
        pad: u8,
        /// The payload length.
        payload_len: usize,
    },
    /// A frame is not Ethernet carrying IPv4/IPv6 and UDP.
    #[error("not a UDP frame: {0}")]
    NotUdp(&'static str),
    /// A malformed IP or UDP header.
    #[error("malformed {layer} header: {reason}")]
    BadHeader {
        /// Which header.
        layer: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A pcap file that is not a classic pcap, or a truncated record.
    #[error("pcap: {0}")]
    Pcap(&'static str),
    /// A value does not fit its field (a QPN or PSN over 24 bits, a pad over 3).
    #[error("{0} does not fit its field")]
    FieldOverflow(&'static str),
    /// A management datagram that is not what its reader takes: another class or class
    /// version, an unknown attribute, a method other than Send.
    #[error("not a CM MAD: {0}")]
    NotCm(&'static str),
}

impl WireError {
    pub(crate) fn check_len(needed: usize, available: usize) -> Result<(), WireError> {
        if available < needed {
            Err(WireError::Truncated { needed, available })
        } else {
            Ok(())
        }
    }
}
