//! `ferroce._ferroce`: the Rust side of the `ferroce` Python package.
//!
//! Verbs shaped like rdma-core's pyverbs (`Context`, `PD`, `MR`, `CQ`, `QP`, `SGE`, `SendWR`,
//! `RecvWR`, work completions with ibverbs' status and opcode numbers), and a `Communicator`
//! running ferroce-coll's collectives on Python buffers. Memory regions are read and written by
//! copy: no Python object views memory a remote peer may write. Every call that waits releases
//! the GIL. Failures of calls raise `VerbsError` (verbs) or `CollectiveError` (collectives);
//! failed work requests are completions with a status, as in pyverbs.
//!
//! The collectives take Python objects, never addresses: the extension asks each object for
//! its bytes through the buffer protocol and holds them exported for the call (the `buffer`
//! module, which says why its C-API declarations are its own in an abi3-py39 build). An
//! earlier design took `(address, length)` pairs from the package's Python code; that let a
//! temporary be freed before the call read it (the torch backend's `t.contiguous()` of a
//! strided tensor: a use-after-free that sent heap contents to a peer), and let any Python code
//! have the extension read or write anywhere. Now no caller can name memory it does not hold,
//! a buffer is checked against what its exporter reports, and an input that overlaps the output
//! is refused. The one exception is the `capi` module's table of C functions for the package's
//! C++ torch backend, which takes addresses from C++ (tensors it holds); Python code could
//! reach it only through ctypes, which can already write anywhere. The collective methods keep
//! a leading underscore: `ferroce.collectives` and `ferroce.torch` are the public faces
//! (element types, tensors), these are theirs.

mod buffer;
mod capi;

use std::time::Duration;

use buffer::{in_out, Input, Output};

use ferroce::cm::{EndpointInfo, RemoteRegion};
use ferroce::{
    Access, ConnectOptions, InitAttr, Provider, QpCaps, QpInitAttr, RecvWr, SendOp, SendWr, Sge,
    WcOpcode, WcStatus, WorkCompletion,
};
use ferroce_coll::{CommOptions, DataType, ReduceOp};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

create_exception!(
    _ferroce,
    VerbsError,
    PyException,
    "A verbs call failed (bad arguments, wrong QP state, no such device, ...)."
);
create_exception!(
    _ferroce,
    CollectiveError,
    PyException,
    "A collective failed: a rank left or stalled, or the ranks called different collectives."
);

fn verbs_err(e: impl std::fmt::Display) -> PyErr {
    VerbsError::new_err(e.to_string())
}

fn coll_err(e: impl std::fmt::Display) -> PyErr {
    CollectiveError::new_err(e.to_string())
}

fn provider_of(name: Option<&str>) -> PyResult<Provider> {
    match name {
        None => Provider::from_env().map_err(verbs_err),
        Some(n) => n
            .parse()
            .map_err(|_| PyValueError::new_err(format!("provider {n:?}: auto, udp or shm"))),
    }
}

/// ibverbs' `enum ibv_wc_status` number of a status.
fn status_number(s: WcStatus) -> u32 {
    match s {
        WcStatus::Success => 0,
        WcStatus::LocalLengthError => 1,
        WcStatus::LocalQpOperationError => 2,
        WcStatus::LocalProtectionError => 4,
        WcStatus::WorkRequestFlushed => 5,
        WcStatus::RemoteInvalidRequestError => 9,
        WcStatus::RemoteAccessError => 10,
        WcStatus::RemoteOperationalError => 11,
        WcStatus::TransportRetryExceeded => 12,
        WcStatus::RnrRetryExceeded => 13,
    }
}

/// ibverbs' `enum ibv_wc_opcode` number of an opcode.
fn opcode_number(o: WcOpcode) -> u32 {
    match o {
        WcOpcode::Send => 0,
        WcOpcode::RdmaWrite => 1,
        WcOpcode::RdmaRead => 2,
        WcOpcode::CompareSwap => 3,
        WcOpcode::FetchAdd => 4,
        WcOpcode::Recv => 128,
        WcOpcode::RecvRdmaWithImm => 129,
    }
}

/// A device opened: pyverbs' `Context(name=...)`.
#[pyclass(module = "ferroce")]
struct Context {
    ctx: ferroce::Context,
}

