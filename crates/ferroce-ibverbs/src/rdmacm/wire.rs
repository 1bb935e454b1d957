//! rdma_cm over IB CM on the wire: how this librdmacm connects with the Linux kernel's rdma_cm
//! (rxe, RDMA NICs) in both roles.
//!
//! Each device an id uses gets one connection manager ([`ferroce::cm::ib`]: the protocol, its
//! retries and duplicates) on QP1 of the device's context, which `libibverbs.so.1` lends this
//! library through its `ferroce_gsi_*` calls (see that crate's `gsi` module). The manager's
//! events become the ids' rdma_cm events here:
//!
//! | IB CM | rdma_cm event |
//! |---|---|
//! | a REQ for a service an id listens on | `CONNECT_REQUEST` on a new id, with the private data after rdma_cm's IP header (56 bytes) |
//! | the REP to an id's REQ | the QP to RTR and RTS, the RTU sent, `ESTABLISHED` with the REP's private data (196 bytes) |
//! | the RTU to an id's REP | `ESTABLISHED` |
//! | a REJ | `REJECTED`, its reason as the status (8: no one listens; 28: the consumer's), its private data |
//! | no answer after every retry | `UNREACHABLE`, status `-ETIMEDOUT` |
//! | a DREQ, or the DREP to this side's DREQ (or its timeout) | `DISCONNECTED` |
//!
//! A service ID is rdma_cm's: the port space and the port ([`ferroce::cm::ib::ip`]). The
//! managers live as long as the process (the kernel's CM lives as long as the machine): they
//! are made on first use and never freed, so an event that comes after its id is gone finds
//! no route and is dropped, never a dangling id.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ferroce::cm::ib::ip::{self, IpHeader, IP_HEADER_LEN};
use ferroce::cm::ib::{AcceptParams, CmAgent, CmEvent, CmManager, ConnId, ConnectParams, MadPort};
use ferroce_wire::cm::rej_reason;
use ferroce_wire::mad::MAD_LEN;

use super::*;

type GsiOpenFn = unsafe extern "C" fn(*mut ibv_context) -> *mut c_void;
type GsiSendFn = unsafe extern "C" fn(*mut c_void, *const u8, *const u8) -> c_int;
type GsiRecvFn = unsafe extern "C" fn(*mut c_void, c_int, *mut u8, *mut u8) -> c_int;
type GsiCloseFn = unsafe extern "C" fn(*mut c_void);

/// QP1 of a context, through `libibverbs.so.1`'s `ferroce_gsi_*` calls.
struct CGsi {
    port: *mut c_void,
    send: GsiSendFn,
    recv: GsiRecvFn,
    close: GsiCloseFn,
}

// SAFETY: the port is a `ferroce::cm::ib::GsiPort`, whose send and receive take `&self` and are
// thread-safe (the QP's calls lock; receives are serialised by the port's own lock).
unsafe impl Send for CGsi {}
// SAFETY: as above.
unsafe impl Sync for CGsi {}

impl CGsi {
    fn open(ctx: *mut ibv_context) -> Option<CGsi> {
        let find = find_symbol;
        // SAFETY: each symbol is libibverbs' (ferroce's) function of that name, with the C
        // signature of the type it is read as (see its `gsi` module).
        let (open, send, recv, close) = unsafe {
            (
                std::mem::transmute::<*mut c_void, GsiOpenFn>(find(c"ferroce_gsi_open")?),
                std::mem::transmute::<*mut c_void, GsiSendFn>(find(c"ferroce_gsi_send")?),
                std::mem::transmute::<*mut c_void, GsiRecvFn>(find(c"ferroce_gsi_recv")?),
                std::mem::transmute::<*mut c_void, GsiCloseFn>(find(c"ferroce_gsi_close")?),
            )
        };
        // SAFETY: a live context of this process's libibverbs, never closed (contexts here are
        // opened once and kept).
        let port = unsafe { open(ctx) };
        (!port.is_null()).then_some(CGsi {
            port,
            send,
            recv,
            close,
        })
    }
}

