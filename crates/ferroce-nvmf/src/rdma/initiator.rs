//! The host's queues on ferroce's verbs: a controller brought up as Linux's host does
//! (Connect on the admin queue, CC.EN, CSTS.RDY, Identify, Set Features), then I/O queues whose
//! commands point at a registered buffer with keyed SGL data blocks, which the controller reads
//! and writes with RDMA.
//!
//! Each queue is an RC queue pair with its own completion queue and channel: responses arrive
//! in receive buffers of one completion entry each, posted again as soon as read; commands go
//! inline (64 bytes). The data buffer is one registered region cut into a slot per command in
//! flight, each of the largest transfer.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroce::{
    Access, CompletionChannel, CompletionQueue, ConnectOptions, Context, InitAttr, MemoryRegion,
    QpCaps, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
};

use super::exchange::{self, ExchangeError};
use super::wire_host::{WireConn, WireHost};
use crate::cm::{CmRequest, RECFMT};
use crate::command::{admin, io, Command, SQE_LEN};
use crate::completion::{Completion, Status, CQE_LEN};
use crate::fabrics::{Connect, ConnectData, Property, CNTLID_DYNAMIC};
use crate::host::{HostQueue, ResponseError};
use crate::identify;
use crate::properties;
use crate::sgl::Sgl;

/// What can go wrong on the host's side.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The verbs failed.
    #[error("{0}")]
    Verbs(#[from] ferroce::Error),
    /// The queue's exchange failed or was refused.
    #[error("{0}")]
    Exchange(#[from] ExchangeError),
    /// A system call failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The controller answered a command with an error.
    #[error("{what}: status {status:?}")]
    Status {
        /// The command.
        what: &'static str,
        /// Its status.
        status: Status,
    },
    /// A response that fits no command, or the transport failed.
    #[error("{0}")]
    Protocol(String),
    /// No answer in time.
    #[error("{0}: no answer within {1:?}")]
    Timeout(&'static str, Duration),
}

impl From<ResponseError> for HostError {
    fn from(e: ResponseError) -> HostError {
        HostError::Protocol(e.to_string())
    }
}

type Result<T> = std::result::Result<T, HostError>;

/// How the host connects.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The host's NQN.
    pub hostnqn: String,
    /// The host identifier.
    pub host_id: [u8; 16],
    /// The subsystem to connect to.
    pub subnqn: String,
    /// Entries of each I/O queue (commands in flight + 1).
    pub io_queue_entries: u16,
    /// The largest transfer of one command this host sends (its buffer slots).
    pub max_transfer: usize,
    /// How long a command may wait for its response.
    pub timeout: Duration,
    /// How queues connect.
    pub cm: HostCm,
    /// The keep-alive timeout asked for at Connect (KATO; zero: none, and a host that
    /// vanishes without a word holds its queues until the target ends). The controller ends
    /// when the target hears no command for this long: call [`Controller::keep_alive`] when
    /// idle.
    pub keep_alive_timeout: Duration,
}

/// How the host's queues connect to the target.
#[derive(Clone)]
pub enum HostCm {
    /// The TCP exchange of ferroce targets ([`super::exchange`]).
    Tcp,
    /// IB CM on the wire, as rdma_cm connects (kernel targets, RDMA NICs).
    Wire(Arc<WireHost>),
}

impl std::fmt::Debug for HostCm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostCm::Tcp => "Tcp",
            HostCm::Wire(_) => "Wire",
        })
    }
}

/// A queue's connection: closing it disconnects the queue.
enum Link {
    Tcp(#[allow(dead_code)] TcpStream),
    Wire(WireConn),
}

/// What the controller's Identify said of namespace 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// The namespace ID.
    pub nsid: u32,
    /// Bytes per logical block.
    pub block_size: usize,
    /// Logical blocks.
    pub blocks: u64,
}

/// A controller the host brought up: its admin queue and what Identify said.
pub struct Controller {
    ctx: Arc<Context>,
    target: SocketAddr,
    options: HostOptions,
    admin: Queue,
    /// The controller's ID.
    pub cntlid: u16,
    /// The controller's largest transfer in bytes (MDTS; `None`: no limit).
    pub max_transfer: Option<usize>,
    /// Namespace 1.
    pub namespace: NamespaceInfo,
}

