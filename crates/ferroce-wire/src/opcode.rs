//! BTH opcodes and the table of headers each one carries.
//!
//! The top three bits of an opcode name the transport (RC, UC, RD, UD, CNP), the low five the
//! operation. [`Opcode::info`] is the single table the parser, the emitter and the transport
//! consult: which extension headers follow the BTH, whether a payload follows them, and where the
//! packet sits in a message (first, middle, last, only).

use core::fmt;

/// The transport service an opcode belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Reliable Connection.
    Rc,
    /// Unreliable Connection.
    Uc,
    /// Reliable Datagram (not spoken by ferroce; its opcodes do not parse).
    Rd,
    /// Unreliable Datagram.
    Ud,
    /// RoCE v2 Congestion Notification Packet.
    Cnp,
    /// Manufacturer specific (opcodes 0xC0–0xFF): ferroce's own, sent only to a peer that
    /// negotiated them.
    Vendor,
}

/// Extension headers that can follow a BTH, as a bit set, in wire order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HeaderSet(u16);

impl HeaderSet {
    /// Datagram ETH (UD).
    pub const DETH: HeaderSet = HeaderSet(1 << 0);
    /// RDMA ETH (WRITE first/only, READ request).
    pub const RETH: HeaderSet = HeaderSet(1 << 1);
    /// Atomic ETH (COMPARE_SWAP, FETCH_ADD).
    pub const ATOMIC_ETH: HeaderSet = HeaderSet(1 << 2);
    /// ACK ETH (acknowledgements, READ response first/last/only).
    pub const AETH: HeaderSet = HeaderSet(1 << 3);
    /// Atomic ACK ETH (ATOMIC_ACKNOWLEDGE).
    pub const ATOMIC_ACK_ETH: HeaderSet = HeaderSet(1 << 4);
    /// Immediate data.
    pub const IMMDT: HeaderSet = HeaderSet(1 << 5);
    /// Invalidate ETH (SEND with invalidate).
    pub const IETH: HeaderSet = HeaderSet(1 << 6);
    /// The 16 reserved bytes of a RoCE v2 CNP.
    pub const CNP_RESERVED: HeaderSet = HeaderSet(1 << 7);

    /// The empty set.
    pub const fn empty() -> HeaderSet {
        HeaderSet(0)
    }

    /// Union of two sets.
    pub const fn with(self, other: HeaderSet) -> HeaderSet {
        HeaderSet(self.0 | other.0)
    }

    /// Whether every header of `other` is in `self`.
    pub const fn contains(self, other: HeaderSet) -> bool {
        self.0 & other.0 == other.0
    }

    /// Total encoded length of the headers in the set.
    pub const fn encoded_len(self) -> usize {
        let mut len = 0;
        if self.contains(Self::DETH) {
            len += crate::deth::LEN;
        }
        if self.contains(Self::RETH) {
            len += crate::reth::LEN;
        }
        if self.contains(Self::ATOMIC_ETH) {
            len += crate::atomic_eth::LEN;
        }
        if self.contains(Self::AETH) {
            len += crate::aeth::LEN;
        }
        if self.contains(Self::ATOMIC_ACK_ETH) {
            len += crate::atomic_ack_eth::LEN;
        }
        if self.contains(Self::IMMDT) {
            len += crate::immdt::LEN;
        }
        if self.contains(Self::IETH) {
            len += crate::ieth::LEN;
        }
        if self.contains(Self::CNP_RESERVED) {
            len += CNP_RESERVED_LEN;
        }
        len
    }
}

/// Length of the reserved block a RoCE v2 CNP carries after its BTH.
pub const CNP_RESERVED_LEN: usize = 16;

/// Where a packet sits within its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// First packet of a multi-packet message.
    First,
    /// A packet between first and last.
    Middle,
    /// Last packet of a multi-packet message.
    Last,
    /// The whole message in one packet.
    Only,
}

impl Position {
    /// Whether this packet starts a message.
    pub const fn starts_message(self) -> bool {
        matches!(self, Position::First | Position::Only)
    }

    /// Whether this packet ends a message.
    pub const fn ends_message(self) -> bool {
        matches!(self, Position::Last | Position::Only)
    }
}

