//! The IB CM protocol as a sans-IO state machine: what the kernel's `ib_cm` does for every
//! connection, without a clock or a socket.
//!
//! A [`CmManager`] serves one GID (one QP1). Application commands ([`CmManager::connect`],
//! [`CmManager::accept`], [`CmManager::ready_to_use`], [`CmManager::reject`],
//! [`CmManager::disconnect`], [`CmManager::resolve_service`], [`CmManager::answer_service`]),
//! inputs ([`CmManager::handle_mad`], [`CmManager::handle_timeout`]) and outputs
//! ([`CmManager::poll_transmit`], [`CmManager::poll_event`], [`CmManager::poll_timeout`]) are
//! all it has: the driver ([`super::agent`]) owns the clock and QP1.
//!
//! # Connection states (IBTA §12.9.5, one [`ConnId`] each: the local communication ID)
//!
//! ```text
//! active:  connect ─REQ→ ReqSent ─REP→ RepReceived ─ready_to_use/RTU→ Established
//! passive: REQ→ ReqReceived ─accept/REP→ RepSent ─RTU→ Established
//! either:  Established ─disconnect/DREQ→ DreqSent ─DREP→ TimeWait
//!          Established ─DREQ→ (DREP) TimeWait
//! ```
//!
//! Every message that expects an answer (REQ, REP, DREQ) is sent again after the peer's CM
//! response time, at most `max_cm_retries` times; then the connection fails with
//! [`CmEvent::Unreachable`] (REQ, REP) or is disconnected anyway (DREQ), as in the kernel.
//! An MRA extends the wait by the time it names. A duplicate of a message already answered gets
//! the answer again (REQ → MRA or REP, REP → RTU, DREQ → DREP, also in time-wait), so a lost
//! answer is recovered by the peer's retry. A message naming a connection this side does not
//! have is answered as IBTA says (a REJ with "invalid communication ID" for a REP, a DREP for a
//! DREQ) or ignored (RTU, DREP, REJ, MRA); nothing a peer sends makes this machine panic or
//! grow without bound: connections in REQ-received state are capped ([`MAX_PENDING`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use ferroce_wire::cm::{
    rej_reason, CmMad, CmMessage, CmPath, CommIds, Dreq, MessageKind, Mra, Rej, Rep, Req, SidrRep,
    SidrReq,
};
use ferroce_wire::mad::MAD_LEN;

/// The local communication ID of a connection, which names it in commands and events.
pub type ConnId = u32;

/// Connections that may wait for the application's accept at once: a flood of REQs beyond it
/// is rejected with "no resources" instead of growing memory.
pub const MAX_PENDING: usize = 1024;

/// How long a received REQ waits for the application's accept or reject: past the longest a
/// peer waits (its 15 retries, each held by an MRA for 2^24 × 4 µs, are longer, but the kernel's
/// rdma_cm gives up on a connection after its own timeouts well before).
pub const ACCEPT_WAIT: Duration = Duration::from_secs(120);

/// How long a connection stays in time-wait, answering duplicate DREQs.
pub const TIME_WAIT: Duration = Duration::from_secs(2);

/// The CM response timeout ferroce advertises and assumes by default: 4.096 µs × 2^17 ≈ 0.54 s
/// (the kernel's rdma_cm advertises 2^20, 4.3 s; a shorter one recovers a lost message sooner).
pub const RESPONSE_TIMEOUT: u8 = 17;

/// How many times a REQ, REP or DREQ is sent again before giving up.
pub const MAX_CM_RETRIES: u8 = 15;

/// IBTA's time encoding: 4.096 µs × 2^`exponent` (the exponent capped at 31).
pub fn cm_time(exponent: u8) -> Duration {
    Duration::from_nanos(4096u64 << exponent.min(31))
}

/// A MAD to send to QP1 of `dest_gid`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// The GID of the peer's QP1.
    pub dest_gid: [u8; 16],
    /// The whole MAD.
    pub mad: [u8; MAD_LEN],
}

