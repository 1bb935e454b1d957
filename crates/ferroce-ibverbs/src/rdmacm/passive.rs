//! The passive side: `rdma_listen`, the ids its requests become, `rdma_accept`, `rdma_reject`
//! and the synchronous `rdma_get_request`.

use super::*;

/// `rdma_listen`: each REQ on the bound address becomes a new id in `CONNECT_REQUEST`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, _backlog: c_int) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let Some(listener) = i.listener.as_ref().and_then(|l| l.try_clone().ok()) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let shared = i.shared.clone();
        let listen = ListenOf {
            id: id as usize,
            context: i.c.context as usize,
            ps: i.c.ps,
            sync: i.sync,
        };
        listen_on_wire(i, listen);
        spawn_helper(move || {
            for conn in listener.incoming() {
                if !shared.alive.load(Ordering::Acquire) {
                    return;
                }
                let Ok(mut s) = conn else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let _ = s.set_nodelay(true);
                let Ok(m) = Message::read(&mut s) else {
                    continue;
                };
                let Some((peer, private)) = peer_of(&m) else {
                    continue;
                };
                let (Ok(local), Ok(remote)) = (s.local_addr(), s.peer_addr()) else {
                    continue;
                };
                // A dual-stack listener (bound to `::`) sees an IPv4 peer as ::ffff:a.b.c.d:
                // the connection is IPv4, and so are its device and addresses.
                let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
                let (local, remote) = (canonical(local), canonical(remote));
                let Some(dev) = device_for(local.ip()) else {
                    let _ = s.write_all(
                        &Message::Reject {
                            private: Vec::new(),
                        }
                        .encode(),
                    );
                    continue;
                };
                post_request(&listen, &shared, dev, (local, remote), peer, private, |c| {
                    *c.shared.stream.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
                });
            }
        });
        0
    })
}

/// Takes REQs on the wire for a listening id's service too (unless `FERROCE_RDMA_CM=tcp`):
/// on its device, or, bound to any address, on every device.
pub(super) fn listen_on_wire(i: &mut CmId, listen: ListenOf) {
    let Some(bound) = src_addr(i) else { return };
    // No REQ on the wire names a loopback address: such a listener serves this host only,
    // through the TCP exchange.
    if wire::mode() == wire::Mode::Tcp || bound.ip().is_loopback() {
        return;
    }
    // Bound to `::`, the id takes IPv4 requests too, as the kernel's rdma_cm does unless the
    // program asks for IPv6 only (`RDMA_OPTION_ID_AFONLY`; the kernel's default follows
    // `net.ipv6.bindv6only`, 0): iperf3's server under `librspreload.so` listens so.
    let dual_stack = bound.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) && !i.afonly;
    let targets: Vec<(Device, IpAddr)> = match i.device {
        Some(dev) => vec![(dev, bound.ip())],
        None => ferroce::devices()
            .unwrap_or_default()
            .iter()
            .flat_map(|d| {
                let gids: Vec<IpAddr> = d.gids().iter().map(|g| g.ip).collect();
                let v4 = gids.iter().copied().find(IpAddr::is_ipv4);
                let v6 = gids.iter().copied().find(IpAddr::is_ipv6);
                match (bound.is_ipv4(), dual_stack) {
                    (true, _) => vec![v4],
                    (false, false) => vec![v6],
                    (false, true) => vec![v4, v6],
                }
            })
            .flatten()
            .filter_map(|ip| Some((device_for(ip)?, ip)))
            .collect(),
    };
    let service = ferroce::cm::ib::ip::service_id(i.c.ps as u16, bound.port());
    for (dev, ip) in targets {
        if let Some(cm) = wire::manager(dev, ip) {
            if cm.listen(service, i.shared.clone(), listen, bound.ip()) {
                i.wire_listens.push((cm, service));
            }
        }
    }
}

/// What a listening id's requests are made from, copied so that a thread may keep it.
#[derive(Clone, Copy)]
pub(super) struct ListenOf {
    pub(super) id: usize,
    pub(super) context: usize,
    pub(super) ps: rdma_port_space,
    pub(super) sync: bool,
}

