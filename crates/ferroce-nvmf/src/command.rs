//! A command capsule's submission queue entry (NVMe base 2.0 §4.2, NVMe-oF 1.1 §2.2): 64
//! bytes, little-endian, the same for admin, I/O and Fabrics commands. Over RDMA the data
//! pointer is always one SGL descriptor (PSDT 01b); the capsule's in-capsule data, if any,
//! follows the entry.

use crate::sgl::Sgl;
use crate::{le, need, WireError};

/// A submission queue entry's size.
pub const SQE_LEN: usize = 64;

/// The Fabrics command opcode; the command's type is then in byte 4 ([`crate::fabrics`]).
pub const OPC_FABRICS: u8 = 0x7F;

/// Admin command opcodes a Linux host uses.
pub mod admin {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0A;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// NVM command set I/O opcodes.
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// Which way a command's data goes, from its opcode's two low bits (NVMe base 2.0 §5: the
/// opcode says it, for every command set and for Fabrics command types alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// No data.
    None,
    /// From the host to the controller (a Write; Connect's data).
    HostToController,
    /// From the controller to the host (a Read; Identify).
    ControllerToHost,
    /// Both (bidirectional: not used over Fabrics).
    Both,
}

impl Direction {
    /// The direction an opcode (or Fabrics command type) names.
    pub fn of(opcode: u8) -> Direction {
        match opcode & 0x3 {
            0 => Direction::None,
            1 => Direction::HostToController,
            2 => Direction::ControllerToHost,
            _ => Direction::Both,
        }
    }
}

/// A submission queue entry, read from a capsule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Command {
    /// The opcode.
    pub opcode: u8,
    /// Byte 1: fused operation (bits 1:0) and PSDT (bits 7:6).
    pub flags: u8,
    /// The command identifier, which the completion echoes.
    pub cid: u16,
    /// The namespace (for a Fabrics command, bytes 4..8 hold its type instead).
    pub nsid: u32,
    /// Command dwords 2 and 3.
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// The data pointer (bytes 24..40), unparsed: [`Command::sgl`] reads it.
    pub dptr: [u8; 16],
    /// Command dwords 10 to 15.
    pub cdw: [u32; 6],
}

impl Command {
    /// Reads the first 64 bytes of a capsule.
    pub fn parse(b: &[u8]) -> Result<Command, WireError> {
        need(b, SQE_LEN, "submission queue entry")?;
        let mut cdw = [0u32; 6];
        for (i, d) in cdw.iter_mut().enumerate() {
            *d = le::u32_at(b, 40 + 4 * i);
        }
        Ok(Command {
            opcode: b[0],
            flags: b[1],
            cid: le::u16_at(b, 2),
            nsid: le::u32_at(b, 4),
            cdw2: le::u32_at(b, 8),
            cdw3: le::u32_at(b, 12),
            dptr: b[24..40].try_into().expect("16 bytes"),
            cdw,
        })
    }

    /// The entry's 64 bytes.
    pub fn encode(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        b[0] = self.opcode;
        b[1] = self.flags;
        le::put_u16(&mut b, 2, self.cid);
        le::put_u32(&mut b, 4, self.nsid);
        le::put_u32(&mut b, 8, self.cdw2);
        le::put_u32(&mut b, 12, self.cdw3);
        b[24..40].copy_from_slice(&self.dptr);
        for (i, d) in self.cdw.iter().enumerate() {
            le::put_u32(&mut b, 40 + 4 * i, *d);
        }
        b
    }

    /// A command with `opcode`, `cid` and `nsid`, its data pointer `sgl` (PSDT set to SGL)
    /// and the other fields 0.
    pub fn new(opcode: u8, cid: u16, nsid: u32, sgl: Sgl) -> Result<Command, WireError> {
        let mut dptr = [0u8; 16];
        sgl.write(&mut dptr)?;
        Ok(Command {
            opcode,
            flags: PSDT_SGL << 6,
            cid,
            nsid,
            cdw2: 0,
            cdw3: 0,
            dptr,
            cdw: [0; 6],
        })
    }

    /// Command dword `n` (10..=15).
    pub fn cdw(&self, n: usize) -> u32 {
        self.cdw[n - 10]
    }

    /// The data pointer as an SGL descriptor. A command that says PRPs (PSDT 00b) is refused:
    /// NVMe over Fabrics takes SGLs only (NVMe-oF 1.1 §2.2).
    pub fn sgl(&self) -> Result<Sgl, WireError> {
        let psdt = self.flags >> 6;
        if psdt != PSDT_SGL {
            return Err(WireError::Invalid {
                what: "PSDT",
                value: u64::from(psdt),
            });
        }
        Sgl::parse(&self.dptr)
    }

    /// The starting LBA of a Read, Write or Write Zeroes (CDW10 and CDW11).
    pub fn slba(&self) -> u64 {
        u64::from(self.cdw(10)) | u64::from(self.cdw(11)) << 32
    }

    /// The number of logical blocks of a Read, Write or Write Zeroes (CDW12 bits 15:0, 0's
    /// based: the count is one more).
    pub fn nlb(&self) -> u32 {
        (self.cdw(12) & 0xFFFF) + 1
    }

    /// The direction of the command's data.
    pub fn direction(&self) -> Direction {
        if self.opcode == OPC_FABRICS {
            Direction::of(self.nsid as u8)
        } else {
            Direction::of(self.opcode)
        }
    }
}

/// PSDT 01b: the data pointer is an SGL descriptor (with a byte-aligned buffer).
pub const PSDT_SGL: u8 = 0b01;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_command_round_trips_and_says_its_blocks() {
        let mut c = Command::new(
            io::READ,
            7,
            1,
            Sgl::Keyed {
                addr: 0x1000,
                len: 8192,
                key: 0xabc,
                invalidate: false,
            },
        )
        .unwrap();
        c.cdw[0] = 0x0000_0010; // SLBA low
        c.cdw[1] = 0x0000_0001; // SLBA high
        c.cdw[2] = 15; // 16 blocks
        let b = c.encode();
        assert_eq!(b[0], 0x02);
        assert_eq!(b[1] >> 6, 1);
        let back = Command::parse(&b).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.slba(), 0x1_0000_0010);
        assert_eq!(back.nlb(), 16);
        assert_eq!(back.direction(), Direction::ControllerToHost);
        assert_eq!(back.sgl().unwrap().len(), 8192);
    }

    #[test]
    fn directions_come_from_the_opcode() {
        assert_eq!(Direction::of(io::WRITE), Direction::HostToController);
        assert_eq!(Direction::of(io::READ), Direction::ControllerToHost);
        assert_eq!(Direction::of(io::FLUSH), Direction::None);
        assert_eq!(Direction::of(admin::IDENTIFY), Direction::ControllerToHost);
        assert_eq!(
            Direction::of(admin::SET_FEATURES),
            Direction::HostToController
        );
    }

    #[test]
    fn prps_and_short_capsules_are_refused() {
        let mut c = Command::new(io::READ, 1, 1, Sgl::InCapsule { offset: 0, len: 0 }).unwrap();
        c.flags = 0;
        assert!(c.sgl().is_err());
        assert!(Command::parse(&[0u8; 63]).is_err());
    }
}
