//! Devices, contexts and what they report: `ibv_get_device_list`, `ibv_open_device`,
//! `ibv_query_device`, `ibv_query_port`, the GID and P_Key tables.
//!
//! A device is a ferroce device (`ferroce_lo`, `ferroce_eth0`, …: one per interface with an
//! address), with link layer Ethernet and RoCE v2 GIDs. Attributes follow Linux rxe's where
//! ferroce has no limit of its own, so programs tuned for rxe size their queues the same way.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use crate::abi::*;
use crate::{copy_c_string, errno_of, guard, set_errno};

/// A device the library handed out: never freed (rdma-core keeps devices for the life of the
/// process too), so every `ibv_device *` a program holds stays valid.
#[repr(C)]
pub(crate) struct Device {
    pub c: ibv_device,
    pub inner: ferroce::Device,
    pub index: i32,
}

/// Every device handed out so far, by address.
static DEVICES: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// An opened device.
#[repr(C)]
pub(crate) struct Context {
    /// rdma-core's extended context, whose last field is the `ibv_context` programs hold: the
    /// inline extended calls of `<infiniband/verbs.h>` find the operations in front of it.
    vctx: verbs_context,
    pub ctx: ferroce::Context,
    /// The GID index the context's socket is bound to (`FERROCE_GID_INDEX`, default 0).
    pub gid_index: usize,
    /// Whether the context's QPs offer selective repeat in their ECE (`ibv_query_ece`): the
    /// context option, on unless `FERROCE_SR=0`.
    pub selective_repeat: bool,
    /// `c.async_fd`: a blocking semaphore eventfd. ferroce raises no asynchronous events yet,
    /// so reading it blocks, as it does on a device where none happens.
    async_fd: OwnedFd,
    /// `c.cmd_fd`: /dev/null, so a program that polls or closes it harms nothing.
    cmd_fd: OwnedFd,
}

impl Context {
    /// The context behind a pointer the program passed.
    ///
    /// # Safety
    /// `ctx` must be a context this library returned and not yet closed.
    pub(crate) unsafe fn from_c<'a>(ctx: *mut ibv_context) -> Option<&'a Context> {
        // SAFETY: the caller's contract.
        unsafe { Context::ptr_of(ctx).as_ref() }
    }

    /// The box a program's `ibv_context *` lies in (NULL for NULL).
    ///
    /// # Safety
    /// `ctx` must be NULL or a context this library returned.
    unsafe fn ptr_of(ctx: *mut ibv_context) -> *mut Context {
        if ctx.is_null() {
            return std::ptr::null_mut();
        }
        // SAFETY: `vctx` is the first field of the repr(C) `Context` and the program's pointer
        // is its `context` field, so stepping back by that field's offset stays inside the box.
        unsafe {
            ctx.byte_sub(std::mem::offset_of!(verbs_context, context))
                .cast::<Context>()
        }
    }

    fn device(&self) -> &ferroce::Device {
        self.ctx.device()
    }
}

fn guid_of(dev: &ferroce::Device) -> u64 {
    // As rxe: the interface's MAC as a modified EUI-64.
    let mac = std::fs::read_to_string(format!("/sys/class/net/{}/address", dev.ifname()))
        .unwrap_or_default();
    let mut b = [0u8; 6];
    for (d, part) in b.iter_mut().zip(mac.trim().split(':')) {
        *d = u8::from_str_radix(part, 16).unwrap_or(0);
    }
    u64::from_be_bytes([b[0] ^ 2, b[1], b[2], 0xff, 0xfe, b[3], b[4], b[5]])
}

fn new_device(inner: ferroce::Device, index: i32) -> *mut Device {
    let mut c = ibv_device {
        node_type: IBV_NODE_CA,
        transport_type: IBV_TRANSPORT_IB,
        ..Default::default()
    };
    copy_c_string(&mut c.name, inner.name());
    copy_c_string(&mut c.dev_name, &format!("uverbs{index}"));
    copy_c_string(
        &mut c.dev_path,
        &format!("/sys/class/infiniband_verbs/uverbs{index}"),
    );
    copy_c_string(
        &mut c.ibdev_path,
        &format!("/sys/class/infiniband/{}", inner.name()),
    );
    Box::into_raw(Box::new(Device { c, inner, index }))
}

