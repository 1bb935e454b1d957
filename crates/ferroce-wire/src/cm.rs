//! Communication management (CM) messages, IBTA §12.6: how two queue pairs are connected over
//! QP1, as the Linux kernel's `ib_cm` and every RDMA NIC's firmware-less stack does it.
//!
//! Each message is the 232 bytes after a [`crate::mad`] header of class [`CLASS`] 0x07,
//! version 2, method Send; the attribute ID says which message. [`CmMad`] is a whole MAD
//! (header and message); [`CmMessage`] the message's fields. Bit fields are as IBTA numbers
//! them (most significant first), at the byte offsets below, relative to the message start.
//!
//! | message | key fields | private data |
//! |---|---|---|
//! | REQ 0x10 | comm ID, vendor ID (5..8), service ID (8), CA GUID (16), Q_Key (28), QPN (32), PSN (44), paths (52, 96) | 140..232 (92) |
//! | MRA 0x11 | comm IDs, message MRAed (8), service timeout (9) | 10..232 (222) |
//! | REJ 0x12 | comm IDs, message rejected (8), ARI length (9), reason (10), ARI (12..84) | 84..232 (148) |
//! | REP 0x13 | comm IDs, Q_Key (8), QPN (12), vendor ID (15, 19, 23), PSN (20), depths (24, 25), CA GUID (28) | 36..232 (196) |
//! | RTU 0x14 | comm IDs | 8..232 (224) |
//! | DREQ 0x15 | comm IDs, remote QPN (8) | 12..232 (220) |
//! | DREP 0x16 | comm IDs | 8..232 (224) |
//! | SIDR_REQ 0x17 | request ID, P_Key (4), service ID (8) | 16..232 (216) |
//! | SIDR_REP 0x18 | request ID, status (4), info length (5), vendor ID (6, 11), QPN (8), service ID (12), Q_Key (20), info (24..96) | 96..232 (136) |
//!
//! ECE (IBTA 1.4's enhanced connection establishment) travels as the kernel puts it: the
//! vendor ID in the REQ's and REP's vendor fields, the options in the MAD header's attribute
//! modifier ([`CmMad::attribute_modifier`]).
//!
//! A message owns its private data (a `Vec`, the whole field as received: the kernel hands a
//! consumer the full length, trailing zeros included). CM runs once per connection step, not
//! per data packet, so the allocation is not on any data path.
//! Parsing never panics: a MAD that is short, of another class or version, or of an attribute
//! this module does not know is an error; values are taken as they are (the connection
//! manager judges them).

use crate::field;
use crate::mad::{self, MadHeader, MadHeaderRepr};
use crate::{Result, WireError};

/// The management class of communication management.
pub const CLASS: u8 = 0x07;
/// The CM class version the kernel and ferroce speak.
pub const CLASS_VERSION: u8 = 2;
/// Bytes of a CM message after the MAD header.
pub const DATA_LEN: usize = mad::MAD_LEN - mad::LEN;

/// The attribute IDs of the CM messages.
pub mod attr {
    /// ConnectRequest.
    pub const REQ: u16 = 0x0010;
    /// MessageReceiptAcknowledgement.
    pub const MRA: u16 = 0x0011;
    /// ConnectReject.
    pub const REJ: u16 = 0x0012;
    /// ConnectReply.
    pub const REP: u16 = 0x0013;
    /// ReadyToUse.
    pub const RTU: u16 = 0x0014;
    /// DisconnectRequest.
    pub const DREQ: u16 = 0x0015;
    /// DisconnectReply.
    pub const DREP: u16 = 0x0016;
    /// ServiceIDResolutionRequest.
    pub const SIDR_REQ: u16 = 0x0017;
    /// ServiceIDResolutionResponse.
    pub const SIDR_REP: u16 = 0x0018;
}

/// Private data lengths of each message (the whole field).
pub mod private_len {
    /// REQ.
    pub const REQ: usize = 92;
    /// MRA.
    pub const MRA: usize = 222;
    /// REJ.
    pub const REJ: usize = 148;
    /// REP.
    pub const REP: usize = 196;
    /// RTU.
    pub const RTU: usize = 224;
    /// DREQ.
    pub const DREQ: usize = 220;
    /// DREP.
    pub const DREP: usize = 224;
    /// SIDR_REQ.
    pub const SIDR_REQ: usize = 216;
    /// SIDR_REP.
    pub const SIDR_REP: usize = 136;
}

