//! `ferroce perf`: perftest-shaped latency and bandwidth tests over ferroce.
//!
//! Run a server (`ferroce perf write_lat`) and a client with the same options and the server's
//! address (`ferroce perf write_lat 10.0.0.1`), or both in one process with `--loopback`. The
//! peers exchange QP numbers, PSNs, GIDs, ports and a memory region over TCP (port 18515, as
//! perftest), bring their QPs to RTS and run one round per message size, synchronising over the
//! same TCP connection before and after each. During READ, WRITE and atomic tests the server
//! only waits on that TCP connection: its engine thread serves the one-sided operations.
//!
//! Latency is half the round trip for WRITE and SEND (ping-pong) and the whole operation for
//! READ and atomics, as perftest reports them. MB is 2^20 bytes, as in perftest.

mod report;

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferroce::cm::{self, EndpointInfo, Listener, RemoteRegion};
use ferroce::{
    Access, CompletionQueue, ConnectOptions, Context, ContextOptions, Device, MemoryRegion,
    ProtectionDomain, Psn, QpCaps, QpInitAttr, QueuePair, RecvWr, SendFlags, SendOp, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};
use report::{BwStats, LatStats};

/// The eight tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Test {
    /// RDMA WRITE ping-pong latency.
    #[value(name = "write_lat")]
    WriteLat,
    /// RDMA READ latency.
    #[value(name = "read_lat")]
    ReadLat,
    /// SEND/RECV ping-pong latency.
    #[value(name = "send_lat")]
    SendLat,
    /// FETCH_ADD latency.
    #[value(name = "atomic_lat")]
    AtomicLat,
    /// RDMA WRITE bandwidth.
    #[value(name = "write_bw")]
    WriteBw,
    /// RDMA READ bandwidth.
    #[value(name = "read_bw")]
    ReadBw,
    /// SEND bandwidth.
    #[value(name = "send_bw")]
    SendBw,
    /// FETCH_ADD message rate.
    #[value(name = "atomic_bw")]
    AtomicBw,
}

impl Test {
    fn is_lat(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::ReadLat | Test::SendLat | Test::AtomicLat
        )
    }
    fn is_atomic(self) -> bool {
        matches!(self, Test::AtomicLat | Test::AtomicBw)
    }
    fn title(self) -> &'static str {
        match self {
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::SendLat => "Send Latency Test",
            Test::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
            Test::WriteBw => "RDMA_Write BW Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::SendBw => "Send BW Test",
            Test::AtomicBw => "Atomic FETCH_AND_ADD BW Test",
        }
    }
}

/// Arguments of `ferroce perf`.
#[derive(Debug, Clone, Args)]
pub struct PerfArgs {
    /// The test.
    test: Test,
    /// The server to connect to; without it this process is the server.
    host: Option<String>,
    /// Run server and client in this process, over loopback.
    #[arg(long)]
    loopback: bool,
    /// Message size in bytes (default 2 for latency, 65536 for bandwidth).
    #[arg(long, short = 's', value_parser = clap::value_parser!(u64).range(0..=(1 << 30)))]
    size: Option<u64>,
    /// Iterations per size (default 1000 for latency, 5000 for bandwidth; with --all, bandwidth
    /// rounds are capped at 1 GiB of data unless --iters is given).
    #[arg(long, short = 'n', value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    iters: Option<u64>,
    /// Every size from 2 bytes to 8 MiB.
    #[arg(long, short = 'a')]
    all: bool,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (default: the device's).
    #[arg(long, short = 'm')]
    mtu: Option<u32>,
    /// Queue pairs (bandwidth tests spread messages over them).
    #[arg(long, short = 'q', default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    qps: u16,
    /// Check every byte and every atomic result.
    #[arg(long)]
    verify: bool,
    /// One JSON object per message size.
    #[arg(long)]
    json: bool,
    /// Print the transport's counters at the end.
    #[arg(long)]
    counters: bool,
    /// TCP port of the connection exchange.
    #[arg(long, short = 'p', default_value_t = 18515)]
    port: u16,
    /// Device to use (ferroce_lo, or an interface name); default: the one holding --bind, or
    /// the one that reaches HOST.
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Local address to use (server default 127.0.0.1).
    #[arg(long)]
    bind: Option<IpAddr>,
    /// UDP port of this side's RoCE socket (0: any free port; the peer learns it).
    #[arg(long, default_value_t = 0)]
    roce_port: u16,
    /// Work requests in flight in bandwidth tests.
    #[arg(long, short = 't', default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    tx_depth: u32,
    /// Seconds to wait for the peer at any step.
    #[arg(long, default_value_t = 10)]
    timeout: u64,
    /// Local ACK timeout code of the QPs: 4.096 µs × 2^CODE (perftest's -u; default 14 = 67 ms).
    #[arg(long, default_value_t = 14, value_parser = clap::value_parser!(u8).range(1..=31))]
    qp_timeout: u8,
    /// Put a chaos relay between client and server (with --loopback, or on the client side):
    /// e.g. loss=0.05,reorder=0.05,duplicate=0.02,corrupt=0.01,delay_ms=1,seed=7 (see
    /// 'ferroce chaos --help').
    #[arg(long, value_name = "FAULTS")]
    chaos: Option<String>,
    /// Print as ibv_rc_pingpong does (set by `ferroce pingpong`).
    #[arg(skip)]
    pingpong_style: bool,
}

/// Arguments of `ferroce pingpong`.
#[derive(Debug, Clone, Args)]
pub struct PingpongArgs {
    /// The server to connect to; without it this process is the server.
    host: Option<String>,
    /// Message size.
    #[arg(long, short = 's', default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=(1 << 24)))]
    size: u64,
    /// Round trips.
    #[arg(long, short = 'n', default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    iters: u64,
    /// TCP port of the connection exchange.
    #[arg(long, short = 'p', default_value_t = 18515)]
    port: u16,
    /// Device to use.
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Local address to use.
    #[arg(long)]
    bind: Option<IpAddr>,
    /// Run both sides in this process, over loopback.
    #[arg(long)]
    loopback: bool,
    /// Check the bytes of every message.
    #[arg(long)]
    verify: bool,
}

/// Runs `ferroce pingpong`: a SEND/RECV ping-pong printed as ibv_rc_pingpong prints it.
pub fn pingpong(p: &PingpongArgs) -> Res<ExitCode> {
    let args = PerfArgs {
        test: Test::SendLat,
        host: p.host.clone(),
        loopback: p.loopback,
        size: Some(p.size),
        iters: Some(p.iters),
        all: false,
        mtu: None,
        qps: 1,
        verify: p.verify,
        json: false,
        counters: false,
        port: p.port,
        device: p.device.clone(),
        bind: p.bind,
        roce_port: 0,
        tx_depth: 128,
        timeout: 10,
        qp_timeout: 14,
        chaos: None,
        pingpong_style: true,
    };
    run(&args)
}

type Res<T> = Result<T, String>;

fn e<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |err| format!("{what}: {err}")
}

