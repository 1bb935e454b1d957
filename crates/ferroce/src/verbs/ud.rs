//! Unreliable datagram (UD) queue pairs and address handles.
//!
//! A UD QP is not connected: each SEND names its destination (an [`AddressHandle`], a QPN and
//! a Q_Key) and goes out as one RoCE v2 packet (`UD_SEND_ONLY`, with a DETH carrying the Q_Key
//! and the sender's QPN), at most one MTU of payload. Nothing acknowledges it and nothing
//! retransmits it. So there is no transport state machine to run: a send is built, sealed and
//! sent by the posting thread itself, and completes as it leaves; a datagram that arrives is
//! placed by whichever thread reads the socket (the engine, or a polling application) into the
//! next posted receive, after the 40 bytes of GRH every UD receive buffer starts with.
//!
//! IBTA's rules for what arrives (C10-, §9.6 and §11.4): a datagram whose Q_Key differs from
//! the QP's is dropped; one with no receive posted is dropped (UD has no RNR); one longer than
//! the receive's buffers consumes it with a local length error. Drops are counted in
//! [`crate::ContextCounters::ud_dropped`]. UD always travels over UDP, also to same-host peers:
//! it is the connection setup and control path of the programs that use it (UCX), not a
//! bandwidth path.
//!
//! The GRH: RoCE v2 over IPv4 has no GRH on the wire; as rxe does, the first 20 bytes are left
//! zero and the last 20 hold the datagram's IPv4 header, which is how `ibv_init_ah_from_wc`
//! tells the sender's address. Over IPv6 the 40 bytes are the IPv6 header.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use ferroce_proto::{
    Access, PathMtu, PostError, QpCaps, QpError, QpState, RecvWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};
use ferroce_wire::bth::BthRepr;
use ferroce_wire::deth::DethRepr;
use ferroce_wire::immdt::ImmDtRepr;
use ferroce_wire::packet::{ExtHeaders, PacketRepr};
use ferroce_wire::{Opcode, Psn, RocePacket};

use super::context::{ContextInner, ContextShared};
use super::cq::CqInner;
use super::device::ip_of;
use super::srq::SrqInner;
use crate::error::{Error, Result};
use crate::provider::{send_datagram, QpSocket};

/// Bytes of GRH at the start of every UD receive buffer.
pub const GRH_LEN: usize = 40;

/// The largest UD payload: one packet of the port's MTU.
pub const UD_MTU: usize = PathMtu::Mtu4096.bytes() as usize;

/// The default partition key (full membership), the only one ferroce has.
const DEFAULT_PKEY: u16 = 0xffff;

/// Where datagrams to one GID go (`ibv_ah`). Made once, used by any number of sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressHandle {
    gid: Ipv6Addr,
    ip: IpAddr,
    /// The UDP port of the peer's context, if fixed; else 4791, or for a host-slot context and
    /// a GID of this host the port the destination QPN names.
    port: Option<u16>,
    this_host: bool,
}

impl AddressHandle {
    /// The destination GID.
    pub fn gid(&self) -> Ipv6Addr {
        self.gid
    }

    fn socket_addr(&self, shared: &ContextShared, dest_qpn: u32) -> SocketAddr {
        let port = match self.port {
            Some(p) => p,
            None if shared.slot.is_some() && self.this_host => {
                crate::host_slot::port_of_qpn(dest_qpn)
            }
            None => ferroce_wire::ROCE_V2_UDP_PORT,
        };
        SocketAddr::new(self.ip, port)
    }
}

/// An address handle to `gid` (with the destination context's UDP port, when not the one the
/// QPN or the standard names); `None` if the GID is of another IP family than `local`.
pub(crate) fn address_handle(
    local: IpAddr,
    gid: Ipv6Addr,
    port: Option<u16>,
) -> Result<AddressHandle> {
    let ip = ip_of(gid);
    if ip.is_ipv4() != local.is_ipv4() {
        return Err(Error::InvalidArgument(format!(
            "GID {gid} and local address {local} are of different IP families"
        )));
    }
    let this_host = ip == local || super::qp::is_local_address(ip);
    Ok(AddressHandle {
        gid,
        ip,
        port,
        this_host,
    })
}

