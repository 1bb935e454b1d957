//! `ferroce perf --perftest`: a peer of the real perftest tools (`ib_write_lat`, `ib_read_bw`,
//! ...) in either role, over RoCE v2.
//!
//! perftest's TCP conversation (4.5, Debian 12), client writing first in every step:
//! - **versions** (16 bytes, "6.06"), page size and cache line (4 + 4 bytes, big-endian), path
//!   MTU (2 bytes: the `ibv_mtu` code as a digit and a NUL); each side takes the larger page and
//!   line and the smaller MTU;
//! - **handshakes**: each side's 108-byte key message
//!   `"LLLL:OOOO:QQQQQQ:PPPPPP:RRRRRRRR:VVVVVVVVVVVVVVVV:gg:...:gg:SSSSSSSS:"` (LID, READ/atomic
//!   depth, QPN, PSN, rkey, address of the region the peer may use, 16 GID bytes, SRQ number),
//!   repeated as barriers at fixed points of each test;
//! - for unidirectional WRITE/READ/atomic bandwidth, the client's figures (size, iterations,
//!   peak, average, message rate: 5 × 8 bytes big-endian) go to the server, which prints them;
//! - a closing handshake and "done".
//!
//! The tests themselves follow perftest: `ib_write_lat` is a ping-pong of WRITEs whose last byte
//! counts iterations, polled in memory (the server writes first); READ and atomic latency are one
//! operation at a time from the client; SEND latency a ping-pong of SENDs (client first);
//! bandwidth tests keep `-t` (128) requests in flight from the client. Nothing about the test is
//! exchanged (perftest never checks that both sides run the same test, size or count): run both
//! sides with the same test and options, as with perftest itself.
//!
//! What ferroce cannot honour is refused before anything is sent: more than one QP, `-a`, and
//! an atomic size other than 8.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferroce::{
    Access, CompletionQueue, Context, ContextOptions, InitAttr, MemoryRegion, PathMtu, Psn, QpCaps,
    QpInitAttr, QueuePair, RecvWr, RtrAttr, RtsAttr, SendOp, SendWr, WcStatus,
};

use super::args::{AtomicType, PerfArgs, Test};
use super::report::{BwStats, LatStats};
use super::session::pick_device;
use super::Res;

/// The version this side announces: perftest 4.5's, so a 4.5 peer and a newer one alike keep
/// the conversation described above.
const VERSION: &str = "6.06";
const KEY_LEN: usize = 108;
const PAGE: u32 = 4096;
const CACHE_LINE: u32 = 64;
/// READ/atomic requests this side's responder serves at once (ferroce's limit).
const OUT_READS: u32 = 16;

/// One side's key message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    lid: u16,
    out_reads: u32,
    qpn: u32,
    psn: u32,
    rkey: u32,
    vaddr: u64,
    gid: Ipv6Addr,
    srqn: u32,
}

impl Key {
    fn encode(&self) -> [u8; KEY_LEN] {
        let mut t = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        for b in self.gid.octets() {
            t.push_str(&format!("{b:02x}:"));
        }
        t.push_str(&format!("{:08x}:", self.srqn));
        let mut m = [0u8; KEY_LEN];
        m[..t.len()].copy_from_slice(t.as_bytes());
        m
    }

    fn decode(m: &[u8]) -> Res<Key> {
        let end = m.iter().position(|&b| b == 0).unwrap_or(m.len());
        let text = std::str::from_utf8(&m[..end])
            .map_err(|_| "the peer's key message is not text: is it perftest 4.x?".to_string())?;
        let f: Vec<&str> = text.split(':').collect();
        // 6 fields, 16 GID bytes, the SRQ number, and what follows the last ':'.
        if f.len() != 24 {
            return Err(format!(
                "the peer's key message {text:?} has {} fields, not perftest's 23 (a peer without -x on InfiniBand?)",
                f.len().saturating_sub(1)
            ));
        }
        let hex = |i: usize, what: &str| -> Res<u64> {
            u64::from_str_radix(f[i], 16)
                .map_err(|_| format!("the peer's key message {text:?}: bad {what}"))
        };
        let mut gid = [0u8; 16];
        for (k, g) in gid.iter_mut().enumerate() {
            *g = hex(6 + k, "GID")? as u8;
        }
        Ok(Key {
            lid: hex(0, "LID")? as u16,
            out_reads: hex(1, "out_reads")? as u32,
            qpn: hex(2, "QPN")? as u32 & 0xff_ffff,
            psn: hex(3, "PSN")? as u32 & 0xff_ffff,
            rkey: hex(4, "rkey")? as u32,
            vaddr: hex(5, "address")?,
            gid: Ipv6Addr::from(gid),
            srqn: hex(22, "SRQ number")? as u32,
        })
    }
}

