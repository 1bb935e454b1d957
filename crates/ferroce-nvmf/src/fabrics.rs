//! Fabrics commands (NVMe-oF 1.1 §3): opcode 0x7F, the command type in byte 4. Connect makes
//! a queue part of a controller (the admin queue creates the controller; an I/O queue joins
//! the one its controller ID names); Property Get and Set read and write the controller's
//! registers (CAP, VS, CC, CSTS), which a PCIe host would map.

use crate::command::{Command, OPC_FABRICS};
use crate::sgl::Sgl;
use crate::{le, need, WireError};

/// Fabrics command types.
pub mod fctype {
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Authentication Send.
    pub const AUTH_SEND: u8 = 0x05;
    /// Authentication Receive.
    pub const AUTH_RECEIVE: u8 = 0x06;
    /// Disconnect (NVMe-oF 1.1 for I/O queues).
    pub const DISCONNECT: u8 = 0x08;
}

/// The controller ID a host asks for in an admin queue's Connect under the dynamic model: any.
pub const CNTLID_DYNAMIC: u16 = 0xFFFF;

/// The length of Connect's data.
pub const CONNECT_DATA_LEN: usize = 1024;

/// The NVMe Qualified Names' field length in Connect's data.
const NQN_FIELD: usize = 256;

/// A Fabrics command's type (byte 4 of its entry).
pub fn fctype_of(c: &Command) -> Option<u8> {
    (c.opcode == OPC_FABRICS).then_some(c.nsid as u8)
}

/// A Connect command's fields (NVMe-oF 1.1 §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connect {
    /// Record format: 0.
    pub recfmt: u16,
    /// The queue: 0 for the admin queue.
    pub qid: u16,
    /// The submission queue's size, 0's based.
    pub sqsize: u16,
    /// Connect attributes (priority class, SQ flow control disable: bit 2).
    pub cattr: u8,
    /// Keep Alive Timeout in ms (admin queue only; 0: none).
    pub kato: u32,
}

impl Connect {
    /// Reads a Connect command's fields.
    pub fn parse(c: &Command) -> Result<Connect, WireError> {
        if fctype_of(c) != Some(fctype::CONNECT) {
            return Err(WireError::Invalid {
                what: "Connect's command type",
                value: u64::from(c.nsid as u8),
            });
        }
        let b = c.encode();
        Ok(Connect {
            recfmt: le::u16_at(&b, 40),
            qid: le::u16_at(&b, 42),
            sqsize: le::u16_at(&b, 44),
            cattr: b[46],
            kato: le::u32_at(&b, 48),
        })
    }

    /// The Connect command with these fields, its data (1024 bytes) at `sgl`.
    pub fn command(&self, cid: u16, sgl: Sgl) -> Result<Command, WireError> {
        let mut c = Command::new(OPC_FABRICS, cid, u32::from(fctype::CONNECT), sgl)?;
        let mut b = c.encode();
        le::put_u16(&mut b, 40, self.recfmt);
        le::put_u16(&mut b, 42, self.qid);
        le::put_u16(&mut b, 44, self.sqsize);
        b[46] = self.cattr;
        le::put_u32(&mut b, 48, self.kato);
        c = Command::parse(&b)?;
        Ok(c)
    }
}

/// Connect's data: who connects to what (NVMe-oF 1.1 Figure 20).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectData {
    /// The host's identifier.
    pub host_id: [u8; 16],
    /// The controller to join ([`CNTLID_DYNAMIC`] for a new one on the admin queue).
    pub cntlid: u16,
    /// The subsystem's NQN.
    pub subnqn: String,
    /// The host's NQN.
    pub hostnqn: String,
}

