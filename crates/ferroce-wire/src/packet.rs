//! A whole transport packet: BTH, extension headers, payload, pad and ICRC.
//!
//! [`RocePacket`] views the bytes a RoCE v2 UDP datagram carries; [`RocePacket::new_checked`]
//! validates them once (known opcode, header version 0, every header present, payload plus pad
//! a multiple of four, no payload on opcodes that carry none) and the getters never panic after.
//! [`PacketRepr`] is the plain form: BTH fields, the extension headers the opcode carries and the
//! payload length. The payload itself stays in the caller's buffer: emitting writes headers and
//! pad only, so a sender copies each payload byte exactly once.

use crate::aeth::{Aeth, AethRepr};
use crate::atomic_ack_eth::{AtomicAckEth, AtomicAckEthRepr};
use crate::atomic_eth::{AtomicEth, AtomicEthRepr};
use crate::bth::{self, Bth, BthRepr};
use crate::deth::{Deth, DethRepr};
use crate::field;
use crate::ieth::{Ieth, IethRepr};
use crate::immdt::{ImmDt, ImmDtRepr};
use crate::opcode::{HeaderSet, Opcode, OpcodeInfo, CNP_RESERVED_LEN};
use crate::reth::{Reth, RethRepr};
use crate::{Result, WireError};

/// Length of the invariant CRC that ends every packet.
pub const ICRC_LEN: usize = 4;

/// The pad that brings `payload_len` to a 4-byte boundary.
pub const fn pad_for(payload_len: usize) -> u8 {
    ((4 - (payload_len % 4)) % 4) as u8
}

/// The order in which extension headers follow the BTH.
const HEADER_ORDER: [HeaderSet; 8] = [
    HeaderSet::DETH,
    HeaderSet::RETH,
    HeaderSet::ATOMIC_ETH,
    HeaderSet::AETH,
    HeaderSet::ATOMIC_ACK_ETH,
    HeaderSet::IMMDT,
    HeaderSet::IETH,
    HeaderSet::CNP_RESERVED,
];

/// Hands out the byte ranges of the extension headers a packet carries, front to back: a
/// single pass over the headers, for parsing and building alike.
struct HeaderCursor {
    set: HeaderSet,
    at: usize,
}

impl HeaderCursor {
    fn new(set: HeaderSet) -> HeaderCursor {
        HeaderCursor { set, at: bth::LEN }
    }

    /// The range of `which` if the packet carries it. Called in [`HEADER_ORDER`].
    #[inline]
    fn next(&mut self, which: HeaderSet) -> Option<core::ops::Range<usize>> {
        if !self.set.contains(which) {
            return None;
        }
        let start = self.at;
        self.at += which.encoded_len();
        Some(start..self.at)
    }
}

/// Zero-copy view of a transport packet, from the first BTH byte to the last ICRC byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RocePacket<T: AsRef<[u8]>> {
    buffer: T,
}

/// Offset of header `which` in a packet whose opcode carries `set`, if it carries it. Headers
/// follow the BTH in the order of the [`HeaderSet`] constants.
fn header_offset(set: HeaderSet, which: HeaderSet) -> Option<usize> {
    if !set.contains(which) {
        return None;
    }
    let mut off = bth::LEN;
    for h in HEADER_ORDER {
        if h == which {
            return Some(off);
        }
        if set.contains(h) {
            off += h.encoded_len();
        }
    }
    None
}

impl<T: AsRef<[u8]>> RocePacket<T> {
    /// Wraps `buffer` without validation; getters may panic or return `None` if it is invalid.
    pub const fn new_unchecked(buffer: T) -> Self {
        RocePacket { buffer }
    }

    /// Wraps `buffer` after validating it (see the module doc).
    pub fn new_checked(buffer: T) -> Result<Self> {
        let p = Self::new_unchecked(buffer);
        p.check()?;
        Ok(p)
    }

    /// Validates the buffer as a packet.
    pub fn check(&self) -> Result<()> {
        self.checked_info().map(|_| ())
    }

