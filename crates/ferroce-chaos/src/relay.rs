//! The relay: a connection-manager proxy plus a fault-injecting UDP forwarder per connection.
//!
//! Peers find each other through the TCP exchange of `ferroce::cm`, so the relay sits in that
//! exchange: it accepts the connector, connects to the real acceptor, and forwards every message,
//! rewriting the GID and UDP port of each `ENDPOINTS` record to one of its own UDP sockets. Each
//! peer then believes the relay *is* the other peer — its QPs send to the relay and accept packets
//! from it (the source-address check of connected QPs holds) — and neither peer needs a flag or
//! knows it is being relayed. The relay learns each side's real RoCE address per QP number from
//! the same records and forwards by the destination QPN in the BTH.
//!
//! The ICRC of RoCE v2 covers the IP addresses and UDP ports, so a packet forwarded from another
//! socket would fail the receiver's check. The relay therefore re-stamps each packet it forwards,
//! as a RoCE-aware NAT would: it verifies the ICRC against the addresses the packet arrived with
//! and, only if that holds, computes it anew for the addresses it leaves with. A packet that
//! arrives damaged is forwarded damaged, and the relay's own corruption is applied after the
//! re-stamp, so the receiver's ICRC check is what catches it.
//!
//! Every connection gets two UDP sockets (one facing each peer) and one forwarding thread per
//! direction. A thread receives a datagram, rolls its [`Fate`], and either drops it, sends it at
//! once, or queues it until its release time (delay, jitter, reordering). Plain blocking
//! `recv_from`/`send_to` per datagram are enough: a relay forwards a few hundred thousand packets a
//! second, more than the lossy runs it exists for need; the receive buffers are made large so the
//! relay's own queues never add losses nobody asked for.

use std::collections::{BinaryHeap, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ferroce::cm;
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::{icrc, RocePacket};

use crate::faults::{Dice, Fate, Faults};

/// How often blocked threads look at the stop flag.
const POLL: Duration = Duration::from_millis(20);
/// How long the relay waits to reach the real acceptor.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Socket buffers asked for: about a millisecond of traffic, like a switch port's buffer. A deep
/// buffer here would hold several go-back-N passes of a 1024-packet window in one queue, delay
/// every retransmission past the senders' ACK timeouts and turn a 1% loss into congestion
/// collapse — a property of the relay, not of the peers under test. What overflows is dropped by
/// the kernel, as a switch drops, and counted as `overflowed`.
const SOCKET_BUFFER: usize = 1 << 20;
/// Largest datagram handled (a UDP payload never exceeds it).
const MAX_DATAGRAM: usize = 65_536;

/// Counters of one direction.
#[derive(Debug, Default)]
struct DirCounters {
    received: AtomicU64,
    forwarded: AtomicU64,
    lost: AtomicU64,
    blackholed: AtomicU64,
    corrupted: AtomicU64,
    duplicated: AtomicU64,
    reordered: AtomicU64,
    unroutable: AtomicU64,
    send_errors: AtomicU64,
    overflowed: AtomicU64,
}

/// What the relay did to the packets of one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionStats {
    /// Datagrams received.
    pub received: u64,
    /// Datagrams sent on (duplicates counted twice).
    pub forwarded: u64,
    /// Dropped by the loss rate.
    pub lost: u64,
    /// Dropped in a blackhole.
    pub blackholed: u64,
    /// Delivered with one bit flipped.
    pub corrupted: u64,
    /// Delivered twice.
    pub duplicated: u64,
    /// Held back to be overtaken.
    pub reordered: u64,
    /// Dropped because no peer address is known for them (too short, unknown QPN).
    pub unroutable: u64,
    /// Sends the kernel refused.
    pub send_errors: u64,
    /// Dropped by the kernel because the relay's receive queue was full (congestion).
    pub overflowed: u64,
}

