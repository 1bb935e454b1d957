//! A communicator: the ranks of a job connected pairwise over ferroce, and the collectives they
//! run together.
//!
//! # Set-up
//! Each rank opens one ferroce context (shared memory to ranks on its host, RoCE v2 over UDP to
//! the others: [`ferroce::Provider::Auto`]), creates one RC QP per other rank and registers its
//! buffers; one [`Store::all_gather`] tells every rank every other rank's QP endpoints and
//! buffer keys, and each pair connects.
//!
//! # Allreduce, allgather, reduce-scatter (ring)
//! The buffer is cut into `n` chunks. In `n - 1` reduce-scatter steps each rank sends one chunk
//! to its right neighbour and folds the chunk arriving from its left into its own; then each
//! rank holds one chunk reduced over all ranks, and `n - 1` allgather steps pass the reduced
//! chunks round the ring. A chunk moves as the way NCCL's IB transport moves it: an RDMA WRITE
//! into a buffer the receiver registered and published at set-up, followed by a zero-byte
//! WRITE with immediate whose immediate says which operation, phase and step it ends. Over
//! shared memory the WRITE is a copy straight into the neighbour's memory.
//!
//! Why no buffer is overwritten before it is read: each phase has its own region, and within an
//! operation a rank writes each chunk index of a region once. Operations alternate between the
//! two halves of the regions: the left neighbour, which writes into this rank's regions, can
//! finish an operation and start the next before this rank has read what arrived in the last,
//! but cannot finish that next one (and come back to the same half) before this rank started
//! it, because this rank's own contribution must come round the ring to it. Standalone
//! allgather and reduce-scatter are one phase of the same ring.
//!
//! # Failure
//! Every wait has the communicator's deadline: a rank that dies or stops answering makes the
//! others' collective fail with [`CollError`] (its QP goes to ERR, or the deadline passes),
//! never hang.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use ferroce::cm::{EndpointInfo, RemoteRegion};
use ferroce::{
    Access, CompletionQueue, ConnectOptions, Context, ContextOptions, MemoryRegion,
    ProtectionDomain, Provider, QpCaps, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, WcOpcode,
    WcStatus,
};

use crate::reduce::{finish_avg, reduce_into, DataType, ReduceOp};
use crate::store::{RankInfo, Store, StoreError};

/// How a communicator is made.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// How long any step may wait for another rank before the collective fails.
    pub timeout: Duration,
    /// Bytes of each staging and receiving region (per phase): an operation uses half of them
    /// (see the module doc), so a larger one is done in segments of half this size.
    pub segment_bytes: usize,
    /// Which provider carries the ranks' QPs (shared memory on one host, UDP between hosts).
    pub provider: Provider,
    /// The ferroce device to open; by default the one holding the address this host reaches
    /// the master from.
    pub device: Option<String>,
}

impl Default for CommOptions {
    fn default() -> CommOptions {
        CommOptions {
            timeout: Duration::from_secs(30),
            segment_bytes: 8 << 20,
            provider: Provider::Auto,
            device: None,
        }
    }
}

