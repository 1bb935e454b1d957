//! The rendezvous: how the ranks of a job find each other before any RDMA connection exists.
//!
//! Rank 0 listens on the master address (torchrun's `MASTER_ADDR`/`MASTER_PORT`); every other
//! rank connects and says who it is. After that the one operation is [`Store::all_gather`]:
//! every rank hands in some bytes (its QP endpoints and region keys, say) and gets back every
//! rank's, in rank order, through rank 0. The TCP connections stay open for the job's life, so
//! a later exchange (a sub-communicator's set-up) costs no new connection.
//!
//! Nothing here waits forever: every step has the store's deadline, and a rank whose connection
//! ends makes the others' exchange fail with [`StoreError::RankGone`] naming it.
//!
//! # Strangers at the door
//! Rank 0's port is open to whoever reaches it: a port scanner, a health check, a rank of
//! another job given the same port, an attacker. None of them can fail or stall the job:
//! - Rank 0 serves every connection at once (non-blocking, one thread): a connection that sends
//!   nothing, or a byte a second, holds up no one, and is closed after [`HELLO_TIMEOUT`] (or
//!   when the job has formed). At most [`MAX_PENDING`] wait at once; past that the oldest goes.
//! - A hello is `FRC2`, a length, then rank, world size and job token. A connection whose
//!   first bytes are not that, or whose length is over [`MAX_HELLO`], is closed and counted;
//!   one with the wrong token, another world size, a rank outside the world, or a rank another
//!   live connection holds is answered `ERR ...` (so a misconfigured rank of this job fails at
//!   once with [`StoreError::Refused`]), closed and counted. Rank 0 goes on waiting; if the job
//!   never forms, its [`StoreError::Timeout`] says what it turned away.
//! - A claim for a rank whose holder's connection has closed replaces it: that is a rank
//!   retrying after its first connection broke before rank 0's answer reached it (a rank
//!   retries by itself when its connection ends before the answer).
//! - Every length on the wire is bounded before anything is allocated ([`MAX_HELLO`],
//!   [`MAX_CARD`], [`MAX_TABLE`]), and buffers grow with the bytes that actually arrive, not
//!   with what a length field claims.
//! - [`Store::stats`] counts what was turned away ([`RendezvousStats`]).
//!
//! Without a token, a stranger that speaks the protocol and claims a free rank first takes it
//! (the real rank is then refused, and the job fails rather than runs with a stranger in it). A
//! job token closes that: set `FERROCE_JOB_TOKEN` ([`TOKEN_ENV`]) to the same secret for every
//! rank (the launcher's environment carries it), and rank 0 admits only hellos that present it,
//! compared in constant time. The token travels in clear over TCP: it keeps out strangers and
//! other jobs, not an eavesdropper on the path (who could as well forge RoCE packets).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Identifies the store's hello (and its version) on the wire.
const MAGIC: [u8; 4] = *b"FRC2";
/// The most bytes one rank may hand to one exchange.
pub const MAX_CARD: usize = 1 << 24;
/// The most bytes of a table (every rank's card) a rank accepts from rank 0.
pub const MAX_TABLE: usize = 1 << 30;
/// The longest job token.
pub const MAX_TOKEN: usize = 1024;
/// The most bytes a hello may say follow its length: rank, world size and token.
pub const MAX_HELLO: usize = 8 + MAX_TOKEN;
/// The environment variable holding the job token (unset or empty: no token).
pub const TOKEN_ENV: &str = "FERROCE_JOB_TOKEN";
/// How long a connection to rank 0 has to send its whole hello (or the store's timeout, if
/// shorter).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// The most connections rank 0 keeps waiting for a hello at once.
pub const MAX_PENDING: usize = 128;
/// The most bytes of rank 0's answer to a hello.
const MAX_ANSWER: usize = 4096;

/// Where a rank stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// How many ranks the job has.
    pub world_size: usize,
    /// Rank 0's address: where it listens, where the others connect.
    pub master: SocketAddr,
    /// The rank's index among the ranks of its host, if the launcher says (`LOCAL_RANK`).
    pub local_rank: Option<usize>,
}

