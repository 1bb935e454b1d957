//! Hand-written command-line parsing: a subcommand, then `--name value` (or `--name=value`)
//! options and the `--json` flag. No dependencies, no panics: every mistake becomes a
//! [`UsageError`] carrying one line of text.

/// Largest UDP payload that fits in one IPv4 datagram (65535 − 20 IP − 8 UDP header bytes).
pub const MAX_UDP_PAYLOAD: usize = 65_507;

/// Upper bound on `--iters` and `--warmup`: every timed round trip keeps an 8-byte sample.
const MAX_ITERS: u64 = 10_000_000;

/// Upper bound on `--bytes` (1 PiB): far beyond any sensible run, small enough for no overflow.
const MAX_BYTES: u64 = 1 << 50;

/// Default number of timed ping-pong round trips.
const DEFAULT_ITERS: u64 = 100_000;

/// Default number of untimed ping-pong round trips before the timed ones.
const DEFAULT_WARMUP: u64 = 1_000;

/// Default ping-pong payload size in bytes.
const DEFAULT_PINGPONG_SIZE: usize = 8;

/// Default stream datagram size in bytes.
const DEFAULT_STREAM_SIZE: usize = 4096;

/// Default stream length: 1 GiB.
const DEFAULT_STREAM_BYTES: u64 = 1 << 30;

/// The text printed by `--help`.
pub const USAGE: &str = "\
udp-baseline: raw UDP floors on loopback (127.0.0.1), to compare ferroce against in the same run

usage:
  udp-baseline pingpong [--size N] [--iters N] [--warmup N] [--json]
      ping-pong of N-byte datagrams between two busy-polling threads; prints the one-way
      latency (half the round trip) in microseconds: min, median, mean, p99.
      defaults: --size 8 --iters 100000 --warmup 1000
  udp-baseline stream [--size N] [--bytes B] [--mode send|sendmmsg|gso] [--json]
      stream B bytes as N-byte datagrams from one thread to another; prints the bandwidth
      the receiver observed (1 MB = 10^6 bytes) and the datagrams lost.
      defaults: --size 4096 --bytes 1073741824 --mode sendmmsg
  udp-baseline --help

--json prints exactly one JSON object on one line. Bad arguments exit with code 2,
failed measurements with code 1.
";

/// A command-line mistake, as the one line of text to show the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

/// How the stream sender hands datagrams to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendMode {
    /// One `send()` system call per datagram.
    Send,
    /// `sendmmsg()` with batches of datagrams per system call.
    Sendmmsg,
    /// UDP generic segmentation offload: one `send()` of a ~64 KiB super-buffer that the kernel
    /// cuts into datagrams (`UDP_SEGMENT`).
    Gso,
}

impl SendMode {
    /// The mode's name, as written on the command line and in the output.
    pub fn name(self) -> &'static str {
        match self {
            SendMode::Send => "send",
            SendMode::Sendmmsg => "sendmmsg",
            SendMode::Gso => "gso",
        }
    }

    /// The mode called `name`, if there is one.
    fn from_name(name: &str) -> Option<SendMode> {
        [SendMode::Send, SendMode::Sendmmsg, SendMode::Gso]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// Parameters of the `pingpong` test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PingPongArgs {
    /// Payload bytes per datagram.
    pub size: usize,
    /// Timed round trips.
    pub iters: u64,
    /// Untimed round trips before the timed ones.
    pub warmup: u64,
    /// Print one JSON object instead of a human-readable line.
    pub json: bool,
}

/// Parameters of the `stream` test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamArgs {
    /// Payload bytes per datagram (the last datagram may be shorter).
    pub size: usize,
    /// Total payload bytes to send.
    pub bytes: u64,
    /// How the sender hands datagrams to the kernel.
    pub mode: SendMode,
    /// Print one JSON object instead of a human-readable line.
    pub json: bool,
}

/// What the command line asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Print the usage text.
    Help,
    /// Run the ping-pong latency test.
    PingPong(PingPongArgs),
    /// Run the streaming bandwidth test.
    Stream(StreamArgs),
}

/// Parses the arguments that follow the program name.
pub fn parse(args: Vec<String>) -> Result<Command, UsageError> {
    let mut it = args.into_iter();
    let Some(cmd) = it.next() else {
        return Err(usage("missing command: pingpong or stream"));
    };
    match cmd.as_str() {
        "-h" | "--help" | "help" => Ok(Command::Help),
        "pingpong" => parse_pingpong(it),
        "stream" => parse_stream(it),
        other => Err(usage(&format!(
            "unknown command '{other}': expected pingpong or stream"
        ))),
    }
}

/// One option from the command line: its name and, for `--name=value`, the inline value.
struct Opt {
    /// The option's name, e.g. `--size`.
    name: String,
    /// The value given as `--name=value`, if any.
    inline: Option<String>,
}