/// `ibv_get_device_list`: every ferroce device, NULL-terminated, in a block `free` releases.
#[no_mangle]
unsafe extern "C" fn ibv_get_device_list(num_devices: *mut libc::c_int) -> *mut *mut ibv_device {
    guard(std::ptr::null_mut(), || {
        let found = match ferroce::devices() {
            Ok(d) => d,
            Err(e) => {
                set_errno(errno_of(&e));
                return std::ptr::null_mut();
            }
        };
        let mut known = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
        let mut list: Vec<*mut ibv_device> = Vec::with_capacity(found.len());
        for dev in found {
            // SAFETY: every address in DEVICES is a leaked `Device`, never freed.
            let existing = known
                .iter()
                .map(|&a| a as *mut Device)
                .find(|&p| unsafe { (*p).inner.name() } == dev.name());
            let p = existing.unwrap_or_else(|| {
                let p = new_device(dev, known.len() as i32);
                known.push(p as usize);
                p
            });
            list.push(p.cast());
        }
        // SAFETY: a fresh allocation of list.len() + 1 pointers, freed by ibv_free_device_list.
        let block = unsafe {
            libc::calloc(list.len() + 1, std::mem::size_of::<*mut ibv_device>())
                .cast::<*mut ibv_device>()
        };
        if block.is_null() {
            set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        for (i, p) in list.iter().enumerate() {
            // SAFETY: i < list.len(), inside the block.
            unsafe { *block.add(i) = *p };
        }
        if !num_devices.is_null() {
            // SAFETY: the caller passed a pointer to an int.
            unsafe { *num_devices = list.len() as libc::c_int };
        }
        block
    })
}

/// `ibv_free_device_list`: frees the list (the devices stay, as in rdma-core while opened).
#[no_mangle]
unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: the list came from calloc in ibv_get_device_list.
    unsafe { libc::free(list.cast()) }
}

/// The device behind a pointer the program passed.
///
/// # Safety
/// `dev` must come from [`ibv_get_device_list`] (devices are never freed).
unsafe fn device_of<'a>(dev: *mut ibv_device) -> Option<&'a Device> {
    // SAFETY: `c` is the first field of the repr(C) `Device`.
    unsafe { dev.cast::<Device>().as_ref() }
}

/// `ibv_get_device_name`.
#[no_mangle]
unsafe extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const libc::c_char {
    // SAFETY: per the API, `dev` came from ibv_get_device_list.
    match unsafe { device_of(dev) } {
        Some(d) => d.c.name.as_ptr(),
        None => std::ptr::null(),
    }
}

/// `ibv_get_device_guid` (network byte order, like rdma-core's).
#[no_mangle]
unsafe extern "C" fn ibv_get_device_guid(dev: *mut ibv_device) -> u64 {
    // SAFETY: per the API, `dev` came from ibv_get_device_list.
    match unsafe { device_of(dev) } {
        Some(d) => guid_of(&d.inner).to_be(),
        None => 0,
    }
}

/// `ibv_get_device_index`.
#[no_mangle]
unsafe extern "C" fn ibv_get_device_index(dev: *mut ibv_device) -> libc::c_int {
    // SAFETY: per the API, `dev` came from ibv_get_device_list.
    match unsafe { device_of(dev) } {
        Some(d) => d.index,
        None => -1,
    }
}