/// A SEND on a UD QP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdSendWr {
    /// The application's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where to: the destination's address handle, QPN and Q_Key. A Q_Key with its top bit set
    /// means the sending QP's own Q_Key (IBTA 10.2.5).
    pub ah: AddressHandle,
    /// Destination QP number.
    pub remote_qpn: u32,
    /// Destination Q_Key.
    pub remote_qkey: u32,
    /// Immediate data (SEND with immediate).
    pub imm_data: Option<u32>,
    /// Local buffers, gathered from.
    pub sgl: Vec<Sge>,
    /// Data carried in the request itself instead of `sgl`.
    pub inline_data: Option<Vec<u8>>,
    /// Whether it makes a completion when it succeeds.
    pub signaled: bool,
    /// Whether the receiver is asked for a solicited event.
    pub solicited: bool,
}

/// What a UD QP holds while it lives (the engine reaches it by QPN).
#[derive(Debug)]
pub(crate) struct UdShared {
    pub qpn: u32,
    pd: u32,
    caps: QpCaps,
    state: Mutex<UdState>,
    recv: Mutex<VecDeque<RecvWr>>,
    srq: Option<Arc<SrqInner>>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    socket: QpSocket,
}

#[derive(Debug)]
struct UdState {
    state: QpState,
    qkey: u32,
    next_psn: u32,
}

/// An unreliable datagram queue pair; destroyed when dropped.
#[derive(Debug)]
pub struct UdQueuePair {
    pub(crate) shared: Arc<UdShared>,
    ctx: Arc<ContextInner>,
}

impl UdShared {
    pub(crate) fn new(
        qpn: u32,
        pd: u32,
        caps: QpCaps,
        send_cq: Arc<CqInner>,
        recv_cq: Arc<CqInner>,
        srq: Option<Arc<SrqInner>>,
        socket: QpSocket,
    ) -> UdShared {
        UdShared {
            qpn,
            pd,
            caps,
            state: Mutex::new(UdState {
                state: QpState::Reset,
                qkey: 0,
                next_psn: 0,
            }),
            recv: Mutex::new(VecDeque::new()),
            srq,
            send_cq,
            recv_cq,
            socket,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, UdState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Completes every posted receive with a flush error (the QP went to ERR or RESET; RESET
    /// drops them without completions, as IBTA says, when `complete` is false).
    fn flush_receives(&self, complete: bool) {
        let flushed: Vec<RecvWr> = self
            .recv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        if !complete {
            return;
        }
        let wcs: Vec<WorkCompletion> = flushed
            .iter()
            .map(|r| self.completion(r.wr_id, WcStatus::WorkRequestFlushed, WcOpcode::Recv, 0))
            .collect();
        if !wcs.is_empty() {
            self.recv_cq.push(&wcs);
        }
    }

    fn completion(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        len: u32,
    ) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: len,
            imm_data: None,
            invalidated_rkey: None,
            qp_num: self.qpn,
            solicited: false,
            src_qp: None,
        }
    }
}

impl UdQueuePair {
    pub(crate) fn new(shared: Arc<UdShared>, ctx: Arc<ContextInner>) -> UdQueuePair {
        UdQueuePair { shared, ctx }
    }

    /// This QP's number.
    pub fn qpn(&self) -> u32 {
        self.shared.qpn
    }

    /// The UDP port datagrams leave from.
    pub fn udp_src_port(&self) -> u16 {
        self.shared.socket.port
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.shared.lock().state
    }

    /// The Q_Key arriving datagrams must carry.
    pub fn qkey(&self) -> u32 {
        self.shared.lock().qkey
    }

    /// The PSN the next send carries.
    pub fn sq_psn(&self) -> Psn {
        Psn::new(self.shared.lock().next_psn)
    }

    /// The capacities it was created with.
    pub fn caps(&self) -> QpCaps {
        self.shared.caps
    }