/// One queue of the host.
pub struct Queue {
    qp: QueuePair,
    cq: CompletionQueue,
    channel: CompletionChannel,
    /// The queue's connection: closing it disconnects the queue.
    link: Link,
    host: HostQueue<usize>,
    /// Submission queue entries.
    entries: u16,
    responses: MemoryRegion,
    data: MemoryRegion,
    slot_len: usize,
    slots: usize,
    timeout: Duration,
    /// Where polls put completions (made once: `reap` runs for every command).
    wcs: Vec<ferroce::WorkCompletion>,
}

const ADMIN_ENTRIES: u16 = 32;

impl Queue {
    #[allow(clippy::too_many_arguments)]
    fn connect(
        ctx: &Context,
        cm: &HostCm,
        target: SocketAddr,
        qid: u16,
        entries: u16,
        slot_len: usize,
        slots: usize,
        timeout: Duration,
    ) -> Result<Queue> {
        let n = usize::from(entries);
        let pd = ctx.alloc_pd()?;
        let channel = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(n * 3 + 8, Some(&channel))?;
        let qp = pd.create_qp(&QpInitAttr::new(
            &cq,
            QpCaps {
                max_send_wr: n as u32 + 4,
                max_recv_wr: n as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: SQE_LEN as u32,
            },
        ))?;
        let responses = pd.alloc_mr(CQE_LEN * n, Access::LOCAL_WRITE)?;
        let data = pd.alloc_mr(
            slot_len * slots,
            Access::LOCAL_WRITE
                .with(Access::REMOTE_READ)
                .with(Access::REMOTE_WRITE),
        )?;
        // Receives are posted in INIT, before the target can answer.
        qp.modify_to_init(&InitAttr {
            access: ConnectOptions::default().access,
            ..InitAttr::default()
        })?;
        for i in 0..n {
            qp.post_recv(RecvWr {
                wr_id: i as u64,
                sgl: vec![responses.sge(i * CQE_LEN, CQE_LEN)?],
            })?;
        }
        let req = CmRequest {
            recfmt: RECFMT,
            qid,
            hrqsize: entries,
            hsqsize: entries - 1,
            cntlid: CNTLID_DYNAMIC,
        };
        let link = match cm {
            HostCm::Tcp => {
                let mut conn = TcpStream::connect_timeout(&target, timeout)?;
                conn.set_read_timeout(Some(timeout))?;
                conn.set_nodelay(true)?;
                let local = qp.endpoint_info(super::random_psn(), None);
                let (_, peer) = exchange::request(&mut conn, &req, &local)?;
                qp.connect(&local, &peer, &ConnectOptions::default())?;
                Link::Tcp(conn)
            }
            HostCm::Wire(host) => Link::Wire(host.connect(&qp, target, &req, timeout)?.0),
        };
        Ok(Queue {
            qp,
            cq,
            channel,
            link,
            host: HostQueue::new(qid, entries),
            entries,
            responses,
            data,
            slot_len,
            slots,
            timeout,
            wcs: vec![ferroce::empty_wc(); 64],
        })
    }

    /// Slots of the data buffer (commands that may be in flight with data).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether another command fits the queue now.
    pub fn can_submit(&self) -> bool {
        self.host.can_submit()
    }

    /// Commands in flight.
    pub fn outstanding(&self) -> usize {
        self.host.outstanding()
    }

    /// Writes `bytes` into a slot's buffer (a Write's data).
    pub fn fill(&self, slot: usize, bytes: &[u8]) -> Result<()> {
        Ok(self.data.write(slot * self.slot_len, bytes)?)
    }

    /// A slot's bytes (a Read's data, once its command completed).
    pub fn slot_bytes(&self, slot: usize, len: usize) -> Result<Vec<u8>> {
        Ok(self.data.to_vec(slot * self.slot_len, len)?)
    }

    /// The keyed SGL of `len` bytes of a slot.
    fn keyed(&self, slot: usize, len: usize) -> Sgl {
        Sgl::Keyed {
            addr: self.data.addr() + (slot * self.slot_len) as u64,
            len: len as u32,
            key: self.data.rkey(),
            invalidate: false,
        }
    }

    /// Sends `cmd` (its ID assigned here); `slot` comes back with its response.
    pub fn submit(&mut self, cmd: Command, slot: usize) -> Result<u16> {
        let (cid, capsule) = self
            .host
            .submit(cmd, &[], slot)
            .ok_or_else(|| HostError::Protocol("the submission queue is full".into()))?;
        self.qp
            .post_send(SendWr::new(u64::from(cid), SendOp::Send, Vec::new()).inline(capsule))?;
        Ok(cid)
    }

