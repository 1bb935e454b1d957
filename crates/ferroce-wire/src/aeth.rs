//! The ACK Extended Transport Header: the responder's verdict on a request.
//!
//! ```text
//!  0      syndrome: reserved(1) kind(2) value(5)
//!  1..4   MSN, the sequence number of the last message completed by the responder
//! ```
//!
//! The syndrome's two kind bits say ACK (value = credit count), RNR NAK (value = the minimum RNR
//! NAK timer code, see [`rnr_timer_micros`]) or NAK (value = [`NakCode`]).

use core::fmt;

use crate::field::{self, fixed_header_view};
use crate::{Result, WireError};

/// Encoded length of an AETH.
pub const LEN: usize = 4;

/// The credit count that means "no end-to-end flow control credits advertised" (rxe sends it).
pub const CREDITS_INVALID: u8 = 31;

fixed_header_view!(
    /// Zero-copy view of an AETH.
    Aeth,
    LEN
);

impl<T: AsRef<[u8]>> Aeth<T> {
    /// The raw syndrome byte.
    pub fn syndrome_byte(&self) -> u8 {
        self.buffer.as_ref()[0]
    }
    /// The decoded syndrome.
    pub fn syndrome(&self) -> Syndrome {
        Syndrome::from_byte(self.syndrome_byte())
    }
    /// Message sequence number (24 bits).
    pub fn msn(&self) -> u32 {
        field::read_u24(self.buffer.as_ref(), 1)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Aeth<T> {
    /// Sets the syndrome byte.
    pub fn set_syndrome(&mut self, s: Syndrome) {
        self.buffer.as_mut()[0] = s.to_byte();
    }
    /// Sets the MSN (low 24 bits).
    pub fn set_msn(&mut self, msn: u32) {
        field::write_u24(self.buffer.as_mut(), 1, msn);
    }
}

/// The NAK codes of the IBTA (syndrome kind 0b11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NakCode {
    /// A PSN ahead of the expected one arrived: resend from the expected PSN.
    PsnSequenceError,
    /// A request the responder cannot carry out (bad opcode sequence, length, unsupported op).
    InvalidRequest,
    /// R_Key, bounds or access-right violation.
    RemoteAccessError,
    /// The responder failed for a reason of its own.
    RemoteOperationalError,
    /// Invalid RD request (Reliable Datagram only).
    InvalidRdRequest,
    /// A code the IBTA reserves.
    Reserved(u8),
}

impl NakCode {
    /// The 5-bit code.
    pub const fn code(self) -> u8 {
        match self {
            NakCode::PsnSequenceError => 0,
            NakCode::InvalidRequest => 1,
            NakCode::RemoteAccessError => 2,
            NakCode::RemoteOperationalError => 3,
            NakCode::InvalidRdRequest => 4,
            NakCode::Reserved(c) => c & 0x1f,
        }
    }

    /// The code for 5 bits.
    pub const fn from_code(c: u8) -> NakCode {
        match c & 0x1f {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            3 => NakCode::RemoteOperationalError,
            4 => NakCode::InvalidRdRequest,
            c => NakCode::Reserved(c),
        }
    }

    /// Short name, as decoders print it.
    pub const fn name(self) -> &'static str {
        match self {
            NakCode::PsnSequenceError => "PSN_SEQUENCE_ERROR",
            NakCode::InvalidRequest => "INVALID_REQUEST",
            NakCode::RemoteAccessError => "REMOTE_ACCESS_ERROR",
            NakCode::RemoteOperationalError => "REMOTE_OPERATIONAL_ERROR",
            NakCode::InvalidRdRequest => "INVALID_RD_REQUEST",
            NakCode::Reserved(_) => "RESERVED",
        }
    }
}

/// A decoded AETH syndrome. Every byte maps to exactly one value and back, so re-emitting a
/// parsed AETH reproduces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement with an end-to-end credit count (31 = none advertised).
    Ack {
        /// Credit count code.
        credits: u8,
    },
    /// Receiver not ready: retry after the timer the code names.
    RnrNak {
        /// Minimum RNR NAK timer code (see [`rnr_timer_micros`]).
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
    /// Kind 0b10, which the IBTA reserves; the raw byte is kept.
    Reserved(u8),
}

