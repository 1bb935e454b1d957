//! A response capsule's completion queue entry (NVMe base 2.0 §4.2.3): 16 bytes, and the
//! status codes this stack answers with. Over Fabrics the phase tag is not used (0) and the
//! submission queue head pointer tells the host how far the controller has read its queue.

use crate::{le, need, WireError};

/// A completion queue entry's size.
pub const CQE_LEN: usize = 16;

/// A command's status: its type (SCT), code (SC) and Do Not Retry bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status {
    /// Status code type: 0 generic, 1 command specific, 2 media and data integrity, 3 path.
    pub sct: u8,
    /// Status code.
    pub sc: u8,
    /// Do Not Retry: the same command would fail again.
    pub dnr: bool,
}

impl Status {
    /// Successful completion.
    pub const SUCCESS: Status = Status::generic(0x00, false);
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::generic(0x01, true);
    /// Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::generic(0x02, true);
    /// Data Transfer Error (a host buffer that could not be read or written: a bad key).
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04, false);
    /// Internal Error (the backing file failed).
    pub const INTERNAL_ERROR: Status = Status::generic(0x06, false);
    /// Command Aborted due to SQ Deletion (the queue went away under it).
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08, false);
    /// Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0B, true);
    /// Command Sequence Error (e.g. an I/O command before Connect).
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0C, true);
    /// Data SGL Length Invalid.
    pub const SGL_LENGTH_INVALID: Status = Status::generic(0x0F, true);
    /// SGL Descriptor Type Invalid.
    pub const SGL_TYPE_INVALID: Status = Status::generic(0x11, true);
    /// SGL Offset Invalid.
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16, true);
    /// Keep Alive Timer Expired.
    pub const KEEP_ALIVE_EXPIRED: Status = Status::generic(0x19, true);
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80, true);
    /// Namespace Not Ready.
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82, false);
    /// Connect: Incompatible Format (command specific).
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80);
    /// Connect: Controller Busy.
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::specific(0x81);
    /// Connect: Invalid Parameters.
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::specific(0x82);
    /// Connect: Invalid Host.
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84);
    /// Invalid Queue Size (Connect's SQSIZE; command specific 0x02 of Create I/O Queue).
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02);

    /// A generic status (SCT 0).
    pub const fn generic(sc: u8, dnr: bool) -> Status {
        Status { sct: 0, sc, dnr }
    }

    /// A command-specific status (SCT 1), never to be retried as is.
    pub const fn specific(sc: u8) -> Status {
        Status {
            sct: 1,
            sc,
            dnr: true,
        }
    }

    /// Whether the command succeeded.
    pub fn is_success(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// The status field's 16 bits (bit 0, the phase tag, 0).
    pub fn to_bits(self) -> u16 {
        u16::from(self.sc) << 1 | u16::from(self.sct & 0x7) << 9 | u16::from(self.dnr) << 15
    }

    /// The status of a status field's 16 bits.
    pub fn from_bits(v: u16) -> Status {
        Status {
            sct: ((v >> 9) & 0x7) as u8,
            sc: (v >> 1) as u8,
            dnr: v & 0x8000 != 0,
        }
    }
}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Command-specific result (Connect: the controller ID; Property Get: the value's low
    /// half; Set Features Number of Queues: the queues allocated).
    pub result: u64,
    /// How far the controller has consumed the submission queue.
    pub sq_head: u16,
    /// The submission queue's ID.
    pub sq_id: u16,
    /// The command's identifier.
    pub cid: u16,
    /// Its status.
    pub status: Status,
}

impl Completion {
    /// The entry's 16 bytes.
    pub fn encode(&self) -> [u8; CQE_LEN] {
        let mut b = [0u8; CQE_LEN];
        le::put_u64(&mut b, 0, self.result);
        le::put_u16(&mut b, 8, self.sq_head);
        le::put_u16(&mut b, 10, self.sq_id);
        le::put_u16(&mut b, 12, self.cid);
        le::put_u16(&mut b, 14, self.status.to_bits());
        b
    }

    /// Reads an entry.
    pub fn parse(b: &[u8]) -> Result<Completion, WireError> {
        need(b, CQE_LEN, "completion queue entry")?;
        Ok(Completion {
            result: le::u64_at(b, 0),
            sq_head: le::u16_at(b, 8),
            sq_id: le::u16_at(b, 10),
            cid: le::u16_at(b, 12),
            status: Status::from_bits(le::u16_at(b, 14)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_bits_are_where_the_specification_puts_them() {
        // LBA Out of Range with DNR: SC 0x80 in bits 8:1, SCT 0, DNR bit 15.
        assert_eq!(Status::LBA_OUT_OF_RANGE.to_bits(), 0x8100);
        // Connect Invalid Parameters: SCT 1 (bit 9), SC 0x82.
        assert_eq!(
            Status::CONNECT_INVALID_PARAMETERS.to_bits(),
            0x8000 | 0x200 | 0x104
        );
        for s in [
            Status::SUCCESS,
            Status::DATA_TRANSFER_ERROR,
            Status::CONNECT_INVALID_HOST,
        ] {
            assert_eq!(Status::from_bits(s.to_bits()), s);
        }
    }

    #[test]
    fn a_completion_round_trips() {
        let c = Completion {
            result: 0x1234,
            sq_head: 5,
            sq_id: 1,
            cid: 0xbeef,
            status: Status::INVALID_FIELD,
        };
        let b = c.encode();
        assert_eq!(&b[12..14], &0xbeefu16.to_le_bytes());
        assert_eq!(Completion::parse(&b).unwrap(), c);
        assert!(Completion::parse(&b[..15]).is_err());
    }
}