/// The operation an opcode performs, independent of transport and position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// SEND (also with immediate or invalidate).
    Send,
    /// RDMA WRITE (also with immediate).
    RdmaWrite,
    /// RDMA READ request.
    RdmaReadRequest,
    /// RDMA READ response.
    RdmaReadResponse,
    /// ACKNOWLEDGE (ACK or NAK).
    Acknowledge,
    /// ATOMIC ACKNOWLEDGE.
    AtomicAcknowledge,
    /// COMPARE_SWAP.
    CompareSwap,
    /// FETCH_ADD.
    FetchAdd,
    /// RoCE v2 Congestion Notification Packet.
    CongestionNotification,
    /// ferroce's selective acknowledgement (a manufacturer-specific opcode): which packets
    /// after a gap the responder keeps.
    SelectiveAck,
}

/// What the opcode table says about one opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpcodeInfo {
    /// IBTA name, e.g. `RC_RDMA_WRITE_FIRST`.
    pub name: &'static str,
    /// Transport service.
    pub transport: Transport,
    /// Operation.
    pub operation: Operation,
    /// Position within the message.
    pub position: Position,
    /// Extension headers that follow the BTH.
    pub headers: HeaderSet,
    /// Whether a payload may follow the headers.
    pub has_payload: bool,
}

/// A BTH opcode byte.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode(pub u8);

