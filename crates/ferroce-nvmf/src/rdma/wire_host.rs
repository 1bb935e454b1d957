//! The host's queues connected through IB CM on the wire, as the Linux kernel's rdma_cm
//! connects them: how `ferroce nvmf-perf` reaches the kernel's own target (`nvmet-rdma`) and
//! any NVMe/RDMA target on an RDMA NIC.
//!
//! A REQ to rdma_cm's service ID for the port carries rdma_cm's IP header and the NVMe/RDMA
//! request; the REP's private data is the controller's accept, a REJ's its status. The QP goes
//! to RTR and RTS on the REP, then the RTU goes out. A [`WireConn`] that is dropped sends the
//! DREQ; a DREQ from the target marks it disconnected.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferroce::cm::ib::ip::{self, IpHeader};
use ferroce::cm::ib::{CmAgent, CmEvent, CmManager, ConnId, ConnectParams, GsiPort};
use ferroce::cm::EndpointInfo;
use ferroce::{ConnectOptions, Context, Psn, QueuePair};
use ferroce_wire::cm::rej_reason;

use super::exchange::ExchangeError;
use super::initiator::HostError;
use crate::cm::{CmAccept, CmRejectStatus, CmRequest};

/// The events of connections not yet taken, by connection, and who waits for them.
#[derive(Default)]
struct Mailbox {
    events: Mutex<HashMap<ConnId, VecDeque<CmEvent>>>,
    arrived: Condvar,
    /// Connections established, with their disconnect flags.
    live: Mutex<HashMap<ConnId, Arc<AtomicBool>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The host's connection manager on QP1 of its context.
pub struct WireHost {
    agent: OnceLock<CmAgent>,
    mailbox: Arc<Mailbox>,
    local_ip: IpAddr,
}

/// A queue's connection through the wire CM: dropping it disconnects (DREQ).
pub struct WireConn {
    host: Arc<WireHost>,
    conn: ConnId,
    disconnected: Arc<AtomicBool>,
}

impl WireConn {
    /// Whether the target disconnected the queue.
    pub fn disconnected(&self) -> bool {
        self.disconnected.load(Ordering::Acquire)
    }
}

impl Drop for WireConn {
    fn drop(&mut self) {
        lock(&self.host.mailbox.live).remove(&self.conn);
        if let Some(a) = self.host.agent.get() {
            let _ = a.command(|m, now| m.disconnect(now, self.conn, &[]));
        }
    }
}

impl WireHost {
    /// Starts the CM on QP1 of `ctx` (which must be its host's RoCE port 4791 for targets to
    /// answer it).
    pub fn open(ctx: &Context) -> std::io::Result<Arc<WireHost>> {
        let gsi = GsiPort::open(ctx).map_err(std::io::Error::other)?;
        let local_ip = ctx.local_addr().ip();
        let gid = ip::gid_of(local_ip);
        let guid = 0x0200_0000_0000_0000
            | u64::from_be_bytes(gid[8..16].try_into().expect("8 bytes")) & 0xffff_ffff_ffff;
        let seed = std::process::id().wrapping_mul(0x85EB_CA6B) | 1;
        let host = Arc::new(WireHost {
            agent: OnceLock::new(),
            mailbox: Arc::new(Mailbox::default()),
            local_ip,
        });
        let mailbox = host.mailbox.clone();
        let agent = CmAgent::start(
            CmManager::new(gid, guid, seed),
            Box::new(gsi),
            Box::new(move |e| deliver(&mailbox, e)),
        )?;
        let _ = host.agent.set(agent);
        Ok(host)
    }

    fn agent(&self) -> &CmAgent {
        self.agent.get().expect("set at open")
    }

