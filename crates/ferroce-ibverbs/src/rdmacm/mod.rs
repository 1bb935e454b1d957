//! A drop-in `librdmacm.so.1`: rdma_cm's connection setup between ferroce peers.
//!
//! The kernel's rdma_cm connects two QPs by IB CM messages (REQ, REP, RTU, DREQ) on QP1 of the
//! fabric. ferroce has no kernel, so its librdmacm carries the same four messages over TCP, to
//! the port the server bound (`rdma_bind_addr` + `rdma_listen`): the same exchange (QPN, PSN,
//! GID, path MTU, READ/atomic depths, retry counts and the application's private data) and the
//! same events, in the same order, on the same event channels. A ferroce peer therefore
//! connects with ferroce peers only; connecting to a kernel rdma_cm (rxe) would need IB CM MADs
//! on QP1, which ferroce does not speak yet.
//!
//! The REQ and REP also carry each side's ECE, as the kernel's IB CM REQ and REP do, so two
//! ferroce processes negotiate selective repeat (`crate::qp`'s ECE) with no help from the
//! program: an id's QP offers its ECE in the REQ (`ibv_query_ece` when `rdma_create_qp` makes
//! it), the passive side hands it to its QP (`ibv_set_ece`) before RTR and answers with what is
//! then in force, which the active side hands to its QP before its own RTR.
//! `rdma_set_local_ece` and `rdma_get_remote_ece` are there for an id without a QP, as in
//! librdmacm (for instance to read a request's ECE before making the QP).
//!
//! This code is linked into `librdmacm.so.1`, a library of its own (programs name its symbol
//! versions, `RDMACM_1.0`…), and reaches the verbs through `libibverbs.so.1`'s exported calls,
//! found with `dlsym`: the contexts, PDs and QPs it makes must be the ones the program's own
//! verbs calls see.

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::abi::*;
use crate::{guard, set_errno};

mod wire;

/// `RAI_*` of `<rdma/rdma_cma.h>` (macros bindgen cannot see).
const RAI_PASSIVE: c_int = 1;
const RAI_NUMERICHOST: c_int = 2;

// ---- the verbs, through libibverbs.so.1 -------------------------------------------------------

type GetDeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
type FreeDeviceListFn = unsafe extern "C" fn(*mut *mut ibv_device);
type GetDeviceNameFn = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
type OpenDeviceFn = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
type QueryPortFn = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
type AllocPdFn = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
type DeallocPdFn = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
type CreateQpFn = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
type ModifyQpFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
type DestroyQpFn = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
type CreateCompChannelFn = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel;
type DestroyCompChannelFn = unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int;
type CreateCqFn = unsafe extern "C" fn(
    *mut ibv_context,
    c_int,
    *mut c_void,
    *mut ibv_comp_channel,
    c_int,
) -> *mut ibv_cq;
type DestroyCqFn = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
type EceFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_ece) -> c_int;

/// The libibverbs calls this library makes, resolved in the process's global scope.
struct Verbs {
    get_device_list: GetDeviceListFn,
    free_device_list: FreeDeviceListFn,
    get_device_name: GetDeviceNameFn,
    open_device: OpenDeviceFn,
    query_port: QueryPortFn,
    alloc_pd: AllocPdFn,
    dealloc_pd: DeallocPdFn,
    create_qp: CreateQpFn,
    modify_qp: ModifyQpFn,
    destroy_qp: DestroyQpFn,
    create_comp_channel: CreateCompChannelFn,
    destroy_comp_channel: DestroyCompChannelFn,
    create_cq: CreateCqFn,
    destroy_cq: DestroyCqFn,
    query_ece: EceFn,
    set_ece: EceFn,
}

fn verbs() -> Option<&'static Verbs> {
    static VERBS: OnceLock<Option<Verbs>> = OnceLock::new();
    VERBS
        .get_or_init(|| {
            let find = |name: &CStr| {
                // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the loaded objects.
                let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
                (!p.is_null()).then_some(p)
            };
            // SAFETY: each symbol is libibverbs' function of that name, whose C signature is
            // the one declared in the field.
            // The symbol `$name`, as the function type `$ty`.
            macro_rules! sym {
                ($name:literal as $ty:ty) => {
                    std::mem::transmute::<*mut c_void, $ty>(find($name)?)
                };
            }
            unsafe {
                Some(Verbs {
                    get_device_list: sym!(c"ibv_get_device_list" as GetDeviceListFn),
                    free_device_list: sym!(c"ibv_free_device_list" as FreeDeviceListFn),
                    get_device_name: sym!(c"ibv_get_device_name" as GetDeviceNameFn),
                    open_device: sym!(c"ibv_open_device" as OpenDeviceFn),
                    query_port: sym!(c"ibv_query_port" as QueryPortFn),
                    alloc_pd: sym!(c"ibv_alloc_pd" as AllocPdFn),
                    dealloc_pd: sym!(c"ibv_dealloc_pd" as DeallocPdFn),
                    create_qp: sym!(c"ibv_create_qp" as CreateQpFn),
                    modify_qp: sym!(c"ibv_modify_qp" as ModifyQpFn),
                    destroy_qp: sym!(c"ibv_destroy_qp" as DestroyQpFn),
                    create_comp_channel: sym!(c"ibv_create_comp_channel" as CreateCompChannelFn),
                    destroy_comp_channel: sym!(c"ibv_destroy_comp_channel" as DestroyCompChannelFn),
                    create_cq: sym!(c"ibv_create_cq" as CreateCqFn),
                    destroy_cq: sym!(c"ibv_destroy_cq" as DestroyCqFn),
                    query_ece: sym!(c"ibv_query_ece" as EceFn),
                    set_ece: sym!(c"ibv_set_ece" as EceFn),
                })
            }
        })
        .as_ref()
}

/// An opened device, shared by every id on it (as librdmacm shares one context per device).
#[derive(Clone, Copy)]
struct Device {
    ctx: *mut ibv_context,
    gid_index: u8,
    mtu: ibv_mtu,
}

// SAFETY: the context is only used through libibverbs calls, which are thread-safe.
unsafe impl Send for Device {}
// SAFETY: as above: a copyable handle whose only use is libibverbs' thread-safe calls.
unsafe impl Sync for Device {}

static CONTEXTS: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

