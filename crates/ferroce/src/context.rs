//! Contexts (an opened device) and protection domains.

use std::collections::HashMap;
use std::net::{Ipv6Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use ferroce_proto::{Access, Counters, QpCaps};
use socket2::{Domain, Protocol, Socket, Type};

use crate::capture::Capture;
use crate::cq::{CompletionChannel, CompletionQueue};
use crate::device::{Device, Gid};
use crate::engine::{self, EngineState};
use crate::error::{Error, Result};
use crate::mr::{MemoryRegion, MrInner, MrTable};
use crate::qp::{QpInitAttr, QpShared, QueuePair, SharedReceiveQueue};
use crate::shm::{Provider, ShmHost};
use crate::sys::EventFd;

/// How a device is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextOptions {
    /// Which GID (address) of the device to use.
    pub gid_index: usize,
    /// The UDP port this context's RoCE socket listens on: 4791 by default; another port (or 0
    /// for any free one) lets several unprivileged processes share a host.
    pub port: u16,
    /// Write every packet to this pcap file (default: the `FERROCE_PCAP` environment variable).
    pub capture: Option<PathBuf>,
    /// Which provider QPs of this context use (default: the `FERROCE_PROVIDER` environment
    /// variable, else [`Provider::Auto`]: shared memory to peers on this host, UDP to others).
    /// A context that writes a capture uses UDP unless shared memory is forced: a capture is
    /// asked for to see the packets.
    pub provider: Provider,
}

impl Default for ContextOptions {
    fn default() -> ContextOptions {
        ContextOptions {
            gid_index: 0,
            port: ferroce_wire::ROCE_V2_UDP_PORT,
            capture: std::env::var_os("FERROCE_PCAP")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            provider: Provider::from_env().unwrap_or_default(),
        }
    }
}

impl ContextOptions {
    /// The defaults with another UDP port.
    pub fn with_port(port: u16) -> ContextOptions {
        ContextOptions {
            port,
            ..ContextOptions::default()
        }
    }
}

/// Counters of a context's packet path (per-QP transport counters are on each QP).
#[derive(Debug, Default)]
pub(crate) struct EngineCounters {
    pub rx_packets: AtomicU64,
    pub tx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub icrc_errors: AtomicU64,
    pub malformed: AtomicU64,
    pub unknown_qpn: AtomicU64,
    pub wrong_source: AtomicU64,
    pub send_errors: AtomicU64,
}

/// A snapshot of a context's counters: its packet path (every datagram the socket saw, and
/// every one refused before it reached a QP) and the transport counters of all its QPs summed,
/// including QPs already destroyed, so one value says everything the context counted.
///
/// The names are rdma-core's (rxe's) where one exists; [`ContextCounters::named`] lists them
/// all, as `ferroce perf --counters` prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ContextCounters {
    /// Datagrams received (every one, refused or not).
    pub rx_packets: u64,
    /// Datagrams sent.
    pub tx_packets: u64,
    /// Bytes received (UDP payload).
    pub rx_bytes: u64,
    /// Bytes sent (UDP payload).
    pub tx_bytes: u64,
    /// Datagrams refused for a bad ICRC.
    pub icrc_errors: u64,
    /// Datagrams that are not RoCE v2 packets (too short, unknown opcode or version, headers or
    /// pad that do not fit).
    pub malformed: u64,
    /// Packets for a QP number this context does not have.
    pub unknown_qpn: u64,
    /// Packets for a connected QP from an address other than its peer's.
    pub wrong_source: u64,
    /// Send system calls that failed or sent only part of a batch (rxe's `send_err`, the
    /// name [`Self::named`] gives it).
    pub send_errors: u64,
    /// The transport counters of every QP of the context, live and destroyed, summed.
    pub qps: Counters,
}

impl ContextCounters {
    /// Every counter as `(name, value)`: the packet path's, then the QPs' sum.
    pub fn named(&self) -> Vec<(&'static str, u64)> {
        // Destructured without `..`, so a new field cannot be forgotten here.
        let ContextCounters {
            rx_packets,
            tx_packets,
            rx_bytes,
            tx_bytes,
            icrc_errors,
            malformed,
            unknown_qpn,
            wrong_source,
            send_errors,
            qps,
        } = *self;
        let mut v = vec![
            ("rx_packets", rx_packets),
            ("tx_packets", tx_packets),
            ("rx_bytes", rx_bytes),
            ("tx_bytes", tx_bytes),
            ("icrc_errors", icrc_errors),
            ("malformed", malformed),
            ("unknown_qpn", unknown_qpn),
            ("wrong_source", wrong_source),
            ("send_err", send_errors),
        ];
        v.extend(qps.named());
        v
    }
}

