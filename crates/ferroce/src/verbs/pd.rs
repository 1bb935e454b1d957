//! Protection domains: the objects they create and the rule that only objects of one domain
//! reach each other.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use ferroce_proto::{Access, QpCaps, Service};

use super::context::ContextInner;
use super::mr::{MemoryRegion, MrInner};
use super::qp::{QpInitAttr, QueuePair};
use super::qp_core::{CoreLock, QpCore, QpShared};
use super::srq::SharedReceiveQueue;
use super::ud::{address_handle, AddressHandle, UdQueuePair, UdShared};
use crate::error::{Error, Result};
use crate::provider::{QpSocket, ShmQp};

/// A protection domain: memory regions and queue pairs of one domain only reach each other.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    pub(super) id: u32,
    pub(super) ctx: Arc<ContextInner>,
}

impl ProtectionDomain {
    /// Allocates and registers `len` zeroed, page-aligned bytes with the given rights.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        let inner = MrInner::map(len, access, self.id)?;
        MemoryRegion::new(inner, self.ctx.clone())
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes for as long as the returned region
    /// (or any work request naming it) lives, and must not be read or written by the caller in
    /// any other way meanwhile — not even through a shared reference — because a peer or the
    /// engine may write it at any moment. Only access it through the region's `read`/`write`.
    /// On a context opened with [`ContextOptions::adopt_registered_pages`](crate::ContextOptions::adopt_registered_pages),
    /// no other thread may store to those pages while this call or the region's drop runs.
    pub unsafe fn register_raw(
        &self,
        ptr: NonNull<u8>,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        let shared = &self.ctx.shared;
        let inner = if shared.adopt_registered_pages && shared.shm.is_some() {
            // SAFETY: the caller's contract, with the adoption clause above.
            unsafe { MrInner::adopted(ptr, len, access, self.id) }
        } else {
            // SAFETY: the caller's contract is the one `MrInner::borrowed` requires.
            unsafe { MrInner::borrowed(ptr, len, access, self.id) }
        };
        MemoryRegion::new(inner, self.ctx.clone())
    }

    /// Creates an unreliable datagram QP in the RESET state (`attr`'s CQs, capacities and
    /// shared receive queue as for an RC QP).
    pub fn create_ud_qp(&self, attr: &QpInitAttr<'_>) -> Result<UdQueuePair> {
        self.create_ud_qp_numbered(attr, None)
    }

    /// Creates QP1, the general services interface QP through which connection management
    /// MADs come and go (a UD QP numbered 1; set its Q_Key to
    /// [`ferroce_wire::deth::GSI_QKEY`]). A context has at most one: a second fails. Only a
    /// context on the standard port 4791 (or host slot 0) can be reached as QP1 by a peer
    /// on another host, since RoCE v2 peers send every packet to 4791.
    pub fn create_gsi_qp(&self, attr: &QpInitAttr<'_>) -> Result<UdQueuePair> {
        self.create_ud_qp_numbered(attr, Some(1))
    }

    fn create_ud_qp_numbered(
        &self,
        attr: &QpInitAttr<'_>,
        qpn: Option<u32>,
    ) -> Result<UdQueuePair> {
        let shared = &self.ctx.shared;
        if !Arc::ptr_eq(&attr.send_cq.ctx, &self.ctx) || !Arc::ptr_eq(&attr.recv_cq.ctx, &self.ctx)
        {
            return Err(Error::Mismatch("a completion queue"));
        }
        let fixed = qpn;
        let qpn = match qpn {
            Some(n) => n,
            None => shared.allocate_qpn()?,
        };
        let socket = QpSocket::open(shared.local.ip(), shared.udp.tos)?;
        let ud = Arc::new(UdShared::new(
            qpn,
            self.id,
            attr.caps,
            attr.send_cq.inner.clone(),
            attr.recv_cq.inner.clone(),
            attr.srq.map(|s| s.inner.clone()),
            socket,
        ));
        if fixed.is_some() {
            // A fixed number (QP1) is taken only if free, checked and taken under one lock.
            if !shared.add_ud_qp_if_absent(ud.clone()) {
                return Err(Error::InvalidArgument(format!("QP{qpn} exists already")));
            }
        } else {
            shared.add_ud_qp(ud.clone());
        }
        Ok(UdQueuePair::new(ud, self.ctx.clone()))
    }

    /// An address handle for UD sends to `gid`: to the standard port 4791, or — from a context
    /// opened with [`crate::ContextOptions::host_slot`] to a GID of this host — to the port the
    /// destination QPN names.
    pub fn create_ah(&self, gid: std::net::Ipv6Addr) -> Result<AddressHandle> {
        address_handle(self.ctx.shared.local.ip(), gid, None)
    }

    /// An address handle for UD sends to `gid` at the UDP port `port` (a ferroce context on
    /// another port than 4791).
    pub fn create_ah_with_port(&self, gid: std::net::Ipv6Addr, port: u16) -> Result<AddressHandle> {
        address_handle(self.ctx.shared.local.ip(), gid, Some(port))
    }

    /// Creates a shared receive queue.
    pub fn create_srq(&self, max_wr: usize, max_sge: usize) -> Result<SharedReceiveQueue> {
        Ok(SharedReceiveQueue::new(max_wr, max_sge))
    }

    /// Creates an RC queue pair in the RESET state.
    pub fn create_qp(&self, attr: &QpInitAttr<'_>) -> Result<QueuePair> {
        self.create_connected_qp(attr, Service::Rc)
    }

    /// Creates a UC queue pair in the RESET state: connected as an RC QP is, SEND and WRITE
    /// only, nothing acknowledged or sent again (see `ferroce_proto::uc`).
    pub fn create_uc_qp(&self, attr: &QpInitAttr<'_>) -> Result<QueuePair> {
        self.create_connected_qp(attr, Service::Uc)
    }

    fn create_connected_qp(&self, attr: &QpInitAttr<'_>, service: Service) -> Result<QueuePair> {
        let shared = &self.ctx.shared;
        if !Arc::ptr_eq(&attr.send_cq.ctx, &self.ctx) || !Arc::ptr_eq(&attr.recv_cq.ctx, &self.ctx)
        {
            return Err(Error::Mismatch("a completion queue"));
        }
        let caps: QpCaps = attr.caps;
        let qpn = shared.allocate_qpn()?;
        let udp = QpSocket::open(shared.local.ip(), shared.udp.tos)?;
        let mut proto = ferroce_proto::QueuePair::with_service(qpn, self.id, caps, service);
        proto.set_congestion_control(shared.congestion);
        let qp = Arc::new(QpShared {
            qpn,
            qp: CoreLock::new(QpCore::new(proto)),
            send_cq: attr.send_cq.inner.clone(),
            recv_cq: attr.recv_cq.inner.clone(),
            srq: attr.srq.map(|s| s.inner.clone()),
            udp,
            last_request_tx: AtomicU64::new(0),
            peer_small_identifications: AtomicBool::new(false),
            shm: match &shared.shm {
                Some(_) => {
                    Some(ShmQp::new().map_err(|e| Error::io("creating the QP's shared page", e))?)
                }
                None => None,
            },
        });
        shared
            .qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qpn, qp.clone());
        shared.qps_generation.fetch_add(1, Ordering::AcqRel);
        Ok(QueuePair {
            shared: qp,
            ctx: self.ctx.clone(),
        })
    }
}