#[pymethods]
impl Context {
    /// Opens device `name` (`lo`, `ferroce_lo`, an interface name) with its own UDP port;
    /// `provider` is auto (shared memory to same-host peers), udp or shm (default: the
    /// FERROCE_PROVIDER environment variable, else auto).
    #[new]
    #[pyo3(signature = (name = "lo", provider = None))]
    fn new(name: &str, provider: Option<&str>) -> PyResult<Context> {
        let device = ferroce::device_by_name(name).map_err(verbs_err)?;
        let ctx = device
            .open(&ferroce::ContextOptions {
                provider: provider_of(provider)?,
                ..ferroce::ContextOptions::with_port(0)
            })
            .map_err(verbs_err)?;
        Ok(Context { ctx })
    }

    /// The device's name.
    #[getter]
    fn name(&self) -> String {
        self.ctx.device().name().to_string()
    }

    /// The RoCE v2 GID the context uses.
    #[getter]
    fn gid(&self) -> String {
        self.ctx.gid().to_string()
    }
}

/// A protection domain.
#[pyclass(module = "ferroce", name = "PD")]
struct Pd {
    pd: ferroce::ProtectionDomain,
    ctx: ferroce::Context,
}

#[pymethods]
impl Pd {
    #[new]
    fn new(ctx: &Context) -> PyResult<Pd> {
        Ok(Pd {
            pd: ctx.ctx.alloc_pd().map_err(verbs_err)?,
            ctx: ctx.ctx.clone(),
        })
    }
}

/// A memory region ferroce allocates (zeroed, page-aligned): read and written by copy.
#[pyclass(module = "ferroce", name = "MR")]
struct Mr {
    mr: ferroce::MemoryRegion,
}

#[pymethods]
impl Mr {
    /// `length` bytes with `access` (an or of `ACCESS_*`).
    #[new]
    #[pyo3(signature = (pd, length, access = 15))]
    fn new(pd: &Pd, length: usize, access: u32) -> PyResult<Mr> {
        Ok(Mr {
            mr: pd
                .pd
                .alloc_mr(length, Access::from_bits(access))
                .map_err(verbs_err)?,
        })
    }

    /// A copy of `length` bytes from `offset`.
    #[pyo3(signature = (length, offset = 0))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        length: usize,
        offset: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = self.mr.to_vec(offset, length).map_err(verbs_err)?;
        Ok(PyBytes::new(py, &v))
    }

    /// Copies `data` (bytes, a bytearray, or anything `bytes()` takes) in at `offset`.
    #[pyo3(signature = (data, offset = 0))]
    fn write(&self, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        if let Ok(b) = data.downcast::<PyBytes>() {
            return self.mr.write(offset, b.as_bytes()).map_err(verbs_err);
        }
        let bytes: Vec<u8> = match data.downcast::<PyByteArray>() {
            Ok(b) => b.to_vec(),
            Err(_) => data
                .py()
                .get_type::<PyBytes>()
                .call1((data,))?
                .downcast_into::<PyBytes>()?
                .as_bytes()
                .to_vec(),
        };
        self.mr.write(offset, &bytes).map_err(verbs_err)
    }

    /// The local key.
    #[getter]
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    /// The remote key.
    #[getter]
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    /// The address a peer names.
    #[getter]
    fn addr(&self) -> u64 {
        self.mr.addr()
    }
    /// Its length.
    #[getter]
    fn length(&self) -> usize {
        self.mr.len()
    }
    fn __len__(&self) -> usize {
        self.mr.len()
    }
}

/// A completion queue.
#[pyclass(module = "ferroce", name = "CQ")]
struct Cq {
    cq: ferroce::CompletionQueue,
}

/// A work completion.
#[pyclass(module = "ferroce", name = "WC", get_all)]
#[derive(Clone)]
struct Wc {
    /// The work request's id.
    wr_id: u64,
    /// ibverbs' `IBV_WC_*` status number (0 is success).
    status: u32,
    /// ibverbs' `IBV_WC_*` opcode number.
    opcode: u32,
    /// Bytes received (receives) or moved.
    byte_len: u32,
    /// The immediate, if the request carried one.
    imm_data: Option<u32>,
    /// The QP it completed on.
    qp_num: u32,
    /// The status in words.
    status_str: String,
}

