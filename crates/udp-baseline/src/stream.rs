//! The streaming bandwidth test: one thread sends a fixed number of bytes as datagrams over
//! loopback, another drains them with `recvmmsg`, and the figure is what the receiver saw.
//!
//! The sender paces itself only by blocking sends; when it outruns the receiver, loopback drops
//! datagrams at the receive buffer (8 MiB requested, `SO_RCVBUFFORCE` first). The receiver counts
//! what arrived; the bandwidth is the bytes it received after its first `recvmmsg` call returned,
//! divided by the time from that return to the return that delivered the last datagram. (The
//! first call's bytes are left out because the time they took to arrive is not in the interval.)
//!
//! The receiver stops as soon as every datagram sent has arrived, or, once the sender has
//! finished, after a full idle timeout with nothing more arriving (the rest was lost).

use std::io;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::args::{SendMode, StreamArgs, MAX_UDP_PAYLOAD};
use crate::output::{json_num, json_str};
use crate::sock::{self, RecvBatch, BATCH};

/// Receive buffer requested for the receiving socket.
const RCVBUF_BYTES: usize = 8 << 20;

/// Send buffer requested for the sending socket (best effort: loopback frees the sender's
/// buffer space as soon as a datagram is handed over, so this hardly matters).
const SNDBUF_BYTES: usize = 8 << 20;

/// How long the receiver waits in one `recvmmsg` before checking whether the sender is done.
const IDLE_TIMEOUT: Duration = Duration::from_millis(50);

/// Most segments the kernel accepts in one UDP GSO send (`UDP_MAX_SEGMENTS`).
const GSO_MAX_SEGMENTS: usize = 64;

/// The figures of one streaming run.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamResult {
    /// The mode asked for on the command line.
    pub requested_mode: SendMode,
    /// The mode actually measured (differs only when GSO was unavailable).
    pub mode: SendMode,
    /// Why GSO was not used, when it was asked for but unavailable.
    pub fallback: Option<String>,
    /// Payload bytes per datagram.
    pub size: usize,
    /// Payload bytes asked for.
    pub bytes_requested: u64,
    /// Payload bytes the kernel accepted from the sender.
    pub bytes_sent: u64,
    /// Datagrams the kernel accepted from the sender.
    pub datagrams_sent: u64,
    /// Payload bytes the receiver got.
    pub bytes_received: u64,
    /// Datagrams the receiver got.
    pub datagrams_received: u64,
    /// Datagrams sent but never received (dropped by the kernel under overload).
    pub datagrams_lost: u64,
    /// `recvmmsg` calls that delivered data.
    pub recv_calls: u64,
    /// Seconds from the receiver's first delivery to its last.
    pub seconds: f64,
    /// Bandwidth the receiver observed, MB/s (10^6 bytes per second).
    pub mb_s: f64,
    /// The same in GB/s (10^9 bytes per second).
    pub gb_s: f64,
    /// Rate at which the sender handed bytes to the kernel, MB/s (the offered load).
    pub sender_mb_s: f64,
    /// The receive buffer the kernel granted (`SO_RCVBUF` as read back).
    pub rcvbuf: usize,
}

impl StreamResult {
    /// The result as one JSON object on one line.
    pub fn to_json(&self) -> String {
        let fallback = self
            .fallback
            .as_deref()
            .map_or("null".to_string(), json_str);
        format!(
            "{{\"test\":\"stream\",\"mode\":\"{}\",\"requested_mode\":\"{}\",\"size\":{},\
             \"bytes_requested\":{},\"bytes_sent\":{},\"bytes_received\":{},\
             \"datagrams_sent\":{},\"datagrams_received\":{},\"datagrams_lost\":{},\
             \"recv_calls\":{},\"seconds\":{},\"mb_s\":{},\"gb_s\":{},\"sender_mb_s\":{},\
             \"rcvbuf\":{},\"fallback\":{}}}",
            self.mode.name(),
            self.requested_mode.name(),
            self.size,
            self.bytes_requested,
            self.bytes_sent,
            self.bytes_received,
            self.datagrams_sent,
            self.datagrams_received,
            self.datagrams_lost,
            self.recv_calls,
            json_num(self.seconds, 6),
            json_num(self.mb_s, 1),
            json_num(self.gb_s, 3),
            json_num(self.sender_mb_s, 1),
            self.rcvbuf,
            fallback,
        )
    }

    /// The result as one line for people.
    pub fn to_human(&self) -> String {
        let note = match &self.fallback {
            Some(reason) => format!(" [gso unavailable: {reason}; measured sendmmsg]"),
            None => String::new(),
        };
        format!(
            "stream {} {} B: receiver {:.1} MB/s ({:.3} GB/s); {} of {} bytes received, \
             {} of {} datagrams lost; sender offered {:.1} MB/s{note}",
            self.mode.name(),
            self.size,
            self.mb_s,
            self.gb_s,
            self.bytes_received,
            self.bytes_sent,
            self.datagrams_lost,
            self.datagrams_sent,
            self.sender_mb_s,
        )
    }
}