/// Makes the id of a request to the listener `listen` (whose shared part is `shared`) between
/// `addrs` (local, remote) on `dev`, lets `prepare` tie it to its connection, and reports it
/// as `CONNECT_REQUEST` with the requester's `private` data. A synchronous listener's requests
/// become synchronous ids, each with a channel of its own; the request itself is reported on
/// the listener's. Returns the new id, or `None` when none was made or the listener is gone
/// (then the id is dropped and nothing is reported).
pub(super) fn post_request(
    listen: &ListenOf,
    shared: &Arc<IdShared>,
    dev: Device,
    addrs: (SocketAddr, SocketAddr),
    peer: Peer,
    private: Vec<u8>,
    prepare: impl FnOnce(&mut CmId),
) -> Option<*mut CmId> {
    let child = if listen.sync {
        new_sync_id(listen.context as *mut c_void, listen.ps)?
    } else {
        new_id(
            shared.channel.load(Ordering::Acquire) as *mut rdma_event_channel,
            shared.queue().clone(),
            listen.context as *mut c_void,
            listen.ps,
        )
    };
    // SAFETY: just made, not yet handed out.
    let c = unsafe { &mut *child };
    set_route(c, dev, addrs.0, Some(addrs.1));
    c.c.route.path_rec = &mut *c.path;
    c.c.route.num_paths = 1;
    *c.shared
        .remote_ece
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = peer.ece.unwrap_or_default();
    let mut e = event(child.cast(), RDMA_CM_EVENT_CONNECT_REQUEST, 0);
    e.c.listen_id = listen.id as *mut rdma_cm_id;
    e.private = private;
    // What the requester serves and asks, from this side's view.
    e.c.param.conn.responder_resources = peer.initiator_depth;
    e.c.param.conn.initiator_depth = peer.responder_resources;
    e.c.param.conn.retry_count = peer.retry_count;
    e.c.param.conn.rnr_retry_count = peer.rnr_retry_count;
    e.c.param.conn.qp_num = peer.qpn;
    c.request = Some(peer);
    prepare(c);
    // A listening id destroyed meanwhile takes no event: the new id is dropped.
    if shared.alive.load(Ordering::Acquire) {
        shared.post(e);
        Some(child)
    } else {
        // SAFETY: never handed out.
        drop(unsafe { Box::from_raw(child) });
        None
    }
}

/// Acknowledges the request event `rdma_get_request` kept on a synchronous id for the program
/// to read (its private data), once the program answers the request.
pub(super) fn release_request_event(i: &mut CmId) {
    if i.sync && !i.c.event.is_null() {
        // SAFETY: an event of ours, not acknowledged yet, acknowledged once (then cleared).
        unsafe { rdma_ack_cm_event(i.c.event) };
        i.c.event = std::ptr::null_mut();
    }
}

/// `rdma_accept`: brings the QP to RTS toward the requester and sends the REP;
/// `ESTABLISHED` when the RTU arrives.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_accept(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        release_request_event(i);
        if i.c.ps == RDMA_PS_UDP {
            // SAFETY: per the API, NULL or the program's parameters.
            let p = unsafe { param.as_ref() }.copied().unwrap_or_default();
            return wire::answer_ud(i, &p);
        }
        let Some(peer) = i.request.clone() else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: per the API, NULL or the program's parameters.
        let p = unsafe { param.as_ref() }
            .copied()
            .unwrap_or(rdma_conn_param {
                responder_resources: peer.initiator_depth.min(MAX_DEPTH),
                initiator_depth: peer.responder_resources.min(MAX_DEPTH),
                retry_count: 7,
                rnr_retry_count: 7,
                ..Default::default()
            });
        let Some(local) = i.local() else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // On the wire each side's starting PSN is the one it expects to receive (see
        // `wire::swap_psns`); ferroce's TCP exchange names the one each sends.
        let on_wire = wire::of_id(&i.shared).is_some();
        let (mine, theirs) = if on_wire {
            wire::swap_psns(local, peer.clone())
        } else {
            (local, peer.clone())
        };
        if let Err(rc) = connect_qp(i.c.qp, &mine, &theirs, &Params::from(&p)) {
            set_errno(rc);
            return -1;
        }
        // The decision, in force from the RTR just made (the request's ECE reached the QP in
        // `rdma_create_qp`); a requester from before ECE gets a REP it can read.
        let ece = peer
            .ece
            .map(|_| verbs().map_or(Ece::default(), |v| ece_in_force(v, i.c.qp)));
        if let Some((cm, conn)) = wire::of_id(&i.shared) {
            // SAFETY: the program's private data.
            let private = unsafe { private_of(&p) };
            // SAFETY: the id's live QP (connected above).
            let (qpn, srq) = unsafe { ((*i.c.qp).qp_num, !(*i.c.qp).srq.is_null()) };
            let ece = ece.unwrap_or_default();
            let rep = ferroce::cm::ib::AcceptParams {
                qpn,
                starting_psn: local.psn,
                responder_resources: p.responder_resources.clamp(1, MAX_DEPTH),
                initiator_depth: p.initiator_depth.clamp(1, MAX_DEPTH),
                rnr_retry_count: p.rnr_retry_count.min(7),
                srq,
                ece: (ece.vendor_id & 0x00ff_ffff, ece.options),
                private_data: private,
            };
            if rep.private_data.len() > ferroce_wire::cm::private_len::REP {
                set_errno(libc::EINVAL);
                return -1;
            }
            let wire::WireId::Conn(conn) = conn else {
                set_errno(libc::EINVAL);
                return -1;
            };
            if !cm.accept(conn, rep) {
                set_errno(libc::ECONNRESET);
                return -1;
            }
            // SAFETY: our live id.
            return unsafe { wait_sync(id, RDMA_CM_EVENT_ESTABLISHED) };
        }
        // SAFETY: the program's private data.
        let rep = connect_message(i, &local, &p, true, unsafe { private_of(&p) }, ece);
        let stream = i
            .shared
            .stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|s| s.try_clone().ok());
        let Some(mut s) = stream else {
            set_errno(libc::ECONNRESET);
            return -1;
        };
        if let Err(e) = s.write_all(&rep.encode()) {
            set_errno(e.raw_os_error().unwrap_or(libc::ECONNRESET));
            return -1;
        }
        let shared = i.shared.clone();
        let id_addr = id as usize;
        spawn_helper(move || {
            let kind = match Message::read(&mut s) {
                Ok(Message::ReadyToUse) => RDMA_CM_EVENT_ESTABLISHED,
                Ok(Message::Reject { .. }) => RDMA_CM_EVENT_REJECTED,
                _ => RDMA_CM_EVENT_CONNECT_ERROR,
            };
            shared.post(event(id_addr as *mut rdma_cm_id, kind, 0));
            if kind == RDMA_CM_EVENT_ESTABLISHED {
                watch_disconnect(s, shared, id_addr);
            }
        });
        // SAFETY: our live id.
        unsafe { wait_sync(id, RDMA_CM_EVENT_ESTABLISHED) }
    })
}