#[pymethods]
impl Wc {
    fn __repr__(&self) -> String {
        format!(
            "WC(wr_id={}, status={} ({}), opcode={}, byte_len={}, imm_data={:?}, qp_num={})",
            self.wr_id,
            self.status,
            self.status_str,
            self.opcode,
            self.byte_len,
            self.imm_data,
            self.qp_num
        )
    }
}

impl From<WorkCompletion> for Wc {
    fn from(w: WorkCompletion) -> Wc {
        Wc {
            wr_id: w.wr_id,
            status: status_number(w.status),
            opcode: opcode_number(w.opcode),
            byte_len: w.byte_len,
            imm_data: w.imm_data,
            qp_num: w.qp_num,
            status_str: w.status.to_string(),
        }
    }
}

#[pymethods]
impl Cq {
    #[new]
    #[pyo3(signature = (ctx, cqe = 256))]
    fn new(ctx: &Context, cqe: usize) -> PyResult<Cq> {
        Ok(Cq {
            cq: ctx.ctx.create_cq(cqe, None).map_err(verbs_err)?,
        })
    }

    /// Up to `num_entries` completions, at once (a list, maybe empty).
    #[pyo3(signature = (num_entries = 1))]
    fn poll(&self, py: Python<'_>, num_entries: usize) -> PyResult<Vec<Wc>> {
        let mut out = vec![ferroce::empty_wc(); num_entries.clamp(1, 4096)];
        let n = py
            .allow_threads(|| self.cq.poll(&mut out))
            .map_err(verbs_err)?;
        Ok(out[..n].iter().map(|&w| w.into()).collect())
    }

    /// Waits (without the GIL) until `num_entries` completions came or `timeout` seconds
    /// passed; returns those that came.
    #[pyo3(signature = (num_entries = 1, timeout = 10.0))]
    fn wait(&self, py: Python<'_>, num_entries: usize, timeout: f64) -> PyResult<Vec<Wc>> {
        let t = Duration::try_from_secs_f64(timeout.max(0.0))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let got = py
            .allow_threads(|| self.cq.wait(num_entries, t))
            .map_err(verbs_err)?;
        Ok(got.into_iter().map(Wc::from).collect())
    }
}

/// A scatter/gather element: `length` bytes at `addr` of the region with `lkey`.
#[pyclass(module = "ferroce", name = "SGE", get_all, set_all)]
#[derive(Clone)]
struct PySge {
    addr: u64,
    length: u32,
    lkey: u32,
}

#[pymethods]
impl PySge {
    #[new]
    fn new(addr: u64, length: u32, lkey: u32) -> PySge {
        PySge { addr, length, lkey }
    }
}

