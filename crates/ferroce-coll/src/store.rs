//! The rendezvous: how the ranks of a job find each other before any RDMA connection exists.
//!
//! Rank 0 listens on the master address (torchrun's `MASTER_ADDR`/`MASTER_PORT`); every other
//! rank connects and says who it is. After that the one operation is [`Store::all_gather`]:
//! every rank hands in some bytes (its QP endpoints and region keys, say) and gets back every
//! rank's, in rank order, through rank 0. The TCP connections stay open for the job's life, so
//! a later exchange (a sub-communicator's set-up) costs no new connection.
//!
//! Nothing here waits forever: every step has the store's deadline, and a rank whose connection
//! ends makes the others' exchange fail with [`StoreError::RankGone`] naming it. Ranks that
//! disagree on the world size, or two ranks claiming one number, are refused at the hello.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Identifies the store's messages (and their version) on the wire.
const MAGIC: [u8; 4] = *b"FRC1";
/// The most bytes one rank may hand to one exchange.
pub const MAX_CARD: usize = 1 << 24;

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
    /// A rank number outside the world.
    #[error("rank {rank} of a world of {world_size}")]
    BadRank {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// The master refused this rank (or, at the master, a rank was refused).
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
}

fn io_err(e: std::io::Error, timeout: Duration, what: impl Into<String>) -> StoreError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            StoreError::Timeout(timeout, what.into())
        }
        _ => StoreError::Io(e),
    }
}

fn hello(rank: usize, world_size: usize) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&(rank as u32).to_be_bytes());
    h[8..12].copy_from_slice(&(world_size as u32).to_be_bytes());
    h
}

/// Reads one length-prefixed message (`u32` length, then the bytes), at most `max` bytes.
fn read_msg(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a message of {len} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn write_msg(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut m = Vec::with_capacity(4 + bytes.len());
    m.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    m.extend_from_slice(bytes);
    s.write_all(&m)
}

impl Store {
    /// Joins the rendezvous `info` names: rank 0 listens on the master address, the others
    /// connect to it (retrying until rank 0 is up, within `timeout`).
    pub fn join(info: &RankInfo, timeout: Duration) -> Result<Store, StoreError> {
        if info.rank == 0 {
            let listener = TcpListener::bind(info.master)?;
            Store::serve(listener, info.world_size, timeout)
        } else {
            Store::connect(info.master, info.rank, info.world_size, timeout)
        }
    }

    /// Rank 0's side, on a listener already bound: waits (within `timeout`) for every other
    /// rank's hello.
    pub fn serve(
        listener: TcpListener,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Store, StoreError> {
        let deadline = Instant::now() + timeout;
        listener.set_nonblocking(true)?;
        let mut slots: Vec<Option<TcpStream>> = (1..world_size).map(|_| None).collect();
        while slots.iter().any(Option::is_none) {
            let (mut s, _) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> =
                            (1..world_size).filter(|r| slots[r - 1].is_none()).collect();
                        return Err(StoreError::Timeout(timeout, format!("ranks {missing:?}")));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            let mut h = [0u8; 12];
            if s.read_exact(&mut h).is_err() || h[..4] != MAGIC {
                // Not one of ours (a port scan, another program): ignore it.
                continue;
            }
            let rank = u32::from_be_bytes(h[4..8].try_into().unwrap_or_default()) as usize;
            let size = u32::from_be_bytes(h[8..12].try_into().unwrap_or_default()) as usize;
            let problem = if size != world_size {
                Some(format!(
                    "rank {rank} says the world has {size} ranks, rank 0 says {world_size}"
                ))
            } else if rank == 0 || rank >= world_size {
                Some(format!("rank {rank} is outside a world of {world_size}"))
            } else if slots[rank - 1].is_some() {
                Some(format!("two processes claim rank {rank}"))
            } else {
                None
            };
            if let Some(p) = problem {
                let _ = write_msg(&mut s, format!("ERR {p}").as_bytes());
                return Err(StoreError::Refused(p));
            }
            write_msg(&mut s, b"OK")?;
            slots[rank - 1] = Some(s);
        }
        Ok(Store {
            rank: 0,
            world_size,
            timeout,
            links: slots.into_iter().flatten().collect(),
            round: 0,
        })
    }

    /// A non-zero rank's side: connects to rank 0 at `master`, retrying until it answers or
    /// `timeout` passes.
    pub fn connect(
        master: SocketAddr,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Store, StoreError> {
        if rank == 0 || rank >= world_size {
            return Err(StoreError::BadRank { rank, world_size });
        }
        let deadline = Instant::now() + timeout;
        let mut s = loop {
            match TcpStream::connect_timeout(&master, timeout) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(io_err(e, timeout, format!("rank 0 at {master}"))),
            }
        };
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        s.write_all(&hello(rank, world_size))?;
        let answer = read_msg(&mut s, 4096).map_err(|e| io_err(e, timeout, "rank 0's answer"))?;
        if answer != b"OK" {
            return Err(StoreError::Refused(
                String::from_utf8_lossy(answer.strip_prefix(b"ERR ").unwrap_or(&answer))
                    .into_owned(),
            ));
        }
        Ok(Store {
            rank,
            world_size,
            timeout,
            links: vec![s],
            round: 0,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the job has.
    pub fn world_size(&self) -> usize {
        self.world_size
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
            let table = read_msg(s, (MAX_CARD + 4) * self.world_size + 8)
                .map_err(|e| gone_or(e, 0, timeout))?;
            parse_table(&table, &round, self.world_size)
        }
    }
}

/// A connection that ended is its rank gone; a read that timed out is a timeout.
fn gone_or(e: std::io::Error, rank: usize, timeout: Duration) -> StoreError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => StoreError::RankGone(rank),
        _ => io_err(e, timeout, format!("rank {rank}")),
    }
}

/// What rank 0 sends instead of a table when an exchange failed (then the reason).
const ABORT: [u8; 8] = [0xff; 8];

fn parse_table(t: &[u8], round: &[u8; 8], n: usize) -> Result<Vec<Vec<u8>>, StoreError> {
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
