//! `ferroce`: the command-line face of ferroce.
//!
//! The binary holds no protocol logic: each subcommand parses its arguments, calls the library
//! crates and prints. Errors are one line on stderr and a non-zero exit, never a backtrace.
#![warn(missing_docs)]

mod chaos;
mod coll;
mod decode;
mod demo;
mod devices;
mod nvmf;
mod perf;
mod pingpong;
mod route;
mod sim;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A userspace RDMA stack speaking RoCE v2.
#[derive(Debug, Parser)]
#[command(name = "ferroce", version, about)]
struct Cli {
    /// Which provider moves the bytes: auto (shared memory to peers on this host, UDP to
    /// others), udp (RoCE v2 always), shm (shared memory always; a peer on another host is an
    /// error). Default: the FERROCE_PROVIDER environment variable, else auto.
    #[arg(long, global = true, value_name = "auto|udp|shm")]
    provider: Option<ferroce::Provider>,
    /// With no command: a guided demo on loopback.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode the RoCE v2 packets of a pcap file, one line each, checking every ICRC.
    Decode(decode::DecodeArgs),
    /// Run the RC transport through a seeded, lossy, simulated network and check its promises.
    Sim(sim::SimArgs),
    /// perftest-style latency and bandwidth tests (server, client, or --loopback).
    Perf(perf::PerfArgs),
    /// SEND/RECV ping-pong, a peer of rdma-core's ibv_rc_pingpong in either role (server
    /// without HOST, client with): its TCP exchange, defaults and output.
    Pingpong(pingpong::PingpongArgs),
    /// List devices and their GID tables, like ibv_devinfo.
    Devices,
    /// A fault-injecting relay between two ferroce peers (loss, reordering, duplication,
    /// corruption, delay, blackholes).
    Chaos(chaos::ChaosArgs),
    /// nccl-tests' all_reduce_perf over ferroce collectives (same flags, table and busbw);
    /// ranks from torchrun's or mpirun's environment, or `--ranks N` local ones.
    #[command(name = "all_reduce_perf")]
    AllReducePerf(coll::CollArgs),
    /// nccl-tests' all_gather_perf (see all_reduce_perf).
    #[command(name = "all_gather_perf")]
    AllGatherPerf(coll::CollArgs),
    /// nccl-tests' reduce_scatter_perf (see all_reduce_perf).
    #[command(name = "reduce_scatter_perf")]
    ReduceScatterPerf(coll::CollArgs),
    /// nccl-tests' broadcast_perf (see all_reduce_perf).
    #[command(name = "broadcast_perf")]
    BroadcastPerf(coll::CollArgs),
    /// nccl-tests' reduce_perf (see all_reduce_perf).
    #[command(name = "reduce_perf")]
    ReducePerf(coll::CollArgs),
    /// nccl-tests' alltoall_perf (see all_reduce_perf).
    #[command(name = "alltoall_perf")]
    AlltoallPerf(coll::CollArgs),
    /// nccl-tests' sendrecv_perf: each rank sends to the next and receives from the previous.
    #[command(name = "sendrecv_perf")]
    SendrecvPerf(coll::CollArgs),
    /// An NVMe over Fabrics target: one namespace per backing file (or --memory SIZE), served
    /// over RDMA until SIGINT.
    #[command(name = "nvmf-target")]
    NvmfTarget(nvmf::target::TargetArgs),
    /// A fio-like NVMe over Fabrics initiator: IOPS, throughput and latency percentiles,
    /// optionally verifying every read.
    #[command(name = "nvmf-perf")]
    NvmfPerf(nvmf::perf::PerfArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help and --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line, not clap's usage block: scripts and people both read it at a glance.
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            eprintln!("ferroce: {first} (see 'ferroce --help')");
            return ExitCode::from(2);
        }
    };
    match cli
        .provider
        .map(Ok)
        .unwrap_or_else(ferroce::Provider::from_env)
    {
        // Contexts read it when they open (ContextOptions::default); set before any thread.
        Ok(p) => std::env::set_var("FERROCE_PROVIDER", p.name()),
        Err(e) => {
            eprintln!("ferroce: {e}");
            return ExitCode::from(2);
        }
    }
    let Some(command) = cli.command else {
        return finish(demo::run());
    };
    let result = match command {
        Command::Decode(args) => decode::run(&args),
        Command::Sim(args) => sim::run(&args),
        Command::Perf(args) => perf::run(&args),
        Command::Pingpong(args) => pingpong::run(&args),
        Command::Devices => devices::run(),
        Command::Chaos(args) => chaos::run(&args),
        Command::AllReducePerf(args) => coll::run(coll::Collective::AllReduce, &args),
        Command::AllGatherPerf(args) => coll::run(coll::Collective::AllGather, &args),
        Command::ReduceScatterPerf(args) => coll::run(coll::Collective::ReduceScatter, &args),
        Command::BroadcastPerf(args) => coll::run(coll::Collective::Broadcast, &args),
        Command::ReducePerf(args) => coll::run(coll::Collective::Reduce, &args),
        Command::AlltoallPerf(args) => coll::run(coll::Collective::Alltoall, &args),
        Command::SendrecvPerf(args) => coll::run(coll::Collective::Sendrecv, &args),
        Command::NvmfTarget(args) => nvmf::target::run(&args),
        Command::NvmfPerf(args) => nvmf::perf::run(&args),
    };
    finish(result)
}

fn finish(result: Result<ExitCode, String>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("ferroce: {msg}");
            ExitCode::from(2)
        }
    }
}