fn sges(list: &[PySge]) -> Vec<Sge> {
    list.iter()
        .map(|s| Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

/// A send work request; `opcode` is one of ibverbs' `IBV_WR_*` numbers (`ferroce.enums`).
#[pyclass(module = "ferroce", name = "SendWR", get_all, set_all)]
#[derive(Clone)]
struct PySendWr {
    wr_id: u64,
    opcode: u32,
    sg_list: Vec<PySge>,
    remote_addr: u64,
    rkey: u32,
    imm_data: u32,
    signaled: bool,
    compare_add: u64,
    swap: u64,
}

#[pymethods]
impl PySendWr {
    #[new]
    #[pyo3(signature = (wr_id = 0, opcode = 2, sg_list = vec![], remote_addr = 0, rkey = 0,
                        imm_data = 0, signaled = true, compare_add = 0, swap = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        wr_id: u64,
        opcode: u32,
        sg_list: Vec<PySge>,
        remote_addr: u64,
        rkey: u32,
        imm_data: u32,
        signaled: bool,
        compare_add: u64,
        swap: u64,
    ) -> PySendWr {
        PySendWr {
            wr_id,
            opcode,
            sg_list,
            remote_addr,
            rkey,
            imm_data,
            signaled,
            compare_add,
            swap,
        }
    }
}

impl PySendWr {
    fn to_wr(&self) -> PyResult<SendWr> {
        let op = match self.opcode {
            0 => SendOp::Write,
            1 => SendOp::WriteWithImm(self.imm_data),
            2 => SendOp::Send,
            3 => SendOp::SendWithImm(self.imm_data),
            4 => SendOp::Read,
            5 => SendOp::CompareSwap {
                compare: self.compare_add,
                swap: self.swap,
            },
            6 => SendOp::FetchAdd {
                add: self.compare_add,
            },
            n => {
                return Err(VerbsError::new_err(format!(
                    "send opcode {n} is not one ferroce supports (IBV_WR_RDMA_WRITE .. IBV_WR_ATOMIC_FETCH_AND_ADD)"
                )))
            }
        };
        let mut wr = SendWr::new(self.wr_id, op, sges(&self.sg_list));
        if self.opcode != 2 && self.opcode != 3 {
            wr = wr.remote(self.remote_addr, self.rkey);
        }
        wr.flags.signaled = self.signaled;
        Ok(wr)
    }
}

/// A receive work request.
#[pyclass(module = "ferroce", name = "RecvWR", get_all, set_all)]
#[derive(Clone)]
struct PyRecvWr {
    wr_id: u64,
    sg_list: Vec<PySge>,
}

#[pymethods]
impl PyRecvWr {
    #[new]
    #[pyo3(signature = (wr_id = 0, sg_list = vec![]))]
    fn new(wr_id: u64, sg_list: Vec<PySge>) -> PyRecvWr {
        PyRecvWr { wr_id, sg_list }
    }
}

/// A reliable-connection queue pair.
#[pyclass(module = "ferroce", name = "QP")]
struct Qp {
    qp: ferroce::QueuePair,
    /// The endpoint this side handed out (its PSN is the one to send from).
    local: Option<EndpointInfo>,
    /// The peer's, once `to_rtr` took it.
    peer: Option<EndpointInfo>,
}

fn psn_for(qpn: u32) -> ferroce::Psn {
    ferroce::Psn::new((qpn.wrapping_mul(2_654_435_761) ^ 0x1234) & 0xff_ffff)
}

#[pymethods]
impl Qp {
    /// An RC QP in RESET on `pd`, its sends completing on `cq` and its receives on `recv_cq`
    /// (default: `cq`).
    #[new]
    #[pyo3(signature = (pd, cq, recv_cq = None, max_send_wr = 256, max_recv_wr = 256))]
    fn new(
        pd: &Pd,
        cq: &Cq,
        recv_cq: Option<&Cq>,
        max_send_wr: u32,
        max_recv_wr: u32,
    ) -> PyResult<Qp> {
        let qp = pd
            .pd
            .create_qp(&QpInitAttr {
                send_cq: &cq.cq,
                recv_cq: recv_cq.map_or(&cq.cq, |c| &c.cq),
                caps: QpCaps {
                    max_send_wr,
                    max_recv_wr,
                    ..QpCaps::default()
                },
                srq: None,
            })
            .map_err(verbs_err)?;
        let _ = &pd.ctx;
        Ok(Qp {
            qp,
            local: None,
            peer: None,
        })
    }

    /// The QP number.
    #[getter]
    fn qp_num(&self) -> u32 {
        self.qp.qpn()
    }

    /// The state: "RESET", "INIT", "RTR", "RTS", "SQD", "SQE" or "ERR".
    #[getter]
    fn state(&self) -> &'static str {
        self.qp.state().name()
    }

    /// This side of the connection exchange, as bytes to hand to the peer (its QP number,
    /// first PSN, GID, UDP port, MTU and, with `mr`, a region it may access).
    #[pyo3(signature = (mr = None))]
    fn endpoint<'py>(&mut self, py: Python<'py>, mr: Option<&Mr>) -> Bound<'py, PyBytes> {
        let region = mr.map(|m| RemoteRegion {
            addr: m.mr.addr(),
            rkey: m.mr.rkey(),
            len: m.mr.len() as u64,
        });
        let e = self.qp.endpoint_info(psn_for(self.qp.qpn()), region);
        self.local = Some(e);
        PyBytes::new(py, &e.to_bytes())
    }

    /// RESET → INIT (every access right granted to peers; regions still decide).
    fn to_init(&self) -> PyResult<()> {
        self.qp
            .modify_to_init(&InitAttr::default())
            .map_err(verbs_err)
    }

    /// INIT → RTR towards the peer whose endpoint bytes are `peer`.
    // pyverbs' name: a state transition, not a conversion.
    #[allow(clippy::wrong_self_convention)]
    fn to_rtr(&mut self, peer: &[u8]) -> PyResult<()> {
        let peer = EndpointInfo::from_bytes(peer).map_err(verbs_err)?;
        let local = *self
            .local
            .get_or_insert_with(|| self.qp.endpoint_info(psn_for(self.qp.qpn()), None));
        self.qp
            .connect_rtr(&local, &peer, &ConnectOptions::default())
            .map_err(verbs_err)?;
        self.peer = Some(peer);
        Ok(())
    }

    /// RTR → RTS, sending from the PSN this side's endpoint announced.
    fn to_rts(&self) -> PyResult<()> {
        let (Some(local), Some(peer)) = (self.local, self.peer) else {
            return Err(VerbsError::new_err("to_rts before to_rtr"));
        };
        self.qp
            .connect_rts(&local, &peer, &ConnectOptions::default())
            .map_err(verbs_err)
    }

    /// `to_init`, `to_rtr(peer)` and `to_rts` in one call.
    fn connect(&mut self, peer: &[u8]) -> PyResult<()> {
        self.to_init()?;
        self.to_rtr(peer)?;
        self.to_rts()
    }

    /// The region the peer's endpoint offered, as `(addr, rkey, length)`, if any.
    #[getter]
    fn peer_region(&self) -> Option<(u64, u32, u64)> {
        let r = self.peer?.region?;
        Some((r.addr, r.rkey, r.len))
    }

    /// Posts a send work request.
    fn post_send(&self, wr: &PySendWr) -> PyResult<()> {
        self.qp.post_send(wr.to_wr()?).map_err(verbs_err)
    }

    /// Posts a receive work request.
    fn post_recv(&self, wr: &PyRecvWr) -> PyResult<()> {
        self.qp
            .post_recv(RecvWr {
                wr_id: wr.wr_id,
                sgl: sges(&wr.sg_list),
            })
            .map_err(verbs_err)
    }
}

