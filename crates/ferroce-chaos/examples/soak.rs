//! Soak: 64 QPs of mixed operations through the chaos relay for minutes, with every result
//! checked and the process's resident memory sampled, to show that nothing leaks or drifts
//! under sustained faults.
//!
//! ```text
//! cargo run --release -p ferroce-chaos --example soak -- [SECONDS] [QPS] [FAULTS]
//! cargo run --release -p ferroce-chaos --example soak -- 300 64 loss=0.02,reorder=0.02,duplicate=0.01,corrupt=0.005
//! ```
//!
//! Each client QP runs WRITE (random size up to 64 KiB) → READ back and compare → FETCH_ADD on
//! its own counter (the original must be exactly the number of earlier adds) → SEND (the server
//! checks the bytes), one operation at a time per QP, 64 QPs at once. A line every 10 s gives
//! operations done, faults injected, retransmissions and RSS.

use std::thread;
use std::time::{Duration, Instant};

use ferroce::cm::{self, EndpointInfo, Listener, RemoteRegion};
use ferroce::{
    device_by_name, Access, CompletionQueue, ConnectOptions, Context, ContextOptions, Device,
    MemoryRegion, ProtectionDomain, Psn, QpCaps, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr,
    WcStatus,
};
use ferroce_chaos::{Faults, Relay};
use ferroce_proto::sim::Rng;

const SLOT: usize = 256 << 10;
const MAX_LEN: usize = 64 << 10;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(seed).fill(&mut v);
    v
}

/// One side's resources: a context, a CQ, `nq` RC QPs on it and a region of two slots per QP.
struct Side {
    ctx: Context,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    mr: MemoryRegion,
    qps: Vec<QueuePair>,
}