/// The GID index contexts bind to: `FERROCE_GID_INDEX`, else 0 (IPv4 comes first).
fn gid_index_from_env() -> usize {
    std::env::var("FERROCE_GID_INDEX")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn open_fd(path: &str) -> Option<OwnedFd> {
    let cpath = std::ffi::CString::new(path).ok()?;
    // SAFETY: a NUL-terminated path; a non-negative result is a descriptor we own.
    let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    // SAFETY: as above.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// How long `ibv_get_cq_event` drives progress before it sleeps: `FERROCE_EVENT_SPIN_US`
/// microseconds (a whole number; 0 turns it off; anything else keeps the default), 200 by
/// default. The spin is adaptive (see `ferroce::CompletionChannel`): after four spins in a row
/// that no event ended, a waiter spins only once in eight waits, so a program whose events
/// come seldom mostly sleeps at once. With it, `ibv_rc_pingpong -e` on 2 CPUs takes 20–25 µs
/// per iteration over shared memory instead of about 165.
const DEFAULT_EVENT_SPIN_US: u64 = 200;

/// (See [`DEFAULT_EVENT_SPIN_US`].)
fn event_spin_from_env() -> std::time::Duration {
    let us = std::env::var("FERROCE_EVENT_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(DEFAULT_EVENT_SPIN_US);
    std::time::Duration::from_micros(us)
}

/// `ibv_open_device`: a ferroce context on the device, in a host slot (see the crate doc).
#[no_mangle]
unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API, `dev` came from ibv_get_device_list.
        let Some(d) = (unsafe { device_of(dev) }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let gid_index = gid_index_from_env();
        let opts = ferroce::ContextOptions {
            gid_index,
            host_slot: true,
            // A polling program drives progress itself; C programs often wait by spinning on
            // memory a peer writes next, so a poll that returns completions hands back.
            hand_over_to_polling_app: true,
            hand_back_at_completion: true,
            // A program that sleeps on completion events (`-e`) pays two wake-ups per message;
            // a short adaptive spin before each sleep saves them in a conversation.
            event_spin: event_spin_from_env(),
            // As on a fabric: an idle QP does not learn that its peer went away.
            fail_idle_qps_when_peer_goes: false,
            adopt_registered_pages: true,
            ..ferroce::ContextOptions::default()
        };
        let selective_repeat = opts.selective_repeat;
        let ctx = match shared_context(&d.inner, &opts) {
            Ok(c) => c,
            Err(e) => {
                set_errno(errno_of(&e));
                return std::ptr::null_mut();
            }
        };
        // SAFETY: eventfd takes no pointers; a non-negative result is a descriptor we own.
        let efd = unsafe { libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) };
        if efd < 0 {
            set_errno(
                std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO),
            );
            return std::ptr::null_mut();
        }
        // SAFETY: just created, owned by nobody else.
        let async_fd = unsafe { OwnedFd::from_raw_fd(efd) };
        let Some(cmd_fd) = open_fd("/dev/null") else {
            set_errno(libc::EIO);
            return std::ptr::null_mut();
        };
        let c = ibv_context {
            device: dev,
            ops: ops_table(),
            cmd_fd: cmd_fd.as_raw_fd(),
            async_fd: async_fd.as_raw_fd(),
            num_comp_vectors: 1,
            // rdma-core's mark of an extended context (`__VERBS_ABI_IS_EXTENDED`).
            abi_compat: usize::MAX as *mut libc::c_void,
            // Zeroed is PTHREAD_MUTEX_INITIALIZER on glibc.
            ..Default::default()
        };
        // The extended operations ferroce has; every other one is NULL, which the inline calls
        // answer with their legacy path or EOPNOTSUPP.
        let vctx = verbs_context {
            query_port: Some(query_port_ex),
            query_device_ex: Some(query_device_ex),
            sz: std::mem::size_of::<verbs_context>() as size_t,
            context: c,
            ..Default::default()
        };
        let boxed = Box::into_raw(Box::new(Context {
            vctx,
            ctx,
            gid_index,
            selective_repeat,
            async_fd,
            cmd_fd,
        }));
        // SAFETY: just made; the program gets the `ibv_context` inside it.
        unsafe { std::ptr::addr_of_mut!((*boxed).vctx.context) }
    })
}

/// The operations the inline calls of `<infiniband/verbs.h>` reach through `ctx->ops`.
fn ops_table() -> ibv_context_ops {
    ibv_context_ops {
        poll_cq: Some(crate::cq::poll_cq),
        req_notify_cq: Some(crate::cq::req_notify_cq),
        post_send: Some(crate::qp::post_send),
        post_recv: Some(crate::qp::post_recv),
        post_srq_recv: Some(crate::qp::post_srq_recv),
        ..Default::default()
    }
}

