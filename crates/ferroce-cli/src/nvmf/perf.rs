//! `ferroce nvmf-perf`: a fio-like initiator. It brings a controller up on the target, opens
//! one I/O queue of `--qd` commands and runs the workload for `--time` seconds; it prints IOPS,
//! throughput and latency percentiles. With `--verify` every block of the working set is
//! written first with a pattern naming its unit and generation, writes advance the
//! generation, and every read is compared byte for byte with what the host last wrote there.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferroce_nvmf::rdma::initiator::{Controller, HostCm, HostOptions, Queue};
use ferroce_nvmf::rdma::wire_host::WireHost;

/// The workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Rw {
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads and writes, half each.
    Randrw,
}

/// `ferroce nvmf-perf` arguments.
#[derive(Debug, Args)]
pub struct PerfArgs {
    /// The target's address.
    #[arg(long)]
    target: IpAddr,
    /// The NVMe-oF service (port).
    #[arg(long, default_value_t = 4420)]
    port: u16,
    /// The subsystem's NQN.
    #[arg(long)]
    nqn: String,
    /// The workload.
    #[arg(long, value_enum)]
    rw: Rw,
    /// Bytes per command (K, M or G), whole blocks.
    #[arg(long, value_parser = crate::coll::parse_size)]
    bs: usize,
    /// Commands in flight.
    #[arg(long, default_value_t = 1)]
    qd: u16,
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    time: f64,
    /// Bytes of the namespace to use from its start (K, M or G; default: all of it, at most
    /// 1 GiB).
    #[arg(long, value_parser = crate::coll::parse_size)]
    size: Option<usize>,
    /// Write the working set first, then check every read against what was written.
    #[arg(long)]
    verify: bool,
    /// How queues connect: ib (IB CM on the wire, as the kernel's rdma_cm: kernel targets and
    /// RDMA NICs), tcp (ferroce's exchange: ferroce targets, also on this host), or auto (tcp
    /// where the target's TCP port answers, else ib).
    #[arg(long, value_enum, default_value_t = CmChoice::Auto)]
    cm: CmChoice,
}

/// `--cm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CmChoice {
    /// TCP where it answers, else the wire.
    Auto,
    /// ferroce's TCP exchange.
    Tcp,
    /// IB CM on the wire.
    Ib,
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The bytes of `unit` at generation `generation`: every 8 bytes name both and their place.
fn pattern(unit: u64, generation: u32, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut i = 0u64;
    while v.len() < len {
        let word = unit << 32 ^ u64::from(generation) << 20 ^ i ^ 0x9E37_79B9_7F4A_7C15;
        v.extend_from_slice(&word.to_le_bytes());
        i += 1;
    }
    v.truncate(len);
    v
}

/// A command in flight.
struct InFlight {
    unit: u64,
    write: bool,
    generation: u32,
    started: Instant,
}

struct Run<'a> {
    queue: &'a mut Queue,
    ns: ferroce_nvmf::rdma::initiator::NamespaceInfo,
    bs: usize,
    blocks_per_unit: u32,
    units: u64,
    slots: Vec<Option<InFlight>>,
    busy_units: HashSet<u64>,
    generations: Vec<u32>,
    latencies_ns: Vec<u64>,
    done: u64,
    errors: u64,
    checked: u64,
    mismatches: u64,
}