/// The TCP connection to the peer: every exchange has the client write first.
struct Link {
    stream: TcpStream,
    client: bool,
}

impl Link {
    fn xchg(&mut self, mine: &[u8], theirs: &mut [u8], what: &str) -> Res<()> {
        let io = |e: std::io::Error| format!("exchanging {what} with the peer: {e}");
        if self.client {
            self.stream.write_all(mine).map_err(io)?;
            self.stream.read_exact(theirs).map_err(io)?;
        } else {
            self.stream.read_exact(theirs).map_err(io)?;
            self.stream.write_all(mine).map_err(io)?;
        }
        Ok(())
    }

    /// One handshake: both keys, used as a barrier.
    fn hand_shake(&mut self, me: &Key) -> Res<Key> {
        let mut m = [0u8; KEY_LEN];
        self.xchg(&me.encode(), &mut m, "keys")?;
        Key::decode(&m)
    }

    /// perftest's closing: a handshake, then "done" (written, and read if the peer sends one).
    /// perftest 4.5 writes its "done" without reading the peer's, and fails if the peer has
    /// closed by then: so this side waits for the peer to close first (on a lossy link TCP may
    /// take seconds to deliver the last bytes).
    fn close(mut self, me: &Key) -> Res<()> {
        self.hand_shake(me)?;
        let _ = self.stream.write_all(b"done\0");
        let _ = self.stream.set_read_timeout(Some(Duration::from_secs(15)));
        // Until the peer's own "done" (perftest 4.5 sends one) or its close.
        let mut got = 0;
        let mut sink = [0u8; 64];
        while got < 5 {
            match self.stream.read(&mut sink) {
                Ok(n) if n > 0 => got += n,
                _ => break,
            }
        }
        Ok(())
    }
}

/// This side, connected and ready for the test.
struct Side {
    ctx: Context,
    cq: CompletionQueue,
    qp: QueuePair,
    buf: MemoryRegion,
    /// Where the peer's operations land: the second half of the buffer, as in perftest.
    target_off: usize,
    me: Key,
    peer: Key,
    mtu: PathMtu,
}

fn mtu_code(m: PathMtu) -> u8 {
    match m.bytes() {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        _ => 5,
    }
}

fn mtu_of_code(c: u8) -> Option<PathMtu> {
    PathMtu::from_bytes(match c {
        1 => 256,
        2 => 512,
        3 => 1024,
        4 => 2048,
        5 => 4096,
        _ => return None,
    })
    .ok()
}

/// What the pre-exchange settles: the path MTU, and the page size and cache line both sides
/// lay their buffers out with (the larger of each side's).
struct Layout {
    mtu: PathMtu,
    cycle: usize,
    line: usize,
}