/// Everything the engine thread and the handles share.
#[derive(Debug)]
pub(crate) struct ContextShared {
    pub device: Device,
    pub gid: Gid,
    pub local: SocketAddr,
    pub socket: UdpSocket,
    pub mrs: MrTable,
    pub qps: RwLock<HashMap<u32, Arc<QpShared>>>,
    pub qps_generation: AtomicU64,
    pub doorbell_fd: EventFd,
    pub sleeping: AtomicBool,
    pub shutdown: AtomicBool,
    /// Until when (ns since `epoch`) an application thread is driving progress itself.
    pub app_polling_until: AtomicU64,
    pub epoch: std::time::Instant,
    pub engine: Mutex<EngineState>,
    pub capture: Option<Capture>,
    /// Whether UDP segmentation offload works for sending (cleared on the first refusal).
    pub gso: AtomicBool,
    /// Whether the engine may ask for UDP GRO on the socket once bulk traffic arrives (see
    /// `engine`'s "Receive offload"); `FERROCE_NO_GRO` says no.
    pub gro_allowed: bool,
    /// Set when work was posted that no pass has looked at yet (lets idle passes skip the QPs).
    pub work_pending: AtomicBool,
    pub counters: EngineCounters,
    /// The transport counters of destroyed QPs, summed.
    pub retired_qp_counters: Mutex<Counters>,
    /// This context's shared-memory presence (absent when the provider is UDP).
    pub shm: Option<ShmHost>,
    next_qpn: AtomicU32,
    next_pd: AtomicU32,
}

impl ContextShared {
    /// Makes a newly registered region reachable by same-host peers.
    pub(crate) fn shm_publish(&self, key: u32, mr: &MrInner) {
        let (Some(host), Some((fd, inode))) = (&self.shm, mr.shared_file()) else {
            return;
        };
        host.table.publish(&crate::shm::PublishedRegion {
            key,
            pd: mr.pd,
            access: mr.access,
            addr: mr.addr(),
            len: mr.len() as u64,
            fd,
            inode,
        });
    }

    /// Withdraws a region from same-host peers.
    pub(crate) fn shm_withdraw(&self, key: u32) {
        if let Some(host) = &self.shm {
            host.table.withdraw(key);
        }
    }

    /// Records whether the engine thread sleeps, for this process and for same-host peers.
    pub(crate) fn set_sleeping(&self, sleeping: bool) {
        self.sleeping.store(sleeping, Ordering::SeqCst);
        if let Some(host) = &self.shm {
            host.table.set_sleeping(sleeping);
        }
    }

    /// The QP numbered `qpn`, if it is alive.
    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<QpShared>> {
        self.qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)
            .cloned()
    }

    /// Looks at the shared-memory listener (hellos, wake-ups, peers gone) — at most every so
    /// often unless `force` — and moves QPs whose peer went away to ERR. Returns whether
    /// anything arrived.
    pub(crate) fn poll_shm_host(&self, now: ferroce_proto::Instant, force: bool) -> bool {
        let Some(host) = &self.shm else {
            return false;
        };
        let ev = host.poll(now.as_nanos(), force, &|qpn| self.qp(qpn));
        for &(qpn, page) in &ev.peers_gone {
            // The hello connection of a link since replaced (the QP was reset, and maybe
            // connected anew) says nothing about the QP now.
            if let Some(qp) = self
                .qp(qpn)
                .filter(|q| q.shm.as_ref().is_some_and(|s| s.linked_to(page)))
            {
                crate::engine::peer_gone(&qp);
            }
        }
        ev.did
    }

    /// The QPs of the context now (a snapshot, so no lock is held while they are visited).
    pub(crate) fn live_qps(&self) -> Vec<Arc<QpShared>> {
        self.qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub(crate) fn remove_qp(&self, qpn: u32) {
        let gone = self
            .qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qpn);
        self.qps_generation.fetch_add(1, Ordering::AcqRel);
        if let Some(qp) = gone {
            // Whatever the engine still counts for it in a pass already under way is lost; a
            // packet that arrives from now on counts as for an unknown QPN.
            let c = *qp.qp.lock().counters();
            self.retired_qp_counters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add(&c);
        }
    }
}

/// Owns the engine thread: when the last handle (context, PD, MR, CQ, QP) goes, it stops it.
#[derive(Debug)]
pub(crate) struct ContextInner {
    pub shared: Arc<ContextShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.doorbell_fd.notify();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        if let Some(c) = &self.shared.capture {
            c.flush();
        }
    }
}