impl MadPort for CGsi {
    fn send(&self, dest_gid: [u8; 16], mad: &[u8; MAD_LEN]) -> std::io::Result<()> {
        // SAFETY: our open port; 16 and 256 readable bytes.
        match unsafe { (self.send)(self.port, dest_gid.as_ptr(), mad.as_ptr()) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    }

    fn recv(&self, timeout: Duration) -> std::io::Result<Option<([u8; 16], Vec<u8>)>> {
        let mut gid = [0u8; 16];
        let mut mad = vec![0u8; MAD_LEN];
        let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
        // SAFETY: our open port; 16 and 256 writable bytes.
        match unsafe { (self.recv)(self.port, ms, gid.as_mut_ptr(), mad.as_mut_ptr()) } {
            1 => Ok(Some((gid, mad))),
            0 => Ok(None),
            _ => Err(std::io::Error::last_os_error()),
        }
    }
}

impl Drop for CGsi {
    fn drop(&mut self) {
        // SAFETY: our port, closed once.
        unsafe { (self.close)(self.port) };
    }
}

/// What an id is on the wire: a connection (or an active UD id's service resolution) by the
/// manager's ID, or a service resolution received for a listener, by a handle of this
/// library's (the requester's own request ID is not unique: any peer picks its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WireId {
    /// A connection, or an active UD id's SIDR_REQ.
    Conn(ConnId),
    /// A SIDR_REQ received, waiting for `rdma_accept` or `rdma_reject`.
    Sidr(u32),
}

/// An id's connection, as the manager's events find it.
struct Route {
    shared: Arc<IdShared>,
    id: usize,
    /// The active side's QP parameters and the passive side's IP, for its RTR and RTS when
    /// the REP comes.
    active: Option<(Local, Params, IpAddr)>,
    /// A UD id's service resolution (SIDR): the passive side's GID and this side's GID index,
    /// for the address handle its `ESTABLISHED` event carries.
    ud: Option<([u8; 16], u8)>,
}

/// A listening id, as a REQ for its service finds it.
struct Listen {
    shared: Arc<IdShared>,
    of: ListenOf,
    /// The address it is bound to (an unspecified IP takes any of the device's).
    bound: IpAddr,
}

/// The connection manager of one device.
pub(super) struct WireCm {
    agent: OnceLock<CmAgent>,
    dev: Device,
    routes: Mutex<HashMap<ConnId, Route>>,
    /// The listening ids of each service: several, bound to different addresses.
    listens: Mutex<HashMap<u64, Vec<Listen>>>,
    /// Service resolutions (SIDR_REQ) reported to a listener and not answered yet, by handle.
    sidr_requests: Mutex<HashMap<u32, SidrWaiting>>,
    next_sidr: std::sync::atomic::AtomicU32,
}

/// A service resolution waiting for the program's answer.
struct SidrWaiting {
    /// The requester's GID.
    gid: [u8; 16],
    /// Its request ID.
    request_id: u32,
    /// The request's transaction ID.
    transaction_id: u64,
    /// The service it names.
    service_id: u64,
}