/// Runs the streaming test described by `args`.
pub fn run(args: &StreamArgs) -> Result<StreamResult, String> {
    let (tx, rx) = sock::loopback_pair().map_err(|e| format!("loopback sockets: {e}"))?;
    let rcvbuf =
        sock::grow_rcvbuf(&rx, RCVBUF_BYTES).map_err(|e| format!("receive buffer: {e}"))?;
    // Best effort, see SNDBUF_BYTES.
    let _ = sock::grow_sndbuf(&tx, SNDBUF_BYTES);
    rx.set_read_timeout(Some(IDLE_TIMEOUT))
        .map_err(|e| format!("receive timeout: {e}"))?;

    let plan = Plan::new(args.size, args.bytes);
    let sender_done = Arc::new(AtomicBool::new(false));
    let receiver = {
        let done = Arc::clone(&sender_done);
        let (size, expected) = (args.size, plan.datagrams);
        thread::Builder::new()
            .name("stream-receiver".into())
            .spawn(move || receive(&rx, size, expected, &done))
            .map_err(|e| format!("cannot start the receiver thread: {e}"))?
    };
    let sent = send_all(&tx, &plan, args.mode);
    sender_done.store(true, Ordering::Release);
    let received = receiver
        .join()
        .map_err(|_| "the receiver thread panicked".to_string())?;
    // A failed receiver makes the sender fail too (its peer is gone): report the cause.
    let received = received?;
    let sent = sent?;

    let seconds = match (received.first, received.last) {
        (Some(first), Some(last)) => last.duration_since(first).as_secs_f64(),
        _ => 0.0,
    };
    let timed_bytes = received.bytes - received.first_call_bytes;
    if received.calls < 2 || seconds <= 0.0 || timed_bytes == 0 {
        return Err(format!(
            "stream too short to time: {} datagrams arrived in {} receive call(s); use a larger \
             --bytes",
            received.datagrams, received.calls
        ));
    }
    let mb_s = timed_bytes as f64 / seconds / 1e6;
    let sender_mb_s = if sent.seconds > 0.0 {
        sent.bytes as f64 / sent.seconds / 1e6
    } else {
        0.0
    };
    Ok(StreamResult {
        requested_mode: args.mode,
        mode: sent.mode,
        fallback: sent.fallback,
        size: args.size,
        bytes_requested: args.bytes,
        bytes_sent: sent.bytes,
        datagrams_sent: sent.datagrams,
        bytes_received: received.bytes,
        datagrams_received: received.datagrams,
        datagrams_lost: sent.datagrams.saturating_sub(received.datagrams),
        recv_calls: received.calls,
        seconds,
        mb_s,
        gb_s: mb_s / 1000.0,
        sender_mb_s,
        rcvbuf,
    })
}

/// How a stream of `bytes` is cut into datagrams of `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    /// Bytes per datagram, except perhaps the last.
    size: usize,
    /// Number of datagrams.
    datagrams: u64,
    /// Bytes in the last datagram (1..=size).
    last_len: usize,
}

impl Plan {
    /// The plan for `bytes` (≥ 1) in datagrams of `size` (≥ 1) bytes.
    fn new(size: usize, bytes: u64) -> Plan {
        let size = size.max(1);
        let bytes = bytes.max(1);
        let datagrams = bytes.div_ceil(size as u64);
        let last = bytes - (datagrams - 1) * size as u64;
        Plan {
            size,
            datagrams,
            // 1 ≤ last ≤ size, so it fits in usize.
            last_len: usize::try_from(last).unwrap_or(size),
        }
    }

    /// Length of datagram `i`.
    fn len(&self, i: u64) -> usize {
        if i + 1 == self.datagrams {
            self.last_len
        } else {
            self.size
        }
    }
}

/// What the sender did.
#[derive(Debug)]
struct Sent {
    /// The mode measured.
    mode: SendMode,
    /// Why GSO fell back to `sendmmsg`, if it did.
    fallback: Option<String>,
    /// Datagrams the kernel accepted.
    datagrams: u64,
    /// Payload bytes the kernel accepted.
    bytes: u64,
    /// Seconds from the first send call to the return of the last.
    seconds: f64,
}

/// Whether a send error only means "try again": an interrupted call, or a momentarily full
/// queue (which a blocking socket rarely reports, but loopback may under memory pressure).
fn transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
    ) || e.raw_os_error() == Some(libc::ENOBUFS)
}