/// Version, page size, cache line and MTU, as perftest exchanges them before any key.
fn pre_exchange(link: &mut Link, mtu: PathMtu) -> Res<Layout> {
    let mut v = [0u8; 16];
    v[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
    let mut rv = [0u8; 16];
    link.xchg(&v, &mut rv, "versions")?;
    let peer_version: String = rv
        .iter()
        .take_while(|&&b| b != 0)
        .map(|&b| b as char)
        .collect();
    // In hundredths: 5.70 is the oldest perftest 4.5 talks to, 6.28 the first that also
    // compares test parameters.
    let hundredths = (peer_version.trim().parse::<f64>().unwrap_or(0.0) * 100.0).round() as u32;
    if !(570..628).contains(&hundredths) {
        return Err(format!(
            "the peer speaks perftest version {peer_version:?}; ferroce speaks the conversation of versions 5.70 to 6.27 (perftest 4.5 sends 6.06)"
        ));
    }
    let mut page = [0u8; 4];
    link.xchg(&PAGE.to_be_bytes(), &mut page, "page sizes")?;
    let mut line = [0u8; 4];
    link.xchg(&CACHE_LINE.to_be_bytes(), &mut line, "cache lines")?;
    let mut rm = [0u8; 2];
    link.xchg(&[b'0' + mtu_code(mtu), 0], &mut rm, "MTUs")?;
    let theirs = mtu_of_code(rm[0].wrapping_sub(b'0')).unwrap_or(mtu);
    // A peer's values beyond reason (a 1 GiB page) are not believed.
    let sane = |v: u32, ours: u32| {
        if v.is_power_of_two() && v <= 1 << 21 {
            v.max(ours)
        } else {
            ours
        }
    };
    Ok(Layout {
        mtu: mtu.min(theirs),
        cycle: sane(u32::from_be_bytes(page), PAGE) as usize,
        line: sane(u32::from_be_bytes(line), CACHE_LINE) as usize,
    })
}

/// perftest's BUFF_SIZE rounded up to the cache line: the size of each half of the buffer
/// (a bandwidth test walks the peer's addresses across a whole page, whatever the size).
fn buff_size(size: u64, l: &Layout) -> usize {
    (size as usize).max(l.cycle).div_ceil(l.line) * l.line
}

fn access_for(test: Test) -> Access {
    match test {
        Test::WriteLat | Test::WriteBw => Access::REMOTE_WRITE,
        Test::ReadLat | Test::ReadBw => Access::REMOTE_READ,
        Test::AtomicLat | Test::AtomicBw => Access::REMOTE_ATOMIC,
        Test::SendLat | Test::SendBw => Access::REMOTE_WRITE,
    }
}

fn psn_seed(qpn: u32) -> u32 {
    super::session::initial_psn(qpn).value()
}

/// Opens the device, makes the QP and buffer, and connects to the peer over perftest's
/// exchange up to the point where each test's sequence differs.
fn setup(args: &PerfArgs, link: &mut Link, peer_ip: Option<IpAddr>) -> Res<Side> {
    let (device, mut gid_index) = pick_device(args, peer_ip)?;
    if let Some(x) = args.gid_index {
        gid_index = x;
    }
    let port = if args.roce_port == 0 {
        ferroce_wire::ROCE_V2_UDP_PORT
    } else {
        args.roce_port
    };
    let ctx = device
        .open(&ContextOptions {
            gid_index,
            port,
            provider: ferroce::Provider::Udp,
            ..ContextOptions::default()
        })
        .map_err(|e| format!("opening {}: {e}", device.name()))?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let depth = args.tx_depth.max(512);
    let cq = ctx
        .create_cq(depth as usize * 2 + 16, None)
        .map_err(|e| e.to_string())?;
    let caps = QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCaps::default()
    };
    let qp = pd
        .create_qp(&QpInitAttr::new(&cq, caps))
        .map_err(|e| e.to_string())?;
    let test = args.test;
    qp.modify_to_init(&InitAttr {
        access: access_for(test),
        ..InitAttr::default()
    })
    .map_err(|e| e.to_string())?;
    let mtu = args
        .mtu
        .map(PathMtu::from_bytes)
        .transpose()
        .map_err(|e| e.to_string())?
        .unwrap_or(PathMtu::Mtu1024)
        .min(device.active_mtu());
    let layout = pre_exchange(link, mtu)?;
    let mtu = layout.mtu;
    let half = buff_size(args.sizes()[0], &layout);
    let buf = pd
        .alloc_mr(2 * half, Access::LOCAL_WRITE.with(access_for(test)))
        .map_err(|e| format!("allocating the buffer: {e}"))?;
    let me = Key {
        lid: 0,
        out_reads: if matches!(
            test,
            Test::ReadLat | Test::ReadBw | Test::AtomicLat | Test::AtomicBw
        ) {
            OUT_READS
        } else {
            1
        },
        qpn: qp.qpn(),
        psn: psn_seed(qp.qpn()),
        rkey: buf.rkey(),
        vaddr: buf.addr() + half as u64,
        gid: ctx.gid(),
        srqn: 0,
    };
    let peer = link.hand_shake(&me)?;
    if peer.gid.to_ipv4_mapped().is_some() != me.gid.to_ipv4_mapped().is_some() {
        return Err(format!(
            "GID types differ: the peer's {} and this side's {} (use -x to pick an IPv4 GID on the peer)",
            peer.gid, me.gid
        ));
    }
    Ok(Side {
        ctx,
        cq,
        qp,
        buf,
        target_off: half,
        me,
        peer,
        mtu,
    })
}