fn dtype_of(name: &str) -> PyResult<DataType> {
    name.parse().map_err(|_| {
        PyValueError::new_err(format!(
            "dtype {name:?}: float, double, half, bfloat16, int32, int64 or uint8"
        ))
    })
}

fn op_of(name: &str) -> PyResult<ReduceOp> {
    name.parse()
        .map_err(|_| PyValueError::new_err(format!("op {name:?}: sum, prod, min, max or avg")))
}

/// The ranks of a job: ferroce-coll's communicator. Buffers are objects with the buffer
/// protocol (numpy arrays, `bytearray`, `bytes` as an input, `memoryview`), C-contiguous, used
/// in place with no copy; the `ferroce.collectives` module wraps this with element types.
#[pyclass(module = "ferroce")]
struct Communicator {
    /// `None` once the torch backend took it (see the `capi` module).
    comm: Option<ferroce_coll::Communicator>,
}

#[pymethods]
impl Communicator {
    /// Joins the job torchrun's environment describes (RANK, WORLD_SIZE, MASTER_ADDR,
    /// MASTER_PORT; Open MPI's rank variables under mpirun).
    #[staticmethod]
    #[pyo3(signature = (timeout = 30.0, provider = None, device = None))]
    fn from_env(
        py: Python<'_>,
        timeout: f64,
        provider: Option<&str>,
        device: Option<String>,
    ) -> PyResult<Communicator> {
        let opts = CommOptions {
            timeout: Duration::try_from_secs_f64(timeout.max(0.001))
                .map_err(|e| PyValueError::new_err(e.to_string()))?,
            provider: provider_of(provider)?,
            device,
            ..CommOptions::default()
        };
        let comm = py
            .allow_threads(|| ferroce_coll::Communicator::from_env(&opts))
            .map_err(coll_err)?;
        Ok(Communicator { comm: Some(comm) })
    }