/// What the active side asks for in a REQ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectParams {
    /// The GID of the passive side (its QP1).
    pub dest_gid: [u8; 16],
    /// The local GID the connection is from (the manager's own when `None`): the REQ's path
    /// names it, and the peer sends there.
    pub local_gid: Option<[u8; 16]>,
    /// The service to connect to.
    pub service_id: u64,
    /// The local QP's number.
    pub qpn: u32,
    /// The PSN the local QP expects to receive first: the peer sends from it (the kernel's
    /// CM, which this follows, has each side name its receive PSN; see `rping_rdmacm.pcap`).
    pub starting_psn: u32,
    /// READ/atomic requests the local QP serves at once.
    pub responder_resources: u8,
    /// READ/atomic requests the local QP keeps outstanding.
    pub initiator_depth: u8,
    /// Transport retries (3 bits).
    pub retry_count: u8,
    /// RNR retries (3 bits).
    pub rnr_retry_count: u8,
    /// Path MTU, IBTA-encoded (1 = 256 … 5 = 4096).
    pub path_mtu: u8,
    /// Transport type: 0 RC, 1 UC.
    pub transport_type: u8,
    /// Whether the local QP takes receives from an SRQ.
    pub srq: bool,
    /// ECE: vendor ID (24 bits) and options.
    pub ece: (u32, u32),
    /// Private data (at most 92 bytes).
    pub private_data: Vec<u8>,
}

/// What the passive side answers in a REP.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AcceptParams {
    /// The local QP's number.
    pub qpn: u32,
    /// The PSN the local QP expects to receive first (as in [`ConnectParams`]).
    pub starting_psn: u32,
    /// READ/atomic requests the local QP serves at once.
    pub responder_resources: u8,
    /// READ/atomic requests the local QP keeps outstanding.
    pub initiator_depth: u8,
    /// RNR retries (3 bits).
    pub rnr_retry_count: u8,
    /// Whether the local QP takes receives from an SRQ.
    pub srq: bool,
    /// ECE: vendor ID (24 bits) and options.
    pub ece: (u32, u32),
    /// Private data (at most 196 bytes).
    pub private_data: Vec<u8>,
}

/// What the manager tells its application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmEvent {
    /// A REQ for a service this side listens on: answer with [`CmManager::accept`] or
    /// [`CmManager::reject`].
    Request {
        /// The new connection.
        conn: ConnId,
        /// The GID the REQ came from.
        from_gid: [u8; 16],
        /// The REQ.
        req: Box<Req>,
        /// ECE options (the MAD's attribute modifier).
        ece_options: u32,
    },
    /// The passive side's REP: move the QP to RTR and RTS, then [`CmManager::ready_to_use`].
    Reply {
        /// The connection.
        conn: ConnId,
        /// The REP.
        rep: Box<Rep>,
        /// ECE options.
        ece_options: u32,
    },
    /// The connection is established (passive side: the RTU came).
    Established {
        /// The connection.
        conn: ConnId,
    },
    /// The peer rejected the REQ or REP.
    Rejected {
        /// The connection.
        conn: ConnId,
        /// The reason ([`rej_reason`]).
        reason: u16,
        /// The REJ's private data.
        private_data: Vec<u8>,
    },
    /// No answer after every retry (REQ or REP).
    Unreachable {
        /// The connection.
        conn: ConnId,
    },
    /// The connection is over: a DREQ came (and was answered), or the DREQ sent was answered
    /// or timed out.
    Disconnected {
        /// The connection.
        conn: ConnId,
    },
    /// A SIDR_REQ for a service this side listens on: answer with
    /// [`CmManager::answer_service`].
    ServiceRequest {
        /// The request's ID (name it in the answer).
        request: u32,
        /// Its MAD's transaction ID (the answer carries it back).
        transaction_id: u64,
        /// The GID it came from.
        from_gid: [u8; 16],
        /// The request.
        req: Box<SidrReq>,
    },
    /// The answer to [`CmManager::resolve_service`]; `rep` is `None` when every retry went
    /// unanswered.
    ServiceReply {
        /// The request's ID.
        request: u32,
        /// The answer (`None` when every retry went unanswered).
        rep: Option<Box<SidrRep>>,
    },
}

/// Why a command was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// No such connection, or not in the state the command needs.
    #[error("connection {0:#x} is not in a state for this")]
    BadState(ConnId),
    /// Someone already listens on the service ID.
    #[error("service ID {0:#018x} is already listened on")]
    Busy(u64),
    /// A value does not fit its field.
    #[error("{0}")]
    Wire(#[from] ferroce_wire::WireError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ReqSent,
    RepReceived,
    ReqReceived,
    RepSent,
    Established,
    DreqSent,
    TimeWait,
}

