//! Contexts (an opened device) and protection domains.

use std::collections::HashMap;
use std::net::{Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use ferroce_proto::Counters;

use super::channel::CompletionChannel;
use super::counters::{ContextCounters, EngineCounters};
use super::cq::CompletionQueue;
use super::device::{Device, Gid};
use super::mr::MrTable;
use super::pd::ProtectionDomain;
use super::qp_core::QpShared;
use super::ud::UdShared;
use crate::error::{Error, Result};
use crate::os::EventFd;
use crate::provider::{engine, flush_held_ack, Ecn, EngineState, Provider, ShmHost, UdpPort};

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
    /// Take the first free port of the host's slot range (4791, 4792, … see [`host_slot`])
    /// instead of `port`, and number QPs by the slot, so that a peer on the same host finds a
    /// QP's port from its number alone. Programs written for libibverbs exchange only a GID and
    /// a QPN and expect the peer on 4791; this is how several of them share one host.
    pub host_slot: bool,
    /// Let an application thread that polls a CQ drive progress alone for a while (the
    /// engine thread then stops reading the socket, which on a small machine would preempt the
    /// poller). Right for programs that poll for what they wait on; wrong for programs that
    /// spin on memory a peer WRITEs (perftest's `ib_write_lat`): between their polls nobody
    /// would read the socket for the whole grace period (unless
    /// [`hand_back_at_completion`](Self::hand_back_at_completion)). Over shared memory too:
    /// the application's polls drain the rings, and same-host peers are told not to wake the
    /// engine thread meanwhile (with the engine thread spinning beside it, an `ibv_rc_pingpong`
    /// iteration between two processes on 2 CPUs took 35 µs instead of 6). Arming a CQ ends a
    /// hand-over (lazily, as a hand-back, where the CQ's channel spins before it sleeps).
    /// Default: on.
    pub hand_over_to_polling_app: bool,
    /// With [`hand_over_to_polling_app`](Self::hand_over_to_polling_app): a CQ poll that
    /// returns completions hands progress back to the engine thread, since a program that got
    /// what it polled for may wait some other way next — `ib_write_lat` polls for its WRITE's
    /// completion, then spins on memory for the peer's. The hand-back is lazy while the
    /// program keeps polling again after its completions (the engine thread checks in every
    /// 250 µs and takes over when a poll did not follow within 150 µs), and immediate for a
    /// while after one did not; [`ContextCounters::hand_backs_missed`](crate::ContextCounters)
    /// counts those (see the engine's `hand_back` module). Without it the engine would stay off
    /// the socket for the whole grace period; without the hand-over at all, the engine thread
    /// and the polling thread would take turns at one socket, and on a small machine every
    /// packet's wake-up would preempt a spinning application. Default: off.
    pub hand_back_at_completion: bool,
    /// How long a thread about to sleep on a completion channel
    /// ([`CompletionChannel::next_event`](crate::CompletionChannel::next_event), the drop-in's
    /// `ibv_get_cq_event`) first drives progress itself, adaptively (see the channel's module
    /// doc): each sleep costs two wake-ups, tens of µs apiece on a busy machine, and a spin
    /// that an event ends costs none. Zero never spins (the default: a Rust program that sleeps
    /// on events asks for its CPU back; the drop-in takes `FERROCE_EVENT_SPIN_US`, default
    /// 200 µs). A waiter that returns sooner can find fewer completions ready than one that
    /// slept: a program that polls exactly one completion per event needs CQs with room for
    /// those left behind (the drop-in rounds capacities up, as rdma-core's providers do).
    pub event_spin: std::time::Duration,
    /// When a same-host peer process goes away (or resets its QP), move QPs linked to it to
    /// ERR at once, even those with nothing to send (default), so the failure is seen fast. Off,
    /// an idle QP stays as it is, as on a fabric, where it could not tell: rdma-core programs
    /// that exit after their last completion leave the peer's spare receives posted, and count
    /// a flushed one as a failure (`ibv_rc_pingpong` does). A QP with work under way fails
    /// either way; a later send on an idle one fails by retry timeout.
    pub fail_idle_qps_when_peer_goes: bool,
    /// Move the whole pages of memory registered with
    /// [`register_raw`](crate::ProtectionDomain::register_raw) onto a memfd in place, so a
    /// same-host peer WRITEs, READs and applies atomics to them directly, with no code running
    /// here (as to regions from [`alloc_mr`](crate::ProtectionDomain::alloc_mr)), instead of
    /// through this context's engine. Only private anonymous memory is moved; the program's
    /// pointers stay valid, `fork` still gives a child private copies, and deregistration gives
    /// the pages back. The price: a store by another thread into those pages while the region
    /// is registered or deregistered may be lost. The drop-in libibverbs turns it on (programs
    /// written for RDMA spin on memory a peer writes); default: off. Ignored without shared
    /// memory.
    pub adopt_registered_pages: bool,
    /// Accept a packet over UDP only if its ICRC verifies for IPv4 Identification 0, with all
    /// 32 bits, never for an Identification solved from the ICRC (default: the
    /// `FERROCE_ICRC_STRICT` environment variable set to anything but empty or `0`, else off).
    /// The price: packets that left with another Identification are refused as ICRC errors —
    /// Linux rxe's (it numbers every packet), and the GSO segments (all but the first of each send) of a ferroce
    /// peer that is not strict itself, so bulk data from it (its WRITEs and SENDs, the
    /// responses to this side's READs) crawls on retransmissions. A strict context sends
    /// without GSO, so its own packets all leave with Identification 0 and two strict contexts
    /// talk normally, but bulk sends cost one system call per 32 packets instead of per 64
    /// KiB (`ferroce perf write_bw --loopback --provider udp`, 64 KiB WRITEs on 2 cores: about
    /// 400 MB/s strict or with `FERROCE_NO_GSO`, 1,000 to 1,500 MB/s otherwise). Off, a solved
    /// Identification is believed below 64 from a peer known to be ferroce (26 bits of the
    /// ICRC checked), and any from others (16 bits); see the UDP provider's docs.
    pub icrc_strict: bool,
    /// Congestion control of this context's QPs over UDP (see `ferroce_proto::cc`). Default:
    /// the delay-based window with pacing, or what the environment says: `FERROCE_CC=off`
    /// (or `delay`), `FERROCE_CC_TARGET_US=N` (the target queueing delay in microseconds,
    /// default 300). Off, a QP sends its whole window at line rate: the fastest into an idle
    /// lossless path, congestion collapse behind any bottleneck. A lower target keeps queues
    /// (and everyone's latency through them) shorter, but below the host's scheduling noise
    /// the window shrinks for delay no queue caused. QPs linked over shared memory run none
    /// (a ring has no queue to share), and QPs to a peer on this host only with
    /// [`congestion_to_local_peers`](Self::congestion_to_local_peers).
    pub congestion: ferroce_proto::CcConfig,
    /// Whether QPs whose peer is on this host (a loopback address or one of this network
    /// namespace's own) run [`congestion`](Self::congestion) too. Default: only when
    /// `FERROCE_CC` names an algorithm. Such a path crosses no link that others share, only the
    /// host's CPUs, and the delay-based window reads their scheduling as queueing: over
    /// loopback on 2 cores it cost `ferroce perf write_bw` with 64 KiB WRITEs about 40 % (2,098
    /// vs 1,243 MB/s). A QP given its own setting with
    /// [`QueuePair::set_congestion_control`](crate::QueuePair::set_congestion_control) keeps it.
    pub congestion_to_local_peers: bool,
    /// Offer selective repeat in the connection exchange (`cm`): with a peer that offers it
    /// too, each side keeps packets that arrive after a gap and only the holes are sent again,
    /// instead of everything after a loss (go-back-N, which stays in force toward any other
    /// peer). Default: on, unless `FERROCE_SR=0`. It costs memory only on loss: a QP's
    /// reorder buffer holds up to 512 packets once a gap appears.
    pub selective_repeat: bool,
    /// How packets over UDP use the IP header's ECN field (default: the `FERROCE_ECN`
    /// environment variable, see [`Ecn::from_env`], else [`Ecn::Ect0`]): ECN-capable packets
    /// that a congested switch marks make the receiving QP send a CNP, which cuts the sender's
    /// rate (DCQCN, as RoCE NICs do). [`Ecn::Off`] sends Not-ECT and ignores marks.
    pub ecn: Ecn,
}

