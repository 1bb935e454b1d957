//! `ferroce nvmf-target`: serves one namespace per backing file (or one in memory) to NVMe-oF
//! hosts until SIGINT or SIGTERM, then prints its counters.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use ferroce_nvmf::controllers::{Subsystem, Target, TargetConfig};
use ferroce_nvmf::namespace::{FileBacking, MemoryBacking, Namespace};
use ferroce_nvmf::rdma::target::{QueueLimits, Server};

/// `ferroce nvmf-target` arguments.
#[derive(Debug, Args)]
pub struct TargetArgs {
    /// The subsystem's NQN.
    #[arg(long)]
    nqn: String,
    /// The address to serve on (a ferroce device's).
    #[arg(long)]
    listen: IpAddr,
    /// The NVMe-oF service (port).
    #[arg(long, default_value_t = 4420)]
    port: u16,
    /// A namespace in memory of this size (K, M or G) instead of files.
    #[arg(long, value_parser = crate::coll::parse_size)]
    memory: Option<usize>,
    /// Logical block size in bytes (512 or 4096).
    #[arg(long, default_value_t = 512)]
    block_size: usize,
    /// The largest transfer of one command, as a power of two of 4 KiB (MDTS).
    #[arg(long, default_value_t = 8)]
    mdts: u8,
    /// Backing files or block devices, a namespace each (IDs 1, 2, ...).
    files: Vec<std::path::PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Release);
}

fn namespaces(args: &TargetArgs) -> Result<Vec<Namespace>, String> {
    let block_shift = match args.block_size {
        512 => 9,
        4096 => 12,
        b => return Err(format!("--block-size {b}: 512 or 4096")),
    };
    let mut out = Vec::new();
    match (&args.memory, args.files.is_empty()) {
        (Some(_), false) => return Err("--memory or files, not both".into()),
        (None, true) => return Err("nothing to serve: give files or --memory SIZE".into()),
        (Some(len), true) => {
            if *len < args.block_size || len % args.block_size != 0 {
                return Err(format!(
                    "--memory {len}: whole blocks of {}",
                    args.block_size
                ));
            }
            out.push(Namespace {
                nsid: 1,
                block_shift,
                backing: Box::new(MemoryBacking::new(*len)),
                nguid: nguid(1),
            });
        }
        (None, false) => {
            for (i, f) in args.files.iter().enumerate() {
                let b = FileBacking::open(f).map_err(|e| format!("{}: {e}", f.display()))?;
                let nsid = i as u32 + 1;
                out.push(Namespace {
                    nsid,
                    block_shift,
                    backing: Box::new(b),
                    nguid: nguid(nsid),
                });
            }
        }
    }
    Ok(out)
}

/// A namespace's globally unique ID: this process's and the namespace's.
fn nguid(nsid: u32) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[..4].copy_from_slice(b"FRCE");
    g[4..8].copy_from_slice(&std::process::id().to_be_bytes());
    g[12..].copy_from_slice(&nsid.to_be_bytes());
    g
}

/// Runs the target.
pub fn run(args: &TargetArgs) -> Result<ExitCode, String> {
    if !(1..=12).contains(&args.mdts) {
        return Err(format!("--mdts {}: 1 to 12", args.mdts));
    }
    let namespaces = namespaces(args)?;
    let ctx = super::open_context(args.listen)?;
    let config = TargetConfig {
        max_queue_entries: 128,
        max_io_queues: 16,
        in_capsule_data: 8192,
        mdts: args.mdts,
        listen: (
            args.listen.to_string(),
            args.port.to_string(),
            args.listen.is_ipv6(),
        ),
    };
    let subsystem = Subsystem {
        nqn: args.nqn.clone(),
        serial: format!("ferroce{}", std::process::id()),
        namespaces: namespaces
            .into_iter()
            .map(|n| (n.nsid, Arc::new(n)))
            .collect(),
    };
    let server = Server::new(
        ctx.clone(),
        Target::new(config, vec![subsystem]),
        QueueLimits {
            max_transfer: 4096 << args.mdts,
            in_capsule: 8192,
            // Four of the largest transfer per I/O queue, beside a 16 KiB slot per entry.
            bounce_bytes: 4 << 20,
            max_queue_entries: 128,
            max_queues: 64,
        },
    );
    // Kernel hosts connect through IB CM on the wire (QP1 of this context); ferroce hosts
    // through the TCP exchange on the same port number.
    let wire = match server.listen_wire(args.port) {
        Ok(w) => Some(w),
        Err(e) => {
            eprintln!("nvmf-target: no IB CM on the wire (kernel hosts cannot connect): {e}");
            None
        }
    };
    let listener = TcpListener::bind(SocketAddr::new(args.listen, args.port))
        .map_err(|e| format!("listening on {}:{}: {e}", args.listen, args.port))?;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    println!(
        "nvmf-target: {} on {}:{} ({} namespace(s))",
        args.nqn,
        args.listen,
        args.port,
        args.files.len().max(1)
    );
    let stop = server.stop_flag();
    let counters = server.counters();
    let watched = counters.clone();
    let watcher = std::thread::spawn(move || {
        let mut expired = 0;
        while !STOP.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(50));
            // A host that vanished is news to whoever runs the target.
            let now = watched.keep_alive_expired.load(Ordering::Relaxed);
            if now > expired {
                expired = now;
                println!(
                    "nvmf-target: a host sent nothing for its keep-alive timeout: its controller \
                     and queues ended ({now} so far)"
                );
            }
        }
        stop.store(true, Ordering::Release);
    });
    server
        .serve_tcp(listener)
        .map_err(|e| format!("serving: {e}"))?;
    let _ = watcher.join();
    drop(wire);
    // Queues see the flag within their idle look: wait until every one opened has ended.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counters.queues_closed.load(Ordering::Acquire)
        < counters.queues_opened.load(Ordering::Acquire)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("nvmf-target: {}", counters.summary());
    println!("nvmf-target: {}", super::transport_summary(&ctx));
    Ok(ExitCode::SUCCESS)
}