    /// Validates the buffer as a packet and returns its opcode's table entry.
    fn checked_info(&self) -> Result<&'static OpcodeInfo> {
        let b = self.buffer.as_ref();
        WireError::check_len(bth::LEN + ICRC_LEN, b.len())?;
        let bth = Bth::new_unchecked(b);
        if bth.tver() != 0 {
            return Err(WireError::UnsupportedVersion(bth.tver()));
        }
        let op = bth.opcode();
        let info = op.info().ok_or(WireError::UnsupportedOpcode(op.0))?;
        let headers_end = bth::LEN + info.headers.encoded_len();
        WireError::check_len(headers_end + ICRC_LEN, b.len())?;
        let body = b.len() - headers_end - ICRC_LEN;
        let pad = bth.pad_count();
        if !info.has_payload && body > 0 {
            return Err(WireError::UnexpectedPayload {
                opcode: op.0,
                extra: body,
            });
        }
        if body < usize::from(pad) || body % 4 != 0 {
            return Err(WireError::Misaligned {
                payload_len: body.saturating_sub(pad.into()),
                pad,
            });
        }
        Ok(info)
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// All bytes of the packet.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The BTH.
    pub fn bth(&self) -> Bth<&[u8]> {
        Bth::new_unchecked(&self.buffer.as_ref()[..bth::LEN])
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        self.bth().opcode()
    }

    /// What the opcode table says of this packet's opcode.
    pub fn info(&self) -> Option<&'static OpcodeInfo> {
        self.opcode().info()
    }

    fn headers(&self) -> HeaderSet {
        self.info().map_or(HeaderSet::empty(), |i| i.headers)
    }

    fn header_bytes(&self, which: HeaderSet) -> Option<&[u8]> {
        let off = header_offset(self.headers(), which)?;
        self.buffer.as_ref().get(off..off + which.encoded_len())
    }

    /// Length of BTH plus extension headers.
    pub fn header_len(&self) -> usize {
        bth::LEN + self.headers().encoded_len()
    }

    /// The RETH, if the opcode carries one.
    pub fn reth(&self) -> Option<Reth<&[u8]>> {
        self.header_bytes(HeaderSet::RETH).map(Reth::new_unchecked)
    }
    /// The AETH, if the opcode carries one.
    pub fn aeth(&self) -> Option<Aeth<&[u8]>> {
        self.header_bytes(HeaderSet::AETH).map(Aeth::new_unchecked)
    }
    /// The AtomicETH, if the opcode carries one.
    pub fn atomic_eth(&self) -> Option<AtomicEth<&[u8]>> {
        self.header_bytes(HeaderSet::ATOMIC_ETH)
            .map(AtomicEth::new_unchecked)
    }
    /// The AtomicAckETH, if the opcode carries one.
    pub fn atomic_ack_eth(&self) -> Option<AtomicAckEth<&[u8]>> {
        self.header_bytes(HeaderSet::ATOMIC_ACK_ETH)
            .map(AtomicAckEth::new_unchecked)
    }
    /// The ImmDt, if the opcode carries one.
    pub fn immdt(&self) -> Option<ImmDt<&[u8]>> {
        self.header_bytes(HeaderSet::IMMDT)
            .map(ImmDt::new_unchecked)
    }
    /// The IETH, if the opcode carries one.
    pub fn ieth(&self) -> Option<Ieth<&[u8]>> {
        self.header_bytes(HeaderSet::IETH).map(Ieth::new_unchecked)
    }
    /// The DETH, if the opcode carries one.
    pub fn deth(&self) -> Option<Deth<&[u8]>> {
        self.header_bytes(HeaderSet::DETH).map(Deth::new_unchecked)
    }

    /// Offset of the first payload byte.
    pub fn payload_offset(&self) -> usize {
        self.header_len()
    }

    /// Payload length, without pad.
    pub fn payload_len(&self) -> usize {
        let b = self.buffer.as_ref().len();
        b.saturating_sub(self.header_len() + ICRC_LEN + usize::from(self.bth().pad_count()))
    }

    /// The payload, without pad.
    pub fn payload(&self) -> &[u8] {
        let start = self.payload_offset();
        let end = start + self.payload_len();
        self.buffer.as_ref().get(start..end).unwrap_or(&[])
    }

    /// Offset of the ICRC (the packet length minus four).
    pub fn icrc_offset(&self) -> usize {
        self.buffer.as_ref().len().saturating_sub(ICRC_LEN)
    }

    /// The packet without its ICRC: what the ICRC covers after the masked BTH.
    pub fn covered(&self) -> &[u8] {
        &self.buffer.as_ref()[..self.icrc_offset()]
    }

    /// The ICRC as carried, read as the little-endian word the CRC produced (the value Wireshark
    /// prints is this word byte-swapped, see [`crate::icrc`]).
    pub fn icrc(&self) -> u32 {
        let b = self.buffer.as_ref();
        let at = self.icrc_offset();
        match b.get(at..at + ICRC_LEN) {
            Some(x) => u32::from_le_bytes([x[0], x[1], x[2], x[3]]),
            None => 0,
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> RocePacket<T> {
    /// The BTH, writable.
    pub fn bth_mut(&mut self) -> Bth<&mut [u8]> {
        Bth::new_unchecked(&mut self.buffer.as_mut()[..bth::LEN])
    }

    /// The payload, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.payload_offset();
        let end = start + self.payload_len();
        self.buffer.as_mut().get_mut(start..end).unwrap_or(&mut [])
    }

    /// Stores the ICRC (as produced by [`crate::icrc`]).
    pub fn set_icrc(&mut self, icrc: u32) {
        let at = self.icrc_offset();
        if let Some(x) = self.buffer.as_mut().get_mut(at..at + ICRC_LEN) {
            x.copy_from_slice(&icrc.to_le_bytes());
        }
    }
}

/// The extension headers a packet carries; which ones must be present is fixed by its opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExtHeaders {
    /// Datagram ETH (UD).
    pub deth: Option<DethRepr>,
    /// RDMA ETH.
    pub reth: Option<RethRepr>,
    /// Atomic ETH.
    pub atomic_eth: Option<AtomicEthRepr>,
    /// ACK ETH.
    pub aeth: Option<AethRepr>,
    /// Atomic ACK ETH.
    pub atomic_ack_eth: Option<AtomicAckEthRepr>,
    /// Immediate data.
    pub immdt: Option<ImmDtRepr>,
    /// Invalidate ETH.
    pub ieth: Option<IethRepr>,
}