/// `ibv_close_device`.
#[no_mangle]
unsafe extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> libc::c_int {
    guard(libc::EFAULT, || {
        if ctx.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: per the API, `ctx` came from ibv_open_device and is closed once.
        let c = unsafe { Box::from_raw(Context::ptr_of(ctx)) };
        // `FERROCE_COUNTERS=1`: what the context counted, on stderr (as `ferroce perf
        // --counters` prints them), for a program that has no way to ask.
        if std::env::var_os("FERROCE_COUNTERS").is_some_and(|v| v == "1") {
            let mut text = format!("ferroce counters of {}:\n", c.ctx.device().name());
            for (name, value) in c.ctx.counters().named() {
                text.push_str(&format!("   {name:<28}{value:>12}\n"));
            }
            eprint!("{text}");
        }
        release_context(&c.ctx, c.gid_index);
        drop(c);
        0
    })
}

/// The ferroce contexts this process has open, per device and GID, with how many
/// `ibv_context`s hold each.
static OPEN: std::sync::Mutex<Vec<(String, usize, ferroce::Context, usize)>> =
    std::sync::Mutex::new(Vec::new());

/// The ferroce context behind a new `ibv_context`: the one this process has open on the device
/// already, if any. A NIC port has one address however many contexts a process opens, and
/// peers on other hosts (rxe, NICs) send every packet to UDP port 4791: so every context of a
/// process on one device shares one RoCE socket (its host slot), its QPs and QP1 (the
/// connection manager's) reachable there. Two contexts of their own would take two slots, and
/// whatever a program made in the second (librdmacm's QPs, when the program opened the device
/// itself too, as perftest `-R` does) would be unreachable from another host.
fn shared_context(
    dev: &ferroce::Device,
    opts: &ferroce::ContextOptions,
) -> ferroce::Result<ferroce::Context> {
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = open
        .iter_mut()
        .find(|e| e.0 == dev.name() && e.1 == opts.gid_index)
    {
        e.3 += 1;
        return Ok(e.2.clone());
    }
    let ctx = dev.open(opts)?;
    open.push((dev.name().to_string(), opts.gid_index, ctx.clone(), 1));
    Ok(ctx)
}

/// One `ibv_context` fewer on `ctx`: the last one closes it.
fn release_context(ctx: &ferroce::Context, gid_index: usize) {
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    let name = ctx.device().name().to_string();
    if let Some(i) = open.iter().position(|e| e.0 == name && e.1 == gid_index) {
        open[i].3 -= 1;
        if open[i].3 == 0 {
            open.remove(i);
        }
    }
}

/// The largest queue, SGE list and so on ferroce accepts, reported as the device's limits.
pub(crate) mod limits {
    /// Work requests per queue.
    pub const MAX_QP_WR: u32 = 16384;
    /// Scatter/gather entries per work request.
    pub const MAX_SGE: u32 = 32;
    /// Inline bytes per work request.
    pub const MAX_INLINE: u32 = 1024;
    /// Completions per CQ.
    pub const MAX_CQE: u32 = 1 << 20;
    /// READ/atomic requests in flight per QP.
    pub const MAX_RD_ATOMIC: u32 = ferroce_proto::attr::MAX_RD_ATOMIC as u32;
}

/// The vendor ID Linux's software RDMA devices report (rxe's `RXE_VENDOR_ID`): programs that
/// key features on the vendor treat ferroce as the software device it is, and rdma-core's own
/// tests insist on a non-zero one.
const SOFTWARE_VENDOR_ID: u32 = 0xff_ffff;

