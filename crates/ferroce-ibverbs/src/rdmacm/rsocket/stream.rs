//! One rsocket stream: its QP, buffers and the protocol's counters, as librdmacm's `rsocket.c`
//! puts them on the wire, so that either side may be rdma-core's.
//!
//! # The protocol (rdma-core's, version 1)
//! * **Connection.** rdma_cm (port space TCP). Each side's private data is a 40-byte
//!   `rs_conn_data`: version 1, flags (bit 0: the host is big-endian, bit 1: it takes direct
//!   writes), its receive credits (its RQ size, big-endian), the iomap size (scaled), then two
//!   SGEs (address, key, length, big-endian): its *target SGL* (two SGE slots the peer writes
//!   new receive buffers into) and the first half of its receive buffer.
//! * **Data.** RDMA WRITE with immediate into the peer's receive buffer, at the SGE the peer
//!   gave last; the immediate is `op << 29 | bytes` (op 0: data). The receiver queues
//!   (op, bytes) per immediate and reads its ring in order.
//! * **Credits.** A receiver that has consumed half its buffer writes the next half's SGE into
//!   the peer's target SGL slot (an RDMA WRITE with immediate `SGL << 29 | seq`), or only the
//!   immediate when no half is free, granting messages up to sequence `seq` (receive queue
//!   entries). A sender sends while it has a send-queue entry, 2 KiB of its own send buffer, a
//!   message credit and room in the current target SGE.
//! * **Control.** `CTRL << 29 | 0` disconnect, `| 2` shutdown of the sender's direction; at
//!   most four control messages are in flight.
//! * **Direct writes (iomap).** `riomap` registers a buffer the peer may write; its
//!   `rs_iomap` (offset, SGE) is written into the peer's iomap table after the target SGL
//!   (immediate `IOMAP_SGL << 29 | index`); `riowrite` writes there with plain RDMA WRITE.
//!
//! # Memory the peer writes
//! The receive buffer and the target table are written by the peer at any time (its RDMA
//! WRITEs land there through ferroce's engine thread): no Rust reference to them exists; they
//! are `calloc`ed raw and read with volatile reads and copies. Everything the peer says is
//! bounded before use: an immediate's length must fit the ring, a write must have a credit, and
//! the SGEs it grants are only ever used as remote addresses of this side's WRITEs (which the
//! peer's own responder checks against its keys).

use super::super::*;

/// Bytes the first transfer of a send is cut to; each next one doubles, up to
/// [`MAX_TRANSFER`] (the first leaves early, the rest are large).
pub(super) const OLAP_START_SIZE: u32 = 2048;
/// Largest single transfer of a send.
const MAX_TRANSFER: u32 = 65536;
/// A sender waits for this much of its send buffer to be free (the socket's low-water mark).
pub(super) const SNDLOWAT: u32 = 2048;
const QP_MIN_SIZE: u16 = 16;
const QP_MAX_SIZE: u16 = 0xFFFE;
/// Control messages that may be in flight at once (a power of two).
const QP_CTRL_SIZE: u32 = 4;
/// Slots in the target SGL: the receive buffer's two halves alternate.
const SGL_SIZE: usize = 2;
/// Bytes of an `rs_sge` (address, key, length).
const SGE_LEN: usize = 16;
/// Bytes of an `rs_iomap` (offset, then an SGE).
pub(super) const IOMAP_LEN: usize = 24;
/// Bytes of the connection data in the private data.
pub(super) const CONN_DATA_LEN: usize = 40;
const CONN_FLAG_NET: u8 = 1;
const CONN_FLAG_IOMAP: u8 = 2;
/// A receive work request's id (a send's is its immediate).
const WR_ID_RECV: u64 = 1 << 63;

/// Message kinds: the top three bits of an immediate.
pub(super) const OP_DATA: u32 = 0;
pub(super) const OP_WRITE: u32 = 2;
pub(super) const OP_SGL: u32 = 4;
pub(super) const OP_IOMAP_SGL: u32 = 6;
pub(super) const OP_CTRL: u32 = 7;
pub(super) const CTRL_DISCONNECT: u32 = 0;
pub(super) const CTRL_SHUTDOWN: u32 = 2;

pub(super) fn msg(op: u32, data: u32) -> u32 {
    (op << 29) | (data & 0x1FFF_FFFF)
}

/// States, ordered as librdmacm orders them (passive, opening, connected, disconnected).
pub(super) const ST_INIT: u32 = 0;
pub(super) const ST_BOUND: u32 = 0x0001;
pub(super) const ST_LISTENING: u32 = 0x0002;
pub(super) const ST_OPENING: u32 = 0x0004;
pub(super) const ST_RESOLVING_ADDR: u32 = ST_OPENING | 0x0010;
pub(super) const ST_RESOLVING_ROUTE: u32 = ST_OPENING | 0x0020;
pub(super) const ST_CONNECTING: u32 = ST_OPENING | 0x0040;
pub(super) const ST_ACCEPTING: u32 = ST_OPENING | 0x0080;
pub(super) const ST_CONNECTED: u32 = 0x0100;
pub(super) const ST_WRITABLE: u32 = 0x0200;
pub(super) const ST_READABLE: u32 = 0x0400;
pub(super) const ST_CONNECT_RDWR: u32 = ST_CONNECTED | ST_READABLE | ST_WRITABLE;
pub(super) const ST_CONNECT_ERROR: u32 = 0x0800;
pub(super) const ST_DISCONNECTED: u32 = 0x1000;
pub(super) const ST_ERROR: u32 = 0x2000;

/// A new socket's sizes: librdmacm's, but for the buffers, read from the files librdmacm reads
/// (`/etc/rdma/rsocket/mem_default`, `wmem_default`, `inline_default`, `sqsize_default`,
/// `rqsize_default`, `iomap_size`) where they exist, so one configuration serves both.
#[derive(Clone, Copy)]
struct Defaults {
    inline: u16,
    sq_size: u16,
    rq_size: u16,
    mem: u32,
    wmem: u32,
    iomap_size: u16,
}

