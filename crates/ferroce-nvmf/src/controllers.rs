//! A target's controllers (NVMe-oF 1.1 §3.3, dynamic controller model): an admin queue's
//! Connect creates a controller of the subsystem it names (or of the discovery subsystem), and
//! I/O queues join it by its ID; admin commands run against that controller's state; a
//! controller whose host stops sending Keep Alive for its timeout is ended, which the transport
//! answers by closing its queues. Sans-IO: the caller passes the time and moves the data.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::command::{admin, Command};
use crate::completion::Status;
use crate::discovery;
use crate::fabrics::{fctype, fctype_of, Connect, ConnectData, Property, CNTLID_DYNAMIC};
use crate::identify::{self, cns, ControllerInfo};
use crate::io::Response;
use crate::namespace::Namespace;
use crate::properties::Registers;

/// A subsystem: its NQN and namespaces.
pub struct Subsystem {
    /// Its NQN.
    pub nqn: String,
    /// Its serial number (Identify Controller).
    pub serial: String,
    /// Its namespaces, by ID.
    pub namespaces: BTreeMap<u32, Arc<Namespace>>,
}

impl Subsystem {
    /// The namespace `nsid`, if it exists.
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.namespaces.get(&nsid).map(|n| &**n)
    }
}

/// How a target is set up.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    /// The most entries a queue may have.
    pub max_queue_entries: u16,
    /// The most I/O queues a controller may have.
    pub max_io_queues: u16,
    /// The in-capsule data the transport takes after a command, in bytes.
    pub in_capsule_data: u32,
    /// The largest transfer, as a power of two of 4 KiB (MDTS).
    pub mdts: u8,
    /// What the discovery log lists for each subsystem: address, service and IPv6 or not.
    pub listen: (String, String, bool),
}

/// A queue's place after its Connect: the controller it belongs to.
#[derive(Clone)]
pub struct QueueBinding {
    /// The controller's ID.
    pub cntlid: u16,
    /// The queue's ID (0: admin).
    pub qid: u16,
    /// Its submission queue size (entries).
    pub sq_entries: u16,
    /// The controller's subsystem (None: the discovery controller).
    pub subsystem: Option<Arc<Subsystem>>,
}

/// What an admin command led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Answer now.
    Respond(Response),
    /// An Asynchronous Event Request: held until an event (or the controller's end, when it
    /// completes as aborted).
    Held,
}

struct Controller {
    subsystem: Option<Arc<Subsystem>>,
    host_id: [u8; 16],
    hostnqn: String,
    regs: Registers,
    kato: Duration,
    last_keep_alive: Instant,
    io_queues: u16,
    features: BTreeMap<u8, u32>,
    held_events: Vec<u16>,
}

/// The controllers of a target.
pub struct Target {
    config: TargetConfig,
    subsystems: Vec<Arc<Subsystem>>,
    controllers: BTreeMap<u16, Controller>,
    next_cntlid: u16,
}

/// Feature identifiers.
mod fid {
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
}

/// Asynchronous Event Request Limit Exceeded.
const AER_LIMIT_EXCEEDED: Status = Status::specific(0x05);
/// Held Asynchronous Event Requests per controller (AERL + 1).
const AER_LIMIT: usize = 4;

/// Where a Connect's invalid parameter is (the response's IATTR bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InvalidIn {
    /// The command (its submission queue entry).
    Command,
    /// The Connect data.
    Data,
}

/// Byte offsets a Connect Invalid Parameters response names: in the command...
const SQE_QID: u16 = 42;
const SQE_SQSIZE: u16 = 44;
/// ...and in its data.
const DATA_HOSTID: u16 = 0;
const DATA_CNTLID: u16 = 16;
const DATA_SUBNQN: u16 = 256;
const DATA_HOSTNQN: u16 = 512;

/// Connect Invalid Parameters naming the parameter (NVMe-oF 1.1, the Connect response: IATTR
/// in bit 16 and the offset in bits 15:0 of its first dword), which a Linux host prints
/// ("Connect Invalid Data Parameter, subsysnqn").
fn invalid_parameter(inside: InvalidIn, offset: u16) -> Response {
    Response {
        result: u64::from(inside == InvalidIn::Data) << 16 | u64::from(offset),
        ..Response::fail(Status::CONNECT_INVALID_PARAMETERS)
    }
}

impl Target {
    /// A target serving `subsystems`.
    pub fn new(config: TargetConfig, subsystems: Vec<Subsystem>) -> Target {
        Target {
            config,
            subsystems: subsystems.into_iter().map(Arc::new).collect(),
            controllers: BTreeMap::new(),
            next_cntlid: 1,
        }
    }

