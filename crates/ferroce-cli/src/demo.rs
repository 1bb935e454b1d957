//! `ferroce` with no arguments: a guided tour on loopback, over both providers.
//!
//! Two peers, each with its own context, connect over TCP the way librdmacm applications do,
//! run every operation with its data checked, and a bandwidth round. The tour runs twice: once
//! with RoCE v2 over UDP forced (real packets, as between two hosts) and once with shared memory
//! forced (what `auto` picks for a peer on the same host), and prints both side by side, so the
//! reader sees what each provider costs. Every count in the table is read from A's context
//! counters after its run. Peer B's application thread only posts receives and waits: the
//! one-sided operations are served by its engine (UDP) or done by A in B's memory (shm).

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferroce::cm::{self, EndpointInfo, Listener, RemoteRegion};
use ferroce::{
    device_by_name, Access, CompletionQueue, ConnectOptions, Context, ContextCounters,
    ContextOptions, ProtectionDomain, Provider, Psn, QpCaps, QpInitAttr, RecvWr, SendOp, SendWr,
    WcOpcode, WcStatus,
};

const ROUNDS: usize = 1000;
const MSG: usize = 64;
const T: Duration = Duration::from_secs(10);
/// The bandwidth round: this many WRITEs of 1 MiB, 16 in flight.
const BW_WRITES: usize = 256;

type Res<T> = Result<T, String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// The operations of the tour, with what the application sees of each.
const OPS: [(&str, &str); 6] = [
    ("SEND/RECV", "landed in a receive B posted"),
    ("RDMA WRITE", "landed in B's memory; B's CPU idle"),
    ("RDMA WRITE with imm", "landed + a receive completion at B"),
    ("RDMA READ", "read from B's memory; B's CPU idle"),
    ("COMPARE_SWAP", "swapped B's word; B's CPU idle"),
    ("FETCH_ADD", "added to B's word; B's CPU idle"),
];

/// One operation's figures in one run.
#[derive(Debug, Clone, Copy)]
struct OpResult {
    median_us: f64,
    p99_us: f64,
    checks: usize,
}

/// What one run of the tour measured and counted.
#[derive(Debug)]
struct Run {
    /// The provider A's QP reported once connected.
    carried_by: Provider,
    local: EndpointInfo,
    peer: EndpointInfo,
    ops: Vec<OpResult>,
    bandwidth_mb_s: f64,
    /// A's context counters after the run.
    counters: ContextCounters,
    retransmits: u64,
}

/// A context on loopback with `provider` forced, its PD and a CQ: what each peer starts from.
fn open_lo(provider: Provider) -> Res<(Context, ProtectionDomain, CompletionQueue)> {
    let ctx = device_by_name("lo")
        .map_err(s)?
        .open(&ContextOptions {
            provider,
            capture: None,
            ..ContextOptions::with_port(0)
        })
        .map_err(s)?;
    let pd = ctx.alloc_pd().map_err(s)?;
    let cq = ctx.create_cq(4096, None).map_err(s)?;
    Ok((ctx, pd, cq))
}

