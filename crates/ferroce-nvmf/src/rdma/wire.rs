//! The target's queues connected through IB CM on the wire, as the Linux kernel's NVMe/RDMA
//! host (`nvme connect -t rdma`) connects them through its rdma_cm: a REQ to rdma_cm's service
//! ID for the port (TCP port space), whose private data is rdma_cm's IP header and then the
//! NVMe/RDMA request; a REP with the accept's private data, or a REJ with its status; a DREQ
//! ends the queue, and a queue that ends on the target's side sends one.
//!
//! The manager runs on QP1 of the target's context ([`ferroce::cm::ib`]), which must be the
//! host's one on RoCE's port 4791 (host slot 0) for kernel peers to reach it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ferroce::cm::ib::ip::{self, IpHeader, IP_HEADER_LEN};
use ferroce::cm::ib::{AcceptParams, CmAgent, CmEvent, CmManager, ConnId, GsiPort};
use ferroce::cm::EndpointInfo;
use ferroce::{PathMtu, Psn};
use ferroce_wire::cm::{rej_reason, Req};

use super::target::{check_request, QueueSetup, RdmaQueue, Server};
use crate::cm::{CmAccept, CmRejectStatus, CmRequest, RECFMT};

/// The wire CM of a serving target: listening while it lives.
pub struct WireListener {
    state: Arc<State>,
}

struct State {
    agent: OnceLock<CmAgent>,
    setup: QueueSetup,
    /// The queues' disconnect flags, by connection.
    queues: Mutex<HashMap<ConnId, Arc<AtomicBool>>>,
}

impl State {
    fn command<R>(&self, f: impl FnOnce(&mut CmManager, std::time::Instant) -> R) -> Option<R> {
        self.agent.get().map(|a| a.command(f))
    }

    fn reject(&self, conn: ConnId, status: CmRejectStatus) {
        self.setup
            .counters
            .queues_refused
            .fetch_add(1, Ordering::Relaxed);
        let _ = self.command(|m, _| m.reject(conn, rej_reason::CONSUMER_DEFINED, &status.encode()));
    }

    fn on_event(self: &Arc<Self>, e: CmEvent) {
        match e {
            CmEvent::Request {
                conn,
                from_gid,
                req,
                ..
            } => self.on_request(conn, from_gid, &req),
            CmEvent::Disconnected { conn } => {
                if let Some(flag) = lock(&self.queues).remove(&conn) {
                    flag.store(true, Ordering::Release);
                }
            }
            CmEvent::Rejected { conn, .. } | CmEvent::Unreachable { conn } => {
                if let Some(flag) = lock(&self.queues).remove(&conn) {
                    flag.store(true, Ordering::Release);
                }
            }
            _ => {}
        }
    }

