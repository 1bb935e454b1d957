//! `ferroce all_reduce_perf` and its siblings: nccl-tests' tools over ferroce collectives.
//!
//! Same flags (`-b -e -f -i -n -w -c -d -o -r -a`, plus `-g`/`-t`, which must be 1), same table
//! (size, count, type, redop, root, then time, algbw, busbw and `#wrong` for out-of-place and
//! in-place), same footer and the same bus-bandwidth formulas, so its figures sit beside NCCL's
//! and Gloo's. `#wrong` counts, over every rank, the elements that differ from what the
//! collective must produce (checked after one run of each size, when `-c 1`).
//!
//! Ranks come from the launcher's environment (torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/
//! `MASTER_PORT`, or `mpirun -x MASTER_ADDR -x MASTER_PORT`), or `--ranks N` starts N local ranks
//! itself (this process is rank 0). With neither, it runs one rank.

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use ferroce_coll::{
    finish_avg, reduce_into, CommOptions, Communicator, DataType, RankInfo, ReduceOp, Store,
};

/// Which collective a tool measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Collective {
    /// all_reduce_perf.
    AllReduce,
    /// all_gather_perf.
    AllGather,
    /// reduce_scatter_perf.
    ReduceScatter,
    /// broadcast_perf.
    Broadcast,
    /// reduce_perf.
    Reduce,
    /// alltoall_perf.
    Alltoall,
    /// sendrecv_perf.
    Sendrecv,
}

/// nccl-tests' flags.
#[derive(Debug, Clone, Args)]
pub struct CollArgs {
    /// Smallest size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "32M", value_parser = parse_size)]
    minbytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    maxbytes: usize,
    /// Multiply the size by this between steps (instead of adding `-i`).
    #[arg(short = 'f', long = "stepfactor")]
    stepfactor: Option<u64>,
    /// Add this many bytes between steps.
    #[arg(short = 'i', long = "stepbytes", default_value = "1M", value_parser = parse_size)]
    stepbytes: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Untimed iterations before them.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Check every element of the result (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    check: u8,
    /// Element type: float, double, half, bfloat16, int32, int64, uint8.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    datatype: String,
    /// Reduction: sum, prod, min, max, avg.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    op: String,
    /// Root of broadcast and reduce.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// How the ranks' times combine: 0 rank 0's, 1 average, 2 minimum, 3 maximum.
    #[arg(short = 'a', long = "average", default_value_t = 1)]
    average: u8,
    /// Devices per rank (nccl-tests' GPUs per thread): ferroce has one.
    #[arg(short = 'g', long = "ngpus", default_value_t = 1)]
    ngpus: u32,
    /// Threads per process: one.
    #[arg(short = 't', long = "nthreads", default_value_t = 1)]
    nthreads: u32,
    /// Start this many local ranks (this process is rank 0) instead of joining the job the
    /// environment describes.
    #[arg(long)]
    ranks: Option<usize>,
    /// Seconds a collective may go without progress before it fails.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

/// Sizes like nccl-tests': a number with an optional K, M or G (powers of 1024).
pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("'{s}' is not a size (a number with an optional K, M or G)"))
}

impl Collective {
    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce_perf",
            Collective::AllGather => "all_gather_perf",
            Collective::ReduceScatter => "reduce_scatter_perf",
            Collective::Broadcast => "broadcast_perf",
            Collective::Reduce => "reduce_perf",
            Collective::Alltoall => "alltoall_perf",
            Collective::Sendrecv => "sendrecv_perf",
        }
    }

    fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        )
    }

    fn rooted(self) -> bool {
        matches!(self, Collective::Broadcast | Collective::Reduce)
    }

    /// nccl-tests' bus bandwidth factor: what each rank's link carries per byte of the
    /// collective's size.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter | Collective::Alltoall => {
                (n - 1.0) / n
            }
            Collective::Broadcast | Collective::Reduce | Collective::Sendrecv => 1.0,
        }
    }

    /// For a size of `bytes`: the elements per rank nccl-tests prints as the count, and the
    /// bytes of the input and output buffers (whole elements, whole blocks).
    fn shape(self, bytes: usize, es: usize, n: usize) -> (usize, usize, usize) {
        let count = bytes / es;
        match self {
            Collective::AllGather => (count / n, count / n * es, count / n * n * es),
            Collective::ReduceScatter => (count / n, count / n * n * es, count / n * es),
            Collective::Alltoall => (count / n, count / n * n * es, count / n * n * es),
            _ => (count, count * es, count * es),
        }
    }
}