/// ConnectReject reasons (IBTA Table 112) that ferroce sends or names.
pub mod rej_reason {
    /// No QP available.
    pub const NO_QP: u16 = 1;
    /// Out of resources.
    pub const NO_RESOURCES: u16 = 3;
    /// A REQ or REP was not answered in time.
    pub const TIMEOUT: u16 = 4;
    /// The REQ asks for what the receiver does not support.
    pub const UNSUPPORTED: u16 = 5;
    /// A message names a communication ID the receiver does not know.
    pub const INVALID_COMM_ID: u16 = 6;
    /// No one listens on the REQ's service ID.
    pub const INVALID_SERVICE_ID: u16 = 8;
    /// The REQ's transport type is not served.
    pub const INVALID_TRANSPORT_TYPE: u16 = 9;
    /// The REQ's QPN is already connected to the receiver (a stale connection).
    pub const STALE_CONNECTION: u16 = 10;
    /// The REQ's path MTU is not supported.
    pub const INVALID_MTU: u16 = 26;
    /// The consumer rejected the request (`rdma_reject`).
    pub const CONSUMER_DEFINED: u16 = 28;
}

/// The message a REJ or MRA is about (2 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// The REQ.
    Req,
    /// The REP.
    Rep,
    /// Another (LAP for an MRA, none named for a REJ).
    Other,
}

impl MessageKind {
    fn from_bits(b: u8) -> MessageKind {
        match b & 3 {
            0 => MessageKind::Req,
            1 => MessageKind::Rep,
            _ => MessageKind::Other,
        }
    }
    fn bits(self) -> u8 {
        match self {
            MessageKind::Req => 0,
            MessageKind::Rep => 1,
            MessageKind::Other => 2,
        }
    }
}

/// A path as a REQ describes it (44 bytes: primary at 52, alternate at 96).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CmPath {
    /// The sender's LID (0xFFFF, permissive, on RoCE).
    pub local_lid: u16,
    /// The receiver's LID.
    pub remote_lid: u16,
    /// The sender's GID.
    pub local_gid: [u8; 16],
    /// The receiver's GID.
    pub remote_gid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Packet rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Whether the path stays in one subnet.
    pub subnet_local: bool,
    /// The sender's local ACK timeout (5 bits).
    pub local_ack_timeout: u8,
}

impl CmPath {
    const LEN: usize = 44;

    fn parse(b: &[u8]) -> CmPath {
        let mut local_gid = [0u8; 16];
        local_gid.copy_from_slice(&b[4..20]);
        let mut remote_gid = [0u8; 16];
        remote_gid.copy_from_slice(&b[20..36]);
        let w = field::read_u32(b, 36);
        CmPath {
            local_lid: field::read_u16(b, 0),
            remote_lid: field::read_u16(b, 2),
            local_gid,
            remote_gid,
            flow_label: w >> 12,
            packet_rate: (w & 0x3f) as u8,
            traffic_class: b[40],
            hop_limit: b[41],
            sl: b[42] >> 4,
            subnet_local: b[42] & 0x08 != 0,
            local_ack_timeout: b[43] >> 3,
        }
    }

    fn emit(&self, b: &mut [u8]) -> Result<()> {
        check(self.flow_label, 20, "flow label")?;
        check(self.packet_rate.into(), 6, "packet rate")?;
        check(self.sl.into(), 4, "service level")?;
        check(self.local_ack_timeout.into(), 5, "local ACK timeout")?;
        field::write_u16(b, 0, self.local_lid);
        field::write_u16(b, 2, self.remote_lid);
        b[4..20].copy_from_slice(&self.local_gid);
        b[20..36].copy_from_slice(&self.remote_gid);
        field::write_u32(b, 36, self.flow_label << 12 | u32::from(self.packet_rate));
        b[40] = self.traffic_class;
        b[41] = self.hop_limit;
        b[42] = self.sl << 4 | u8::from(self.subnet_local) << 3;
        b[43] = self.local_ack_timeout << 3;
        Ok(())
    }
}