/// Sends the whole `plan` on the connected socket `sock` in `mode`.
fn send_all(sock: &UdpSocket, plan: &Plan, mode: SendMode) -> Result<Sent, String> {
    let mut mode = mode;
    let mut fallback = None;
    let gso_segments = (MAX_UDP_PAYLOAD / plan.size).clamp(1, GSO_MAX_SEGMENTS);
    if mode == SendMode::Gso {
        if let Err(e) = sock::set_gso_segment(sock, plan.size) {
            fallback = Some(format!("setsockopt UDP_SEGMENT: {e}"));
            mode = SendMode::Sendmmsg;
        }
    }
    let payload = vec![0xa5u8; plan.size * gso_segments];
    let mut lens = [0usize; BATCH];
    let mut next = 0u64;
    let mut bytes = 0u64;
    let start = Instant::now();
    while next < plan.datagrams {
        let left = plan.datagrams - next;
        let outcome = match mode {
            SendMode::Send => {
                let len = plan.len(next);
                sock.send(&payload[..len]).map(|_| (1, len as u64))
            }
            SendMode::Sendmmsg => {
                // left ≥ 1; the minimum with BATCH fits in usize.
                let k = usize::try_from(left.min(BATCH as u64)).unwrap_or(BATCH);
                for (j, l) in lens[..k].iter_mut().enumerate() {
                    *l = plan.len(next + j as u64);
                }
                sock::send_batch(sock, &payload, &lens[..k]).map(|n| {
                    let b = lens[..n].iter().map(|&l| l as u64).sum();
                    (n as u64, b)
                })
            }
            SendMode::Gso => {
                let k = left.min(gso_segments as u64);
                // Only the last segment of a GSO send may be shorter than the segment size.
                let len = (k as usize - 1) * plan.size + plan.len(next + k - 1);
                match sock.send(&payload[..len]) {
                    Err(e) if next == 0 && !transient(&e) => {
                        // The option was accepted but the path cannot segment: measure
                        // sendmmsg instead (clearing the option, although datagrams no longer
                        // than the segment size are unaffected by it anyway).
                        let _ = sock::set_gso_segment(sock, 0);
                        fallback = Some(format!("send with UDP_SEGMENT: {e}"));
                        mode = SendMode::Sendmmsg;
                        continue;
                    }
                    r => r.map(|_| (k, len as u64)),
                }
            }
        };
        match outcome {
            Ok((n, b)) => {
                next += n;
                bytes += b;
            }
            Err(e) if transient(&e) => thread::yield_now(),
            Err(e) => return Err(format!("{} after {next} datagrams: {e}", mode.name())),
        }
    }
    Ok(Sent {
        mode,
        fallback,
        datagrams: next,
        bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// What the receiver saw.
#[derive(Debug, Default)]
struct Receipts {
    /// Datagrams received.
    datagrams: u64,
    /// Payload bytes received.
    bytes: u64,
    /// Bytes delivered by the first `recvmmsg` call (not timed, see the module docs).
    first_call_bytes: u64,
    /// `recvmmsg` calls that delivered data.
    calls: u64,
    /// When the first delivering call returned.
    first: Option<Instant>,
    /// When the last delivering call returned.
    last: Option<Instant>,
}

/// The receiver: drains `sock` until `expected` datagrams have arrived, or until the sender is
/// done (`sender_done`) and a whole [`IDLE_TIMEOUT`] has passed after that with nothing arriving.
fn receive(
    sock: &UdpSocket,
    size: usize,
    expected: u64,
    sender_done: &AtomicBool,
) -> Result<Receipts, String> {
    let mut batch = RecvBatch::new(size);
    let mut r = Receipts::default();
    let mut done_seen = false;
    while r.datagrams < expected {
        match batch.recv(sock) {
            Ok(Some(got)) => {
                let now = Instant::now();
                if r.first.is_none() {
                    r.first = Some(now);
                    r.first_call_bytes = got.bytes;
                }
                r.last = Some(now);
                r.calls += 1;
                r.datagrams += got.datagrams as u64;
                r.bytes += got.bytes;
            }
            Ok(None) => {
                // A timeout that began before the sender finished proves nothing; one that
                // began after it did means the rest is not coming.
                if done_seen {
                    break;
                }
                done_seen = sender_done.load(Ordering::Acquire);
            }
            Err(e) => return Err(format!("recvmmsg: {e}")),
        }
    }
    Ok(r)
}

/// Tests of the datagram plan and small real streams.
#[cfg(test)]
mod tests {
    use super::*;

    /// Streams are cut into full datagrams and one possibly shorter last one.
    #[test]
    fn plans() {
        assert_eq!(
            Plan::new(4096, 1 << 20),
            Plan {
                size: 4096,
                datagrams: 256,
                last_len: 4096
            }
        );
        let p = Plan::new(1000, 2500);
        assert_eq!(
            (p.datagrams, p.len(0), p.len(1), p.len(2)),
            (3, 1000, 1000, 500)
        );
        assert_eq!(Plan::new(8, 8).datagrams, 1);
    }

    /// Every send mode delivers a stream whose last datagram is short.
    #[test]
    fn every_mode_delivers_odd_lengths() {
        for mode in [SendMode::Send, SendMode::Sendmmsg, SendMode::Gso] {
            // 1000 datagrams, the last one short: small enough never to overflow the buffer.
            let r = run(&StreamArgs {
                size: 1000,
                bytes: 999_500,
                mode,
                json: true,
            })
            .unwrap();
            assert_eq!(r.bytes_sent, 999_500, "{mode:?}");
            assert_eq!(r.datagrams_sent, 1000, "{mode:?}");
            assert!(r.bytes_received <= r.bytes_sent, "{mode:?}");
            assert_eq!(r.datagrams_received + r.datagrams_lost, 1000, "{mode:?}");
            assert!(r.mb_s > 0.0 && r.mb_s.is_finite());
        }
    }
}