/// Peer B: exposes a region, posts receives for the SENDs, and otherwise just waits.
fn peer_b(listener: Listener, provider: Provider) -> Res<()> {
    let (_ctx, pd, cq) = open_lo(provider)?;
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
    // Until A is done: READ, WRITE and atomics need nothing from this thread; receive
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

/// One run of the tour with both peers on `provider`.
fn tour(provider: Provider) -> Res<Run> {
    let listener = Listener::bind(SocketAddr::new(IpAddr::from([127, 0, 0, 1]), 0)).map_err(s)?;
    let cm_addr = listener.local_addr();
    let b = std::thread::spawn(move || peer_b(listener, provider));
    let a = peer_a(cm_addr, provider);
    let b = b.join().map_err(|_| "peer B panicked".to_string())?;
    // B's error explains A's (A only sees B go away).
    b.map_err(|e| format!("{provider}: {e}"))?;
    a.map_err(|e| format!("{provider}: {e}"))
}

/// Runs the tour.
pub fn run() -> Res<ExitCode> {
    println!("ferroce — userspace RDMA with the verbs API: RoCE v2 over UDP between hosts, shared");
    println!("memory within one. A guided tour on loopback, run once over each provider.\n");
    let udp = tour(Provider::Udp)?;
    let shm = tour(Provider::Shm)?;
    print_report(&udp, &shm);
    Ok(ExitCode::SUCCESS)
}

fn print_report(udp: &Run, shm: &Run) {
    let (local, peer) = (&udp.local, &udp.peer);
    println!(" 1. Connected over TCP (like librdmacm): each side learned the other's QP number,");
    println!(
        "    first PSN, GID, UDP port and MTU; B also handed out a memory region (addr + rkey)."
    );
    println!(
        "      A: QP 0x{:06x}  GID {}  UDP port {}",
        local.qpn, local.gid, local.udp_port
    );
    if let Some(r) = peer.region {
        println!(
            "      B: QP 0x{:06x}  GID {}  UDP port {}  region 0x{:x} rkey 0x{:x} ({} bytes)",
            peer.qpn, peer.gid, peer.udp_port, r.addr, r.rkey, r.len
        );
    }
    println!(
        "    Both queue pairs are in RTS, path MTU {} bytes. Providers that carried the QPs:",
        local.mtu.min(peer.mtu).bytes()
    );
    println!(
        "      run 1: {} (RoCE v2 packets over UDP sockets)   run 2: {} (shared memory)\n",
        udp.carried_by, shm.carried_by
    );

    println!(
        " 2. Every operation, {ROUNDS} times, {MSG}-byte messages, data checked; µs from post to"
    );
    println!("    completion, median (p99):");
    println!(
        "    {:<20} {:>18} {:>18} {:>12}   what happened",
        "operation", "RoCE v2 over UDP", "shared memory", "checks"
    );
    for (k, (name, what)) in OPS.iter().enumerate() {
        let cell = |r: &OpResult| format!("{:.2} ({:.2})", r.median_us, r.p99_us);
        let (u, m) = (&udp.ops[k], &shm.ops[k]);
        println!(
            "    {name:<20} {:>18} {:>18} {:>5} + {:<4}   {what}",
            cell(u),
            cell(m),
            u.checks,
            m.checks
        );
    }
    let mib = 1usize << 20;
    println!(
        "\n 3. Bandwidth, {BW_WRITES} RDMA WRITEs of 1 MiB: {:>9.0} MB/s {:>14.0} MB/s",
        udp.bandwidth_mb_s, shm.bandwidth_mb_s
    );
    println!(
        "    Over UDP each 1 MiB WRITE is {} packets at MTU {}; over shared memory A copies it",
        mib / local.mtu.min(peer.mtu).bytes() as usize,
        local.mtu.min(peer.mtu).bytes()
    );
    println!("    into B's memory itself (no packet).\n");

    println!(" 4. What A's context counted (Context::counters, whole run):");
    println!("    {:<44} {:>14} {:>14}", "counter", "UDP run", "shm run");
    let row = |name: &str, value: fn(&Run) -> u64| {
        println!("    {name:<44} {:>14} {:>14}", value(udp), value(shm));
    };
    row("packets sent (UDP datagrams / ring entries)", |r| {
        r.counters.tx_packets
    });
    row("packets received", |r| r.counters.rx_packets);
    row("bytes sent in packets", |r| r.counters.tx_bytes);
    row("one-sided ops done in B's memory directly", |r| {
        r.counters.direct_ops
    });
    row("ICRC errors", |r| r.counters.icrc_errors);
    row("retransmissions (A's QP)", |r| r.retransmits);
    row("send errors", |r| r.counters.send_errors);
    println!(
        "    Over UDP every operation became packets (requests, responses, ACKs); over shared"
    );
    println!(
        "    memory SEND/RECV and WRITE with immediate still travel as packets through B's ring,"
    );
    println!(
        "    while WRITE, READ and atomics on an idle QP were done in B's memory by A itself."
    );
    println!("    B's application thread made no RDMA call during steps 2 and 3 but for posting");
    println!("    receives.\n");
    println!(" Next: ferroce perf write_lat --loopback --provider udp   ferroce sim --trace");
    println!("       FERROCE_PCAP=demo.pcap ferroce perf send_lat --loopback && ferroce decode demo.pcap");
}

fn peer_a(cm_addr: SocketAddr, provider: Provider) -> Res<Run> {
    let (ctx, pd, cq) = open_lo(provider)?;
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
    let carried_by = qp.provider();
    if carried_by != provider {
        return Err(format!(
            "asked for provider {provider}, the QP is carried by {carried_by}"
        ));
    }

    let src = |i: usize| -> Vec<u8> { (0..MSG).map(|k| (i * 7 + k) as u8).collect() };
    let counter = remote.addr + (1 << 20);
    let mut ops = Vec::with_capacity(OPS.len());
    for (k, (name, _)) in OPS.iter().enumerate() {
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
        ops.push(OpResult {
            median_us: samples[samples.len() / 2] as f64 / 1000.0,
            p99_us: samples[samples.len() * 99 / 100] as f64 / 1000.0,
            checks,
        });
    }

    let mib = 1 << 20;
    let t0 = Instant::now();
    let (mut posted, mut done) = (0, 0);
    while done < BW_WRITES {
        while posted < BW_WRITES && posted - done < 16 {
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
    conn.sync(Duration::from_secs(120)).map_err(s)?;
    conn.sync(T).map_err(s)?;
    Ok(Run {
        carried_by,
        local,
        peer,
        ops,
        bandwidth_mb_s: (BW_WRITES * mib) as f64 / (1 << 20) as f64 / secs,
        counters: ctx.counters(),
        retransmits: qp.counters().retransmits,
    })
}