/// ConnectRequest: the active side's QP and what it asks of the passive side's.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Req {
    /// The sender's communication ID for this connection.
    pub local_comm_id: u32,
    /// ECE vendor ID (24 bits; 0 for none).
    pub vendor_id: u32,
    /// The service the sender connects to (rdma_cm: port space and port).
    pub service_id: u64,
    /// The sender's CA GUID.
    pub local_ca_guid: u64,
    /// The sender's Q_Key (UD-like transports; 0 for RC).
    pub local_qkey: u32,
    /// The sender's QPN (24 bits).
    pub local_qpn: u32,
    /// READ/atomic requests the sender will serve at once.
    pub responder_resources: u8,
    /// The sender's EE context (RD only).
    pub local_eecn: u32,
    /// READ/atomic requests the sender will have outstanding.
    pub initiator_depth: u8,
    /// The receiver's EE context (RD only).
    pub remote_eecn: u32,
    /// How long the receiver may take to answer: 4.096 µs × 2^value (5 bits).
    pub remote_cm_response_timeout: u8,
    /// Transport service type (2 bits): 0 RC, 1 UC, 3 with an extended type.
    pub transport_type: u8,
    /// End-to-end flow control.
    pub end_to_end_flow_control: bool,
    /// Starting PSN (24 bits). Linux's CM fills it with the PSN the sender's QP expects to
    /// receive first, from which the receiver sends (`rping_rdmacm.pcap`: the passive side
    /// sends from the REQ's, the active side from the REP's).
    pub starting_psn: u32,
    /// How long the sender takes to answer (5 bits).
    pub local_cm_response_timeout: u8,
    /// Transport retry count (3 bits).
    pub retry_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Path MTU as IBTA encodes it (1 = 256 … 5 = 4096; 4 bits).
    pub path_mtu: u8,
    /// RD only.
    pub rdc_exists: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// How many times the sender retries a CM message (4 bits).
    pub max_cm_retries: u8,
    /// Whether the sender's QP takes receives from an SRQ.
    pub srq: bool,
    /// Extended transport type (3 bits; 1 = XRC).
    pub extended_transport_type: u8,
    /// The primary path.
    pub primary_path: CmPath,
    /// The alternate path (all zero when there is none).
    pub alternate_path: CmPath,
    /// Private data (at most 92 bytes; rdma_cm puts its IP header first).
    pub private_data: Vec<u8>,
}

/// ConnectReply: the passive side's QP.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rep {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The REQ's sender's communication ID.
    pub remote_comm_id: u32,
    /// The sender's Q_Key.
    pub local_qkey: u32,
    /// The sender's QPN (24 bits).
    pub local_qpn: u32,
    /// ECE vendor ID (24 bits).
    pub vendor_id: u32,
    /// The sender's EE context (RD only).
    pub local_eecn: u32,
    /// Starting PSN (24 bits): as in [`Req::starting_psn`], the one the sender expects first.
    pub starting_psn: u32,
    /// READ/atomic requests the sender will serve at once.
    pub responder_resources: u8,
    /// READ/atomic requests the sender will have outstanding.
    pub initiator_depth: u8,
    /// Target ACK delay (5 bits).
    pub target_ack_delay: u8,
    /// Failover accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-end flow control.
    pub end_to_end_flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// Whether the sender's QP takes receives from an SRQ.
    pub srq: bool,
    /// The sender's CA GUID.
    pub local_ca_guid: u64,
    /// Private data (at most 196 bytes).
    pub private_data: Vec<u8>,
}

/// A message that names both communication IDs and carries only private data besides (RTU,
/// DREP).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CommIds {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID.
    pub remote_comm_id: u32,
    /// Private data (at most 224 bytes).
    pub private_data: Vec<u8>,
}

/// ConnectReject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rej {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID (0 when the REJ answers a REQ never accepted).
    pub remote_comm_id: u32,
    /// Which message is rejected.
    pub message_rejected: MessageKind,
    /// Why ([`rej_reason`]).
    pub reason: u16,
    /// Additional rejection information (at most 72 bytes).
    pub ari: Vec<u8>,
    /// Private data (at most 148 bytes).
    pub private_data: Vec<u8>,
}

/// MessageReceiptAcknowledgement: "your message arrived, the answer will take longer".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mra {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID.
    pub remote_comm_id: u32,
    /// Which message is acknowledged.
    pub message_mraed: MessageKind,
    /// How much longer the answer may take: 4.096 µs × 2^value (5 bits).
    pub service_timeout: u8,
    /// Private data (at most 222 bytes).
    pub private_data: Vec<u8>,
}