/// The congestion control the environment asks for (`FERROCE_CC`, `FERROCE_CC_TARGET_US`);
/// the default for what is unset or unreadable.
fn congestion_from_env() -> ferroce_proto::CcConfig {
    let mut cc = ferroce_proto::CcConfig::default();
    if let Some(a) = std::env::var("FERROCE_CC")
        .ok()
        .and_then(|v| ferroce_proto::CcAlgorithm::from_name(&v))
    {
        cc.algorithm = a;
    }
    if let Some(us) = std::env::var("FERROCE_CC_TARGET_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&us| (1..=1_000_000).contains(&us))
    {
        cc.target_delay = std::time::Duration::from_micros(us);
    }
    cc
}

/// Whether `FERROCE_CC` names an algorithm (then it applies to peers on this host too).
fn congestion_named_in_env() -> bool {
    std::env::var("FERROCE_CC")
        .ok()
        .and_then(|v| ferroce_proto::CcAlgorithm::from_name(&v))
        .is_some()
}

/// Whether selective repeat is offered: unless `FERROCE_SR` is `0`.
fn selective_repeat_from_env() -> bool {
    std::env::var_os("FERROCE_SR").map_or(true, |v| v != "0")
}

/// Whether `FERROCE_ICRC_STRICT` asks for strict ICRC checking (set, not empty, not `0`).
fn icrc_strict_from_env() -> bool {
    std::env::var_os("FERROCE_ICRC_STRICT").is_some_and(|v| !v.is_empty() && v != "0")
}

/// Several processes of one host, each with its own UDP port, told apart by QPN alone.
///
/// A context opened with [`ContextOptions::host_slot`] takes slot `s`: UDP port `4791 + s`, and
/// QPNs `s << 12 | n`. A QP that connects to a GID of this host finds its peer's port from the
/// peer's QPN with [`port_of_qpn`](host_slot::port_of_qpn); slot 0 is the standard port, so a peer on another host (or
/// Linux rxe) reaches the context holding 4791 as it expects. The numbers stay unique per host
/// because ports are.
pub mod host_slot {
    /// Slots a host has (12 bits of the 24-bit QPN).
    pub const SLOTS: u32 = 1 << 12;
    /// QPNs a slot has (the other 12 bits).
    pub const QPNS_PER_SLOT: u32 = 1 << 12;
    /// The first QPN of slot 0 (QPs 0 and 1 are special in IBTA, rxe starts at 0x11 too).
    pub const FIRST_QPN: u32 = 0x11;

    /// The UDP port of slot `slot`.
    pub fn port_of_slot(slot: u32) -> u16 {
        (u32::from(ferroce_wire::ROCE_V2_UDP_PORT) + slot % SLOTS) as u16
    }

    /// The UDP port of the context owning `qpn`, for a QP of a host-slot context.
    pub fn port_of_qpn(qpn: u32) -> u16 {
        port_of_slot((qpn & 0x00ff_ffff) / QPNS_PER_SLOT)
    }
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
            host_slot: false,
            hand_over_to_polling_app: true,
            hand_back_at_completion: false,
            event_spin: std::time::Duration::ZERO,
            fail_idle_qps_when_peer_goes: true,
            adopt_registered_pages: false,
            icrc_strict: icrc_strict_from_env(),
            congestion: congestion_from_env(),
            congestion_to_local_peers: congestion_named_in_env(),
            selective_repeat: selective_repeat_from_env(),
            ecn: Ecn::from_env(),
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

/// Everything the engine thread and the handles share.
#[derive(Debug)]
pub(crate) struct ContextShared {
    pub device: Device,
    pub gid: Gid,
    pub local: SocketAddr,
    pub mrs: MrTable,
    pub qps: RwLock<HashMap<u32, Arc<QpShared>>>,
    pub qps_generation: AtomicU64,
    /// The UD QPs, by number (they share the QPN space with `qps`).
    pub ud_qps: RwLock<HashMap<u32, Arc<UdShared>>>,
    /// Whether `ud_qps` holds any (read on every receive pass, without the lock).
    pub ud_qp_count: AtomicUsize,
    pub doorbell_fd: EventFd,
    pub sleeping: AtomicBool,
    pub shutdown: AtomicBool,
    /// Until when (ns since `epoch`) an application thread is driving progress itself.
    pub app_polling_until: AtomicU64,
    /// See [`ContextOptions::hand_over_to_polling_app`].
    pub hand_over_to_polling_app: bool,
    /// See [`ContextOptions::hand_back_at_completion`].
    pub hand_back_at_completion: bool,
    /// When to hand back: at once, or lazily (see `provider::hand_back`).
    pub hand_back: crate::provider::hand_back::HandBack,
    /// See [`ContextOptions::event_spin`].
    pub event_spin: std::time::Duration,
    /// Whether a QP of the context uses the UDP socket (as the engine's last pass saw): only
    /// then is the socket read in every pass, and does a thread that keeps polling an empty CQ
    /// yield its CPU.
    pub socket_in_use: AtomicBool,
    /// See [`ContextOptions::fail_idle_qps_when_peer_goes`].
    pub fail_idle_qps_when_peer_goes: bool,
    /// See [`ContextOptions::adopt_registered_pages`].
    pub adopt_registered_pages: bool,
    /// See [`ContextOptions::icrc_strict`].
    pub icrc_strict: bool,
    /// See [`ContextOptions::congestion`].
    pub congestion: ferroce_proto::CcConfig,
    /// See [`ContextOptions::congestion_to_local_peers`].
    pub congestion_to_local_peers: bool,
    /// The base RTT of each peer's path, shared by the QPs to it.
    pub path_rtts: crate::provider::path_rtt::PathRtts,
    /// See [`ContextOptions::selective_repeat`].
    pub selective_repeat: bool,
    pub epoch: std::time::Instant,
    pub engine: Mutex<EngineState>,
    /// Set when work was posted that no pass has looked at yet (lets idle passes skip the QPs).
    pub work_pending: AtomicBool,
    pub counters: EngineCounters,
    /// The transport counters of destroyed QPs, summed.
    pub retired_qp_counters: Mutex<Counters>,
    /// The UDP provider's side: the RoCE socket every packet arrives on.
    pub udp: UdpPort,
    /// The shared-memory provider's side (absent when the provider is UDP).
    pub shm: Option<ShmHost>,
    pub(super) next_qpn: AtomicU32,
    /// The host slot the context holds (see [`host_slot`]), if it was opened with one.
    pub(crate) slot: Option<u32>,
    pub(super) next_pd: AtomicU32,
}

impl ContextShared {
    /// The QP numbered `qpn`, if it is alive.
    /// The UD QP of number `qpn`.
    pub(crate) fn ud_qp(&self, qpn: u32) -> Option<Arc<UdShared>> {
        if self.ud_qp_count.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.ud_qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)
            .cloned()
    }

    /// Whether the context has UD QPs (whose datagrams come over UDP whatever the provider).
    pub(crate) fn has_ud_qps(&self) -> bool {
        self.ud_qp_count.load(Ordering::Acquire) > 0
    }

    pub(crate) fn add_ud_qp(&self, qp: Arc<UdShared>) {
        let mut m = self.ud_qps.write().unwrap_or_else(|e| e.into_inner());
        m.insert(qp.qpn, qp);
        self.ud_qp_count.store(m.len(), Ordering::Release);
    }

    /// Adds `qp` unless a UD QP of its number lives; whether it was added.
    pub(crate) fn add_ud_qp_if_absent(&self, qp: Arc<UdShared>) -> bool {
        let mut m = self.ud_qps.write().unwrap_or_else(|e| e.into_inner());
        if m.contains_key(&qp.qpn) {
            return false;
        }
        m.insert(qp.qpn, qp);
        self.ud_qp_count.store(m.len(), Ordering::Release);
        true
    }

    pub(crate) fn remove_ud_qp(&self, qpn: u32) {
        let mut m = self.ud_qps.write().unwrap_or_else(|e| e.into_inner());
        m.remove(&qpn);
        self.ud_qp_count.store(m.len(), Ordering::Release);
    }

    pub(crate) fn qp(&self, qpn: u32) -> Option<Arc<QpShared>> {
        self.qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)
            .cloned()
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

    /// A number for a new QP: the next one, or for a host-slot context the next one of its
    /// slot that no live QP holds.
    pub(crate) fn allocate_qpn(&self) -> Result<u32> {
        let Some(slot) = self.slot else {
            return Ok(self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff);
        };
        let base = slot * host_slot::QPNS_PER_SLOT;
        let live = self.qps.read().unwrap_or_else(|e| e.into_inner());
        let live_ud = self.ud_qps.read().unwrap_or_else(|e| e.into_inner());
        for _ in 0..host_slot::QPNS_PER_SLOT {
            let qpn =
                base + self.next_qpn.fetch_add(1, Ordering::Relaxed) % host_slot::QPNS_PER_SLOT;
            if qpn >= host_slot::FIRST_QPN
                && !live.contains_key(&qpn)
                && !live_ud.contains_key(&qpn)
            {
                return Ok(qpn);
            }
        }
        Err(Error::InvalidArgument(format!(
            "all {} QPNs of host slot {slot} are in use",
            host_slot::QPNS_PER_SLOT
        )))
    }

    pub(crate) fn remove_qp(&self, qpn: u32) {
        if let Some(qp) = self.qp(qpn) {
            crate::provider::send_owed(self, &qp);
        }
        let gone = self
            .qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qpn);
        self.qps_generation.fetch_add(1, Ordering::AcqRel);
        if let Some(qp) = gone {
            flush_held_ack(self, &qp);
            // Whatever the engine still counts for it in a pass already under way is lost; a
            // packet that arrives from now on counts as for an unknown QPN.
            let core = qp.qp.lock();
            let c = *core.counters();
            self.counters
                .direct_ops
                .fetch_add(core.direct_ops, Ordering::Relaxed);
            drop(core);
            self.retired_qp_counters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add(&c);
        }
    }
}