/// Element `i` of the test stream `seed`: small integers, so every reduction is exact in every
/// type whatever order the ranks combine them in (only 1 and 2 for products).
fn stream(t: DataType, op: ReduceOp, seed: usize, elems: usize) -> Vec<u8> {
    let mut v = vec![0u8; elems * t.size()];
    for (i, e) in v.chunks_mut(t.size()).enumerate() {
        let x = if op == ReduceOp::Prod {
            ((i + seed) % 2 + 1) as u8
        } else {
            ((i * 7 + seed * 3) % 4 + 1) as u8
        };
        match t {
            DataType::I32 => e.copy_from_slice(&i32::from(x).to_ne_bytes()),
            DataType::I64 => e.copy_from_slice(&i64::from(x).to_ne_bytes()),
            DataType::U8 => e[0] = x,
            DataType::F32 => e.copy_from_slice(&f32::from(x).to_ne_bytes()),
            DataType::F64 => e.copy_from_slice(&f64::from(x).to_ne_bytes()),
            DataType::F16 => e.copy_from_slice(&half_bits(f32::from(x), false).to_ne_bytes()),
            DataType::Bf16 => e.copy_from_slice(&half_bits(f32::from(x), true).to_ne_bytes()),
        }
    }
    v
}

/// The f16 (or bf16) bits of a small integer.
fn half_bits(x: f32, bf16: bool) -> u16 {
    if bf16 {
        (x.to_bits() >> 16) as u16
    } else if x == 0.0 {
        0
    } else {
        // Small positive integers: exponent and mantissa of f32 moved to f16's fields.
        let b = x.to_bits();
        let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
        ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
    }
}

/// Elements of `got` that differ from `want`.
fn wrong(got: &[u8], want: &[u8], es: usize) -> u64 {
    got.chunks(es)
        .zip(want.chunks(es))
        .filter(|(a, b)| a != b)
        .count() as u64
}

/// The reduction of streams `seeds` with `op` (avg finished over `n` ranks).
fn reduced(t: DataType, op: ReduceOp, seeds: impl Iterator<Item = usize>, elems: usize) -> Vec<u8> {
    let mut acc: Option<Vec<u8>> = None;
    let mut n = 0;
    for s in seeds {
        n += 1;
        let v = stream(t, op, s, elems);
        match &mut acc {
            None => acc = Some(v),
            Some(a) => {
                let _ = reduce_into(a, &v, t, op);
            }
        }
    }
    let mut acc = acc.unwrap_or_default();
    if op == ReduceOp::Avg {
        let _ = finish_avg(&mut acc, t, n);
    }
    acc
}

/// One rank's run of one collective at one size.
struct Case {
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    /// Elements per rank (the printed count).
    count: usize,
    in_bytes: usize,
    out_bytes: usize,
}

impl Case {
    /// This rank's input.
    fn input(&self, rank: usize, n: usize) -> Vec<u8> {
        let (t, op, es) = (self.dtype, self.op, self.dtype.size());
        match self.coll {
            Collective::ReduceScatter | Collective::Alltoall => (0..n)
                .flat_map(|b| stream(t, op, rank * n + b, self.in_bytes / n / es))
                .collect(),
            Collective::Broadcast => stream(t, op, 1000 + self.root, self.in_bytes / es),
            _ => stream(t, op, rank, self.in_bytes / es),
        }
    }

    /// What this rank's output must hold (`None`: nothing to check here).
    fn expected(&self, rank: usize, n: usize) -> Option<Vec<u8>> {
        let (t, op, es) = (self.dtype, self.op, self.dtype.size());
        let elems = self.out_bytes / es;
        Some(match self.coll {
            Collective::AllReduce => reduced(t, op, 0..n, elems),
            Collective::Reduce if rank == self.root => reduced(t, op, 0..n, elems),
            Collective::Reduce => return None,
            Collective::AllGather => (0..n).flat_map(|r| stream(t, op, r, elems / n)).collect(),
            Collective::ReduceScatter => reduced(t, op, (0..n).map(|r| r * n + rank), elems),
            Collective::Alltoall => (0..n)
                .flat_map(|i| stream(t, op, i * n + rank, elems / n))
                .collect(),
            Collective::Broadcast => stream(t, op, 1000 + self.root, elems),
            Collective::Sendrecv => stream(t, op, (rank + n - 1) % n, elems),
        })
    }