/// DisconnectRequest.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Dreq {
    /// The sender's communication ID.
    pub local_comm_id: u32,
    /// The receiver's communication ID.
    pub remote_comm_id: u32,
    /// The receiver's QPN (24 bits).
    pub remote_qpn: u32,
    /// Private data (at most 220 bytes).
    pub private_data: Vec<u8>,
}

/// ServiceIDResolutionRequest: which UD QP serves a service.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SidrReq {
    /// The sender's request ID.
    pub request_id: u32,
    /// Partition key.
    pub pkey: u16,
    /// The service asked about.
    pub service_id: u64,
    /// Private data (at most 216 bytes; rdma_cm puts its IP header first).
    pub private_data: Vec<u8>,
}

/// ServiceIDResolutionResponse.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SidrRep {
    /// The request's ID.
    pub request_id: u32,
    /// 0 = the QP is valid; 1 = no service; 2 = rejected; 3 = no QP; 4 = redirect; 5 = bad
    /// class version.
    pub status: u8,
    /// ECE vendor ID (24 bits).
    pub vendor_id: u32,
    /// The QPN serving the service (24 bits).
    pub qpn: u32,
    /// The service.
    pub service_id: u64,
    /// The serving QP's Q_Key.
    pub qkey: u32,
    /// Additional information (at most 72 bytes).
    pub additional_info: Vec<u8>,
    /// Private data (at most 136 bytes).
    pub private_data: Vec<u8>,
}

/// A CM message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmMessage {
    /// ConnectRequest.
    Req(Req),
    /// MessageReceiptAcknowledgement.
    Mra(Mra),
    /// ConnectReject.
    Rej(Rej),
    /// ConnectReply.
    Rep(Rep),
    /// ReadyToUse.
    Rtu(CommIds),
    /// DisconnectRequest.
    Dreq(Dreq),
    /// DisconnectReply.
    Drep(CommIds),
    /// ServiceIDResolutionRequest.
    SidrReq(SidrReq),
    /// ServiceIDResolutionResponse.
    SidrRep(SidrRep),
}

/// A whole CM MAD: the header's transaction ID and attribute modifier, and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmMad {
    /// Transaction ID: a REP, RTU, REJ or MRA carries the REQ's; a DREP the DREQ's.
    pub transaction_id: u64,
    /// Attribute modifier: ECE options in a REQ or REP, otherwise 0.
    pub attribute_modifier: u32,
    /// The message.
    pub message: CmMessage,
}

fn check(value: u32, bits: u32, what: &'static str) -> Result<()> {
    if value >> bits != 0 {
        Err(WireError::FieldOverflow(what))
    } else {
        Ok(())
    }
}

fn put_private(b: &mut [u8], at: usize, len: usize, data: &[u8], what: &'static str) -> Result<()> {
    if data.len() > len {
        return Err(WireError::FieldOverflow(what));
    }
    b[at..at + data.len()].copy_from_slice(data);
    Ok(())
}

impl CmMessage {
    /// The attribute ID that names this message.
    pub fn attribute_id(&self) -> u16 {
        match self {
            CmMessage::Req(_) => attr::REQ,
            CmMessage::Mra(_) => attr::MRA,
            CmMessage::Rej(_) => attr::REJ,
            CmMessage::Rep(_) => attr::REP,
            CmMessage::Rtu(_) => attr::RTU,
            CmMessage::Dreq(_) => attr::DREQ,
            CmMessage::Drep(_) => attr::DREP,
            CmMessage::SidrReq(_) => attr::SIDR_REQ,
            CmMessage::SidrRep(_) => attr::SIDR_REP,
        }
    }