/// Why a collective (or the set-up) failed.
#[derive(Debug, thiserror::Error)]
pub enum CollError {
    /// The rendezvous failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A ferroce call failed.
    #[error("ferroce: {0}")]
    Verbs(#[from] ferroce::Error),
    /// No ferroce device fits.
    #[error("no ferroce device for {0}")]
    NoDevice(String),
    /// A rank's card does not parse.
    #[error("rank {0} sent a card that does not parse: {1}")]
    BadCard(usize, String),
    /// A work request failed (the peer left, or refused the access).
    #[error("rank {rank}: {what} failed: {status:?}")]
    Transfer {
        /// The peer rank of the QP.
        rank: usize,
        /// What was under way.
        what: &'static str,
        /// The completion's status.
        status: WcStatus,
    },
    /// A peer's message is not the one this step expects: the ranks called different
    /// collectives, or the same one with different sizes.
    #[error("rank {rank} sent step {got:#x} where {want:#x} was due (mismatched collectives?)")]
    OutOfStep {
        /// The peer rank.
        rank: usize,
        /// The immediate received.
        got: u32,
        /// The immediate expected.
        want: u32,
    },
    /// A peer stopped answering.
    #[error("no answer from rank {rank} within {timeout:?} ({what})")]
    Timeout {
        /// The peer rank.
        rank: usize,
        /// The deadline.
        timeout: Duration,
        /// What was awaited.
        what: &'static str,
    },
    /// Buffers whose sizes do not fit the collective.
    #[error("{what} of {got} bytes, {want} expected")]
    Size {
        /// Which buffer.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The size the collective needs.
        want: usize,
    },
    /// A buffer that is not a whole number of elements.
    #[error(transparent)]
    Reduce(#[from] crate::reduce::ReduceError),
}

/// Receive requests kept posted on each QP (each WRITE with immediate consumes one).
const RECV_DEPTH: usize = 64;

/// Regions a rank publishes, by index in the card.
const REGIONS: usize = 2;
/// The receiving region of the reduce-scatter phase.
const R_RS: usize = 0;
/// The receiving region of the allgather phase.
const R_AG: usize = 1;

/// One other rank as this rank sees it.
struct Link {
    qp: QueuePair,
    /// The peer's receiving regions (as published).
    remote: [RemoteRegion; REGIONS],
    /// Receives posted and not yet consumed.
    posted: usize,
}

/// The ranks of a job, connected; see the module doc.
pub struct Communicator {
    rank: usize,
    size: usize,
    store: Store,
    timeout: Duration,
    _ctx: Context,
    _pd: ProtectionDomain,
    /// Completions of this rank's sends.
    send_cq: CompletionQueue,
    /// Completions of the WRITEs with immediate that end each step (a neighbour ahead of this
    /// rank may already have sent the next ones: they wait here, in order).
    recv_cq: CompletionQueue,
    links: Vec<Option<Link>>,
    /// Where this rank stages what it sends, by phase.
    stage: [MemoryRegion; REGIONS],
    /// Where the left neighbour writes, by phase.
    inbox: [MemoryRegion; REGIONS],
    segment: usize,
    /// Operations done (the immediates carry it, so a stray message is caught).
    seq: u32,
    /// Signaled sends not yet completed.
    sends_out: usize,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

/// The ferroce device holding the address this host reaches `master` from.
fn device_for(master: SocketAddr) -> Result<ferroce::Device, CollError> {
    let local: IpAddr = if master.ip().is_loopback() {
        master.ip()
    } else {
        let probe = UdpSocket::bind(SocketAddr::new(
            if master.is_ipv4() {
                IpAddr::from([0, 0, 0, 0])
            } else {
                IpAddr::from([0u16; 8])
            },
            0,
        ))
        .and_then(|s| s.connect(master).map(|_| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| CollError::NoDevice(format!("a route to {master}: {e}")))?;
        probe.ip()
    };
    let gid = ferroce::gid_of(local);
    ferroce::devices()?
        .into_iter()
        .find(|d| d.gids().iter().any(|g| g.gid == gid))
        .ok_or_else(|| CollError::NoDevice(local.to_string()))
}

fn region_of(mr: &MemoryRegion) -> RemoteRegion {
    RemoteRegion {
        addr: mr.addr(),
        rkey: mr.rkey(),
        len: mr.len() as u64,
    }
}

/// Between two empty polls: spin, and now and then give the CPU away, so that ranks (and their
/// engines) that share a core more than they have one still all make progress.
fn idle(polls: &mut u32) {
    *polls = polls.wrapping_add(1);
    if *polls % 64 == 0 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// The immediate ending step `step` of `phase` (0 reduce-scatter, 1 allgather) of operation
/// `seq`.
fn imm(seq: u32, phase: usize, step: usize) -> u32 {
    (seq & 0xffff) << 16 | (phase as u32) << 15 | (step as u32 & 0x7fff)
}

impl Communicator {
    /// Joins the job torchrun's environment describes (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`).
    pub fn from_env(opts: &CommOptions) -> Result<Communicator, CollError> {
        let info = RankInfo::from_env()?;
        let store = Store::join(&info, opts.timeout)?;
        Communicator::with_store(store, info.master, opts)
    }

    /// Connects the ranks of `store` (whose rendezvous is at `master`).
    pub fn with_store(
        mut store: Store,
        master: SocketAddr,
        opts: &CommOptions,
    ) -> Result<Communicator, CollError> {
        let (rank, size) = (store.rank(), store.world_size());
        let device = match &opts.device {
            Some(name) => ferroce::device_by_name(name)?,
            None => device_for(master)?,
        };
        let ctx = device.open(&ContextOptions {
            provider: opts.provider,
            capture: None,
            ..ContextOptions::with_port(0)
        })?;
        let pd = ctx.alloc_pd()?;
        let send_cq = ctx.create_cq(512 * size.max(1), None)?;
        let recv_cq = ctx.create_cq((RECV_DEPTH + 16) * size.max(1), None)?;
        let segment = opts.segment_bytes.max(64);
        let rights = Access::LOCAL_WRITE.with(Access::REMOTE_WRITE);
        let stage = [pd.alloc_mr(segment, rights)?, pd.alloc_mr(segment, rights)?];
        let inbox = [pd.alloc_mr(segment, rights)?, pd.alloc_mr(segment, rights)?];
        let caps = QpCaps {
            max_send_wr: 256,
            max_recv_wr: RECV_DEPTH as u32,
            ..QpCaps::default()
        };
        let mut qps: Vec<Option<QueuePair>> = Vec::with_capacity(size);
        for r in 0..size {
            qps.push(if r == rank {
                None
            } else {
                Some(pd.create_qp(&QpInitAttr {
                    send_cq: &send_cq,
                    recv_cq: &recv_cq,
                    caps,
                    srq: None,
                })?)
            });
        }
        // The card: this rank's two receiving regions, then one endpoint per rank (a zero
        // record for itself).
        let psn =
            |qpn: u32| ferroce::Psn::new((qpn.wrapping_mul(2_654_435_761) ^ 0x5a5a) & 0xff_ffff);
        let mut card = Vec::new();
        for mr in &inbox {
            let r = region_of(mr);
            card.extend_from_slice(&r.addr.to_be_bytes());
            card.extend_from_slice(&r.len.to_be_bytes());
            card.extend_from_slice(&r.rkey.to_be_bytes());
        }
        let mut locals = Vec::with_capacity(size);
        for q in &qps {
            match q {
                Some(q) => {
                    let e = q.endpoint_info(psn(q.qpn()), None);
                    card.extend_from_slice(&e.to_bytes());
                    locals.push(Some(e));
                }
                None => {
                    card.extend_from_slice(&[0u8; ferroce::cm::ENDPOINT_LEN]);
                    locals.push(None);
                }
            }
        }
        let cards = store.all_gather(&card)?;
        let region_len = 20 * REGIONS;
        let mut links = Vec::with_capacity(size);
        for (r, q) in qps.into_iter().enumerate() {
            let Some(qp) = q else {
                links.push(None);
                continue;
            };
            let c = &cards[r];
            let want = region_len + size * ferroce::cm::ENDPOINT_LEN;
            if c.len() != want {
                return Err(CollError::BadCard(
                    r,
                    format!("{} bytes, {want} expected", c.len()),
                ));
            }
            let region = |i: usize| {
                let b = &c[20 * i..20 * i + 20];
                RemoteRegion {
                    addr: u64::from_be_bytes(b[..8].try_into().unwrap_or_default()),
                    len: u64::from_be_bytes(b[8..16].try_into().unwrap_or_default()),
                    rkey: u32::from_be_bytes(b[16..20].try_into().unwrap_or_default()),
                }
            };
            let at = region_len + rank * ferroce::cm::ENDPOINT_LEN;
            let peer = EndpointInfo::from_bytes(&c[at..at + ferroce::cm::ENDPOINT_LEN])
                .map_err(|e| CollError::BadCard(r, e.to_string()))?;
            let local = locals[r].expect("a QP for every other rank");
            qp.connect(&local, &peer, &ConnectOptions::default())?;
            for i in 0..RECV_DEPTH {
                qp.post_recv(RecvWr {
                    wr_id: i as u64,
                    sgl: vec![],
                })?;
            }
            links.push(Some(Link {
                qp,
                remote: [region(R_RS), region(R_AG)],
                posted: RECV_DEPTH,
            }));
        }
        // Every rank's QPs are ready before anyone sends.
        store.all_gather(&[])?;
        Ok(Communicator {
            rank,
            size,
            store,
            timeout: opts.timeout,
            _ctx: ctx,
            _pd: pd,
            send_cq,
            recv_cq,
            links,
            stage,
            inbox,
            segment,
            seq: 0,
            sends_out: 0,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The rendezvous, for exchanges outside the collectives.
    pub fn store(&mut self) -> &mut Store {
        &mut self.store
    }

    /// Reduces `buf` (elements of `dtype`) with `op` over every rank, in place: afterwards each
    /// rank's `buf` holds the same reduction.
    pub fn allreduce(
        &mut self,
        buf: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        let es = dtype.size();
        if buf.len() % es != 0 {
            return Err(crate::reduce::ReduceError::PartialElement {
                len: buf.len(),
                dtype,
            }
            .into());
        }
        if self.size > 1 && !buf.is_empty() {
            // Segments of whole elements that fit half a region (see `block_op`), each cut
            // into `n` chunks.
            let seg = (self.segment / 2 / es).max(1) * es;
            for part in buf.chunks_mut(seg) {
                self.ring_allreduce(part, dtype, op)?;
            }
        }
        if op == ReduceOp::Avg {
            finish_avg(buf, dtype, self.size)?;
        }
        Ok(())
    }

    /// Waits until every rank called `barrier`.
    pub fn barrier(&mut self) -> Result<(), CollError> {
        // An allreduce of one byte: every rank's contribution must come round the ring.
        let mut b = [0u8];
        self.allreduce(&mut b, DataType::U8, ReduceOp::Max)
    }

    fn ring_allreduce(
        &mut self,
        buf: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        let (n, r) = (self.size, self.rank);
        let es = dtype.size();
        let elems = buf.len() / es;
        // Chunk i: elements [start(i), start(i + 1)).
        let start = |i: usize| (elems * i / n) * es;
        self.seq = self.seq.wrapping_add(1);
        // Reduce-scatter sends chunk r first (after n - 1 steps this rank holds chunk r + 1
        // reduced over all); the allgather passes on chunk r + 1 first.
        let base = self.half_base();
        self.ring_phase(buf, &start, R_RS, r, base, Some((dtype, op)))?;
        self.ring_phase(buf, &start, R_AG, r + 1, base, None)?;
        self.drain_sends()
    }

    /// One phase of the ring over `buf` cut into chunks at `start(0..=n)`: `n - 1` steps, step
    /// `s` sending chunk `first - s` to the right and taking chunk `first - s - 1` from the
    /// left, folded in with `reduce` or copied. Chunks live at offset `base` + their offset in
    /// the regions.
    fn ring_phase(
        &mut self,
        buf: &mut [u8],
        start: &dyn Fn(usize) -> usize,
        phase: usize,
        first: usize,
        base: usize,
        reduce: Option<(DataType, ReduceOp)>,
    ) -> Result<(), CollError> {
        let (n, r) = (self.size, self.rank);
        let right = (r + 1) % n;
        let left = (r + n - 1) % n;
        let seq = self.seq;
        let range = |i: usize| start(i)..start(i + 1);
        for step in 0..n - 1 {
            let send = (first + n - step % n) % n;
            let recv = (send + n - 1) % n;
            self.send_chunk(
                right,
                phase,
                seq,
                step,
                &buf[range(send)],
                base + start(send),
            )?;
            self.wait_step(left, imm(seq, phase, step))?;
            let rr = range(recv);
            let inbox = &self.inbox[phase];
            let at = base + rr.start;
            match reduce {
                Some((dtype, op)) => {
                    let len = rr.len();
                    // SAFETY: the left neighbour wrote this chunk of the region before the
                    // WRITE with immediate just received, and writes it again only in a later
                    // operation, which it cannot start before this rank finished this one
                    // (see the module doc); nothing else writes the region.
                    unsafe {
                        inbox.with_slice(at, len, |src| reduce_into(&mut buf[rr], src, dtype, op))
                    }??;
                }
                None => inbox.read(at, &mut buf[rr])?,
            }
        }
        Ok(())
    }

    /// Gathers every rank's `input` into `output` (`n` blocks of `input.len()` bytes, block `i`
    /// from rank `i`).
    pub fn allgather(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CollError> {
        let n = self.size;
        let block = input.len();
        if output.len() != block * n {
            return Err(CollError::Size {
                what: "allgather output",
                got: output.len(),
                want: block * n,
            });
        }
        output[self.rank * block..(self.rank + 1) * block].copy_from_slice(input);
        if n == 1 || block == 0 {
            return Ok(());
        }
        // Segments of each block, gathered in a contiguous buffer of n pieces that fits half
        // a region (see `block_op`).
        self.block_op(output, block, 1, |comm, work, piece| {
            let start = |i: usize| i * piece;
            comm.ring_phase(work, &start, R_AG, comm.rank, comm.half_base(), None)
        })
    }

    /// Reduces `input` (`n` blocks of `output.len()` bytes) over every rank with `op` and
    /// leaves block `rank` of the result in `output`.
    pub fn reduce_scatter(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollError> {
        let n = self.size;
        let block = output.len();
        if input.len() != block * n {
            return Err(CollError::Size {
                what: "reduce_scatter input",
                got: input.len(),
                want: block * n,
            });
        }
        if block % dtype.size() != 0 {
            return Err(crate::reduce::ReduceError::PartialElement { len: block, dtype }.into());
        }
        let mut work = input.to_vec();
        if n > 1 && block > 0 {
            let first = (self.rank + n - 1) % n;
            self.block_op(&mut work, block, dtype.size(), |comm, w, piece| {
                let start = |i: usize| i * piece;
                comm.ring_phase(w, &start, R_RS, first, comm.half_base(), Some((dtype, op)))
            })?;
        }
        output.copy_from_slice(&work[self.rank * block..(self.rank + 1) * block]);
        if op == ReduceOp::Avg {
            finish_avg(output, dtype, n)?;
        }
        Ok(())
    }

    /// Runs `phase` over `data` (`n` blocks of `block` bytes) a segment of every block at a
    /// time: each segment's pieces are gathered into a contiguous buffer, `phase` runs on it
    /// (pieces of `piece` bytes), and they go back.
    fn block_op(
        &mut self,
        data: &mut [u8],
        block: usize,
        elem: usize,
        mut phase: impl FnMut(&mut Communicator, &mut [u8], usize) -> Result<(), CollError>,
    ) -> Result<(), CollError> {
        let n = self.size;
        let per_piece = ((self.segment / 2 / n) / elem).max(1) * elem;
        let mut work = Vec::with_capacity(per_piece * n);
        let mut at = 0;
        while at < block {
            let piece = per_piece.min(block - at);
            work.clear();
            for i in 0..n {
                work.extend_from_slice(&data[i * block + at..i * block + at + piece]);
            }
            self.seq = self.seq.wrapping_add(1);
            phase(self, &mut work, piece)?;
            self.drain_sends()?;
            for i in 0..n {
                data[i * block + at..i * block + at + piece]
                    .copy_from_slice(&work[i * piece..(i + 1) * piece]);
            }
            at += piece;
        }
        Ok(())
    }

    /// Where this operation's half of the regions starts. Operations alternate between the two
    /// halves: a neighbour that finished an operation may start the next before this rank read
    /// what it received in the last one, but not before this rank started the next one (this
    /// rank's own contribution must come round the ring to it), so it never writes the half
    /// this rank may still be reading.
    fn half_base(&self) -> usize {
        (self.seq as usize % 2) * (self.segment / 2)
    }

    /// Stages `data` (chunk bytes at offset `at` of the segment) and WRITEs it to the same
    /// offset of `to`'s receiving region of `phase`, then the WRITE with immediate that ends
    /// the step.
    fn send_chunk(
        &mut self,
        to: usize,
        phase: usize,
        seq: u32,
        step: usize,
        data: &[u8],
        at: usize,
    ) -> Result<(), CollError> {
        let stage = &self.stage[phase];
        let link = self.links[to].as_ref().expect("a link to every other rank");
        let dst = link.remote[phase];
        let mut wrs = Vec::with_capacity(2);
        if !data.is_empty() {
            stage.write(at, data)?;
            let mut w = SendWr::new(0, SendOp::Write, vec![stage.sge(at, data.len())?])
                .remote(dst.addr + at as u64, dst.rkey);
            w.flags.signaled = false;
            wrs.push(w);
        }
        wrs.push(
            SendWr::new(1, SendOp::WriteWithImm(imm(seq, phase, step)), vec![])
                .remote(dst.addr, dst.rkey),
        );
        link.qp.post_send_batch(wrs)?;
        self.sends_out += 1;
        Ok(())
    }

    /// Polls until the step's WRITE with immediate from `from` arrived (send completions seen
    /// meanwhile are counted).
    fn wait_step(&mut self, from: usize, want: u32) -> Result<(), CollError> {
        let deadline = Instant::now() + self.timeout;
        let from_qpn = self.links[from].as_ref().map(|l| l.qp.qpn());
        let mut polls = 0u32;
        loop {
            if let Some(wc) = self.recv_cq.poll_one()? {
                let rank = self.rank_of_qpn(wc.qp_num);
                if wc.status == WcStatus::WorkRequestFlushed && Some(wc.qp_num) != from_qpn {
                    // A QP this step does not use went to ERR (its peer left: with the ring
                    // only the neighbours' QPs carry anything, the others' posted receives are
                    // flushed when their peer goes). Whoever needs that peer fails on its own
                    // QP, or at its deadline.
                    continue;
                }
                if wc.status != WcStatus::Success {
                    return Err(CollError::Transfer {
                        rank,
                        what: "a receive",
                        status: wc.status,
                    });
                }
                self.repost(rank)?;
                let got = wc.imm_data.unwrap_or(u32::MAX);
                if Some(wc.qp_num) != from_qpn
                    || wc.opcode != WcOpcode::RecvRdmaWithImm
                    || got != want
                {
                    return Err(CollError::OutOfStep { rank, got, want });
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CollError::Timeout {
                    rank: from,
                    timeout: self.timeout,
                    what: "a step of a collective",
                });
            }
            idle(&mut polls);
        }
    }

    /// Waits for every signaled send to complete (its bytes left the staging region).
    fn drain_sends(&mut self) -> Result<(), CollError> {
        let deadline = Instant::now() + self.timeout;
        let mut polls = 0u32;
        while self.sends_out > 0 {
            match self.send_cq.poll_one()? {
                Some(wc) => {
                    if wc.status != WcStatus::Success {
                        return Err(CollError::Transfer {
                            rank: self.rank_of_qpn(wc.qp_num),
                            what: "a send",
                            status: wc.status,
                        });
                    }
                    self.sends_out -= 1;
                }
                None if Instant::now() > deadline => {
                    return Err(CollError::Timeout {
                        rank: (self.rank + 1) % self.size,
                        timeout: self.timeout,
                        what: "the acknowledgement of a send",
                    });
                }
                None => idle(&mut polls),
            }
        }
        Ok(())
    }

    fn repost(&mut self, rank: usize) -> Result<(), CollError> {
        if let Some(l) = self.links[rank].as_mut() {
            l.posted -= 1;
            while l.posted < RECV_DEPTH {
                l.qp.post_recv(RecvWr {
                    wr_id: 0,
                    sgl: vec![],
                })?;
                l.posted += 1;
            }
        }
        Ok(())
    }

    fn rank_of_qpn(&self, qpn: u32) -> usize {
        self.links
            .iter()
            .position(|l| l.as_ref().is_some_and(|l| l.qp.qpn() == qpn))
            .unwrap_or(usize::MAX)
    }
}