/// One manager per context (and so per device: contexts are opened once per device).
static MANAGERS: Mutex<Vec<(usize, &'static WireCm)>> = Mutex::new(Vec::new());

/// At exit, every connection still up is disconnected (a DREQ each), as the kernel's rdma_cm
/// does when a process's last descriptor closes: a peer that only receives would otherwise
/// never learn that this process is gone. The engine first gets a moment to send what was
/// posted (the DREQ would otherwise overtake the last data). Nothing here waits for a lock
/// another thread holds (the exit may have interrupted it); a child made by `fork` (which has
/// the parent's table but not its threads, nor its connections to end) does nothing.
extern "C" fn disconnect_all_at_exit() {
    crate::guard((), || {
        if EXIT_PID.load(Ordering::Relaxed) != std::process::id() {
            return;
        }
        let Ok(all) = MANAGERS.try_lock() else { return };
        let mut live: Vec<(&'static WireCm, Vec<ConnId>)> = Vec::new();
        for (_, cm) in all.iter() {
            if let Ok(routes) = cm.routes.try_lock() {
                if !routes.is_empty() {
                    live.push((cm, routes.keys().copied().collect()));
                }
            }
        }
        drop(all);
        if live.is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        for (cm, conns) in live {
            let Some(agent) = cm.agent() else { continue };
            for conn in conns {
                let _ = agent.try_command(|m, now| m.disconnect(now, conn, &[]));
            }
        }
        // The DREQs were posted; an engine thread busy at that moment sends them on its
        // next pass, which this short wait leaves it.
        std::thread::sleep(std::time::Duration::from_millis(20));
    })
}

/// The process that registered [`disconnect_all_at_exit`].
static EXIT_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The manager of `dev` (whose RoCE address is `ip`), started on first use; `None` when QP1
/// cannot be had (a context of another library, or none).
pub(super) fn manager(dev: Device, ip: IpAddr) -> Option<&'static WireCm> {
    let mut all = MANAGERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = all.iter().find(|(c, _)| *c == dev.ctx as usize) {
        return Some(m);
    }
    let port = CGsi::open(dev.ctx)?;
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    AT_EXIT.call_once(|| {
        EXIT_PID.store(std::process::id(), Ordering::Relaxed);
        // SAFETY: registers a function with C's ABI that takes nothing, once.
        unsafe { libc::atexit(disconnect_all_at_exit) };
    });
    let gid = ip::gid_of(ip);
    // A CA GUID of this address: stable, and distinct between hosts, which the kernel's CM
    // uses (with the QPN) to tell connections apart.
    let guid =
        0x0200_0000_0000_0000 | u64::from_be_bytes(gid[8..16].try_into().ok()?) & 0xffff_ffff_ffff;
    let cm: &'static WireCm = Box::leak(Box::new(WireCm {
        agent: OnceLock::new(),
        dev,
        routes: Mutex::new(HashMap::new()),
        listens: Mutex::new(HashMap::new()),
        sidr_requests: Mutex::new(HashMap::new()),
        next_sidr: std::sync::atomic::AtomicU32::new(1),
    }));
    let manager = CmManager::new(gid, guid, random_psn() << 8 | 1);
    // Held until `cm` has its agent: a REQ that comes first is answered then, not dropped.
    let agent =
        CmAgent::start_held(manager, Box::new(port), Box::new(move |e| cm.on_event(e))).ok()?;
    cm.agent.get_or_init(|| agent).release();
    all.push((dev.ctx as usize, cm));
    Some(cm)
}

/// How `rdma_connect` reaches the passive side (`FERROCE_RDMA_CM`): `auto` (the default)
/// tries ferroce's TCP exchange first, which finds a ferroce listener in any host slot, and,
/// toward another host, IB CM on the wire when nothing answers it (a kernel's rdma_cm); `ib`
/// goes on the wire at once; `tcp` never does (and a listener takes no REQs from the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Auto,
    Ib,
    Tcp,
}