#[derive(Debug)]
struct Conn {
    state: State,
    remote_gid: [u8; 16],
    remote_comm_id: u32,
    remote_qpn: u32,
    transaction_id: u64,
    /// The last message sent that a duplicate of the peer's message is answered with, or that
    /// a timeout sends again.
    last_sent: Option<[u8; MAD_LEN]>,
    /// When the wait for the peer's answer ends (or time-wait does).
    deadline: Option<Instant>,
    retries_left: u8,
    /// How long the peer may take to answer.
    peer_response: Duration,
}

#[derive(Debug)]
struct SidrPending {
    dest_gid: [u8; 16],
    mad: [u8; MAD_LEN],
    deadline: Instant,
    retries_left: u8,
}

/// The CM of one GID: every connection and service resolution through its QP1.
#[derive(Debug)]
pub struct CmManager {
    local_gid: [u8; 16],
    ca_guid: u64,
    next_id: u32,
    conns: HashMap<ConnId, Conn>,
    /// Passive connections by (the peer's GID, the peer's communication ID), to spot duplicates.
    by_remote: HashMap<([u8; 16], u32), ConnId>,
    listening: HashSet<u64>,
    sidr: HashMap<u32, SidrPending>,
    /// Requests answered: (the peer's GID, its request ID) → the answer, for duplicates.
    sidr_answered: HashMap<([u8; 16], u32), ([u8; MAD_LEN], Instant)>,
    /// Requests reported and not answered yet: a duplicate is not reported again.
    sidr_waiting: HashSet<([u8; 16], u32)>,
    transmit: VecDeque<Outgoing>,
    events: VecDeque<CmEvent>,
    /// Counts of MADs that could not be read (malformed, another class).
    pub malformed: u64,
}

impl CmManager {
    /// A manager for `local_gid`, whose CA GUID is `ca_guid`; `seed` starts its communication
    /// IDs (random in a real driver, so a restarted process does not reuse its predecessor's).
    pub fn new(local_gid: [u8; 16], ca_guid: u64, seed: u32) -> CmManager {
        CmManager {
            local_gid,
            ca_guid,
            next_id: seed | 1,
            conns: HashMap::new(),
            by_remote: HashMap::new(),
            listening: HashSet::new(),
            sidr: HashMap::new(),
            sidr_answered: HashMap::new(),
            sidr_waiting: HashSet::new(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            malformed: 0,
        }
    }

    /// The GID this manager serves.
    pub fn local_gid(&self) -> [u8; 16] {
        self.local_gid
    }

    fn new_id(&mut self) -> u32 {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if id != 0 && !self.conns.contains_key(&id) && !self.sidr.contains_key(&id) {
                return id;
            }
        }
    }

    /// Takes REQs and SIDR_REQs for `service_id` from now on.
    pub fn listen(&mut self, service_id: u64) -> Result<(), CommandError> {
        if !self.listening.insert(service_id) {
            return Err(CommandError::Busy(service_id));
        }
        Ok(())
    }

    /// Stops taking REQs for `service_id` (later ones are rejected as for no listener).
    pub fn unlisten(&mut self, service_id: u64) {
        self.listening.remove(&service_id);
    }

    fn send(&mut self, dest_gid: [u8; 16], mad: &CmMad) -> Result<[u8; MAD_LEN], CommandError> {
        let bytes = mad.to_bytes()?;
        self.transmit.push_back(Outgoing {
            dest_gid,
            mad: bytes,
        });
        Ok(bytes)
    }

    /// Starts a connection: sends a REQ. The answer comes as [`CmEvent::Reply`],
    /// [`CmEvent::Rejected`] or [`CmEvent::Unreachable`].
    pub fn connect(&mut self, now: Instant, p: ConnectParams) -> Result<ConnId, CommandError> {
        let id = self.new_id();
        let transaction_id = u64::from(id) << 32 | u64::from(id);
        let path = CmPath {
            local_lid: 0xffff,
            remote_lid: 0xffff,
            local_gid: p.local_gid.unwrap_or(self.local_gid),
            remote_gid: p.dest_gid,
            hop_limit: 64,
            local_ack_timeout: 19,
            ..Default::default()
        };
        let req = Req {
            local_comm_id: id,
            vendor_id: p.ece.0,
            service_id: p.service_id,
            local_ca_guid: self.ca_guid,
            local_qpn: p.qpn,
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            remote_cm_response_timeout: RESPONSE_TIMEOUT,
            transport_type: p.transport_type,
            starting_psn: p.starting_psn,
            local_cm_response_timeout: RESPONSE_TIMEOUT,
            retry_count: p.retry_count,
            pkey: 0xffff,
            path_mtu: p.path_mtu,
            rnr_retry_count: p.rnr_retry_count,
            max_cm_retries: MAX_CM_RETRIES,
            srq: p.srq,
            primary_path: path,
            private_data: p.private_data,
            ..Default::default()
        };
        let mad = CmMad {
            transaction_id,
            attribute_modifier: p.ece.1,
            message: CmMessage::Req(req),
        };
        let bytes = self.send(p.dest_gid, &mad)?;
        let peer_response = cm_time(RESPONSE_TIMEOUT);
        self.conns.insert(
            id,
            Conn {
                state: State::ReqSent,
                remote_gid: p.dest_gid,
                remote_comm_id: 0,
                remote_qpn: 0,
                transaction_id,
                last_sent: Some(bytes),
                deadline: Some(now + peer_response),
                retries_left: MAX_CM_RETRIES,
                peer_response,
            },
        );
        Ok(id)
    }

