//! The target's queues on ferroce's verbs: one RC queue pair, one completion queue and one
//! thread per queue, driving a [`TargetQueue`] (what to move) against the shared [`Target`]
//! (the controllers).
//!
//! Per queue: receive buffers for `HSQSIZE + 1` capsules (a command and its in-capsule data
//! each), always posted again as soon as a capsule is taken; a bounce pool registered once, from
//! which each RDMA READ (a Write's data, from the host) and RDMA WRITE (a Read's data, to the
//! host) takes a slot of the largest transfer; responses go inline. What finds no free slot
//! waits in order, with everything after it, so a response never overtakes its data. The
//! queue ends when its connection does (the host's disconnect), when the transport fails (a
//! completion in error: a bad key, a host gone), when the host breaks the protocol, or when
//! its controller ends (the admin queue's end, or the keep-alive timeout).

use std::collections::VecDeque;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferroce::{
    Access, CompletionChannel, CompletionQueue, ConnectOptions, Context, InitAttr, MemoryRegion,
    QpCaps, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, WcStatus, WorkCompletion,
};

use super::bounce::Bounce;
use super::exchange::{self, Answer};
use crate::cm::{CmAccept, CmRejectStatus, CmRequest, RECFMT};
use crate::command::SQE_LEN;
use crate::controllers::Target;
use crate::queue::{Action, TargetQueue};

/// The host never reaches into the target's memory.
const TARGET_QP_ACCESS: Access = Access::LOCAL_WRITE;

/// How often a queue with nothing to do looks at its connection and its controller.
const IDLE_LOOK: Duration = Duration::from_millis(50);

/// What the target counts, for its report and its tests.
#[derive(Debug, Default)]
pub struct Counters {
    /// Queues connected (admin and I/O).
    pub queues_opened: AtomicU64,
    /// Queues ended.
    pub queues_closed: AtomicU64,
    /// Queues refused at connect.
    pub queues_refused: AtomicU64,
    /// Command capsules taken.
    pub commands: AtomicU64,
    /// Bytes moved to hosts by RDMA WRITE.
    pub bytes_to_hosts: AtomicU64,
    /// Bytes moved from hosts by RDMA READ.
    pub bytes_from_hosts: AtomicU64,
    /// Completions in error (a bad key, a host gone).
    pub transport_errors: AtomicU64,
    /// Controllers ended because their host sent nothing for a keep-alive timeout.
    pub keep_alive_expired: AtomicU64,
}

impl Counters {
    /// One line: every counter.
    pub fn summary(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "queues opened {} closed {} refused {}, commands {}, bytes to hosts {} from hosts {}, \
             transport errors {}, keep-alive expiries {}",
            g(&self.queues_opened),
            g(&self.queues_closed),
            g(&self.queues_refused),
            g(&self.commands),
            g(&self.bytes_to_hosts),
            g(&self.bytes_from_hosts),
            g(&self.transport_errors),
            g(&self.keep_alive_expired),
        )
    }
}

/// The transport's limits.
#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    /// The largest transfer of one command (the controller's MDTS in bytes).
    pub max_transfer: usize,
    /// In-capsule data a capsule may carry after its command.
    pub in_capsule: usize,
    /// Bytes of bounce buffer per queue (at least one transfer's worth is used).
    pub bounce_bytes: usize,
    /// Most entries a queue may have.
    pub max_queue_entries: u16,
    /// Most queues alive at once (all hosts together): past it a queue is refused with
    /// "no resources" before anything is made for it.
    pub max_queues: usize,
}