    /// Responses that arrived, waiting at most `wait` for the first one.
    pub fn reap(&mut self, wait: Duration) -> Result<Vec<(Completion, usize)>> {
        let deadline = Instant::now() + wait;
        let mut out = Vec::new();
        loop {
            let n = self.cq.poll(&mut self.wcs)?;
            for wc in &self.wcs[..n] {
                if wc.status != WcStatus::Success {
                    return Err(HostError::Protocol(format!(
                        "the queue's transport failed: {} ({:?})",
                        wc.status, wc.opcode
                    )));
                }
                if wc.opcode != WcOpcode::Recv {
                    continue;
                }
                let i = wc.wr_id as usize;
                let cqe = self
                    .responses
                    .to_vec(i * CQE_LEN, (wc.byte_len as usize).min(CQE_LEN))?;
                self.qp.post_recv(RecvWr {
                    wr_id: wc.wr_id,
                    sgl: vec![self.responses.sge(i * CQE_LEN, CQE_LEN)?],
                })?;
                out.push(self.host.on_response(&cqe)?);
            }
            if !out.is_empty() || Instant::now() >= deadline {
                return Ok(out);
            }
            if let Link::Wire(w) = &self.link {
                if w.disconnected() {
                    return Err(HostError::Protocol(
                        "the target disconnected the queue".into(),
                    ));
                }
            }
            if n == 0 {
                self.cq.req_notify(false)?;
                if self.cq.is_empty() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    self.channel
                        .get_event(Some(left.min(Duration::from_millis(20))))?;
                }
            }
        }
    }

    /// Runs one command to its response (nothing else in flight; any data moves through
    /// slot 0): its completion.
    fn run(&mut self, what: &'static str, cmd: Command) -> Result<Completion> {
        let cid = self.submit(cmd, 0)?;
        let deadline = Instant::now() + self.timeout;
        loop {
            for (c, _) in self.reap(Duration::from_millis(100))? {
                if c.cid == cid {
                    if !c.status.is_success() {
                        return Err(HostError::Status {
                            what,
                            status: c.status,
                        });
                    }
                    return Ok(c);
                }
            }
            if Instant::now() >= deadline {
                return Err(HostError::Timeout(what, self.timeout));
            }
        }
    }

    fn fabrics_connect(&mut self, opts: &HostOptions, qid: u16, cntlid: u16) -> Result<u16> {
        let data = ConnectData {
            host_id: opts.host_id,
            cntlid,
            subnqn: opts.subnqn.clone(),
            hostnqn: opts.hostnqn.clone(),
        }
        .encode()
        .map_err(|e| HostError::Protocol(e.to_string()))?;
        self.fill(0, &data)?;
        let sgl = self.keyed(0, data.len());
        let cmd = Connect {
            recfmt: 0,
            qid,
            sqsize: self.entries - 1,
            cattr: 0,
            // Milliseconds, and only the admin queue's counts.
            kato: if qid == 0 {
                u32::try_from(opts.keep_alive_timeout.as_nanos().div_ceil(1_000_000))
                    .unwrap_or(u32::MAX)
            } else {
                0
            },
        }
        .command(0, sgl)
        .map_err(|e| HostError::Protocol(e.to_string()))?;
        Ok(self.run("Connect", cmd)?.result as u16)
    }

    /// An I/O command on namespace `nsid` through `slot`: Read or Write of `blocks` blocks of
    /// `block_size` from `slba`.
    pub fn submit_io(
        &mut self,
        write: bool,
        ns: &NamespaceInfo,
        slba: u64,
        blocks: u32,
        slot: usize,
    ) -> Result<u16> {
        let len = blocks as usize * ns.block_size;
        if len > self.slot_len || blocks == 0 {
            return Err(HostError::Protocol(format!(
                "{len} bytes do not fit a slot of {}",
                self.slot_len
            )));
        }
        let mut cmd = Command::new(
            if write { io::WRITE } else { io::READ },
            0,
            ns.nsid,
            self.keyed(slot, len),
        )
        .map_err(|e| HostError::Protocol(e.to_string()))?;
        cmd.cdw[0] = slba as u32;
        cmd.cdw[1] = (slba >> 32) as u32;
        cmd.cdw[2] = blocks - 1;
        self.submit(cmd, slot)
    }
}