/// RTR and RTS with perftest's attributes.
fn connect(args: &PerfArgs, s: &Side, port: u16) -> Res<()> {
    let rtr = RtrAttr {
        path_mtu: s.mtu,
        dest_qpn: s.peer.qpn,
        dest_gid: s.peer.gid,
        rq_psn: Psn::new(s.peer.psn),
        max_dest_rd_atomic: s.me.out_reads.min(OUT_READS) as u8,
        min_rnr_timer: 12,
    };
    s.qp.modify_to_rtr_with_port(&rtr, port)
        .map_err(|e| format!("moving the QP to RTR: {e}"))?;
    let rts = RtsAttr {
        sq_psn: Psn::new(s.me.psn),
        timeout: args.qp_timeout,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: s.peer.out_reads.clamp(1, OUT_READS) as u8,
    };
    s.qp.modify_to_rts(&rts)
        .map_err(|e| format!("moving the QP to RTS: {e}"))
}

/// When a wait that began now gives up: `--timeout` seconds without progress (a slow peer,
/// such as rxe in a guest under TCG on a lossy link, may take far longer than that in all).
fn stall_limit(args: &PerfArgs) -> Instant {
    Instant::now() + args.timeout()
}

fn wait_one(s: &Side, deadline: Instant, what: &str) -> Res<ferroce::WorkCompletion> {
    loop {
        if let Some(wc) = s.cq.poll_one().map_err(|e| e.to_string())? {
            if wc.status != WcStatus::Success {
                return Err(format!("{what}: {}", wc.status));
            }
            return Ok(wc);
        }
        if Instant::now() > deadline {
            return Err(format!("{what}: no completion before the timeout"));
        }
        std::hint::spin_loop();
    }
}

fn post(s: &Side, op: SendOp, len: u64, remote: bool) -> Res<()> {
    let sgl = if len == 0 {
        vec![]
    } else {
        vec![s.buf.sge(0, len as usize).map_err(|e| e.to_string())?]
    };
    let mut wr = SendWr::new(0, op, sgl);
    if remote {
        wr = wr.remote(s.peer.vaddr, s.peer.rkey);
    }
    s.qp.post_send(wr).map_err(|e| e.to_string())
}

fn post_recv(s: &Side, len: u64) -> Res<()> {
    let sgl = if len == 0 {
        vec![]
    } else {
        vec![s
            .buf
            .sge(s.target_off, len as usize)
            .map_err(|e| e.to_string())?]
    };
    s.qp.post_recv(RecvWr { wr_id: 1, sgl })
        .map_err(|e| e.to_string())
}

fn atomic_op(args: &PerfArgs) -> SendOp {
    match args.atomic_type {
        AtomicType::FetchAndAdd => SendOp::FetchAdd { add: 1 },
        AtomicType::CmpAndSwap => SendOp::CompareSwap {
            compare: 0,
            swap: 0,
        },
    }
}

/// `ib_write_lat`'s ping-pong: wait for the peer's counter in the last byte of the target
/// area, then WRITE this side's (the server writes first). Returns the post times.
fn write_lat(args: &PerfArgs, s: &Side, size: u64, iters: u64, server: bool) -> Res<Vec<u64>> {
    let flag_at = s.target_off + size as usize - 1;
    let t0 = Instant::now();
    let mut times = Vec::with_capacity(iters as usize);
    let (mut scnt, mut rcnt) = (0u64, 0u64);
    let mut byte = [0u8; 1];
    while scnt < iters || rcnt < iters {
        if rcnt < iters && !(scnt < 1 && server) {
            rcnt += 1;
            let want = rcnt as u8;
            let deadline = stall_limit(args);
            let mut looks = 0u32;
            loop {
                s.buf.read(flag_at, &mut byte).map_err(|e| e.to_string())?;
                if byte[0] == want {
                    break;
                }
                looks += 1;
                if looks % 64 == 0 {
                    s.ctx.progress();
                    if Instant::now() > deadline {
                        return Err(format!(
                            "WRITE {rcnt} of the peer did not arrive before the timeout"
                        ));
                    }
                }
            }
        }
        if scnt < iters {
            scnt += 1;
            s.buf
                .write(size as usize - 1, &[scnt as u8])
                .map_err(|e| e.to_string())?;
            times.push(t0.elapsed().as_nanos() as u64);
            post(s, SendOp::Write, size, true)?;
            wait_one(s, stall_limit(args), "RDMA WRITE")?;
        }
    }
    Ok(times)
}

