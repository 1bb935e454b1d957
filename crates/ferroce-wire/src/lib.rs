//! The IBTA / RoCE v2 wire format.
//!
//! Everything a RoCE v2 packet carries between the UDP header and the end of the frame: the Base
//! Transport Header ([`bth`]), the extension headers ([`reth`], [`aeth`], [`atomic_eth`],
//! [`atomic_ack_eth`], [`immdt`], [`ieth`], [`deth`]), the opcode table that says which of them
//! follow the BTH ([`opcode`]), 24-bit PSN arithmetic ([`psn`]) and the invariant CRC ([`icrc`]).
//! Around it: Ethernet/IPv4/IPv6/UDP framing for captures ([`frame`]), classic pcap files
//! ([`pcap`]) and a one-line-per-packet decoder ([`decode`]).
//!
//! # Contract (after smoltcp's `wire` module)
//! * Every header has a zero-copy view `Header<T: AsRef<[u8]>>` whose `new_checked` validates the
//!   length once; after that its getters never panic. Setters exist where `T: AsMut<[u8]>`.
//! * Every header has a plain `Repr` value with `parse(&view) -> Result<Repr>` and
//!   `emit(&self, &mut view)`, and its encoded length as `LEN`/`buffer_len()`.
//! * [`packet::RocePacket`] is the view of a whole transport packet (BTH to ICRC) and
//!   [`packet::PacketRepr`] its plain form.
//!
//! Nothing here does I/O, allocates per packet or panics on any input: parsing returns
//! [`WireError`].
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod aeth;
pub mod atomic_ack_eth;
pub mod atomic_eth;
pub mod bth;
pub mod cm;
pub mod decode;
pub mod deth;
mod error;
mod field;
pub mod frame;
pub mod icrc;
pub mod ieth;
pub mod immdt;
pub mod mad;
pub mod opcode;
pub mod packet;
pub mod pcap;
pub mod psn;
pub mod reth;

pub use error::WireError;
pub use opcode::Opcode;
pub use packet::{ExtHeaders, PacketRepr, RocePacket};
pub use psn::Psn;

/// The UDP destination port IANA assigned to RoCE v2.
pub const ROCE_V2_UDP_PORT: u16 = 4791;

/// Result type of this crate.
pub type Result<T> = core::result::Result<T, WireError>;
