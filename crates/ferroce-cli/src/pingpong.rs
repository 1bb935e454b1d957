//! `ferroce pingpong`: a peer of rdma-core's `ibv_rc_pingpong`, in either role.
//!
//! It speaks the tool's TCP exchange and keeps its defaults, so either side can be the real
//! `ibv_rc_pingpong` (on Linux rxe or a RoCE NIC) and the other ferroce:
//! - **Exchange** (TCP port 18515): the client writes its 52-byte address message
//!   `"LLLL:QQQQQQ:PPPPPP:<32 hex GID>\0"` (LID, QPN, PSN, GID bytes in network order), the
//!   server reads it, brings its QP to RTS, answers with its own, and the client ends with
//!   `"done\0"`. Each message goes in one write; each is read whole.
//! - **QP**: RC, path MTU `-m` (1024), receives posted before the exchange (`-r`, 500), INIT
//!   with no remote access, RTR with `max_dest_rd_atomic` 1 and `min_rnr_timer` 12, RTS with
//!   timeout 14, retry 7, RNR retry 7, `max_rd_atomic` 1. The peer is reached at its GID's
//!   address, on the RoCE v2 port 4791 (the exchange carries no port).
//! - **Data**: `-n` (1000) SENDs of `-s` (4096) bytes each way, strict ping-pong, client first;
//!   receives land in the one buffer sends go from, so the server echoes what it got.
//! - **Output**: the address lines and `"N bytes in S seconds = R Mbit/sec"`,
//!   `"N iters in S seconds = U usec/iter"`, as the tool prints them.
//!
//! Beyond the tool: `--verify` makes a client fill each message with its own pattern and check
//! every echo byte for byte (the real server echoes, so this checks a real peer's data path);
//! `--loopback` runs both sides in one process (each on its own UDP port, which the exchange
//! cannot carry, so the two learn each other's port in-process); `--timeout` ends a run whose
//! peer stopped answering, where the tool would wait forever.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Args;
use ferroce::{
    Access, CompletionChannel, CompletionQueue, Context, ContextOptions, Device, InitAttr,
    MemoryRegion, PathMtu, ProtectionDomain, Psn, QpCaps, QpInitAttr, QueuePair, RecvWr, RtrAttr,
    RtsAttr, SendOp, SendWr, WcStatus,
};

use crate::route;

type Res<T> = Result<T, String>;

/// The address message: `"%04x:%06x:%06x:%s"` with a 32-character GID, and its NUL.
const MSG_LEN: usize = 52;
/// What the client writes last.
const DONE: &[u8; 5] = b"done\0";
const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
const PAGE: usize = 4096;

/// Arguments of `ferroce pingpong` (ibv_rc_pingpong's, and a few of ferroce's own).
#[derive(Debug, Clone, Args)]
pub struct PingpongArgs {
    /// The server to connect to (omit to be the server).
    host: Option<String>,
    /// TCP port of the exchange.
    #[arg(long, short = 'p', default_value_t = 18515)]
    port: u16,
    /// Device (as `ferroce devices` lists it; default: the one holding the route to HOST, or
    /// the first with an IPv4 address for a server).
    #[arg(long = "ib-dev", short = 'd')]
    device: Option<String>,
    /// Port of the device (ferroce devices have one).
    #[arg(long = "ib-port", short = 'i', default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=1))]
    ib_port: u8,
    /// Bytes per message.
    #[arg(long, short = 's', default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=(1 << 30)))]
    size: u64,
    /// Path MTU: 256, 512, 1024, 2048 or 4096.
    #[arg(long, short = 'm', default_value_t = 1024)]
    mtu: u32,
    /// Receives posted at once.
    #[arg(long = "rx-depth", short = 'r', default_value_t = 500, value_parser = clap::value_parser!(u32).range(2..=16384))]
    rx_depth: u32,
    /// Messages each way.
    #[arg(long, short = 'n', default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    iters: u64,
    /// Service level (RoCE v2 carries none; accepted for the tool's command lines).
    #[arg(long, short = 'l', default_value_t = 0)]
    sl: u8,
    /// Sleep on completion events instead of polling.
    #[arg(long, short = 'e')]
    events: bool,
    /// GID index of the local device (ferroce's GID tables hold RoCE v2 GIDs only; default 0).
    #[arg(long = "gid-idx", short = 'g')]
    gid_index: Option<usize>,
    /// Validate the buffer as the tool does: the client zeroes the first byte of each page, the
    /// server checks those bytes after the run.
    #[arg(long, short = 'c')]
    chk: bool,
    /// ferroce: fill each message with its own pattern and check every echo byte for byte
    /// (client side).
    #[arg(long)]
    verify: bool,
    /// ferroce: print this side's context counters after the run (rxe's names where rxe has
    /// the counter).
    #[arg(long)]
    counters: bool,
    /// ferroce: both sides in this process, on loopback.
    #[arg(long)]
    loopback: bool,
    /// ferroce: the UDP port of this side's RoCE socket and of the peer's (RoCE v2: 4791).
    #[arg(long, default_value_t = ferroce_wire::ROCE_V2_UDP_PORT)]
    roce_port: u16,
    /// ferroce: seconds without progress after which the run fails (the tool waits forever).
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

/// One side's address, as the exchange carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dest {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: Ipv6Addr,
}