impl Opt {
    /// Splits `--name=value` into its parts; anything else is a name alone.
    fn split(arg: String) -> Opt {
        match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => Opt {
                name: name.to_string(),
                inline: Some(value.to_string()),
            },
            _ => Opt {
                name: arg,
                inline: None,
            },
        }
    }

    /// The option's value: inline, or else the next argument.
    fn value(&mut self, rest: &mut impl Iterator<Item = String>) -> Result<String, UsageError> {
        match self.inline.take().or_else(|| rest.next()) {
            Some(v) => Ok(v),
            None => Err(usage(&format!("{} needs a value", self.name))),
        }
    }

    /// Checks that a flag (an option without a value) was not given `=value`.
    fn flag(&self) -> Result<(), UsageError> {
        match &self.inline {
            None => Ok(()),
            Some(_) => Err(usage(&format!("{} takes no value", self.name))),
        }
    }

    /// Reads the option's value as a whole number within `min..=max`.
    fn number(
        &mut self,
        rest: &mut impl Iterator<Item = String>,
        min: u64,
        max: u64,
    ) -> Result<u64, UsageError> {
        let text = self.value(rest)?;
        let n = if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
            text.parse::<u64>().ok()
        } else {
            None
        };
        match n {
            Some(n) if (min..=max).contains(&n) => Ok(n),
            Some(_) => Err(usage(&format!(
                "{} must be between {min} and {max}, got {text}",
                self.name
            ))),
            None => Err(usage(&format!(
                "{} expects a whole number, got '{text}'",
                self.name
            ))),
        }
    }

    /// Reads the option's value as a datagram payload size.
    fn size(&mut self, rest: &mut impl Iterator<Item = String>) -> Result<usize, UsageError> {
        // MAX_UDP_PAYLOAD fits in u64 and the result fits back in usize.
        let n = self.number(rest, 1, MAX_UDP_PAYLOAD as u64)?;
        usize::try_from(n).map_err(|_| usage(&format!("{} is too large", self.name)))
    }

    /// The error for an option this command does not know.
    fn unknown(&self, command: &str) -> UsageError {
        usage(&format!("unknown option '{}' for {command}", self.name))
    }
}

/// Parses the options of `pingpong`.
fn parse_pingpong(mut rest: impl Iterator<Item = String>) -> Result<Command, UsageError> {
    let mut a = PingPongArgs {
        size: DEFAULT_PINGPONG_SIZE,
        iters: DEFAULT_ITERS,
        warmup: DEFAULT_WARMUP,
        json: false,
    };
    while let Some(arg) = rest.next() {
        let mut opt = Opt::split(arg);
        match opt.name.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--json" => {
                opt.flag()?;
                a.json = true;
            }
            "--size" => a.size = opt.size(&mut rest)?,
            "--iters" => a.iters = opt.number(&mut rest, 1, MAX_ITERS)?,
            "--warmup" => a.warmup = opt.number(&mut rest, 0, MAX_ITERS)?,
            _ => return Err(opt.unknown("pingpong")),
        }
    }
    Ok(Command::PingPong(a))
}

/// Parses the options of `stream`.
fn parse_stream(mut rest: impl Iterator<Item = String>) -> Result<Command, UsageError> {
    let mut a = StreamArgs {
        size: DEFAULT_STREAM_SIZE,
        bytes: DEFAULT_STREAM_BYTES,
        mode: SendMode::Sendmmsg,
        json: false,
    };
    while let Some(arg) = rest.next() {
        let mut opt = Opt::split(arg);
        match opt.name.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--json" => {
                opt.flag()?;
                a.json = true;
            }
            "--size" => a.size = opt.size(&mut rest)?,
            "--bytes" => a.bytes = opt.number(&mut rest, 1, MAX_BYTES)?,
            "--mode" => {
                let name = opt.value(&mut rest)?;
                a.mode = SendMode::from_name(&name).ok_or_else(|| {
                    usage(&format!(
                        "--mode must be send, sendmmsg or gso, got '{name}'"
                    ))
                })?;
            }
            _ => return Err(opt.unknown("stream")),
        }
    }
    // usize -> u64 never truncates on the 32- and 64-bit targets Rust supports.
    if a.bytes < a.size as u64 {
        return Err(usage(&format!(
            "--bytes ({}) must be at least --size ({})",
            a.bytes, a.size
        )));
    }
    Ok(Command::Stream(a))
}

/// Builds a [`UsageError`] from a message.
fn usage(msg: &str) -> UsageError {
    UsageError(msg.to_string())
}

/// Parsing tests: defaults, both option spellings, rejected mistakes.
#[cfg(test)]
mod tests {
    use super::*;

    /// Parses a command line given as one string.
    fn p(line: &str) -> Result<Command, UsageError> {
        parse(line.split_whitespace().map(String::from).collect())
    }

    /// Each command alone gets the documented defaults.
    #[test]
    fn defaults() {
        assert_eq!(
            p("pingpong"),
            Ok(Command::PingPong(PingPongArgs {
                size: 8,
                iters: 100_000,
                warmup: 1_000,
                json: false
            }))
        );
        assert_eq!(
            p("stream"),
            Ok(Command::Stream(StreamArgs {
                size: 4096,
                bytes: 1 << 30,
                mode: SendMode::Sendmmsg,
                json: false
            }))
        );
    }

    /// `--name value` and `--name=value` both work, in any order.
    #[test]
    fn options_both_spellings() {
        assert_eq!(
            p("stream --size=1000 --bytes 5000 --mode gso --json"),
            Ok(Command::Stream(StreamArgs {
                size: 1000,
                bytes: 5000,
                mode: SendMode::Gso,
                json: true
            }))
        );
        assert_eq!(
            p("pingpong --iters=7 --warmup 0 --size 1"),
            Ok(Command::PingPong(PingPongArgs {
                size: 1,
                iters: 7,
                warmup: 0,
                json: false
            }))
        );
        assert_eq!(p("pingpong --help"), Ok(Command::Help));
    }

    /// Every kind of mistake is an error, not a panic or a silent default.
    #[test]
    fn mistakes() {
        for bad in [
            "",
            "bogus",
            "pingpong --size",
            "pingpong --size 0",
            "pingpong --size 65508",
            "pingpong --size -1",
            "pingpong --size +8",
            "pingpong --size 8x",
            "pingpong --iters 0",
            "pingpong --iters 99999999999999999999999",
            "pingpong --bytes 10",
            "pingpong --json=1",
            "stream --mode nope",
            "stream --iters 5",
            "stream --size 4096 --bytes 100",
            "stream extra",
        ] {
            assert!(p(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