/// The device's attributes.
fn device_attr(c: &Context) -> ibv_device_attr {
    let mut a = ibv_device_attr {
        node_guid: guid_of(c.device()).to_be(),
        sys_image_guid: guid_of(c.device()).to_be(),
        max_mr_size: ferroce_proto::attr::MAX_MESSAGE_LEN,
        page_size_cap: 0xffff_f000,
        vendor_id: SOFTWARE_VENDOR_ID,
        vendor_part_id: 0,
        hw_ver: 0,
        max_qp: ferroce::host_slot::QPNS_PER_SLOT as i32 - 0x11,
        max_qp_wr: limits::MAX_QP_WR as i32,
        device_cap_flags: IBV_DEVICE_PORT_ACTIVE_EVENT
            | IBV_DEVICE_SYS_IMAGE_GUID
            | IBV_DEVICE_RC_RNR_NAK_GEN
            | IBV_DEVICE_N_NOTIFY_CQ,
        max_sge: limits::MAX_SGE as i32,
        max_sge_rd: limits::MAX_SGE as i32,
        max_cq: 1 << 16,
        max_cqe: limits::MAX_CQE as i32,
        max_mr: 1 << 18,
        max_pd: 1 << 16,
        max_qp_rd_atom: limits::MAX_RD_ATOMIC as i32,
        max_ee_rd_atom: 0,
        max_res_rd_atom: (limits::MAX_RD_ATOMIC * 4096) as i32,
        max_qp_init_rd_atom: limits::MAX_RD_ATOMIC as i32,
        max_ee_init_rd_atom: 0,
        atomic_cap: IBV_ATOMIC_HCA,
        max_srq: 1 << 16,
        max_srq_wr: limits::MAX_QP_WR as i32,
        max_srq_sge: limits::MAX_SGE as u16 as i32,
        max_pkeys: 1,
        max_ah: 1 << 16,
        local_ca_ack_delay: 15,
        phys_port_cnt: 1,
        ..Default::default()
    };
    copy_c_string(
        &mut a.fw_ver,
        concat!("ferroce ", env!("CARGO_PKG_VERSION")),
    );
    a
}

/// `ibv_query_device`.
#[no_mangle]
unsafe extern "C" fn ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let (Some(c), Some(out)) = (unsafe { Context::from_c(ctx) }, unsafe { attr.as_mut() })
        else {
            return libc::EINVAL;
        };
        *out = device_attr(c);
        0
    })
}

fn mtu_code(mtu: ferroce_proto::PathMtu) -> ibv_mtu {
    use ferroce_proto::PathMtu as M;
    match mtu {
        M::Mtu256 => IBV_MTU_256,
        M::Mtu512 => IBV_MTU_512,
        M::Mtu1024 => IBV_MTU_1024,
        M::Mtu2048 => IBV_MTU_2048,
        M::Mtu4096 => IBV_MTU_4096,
    }
}

/// The port's attributes (there is one port, number 1).
pub(crate) fn port_attr(c: &Context) -> ibv_port_attr {
    let dev = c.device();
    ibv_port_attr {
        state: IBV_PORT_ACTIVE,
        max_mtu: IBV_MTU_4096,
        active_mtu: mtu_code(dev.active_mtu()),
        gid_tbl_len: dev.gids().len() as i32,
        port_cap_flags: IBV_PORT_CM_SUP | IBV_PORT_IP_BASED_GIDS,
        max_msg_sz: ferroce_proto::attr::MAX_MESSAGE_LEN as u32,
        pkey_tbl_len: 1,
        lid: 0,
        max_vl_num: 1,
        active_width: 2,  // 4X, as rxe
        active_speed: 32, // EDR
        phys_state: 5,    // LinkUp
        link_layer: IBV_LINK_LAYER_ETHERNET as u8,
        ..Default::default()
    }
}

/// The bytes of `ibv_port_attr` the exported `ibv_query_port@IBVERBS_1.1` may write: programs
/// built against older headers pass a shorter structure (`_compat_ibv_port_attr`), and the
/// inline `ibv_query_port` of today's headers zeroes the rest before calling.
pub(crate) const COMPAT_PORT_ATTR_LEN: usize = std::mem::offset_of!(ibv_port_attr, port_cap_flags2);