/// One READ or atomic at a time (the client of `ib_read_lat`/`ib_atomic_lat`): each sample
/// is a whole operation.
fn one_at_a_time(args: &PerfArgs, s: &Side, size: u64, iters: u64) -> Res<Vec<u64>> {
    let mut samples = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        let t = Instant::now();
        match args.test {
            Test::ReadLat => post(s, SendOp::Read, size, true)?,
            _ => post(s, atomic_op(args), 8, true)?,
        }
        wait_one(s, stall_limit(args), "the operation")?;
        samples.push(t.elapsed().as_nanos() as u64);
    }
    Ok(samples)
}

/// `ib_send_lat`'s ping-pong (the client sends first); returns the post times.
fn send_lat(
    args: &PerfArgs,
    s: &Side,
    size: u64,
    iters: u64,
    server: bool,
    rx: u64,
) -> Res<Vec<u64>> {
    let t0 = Instant::now();
    let mut times = Vec::with_capacity(iters as usize);
    let (mut scnt, mut rcnt, mut posted) = (0u64, 0u64, rx);
    let mut recv_pending = false;
    while scnt < iters || rcnt < iters {
        if rcnt < iters && (server || scnt > 0) {
            // Wait for the peer's message (receive completions and our sends' may interleave).
            while !recv_pending {
                let wc = wait_one(s, stall_limit(args), "a receive")?;
                if wc.opcode == ferroce::WcOpcode::Recv {
                    recv_pending = true;
                }
            }
            recv_pending = false;
            rcnt += 1;
            if posted < iters {
                post_recv(s, size)?;
                posted += 1;
            }
        }
        if scnt < iters {
            scnt += 1;
            times.push(t0.elapsed().as_nanos() as u64);
            post(s, SendOp::Send, size, false)?;
            loop {
                let wc = wait_one(s, stall_limit(args), "a send")?;
                if wc.opcode == ferroce::WcOpcode::Recv {
                    recv_pending = true;
                } else {
                    break;
                }
            }
        }
    }
    Ok(times)
}

/// The client of a bandwidth test: `tx_depth` requests in flight, every one signaled; the
/// completion times since the first post.
fn bw_client(args: &PerfArgs, s: &Side, size: u64, iters: u64) -> Res<Vec<u64>> {
    let depth = u64::from(args.tx_depth);
    let t0 = Instant::now();
    let mut times = Vec::with_capacity(iters as usize);
    let (mut posted, mut done) = (0u64, 0u64);
    while done < iters {
        while posted < iters && posted - done < depth {
            match args.test {
                Test::WriteBw => post(s, SendOp::Write, size, true)?,
                Test::ReadBw => post(s, SendOp::Read, size, true)?,
                Test::SendBw => post(s, SendOp::Send, size, false)?,
                _ => post(s, atomic_op(args), 8, true)?,
            }
            posted += 1;
        }
        wait_one(s, stall_limit(args), "a request")?;
        done += 1;
        times.push(t0.elapsed().as_nanos() as u64);
    }
    Ok(times)
}

/// The server of `ib_send_bw`: receives `iters` messages, reposting; the completion times.
fn send_bw_server(args: &PerfArgs, s: &Side, size: u64, iters: u64, rx: u64) -> Res<Vec<u64>> {
    let mut times = Vec::with_capacity(iters as usize);
    let mut t0 = None;
    let mut posted = rx;
    for _ in 0..iters {
        wait_one(s, stall_limit(args), "a receive")?;
        let start = *t0.get_or_insert_with(Instant::now);
        times.push(start.elapsed().as_nanos() as u64);
        if posted < iters {
            post_recv(s, size)?;
            posted += 1;
        }
    }
    Ok(times)
}

/// MB/s (2^20 bytes) to Gb/s, perftest's two units.
fn gbits(mb_s: f64) -> f64 {
    mb_s * (1u64 << 20) as f64 * 8.0 / 1e9
}