    fn move_to(
        &self,
        to: QpState,
        allowed_from: &[QpState],
    ) -> Result<std::sync::MutexGuard<'_, UdState>> {
        let st = self.shared.lock();
        if !allowed_from.contains(&st.state) {
            return Err(QpError::InvalidTransition { from: st.state, to }.into());
        }
        Ok(st)
    }

    /// RESET → INIT (or INIT → INIT), with the Q_Key arriving datagrams must carry.
    pub fn modify_to_init(&self, qkey: u32) -> Result<()> {
        let mut st = self.move_to(QpState::Init, &[QpState::Reset, QpState::Init])?;
        st.state = QpState::Init;
        st.qkey = qkey;
        Ok(())
    }

    /// INIT → RTR: datagrams are received from now on.
    pub fn modify_to_rtr(&self) -> Result<()> {
        let mut st = self.move_to(QpState::Rtr, &[QpState::Init])?;
        st.state = QpState::Rtr;
        Ok(())
    }

    /// RTR → RTS (or SQE → RTS, which recovers a send queue error), with the PSN the first
    /// send carries.
    pub fn modify_to_rts(&self, sq_psn: Psn) -> Result<()> {
        let mut st = self.move_to(QpState::Rts, &[QpState::Rtr, QpState::Sqe, QpState::Rts])?;
        if st.state == QpState::Rtr {
            st.next_psn = sq_psn.value();
        }
        st.state = QpState::Rts;
        Ok(())
    }

    /// Changes the Q_Key (allowed in INIT, RTR, RTS and SQE).
    pub fn set_qkey(&self, qkey: u32) -> Result<()> {
        let mut st = self.shared.lock();
        if !matches!(
            st.state,
            QpState::Init | QpState::Rtr | QpState::Rts | QpState::Sqe
        ) {
            return Err(QpError::InvalidAttribute {
                name: "qkey",
                value: u64::from(qkey),
            }
            .into());
        }
        st.qkey = qkey;
        Ok(())
    }

    /// Any state → ERR: posted receives complete with a flush error.
    pub fn modify_to_error(&self) {
        self.shared.lock().state = QpState::Error;
        self.shared.flush_receives(true);
    }

    /// Any state → RESET: posted receives are dropped without completions.
    pub fn reset(&self) {
        let mut st = self.shared.lock();
        st.state = QpState::Reset;
        st.qkey = 0;
        st.next_psn = 0;
        drop(st);
        self.shared.flush_receives(false);
    }

