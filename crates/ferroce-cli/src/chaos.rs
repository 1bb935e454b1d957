//! `ferroce chaos`: a fault-injecting relay between any two ferroce peers.
//!
//! It listens where clients connect, forwards each connection exchange to the real server and
//! puts itself in the RoCE path of every QP so connected (see `ferroce_chaos`). Start it, then
//! point a client at it instead of the server:
//!
//! ```text
//! ferroce perf write_bw                                   # server, cm port 18515
//! ferroce chaos --to 127.0.0.1:18515 --listen 127.0.0.1:18516 loss=0.05,reorder=0.05
//! ferroce perf write_bw 127.0.0.1 --port 18516 --counters  # client, through the relay
//! ```

use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use ferroce_chaos::{DirectionStats, Faults, Relay, RelayStats};

/// Arguments of `ferroce chaos`.
#[derive(Debug, Clone, Args)]
pub struct ChaosArgs {
    /// Faults to inject, comma-separated key=value: loss, reorder, duplicate, corrupt (rates
    /// 0..1), delay_ms, jitter_ms, blackhole=AFTER_MS+LENGTH_MS, seed.
    #[arg(default_value = "")]
    faults: String,
    /// The ferroce server's connection-manager address (HOST:PORT).
    #[arg(long)]
    to: String,
    /// Where clients connect (port 0: any free port, printed on the first line).
    #[arg(long, default_value = "127.0.0.1:18516")]
    listen: SocketAddr,
    /// Print the counters every this many seconds (0: only at the end).
    #[arg(long, default_value_t = 5)]
    stats_every: u64,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long)]
    duration: Option<u64>,
    /// Print counters as JSON objects.
    #[arg(long)]
    json: bool,
}

/// Reads a fault specification the way `--chaos` and `ferroce chaos` take it.
pub fn parse_faults(spec: &str) -> Result<Faults, String> {
    spec.parse()
        .map_err(|e: ferroce_chaos::FaultsError| e.to_string())
}

/// Runs the relay.
pub fn run(args: &ChaosArgs) -> Result<ExitCode, String> {
    let faults = parse_faults(&args.faults)?;
    let to = args
        .to
        .to_socket_addrs()
        .map_err(|e| format!("resolving {}: {e}", args.to))?
        .next()
        .ok_or_else(|| format!("{} has no address", args.to))?;
    let relay = Relay::start(args.listen, to, faults)
        .map_err(|e| format!("listening on {}: {e}", args.listen))?;
    println!(
        "ferroce chaos: listening on {}, relaying to {} with {}",
        relay.cm_addr(),
        relay.target(),
        relay.faults()
    );
    let started = Instant::now();
    let end = args.duration.map(|s| started + Duration::from_secs(s));
    let every = (args.stats_every > 0).then(|| Duration::from_secs(args.stats_every));
    let mut next = every.map(|e| started + e);
    loop {
        let now = Instant::now();
        if end.is_some_and(|e| now >= e) {
            break;
        }
        if let Some(n) = next.filter(|n| now >= *n) {
            print_stats(&relay.stats(), started.elapsed(), args.json);
            next = every.map(|e| n + e);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    print_stats(&relay.stats(), started.elapsed(), args.json);
    Ok(ExitCode::SUCCESS)
}

fn direction_json(d: &DirectionStats) -> serde_json::Value {
    serde_json::json!({
        "received": d.received, "forwarded": d.forwarded, "lost": d.lost,
        "blackholed": d.blackholed, "corrupted": d.corrupted, "duplicated": d.duplicated,
        "reordered": d.reordered, "unroutable": d.unroutable, "send_errors": d.send_errors,
        "overflowed": d.overflowed,
    })
}

/// Prints what a relay did: a JSON object, or a two-line table.
pub fn print_stats(s: &RelayStats, elapsed: Duration, json: bool) {
    if json {
        let v = serde_json::json!({
            "chaos": {
                "seconds": elapsed.as_secs_f64(),
                "connections": s.connections,
                "to_server": direction_json(&s.to_server),
                "to_client": direction_json(&s.to_client),
            }
        });
        println!("{v}");
        return;
    }
    println!(
        " Chaos relay after {:.1} s, {} connection(s):",
        elapsed.as_secs_f64(),
        s.connections
    );
    println!(
        "   {:<10} {:>10} {:>10} {:>8} {:>10} {:>9} {:>10} {:>9} {:>10}",
        "direction",
        "received",
        "forwarded",
        "lost",
        "blackholed",
        "corrupted",
        "duplicated",
        "reordered",
        "overflowed"
    );
    for (name, d) in [("to server", &s.to_server), ("to client", &s.to_client)] {
        println!(
            "   {:<10} {:>10} {:>10} {:>8} {:>10} {:>9} {:>10} {:>9} {:>10}",
            name,
            d.received,
            d.forwarded,
            d.lost,
            d.blackholed,
            d.corrupted,
            d.duplicated,
            d.reordered,
            d.overflowed
        );
    }
}