    /// Runs the collective once: out of place from `input` into `output`, or in place in
    /// `output` (which then holds the input as nccl-tests lays it out in place). Returns the
    /// bytes holding the result.
    fn run(
        &self,
        comm: &mut Communicator,
        input: &[u8],
        output: &mut [u8],
        in_place: bool,
    ) -> Result<std::ops::Range<usize>, ferroce_coll::CollError> {
        let (n, r) = (comm.size(), comm.rank());
        let (t, op) = (self.dtype, self.op);
        let all = 0..self.out_bytes;
        match (self.coll, in_place) {
            (Collective::AllReduce, false) => comm.allreduce_into(input, output, t, op)?,
            (Collective::AllReduce, true) => comm.allreduce(output, t, op)?,
            (Collective::AllGather, false) => comm.allgather(input, output)?,
            (Collective::AllGather, true) => comm.allgather_in_place(output)?,
            (Collective::ReduceScatter, false) => comm.reduce_scatter(input, output, t, op)?,
            (Collective::ReduceScatter, true) => {
                comm.reduce_scatter_in_place(output, t, op)?;
                return Ok(r * self.out_bytes..(r + 1) * self.out_bytes);
            }
            (Collective::Broadcast, false) => comm.broadcast_into(input, output, self.root)?,
            (Collective::Broadcast, true) => comm.broadcast(output, self.root)?,
            (Collective::Reduce, false) => comm.reduce(input, output, t, op, self.root)?,
            (Collective::Reduce, true) => comm.reduce_in_place(output, t, op, self.root)?,
            (Collective::Alltoall, false) => comm.alltoall(input, output)?,
            (Collective::Alltoall, true) => comm.alltoall_in_place(output)?,
            (Collective::Sendrecv, false) => {
                comm.sendrecv(input, (r + 1) % n, output, (r + n - 1) % n)?
            }
            (Collective::Sendrecv, true) => {
                let mine = output.to_vec();
                comm.sendrecv(&mine, (r + 1) % n, output, (r + n - 1) % n)?
            }
        }
        Ok(all)
    }

    /// The buffer an in-place run starts from.
    fn in_place_buffer(&self, input: &[u8], rank: usize) -> Vec<u8> {
        match self.coll {
            Collective::AllGather => {
                let mut b = vec![0u8; self.out_bytes];
                b[rank * input.len()..(rank + 1) * input.len()].copy_from_slice(input);
                b
            }
            _ => input.to_vec(),
        }
    }
}

/// One column's outcome on this rank: seconds per run, elements wrong.
fn measure(
    comm: &mut Communicator,
    case: &Case,
    args: &CollArgs,
    in_place: bool,
) -> Result<(f64, u64), String> {
    let (n, r) = (comm.size(), comm.rank());
    let fail = |e: ferroce_coll::CollError| format!("rank {r}: {}: {e}", case.coll.name());
    let input = case.input(r, n);
    let fresh = |input: &[u8]| {
        if in_place {
            case.in_place_buffer(input, r)
        } else {
            vec![0u8; case.out_bytes]
        }
    };
    let mut output = fresh(&input);
    for _ in 0..args.warmup {
        case.run(comm, &input, &mut output, in_place)
            .map_err(fail)?;
    }
    comm.barrier().map_err(fail)?;
    let started = Instant::now();
    for _ in 0..args.iters {
        case.run(comm, &input, &mut output, in_place)
            .map_err(fail)?;
    }
    let took = started.elapsed().as_secs_f64() / args.iters.max(1) as f64;
    let mut wrong_here = 0;
    if args.check != 0 {
        let mut output = fresh(&input);
        let at = case
            .run(comm, &input, &mut output, in_place)
            .map_err(fail)?;
        if let Some(want) = case.expected(r, n) {
            wrong_here = wrong(&output[at], &want, case.dtype.size());
        }
    }
    Ok((took, wrong_here))
}

/// Combines a per-rank figure over the ranks with `op`.
fn combine(comm: &mut Communicator, v: f64, op: ReduceOp) -> Result<f64, String> {
    let mut b = v.to_ne_bytes();
    comm.allreduce(&mut b, DataType::F64, op)
        .map_err(|e| format!("rank {}: combining results: {e}", comm.rank()))?;
    Ok(f64::from_ne_bytes(b))
}