    /// Posts a receive: its buffers take the 40-byte GRH, then the datagram.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        if self.shared.srq.is_some() {
            return Err(Error::InvalidArgument(
                "this QP takes its receives from a shared receive queue".into(),
            ));
        }
        let state = self.shared.lock().state;
        if state == QpState::Reset {
            return Err(PostError::InvalidState(state).into());
        }
        if wr.sgl.len() > self.shared.caps.max_recv_sge as usize {
            return Err(PostError::TooManySge {
                given: wr.sgl.len(),
                max: self.shared.caps.max_recv_sge,
            }
            .into());
        }
        let mut q = self.shared.recv.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= self.shared.caps.max_recv_wr as usize {
            return Err(PostError::QueueFull(self.shared.caps.max_recv_wr).into());
        }
        q.push_back(wr);
        drop(q);
        if state == QpState::Error {
            self.shared.flush_receives(true);
        }
        Ok(())
    }

    /// Sends a datagram. It completes (if signaled) as it leaves; a local buffer that fails
    /// its checks completes with a local protection error and moves the QP to SQE, as IBTA
    /// says for UD.
    pub fn post_send(&self, wr: &UdSendWr) -> Result<()> {
        let shared = &self.ctx.shared;
        let caps = &self.shared.caps;
        if wr.sgl.len() > caps.max_send_sge as usize {
            return Err(PostError::TooManySge {
                given: wr.sgl.len(),
                max: caps.max_send_sge,
            }
            .into());
        }
        let len = match &wr.inline_data {
            Some(d) if d.len() > caps.max_inline_data as usize => {
                return Err(PostError::InlineNotAllowed {
                    given: d.len(),
                    max: caps.max_inline_data,
                }
                .into());
            }
            Some(d) => d.len(),
            None => wr.sgl.iter().map(|s| s.length as usize).sum(),
        };
        if len > UD_MTU {
            return Err(Error::InvalidArgument(format!(
                "a UD message of {len} bytes exceeds the MTU ({UD_MTU})"
            )));
        }
        let (psn, qkey) = {
            let mut st = self.shared.lock();
            if st.state != QpState::Rts {
                return Err(PostError::InvalidState(st.state).into());
            }
            let psn = st.next_psn;
            st.next_psn = (psn + 1) & 0x00ff_ffff;
            let qkey = if wr.remote_qkey & 0x8000_0000 != 0 {
                st.qkey
            } else {
                wr.remote_qkey
            };
            (psn, qkey)
        };
        let repr = PacketRepr::new(
            BthRepr {
                opcode: if wr.imm_data.is_some() {
                    Opcode::UD_SEND_ONLY_WITH_IMMEDIATE
                } else {
                    Opcode::UD_SEND_ONLY
                },
                solicited: wr.solicited,
                migreq: false,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qpn: wr.remote_qpn & 0x00ff_ffff,
                ack_req: false,
                psn: Psn::new(psn),
            },
            ExtHeaders {
                deth: Some(DethRepr {
                    qkey,
                    src_qpn: self.shared.qpn,
                }),
                immdt: wr.imm_data.map(|value| ImmDtRepr { value }),
                ..ExtHeaders::default()
            },
            len,
        );
        let mut buf = vec![
            0u8;
            repr.buffer_len()
                .map_err(|e| Error::InvalidArgument(e.to_string()))?
        ];
        repr.emit(&mut buf)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let at = RocePacket::new_unchecked(&buf[..]).payload_offset();
        let gathered = match &wr.inline_data {
            Some(d) => {
                buf[at..at + d.len()].copy_from_slice(d);
                true
            }
            None => self.gather(&wr.sgl, &mut buf[at..at + len]),
        };
        if !gathered {
            self.shared.lock().state = QpState::Sqe;
            let wc =
                self.shared
                    .completion(wr.wr_id, WcStatus::LocalProtectionError, WcOpcode::Send, 0);
            self.shared.send_cq.push(&[wc]);
            return Ok(());
        }
        send_datagram(
            shared,
            &self.shared.socket,
            wr.ah.socket_addr(shared, wr.remote_qpn),
            &mut buf,
        );
        if wr.signaled {
            let wc =
                self.shared
                    .completion(wr.wr_id, WcStatus::Success, WcOpcode::Send, len as u32);
            self.shared.send_cq.push(&[wc]);
        }
        Ok(())
    }

    /// Copies the bytes `sgl` names into `out`, checking each local buffer (key, protection
    /// domain, bounds); false if one fails.
    fn gather(&self, sgl: &[Sge], out: &mut [u8]) -> bool {
        let mrs = &self.ctx.shared.mrs;
        let mut at = 0;
        for sge in sgl {
            let n = sge.length as usize;
            if n == 0 {
                continue;
            }
            let Some(mr) = mrs.get(sge.lkey) else {
                return false;
            };
            let Ok(off) = mr.admit(sge.lkey, self.shared.pd, Access::NONE, sge.addr, n as u64)
            else {
                return false;
            };
            if mr.copy_out(off, &mut out[at..at + n]).is_err() {
                return false;
            }
            at += n;
        }
        true
    }
}

impl Drop for UdQueuePair {
    fn drop(&mut self) {
        self.ctx.shared.remove_ud_qp(self.shared.qpn);
    }
}