/// `rdma_reject`: sends a REJ with the program's private data.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_reject(
    id: *mut rdma_cm_id,
    private: *const c_void,
    len: u8,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        release_request_event(i);
        let p = rdma_conn_param {
            private_data: private,
            private_data_len: len,
            ..Default::default()
        };
        // SAFETY: the program's private data.
        let private = unsafe { private_of(&p) };
        if let Some((cm, id_on_wire)) = wire::of_id(&i.shared) {
            let done = match id_on_wire {
                wire::WireId::Sidr(handle) => cm.reject_ud(handle, &private),
                wire::WireId::Conn(conn) => cm.reject(conn, &private),
            };
            if !done {
                // Private data too long for the message, or the request is gone.
                set_errno(libc::EINVAL);
                return -1;
            }
            *i.shared.wire.lock().unwrap_or_else(|e| e.into_inner()) = None;
            return 0;
        }
        let rej = Message::Reject { private };
        if let Some(s) = i
            .shared
            .stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = (&s).write_all(&rej.encode());
            let _ = s.shutdown(Shutdown::Both);
        }
        0
    })
}

/// `rdma_get_request`: on a synchronous listener, the next connection request, as a new
/// synchronous id (with a QP if the listener is an endpoint made with QP attributes). The
/// request event stays with the id (`id->event`) until it is accepted or rejected.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_get_request(
    listen: *mut rdma_cm_id,
    out: *mut *mut rdma_cm_id,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(l) = (unsafe { id_of(listen) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if !l.sync || out.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let ep_qp = l.ep_qp;
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the listener's own channel.
        if unsafe { rdma_get_cm_event(l.c.channel, &mut ev) } != 0 {
            return -1;
        }
        // SAFETY: an event just handed out.
        let (kind, child) = unsafe { ((*ev).event, (*ev).id) };
        if kind != RDMA_CM_EVENT_CONNECT_REQUEST {
            // SAFETY: acknowledged once.
            unsafe { rdma_ack_cm_event(ev) };
            set_errno(libc::EINVAL);
            return -1;
        }
        // The new id's channel is made now, as librdmacm makes it while the program takes the
        // request (not when the request arrived): its descriptor is then newer than any the
        // program opened before the call. `librspreload.so` relies on that: it opens its own
        // descriptor for a socket before `raccept` and maps its `select` sets back by walking
        // descriptors upwards, so an rsocket numbered below its own descriptor is reported
        // under the wrong one (and the walk runs off the end of the set).
        // SAFETY: the request's new id, alive and not yet the program's.
        if unsafe { id_of(child) }.is_some_and(|c| c.sync) {
            // SAFETY: as above; NULL moves it to a channel of its own.
            if unsafe { rdma_migrate_id(child, std::ptr::null_mut()) } != 0 {
                let e = std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO);
                // SAFETY: acknowledged once; the new id, never handed out.
                unsafe {
                    rdma_ack_cm_event(ev);
                    rdma_destroy_id(child);
                }
                set_errno(e);
                return -1;
            }
        }
        // SAFETY: the request's new id, alive and not yet the program's.
        if let Some(c) = unsafe { id_of(child) } {
            c.c.event = ev;
        }
        if let Some((pd, mut attr)) = ep_qp {
            // SAFETY: our new id, the listener's PD and a copy of its attributes.
            if unsafe { rdma_create_qp(child, pd as *mut ibv_pd, &mut attr) } != 0 {
                let e = std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO);
                // SAFETY: the new id, never handed out.
                unsafe { rdma_destroy_id(child) };
                set_errno(e);
                return -1;
            }
        }
        // SAFETY: checked non-null; the caller's output.
        unsafe { *out = child };
        0
    })
}
