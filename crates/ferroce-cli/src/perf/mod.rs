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
//!
//! `--duration SECS` (write_bw, read_bw) runs for a time instead of a count, each QP with its
//! own window, and reports every QP's bytes: what `scripts/bench_net.sh` needs for per-flow
//! goodput and fairness, and for a row that says how much a collapsing run delivered instead
//! of no row at all.

mod args;
mod perftest;
mod report;
mod rounds;
mod session;
mod wait;

pub use args::{PerfArgs, Test};
use rounds::*;
use session::*;
use wait::*;

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use ferroce::cm::Listener;
use ferroce::{RecvWr, SendOp, SendWr, WcOpcode};
use report::{BwStats, LatStats};

type Res<T> = Result<T, String>;

fn e<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |err| format!("{what}: {err}")
}

/// Runs the command.
pub fn run(args: &PerfArgs) -> Res<ExitCode> {
    if args.events && args.perftest {
        return Err(
            "--events is ferroce's own here; --perftest waits as perftest's defaults do".into(),
        );
    }
    if args.events && matches!(args.test, Test::WriteLat) {
        return Err(
            "write_lat waits on the flag in memory, which raises no completion event: \
             send_lat --events is the ping-pong that sleeps"
                .into(),
        );
    }
    if args.perftest {
        return perftest::run(args);
    }
    args.check_duration()?;
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
                    if n == 0 {
                        idle_wait(&s, deadline)?;
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
        s.sync(args.round_sync(iters))?;
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
    if args.counters && !args.loopback {
        // What the receiving side counted is half the story of a run (ICRC checks, NAKs sent).
        // With --loopback the client's counters are the run's report.
        print_counters(args, &s);
    }
    Ok(())
}

/// The client's side: runs every size and prints the results.
fn client(args: &PerfArgs, server: SocketAddr) -> Res<ExitCode> {
    let mut s = setup(args, None, Some(server))?;
    let t = args.timeout();
    if !args.json {
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
        let line = if args.test.is_lat() {
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
        } else if let Some(window) = args.window() {
            let r = bw_round_timed(args, &s, size, window, t)?;
            let line = timed_report(args, size, window, &r);
            if !r.clean() {
                // The peer cannot be told the round is over (it would wait for the rest), so
                // report what was delivered and end here.
                if !args.json && !header_done {
                    println!("{}", BwStats::HEADER);
                }
                println!("{line}");
                if args.counters {
                    print_counters(args, &s);
                }
                let mut why = Vec::new();
                if r.outstanding > 0 {
                    why.push(format!(
                        "{} messages still outstanding {} s after the {} s run",
                        r.outstanding,
                        t.as_secs(),
                        window.as_secs_f64()
                    ));
                }
                if let Some((first, qps)) = &r.failure {
                    why.push(format!("{qps} QPs failed, the first with: {first}"));
                }
                return Err(format!("the timed run did not finish: {}", why.join("; ")));
            }
            line
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
        s.sync(args.round_sync(iters))?;
        s.sync(t)?;
        if !args.json && !header_done {
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
    if !args.json {
        println!("---------------------------------------------------------------------------------------");
    }
    if args.counters {
        print_counters(args, &s);
    }
    Ok(ExitCode::SUCCESS)
}

/// The result line of a timed round: the usual statistics over the whole window, then (JSON)
/// the window, each QP's share and what did not complete, or (text) each QP's average on a
/// second line.
fn timed_report(args: &PerfArgs, size: u64, window: Duration, r: &TimedBw) -> String {
    let st = BwStats::over(size, &r.times, window.as_nanos() as u64);
    let secs = window.as_secs_f64();
    let mb = (1u64 << 20) as f64;
    let per_qp_mb_s: Vec<f64> = r
        .per_qp
        .iter()
        .map(|&n| (n * size) as f64 / mb / secs)
        .collect();
    if args.json {
        let mut v = st.json();
        let extra = serde_json::json!({
            "duration_s": secs,
            "delivered_bytes": r.per_qp.iter().sum::<u64>() * size,
            "per_qp_bytes": r.per_qp.iter().map(|&n| n * size).collect::<Vec<_>>(),
            "per_qp_mb_s": per_qp_mb_s,
            "late_completions": r.late,
            "outstanding": r.outstanding,
            "failed_qps": r.failure.as_ref().map_or(0, |f| f.1),
            "error": r.failure.as_ref().map(|f| f.0.clone()),
            "finished": r.clean(),
        });
        if let (Some(o), serde_json::Value::Object(e)) = (v.as_object_mut(), extra) {
            o.extend(e);
        }
        v.to_string()
    } else {
        let per: Vec<String> = per_qp_mb_s.iter().map(|x| format!("{x:.2}")).collect();
        format!(
            "{}\n per-QP BW average[MB/sec] over {secs} s: {}",
            st.line(),
            per.join(" ")
        )
    }
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
        // And each QP's congestion state: how the flows of one run shared a bottleneck.
        let per_qp: Vec<serde_json::Value> = s
            .qps
            .iter()
            .map(|q| {
                let c = q.counters();
                let rtt = q.round_trip();
                serde_json::json!({
                    "cwnd": q.congestion_window(),
                    "srtt_us": rtt.map(|r| r.0.as_secs_f64() * 1e6),
                    "min_rtt_us": rtt.map(|r| r.1.as_secs_f64() * 1e6),
                    "retransmits": c.retransmits,
                    "rto_fired": c.rto_fired,
                    "sent_pkts": c.sent_pkts,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "counters": map,
                "per_qp": per_qp,
                "event_waits": s.channel.as_ref().map(|_| s.event_waits.get()),
            })
        );
    } else {
        println!(" Counters (this side):");
        for (k, v) in named {
            println!("   {k:<28} {v}");
        }
    }
}
