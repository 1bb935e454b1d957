//! The command line of `ferroce perf`: the tests and their options, as perftest names them.

use std::net::IpAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// The eight tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Test {
    /// RDMA WRITE ping-pong latency.
    #[value(name = "write_lat")]
    WriteLat,
    /// RDMA READ latency.
    #[value(name = "read_lat")]
    ReadLat,
    /// SEND/RECV ping-pong latency.
    #[value(name = "send_lat")]
    SendLat,
    /// FETCH_ADD latency.
    #[value(name = "atomic_lat")]
    AtomicLat,
    /// RDMA WRITE bandwidth.
    #[value(name = "write_bw")]
    WriteBw,
    /// RDMA READ bandwidth.
    #[value(name = "read_bw")]
    ReadBw,
    /// SEND bandwidth.
    #[value(name = "send_bw")]
    SendBw,
    /// FETCH_ADD message rate.
    #[value(name = "atomic_bw")]
    AtomicBw,
}

impl Test {
    pub(super) fn is_lat(self) -> bool {
        matches!(
            self,
            Test::WriteLat | Test::ReadLat | Test::SendLat | Test::AtomicLat
        )
    }
    pub(super) fn is_atomic(self) -> bool {
        matches!(self, Test::AtomicLat | Test::AtomicBw)
    }
    pub(super) fn title(self) -> &'static str {
        match self {
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::SendLat => "Send Latency Test",
            Test::AtomicLat => "Atomic FETCH_AND_ADD Latency Test",
            Test::WriteBw => "RDMA_Write BW Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::SendBw => "Send BW Test",
            Test::AtomicBw => "Atomic FETCH_AND_ADD BW Test",
        }
    }
}

/// Arguments of `ferroce perf`.
#[derive(Debug, Clone, Args)]
pub struct PerfArgs {
    /// The test.
    pub(super) test: Test,
    /// The server to connect to; without it this process is the server.
    pub(super) host: Option<String>,
    /// Run server and client in this process, over loopback.
    #[arg(long)]
    pub(super) loopback: bool,
    /// Message size in bytes (default 2 for latency, 65536 for bandwidth).
    #[arg(long, short = 's', value_parser = clap::value_parser!(u64).range(0..=(1 << 30)))]
    pub(super) size: Option<u64>,
    /// Iterations per size (default 1000 for latency, 5000 for bandwidth; with --all, bandwidth
    /// rounds are capped at 1 GiB of data unless --iters is given).
    #[arg(long, short = 'n', value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub(super) iters: Option<u64>,
    /// Every size from 2 bytes to 8 MiB.
    #[arg(long, short = 'a')]
    pub(super) all: bool,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (default: the device's).
    #[arg(long, short = 'm')]
    pub(super) mtu: Option<u32>,
    /// Queue pairs (bandwidth tests spread messages over them).
    #[arg(long, short = 'q', default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub(super) qps: u16,
    /// Check every byte and every atomic result.
    #[arg(long)]
    pub(super) verify: bool,
    /// One JSON object per message size.
    #[arg(long)]
    pub(super) json: bool,
    /// Print the transport's counters at the end.
    #[arg(long)]
    pub(super) counters: bool,
    /// TCP port of the connection exchange.
    #[arg(long, short = 'p', default_value_t = 18515)]
    pub(super) port: u16,
    /// Device to use (ferroce_lo, or an interface name); default: the one holding --bind, or
    /// the one that reaches HOST.
    #[arg(long, short = 'd')]
    pub(super) device: Option<String>,
    /// Local address to use (server default 127.0.0.1).
    #[arg(long)]
    pub(super) bind: Option<IpAddr>,
    /// UDP port of this side's RoCE socket (0: any free port; the peer learns it).
    #[arg(long, default_value_t = 0)]
    pub(super) roce_port: u16,
    /// Bandwidth tests over WRITE or READ: post for this many seconds instead of --iters
    /// messages. Each QP then keeps its own --tx-depth requests in flight (no QP waits for
    /// another), and the report counts the messages that completed within the time, per QP
    /// too. After the time the client waits at most --timeout seconds for what is still in
    /// flight; a run that fails or cannot drain still reports what was delivered (JSON:
    /// "finished": false), then fails.
    #[arg(long, value_name = "SECS")]
    pub(super) duration: Option<f64>,
    /// Work requests in flight in bandwidth tests.
    #[arg(long, short = 't', default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(super) tx_depth: u32,
    /// Seconds to wait for the peer at any step.
    #[arg(long, default_value_t = 10)]
    pub(super) timeout: u64,
    /// Local ACK timeout code of the QPs: 4.096 µs × 2^CODE (perftest's -u; default 14 = 67 ms).
    #[arg(long, default_value_t = 14, value_parser = clap::value_parser!(u8).range(1..=31))]
    pub(super) qp_timeout: u8,
    /// Put a chaos relay between client and server (with --loopback, or on the client side):
    /// e.g. loss=0.05,reorder=0.05,duplicate=0.02,corrupt=0.01,delay_ms=1,seed=7 (see
    /// 'ferroce chaos --help').
    #[arg(long, value_name = "FAULTS")]
    pub(super) chaos: Option<String>,
    /// Speak perftest's own TCP exchange, to pair with the real ib_write_lat, ib_read_bw, ...
    /// in either role (one QP, one size; both sides given the same test and options).
    #[arg(long)]
    pub(super) perftest: bool,
    /// Wait in the WRITE latency test as perftest does: spin on the flag byte without a CQ
    /// poll (a peer's WRITE arriving over UDP is then landed by the engine thread), with the
    /// context settings of the drop-in libibverbs (a poll that returns completions hands
    /// progress back to the engine). What perftest over the drop-in measures, minus the C ABI.
    #[arg(long)]
    pub(super) wait_like_perftest: bool,
    /// Sleep on completion events instead of busy-polling the CQ when it is empty (perftest's
    /// -e): in the bandwidth tests and in send_lat, read_lat and atomic_lat (write_lat waits
    /// on memory, which raises no event). A process then takes a CPU only for the work itself,
    /// which is what lets many of them share a small machine (bench_net's flows). The engine
    /// thread moves the packets meanwhile; each wait costs wake-ups (tens of µs on a busy
    /// host), which a window of --tx-depth messages hides and a latency test pays.
    #[arg(long, short = 'e')]
    pub(super) events: bool,
    /// GID index of the local device (perftest's -x).
    #[arg(long = "gid-index", short = 'x')]
    pub(super) gid_index: Option<usize>,
    /// Accepted for perftest's command lines (-F: no CPU frequency warning); ferroce measures
    /// with a monotonic clock, not the cycle counter.
    #[arg(long = "CPU-freq", short = 'F')]
    pub(super) cpu_freq: bool,
    /// Report bandwidth in Gb/s (perftest's --report_gbits).
    #[arg(long = "report_gbits")]
    pub(super) report_gbits: bool,
    /// Atomic operation of the atomic tests (perftest's -A).
    #[arg(long = "atomic_type", short = 'A', value_enum, default_value_t = AtomicType::FetchAndAdd)]
    pub(super) atomic_type: AtomicType,
}

/// The atomic operation of the atomic tests, as perftest names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AtomicType {
    /// FETCH_ADD of 1.
    #[value(name = "FETCH_AND_ADD")]
    FetchAndAdd,
    /// COMPARE_SWAP of 0 with 0.
    #[value(name = "CMP_AND_SWAP")]
    CmpAndSwap,
}