/// The client's figures, as perftest's report exchange carries them: bandwidth in the unit the
/// run reports in (Gb/s with --report_gbits, else MB/s), message rate in Mpps.
fn report_bytes(st: &BwStats, in_gbits: bool) -> [[u8; 8]; 5] {
    let unit = |v: f64| if in_gbits { gbits(v) } else { v };
    [
        st.bytes.to_be_bytes(),
        st.iterations.to_be_bytes(),
        unit(st.bw_peak).to_bits().to_be_bytes(),
        unit(st.bw_avg).to_bits().to_be_bytes(),
        st.msg_rate.to_bits().to_be_bytes(),
    ]
}

/// Exchanges the bandwidth reports; returns the peer's, in MB/s.
fn exchange_report(link: &mut Link, mine: &BwStats, in_gbits: bool) -> Res<BwStats> {
    let mut got = [[0u8; 8]; 5];
    for (m, g) in report_bytes(mine, in_gbits).iter().zip(got.iter_mut()) {
        link.xchg(m, g, "bandwidth reports")?;
    }
    let f = |i: usize| f64::from_bits(u64::from_be_bytes(got[i]));
    let mb = |v: f64| if in_gbits { v / gbits(1.0) } else { v };
    Ok(BwStats {
        bytes: u64::from_be_bytes(got[0]),
        iterations: u64::from_be_bytes(got[1]),
        bw_peak: mb(f(2)),
        bw_avg: mb(f(3)),
        msg_rate: f(4),
    })
}

fn print_lat(args: &PerfArgs, st: &LatStats) {
    if args.json {
        println!("{}", st.json());
    } else {
        println!("{}", LatStats::HEADER);
        println!("{}", st.line());
    }
}

fn print_bw(args: &PerfArgs, st: &BwStats) {
    if args.json {
        println!("{}", st.json());
        return;
    }
    if args.report_gbits {
        let g = gbits;
        println!(
            " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
        );
        println!(
            " {:<10} {:<10}       {:<16.2}   {:<18.2}   {:.6}",
            st.bytes,
            st.iterations,
            g(st.bw_peak),
            g(st.bw_avg),
            st.msg_rate
        );
    } else {
        println!("{}", BwStats::HEADER);
        println!("{}", st.line());
    }
}

/// Refuses what perftest's conversation would need and ferroce does not do.
fn refuse_unsupported(args: &PerfArgs) -> Res<()> {
    if args.qps != 1 {
        return Err("--perftest runs one QP (-q 1)".into());
    }
    if args.all {
        return Err("--perftest runs one size at a time (no -a)".into());
    }
    if args.test == Test::WriteLat && args.size == Some(0) {
        return Err(
            "ib_write_lat needs at least 1 byte (-s 1): its last byte carries the count".into(),
        );
    }
    if args.test.is_atomic() && args.size.is_some_and(|s| s != 8) {
        return Err("Message size cannot be changed for Atomic tests".into());
    }
    if args.chaos.is_some() || args.loopback {
        return Err("--perftest pairs with a real perftest peer: no --chaos or --loopback".into());
    }
    Ok(())
}

