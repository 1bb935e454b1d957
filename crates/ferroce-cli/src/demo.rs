//! `ferroce` with no arguments: a guided tour on loopback.
//!
//! Two peers, each with its own context (UDP socket and engine thread), connect over TCP the way
//! librdmacm applications do, then run every operation with its data checked, and a bandwidth
//! round. Peer B's application thread only posts receives and waits: the one-sided operations
//! are served by its engine, as a NIC would.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferroce::cm::{self, Listener, RemoteRegion};
use ferroce::{
    device_by_name, Access, ConnectOptions, ContextOptions, Psn, QpCaps, QpInitAttr, RecvWr,
    SendOp, SendWr, WcOpcode, WcStatus,
};

const ROUNDS: usize = 1000;
const MSG: usize = 64;
const T: Duration = Duration::from_secs(10);

type Res<T> = Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Peer B: exposes a region, posts receives for the SENDs, and otherwise just waits.
fn peer_b(listener: Listener) -> Res<()> {
    let lo = device_by_name("lo").map_err(s)?;
    let ctx = lo.open(&ContextOptions::with_port(0)).map_err(s)?;
    let pd = ctx.alloc_pd().map_err(s)?;
    let cq = ctx.create_cq(4096, None).map_err(s)?;
    let caps = QpCaps {
        max_recv_wr: 4096,
        ..QpCaps::default()
    };
    let qp = pd.create_qp(&QpInitAttr::new(&cq, caps)).map_err(s)?;
    let mem = pd.alloc_mr(2 << 20, Access::ALL).map_err(s)?;
    let region = RemoteRegion {
        addr: mem.addr(),
        rkey: mem.rkey(),
        len: mem.len() as u64,
    };
    let local = qp.endpoint_info(Psn::new(0x2000), Some(region));
    let mut conn = listener.accept(&local, T).map_err(s)?;
    qp.connect(&local, &conn.peer, &ConnectOptions::default())
        .map_err(s)?;
    for i in 0..(2 * ROUNDS + 8) as u64 {
        qp.post_recv(RecvWr {
            wr_id: i,
            sgl: vec![mem.sge(0, MSG).map_err(s)?],
        })
        .map_err(s)?;
    }
    conn.sync(T).map_err(s)?;
    // Until A is done: the engine serves READ, WRITE and atomics on its own; receive
    // completions are checked here.
    conn.sync(Duration::from_secs(120)).map_err(s)?;
    let mut received = 0;
    while let Some(wc) = cq.poll_one().map_err(s)? {
        if wc.status != WcStatus::Success {
            return Err(format!("B: receive {} failed: {}", wc.wr_id, wc.status));
        }
        received += 1;
    }
    if received < 2 * ROUNDS {
        return Err(format!(
            "B: {received} receives completed, expected {}",
            2 * ROUNDS
        ));
    }
    conn.sync(T).map_err(s)?;
    Ok(())
}

/// Runs the tour.
pub fn run() -> Res<ExitCode> {
    println!("ferroce — userspace RDMA over RoCE v2. A guided tour on loopback.\n");
    let listener = Listener::bind(SocketAddr::new(IpAddr::from([127, 0, 0, 1]), 0)).map_err(s)?;
    let cm_addr = listener.local_addr();
    let b = std::thread::spawn(move || peer_b(listener));
    let a = peer_a(cm_addr);
    let b = b.join().map_err(|_| "peer B panicked".to_string())?;
    // B's error explains A's (A only sees B go away).
    b?;
    a?;
    println!("    B's application thread made no RDMA call during steps 2 and 3 but for posting receives.\n");
    println!(" Next: ferroce perf write_lat --loopback   ferroce sim --trace   FERROCE_PCAP=demo.pcap ferroce && ferroce decode demo.pcap");
    Ok(ExitCode::SUCCESS)
}