/// `ibv_query_port` (the exported compat entry the inline call falls back to).
#[no_mangle]
unsafe extern "C" fn ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut _compat_ibv_port_attr,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            return libc::EINVAL;
        };
        if port != 1 || attr.is_null() {
            return libc::EINVAL;
        }
        let a = port_attr(c);
        // SAFETY: the caller's structure holds at least the compat prefix, which we copy from
        // a full local structure.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&a as *const ibv_port_attr).cast::<u8>(),
                attr.cast::<u8>(),
                COMPAT_PORT_ATTR_LEN,
            )
        };
        0
    })
}

/// `ibv_query_gid`: the RoCE v2 GID at `index`.
#[no_mangle]
unsafe extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: libc::c_int,
    gid: *mut ibv_gid,
) -> libc::c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let (Some(c), Some(out)) = (unsafe { Context::from_c(ctx) }, unsafe { gid.as_mut() })
        else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let entry = usize::try_from(index)
            .ok()
            .and_then(|i| c.device().gids().get(i));
        match entry {
            Some(g) if port == 1 => {
                *out = ibv_gid {
                    raw: g.gid.octets(),
                };
                0
            }
            _ => {
                set_errno(libc::EINVAL);
                -1
            }
        }
    })
}

fn ifindex_of(dev: &ferroce::Device) -> u32 {
    let Ok(name) = std::ffi::CString::new(dev.ifname()) else {
        return 0;
    };
    // SAFETY: a NUL-terminated name.
    unsafe { libc::if_nametoindex(name.as_ptr()) }
}

fn gid_entry(dev: &ferroce::Device, g: &ferroce::Gid) -> ibv_gid_entry {
    ibv_gid_entry {
        gid: ibv_gid {
            raw: g.gid.octets(),
        },
        gid_index: g.index as u32,
        port_num: 1,
        gid_type: IBV_GID_TYPE_ROCE_V2,
        ndev_ifindex: ifindex_of(dev),
    }
}

/// `ibv_query_gid_ex`: one GID entry (type RoCE v2).
#[no_mangle]
unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            return libc::EINVAL;
        };
        if port != 1
            || flags != 0
            || entry.is_null()
            || entry_size < std::mem::size_of::<ibv_gid_entry>()
        {
            return libc::EINVAL;
        }
        let dev = c.device();
        let Some(g) = dev.gids().get(index as usize) else {
            return libc::ENODATA;
        };
        // SAFETY: the caller's entry holds entry_size >= size_of bytes.
        unsafe { *entry = gid_entry(dev, g) };
        0
    })
}

/// `ibv_query_gid_table`: every GID entry; returns how many.
#[no_mangle]
unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard(-(libc::EFAULT as isize), || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            return -(libc::EINVAL as isize);
        };
        if flags != 0 || entries.is_null() || entry_size < std::mem::size_of::<ibv_gid_entry>() {
            return -(libc::EINVAL as isize);
        }
        let dev = c.device();
        if dev.gids().len() > max_entries {
            return -(libc::EINVAL as isize);
        }
        for (i, g) in dev.gids().iter().enumerate() {
            // SAFETY: i < max_entries entries of entry_size bytes each.
            unsafe {
                *entries
                    .cast::<u8>()
                    .add(i * entry_size)
                    .cast::<ibv_gid_entry>() = gid_entry(dev, g)
            };
        }
        dev.gids().len() as isize
    })
}

/// `IBV_GID_TYPE_SYSFS_ROCE_V2` of rdma-core's private `<infiniband/driver.h>`.
const IBV_GID_TYPE_SYSFS_ROCE_V2: u32 = 1;

/// `ibv_query_gid_type` (private to rdma-core's providers; perftest's older paths use it).
#[no_mangle]
unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: libc::c_uint,
    gid_type: *mut u32,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            return libc::EINVAL;
        };
        if port != 1 || gid_type.is_null() || c.device().gids().get(index as usize).is_none() {
            return libc::EINVAL;
        }
        // SAFETY: checked non-null; the caller passed an int to fill.
        unsafe { *gid_type = IBV_GID_TYPE_SYSFS_ROCE_V2 };
        0
    })
}