    /// Connects `qp` (in INIT, its receives posted) to the target's queue at `target`
    /// with the NVMe/RDMA request `req`; returns the connection and the target's accept.
    pub fn connect(
        self: &Arc<Self>,
        qp: &QueuePair,
        target: SocketAddr,
        req: &CmRequest,
        timeout: Duration,
    ) -> Result<(WireConn, CmAccept), HostError> {
        let receive_psn = super::random_psn().value();
        let mut local = qp.endpoint_info(Psn::new(0), None);
        let header = IpHeader {
            src: SocketAddr::new(self.local_ip, 0),
            dst: target.ip(),
        };
        let mut private = header.to_bytes().to_vec();
        private.extend_from_slice(&req.encode());
        let params = ConnectParams {
            dest_gid: ip::gid_of(target.ip()),
            local_gid: None,
            service_id: ip::service_id(ip::port_space::TCP, target.port()),
            qpn: qp.qpn(),
            starting_psn: receive_psn,
            responder_resources: 16,
            initiator_depth: 16,
            retry_count: 7,
            rnr_retry_count: 7,
            path_mtu: (local.mtu.bytes().trailing_zeros() - 7) as u8,
            transport_type: 0,
            srq: false,
            ece: (0, 0),
            private_data: private,
        };
        let conn = self
            .agent()
            .command(|m, now| m.connect(now, params))
            .map_err(|e| HostError::Protocol(format!("sending the REQ: {e}")))?;
        // Whatever happens next, no event of this connection waits in the mailbox after it.
        struct Forget<'a>(&'a Mailbox, ConnId);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                lock(&self.0.events).remove(&self.1);
            }
        }
        let _forget = Forget(&self.mailbox, conn);
        let deadline = Instant::now() + timeout;
        let rep = loop {
            match self.next_event(conn, deadline)? {
                CmEvent::Reply { rep, .. } => break rep,
                CmEvent::Rejected {
                    reason,
                    private_data,
                    ..
                } => {
                    return Err(match CmRejectStatus::parse(&private_data) {
                        Ok(s) if reason == rej_reason::CONSUMER_DEFINED => {
                            HostError::Exchange(ExchangeError::Rejected(s))
                        }
                        _ => HostError::Protocol(format!(
                            "the target rejected the queue (reason {reason})"
                        )),
                    })
                }
                CmEvent::Unreachable { .. } => {
                    return Err(HostError::Protocol(format!(
                        "no answer from {target}'s connection manager"
                    )))
                }
                _ => continue,
            }
        };
        let accept = CmAccept::parse(&rep.private_data)
            .map_err(|e| HostError::Protocol(format!("the target's accept: {e}")))?;
        // Each side names the PSN it receives from first: the REP's is where this side sends
        // from.
        local.psn = Psn::new(rep.starting_psn);
        let peer = EndpointInfo {
            qpn: rep.local_qpn,
            psn: Psn::new(receive_psn),
            gid: std::net::Ipv6Addr::from(ip::gid_of(target.ip())),
            udp_port: ferroce_wire::ROCE_V2_UDP_PORT,
            mtu: local.mtu,
            max_rd_atomic: rep.responder_resources.clamp(1, 16),
            region: None,
            acks_unasked: false,
            small_identifications: false,
            selective_repeat: false,
        };
        let opts = ConnectOptions {
            max_rd_atomic: rep.responder_resources.clamp(1, 16),
            ..ConnectOptions::default()
        };
        if let Err(e) = qp.connect(&local, &peer, &opts) {
            let _ = self
                .agent()
                .command(|m, _| m.reject(conn, rej_reason::CONSUMER_DEFINED, &[]));
            return Err(e.into());
        }
        // As the target's side does (see `wire`): what follows a gap is kept.
        qp.set_keep_out_of_order(true);
        let disconnected = Arc::new(AtomicBool::new(false));
        lock(&self.mailbox.live).insert(conn, disconnected.clone());
        self.agent()
            .command(|m, _| m.ready_to_use(conn, &[]))
            .map_err(|e| HostError::Protocol(format!("sending the RTU: {e}")))?;
        Ok((
            WireConn {
                host: self.clone(),
                conn,
                disconnected,
            },
            accept,
        ))
    }

    fn next_event(&self, conn: ConnId, deadline: Instant) -> Result<CmEvent, HostError> {
        let mut events = lock(&self.mailbox.events);
        loop {
            if let Some(e) = events.get_mut(&conn).and_then(VecDeque::pop_front) {
                return Ok(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(HostError::Timeout("the target's REP", Duration::ZERO));
            }
            events = self
                .mailbox
                .arrived
                .wait_timeout(events, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Where the agent's thread puts an event: a live connection's disconnect sets its flag;
/// the rest wait in the mailbox for the connecting thread.
fn deliver(mailbox: &Mailbox, e: CmEvent) {
    let conn = match &e {
        CmEvent::Reply { conn, .. }
        | CmEvent::Established { conn }
        | CmEvent::Rejected { conn, .. }
        | CmEvent::Unreachable { conn }
        | CmEvent::Disconnected { conn } => *conn,
        // A host listens for nothing: a REQ is answered by the manager's own rules.
        _ => return,
    };
    if let Some(flag) = lock(&mailbox.live).get(&conn) {
        if matches!(e, CmEvent::Disconnected { .. }) {
            flag.store(true, Ordering::Release);
        }
        return;
    }
    let mut events = lock(&mailbox.events);
    let q = events.entry(conn).or_default();
    // A connection nobody takes events for any more keeps at most a few.
    if q.len() < 8 {
        q.push_back(e);
    }
    drop(events);
    mailbox.arrived.notify_all();
}