impl ExtHeaders {
    /// The set of headers present (CNP's reserved block is not a header and never listed).
    pub fn present(&self) -> HeaderSet {
        let mut s = HeaderSet::empty();
        let pairs = [
            (self.deth.is_some(), HeaderSet::DETH),
            (self.reth.is_some(), HeaderSet::RETH),
            (self.atomic_eth.is_some(), HeaderSet::ATOMIC_ETH),
            (self.aeth.is_some(), HeaderSet::AETH),
            (self.atomic_ack_eth.is_some(), HeaderSet::ATOMIC_ACK_ETH),
            (self.immdt.is_some(), HeaderSet::IMMDT),
            (self.ieth.is_some(), HeaderSet::IETH),
        ];
        for (present, h) in pairs {
            if present {
                s = s.with(h);
            }
        }
        s
    }
}

/// The plain form of a transport packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketRepr {
    /// Base transport header. Its pad count must equal [`pad_for`]`(payload_len)`.
    pub bth: BthRepr,
    /// Extension headers.
    pub ext: ExtHeaders,
    /// Payload bytes, without pad.
    pub payload_len: usize,
}

impl PacketRepr {
    /// A packet with the given headers and payload length; sets the BTH pad count to match.
    pub fn new(mut bth: BthRepr, ext: ExtHeaders, payload_len: usize) -> PacketRepr {
        bth.pad_count = pad_for(payload_len);
        PacketRepr {
            bth,
            ext,
            payload_len,
        }
    }