impl Dest {
    fn encode(&self) -> [u8; MSG_LEN] {
        let gid: String = self
            .gid
            .octets()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let text = format!(
            "{:04x}:{:06x}:{:06x}:{gid}",
            self.lid,
            self.qpn & 0xff_ffff,
            self.psn & 0xff_ffff
        );
        let mut m = [0u8; MSG_LEN];
        m[..text.len()].copy_from_slice(text.as_bytes());
        m
    }

    /// Parses a message as the tool does (`%x:%x:%x:%s`, then 32 hex digits of GID); says
    /// which field is wrong otherwise.
    fn decode(m: &[u8]) -> Res<Dest> {
        let end = m.iter().position(|&b| b == 0).unwrap_or(m.len());
        let text = std::str::from_utf8(&m[..end])
            .map_err(|_| "the peer's address message is not text: is it ibv_rc_pingpong?")?;
        let bad = |what: &str| format!("the peer's address message {text:?}: bad {what}");
        let mut f = text.split(':');
        let mut hex = |what: &str, max: u32| -> Res<u32> {
            f.next()
                .and_then(|v| u32::from_str_radix(v, 16).ok())
                .filter(|&v| v <= max)
                .ok_or_else(|| bad(what))
        };
        let lid = hex("LID", 0xffff)? as u16;
        let qpn = hex("QPN", 0xff_ffff)?;
        let psn = hex("PSN", 0xff_ffff)?;
        let g = f
            .next()
            .filter(|g| g.len() == 32 && g.is_ascii())
            .ok_or_else(|| bad("GID"))?;
        let mut octets = [0u8; 16];
        for (i, o) in octets.iter_mut().enumerate() {
            *o = u8::from_str_radix(&g[2 * i..2 * i + 2], 16).map_err(|_| bad("GID"))?;
        }
        Ok(Dest {
            lid,
            qpn,
            psn,
            gid: Ipv6Addr::from(octets),
        })
    }

    /// The tool's line for this address: `which` is `"local address: "` or
    /// `"remote address:"`.
    fn print(&self, which: &str) {
        println!(
            "  {which} LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
            self.lid, self.qpn, self.psn, self.gid
        );
    }
}

/// One side's verbs objects.
struct Side {
    ctx: Context,
    _pd: ProtectionDomain,
    channel: Option<CompletionChannel>,
    cq: CompletionQueue,
    qp: QueuePair,
    buf: MemoryRegion,
    me: Dest,
}

fn s<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

fn psn_seed() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (t.wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 40) as u32 & 0xff_ffff
}