    /// Reads the message of attribute `attribute_id` from the 232 bytes after the header.
    pub fn parse(attribute_id: u16, b: &[u8]) -> Result<CmMessage> {
        WireError::check_len(DATA_LEN, b.len())?;
        let b = &b[..DATA_LEN];
        let ids = (field::read_u32(b, 0), field::read_u32(b, 4));
        Ok(match attribute_id {
            attr::REQ => CmMessage::Req(Req {
                local_comm_id: ids.0,
                vendor_id: field::read_u24(b, 5),
                service_id: field::read_u64(b, 8),
                local_ca_guid: field::read_u64(b, 16),
                local_qkey: field::read_u32(b, 28),
                local_qpn: field::read_u24(b, 32),
                responder_resources: b[35],
                local_eecn: field::read_u24(b, 36),
                initiator_depth: b[39],
                remote_eecn: field::read_u24(b, 40),
                remote_cm_response_timeout: b[43] >> 3,
                transport_type: (b[43] >> 1) & 3,
                end_to_end_flow_control: b[43] & 1 != 0,
                starting_psn: field::read_u24(b, 44),
                local_cm_response_timeout: b[47] >> 3,
                retry_count: b[47] & 7,
                pkey: field::read_u16(b, 48),
                path_mtu: b[50] >> 4,
                rdc_exists: b[50] & 0x08 != 0,
                rnr_retry_count: b[50] & 7,
                max_cm_retries: b[51] >> 4,
                srq: b[51] & 0x08 != 0,
                extended_transport_type: b[51] & 7,
                primary_path: CmPath::parse(&b[52..52 + CmPath::LEN]),
                alternate_path: CmPath::parse(&b[96..96 + CmPath::LEN]),
                private_data: b[140..].to_vec(),
            }),
            attr::MRA => CmMessage::Mra(Mra {
                local_comm_id: ids.0,
                remote_comm_id: ids.1,
                message_mraed: MessageKind::from_bits(b[8] >> 6),
                service_timeout: b[9] >> 3,
                private_data: b[10..].to_vec(),
            }),
            attr::REJ => {
                let ari_len = usize::from(b[9] >> 1).min(72);
                CmMessage::Rej(Rej {
                    local_comm_id: ids.0,
                    remote_comm_id: ids.1,
                    message_rejected: MessageKind::from_bits(b[8] >> 6),
                    reason: field::read_u16(b, 10),
                    ari: b[12..12 + ari_len].to_vec(),
                    private_data: b[84..].to_vec(),
                })
            }
            attr::REP => CmMessage::Rep(Rep {
                local_comm_id: ids.0,
                remote_comm_id: ids.1,
                local_qkey: field::read_u32(b, 8),
                local_qpn: field::read_u24(b, 12),
                vendor_id: u32::from(b[15]) << 16 | u32::from(b[19]) << 8 | u32::from(b[23]),
                local_eecn: field::read_u24(b, 16),
                starting_psn: field::read_u24(b, 20),
                responder_resources: b[24],
                initiator_depth: b[25],
                target_ack_delay: b[26] >> 3,
                failover_accepted: (b[26] >> 1) & 3,
                end_to_end_flow_control: b[26] & 1 != 0,
                rnr_retry_count: b[27] >> 5,
                srq: b[27] & 0x10 != 0,
                local_ca_guid: field::read_u64(b, 28),
                private_data: b[36..].to_vec(),
            }),
            attr::RTU | attr::DREP => {
                let m = CommIds {
                    local_comm_id: ids.0,
                    remote_comm_id: ids.1,
                    private_data: b[8..].to_vec(),
                };
                if attribute_id == attr::RTU {
                    CmMessage::Rtu(m)
                } else {
                    CmMessage::Drep(m)
                }
            }
            attr::DREQ => CmMessage::Dreq(Dreq {
                local_comm_id: ids.0,
                remote_comm_id: ids.1,
                remote_qpn: field::read_u24(b, 8),
                private_data: b[12..].to_vec(),
            }),
            attr::SIDR_REQ => CmMessage::SidrReq(SidrReq {
                request_id: ids.0,
                pkey: field::read_u16(b, 4),
                service_id: field::read_u64(b, 8),
                private_data: b[16..].to_vec(),
            }),
            attr::SIDR_REP => {
                let info_len = usize::from(b[5]).min(72);
                CmMessage::SidrRep(SidrRep {
                    request_id: ids.0,
                    status: b[4],
                    vendor_id: u32::from(field::read_u16(b, 6)) << 8 | u32::from(b[11]),
                    qpn: field::read_u24(b, 8),
                    service_id: field::read_u64(b, 12),
                    qkey: field::read_u32(b, 20),
                    additional_info: b[24..24 + info_len].to_vec(),
                    private_data: b[96..].to_vec(),
                })
            }
            _ => return Err(WireError::NotCm("unknown CM attribute")),
        })
    }