impl Run<'_> {
    fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(Option::is_none)
    }

    fn submit(&mut self, unit: u64, write: bool) -> Result<(), String> {
        let slot = self.free_slot().ok_or("no free slot")?;
        let generation = if write {
            self.generations[unit as usize] + 1
        } else {
            self.generations[unit as usize]
        };
        if write {
            self.queue
                .fill(slot, &pattern(unit, generation, self.bs))
                .map_err(|e| e.to_string())?;
        }
        self.queue
            .submit_io(
                write,
                &self.ns,
                unit * u64::from(self.blocks_per_unit),
                self.blocks_per_unit,
                slot,
            )
            .map_err(|e| e.to_string())?;
        self.busy_units.insert(unit);
        self.slots[slot] = Some(InFlight {
            unit,
            write,
            generation,
            started: Instant::now(),
        });
        Ok(())
    }

    fn reap(&mut self, verify: bool) -> Result<(), String> {
        let got = self
            .queue
            .reap(Duration::from_millis(100))
            .map_err(|e| e.to_string())?;
        for (c, slot) in got {
            let f = self.slots[slot]
                .take()
                .ok_or("a response for an idle slot")?;
            self.busy_units.remove(&f.unit);
            self.latencies_ns
                .push(f.started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64);
            self.done += 1;
            if !c.status.is_success() {
                self.errors += 1;
                if self.errors <= 5 {
                    eprintln!("nvmf-perf: unit {} failed: {:?}", f.unit, c.status);
                }
                continue;
            }
            if f.write {
                self.generations[f.unit as usize] = f.generation;
            } else if verify && f.generation > 0 {
                let got = self
                    .queue
                    .slot_bytes(slot, self.bs)
                    .map_err(|e| e.to_string())?;
                self.checked += 1;
                if got != pattern(f.unit, f.generation, self.bs) {
                    self.mismatches += 1;
                    if self.mismatches <= 5 {
                        eprintln!("nvmf-perf: unit {} read back other bytes", f.unit);
                    }
                }
            }
        }
        Ok(())
    }
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// Runs the initiator.
pub fn run(args: &PerfArgs) -> Result<ExitCode, String> {
    if args.qd == 0 || args.qd > 127 {
        return Err(format!("--qd {}: 1 to 127", args.qd));
    }
    if !(args.time > 0.0 && args.time <= 86_400.0) {
        return Err(format!("--time {}: more than 0, at most a day", args.time));
    }
    let local = crate::route::source_for(args.target)?;
    let ctx = super::open_context(local)?;
    let mut host_id = [0u8; 16];
    host_id[..8].copy_from_slice(b"ferroce\0");
    host_id[8..12].copy_from_slice(&std::process::id().to_be_bytes());
    let options = HostOptions {
        hostnqn: format!(
            "nqn.2014-08.org.nvmexpress:uuid:ferroce-{}",
            std::process::id()
        ),
        host_id,
        subnqn: args.nqn.clone(),
        io_queue_entries: args.qd + 1,
        max_transfer: args.bs,
        timeout: Duration::from_secs(10),
        cm: HostCm::Tcp,
        // Three of the Keep Alives the run sends every 5 s when idle (Linux asks for 5 s).
        keep_alive_timeout: Duration::from_secs(15),
    };
    let target = SocketAddr::new(args.target, args.port);
    let tcp = match args.cm {
        CmChoice::Tcp => true,
        CmChoice::Ib => false,
        CmChoice::Auto => {
            std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2)).is_ok()
        }
    };
    let cm = if tcp {
        HostCm::Tcp
    } else {
        HostCm::Wire(
            WireHost::open(&ctx).map_err(|e| format!("starting the IB CM on {local}: {e}"))?,
        )
    };
    let options = HostOptions { cm, ..options };
    let mut ctrl = Controller::connect(ctx.clone(), target, options)
        .map_err(|e| format!("connecting to {target}: {e}"))?;
    let ns = ctrl.namespace;
    if args.bs == 0 || args.bs % ns.block_size != 0 {
        return Err(format!(
            "--bs {}: whole blocks of {} bytes",
            args.bs, ns.block_size
        ));
    }
    if let Some(m) = ctrl.max_transfer.filter(|&m| args.bs > m) {
        return Err(format!(
            "--bs {}: the controller takes at most {m}",
            args.bs
        ));
    }
    let ns_bytes = ns.blocks.saturating_mul(ns.block_size as u64);
    let size = args
        .size
        .map(|s| s as u64)
        .unwrap_or(ns_bytes.min(1 << 30))
        .min(ns_bytes);
    let units = size / args.bs as u64;
    if units < u64::from(args.qd) {
        return Err(format!(
            "{size} bytes of namespace hold {units} commands of {} B: fewer than --qd",
            args.bs
        ));
    }
    let mut queue = ctrl
        .io_queue(1, args.bs)
        .map_err(|e| format!("connecting the I/O queue: {e}"))?;
    let mut run = Run {
        slots: (0..usize::from(args.qd).min(queue.slots()))
            .map(|_| None)
            .collect(),
        queue: &mut queue,
        ns,
        bs: args.bs,
        blocks_per_unit: (args.bs / ns.block_size) as u32,
        units,
        busy_units: HashSet::new(),
        generations: vec![0; units as usize],
        latencies_ns: Vec::new(),
        done: 0,
        errors: 0,
        checked: 0,
        mismatches: 0,
    };
    if args.verify {
        // Every unit written once, so that every read has something to be checked against.
        let mut next = 0u64;
        let mut keep_alive = Instant::now();
        while next < run.units || run.slots.iter().any(Option::is_some) {
            if keep_alive.elapsed() > Duration::from_secs(5) {
                keep_alive = Instant::now();
                ctrl_keep_alive(&mut ctrl)?;
            }
            while next < run.units && run.free_slot().is_some() && run.queue.can_submit() {
                run.submit(next, true)?;
                next += 1;
            }
            run.reap(true)?;
        }
        if run.errors > 0 {
            return Err(format!("{} writes of the first pass failed", run.errors));
        }
        run.latencies_ns.clear();
        run.done = 0;
    }
    let mut rng = Rng(0x2545_F491_4F6C_DD1D ^ u64::from(std::process::id()));
    let mut cursor = 0u64;
    let start = Instant::now();
    let limit = Duration::from_secs_f64(args.time);
    let mut keep_alive = Instant::now();
    loop {
        let running = start.elapsed() < limit;
        if !running && run.slots.iter().all(Option::is_none) {
            break;
        }
        while running && run.free_slot().is_some() && run.queue.can_submit() {
            let (unit, write) = match args.rw {
                Rw::Read | Rw::Write => {
                    let u = cursor % run.units;
                    cursor += 1;
                    (u, args.rw == Rw::Write)
                }
                Rw::Randread => (rng.below(run.units), false),
                Rw::Randwrite => (rng.below(run.units), true),
                Rw::Randrw => (rng.below(run.units), rng.below(2) == 0),
            };
            if run.busy_units.contains(&unit) {
                // NVMe orders nothing between commands in flight: never two on one unit.
                break;
            }
            run.submit(unit, write)?;
        }
        run.reap(args.verify)?;
        if keep_alive.elapsed() > Duration::from_secs(5) {
            keep_alive = Instant::now();
            ctrl_keep_alive(&mut ctrl)?;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let mut lat = std::mem::take(&mut run.latencies_ns);
    lat.sort_unstable();
    let avg = lat.iter().sum::<u64>() as f64 / lat.len().max(1) as f64 / 1000.0;
    let iops = run.done as f64 / secs;
    println!(
        "nvmf-perf: {:?} bs={} qd={} time={secs:.1}s namespace {} blocks of {} B",
        args.rw, args.bs, args.qd, ns.blocks, ns.block_size
    );
    println!(
        "  IOPS {iops:.0}  throughput {:.1} MB/s  lat us: avg {avg:.1} p50 {:.1} p99 {:.1} \
         p99.9 {:.1} max {:.1}",
        iops * args.bs as f64 / 1e6,
        percentile(&lat, 0.50),
        percentile(&lat, 0.99),
        percentile(&lat, 0.999),
        percentile(&lat, 1.0),
    );
    if args.verify {
        println!(
            "  verify: {} reads checked, {} mismatches",
            run.checked, run.mismatches
        );
    }
    println!("  errors: {}", run.errors);
    println!("  transport: {}", super::transport_summary(&ctx));
    if run.errors > 0 || run.mismatches > 0 {
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn ctrl_keep_alive(ctrl: &mut Controller) -> Result<(), String> {
    ctrl.keep_alive().map_err(|e| format!("keep alive: {e}"))
}