/// The send and receive buffers without a configuration file: 1 MiB each, where librdmacm
/// takes 128 KiB. A stream moves one buffer's worth per round of credits, and a round costs
/// more here than on a NIC (a wake-up of the peer's thread): iperf3 over `librspreload.so` on
/// one host went from 0.29x to 0.93x of its goodput over TCP (3 interleaved pairs each; 4 MiB
/// gave no more). The buffers' sizes travel in the connection's data, so a peer with other
/// sizes (rdma-core's) interoperates as before.
const DEF_BUFFER: u32 = 1 << 20;

fn defaults() -> Defaults {
    static D: std::sync::OnceLock<Defaults> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        let read = |name: &str| -> Option<u64> {
            std::fs::read_to_string(format!("/etc/rdma/rsocket/{name}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        let u16_of =
            |name: &str, def: u16| read(name).map_or(def, |v| v.min(u64::from(u16::MAX)) as u16);
        let wmem = read("wmem_default").map_or(DEF_BUFFER, |v| v.min(1 << 28) as u32);
        Defaults {
            inline: u16_of("inline_default", 64),
            sq_size: u16_of("sqsize_default", 384),
            rq_size: u16_of("rqsize_default", 384),
            mem: read("mem_default").map_or(DEF_BUFFER, |v| v.clamp(1, 1 << 28) as u32),
            wmem: if wmem < SNDLOWAT { SNDLOWAT << 1 } else { wmem },
            iomap_size: u16_of("iomap_size", 0).min(255),
        }
    })
}

/// A remote (or granted) buffer: address, key, length.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(super) struct Sge {
    pub(super) addr: u64,
    pub(super) key: u32,
    pub(super) length: u32,
}

impl Sge {
    fn to_net(self) -> [u8; SGE_LEN] {
        let mut b = [0u8; SGE_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&self.key.to_be_bytes());
        b[12..].copy_from_slice(&self.length.to_be_bytes());
        b
    }
    fn from_net(b: &[u8]) -> Sge {
        Sge {
            addr: u64::from_be_bytes(b[..8].try_into().unwrap_or_default()),
            key: u32::from_be_bytes(b[8..12].try_into().unwrap_or_default()),
            length: u32::from_be_bytes(b[12..16].try_into().unwrap_or_default()),
        }
    }
}

/// A `calloc`ed buffer with its memory region: memory the QP (and, if registered for remote
/// writes, the peer) reaches, so never seen through a Rust reference.
pub(super) struct Buffer {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) mr: *mut ibv_mr,
}

impl Buffer {
    fn new(v: &Verbs, pd: *mut ibv_pd, len: usize, access: c_int) -> Option<Buffer> {
        // SAFETY: a fresh zeroed allocation (at least one byte), freed in `free`.
        let ptr = unsafe { libc::calloc(len.max(1), 1) }.cast::<u8>();
        if ptr.is_null() {
            set_errno(libc::ENOMEM);
            return None;
        }
        // SAFETY: the allocation just made, `len` bytes, registered on the id's PD.
        let mr = unsafe { (v.reg_mr)(pd, ptr.cast(), len.max(1), access) };
        if mr.is_null() {
            // SAFETY: ours, freed once.
            unsafe { libc::free(ptr.cast()) };
            return None;
        }
        Some(Buffer { ptr, len, mr })
    }

    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: a live MR of ours.
        unsafe { (*self.mr).lkey }
    }

    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }

    pub(super) fn addr(&self, offset: usize) -> u64 {
        self.ptr as u64 + offset as u64
    }

    /// Copies `out.len()` bytes from `offset` (in bounds: the caller's arithmetic).
    fn read(&self, offset: usize, out: &mut [u8]) {
        debug_assert!(offset + out.len() <= self.len);
        // SAFETY: in bounds of the allocation; a copy, no reference to memory the peer writes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
    }

    /// Copies `data` to `offset` (in bounds).
    fn write(&self, offset: usize, data: &[u8]) {
        debug_assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds; only this side writes its send buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
    }

    /// An SGE (or iomap) slot the peer writes: read with volatile reads.
    fn read_sge(&self, offset: usize, swap: bool) -> Sge {
        if offset + SGE_LEN > self.len {
            return Sge::default();
        }
        // SAFETY: in bounds; volatile reads of plain integers another writer may change.
        let (addr, key, length) = unsafe {
            let p = self.ptr.add(offset);
            (
                std::ptr::read_volatile(p.cast::<u64>()),
                std::ptr::read_volatile(p.add(8).cast::<u32>()),
                std::ptr::read_volatile(p.add(12).cast::<u32>()),
            )
        };
        if swap {
            Sge {
                addr: addr.swap_bytes(),
                key: key.swap_bytes(),
                length: length.swap_bytes(),
            }
        } else {
            Sge { addr, key, length }
        }
    }

    /// Writes an SGE slot of this side's own table (consuming it, as librdmacm does).
    fn write_sge(&self, offset: usize, s: Sge, swap: bool) {
        if offset + SGE_LEN > self.len {
            return;
        }
        let s = if swap {
            Sge {
                addr: s.addr.swap_bytes(),
                key: s.key.swap_bytes(),
                length: s.length.swap_bytes(),
            }
        } else {
            s
        };
        // SAFETY: in bounds; volatile writes of plain integers.
        unsafe {
            let p = self.ptr.add(offset);
            std::ptr::write_volatile(p.cast::<u64>(), s.addr);
            std::ptr::write_volatile(p.add(8).cast::<u32>(), s.key);
            std::ptr::write_volatile(p.add(12).cast::<u32>(), s.length);
        }
    }

    /// The 8-byte offset of an iomap slot (volatile), then its SGE.
    fn read_iomap(&self, offset: usize, swap: bool) -> (u64, Sge) {
        if offset + IOMAP_LEN > self.len {
            return (0, Sge::default());
        }
        // SAFETY: in bounds; a volatile read of a plain integer.
        let off = unsafe { std::ptr::read_volatile(self.ptr.add(offset).cast::<u64>()) };
        let off = if swap { off.swap_bytes() } else { off };
        (off, self.read_sge(offset + 8, swap))
    }

    fn free(&mut self, v: &Verbs) {
        if !self.mr.is_null() {
            // SAFETY: our MR, deregistered once.
            unsafe { (v.dereg_mr)(self.mr) };
            self.mr = std::ptr::null_mut();
        }
        if !self.ptr.is_null() {
            // SAFETY: our allocation, freed once (after its MR, so nothing reaches it).
            unsafe { libc::free(self.ptr.cast()) };
            self.ptr = std::ptr::null_mut();
        }
    }
}

