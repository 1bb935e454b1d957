//! The active side: `rdma_connect` (over TCP to a ferroce peer, or IB CM on the wire) and
//! `rdma_disconnect`.

use super::*;

/// `rdma_connect`: sends the REQ; `ESTABLISHED` (with the REP's private data) once the QP is
/// in RTS and the RTU is sent, `REJECTED` on a REJ or when nothing listens, `UNREACHABLE` when
/// the peer cannot be reached.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_connect(
    id: *mut rdma_cm_id,
    param: *mut rdma_conn_param,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let Some(dst) = dst_addr(i) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: per the API, NULL or the program's parameters.
        let p = unsafe { param.as_ref() }
            .copied()
            .unwrap_or(rdma_conn_param {
                responder_resources: 1,
                initiator_depth: 1,
                retry_count: 7,
                rnr_retry_count: 7,
                ..Default::default()
            });
        // SAFETY: the program's private data.
        let private = unsafe { private_of(&p) };
        if i.c.ps == RDMA_PS_UDP {
            return wire::resolve_ud(i, id, dst, &private);
        }
        if i.c.qp.is_null() || private.len() > 56 {
            set_errno(libc::EINVAL);
            return -1;
        }
        // An id whose address was not resolved has no device to connect from.
        let Some(local) = i.local() else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let params = Params::from(&p);
        let mode = wire::mode();
        let on_wire = match mode {
            wire::Mode::Tcp => None,
            // A peer on this host is a ferroce process, which the TCP exchange finds in any
            // host slot; QP1 of an address is only the one of slot 0.
            wire::Mode::Auto if is_local(dst.ip()) => None,
            _ => {
                let src = source_port_of(i);
                wire::request_params(i.c.ps, src, dst, i.c.qp, &local, &params, &private)
            }
        };
        let req = connect_message(i, &local, &p, false, private, Some(local.ece));
        let p = params;
        let shared = i.shared.clone();
        let id_addr = id as usize;
        spawn_helper(move || {
            let id = id_addr as *mut rdma_cm_id;
            let fail = |kind, status| shared.post(event(id, kind, status));
            // IB CM on the wire: at once, or when no ferroce listener answers over TCP.
            let go_wire = |on_wire: Option<ferroce::cm::ib::ConnectParams>| {
                let src_ip = local_ip_of(&on_wire);
                let cm = on_wire
                    .as_ref()
                    .and(src_ip)
                    .and_then(|ip| wire::manager(local.device, ip));
                match (cm, on_wire) {
                    (Some(cm), Some(req)) => {
                        if cm.connect(shared.clone(), id_addr, local, p, req).is_none() {
                            fail(RDMA_CM_EVENT_UNREACHABLE, -libc::ENETUNREACH);
                        }
                    }
                    _ => fail(RDMA_CM_EVENT_UNREACHABLE, -libc::ENETUNREACH),
                }
            };
            if mode == wire::Mode::Ib {
                return go_wire(on_wire);
            }
            let (mut s, answer) = match request(dst, req) {
                Ok(r) => r,
                // No ferroce peer answers over TCP (nothing listens, or not ferroce's protocol):
                // a kernel's rdma_cm may, on the wire.
                Err(_) if mode == wire::Mode::Auto && on_wire.is_some() => return go_wire(on_wire),
                Err((kind, status)) => return fail(kind, status),
            };
            match answer {
                Message::Reject { private } => {
                    let mut e = event(id, RDMA_CM_EVENT_REJECTED, 28);
                    e.private = private;
                    shared.post(e);
                }
                m @ Message::Connect { reply: true, .. } => {
                    let Some((peer, private)) = peer_of(&m) else {
                        return;
                    };
                    let remote = peer.ece.unwrap_or_default();
                    *shared.remote_ece.lock().unwrap_or_else(|e| e.into_inner()) = remote;
                    let connected = {
                        let qp = shared.qp.lock().unwrap_or_else(|e| e.into_inner());
                        if !shared.alive.load(Ordering::Acquire) {
                            return;
                        }
                        let qp = *qp as *mut ibv_qp;
                        if let (false, Some(v)) = (qp.is_null(), verbs()) {
                            set_peer_ece(v, qp, local.ece, remote);
                        }
                        connect_qp(qp, &local, &peer, &p)
                    };
                    if let Err(rc) = connected {
                        let _ = s.write_all(
                            &Message::Reject {
                                private: Vec::new(),
                            }
                            .encode(),
                        );
                        return fail(RDMA_CM_EVENT_CONNECT_ERROR, -rc);
                    }
                    if s.write_all(&Message::ReadyToUse.encode()).is_err() {
                        return fail(RDMA_CM_EVENT_CONNECT_ERROR, -libc::ECONNRESET);
                    }
                    let reader = s.try_clone();
                    *shared.stream.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
                    let mut e = event(id, RDMA_CM_EVENT_ESTABLISHED, 0);
                    e.private = private;
                    // What the peer serves and asks, from this side's view.
                    e.c.param.conn.responder_resources = peer.initiator_depth;
                    e.c.param.conn.initiator_depth = peer.responder_resources;
                    e.c.param.conn.qp_num = peer.qpn;
                    shared.post(e);
                    if let Ok(r) = reader {
                        watch_disconnect(r, shared, id_addr);
                    }
                }
                _ => fail(RDMA_CM_EVENT_UNREACHABLE, -libc::EPROTO),
            }
        });
        // SAFETY: our live id.
        unsafe { wait_sync(id, RDMA_CM_EVENT_ESTABLISHED) }
    })
}

/// The local IP a REQ's IP header names.
pub(super) fn local_ip_of(req: &Option<ferroce::cm::ib::ConnectParams>) -> Option<IpAddr> {
    let r = req.as_ref()?;
    ferroce::cm::ib::ip::IpHeader::parse(&r.private_data)
        .ok()
        .map(|h| h.src.ip())
}

/// `rdma_disconnect`: moves the QP to ERR, sends a DREQ; `DISCONNECTED` on both sides.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        move_qp_to_error(i.c.qp);
        if let Some((cm, wire::WireId::Conn(conn))) = wire::of_id(&i.shared) {
            cm.disconnect(conn);
            return 0;
        }
        let stream = i
            .shared
            .stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(s) = stream else {
            set_errno(libc::ENOTCONN);
            return -1;
        };
        let _ = (&s).write_all(&Message::Disconnect.encode());
        // The watching thread reads the close and reports DISCONNECTED here as well.
        let _ = s.shutdown(Shutdown::Both);
        0
    })
}