    /// Writes the message into the 232 bytes after the header (every reserved bit zero, the
    /// private data padded with zeros). Fails when a value does not fit its field.
    pub fn emit(&self, out: &mut [u8]) -> Result<()> {
        WireError::check_len(DATA_LEN, out.len())?;
        let b = &mut out[..DATA_LEN];
        b.fill(0);
        let ids = |b: &mut [u8], local: u32, remote: u32| {
            field::write_u32(b, 0, local);
            field::write_u32(b, 4, remote);
        };
        match self {
            CmMessage::Req(m) => {
                check(m.vendor_id, 24, "vendor ID")?;
                check(m.local_qpn, 24, "local QPN")?;
                check(m.local_eecn, 24, "local EECN")?;
                check(m.remote_eecn, 24, "remote EECN")?;
                check(
                    m.remote_cm_response_timeout.into(),
                    5,
                    "remote CM response timeout",
                )?;
                check(m.transport_type.into(), 2, "transport service type")?;
                check(m.starting_psn, 24, "starting PSN")?;
                check(
                    m.local_cm_response_timeout.into(),
                    5,
                    "local CM response timeout",
                )?;
                check(m.retry_count.into(), 3, "retry count")?;
                check(m.path_mtu.into(), 4, "path MTU")?;
                check(m.rnr_retry_count.into(), 3, "RNR retry count")?;
                check(m.max_cm_retries.into(), 4, "max CM retries")?;
                check(
                    m.extended_transport_type.into(),
                    3,
                    "extended transport type",
                )?;
                field::write_u32(b, 0, m.local_comm_id);
                field::write_u24(b, 5, m.vendor_id);
                field::write_u64(b, 8, m.service_id);
                field::write_u64(b, 16, m.local_ca_guid);
                field::write_u32(b, 28, m.local_qkey);
                field::write_u24(b, 32, m.local_qpn);
                b[35] = m.responder_resources;
                field::write_u24(b, 36, m.local_eecn);
                b[39] = m.initiator_depth;
                field::write_u24(b, 40, m.remote_eecn);
                b[43] = m.remote_cm_response_timeout << 3
                    | m.transport_type << 1
                    | u8::from(m.end_to_end_flow_control);
                field::write_u24(b, 44, m.starting_psn);
                b[47] = m.local_cm_response_timeout << 3 | m.retry_count;
                field::write_u16(b, 48, m.pkey);
                b[50] = m.path_mtu << 4 | u8::from(m.rdc_exists) << 3 | m.rnr_retry_count;
                b[51] = m.max_cm_retries << 4 | u8::from(m.srq) << 3 | m.extended_transport_type;
                m.primary_path.emit(&mut b[52..96])?;
                m.alternate_path.emit(&mut b[96..140])?;
                put_private(
                    b,
                    140,
                    private_len::REQ,
                    &m.private_data,
                    "REQ private data",
                )?;
            }
            CmMessage::Mra(m) => {
                check(m.service_timeout.into(), 5, "service timeout")?;
                ids(b, m.local_comm_id, m.remote_comm_id);
                b[8] = m.message_mraed.bits() << 6;
                b[9] = m.service_timeout << 3;
                put_private(b, 10, private_len::MRA, &m.private_data, "MRA private data")?;
            }
            CmMessage::Rej(m) => {
                if m.ari.len() > 72 {
                    return Err(WireError::FieldOverflow("REJ additional information"));
                }
                ids(b, m.local_comm_id, m.remote_comm_id);
                b[8] = m.message_rejected.bits() << 6;
                b[9] = (m.ari.len() as u8) << 1;
                field::write_u16(b, 10, m.reason);
                b[12..12 + m.ari.len()].copy_from_slice(&m.ari);
                put_private(b, 84, private_len::REJ, &m.private_data, "REJ private data")?;
            }
            CmMessage::Rep(m) => {
                check(m.local_qpn, 24, "local QPN")?;
                check(m.vendor_id, 24, "vendor ID")?;
                check(m.local_eecn, 24, "local EECN")?;
                check(m.starting_psn, 24, "starting PSN")?;
                check(m.target_ack_delay.into(), 5, "target ACK delay")?;
                check(m.failover_accepted.into(), 2, "failover accepted")?;
                check(m.rnr_retry_count.into(), 3, "RNR retry count")?;
                ids(b, m.local_comm_id, m.remote_comm_id);
                field::write_u32(b, 8, m.local_qkey);
                field::write_u24(b, 12, m.local_qpn);
                b[15] = (m.vendor_id >> 16) as u8;
                field::write_u24(b, 16, m.local_eecn);
                b[19] = (m.vendor_id >> 8) as u8;
                field::write_u24(b, 20, m.starting_psn);
                b[23] = m.vendor_id as u8;
                b[24] = m.responder_resources;
                b[25] = m.initiator_depth;
                b[26] = m.target_ack_delay << 3
                    | m.failover_accepted << 1
                    | u8::from(m.end_to_end_flow_control);
                b[27] = m.rnr_retry_count << 5 | u8::from(m.srq) << 4;
                field::write_u64(b, 28, m.local_ca_guid);
                put_private(b, 36, private_len::REP, &m.private_data, "REP private data")?;
            }
            CmMessage::Rtu(m) | CmMessage::Drep(m) => {
                ids(b, m.local_comm_id, m.remote_comm_id);
                put_private(b, 8, private_len::RTU, &m.private_data, "private data")?;
            }
            CmMessage::Dreq(m) => {
                check(m.remote_qpn, 24, "remote QPN")?;
                ids(b, m.local_comm_id, m.remote_comm_id);
                field::write_u24(b, 8, m.remote_qpn);
                put_private(
                    b,
                    12,
                    private_len::DREQ,
                    &m.private_data,
                    "DREQ private data",
                )?;
            }
            CmMessage::SidrReq(m) => {
                field::write_u32(b, 0, m.request_id);
                field::write_u16(b, 4, m.pkey);
                field::write_u64(b, 8, m.service_id);
                put_private(
                    b,
                    16,
                    private_len::SIDR_REQ,
                    &m.private_data,
                    "SIDR_REQ private data",
                )?;
            }
            CmMessage::SidrRep(m) => {
                check(m.vendor_id, 24, "vendor ID")?;
                check(m.qpn, 24, "QPN")?;
                if m.additional_info.len() > 72 {
                    return Err(WireError::FieldOverflow("SIDR_REP additional information"));
                }
                field::write_u32(b, 0, m.request_id);
                b[4] = m.status;
                b[5] = m.additional_info.len() as u8;
                field::write_u16(b, 6, (m.vendor_id >> 8) as u16);
                field::write_u24(b, 8, m.qpn);
                b[11] = m.vendor_id as u8;
                field::write_u64(b, 12, m.service_id);
                field::write_u32(b, 20, m.qkey);
                b[24..24 + m.additional_info.len()].copy_from_slice(&m.additional_info);
                put_private(
                    b,
                    96,
                    private_len::SIDR_REP,
                    &m.private_data,
                    "SIDR_REP private data",
                )?;
            }
        }
        Ok(())
    }
}