    fn conn_in(&mut self, conn: ConnId, state: State) -> Result<&mut Conn, CommandError> {
        match self.conns.get_mut(&conn) {
            Some(c) if c.state == state => Ok(c),
            _ => Err(CommandError::BadState(conn)),
        }
    }

    /// Answers a [`CmEvent::Request`] with a REP.
    pub fn accept(
        &mut self,
        now: Instant,
        conn: ConnId,
        p: AcceptParams,
    ) -> Result<(), CommandError> {
        let ca_guid = self.ca_guid;
        let c = self.conn_in(conn, State::ReqReceived)?;
        let mad = CmMad {
            transaction_id: c.transaction_id,
            attribute_modifier: p.ece.1,
            message: CmMessage::Rep(Rep {
                local_comm_id: conn,
                remote_comm_id: c.remote_comm_id,
                local_qpn: p.qpn,
                vendor_id: p.ece.0,
                starting_psn: p.starting_psn,
                responder_resources: p.responder_resources,
                initiator_depth: p.initiator_depth,
                target_ack_delay: 15,
                rnr_retry_count: p.rnr_retry_count,
                srq: p.srq,
                local_ca_guid: ca_guid,
                private_data: p.private_data,
                ..Default::default()
            }),
        };
        let gid = c.remote_gid;
        let bytes = self.send(gid, &mad)?;
        let c = self.conns.get_mut(&conn).expect("checked above");
        c.state = State::RepSent;
        c.last_sent = Some(bytes);
        c.deadline = Some(now + c.peer_response);
        c.retries_left = MAX_CM_RETRIES;
        Ok(())
    }

    /// Finishes the active side after [`CmEvent::Reply`]: sends the RTU; the connection is
    /// established.
    pub fn ready_to_use(&mut self, conn: ConnId, private_data: &[u8]) -> Result<(), CommandError> {
        let c = self.conn_in(conn, State::RepReceived)?;
        let mad = CmMad {
            transaction_id: c.transaction_id,
            attribute_modifier: 0,
            message: CmMessage::Rtu(CommIds {
                local_comm_id: conn,
                remote_comm_id: c.remote_comm_id,
                private_data: private_data.to_vec(),
            }),
        };
        let gid = c.remote_gid;
        let bytes = self.send(gid, &mad)?;
        let c = self.conns.get_mut(&conn).expect("checked above");
        c.state = State::Established;
        c.last_sent = Some(bytes);
        c.deadline = None;
        Ok(())
    }

    /// Rejects a request (passive side, before accepting) or a reply (active side, after
    /// [`CmEvent::Reply`]); the connection is forgotten.
    pub fn reject(
        &mut self,
        conn: ConnId,
        reason: u16,
        private_data: &[u8],
    ) -> Result<(), CommandError> {
        let Some(c) = self.conns.get(&conn) else {
            return Err(CommandError::BadState(conn));
        };
        let rejected = match c.state {
            State::ReqReceived => MessageKind::Req,
            State::RepReceived => MessageKind::Rep,
            _ => return Err(CommandError::BadState(conn)),
        };
        let mad = CmMad {
            transaction_id: c.transaction_id,
            attribute_modifier: 0,
            message: CmMessage::Rej(Rej {
                local_comm_id: conn,
                remote_comm_id: c.remote_comm_id,
                message_rejected: rejected,
                reason,
                ari: Vec::new(),
                private_data: private_data.to_vec(),
            }),
        };
        let gid = c.remote_gid;
        self.send(gid, &mad)?;
        self.forget(conn);
        Ok(())
    }