    /// The live controllers' IDs.
    pub fn controllers(&self) -> Vec<u16> {
        self.controllers.keys().copied().collect()
    }

    /// A Connect on a new queue: the admin queue's makes a controller, an I/O queue's joins
    /// one. `Err` carries the response the host gets (the queue stays unbound).
    pub fn connect(
        &mut self,
        now: Instant,
        cmd: &Command,
        data: &[u8],
    ) -> Result<(QueueBinding, Response), Response> {
        let c = Connect::parse(cmd).map_err(|_| Response::fail(Status::INVALID_FIELD))?;
        if c.recfmt != 0 {
            return Err(Response::fail(Status::CONNECT_INCOMPATIBLE_FORMAT));
        }
        let d = ConnectData::parse(data).map_err(|_| invalid_parameter(InvalidIn::Data, 0))?;
        let entries = u32::from(c.sqsize) + 1;
        if c.sqsize == 0 || entries > u32::from(self.config.max_queue_entries) {
            return Err(invalid_parameter(InvalidIn::Command, SQE_SQSIZE));
        }
        let sq_entries = entries as u16;
        if c.qid == 0 {
            if d.cntlid != CNTLID_DYNAMIC {
                return Err(invalid_parameter(InvalidIn::Data, DATA_CNTLID));
            }
            let subsystem = if d.subnqn == discovery::DISCOVERY_NQN {
                None
            } else {
                Some(
                    self.subsystems
                        .iter()
                        .find(|s| s.nqn == d.subnqn)
                        .cloned()
                        .ok_or_else(|| invalid_parameter(InvalidIn::Data, DATA_SUBNQN))?,
                )
            };
            let Some(cntlid) = self.free_cntlid() else {
                return Err(Response::fail(Status::CONNECT_CONTROLLER_BUSY));
            };
            self.controllers.insert(
                cntlid,
                Controller {
                    subsystem: subsystem.clone(),
                    host_id: d.host_id,
                    hostnqn: d.hostnqn,
                    regs: Registers::new(self.config.max_queue_entries),
                    kato: Duration::from_millis(u64::from(c.kato)),
                    last_keep_alive: now,
                    io_queues: 0,
                    features: BTreeMap::new(),
                    held_events: Vec::new(),
                },
            );
            let b = QueueBinding {
                cntlid,
                qid: 0,
                sq_entries,
                subsystem,
            };
            return Ok((b, Response::ok(u64::from(cntlid), Vec::new())));
        }
        let Some(ctrl) = self.controllers.get(&d.cntlid) else {
            return Err(invalid_parameter(InvalidIn::Data, DATA_CNTLID));
        };
        let same_subsystem = match &ctrl.subsystem {
            Some(s) => s.nqn == d.subnqn,
            None => false,
        };
        if !same_subsystem {
            return Err(invalid_parameter(InvalidIn::Data, DATA_SUBNQN));
        }
        if ctrl.host_id != d.host_id {
            return Err(invalid_parameter(InvalidIn::Data, DATA_HOSTID));
        }
        if ctrl.hostnqn != d.hostnqn {
            return Err(invalid_parameter(InvalidIn::Data, DATA_HOSTNQN));
        }
        if !ctrl.regs.ready() {
            return Err(Response::fail(Status::COMMAND_SEQUENCE_ERROR));
        }
        if c.qid > ctrl.io_queues.max(1) || c.qid > self.config.max_io_queues {
            return Err(invalid_parameter(InvalidIn::Command, SQE_QID));
        }
        let b = QueueBinding {
            cntlid: d.cntlid,
            qid: c.qid,
            sq_entries,
            subsystem: ctrl.subsystem.clone(),
        };
        Ok((b, Response::ok(u64::from(d.cntlid), Vec::new())))
    }