impl PerfArgs {
    pub(super) fn sizes(&self) -> Vec<u64> {
        if self.test.is_atomic() {
            // An atomic moves one 8-byte word whatever else is asked (a size other than 8 is
            // refused), and the report says so.
            vec![8]
        } else if self.all {
            (1..=23).map(|k| 1u64 << k).collect()
        } else {
            vec![self
                .size
                .unwrap_or(if self.test.is_lat() { 2 } else { 65_536 })]
        }
    }
    pub(super) fn iters_for(&self, size: u64) -> u64 {
        match self.iters {
            Some(n) => n,
            None if self.test.is_lat() => 1000,
            None if self.all => 5000u64.min(((1u64 << 30) / size.max(1)).max(16)),
            None => 5000,
        }
    }
    /// `--duration` as a duration, once `check_duration` has accepted it.
    pub(super) fn window(&self) -> Option<Duration> {
        self.duration.map(Duration::from_secs_f64)
    }
    /// Refuses a `--duration` the tests cannot honour.
    pub(super) fn check_duration(&self) -> Result<(), String> {
        let Some(d) = self.duration else {
            return Ok(());
        };
        if !(d.is_finite() && d > 0.0 && d <= 86_400.0) {
            return Err(format!(
                "--duration {d}: give seconds, more than 0 and at most a day"
            ));
        }
        if !matches!(self.test, Test::WriteBw | Test::ReadBw) {
            return Err("--duration is for write_bw and read_bw (the other tests count messages the server must know in advance)".into());
        }
        if self.perftest {
            return Err(
                "--duration is ferroce's own; perftest's exchange has no such option".into(),
            );
        }
        Ok(())
    }
    /// How long a side waits at the barrier after a round of `iters` messages: the peer may
    /// still be sending, for `--duration` and then its drain if the run is timed.
    pub(super) fn round_sync(&self, iters: u64) -> Duration {
        match self.window() {
            Some(w) => w + 2 * self.timeout() + Duration::from_secs(60),
            None => self.timeout() + Duration::from_secs(iters / 1000 + 60),
        }
    }
    pub(super) fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout.max(1))
    }
}
