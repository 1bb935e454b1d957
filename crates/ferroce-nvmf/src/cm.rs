//! What rdma_cm carries when an NVMe/RDMA queue connects (NVMe-oF 1.1 §7.3.1): the host's
//! REQ private data names the queue and its sizes, the controller's REP private data its
//! receive queue size, and a REJ's private data the reason. 32 bytes each (a REJ's status is
//! in its first 4), little-endian, after rdma_cm's own IP header on the wire.

use crate::{le, need, WireError};

/// The only record format defined.
pub const RECFMT: u16 = 0;

/// The private data's length in a REQ and a REP.
pub const PRIVATE_LEN: usize = 32;

/// The host's request (REQ private data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmRequest {
    /// Record format.
    pub recfmt: u16,
    /// The queue (0: admin).
    pub qid: u16,
    /// Host receive queue size: the responses the host can take at once.
    pub hrqsize: u16,
    /// Host send queue size, 0's based: the commands it may have outstanding, less one.
    pub hsqsize: u16,
    /// The controller an I/O queue joins (NVMe-oF 1.1; 0 from older hosts).
    pub cntlid: u16,
}

impl CmRequest {
    /// Reads a REQ's private data (at least its first 10 bytes: older hosts send only those
    /// of the 1.0 layout plus padding).
    pub fn parse(b: &[u8]) -> Result<CmRequest, WireError> {
        need(b, 10, "NVMe/RDMA CM request")?;
        Ok(CmRequest {
            recfmt: le::u16_at(b, 0),
            qid: le::u16_at(b, 2),
            hrqsize: le::u16_at(b, 4),
            hsqsize: le::u16_at(b, 6),
            cntlid: le::u16_at(b, 8),
        })
    }

    /// The 32 bytes.
    pub fn encode(&self) -> [u8; PRIVATE_LEN] {
        let mut b = [0u8; PRIVATE_LEN];
        le::put_u16(&mut b, 0, self.recfmt);
        le::put_u16(&mut b, 2, self.qid);
        le::put_u16(&mut b, 4, self.hrqsize);
        le::put_u16(&mut b, 6, self.hsqsize);
        le::put_u16(&mut b, 8, self.cntlid);
        b
    }
}

/// The controller's accept (REP private data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmAccept {
    /// Record format.
    pub recfmt: u16,
    /// Controller receive queue size: the capsules it has posted receives for.
    pub crqsize: u16,
}

impl CmAccept {
    /// Reads a REP's private data.
    pub fn parse(b: &[u8]) -> Result<CmAccept, WireError> {
        need(b, 4, "NVMe/RDMA CM accept")?;
        Ok(CmAccept {
            recfmt: le::u16_at(b, 0),
            crqsize: le::u16_at(b, 2),
        })
    }

    /// The 32 bytes.
    pub fn encode(&self) -> [u8; PRIVATE_LEN] {
        let mut b = [0u8; PRIVATE_LEN];
        le::put_u16(&mut b, 0, self.recfmt);
        le::put_u16(&mut b, 2, self.crqsize);
        b
    }
}

/// Why a controller rejects a queue (a REJ's private data status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum CmRejectStatus {
    /// The record format is not one the controller knows.
    InvalidRecordFormat = 0x01,
    /// The queue ID is not valid (for the controller named).
    InvalidQueueId = 0x02,
    /// HSQSIZE is out of range.
    InvalidHsqsize = 0x03,
    /// HRQSIZE is out of range.
    InvalidHrqsize = 0x04,
    /// The controller has no resources for the queue.
    NoResources = 0x05,
    /// The initiator depth asked for is not supported.
    InvalidIrd = 0x06,
    /// The responder resources asked for are not supported.
    InvalidOrd = 0x07,
    /// The controller ID is not valid.
    InvalidCntlid = 0x08,
}

impl CmRejectStatus {
    /// The REJ's private data: record format and status.
    pub fn encode(self) -> [u8; 4] {
        let mut b = [0u8; 4];
        le::put_u16(&mut b, 0, RECFMT);
        le::put_u16(&mut b, 2, self as u16);
        b
    }

    /// Reads a REJ's private data status.
    pub fn parse(b: &[u8]) -> Result<CmRejectStatus, WireError> {
        need(b, 4, "NVMe/RDMA CM reject")?;
        use CmRejectStatus::*;
        Ok(match le::u16_at(b, 2) {
            0x01 => InvalidRecordFormat,
            0x02 => InvalidQueueId,
            0x03 => InvalidHsqsize,
            0x04 => InvalidHrqsize,
            0x05 => NoResources,
            0x06 => InvalidIrd,
            0x07 => InvalidOrd,
            0x08 => InvalidCntlid,
            v => {
                return Err(WireError::Invalid {
                    what: "NVMe/RDMA CM reject status",
                    value: u64::from(v),
                })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_linux_hosts_request_reads_as_its_fields() {
        // nvme-rdma's `nvme_rdma_route_resolved` for an I/O queue of 128 entries on
        // controller 1: recfmt 0, qid 3, hrqsize 128, hsqsize 127, cntlid 1.
        let b = [
            0, 0, 3, 0, 128, 0, 127, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0,
        ];
        let r = CmRequest::parse(&b).unwrap();
        assert_eq!(
            r,
            CmRequest {
                recfmt: 0,
                qid: 3,
                hrqsize: 128,
                hsqsize: 127,
                cntlid: 1
            }
        );
        assert_eq!(r.encode(), b);
        assert!(CmRequest::parse(&b[..9]).is_err());
    }

    #[test]
    fn accepts_and_rejects_round_trip() {
        let a = CmAccept {
            recfmt: 0,
            crqsize: 128,
        };
        assert_eq!(CmAccept::parse(&a.encode()).unwrap(), a);
        for s in [
            CmRejectStatus::InvalidQueueId,
            CmRejectStatus::InvalidCntlid,
        ] {
            assert_eq!(CmRejectStatus::parse(&s.encode()).unwrap(), s);
        }
        assert!(CmRejectStatus::parse(&[0, 0, 9, 0]).is_err());
    }
}