/// A buffer `riomap` registered for the peer's direct writes (or for this side's own).
pub(super) struct IomapMr {
    pub(super) offset: u64,
    pub(super) mr: *mut ibv_mr,
    /// Its slot in the peer's iomap table (`None`: a local mapping, not announced).
    pub(super) index: Option<usize>,
    /// Announced to the peer already.
    pub(super) sent: bool,
}

/// The buffers of a connected stream.
pub(super) struct Bufs {
    pub(super) sbuf: Buffer,
    pub(super) rbuf: Buffer,
    pub(super) target: Buffer,
}

/// One stream rsocket.
pub(super) struct Stream {
    pub(super) cm_id: *mut rdma_cm_id,
    pub(super) state: u32,
    pub(super) err: c_int,
    pub(super) fd_flags: c_int,
    pub(super) so_opts: u64,
    pub(super) tcp_opts: u64,
    pub(super) ipv6_opts: u64,
    pub(super) keepalive_time: u32,

    pub(super) sq_size: u16,
    pub(super) rq_size: u16,
    pub(super) sq_inline: u16,
    pub(super) sbuf_size: u32,
    pub(super) rbuf_size: u32,
    pub(super) target_iomap_size: u16,

    ctrl_seqno: u32,
    pub(super) ctrl_max_seqno: u32,
    sseq_no: u16,
    sseq_comp: u16,
    rseq_no: u16,
    rseq_comp: u16,

    remote_sge: usize,
    remote_sgl: Sge,
    pub(super) remote_iomap: Sge,
    swap_sgl: bool,
    pub(super) bufs: Option<Bufs>,
    pub(super) channel: *mut ibv_comp_channel,
    pub(super) cq: *mut ibv_cq,
    target_sge: usize,

    rbuf_bytes_avail: u32,
    rbuf_free_offset: u32,
    rbuf_offset: u32,
    sbuf_bytes_avail: u32,
    /// Where the next copy into the send buffer goes.
    ssgl_offset: u32,
    /// Received messages not yet read: (op, bytes left).
    rmsg: VecDeque<(u32, u32)>,
    pub(super) cq_armed: bool,
    sqe_avail: i32,

    pub(super) iomaps: Vec<IomapMr>,
}

// SAFETY: the raw pointers are the id's, its QP's, CQ's and MRs' handles, used only under the
// socket's lock through libibverbs' and librdmacm's thread-safe calls, and buffers reached only
// by copies.
unsafe impl Send for Stream {}

fn scale_to_value(value: u32, bits: u32) -> u32 {
    if value <= 1 << (bits - 1) {
        value
    } else {
        (value & !(1 << (bits - 1))) << bits
    }
}

fn value_to_scale(value: u32, bits: u32) -> u32 {
    if value <= 1 << (bits - 1) {
        value
    } else {
        (1 << (bits - 1)) | (value >> bits)
    }
}

impl Stream {
    /// A new stream on `cm_id`, with the sizes of `inherit` (a listener's) or the defaults.
    pub(super) fn new(cm_id: *mut rdma_cm_id, inherit: Option<&Stream>) -> Stream {
        let (sbuf_size, rbuf_size, sq_inline, sq_size, rq_size, iomap) = match inherit {
            Some(l) => (
                l.sbuf_size,
                l.rbuf_size,
                l.sq_inline,
                l.sq_size,
                l.rq_size,
                l.target_iomap_size,
            ),
            None => {
                let d = defaults();
                (d.wmem, d.mem, d.inline, d.sq_size, d.rq_size, d.iomap_size)
            }
        };
        Stream {
            cm_id,
            state: ST_INIT,
            err: 0,
            fd_flags: 0,
            so_opts: 0,
            tcp_opts: 0,
            ipv6_opts: 0,
            keepalive_time: 0,
            sq_size,
            rq_size,
            sq_inline,
            sbuf_size,
            rbuf_size,
            target_iomap_size: iomap,
            ctrl_seqno: 0,
            ctrl_max_seqno: QP_CTRL_SIZE,
            sseq_no: 0,
            sseq_comp: 0,
            rseq_no: 0,
            rseq_comp: 0,
            remote_sge: 0,
            remote_sgl: Sge::default(),
            remote_iomap: Sge::default(),
            swap_sgl: false,
            bufs: None,
            channel: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
            target_sge: 0,
            rbuf_bytes_avail: 0,
            rbuf_free_offset: 0,
            rbuf_offset: 0,
            sbuf_bytes_avail: 0,
            ssgl_offset: 0,
            rmsg: VecDeque::new(),
            cq_armed: false,
            sqe_avail: 0,
            iomaps: Vec::new(),
        }
    }

    fn qp(&self) -> *mut ibv_qp {
        // SAFETY: our live id.
        unsafe { (*self.cm_id).qp }
    }