macro_rules! opcodes {
    ($( $(#[$doc:meta])* $konst:ident = $val:expr, $name:expr, $tr:ident, $op:ident, $pos:ident, [$($h:ident),*], $payload:expr; )*) => {
        impl Opcode {
            $( $(#[$doc])* pub const $konst: Opcode = Opcode($val); )*

            /// What the table says about this opcode, or `None` for a reserved or RD opcode.
            #[inline]
            pub const fn info(self) -> Option<&'static OpcodeInfo> {
                // One load from a table built at compile time: every packet parsed or built
                // asks, some several times.
                OPCODE_TABLE[self.0 as usize]
            }

            /// The table's entry for `self`, as written in the list below.
            const fn lookup(self) -> Option<&'static OpcodeInfo> {
                match self.0 {
                    $( $val => {
                        const INFO: OpcodeInfo = OpcodeInfo {
                            name: $name,
                            transport: Transport::$tr,
                            operation: Operation::$op,
                            position: Position::$pos,
                            headers: HeaderSet::empty()$(.with(HeaderSet::$h))*,
                            has_payload: $payload,
                        };
                        Some(&INFO)
                    } )*
                    _ => None,
                }
            }
        }

        /// [`Opcode::info`] of every byte value.
        const OPCODE_TABLE: [Option<&'static OpcodeInfo>; 256] = {
            let mut table = [None; 256];
            let mut i = 0;
            while i < 256 {
                table[i] = Opcode(i as u8).lookup();
                i += 1;
            }
            table
        };

        /// Every opcode ferroce parses, in numeric order.
        pub const ALL_OPCODES: &[Opcode] = &[$(Opcode($val)),*];
    };
}

opcodes! {
    /// RC SEND first packet.
    RC_SEND_FIRST = 0x00, "RC_SEND_FIRST", Rc, Send, First, [], true;
    /// RC SEND middle packet.
    RC_SEND_MIDDLE = 0x01, "RC_SEND_MIDDLE", Rc, Send, Middle, [], true;
    /// RC SEND last packet.
    RC_SEND_LAST = 0x02, "RC_SEND_LAST", Rc, Send, Last, [], true;
    /// RC SEND last packet with immediate data.
    RC_SEND_LAST_WITH_IMMEDIATE = 0x03, "RC_SEND_LAST_WITH_IMMEDIATE", Rc, Send, Last, [IMMDT], true;
    /// RC SEND in one packet.
    RC_SEND_ONLY = 0x04, "RC_SEND_ONLY", Rc, Send, Only, [], true;
    /// RC SEND in one packet with immediate data.
    RC_SEND_ONLY_WITH_IMMEDIATE = 0x05, "RC_SEND_ONLY_WITH_IMMEDIATE", Rc, Send, Only, [IMMDT], true;
    /// RC RDMA WRITE first packet.
    RC_RDMA_WRITE_FIRST = 0x06, "RC_RDMA_WRITE_FIRST", Rc, RdmaWrite, First, [RETH], true;
    /// RC RDMA WRITE middle packet.
    RC_RDMA_WRITE_MIDDLE = 0x07, "RC_RDMA_WRITE_MIDDLE", Rc, RdmaWrite, Middle, [], true;
    /// RC RDMA WRITE last packet.
    RC_RDMA_WRITE_LAST = 0x08, "RC_RDMA_WRITE_LAST", Rc, RdmaWrite, Last, [], true;
    /// RC RDMA WRITE last packet with immediate data.
    RC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09, "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE", Rc, RdmaWrite, Last, [IMMDT], true;
    /// RC RDMA WRITE in one packet.
    RC_RDMA_WRITE_ONLY = 0x0a, "RC_RDMA_WRITE_ONLY", Rc, RdmaWrite, Only, [RETH], true;
    /// RC RDMA WRITE in one packet with immediate data.
    RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0b, "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", Rc, RdmaWrite, Only, [RETH, IMMDT], true;
    /// RC RDMA READ request.
    RC_RDMA_READ_REQUEST = 0x0c, "RC_RDMA_READ_REQUEST", Rc, RdmaReadRequest, Only, [RETH], false;
    /// RC RDMA READ response, first packet.
    RC_RDMA_READ_RESPONSE_FIRST = 0x0d, "RC_RDMA_READ_RESPONSE_FIRST", Rc, RdmaReadResponse, First, [AETH], true;
    /// RC RDMA READ response, middle packet.
    RC_RDMA_READ_RESPONSE_MIDDLE = 0x0e, "RC_RDMA_READ_RESPONSE_MIDDLE", Rc, RdmaReadResponse, Middle, [], true;
    /// RC RDMA READ response, last packet.
    RC_RDMA_READ_RESPONSE_LAST = 0x0f, "RC_RDMA_READ_RESPONSE_LAST", Rc, RdmaReadResponse, Last, [AETH], true;
    /// RC RDMA READ response in one packet.
    RC_RDMA_READ_RESPONSE_ONLY = 0x10, "RC_RDMA_READ_RESPONSE_ONLY", Rc, RdmaReadResponse, Only, [AETH], true;
    /// RC ACKNOWLEDGE (ACK, RNR NAK or NAK).
    RC_ACKNOWLEDGE = 0x11, "RC_ACKNOWLEDGE", Rc, Acknowledge, Only, [AETH], false;
    /// RC ATOMIC ACKNOWLEDGE.
    RC_ATOMIC_ACKNOWLEDGE = 0x12, "RC_ATOMIC_ACKNOWLEDGE", Rc, AtomicAcknowledge, Only, [AETH, ATOMIC_ACK_ETH], false;
    /// RC COMPARE_SWAP.
    RC_COMPARE_SWAP = 0x13, "RC_COMPARE_SWAP", Rc, CompareSwap, Only, [ATOMIC_ETH], false;
    /// RC FETCH_ADD.
    RC_FETCH_ADD = 0x14, "RC_FETCH_ADD", Rc, FetchAdd, Only, [ATOMIC_ETH], false;
    /// RC SEND last packet with invalidate.
    RC_SEND_LAST_WITH_INVALIDATE = 0x16, "RC_SEND_LAST_WITH_INVALIDATE", Rc, Send, Last, [IETH], true;
    /// RC SEND in one packet with invalidate.
    RC_SEND_ONLY_WITH_INVALIDATE = 0x17, "RC_SEND_ONLY_WITH_INVALIDATE", Rc, Send, Only, [IETH], true;
    /// UC SEND first packet.
    UC_SEND_FIRST = 0x20, "UC_SEND_FIRST", Uc, Send, First, [], true;
    /// UC SEND middle packet.
    UC_SEND_MIDDLE = 0x21, "UC_SEND_MIDDLE", Uc, Send, Middle, [], true;
    /// UC SEND last packet.
    UC_SEND_LAST = 0x22, "UC_SEND_LAST", Uc, Send, Last, [], true;
    /// UC SEND last packet with immediate data.
    UC_SEND_LAST_WITH_IMMEDIATE = 0x23, "UC_SEND_LAST_WITH_IMMEDIATE", Uc, Send, Last, [IMMDT], true;
    /// UC SEND in one packet.
    UC_SEND_ONLY = 0x24, "UC_SEND_ONLY", Uc, Send, Only, [], true;
    /// UC SEND in one packet with immediate data.
    UC_SEND_ONLY_WITH_IMMEDIATE = 0x25, "UC_SEND_ONLY_WITH_IMMEDIATE", Uc, Send, Only, [IMMDT], true;
    /// UC RDMA WRITE first packet.
    UC_RDMA_WRITE_FIRST = 0x26, "UC_RDMA_WRITE_FIRST", Uc, RdmaWrite, First, [RETH], true;
    /// UC RDMA WRITE middle packet.
    UC_RDMA_WRITE_MIDDLE = 0x27, "UC_RDMA_WRITE_MIDDLE", Uc, RdmaWrite, Middle, [], true;
    /// UC RDMA WRITE last packet.
    UC_RDMA_WRITE_LAST = 0x28, "UC_RDMA_WRITE_LAST", Uc, RdmaWrite, Last, [], true;
    /// UC RDMA WRITE last packet with immediate data.
    UC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x29, "UC_RDMA_WRITE_LAST_WITH_IMMEDIATE", Uc, RdmaWrite, Last, [IMMDT], true;
    /// UC RDMA WRITE in one packet.
    UC_RDMA_WRITE_ONLY = 0x2a, "UC_RDMA_WRITE_ONLY", Uc, RdmaWrite, Only, [RETH], true;
    /// UC RDMA WRITE in one packet with immediate data.
    UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x2b, "UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", Uc, RdmaWrite, Only, [RETH, IMMDT], true;
    /// UD SEND (a datagram is always one packet).
    UD_SEND_ONLY = 0x64, "UD_SEND_ONLY", Ud, Send, Only, [DETH], true;
    /// UD SEND with immediate data.
    UD_SEND_ONLY_WITH_IMMEDIATE = 0x65, "UD_SEND_ONLY_WITH_IMMEDIATE", Ud, Send, Only, [DETH, IMMDT], true;
    /// RoCE v2 Congestion Notification Packet.
    CNP = 0x81, "CNP", Cnp, CongestionNotification, Only, [CNP_RESERVED], false;
    /// ferroce's selective acknowledgement, in the manufacturer-specific range (IBTA 9.2:
    /// opcodes 0xC0–0xFF): an ACK's BTH and AETH, then a bitmap of the PSNs kept after the
    /// gap. Sent only to a peer that negotiated selective repeat (see ferroce-proto's `sack`).
    FERROCE_SACK = 0xc0, "FERROCE_SACK", Vendor, SelectiveAck, Only, [AETH], true;
}

impl Opcode {
    /// IBTA name, or `UNKNOWN` for a reserved opcode.
    pub fn name(self) -> &'static str {
        self.info().map_or("UNKNOWN", |i| i.name)
    }

    /// Transport named by the top three bits, whether or not the opcode itself is defined.
    pub const fn transport_bits(self) -> Transport {
        match self.0 >> 5 {
            0 => Transport::Rc,
            1 => Transport::Uc,
            2 => Transport::Rd,
            3 => Transport::Ud,
            6 | 7 => Transport::Vendor,
            _ => Transport::Cnp,
        }
    }
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(0x{:02x})", self.name(), self.0)
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for &op in ALL_OPCODES {
            let info = op.info().expect("listed opcode has info");
            assert_eq!(op.transport_bits(), info.transport, "{op:?}");
            if info.headers.contains(HeaderSet::IMMDT) {
                assert!(
                    info.position.ends_message(),
                    "{op:?} immediate on a non-final packet"
                );
            }
            if info.headers.contains(HeaderSet::RETH) && info.operation == Operation::RdmaWrite {
                assert!(info.position.starts_message(), "{op:?}");
            }
        }
        // RC 0x00..=0x14 and 0x16, 0x17; UC 0x20..=0x2b; UD 0x64, 0x65; CNP 0x81; ferroce's 0xc0.
        assert_eq!(ALL_OPCODES.len(), 23 + 12 + 2 + 1 + 1);
        assert_eq!(Opcode(0xc1).transport_bits(), Transport::Vendor);
    }

    #[test]
    fn reserved_and_rd_opcodes_have_no_info() {
        for raw in [0x15u8, 0x18, 0x1f, 0x2c, 0x40, 0x5f, 0x66, 0x80, 0xff] {
            assert!(Opcode(raw).info().is_none(), "0x{raw:02x}");
        }
        assert_eq!(Opcode(0x40).transport_bits(), Transport::Rd);
    }

    #[test]
    fn header_lengths() {
        let i = Opcode::RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE.info().unwrap();
        assert_eq!(i.headers.encoded_len(), 16 + 4);
        let i = Opcode::RC_ATOMIC_ACKNOWLEDGE.info().unwrap();
        assert_eq!(i.headers.encoded_len(), 4 + 8);
        let i = Opcode::UD_SEND_ONLY_WITH_IMMEDIATE.info().unwrap();
        assert_eq!(i.headers.encoded_len(), 8 + 4);
    }
}