    /// Disconnects an established connection (DREQ); [`CmEvent::Disconnected`] follows when
    /// the DREP comes or the retries run out. A connection still being set up is abandoned
    /// (a REJ to the peer, as the kernel's `ib_destroy_cm_id` does, with reason timeout);
    /// one already disconnected is left as it is.
    pub fn disconnect(
        &mut self,
        now: Instant,
        conn: ConnId,
        private_data: &[u8],
    ) -> Result<(), CommandError> {
        let Some(c) = self.conns.get(&conn) else {
            return Err(CommandError::BadState(conn));
        };
        match c.state {
            State::Established => {}
            State::DreqSent | State::TimeWait => return Ok(()),
            State::ReqSent | State::RepSent | State::ReqReceived | State::RepReceived => {
                let (gid, tid, remote) = (c.remote_gid, c.transaction_id, c.remote_comm_id);
                let rejected = if c.state == State::RepSent || c.state == State::ReqReceived {
                    MessageKind::Req
                } else {
                    MessageKind::Rep
                };
                // As the kernel's `cm_destroy_id`: a REQ given up on is rejected for timeout,
                // with this CA's GUID as the ARI (the peer finds the connection by it, since
                // it never learned this side's communication ID); anything later is the
                // consumer's rejection.
                let (reason, ari) = if c.state == State::ReqSent {
                    (rej_reason::TIMEOUT, self.ca_guid.to_be_bytes().to_vec())
                } else {
                    (rej_reason::CONSUMER_DEFINED, Vec::new())
                };
                self.send(
                    gid,
                    &CmMad {
                        transaction_id: tid,
                        attribute_modifier: 0,
                        message: CmMessage::Rej(Rej {
                            local_comm_id: conn,
                            remote_comm_id: remote,
                            message_rejected: rejected,
                            reason,
                            ari,
                            private_data: Vec::new(),
                        }),
                    },
                )?;
                self.forget(conn);
                return Ok(());
            }
        }
        let transaction_id = u64::from(self.new_id()) << 32 | u64::from(conn);
        let c = &self.conns[&conn];
        let mad = CmMad {
            transaction_id,
            attribute_modifier: 0,
            message: CmMessage::Dreq(Dreq {
                local_comm_id: conn,
                remote_comm_id: c.remote_comm_id,
                remote_qpn: c.remote_qpn,
                private_data: private_data.to_vec(),
            }),
        };
        let gid = c.remote_gid;
        let bytes = self.send(gid, &mad)?;
        let c = self.conns.get_mut(&conn).expect("present");
        c.state = State::DreqSent;
        c.last_sent = Some(bytes);
        c.deadline = Some(now + c.peer_response);
        c.retries_left = MAX_CM_RETRIES;
        Ok(())
    }