/// The context of the device named `name`, opened once.
fn context_named(v: &Verbs, name: &str) -> Option<*mut ibv_context> {
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
fn device_for(ip: IpAddr) -> Option<Device> {
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
fn source_for(dst: IpAddr) -> Option<IpAddr> {
    let any: IpAddr = match dst {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let s = std::net::UdpSocket::bind(SocketAddr::new(any, 0)).ok()?;
    s.connect(SocketAddr::new(dst, 9)).ok()?;
    Some(s.local_addr().ok()?.ip())
}

// ---- socket addresses ----------------------------------------------------------------------

/// Reads a C socket address.
///
/// # Safety
/// `sa` must be NULL or point to a socket address of its family's size.
unsafe fn read_sockaddr(sa: *const sockaddr) -> Option<SocketAddr> {
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
fn write_sockaddr(dst: &mut sockaddr_storage, a: SocketAddr) {
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

fn gid_of(ip: IpAddr) -> [u8; 16] {
    ferroce::gid_of(ip).octets()
}

// ---- the messages on the wire -----------------------------------------------------------------

const MAGIC: &[u8; 4] = b"FRCM";

/// The kinds of message, the byte after the magic. It is the format's version too: a reader
/// refuses a kind it does not know (and closes the connection), so a new field comes as new
/// kinds, here REQ and REP with an ECE (see [`Message`]).
mod kind {
    pub const REQ: u8 = 1;
    pub const REP: u8 = 2;
    pub const REJ: u8 = 3;
    pub const RTU: u8 = 4;
    pub const DREQ: u8 = 5;
    pub const REQ_ECE: u8 = 6;
    pub const REP_ECE: u8 = 7;
}

/// An ECE as a REQ or REP carries it: `struct ibv_ece` without its `comp_mask`. Vendor 0 is
/// none (what librdmacm reports of a peer that sent none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ece {
    /// The vendor whose options these are (an IEEE OUI, or ferroce's id above 24 bits).
    pub vendor_id: u32,
    /// The options, in the vendor's meaning.
    pub options: u32,
}

impl From<ibv_ece> for Ece {
    fn from(e: ibv_ece) -> Ece {
        Ece {
            vendor_id: e.vendor_id,
            options: e.options,
        }
    }
}

impl From<Ece> for ibv_ece {
    fn from(e: Ece) -> ibv_ece {
        ibv_ece {
            vendor_id: e.vendor_id,
            options: e.options,
            comp_mask: 0,
        }
    }
}

/// The IB CM messages rdma_cm exchanges, carried over TCP. (`pub` only so that the `fuzzing`
/// feature's hooks can name it; the module is private.)
///
/// Each starts with the magic `FRCM` and a kind byte. A REQ or REP (kind 1 or 2) follows with
/// the QPN and PSN (4 bytes each, big-endian, 24 bits used), the GID (16), the path MTU, the
/// responder resources, the initiator depth, the retry and RNR retry counts (a byte each), the
/// private data's length (a byte) and the private data. Kinds 6 and 7 are a REQ and a REP with
/// the sender's ECE after that: vendor id and options, 4 bytes each, big-endian. A REJ (3) is
/// the private data's length and the private data; an RTU (4) and a DREQ (5) are the kind
/// alone.
///
/// A build from before ECE knows kinds 1 to 5 only and closes the connection on a REQ of kind
/// 6; the active side then sends its REQ again as kind 1, on a new connection, and goes on
/// without ECE (go-back-N). A passive side answers a REQ of kind 1 with a REP of kind 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// REQ (from the active side) and REP (the passive side's answer) carry the same fields.
    Connect {
        /// REP (else REQ).
        reply: bool,
        /// The sender's QP number (24 bits).
        qpn: u32,
        /// The sender's first PSN (24 bits).
        psn: u32,
        /// The sender's GID.
        gid: [u8; 16],
        /// Path MTU, as the verbs enum.
        mtu: u8,
        /// READ/atomic requests the sender serves at once.
        responder_resources: u8,
        /// READ/atomic requests the sender issues at once.
        initiator_depth: u8,
        /// Transport retries.
        retry_count: u8,
        /// RNR retries.
        rnr_retry_count: u8,
        /// The application's private data (at most 255 bytes: its length is one byte).
        private: Vec<u8>,
        /// The sender's ECE: in a REQ what its QP offers, in a REP what is in force. `None` in
        /// the kinds of a build from before ECE.
        ece: Option<Ece>,
    },
    /// REJ, with the rejecting side's private data.
    Reject {
        /// The application's private data (at most 255 bytes).
        private: Vec<u8>,
    },
    /// RTU: the active side is ready; the passive side is established.
    ReadyToUse,
    /// DREQ.
    Disconnect,
}

impl Message {
    /// The message's bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        match self {
            Message::Connect {
                reply,
                qpn,
                psn,
                gid,
                mtu,
                responder_resources,
                initiator_depth,
                retry_count,
                rnr_retry_count,
                private,
                ece,
            } => {
                b.push(match (*reply, ece.is_some()) {
                    (false, false) => kind::REQ,
                    (true, false) => kind::REP,
                    (false, true) => kind::REQ_ECE,
                    (true, true) => kind::REP_ECE,
                });
                b.extend_from_slice(&qpn.to_be_bytes());
                b.extend_from_slice(&psn.to_be_bytes());
                b.extend_from_slice(gid);
                b.extend_from_slice(&[
                    *mtu,
                    *responder_resources,
                    *initiator_depth,
                    *retry_count,
                    *rnr_retry_count,
                    private.len() as u8,
                ]);
                b.extend_from_slice(private);
                if let Some(e) = ece {
                    b.extend_from_slice(&e.vendor_id.to_be_bytes());
                    b.extend_from_slice(&e.options.to_be_bytes());
                }
            }
            Message::Reject { private } => {
                b.push(kind::REJ);
                b.push(private.len() as u8);
                b.extend_from_slice(private);
            }
            Message::ReadyToUse => b.push(kind::RTU),
            Message::Disconnect => b.push(kind::DREQ),
        }
        b
    }

    /// Reads one message from `s` (an error for anything else, never a panic).
    pub fn read(s: &mut impl Read) -> std::io::Result<Message> {
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut head = [0u8; 5];
        s.read_exact(&mut head)?;
        if &head[..4] != MAGIC {
            return Err(bad("not a ferroce rdma_cm peer"));
        }
        let read_private = |s: &mut dyn Read, n: u8| -> std::io::Result<Vec<u8>> {
            let mut p = vec![0u8; usize::from(n)];
            s.read_exact(&mut p)?;
            Ok(p)
        };
        match head[4] {
            k @ (kind::REQ | kind::REP | kind::REQ_ECE | kind::REP_ECE) => {
                let mut f = [0u8; 4 + 4 + 16 + 6];
                s.read_exact(&mut f)?;
                let private = read_private(s, f[29])?;
                let ece = if k == kind::REQ_ECE || k == kind::REP_ECE {
                    let mut e = [0u8; 8];
                    s.read_exact(&mut e)?;
                    Some(Ece {
                        vendor_id: u32::from_be_bytes([e[0], e[1], e[2], e[3]]),
                        options: u32::from_be_bytes([e[4], e[5], e[6], e[7]]),
                    })
                } else {
                    None
                };
                Ok(Message::Connect {
                    reply: k == kind::REP || k == kind::REP_ECE,
                    qpn: u32::from_be_bytes([f[0], f[1], f[2], f[3]]) & 0x00ff_ffff,
                    psn: u32::from_be_bytes([f[4], f[5], f[6], f[7]]) & 0x00ff_ffff,
                    gid: f[8..24].try_into().map_err(|_| bad("gid"))?,
                    mtu: f[24],
                    responder_resources: f[25],
                    initiator_depth: f[26],
                    retry_count: f[27],
                    rnr_retry_count: f[28],
                    private,
                    ece,
                })
            }
            kind::REJ => {
                let mut n = [0u8; 1];
                s.read_exact(&mut n)?;
                Ok(Message::Reject {
                    private: read_private(s, n[0])?,
                })
            }
            kind::RTU => Ok(Message::ReadyToUse),
            kind::DREQ => Ok(Message::Disconnect),
            _ => Err(bad("unknown rdma_cm message")),
        }
    }
}

// ---- event channels and events -----------------------------------------------------------------

#[repr(C)]
struct Channel {
    c: rdma_event_channel,
    queue: Arc<EventQueue>,
}

/// A channel's events: shared with the threads of its ids' connections, which may outlive
/// the channel (a program destroys its ids and channel while a connection winds down).
struct EventQueue {
    /// A blocking semaphore eventfd (the channel's `fd`): one count per queued event.
    efd: OwnedFd,
    events: Mutex<VecDeque<usize>>,
}

#[repr(C)]
struct Event {
    c: rdma_cm_event,
    /// The bytes `c.param.conn.private_data` points to.
    private: Vec<u8>,
}

impl IdShared {
    fn post(&self, ev: Box<Event>) {
        self.queue.post(self, ev);
    }
}

impl EventQueue {
    /// Queues an event for `id` unless the id was destroyed (checked under the queue's lock,
    /// which `rdma_destroy_id` takes too, so no event for a dead id is ever queued).
    fn post(&self, id: &IdShared, mut ev: Box<Event>) {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if !id.alive.load(Ordering::Acquire) {
            return;
        }
        if !ev.private.is_empty() {
            // The conn arm of the union, which these events use.
            ev.c.param.conn.private_data = ev.private.as_ptr().cast();
            ev.c.param.conn.private_data_len = ev.private.len() as u8;
        }
        q.push_back(Box::into_raw(ev) as usize);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local to our eventfd.
        let _ = unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

impl Drop for EventQueue {
    fn drop(&mut self) {
        for e in self
            .events
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            // SAFETY: each entry is a leaked Event box, freed once.
            drop(unsafe { Box::from_raw(e as *mut Event) });
        }
    }
}

fn event(id: *mut rdma_cm_id, kind: rdma_cm_event_type, status: c_int) -> Box<Event> {
    Box::new(Event {
        c: rdma_cm_event {
            id,
            event: kind,
            status,
            ..Default::default()
        },
        private: Vec::new(),
    })
}

// ---- ids ------------------------------------------------------------------------------------------

/// What the threads of a connection share with the id.
struct IdShared {
    alive: AtomicBool,
    stream: Mutex<Option<TcpStream>>,
    /// The id's QP (its address, or 0). A connection's thread touches the QP only under this
    /// lock and only while `alive`; `rdma_destroy_qp` and `rdma_destroy_id` take it too.
    qp: Mutex<usize>,
    /// The id's channel's events.
    queue: Arc<EventQueue>,
    /// The peer's ECE, from its REQ (a passive id) or REP (an active one); vendor 0 if it sent
    /// none (`rdma_get_remote_ece`).
    remote_ece: Mutex<Ece>,
    /// A connection through IB CM on the wire (instead of `stream`): its manager (a leaked
    /// [`wire::WireCm`], by address) and connection.
    wire: Mutex<Option<(usize, ferroce::cm::ib::ConnId)>>,
}

/// The peer's side of a connection, as its REQ or REP said.
#[derive(Clone)]
struct Peer {
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
    mtu: u8,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    /// Its ECE; `None` from a build before ECE, which is answered in its own kinds.
    ece: Option<Ece>,
}

#[repr(C)]
struct CmId {
    c: rdma_cm_id,
    shared: Arc<IdShared>,
    device: Option<Device>,
    listener: Option<TcpListener>,
    /// The REQ a passive id was made for.
    request: Option<Peer>,
    my_psn: u32,
    /// The ECE this side's REQ offers: its QP's (`ibv_query_ece` when `rdma_create_qp` makes
    /// it), else what `rdma_set_local_ece` set; vendor 0 for none.
    local_ece: Ece,
    /// The local ACK timeout (`RDMA_OPTION_ID_ACK_TIMEOUT`), else 14 (67 ms), as ferroce's own.
    ack_timeout: u8,
    owns_pd: bool,
    /// CQs and channels `rdma_create_qp` made because the program passed none (librdmacm
    /// does the same); destroyed with the QP.
    owns_cqs: bool,
    /// A synchronous id (made with a NULL channel): each call waits for its own event, on a
    /// channel of the id's own (`owns_channel`).
    sync: bool,
    owns_channel: bool,
    /// For a passive endpoint (`rdma_create_ep`): the PD and QP attributes each request's QP
    /// is made with in `rdma_get_request`.
    ep_qp: Option<(usize, ibv_qp_init_attr)>,
    path: Box<ibv_sa_path_rec>,
    /// The services a listening id takes REQs for on the wire, and on which managers.
    wire_listens: Vec<(&'static wire::WireCm, u64)>,
}

/// # Safety
/// `id` must be NULL or an id this library returned and not yet destroyed.
unsafe fn id_of<'a>(id: *mut rdma_cm_id) -> Option<&'a mut CmId> {
    // SAFETY: `c` is the first field of the repr(C) `CmId`.
    unsafe { id.cast::<CmId>().as_mut() }
}

/// # Safety
/// `ch` must be NULL or a channel this library returned and not yet destroyed.
unsafe fn channel_of<'a>(ch: *mut rdma_event_channel) -> Option<&'a Channel> {
    // SAFETY: `c` is the first field of the repr(C) `Channel`.
    unsafe { ch.cast::<Channel>().as_ref() }
}

fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: fills 4 bytes of a local.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    u32::from_ne_bytes(b) & 0x00ff_ffff
}

fn new_id(
    channel: *mut rdma_event_channel,
    queue: Arc<EventQueue>,
    context: *mut c_void,
    ps: rdma_port_space,
) -> *mut CmId {
    Box::into_raw(Box::new(CmId {
        c: rdma_cm_id {
            channel,
            context,
            ps,
            // rdma_cm's UDP port space is UD QPs (resolved by SIDR); TCP's is RC.
            qp_type: if ps == RDMA_PS_UDP {
                IBV_QPT_UD
            } else {
                IBV_QPT_RC
            },
            ..Default::default()
        },
        shared: Arc::new(IdShared {
            alive: AtomicBool::new(true),
            stream: Mutex::new(None),
            qp: Mutex::new(0),
            queue,
            remote_ece: Mutex::new(Ece::default()),
            wire: Mutex::new(None),
        }),
        device: None,
        listener: None,
        request: None,
        my_psn: random_psn(),
        local_ece: Ece::default(),
        ack_timeout: 14,
        owns_pd: false,
        owns_cqs: false,
        sync: false,
        owns_channel: false,
        ep_qp: None,
        path: Box::default(),
        wire_listens: Vec::new(),
    }))
}

/// A new id with a channel of its own, for librdmacm's synchronous mode.
fn new_sync_id(context: *mut c_void, ps: rdma_port_space) -> Option<*mut CmId> {
    let channel = rdma_create_event_channel();
    // SAFETY: just made.
    let queue = unsafe { channel_of(channel) }?.queue.clone();
    let id = new_id(channel, queue, context, ps);
    // SAFETY: just made, not yet handed out.
    let i = unsafe { &mut *id };
    i.sync = true;
    i.owns_channel = true;
    Some(id)
}

/// In synchronous mode, waits for the id's next event: 0 if it is `want`, else -1 with the
/// errno that event stands for. An asynchronous id returns 0 at once (its event is the
/// program's to read).
///
/// # Safety
/// `id` must be a live id of ours.
unsafe fn wait_sync(id: *mut rdma_cm_id, want: rdma_cm_event_type) -> c_int {
    // SAFETY: the caller's contract.
    let Some(i) = (unsafe { id_of(id) }) else {
        return 0;
    };
    if !i.sync {
        return 0;
    }
    let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
    // SAFETY: the id's own channel.
    if unsafe { rdma_get_cm_event(i.c.channel, &mut ev) } != 0 {
        return -1;
    }
    // SAFETY: an event just handed out, acknowledged once here.
    let (kind, status) = unsafe { ((*ev).event, (*ev).status) };
    // SAFETY: as above.
    unsafe { rdma_ack_cm_event(ev) };
    i.c.event = std::ptr::null_mut();
    if kind == want && status == 0 {
        return 0;
    }
    set_errno(match kind {
        RDMA_CM_EVENT_REJECTED => libc::ECONNREFUSED,
        RDMA_CM_EVENT_UNREACHABLE => libc::ENETUNREACH,
        RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR => libc::EADDRNOTAVAIL,
        _ if status < 0 => -status,
        _ => libc::ECONNRESET,
    });
    -1
}

/// Fills the id's route for a connection from `src` to `dst` on `dev`.
fn set_route(id: &mut CmId, dev: Device, src: SocketAddr, dst: Option<SocketAddr>) {
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

fn src_addr(id: &CmId) -> Option<SocketAddr> {
    // SAFETY: the storage arm holds a socket address (or family 0: None).
    unsafe { read_sockaddr(&id.c.route.addr.__bindgen_anon_1.src_addr) }
}

fn dst_addr(id: &CmId) -> Option<SocketAddr> {
    // SAFETY: as above.
    unsafe { read_sockaddr(&id.c.route.addr.__bindgen_anon_2.dst_addr) }
}

// ---- exported calls: channels, ids, addresses ------------------------------------------------

/// `rdma_create_event_channel`.
#[no_mangle]
extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    guard(std::ptr::null_mut(), || {
        // SAFETY: eventfd takes no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return std::ptr::null_mut();
        }
        // SAFETY: just created, ours.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        Box::into_raw(Box::new(Channel {
            c: rdma_event_channel { fd },
            queue: Arc::new(EventQueue {
                efd,
                events: Mutex::new(VecDeque::new()),
            }),
        }))
        .cast()
    })
}