impl Side {
    fn open(dev: &Device, nq: usize) -> Side {
        let ctx = dev
            .open(&ContextOptions {
                capture: None,
                ..ContextOptions::with_port(0)
            })
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(nq * 8, None).unwrap();
        let mr = pd.alloc_mr(nq * SLOT * 2, Access::ALL).unwrap();
        let caps = QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            ..QpCaps::default()
        };
        let qps = (0..nq)
            .map(|_| pd.create_qp(&QpInitAttr::new(&cq, caps)).unwrap())
            .collect();
        Side {
            ctx,
            _pd: pd,
            cq,
            mr,
            qps,
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seconds: u64 = args.first().and_then(|s| s.parse().ok()).unwrap_or(180);
    let nq: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let spec = args
        .get(2)
        .cloned()
        .unwrap_or_else(|| "loss=0.02,reorder=0.02,duplicate=0.01,corrupt=0.005,seed=1".into());
    let faults: Faults = spec.parse().expect("fault specification");
    let opts = ConnectOptions {
        timeout: 12,
        min_rnr_timer: 1,
        ..ConnectOptions::default()
    };
    let listener = Listener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let relay = Relay::start(
        "127.0.0.1:0".parse().unwrap(),
        listener.local_addr(),
        faults,
    )
    .unwrap();
    let dev = device_by_name("lo").unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));

    // The server: a region for WRITE/READ/atomics, and receives for the SENDs (checked here).
    let server_stop = stop.clone();
    let server = thread::spawn(move || {
        let Side {
            ctx,
            _pd,
            cq,
            mr,
            qps,
        } = Side::open(&dev, nq);
        let region = RemoteRegion {
            addr: mr.addr(),
            rkey: mr.rkey(),
            len: mr.len() as u64,
        };
        let local: Vec<EndpointInfo> = qps
            .iter()
            .map(|q| q.endpoint_info(Psn::new(q.qpn() * 7), Some(region)))
            .collect();
        let mut conn = listener
            .accept_many(&local, Duration::from_secs(30))
            .unwrap();
        for ((q, l), p) in qps.iter().zip(&local).zip(&conn.peers) {
            q.connect(l, p, &opts).unwrap();
        }
        let recv_at = |i: usize| nq * SLOT + i * SLOT;
        for (i, q) in qps.iter().enumerate() {
            q.post_recv(RecvWr {
                wr_id: i as u64,
                sgl: vec![mr.sge(recv_at(i), MAX_LEN).unwrap()],
            })
            .unwrap();
        }
        conn.sync(Duration::from_secs(30)).unwrap();
        let mut checked = 0u64;
        while !server_stop.load(std::sync::atomic::Ordering::Relaxed) {
            for wc in cq.wait(1, Duration::from_millis(50)).unwrap() {
                assert_eq!(wc.status, WcStatus::Success, "server: {wc:?}");
                let i = wc.wr_id as usize;
                let got = mr.to_vec(recv_at(i), wc.byte_len as usize).unwrap();
                let seed = u64::from_le_bytes(got[..8].try_into().unwrap());
                assert_eq!(got[8..], pattern(seed, got.len() - 8)[..], "SEND on QP {i}");
                checked += 1;
                qps[i]
                    .post_recv(RecvWr {
                        wr_id: i as u64,
                        sgl: vec![mr.sge(recv_at(i), MAX_LEN).unwrap()],
                    })
                    .unwrap();
            }
        }
        (
            checked,
            qps.iter().map(|q| q.counters()).collect::<Vec<_>>(),
            ctx.counters(),
        )
    });

    let Side {
        ctx: _ctx,
        _pd,
        cq,
        mr,
        qps,
    } = Side::open(&device_by_name("lo").unwrap(), nq);
    let local: Vec<EndpointInfo> = qps
        .iter()
        .map(|q| q.endpoint_info(Psn::new(q.qpn() * 13), None))
        .collect();
    let mut conn = cm::connect_many(relay.cm_addr(), &local, Duration::from_secs(30)).unwrap();
    for ((q, l), p) in qps.iter().zip(&local).zip(&conn.peers) {
        q.connect(l, p, &opts).unwrap();
    }
    let remote = conn.peer.region.unwrap();
    conn.sync(Duration::from_secs(30)).unwrap();

    // Per QP: step (0 WRITE, 1 READ, 2 FETCH_ADD, 3 SEND), current length and seed, adds done.
    let mut rng = Rng::new(7);
    let mut state: Vec<(u8, usize, u64, u64)> = vec![(0, 0, 0, 0); nq];
    let counter_at = |i: usize| (remote.addr + (i * SLOT + SLOT - 8) as u64, remote.rkey);
    let post = |i: usize, st: &mut (u8, usize, u64, u64), rng: &mut Rng| {
        let (local_off, remote_off) = (i * SLOT, (i * SLOT) as u64);
        let wr = match st.0 {
            0 => {
                st.1 = 1 + rng.below(MAX_LEN as u64 - 8) as usize;
                st.2 = rng.next_u64();
                mr.write(local_off, &pattern(st.2, st.1)).unwrap();
                SendWr::new(
                    i as u64,
                    SendOp::Write,
                    vec![mr.sge(local_off, st.1).unwrap()],
                )
                .remote(remote.addr + remote_off, remote.rkey)
            }
            1 => {
                mr.fill(nq * SLOT + local_off, st.1, 0).unwrap();
                SendWr::new(
                    i as u64,
                    SendOp::Read,
                    vec![mr.sge(nq * SLOT + local_off, st.1).unwrap()],
                )
                .remote(remote.addr + remote_off, remote.rkey)
            }
            2 => {
                let (addr, rkey) = counter_at(i);
                SendWr::new(
                    i as u64,
                    SendOp::FetchAdd { add: 1 },
                    vec![mr.sge(local_off + SLOT - 8, 8).unwrap()],
                )
                .remote(addr, rkey)
            }
            _ => {
                let seed = rng.next_u64();
                let len = 8 + rng.below(MAX_LEN as u64 - 8) as usize;
                mr.write(local_off, &seed.to_le_bytes()).unwrap();
                mr.write(local_off + 8, &pattern(seed, len - 8)).unwrap();
                SendWr::new(
                    i as u64,
                    SendOp::Send,
                    vec![mr.sge(local_off, len).unwrap()],
                )
            }
        };
        qps[i].post_send(wr).unwrap();
    };
    for (i, st) in state.iter_mut().enumerate() {
        post(i, st, &mut rng);
    }
    let started = Instant::now();
    let mut ops = 0u64;
    let mut next_report = Duration::from_secs(10);
    let mut peak_rss = 0;
    println!("soak: {nq} QPs, {seconds} s, faults {}", relay.faults());
    println!(
        "{:>6} {:>12} {:>10} {:>12} {:>9}",
        "t[s]", "operations", "faults", "retransmits", "RSS[KiB]"
    );
    while started.elapsed() < Duration::from_secs(seconds) {
        for wc in cq.wait(1, Duration::from_millis(50)).unwrap() {
            assert_eq!(wc.status, WcStatus::Success, "client: {wc:?}");
            let i = wc.wr_id as usize;
            let st = &mut state[i];
            match st.0 {
                1 => {
                    let back = mr.to_vec(nq * SLOT + i * SLOT, st.1).unwrap();
                    assert!(
                        back == pattern(st.2, st.1),
                        "QP {i}: READ back differs from WRITE"
                    );
                }
                2 => {
                    assert_eq!(
                        mr.read_u64(i * SLOT + SLOT - 8).unwrap(),
                        st.3,
                        "QP {i} FETCH_ADD"
                    );
                    st.3 += 1;
                }
                _ => {}
            }
            st.0 = (st.0 + 1) % 4;
            ops += 1;
            post(i, st, &mut rng);
        }
        if started.elapsed() >= next_report {
            let rss = rss_kib();
            peak_rss = peak_rss.max(rss);
            let retrans: u64 = qps.iter().map(|q| q.counters().retransmits).sum();
            println!(
                "{:>6} {:>12} {:>10} {:>12} {:>9}",
                next_report.as_secs(),
                ops,
                relay.stats().faults(),
                retrans,
                rss
            );
            next_report += Duration::from_secs(10);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sends_checked, server_counters, _) = server.join().unwrap();
    let client_retrans: u64 = qps.iter().map(|q| q.counters().retransmits).sum();
    let server_dups: u64 = server_counters.iter().map(|c| c.duplicate_request).sum();
    let st = relay.stats();
    println!(
        "done: {ops} operations in {:.0} s, every result checked ({sends_checked} SENDs checked by the server); faults injected {} (lost {}, corrupted {}, duplicated {}, reordered {}, overflowed {}); client retransmits {client_retrans}, server duplicate requests {server_dups}; peak RSS {peak_rss} KiB",
        started.elapsed().as_secs_f64(),
        st.faults(),
        st.to_server.lost + st.to_client.lost,
        st.to_server.corrupted + st.to_client.corrupted,
        st.to_server.duplicated + st.to_client.duplicated,
        st.to_server.reordered + st.to_client.reordered,
        st.to_server.overflowed + st.to_client.overflowed,
    );
}