    /// Forgets a connection at once (its id destroyed): nothing more is sent or reported.
    pub fn forget(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            self.by_remote.remove(&(c.remote_gid, c.remote_comm_id));
        }
    }

    /// Asks which UD QP serves `service_id` at `dest_gid` (SIDR_REQ); the answer comes as
    /// [`CmEvent::ServiceReply`]. Returns the request's ID.
    pub fn resolve_service(
        &mut self,
        now: Instant,
        dest_gid: [u8; 16],
        service_id: u64,
        private_data: Vec<u8>,
    ) -> Result<u32, CommandError> {
        let id = self.new_id();
        let mad = CmMad {
            transaction_id: u64::from(id) << 32 | u64::from(id),
            attribute_modifier: 0,
            message: CmMessage::SidrReq(SidrReq {
                request_id: id,
                pkey: 0xffff,
                service_id,
                private_data,
            }),
        };
        let bytes = self.send(dest_gid, &mad)?;
        self.sidr.insert(
            id,
            SidrPending {
                dest_gid,
                mad: bytes,
                deadline: now + cm_time(RESPONSE_TIMEOUT),
                retries_left: MAX_CM_RETRIES,
            },
        );
        Ok(id)
    }

    /// Answers a [`CmEvent::ServiceRequest`] (`answer.request_id` names it).
    pub fn answer_service(
        &mut self,
        now: Instant,
        to_gid: [u8; 16],
        transaction_id: u64,
        answer: SidrRep,
    ) -> Result<(), CommandError> {
        let key = (to_gid, answer.request_id);
        self.sidr_waiting.remove(&key);
        let mad = CmMad {
            transaction_id,
            attribute_modifier: 0,
            message: CmMessage::SidrRep(answer),
        };
        let bytes = self.send(to_gid, &mad)?;
        if self.sidr_answered.len() < MAX_PENDING {
            self.sidr_answered.insert(key, (bytes, now + TIME_WAIT));
        }
        Ok(())
    }

    /// The next MAD to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Outgoing> {
        self.transmit.pop_front()
    }

    /// The next event for the application, if any.
    pub fn poll_event(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }

    /// When [`CmManager::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let conns = self.conns.values().filter_map(|c| c.deadline);
        let sidr = self.sidr.values().map(|s| s.deadline);
        let answered = self.sidr_answered.values().map(|a| a.1);
        conns.chain(sidr).chain(answered).min()
    }

    /// Sends again what is unanswered, fails what ran out of retries, ends time-waits.
    pub fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            let c = self.conns.get_mut(&id).expect("listed");
            if c.state == State::TimeWait {
                self.forget(id);
                continue;
            }
            if c.state == State::ReqReceived {
                self.forget(id);
                self.events.push_back(CmEvent::Unreachable { conn: id });
                continue;
            }
            if c.retries_left == 0 {
                let state = c.state;
                match state {
                    State::DreqSent => {
                        c.state = State::TimeWait;
                        c.deadline = Some(now + TIME_WAIT);
                        self.events.push_back(CmEvent::Disconnected { conn: id });
                    }
                    _ => {
                        self.forget(id);
                        self.events.push_back(CmEvent::Unreachable { conn: id });
                    }
                }
                continue;
            }
            c.retries_left -= 1;
            c.deadline = Some(now + c.peer_response);
            if let Some(mad) = c.last_sent {
                let dest_gid = c.remote_gid;
                self.transmit.push_back(Outgoing { dest_gid, mad });
            }
        }
        let due: Vec<u32> = self
            .sidr
            .iter()
            .filter(|(_, s)| s.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            let s = self.sidr.get_mut(&id).expect("listed");
            if s.retries_left == 0 {
                self.sidr.remove(&id);
                self.events.push_back(CmEvent::ServiceReply {
                    request: id,
                    rep: None,
                });
                continue;
            }
            s.retries_left -= 1;
            s.deadline = now + cm_time(RESPONSE_TIMEOUT);
            let out = Outgoing {
                dest_gid: s.dest_gid,
                mad: s.mad,
            };
            self.transmit.push_back(out);
        }
        self.sidr_answered.retain(|_, (_, until)| *until > now);
    }

    /// Takes a MAD that arrived at QP1 from `from_gid`. One that cannot be read is counted in
    /// [`CmManager::malformed`] and dropped, as a NIC drops a bad MAD.
    pub fn handle_mad(&mut self, now: Instant, from_gid: [u8; 16], bytes: &[u8]) {
        let Ok(mad) = CmMad::parse(bytes) else {
            self.malformed += 1;
            return;
        };
        let tid = mad.transaction_id;
        let ece_options = mad.attribute_modifier;
        match mad.message {
            CmMessage::Req(req) => self.on_req(now, from_gid, tid, ece_options, req),
            CmMessage::Rep(rep) => self.on_rep(from_gid, tid, ece_options, rep),
            CmMessage::Rtu(rtu) => {
                if let Ok(c) = self.conn_in(rtu.remote_comm_id, State::RepSent) {
                    if c.remote_comm_id == rtu.local_comm_id && c.remote_gid == from_gid {
                        c.state = State::Established;
                        c.deadline = None;
                        c.last_sent = None;
                        let conn = rtu.remote_comm_id;
                        self.events.push_back(CmEvent::Established { conn });
                    }
                }
            }
            CmMessage::Rej(rej) => {
                // A REJ names this side's communication ID, or, from a peer that gives up on
                // its REQ before hearing the REP, only its own (and 0 for this side's).
                let conn = if self.conns.contains_key(&rej.remote_comm_id) {
                    rej.remote_comm_id
                } else {
                    match self.by_remote.get(&(from_gid, rej.local_comm_id)) {
                        Some(&c) => c,
                        None => return,
                    }
                };
                let ours = self.conns.get(&conn).is_some_and(|c| {
                    c.remote_gid == from_gid
                        && matches!(
                            c.state,
                            State::ReqSent
                                | State::RepSent
                                | State::RepReceived
                                | State::ReqReceived
                        )
                        && (c.state == State::ReqSent || c.remote_comm_id == rej.local_comm_id)
                });
                if ours {
                    self.forget(conn);
                    self.events.push_back(CmEvent::Rejected {
                        conn,
                        reason: rej.reason,
                        private_data: rej.private_data,
                    });
                }
            }
            CmMessage::Mra(mra) => {
                if let Some(c) = self.conns.get_mut(&mra.remote_comm_id) {
                    let waiting = matches!(
                        (c.state, mra.message_mraed),
                        (State::ReqSent, MessageKind::Req) | (State::RepSent, MessageKind::Rep)
                    );
                    if waiting && c.remote_gid == from_gid {
                        c.deadline = Some(now + c.peer_response + cm_time(mra.service_timeout));
                    }
                }
            }
            CmMessage::Dreq(dreq) => self.on_dreq(now, from_gid, tid, dreq),
            CmMessage::Drep(drep) => {
                if let Ok(c) = self.conn_in(drep.remote_comm_id, State::DreqSent) {
                    if c.remote_comm_id == drep.local_comm_id {
                        c.state = State::TimeWait;
                        c.deadline = Some(now + TIME_WAIT);
                        c.last_sent = None;
                        let conn = drep.remote_comm_id;
                        self.events.push_back(CmEvent::Disconnected { conn });
                    }
                }
            }
            CmMessage::SidrReq(req) => {
                if let Some((bytes, _)) = self.sidr_answered.get(&(from_gid, req.request_id)) {
                    let out = Outgoing {
                        dest_gid: from_gid,
                        mad: *bytes,
                    };
                    self.transmit.push_back(out);
                } else if self.sidr_waiting.contains(&(from_gid, req.request_id)) {
                    // A duplicate of a request the application has not answered yet.
                } else if self.listening.contains(&req.service_id)
                    && self.sidr_waiting.len() < MAX_PENDING
                {
                    self.sidr_waiting.insert((from_gid, req.request_id));
                    self.events.push_back(CmEvent::ServiceRequest {
                        request: req.request_id,
                        transaction_id: tid,
                        from_gid,
                        req: Box::new(req),
                    });
                } else {
                    // "No such service", answered without keeping state: a flood of requests
                    // for unknown services costs nothing but the answers.
                    let answer = CmMad {
                        transaction_id: tid,
                        attribute_modifier: 0,
                        message: CmMessage::SidrRep(SidrRep {
                            request_id: req.request_id,
                            status: 1,
                            service_id: req.service_id,
                            ..Default::default()
                        }),
                    };
                    let _ = self.send(from_gid, &answer);
                }
            }
            CmMessage::SidrRep(rep) => {
                let ours = self
                    .sidr
                    .get(&rep.request_id)
                    .is_some_and(|s| s.dest_gid == from_gid);
                if ours {
                    self.sidr.remove(&rep.request_id);
                    self.events.push_back(CmEvent::ServiceReply {
                        request: rep.request_id,
                        rep: Some(Box::new(rep)),
                    });
                }
            }
        }
    }

    fn on_req(&mut self, now: Instant, from: [u8; 16], tid: u64, ece: u32, req: Req) {
        if let Some(&conn) = self.by_remote.get(&(from, req.local_comm_id)) {
            // A duplicate: the peer did not hear the answer yet.
            let c = &self.conns[&conn];
            match c.state {
                State::ReqReceived => {
                    let mra = CmMad {
                        transaction_id: tid,
                        attribute_modifier: 0,
                        message: CmMessage::Mra(Mra {
                            local_comm_id: conn,
                            remote_comm_id: req.local_comm_id,
                            message_mraed: MessageKind::Req,
                            service_timeout: 24,
                            private_data: Vec::new(),
                        }),
                    };
                    let _ = self.send(from, &mra);
                }
                State::RepSent => {
                    if let Some(mad) = c.last_sent {
                        self.transmit.push_back(Outgoing {
                            dest_gid: from,
                            mad,
                        });
                    }
                }
                _ => {}
            }
            return;
        }
        let refuse = |reason| Rej {
            local_comm_id: 0,
            remote_comm_id: req.local_comm_id,
            message_rejected: MessageKind::Req,
            reason,
            ari: Vec::new(),
            private_data: Vec::new(),
        };
        let pending = self
            .conns
            .values()
            .filter(|c| c.state == State::ReqReceived)
            .count();
        let rej = if !self.listening.contains(&req.service_id) {
            Some(refuse(rej_reason::INVALID_SERVICE_ID))
        } else if pending >= MAX_PENDING {
            Some(refuse(rej_reason::NO_RESOURCES))
        } else {
            None
        };
        if let Some(rej) = rej {
            let mad = CmMad {
                transaction_id: tid,
                attribute_modifier: 0,
                message: CmMessage::Rej(rej),
            };
            let _ = self.send(from, &mad);
            return;
        }
        let conn = self.new_id();
        self.conns.insert(
            conn,
            Conn {
                state: State::ReqReceived,
                remote_gid: from,
                remote_comm_id: req.local_comm_id,
                remote_qpn: req.local_qpn,
                transaction_id: tid,
                last_sent: None,
                // An application that never answers holds the request this long, then it is
                // dropped (the peer has given up by then), so unanswered requests cannot fill
                // the `MAX_PENDING` places for good.
                deadline: Some(now + ACCEPT_WAIT),
                retries_left: MAX_CM_RETRIES,
                peer_response: cm_time(req.local_cm_response_timeout.clamp(12, 21)),
            },
        );
        self.by_remote.insert((from, req.local_comm_id), conn);
        self.events.push_back(CmEvent::Request {
            conn,
            from_gid: from,
            req: Box::new(req),
            ece_options: ece,
        });
    }

    fn on_rep(&mut self, from: [u8; 16], tid: u64, ece: u32, rep: Rep) {
        let conn = rep.remote_comm_id;
        let Some(c) = self.conns.get_mut(&conn) else {
            // IBTA: a REP for no connection is rejected, so the peer stops sending it.
            let mad = CmMad {
                transaction_id: tid,
                attribute_modifier: 0,
                message: CmMessage::Rej(Rej {
                    local_comm_id: conn,
                    remote_comm_id: rep.local_comm_id,
                    message_rejected: MessageKind::Rep,
                    reason: rej_reason::INVALID_COMM_ID,
                    ari: Vec::new(),
                    private_data: Vec::new(),
                }),
            };
            let _ = self.send(from, &mad);
            return;
        };
        if c.remote_gid != from {
            return;
        }
        match c.state {
            State::ReqSent => {
                c.state = State::RepReceived;
                c.remote_comm_id = rep.local_comm_id;
                c.remote_qpn = rep.local_qpn;
                c.deadline = None;
                c.last_sent = None;
                self.events.push_back(CmEvent::Reply {
                    conn,
                    rep: Box::new(rep),
                    ece_options: ece,
                });
            }
            // The RTU was lost: the peer's REP retry gets it again.
            State::Established if c.remote_comm_id == rep.local_comm_id => {
                if let Some(mad) = c.last_sent {
                    self.transmit.push_back(Outgoing {
                        dest_gid: from,
                        mad,
                    });
                }
            }
            _ => {}
        }
    }

    fn on_dreq(&mut self, now: Instant, from: [u8; 16], tid: u64, dreq: Dreq) {
        let conn = dreq.remote_comm_id;
        let known = self
            .conns
            .get(&conn)
            .is_some_and(|c| c.remote_gid == from && c.remote_comm_id == dreq.local_comm_id);
        let drep = CmMad {
            transaction_id: tid,
            attribute_modifier: 0,
            message: CmMessage::Drep(CommIds {
                local_comm_id: conn,
                remote_comm_id: dreq.local_comm_id,
                private_data: Vec::new(),
            }),
        };
        // IBTA: a DREQ is always answered, for a connection already gone too.
        let _ = self.send(from, &drep);
        if !known {
            return;
        }
        let c = self.conns.get_mut(&conn).expect("known");
        match c.state {
            // The passive side's RTU may be lost while the peer already disconnects.
            State::Established | State::RepSent | State::DreqSent => {
                c.state = State::TimeWait;
                c.deadline = Some(now + TIME_WAIT);
                c.last_sent = None;
                self.events.push_back(CmEvent::Disconnected { conn });
            }
            _ => {}
        }
    }

    /// How many connections the manager holds (any state, time-wait included).
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Whether a connection is established.
    pub fn is_established(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .is_some_and(|c| c.state == State::Established)
    }
}

/// The attribute ID of a MAD, for logs (0 when it is too short).
pub fn attribute_of(mad: &[u8]) -> u16 {
    match mad.get(16..18) {
        Some(b) => u16::from_be_bytes([b[0], b[1]]),
        None => 0,
    }
}
