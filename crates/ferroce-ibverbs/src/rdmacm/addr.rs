//! Addresses: C socket addresses, an id's route (`rdma_bind_addr`, `rdma_resolve_addr`,
//! `rdma_resolve_route`) and its ports.

use super::*;

/// Reads a C socket address.
///
/// # Safety
/// `sa` must be NULL or point to a socket address of its family's size.
pub(super) unsafe fn read_sockaddr(sa: *const sockaddr) -> Option<SocketAddr> {
    // SAFETY: the caller's contract.
    let family = c_int::from(unsafe { sa.as_ref() }?.sa_family);
    match family {
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in.
            let sin = unsafe { &*(sa as *const libc::sockaddr_in) };
            Some(SocketAddr::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).into(),
                u16::from_be(sin.sin_port),
            ))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a sockaddr_in6.
            let sin6 = unsafe { &*(sa as *const libc::sockaddr_in6) };
            Some(SocketAddr::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr).into(),
                u16::from_be(sin6.sin6_port),
            ))
        }
        _ => None,
    }
}

/// Writes `a` into a C socket address of storage size.
pub(super) fn write_sockaddr(dst: &mut sockaddr_storage, a: SocketAddr) {
    *dst = sockaddr_storage::default();
    let p = dst as *mut sockaddr_storage;
    match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_in fits in sockaddr_storage.
            unsafe { p.cast::<libc::sockaddr_in>().write(sin) };
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: a sockaddr_in6 fits in sockaddr_storage.
            unsafe { p.cast::<libc::sockaddr_in6>().write(sin6) };
        }
    }
}

pub(super) use ferroce::cm::ib::ip::gid_of;

/// Fills the id's route for a connection from `src` to `dst` on `dev`.
pub(super) fn set_route(id: &mut CmId, dev: Device, src: SocketAddr, dst: Option<SocketAddr>) {
    id.device = Some(dev);
    id.c.verbs = dev.ctx;
    id.c.port_num = 1;
    let route = &mut id.c.route;
    // SAFETY: the storage arm covers the whole union.
    write_sockaddr(unsafe { &mut route.addr.__bindgen_anon_1.src_storage }, src);
    if let Some(d) = dst {
        // SAFETY: as above.
        write_sockaddr(unsafe { &mut route.addr.__bindgen_anon_2.dst_storage }, d);
    }
    let ib = rdma_ib_addr {
        sgid: ibv_gid {
            raw: gid_of(src.ip()),
        },
        dgid: ibv_gid {
            raw: dst.map_or([0; 16], |d| gid_of(d.ip())),
        },
        pkey: 0xffffu16.to_be(),
    };
    route.addr.addr = rdma_addr__bindgen_ty_3 { ibaddr: ib };
    *id.path = ibv_sa_path_rec {
        dgid: ib.dgid,
        sgid: ib.sgid,
        pkey: ib.pkey,
        mtu: dev.mtu as u8,
        hop_limit: 64,
        ..Default::default()
    };
}

pub(super) fn src_addr(id: &CmId) -> Option<SocketAddr> {
    // SAFETY: the storage arm holds a socket address (or family 0: None).
    unsafe { read_sockaddr(&id.c.route.addr.__bindgen_anon_1.src_addr) }
}

pub(super) fn dst_addr(id: &CmId) -> Option<SocketAddr> {
    // SAFETY: as above.
    unsafe { read_sockaddr(&id.c.route.addr.__bindgen_anon_2.dst_addr) }
}

/// `rdma_bind_addr`: takes the address (and port: 0 picks one) for `rdma_listen`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let (Some(i), Some(a)) = (unsafe { id_of(id) }, unsafe { read_sockaddr(addr) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let listener = match TcpListener::bind(a) {
            Ok(l) => l,
            Err(e) => {
                set_errno(e.raw_os_error().unwrap_or(libc::EADDRINUSE));
                return -1;
            }
        };
        let bound = listener.local_addr().unwrap_or(a);
        // A specific address names its device; a wildcard leaves `verbs` NULL, as librdmacm.
        // So does a loopback address, as the kernel's rdma_cm binds it (checked against the
        // guests' kernel: `rping -s -a 127.0.0.1` binds and listens; RDMA devices hold no
        // loopback GID). Programs rely on that: libfabric's verbs provider binds "localhost"
        // to learn which device a wildcard endpoint is on, and takes a NULL `verbs` to mean
        // "every device, each with its own address".
        if !a.ip().is_unspecified() && !a.ip().is_loopback() {
            let Some(dev) = device_for(a.ip()) else {
                set_errno(libc::EADDRNOTAVAIL);
                return -1;
            };
            set_route(i, dev, bound, None);
        } else {
            // SAFETY: the storage arm covers the union.
            write_sockaddr(
                unsafe { &mut i.c.route.addr.__bindgen_anon_1.src_storage },
                bound,
            );
        }
        i.listener = Some(listener);
        0
    })
}

/// `rdma_resolve_addr`: finds the device a packet to `dst` leaves from; `ADDR_RESOLVED`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut sockaddr,
    dst: *mut sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let (Some(i), Some(d)) = (unsafe { id_of(id) }, unsafe { read_sockaddr(dst) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: per the API, NULL or an address.
        let local = match unsafe { read_sockaddr(src) } {
            Some(s) if !s.ip().is_unspecified() => Some(s.ip()),
            _ => source_for(d.ip()),
        };
        let Some(dev) = local.and_then(|ip| device_for(ip).map(|dev| (ip, dev))) else {
            set_errno(libc::EADDRNOTAVAIL);
            return -1;
        };
        set_route(i, dev.1, SocketAddr::new(dev.0, 0), Some(d));
        i.shared.post(event(id, RDMA_CM_EVENT_ADDR_RESOLVED, 0));
        // SAFETY: our live id.
        unsafe { wait_sync(id, RDMA_CM_EVENT_ADDR_RESOLVED) }
    })
}

/// `rdma_resolve_route`: RoCE needs no path query; `ROUTE_RESOLVED` with one path record.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_resolve_route(
    id: *mut rdma_cm_id,
    _timeout_ms: c_int,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if i.device.is_none() {
            set_errno(libc::EINVAL);
            return -1;
        }
        i.c.route.path_rec = &mut *i.path;
        i.c.route.num_paths = 1;
        i.shared.post(event(id, RDMA_CM_EVENT_ROUTE_RESOLVED, 0));
        // SAFETY: our live id.
        unsafe { wait_sync(id, RDMA_CM_EVENT_ROUTE_RESOLVED) }
    })
}

/// The id's source address, with a port: one picked now from the ephemeral range if it has
/// none (an address resolved for `rdma_connect`), as the kernel binds one, so that the IP
/// header of the REQ names it and `rdma_get_src_port` reports it.
pub(super) fn source_port_of(i: &mut CmId) -> SocketAddr {
    let src = src_addr(i).unwrap_or(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0));
    if src.port() != 0 {
        return src;
    }
    let with_port = SocketAddr::new(src.ip(), 32768 + (random_psn() % 28232) as u16);
    // SAFETY: the storage arm covers the whole union.
    write_sockaddr(
        unsafe { &mut i.c.route.addr.__bindgen_anon_1.src_storage },
        with_port,
    );
    with_port
}

/// `rdma_get_src_port` (network byte order).
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the API.
    unsafe { id_of(id) }
        .and_then(|i| src_addr(i))
        .map_or(0, |a| a.port().to_be())
}

/// `rdma_get_dst_port` (network byte order).
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the API.
    unsafe { id_of(id) }
        .and_then(|i| dst_addr(i))
        .map_or(0, |a| a.port().to_be())
}