    /// Reads a packet (validating it first).
    pub fn parse<T: AsRef<[u8]>>(p: &RocePacket<T>) -> Result<PacketRepr> {
        let info = p.checked_info()?;
        let b = p.as_bytes();
        let bth = BthRepr::parse(&p.bth())?;
        let mut cursor = HeaderCursor::new(info.headers);
        // `checked_info` made sure every header the opcode carries is there.
        let mut next = |which: HeaderSet| -> Result<Option<&[u8]>> {
            cursor
                .next(which)
                .map(|r| {
                    let needed = r.end;
                    b.get(r).ok_or(WireError::Truncated {
                        needed,
                        available: b.len(),
                    })
                })
                .transpose()
        };
        let ext = ExtHeaders {
            deth: next(HeaderSet::DETH)?
                .map(|h| DethRepr::parse(&Deth::new_unchecked(h)))
                .transpose()?,
            reth: next(HeaderSet::RETH)?
                .map(|h| RethRepr::parse(&Reth::new_unchecked(h)))
                .transpose()?,
            atomic_eth: next(HeaderSet::ATOMIC_ETH)?
                .map(|h| AtomicEthRepr::parse(&AtomicEth::new_unchecked(h)))
                .transpose()?,
            aeth: next(HeaderSet::AETH)?
                .map(|h| AethRepr::parse(&Aeth::new_unchecked(h)))
                .transpose()?,
            atomic_ack_eth: next(HeaderSet::ATOMIC_ACK_ETH)?
                .map(|h| AtomicAckEthRepr::parse(&AtomicAckEth::new_unchecked(h)))
                .transpose()?,
            immdt: next(HeaderSet::IMMDT)?
                .map(|h| ImmDtRepr::parse(&ImmDt::new_unchecked(h)))
                .transpose()?,
            ieth: next(HeaderSet::IETH)?
                .map(|h| IethRepr::parse(&Ieth::new_unchecked(h)))
                .transpose()?,
        };
        let headers_end = bth::LEN + info.headers.encoded_len();
        Ok(PacketRepr {
            payload_len: b
                .len()
                .saturating_sub(headers_end + ICRC_LEN + usize::from(bth.pad_count)),
            bth,
            ext,
        })
    }

    /// The opcode table's entry, or an error for an opcode ferroce does not speak.
    pub fn info(&self) -> Result<&'static OpcodeInfo> {
        self.bth
            .opcode
            .info()
            .ok_or(WireError::UnsupportedOpcode(self.bth.opcode.0))
    }

    /// Length of BTH plus extension headers.
    pub fn header_len(&self) -> Result<usize> {
        Ok(bth::LEN + self.info()?.headers.encoded_len())
    }

    /// Whole packet length: headers, payload, pad and ICRC.
    pub fn buffer_len(&self) -> Result<usize> {
        Ok(self.header_len()?
            + self.payload_len
            + usize::from(pad_for(self.payload_len))
            + ICRC_LEN)
    }

    /// Checks the headers match the opcode, the pad count matches the payload length, and an
    /// opcode without payload has none.
    pub fn validate(&self) -> Result<()> {
        self.validated_info().map(|_| ())
    }

    /// [`Self::validate`], returning the opcode's table entry.
    fn validated_info(&self) -> Result<&'static OpcodeInfo> {
        let info = self.info()?;
        // The CNP's reserved block is not an extension header: a CNP carries none.
        let mut expected = info.headers;
        if expected.contains(HeaderSet::CNP_RESERVED) {
            expected = HeaderSet::empty();
        }
        if self.ext.present() != expected {
            return Err(WireError::HeaderMismatch(self.bth.opcode.0));
        }
        if !info.has_payload && self.payload_len > 0 {
            return Err(WireError::UnexpectedPayload {
                opcode: self.bth.opcode.0,
                extra: self.payload_len,
            });
        }
        if self.bth.pad_count != pad_for(self.payload_len) {
            return Err(WireError::BadPadCount {
                pad: self.bth.pad_count,
                payload_len: self.payload_len,
            });
        }
        Ok(info)
    }

    /// Writes headers and pad into the first [`Self::buffer_len`] bytes of `buf`, leaving the
    /// payload bytes and the ICRC untouched. Returns the packet length.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let info = self.validated_info()?;
        let headers_end = bth::LEN + info.headers.encoded_len();
        let pad_start = headers_end + self.payload_len;
        let total = pad_start + usize::from(self.bth.pad_count) + ICRC_LEN;
        WireError::check_len(total, buf.len())?;
        let buf = &mut buf[..total];
        self.bth
            .emit(&mut Bth::new_unchecked(&mut buf[..bth::LEN]))?;
        // `validated_info` made sure the headers present are exactly the opcode's, and every
        // range lies before `headers_end`, inside `buf`.
        let mut cursor = HeaderCursor::new(info.headers);
        if let Some(r) = cursor.next(HeaderSet::DETH) {
            if let Some(h) = &self.ext.deth {
                h.emit(&mut Deth::new_unchecked(&mut buf[r]))?;
            }
        }
        if let Some(r) = cursor.next(HeaderSet::RETH) {
            if let Some(h) = &self.ext.reth {
                h.emit(&mut Reth::new_unchecked(&mut buf[r]))?;
            }
        }
        if let Some(r) = cursor.next(HeaderSet::ATOMIC_ETH) {
            if let Some(h) = &self.ext.atomic_eth {
                h.emit(&mut AtomicEth::new_unchecked(&mut buf[r]))?;
            }
        }
        if let Some(r) = cursor.next(HeaderSet::AETH) {
            if let Some(h) = &self.ext.aeth {
                h.emit(&mut Aeth::new_unchecked(&mut buf[r]))?;
            }
        }
        if let Some(r) = cursor.next(HeaderSet::ATOMIC_ACK_ETH) {
            if let Some(h) = &self.ext.atomic_ack_eth {
                h.emit(&mut AtomicAckEth::new_unchecked(&mut buf[r]))?;
            }
        }
        if let Some(r) = cursor.next(HeaderSet::IMMDT) {
            if let Some(h) = &self.ext.immdt {
                h.emit(&mut ImmDt::new_unchecked(&mut buf[r]))?;
            }
        }
        if let Some(r) = cursor.next(HeaderSet::IETH) {
            if let Some(h) = &self.ext.ieth {
                h.emit(&mut Ieth::new_unchecked(&mut buf[r]))?;
            }
        }
        if let Some(r) = cursor.next(HeaderSet::CNP_RESERVED) {
            buf[r].fill(0);
        }
        buf[pad_start..total - ICRC_LEN].fill(0);
        Ok(total)
    }
}