    /// Connects rank `rank` of `size` through `exchange`, a callable that takes this rank's
    /// bytes and returns every rank's (a list, in rank order): another framework's store
    /// carries the endpoints (torch.distributed's, for the torch backend). `master` is the
    /// address whose route picks the device (e.g. MASTER_ADDR), unless `device` names one.
    #[staticmethod]
    #[pyo3(signature = (rank, size, exchange, timeout = 30.0, provider = None, device = None,
                        master = None))]
    #[allow(clippy::too_many_arguments)]
    fn from_exchange(
        rank: usize,
        size: usize,
        exchange: &Bound<'_, PyAny>,
        timeout: f64,
        provider: Option<&str>,
        device: Option<String>,
        master: Option<&str>,
    ) -> PyResult<Communicator> {
        let opts = CommOptions {
            timeout: Duration::try_from_secs_f64(timeout.max(0.001))
                .map_err(|e| PyValueError::new_err(e.to_string()))?,
            provider: provider_of(provider)?,
            device,
            ..CommOptions::default()
        };
        let master = match master {
            Some(host) => std::net::ToSocketAddrs::to_socket_addrs(&(host, 0))
                .ok()
                .and_then(|mut a| a.next()),
            None => None,
        };
        let comm = ferroce_coll::Communicator::with_exchange(rank, size, master, &opts, |card| {
            let got = exchange
                .call1((PyBytes::new(exchange.py(), card),))
                .map_err(|e| e.to_string())?;
            got.extract::<Vec<Vec<u8>>>().map_err(|e| e.to_string())
        })
        .map_err(coll_err)?;
        Ok(Communicator { comm: Some(comm) })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.get()?.rank())
    }

    /// How many ranks.
    #[getter]
    fn size(&self) -> PyResult<usize> {
        Ok(self.get()?.size())
    }

    /// Reduces `buf` (an object with the buffer protocol, C-contiguous and writable) in place
    /// over every rank. Private to the package (`ferroce.collectives`, `ferroce.torch`), which
    /// infer `dtype`; see the `buffer` module for how the bytes are held.
    fn _allreduce(&mut self, buf: &Bound<'_, PyAny>, dtype: &str, op: &str) -> PyResult<()> {
        let (t, o) = (dtype_of(dtype)?, op_of(op)?);
        let mut b = Output::of(buf)?;
        let bytes = b.alone();
        self.detached(buf.py(), |comm| comm.allreduce(bytes, t, o))
    }

    /// Gathers every rank's `inp` into `out` (rank order); they must not overlap.
    fn _allgather(&mut self, inp: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let (i, mut o) = (Input::of(inp)?, Output::of(out)?);
        let (i, o) = in_out(&i, &mut o)?;
        self.detached(inp.py(), |comm| comm.allgather(i, o))
    }

    /// Reduces `inp` (size blocks) over every rank; `out` gets this rank's block. They must
    /// not overlap.
    fn _reduce_scatter(
        &mut self,
        inp: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        dtype: &str,
        op: &str,
    ) -> PyResult<()> {
        let (t, op) = (dtype_of(dtype)?, op_of(op)?);
        let (i, mut o) = (Input::of(inp)?, Output::of(out)?);
        let (i, o) = in_out(&i, &mut o)?;
        self.detached(inp.py(), |comm| comm.reduce_scatter(i, o, t, op))
    }

    /// Copies rank `root`'s `buf` into every rank's.
    fn _broadcast(&mut self, buf: &Bound<'_, PyAny>, root: usize) -> PyResult<()> {
        let mut b = Output::of(buf)?;
        let bytes = b.alone();
        self.detached(buf.py(), |comm| comm.broadcast(bytes, root))
    }

    /// Sends block j of `inp` to rank j; block i of `out` comes from rank i. They must not
    /// overlap.
    fn _alltoall(&mut self, inp: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let (i, mut o) = (Input::of(inp)?, Output::of(out)?);
        let (i, o) = in_out(&i, &mut o)?;
        self.detached(inp.py(), |comm| comm.alltoall(i, o))
    }

    /// Sends `buf`'s bytes to rank `peer`.
    fn _send(&mut self, buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        let b = Input::of(buf)?;
        let bytes = b.bytes();
        self.detached(buf.py(), |comm| comm.send(bytes, peer))
    }

    /// Receives into `buf` what rank `peer` sends.
    fn _recv(&mut self, buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        let mut b = Output::of(buf)?;
        let bytes = b.alone();
        self.detached(buf.py(), |comm| comm.recv(bytes, peer))
    }

    /// Reduces every rank's `buf` with `op` into rank `root`'s `buf` (in place; elsewhere
    /// `buf` is left alone).
    fn _reduce(
        &mut self,
        buf: &Bound<'_, PyAny>,
        dtype: &str,
        op: &str,
        root: usize,
    ) -> PyResult<()> {
        let (t, o) = (dtype_of(dtype)?, op_of(op)?);
        let mut b = Output::of(buf)?;
        let bytes = b.alone();
        self.detached(buf.py(), |comm| comm.reduce_in_place(bytes, t, o, root))
    }

    /// Sends `out` to rank `to` and receives into `into` from rank `source` at once; either
    /// may be `None` (a pair exchanging buffers this way cannot deadlock). They must not
    /// overlap.
    #[pyo3(signature = (out, to, into, source))]
    fn _sendrecv(
        &mut self,
        out: Option<&Bound<'_, PyAny>>,
        to: usize,
        into: Option<&Bound<'_, PyAny>>,
        source: usize,
        py: Python<'_>,
    ) -> PyResult<()> {
        let i = out.map(Input::of).transpose()?;
        let mut o = into.map(Output::of).transpose()?;
        let (send, recv): (&[u8], &mut [u8]) = match (&i, &mut o) {
            (Some(i), Some(o)) => in_out(i, o)?,
            (Some(i), None) => (i.bytes(), &mut []),
            (None, Some(o)) => (&[], o.alone()),
            (None, None) => return Ok(()),
        };
        let to = if i.is_some() { to } else { usize::MAX };
        let source = if into.is_some() { source } else { usize::MAX };
        self.detached(py, |comm| comm.sendrecv(send, to, recv, source))
    }

    /// Seconds a collective may go without progress before it fails (settable).
    #[getter]
    fn timeout(&self) -> PyResult<f64> {
        Ok(self.get()?.timeout().as_secs_f64())
    }

    #[setter]
    fn set_timeout(&mut self, seconds: f64) -> PyResult<()> {
        let t = Duration::try_from_secs_f64(seconds.max(0.001))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        self.get_mut()?.set_timeout(t);
        Ok(())
    }

    /// Waits until every rank called it.
    fn barrier(&mut self, py: Python<'_>) -> PyResult<()> {
        self.detached(py, |comm| comm.barrier())
    }
}