impl RankInfo {
    /// Reads torchrun's environment: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (and
    /// `LOCAL_RANK` if set). Under Open MPI's or a PMI launcher's `mpirun`, which set their
    /// own rank variables, `RANK`, `WORLD_SIZE` and `LOCAL_RANK` fall back to
    /// `OMPI_COMM_WORLD_RANK`/`PMI_RANK`, `OMPI_COMM_WORLD_SIZE`/`PMI_SIZE` and
    /// `OMPI_COMM_WORLD_LOCAL_RANK` (`MASTER_ADDR` and `MASTER_PORT` still come from the
    /// caller: `mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`).
    pub fn from_env() -> Result<RankInfo, StoreError> {
        Self::from_vars(|k| {
            let fallbacks: &[&str] = match k {
                "RANK" => &["OMPI_COMM_WORLD_RANK", "PMI_RANK"],
                "WORLD_SIZE" => &["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"],
                "LOCAL_RANK" => &["OMPI_COMM_WORLD_LOCAL_RANK"],
                _ => &[],
            };
            std::iter::once(k)
                .chain(fallbacks.iter().copied())
                .find_map(|v| std::env::var(v).ok())
        })
    }

    /// As [`from_env`](Self::from_env), from any source of variables.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<RankInfo, StoreError> {
        let var = |k: &'static str| get(k).ok_or(StoreError::MissingVar(k));
        let number = |k: &'static str, v: String| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| StoreError::BadVar(k, v.clone()))
        };
        let rank = number("RANK", var("RANK")?)?;
        let world_size = number("WORLD_SIZE", var("WORLD_SIZE")?)?;
        let port = var("MASTER_PORT")?;
        let port: u16 = port
            .trim()
            .parse()
            .map_err(|_| StoreError::BadVar("MASTER_PORT", port.clone()))?;
        let host = var("MASTER_ADDR")?;
        let master = std::net::ToSocketAddrs::to_socket_addrs(&(host.trim(), port))
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| StoreError::BadVar("MASTER_ADDR", host.clone()))?;
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => Some(number("LOCAL_RANK", v)?),
            None => None,
        };
        if world_size == 0 || rank >= world_size {
            return Err(StoreError::BadRank { rank, world_size });
        }
        Ok(RankInfo {
            rank,
            world_size,
            master,
            local_rank,
        })
    }
}

/// Why the rendezvous failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An environment variable the launcher should have set is missing.
    #[error("{0} is not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")]
    MissingVar(&'static str),
    /// An environment variable does not parse.
    #[error("{0}={1:?} does not parse")]
    BadVar(&'static str, String),
    /// A job token longer than [`MAX_TOKEN`] (its bytes are not repeated here).
    #[error("a job token of {0} bytes (at most {MAX_TOKEN})")]
    BadToken(usize),
    /// A rank number outside the world.
    #[error("rank {rank} of a world of {world_size}")]
    BadRank {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// Rank 0 refused this rank (another world size, a rank another process holds, another
    /// job token).
    #[error("rendezvous refused: {0}")]
    Refused(String),
    /// A rank's connection ended (it exited or crashed).
    #[error("rank {0} left the job")]
    RankGone(usize),
    /// Rank 0 gave up on an exchange (another rank left or timed out) and said why.
    #[error("the exchange failed at rank 0: {0}")]
    Aborted(String),
    /// The deadline passed.
    #[error("rendezvous timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// A card longer than [`MAX_CARD`], or a malformed message.
    #[error("bad rendezvous message: {0}")]
    Protocol(String),
    /// A socket error.
    #[error("rendezvous: {0}")]
    Io(#[from] std::io::Error),
}

/// What rank 0 turned away while the job formed (see the module doc): every connection that
/// was not admitted as a rank is counted once, under the first reason that fits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RendezvousStats {
    /// Connections admitted as ranks.
    pub admitted: u64,
    /// Connections whose first bytes were not a hello, or that closed before a whole one.
    pub garbage: u64,
    /// Hellos whose length was over [`MAX_HELLO`].
    pub oversized: u64,
    /// Hellos without the job's token (or with a token when the job has none).
    pub bad_token: u64,
    /// Hellos with another world size.
    pub wrong_world: u64,
    /// Hellos claiming rank 0 or a rank outside the world.
    pub out_of_range: u64,
    /// Hellos claiming a rank a live connection already holds.
    pub duplicate: u64,
    /// Hellos that took the place of a rank's earlier connection, which had closed (a retry).
    pub replaced: u64,
    /// Connections that sent no whole hello within [`HELLO_TIMEOUT`], or by the time the job
    /// formed.
    pub silent: u64,
    /// Connections closed because [`MAX_PENDING`] others waited, and failed accepts (out of
    /// file descriptors, say).
    pub overflow: u64,
}

impl RendezvousStats {
    /// How many connections were turned away, for any reason (a retry that replaced its own
    /// earlier connection is not one).
    pub fn ignored(&self) -> u64 {
        self.garbage
            + self.oversized
            + self.bad_token
            + self.wrong_world
            + self.out_of_range
            + self.duplicate
            + self.silent
            + self.overflow
    }
}

impl std::fmt::Display for RendezvousStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} garbage, {} oversized, {} with a wrong token, {} with another world size, {} \
             out of range, {} duplicate, {} silent, {} overflowed",
            self.garbage,
            self.oversized,
            self.bad_token,
            self.wrong_world,
            self.out_of_range,
            self.duplicate,
            self.silent,
            self.overflow
        )
    }
}

