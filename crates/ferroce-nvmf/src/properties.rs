//! A controller's properties (NVMe base 2.0 §3.1.4): the registers a PCIe host maps, read and
//! written over Fabrics with Property Get and Set. The host enables the controller (CC.EN),
//! waits for CSTS.RDY, and at the end asks for a shutdown (CC.SHN) and waits for CSTS.SHST.

use crate::completion::Status;

/// Controller Capabilities.
pub const CAP: u32 = 0x00;
/// Version.
pub const VS: u32 = 0x08;
/// Controller Configuration.
pub const CC: u32 = 0x14;
/// Controller Status.
pub const CSTS: u32 = 0x1C;

/// The version this controller reports: NVMe 1.3 (what the kernel's target reports for an
/// RDMA port, and what every Linux host takes).
pub const VERSION: u32 = 0x0001_0300;

/// The registers of one controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registers {
    /// CAP, fixed.
    pub cap: u64,
    /// CC, as the host last set it.
    pub cc: u32,
    /// CSTS.
    pub csts: u32,
}

impl Registers {
    /// A controller whose queues hold at most `max_queue_entries` entries, disabled.
    pub fn new(max_queue_entries: u16) -> Registers {
        let mqes = u64::from(max_queue_entries.max(2) - 1);
        // CQR (contiguous queues required), TO 15 (7.5 s to become ready), CSS bit 37: the
        // NVM command set; MPSMIN = MPSMAX = 0 (4 KiB pages).
        let cap = mqes | 1 << 16 | 15 << 24 | 1 << 37;
        Registers {
            cap,
            cc: 0,
            csts: 0,
        }
    }

    /// Whether the host has enabled the controller and it is ready.
    pub fn ready(&self) -> bool {
        self.csts & 1 != 0
    }

    /// Property Get: the value at `offset` (`eight` bytes or four).
    pub fn get(&self, offset: u32, eight: bool) -> Result<u64, Status> {
        match (offset, eight) {
            (CAP, true) => Ok(self.cap),
            (CAP, false) => Ok(self.cap & 0xFFFF_FFFF),
            (VS, false) => Ok(u64::from(VERSION)),
            (CC, false) => Ok(u64::from(self.cc)),
            (CSTS, false) => Ok(u64::from(self.csts)),
            _ => Err(Status::INVALID_FIELD),
        }
    }

    /// Property Set: only CC is writable. Enabling makes the controller ready (if the queue
    /// entry sizes are the only ones NVMe defines: 64-byte submissions, 16-byte
    /// completions); disabling resets it; a shutdown request completes at once (nothing here
    /// is cached).
    pub fn set(&mut self, offset: u32, eight: bool, value: u64) -> Result<(), Status> {
        if offset != CC || eight {
            return Err(Status::INVALID_FIELD);
        }
        let cc = value as u32;
        let enable = cc & 1 != 0;
        let was = self.cc & 1 != 0;
        if enable && !was {
            let iosqes = (cc >> 16) & 0xF;
            let iocqes = (cc >> 20) & 0xF;
            if iosqes == 6 && iocqes == 4 {
                self.csts |= 1;
            } else {
                // CFS: the host asked for what cannot be.
                self.csts |= 1 << 1;
            }
        } else if !enable && was {
            self.csts = 0;
        }
        let shn = (cc >> 14) & 0x3;
        if shn != 0 {
            // SHST = 10b: shutdown processing complete.
            self.csts = (self.csts & !(0x3 << 2)) | 0b10 << 2;
        } else {
            self.csts &= !(0x3 << 2);
        }
        self.cc = cc;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_linux_hosts_enable_and_shutdown() {
        let mut r = Registers::new(128);
        assert_eq!(r.get(CAP, true).unwrap() & 0xFFFF, 127);
        assert_eq!(r.get(VS, false).unwrap(), 0x10300);
        assert!(!r.ready());
        // nvme_enable_ctrl: IOCQES 4, IOSQES 6, AMS 0, MPS 0, CSS 0, EN.
        r.set(CC, false, 4 << 20 | 6 << 16 | 1).unwrap();
        assert!(r.ready());
        assert_eq!(r.get(CSTS, false).unwrap() & 1, 1);
        // nvme_shutdown_ctrl: SHN normal (01b).
        r.set(CC, false, 4 << 20 | 6 << 16 | 1 << 14 | 1).unwrap();
        assert_eq!((r.get(CSTS, false).unwrap() >> 2) & 3, 0b10);
        r.set(CC, false, 0).unwrap();
        assert!(!r.ready());
    }

    #[test]
    fn odd_sizes_offsets_and_entry_sizes_are_refused() {
        let mut r = Registers::new(32);
        assert_eq!(r.get(0x40, false), Err(Status::INVALID_FIELD));
        assert_eq!(r.get(VS, true), Err(Status::INVALID_FIELD));
        assert_eq!(r.set(CAP, true, 0), Err(Status::INVALID_FIELD));
        r.set(CC, false, 1).unwrap();
        assert!(!r.ready());
        assert_eq!(r.get(CSTS, false).unwrap() & 2, 2);
    }
}