/// Reads the 16-byte CNP reserved block as two words, for printing; `None` if absent.
pub fn cnp_reserved<T: AsRef<[u8]>>(p: &RocePacket<T>) -> Option<(u64, u64)> {
    let off = header_offset(p.headers(), HeaderSet::CNP_RESERVED)?;
    let b = p.as_bytes().get(off..off + CNP_RESERVED_LEN)?;
    Some((field::read_u64(b, 0), field::read_u64(b, 8)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aeth::Syndrome;
    use crate::psn::Psn;

    fn bth(op: Opcode) -> BthRepr {
        BthRepr {
            opcode: op,
            solicited: false,
            migreq: false,
            pad_count: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qpn: 0x12,
            ack_req: true,
            psn: Psn::new(77),
        }
    }

    #[test]
    fn write_only_with_odd_payload() {
        let ext = ExtHeaders {
            reth: Some(RethRepr {
                va: 0x1000,
                rkey: 5,
                dma_len: 5,
            }),
            ..Default::default()
        };
        let repr = PacketRepr::new(bth(Opcode::RC_RDMA_WRITE_ONLY), ext, 5);
        assert_eq!(repr.bth.pad_count, 3);
        assert_eq!(repr.buffer_len().unwrap(), 12 + 16 + 5 + 3 + 4);
        let mut buf = vec![0xaa; repr.buffer_len().unwrap()];
        repr.emit(&mut buf).unwrap();
        let mut p = RocePacket::new_checked(&mut buf[..]).unwrap();
        p.payload_mut().copy_from_slice(b"hello");
        assert_eq!(p.payload(), b"hello");
        assert_eq!(&p.as_bytes()[33..36], &[0, 0, 0]);
        assert_eq!(PacketRepr::parse(&p).unwrap(), repr);
    }

    #[test]
    fn cnp_round_trips_with_becn_and_its_reserved_block() {
        // IBTA Annex A17.9.2: BTH (opcode 0x81, BECN set, PSN 0), 16 reserved bytes, ICRC.
        let mut b = bth(Opcode::CNP);
        b.becn = true;
        b.ack_req = false;
        b.psn = Psn::new(0);
        let repr = PacketRepr::new(b, ExtHeaders::default(), 0);
        assert_eq!(repr.buffer_len().unwrap(), 32);
        let mut buf = [0xaau8; 32];
        assert_eq!(repr.emit(&mut buf).unwrap(), 32);
        let expected_bth = [
            0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x00, 0x12, 0x00, 0, 0, 0,
        ];
        assert_eq!(&buf[..12], &expected_bth);
        assert_eq!(&buf[12..28], &[0u8; 16], "reserved block zeroed");
        assert_eq!(&buf[28..], &[0xaa; 4], "the ICRC is the caller's");
        let p = RocePacket::new_checked(&buf[..]).unwrap();
        assert_eq!(p.opcode(), Opcode::CNP);
        assert_eq!(PacketRepr::parse(&p).unwrap(), repr);
        assert_eq!(cnp_reserved(&p), Some((0, 0)));
        // A receiver ignores what a sender put in the reserved block.
        buf[12..28].fill(0x5a);
        let p = RocePacket::new_checked(&buf[..]).unwrap();
        assert_eq!(PacketRepr::parse(&p).unwrap(), repr);
        assert!(cnp_reserved(&p).is_some_and(|(a, b)| a != 0 && b != 0));
        // A CNP carries nothing else.
        let mut longer = buf.to_vec();
        longer.extend_from_slice(&[0; 4]);
        assert!(matches!(
            RocePacket::new_checked(&longer[..]),
            Err(WireError::UnexpectedPayload { .. })
        ));
        assert!(RocePacket::new_checked(&buf[..28]).is_err());
    }

    #[test]
    fn header_mismatch_and_bad_pad_are_errors() {
        let repr = PacketRepr::new(bth(Opcode::RC_RDMA_WRITE_ONLY), ExtHeaders::default(), 0);
        assert_eq!(
            repr.emit(&mut [0u8; 64]),
            Err(WireError::HeaderMismatch(0x0a))
        );
        let mut repr = PacketRepr::new(bth(Opcode::RC_SEND_ONLY), ExtHeaders::default(), 6);
        repr.bth.pad_count = 0;
        assert!(matches!(
            repr.emit(&mut [0u8; 64]),
            Err(WireError::BadPadCount { .. })
        ));
        let repr = PacketRepr::new(
            bth(Opcode::RC_ACKNOWLEDGE),
            ExtHeaders {
                aeth: Some(AethRepr {
                    syndrome: Syndrome::Ack { credits: 31 },
                    msn: 1,
                }),
                ..Default::default()
            },
            4,
        );
        assert!(matches!(
            repr.emit(&mut [0u8; 64]),
            Err(WireError::UnexpectedPayload { .. })
        ));
    }

    #[test]
    fn checks_reject_malformed() {
        // ACK with 4 stray bytes.
        let mut b = [0u8; 12 + 4 + 4 + 4];
        b[0] = 0x11;
        assert!(matches!(
            RocePacket::new_checked(&b[..]),
            Err(WireError::UnexpectedPayload { .. })
        ));
        // SEND_ONLY with a 3-byte body: misaligned.
        let mut b = [0u8; 12 + 3 + 4];
        b[0] = 0x04;
        assert!(matches!(
            RocePacket::new_checked(&b[..]),
            Err(WireError::Misaligned { .. })
        ));
        // Pad count 2 on an empty body.
        let mut b = [0u8; 12 + 4];
        b[0] = 0x04;
        b[1] = 0x20;
        assert!(matches!(
            RocePacket::new_checked(&b[..]),
            Err(WireError::Misaligned { .. })
        ));
        // Reserved opcode.
        let mut b = [0u8; 16];
        b[0] = 0x15;
        assert_eq!(
            RocePacket::new_checked(&b[..]),
            Err(WireError::UnsupportedOpcode(0x15))
        );
        // READ request cut inside its RETH.
        let mut b = [0u8; 12 + 10 + 4];
        b[0] = 0x0c;
        assert!(matches!(
            RocePacket::new_checked(&b[..]),
            Err(WireError::Truncated { .. })
        ));
    }
}