impl Controller {
    /// Connects to the target at `target` (a ferroce target's queue exchange) and brings the
    /// controller up.
    pub fn connect(ctx: Arc<Context>, target: SocketAddr, options: HostOptions) -> Result<Self> {
        let mut admin = Queue::connect(
            &ctx,
            &options.cm,
            target,
            0,
            ADMIN_ENTRIES,
            identify::PAGE,
            1,
            options.timeout,
        )?;
        let cntlid = admin.fabrics_connect(&options, 0, CNTLID_DYNAMIC)?;
        let cc = Property {
            offset: properties::CC,
            eight_bytes: false,
            // EN, I/O submission entries of 64 bytes, completion entries of 16.
            value: 4 << 20 | 6 << 16 | 1,
        };
        admin.run(
            "Property Set CC",
            without_data(cc.command(0, true).map_err(proto)?)?,
        )?;
        let deadline = Instant::now() + options.timeout;
        loop {
            let get = Property {
                offset: properties::CSTS,
                eight_bytes: false,
                value: 0,
            };
            let c = admin.run(
                "Property Get CSTS",
                without_data(get.command(0, false).map_err(proto)?)?,
            )?;
            if c.result & 1 == 1 {
                break;
            }
            if Instant::now() >= deadline {
                return Err(HostError::Timeout("CSTS.RDY", options.timeout));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let ctrl = admin.identify(0, identify::cns::CONTROLLER)?;
        let mdts = ctrl[77];
        // MPSMIN is 4 KiB (CAP.MPSMIN 0) on the targets this host reaches.
        // A value past what any transfer could be (a hostile target's) is no limit.
        let max_transfer = (1..=20).contains(&mdts).then(|| 4096usize << mdts);
        let ns = admin.identify(1, identify::cns::NAMESPACE)?;
        let blocks = u64::from_le_bytes(ns[0..8].try_into().expect("8 bytes"));
        let lbaf = usize::from(ns[26] & 0xf);
        let lbads = ns[128 + 4 * lbaf + 2];
        if !(9..=16).contains(&lbads) {
            return Err(HostError::Protocol(format!(
                "namespace 1 reports blocks of 2^{lbads} bytes"
            )));
        }
        let mut set = Command::new(
            admin::SET_FEATURES,
            0,
            0,
            Sgl::InCapsule { offset: 0, len: 0 },
        )
        .map_err(proto)?;
        set.cdw[0] = 0x07; // Number of Queues: one I/O queue each way.
        set.cdw[1] = 0;
        admin.run("Set Features (number of queues)", without_data(set)?)?;
        Ok(Controller {
            ctx,
            target,
            options,
            admin,
            cntlid,
            max_transfer,
            namespace: NamespaceInfo {
                nsid: 1,
                block_size: 1usize << lbads,
                blocks,
            },
        })
    }

    /// Connects I/O queue `qid` with slots of `slot_len` bytes.
    pub fn io_queue(&mut self, qid: u16, slot_len: usize) -> Result<Queue> {
        let entries = self.options.io_queue_entries.max(2);
        let mut q = Queue::connect(
            &self.ctx,
            &self.options.cm,
            self.target,
            qid,
            entries,
            slot_len.max(identify::PAGE),
            usize::from(entries - 1),
            self.options.timeout,
        )?;
        q.fabrics_connect(&self.options, qid, self.cntlid)?;
        Ok(q)
    }

    /// Sets the entries of I/O queues connected from now on.
    pub fn set_io_queue_entries(&mut self, entries: u16) {
        self.options.io_queue_entries = entries;
    }

    /// Sends a Keep Alive on the admin queue.
    pub fn keep_alive(&mut self) -> Result<()> {
        let cmd = Command::new(
            admin::KEEP_ALIVE,
            0,
            0,
            Sgl::InCapsule { offset: 0, len: 0 },
        )
        .map_err(proto)?;
        self.admin.run("Keep Alive", without_data(cmd)?).map(|_| ())
    }
}

impl Queue {
    fn identify(&mut self, nsid: u32, cns: u8) -> Result<Vec<u8>> {
        let mut cmd =
            Command::new(admin::IDENTIFY, 0, nsid, self.keyed(0, identify::PAGE)).map_err(proto)?;
        cmd.cdw[0] = u32::from(cns);
        self.run("Identify", cmd)?;
        self.slot_bytes(0, identify::PAGE)
    }
}

/// `cmd` pointing at no data as Linux's host does it: a keyed data block of length 0 (a target
/// such as the kernel's takes an in-capsule descriptor only for commands that write).
fn without_data(mut cmd: Command) -> Result<Command> {
    Sgl::Keyed {
        addr: 0,
        len: 0,
        key: 0,
        invalidate: false,
    }
    .write(&mut cmd.dptr)
    .map_err(proto)?;
    Ok(cmd)
}

fn proto(e: impl std::fmt::Display) -> HostError {
    HostError::Protocol(e.to_string())
}