fn peer_a(cm_addr: SocketAddr) -> Res<()> {
    let lo = device_by_name("lo").map_err(s)?;
    let ctx = lo.open(&ContextOptions::with_port(0)).map_err(s)?;
    let pd = ctx.alloc_pd().map_err(s)?;
    let cq = ctx.create_cq(4096, None).map_err(s)?;
    let qp = pd
        .create_qp(&QpInitAttr::new(&cq, QpCaps::default()))
        .map_err(s)?;
    let mem = pd.alloc_mr(2 << 20, Access::ALL).map_err(s)?;
    let local = qp.endpoint_info(Psn::new(0x1000), None);
    let mut conn = cm::connect(cm_addr, &local, T).map_err(s)?;
    qp.connect(&local, &conn.peer, &ConnectOptions::default())
        .map_err(s)?;
    conn.sync(T).map_err(s)?;
    let peer = conn.peer;
    let remote = peer.region.ok_or("B offered no region")?;
    println!(
        " 1. Connected over TCP {} (like librdmacm): each side learned the other's QP number,",
        cm_addr
    );
    println!(
        "    first PSN, GID, UDP port and MTU; B also handed out a memory region (addr + rkey)."
    );
    println!(
        "      A: QP 0x{:06x}  GID {}  UDP port {}",
        local.qpn, local.gid, local.udp_port
    );
    println!(
        "      B: QP 0x{:06x}  GID {}  UDP port {}  region 0x{:x} rkey 0x{:x} ({} bytes)",
        peer.qpn, peer.gid, peer.udp_port, remote.addr, remote.rkey, remote.len
    );
    println!(
        "    Both queue pairs are in RTS, path MTU {} bytes.\n",
        local.mtu.min(peer.mtu).bytes()
    );

    println!(" 2. Every operation, {ROUNDS} times, {MSG}-byte messages, data checked (round trip to completion):");
    println!(
        "    {:<22} {:>10} {:>10} {:>10}   what happened",
        "operation", "median µs", "p99 µs", "checks"
    );
    let src = |i: usize| -> Vec<u8> { (0..MSG).map(|k| (i * 7 + k) as u8).collect() };
    let ops: [(&str, &str); 6] = [
        ("SEND/RECV", "landed in a receive B posted"),
        ("RDMA WRITE", "landed in B's memory; B's CPU idle"),
        ("RDMA WRITE with imm", "landed + a receive completion at B"),
        ("RDMA READ", "read from B's memory; B's CPU idle"),
        ("COMPARE_SWAP", "swapped B's word; B's CPU idle"),
        ("FETCH_ADD", "added to B's word; B's CPU idle"),
    ];
    let counter = remote.addr + (1 << 20);
    for (k, (name, what)) in ops.iter().enumerate() {
        let mut samples = Vec::with_capacity(ROUNDS);
        let mut checks = 0;
        for i in 0..ROUNDS {
            let data = src(i);
            mem.write(0, &data).map_err(s)?;
            let sge = mem.sge(0, MSG).map_err(s)?;
            let wr = match k {
                0 => SendWr::new(i as u64, SendOp::Send, vec![sge]),
                1 => {
                    SendWr::new(i as u64, SendOp::Write, vec![sge]).remote(remote.addr, remote.rkey)
                }
                2 => SendWr::new(i as u64, SendOp::WriteWithImm(i as u32), vec![sge])
                    .remote(remote.addr + 4096, remote.rkey),
                3 => SendWr::new(i as u64, SendOp::Read, vec![mem.sge(8192, MSG).map_err(s)?])
                    .remote(remote.addr, remote.rkey),
                4 => SendWr::new(
                    i as u64,
                    SendOp::CompareSwap {
                        compare: i as u64,
                        swap: i as u64 + 1,
                    },
                    vec![mem.sge(16384, 8).map_err(s)?],
                )
                .remote(counter, remote.rkey),
                _ => SendWr::new(
                    i as u64,
                    SendOp::FetchAdd { add: 1 },
                    vec![mem.sge(16384, 8).map_err(s)?],
                )
                .remote(counter + 8, remote.rkey),
            };
            let t0 = Instant::now();
            qp.post_send(wr).map_err(s)?;
            let wc = cq.wait(1, T).map_err(s)?;
            samples.push(t0.elapsed().as_nanos() as u64);
            let wc = wc
                .first()
                .ok_or(format!("{name}: no completion within {T:?}"))?;
            if wc.status != WcStatus::Success {
                return Err(format!("{name}: {}", wc.status));
            }
            // Check what can be checked from A's side at once.
            match k {
                1 => {
                    // WRITE then READ back the same bytes.
                    qp.post_send(
                        SendWr::new(0, SendOp::Read, vec![mem.sge(8192, MSG).map_err(s)?])
                            .remote(remote.addr, remote.rkey),
                    )
                    .map_err(s)?;
                    cq.wait(1, T).map_err(s)?;
                    if mem.to_vec(8192, MSG).map_err(s)? != data {
                        return Err(format!("{name}: the bytes read back differ"));
                    }
                    checks += 1;
                }
                3 => {
                    // The last WRITE left src(ROUNDS - 1) there.
                    if mem.to_vec(8192, MSG).map_err(s)? != src(ROUNDS - 1) {
                        return Err(format!("{name}: read other bytes than were written"));
                    }
                    checks += 1;
                }
                4 | 5 => {
                    if mem.read_u64(16384).map_err(s)? != i as u64 {
                        return Err(format!(
                            "{name}: iteration {i} found {}",
                            mem.read_u64(16384).map_err(s)?
                        ));
                    }
                    checks += 1;
                }
                _ => checks += usize::from(wc.opcode != WcOpcode::Recv),
            }
        }
        samples.sort_unstable();
        let med = samples[samples.len() / 2] as f64 / 1000.0;
        let p99 = samples[samples.len() * 99 / 100] as f64 / 1000.0;
        println!("    {name:<22} {med:>10.2} {p99:>10.2} {checks:>10}   {what}");
    }

    // Bandwidth: 256 WRITEs of 1 MiB, 16 in flight.
    let mib = 1 << 20;
    let n = 256;
    let t0 = Instant::now();
    let (mut posted, mut done) = (0, 0);
    while done < n {
        while posted < n && posted - done < 16 {
            qp.post_send(
                SendWr::new(
                    posted as u64,
                    SendOp::Write,
                    vec![mem.sge(0, mib).map_err(s)?],
                )
                .remote(remote.addr, remote.rkey),
            )
            .map_err(s)?;
            posted += 1;
        }
        if let Some(wc) = cq.poll_one().map_err(s)? {
            if wc.status != WcStatus::Success {
                return Err(format!("bandwidth round: {}", wc.status));
            }
            done += 1;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    println!("\n 3. Bandwidth: {n} RDMA WRITEs of 1 MiB: {:.0} MB/s ({:.2} GB/s), {} packets per MiB at MTU {}.",
        (n * mib) as f64 / 1e6 / secs, (n * mib) as f64 / 1e9 / secs, mib / local.mtu.min(peer.mtu).bytes() as usize, local.mtu.min(peer.mtu).bytes());
    let c = ctx.counters();
    println!(
        "    A sent {} datagrams and received {}; retransmissions: {}.",
        c.tx_packets,
        c.rx_packets,
        qp.counters().retransmits
    );
    conn.sync(Duration::from_secs(120)).map_err(s)?;
    conn.sync(T).map_err(s)?;
    Ok(())
}
