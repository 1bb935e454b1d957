//! Devices: the one context this library opens per device, the device holding an address, and
//! `rdma_get_devices`.

use super::*;

/// An opened device, shared by every id on it (as librdmacm shares one context per device).
#[derive(Clone, Copy)]
pub(super) struct Device {
    pub(super) ctx: *mut ibv_context,
    pub(super) gid_index: u8,
    pub(super) mtu: ibv_mtu,
}

// SAFETY: the context is only used through libibverbs calls, which are thread-safe.
unsafe impl Send for Device {}

// SAFETY: as above: a copyable handle whose only use is libibverbs' thread-safe calls.
unsafe impl Sync for Device {}

pub(super) static CONTEXTS: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

/// The context of the device named `name`, opened once.
pub(super) fn context_named(v: &Verbs, name: &str) -> Option<*mut ibv_context> {
    let mut open = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, c)) = open.iter().find(|(n, _)| n == name) {
        return Some(*c as *mut ibv_context);
    }
    let mut n = 0;
    // SAFETY: libibverbs' call; the list is freed below.
    let list = unsafe { (v.get_device_list)(&mut n) };
    if list.is_null() {
        return None;
    }
    let mut found = None;
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: i < n entries of the list.
        let dev = unsafe { *list.add(i) };
        // SAFETY: a device of the list; the name is a C string.
        let dev_name = unsafe { CStr::from_ptr((v.get_device_name)(dev)) };
        if dev_name.to_bytes() == name.as_bytes() {
            // SAFETY: a device of the list.
            let ctx = unsafe { (v.open_device)(dev) };
            if !ctx.is_null() {
                found = Some(ctx);
            }
            break;
        }
    }
    // SAFETY: the list from get_device_list, freed once (opened devices stay valid).
    unsafe { (v.free_device_list)(list) };
    let ctx = found?;
    open.push((name.to_string(), ctx as usize));
    Some(ctx)
}

/// The device holding `ip`, with the index of its GID.
pub(super) fn device_for(ip: IpAddr) -> Option<Device> {
    let v = verbs()?;
    let dev = ferroce::devices()
        .ok()?
        .into_iter()
        .find(|d| d.gids().iter().any(|g| g.ip == ip))?;
    let gid_index = dev.gids().iter().position(|g| g.ip == ip)? as u8;
    let ctx = context_named(v, dev.name())?;
    let mut port = ibv_port_attr::default();
    // SAFETY: a live context and a full port structure.
    let mtu = if unsafe { (v.query_port)(ctx, 1, &mut port) } == 0 {
        port.active_mtu
    } else {
        IBV_MTU_1024
    };
    Some(Device {
        ctx,
        gid_index,
        mtu,
    })
}

/// The local address a packet to `dst` leaves from.
pub(super) fn source_for(dst: IpAddr) -> Option<IpAddr> {
    let any: IpAddr = match dst {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let s = std::net::UdpSocket::bind(SocketAddr::new(any, 0)).ok()?;
    s.connect(SocketAddr::new(dst, 9)).ok()?;
    Some(s.local_addr().ok()?.ip())
}

/// Whether `ip` is an address of this host.
pub(super) fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback()
        || ferroce::devices()
            .unwrap_or_default()
            .iter()
            .any(|d| d.gids().iter().any(|g| g.ip == ip))
}

/// `rdma_get_devices`: every device's context, NULL-terminated.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context {
    guard(std::ptr::null_mut(), || {
        let Some(v) = verbs() else {
            set_errno(libc::ENOSYS);
            return std::ptr::null_mut();
        };
        let ctxs: Vec<*mut ibv_context> = ferroce::devices()
            .unwrap_or_default()
            .iter()
            .filter_map(|d| context_named(v, d.name()))
            .collect();
        // SAFETY: an allocation of n + 1 pointers, freed by rdma_free_devices.
        let list = unsafe { libc::calloc(ctxs.len() + 1, std::mem::size_of::<*mut ibv_context>()) }
            .cast::<*mut ibv_context>();
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        for (k, c) in ctxs.iter().enumerate() {
            // SAFETY: k < n.
            unsafe { *list.add(k) = *c };
        }
        if !num.is_null() {
            // SAFETY: the caller's output.
            unsafe { *num = ctxs.len() as c_int };
        }
        list
    })
}

/// `rdma_free_devices`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: the list from rdma_get_devices (its contexts stay open, as librdmacm's).
    unsafe { libc::free(list.cast()) }
}