/// Opens the device, makes the objects the tool makes, and posts the receives (before the
/// exchange, as the tool does: the peer may SEND as soon as it is connected).
/// `-g` chooses the GID, else the one of the address the peer is reached by (`gid_index`).
fn open_side(a: &PingpongArgs, device: &Device, gid_index: usize, roce_port: u16) -> Res<Side> {
    let gid_index = a.gid_index.unwrap_or(gid_index);
    let ctx = device
        .open(&ContextOptions {
            gid_index,
            port: roce_port,
            // The tool's peer is whatever is at the GID: no same-host shortcut.
            provider: ferroce::Provider::Udp,
            ..ContextOptions::default()
        })
        .map_err(s("opening the device"))?;
    let pd = ctx.alloc_pd().map_err(s("allocating a PD"))?;
    let channel = if a.events {
        Some(
            ctx.create_comp_channel()
                .map_err(s("creating a completion channel"))?,
        )
    } else {
        None
    };
    let cq = ctx
        .create_cq(a.rx_depth as usize + 1, channel.as_ref())
        .map_err(s("creating the CQ"))?;
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: a.rx_depth,
        ..QpCaps::default()
    };
    let qp = pd
        .create_qp(&QpInitAttr::new(&cq, caps))
        .map_err(s("creating the QP"))?;
    qp.modify_to_init(&InitAttr {
        access: Access::LOCAL_WRITE,
        ..InitAttr::default()
    })
    .map_err(s("moving the QP to INIT"))?;
    let buf = pd
        .alloc_mr(a.size as usize, Access::LOCAL_WRITE)
        .map_err(s("registering the buffer"))?;
    buf.fill(0, a.size as usize, 0x7b)
        .map_err(s("filling the buffer"))?;
    if a.events {
        cq.req_notify(false).map_err(s("arming the CQ"))?;
    }
    let me = Dest {
        lid: 0,
        qpn: qp.qpn(),
        psn: psn_seed(),
        gid: ctx.gid(),
    };
    let side = Side {
        ctx,
        _pd: pd,
        channel,
        cq,
        qp,
        buf,
        me,
    };
    for _ in 0..a.rx_depth {
        post_recv(&side, a.size)?;
    }
    Ok(side)
}

fn post_recv(side: &Side, size: u64) -> Res<()> {
    side.qp
        .post_recv(RecvWr {
            wr_id: RECV_WRID,
            sgl: vec![side.buf.sge(0, size as usize).map_err(|e| e.to_string())?],
        })
        .map_err(s("posting a receive"))
}

fn post_send(side: &Side, size: u64) -> Res<()> {
    let wr = SendWr::new(
        SEND_WRID,
        SendOp::Send,
        vec![side.buf.sge(0, size as usize).map_err(|e| e.to_string())?],
    );
    side.qp.post_send(wr).map_err(s("posting a send"))
}

/// RTR and RTS with the tool's attributes, towards `peer` at `peer_port`.
fn connect_qp(a: &PingpongArgs, side: &Side, peer: &Dest, peer_port: u16) -> Res<()> {
    if peer.gid.octets()[8..] == [0u8; 8] {
        return Err(format!(
            "the peer sent GID {}: RoCE needs its GID (run ibv_rc_pingpong with -g <index of its RoCE v2 IPv4 GID>)",
            peer.gid
        ));
    }
    let path_mtu = PathMtu::from_bytes(a.mtu).map_err(|e| e.to_string())?;
    let rtr = RtrAttr {
        path_mtu,
        dest_qpn: peer.qpn,
        dest_gid: peer.gid,
        rq_psn: Psn::new(peer.psn),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
    };
    side.qp
        .modify_to_rtr_with_port(&rtr, peer_port)
        .map_err(s("moving the QP to RTR"))?;
    let rts = RtsAttr {
        sq_psn: Psn::new(side.me.psn),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
    };
    side.qp
        .modify_to_rts(&rts)
        .map_err(s("moving the QP to RTS"))
}

fn read_exact(stream: &mut TcpStream, buf: &mut [u8], what: &str) -> Res<()> {
    stream
        .read_exact(buf)
        .map_err(|e| format!("reading the peer's {what}: {e}"))
}