/// `rdma_destroy_event_channel`: events not yet read are freed with it (once no connection
/// thread holds its queue any more).
#[no_mangle]
unsafe extern "C" fn rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    if ch.is_null() {
        return;
    }
    // SAFETY: per the API, a channel of ours, destroyed once.
    drop(unsafe { Box::from_raw(ch.cast::<Channel>()) });
}

/// `rdma_create_id`: an id for RC connections (`RDMA_PS_TCP`) reporting on `channel`.
#[no_mangle]
unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space,
) -> c_int {
    guard(-1, || {
        if id.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        if ps != RDMA_PS_TCP && ps != RDMA_PS_UDP {
            set_errno(libc::EOPNOTSUPP);
            return -1;
        }
        // A NULL channel asks for librdmacm's synchronous mode.
        if channel.is_null() {
            let Some(made) = new_sync_id(context, ps) else {
                return -1;
            };
            // SAFETY: checked non-null; the caller's output.
            unsafe { *id = made.cast() };
            return 0;
        }
        // SAFETY: per the API, a channel of ours.
        let Some(ch) = (unsafe { channel_of(channel) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: checked non-null; the caller's output.
        unsafe { *id = new_id(channel, ch.queue.clone(), context, ps).cast() };
        0
    })
}

/// `rdma_destroy_id`: closes its connection and drops its unread events.
#[no_mangle]
unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    guard(-1, || {
        if id.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: per the API, an id of ours, destroyed once.
        let b = unsafe { Box::from_raw(id.cast::<CmId>()) };
        {
            // Under the QP lock no connection thread is using the QP; under the queue's lock
            // none is queuing an event. After both, none will.
            let _qp = b.shared.qp.lock().unwrap_or_else(|e| e.into_inner());
            let mut q = b
                .shared
                .queue
                .events
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            b.shared.alive.store(false, Ordering::Release);
            q.retain(|&e| {
                // SAFETY: queued events are live boxes.
                let ev = unsafe { &*(e as *const Event) };
                let mine = ev.c.id == id || ev.c.listen_id == id;
                if mine {
                    // SAFETY: removed from the queue, freed once.
                    drop(unsafe { Box::from_raw(e as *mut Event) });
                }
                !mine
            });
        }
        if let Some(s) = b
            .shared
            .stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some((cm, conn)) = wire::of_id(&b.shared) {
            cm.release(conn);
        }
        for (cm, service) in &b.wire_listens {
            cm.unlisten(*service);
        }
        if let Some(l) = &b.listener {
            // Stops listening now, so the port may be bound again at once (the accepting
            // thread holds a clone of the socket; its accept then fails and it ends).
            // SAFETY: shutdown on a descriptor this id owns.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        if b.sync && !b.c.event.is_null() {
            // The request event `rdma_get_request` kept for the program.
            // SAFETY: an event of ours, not acknowledged yet.
            unsafe { rdma_ack_cm_event(b.c.event) };
        }
        if b.owns_channel {
            // SAFETY: the id's own channel, which nothing else uses.
            unsafe { rdma_destroy_event_channel(b.c.channel) };
        }
        0
    })
}

/// `rdma_bind_addr`: takes the address (and port: 0 picks one) for `rdma_listen`.
#[no_mangle]
unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int {
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
        if !a.ip().is_unspecified() {
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
unsafe extern "C" fn rdma_resolve_addr(
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
unsafe extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
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

// ---- QPs -----------------------------------------------------------------------------------------

/// `rdma_create_qp`: an RC QP on the id's device, brought to INIT (a NULL `pd` gets one).
#[no_mangle]
unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let (Some(i), Some(a), Some(v)) = (unsafe { id_of(id) }, unsafe { attr.as_mut() }, verbs())
        else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if i.c.verbs.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let mut pd = pd;
        if pd.is_null() {
            // SAFETY: the id's live context.
            pd = unsafe { (v.alloc_pd)(i.c.verbs) };
            if pd.is_null() {
                return -1;
            }
            i.owns_pd = true;
        }
        // The id's port space names the QP type (RC for RDMA_PS_TCP), as in librdmacm.
        a.qp_type = i.c.qp_type;
        if a.send_cq.is_null() || a.recv_cq.is_null() {
            // As librdmacm: a channel and a CQ for each the program left out, sized by the caps.
            i.owns_cqs = true;
            for send in [true, false] {
                let (slot, depth) = if send {
                    (&mut a.send_cq, a.cap.max_send_wr)
                } else {
                    (&mut a.recv_cq, a.cap.max_recv_wr)
                };
                if !slot.is_null() {
                    continue;
                }
                // SAFETY: the id's live context.
                let ch = unsafe { (v.create_comp_channel)(i.c.verbs) };
                let cq = if ch.is_null() {
                    std::ptr::null_mut()
                } else {
                    // SAFETY: the id's live context and the channel just made.
                    unsafe { (v.create_cq)(i.c.verbs, depth.max(1) as c_int, id.cast(), ch, 0) }
                };
                if send {
                    (i.c.send_cq_channel, i.c.send_cq) = (ch, cq);
                } else {
                    (i.c.recv_cq_channel, i.c.recv_cq) = (ch, cq);
                }
                if cq.is_null() {
                    release_cqs(i, v);
                    return -1;
                }
                *slot = cq;
            }
        }
        // SAFETY: libibverbs' call with the program's attributes.
        let qp = unsafe { (v.create_qp)(pd, a) };
        if qp.is_null() {
            release_cqs(i, v);
            return -1;
        }
        let rc = if a.qp_type == IBV_QPT_UD {
            ready_ud_qp(v, qp)
        } else {
            let mut init = ibv_qp_attr {
                qp_state: IBV_QPS_INIT,
                pkey_index: 0,
                port_num: 1,
                qp_access_flags: IBV_ACCESS_REMOTE_READ
                    | IBV_ACCESS_REMOTE_WRITE
                    | IBV_ACCESS_REMOTE_ATOMIC,
                ..Default::default()
            };
            let mask = crate::qp::INIT_NEEDS;
            // SAFETY: the QP just created.
            unsafe { (v.modify_qp)(qp, &mut init, mask as c_int) }
        };
        if rc != 0 {
            // SAFETY: destroyed once, never handed out.
            unsafe { (v.destroy_qp)(qp) };
            set_errno(rc);
            return -1;
        }
        init_ece(i, v, qp);
        i.c.qp = qp;
        *i.shared.qp.lock().unwrap_or_else(|e| e.into_inner()) = qp as usize;
        i.c.pd = pd;
        i.c.send_cq = a.send_cq;
        i.c.recv_cq = a.recv_cq;
        i.c.srq = a.srq;
        0
    })
}

/// Destroys the CQs and channels `rdma_create_qp` made for the id, if it made them.
/// A UD QP of rdma_cm's UDP port space is ready to send as soon as it is made, as librdmacm
/// makes it: INIT with rdma_cm's Q_Key (`RDMA_UDP_QKEY`), RTR, RTS.
fn ready_ud_qp(v: &Verbs, qp: *mut ibv_qp) -> c_int {
    let steps = [
        (
            ibv_qp_attr {
                qp_state: IBV_QPS_INIT,
                port_num: 1,
                qkey: RDMA_UDP_QKEY,
                ..Default::default()
            },
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
        ),
        (
            ibv_qp_attr {
                qp_state: IBV_QPS_RTR,
                ..Default::default()
            },
            IBV_QP_STATE,
        ),
        (
            ibv_qp_attr {
                qp_state: IBV_QPS_RTS,
                ..Default::default()
            },
            IBV_QP_STATE | IBV_QP_SQ_PSN,
        ),
    ];
    for (mut attr, mask) in steps {
        // SAFETY: the QP the caller just created.
        let rc = unsafe { (v.modify_qp)(qp, &mut attr, mask as c_int) };
        if rc != 0 {
            return rc;
        }
    }
    0
}

fn release_cqs(i: &mut CmId, v: &Verbs) {
    if !i.owns_cqs {
        return;
    }
    i.owns_cqs = false;
    let cqs = [
        (&mut i.c.send_cq, &mut i.c.send_cq_channel),
        (&mut i.c.recv_cq, &mut i.c.recv_cq_channel),
    ];
    for (cq, ch) in cqs {
        // SAFETY: objects this library made for the id, destroyed once (then cleared).
        unsafe {
            if !cq.is_null() {
                (v.destroy_cq)(*cq);
            }
            if !ch.is_null() {
                (v.destroy_comp_channel)(*ch);
            }
        }
        *cq = std::ptr::null_mut();
        *ch = std::ptr::null_mut();
    }
}

/// `rdma_create_qp_ex`: the basic attributes of an extended request (a PD is required there).
#[no_mangle]
unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    // SAFETY: per the API.
    let Some(a) = (unsafe { attr.as_ref() }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    // Only the fields the basic call knows: anything more is asked for by comp_mask bits
    // beyond the PD.
    if a.comp_mask & !IBV_QP_INIT_ATTR_PD != 0 {
        set_errno(libc::EOPNOTSUPP);
        return -1;
    }
    let mut basic = ibv_qp_init_attr {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    // SAFETY: as rdma_create_qp, with the same id and PD.
    let rc = unsafe { rdma_create_qp(id, a.pd, &mut basic) };
    if rc == 0 {
        // SAFETY: the caller's attributes get the caps the QP has, as in the basic call.
        unsafe { (*attr).cap = basic.cap };
    }
    rc
}

/// `rdma_destroy_qp`.
#[no_mangle]
unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    guard((), || {
        // SAFETY: per the API.
        let (Some(i), Some(v)) = (unsafe { id_of(id) }, verbs()) else {
            return;
        };
        if !i.c.qp.is_null() {
            // Under the lock, so that no connection thread is moving the QP meanwhile.
            let mut held = i.shared.qp.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the id's QP, destroyed once.
            unsafe { (v.destroy_qp)(i.c.qp) };
            *held = 0;
            i.c.qp = std::ptr::null_mut();
        }
        release_cqs(i, v);
        if i.owns_pd && !i.c.pd.is_null() {
            // SAFETY: the PD this library allocated for the id.
            unsafe { (v.dealloc_pd)(i.c.pd) };
            i.c.pd = std::ptr::null_mut();
            i.owns_pd = false;
        }
    })
}

/// This side's connection parameters, without the private data (so a thread may keep them).
#[derive(Clone, Copy)]
struct Params {
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
}

impl From<&rdma_conn_param> for Params {
    fn from(p: &rdma_conn_param) -> Params {
        Params {
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            retry_count: p.retry_count,
            rnr_retry_count: p.rnr_retry_count,
        }
    }
}

/// What a connection's thread needs of its id, copied so that it never reads the id itself.
#[derive(Clone, Copy)]
struct Local {
    device: Device,
    psn: u32,
    ack_timeout: u8,
    ece: Ece,
}

impl CmId {
    fn local(&self) -> Option<Local> {
        Some(Local {
            device: self.device?,
            psn: self.my_psn,
            ack_timeout: self.ack_timeout,
            ece: self.local_ece,
        })
    }
}

/// As librdmacm when it makes an id's QP: the QP's ECE (what it offers) becomes the id's local
/// one, which its REQ carries. On a passive id the request's ECE is known already and goes to
/// the QP for its RTR: as it is if of the same vendor, else as this side's vendor with no
/// options (the peer's bits mean something else). A QP without ECE is left as it is.
fn init_ece(i: &mut CmId, v: &Verbs, qp: *mut ibv_qp) {
    let mut mine = ibv_ece::default();
    // SAFETY: a live QP and a full structure.
    i.local_ece = if unsafe { (v.query_ece)(qp, &mut mine) } == 0 {
        mine.into()
    } else {
        Ece::default()
    };
    let remote = *i
        .shared
        .remote_ece
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if remote.vendor_id == 0 {
        return;
    }
    set_peer_ece(v, qp, i.local_ece, remote);
}

/// Hands the peer's ECE to `qp` before its RTR (`ibv_set_ece`): another vendor's, or none (a
/// peer without ECE), as this side's vendor with no options, as librdmacm does. A failure (a
/// QP without ECE) leaves the QP as it is, as librdmacm ignores it too.
fn set_peer_ece(v: &Verbs, qp: *mut ibv_qp, local: Ece, remote: Ece) {
    let given = if remote.vendor_id == local.vendor_id {
        remote
    } else {
        Ece {
            vendor_id: local.vendor_id,
            options: 0,
        }
    };
    let mut e = ibv_ece::from(given);
    // SAFETY: a live QP of the id (the caller holds it) and a full structure.
    unsafe { (v.set_ece)(qp, &mut e) };
}

/// The ECE in force on `qp` (after its RTR), which a REP carries; vendor 0 if it has none.
fn ece_in_force(v: &Verbs, qp: *mut ibv_qp) -> Ece {
    let mut e = ibv_ece::default();
    // SAFETY: a live QP of the id and a full structure.
    if qp.is_null() || unsafe { (v.query_ece)(qp, &mut e) } != 0 {
        return Ece::default();
    }
    e.into()
}

/// The deepest READ/atomic queue a ferroce QP serves or keeps: a request that asks for more
/// (the kernel's rdma_cm asks for its device's maximum, 128 on rxe, when the program passes no
/// parameters) gets this, as librdmacm caps the request's values by the device's.
const MAX_DEPTH: u8 = ferroce_proto::attr::MAX_RD_ATOMIC;

/// Brings `qp` to RTR and RTS toward `peer`.
fn connect_qp(qp: *mut ibv_qp, local: &Local, peer: &Peer, mine: &Params) -> Result<(), c_int> {
    let v = verbs().ok_or(libc::ENOSYS)?;
    let dev = local.device;
    if qp.is_null() {
        // A QP the program made itself (conn_param.qp_num) is not reachable from here.
        return Err(libc::EOPNOTSUPP);
    }
    let mut ah = ibv_ah_attr {
        is_global: 1,
        port_num: 1,
        ..Default::default()
    };
    ah.grh.dgid = ibv_gid { raw: peer.gid };
    ah.grh.sgid_index = dev.gid_index;
    ah.grh.hop_limit = 64;
    let mut rtr = ibv_qp_attr {
        qp_state: IBV_QPS_RTR,
        path_mtu: (dev.mtu).min(ibv_mtu::from(peer.mtu)).max(IBV_MTU_256),
        dest_qp_num: peer.qpn,
        rq_psn: peer.psn,
        max_dest_rd_atomic: mine.responder_resources.clamp(1, MAX_DEPTH),
        min_rnr_timer: 12,
        ah_attr: ah,
        ..Default::default()
    };
    let mask = crate::qp::RTR_NEEDS;
    // SAFETY: the id's live QP.
    let rc = unsafe { (v.modify_qp)(qp, &mut rtr, mask as c_int) };
    if rc != 0 {
        return Err(rc);
    }
    let mut rts = ibv_qp_attr {
        qp_state: IBV_QPS_RTS,
        sq_psn: local.psn,
        timeout: local.ack_timeout,
        retry_cnt: mine.retry_count.min(7),
        rnr_retry: mine.rnr_retry_count.min(7),
        max_rd_atomic: mine
            .initiator_depth
            .min(peer.responder_resources)
            .clamp(1, MAX_DEPTH),
        ..Default::default()
    };
    let mask = crate::qp::RTS_NEEDS;
    // SAFETY: the id's live QP.
    let rc = unsafe { (v.modify_qp)(qp, &mut rts, mask as c_int) };
    if rc != 0 {
        return Err(rc);
    }
    Ok(())
}

fn move_qp_to_error(qp: *mut ibv_qp) {
    if let (false, Some(v)) = (qp.is_null(), verbs()) {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: a QP of an id; ERR is reachable from any state.
        unsafe { (v.modify_qp)(qp, &mut a, IBV_QP_STATE as c_int) };
    }
}

/// The private data a connection parameter names.
///
/// # Safety
/// `p.private_data` must point to `private_data_len` bytes (or be NULL).
unsafe fn private_of(p: &rdma_conn_param) -> Vec<u8> {
    if p.private_data.is_null() || p.private_data_len == 0 {
        return Vec::new();
    }
    // SAFETY: the caller's contract.
    unsafe {
        std::slice::from_raw_parts(p.private_data.cast::<u8>(), usize::from(p.private_data_len))
    }
    .to_vec()
}

/// The REQ (or, `reply`, the REP) this side sends: its QP, PSN, GID and path MTU, `p`'s depths
/// and retry counts, the program's private data and `ece` (`None` toward a build before ECE).
fn connect_message(
    i: &CmId,
    local: &Local,
    p: &rdma_conn_param,
    reply: bool,
    private: Vec<u8>,
    ece: Option<Ece>,
) -> Message {
    let qpn = if i.c.qp.is_null() {
        p.qp_num
    } else {
        // SAFETY: the id's live QP.
        unsafe { (*i.c.qp).qp_num }
    };
    // The route's source was set when the address was resolved or bound.
    let src_ip = src_addr(i)
        .map(|a| a.ip())
        .unwrap_or(Ipv4Addr::UNSPECIFIED.into());
    Message::Connect {
        reply,
        qpn,
        psn: local.psn,
        gid: gid_of(src_ip),
        mtu: local.device.mtu as u8,
        responder_resources: p.responder_resources,
        initiator_depth: p.initiator_depth,
        retry_count: p.retry_count,
        rnr_retry_count: p.rnr_retry_count,
        private,
        ece,
    }
}

fn peer_of(m: &Message) -> Option<(Peer, Vec<u8>)> {
    match m {
        Message::Connect {
            qpn,
            psn,
            gid,
            mtu,
            responder_resources,
            initiator_depth,
            retry_count,
            rnr_retry_count,
            private,
            ece,
            ..
        } => Some((
            Peer {
                qpn: *qpn,
                psn: *psn,
                gid: *gid,
                mtu: *mtu,
                responder_resources: *responder_resources,
                initiator_depth: *initiator_depth,
                retry_count: *retry_count,
                rnr_retry_count: *rnr_retry_count,
                ece: *ece,
            },
            private.clone(),
        )),
        _ => None,
    }
}

/// Reads the rest of a connection: a DREQ or the stream closing is `DISCONNECTED`.
fn watch_disconnect(mut s: TcpStream, shared: Arc<IdShared>, id: usize) {
    loop {
        match Message::read(&mut s) {
            Ok(Message::Disconnect) | Err(_) => break,
            Ok(_) => continue,
        }
    }
    // The QP stays as it is, as with the kernel's rdma_cm: the program reacts to the event
    // (usually with its own rdma_disconnect, which moves its QP to ERR).
    shared.post(event(id as *mut rdma_cm_id, RDMA_CM_EVENT_DISCONNECTED, 0));
}

/// `rdma_connect`: sends the REQ; `ESTABLISHED` (with the REP's private data) once the QP is
/// in RTS and the RTU is sent, `REJECTED` on a REJ or when nothing listens, `UNREACHABLE` when
/// the peer cannot be reached.
#[no_mangle]
unsafe extern "C" fn rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
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
        std::thread::spawn(move || {
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

/// The id's source address, with a port: one picked now from the ephemeral range if it has
/// none (an address resolved for `rdma_connect`), as the kernel binds one, so that the IP
/// header of the REQ names it and `rdma_get_src_port` reports it.
fn source_port_of(i: &mut CmId) -> SocketAddr {
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

/// Whether `ip` is an address of this host.
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback()
        || ferroce::devices()
            .unwrap_or_default()
            .iter()
            .any(|d| d.gids().iter().any(|g| g.ip == ip))
}

/// The local IP a REQ's IP header names.
fn local_ip_of(req: &Option<ferroce::cm::ib::ConnectParams>) -> Option<IpAddr> {
    let r = req.as_ref()?;
    ferroce::cm::ib::ip::IpHeader::parse(&r.private_data)
        .ok()
        .map(|h| h.src.ip())
}

/// Sends the REQ `req` to `dst` on a new connection; the connection and the peer's answer, or
/// the event (and status) that reports the failure. A peer that closes the connection on a REQ
/// with an ECE is a build from before ECE (see [`Message`]): the REQ goes again without it.
fn request(
    dst: SocketAddr,
    mut req: Message,
) -> Result<(TcpStream, Message), (rdma_cm_event_type, c_int)> {
    loop {
        let mut s = match TcpStream::connect_timeout(&dst, Duration::from_secs(5)) {
            Ok(s) => s,
            // Nothing listens: IB CM's "invalid service ID" rejection, status 8.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err((RDMA_CM_EVENT_REJECTED, 8))
            }
            Err(_) => return Err((RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT)),
        };
        let _ = s.set_nodelay(true);
        if s.write_all(&req.encode()).is_err() {
            return Err((RDMA_CM_EVENT_UNREACHABLE, -libc::ECONNRESET));
        }
        match Message::read(&mut s) {
            Ok(m) => return Ok((s, m)),
            Err(e) => {
                use std::io::ErrorKind as K;
                // The old reader refuses the kind after reading 5 bytes and closes with the
                // rest unread: a reset, or an end of stream if it all came in one read.
                let refused = matches!(
                    e.kind(),
                    K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted
                );
                if let Message::Connect {
                    ece: ece @ Some(_), ..
                } = &mut req
                {
                    if refused {
                        *ece = None;
                        continue;
                    }
                }
                return Err((RDMA_CM_EVENT_UNREACHABLE, -libc::EPROTO));
            }
        }
    }
}

/// `rdma_listen`: each REQ on the bound address becomes a new id in `CONNECT_REQUEST`.
#[no_mangle]
unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, _backlog: c_int) -> c_int {
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
            channel: i.c.channel as usize,
            context: i.c.context as usize,
            ps: i.c.ps,
            sync: i.sync,
        };
        listen_on_wire(i, listen);
        std::thread::spawn(move || {
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
fn listen_on_wire(i: &mut CmId, listen: ListenOf) {
    let Some(bound) = src_addr(i) else { return };
    if wire::mode() == wire::Mode::Tcp {
        return;
    }
    let targets: Vec<(Device, IpAddr)> = match i.device {
        Some(dev) => vec![(dev, bound.ip())],
        None => ferroce::devices()
            .unwrap_or_default()
            .iter()
            .filter_map(|d| {
                let ip = d
                    .gids()
                    .iter()
                    .map(|g| g.ip)
                    .find(|ip| ip.is_ipv4() == bound.is_ipv4())?;
                Some((device_for(ip)?, ip))
            })
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
struct ListenOf {
    id: usize,
    channel: usize,
    context: usize,
    ps: rdma_port_space,
    sync: bool,
}

/// Makes the id of a request to the listener `listen` (whose shared part is `shared`) between
/// `addrs` (local, remote) on `dev`, lets `prepare` tie it to its connection, and reports it
/// as `CONNECT_REQUEST` with the requester's `private` data. A synchronous listener's requests
/// become synchronous ids, each with a channel of its own; the request itself is reported on
/// the listener's. Returns the new id, or `None` when none was made or the listener is gone
/// (then the id is dropped and nothing is reported).
fn post_request(
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
            listen.channel as *mut rdma_event_channel,
            shared.queue.clone(),
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
fn release_request_event(i: &mut CmId) {
    if i.sync && !i.c.event.is_null() {
        // SAFETY: an event of ours, not acknowledged yet, acknowledged once (then cleared).
        unsafe { rdma_ack_cm_event(i.c.event) };
        i.c.event = std::ptr::null_mut();
    }
}

/// `rdma_accept`: brings the QP to RTS toward the requester and sends the REP;
/// `ESTABLISHED` when the RTU arrives.
#[no_mangle]
unsafe extern "C" fn rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
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
        std::thread::spawn(move || {
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
unsafe extern "C" fn rdma_reject(id: *mut rdma_cm_id, private: *const c_void, len: u8) -> c_int {
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
        if let Some((cm, conn)) = wire::of_id(&i.shared) {
            if i.c.ps == RDMA_PS_UDP {
                cm.reject_ud(conn, &private);
            } else {
                cm.reject(conn, &private);
            }
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

/// `rdma_disconnect`: moves the QP to ERR, sends a DREQ; `DISCONNECTED` on both sides.
#[no_mangle]
unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        move_qp_to_error(i.c.qp);
        if let Some((cm, conn)) = wire::of_id(&i.shared) {
            if !cm.disconnect(conn) {
                set_errno(libc::ENOTCONN);
                return -1;
            }
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

/// `rdma_get_request`: on a synchronous listener, the next connection request, as a new
/// synchronous id (with a QP if the listener is an endpoint made with QP attributes). The
/// request event stays with the id (`id->event`) until it is accepted or rejected.
#[no_mangle]
unsafe extern "C" fn rdma_get_request(listen: *mut rdma_cm_id, out: *mut *mut rdma_cm_id) -> c_int {
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

/// `rdma_create_ep`: a synchronous id for `res`: bound (passive) or resolved to its
/// destination (active), with a QP made from `qp_attr` if given (for a passive endpoint, each
/// request's id gets one in `rdma_get_request`).
#[no_mangle]
unsafe extern "C" fn rdma_create_ep(
    out: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(r) = (unsafe { res.as_ref() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if out.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let ps = if r.ai_port_space != 0 {
            r.ai_port_space as rdma_port_space
        } else {
            RDMA_PS_TCP
        };
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: a NULL channel makes a synchronous id; the output is a local.
        if unsafe { rdma_create_id(std::ptr::null_mut(), &mut id, std::ptr::null_mut(), ps) } != 0 {
            return -1;
        }
        let fail = |id: *mut rdma_cm_id| {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            // SAFETY: the id made above, never handed out.
            unsafe { rdma_destroy_id(id) };
            set_errno(e);
            -1
        };
        // SAFETY: our id and the program's addresses.
        let rc = unsafe {
            if r.ai_flags & RAI_PASSIVE != 0 {
                rdma_bind_addr(id, r.ai_src_addr)
            } else {
                match rdma_resolve_addr(id, r.ai_src_addr, r.ai_dst_addr, 2000) {
                    0 => rdma_resolve_route(id, 2000),
                    e => e,
                }
            }
        };
        if rc != 0 {
            return fail(id);
        }
        // SAFETY: per the API, NULL or the program's attributes.
        if let Some(a) = unsafe { qp_attr.as_mut() } {
            if r.ai_flags & RAI_PASSIVE != 0 {
                // SAFETY: our id.
                if let Some(i) = unsafe { id_of(id) } {
                    i.ep_qp = Some((pd as usize, *a));
                }
            // SAFETY: our resolved id and the program's attributes.
            } else if unsafe { rdma_create_qp(id, pd, a) } != 0 {
                return fail(id);
            }
        }
        // SAFETY: checked non-null; the caller's output.
        unsafe { *out = id };
        0
    })
}

/// `rdma_destroy_ep`: the endpoint's QP (and the CQs made for it), then the id.
#[no_mangle]
unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    // SAFETY: per the API, an endpoint of ours, destroyed once.
    unsafe {
        rdma_destroy_qp(id);
        rdma_destroy_id(id);
    }
}

/// `rdma_get_cm_event`: the next event; blocks unless the channel's fd is non-blocking.
#[no_mangle]
unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_event,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(ch) = (unsafe { channel_of(channel) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if out.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // The queue, not the channel: a program may destroy the channel while this thread
        // waits (rping's event thread waits on while the main thread tears down). The queue
        // and its descriptor then live on with this wait, which goes on blocking, as a read of
        // the kernel's event file does once the file is closed under it.
        let queue = ch.queue.clone();
        // A count whose event went with its destroyed id is skipped: the next read blocks (or
        // says EAGAIN on a non-blocking fd), as for a channel with nothing to report.
        let e = loop {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a local; blocks per the fd's flags, as librdmacm's.
            let n = unsafe { libc::read(queue.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            if n != 8 {
                return -1;
            }
            let e = queue
                .events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            if e.is_some() {
                break e;
            }
        };
        match e {
            Some(e) => {
                let ev = e as *mut Event;
                // SAFETY: a queued event box, now the program's until acknowledged; a new id
                // from a request learns its event.
                unsafe {
                    if let Some(id) = id_of((*ev).c.id) {
                        id.c.event = ev.cast();
                    }
                    *out = ev.cast();
                }
                0
            }
            None => {
                set_errno(libc::EAGAIN);
                -1
            }
        }
    })
}

/// `rdma_ack_cm_event`.
#[no_mangle]
unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    if event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: an event this library handed out, acknowledged once.
    drop(unsafe { Box::from_raw(event.cast::<Event>()) });
    0
}

/// `rdma_event_str`.
#[no_mangle]
extern "C" fn rdma_event_str(event: rdma_cm_event_type) -> *const c_char {
    let s: &CStr = match event {
        RDMA_CM_EVENT_ADDR_RESOLVED => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        RDMA_CM_EVENT_ADDR_ERROR => c"RDMA_CM_EVENT_ADDR_ERROR",
        RDMA_CM_EVENT_ROUTE_RESOLVED => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        RDMA_CM_EVENT_ROUTE_ERROR => c"RDMA_CM_EVENT_ROUTE_ERROR",
        RDMA_CM_EVENT_CONNECT_REQUEST => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        RDMA_CM_EVENT_CONNECT_RESPONSE => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        RDMA_CM_EVENT_CONNECT_ERROR => c"RDMA_CM_EVENT_CONNECT_ERROR",
        RDMA_CM_EVENT_UNREACHABLE => c"RDMA_CM_EVENT_UNREACHABLE",
        RDMA_CM_EVENT_REJECTED => c"RDMA_CM_EVENT_REJECTED",
        RDMA_CM_EVENT_ESTABLISHED => c"RDMA_CM_EVENT_ESTABLISHED",
        RDMA_CM_EVENT_DISCONNECTED => c"RDMA_CM_EVENT_DISCONNECTED",
        RDMA_CM_EVENT_DEVICE_REMOVAL => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        RDMA_CM_EVENT_MULTICAST_JOIN => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        RDMA_CM_EVENT_MULTICAST_ERROR => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        RDMA_CM_EVENT_ADDR_CHANGE => c"RDMA_CM_EVENT_ADDR_CHANGE",
        RDMA_CM_EVENT_TIMEWAIT_EXIT => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    };
    s.as_ptr()
}

/// `rdma_get_src_port` (network byte order).
#[no_mangle]
unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the API.
    unsafe { id_of(id) }
        .and_then(|i| src_addr(i))
        .map_or(0, |a| a.port().to_be())
}

/// `rdma_get_dst_port` (network byte order).
#[no_mangle]
unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: per the API.
    unsafe { id_of(id) }
        .and_then(|i| dst_addr(i))
        .map_or(0, |a| a.port().to_be())
}

/// `rdma_set_option`: the local ACK timeout is honoured, address reuse is what ferroce does
/// anyway; anything else (TOS, path records) is not supported.
#[no_mangle]
unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    // SAFETY: per the API.
    let Some(i) = (unsafe { id_of(id) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    match (level as u32, optname as u32) {
        (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT) if optlen >= 1 && !optval.is_null() => {
            // SAFETY: at least one byte, as optlen says.
            i.ack_timeout = unsafe { *optval.cast::<u8>() }.min(31);
            0
        }
        (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR) => 0,
        _ => {
            set_errno(libc::EOPNOTSUPP);
            -1
        }
    }
}

/// `rdma_set_local_ece`: the ECE an id without a QP offers in its REQ or REP, as librdmacm
/// (for a program's own QP, which ferroce's librdmacm does not connect: `rdma_create_qp`
/// replaces it with its QP's). EINVAL for an id with a QP, vendor 0 or a `comp_mask`.
#[no_mangle]
unsafe extern "C" fn rdma_set_local_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    guard(-1, || {
        // SAFETY: per the API, an id of ours and the caller's structure.
        let (Some(i), Some(e)) = (unsafe { id_of(id) }, unsafe { ece.as_ref() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if !i.c.qp.is_null() || e.vendor_id == 0 || e.comp_mask != 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        i.local_ece = (*e).into();
        0
    })
}

/// `rdma_get_remote_ece`: the ECE the peer's REQ (on a passive id, from its
/// `CONNECT_REQUEST`) or REP carried; vendor 0 if it carried none. As librdmacm, only for an id
/// without a QP (EINVAL otherwise): a passive side reads the request's before `rdma_create_qp`.
#[no_mangle]
unsafe extern "C" fn rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece) -> c_int {
    guard(-1, || {
        // SAFETY: per the API, an id of ours and the caller's structure.
        let (Some(i), Some(out)) = (unsafe { id_of(id) }, unsafe { ece.as_mut() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if !i.c.qp.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        let remote = *i
            .shared
            .remote_ece
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *out = remote.into();
        0
    })
}

/// `rdma_getaddrinfo`: the system's resolution, shaped as RC connection addresses.
#[no_mangle]
unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard(-1, || {
        if res.is_null() || (node.is_null() && service.is_null()) {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: per the API, NULL or the program's hints.
        let h = unsafe { hints.as_ref() }.copied().unwrap_or_default();
        let passive = h.ai_flags & RAI_PASSIVE != 0;
        let mut sys_hints: libc::addrinfo = unsafe { std::mem::zeroed() };
        sys_hints.ai_family = h.ai_family;
        sys_hints.ai_socktype = libc::SOCK_STREAM;
        sys_hints.ai_flags = if passive { libc::AI_PASSIVE } else { 0 }
            | if h.ai_flags & RAI_NUMERICHOST != 0 {
                libc::AI_NUMERICHOST
            } else {
                0
            };
        let mut found: *mut libc::addrinfo = std::ptr::null_mut();
        // SAFETY: C strings or NULL, a zero-initialised hints structure and an output.
        let rc = unsafe { libc::getaddrinfo(node, service, &sys_hints, &mut found) };
        if rc != 0 || found.is_null() {
            set_errno(libc::EADDRNOTAVAIL);
            return -1;
        }
        // SAFETY: the first entry of the list getaddrinfo returned.
        let first = unsafe { &*found };
        let len = first.ai_addrlen;
        // SAFETY: fresh allocations of the sizes written below, freed in rdma_freeaddrinfo.
        let (ai, addr) = unsafe {
            (
                libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()).cast::<rdma_addrinfo>(),
                libc::calloc(1, len as usize).cast::<sockaddr>(),
            )
        };
        if ai.is_null() || addr.is_null() {
            // SAFETY: freeing what was allocated (free(NULL) is a no-op).
            unsafe {
                libc::free(ai.cast());
                libc::free(addr.cast());
                libc::freeaddrinfo(found);
            }
            set_errno(libc::ENOMEM);
            return -1;
        }
        // SAFETY: `len` bytes from getaddrinfo's address into ours; then its list is freed.
        unsafe {
            std::ptr::copy_nonoverlapping(
                first.ai_addr.cast::<u8>(),
                addr.cast::<u8>(),
                len as usize,
            );
            let family = first.ai_family;
            libc::freeaddrinfo(found);
            let a = &mut *ai;
            a.ai_flags = h.ai_flags;
            a.ai_family = family;
            a.ai_qp_type = if h.ai_qp_type != 0 {
                h.ai_qp_type
            } else {
                IBV_QPT_RC as c_int
            };
            a.ai_port_space = if h.ai_port_space != 0 {
                h.ai_port_space
            } else {
                RDMA_PS_TCP as c_int
            };
            if passive {
                a.ai_src_len = len;
                a.ai_src_addr = addr;
            } else {
                a.ai_dst_len = len;
                a.ai_dst_addr = addr;
            }
            *res = ai;
        }
        0
    })
}

/// `rdma_freeaddrinfo`.
#[no_mangle]
unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut cur = res;
    // SAFETY: a list from rdma_getaddrinfo, freed once, entry by entry.
    while let Some(a) = unsafe { cur.as_mut() } {
        let next = a.ai_next;
        // SAFETY: each pointer is ours or NULL.
        unsafe {
            libc::free(a.ai_src_addr.cast());
            libc::free(a.ai_dst_addr.cast());
            libc::free(a.ai_src_canonname.cast());
            libc::free(a.ai_dst_canonname.cast());
            libc::free(cur.cast());
        }
        cur = next;
    }
}

/// `rdma_get_devices`: every device's context, NULL-terminated.
#[no_mangle]
unsafe extern "C" fn rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context {
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
unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: the list from rdma_get_devices (its contexts stay open, as librdmacm's).
    unsafe { libc::free(list.cast()) }
}

/// The rest of librdmacm: SRQs on ids, multicast, migration, the calls for a program's own QP
/// (`rdma_establish`, `rdma_init_qp_attr`), rejecting for an ECE (`rdma_reject_ece`: the REJ
/// carries no reason) and rsockets. They fail as unsupported.
mod unsupported {

    returns_minus_one!(
        rdma_create_srq,
        rdma_create_srq_ex,
        rdma_join_multicast,
        rdma_join_multicast_ex,
        rdma_leave_multicast,
        rdma_migrate_id,
        rdma_notify,
        rdma_establish,
        rdma_init_qp_attr,
        rdma_reject_ece,
        raccept,
        rbind,
        rclose,
        rconnect,
        rfcntl,
        rgetpeername,
        rgetsockname,
        rgetsockopt,
        riomap,
        riounmap,
        riowrite,
        rlisten,
        rpoll,
        rread,
        rreadv,
        rrecv,
        rrecvfrom,
        rrecvmsg,
        rselect,
        rsend,
        rsendmsg,
        rsendto,
        rsetsockopt,
        rshutdown,
        rsocket,
        rwrite,
        rwritev,
    );

    // No SRQ is ever made on an id (its creation is unsupported).
    does_nothing!(rdma_destroy_srq);
}

#[cfg(test)]
mod tests {
    use super::{Ece, Message};

    /// A thread waiting for an event is woken for one that its destroyed id took away, and the
    /// program destroys the channel meanwhile (rping's client does both as it ends): the wait
    /// goes on blocking, as a read of the kernel's event file does, and never fails with a
    /// closed descriptor (rping then exits 255) or reads the freed channel.
    #[test]
    fn a_wait_outlives_its_channel_and_a_taken_event() {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::Duration;

        let ch = super::rdma_create_event_channel();
        assert!(!ch.is_null());
        // SAFETY: our live channel.
        let queue = unsafe { super::channel_of(ch) }.unwrap().queue.clone();
        let returned = Arc::new(AtomicBool::new(false));
        let (flag, addr) = (returned.clone(), ch as usize);
        {
            // A count whose event is gone by the time the woken thread looks: the queue stays
            // locked until the program has destroyed the channel.
            let _q = queue.events.lock().unwrap();
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local to the channel's eventfd.
            unsafe { libc::write(queue.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
            std::thread::spawn(move || {
                let mut ev = std::ptr::null_mut();
                // SAFETY: the channel is live when the call starts: it is destroyed only
                // once this call took the count, after it entered.
                let _ = unsafe { super::rdma_get_cm_event(addr as *mut _, &mut ev) };
                flag.store(true, Ordering::Release);
            });
            // The thread took the count (so it is inside the call, past its start) once the
            // eventfd no longer reads as ready.
            let mut fd = libc::pollfd {
                fd: queue.efd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd of ours.
            while unsafe { libc::poll(&mut fd, 1, 0) } > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            // SAFETY: our channel, destroyed once.
            unsafe { super::rdma_destroy_event_channel(ch) };
        }
        drop(queue);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !returned.load(Ordering::Acquire),
            "the wait ended once its channel was gone"
        );
    }

    #[test]
    fn messages_round_trip_and_refuse_junk() {
        let msgs = [
            Message::Connect {
                reply: false,
                qpn: 0x12_3456,
                psn: 0xab_cdef,
                gid: [7; 16],
                mtu: 5,
                responder_resources: 16,
                initiator_depth: 4,
                retry_count: 7,
                rnr_retry_count: 6,
                private: b"perftest".to_vec(),
                ece: None,
            },
            Message::Connect {
                reply: false,
                qpn: 0x12_3456,
                psn: 0xab_cdef,
                gid: [7; 16],
                mtu: 5,
                responder_resources: 16,
                initiator_depth: 4,
                retry_count: 7,
                rnr_retry_count: 6,
                private: b"perftest".to_vec(),
                ece: Some(Ece {
                    vendor_id: 0x4652_4345,
                    options: 1,
                }),
            },
            Message::Connect {
                reply: true,
                qpn: 9,
                psn: 8,
                gid: [1; 16],
                mtu: 1,
                responder_resources: 1,
                initiator_depth: 1,
                retry_count: 1,
                rnr_retry_count: 1,
                private: vec![0xaa; 255],
                ece: Some(Ece {
                    vendor_id: u32::MAX,
                    options: u32::MAX,
                }),
            },
            Message::Connect {
                reply: true,
                qpn: 1,
                psn: 2,
                gid: [0; 16],
                mtu: 3,
                responder_resources: 0,
                initiator_depth: 0,
                retry_count: 0,
                rnr_retry_count: 0,
                private: Vec::new(),
                ece: None,
            },
            Message::Reject {
                private: vec![1, 2, 3],
            },
            Message::ReadyToUse,
            Message::Disconnect,
        ];
        for m in msgs {
            let b = m.encode();
            assert_eq!(Message::read(&mut &b[..]).unwrap(), m);
            // Every truncation is an error, never a panic.
            for cut in 0..b.len() {
                assert!(Message::read(&mut &b[..cut]).is_err());
            }
        }
        assert!(Message::read(&mut &b"XXXX\x01"[..]).is_err());
        assert!(Message::read(&mut &b"FRCM\x09"[..]).is_err());
    }

    /// A REQ or REP without an ECE is byte for byte what builds before ECE send and read (kind
    /// 1 or 2); with one it is kind 6 or 7, the ECE after the private data.
    #[test]
    fn connect_messages_keep_the_format_before_ece() {
        let req = |ece| Message::Connect {
            reply: false,
            qpn: 0x01_0203,
            psn: 0x04_0506,
            gid: [9; 16],
            mtu: 3,
            responder_resources: 2,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            private: b"hi".to_vec(),
            ece,
        };
        let mut legacy = b"FRCM\x01\x00\x01\x02\x03\x00\x04\x05\x06".to_vec();
        legacy.extend_from_slice(&[9; 16]);
        legacy.extend_from_slice(&[3, 2, 1, 7, 7, 2, b'h', b'i']);
        assert_eq!(req(None).encode(), legacy);
        let with = req(Some(Ece {
            vendor_id: 0x4652_4345,
            options: 1,
        }))
        .encode();
        let mut want = legacy.clone();
        want[4] = 6;
        want.extend_from_slice(b"FRCE\x00\x00\x00\x01");
        assert_eq!(with, want);
        // A REP likewise: kind 2 without, 7 with.
        let mut rep = legacy.clone();
        rep[4] = 2;
        assert!(matches!(
            Message::read(&mut &rep[..]),
            Ok(Message::Connect {
                reply: true,
                ece: None,
                ..
            })
        ));
        rep[4] = 7;
        rep.extend_from_slice(&[0, 0, 0x15, 0xb3, 0, 0, 0, 3]);
        assert!(matches!(
            Message::read(&mut &rep[..]),
            Ok(Message::Connect {
                reply: true,
                ece: Some(Ece {
                    vendor_id: 0x15b3,
                    options: 3
                }),
                ..
            })
        ));
    }
}