/// The job token from [`TOKEN_ENV`]: `None` when unset or empty.
pub fn token_from_env() -> Result<Option<Vec<u8>>, StoreError> {
    use std::os::unix::ffi::OsStringExt;
    let token = std::env::var_os(TOKEN_ENV)
        .map(OsStringExt::into_vec)
        .filter(|t| !t.is_empty());
    match token {
        Some(t) if t.len() > MAX_TOKEN => Err(StoreError::BadToken(t.len())),
        t => Ok(t),
    }
}

/// Whether `got` is `want`, in a time that depends on `want`'s length only: a stranger learns
/// nothing from how long the comparison took about how much of its guess was right.
fn same_token(want: &[u8], got: &[u8]) -> bool {
    let mut diff = u8::from(want.len() != got.len());
    for (i, w) in want.iter().enumerate() {
        diff |= w ^ got.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

/// A rank's place in the rendezvous.
#[derive(Debug)]
pub struct Store {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Rank 0: a connection per other rank (index `r - 1`); the others: the one to rank 0.
    links: Vec<TcpStream>,
    /// Exchanges done so far (each message carries it, so a stray one is caught).
    round: u64,
    /// Rank 0: what it turned away while the job formed.
    stats: RendezvousStats,
}

fn io_err(e: std::io::Error, timeout: Duration, what: impl Into<String>) -> StoreError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => StoreError::Timeout(timeout, what.into()),
        ErrorKind::InvalidData => StoreError::Protocol(format!("{} from {}", e, what.into())),
        _ => StoreError::Io(e),
    }
}

/// A hello: magic, the length of the rest, rank, world size, token.
pub(crate) fn hello(rank: u32, world_size: u32, token: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(16 + token.len());
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&((8 + token.len()) as u32).to_be_bytes());
    h.extend_from_slice(&rank.to_be_bytes());
    h.extend_from_slice(&world_size.to_be_bytes());
    h.extend_from_slice(token);
    h
}

/// Reads one length-prefixed message (`u32` length, then the bytes), at most `max` bytes. The
/// buffer grows with the bytes that arrive, so a length that lies costs no memory.
pub(crate) fn read_msg(s: &mut impl Read, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a message of {len} bytes (at most {max})"),
        ));
    }
    let mut buf = Vec::with_capacity(len.min(64 << 10));
    Read::by_ref(s).take(len as u64).read_to_end(&mut buf)?;
    if buf.len() < len {
        return Err(ErrorKind::UnexpectedEof.into());
    }
    Ok(buf)
}

fn write_msg(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut m = Vec::with_capacity(4 + bytes.len());
    m.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    m.extend_from_slice(bytes);
    s.write_all(&m)
}