impl DirCounters {
    fn snapshot(&self) -> DirectionStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DirectionStats {
            received: g(&self.received),
            forwarded: g(&self.forwarded),
            lost: g(&self.lost),
            blackholed: g(&self.blackholed),
            corrupted: g(&self.corrupted),
            duplicated: g(&self.duplicated),
            reordered: g(&self.reordered),
            unroutable: g(&self.unroutable),
            send_errors: g(&self.send_errors),
            overflowed: g(&self.overflowed),
        }
    }
}

/// What the relay did, per direction, over all connections so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Connections relayed.
    pub connections: u64,
    /// From the connecting side (the client) to the accepting side (the server).
    pub to_server: DirectionStats,
    /// From the server to the client.
    pub to_client: DirectionStats,
}

impl RelayStats {
    /// Faults injected in both directions: drops, blackholed packets, corruptions, duplicates
    /// and reorderings.
    pub fn faults(&self) -> u64 {
        [self.to_server, self.to_client]
            .iter()
            .map(|d| d.lost + d.blackholed + d.corrupted + d.duplicated + d.reordered)
            .sum()
    }
}

#[derive(Debug)]
struct Shared {
    faults: Faults,
    started: Instant,
    stop: AtomicBool,
    blackhole: AtomicBool,
    connections: AtomicU64,
    to_server: DirCounters,
    to_client: DirCounters,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A running relay. Dropping it stops every thread it started.
#[derive(Debug)]
pub struct Relay {
    cm_addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Relay {
    /// Listens for connection-manager clients on `listen` (port 0: any free port) and relays each
    /// to the ferroce listener at `target`, injecting `faults` into their RoCE traffic.
    pub fn start(listen: SocketAddr, target: SocketAddr, faults: Faults) -> io::Result<Relay> {
        let listener = TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let cm_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            faults,
            started: Instant::now(),
            stop: AtomicBool::new(false),
            blackhole: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            to_server: DirCounters::default(),
            to_client: DirCounters::default(),
            threads: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let acceptor = thread::Builder::new()
            .name("chaos-accept".into())
            .spawn(move || accept_loop(&listener, target, &s))?;
        Ok(Relay {
            cm_addr,
            target,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// Where clients connect (give this to `cm::connect` or `ferroce perf HOST --port`).
    pub fn cm_addr(&self) -> SocketAddr {
        self.cm_addr
    }

    /// The listener the relay forwards to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// The faults in force.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// Drops every packet while `on`, in both directions (a cut cable), besides any timed
    /// blackhole of the [`Faults`].
    pub fn set_blackhole(&self, on: bool) {
        self.shared.blackhole.store(on, Ordering::SeqCst);
    }

    /// What the relay has done so far.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            connections: self.shared.connections.load(Ordering::Relaxed),
            to_server: self.shared.to_server.snapshot(),
            to_client: self.shared.to_client.snapshot(),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn spawn(shared: &Arc<Shared>, name: &str, f: impl FnOnce() + Send + 'static) {
    match thread::Builder::new().name(name.into()).spawn(f) {
        Ok(h) => lock(&shared.threads).push(h),
        Err(e) => eprintln!("ferroce chaos: cannot start a thread: {e}"),
    }
}

fn accept_loop(listener: &TcpListener, target: SocketAddr, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                shared.connections.fetch_add(1, Ordering::Relaxed);
                let s = shared.clone();
                spawn(shared, "chaos-link", move || {
                    if let Err(e) = link(client, target, &s) {
                        eprintln!("ferroce chaos: relaying a connection to {target}: {e}");
                    }
                });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(POLL / 4),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("ferroce chaos: accept: {e}");
                thread::sleep(POLL);
            }
        }
    }
}

/// Real RoCE addresses of one side's QPs, learned from its `ENDPOINTS` records, plus the last
/// address a packet came from (for a packet whose QPN was never announced).
#[derive(Debug, Default)]
struct Routes {
    by_qpn: RwLock<HashMap<u32, SocketAddr>>,
    any: RwLock<Option<SocketAddr>>,
}

impl Routes {
    fn learn(&self, qpn: u32, addr: SocketAddr) {
        self.by_qpn
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(qpn, addr);
        *self.any.write().unwrap_or_else(|p| p.into_inner()) = Some(addr);
    }

    fn lookup(&self, qpn: u32) -> Option<SocketAddr> {
        let known = self
            .by_qpn
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&qpn)
            .copied();
        known.or(*self.any.read().unwrap_or_else(|p| p.into_inner()))
    }
}

fn udp_socket(ip: IpAddr) -> io::Result<UdpSocket> {
    let s = UdpSocket::bind(SocketAddr::new(ip, 0))?;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
        if set_buffer(&s, opt).is_err() {
            // Unprivileged: the plain options, capped by net.core.[rw]mem_max.
            let plain = if opt == libc::SO_RCVBUFFORCE {
                libc::SO_RCVBUF
            } else {
                libc::SO_SNDBUF
            };
            let _ = set_buffer(&s, plain);
        }
    }
    Ok(s)
}

fn set_buffer(s: &UdpSocket, opt: libc::c_int) -> io::Result<()> {
    let v = SOCKET_BUFFER as libc::c_int;
    // SAFETY: the fd is a live socket owned by `s`; the option value points to a c_int that lives
    // across the call and its exact size is passed.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Relays one connection: the CM exchange in both directions and, until the relay stops, the
/// RoCE traffic between the two peers.
fn link(client: TcpStream, target: SocketAddr, shared: &Arc<Shared>) -> io::Result<()> {
    client.set_nonblocking(false)?;
    let server = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)?;
    // Each UDP socket sits on the address its peer already reaches us by.
    let facing_client = udp_socket(client.local_addr()?.ip())?;
    let facing_server = udp_socket(server.local_addr()?.ip())?;
    // Announce the socket facing the server to the server, and the one facing the client to the
    // client.
    let to_server_as = facing_server.local_addr()?;
    let to_client_as = facing_client.local_addr()?;
    let client_routes = Arc::new(Routes::default());
    let server_routes = Arc::new(Routes::default());

    let (c2s_in, c2s_out) = (facing_client.try_clone()?, facing_server.try_clone()?);
    let (s2c_in, s2c_out) = (facing_server, facing_client);
    let (sr, s) = (server_routes.clone(), shared.clone());
    spawn(shared, "chaos-to-server", move || {
        forward(&c2s_in, &c2s_out, &sr, &s, 0)
    });
    let (cr, s) = (client_routes.clone(), shared.clone());
    spawn(shared, "chaos-to-client", move || {
        forward(&s2c_in, &s2c_out, &cr, &s, 1)
    });

    let (c_read, s_write) = (client.try_clone()?, server.try_clone()?);
    let s = shared.clone();
    spawn(shared, "chaos-cm-up", move || {
        pump(c_read, s_write, to_server_as, &client_routes, &s)
    });
    pump(server, client, to_client_as, &server_routes, shared);
    Ok(())
}

/// Reads exactly `buf.len()` bytes unless the relay stops or the stream ends; `Ok(false)` on a
/// clean end before the first byte.
fn read_full(r: &mut TcpStream, buf: &mut [u8], shared: &Shared) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        if shared.stop.load(Ordering::SeqCst) {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "relay stopped"));
        }
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Forwards connection-manager messages from `from` to `to`, rewriting the address of every
/// `ENDPOINTS` record to `announce` and remembering the real one in `routes`. Anything that is
/// not a well-formed version-1 message is passed through untouched from there on, so the peers
/// report the problem themselves.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    announce: SocketAddr,
    routes: &Routes,
    shared: &Shared,
) {
    let _ = from.set_read_timeout(Some(POLL));
    let announced_gid = match announce.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let mut header = [0u8; cm::HEADER_LEN];
    let mut body = Vec::new();
    let mut transparent = false;
    loop {
        if transparent {
            let mut buf = [0u8; 4096];
            match read_full(&mut from, &mut buf[..1], shared) {
                Ok(true) => {
                    let n = from.read(&mut buf[1..]).unwrap_or(0);
                    if to.write_all(&buf[..n + 1]).is_err() {
                        break;
                    }
                }
                _ => break,
            }
            continue;
        }
        match read_full(&mut from, &mut header, shared) {
            Ok(true) => {}
            _ => break,
        }
        let body_len = u32::from_be_bytes([header[8], header[9], header[10], header[11]]) as usize;
        let count = usize::from(u16::from_be_bytes([header[6], header[7]]));
        let endpoints = header[5] == 1 && body_len == count * cm::ENDPOINT_LEN;
        if header[..4] != cm::MAGIC
            || header[4] != cm::VERSION
            || body_len > cm::MAX_ENDPOINTS * cm::ENDPOINT_LEN
        {
            transparent = true;
            if to.write_all(&header).is_err() {
                break;
            }
            continue;
        }
        body.resize(body_len, 0);
        match read_full(&mut from, &mut body, shared) {
            Ok(true) => {}
            _ => break,
        }
        if endpoints {
            for r in body.chunks_exact_mut(cm::ENDPOINT_LEN) {
                let qpn = u32::from_be_bytes([r[0], r[1], r[2], r[3]]) & 0x00ff_ffff;
                let mut gid = [0u8; 16];
                gid.copy_from_slice(&r[8..24]);
                let gid = Ipv6Addr::from(gid);
                let ip = gid
                    .to_ipv4_mapped()
                    .map(IpAddr::V4)
                    .unwrap_or(IpAddr::V6(gid));
                routes.learn(qpn, SocketAddr::new(ip, u16::from_be_bytes([r[24], r[25]])));
                r[8..24].copy_from_slice(&announced_gid.octets());
                r[24..26].copy_from_slice(&announce.port().to_be_bytes());
            }
        }
        if to.write_all(&header).is_err() || to.write_all(&body).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// A datagram waiting for its release time.
#[derive(Debug, PartialEq, Eq)]
struct Held {
    at: Instant,
    seq: u64,
    to: SocketAddr,
    bytes: Vec<u8>,
}

impl Ord for Held {
    fn cmp(&self, other: &Held) -> std::cmp::Ordering {
        // Earliest first out of a max-heap; equal times in arrival order.
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Held) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// One direction of one connection: datagrams from `input` go out of `output` to the peer the
/// destination QPN belongs to.
fn forward(
    input: &UdpSocket,
    output: &UdpSocket,
    routes: &Routes,
    shared: &Shared,
    direction: u64,
) {
    let counters = if direction == 0 {
        &shared.to_server
    } else {
        &shared.to_client
    };
    let mut dice = Dice::new(&shared.faults, direction);
    let mut held: BinaryHeap<Held> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let (Ok(arrived_at), Ok(departs_from)) = (input.local_addr(), output.local_addr()) else {
        return;
    };
    let mut timeout = Some(POLL);
    let _ = input.set_read_timeout(timeout);
    let send = |to: SocketAddr, bytes: &[u8]| match output.send_to(bytes, to) {
        Ok(_) => {
            counters.forwarded.fetch_add(1, Ordering::Relaxed);
        }
        Err(_) => {
            counters.send_errors.fetch_add(1, Ordering::Relaxed);
        }
    };
    while !shared.stop.load(Ordering::SeqCst) {
        if let Some(d) = socket_drops(input) {
            counters.overflowed.store(d, Ordering::Relaxed);
        }
        let now = Instant::now();
        while held.peek().is_some_and(|h| h.at <= now) {
            if let Some(h) = held.pop() {
                send(h.to, &h.bytes);
            }
        }
        let want = held
            .peek()
            .map(|h| {
                h.at.saturating_duration_since(now)
                    .clamp(Duration::from_micros(20), POLL)
            })
            .unwrap_or(POLL);
        if timeout != Some(want) {
            timeout = Some(want);
            let _ = input.set_read_timeout(timeout);
        }
        let (n, from) = match input.recv_from(&mut buf) {
            Ok(got) => got,
            Err(_) => continue,
        };
        counters.received.fetch_add(1, Ordering::Relaxed);
        // The BTH's destination QP number: bytes 5..8 of the UDP payload.
        let to = if n >= 12 {
            routes.lookup(u32::from_be_bytes([0, buf[5], buf[6], buf[7]]))
        } else {
            None
        };
        let Some(to) = to else {
            counters.unroutable.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        restamp(&mut buf[..n], from, arrived_at, departs_from, to);
        let fate = dice.roll(
            n,
            shared.started.elapsed(),
            shared.blackhole.load(Ordering::Relaxed),
        );
        match fate {
            Fate::Lost => {
                counters.lost.fetch_add(1, Ordering::Relaxed);
            }
            Fate::Blackholed => {
                counters.blackholed.fetch_add(1, Ordering::Relaxed);
            }
            Fate::Delivered {
                copies,
                hold,
                reordered,
                flip,
            } => {
                if let Some(bit) = flip {
                    buf[bit / 8] ^= 1 << (bit % 8);
                    counters.corrupted.fetch_add(1, Ordering::Relaxed);
                }
                if copies > 1 {
                    counters.duplicated.fetch_add(1, Ordering::Relaxed);
                }
                if reordered {
                    counters.reordered.fetch_add(1, Ordering::Relaxed);
                }
                for _ in 0..copies {
                    if hold.is_zero() && held.is_empty() {
                        send(to, &buf[..n]);
                    } else {
                        seq += 1;
                        held.push(Held {
                            at: Instant::now() + hold,
                            seq,
                            to,
                            bytes: buf[..n].to_vec(),
                        });
                    }
                }
            }
        }
    }
}

/// Replaces the ICRC of `pkt`, valid for a trip `from` → `arrived_at`, with the one valid for
/// `departs_from` → `to`; leaves a packet whose ICRC was already wrong (or that is no RoCE
/// packet) as it is. The IPv4 Identification it arrived with is not shown by the socket: any
/// that makes the ICRC verify is taken (a segment of a GSO send carries its place in the send,
/// see the UDP provider); it leaves alone, with Identification 0.
fn restamp(
    pkt: &mut [u8],
    from: SocketAddr,
    arrived_at: SocketAddr,
    departs_from: SocketAddr,
    to: SocketAddr,
) {
    let headers = |src: SocketAddr, dst: SocketAddr| {
        let mut h = UdpFrameHeaders::roce(src.ip(), src.port(), dst.ip());
        h.dst_port = dst.port();
        h.ip_udp_headers(pkt.len()).ok()
    };
    let Ok(view) = RocePacket::new_checked(&pkt[..]) else {
        return;
    };
    let good = headers(from, arrived_at)
        .and_then(|h| {
            icrc::verify_any_ipv4_identification(h.ip(), h.udp(), view.covered(), view.icrc()).ok()
        })
        .is_some_and(|c| c.is_ok());
    if !good {
        return;
    }
    let Some(crc) =
        headers(departs_from, to).and_then(|h| icrc::compute(h.ip(), h.udp(), view.covered()).ok())
    else {
        return;
    };
    RocePacket::new_unchecked(pkt).set_icrc(crc);
}

/// Datagrams the kernel dropped on `s` for want of buffer space (`SK_MEMINFO_DROPS` of
/// `SO_MEMINFO`), if the kernel tells.
fn socket_drops(s: &UdpSocket) -> Option<u64> {
    const SK_MEMINFO_VARS: usize = 9;
    const SK_MEMINFO_DROPS: usize = 8;
    let mut info = [0u32; SK_MEMINFO_VARS];
    let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
    // SAFETY: the fd is a live socket owned by `s`; `info` is a writable buffer of `len` bytes
    // that outlives the call, and the kernel writes at most `len` bytes and updates `len`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MEMINFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    (rc == 0 && len as usize >= (SK_MEMINFO_DROPS + 1) * 4)
        .then(|| u64::from(info[SK_MEMINFO_DROPS]))
}