    /// Makes the CQ (with its channel), the QP, the buffers, and posts the receives.
    pub(super) fn create_ep(&mut self) -> Result<(), c_int> {
        let v = verbs().ok_or(libc::ENODEV)?;
        self.sq_size = self.sq_size.clamp(QP_MIN_SIZE, QP_MAX_SIZE.min(8192));
        self.rq_size = self.rq_size.clamp(QP_MIN_SIZE, QP_MAX_SIZE.min(8192));
        // SAFETY: our live id, its device context resolved.
        let ctx = unsafe { (*self.cm_id).verbs };
        if ctx.is_null() {
            return Err(libc::ENODEV);
        }
        // SAFETY: a live context.
        let channel = unsafe { (v.create_comp_channel)(ctx) };
        if channel.is_null() {
            return Err(errno());
        }
        self.channel = channel;
        let entries = c_int::from(self.sq_size) + c_int::from(self.rq_size);
        // SAFETY: a live context and channel.
        let cq = unsafe { (v.create_cq)(ctx, entries, self.cm_id.cast(), channel, 0) };
        if cq.is_null() {
            return Err(errno());
        }
        self.cq = cq;
        // The channel never blocks: waits are polls on its descriptor (see `wait`).
        // SAFETY: the channel's own descriptor.
        unsafe {
            let fd = (*channel).fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        self.arm();
        // SAFETY: our live id; the CQ serves both queues, as librdmacm's.
        unsafe {
            (*self.cm_id).recv_cq_channel = channel;
            (*self.cm_id).send_cq_channel = channel;
            (*self.cm_id).recv_cq = cq;
            (*self.cm_id).send_cq = cq;
        }
        let mut attr = ibv_qp_init_attr {
            send_cq: cq,
            recv_cq: cq,
            qp_type: IBV_QPT_RC,
            sq_sig_all: 1,
            cap: ibv_qp_cap {
                max_send_wr: u32::from(self.sq_size),
                max_recv_wr: u32::from(self.rq_size),
                max_send_sge: 2,
                max_recv_sge: 1,
                max_inline_data: u32::from(self.sq_inline),
            },
            ..Default::default()
        };
        // SAFETY: our id, a NULL PD (the id's own) and full attributes.
        if unsafe { rdma_create_qp(self.cm_id, std::ptr::null_mut(), &mut attr) } != 0 {
            return Err(errno());
        }
        self.sq_inline = attr.cap.max_inline_data.min(u32::from(u16::MAX)) as u16;
        self.init_bufs(v)?;
        for _ in 0..self.rq_size {
            self.post_recv()?;
        }
        Ok(())
    }

    fn init_bufs(&mut self, v: &Verbs) -> Result<(), c_int> {
        // SAFETY: our id; `rdma_create_qp` gave it a PD.
        let pd = unsafe { (*self.cm_id).pd };
        let mut sbuf_len = self.sbuf_size as usize;
        if usize::from(self.sq_inline) < SGE_LEN {
            // Room for control messages' SGEs when they cannot go inline.
            sbuf_len += SGE_LEN * QP_CTRL_SIZE as usize;
        }
        let local = IBV_ACCESS_LOCAL_WRITE as c_int;
        let remote = (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as c_int;
        let sbuf = Buffer::new(v, pd, sbuf_len, local).ok_or_else(errno)?;
        let target_len = SGE_LEN * SGL_SIZE + IOMAP_LEN * usize::from(self.target_iomap_size);
        let Some(target) = Buffer::new(v, pd, target_len, remote) else {
            let e = errno();
            let mut s = sbuf;
            s.free(v);
            return Err(e);
        };
        let Some(rbuf) = Buffer::new(v, pd, self.rbuf_size as usize, remote) else {
            let e = errno();
            let (mut s, mut t) = (sbuf, target);
            s.free(v);
            t.free(v);
            return Err(e);
        };
        self.bufs = Some(Bufs { sbuf, rbuf, target });
        self.ssgl_offset = 0;
        self.sbuf_bytes_avail = self.sbuf_size;
        self.rbuf_free_offset = self.rbuf_size >> 1;
        self.rbuf_bytes_avail = self.rbuf_size >> 1;
        self.sqe_avail = i32::from(self.sq_size) - self.ctrl_max_seqno as i32;
        self.rseq_comp = self.rq_size >> 1;
        Ok(())
    }

    /// Frees the buffers, QP, CQ and channel (the id is the caller's).
    pub(super) fn free_ep(&mut self) {
        let Some(v) = verbs() else { return };
        for m in self.iomaps.drain(..) {
            if !m.mr.is_null() {
                // SAFETY: our MR, deregistered once.
                unsafe { (v.dereg_mr)(m.mr) };
            }
        }
        if !self.qp().is_null() {
            // SAFETY: our id's QP, destroyed once.
            unsafe { rdma_destroy_qp(self.cm_id) };
        }
        if let Some(mut b) = self.bufs.take() {
            b.sbuf.free(v);
            b.rbuf.free(v);
            b.target.free(v);
        }
        if !self.cq.is_null() {
            // SAFETY: our id's CQ, its QP gone; unacknowledged events none (each is
            // acknowledged as it is taken).
            unsafe {
                (*self.cm_id).recv_cq = std::ptr::null_mut();
                (*self.cm_id).send_cq = std::ptr::null_mut();
                (v.destroy_cq)(self.cq)
            };
            self.cq = std::ptr::null_mut();
        }
        if !self.channel.is_null() {
            // SAFETY: our channel, its CQ gone.
            unsafe {
                (*self.cm_id).recv_cq_channel = std::ptr::null_mut();
                (*self.cm_id).send_cq_channel = std::ptr::null_mut();
                (v.destroy_comp_channel)(self.channel)
            };
            self.channel = std::ptr::null_mut();
        }
    }

    /// The connection data this side sends.
    pub(super) fn conn_data(&self) -> [u8; CONN_DATA_LEN] {
        let mut c = [0u8; CONN_DATA_LEN];
        let Some(b) = &self.bufs else { return c };
        c[0] = 1;
        c[1] = CONN_FLAG_IOMAP
            | if cfg!(target_endian = "big") {
                CONN_FLAG_NET
            } else {
                0
            };
        c[2..4].copy_from_slice(&self.rq_size.to_be_bytes());
        c[7] = value_to_scale(u32::from(self.target_iomap_size), 8) as u8;
        let target = Sge {
            addr: b.target.addr(0),
            key: b.target.rkey(),
            length: SGL_SIZE as u32,
        };
        let data = Sge {
            addr: b.rbuf.addr(0),
            key: b.rbuf.rkey(),
            length: self.rbuf_size >> 1,
        };
        c[8..24].copy_from_slice(&target.to_net());
        c[24..40].copy_from_slice(&data.to_net());
        c
    }

    /// Takes the peer's connection data (checked: version 1, a target SGL of 2 slots).
    pub(super) fn save_conn_data(&mut self, c: &[u8]) -> Result<(), c_int> {
        if c.len() < CONN_DATA_LEN || c[0] != 1 {
            return Err(libc::EOPNOTSUPP);
        }
        let remote_sgl = Sge::from_net(&c[8..24]);
        // librdmacm's table always has two slots; the index below cycles over exactly them.
        if remote_sgl.length != SGL_SIZE as u32 {
            return Err(libc::EPROTO);
        }
        self.remote_sgl = remote_sgl;
        self.remote_sge = 1;
        let net = c[1] & CONN_FLAG_NET != 0;
        self.swap_sgl = net != cfg!(target_endian = "big");
        if c[1] & CONN_FLAG_IOMAP != 0 {
            self.remote_iomap = Sge {
                addr: remote_sgl
                    .addr
                    .wrapping_add(SGE_LEN as u64 * u64::from(remote_sgl.length)),
                length: scale_to_value(u32::from(c[7]), 8),
                key: remote_sgl.key,
            };
        }
        let data = Sge::from_net(&c[24..40]);
        if let Some(b) = &self.bufs {
            // The table is in this host's order: a peer of the other order swaps what it
            // writes here (librdmacm's `RS_OPT_SWAP_SGL`), so reads never do. Only slot 0 is
            // this side's: the peer's first grant may already be in slot 1.
            b.target.write_sge(0, data, false);
        }
        self.target_sge = 0;
        self.sseq_comp = u16::from_be_bytes([c[2], c[3]]);
        Ok(())
    }

    /// The current target SGE (the table is in this host's order, see `save_conn_data`).
    fn target(&self) -> Sge {
        let Some(b) = &self.bufs else {
            return Sge::default();
        };
        b.target.read_sge(self.target_sge * SGE_LEN, false)
    }

    fn set_target(&self, s: Sge) {
        if let Some(b) = &self.bufs {
            b.target.write_sge(self.target_sge * SGE_LEN, s, false);
        }
    }

    fn post_recv(&mut self) -> Result<(), c_int> {
        let mut wr = ibv_recv_wr {
            wr_id: WR_ID_RECV,
            ..Default::default()
        };
        let mut bad = std::ptr::null_mut();
        let qp = self.qp();
        // SAFETY: our live QP; its context's ops are libibverbs' (rdma-core's inline calls).
        let rc = unsafe {
            let post = (*(*qp).context).ops.post_recv.ok_or(libc::ENOSYS)?;
            post(qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(rc);
        }
        Ok(())
    }

    /// Posts an RDMA WRITE (with immediate `imm` unless `plain`) of `sgl` to `addr`/`rkey`,
    /// its completion carrying `wr_data`.
    fn post_write(
        &mut self,
        sgl: &mut [ibv_sge],
        wr_data: u32,
        imm: Option<u32>,
        inline: bool,
        addr: u64,
        rkey: u32,
    ) -> Result<(), c_int> {
        let mut wr = ibv_send_wr {
            wr_id: u64::from(wr_data),
            sg_list: if sgl.is_empty() {
                std::ptr::null_mut()
            } else {
                sgl.as_mut_ptr()
            },
            num_sge: sgl.len() as c_int,
            opcode: if imm.is_some() {
                IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                IBV_WR_RDMA_WRITE
            },
            send_flags: if inline { IBV_SEND_INLINE } else { 0 },
            ..Default::default()
        };
        if let Some(i) = imm {
            wr.__bindgen_anon_1.imm_data = i.to_be();
        }
        wr.wr.rdma = ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: addr,
            rkey,
        };
        let mut bad = std::ptr::null_mut();
        let qp = self.qp();
        // SAFETY: our live QP; the SGEs point into this side's registered send buffer or, for
        // inline data, to bytes that live through the call (copied at the post).
        let rc = unsafe {
            let post = (*(*qp).context).ops.post_send.ok_or(libc::ENOSYS)?;
            post(qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(rc);
        }
        Ok(())
    }

    /// A message with no data: a zero-length WRITE with immediate `m`.
    fn post_msg(&mut self, m: u32) -> Result<(), c_int> {
        self.post_write(&mut [], m, Some(m), false, 0, 0)
    }

    /// Whether a control message may be sent.
    pub(super) fn ctrl_avail(&self) -> bool {
        self.ctrl_seqno != self.ctrl_max_seqno
    }

    fn give_credits(&self) -> bool {
        (self.rbuf_bytes_avail >= (self.rbuf_size >> 1)
            || (self.rseq_no.wrapping_sub(self.rseq_comp) as i16) >= 0)
            && self.ctrl_avail()
            && self.state & ST_CONNECTED != 0
    }

    fn send_credits(&mut self) {
        self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
        self.rseq_comp = self.rseq_no.wrapping_add(self.rq_size >> 1);
        let grant = msg(OP_SGL, u32::from(self.rseq_no.wrapping_add(self.rq_size)));
        let half = self.rbuf_size >> 1;
        if self.rbuf_bytes_avail >= half {
            let Some(b) = &self.bufs else { return };
            let s = Sge {
                addr: b.rbuf.addr(self.rbuf_free_offset as usize),
                key: b.rbuf.rkey(),
                length: half,
            };
            // In the peer's order (its table is read unswapped).
            let s = if self.swap_sgl {
                Sge {
                    addr: s.addr.swap_bytes(),
                    key: s.key.swap_bytes(),
                    length: s.length.swap_bytes(),
                }
            } else {
                s
            };
            let bytes = [
                s.addr.to_ne_bytes().as_slice(),
                &s.key.to_ne_bytes(),
                &s.length.to_ne_bytes(),
            ]
            .concat();
            let slot = self
                .remote_sgl
                .addr
                .wrapping_add((self.remote_sge * SGE_LEN) as u64);
            let rkey = self.remote_sgl.key;
            let (mut sge, inline) = if usize::from(self.sq_inline) >= SGE_LEN {
                (
                    ibv_sge {
                        addr: bytes.as_ptr() as u64,
                        length: SGE_LEN as u32,
                        lkey: 0,
                    },
                    true,
                )
            } else {
                // The control area after the send buffer, one slot per control message.
                let at = self.sbuf_size as usize
                    + SGE_LEN * (self.ctrl_seqno & (QP_CTRL_SIZE - 1)) as usize;
                b.sbuf.write(at, &bytes);
                (
                    ibv_sge {
                        addr: b.sbuf.addr(at),
                        length: SGE_LEN as u32,
                        lkey: b.sbuf.lkey(),
                    },
                    false,
                )
            };
            if self
                .post_write(
                    std::slice::from_mut(&mut sge),
                    grant,
                    Some(grant),
                    inline,
                    slot,
                    rkey,
                )
                .is_err()
            {
                self.fail(libc::EIO);
                return;
            }
            self.rbuf_bytes_avail -= half;
            self.rbuf_free_offset += half;
            if self.rbuf_free_offset >= self.rbuf_size {
                self.rbuf_free_offset = 0;
            }
            self.remote_sge = (self.remote_sge + 1) % SGL_SIZE;
        } else if self.post_msg(grant).is_err() {
            self.fail(libc::EIO);
        }
    }

    pub(super) fn update_credits(&mut self) {
        if self.give_credits() {
            self.send_credits();
        }
    }

    fn fail(&mut self, e: c_int) {
        self.state = ST_ERROR;
        self.err = e;
    }

    /// Takes every completion: received messages queued, credits, control messages, send
    /// buffer and queue space returned; consumed receives posted again.
    pub(super) fn poll_cq(&mut self) -> Result<(), c_int> {
        if self.cq.is_null() {
            return Ok(());
        }
        let mut reposts = 0;
        loop {
            let mut wc = ibv_wc::default();
            // SAFETY: our live CQ; its context's ops are libibverbs'.
            let n = unsafe {
                let poll = (*(*self.cq).context).ops.poll_cq.ok_or(libc::ENOSYS)?;
                poll(self.cq, 1, &mut wc)
            };
            if n <= 0 {
                break;
            }
            if wc.wr_id & WR_ID_RECV != 0 {
                if wc.status != IBV_WC_SUCCESS {
                    continue;
                }
                reposts += 1;
                if wc.wc_flags & IBV_WC_WITH_IMM == 0 {
                    // rsockets over RoCE always carry an immediate; anything else is no
                    // message of this protocol.
                    self.fail(libc::EPROTO);
                    continue;
                }
                // SAFETY: a completion with immediate data: that arm of the union.
                let m = u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data });
                let (op, data) = (m >> 29, m & 0x1FFF_FFFF);
                match op {
                    OP_SGL => self.sseq_comp = data as u16,
                    OP_IOMAP_SGL => {}
                    OP_CTRL => {
                        if data == CTRL_DISCONNECT {
                            self.state = ST_DISCONNECTED;
                            return Ok(());
                        } else if data == CTRL_SHUTDOWN {
                            if self.state & ST_WRITABLE != 0 {
                                self.state &= !ST_READABLE;
                            } else {
                                self.state = ST_DISCONNECTED;
                                return Ok(());
                            }
                        }
                    }
                    OP_WRITE => {}
                    _ => {
                        // Data: bounded by the ring (what is unread, plus this, plus what
                        // is free and not yet granted never exceeds it) and by the receive
                        // queue, whatever the peer claims.
                        let queued: u64 = self.rmsg.iter().map(|&(_, n)| u64::from(n)).sum();
                        if u64::from(data) + queued + u64::from(self.rbuf_bytes_avail)
                            > u64::from(self.rbuf_size)
                            || self.rmsg.len() > usize::from(self.rq_size)
                        {
                            self.fail(libc::EPROTO);
                            continue;
                        }
                        self.rmsg.push_back((op, data));
                    }
                }
            } else {
                let m = wc.wr_id as u32;
                let (op, data) = (m >> 29, m & 0x1FFF_FFFF);
                match op {
                    OP_SGL => self.ctrl_max_seqno = self.ctrl_max_seqno.wrapping_add(1),
                    OP_CTRL => {
                        self.ctrl_max_seqno = self.ctrl_max_seqno.wrapping_add(1);
                        if data == CTRL_DISCONNECT {
                            self.state = ST_DISCONNECTED;
                        }
                    }
                    OP_IOMAP_SGL => {
                        self.sqe_avail += 1;
                        self.sbuf_bytes_avail += IOMAP_LEN as u32;
                    }
                    _ => {
                        self.sqe_avail += 1;
                        self.sbuf_bytes_avail += data;
                    }
                }
                if wc.status != IBV_WC_SUCCESS && self.state & ST_CONNECTED != 0 {
                    self.fail(libc::EIO);
                }
            }
        }
        if self.state & ST_CONNECTED != 0 {
            for _ in 0..reposts {
                if let Err(e) = self.post_recv() {
                    self.fail(e);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Asks for the CQ's next completion event.
    pub(super) fn arm(&mut self) {
        if self.cq.is_null() {
            return;
        }
        // SAFETY: our live CQ; its context's ops are libibverbs'.
        unsafe {
            if let Some(f) = (*(*self.cq).context).ops.req_notify_cq {
                f(self.cq, 0);
            }
        }
        self.cq_armed = true;
    }

    /// Takes a completion event if one came (the channel never blocks).
    pub(super) fn take_cq_event(&mut self) {
        let Some(v) = verbs() else { return };
        if self.channel.is_null() {
            return;
        }
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: our channel (non-blocking).
        if unsafe { (v.get_cq_event)(self.channel, &mut cq, &mut ctx) } == 0 {
            // SAFETY: the CQ the event named, ours; acknowledged at once.
            unsafe { (v.ack_cq_events)(cq, 1) };
            self.cq_armed = false;
        }
    }

    /// The id's own channel descriptor (its CM events).
    pub(super) fn id_fd(&self) -> c_int {
        // SAFETY: our live id's channel.
        unsafe { (*(*self.cm_id).channel).fd }
    }

    /// Takes a CM event that came while connected, never waiting: the peer's DREQ (its process
    /// ended, or it disconnected without the protocol's disconnect message) ends the
    /// connection as that message would, so a socket that only receives learns of it (its
    /// queued data is still read first). The CQ alone never says so: nothing flushes this
    /// side's receives.
    pub(super) fn take_cm_event(&mut self) {
        if self.state & ST_CONNECTED == 0 || self.cm_id.is_null() {
            return;
        }
        // Looked for in the channel's queue (no system call on the data path's every turn).
        // SAFETY: our live id's own channel.
        let pending = unsafe { channel_of((*self.cm_id).channel) }.is_some_and(|c| {
            !c.queue
                .events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
        });
        if !pending {
            return;
        }
        let mut ev = std::ptr::null_mut();
        // SAFETY: the id's own channel, which only this socket reads (under its lock), with an
        // event queued: this does not wait.
        if unsafe { rdma_get_cm_event((*self.cm_id).channel, &mut ev) } != 0 {
            return;
        }
        // SAFETY: the event just handed out, acknowledged once.
        let kind = unsafe { (*ev).event };
        unsafe { rdma_ack_cm_event(ev) };
        if matches!(
            kind,
            RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_DEVICE_REMOVAL | RDMA_CM_EVENT_TIMEWAIT_EXIT
        ) {
            self.state = ST_DISCONNECTED;
        }
    }

    /// The descriptor a wait polls: the CQ's channel once connected, else the id's.
    pub(super) fn wait_fd(&self) -> c_int {
        if !self.channel.is_null() && self.state & (ST_CONNECTED | ST_DISCONNECTED | ST_ERROR) != 0
        {
            // SAFETY: our live channel.
            unsafe { (*self.channel).fd }
        } else {
            // SAFETY: our live id's channel.
            unsafe { (*(*self.cm_id).channel).fd }
        }
    }

    pub(super) fn can_send(&self) -> bool {
        self.sqe_avail > 0
            && self.sbuf_bytes_avail >= SNDLOWAT
            && self.sseq_no != self.sseq_comp
            && self.target().length != 0
    }

    pub(super) fn have_rdata(&self) -> bool {
        !self.rmsg.is_empty()
    }

    pub(super) fn all_sends_done(&self) -> bool {
        (self.ctrl_max_seqno.wrapping_sub(self.ctrl_seqno) as i32 + self.sqe_avail
            == i32::from(self.sq_size))
            || self.state & ST_CONNECTED == 0
    }

    fn sbuf_left(&self) -> u32 {
        self.sbuf_size - self.ssgl_offset
    }

    /// The size of the next transfer of `left` bytes: the ramp `olen` (doubling up to
    /// [`MAX_TRANSFER`]: the first part leaves early, the rest are large), or all of it.
    fn ramp(olen: &mut u32, left: usize) -> u32 {
        if (*olen as usize) < left {
            let x = *olen;
            if *olen < MAX_TRANSFER {
                *olen <<= 1;
            }
            x
        } else {
            left as u32
        }
    }

    /// Stages `chunk` for a WRITE: inline from the caller's bytes (which live through the
    /// post) when it fits, else copied into the send ring, in two SGEs where the ring wraps.
    /// Returns the SGEs, how many, and whether inline.
    fn stage(&mut self, chunk: &[u8]) -> Result<([ibv_sge; 2], usize, bool), c_int> {
        let len = chunk.len() as u32;
        let mut sgl = [ibv_sge::default(); 2];
        if len <= u32::from(self.sq_inline) {
            sgl[0] = ibv_sge {
                addr: chunk.as_ptr() as u64,
                length: len,
                lkey: 0,
            };
            return Ok((sgl, 1, true));
        }
        let left = self.sbuf_left();
        let Some(b) = &self.bufs else {
            return Err(libc::ENOTCONN);
        };
        let (lkey, base) = (b.sbuf.lkey(), b.sbuf.addr(0));
        let at = self.ssgl_offset;
        if len <= left {
            b.sbuf.write(at as usize, chunk);
            sgl[0] = ibv_sge {
                addr: base + u64::from(at),
                length: len,
                lkey,
            };
            self.ssgl_offset = if len < left { at + len } else { 0 };
            Ok((sgl, 1, false))
        } else {
            b.sbuf.write(at as usize, &chunk[..left as usize]);
            b.sbuf.write(0, &chunk[left as usize..]);
            sgl[0] = ibv_sge {
                addr: base + u64::from(at),
                length: left,
                lkey,
            };
            sgl[1] = ibv_sge {
                addr: base,
                length: len - left,
                lkey,
            };
            self.ssgl_offset = len - left;
            Ok((sgl, 2, false))
        }
    }

    /// Sends up to the next transfer of `data` (the caller checked `can_send`); returns the
    /// bytes sent. `olen` is the transfer size ramp.
    pub(super) fn send_some(&mut self, data: &[u8], olen: &mut u32) -> Result<usize, c_int> {
        // Read once: the peer may rewrite the slot (it must not, while it is in use).
        let target = self.target();
        let xfer = Self::ramp(olen, data.len())
            .min(self.sbuf_bytes_avail)
            .min(target.length);
        if xfer == 0 {
            return Ok(0);
        }
        let (mut sgl, n, inline) = self.stage(&data[..xfer as usize])?;
        self.write_data(&mut sgl[..n], target, xfer, inline)?;
        Ok(xfer as usize)
    }

    /// Writes `len` bytes (at most `t.length`) at the current target SGE `t`, moving it on
    /// (librdmacm updates the SGE before the data goes, since the peer may replace it as soon
    /// as it is used up).
    fn write_data(
        &mut self,
        sgl: &mut [ibv_sge],
        t: Sge,
        len: u32,
        inline: bool,
    ) -> Result<(), c_int> {
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= len;
        let (addr, rkey) = (t.addr, t.key);
        let rest = Sge {
            addr: t.addr.wrapping_add(u64::from(len)),
            key: t.key,
            length: t.length.saturating_sub(len),
        };
        self.set_target(rest);
        if rest.length == 0 {
            self.target_sge = (self.target_sge + 1) % SGL_SIZE;
        }
        let m = msg(OP_DATA, len);
        self.post_write(sgl, m, Some(m), inline, addr, rkey)
    }

    /// Copies received bytes into `out` (up to its length), consuming them unless `peek`;
    /// returns the count.
    pub(super) fn read_some(&mut self, out: &mut [u8], peek: bool) -> usize {
        let Some(b) = &self.bufs else { return 0 };
        let size = self.rbuf_size;
        let mut done = 0usize;
        let mut offset = self.rbuf_offset;
        let mut consumed_msgs = 0u16;
        let mut freed = 0u32;
        let mut i = 0;
        while done < out.len() && i < self.rmsg.len() {
            let avail = self.rmsg[i].1;
            let want = (out.len() - done) as u32;
            let n = avail.min(want);
            // The ring wraps at its end.
            let mut left = n;
            while left > 0 {
                let run = left.min(size - offset);
                b.rbuf
                    .read(offset as usize, &mut out[done..done + run as usize]);
                done += run as usize;
                offset += run;
                if offset == size {
                    offset = 0;
                }
                left -= run;
            }
            freed += n;
            if n == avail {
                consumed_msgs += 1;
                i += 1;
            } else {
                if !peek {
                    self.rmsg[i].1 -= n;
                }
                break;
            }
        }
        if !peek {
            for _ in 0..consumed_msgs {
                self.rmsg.pop_front();
            }
            self.rseq_no = self.rseq_no.wrapping_add(consumed_msgs);
            self.rbuf_offset = offset;
            self.rbuf_bytes_avail += freed;
        }
        done
    }

    /// Sends a control message (the caller checked `ctrl_avail`).
    pub(super) fn send_ctrl(&mut self, ctrl: u32) -> Result<(), c_int> {
        self.ctrl_seqno = self.ctrl_seqno.wrapping_add(1);
        self.post_msg(msg(OP_CTRL, ctrl))
    }

    /// Moves the QP to the error state (librdmacm's `ucma_shutdown` for IB and RoCE).
    pub(super) fn qp_to_error(&mut self) {
        let qp = self.qp();
        let Some(v) = verbs() else { return };
        if qp.is_null() {
            return;
        }
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: our live QP.
        unsafe { (v.modify_qp)(qp, &mut a, IBV_QP_STATE as c_int) };
    }

    /// The iomap slot `index` of the peer's table, as the peer wrote it.
    pub(super) fn target_iomap(&self, index: usize) -> (u64, Sge) {
        let Some(b) = &self.bufs else {
            return (0, Sge::default());
        };
        b.target
            .read_iomap(SGE_LEN * SGL_SIZE + IOMAP_LEN * index, false)
    }

    /// Announces mapping `i` (an `riomap` with write access) in the peer's iomap table (the
    /// caller checked `can_send`).
    pub(super) fn send_iomap(&mut self, i: usize) -> Result<(), c_int> {
        let (index, offset, mr) = {
            let m = &self.iomaps[i];
            (m.index.unwrap_or(0), m.offset, m.mr)
        };
        // SAFETY: a live MR of ours.
        let (addr, length, rkey) = unsafe { ((*mr).addr as u64, (*mr).length as u32, (*mr).rkey) };
        let mut bytes = Vec::with_capacity(IOMAP_LEN);
        if self.swap_sgl {
            bytes.extend_from_slice(&offset.swap_bytes().to_ne_bytes());
            bytes.extend_from_slice(&addr.swap_bytes().to_ne_bytes());
            bytes.extend_from_slice(&rkey.swap_bytes().to_ne_bytes());
            bytes.extend_from_slice(&length.swap_bytes().to_ne_bytes());
        } else {
            bytes.extend_from_slice(&offset.to_ne_bytes());
            bytes.extend_from_slice(&addr.to_ne_bytes());
            bytes.extend_from_slice(&rkey.to_ne_bytes());
            bytes.extend_from_slice(&length.to_ne_bytes());
        }
        self.sseq_no = self.sseq_no.wrapping_add(1);
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= IOMAP_LEN as u32;
        let slot = self
            .remote_iomap
            .addr
            .wrapping_add((index * IOMAP_LEN) as u64);
        let m = msg(OP_IOMAP_SGL, index as u32);
        let (mut sgl, n, inline) = self.stage(&bytes)?;
        self.iomaps[i].sent = true;
        let rkey_remote = self.remote_iomap.key;
        self.post_write(&mut sgl[..n], m, Some(m), inline, slot, rkey_remote)
    }

    /// A direct write of `data` at `addr`/`rkey` (in the peer's mapping); the caller checked
    /// `can_send`. Returns the bytes sent (at most one transfer).
    pub(super) fn write_direct(
        &mut self,
        data: &[u8],
        addr: u64,
        rkey: u32,
        olen: &mut u32,
    ) -> Result<usize, c_int> {
        let xfer = Self::ramp(olen, data.len()).min(self.sbuf_bytes_avail);
        if xfer == 0 {
            return Ok(0);
        }
        let (mut sgl, n, inline) = self.stage(&data[..xfer as usize])?;
        self.sqe_avail -= 1;
        self.sbuf_bytes_avail -= xfer;
        self.post_write(&mut sgl[..n], msg(OP_WRITE, xfer), None, inline, addr, rkey)?;
        Ok(xfer as usize)
    }
}

/// `errno` now.
pub(super) fn errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}