/// An opened device: one UDP socket, one engine thread, and the objects created from it.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

fn bind_socket(addr: SocketAddr, rcvbuf: usize) -> std::io::Result<UdpSocket> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // Large buffers absorb bursts of a whole send window; the privileged "force" variant is
    // tried first, the ordinary one (capped by net.core.rmem_max) after.
    if !set_int_opt(
        &s,
        libc::SOL_SOCKET,
        libc::SO_RCVBUFFORCE,
        rcvbuf as libc::c_int,
    ) {
        let _ = s.set_recv_buffer_size(rcvbuf);
    }
    if !set_int_opt(
        &s,
        libc::SOL_SOCKET,
        libc::SO_SNDBUFFORCE,
        rcvbuf as libc::c_int,
    ) {
        let _ = s.set_send_buffer_size(rcvbuf);
    }
    if addr.is_ipv4() {
        // DF set, as RoCE v2 requires; Linux then sends Identification 0 from an unconnected
        // socket, which is what the ICRC is computed over on both ends.
        set_pmtudisc_do(&s);
    }
    s.bind(&addr.into())?;
    Ok(s.into())
}

fn set_pmtudisc_do(s: &Socket) {
    set_int_opt(
        s,
        libc::IPPROTO_IP,
        libc::IP_MTU_DISCOVER,
        libc::IP_PMTUDISC_DO,
    );
}