/// A connection to rank 0 that has not finished its hello.
struct Pending {
    s: TcpStream,
    /// The hello's bytes so far.
    buf: Vec<u8>,
    since: Instant,
}

/// Which of [`RendezvousStats`]' counters a connection turned away goes to.
pub(crate) type Counter = fn(&mut RendezvousStats) -> &mut u64;

/// What became of a pending connection after a read.
pub(crate) enum Step {
    /// More bytes are due.
    Wait,
    /// Closed and counted under the reason (the counter to bump).
    Drop(Counter),
    /// A whole hello: rank, world size, token.
    Hello(usize, usize, Vec<u8>),
}

impl Pending {
    /// Reads what has arrived (never more than the hello), and judges it.
    fn step(&mut self) -> Step {
        step_hello(&mut self.buf, &mut self.s)
    }
}

/// What the bytes of a hello received so far say: the pure half of [`step_hello`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HelloSoFar<'a> {
    /// `.0` bytes in all are due: read up to `.0 - buf.len()` more.
    Need(usize),
    /// Not one of ours: another magic, a length under 8.
    Garbage,
    /// A length over [`MAX_HELLO`].
    Oversized,
    /// A whole hello: rank, world size, token.
    Hello(u32, u32, &'a [u8]),
}

/// Judges the first bytes of a connection: magic first (on as many bytes as there are, so a
/// stranger is dropped at its first wrong byte), then the length, before waiting for more.
pub(crate) fn judge_hello(buf: &[u8]) -> HelloSoFar<'_> {
    let m = buf.len().min(4);
    if buf[..m] != MAGIC[..m] {
        // Not one of ours (a port scan, an HTTP probe, another program).
        return HelloSoFar::Garbage;
    }
    if buf.len() < 8 {
        return HelloSoFar::Need(8);
    }
    let len = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    if len > MAX_HELLO {
        return HelloSoFar::Oversized;
    }
    if len < 8 {
        return HelloSoFar::Garbage;
    }
    let want = 8 + len;
    match buf.len().cmp(&want) {
        std::cmp::Ordering::Less => HelloSoFar::Need(want),
        std::cmp::Ordering::Equal => {
            let word =
                |at: usize| u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
            HelloSoFar::Hello(word(8), word(12), &buf[16..])
        }
        // `step_hello` never reads past the hello; more bytes than it are not a hello.
        std::cmp::Ordering::Greater => HelloSoFar::Garbage,
    }
}