impl CmMad {
    /// Reads a CM MAD (at least 256 bytes: a UD payload; more is ignored).
    pub fn parse(bytes: &[u8]) -> Result<CmMad> {
        WireError::check_len(mad::MAD_LEN, bytes.len())?;
        let header = MadHeaderRepr::parse(&MadHeader::new_checked(&bytes[..mad::LEN])?)?;
        if header.mgmt_class != CLASS {
            return Err(WireError::NotCm("management class is not CM (0x07)"));
        }
        if header.class_version != CLASS_VERSION {
            return Err(WireError::NotCm("CM class version is not 2"));
        }
        if header.method != mad::METHOD_SEND {
            return Err(WireError::NotCm("CM method is not Send"));
        }
        Ok(CmMad {
            transaction_id: header.transaction_id,
            attribute_modifier: header.attribute_modifier,
            message: CmMessage::parse(header.attribute_id, &bytes[mad::LEN..mad::MAD_LEN])?,
        })
    }

    /// Writes the whole MAD into the first 256 bytes of `out`.
    pub fn emit(&self, out: &mut [u8]) -> Result<()> {
        WireError::check_len(mad::MAD_LEN, out.len())?;
        let header = MadHeaderRepr {
            mgmt_class: CLASS,
            class_version: CLASS_VERSION,
            method: mad::METHOD_SEND,
            status: 0,
            class_specific: 0,
            transaction_id: self.transaction_id,
            attribute_id: self.message.attribute_id(),
            attribute_modifier: self.attribute_modifier,
        };
        header.emit(&mut MadHeader::new_unchecked(&mut out[..mad::LEN]))?;
        self.message.emit(&mut out[mad::LEN..mad::MAD_LEN])
    }

    /// The MAD as 256 bytes.
    pub fn to_bytes(&self) -> Result<[u8; mad::MAD_LEN]> {
        let mut out = [0u8; mad::MAD_LEN];
        self.emit(&mut out)?;
        Ok(out)
    }
}