/// A serving target: its controllers, verbs context and counters.
pub struct Server {
    live: Arc<AtomicUsize>,
    ctx: Arc<Context>,
    target: Arc<Mutex<Target>>,
    limits: QueueLimits,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

fn lock(t: &Mutex<Target>) -> MutexGuard<'_, Target> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

impl Server {
    /// A server of `target`'s controllers on `ctx`.
    pub fn new(ctx: Arc<Context>, target: Target, limits: QueueLimits) -> Server {
        Server {
            live: Arc::new(AtomicUsize::new(0)),
            ctx,
            target: Arc::new(Mutex::new(target)),
            limits,
            counters: Arc::new(Counters::default()),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The counters.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// The flag that ends every queue and the listener when set.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// What a new queue's thread starts from.
    pub(super) fn setup(&self) -> QueueSetup {
        QueueSetup {
            live: self.live.clone(),
            ctx: self.ctx.clone(),
            target: self.target.clone(),
            limits: self.limits,
            counters: self.counters.clone(),
            stop: self.stop.clone(),
        }
    }

    /// Takes ferroce hosts' queues from `listener` (see [`super::exchange`]) until the stop
    /// flag is set; each queue runs on a thread of its own.
    pub fn serve_tcp(&self, listener: TcpListener) -> std::io::Result<()> {
        listener.set_nonblocking(true)?;
        while !self.stop.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false)?;
                    let q = self.setup();
                    std::thread::Builder::new()
                        .name("nvmf-queue".into())
                        .spawn(move || q.run_tcp(stream))?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// What a queue's thread starts from.
#[derive(Clone)]
pub(super) struct QueueSetup {
    pub(super) live: Arc<AtomicUsize>,
    pub(super) ctx: Arc<Context>,
    pub(super) target: Arc<Mutex<Target>>,
    pub(super) limits: QueueLimits,
    pub(super) counters: Arc<Counters>,
    pub(super) stop: Arc<AtomicBool>,
}

/// Why a request is refused, checked before any resource is made.
pub(super) fn check_request(req: &CmRequest, limits: &QueueLimits) -> Result<u16, CmRejectStatus> {
    if req.recfmt != RECFMT {
        return Err(CmRejectStatus::InvalidRecordFormat);
    }
    let entries = u32::from(req.hsqsize) + 1;
    if entries < 2 || entries > u32::from(limits.max_queue_entries) {
        return Err(CmRejectStatus::InvalidHsqsize);
    }
    if req.hrqsize == 0 || u32::from(req.hrqsize) > u32::from(limits.max_queue_entries) + 1 {
        return Err(CmRejectStatus::InvalidHrqsize);
    }
    Ok(entries as u16)
}

/// A queue's place among the live ones, given back when dropped.
pub(super) struct QueueTicket(Arc<AtomicUsize>);

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl QueueSetup {
    /// A place for one more queue, unless as many as the limits allow are alive.
    pub(super) fn ticket(&self) -> Option<QueueTicket> {
        let max = self.limits.max_queues;
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| QueueTicket(self.live.clone()))
    }

    fn run_tcp(self, mut stream: TcpStream) {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let Ok((req, host)) = exchange::read_request(&mut stream) else {
            return;
        };
        let entries = match check_request(&req, &self.limits) {
            Ok(n) => n,
            Err(r) => {
                self.counters.queues_refused.fetch_add(1, Ordering::Relaxed);
                let _ = exchange::answer(&mut stream, &Answer::Reject(r));
                return;
            }
        };
        let Some(_ticket) = self.ticket() else {
            self.counters.queues_refused.fetch_add(1, Ordering::Relaxed);
            let _ = exchange::answer(&mut stream, &Answer::Reject(CmRejectStatus::NoResources));
            return;
        };
        let q = match RdmaQueue::new(&self, entries, req.qid == 0) {
            Ok(q) => q,
            Err(_) => {
                self.counters.queues_refused.fetch_add(1, Ordering::Relaxed);
                let _ = exchange::answer(&mut stream, &Answer::Reject(CmRejectStatus::NoResources));
                return;
            }
        };
        let local = q.qp.endpoint_info(super::random_psn(), None);
        if q.qp.connect(&local, &host, &q.connect_options()).is_err() {
            self.counters.queues_refused.fetch_add(1, Ordering::Relaxed);
            let _ = exchange::answer(&mut stream, &Answer::Reject(CmRejectStatus::NoResources));
            return;
        }
        let accept = CmAccept {
            recfmt: RECFMT,
            crqsize: entries,
        };
        if exchange::answer(&mut stream, &Answer::Accept(accept, local)).is_err() {
            return;
        }
        self.counters.queues_opened.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nonblocking(true);
        let mut conn = Some(stream);
        q.run(&self, &mut || connection_ended(&mut conn));
        self.counters.queues_closed.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether the host closed the queue's connection (or broke it).
fn connection_ended(conn: &mut Option<TcpStream>) -> bool {
    let Some(s) = conn else {
        return true;
    };
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// What a work request was, by its ID's top byte.
mod wr {
    pub const RECV: u64 = 0;
    pub const READ: u64 = 1;
    pub const WRITE: u64 = 2;
    pub const SEND: u64 = 3;
    pub fn id(kind: u64, slot: usize, tag: u16) -> u64 {
        kind << 56 | (slot as u64) << 16 | u64::from(tag)
    }
    pub fn split(id: u64) -> (u64, usize, u16) {
        (id >> 56, ((id >> 16) & 0xff_ffff_ffff) as usize, id as u16)
    }
}

/// One queue's verbs and buffers.
pub(super) struct RdmaQueue {
    pub(super) qp: QueuePair,
    /// Submission queue entries (the request's HSQSIZE + 1): receives posted.
    entries: u16,
    cq: CompletionQueue,
    channel: CompletionChannel,
    recv: MemoryRegion,
    recv_slot: usize,
    bounce: Bounce,
    /// The length of the READ each slot was last given to.
    read_len: Vec<usize>,
}

impl RdmaQueue {
    pub(super) fn new(setup: &QueueSetup, entries: u16, admin: bool) -> ferroce::Result<RdmaQueue> {
        let ctx = &setup.ctx;
        let n = usize::from(entries);
        let pd = ctx.alloc_pd()?;
        let channel = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(n * 5 + 8, Some(&channel))?;
        let qp = pd.create_qp(&QpInitAttr::new(
            &cq,
            QpCaps {
                max_send_wr: (n * 3 + 4) as u32,
                max_recv_wr: n as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 64,
            },
        ))?;
        let recv_slot = SQE_LEN + setup.limits.in_capsule;
        let recv = pd.alloc_mr(recv_slot * n, Access::LOCAL_WRITE)?;
        // The admin queue moves a page at a time; an I/O queue gets a small slot per entry and
        // as many of the largest transfer as the limits allow.
        let large = if admin {
            1
        } else {
            (setup.limits.bounce_bytes / setup.limits.max_transfer.max(1)).clamp(1, n)
        };
        let small = if admin { 0 } else { n };
        let bounce = Bounce::new(&pd, small, large, setup.limits.max_transfer)?;
        // Receives are posted in INIT, before the host can send.
        qp.modify_to_init(&InitAttr {
            access: TARGET_QP_ACCESS,
            ..InitAttr::default()
        })?;
        for i in 0..n {
            qp.post_recv(RecvWr {
                wr_id: wr::id(wr::RECV, i, 0),
                sgl: vec![recv.sge(i * recv_slot, recv_slot)?],
            })?;
        }
        Ok(RdmaQueue {
            qp,
            entries,
            cq,
            channel,
            recv,
            recv_slot,
            read_len: vec![0; small + large],
            bounce,
        })
    }

    pub(super) fn connect_options(&self) -> ConnectOptions {
        ConnectOptions {
            access: TARGET_QP_ACCESS,
            ..ConnectOptions::default()
        }
    }

    /// Serves until the queue ends.
    pub(super) fn run(mut self, setup: &QueueSetup, ended: &mut dyn FnMut() -> bool) {
        let mut tq = TargetQueue::new(self.entries, setup.limits.in_capsule as u32);
        tq.set_max_transfer(u32::try_from(setup.limits.max_transfer).unwrap_or(u32::MAX));
        let mut waiting: VecDeque<Action> = VecDeque::new();
        let mut wcs = vec![ferroce::empty_wc(); 32];
        let mut last_look = Instant::now();
        'serve: while let Ok(n) = self.cq.poll(&mut wcs) {
            for wc in &wcs[..n] {
                let actions = match self.on_completion(setup, &mut tq, wc) {
                    Some(a) => a,
                    None => break 'serve,
                };
                waiting.extend(actions);
            }
            if !self.start(setup, &mut waiting) {
                break;
            }
            let now = Instant::now();
            if n == 0 || now.duration_since(last_look) >= IDLE_LOOK {
                last_look = now;
                if setup.stop.load(Ordering::Acquire) || ended() || self.controller_gone(setup, &tq)
                {
                    break;
                }
            }
            if n == 0 {
                if self.cq.req_notify(false).is_err() {
                    break;
                }
                if self.cq.is_empty() {
                    let _ = self.channel.get_event(Some(IDLE_LOOK));
                }
            }
        }
        // The controller of an admin queue ends with it; its I/O queues see it gone.
        if let Some(b) = tq.binding() {
            if b.qid == 0 {
                lock(&setup.target).remove(b.cntlid);
            }
        }
        self.qp.modify_to_error();
    }

    /// Whether the queue's controller ended (another queue's admin end, or keep-alive).
    fn controller_gone(&self, setup: &QueueSetup, tq: &TargetQueue) -> bool {
        let Some(b) = tq.binding() else {
            return false;
        };
        let t = lock(&setup.target);
        if b.qid == 0 && t.expired(Instant::now()).contains(&b.cntlid) {
            setup
                .counters
                .keep_alive_expired
                .fetch_add(1, Ordering::Relaxed);
            return true;
        }
        !t.controllers().contains(&b.cntlid)
    }

    /// What a completion means for the queue; `None` ends it.
    fn on_completion(
        &mut self,
        setup: &QueueSetup,
        tq: &mut TargetQueue,
        wc: &WorkCompletion,
    ) -> Option<Vec<Action>> {
        let (kind, slot, tag) = wr::split(wc.wr_id);
        if wc.status != WcStatus::Success {
            // Flushed work is the QP's end (a same-host peer that went away moves it to ERR),
            // not an error of its own.
            if wc.status != WcStatus::WorkRequestFlushed {
                setup
                    .counters
                    .transport_errors
                    .fetch_add(1, Ordering::Relaxed);
            }
            if kind == wr::READ {
                // The host's key did not grant its buffer: the QP is in error, the queue ends.
                let _ = tq.read_done(Instant::now(), &mut lock(&setup.target), tag, None);
            }
            return None;
        }
        match kind {
            wr::RECV => {
                let len = (wc.byte_len as usize).min(self.recv_slot);
                let capsule = self.recv.to_vec(slot * self.recv_slot, len).ok()?;
                setup.counters.commands.fetch_add(1, Ordering::Relaxed);
                let actions = tq.on_capsule(Instant::now(), &mut lock(&setup.target), &capsule);
                self.qp
                    .post_recv(RecvWr {
                        wr_id: wc.wr_id,
                        sgl: vec![self.recv.sge(slot * self.recv_slot, self.recv_slot).ok()?],
                    })
                    .ok()?;
                Some(actions)
            }
            wr::READ => {
                // A READ's completion need not carry its length (the verbs define byte_len for
                // receives): the length asked for is kept with the slot.
                let len = self.read_len.get(slot).copied().unwrap_or(0);
                setup
                    .counters
                    .bytes_from_hosts
                    .fetch_add(len as u64, Ordering::Relaxed);
                let mut target = lock(&setup.target);
                let actions = self
                    .bounce
                    .with_slot(slot, len, |data| {
                        tq.read_done(Instant::now(), &mut target, tag, Some(data))
                    })
                    .unwrap_or_else(|_| tq.read_done(Instant::now(), &mut target, tag, None));
                self.bounce.give(slot);
                Some(actions)
            }
            wr::WRITE => {
                self.bounce.give(slot);
                Some(Vec::new())
            }
            _ => Some(Vec::new()),
        }
    }

    /// Posts what can go now, in order; `false` ends the queue.
    fn start(&mut self, setup: &QueueSetup, waiting: &mut VecDeque<Action>) -> bool {
        while let Some(a) = waiting.front() {
            let needs = match a {
                Action::Read { len, .. } => Some(*len as usize),
                Action::Write { data, .. } => Some(data.len()),
                _ => None,
            };
            if let Some(len) = needs {
                // Larger than any transfer the controller announced: the host broke MDTS.
                if len > self.bounce.max_len() {
                    return false;
                }
                if !self.bounce.has_room(len) {
                    return true;
                }
            }
            let a = waiting.pop_front().expect("looked at");
            let posted = match a {
                Action::Read {
                    tag,
                    addr,
                    key,
                    len,
                } => {
                    let slot = self.bounce.take(len as usize).expect("checked");
                    self.read_len[slot] = len as usize;
                    self.bounce.sge(slot, len as usize).and_then(|sge| {
                        self.qp.post_send(
                            SendWr::new(wr::id(wr::READ, slot, tag), SendOp::Read, vec![sge])
                                .remote(addr, key),
                        )
                    })
                }
                Action::Write { addr, key, data } => {
                    let slot = self.bounce.take(data.len()).expect("checked");
                    setup
                        .counters
                        .bytes_to_hosts
                        .fetch_add(data.len() as u64, Ordering::Relaxed);
                    self.bounce
                        .write(slot, &data)
                        .and_then(|()| self.bounce.sge(slot, data.len()))
                        .and_then(|sge| {
                            self.qp.post_send(
                                SendWr::new(wr::id(wr::WRITE, slot, 0), SendOp::Write, vec![sge])
                                    .remote(addr, key),
                            )
                        })
                }
                Action::Send { cqe, invalidate } => {
                    let op = match invalidate {
                        Some(k) => SendOp::SendWithInvalidate(k),
                        None => SendOp::Send,
                    };
                    self.qp.post_send(
                        SendWr::new(wr::id(wr::SEND, 0, 0), op, Vec::new()).inline(cqe.to_vec()),
                    )
                }
                Action::Close => return false,
            };
            if posted.is_err() {
                return false;
            }
        }
        true
    }
}
