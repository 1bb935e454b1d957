//! A ferroce twin of the interop harness's `rdma_imm.c`: SEND and RDMA WRITE with immediate
//! data, each at 64 B (one packet) and 4 KiB (FIRST/MIDDLE/LAST at path MTU 1024), against the
//! C program on Linux rxe, in either role, speaking its exchange.
//!
//!     rdma_imm [-r] [--bind IP]          # server: takes the four messages
//!     rdma_imm SERVER_IP                 # client: sends them
//!
//! The exchange (TCP port 18515): both sides write a packed little-endian record
//! `{qpn u32, psn u32, rkey u32, addr u64, gid [u8; 16]}` (36 bytes) and read the peer's, then
//! one byte each way once both QPs are at RTS, and one more at the end. With `-r` the server posts
//! its receives 300 ms late, with the shortest RNR timer code (0 = 655 ms) asked of the peer, so
//! the client's first SEND draws an RNR NAK and is retried.
//!
//! The server checks what arrived: each receive's immediate and length, and the bytes the WRITEs
//! left (the client's buffer holds `0x40 + (i & 0x3f)` at byte `i`). It prints one line per
//! completion, as the C program does, then `ok`, and its context counters.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferroce::{
    devices, Access, CompletionQueue, ContextOptions, InitAttr, PathMtu, Psn, QpCaps, QpInitAttr,
    RecvWr, RtrAttr, RtsAttr, SendOp, SendWr, WcStatus, WorkCompletion,
};

const PORT: u16 = 18515;
const BUF: usize = 16384;
const BIG: usize = 4096;
const SMALL: usize = 64;
const INFO_LEN: usize = 36;
/// The four messages: operation, length, immediate, name.
const MESSAGES: [(bool, usize, u32, &str); 4] = [
    (false, SMALL, 0x1122_3344, "SEND_WITH_IMM 64B"),
    (false, BIG, 0x5566_7788, "SEND_WITH_IMM 4096B"),
    (true, SMALL, 0x99aa_bbcc, "RDMA_WRITE_WITH_IMM 64B"),
    (true, BIG, 0xddee_ff00, "RDMA_WRITE_WITH_IMM 4096B"),
];

type Res<T> = Result<T, String>;

fn s<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

struct Info {
    qpn: u32,
    psn: u32,
    rkey: u32,
    addr: u64,
    gid: [u8; 16],
}