/// Runs one perftest-compatible test, as server (no host) or client.
pub(super) fn run(args: &PerfArgs) -> Res<ExitCode> {
    refuse_unsupported(args)?;
    let client = args.host.is_some();
    let (mut link, peer_ip) = match &args.host {
        Some(h) => {
            let addr = std::net::ToSocketAddrs::to_socket_addrs(&(h.as_str(), args.port))
                .map_err(|e| format!("{h}: {e}"))?
                .find(SocketAddr::is_ipv4)
                .ok_or_else(|| format!("{h}: no IPv4 address"))?;
            let deadline = Instant::now() + args.timeout();
            let stream = loop {
                match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    Ok(st) => break st,
                    Err(e) if Instant::now() > deadline => {
                        return Err(format!("Couldn't connect to {addr}: {e}"))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            };
            (
                Link {
                    stream,
                    client: true,
                },
                Some(addr.ip()),
            )
        }
        None => {
            let l = TcpListener::bind((IpAddr::from([0u8; 4]), args.port))
                .map_err(|e| format!("listening on TCP port {}: {e}", args.port))?;
            eprintln!(
                "ferroce perf: {} server (perftest) on port {}",
                test_name(args),
                args.port
            );
            let (stream, _) = l.accept().map_err(|e| e.to_string())?;
            // The device is the one the client reached (its address is the GID to announce),
            // unless --bind or -d says otherwise.
            let here = stream.local_addr().map_err(|e| e.to_string())?.ip();
            (
                Link {
                    stream,
                    client: false,
                },
                Some(here),
            )
        }
    };
    let _ = link
        .stream
        .set_read_timeout(Some(args.timeout() + Duration::from_secs(600)));
    let s = setup(args, &mut link, peer_ip)?;
    let port = s.ctx.local_addr().port();
    let size = if args.test.is_atomic() {
        8
    } else {
        args.sizes()[0]
    };
    let iters = args.iters_for(size);
    let me = s.me;
    let server = !client;
    match args.test {
        Test::WriteLat => {
            link.hand_shake(&me)?;
            connect(args, &s, port)?;
            link.hand_shake(&me)?;
            link.hand_shake(&me)?;
            let mut times = write_lat(args, &s, size, iters, server)?;
            let mut samples: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
            times.clear();
            print_lat(args, &LatStats::from_samples(size, &mut samples, 2.0));
        }
        Test::ReadLat | Test::AtomicLat => {
            link.hand_shake(&me)?;
            connect(args, &s, port)?;
            link.hand_shake(&me)?;
            link.hand_shake(&me)?;
            if server {
                link.close(&me)?;
            } else {
                let mut samples = one_at_a_time(args, &s, size, iters)?;
                print_lat(args, &LatStats::from_samples(size, &mut samples, 1.0));
                link.close(&me)?;
            }
        }
        Test::SendLat => {
            connect(args, &s, port)?;
            link.hand_shake(&me)?;
            link.hand_shake(&me)?;
            let rx = iters.min(512).div_ceil(2) * 2;
            for _ in 0..rx.min(iters) {
                post_recv(&s, size)?;
            }
            link.hand_shake(&me)?;
            let times = send_lat(args, &s, size, iters, server, rx.min(iters))?;
            let mut samples: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
            print_lat(args, &LatStats::from_samples(size, &mut samples, 2.0));
            link.close(&me)?;
        }
        Test::WriteBw | Test::ReadBw | Test::AtomicBw => {
            connect(args, &s, port)?;
            link.hand_shake(&me)?;
            link.hand_shake(&me)?;
            if server {
                // The client's test runs now; this side's engine serves it.
                link.hand_shake(&me)?;
                let theirs = exchange_report(
                    &mut link,
                    &BwStats::from_completions(size, &[]),
                    args.report_gbits,
                )?;
                print_bw(args, &theirs);
            } else {
                let times = bw_client(args, &s, size, iters)?;
                let st = BwStats::from_completions(size, &times);
                link.hand_shake(&me)?;
                exchange_report(&mut link, &st, args.report_gbits)?;
                print_bw(args, &st);
            }
            link.close(&me)?;
        }
        Test::SendBw => {
            connect(args, &s, port)?;
            link.hand_shake(&me)?;
            link.hand_shake(&me)?;
            let rx = iters.min(u64::from(args.tx_depth.max(512)));
            if server {
                for _ in 0..rx {
                    post_recv(&s, size)?;
                }
            }
            link.hand_shake(&me)?;
            let times = if server {
                send_bw_server(args, &s, size, iters, rx)?
            } else {
                bw_client(args, &s, size, iters)?
            };
            print_bw(args, &BwStats::from_completions(size, &times));
            link.close(&me)?;
        }
    }
    if args.counters {
        println!(" Counters (this side):");
        for (k, v) in s.ctx.counters().named() {
            println!("   {k:<28} {v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn test_name(args: &PerfArgs) -> String {
    super::test_name(args.test)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_message_is_perftests() {
        let k = Key {
            lid: 0,
            out_reads: 1,
            qpn: 0x11a,
            psn: 0x3f09c2,
            rkey: 0x1234,
            vaddr: 0x7f12a0001000,
            gid: "::ffff:192.168.1.10".parse().unwrap(),
            srqn: 0,
        };
        let m = k.encode();
        assert_eq!(
            &m[..107],
            b"0000:0001:00011a:3f09c2:00001234:00007f12a0001000:00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:01:0a:00000000:"
        );
        assert_eq!(m[107], 0);
        assert_eq!(Key::decode(&m).unwrap(), k);
    }

    #[test]
    fn a_short_key_message_is_refused_with_its_reason() {
        let e = Key::decode(b"0000:0001:00011a:3f09c2:00001234:00007f12a0001000:00000000\0")
            .unwrap_err();
        assert!(e.contains("fields"), "{e}");
    }
}