/// Runs a tool: as the launcher of `--ranks N`, or as one rank.
pub fn run(coll: Collective, args: &CollArgs) -> Result<ExitCode, String> {
    if args.ngpus != 1 || args.nthreads != 1 {
        return Err("ferroce runs one rank per process: -g and -t must be 1".into());
    }
    let dtype: DataType = args.datatype.parse().map_err(|_| {
        format!(
            "datatype '{}' is not supported (ferroce has: {})",
            args.datatype,
            DataType::ALL.map(DataType::name).join(", ")
        )
    })?;
    let op: ReduceOp = args.op.parse().map_err(|_| {
        format!(
            "op '{}' is not supported (ferroce has: {})",
            args.op,
            ReduceOp::ALL.map(ReduceOp::name).join(", ")
        )
    })?;
    if args.minbytes > args.maxbytes {
        return Err(format!(
            "-b {} is larger than -e {}",
            args.minbytes, args.maxbytes
        ));
    }
    if args.stepfactor.is_some_and(|f| f < 2) && args.minbytes < args.maxbytes {
        return Err("-f must be at least 2".into());
    }
    if args.stepfactor.is_none() && args.stepbytes == 0 && args.minbytes < args.maxbytes {
        return Err("-i must be at least 1".into());
    }
    if args.average > 3 {
        return Err("-a takes 0 (rank 0), 1 (average), 2 (minimum) or 3 (maximum)".into());
    }
    let opts = CommOptions {
        timeout: Duration::from_secs(args.timeout.max(1)),
        provider: ferroce::Provider::from_env().map_err(|e| e.to_string())?,
        ..CommOptions::default()
    };
    // The rendezvous: local ranks this process starts, the launcher's job, or one rank alone.
    let mut children: Vec<Child> = Vec::new();
    let (store, master) = match args.ranks {
        Some(0) => return Err("--ranks must be at least 1".into()),
        Some(n) => {
            let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            let master = listener.local_addr().map_err(|e| e.to_string())?;
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let mut argv: Vec<String> = std::env::args().skip(1).collect();
            strip_ranks(&mut argv);
            for rank in 1..n {
                let child = Command::new(&exe)
                    .args(&argv)
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("MASTER_ADDR", master.ip().to_string())
                    .env("MASTER_PORT", master.port().to_string())
                    .spawn()
                    .map_err(|e| format!("starting rank {rank}: {e}"))?;
                children.push(child);
            }
            let store = Store::serve(listener, n, opts.timeout).map_err(|e| e.to_string())?;
            (store, master)
        }
        None if std::env::var_os("RANK").is_some()
            || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()
            || std::env::var_os("PMI_RANK").is_some() =>
        {
            let info = RankInfo::from_env().map_err(|e| e.to_string())?;
            let store = Store::join(&info, opts.timeout).map_err(|e| e.to_string())?;
            (store, info.master)
        }
        None => {
            let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            let master: SocketAddr = listener.local_addr().map_err(|e| e.to_string())?;
            let store = Store::serve(listener, 1, opts.timeout).map_err(|e| e.to_string())?;
            (store, master)
        }
    };
    let outcome = run_rank(coll, args, dtype, op, store, master, &opts);
    let mut failed_children = 0;
    for mut c in children {
        if !c.wait().is_ok_and(|s| s.success()) {
            failed_children += 1;
        }
    }
    match outcome {
        Err(e) => Err(e),
        Ok(wrong) if wrong > 0 || failed_children > 0 => Ok(ExitCode::from(1)),
        Ok(_) => Ok(ExitCode::SUCCESS),
    }
}

/// Drops `--ranks N` (or `--ranks=N`) from the arguments a child rank gets.
fn strip_ranks(argv: &mut Vec<String>) {
    let mut i = 0;
    while i < argv.len() {
        if argv[i] == "--ranks" {
            argv.drain(i..(i + 2).min(argv.len()));
        } else if argv[i].starts_with("--ranks=") {
            argv.remove(i);
        } else {
            i += 1;
        }
    }
}