    fn on_request(self: &Arc<Self>, conn: ConnId, from_gid: [u8; 16], req: &Req) {
        // rdma_cm's IP header, then the NVMe/RDMA request.
        let (Ok(_), Some(nvme)) = (
            IpHeader::parse(&req.private_data),
            req.private_data.get(IP_HEADER_LEN..),
        ) else {
            return self.reject(conn, CmRejectStatus::InvalidRecordFormat);
        };
        let Ok(nvme) = CmRequest::parse(nvme) else {
            return self.reject(conn, CmRejectStatus::InvalidRecordFormat);
        };
        let entries = match check_request(&nvme, &self.setup.limits) {
            Ok(n) => n,
            Err(r) => return self.reject(conn, r),
        };
        let Ok(mtu) = PathMtu::from_bytes(128u32 << req.path_mtu.min(5)) else {
            return self.reject(conn, CmRejectStatus::NoResources);
        };
        let Some(ticket) = self.setup.ticket() else {
            return self.reject(conn, CmRejectStatus::NoResources);
        };
        let Ok(q) = RdmaQueue::new(&self.setup, entries, nvme.qid == 0) else {
            return self.reject(conn, CmRejectStatus::NoResources);
        };
        // Each side names in its message the PSN it receives from first: the REQ's is where
        // this side sends from, and the REP's where the host does.
        let receive_psn = super::random_psn().value();
        let mut local = q.qp.endpoint_info(Psn::new(req.starting_psn), None);
        local.mtu = local.mtu.min(mtu);
        let peer = EndpointInfo {
            qpn: req.local_qpn,
            psn: Psn::new(receive_psn),
            gid: std::net::Ipv6Addr::from(from_gid),
            udp_port: ferroce_wire::ROCE_V2_UDP_PORT,
            mtu,
            max_rd_atomic: req.responder_resources.clamp(1, 16),
            region: None,
            acks_unasked: false,
            small_identifications: false,
            selective_repeat: false,
        };
        let mut opts = q.connect_options();
        opts.retry_cnt = req.retry_count.min(7);
        opts.rnr_retry = req.rnr_retry_count.min(7);
        if q.qp.connect(&local, &peer, &opts).is_err() {
            return self.reject(conn, CmRejectStatus::NoResources);
        }
        // A kernel host's SEND after a lost one, resent after the NAK and lost again, would
        // otherwise wait for its retransmission timer (see `set_keep_out_of_order`).
        q.qp.set_keep_out_of_order(true);
        let accept = AcceptParams {
            qpn: q.qp.qpn(),
            starting_psn: receive_psn,
            responder_resources: req.initiator_depth.min(16),
            initiator_depth: req.responder_resources.min(16),
            rnr_retry_count: 7,
            srq: false,
            ece: (0, 0),
            private_data: CmAccept {
                recfmt: RECFMT,
                crqsize: entries,
            }
            .encode()
            .to_vec(),
        };
        if !matches!(
            self.command(|m, now| m.accept(now, conn, accept)),
            Some(Ok(()))
        ) {
            return self.reject(conn, CmRejectStatus::NoResources);
        }
        let ended = Arc::new(AtomicBool::new(false));
        lock(&self.queues).insert(conn, ended.clone());
        self.setup
            .counters
            .queues_opened
            .fetch_add(1, Ordering::Relaxed);
        let state = self.clone();
        let spawned = std::thread::Builder::new()
            .name("nvmf-queue".into())
            .spawn(move || {
                let _ticket = ticket;
                let setup = state.setup.clone();
                q.run(&setup, &mut || ended.load(Ordering::Acquire));
                setup.counters.queues_closed.fetch_add(1, Ordering::Relaxed);
                // Ended here (not by the host's DREQ): the host hears of it.
                if lock(&state.queues).remove(&conn).is_some() {
                    let _ = state.command(|m, now| m.disconnect(now, conn, &[]));
                }
            });
        if spawned.is_err() {
            lock(&self.queues).remove(&conn);
            let _ = self.command(|m, now| m.disconnect(now, conn, &[]));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Server {
    /// Listens through IB CM on the wire for NVMe/RDMA hosts on `port` (rdma_cm's TCP port
    /// space, as the kernel's host connects): kernel hosts over rxe or RDMA NICs.
    pub fn listen_wire(&self, port: u16) -> std::io::Result<WireListener> {
        let setup = self.setup();
        let ctx = setup.ctx.clone();
        let gsi = GsiPort::open(&ctx).map_err(std::io::Error::other)?;
        let gid = ip::gid_of(ctx.local_addr().ip());
        // A CA GUID of this address: stable, and distinct between hosts.
        let guid = 0x0200_0000_0000_0000
            | u64::from_be_bytes(gid[8..16].try_into().expect("8 bytes")) & 0xffff_ffff_ffff;
        let seed = std::process::id().wrapping_mul(0x9E37_79B9) | 1;
        let mut manager = CmManager::new(gid, guid, seed);
        manager
            .listen(ip::service_id(ip::port_space::TCP, port))
            .map_err(std::io::Error::other)?;
        let state = Arc::new(State {
            agent: OnceLock::new(),
            setup,
            queues: Mutex::new(HashMap::new()),
        });
        // The agent's callback holds the state weakly: the state owns the agent, and the
        // listener's end drops both.
        let sink_state = Arc::downgrade(&state);
        // Held until the state has its agent: a REQ that comes first is answered then.
        let agent = CmAgent::start_held(
            manager,
            Box::new(gsi),
            Box::new(move |e| {
                if let Some(s) = sink_state.upgrade() {
                    s.on_event(e)
                }
            }),
        )?;
        state.agent.get_or_init(|| agent).release();
        Ok(WireListener { state })
    }
}

impl WireListener {
    /// Queues connected through the wire CM and not ended yet.
    pub fn queues(&self) -> usize {
        lock(&self.state.queues).len()
    }
}