/// The 40 bytes of GRH a UD receive starts with, for a datagram from `src` to `dst` whose
/// RoCE packet (BTH to ICRC) is `packet_len` bytes.
fn grh(src: IpAddr, dst: IpAddr, packet_len: usize) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let ip = &mut g[20..];
            let total = (20 + 8 + packet_len) as u16;
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&total.to_be_bytes());
            ip[6] = 0x40; // DF
            ip[8] = 64;
            ip[9] = 17;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            let sum = ip
                .chunks(2)
                .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
                .sum::<u32>();
            let folded = (sum & 0xffff) + (sum >> 16);
            let folded = (folded & 0xffff) + (folded >> 16);
            ip[10..12].copy_from_slice(&(!(folded as u16)).to_be_bytes());
        }
        _ => {
            let to6 = |a: IpAddr| match a {
                IpAddr::V4(v) => v.to_ipv6_mapped(),
                IpAddr::V6(v) => v,
            };
            g[0] = 0x60;
            g[4..6].copy_from_slice(&((8 + packet_len) as u16).to_be_bytes());
            g[6] = 17;
            g[7] = 64;
            g[8..24].copy_from_slice(&to6(src).octets());
            g[24..40].copy_from_slice(&to6(dst).octets());
        }
    }
    g
}

/// Places a UD datagram that arrived from `from` (its ICRC checked) into the next receive of
/// the QP it names; returns false if this context has no UD QP of that number.
pub(crate) fn receive_datagram(
    shared: &ContextShared,
    pkt: &RocePacket<&[u8]>,
    from: IpAddr,
) -> bool {
    let qpn = pkt.bth().dest_qpn();
    let Some(qp) = shared.ud_qp(qpn) else {
        return false;
    };
    let dropped = || {
        shared.counters.ud_dropped.fetch_add(1, Ordering::Relaxed);
    };
    let Some(deth) = pkt.deth() else {
        dropped();
        return true;
    };
    {
        let st = qp.lock();
        let receiving = matches!(st.state, QpState::Rtr | QpState::Rts | QpState::Sqe);
        if !receiving || deth.qkey() != st.qkey {
            dropped();
            return true;
        }
    }
    let wr = match &qp.srq {
        Some(srq) => srq.pop(),
        None => qp
            .recv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front(),
    };
    let Some(wr) = wr else {
        dropped();
        return true;
    };
    let payload = pkt.payload();
    let total = GRH_LEN + payload.len();
    let room: usize = wr.sgl.iter().map(|s| s.length as usize).sum();
    let header = grh(from, shared.local.ip(), pkt.as_bytes().len());
    let status = if room < total {
        WcStatus::LocalLengthError
    } else if scatter(shared, qp.pd, &wr.sgl, &[&header, payload]) {
        WcStatus::Success
    } else {
        WcStatus::LocalProtectionError
    };
    let imm = pkt.immdt().map(|h| h.value());
    let mut wc = qp.completion(
        wr.wr_id,
        status,
        WcOpcode::Recv,
        if status == WcStatus::Success {
            total as u32
        } else {
            0
        },
    );
    if status == WcStatus::Success {
        wc.imm_data = imm;
        wc.src_qp = Some(deth.src_qpn());
        wc.solicited = pkt.bth().solicited();
    }
    qp.recv_cq.push(&[wc]);
    true
}

/// Writes `parts` one after the other into the buffers `sgl` names (which hold them all),
/// checking each (key, protection domain `pd`, LOCAL_WRITE, bounds); false if one fails.
fn scatter(shared: &ContextShared, pd: u32, sgl: &[Sge], parts: &[&[u8]]) -> bool {
    let mut parts = parts.iter().flat_map(|p| p.chunks(usize::MAX)).peekable();
    let mut pending: &[u8] = parts.next().unwrap_or(&[]);
    for sge in sgl {
        let mut room = sge.length as usize;
        let mut addr = sge.addr;
        if room == 0 {
            continue;
        }
        let Some(mr) = shared.mrs.get(sge.lkey) else {
            return false;
        };
        while room > 0 {
            while pending.is_empty() {
                match parts.next() {
                    Some(p) => pending = p,
                    None => return true,
                }
            }
            let n = room.min(pending.len());
            let Ok(off) = mr.admit(sge.lkey, pd, Access::LOCAL_WRITE, addr, n as u64) else {
                return false;
            };
            if mr.copy_in(off, &pending[..n]).is_err() {
                return false;
            }
            pending = &pending[n..];
            room -= n;
            addr += n as u64;
        }
    }
    pending.is_empty() && parts.peek().is_none()
}