impl Communicator {
    fn gone() -> PyErr {
        CollectiveError::new_err(
            "this Communicator was handed to a torch backend, which owns it now",
        )
    }

    fn get(&self) -> PyResult<&ferroce_coll::Communicator> {
        self.comm.as_ref().ok_or_else(Communicator::gone)
    }

    fn get_mut(&mut self) -> PyResult<&mut ferroce_coll::Communicator> {
        self.comm.as_mut().ok_or_else(Communicator::gone)
    }

    /// Runs `f` on the communicator without the GIL; its failure is raised as
    /// `CollectiveError`.
    fn detached(
        &mut self,
        py: Python<'_>,
        f: impl FnOnce(&mut ferroce_coll::Communicator) -> Result<(), ferroce_coll::CollError> + Send,
    ) -> PyResult<()> {
        let comm = self.get_mut()?;
        py.allow_threads(|| f(comm)).map_err(coll_err)
    }
}

/// The `ferroce._ferroce` module.
#[pymodule]
fn _ferroce(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("VerbsError", m.py().get_type::<VerbsError>())?;
    m.add("CollectiveError", m.py().get_type::<CollectiveError>())?;
    m.add_class::<Context>()?;
    m.add_class::<Pd>()?;
    m.add_class::<Mr>()?;
    m.add_class::<Cq>()?;
    m.add_class::<Wc>()?;
    m.add_class::<PySge>()?;
    m.add_class::<PySendWr>()?;
    m.add_class::<PyRecvWr>()?;
    m.add_class::<Qp>()?;
    m.add_class::<Communicator>()?;
    m.add_function(wrap_pyfunction!(capi::_coll_api, m)?)?;
    Ok(())
}