impl PerfArgs {
    fn sizes(&self) -> Vec<u64> {
        if self.test.is_atomic() {
            // An atomic moves one 8-byte word whatever else is asked (a size other than 8 is
            // refused), and the report says so.
            vec![8]
        } else if self.all {
            (1..=23).map(|k| 1u64 << k).collect()
        } else {
            vec![self
                .size
                .unwrap_or(if self.test.is_lat() { 2 } else { 65_536 })]
        }
    }
    fn iters_for(&self, size: u64) -> u64 {
        match self.iters {
            Some(n) => n,
            None if self.test.is_lat() => 1000,
            None if self.all => 5000u64.min(((1u64 << 30) / size.max(1)).max(16)),
            None => 5000,
        }
    }
    fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout.max(1))
    }
}

/// Runs the command.
pub fn run(args: &PerfArgs) -> Res<ExitCode> {
    if args.test.is_lat() && args.qps != 1 {
        return Err("latency tests use one QP (--qps 1)".into());
    }
    let sizes = args.sizes();
    if matches!(args.test, Test::WriteLat) && sizes.contains(&0) {
        return Err("write_lat needs --size of at least 1 (the last byte signals arrival)".into());
    }
    if args.test.is_atomic() && args.size.is_some_and(|s| s != 8) {
        return Err("atomic tests move 8 bytes; leave --size out".into());
    }
    if let Some(m) = args.mtu {
        ferroce::PathMtu::from_bytes(m).map_err(|e| e.to_string())?;
    }
    let faults = args
        .chaos
        .as_deref()
        .map(crate::chaos::parse_faults)
        .transpose()?;
    if faults.is_some() && !args.loopback && args.host.is_none() {
        return Err("--chaos goes on the client side (with HOST) or with --loopback".into());
    }
    // The relay, when asked for, stands where the client connects and forwards to `server`.
    let via_relay = |server: SocketAddr| -> Res<(SocketAddr, Option<ferroce_chaos::Relay>)> {
        match &faults {
            None => Ok((server, None)),
            Some(f) => {
                let relay = ferroce_chaos::Relay::start(
                    SocketAddr::new(IpAddr::from([127, 0, 0, 1]), 0),
                    server,
                    f.clone(),
                )
                .map_err(e("starting the chaos relay"))?;
                Ok((relay.cm_addr(), Some(relay)))
            }
        }
    };
    let report_relay = |relay: Option<ferroce_chaos::Relay>, t0: Instant| {
        if let Some(r) = relay {
            crate::chaos::print_stats(&r.stats(), t0.elapsed(), args.json);
        }
    };
    let t0 = Instant::now();
    if args.loopback {
        if args.host.is_some() {
            return Err("--loopback runs both sides; give no HOST".into());
        }
        let bind = args.bind.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let listener = Listener::bind(SocketAddr::new(bind, 0)).map_err(|e| e.to_string())?;
        let (addr, relay) = via_relay(listener.local_addr())?;
        let server_args = args.clone();
        let server = std::thread::spawn(move || serve(&server_args, &listener));
        let client = client(args, addr);
        // What the relay did explains a failure too: print it before any error.
        report_relay(relay, t0);
        let code = client?;
        let server = server
            .join()
            .map_err(|_| "the server thread panicked".to_string())?;
        server?;
        return Ok(code);
    }
    match &args.host {
        Some(host) => {
            let addr = (host.as_str(), args.port)
                .to_socket_addrs()
                .map_err(e(&format!("resolving {host}")))?
                .next()
                .ok_or_else(|| format!("{host} has no address"))?;
            let (addr, relay) = via_relay(addr)?;
            let code = client(args, addr);
            report_relay(relay, t0);
            code
        }
        None => {
            let bind = args.bind.unwrap_or(IpAddr::from([127, 0, 0, 1]));
            let listener =
                Listener::bind(SocketAddr::new(bind, args.port)).map_err(|e| e.to_string())?;
            eprintln!(
                "ferroce perf: {} server on {}",
                test_name(args.test),
                listener.local_addr()
            );
            serve(args, &listener)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn test_name(t: Test) -> String {
    t.to_possible_value()
        .map(|v| v.get_name().to_string())
        .unwrap_or_default()
}

/// The device to use: named, holding `ip`, or (for a client) the one that routes to `peer`.
fn pick_device(args: &PerfArgs, peer: Option<IpAddr>) -> Res<(Device, usize)> {
    let devices = ferroce::devices().map_err(|e| e.to_string())?;
    let want_ip = match (args.bind, peer) {
        (Some(ip), _) => Some(ip),
        (None, Some(p)) => {
            // The kernel's choice of source address for that peer.
            let s = UdpSocket::bind(SocketAddr::new(
                if p.is_ipv4() {
                    IpAddr::from([0, 0, 0, 0])
                } else {
                    IpAddr::from([0u16; 8])
                },
                0,
            ))
            .map_err(e("probing the route"))?;
            s.connect(SocketAddr::new(p, 9))
                .map_err(e(&format!("no route to {p}")))?;
            Some(s.local_addr().map_err(e("probing the route"))?.ip())
        }
        (None, None) => Some(IpAddr::from([127, 0, 0, 1])),
    };
    if let Some(name) = &args.device {
        let d = devices
            .into_iter()
            .find(|d| d.name() == name || d.ifname() == name)
            .ok_or_else(|| format!("no device {name} (see 'ferroce devices')"))?;
        let idx = want_ip
            .and_then(|ip| d.gids().iter().position(|g| g.ip == ip))
            .unwrap_or(0);
        return Ok((d, idx));
    }
    let ip = want_ip.unwrap_or(IpAddr::from([127, 0, 0, 1]));
    for d in devices {
        if let Some(i) = d.gids().iter().position(|g| g.ip == ip) {
            return Ok((d, i));
        }
    }
    Err(format!(
        "no device holds the address {ip} (see 'ferroce devices')"
    ))
}

/// One side's resources, connected.
struct Session {
    ctx: Context,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    qps: Vec<QueuePair>,
    buf: MemoryRegion,
    /// Bytes of buffer per QP: a receive area then a send area, each `area` long.
    slot: usize,
    /// The largest message size rounded up to whole pairs of cache lines, so the area the peer
    /// writes and the one this side writes never share a line (or an adjacent-line prefetch
    /// pair): a latency test's flag bytes would otherwise bounce one line between the cores.
    area: usize,
    remote: RemoteRegion,
    conn: cm::Connection,
    mtu: ferroce::PathMtu,
    local: Vec<EndpointInfo>,
}

impl Session {
    fn recv_off(&self, q: usize) -> usize {
        q * self.slot
    }
    fn send_off(&self, q: usize) -> usize {
        q * self.slot + self.area
    }
    fn counter_off(&self) -> usize {
        self.qps.len() * self.slot
    }
    fn remote_addr(&self, off: usize) -> u64 {
        self.remote.addr + off as u64
    }
    fn sync(&mut self, t: Duration) -> Res<()> {
        self.conn.sync(t).map_err(|e| e.to_string())
    }
}

fn initial_psn(qpn: u32) -> Psn {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let x = (t ^ u64::from(qpn).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_mul(0xbf58_476d_1ce4_e5b9);
    Psn::new((x >> 40) as u32)
}

fn setup(
    args: &PerfArgs,
    listener: Option<&Listener>,
    server_addr: Option<SocketAddr>,
) -> Res<Session> {
    let (device, gid_index) = pick_device(args, server_addr.map(|a| a.ip()))?;
    let opts = ContextOptions {
        gid_index,
        port: args.roce_port,
        ..ContextOptions::default()
    };
    let ctx = device.open(&opts).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let nq = usize::from(args.qps);
    let depth = args.tx_depth.max(512) as usize;
    let cq = ctx
        .create_cq(depth * nq * 2 + 1024, None)
        .map_err(|e| e.to_string())?;
    let caps = QpCaps {
        max_send_wr: depth as u32 * 2,
        max_recv_wr: depth as u32 * 2,
        ..QpCaps::default()
    };
    let qps = (0..nq)
        .map(|_| pd.create_qp(&QpInitAttr::new(&cq, caps)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let max_size = args.sizes().into_iter().max().unwrap_or(8).max(8) as usize;
    let area = max_size.div_ceil(128) * 128;
    let slot = 2 * area;
    let buf = pd
        .alloc_mr(slot * nq + 64, Access::ALL)
        .map_err(e("allocating buffers"))?;
    let region = RemoteRegion {
        addr: buf.addr(),
        rkey: buf.rkey(),
        len: buf.len() as u64,
    };
    let mut local: Vec<EndpointInfo> = qps
        .iter()
        .map(|q| q.endpoint_info(initial_psn(q.qpn()), Some(region)))
        .collect();
    if let Some(m) = args.mtu {
        let m = ferroce::PathMtu::from_bytes(m).map_err(|e| e.to_string())?;
        for l in &mut local {
            l.mtu = l.mtu.min(m);
        }
    }
    let conn = match (listener, server_addr) {
        (Some(l), _) => l.accept_many(&local, Duration::from_secs(600)),
        (None, Some(addr)) => cm::connect_many(addr, &local, args.timeout()),
        (None, None) => return Err("internal: setup needs a listener or a server address".into()),
    }
    .map_err(|e| e.to_string())?;
    let copts = ConnectOptions {
        min_rnr_timer: 1,
        timeout: args.qp_timeout,
        ..ConnectOptions::default()
    };
    for ((q, l), p) in qps.iter().zip(&local).zip(&conn.peers) {
        q.connect(l, p, &copts)
            .map_err(|e| format!("connecting QP 0x{:x}: {e}", q.qpn()))?;
    }
    let remote = conn
        .peer
        .region
        .ok_or("the peer offered no memory region")?;
    if remote.len < (slot * nq + 8) as u64 {
        return Err("the peer's buffer is smaller than this side's: run both sides with the same --size/--all/--qps".into());
    }
    let mtu = conn.mtu(&local[0]);
    let mut s = Session {
        ctx,
        _pd: pd,
        cq,
        qps,
        buf,
        slot,
        area,
        remote,
        conn,
        mtu,
        local,
    };
    s.sync(args.timeout())?;
    Ok(s)
}

fn pattern(size: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(131)
                .wrapping_add(size.wrapping_mul(7)) as u8
                ^ (i >> 10) as u8
        })
        .collect()
}

fn check_wc(wc: &WorkCompletion) -> Res<()> {
    if wc.status == WcStatus::Success {
        Ok(())
    } else {
        Err(format!(
            "work request {:#x} on QP 0x{:x} failed: {}",
            wc.wr_id, wc.qp_num, wc.status
        ))
    }
}

fn sge(s: &Session, off: usize, len: u64) -> Res<Vec<ferroce::Sge>> {
    if len == 0 {
        Ok(vec![])
    } else {
        Ok(vec![s
            .buf
            .sge(off, len as usize)
            .map_err(|e| e.to_string())?])
    }
}

fn unsignaled() -> SendFlags {
    SendFlags::default()
}

/// The last (up to) 8 bytes of a message in the send area, whose last byte is the flag of a
/// WRITE latency test. Setting the flag stores the whole word, built in a register: the post
/// that follows reads the message, and a load that takes a word from a smaller store still in
/// the store buffer has to wait for that store to reach the cache (a store-forwarding stall, a
/// few nanoseconds each turn of an 8 B shared-memory ping-pong). The same holds for a word put
/// together in memory from a byte store, so the word is shifted, never written byte by byte.
struct FlagWord {
    off: usize,
    len: usize,
    /// The bytes, little-endian: byte `i` of the message's tail is bits `8i..8i + 8`.
    word: u64,
}

impl FlagWord {
    /// The word ending the `len`-byte message at `off`, as the buffer holds it now.
    fn new(s: &Session, off: usize, len: usize) -> Res<FlagWord> {
        let n = len.min(8);
        let mut bytes = [0u8; 8];
        s.buf
            .read(off + len - n, &mut bytes[..n])
            .map_err(|e| e.to_string())?;
        Ok(FlagWord {
            off: off + len - n,
            len: n,
            word: u64::from_le_bytes(bytes),
        })
    }

    #[inline(always)]
    fn set(&mut self, s: &Session, flag: u8) -> Res<()> {
        let shift = 8 * (self.len - 1);
        self.word = self.word & !(0xff << shift) | u64::from(flag) << shift;
        let bytes = self.word.to_le_bytes();
        let done = if self.len == 8 {
            s.buf.write(self.off, &bytes)
        } else {
            s.buf.write(self.off, &bytes[..self.len])
        };
        done.map_err(|e| e.to_string())
    }
}

/// How many times `wait_flag` reads the flag byte between two CQ polls. A WRITE arriving as
/// packets needs the engine, which a CQ poll drives inline; a same-host peer's WRITE lands in
/// memory with no call here, and a poll in the way only delays seeing it, so then the CQ is
/// polled only now and then (for an error completion, and the clock).
fn flag_looks(s: &Session) -> usize {
    match s.qps[0].provider() {
        ferroce::Provider::Shm => FLAG_LOOKS_PER_POLL_SHM,
        _ => 1,
    }
}

/// Polls until the byte at `off` is `flag`: looks at it `looks` times between two CQ polls.
/// Inlined, so that what follows a wait (the next post) comes straight after the look that
/// ends it.
#[inline(always)]
fn wait_flag(s: &Session, off: usize, flag: u8, looks: usize, deadline: Instant) -> Res<()> {
    let mut b = [0u8];
    let mut polls = 0u64;
    loop {
        for _ in 0..looks {
            s.buf.read(off, &mut b).map_err(|e| e.to_string())?;
            if b[0] == flag {
                return Ok(());
            }
            // Between looks at memory another core writes, a pause keeps the look from
            // costing the writer (without it an 8 B shared-memory WRITE ping-pong here takes
            // 4x as long). Between CQ polls, each a system call, it would only add ~25 ns.
            if looks > 1 {
                std::hint::spin_loop();
            }
        }
        poll_while_waiting(s, &mut polls, deadline)?;
    }
}

/// `wait_flag`'s CQ poll (for an error completion) and deadline, out of line: the loop that
/// looks at the flag stays a few instructions, and the code after it follows it closely.
#[inline(never)]
fn poll_while_waiting(s: &Session, polls: &mut u64, deadline: Instant) -> Res<()> {
    if let Some(wc) = s.cq.poll_one().map_err(|e| e.to_string())? {
        check_wc(&wc)?;
    }
    *polls += 1;
    if *polls % POLLS_PER_CLOCK_READ == 0 && Instant::now() > deadline {
        return Err("the peer stopped answering".into());
    }
    Ok(())
}

/// How many CQ polls `wait_flag` makes between two looks at the clock (for its deadline).
const POLLS_PER_CLOCK_READ: u64 = 16;

/// Polls until a receive completion arrives.
fn wait_recv(s: &Session, deadline: Instant) -> Res<WorkCompletion> {
    loop {
        if let Some(wc) = s.cq.poll_one().map_err(|e| e.to_string())? {
            check_wc(&wc)?;
            if wc.opcode == WcOpcode::Recv {
                return Ok(wc);
            }
        } else if Instant::now() > deadline {
            return Err("the peer stopped answering".into());
        }
    }
}

fn wait_send(s: &Session, deadline: Instant) -> Res<WorkCompletion> {
    loop {
        if let Some(wc) = s.cq.poll_one().map_err(|e| e.to_string())? {
            check_wc(&wc)?;
            if wc.opcode != WcOpcode::Recv {
                return Ok(wc);
            }
        } else if Instant::now() > deadline {
            return Err("the peer stopped answering".into());
        }
    }
}

fn verify_bytes(s: &Session, off: usize, expected: &[u8], what: &str) -> Res<()> {
    let got = s
        .buf
        .to_vec(off, expected.len())
        .map_err(|e| e.to_string())?;
    match got.iter().zip(expected).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "verification failed: {what}: byte {i} is {:#04x}, expected {:#04x}",
            got[i], expected[i]
        )),
    }
}

/// How often `wait_flag` reads the flag byte between two CQ polls over shared memory.
const FLAG_LOOKS_PER_POLL_SHM: usize = 256;

fn flag_of(i: u64) -> u8 {
    (i % 250) as u8 + 1
}

/// The server's side of every size.
fn serve(args: &PerfArgs, listener: &Listener) -> Res<()> {
    let mut s = setup(args, Some(listener), None)?;
    let t = args.timeout();
    for size in args.sizes() {
        let iters = args.iters_for(size);
        let len = size as usize;
        // Prepare: data to be read or sent back, a zeroed counter, posted receives.
        let data = pattern(size, len);
        for q in 0..s.qps.len() {
            s.buf
                .write(s.send_off(q), &data)
                .map_err(|e| e.to_string())?;
            s.buf
                .fill(s.recv_off(q), len, 0)
                .map_err(|e| e.to_string())?;
        }
        s.buf
            .write_u64(s.counter_off(), 0)
            .map_err(|e| e.to_string())?;
        let recvs = match args.test {
            Test::SendLat => 1,
            Test::SendBw => iters.min(512),
            _ => 0,
        };
        for (q, qp) in s.qps.iter().enumerate() {
            for _ in 0..recvs {
                qp.post_recv(RecvWr {
                    wr_id: q as u64,
                    sgl: sge(&s, s.recv_off(q), size)?,
                })
                .map_err(|e| e.to_string())?;
            }
        }
        s.sync(t)?;
        let deadline = Instant::now() + t + Duration::from_millis(iters / 10);
        match args.test {
            Test::WriteLat => {
                let mut wr = SendWr::new(0, SendOp::Write, sge(&s, s.send_off(0), size)?)
                    .remote(s.remote_addr(s.recv_off(0)), s.remote.rkey)
                    .flags(unsignaled());
                let looks = flag_looks(&s);
                // One thread posts: the sender may skip the QP's lock (see `QpSender`).
                let mut tx = s.qps[0].sender();
                let mut tail = FlagWord::new(&s, s.send_off(0), len)?;
                for i in 0..iters {
                    let flag = flag_of(i);
                    wait_flag(&s, s.recv_off(0) + len - 1, flag, looks, deadline)?;
                    tail.set(&s, flag)?;
                    wr.wr_id = i;
                    tx.post_send(&wr).map_err(|e| e.to_string())?;
                }
                if args.verify {
                    verify_bytes(
                        &s,
                        s.recv_off(0),
                        &data[..len - 1],
                        "WRITE data at the server",
                    )?;
                }
            }
            Test::SendLat => {
                for i in 0..iters {
                    wait_recv(&s, deadline)?;
                    s.qps[0]
                        .post_recv(RecvWr {
                            wr_id: 0,
                            sgl: sge(&s, s.recv_off(0), size)?,
                        })
                        .map_err(|e| e.to_string())?;
                    let wr = SendWr::new(i, SendOp::Send, sge(&s, s.send_off(0), size)?)
                        .flags(unsignaled());
                    s.qps[0].post_send(wr).map_err(|e| e.to_string())?;
                }
                if args.verify {
                    verify_bytes(&s, s.recv_off(0), &data, "SEND data at the server")?;
                }
            }
            Test::SendBw => {
                let total = iters * s.qps.len() as u64;
                let mut got = 0;
                let mut wcs = vec![ferroce::empty_wc(); 64];
                while got < total {
                    let n = s.cq.poll(&mut wcs).map_err(|e| e.to_string())?;
                    for wc in &wcs[..n] {
                        check_wc(wc)?;
                        if wc.opcode == WcOpcode::Recv {
                            got += 1;
                            let q = wc.wr_id as usize;
                            if got + (recvs * s.qps.len() as u64)
                                <= total + recvs * s.qps.len() as u64
                            {
                                s.qps[q]
                                    .post_recv(RecvWr {
                                        wr_id: q as u64,
                                        sgl: sge(&s, s.recv_off(q), size)?,
                                    })
                                    .map_err(|e| e.to_string())?;
                            }
                        }
                    }
                    if n == 0 && Instant::now() > deadline {
                        return Err(format!("send_bw: {got} of {total} messages arrived"));
                    }
                }
                if args.verify {
                    for q in 0..s.qps.len() {
                        verify_bytes(&s, s.recv_off(q), &data, "SEND data at the server")?;
                    }
                }
            }
            // One-sided tests: the server does nothing; its engine serves the client.
            _ => {}
        }
        s.sync(t + Duration::from_secs(iters / 1000 + 60))?;
        if args.verify {
            match args.test {
                Test::WriteBw => {
                    for q in 0..s.qps.len() {
                        verify_bytes(&s, s.recv_off(q), &data, "WRITE data at the server")?;
                    }
                }
                Test::AtomicLat | Test::AtomicBw => {
                    let v = s.buf.read_u64(s.counter_off()).map_err(|e| e.to_string())?;
                    let want = iters * s.qps.len() as u64;
                    if v != want {
                        return Err(format!(
                            "verification failed: the counter is {v} after {want} FETCH_ADDs of 1"
                        ));
                    }
                }
                _ => {}
            }
        }
        // Receives left over (send tests) are flushed when the QPs go away.
        s.sync(t)?;
    }
    Ok(())
}

/// The client's side: runs every size and prints the results.
fn client(args: &PerfArgs, server: SocketAddr) -> Res<ExitCode> {
    let mut s = setup(args, None, Some(server))?;
    let t = args.timeout();
    if args.pingpong_style {
        let (l, p) = (&s.local[0], &s.conn.peer);
        println!(
            "  local address:  LID 0x0000, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
            l.qpn,
            l.psn.value(),
            l.gid
        );
        println!(
            "  remote address: LID 0x0000, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
            p.qpn,
            p.psn.value(),
            p.gid
        );
    } else if !args.json {
        print_banner(args, &s);
    }
    let mut header_done = false;
    for size in args.sizes() {
        let iters = args.iters_for(size);
        let len = size as usize;
        let data = pattern(size, len);
        for q in 0..s.qps.len() {
            s.buf
                .write(s.send_off(q), &data)
                .map_err(|e| e.to_string())?;
            s.buf
                .fill(s.recv_off(q), len, 0)
                .map_err(|e| e.to_string())?;
        }
        if args.test == Test::SendLat {
            s.qps[0]
                .post_recv(RecvWr {
                    wr_id: 0,
                    sgl: sge(&s, s.recv_off(0), size)?,
                })
                .map_err(|e| e.to_string())?;
        }
        s.sync(t)?;
        let deadline = Instant::now() + t + Duration::from_millis(iters / 10);
        let line = if args.pingpong_style {
            let t0 = Instant::now();
            lat_round(args, &s, size, iters, deadline)?;
            let secs = t0.elapsed().as_secs_f64();
            let bytes = size * iters * 2;
            format!(
                "{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec\n{iters} iters in {secs:.2} seconds = {:.2} usec/iter",
                bytes as f64 * 8.0 / secs / 1e6,
                secs * 1e6 / iters as f64
            )
        } else if args.test.is_lat() {
            let mut samples = lat_round(args, &s, size, iters, deadline)?;
            let divisor = if matches!(args.test, Test::WriteLat | Test::SendLat) {
                2.0
            } else {
                1.0
            };
            let st = LatStats::from_samples(size, &mut samples, divisor);
            if args.json {
                st.json().to_string()
            } else {
                st.line()
            }
        } else {
            let times = bw_round(args, &s, size, iters, deadline)?;
            let st =
                BwStats::from_completions(if args.test.is_atomic() { 8 } else { size }, &times);
            if args.json {
                st.json().to_string()
            } else {
                st.line()
            }
        };
        if args.verify {
            match args.test {
                Test::WriteLat => verify_bytes(
                    &s,
                    s.recv_off(0),
                    &data[..len - 1],
                    "WRITE data at the client",
                )?,
                Test::SendLat => verify_bytes(&s, s.recv_off(0), &data, "SEND data at the client")?,
                Test::ReadLat | Test::ReadBw => {
                    for q in 0..s.qps.len() {
                        verify_bytes(&s, s.recv_off(q), &data, "READ data at the client")?;
                    }
                }
                _ => {}
            }
        }
        s.sync(t + Duration::from_secs(iters / 1000 + 60))?;
        s.sync(t)?;
        if !args.json && !header_done && !args.pingpong_style {
            println!(
                "{}",
                if args.test.is_lat() {
                    LatStats::HEADER
                } else {
                    BwStats::HEADER
                }
            );
            header_done = true;
        }
        println!("{line}");
    }
    if !args.json && !args.pingpong_style {
        println!("---------------------------------------------------------------------------------------");
    }
    if args.counters {
        print_counters(args, &s);
    }
    Ok(ExitCode::SUCCESS)
}

/// The client's side of the WRITE ping-pong: set the flag, post, read the clock, wait for the
/// answer. Its own loop, apart from the other latency tests: on shared memory the path from
/// seeing the peer's flag to the store of the next WRITE is the whole of what this test
/// measures beyond the line crossing, and every instruction on it (the other tests' arms and
/// their bookkeeping included) is on it once per half round trip.
fn write_lat_round(s: &Session, size: u64, iters: u64, deadline: Instant) -> Res<Vec<u64>> {
    let len = size as usize;
    let mut wr = SendWr::new(0, SendOp::Write, sge(s, s.send_off(0), size)?)
        .remote(s.remote_addr(s.recv_off(0)), s.remote.rkey)
        .flags(unsignaled());
    let looks = flag_looks(s);
    let flag_off = s.recv_off(0) + len - 1;
    let mut tx = s.qps[0].sender();
    let mut tail = FlagWord::new(s, s.send_off(0), len)?;
    let mut laps = Laps::new(iters, false);
    for i in 0..iters {
        let flag = flag_of(i);
        tail.set(s, flag)?;
        wr.wr_id = i;
        tx.post_send(&wr).map_err(|e| e.to_string())?;
        laps.lap();
        wait_flag(s, flag_off, flag, looks, deadline)?;
    }
    laps.lap();
    Ok(laps.samples)
}

/// A latency test's samples: the times between consecutive clock reads, one read per
/// iteration. In the ping-pong tests (WRITE, SEND) the read comes right after the post, while
/// the message is on its way and this side would only wait: each interval is still one whole
/// round trip, but reading the clock is not on the path the peer waits for. (The last interval
/// ends when the last answer arrives, without a post: one sample in `iters`.) The other tests
/// read the clock before the first post and after each completion.
struct Laps {
    last: Option<Instant>,
    samples: Vec<u64>,
}

impl Laps {
    /// Room for `iters` samples, already in memory; the first interval starts now if
    /// `start_now`, else at the first `lap`.
    fn new(iters: u64, start_now: bool) -> Laps {
        // Written once before the clock starts: a fresh allocation's pages are only mapped at
        // their first store, and a page fault every 512 samples would land in the samples.
        // (Not with zeros: zeroed memory is asked for as such and comes as untouched pages.)
        let mut samples = vec![u64::MAX; iters as usize];
        samples.clear();
        Laps {
            last: start_now.then(Instant::now),
            samples,
        }
    }

    /// Reads the clock, ending the interval under way (if any) and starting the next.
    fn lap(&mut self) {
        let t = Instant::now();
        if let Some(l) = self.last.replace(t) {
            self.samples.push((t - l).as_nanos() as u64);
        }
    }
}

fn lat_round(
    args: &PerfArgs,
    s: &Session,
    size: u64,
    iters: u64,
    deadline: Instant,
) -> Res<Vec<u64>> {
    let qp = &s.qps[0];
    let mut last_orig = None;
    // Each test posts the same request every iteration, built once (as perftest does): a post
    // then allocates nothing.
    let mut wr = match args.test {
        Test::WriteLat => return write_lat_round(s, size, iters, deadline),
        Test::SendLat => {
            SendWr::new(0, SendOp::Send, sge(s, s.send_off(0), size)?).flags(unsignaled())
        }
        Test::ReadLat => SendWr::new(0, SendOp::Read, sge(s, s.recv_off(0), size)?)
            .remote(s.remote_addr(s.send_off(0)), s.remote.rkey),
        Test::AtomicLat => SendWr::new(0, SendOp::FetchAdd { add: 1 }, sge(s, s.recv_off(0), 8)?)
            .remote(s.remote_addr(s.counter_off()), s.remote.rkey),
        _ => return Err(format!("{} is not a latency test", test_name(args.test))),
    };
    let mut tx = qp.sender();
    let ping_pong = matches!(args.test, Test::SendLat);
    let mut laps = Laps::new(iters, !ping_pong);
    for i in 0..iters {
        wr.wr_id = i;
        tx.post_send(&wr).map_err(|e| e.to_string())?;
        if ping_pong {
            laps.lap();
            wait_recv(s, deadline)?;
            qp.post_recv(RecvWr {
                wr_id: 0,
                sgl: sge(s, s.recv_off(0), size)?,
            })
            .map_err(|e| e.to_string())?;
            continue;
        }
        wait_send(s, deadline)?;
        if args.verify && matches!(args.test, Test::AtomicLat) {
            let orig = s.buf.read_u64(s.recv_off(0)).map_err(|e| e.to_string())?;
            if orig != i || last_orig.is_some_and(|p| p + 1 != orig) {
                return Err(format!(
                    "verification failed: FETCH_ADD {i} returned {orig}"
                ));
            }
            last_orig = Some(orig);
        }
        laps.lap();
    }
    if ping_pong {
        laps.lap();
    }
    Ok(laps.samples)
}

fn bw_round(
    args: &PerfArgs,
    s: &Session,
    size: u64,
    iters: u64,
    deadline: Instant,
) -> Res<Vec<u64>> {
    let nq = s.qps.len();
    let total = iters * nq as u64;
    let depth = u64::from(args.tx_depth);
    let (mut posted, mut done) = (0u64, 0u64);
    let mut times = Vec::with_capacity(total as usize);
    let mut wcs = vec![ferroce::empty_wc(); 64];
    let t0 = Instant::now();
    let wr_for = |n: u64| -> Res<(usize, SendWr)> {
        let q = (n % nq as u64) as usize;
        let wr = match args.test {
            Test::WriteBw => SendWr::new(n, SendOp::Write, sge(s, s.send_off(q), size)?)
                .remote(s.remote_addr(s.recv_off(q)), s.remote.rkey),
            Test::ReadBw => SendWr::new(n, SendOp::Read, sge(s, s.recv_off(q), size)?)
                .remote(s.remote_addr(s.send_off(q)), s.remote.rkey),
            Test::SendBw => SendWr::new(n, SendOp::Send, sge(s, s.send_off(q), size)?),
            _ => SendWr::new(n, SendOp::FetchAdd { add: 1 }, sge(s, s.recv_off(q), 8)?)
                .remote(s.remote_addr(s.counter_off()), s.remote.rkey),
        };
        Ok((q, wr))
    };
    while done < total {
        // Post up to the window, in one doorbell per QP.
        let room = (depth - (posted - done)).min(total - posted);
        if room > 0 {
            let mut per_qp: Vec<Vec<SendWr>> = vec![Vec::new(); nq];
            for _ in 0..room {
                let (q, wr) = wr_for(posted)?;
                per_qp[q].push(wr);
                posted += 1;
            }
            for (q, wrs) in per_qp.into_iter().enumerate() {
                if !wrs.is_empty() {
                    s.qps[q].post_send_batch(wrs).map_err(|e| e.to_string())?;
                }
            }
        }
        let n = s.cq.poll(&mut wcs).map_err(|e| e.to_string())?;
        let now = t0.elapsed().as_nanos() as u64;
        for wc in &wcs[..n] {
            check_wc(wc)?;
            done += 1;
            times.push(now);
        }
        if n == 0 && Instant::now() > deadline + Duration::from_secs(size * total / (50 << 20)) {
            return Err(format!(
                "{} of {total} operations completed before the timeout",
                done
            ));
        }
    }
    Ok(times)
}

fn print_banner(args: &PerfArgs, s: &Session) {
    let bar =
        "---------------------------------------------------------------------------------------";
    println!("{bar}");
    println!("                    {}", args.test.title());
    println!(" Device          : {}", s.ctx.device().name());
    let transport = match s.qps.first().map(|q| q.provider()) {
        Some(ferroce::Provider::Shm) => "shared memory (ferroce)",
        _ => "RoCE v2 over UDP (ferroce)",
    };
    println!(
        " Number of qps   : {:<12} Transport type : {transport}",
        s.qps.len()
    );
    println!(" Connection type : RC",);
    println!(" Mtu             : {}[B]", s.mtu.bytes());
    if !args.test.is_lat() {
        println!(" TX depth        : {}", args.tx_depth);
    }
    for (l, p) in s.local.iter().zip(&s.conn.peers).take(4) {
        println!(
            " local address:  QPN 0x{:06x} PSN 0x{:06x} GID {} UDP port {}",
            l.qpn,
            l.psn.value(),
            l.gid,
            l.udp_port
        );
        println!(
            " remote address: QPN 0x{:06x} PSN 0x{:06x} GID {} UDP port {}",
            p.qpn,
            p.psn.value(),
            p.gid,
            p.udp_port
        );
    }
    println!("{bar}");
}

fn print_counters(args: &PerfArgs, s: &Session) {
    // The context's view: its packet path plus every QP's transport counters summed.
    let named = s.ctx.counters().named();
    if args.json {
        let map: serde_json::Map<String, serde_json::Value> = named
            .iter()
            .map(|&(k, v)| (k.to_string(), v.into()))
            .collect();
        println!("{}", serde_json::json!({ "counters": map }));
    } else {
        println!(" Counters (this side):");
        for (k, v) in named {
            println!("   {k:<28} {v}");
        }
    }
}