impl Syndrome {
    /// Decodes a syndrome byte (the reserved top bit is ignored).
    pub const fn from_byte(b: u8) -> Syndrome {
        let value = b & 0x1f;
        match (b >> 5) & 0x3 {
            0 => Syndrome::Ack { credits: value },
            1 => Syndrome::RnrNak { timer: value },
            3 => Syndrome::Nak(NakCode::from_code(value)),
            _ => Syndrome::Reserved(value),
        }
    }

    /// Encodes the syndrome byte.
    pub const fn to_byte(self) -> u8 {
        match self {
            Syndrome::Ack { credits } => credits & 0x1f,
            Syndrome::RnrNak { timer } => 0x20 | (timer & 0x1f),
            Syndrome::Nak(code) => 0x60 | code.code(),
            Syndrome::Reserved(v) => 0x40 | (v & 0x1f),
        }
    }

    /// Whether this is a positive acknowledgement.
    pub const fn is_ack(self) -> bool {
        matches!(self, Syndrome::Ack { .. })
    }
}

impl fmt::Display for Syndrome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Syndrome::Ack { credits } => write!(f, "ACK(credits={credits})"),
            Syndrome::RnrNak { timer } => {
                write!(f, "RNR_NAK(timer={timer},{}us)", rnr_timer_micros(*timer))
            }
            Syndrome::Nak(code) => write!(f, "NAK({})", code.name()),
            Syndrome::Reserved(v) => write!(f, "RESERVED({v})"),
        }
    }
}

/// Minimum RNR NAK timer values in microseconds, indexed by the 5-bit timer code (IBTA
/// table 45). Code 0 is the longest, 655.36 ms.
pub const RNR_TIMER_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

/// The RNR delay, in microseconds, that a timer code asks for.
pub const fn rnr_timer_micros(code: u8) -> u32 {
    RNR_TIMER_MICROS[(code & 0x1f) as usize]
}

/// The fields of an AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AethRepr {
    /// Syndrome.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl AethRepr {
    /// Reads an AETH.
    pub fn parse<T: AsRef<[u8]>>(h: &Aeth<T>) -> Result<AethRepr> {
        h.check_len()?;
        Ok(AethRepr {
            syndrome: h.syndrome(),
            msn: h.msn(),
        })
    }
    /// Writes an AETH. Fails if the MSN does not fit 24 bits.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, h: &mut Aeth<T>) -> Result<()> {
        h.check_len()?;
        if self.msn > 0x00ff_ffff {
            return Err(WireError::FieldOverflow("MSN"));
        }
        h.set_syndrome(self.syndrome);
        h.set_msn(self.msn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syndromes_from_captures() {
        // 31 = ACK with invalid credits (every capture); 32 = RNR NAK timer 0 (rnr_nak_send_imm).
        assert_eq!(Syndrome::from_byte(31), Syndrome::Ack { credits: 31 });
        assert_eq!(Syndrome::from_byte(32), Syndrome::RnrNak { timer: 0 });
        assert_eq!(
            Syndrome::from_byte(0x60),
            Syndrome::Nak(NakCode::PsnSequenceError)
        );
        assert_eq!(
            Syndrome::from_byte(0x62),
            Syndrome::Nak(NakCode::RemoteAccessError)
        );
    }

    #[test]
    fn every_syndrome_byte_round_trips() {
        for b in 0u8..0x80 {
            assert_eq!(Syndrome::from_byte(b).to_byte(), b, "0x{b:02x}");
        }
    }

    #[test]
    fn aeth_round_trip() {
        let bytes = [0x1f, 0x00, 0x00, 0x01];
        let r = AethRepr::parse(&Aeth::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            AethRepr {
                syndrome: Syndrome::Ack { credits: 31 },
                msn: 1
            }
        );
        let mut out = [0u8; 4];
        r.emit(&mut Aeth::new_unchecked(&mut out[..])).unwrap();
        assert_eq!(out, bytes);
        assert!(Aeth::new_checked(&bytes[..3]).is_err());
    }

    #[test]
    fn rnr_table_endpoints() {
        assert_eq!(rnr_timer_micros(0), 655_360);
        assert_eq!(rnr_timer_micros(1), 10);
        assert_eq!(rnr_timer_micros(14), 1_280);
        assert_eq!(rnr_timer_micros(31), 491_520);
    }
}
