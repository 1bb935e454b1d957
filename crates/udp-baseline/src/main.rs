//! `udp-baseline`: the raw-UDP floors that ferroce is compared against, measured in the same run.
//!
//! ferroce carries RoCE v2 over UDP, so no ferroce figure on loopback can beat what plain UDP
//! sockets achieve on the same machine at the same moment. Absolute figures drift from machine to
//! machine and from run to run, so instead of quoting a number measured once (see the anchors'
//! `bench/floors.c`), ferroce's perf tool runs this binary beside itself and reports ratios.
//!
//! Two tests, both over 127.0.0.1 only:
//!
//! - `pingpong`: two threads, each with its own UDP socket, bounce one datagram back and forth;
//!   both busy-poll with non-blocking receives. The figure is the one-way latency (half the
//!   round trip): minimum, median ("typical"), mean and 99th percentile.
//! - `stream`: a sender pushes a fixed number of bytes as datagrams (`send`, `sendmmsg` or UDP
//!   GSO) to a receiver draining with `recvmmsg`; the figure is the bandwidth the receiver saw.
//!
//! `--json` prints one JSON object on one line for machines; otherwise one line for people.
//! Bad arguments print one line starting with `udp-baseline: ` on stderr and exit with code 2;
//! failures while measuring do the same with exit code 1.
#![warn(missing_docs)]
#![warn(clippy::missing_docs_in_private_items)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod args;
mod output;
mod pingpong;
mod sock;
mod stream;

use std::process::ExitCode;

use args::Command;

/// Exit code for arguments that could not be understood.
const EXIT_USAGE: u8 = 2;

/// Exit code for a measurement that failed (a socket call returned an error, a peer went silent).
const EXIT_FAILURE: u8 = 1;

/// Parses the command line, runs the requested test and prints its result.
fn main() -> ExitCode {
    let command = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| args::UsageError(format!("argument {a:?} is not valid UTF-8")))
        })
        .collect::<Result<Vec<String>, _>>()
        .and_then(args::parse);
    let command = match command {
        Ok(c) => c,
        Err(args::UsageError(msg)) => {
            output::error_line(&format!("{msg} (try --help)"));
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let line = match command {
        Command::Help => Ok(args::USAGE.trim_end().to_string()),
        Command::PingPong(a) => {
            pingpong::run(&a).map(|r| if a.json { r.to_json() } else { r.to_human() })
        }
        Command::Stream(a) => stream::run(&a).map(|r| {
            if let Some(reason) = &r.fallback {
                output::error_line(&format!(
                    "note: GSO unavailable ({reason}); measured sendmmsg instead"
                ));
            }
            if a.json {
                r.to_json()
            } else {
                r.to_human()
            }
        }),
    };
    match line {
        Ok(line) => {
            if output::stdout_line(&line) {
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