/// Binds the first free port of the host's slots (see [`host_slot`]).
fn open_in_slot(
    ip: std::net::IpAddr,
    capture: Option<&std::path::Path>,
    ecn: Ecn,
) -> Result<(UdpPort, Option<u32>)> {
    for slot in 0..host_slot::SLOTS {
        let addr = SocketAddr::new(ip, host_slot::port_of_slot(slot));
        match UdpPort::open(addr, capture, ecn) {
            Ok(udp) => return Ok((udp, Some(slot))),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {}
            Err(e) => return Err(e),
        }
    }
    Err(Error::io(
        format!(
            "finding a free host slot on {ip}: all {} ports from 4791 are taken",
            host_slot::SLOTS
        ),
        std::io::Error::from(std::io::ErrorKind::AddrInUse),
    ))
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
        self.shared.udp.flush();
    }
}

/// An opened device: one UDP socket, one engine thread, and the objects created from it.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
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
        let (udp, slot) = if options.host_slot {
            open_in_slot(gid.ip, options.capture.as_deref(), options.ecn)?
        } else {
            let addr = SocketAddr::new(gid.ip, options.port);
            (
                UdpPort::open(addr, options.capture.as_deref(), options.ecn)?,
                None,
            )
        };
        let local = udp.local_addr()?;
        if options.icrc_strict {
            // Every packet it sends must verify for Identification 0 too: a GSO send's
            // segments leave numbered.
            udp.gso.store(false, Ordering::Relaxed);
        }
        let provider = match options.provider {
            Provider::Auto if udp.capture.is_some() => Provider::Udp,
            p => p,
        };
        let shm = match provider {
            Provider::Udp => None,
            // Abstract socket names are first come, first served: another user may have taken
            // ours. With Auto that costs the shortcut, not the context: its QPs use UDP.
            Provider::Auto => ShmHost::open(Provider::Auto, local).ok(),
            p => Some(
                ShmHost::open(p, local)
                    .map_err(|e| Error::io(format!("publishing {local} for same-host peers"), e))?,
            ),
        };
        let shared = Arc::new(ContextShared {
            device: device.clone(),
            gid,
            local,
            mrs: MrTable::default(),
            qps: RwLock::new(HashMap::new()),
            qps_generation: AtomicU64::new(0),
            ud_qps: RwLock::new(HashMap::new()),
            ud_qp_count: AtomicUsize::new(0),
            doorbell_fd: EventFd::new().map_err(|e| Error::io("creating the doorbell", e))?,
            sleeping: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            app_polling_until: AtomicU64::new(0),
            hand_over_to_polling_app: options.hand_over_to_polling_app,
            hand_back_at_completion: options.hand_over_to_polling_app
                && options.hand_back_at_completion,
            hand_back: Default::default(),
            event_spin: options.event_spin,
            socket_in_use: AtomicBool::new(true),
            fail_idle_qps_when_peer_goes: options.fail_idle_qps_when_peer_goes,
            adopt_registered_pages: options.adopt_registered_pages,
            icrc_strict: options.icrc_strict,
            congestion: options.congestion,
            congestion_to_local_peers: options.congestion_to_local_peers,
            path_rtts: Default::default(),
            selective_repeat: options.selective_repeat,
            epoch: std::time::Instant::now(),
            engine: Mutex::new(EngineState::new()),
            work_pending: AtomicBool::new(true),
            counters: EngineCounters::default(),
            retired_qp_counters: Mutex::new(Counters::default()),
            udp,
            shm,
            next_qpn: AtomicU32::new(host_slot::FIRST_QPN),
            slot,
            next_pd: AtomicU32::new(1),
        });
        let for_thread = shared.clone();
        let thread = crate::os::spawn_without_signals(
            std::thread::Builder::new().name(format!("ferroce-engine-{}", local.port())),
            move || engine::run(for_thread),
        )
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
        CompletionChannel::new(&self.inner.shared)
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
        let c = &shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut direct_ops = l(&c.direct_ops);
        for qp in shared.live_qps() {
            let core = qp.qp.lock();
            qps.add(core.counters());
            direct_ops += core.direct_ops;
        }
        ContextCounters {
            rx_packets: l(&c.rx_packets),
            tx_packets: l(&c.tx_packets),
            rx_bytes: l(&c.rx_bytes),
            tx_bytes: l(&c.tx_bytes),
            icrc_errors: l(&c.icrc_errors),
            icrc_ident_solved: l(&c.icrc_ident_solved),
            malformed: l(&c.malformed),
            unknown_qpn: l(&c.unknown_qpn),
            wrong_source: l(&c.wrong_source),
            send_errors: l(&c.send_errors),
            direct_ops,
            ud_dropped: l(&c.ud_dropped),
            shm_peer_violations: l(&c.shm_peer_violations),
            shm_links_refused: shared.shm.as_ref().map_or(0, |h| l(&h.links_refused)),
            hand_backs_missed: shared.hand_back.missed_count(),
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