pub(super) fn mode() -> Mode {
    match std::env::var("FERROCE_RDMA_CM").as_deref() {
        Ok("ib") => Mode::Ib,
        Ok("tcp") => Mode::Tcp,
        _ => Mode::Auto,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl WireCm {
    fn agent(&self) -> Option<&CmAgent> {
        self.agent.get()
    }

    /// Takes REQs for `service_id` to `bound` for the listening id (beside other ids that
    /// listen on the same service at other addresses).
    pub(super) fn listen(
        &self,
        service_id: u64,
        shared: Arc<IdShared>,
        of: ListenOf,
        bound: IpAddr,
    ) -> bool {
        let Some(agent) = self.agent() else {
            return false;
        };
        let mut listens = lock(&self.listens);
        let list = listens.entry(service_id).or_default();
        if list
            .iter()
            .any(|l| l.bound == bound || l.bound.is_unspecified() || bound.is_unspecified())
        {
            return false;
        }
        if list.is_empty() && agent.command(|m, _| m.listen(service_id)).is_err() {
            return false;
        }
        list.push(Listen { shared, of, bound });
        true
    }

    /// Stops taking REQs for `service_id` for the listening id whose shared part is `shared`.
    pub(super) fn unlisten(&self, service_id: u64, shared: &Arc<IdShared>) {
        let mut listens = lock(&self.listens);
        let Some(list) = listens.get_mut(&service_id) else {
            return;
        };
        list.retain(|l| !Arc::ptr_eq(&l.shared, shared));
        if list.is_empty() {
            listens.remove(&service_id);
            if let Some(agent) = self.agent() {
                agent.command(|m, _| m.unlisten(service_id));
            }
        }
    }

    /// Sends the REQ of an active id; its events follow.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn connect(
        &self,
        shared: Arc<IdShared>,
        id: usize,
        local: Local,
        params: Params,
        req: ConnectParams,
    ) -> Option<ConnId> {
        let agent = self.agent()?;
        // The route and the id's `wire` are in place before the REQ leaves, so the REP (or a
        // REJ) cannot come first; an id destroyed meanwhile is released either by
        // `rdma_destroy_id` (which finds `wire` set) or here (which finds it dead).
        let mut routes = lock(&self.routes);
        if !shared.alive.load(Ordering::Acquire) {
            return None;
        }
        let peer_ip = ip::ip_of_gid(req.dest_gid);
        let conn = agent.command(|m, now| m.connect(now, req)).ok()?;
        let active = Some((local, params, peer_ip));
        let route = Route {
            shared: shared.clone(),
            id,
            active,
            ud: None,
        };
        routes.insert(conn, route);
        *lock(&shared.wire) = Some((self as *const WireCm as usize, WireId::Conn(conn)));
        drop(routes);
        if !shared.alive.load(Ordering::Acquire) {
            self.release(WireId::Conn(conn));
        }
        Some(conn)
    }

    /// Answers a request with a REP.
    pub(super) fn accept(&self, conn: ConnId, p: AcceptParams) -> bool {
        self.agent()
            .is_some_and(|a| a.command(|m, now| m.accept(now, conn, p)).is_ok())
    }

    /// Rejects a request (the consumer's reason, 28); `false` when the private data does not
    /// fit a REJ (148 bytes) or the request is not waiting.
    pub(super) fn reject(&self, conn: ConnId, private: &[u8]) -> bool {
        if private.len() > ferroce_wire::cm::private_len::REJ {
            return false;
        }
        let done = self.agent().is_some_and(|a| {
            a.command(|m, _| m.reject(conn, rej_reason::CONSUMER_DEFINED, private))
                .is_ok()
        });
        if done {
            lock(&self.routes).remove(&conn);
        }
        done
    }

    /// Sends a DREQ (or abandons a connection being set up); `DISCONNECTED` follows. A
    /// connection already over is left as it is, and that is no error (the kernel's
    /// `rdma_disconnect` answers so too).
    pub(super) fn disconnect(&self, conn: ConnId) {
        if let Some(a) = self.agent() {
            let _ = a.command(|m, now| m.disconnect(now, conn, &[]));
        }
    }

    /// The id is gone: no more events for it; a connection still up is disconnected, as the
    /// kernel's `ib_destroy_cm_id` does; a service resolution not answered yet is refused
    /// (SIDR status 2), as its `cm_destroy_id` does.
    pub(super) fn release(&self, id: WireId) {
        match id {
            WireId::Conn(conn) => {
                lock(&self.routes).remove(&conn);
                self.disconnect(conn);
            }
            WireId::Sidr(handle) => {
                self.answer_service(handle, 2, 0, &[]);
            }
        }
    }

    fn route(&self, conn: ConnId, remove: bool) -> Option<Route> {
        let mut routes = lock(&self.routes);
        if remove {
            routes.remove(&conn)
        } else {
            routes.get(&conn).map(|r| Route {
                shared: r.shared.clone(),
                id: r.id,
                active: r.active,
                ud: r.ud,
            })
        }
    }

    fn on_event(&'static self, e: CmEvent) {
        let Some(agent) = self.agent() else { return };
        match e {
            CmEvent::Request {
                conn,
                from_gid,
                req,
                ece_options,
            } => {
                if !self.on_request(conn, from_gid, &req, ece_options) {
                    let _ =
                        agent.command(|m, _| m.reject(conn, rej_reason::INVALID_SERVICE_ID, &[]));
                }
            }
            CmEvent::Reply {
                conn,
                rep,
                ece_options,
            } => {
                let Some(r) = self.route(conn, false) else {
                    let reason = rej_reason::CONSUMER_DEFINED;
                    let _ = agent.command(|m, _| m.reject(conn, reason, &[]));
                    return;
                };
                let Some((local, params, peer_ip)) = r.active else {
                    return;
                };
                let peer = Peer {
                    qpn: rep.local_qpn,
                    psn: rep.starting_psn,
                    gid: ip::gid_of(peer_ip),
                    mtu: local.device.mtu as u8,
                    responder_resources: rep.responder_resources,
                    initiator_depth: rep.initiator_depth,
                    retry_count: params.retry_count,
                    rnr_retry_count: rep.rnr_retry_count,
                    ece: (rep.vendor_id != 0).then_some(Ece {
                        vendor_id: vendor_from_wire(rep.vendor_id),
                        options: ece_options,
                    }),
                };
                let (local, peer) = swap_psns(local, peer);
                let remote = peer.ece.unwrap_or_default();
                *lock(&r.shared.remote_ece) = remote;
                let connected = {
                    let qp = lock(&r.shared.qp);
                    if !r.shared.alive.load(Ordering::Acquire) {
                        // Destroyed meanwhile: the peer hears of it now, not after its retries.
                        drop(qp);
                        self.route(conn, true);
                        let reason = rej_reason::CONSUMER_DEFINED;
                        let _ = agent.command(|m, _| m.reject(conn, reason, &[]));
                        return;
                    }
                    let qp = *qp as *mut ibv_qp;
                    if let (false, Some(v)) = (qp.is_null(), verbs()) {
                        set_peer_ece(v, qp, local.ece, remote);
                    }
                    connect_qp(qp, &local, &peer, &params)
                };
                let id = r.id as *mut rdma_cm_id;
                if let Err(rc) = connected {
                    self.route(conn, true);
                    let _ = agent.command(|m, _| m.reject(conn, rej_reason::NO_RESOURCES, &[]));
                    r.shared.post(event(id, RDMA_CM_EVENT_CONNECT_ERROR, -rc));
                    return;
                }
                let _ = agent.command(|m, _| m.ready_to_use(conn, &[]));
                let mut e = event(id, RDMA_CM_EVENT_ESTABLISHED, 0);
                e.private = rep.private_data.clone();
                e.c.param.conn.responder_resources = rep.initiator_depth;
                e.c.param.conn.initiator_depth = rep.responder_resources;
                e.c.param.conn.qp_num = rep.local_qpn;
                r.shared.post(e);
            }
            CmEvent::Established { conn } => {
                if let Some(r) = self.route(conn, false) {
                    r.shared
                        .post(event(r.id as *mut rdma_cm_id, RDMA_CM_EVENT_ESTABLISHED, 0));
                }
            }
            CmEvent::Rejected {
                conn,
                reason,
                private_data,
            } => {
                if let Some(r) = self.route(conn, true) {
                    let mut e = event(
                        r.id as *mut rdma_cm_id,
                        RDMA_CM_EVENT_REJECTED,
                        c_int::from(reason),
                    );
                    e.private = private_data;
                    *lock(&r.shared.wire) = None;
                    r.shared.post(e);
                }
            }
            CmEvent::Unreachable { conn } => {
                if let Some(r) = self.route(conn, true) {
                    *lock(&r.shared.wire) = None;
                    r.shared.post(event(
                        r.id as *mut rdma_cm_id,
                        RDMA_CM_EVENT_UNREACHABLE,
                        -libc::ETIMEDOUT,
                    ));
                }
            }
            CmEvent::Disconnected { conn } => {
                if let Some(r) = self.route(conn, true) {
                    r.shared.post(event(
                        r.id as *mut rdma_cm_id,
                        RDMA_CM_EVENT_DISCONNECTED,
                        0,
                    ));
                }
            }
            CmEvent::ServiceRequest {
                request,
                transaction_id,
                from_gid,
                req,
            } => {
                let handle = self.next_sidr.fetch_add(1, Ordering::Relaxed);
                let waiting = SidrWaiting {
                    gid: from_gid,
                    request_id: request,
                    transaction_id,
                    service_id: req.service_id,
                };
                lock(&self.sidr_requests).insert(handle, waiting);
                if !self.on_service_request(handle, from_gid, &req) {
                    // No UD listener for that address: "service ID not supported".
                    self.answer_service(handle, 1, 0, &[]);
                }
            }
            CmEvent::ServiceReply { request, rep } => {
                let Some(r) = self.route(request, true) else {
                    return;
                };
                let id = r.id as *mut rdma_cm_id;
                *lock(&r.shared.wire) = None;
                let (Some(rep), Some((gid, gid_index))) = (rep, r.ud) else {
                    r.shared
                        .post(event(id, RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT));
                    return;
                };
                if rep.status != 0 {
                    let status = c_int::from(rep.status);
                    r.shared.post(event(id, RDMA_CM_EVENT_UNREACHABLE, status));
                    return;
                }
                let mut e = event(id, RDMA_CM_EVENT_ESTABLISHED, 0);
                e.private = rep.private_data.clone();
                let mut ah = ibv_ah_attr {
                    is_global: 1,
                    port_num: 1,
                    ..Default::default()
                };
                ah.grh.dgid = ibv_gid { raw: gid };
                ah.grh.sgid_index = gid_index;
                ah.grh.hop_limit = 64;
                e.c.param.ud.ah_attr = ah;
                e.c.param.ud.qp_num = rep.qpn;
                e.c.param.ud.qkey = rep.qkey;
                r.shared.post(e);
            }
        }
    }

    /// The listener a REQ or SIDR_REQ for `service_id` is for, with rdma_cm's IP header from
    /// the front of its `private_data`: none when nothing listens on the service, the header
    /// is unreadable, or the listener is bound to another address than the header names.
    fn listener_for(
        &self,
        service_id: u64,
        private_data: &[u8],
    ) -> Option<(Arc<IdShared>, ListenOf, IpHeader)> {
        let header = IpHeader::parse(private_data).ok()?;
        let listens = lock(&self.listens);
        let list = listens.get(&service_id)?;
        let l = list
            .iter()
            .find(|l| l.bound == header.dst)
            .or_else(|| list.iter().find(|l| l.bound.is_unspecified()))?;
        Some((l.shared.clone(), l.of, header))
    }

    /// A REQ for a listened service: a new id reported to the listener. `false` when the
    /// REQ is not for this listener (another address) or its IP header is unreadable.
    fn on_request(
        &'static self,
        conn: ConnId,
        from_gid: [u8; 16],
        req: &ferroce_wire::cm::Req,
        ece: u32,
    ) -> bool {
        let Some((shared, of, header)) = self.listener_for(req.service_id, &req.private_data)
        else {
            return false;
        };
        // A REQ connects RC QPs: a UD listener takes SIDR only (the kernel's
        // `cma_check_req_qp_type`).
        if of.ps == RDMA_PS_UDP {
            return false;
        }
        let mut child_shared = None;
        let port = ip::service_port(req.service_id).map_or(0, |p| p.1);
        let peer = Peer {
            qpn: req.local_qpn,
            psn: req.starting_psn,
            gid: from_gid,
            mtu: req.path_mtu,
            responder_resources: req.responder_resources,
            initiator_depth: req.initiator_depth,
            retry_count: req.retry_count,
            rnr_retry_count: req.rnr_retry_count,
            ece: (req.vendor_id != 0).then_some(Ece {
                vendor_id: vendor_from_wire(req.vendor_id),
                options: ece,
            }),
        };
        let local = SocketAddr::new(header.dst, port);
        let private = req.private_data[IP_HEADER_LEN..].to_vec();
        let me = self as *const WireCm as usize;
        let mut routes = lock(&self.routes);
        let child = post_request(
            &of,
            &shared,
            self.dev,
            (local, header.src),
            peer,
            private,
            |c| {
                *lock(&c.shared.wire) = Some((me, WireId::Conn(conn)));
                child_shared = Some(c.shared.clone());
            },
        );
        let (Some(child), Some(shared)) = (child, child_shared) else {
            return false;
        };
        let route = Route {
            shared,
            id: child as usize,
            active: None,
            ud: None,
        };
        routes.insert(conn, route);
        true
    }
}

/// The PSNs of a connection made on the wire, as `connect_qp` takes them (`local.psn` its send
/// PSN, `peer.psn` its receive PSN): the kernel's CM has each side's REQ or REP carry the PSN
/// that side expects to *receive* (in `rping_rdmacm.pcap` the passive side sends from the
/// REQ's starting PSN and the active side from the REP's), so the PSN an id advertised is its
/// receive PSN and the peer's is its send PSN.
pub(super) fn swap_psns(mut local: Local, mut peer: Peer) -> (Local, Peer) {
    std::mem::swap(&mut local.psn, &mut peer.psn);
    (local, peer)
}

impl WireCm {
    /// A SIDR_REQ for a listened UDP service: a new id reported to the listener, answered by
    /// `rdma_accept` (the QP) or `rdma_reject`. `false` when no listener takes it.
    fn on_service_request(
        &'static self,
        handle: u32,
        from_gid: [u8; 16],
        req: &ferroce_wire::cm::SidrReq,
    ) -> bool {
        let Some((shared, of, header)) = self.listener_for(req.service_id, &req.private_data)
        else {
            return false;
        };
        // SIDR resolves UD services only.
        if of.ps != RDMA_PS_UDP {
            return false;
        }
        let port = ip::service_port(req.service_id).map_or(0, |p| p.1);
        let peer = Peer {
            qpn: 0,
            psn: 0,
            gid: from_gid,
            mtu: self.dev.mtu as u8,
            responder_resources: 0,
            initiator_depth: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            ece: None,
        };
        let local = SocketAddr::new(header.dst, port);
        let private = req.private_data[IP_HEADER_LEN..].to_vec();
        let me = self as *const WireCm as usize;
        post_request(
            &of,
            &shared,
            self.dev,
            (local, header.src),
            peer,
            private,
            |c| {
                *lock(&c.shared.wire) = Some((me, WireId::Sidr(handle)));
            },
        )
        .is_some()
    }

    /// Answers a service resolution: `status` 0 with the QP, 1 for no service, 2 rejected.
    fn answer_service(&self, handle: u32, status: u8, qpn: u32, private: &[u8]) -> bool {
        let Some(w) = lock(&self.sidr_requests).remove(&handle) else {
            return false;
        };
        let (gid, tid) = (w.gid, w.transaction_id);
        let answer = ferroce_wire::cm::SidrRep {
            request_id: w.request_id,
            status,
            qpn,
            service_id: w.service_id,
            qkey: if status == 0 { RDMA_UDP_QKEY } else { 0 },
            private_data: private.to_vec(),
            ..Default::default()
        };
        self.agent().is_some_and(|a| {
            a.command(|m, now| m.answer_service(now, gid, tid, answer))
                .is_ok()
        })
    }

    /// `rdma_reject` of a UD request: SIDR status 2, rejected; `false` when the private data
    /// does not fit a SIDR_REP (136 bytes) or the request is not waiting.
    pub(super) fn reject_ud(&self, handle: u32, private: &[u8]) -> bool {
        private.len() <= ferroce_wire::cm::private_len::SIDR_REP
            && self.answer_service(handle, 2, 0, private)
    }
}

/// `rdma_connect` of a UD id (rdma_cm's UDP port space): a SIDR_REQ to the service of `dst`'s
/// port; `ESTABLISHED` with the address handle, QPN and Q_Key to send to when the answer
/// comes, `UNREACHABLE` when it says no or never comes. UD resolution always goes on the
/// wire, so a listener on this host must be its address's first ferroce process (host slot
/// 0), the one QP1 reaches.
pub(super) fn resolve_ud(
    i: &mut CmId,
    id: *mut rdma_cm_id,
    dst: SocketAddr,
    private: &[u8],
) -> c_int {
    if private.len() > ferroce_wire::cm::private_len::SIDR_REQ - IP_HEADER_LEN {
        set_errno(libc::EINVAL);
        return -1;
    }
    let Some(dev) = i.device else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let src = source_port_of(i);
    let Some((cm, agent)) = manager(dev, src.ip()).and_then(|cm| Some((cm, cm.agent()?))) else {
        set_errno(libc::ENETUNREACH);
        return -1;
    };
    let mut data = IpHeader { src, dst: dst.ip() }.to_bytes().to_vec();
    data.extend_from_slice(private);
    let gid = ip::gid_of(dst.ip());
    let service = ip::service_id(RDMA_PS_UDP as u16, dst.port());
    // The route is in place before the request leaves, so the answer cannot come first.
    let mut routes = lock(&cm.routes);
    let Ok(request) = agent.command(|m, now| m.resolve_service(now, gid, service, data)) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let shared = i.shared.clone();
    *lock(&shared.wire) = Some((cm as *const WireCm as usize, WireId::Conn(request)));
    let route = Route {
        shared,
        id: id as usize,
        active: None,
        ud: Some((gid, dev.gid_index)),
    };
    routes.insert(request, route);
    drop(routes);
    // SAFETY: our live id.
    unsafe { wait_sync(id, RDMA_CM_EVENT_ESTABLISHED) }
}

/// `rdma_accept` of a UD request: the SIDR_REP with the program's QP (`qp_num`, else the id's)
/// and rdma_cm's Q_Key.
pub(super) fn answer_ud(i: &mut CmId, p: &rdma_conn_param) -> c_int {
    let Some((cm, WireId::Sidr(request))) = of_id(&i.shared) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let qpn = if p.qp_num != 0 {
        p.qp_num
    } else if !i.c.qp.is_null() {
        // SAFETY: the id's live QP.
        unsafe { (*i.c.qp).qp_num }
    } else {
        set_errno(libc::EINVAL);
        return -1;
    };
    // SAFETY: the program's private data.
    let private = unsafe { private_of(p) };
    if private.len() > ferroce_wire::cm::private_len::SIDR_REP {
        set_errno(libc::EINVAL);
        return -1;
    }
    if !cm.answer_service(request, 0, qpn, &private) {
        set_errno(libc::ECONNRESET);
        return -1;
    }
    *lock(&i.shared.wire) = None;
    0
}

/// IB CM carries a 24-bit ECE vendor ID; ferroce's is 32 bits ("FRCE"), so its low 24 bits
/// on the wire stand for it.
fn vendor_from_wire(v: u32) -> u32 {
    if v == crate::qp::ECE_VENDOR_ID & 0x00ff_ffff {
        crate::qp::ECE_VENDOR_ID
    } else {
        v
    }
}

/// The manager an id's `wire` field names.
pub(super) fn of_id(shared: &IdShared) -> Option<(&'static WireCm, WireId)> {
    let w = (*lock(&shared.wire))?;
    // SAFETY: managers are leaked boxes, never freed; the address is one of them.
    Some((unsafe { &*(w.0 as *const WireCm) }, w.1))
}

/// rdma_cm's REQ for an active id: its QP, the service of `dst`'s port, the IP header and
/// the program's private data after it.
pub(super) fn request_params(
    ps: rdma_port_space,
    src: SocketAddr,
    dst: SocketAddr,
    qp: *mut ibv_qp,
    local: &Local,
    p: &Params,
    private: &[u8],
) -> Option<ConnectParams> {
    if qp.is_null() {
        return None;
    }
    let header = IpHeader { src, dst: dst.ip() };
    let mut data = header.to_bytes().to_vec();
    data.extend_from_slice(private);
    // SAFETY: the id's live QP (the caller holds the id).
    let (qpn, srq) = unsafe { ((*qp).qp_num, !(*qp).srq.is_null()) };
    Some(ConnectParams {
        dest_gid: ip::gid_of(dst.ip()),
        local_gid: Some(ip::gid_of(src.ip())),
        service_id: ip::service_id(ps as u16, dst.port()),
        qpn,
        starting_psn: local.psn,
        responder_resources: p.responder_resources.clamp(1, MAX_DEPTH),
        initiator_depth: p.initiator_depth.clamp(1, MAX_DEPTH),
        retry_count: p.retry_count.min(7),
        rnr_retry_count: p.rnr_retry_count.min(7),
        path_mtu: local.device.mtu as u8,
        transport_type: 0,
        srq,
        ece: (local.ece.vendor_id & 0x00ff_ffff, local.ece.options),
        private_data: data,
    })
}
