//! Selective acknowledgements between selective-repeat peers.
//!
//! With selective repeat (see [`crate::reorder`]) the responder keeps the packets that arrive
//! after a gap, and an IBTA sequence-error NAK can name only one gap: the expected PSN. With a
//! few losses in a window the requester then learns of them one round trip after another, and a
//! resend that is itself lost is only found by the retransmission timer. A SACK tells the
//! requester everything the responder holds at once, as TCP's SACK option and IRN's selective
//! acknowledgements do, so every hole is resent in the same round trip and a lost resend is
//! found by the next SACK.
//!
//! On the wire a SACK is a packet of ferroce's manufacturer-specific opcode
//! [`Opcode::FERROCE_SACK`] (0xC0; IBTA reserves 0xC0–0xFF for manufacturers): the BTH of an ACK
//! (PSN: the last PSN received in order, so `PSN + 1` is the responder's expected PSN), an ACK's
//! AETH (MSN, credits invalid), and as payload a bitmap: bit `i % 8` of byte `i / 8` set when the
//! packet `PSN + 2 + i` is kept, `PSN + 1` being the gap itself. The bitmap is at most
//! [`SACK_BITMAP_BYTES`] long (the reorder buffer's reach) and cut after its last non-zero
//! word. It is sent only to a peer that negotiated selective repeat (ECE, the connection
//! exchange), which never sends it to anyone else either; a QP without selective repeat drops
//! one as of a foreign transport (`dropped_bad_state`). IBTA-conformant peers never see one.
//!
//! The responder owes a SACK whenever it keeps a packet after a gap, or is sent again one it
//! already keeps (a resend or a tail-loss probe that needs the news). The requester takes the
//! cumulative part as an ACK and queues each hole below the highest kept PSN for one resend
//! (see the requester's selective resends): at most [`MAX_HOLES_PER_SACK`] per SACK, the rest
//! being named again by the next.

use ferroce_wire::aeth::{AethRepr, Syndrome, CREDITS_INVALID};
use ferroce_wire::{ExtHeaders, Opcode, Psn};

use crate::emit::{self, Bth};
use crate::qp::Params;
use crate::reorder::REORDER_CAPACITY;

/// Longest bitmap a SACK carries: one bit per PSN the reorder buffer can keep.
pub const SACK_BITMAP_BYTES: usize = REORDER_CAPACITY as usize / 8;

/// Most holes one SACK queues for a resend: a bound on the work a (possibly lying) peer's SACK
/// can cause.
pub const MAX_HOLES_PER_SACK: usize = 64;

/// Writes a SACK to the peer into `buf`: `expected` is the responder's expected PSN, `msn` its
/// MSN, and `bitmap` the kept PSNs from `expected + 1` on (bit `i`: `expected + 1 + i`), already
/// cut to its length (a multiple of 4 bytes). Returns the packet's length, ICRC left zero, or
/// `None` if `buf` is too small.
pub(crate) fn emit(
    buf: &mut [u8],
    p: &Params,
    expected: Psn,
    msn: u32,
    bitmap: &[u8],
) -> Option<usize> {
    let ext = ExtHeaders {
        aeth: Some(AethRepr {
            syndrome: Syndrome::Ack {
                credits: CREDITS_INVALID,
            },
            msn,
        }),
        ..Default::default()
    };
    let bth = Bth::plain(Opcode::FERROCE_SACK, expected.sub(1));
    let (start, total) = emit::headers(buf, p, bth, ext, bitmap.len())?;
    buf[start..start + bitmap.len()].copy_from_slice(bitmap);
    Some(total)
}

/// The PSNs a SACK reports missing, oldest first: the expected PSN (`last_in_order + 1`) and
/// every PSN after it below the highest one the bitmap marks kept whose bit is clear. Nothing
/// when the bitmap marks nothing (a plain acknowledgement).
pub fn holes(last_in_order: Psn, bitmap: &[u8]) -> impl Iterator<Item = Psn> + '_ {
    let bitmap = &bitmap[..bitmap.len().min(SACK_BITMAP_BYTES)];
    let highest = bitmap
        .iter()
        .enumerate()
        .rev()
        .find(|(_, b)| **b != 0)
        .map(|(i, b)| i * 8 + 7 - b.leading_zeros() as usize);
    let expected = last_in_order.next();
    let gap = highest.map(|_| expected);
    let later = (0..highest.unwrap_or(0))
        .filter(move |&i| bitmap[i / 8] & (1 << (i % 8)) == 0)
        .map(move |i| expected.add(1 + i as u32));
    gap.into_iter().chain(later)
}

/// Cuts a bitmap of [`SACK_BITMAP_BYTES`] to what a SACK carries: up to its last non-zero
/// 4-byte word (packet payloads are padded to 4 bytes; nothing kept gives an empty bitmap).
pub fn trimmed(bitmap: &[u8; SACK_BITMAP_BYTES]) -> &[u8] {
    let used = bitmap.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    &bitmap[..used.div_ceil(4) * 4]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holes_are_the_gap_and_the_clear_bits_below_the_highest_kept() {
        let last = Psn::new(0xff_fffe);
        let mut map = [0u8; SACK_BITMAP_BYTES];
        // Kept: expected+1, +2, +5 and +17 (bits 0, 1, 4, 16); across the 24-bit wrap.
        for bit in [0, 1, 4, 16] {
            map[bit / 8] |= 1 << (bit % 8);
        }
        let t = trimmed(&map);
        assert_eq!(t.len(), 4);
        let e = last.next();
        let got: Vec<Psn> = holes(last, t).collect();
        let mut want = vec![e, e.add(3), e.add(4)];
        want.extend((6..17).map(|k| e.add(k)));
        assert_eq!(got, want);
    }

    #[test]
    fn an_empty_bitmap_reports_nothing() {
        let map = [0u8; SACK_BITMAP_BYTES];
        assert!(trimmed(&map).is_empty());
        assert_eq!(holes(Psn::new(7), &[]).count(), 0);
        assert_eq!(holes(Psn::new(7), &[0, 0, 0, 0]).count(), 0);
    }

    #[test]
    fn a_bitmap_longer_than_the_reach_is_read_only_up_to_it() {
        let mut long = vec![0u8; SACK_BITMAP_BYTES + 64];
        long[SACK_BITMAP_BYTES + 3] = 0xff;
        assert_eq!(holes(Psn::new(1), &long).count(), 0);
        let mut full = [0xffu8; SACK_BITMAP_BYTES];
        assert_eq!(holes(Psn::new(1), &full).collect::<Vec<_>>(), [Psn::new(2)]);
        full[0] = 0xfe;
        let h: Vec<Psn> = holes(Psn::new(1), &full).collect();
        assert_eq!(h, [Psn::new(2), Psn::new(3)]);
    }
}