/// Reads from `s` what has arrived of a hello into `buf` (never more than the hello, at most
/// 256 bytes a read), and judges it.
pub(crate) fn step_hello(buf: &mut Vec<u8>, s: &mut impl Read) -> Step {
    loop {
        let want = match judge_hello(buf) {
            HelloSoFar::Need(want) => want,
            HelloSoFar::Garbage => return Step::Drop(|s| &mut s.garbage),
            HelloSoFar::Oversized => return Step::Drop(|s| &mut s.oversized),
            HelloSoFar::Hello(rank, size, token) => {
                return Step::Hello(rank as usize, size as usize, token.to_vec())
            }
        };
        let mut chunk = [0u8; 256];
        let n = (want - buf.len()).min(chunk.len());
        match s.read(&mut chunk[..n]) {
            Ok(0) => return Step::Drop(|s| &mut s.garbage),
            Ok(got) => buf.extend_from_slice(&chunk[..got]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Wait,
            Err(_) => return Step::Drop(|s| &mut s.garbage),
        }
    }
}

/// Whether the connection is still open (a closed one reads as the end of the stream).
fn alive(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let open = match s.peek(&mut [0u8; 1]) {
        Ok(n) => n > 0,
        Err(e) => e.kind() == ErrorKind::WouldBlock,
    };
    open && s.set_nonblocking(false).is_ok()
}

impl Store {
    /// Joins the rendezvous `info` names: rank 0 listens on the master address, the others
    /// connect to it (retrying until rank 0 is up, within `timeout`). Every rank presents the
    /// job token in [`TOKEN_ENV`], if set.
    pub fn join(info: &RankInfo, timeout: Duration) -> Result<Store, StoreError> {
        let token = token_from_env()?;
        if info.rank == 0 {
            let listener = TcpListener::bind(info.master)?;
            Store::serve_with_token(listener, info.world_size, timeout, token.as_deref())
        } else {
            Store::connect_with_token(
                info.master,
                info.rank,
                info.world_size,
                timeout,
                token.as_deref(),
            )
        }
    }

    /// Rank 0's side, on a listener already bound: waits (within `timeout`) for every other
    /// rank's hello. The job token is [`TOKEN_ENV`]'s, if set.
    pub fn serve(
        listener: TcpListener,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Store, StoreError> {
        let token = token_from_env()?;
        Store::serve_with_token(listener, world_size, timeout, token.as_deref())
    }

    /// As [`serve`](Self::serve), admitting only ranks that present `token` (`None`: ranks
    /// that present none). Connections that are not such a rank's hello are turned away and
    /// counted (see the module doc), never an error of the job's.
    pub fn serve_with_token(
        listener: TcpListener,
        world_size: usize,
        timeout: Duration,
        token: Option<&[u8]>,
    ) -> Result<Store, StoreError> {
        let want = token.unwrap_or_default();
        if want.len() > MAX_TOKEN {
            return Err(StoreError::BadToken(want.len()));
        }
        let deadline = Instant::now() + timeout;
        let hello_limit = timeout.min(HELLO_TIMEOUT);
        listener.set_nonblocking(true)?;
        let mut stats = RendezvousStats::default();
        let mut last_accept_error = None;
        let mut slots: Vec<Option<TcpStream>> = (1..world_size).map(|_| None).collect();
        let mut pending: VecDeque<Pending> = VecDeque::new();
        while slots.iter().any(Option::is_none) {
            let mut busy = false;
            loop {
                match listener.accept() {
                    Ok((s, _)) => {
                        busy = true;
                        if s.set_nonblocking(true).is_err() {
                            stats.garbage += 1;
                            continue;
                        }
                        if pending.len() >= MAX_PENDING {
                            pending.pop_front();
                            stats.overflow += 1;
                        }
                        pending.push_back(Pending {
                            s,
                            buf: Vec::new(),
                            since: Instant::now(),
                        });
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        // Out of file descriptors (a flood), or a connection reset before it
                        // was accepted: not the job's failure. The deadline bounds a listener
                        // that keeps failing.
                        stats.overflow += 1;
                        last_accept_error = Some(e.to_string());
                        break;
                    }
                }
            }
            let mut i = 0;
            while i < pending.len() {
                let step = pending[i].step();
                let p = match step {
                    Step::Wait if pending[i].since.elapsed() > hello_limit => {
                        stats.silent += 1;
                        pending.remove(i);
                        continue;
                    }
                    Step::Wait => {
                        i += 1;
                        continue;
                    }
                    Step::Drop(counter) => {
                        *counter(&mut stats) += 1;
                        pending.remove(i);
                        busy = true;
                        continue;
                    }
                    Step::Hello(rank, size, presented) => {
                        busy = true;
                        let p = pending.remove(i).expect("in range");
                        (p, rank, size, presented)
                    }
                };
                let (mut p, rank, size, presented) = p;
                let problem: Option<(Counter, String)> = if !same_token(want, &presented) {
                    // Nothing else is said to a connection without the token.
                    Some((|s| &mut s.bad_token, "the job token does not match".into()))
                } else if size != world_size {
                    Some((
                        |s| &mut s.wrong_world,
                        format!(
                            "rank {rank} says the world has {size} ranks, rank 0 says \
                                 {world_size}"
                        ),
                    ))
                } else if rank == 0 || rank >= world_size {
                    Some((
                        |s| &mut s.out_of_range,
                        format!("rank {rank} is outside a world of {world_size}"),
                    ))
                } else if slots[rank - 1].as_ref().is_some_and(alive) {
                    Some((
                        |s| &mut s.duplicate,
                        format!("two processes claim rank {rank}"),
                    ))
                } else {
                    None
                };
                if let Some((counter, why)) = problem {
                    *counter(&mut stats) += 1;
                    // A rank of this job that is misconfigured learns why at once; the
                    // connection is non-blocking, so a peer that reads nothing costs nothing.
                    let _ = write_msg(&mut p.s, format!("ERR {why}").as_bytes());
                    continue;
                }
                let s = p.s;
                let admitted = s.set_nonblocking(false).is_ok()
                    && s.set_nodelay(true).is_ok()
                    && s.set_read_timeout(Some(timeout)).is_ok()
                    && s.set_write_timeout(Some(hello_limit)).is_ok();
                let mut s = s;
                if !admitted || write_msg(&mut s, b"OK").is_err() {
                    stats.garbage += 1;
                    continue;
                }
                s.set_write_timeout(Some(timeout))?;
                if slots[rank - 1].replace(s).is_some() {
                    stats.replaced += 1;
                }
                stats.admitted += 1;
            }
            if slots.iter().all(Option::is_some) {
                // A rank whose connection broke after it was admitted is not counted in: the
                // job would form with it and fail at once. Its retry takes its place.
                for slot in slots.iter_mut() {
                    if slot.as_ref().is_some_and(|s| !alive(s)) {
                        *slot = None;
                    }
                }
                if slots.iter().all(Option::is_some) {
                    break;
                }
            }
            if Instant::now() > deadline {
                let missing: Vec<usize> =
                    (1..world_size).filter(|r| slots[r - 1].is_none()).collect();
                let mut what = format!("ranks {missing:?} (turned away: {stats}");
                if let Some(e) = last_accept_error {
                    what.push_str(&format!("; last accept error: {e}"));
                }
                what.push(')');
                return Err(StoreError::Timeout(timeout, what));
            }
            if !busy {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        stats.silent += pending.len() as u64;
        Ok(Store {
            rank: 0,
            world_size,
            timeout,
            links: slots.into_iter().flatten().collect(),
            round: 0,
            stats,
        })
    }

    /// A non-zero rank's side: connects to rank 0 at `master`, retrying until it answers or
    /// `timeout` passes. The job token is [`TOKEN_ENV`]'s, if set.
    pub fn connect(
        master: SocketAddr,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Store, StoreError> {
        let token = token_from_env()?;
        Store::connect_with_token(master, rank, world_size, timeout, token.as_deref())
    }

    /// As [`connect`](Self::connect), presenting `token` (`None`: none).
    pub fn connect_with_token(
        master: SocketAddr,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        token: Option<&[u8]>,
    ) -> Result<Store, StoreError> {
        let (Ok(r32), Ok(n32)) = (u32::try_from(rank), u32::try_from(world_size)) else {
            return Err(StoreError::BadRank { rank, world_size });
        };
        if rank == 0 || rank >= world_size {
            return Err(StoreError::BadRank { rank, world_size });
        }
        let token = token.unwrap_or_default();
        if token.len() > MAX_TOKEN {
            return Err(StoreError::BadToken(token.len()));
        }
        let deadline = Instant::now() + timeout;
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        loop {
            let mut s = match TcpStream::connect_timeout(&master, left()) {
                Ok(s) => s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(e) => return Err(io_err(e, timeout, format!("rank 0 at {master}"))),
            };
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(left()))?;
            s.set_write_timeout(Some(left()))?;
            let answer = s
                .write_all(&hello(r32, n32, token))
                .and_then(|()| read_msg(&mut s, MAX_ANSWER));
            let answer = match answer {
                Ok(a) => a,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::UnexpectedEof
                            | ErrorKind::ConnectionReset
                            | ErrorKind::BrokenPipe
                            | ErrorKind::ConnectionAborted
                    ) && Instant::now() < deadline =>
                {
                    // The connection broke before rank 0 answered (it turned away connections
                    // in a flood, say): try again; a claim of ours it admitted on the broken
                    // connection gives way to this one.
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(e) => return Err(io_err(e, timeout, "rank 0's answer")),
            };
            if answer != b"OK" {
                return Err(StoreError::Refused(
                    String::from_utf8_lossy(answer.strip_prefix(b"ERR ").unwrap_or(&answer))
                        .into_owned(),
                ));
            }
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            return Ok(Store {
                rank,
                world_size,
                timeout,
                links: vec![s],
                round: 0,
                stats: RendezvousStats::default(),
            });
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the job has.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// At rank 0, what it turned away while the job formed (all zeros at the other ranks).
    pub fn stats(&self) -> RendezvousStats {
        self.stats
    }
    /// Hands `card` in and returns every rank's card, in rank order (this rank's included).
    pub fn all_gather(&mut self, card: &[u8]) -> Result<Vec<Vec<u8>>, StoreError> {
        if card.len() > MAX_CARD {
            return Err(StoreError::Protocol(format!(
                "a card of {} bytes (at most {MAX_CARD})",
                card.len()
            )));
        }
        self.round += 1;
        let round = self.round.to_be_bytes();
        let timeout = self.timeout;
        if self.rank == 0 {
            let mut cards = vec![card.to_vec()];
            for i in 0..self.links.len() {
                let r = i + 1;
                let got = read_msg(&mut self.links[i], MAX_CARD + 8)
                    .map_err(|e| gone_or(e, r, timeout))
                    .and_then(|msg| {
                        if msg.len() < 8 || msg[..8] != round {
                            return Err(StoreError::Protocol(format!(
                                "rank {r} is not in exchange {}",
                                self.round
                            )));
                        }
                        Ok(msg[8..].to_vec())
                    });
                match got {
                    Ok(c) => cards.push(c),
                    Err(e) => {
                        // The others wait for the table: tell them now, not at their deadline.
                        let mut abort = ABORT.to_vec();
                        abort.extend_from_slice(e.to_string().as_bytes());
                        for s in self.links.iter_mut() {
                            let _ = write_msg(s, &abort);
                        }
                        return Err(e);
                    }
                }
            }
            let mut table = round.to_vec();
            for c in &cards {
                table.extend_from_slice(&(c.len() as u32).to_be_bytes());
                table.extend_from_slice(c);
            }
            for (i, s) in self.links.iter_mut().enumerate() {
                write_msg(s, &table).map_err(|e| gone_or(e, i + 1, timeout))?;
            }
            Ok(cards)
        } else {
            let s = &mut self.links[0];
            let mut msg = round.to_vec();
            msg.extend_from_slice(card);
            write_msg(s, &msg).map_err(|e| gone_or(e, 0, timeout))?;
            let most = (MAX_CARD + 4)
                .saturating_mul(self.world_size)
                .saturating_add(8)
                .min(MAX_TABLE);
            let table = read_msg(s, most).map_err(|e| gone_or(e, 0, timeout))?;
            parse_table(&table, &round, self.world_size)
        }
    }
}

/// A connection that ended is its rank gone; a read that timed out is a timeout.
fn gone_or(e: std::io::Error, rank: usize, timeout: Duration) -> StoreError {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            StoreError::RankGone(rank)
        }
        _ => io_err(e, timeout, format!("rank {rank}")),
    }
}

/// What rank 0 sends instead of a table when an exchange failed (then the reason).
const ABORT: [u8; 8] = [0xff; 8];

pub(crate) fn parse_table(t: &[u8], round: &[u8; 8], n: usize) -> Result<Vec<Vec<u8>>, StoreError> {
    let bad = |what: &str| StoreError::Protocol(what.to_string());
    if let Some(why) = t.strip_prefix(&ABORT) {
        return Err(StoreError::Aborted(
            String::from_utf8_lossy(why).into_owned(),
        ));
    }
    if t.len() < 8 || t[..8] != *round {
        // Rank 0 answers a round only once every rank handed its card in: a table of another
        // round means rank 0 moved on without us, or a rank 0 that failed.
        return Err(bad("a table of another exchange"));
    }
    let mut at = 8;
    let mut cards = Vec::with_capacity(n);
    for _ in 0..n {
        let len = t
            .get(at..at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| bad("a truncated table"))?;
        at += 4;
        let card = t.get(at..at + len).ok_or_else(|| bad("a truncated card"))?;
        cards.push(card.to_vec());
        at += len;
    }
    if at != t.len() {
        return Err(bad("bytes after the last card"));
    }
    Ok(cards)
}