/// Sets an integer socket option; returns whether the kernel accepted it.
fn set_int_opt(s: &Socket, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> bool {
    // SAFETY: passes a pointer to a live c_int and its size, as integer options expect.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(s),
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

impl Context {
    pub(crate) fn open(device: &Device, options: &ContextOptions) -> Result<Context> {
        let gid = *device.gids().get(options.gid_index).ok_or_else(|| {
            Error::NoDevice(format!(
                "{} has no GID index {}",
                device.name(),
                options.gid_index
            ))
        })?;
        let addr = SocketAddr::new(gid.ip, options.port);
        let socket = bind_socket(addr, 8 << 20)
            .map_err(|e| Error::io(format!("binding the RoCE socket to {addr}"), e))?;
        socket
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the RoCE socket non-blocking", e))?;
        let local = socket
            .local_addr()
            .map_err(|e| Error::io("reading the RoCE socket's address", e))?;
        let capture = options
            .capture
            .as_deref()
            .map(Capture::create)
            .transpose()?;
        let provider = match options.provider {
            Provider::Auto if capture.is_some() => Provider::Udp,
            p => p,
        };
        let shm = match provider {
            Provider::Udp => None,
            p => Some(
                ShmHost::open(p, local)
                    .map_err(|e| Error::io(format!("publishing {local} for same-host peers"), e))?,
            ),
        };
        let shared = Arc::new(ContextShared {
            device: device.clone(),
            gid,
            local,
            socket,
            mrs: MrTable::default(),
            qps: RwLock::new(HashMap::new()),
            qps_generation: AtomicU64::new(0),
            doorbell_fd: EventFd::new().map_err(|e| Error::io("creating the doorbell", e))?,
            sleeping: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            app_polling_until: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
            engine: Mutex::new(EngineState::new()),
            capture,
            work_pending: AtomicBool::new(true),
            gso: AtomicBool::new(std::env::var_os("FERROCE_NO_GSO").is_none()),
            gro_allowed: std::env::var_os("FERROCE_NO_GRO").is_none(),
            counters: EngineCounters::default(),
            retired_qp_counters: Mutex::new(Counters::default()),
            shm,
            next_qpn: AtomicU32::new(0x11),
            next_pd: AtomicU32::new(1),
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ferroce-engine-{}", local.port()))
            .spawn(move || engine::run(for_thread))
            .map_err(|e| Error::io("starting the engine thread", e))?;
        Ok(Context {
            inner: Arc::new(ContextInner {
                shared,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// The device this context was opened on.
    pub fn device(&self) -> &Device {
        &self.inner.shared.device
    }

    /// The GID peers address this context by.
    pub fn gid(&self) -> Ipv6Addr {
        self.inner.shared.gid.gid
    }

    /// The provider this context's QPs use ([`Provider::Auto`] picks per QP).
    pub fn provider(&self) -> Provider {
        self.inner
            .shared
            .shm
            .as_ref()
            .map_or(Provider::Udp, |h| h.provider)
    }

    /// The address and UDP port of this context's RoCE socket.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.shared.local
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let id = self.inner.shared.next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(ProtectionDomain {
            id,
            ctx: self.inner.clone(),
        })
    }

    /// Creates a completion channel.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new()
    }

    /// Creates a completion queue of `capacity` entries, optionally tied to a channel.
    pub fn create_cq(
        &self,
        capacity: usize,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        if capacity == 0 {
            return Err(Error::InvalidArgument(
                "a completion queue needs at least one entry".into(),
            ));
        }
        Ok(CompletionQueue::new(self.inner.clone(), capacity, channel))
    }

    /// Drives the engine once from the calling thread (receive, timers, transmit, completions);
    /// returns whether anything happened. Polling an empty CQ does this already.
    pub fn progress(&self) -> bool {
        self.inner.shared.progress_inline()
    }

    /// The context's counters: its packet path and the sum over all its QPs, destroyed ones
    /// included (see [`ContextCounters`]).
    pub fn counters(&self) -> ContextCounters {
        let shared = &self.inner.shared;
        let mut qps = *shared
            .retired_qp_counters
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for qp in shared.live_qps() {
            qps.add(qp.qp.lock().counters());
        }
        let c = &shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ContextCounters {
            rx_packets: l(&c.rx_packets),
            tx_packets: l(&c.tx_packets),
            rx_bytes: l(&c.rx_bytes),
            tx_bytes: l(&c.tx_bytes),
            icrc_errors: l(&c.icrc_errors),
            malformed: l(&c.malformed),
            unknown_qpn: l(&c.unknown_qpn),
            wrong_source: l(&c.wrong_source),
            send_errors: l(&c.send_errors),
            qps,
        }
    }

    /// Memory regions registered now.
    pub fn memory_region_count(&self) -> usize {
        self.inner.shared.mrs.len()
    }

    /// Queue pairs alive now.
    pub fn queue_pair_count(&self) -> usize {
        self.inner
            .shared
            .qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }
}

/// A protection domain: memory regions and queue pairs of one domain only reach each other.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    id: u32,
    ctx: Arc<ContextInner>,
}

impl ProtectionDomain {
    /// Allocates and registers `len` zeroed, page-aligned bytes with the given rights.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        let inner = MrInner::map(len, access, self.id)?;
        MemoryRegion::new(inner, self.ctx.clone())
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes for as long as the returned region
    /// (or any work request naming it) lives, and must not be read or written by the caller in
    /// any other way meanwhile — not even through a shared reference — because a peer or the
    /// engine may write it at any moment. Only access it through the region's `read`/`write`.
    pub unsafe fn register_raw(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        // SAFETY: the caller's contract is the one `MrInner::borrowed` requires.
        let inner = unsafe { MrInner::borrowed(ptr, len, access, self.id) };
        MemoryRegion::new(inner, self.ctx.clone())
    }

    /// Creates a shared receive queue.
    pub fn create_srq(&self, max_wr: usize, max_sge: usize) -> Result<SharedReceiveQueue> {
        Ok(SharedReceiveQueue::new(max_wr, max_sge))
    }

    /// Creates an RC queue pair in the RESET state.
    pub fn create_qp(&self, attr: &QpInitAttr<'_>) -> Result<QueuePair> {
        let shared = &self.ctx.shared;
        if !Arc::ptr_eq(&attr.send_cq.ctx, &self.ctx) || !Arc::ptr_eq(&attr.recv_cq.ctx, &self.ctx)
        {
            return Err(Error::Mismatch("a completion queue"));
        }
        let caps: QpCaps = attr.caps;
        let qpn = shared.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let send_socket = bind_socket(SocketAddr::new(shared.local.ip(), 0), 4 << 20)
            .map_err(|e| Error::io("binding the QP's sending socket", e))?;
        let src_port = send_socket
            .local_addr()
            .map_err(|e| Error::io("reading the QP's port", e))?
            .port();
        let qp = Arc::new(QpShared {
            qpn,
            qp: crate::qp::CoreLock::new(crate::qp::QpCore::new(ferroce_proto::QueuePair::new(
                qpn, self.id, caps,
            ))),
            send_cq: attr.send_cq.inner.clone(),
            recv_cq: attr.recv_cq.inner.clone(),
            srq: attr.srq.map(|s| s.inner.clone()),
            send_socket,
            src_port,
            last_request_tx: AtomicU64::new(0),
            shm: match &shared.shm {
                Some(_) => Some(
                    crate::shm::ShmQp::new()
                        .map_err(|e| Error::io("creating the QP's shared page", e))?,
                ),
                None => None,
            },
        });
        shared
            .qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qpn, qp.clone());
        shared.qps_generation.fetch_add(1, Ordering::AcqRel);
        Ok(QueuePair {
            shared: qp,
            ctx: self.ctx.clone(),
        })
    }
}