/// One rank's whole run; returns the elements wrong over every rank and size.
fn run_rank(
    coll: Collective,
    args: &CollArgs,
    dtype: DataType,
    op: ReduceOp,
    store: Store,
    master: SocketAddr,
    opts: &CommOptions,
) -> Result<u64, String> {
    let mut comm = Communicator::with_store(store, master, opts).map_err(|e| e.to_string())?;
    let (n, r) = (comm.size(), comm.rank());
    if args.root >= n && coll.rooted() {
        return Err(format!("-r {} names no rank (there are {n})", args.root));
    }
    // Each rank's device line reaches rank 0 through the rendezvous.
    let providers: Vec<&str> = (0..n)
        .filter_map(|p| comm.provider_to(p).map(|p| p.name()))
        .collect();
    let line = format!(
        "#  Rank {r:2} Group  0 Pid {:6} on {:>10} device  0 [{}] ferroce, links: {}",
        std::process::id(),
        hostname(),
        opts.device.clone().unwrap_or_else(|| "auto".into()),
        summarize(&providers),
    );
    let lines = comm
        .store()
        .ok_or("no rendezvous")?
        .all_gather(line.as_bytes())
        .map_err(|e| e.to_string())?;
    let lead = r == 0;
    if lead {
        let step = match args.stepfactor {
            Some(f) => format!("{f}(factor)"),
            None => format!("{}(bytes)", args.stepbytes),
        };
        println!(
            "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} \
             agg iters: 1 validation: {} graph: 0",
            args.minbytes, args.maxbytes, args.warmup, args.iters, args.check
        );
        println!("#");
        println!("# Using devices");
        for l in &lines {
            println!("{}", String::from_utf8_lossy(l));
        }
        println!("#");
        println!(
            "#                                                              out-of-place                       in-place          "
        );
        println!(
            "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
        );
        println!(
            "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       "
        );
    }
    let combine_op = match args.average {
        2 => ReduceOp::Min,
        3 => ReduceOp::Max,
        _ => ReduceOp::Sum,
    };
    let mut bw_sum = 0.0;
    let mut bw_count = 0;
    let mut wrong_total = 0u64;
    let mut size = args.minbytes;
    loop {
        let (count, in_bytes, out_bytes) = coll.shape(size, dtype.size(), n);
        let case = Case {
            coll,
            dtype,
            op,
            root: args.root,
            count,
            in_bytes,
            out_bytes,
        };
        let mut row = format!(
            "{:12}  {:12}  {:>8}  {:>6}  {:6}",
            in_bytes.max(out_bytes),
            case.count,
            dtype.name(),
            if coll.reduces() { op.name() } else { "none" },
            if coll.rooted() { args.root as i64 } else { -1 },
        );
        for in_place in [false, true] {
            let (took, wrong_here) = measure(&mut comm, &case, args, in_place)?;
            let mut took = match args.average {
                0 => {
                    let mut b = if lead { took } else { 0.0 }.to_ne_bytes();
                    comm.allreduce(&mut b, DataType::F64, ReduceOp::Sum)
                        .map_err(|e| e.to_string())?;
                    f64::from_ne_bytes(b)
                }
                _ => combine(&mut comm, took, combine_op)?,
            };
            if args.average == 1 {
                took /= n as f64;
            }
            let wrong_all = combine(&mut comm, wrong_here as f64, ReduceOp::Sum)? as u64;
            wrong_total += wrong_all;
            let algbw = in_bytes.max(out_bytes) as f64 / took / 1e9;
            let busbw = algbw * coll.bus_factor(n);
            bw_sum += busbw;
            bw_count += 1;
            let time = if took * 1e6 >= 10_000.0 {
                format!("{:7.0}", took * 1e6)
            } else {
                format!("{:7.2}", took * 1e6)
            };
            let wrong_text = if args.check != 0 {
                wrong_all.to_string()
            } else {
                "N/A".into()
            };
            row.push_str(&format!(
                "  {time}  {algbw:6.2}  {busbw:6.2}  {wrong_text:>5}"
            ));
        }
        if lead {
            println!("{row}");
        }
        let next = match args.stepfactor {
            Some(f) => size.saturating_mul(f as usize),
            None => size.saturating_add(args.stepbytes),
        };
        if size >= args.maxbytes || next > args.maxbytes || next == size {
            break;
        }
        size = next;
    }
    if lead {
        println!(
            "# Out of bounds values : {wrong_total} {}",
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
        println!(
            "# Avg bus bandwidth    : {:.6} ",
            bw_sum / bw_count.max(1) as f64
        );
        println!("#");
    }
    Ok(wrong_total)
}

/// "3 shm" or "1 shm, 2 udp": how this rank reaches the others.
fn summarize(providers: &[&str]) -> String {
    if providers.is_empty() {
        return "none".into();
    }
    let mut names: Vec<&str> = providers.to_vec();
    names.sort_unstable();
    names.dedup();
    names
        .iter()
        .map(|n| format!("{} {n}", providers.iter().filter(|p| *p == n).count()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}
