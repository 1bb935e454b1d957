//! `shm-baseline`: the same-host floors that ferroce's shared-memory provider is compared
//! against, measured in the same run.
//!
//! Between two processes on one machine nothing moves data faster than the CPU's own cache
//! coherence and `memcpy`, so those are the floors: a shared-memory WRITE cannot be seen by the
//! peer sooner than a cache line can travel there, and a large WRITE cannot go faster than one
//! thread copying the bytes. Absolute figures drift from machine to machine and from run to run
//! (the anchors measured 31 ns and 47 GB/s once), so `scripts/bench_shm.sh` runs this binary
//! beside ferroce and reports ratios.
//!
//! - `pingpong`: two processes (this binary re-executed as a hidden `pingpong-responder`) share
//!   a sealed memfd page; each spins on its own cache line and writes the other's. The figure is
//!   the one-way latency (half the round trip): minimum, median ("typical"), mean, 99th
//!   percentile and maximum, in nanoseconds.
//! - `memcpy`: one thread copies a buffer into another of the same size, over and over; the
//!   figure is the bytes copied per second (buffers small enough for the caches stay there, as
//!   they would for a provider copying the same buffer repeatedly).
//!
//! `--json` prints one JSON object per line for machines; otherwise one line per result for
//! people. Bad arguments print one line starting with `shm-baseline: ` on stderr and exit with
//! code 2; failures while measuring do the same with exit code 1.
#![warn(missing_docs)]
#![warn(clippy::missing_docs_in_private_items)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod clock;
mod memcpy;
mod output;
mod pingpong;
mod shared;
mod stats;

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Args, Parser, Subcommand};

/// Exit code for arguments that could not be understood.
const EXIT_USAGE: u8 = 2;

/// Exit code for a measurement that failed (the responder died, a system call failed).
const EXIT_FAILURE: u8 = 1;

/// Upper bound on ping-pong `--iters` and `--warmup`: every timed round trip keeps an 8-byte
/// sample, so this caps the sample buffer at 80 MB.
const MAX_PINGPONG_ITERS: u64 = 10_000_000;

/// Upper bound on memcpy `--size`: two buffers of 1 GiB each are already more than a small CI
/// machine should be asked for.
const MAX_MEMCPY_SIZE: u64 = 1 << 30;

/// Upper bound on memcpy `--iters` (a billion copies of one byte still end in seconds).
const MAX_MEMCPY_ITERS: u64 = 1_000_000_000;

/// Same-host baselines for ferroce's shared-memory provider: cache-line ping-pong between two
/// processes and single-thread memcpy bandwidth.
#[derive(Debug, Parser)]
#[command(name = "shm-baseline", version, color = clap::ColorChoice::Never)]
struct Cli {
    /// The test to run.
    #[command(subcommand)]
    command: Command,
}

/// The tests.
#[derive(Debug, Subcommand)]
enum Command {
    /// Ping-pong one cache line between two processes sharing a memfd page; prints the one-way
    /// latency (half the round trip) in ns: min, median, mean, p99, max.
    Pingpong(PingPongArgs),
    /// Single-thread memcpy bandwidth between two buffers of one size; GB/s is 10^9 B/s, MB/s is
    /// 2^20 B/s (perftest's MB).
    Memcpy(MemcpyArgs),
    /// The second process of `pingpong` (started by it, with the shared page as stdin).
    #[command(name = "pingpong-responder", hide = true)]
    PingpongResponder,
}

/// Options of `pingpong`.
#[derive(Debug, Clone, Args)]
pub struct PingPongArgs {
    /// Timed round trips.
    #[arg(long, value_name = "N", default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(1..=MAX_PINGPONG_ITERS))]
    pub iters: u64,
    /// Untimed round trips before the timed ones (they bring both processes up to speed and the
    /// line into the caches).
    #[arg(long, value_name = "N", default_value_t = 100_000,
          value_parser = clap::value_parser!(u64).range(0..=MAX_PINGPONG_ITERS))]
    pub warmup: u64,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

/// Options of `memcpy`.
#[derive(Debug, Clone, Args)]
pub struct MemcpyArgs {
    /// Bytes per copy.
    #[arg(long, value_name = "BYTES", required_unless_present = "all", conflicts_with = "all",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MEMCPY_SIZE))]
    pub size: Option<u64>,
    /// Every power of two from 4 KiB to 4 MiB, one result per line.
    #[arg(long)]
    pub all: bool,
    /// Copies per size (default: enough for 2 GiB, between 10 and 10 million).
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MEMCPY_ITERS))]
    pub iters: Option<u64>,
    /// Print one JSON object per size instead of lines of text.
    #[arg(long)]
    pub json: bool,
}

/// Parses the command line, runs the requested test and prints its results.
fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    let lines = match cli.command {
        Command::Pingpong(a) => {
            pingpong::run(&a).map(|r| vec![if a.json { r.to_json() } else { r.to_human() }])
        }
        Command::Memcpy(a) => memcpy::run_all(&a).map(|results| {
            results
                .iter()
                .map(|r| if a.json { r.to_json() } else { r.to_human() })
                .collect()
        }),
        Command::PingpongResponder => pingpong::respond().map(|()| Vec::new()),
    };
    match lines {
        Ok(lines) => {
            if lines.iter().all(|l| output::stdout_line(l)) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
        Err(msg) => {
            output::error_line(&msg);
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// Reports a command line clap could not accept: help and version go to stdout with success,
/// anything else becomes one line on stderr and exit code 2.
fn usage_error(e: &clap::Error) -> ExitCode {
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        return if e.print().is_ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(EXIT_FAILURE)
        };
    }
    output::error_line(&format!("{} (try --help)", one_line_message(e)));
    ExitCode::from(EXIT_USAGE)
}

/// The gist of a clap error on one line. clap writes a paragraph (the error, sometimes with the
/// missing arguments on the lines below it), a blank line, then usage and a hint; the first
/// paragraph is the message. A bare `shm-baseline` makes clap print the whole help instead.
fn one_line_message(e: &clap::Error) -> String {
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand
    ) {
        return "missing command: pingpong or memcpy".to_string();
    }
    let text = e.render().to_string();
    let paragraph: Vec<&str> = text
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let joined = paragraph.join(" ");
    joined
        .strip_prefix("error: ")
        .unwrap_or(&joined)
        .to_string()
}