impl Info {
    fn encode(&self) -> [u8; INFO_LEN] {
        let mut m = [0u8; INFO_LEN];
        m[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        m[4..8].copy_from_slice(&self.psn.to_le_bytes());
        m[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        m[12..20].copy_from_slice(&self.addr.to_le_bytes());
        m[20..36].copy_from_slice(&self.gid);
        m
    }

    fn decode(m: &[u8; INFO_LEN]) -> Info {
        let u32_at = |i: usize| u32::from_le_bytes(m[i..i + 4].try_into().unwrap_or([0; 4]));
        Info {
            qpn: u32_at(0) & 0xff_ffff,
            psn: u32_at(4) & 0xff_ffff,
            rkey: u32_at(8),
            addr: u64::from_le_bytes(m[12..20].try_into().unwrap_or([0; 8])),
            gid: m[20..36].try_into().unwrap_or([0; 16]),
        }
    }
}

/// Both sides write, then read: what the C program's `xfer` does.
fn xfer(stream: &mut TcpStream, out: &[u8], into: &mut [u8]) -> Res<()> {
    stream.write_all(out).map_err(s("writing to the peer"))?;
    stream.read_exact(into).map_err(s("reading from the peer"))
}

fn wait(cq: &CompletionQueue, what: &str) -> Res<WorkCompletion> {
    let wc = cq
        .wait(1, Duration::from_secs(30))
        .map_err(s("polling"))?
        .pop()
        .ok_or_else(|| format!("{what}: no completion within 30 s"))?;
    if wc.status != WcStatus::Success {
        return Err(format!("{what}: wc status {}", wc.status));
    }
    match wc.imm_data {
        Some(imm) => println!(
            "{what}: wc opcode {:?} len {} imm_data 0x{imm:08x}",
            wc.opcode, wc.byte_len
        ),
        None => println!("{what}: wc opcode {:?} len {}", wc.opcode, wc.byte_len),
    }
    Ok(wc)
}

fn run() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let (mut rnr, mut bind, mut peer) = (false, None::<IpAddr>, None::<IpAddr>);
    while let Some(a) = args.next() {
        match a.as_str() {
            "-r" => rnr = true,
            "--bind" => {
                bind = Some(
                    args.next()
                        .and_then(|v| v.parse().ok())
                        .ok_or("--bind IP")?,
                )
            }
            v => peer = Some(v.parse().map_err(|_| format!("not an IPv4 address: {v}"))?),
        }
    }
    let client = peer.is_some();
    // This side's address: the one routing to the peer, or the one given.
    let local_ip = match (bind, peer) {
        (Some(ip), _) => ip,
        (None, Some(p)) => {
            let u = std::net::UdpSocket::bind("0.0.0.0:0").map_err(s("probing the route"))?;
            u.connect((p, 9)).map_err(s("no route to the peer"))?;
            u.local_addr().map_err(s("probing the route"))?.ip()
        }
        (None, None) => return Err("a server needs --bind IP".into()),
    };
    let (device, gid_index) = devices()
        .map_err(|e| e.to_string())?
        .into_iter()
        .find_map(|d| {
            let i = d.gids().iter().position(|g| g.ip == local_ip)?;
            Some((d, i))
        })
        .ok_or_else(|| format!("no ferroce device holds {local_ip}"))?;
    let ctx = device
        .open(&ContextOptions {
            gid_index,
            provider: ferroce::Provider::Udp,
            ..ContextOptions::default()
        })
        .map_err(s("opening the device"))?;
    let pd = ctx.alloc_pd().map_err(s("PD"))?;
    let cq = ctx.create_cq(16, None).map_err(s("CQ"))?;
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        ..QpCaps::default()
    };
    let qp = pd.create_qp(&QpInitAttr::new(&cq, caps)).map_err(s("QP"))?;
    let rights = Access::LOCAL_WRITE
        .with(Access::REMOTE_WRITE)
        .with(Access::REMOTE_READ);
    let buf = pd.alloc_mr(BUF, rights).map_err(s("MR"))?;
    if client {
        let pattern: Vec<u8> = (0..BUF).map(|i| 0x40 + (i & 0x3f) as u8).collect();
        buf.write(0, &pattern).map_err(|e| e.to_string())?;
    }
    qp.modify_to_init(&InitAttr {
        access: Access::REMOTE_WRITE.with(Access::REMOTE_READ),
        ..InitAttr::default()
    })
    .map_err(s("INIT"))?;
    let post_recvs = || -> Res<()> {
        for i in 0..4 {
            qp.post_recv(RecvWr {
                wr_id: i,
                sgl: vec![buf
                    .sge(i as usize * 4096, 4096)
                    .map_err(|e| e.to_string())?],
            })
            .map_err(s("post_recv"))?;
        }
        Ok(())
    };
    if !client && !rnr {
        post_recvs()?;
    }
    let me = Info {
        qpn: qp.qpn(),
        psn: std::process::id().wrapping_mul(7919) & 0xff_ffff,
        rkey: buf.rkey(),
        addr: buf.addr(),
        gid: ctx.gid().octets(),
    };
    let mut stream = match peer {
        Some(p) => {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match TcpStream::connect(SocketAddr::new(p, PORT)) {
                    Ok(st) => break st,
                    Err(e) if Instant::now() > deadline => return Err(format!("connect: {e}")),
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        }
        None => {
            let l = TcpListener::bind(SocketAddr::new(local_ip, PORT)).map_err(s("listen"))?;
            l.accept().map_err(s("accept"))?.0
        }
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let mut m = [0u8; INFO_LEN];
    xfer(&mut stream, &me.encode(), &mut m)?;
    let rem = Info::decode(&m);
    println!(
        "local QPN 0x{:06x} PSN 0x{:06x}, remote QPN 0x{:06x} PSN 0x{:06x} rkey 0x{:x}",
        me.qpn, me.psn, rem.qpn, rem.psn, rem.rkey
    );
    qp.modify_to_rtr(&RtrAttr {
        path_mtu: PathMtu::Mtu1024,
        dest_qpn: rem.qpn,
        dest_gid: rem.gid.into(),
        rq_psn: Psn::new(rem.psn),
        max_dest_rd_atomic: 1,
        min_rnr_timer: if rnr { 0 } else { 12 },
    })
    .map_err(s("RTR"))?;
    qp.modify_to_rts(&RtsAttr {
        sq_psn: Psn::new(me.psn),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
    })
    .map_err(s("RTS"))?;
    let mut r = [0u8; 1];
    xfer(&mut stream, b"r", &mut r)?;
    if client {
        for (i, &(write, len, imm, name)) in MESSAGES.iter().enumerate() {
            let op = if write {
                SendOp::WriteWithImm(imm)
            } else {
                SendOp::SendWithImm(imm)
            };
            let wr = SendWr::new(
                i as u64,
                op,
                vec![buf.sge(i * 4096, len).map_err(|e| e.to_string())?],
            )
            .remote(rem.addr + 8192 + (i as u64 & 1) * 4096, rem.rkey);
            qp.post_send(wr).map_err(s("post_send"))?;
            wait(&cq, name)?;
        }
    } else {
        if rnr {
            std::thread::sleep(Duration::from_millis(300));
            post_recvs()?;
            println!("receives posted 300 ms late (RNR test)");
        }
        for &(write, len, imm, name) in &MESSAGES {
            let wc = wait(&cq, "recv")?;
            // A WRITE with immediate must complete as one (its bytes went to the address its
            // RETH named, not into this receive's buffer).
            let want = if write {
                ferroce::WcOpcode::RecvRdmaWithImm
            } else {
                ferroce::WcOpcode::Recv
            };
            if wc.opcode != want {
                return Err(format!("{name}: completed as {:?}", wc.opcode));
            }
            // A WRITE with immediate consumes a receive, and says how many bytes it wrote.
            if wc.imm_data != Some(imm) {
                return Err(format!(
                    "{name}: immediate {:?}, expected 0x{imm:08x}",
                    wc.imm_data
                ));
            }
            if wc.byte_len as usize != len {
                return Err(format!("{name}: {} bytes, expected {len}", wc.byte_len));
            }
        }
        // The SENDs landed in receives 0 and 1, the WRITEs at 8192 (64 B) and 12288 (4 KiB).
        let pattern = |i: usize| 0x40 + (i & 0x3f) as u8;
        let check = |at: usize, len: usize, from: usize, what: &str| -> Res<()> {
            let got = buf.to_vec(at, len).map_err(|e| e.to_string())?;
            let want: Vec<u8> = (from..from + len).map(pattern).collect();
            if got != want {
                return Err(format!(
                    "{what}: the bytes differ from what the client sent"
                ));
            }
            Ok(())
        };
        check(0, SMALL, 0, "SEND 64B")?;
        check(4096, BIG, 4096, "SEND 4096B")?;
        check(8192, SMALL, 8192, "WRITE 64B")?;
        check(12288, BIG, 12288, "WRITE 4096B")?;
        let b = buf.to_vec(0, BUF).map_err(|e| e.to_string())?;
        println!(
            "write target bytes: [8192]=0x{:02x} [12288+4095]=0x{:02x}",
            b[8192],
            b[12288 + 4095]
        );
    }
    xfer(&mut stream, b"d", &mut r)?;
    println!("ok");
    for (k, v) in ctx.counters().named() {
        println!("   {k:<28} {v}");
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdma_imm: {e}");
            ExitCode::FAILURE
        }
    }
}