/// The client's exchange: its address, the server's, then "done".
fn client_exchange(server: SocketAddr, me: &Dest, deadline: Instant) -> Res<Dest> {
    // The tool does not retry; a peer started a moment later is still worth waiting for.
    let mut stream = loop {
        match TcpStream::connect_timeout(&server, Duration::from_secs(1)) {
            Ok(st) => break st,
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("Couldn't connect to {server}: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_secs(1));
    let _ = stream.set_read_timeout(Some(left));
    stream
        .write_all(&me.encode())
        .map_err(s("sending the local address"))?;
    let mut m = [0u8; MSG_LEN];
    read_exact(&mut stream, &mut m, "address")?;
    let peer = Dest::decode(&m)?;
    stream.write_all(DONE).map_err(s("sending done"))?;
    Ok(peer)
}

/// The server's exchange: the client's address, then (once `ready` connected the QP) its own,
/// then the client's "done".
fn server_exchange(
    mut stream: TcpStream,
    me: &Dest,
    ready: impl FnOnce(&Dest) -> Res<()>,
    timeout: Duration,
) -> Res<Dest> {
    let _ = stream.set_read_timeout(Some(timeout));
    let mut m = [0u8; MSG_LEN];
    read_exact(&mut stream, &mut m, "address")?;
    let peer = Dest::decode(&m)?;
    // The QP is at RTS before the answer leaves: the client may SEND as soon as it has it.
    ready(&peer)?;
    stream
        .write_all(&me.encode())
        .map_err(s("sending the local address"))?;
    let mut done = [0u8; DONE.len()];
    read_exact(&mut stream, &mut done, "done")?;
    if &done != DONE {
        return Err(format!(
            "the client ended the exchange with {done:?}, not \"done\""
        ));
    }
    Ok(peer)
}

/// The pattern of message `i` under `--verify`: a different byte string per message, with
/// the first byte of each page 0 so that `-c` on either side still holds.
fn pattern(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| {
            if k % PAGE == 0 {
                0
            } else {
                (k as u64)
                    .wrapping_mul(31)
                    .wrapping_add(i.wrapping_mul(131)) as u8
                    | 1
            }
        })
        .collect()
}

/// The ping-pong itself; returns the elapsed time.
fn run_loop(a: &PingpongArgs, side: &Side, client: bool) -> Res<Duration> {
    let len = a.size as usize;
    let stall = Duration::from_secs(a.timeout.max(1));
    let (mut rcnt, mut scnt) = (0u64, 0u64);
    let mut routs = a.rx_depth as u64;
    let mut pending = RECV_WRID;
    let start = Instant::now();
    if client {
        if a.chk && !a.verify {
            for page in (0..len).step_by(PAGE) {
                side.buf.write(page, &[0]).map_err(|e| e.to_string())?;
            }
        }
        if a.verify {
            side.buf
                .write(0, &pattern(0, len))
                .map_err(|e| e.to_string())?;
        }
        post_send(side, a.size)?;
        pending |= SEND_WRID;
    }
    let mut last_progress = Instant::now();
    while rcnt < a.iters || scnt < a.iters {
        let wcs = match &side.channel {
            Some(ch) => {
                if ch
                    .get_event(Some(Duration::from_millis(100)))
                    .map_err(s("waiting for a completion event"))?
                {
                    side.cq.req_notify(false).map_err(s("arming the CQ"))?;
                }
                drain(&side.cq)?
            }
            None => {
                let mut w = drain(&side.cq)?;
                let t0 = Instant::now();
                while w.is_empty() && t0.elapsed() < Duration::from_millis(100) {
                    std::hint::spin_loop();
                    w = drain(&side.cq)?;
                }
                w
            }
        };
        if wcs.is_empty() && last_progress.elapsed() > stall {
            return Err(format!(
                "no completion for {stall:?} ({rcnt} received, {scnt} sent): the peer stopped answering"
            ));
        }
        if !wcs.is_empty() {
            last_progress = Instant::now();
        }
        for wc in wcs {
            if wc.status != WcStatus::Success {
                return Err(format!(
                    "Failed status {} for wr_id {}",
                    wc.status, wc.wr_id
                ));
            }
            match wc.wr_id {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    rcnt += 1;
                    routs -= 1;
                    if routs <= 1 {
                        for _ in routs..u64::from(a.rx_depth) {
                            post_recv(side, a.size)?;
                        }
                        routs = u64::from(a.rx_depth);
                    }
                    if client && a.verify {
                        let got = side.buf.to_vec(0, len).map_err(|e| e.to_string())?;
                        if got != pattern(rcnt - 1, len) {
                            let at = got
                                .iter()
                                .zip(pattern(rcnt - 1, len))
                                .position(|(g, w)| *g != w)
                                .unwrap_or(0);
                            return Err(format!(
                                "message {rcnt} came back different from what was sent (first at byte {at})"
                            ));
                        }
                    }
                }
                other => return Err(format!("Completion for unknown wr_id {other}")),
            }
            pending &= !wc.wr_id;
            if scnt < a.iters && pending == 0 {
                if client && a.verify {
                    side.buf
                        .write(0, &pattern(scnt, len))
                        .map_err(|e| e.to_string())?;
                }
                post_send(side, a.size)?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    Ok(start.elapsed())
}

/// Every completion waiting now (none: the engine was driven once).
fn drain(cq: &CompletionQueue) -> Res<Vec<ferroce::WorkCompletion>> {
    let mut buf = [ferroce::empty_wc(); 16];
    let n = cq.poll(&mut buf).map_err(s("polling the CQ"))?;
    Ok(buf[..n].to_vec())
}

fn print_counters(a: &PingpongArgs, side: &Side) {
    if a.counters {
        println!(" Counters (this side):");
        for (k, v) in side.ctx.counters().named() {
            println!("   {k:<28} {v}");
        }
    }
}

fn report(a: &PingpongArgs, elapsed: Duration) {
    let usec = elapsed.as_secs_f64() * 1e6;
    let bytes = a.size * a.iters * 2;
    println!(
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        a.iters,
        usec / 1e6,
        usec / a.iters as f64
    );
}

/// The server's check under `-c`: the first byte of every page is 0.
fn check_pages(a: &PingpongArgs, side: &Side) -> Res<()> {
    for (i, page) in (0..a.size as usize).step_by(PAGE).enumerate() {
        let b = side.buf.to_vec(page, 1).map_err(|e| e.to_string())?;
        if b[0] != 0 {
            return Err(format!("invalid data in page {i}"));
        }
    }
    Ok(())
}

/// Runs `ferroce pingpong`.
pub fn run(a: &PingpongArgs) -> Res<ExitCode> {
    PathMtu::from_bytes(a.mtu).map_err(|e| format!("-m {}: {e}", a.mtu))?;
    if a.loopback {
        return loopback(a);
    }
    let timeout = Duration::from_secs(a.timeout.max(1));
    match &a.host {
        Some(host) => {
            let server = (host.as_str(), a.port)
                .to_socket_addrs()
                .map_err(|e| format!("{host}: {e}"))?
                .find(|s| s.is_ipv4())
                .ok_or_else(|| format!("{host}: no IPv4 address"))?;
            let local_ip = route::source_for(server.ip())?;
            let (device, gid) = route::device_for(a.device.as_deref(), local_ip)?;
            let side = open_side(a, &device, gid, a.roce_port)?;
            let peer = client_exchange(server, &side.me, Instant::now() + timeout)?;
            connect_qp(a, &side, &peer, a.roce_port)?;
            side.me.print("local address: ");
            peer.print("remote address:");
            let elapsed = run_loop(a, &side, true)?;
            report(a, elapsed);
            print_counters(a, &side);
        }
        None => {
            let listener = TcpListener::bind((IpAddr::from([0u8; 4]), a.port))
                .map_err(|e| format!("listening on TCP port {}: {e}", a.port))?;
            let (stream, _) = listener.accept().map_err(s("accepting the client"))?;
            // The device is the one the client reached: its address is the GID to announce.
            // Receives are still posted before this side answers, as the tool does.
            let local_ip = stream.local_addr().map_err(|e| e.to_string())?.ip();
            let (device, gid) = route::device_for(a.device.as_deref(), local_ip)?;
            let side = open_side(a, &device, gid, a.roce_port)?;
            let peer = server_exchange(
                stream,
                &side.me,
                |p| connect_qp(a, &side, p, a.roce_port),
                timeout,
            )?;
            side.me.print("local address: ");
            peer.print("remote address:");
            let elapsed = run_loop(a, &side, false)?;
            if a.chk {
                check_pages(a, &side)?;
            }
            report(a, elapsed);
            print_counters(a, &side);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Both sides in one process on loopback, each context on a port of its own; the ports go
/// between the two in-process (the exchange itself is the tool's, over TCP).
fn loopback(a: &PingpongArgs) -> Res<ExitCode> {
    let lo = IpAddr::from([127, 0, 0, 1]);
    let (device, gid) = route::device_for(a.device.as_deref(), lo)?;
    let listener = TcpListener::bind((lo, 0)).map_err(|e| format!("listening on loopback: {e}"))?;
    let cm = listener.local_addr().map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs(a.timeout.max(1));
    let (to_server, from_client) = mpsc::channel::<u16>();
    let (to_client, from_server) = mpsc::channel::<u16>();
    let server_args = a.clone();
    let server_device = device.clone();
    let server = std::thread::spawn(move || -> Res<()> {
        let a = &server_args;
        let side = open_side(a, &server_device, gid, 0)?;
        to_client
            .send(side.ctx.local_addr().port())
            .map_err(|e| e.to_string())?;
        let client_port = from_client
            .recv_timeout(timeout)
            .map_err(|e| e.to_string())?;
        let (stream, _) = listener.accept().map_err(s("accepting the client"))?;
        server_exchange(
            stream,
            &side.me,
            |p| connect_qp(a, &side, p, client_port),
            timeout,
        )?;
        run_loop(a, &side, false)?;
        if a.chk {
            check_pages(a, &side)?;
        }
        Ok(())
    });
    let client = (|| -> Res<Duration> {
        let side = open_side(a, &device, gid, 0)?;
        to_server
            .send(side.ctx.local_addr().port())
            .map_err(|e| e.to_string())?;
        let server_port = from_server
            .recv_timeout(timeout)
            .map_err(|e| e.to_string())?;
        let peer = client_exchange(cm, &side.me, Instant::now() + timeout)?;
        connect_qp(a, &side, &peer, server_port)?;
        side.me.print("local address: ");
        peer.print("remote address:");
        run_loop(a, &side, true)
    })();
    let server = server
        .join()
        .map_err(|_| "the server side panicked".to_string())?;
    let elapsed = client?;
    server.map_err(|e| format!("server side: {e}"))?;
    report(a, elapsed);
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_message_is_the_tools() {
        let d = Dest {
            lid: 0,
            qpn: 0x11a,
            psn: 0x3f09c2,
            gid: "::ffff:192.168.1.10".parse().unwrap(),
        };
        let m = d.encode();
        assert_eq!(
            &m[..],
            b"0000:00011a:3f09c2:00000000000000000000ffffc0a8010a\0"
        );
        assert_eq!(Dest::decode(&m).unwrap(), d);
    }

    #[test]
    fn a_bad_field_is_named() {
        let e = Dest::decode(b"0000:zz011a:3f09c2:00000000000000000000ffffc0a8010a\0").unwrap_err();
        assert!(e.contains("bad QPN"), "{e}");
        let e =
            Dest::decode(b"0000:00011a:3f09c2:00000000000000000000ffffc0a801\0\0\0").unwrap_err();
        assert!(e.contains("bad GID"), "{e}");
        let e = Dest::decode(b"FRCE\x01\x01").unwrap_err();
        assert!(e.contains("bad LID") || e.contains("not text"), "{e}");
    }
}