    fn free_cntlid(&mut self) -> Option<u16> {
        // IDs 1..=0xFFEF (the rest are reserved).
        for _ in 0..0xFFEF {
            let id = self.next_cntlid;
            self.next_cntlid = if id >= 0xFFEF { 1 } else { id + 1 };
            if !self.controllers.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    /// Ends a controller (its admin queue closed, or its keep-alive expired); returns the
    /// held Asynchronous Event Requests' command IDs, to complete as aborted.
    pub fn remove(&mut self, cntlid: u16) -> Vec<u16> {
        self.controllers
            .remove(&cntlid)
            .map(|c| c.held_events)
            .unwrap_or_default()
    }

    /// Any command of controller `cntlid` arrived: the Keep Alive Timer restarts (traffic-based
    /// keep alive, which Identify advertises).
    pub fn traffic(&mut self, cntlid: u16, now: Instant) {
        if let Some(c) = self.controllers.get_mut(&cntlid) {
            c.last_keep_alive = now;
        }
    }

    /// The controllers whose keep-alive timeout passed without a Keep Alive by `now`.
    pub fn expired(&self, now: Instant) -> Vec<u16> {
        self.controllers
            .iter()
            .filter(|(_, c)| {
                !c.kato.is_zero() && now.saturating_duration_since(c.last_keep_alive) > c.kato
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// An admin command (or a Fabrics command on the admin queue) of the controller `cntlid`;
    /// `sgl_len` is the host buffer's length, `_data` what the transport brought of it (none
    /// of the admin commands served takes data from the host).
    pub fn admin(
        &mut self,
        now: Instant,
        cntlid: u16,
        cmd: &Command,
        sgl_len: u32,
        _data: &[u8],
    ) -> Outcome {
        let config = self.config.clone();
        let subsystems = self.subsystems.clone();
        let Some(ctrl) = self.controllers.get_mut(&cntlid) else {
            return Outcome::Respond(Response::fail(Status::COMMAND_SEQUENCE_ERROR));
        };
        let respond = |r: Response| Outcome::Respond(fit(r, sgl_len));
        if let Some(t) = fctype_of(cmd) {
            return respond(match t {
                fctype::PROPERTY_GET => match Property::parse(cmd) {
                    Ok(p) => match ctrl.regs.get(p.offset, p.eight_bytes) {
                        Ok(v) => Response::ok(v, Vec::new()),
                        Err(s) => Response::fail(s),
                    },
                    Err(_) => Response::fail(Status::INVALID_FIELD),
                },
                fctype::PROPERTY_SET => match Property::parse(cmd) {
                    Ok(p) => match ctrl.regs.set(p.offset, p.eight_bytes, p.value) {
                        Ok(()) => Response::ok(0, Vec::new()),
                        Err(s) => Response::fail(s),
                    },
                    Err(_) => Response::fail(Status::INVALID_FIELD),
                },
                fctype::CONNECT => Response::fail(Status::COMMAND_SEQUENCE_ERROR),
                _ => Response::fail(Status::INVALID_OPCODE),
            });
        }
        // Anything but a property access needs an enabled controller.
        if !ctrl.regs.ready() {
            return respond(Response::fail(Status::COMMAND_SEQUENCE_ERROR));
        }
        let discovery_ctrl = ctrl.subsystem.is_none();
        match cmd.opcode {
            admin::KEEP_ALIVE => {
                ctrl.last_keep_alive = now;
                respond(Response::ok(0, Vec::new()))
            }
            admin::IDENTIFY => respond(identify_command(ctrl, cntlid, &config, cmd)),
            admin::GET_LOG_PAGE => {
                let lid = (cmd.cdw(10) & 0xFF) as u8;
                let dwords = u64::from(cmd.cdw(10) >> 16 | (cmd.cdw(11) & 0xFFFF) << 16) + 1;
                let offset = u64::from(cmd.cdw(12)) | u64::from(cmd.cdw(13)) << 32;
                let page = match (lid, discovery_ctrl) {
                    (discovery::LID, true) => {
                        let (traddr, trsvcid, ipv6) = config.listen.clone();
                        let entries: Vec<discovery::Entry> = subsystems
                            .iter()
                            .map(|s| discovery::Entry {
                                subnqn: s.nqn.clone(),
                                traddr: traddr.clone(),
                                trsvcid: trsvcid.clone(),
                                ipv6,
                                portid: 1,
                            })
                            .collect();
                        Some(discovery::log_page(&entries, 1))
                    }
                    // Error information (one empty entry), SMART / health, firmware slots.
                    (0x01, _) => Some(vec![0u8; 64]),
                    (0x02, false) => Some(vec![0u8; 512]),
                    (0x03, false) => {
                        let mut b = vec![0u8; 512];
                        b[0] = 1;
                        b[8..11].copy_from_slice(b"0.1");
                        b[11..16].fill(b' ');
                        Some(b)
                    }
                    _ => None,
                };
                respond(match page {
                    Some(p) => Response::ok(0, window(&p, offset, dwords * 4)),
                    None => Response::fail(Status::INVALID_FIELD),
                })
            }
            admin::SET_FEATURES | admin::GET_FEATURES => {
                let set = cmd.opcode == admin::SET_FEATURES;
                let f = (cmd.cdw(10) & 0xFF) as u8;
                let v = cmd.cdw(11);
                respond(match f {
                    fid::NUMBER_OF_QUEUES if !discovery_ctrl => {
                        if set {
                            if v & 0xFFFF == 0xFFFF || v >> 16 == 0xFFFF {
                                return respond(Response::fail(Status::INVALID_FIELD));
                            }
                            let want = (v & 0xFFFF).min(v >> 16) as u16 + 1;
                            ctrl.io_queues = want.min(config.max_io_queues);
                        }
                        let n = u32::from(ctrl.io_queues.max(1) - 1);
                        Response::ok(u64::from(n | n << 16), Vec::new())
                    }
                    fid::KEEP_ALIVE_TIMER => {
                        if set {
                            ctrl.kato = Duration::from_millis(u64::from(v));
                            ctrl.last_keep_alive = now;
                        }
                        Response::ok(ctrl.kato.as_millis() as u64, Vec::new())
                    }
                    fid::ASYNC_EVENT_CONFIG | fid::VOLATILE_WRITE_CACHE => {
                        if set {
                            ctrl.features.insert(f, v);
                        }
                        Response::ok(
                            u64::from(ctrl.features.get(&f).copied().unwrap_or(0)),
                            Vec::new(),
                        )
                    }
                    _ => Response::fail(Status::INVALID_FIELD),
                })
            }
            admin::ASYNC_EVENT_REQUEST => {
                if ctrl.held_events.len() >= AER_LIMIT {
                    return respond(Response::fail(AER_LIMIT_EXCEEDED));
                }
                ctrl.held_events.push(cmd.cid);
                Outcome::Held
            }
            // Abort: the command was not aborted (bit 0 of the result), as a controller may
            // answer; the host's command completes on its own.
            admin::ABORT => respond(Response::ok(1, Vec::new())),
            _ => respond(Response::fail(Status::INVALID_OPCODE)),
        }
    }
}

/// The Identify command of a controller.
fn identify_command(
    ctrl: &Controller,
    cntlid: u16,
    config: &TargetConfig,
    cmd: &Command,
) -> Response {
    let cns_value = (cmd.cdw(10) & 0xFF) as u8;
    let Some(sub) = &ctrl.subsystem else {
        if cns_value != cns::CONTROLLER {
            return Response::fail(Status::INVALID_FIELD);
        }
        return Response::ok(
            0,
            identify::controller(&ControllerInfo {
                cntlid,
                serial: "ferroce-discovery".into(),
                model: "ferroce".into(),
                firmware: "0.1".into(),
                subnqn: discovery::DISCOVERY_NQN.into(),
                nn: 0,
                discovery: true,
                mdts: config.mdts,
                max_cmd: config.max_queue_entries,
                in_capsule_data: config.in_capsule_data,
            }),
        );
    };
    match cns_value {
        cns::CONTROLLER => Response::ok(
            0,
            identify::controller(&ControllerInfo {
                cntlid,
                serial: sub.serial.clone(),
                model: "ferroce".into(),
                firmware: "0.1".into(),
                subnqn: sub.nqn.clone(),
                nn: sub.namespaces.keys().copied().max().unwrap_or(0),
                discovery: false,
                mdts: config.mdts,
                max_cmd: config.max_queue_entries,
                in_capsule_data: config.in_capsule_data,
            }),
        ),
        cns::NAMESPACE => match sub.namespace(cmd.nsid) {
            Some(ns) => Response::ok(0, identify::namespace(ns)),
            None => Response::fail(Status::INVALID_NAMESPACE),
        },
        cns::ACTIVE_NAMESPACES => Response::ok(
            0,
            identify::active_namespaces(sub.namespaces.keys().copied(), cmd.nsid),
        ),
        cns::NS_DESCRIPTORS => match sub.namespace(cmd.nsid) {
            Some(ns) => Response::ok(0, identify::ns_descriptors(ns)),
            None => Response::fail(Status::INVALID_NAMESPACE),
        },
        _ => Response::fail(Status::INVALID_FIELD),
    }
}

/// `len` bytes of `page` from `offset` (zeroes past its end).
fn window(page: &[u8], offset: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len.min(1 << 20) as usize];
    if let Ok(start) = usize::try_from(offset) {
        if start < page.len() {
            let n = out.len().min(page.len() - start);
            out[..n].copy_from_slice(&page[start..start + n]);
        }
    }
    out
}

/// A response's data cut to the host's buffer (`sgl_len`), as a controller transfers no more
/// than the host described.
fn fit(mut r: Response, sgl_len: u32) -> Response {
    r.data.truncate(sgl_len as usize);
    r
}

#[cfg(test)]
mod tests;