impl ConnectData {
    /// Reads Connect's data. The NQNs are NUL-terminated UTF-8 within their 256-byte fields;
    /// one that is not, or fills its field without a NUL, is refused (Connect Invalid
    /// Parameters).
    pub fn parse(b: &[u8]) -> Result<ConnectData, WireError> {
        need(b, CONNECT_DATA_LEN, "Connect data")?;
        let nqn = |at: usize, what: &'static str| -> Result<String, WireError> {
            let field = &b[at..at + NQN_FIELD];
            let end = field
                .iter()
                .position(|&c| c == 0)
                .ok_or(WireError::Invalid {
                    what,
                    value: NQN_FIELD as u64,
                })?;
            String::from_utf8(field[..end].to_vec()).map_err(|_| WireError::Invalid {
                what,
                value: end as u64,
            })
        };
        Ok(ConnectData {
            host_id: b[0..16].try_into().expect("16 bytes"),
            cntlid: le::u16_at(b, 16),
            subnqn: nqn(256, "SUBNQN")?,
            hostnqn: nqn(512, "HOSTNQN")?,
        })
    }

    /// The 1024 bytes. An NQN longer than 255 bytes is refused.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut b = vec![0u8; CONNECT_DATA_LEN];
        b[0..16].copy_from_slice(&self.host_id);
        le::put_u16(&mut b, 16, self.cntlid);
        for (at, s, what) in [
            (256, &self.subnqn, "SUBNQN"),
            (512, &self.hostnqn, "HOSTNQN"),
        ] {
            if s.len() >= NQN_FIELD {
                return Err(WireError::Invalid {
                    what,
                    value: s.len() as u64,
                });
            }
            b[at..at + s.len()].copy_from_slice(s.as_bytes());
        }
        Ok(b)
    }
}

/// A Property Get or Set (NVMe-oF 1.1 §3.4, §3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Property {
    /// The register's offset (CAP 0x00, VS 0x08, CC 0x14, CSTS 0x1C).
    pub offset: u32,
    /// Its size: 8 bytes, or 4.
    pub eight_bytes: bool,
    /// The value to set (Property Set).
    pub value: u64,
}

impl Property {
    /// Reads a Property Get or Set command's fields.
    pub fn parse(c: &Command) -> Result<Property, WireError> {
        let b = c.encode();
        let attrib = b[40] & 0x7;
        if attrib > 1 {
            return Err(WireError::Invalid {
                what: "property size",
                value: u64::from(attrib),
            });
        }
        Ok(Property {
            offset: le::u32_at(&b, 44),
            eight_bytes: attrib == 1,
            value: le::u64_at(&b, 48),
        })
    }

    /// The Property Get (`set` false) or Set command for these fields.
    pub fn command(&self, cid: u16, set: bool) -> Result<Command, WireError> {
        let t = if set {
            fctype::PROPERTY_SET
        } else {
            fctype::PROPERTY_GET
        };
        let c = Command::new(
            OPC_FABRICS,
            cid,
            u32::from(t),
            Sgl::InCapsule { offset: 0, len: 0 },
        )?;
        let mut b = c.encode();
        b[40] = u8::from(self.eight_bytes);
        le::put_u32(&mut b, 44, self.offset);
        if set {
            le::put_u64(&mut b, 48, self.value);
        }
        Command::parse(&b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Direction;

    #[test]
    fn a_connect_round_trips_with_its_data() {
        let conn = Connect {
            recfmt: 0,
            qid: 0,
            sqsize: 31,
            cattr: 0,
            kato: 5000,
        };
        let c = conn
            .command(
                1,
                Sgl::InCapsule {
                    offset: 0,
                    len: 1024,
                },
            )
            .unwrap();
        assert_eq!(c.encode()[4], fctype::CONNECT);
        assert_eq!(c.direction(), Direction::HostToController);
        assert_eq!(Connect::parse(&c).unwrap(), conn);
        let d = ConnectData {
            host_id: [7; 16],
            cntlid: CNTLID_DYNAMIC,
            subnqn: "nqn.2026-11.io.ferroce:test".into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427".into(),
        };
        let b = d.encode().unwrap();
        assert_eq!(&b[16..18], &[0xFF, 0xFF]);
        assert_eq!(ConnectData::parse(&b).unwrap(), d);
    }

    #[test]
    fn an_nqn_without_its_nul_or_not_utf8_is_refused() {
        let mut b = ConnectData {
            host_id: [0; 16],
            cntlid: 1,
            subnqn: "a".into(),
            hostnqn: "b".into(),
        }
        .encode()
        .unwrap();
        b[256..512].fill(b'x');
        assert!(ConnectData::parse(&b).is_err());
        b[256] = 0xFF;
        b[257] = 0;
        assert!(ConnectData::parse(&b).is_err());
        assert!(ConnectData::parse(&b[..1023]).is_err());
    }

    #[test]
    fn properties_round_trip_and_bad_sizes_are_refused() {
        let p = Property {
            offset: 0x14,
            eight_bytes: false,
            value: 0x46_0001,
        };
        let c = p.command(9, true).unwrap();
        assert_eq!(fctype_of(&c), Some(fctype::PROPERTY_SET));
        assert_eq!(Property::parse(&c).unwrap(), p);
        let mut b = c.encode();
        b[40] = 2;
        assert!(Property::parse(&Command::parse(&b).unwrap()).is_err());
    }
}