/// `ibv_query_pkey`: one P_Key, the default full-membership 0xffff.
#[no_mangle]
unsafe extern "C" fn ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: libc::c_int,
    pkey: *mut u16,
) -> libc::c_int {
    // SAFETY: per the API.
    if unsafe { Context::from_c(ctx) }.is_none() || port != 1 || index != 0 || pkey.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: checked non-null.
    unsafe { *pkey = 0xffffu16.to_be() };
    0
}

/// `ibv_get_pkey_index`.
#[no_mangle]
unsafe extern "C" fn ibv_get_pkey_index(ctx: *mut ibv_context, port: u8, pkey: u16) -> libc::c_int {
    // SAFETY: per the API.
    if unsafe { Context::from_c(ctx) }.is_none() || port != 1 {
        set_errno(libc::EINVAL);
        return -1;
    }
    if u16::from_be(pkey) & 0x7fff == 0x7fff {
        0
    } else {
        set_errno(libc::ENOENT);
        -1
    }
}

/// `ibv_get_async_event`: ferroce raises no asynchronous events yet, so this blocks (or says
/// EAGAIN on a non-blocking `async_fd`), as on a device where nothing happens.
#[no_mangle]
unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut ibv_context,
    _event: *mut ibv_async_event,
) -> libc::c_int {
    // SAFETY: per the API.
    let Some(c) = (unsafe { Context::from_c(ctx) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a local; blocks unless the program made the fd non-blocking.
    let n = unsafe { libc::read(c.async_fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    if n < 0 {
        return -1;
    }
    set_errno(libc::EIO);
    -1
}

/// `ibv_ack_async_event`: nothing to count, as no event is ever handed out.
#[no_mangle]
unsafe extern "C" fn ibv_ack_async_event(_event: *mut ibv_async_event) {}

/// `verbs_context.query_device_ex`: the attributes and the extended ones ferroce has (one
/// port; no ODP, TSO, RSS, tag matching, packet pacing). Copies at most `attr_size` bytes,
/// zeroing any the program's newer structure has beyond ours.
unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: size_t,
) -> libc::c_int {
    let attr_size = attr_size as usize;
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            return libc::EINVAL;
        };
        // SAFETY: per the API, NULL or the program's input.
        if unsafe { input.as_ref() }.is_some_and(|i| i.comp_mask != 0) {
            return libc::EINVAL;
        }
        if attr.is_null() || attr_size < std::mem::size_of::<ibv_device_attr>() {
            return libc::EINVAL;
        }
        let full = ibv_device_attr_ex {
            orig_attr: device_attr(c),
            phys_port_cnt_ex: 1,
            ..Default::default()
        };
        let ours = std::mem::size_of::<ibv_device_attr_ex>();
        // SAFETY: the program's structure holds attr_size bytes; we write that many at most.
        unsafe {
            std::ptr::write_bytes(attr.cast::<u8>(), 0, attr_size);
            std::ptr::copy_nonoverlapping(
                (&full as *const ibv_device_attr_ex).cast::<u8>(),
                attr.cast::<u8>(),
                attr_size.min(ours),
            );
        }
        0
    })
}

/// `verbs_context.query_port`: the whole port structure the program's headers know.
unsafe extern "C" fn query_port_ex(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    attr_len: size_t,
) -> libc::c_int {
    let attr_len = attr_len as usize;
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            return libc::EINVAL;
        };
        if port != 1 || attr.is_null() {
            return libc::EINVAL;
        }
        let full = port_attr(c);
        let ours = std::mem::size_of::<ibv_port_attr>();
        // SAFETY: the program's structure holds attr_len bytes; we write that many at most.
        unsafe {
            std::ptr::write_bytes(attr.cast::<u8>(), 0, attr_len);
            std::ptr::copy_nonoverlapping(
                (&full as *const ibv_port_attr).cast::<u8>(),
                attr.cast::<u8>(),
                attr_len.min(ours),
            );
        }
        0
    })
}
