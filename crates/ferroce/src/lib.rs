//! ferroce: the RDMA verbs programming model over RoCE v2, in userspace.
//!
//! Open a [`Device`] into a [`Context`], allocate a [`ProtectionDomain`], register
//! [`MemoryRegion`]s, create [`CompletionQueue`]s and [`QueuePair`]s, bring the QPs to RTS with
//! the peer's parameters (exchanged with [`cm`]), and post work requests. The context's engine
//! thread plays the NIC: it serves one-sided operations while the application sleeps.
//!
//! # Layout
//! - `verbs/`: the objects above and the state behind each (what a NIC would keep for it).
//! - `provider/`: what moves the bytes. `provider/mod.rs` is the seam between the two layers
//!   (read its module doc first): `engine` drives every QP's transport, `udp/` carries packets
//!   as RoCE v2 over UDP, `shm/` carries them through shared-memory rings to a same-host peer
//!   and does one-sided operations straight in that peer's memory. A context picks per QP
//!   ([`Provider`]).
//! - `cm/`: the connection exchange over TCP. `os.rs`, `spin.rs`: small pieces every layer uses.
//!
//! ```
//! use std::time::Duration;
//! use ferroce::{device_by_name, Access, ContextOptions, InitAttr, QpCaps, QpInitAttr, RtrAttr, RtsAttr};
//! use ferroce::{SendOp, SendWr, WcStatus};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Two contexts on loopback, each on its own UDP port, standing for two hosts.
//! let lo = device_by_name("lo")?;
//! let a = lo.open(&ContextOptions::with_port(0))?;
//! let b = lo.open(&ContextOptions::with_port(0))?;
//! let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
//! let (cq_a, cq_b) = (a.create_cq(16, None)?, b.create_cq(16, None)?);
//! let caps = QpCaps::default();
//! let qa = pd_a.create_qp(&QpInitAttr::new(&cq_a, caps))?;
//! let qb = pd_b.create_qp(&QpInitAttr::new(&cq_b, caps))?;
//! for (qp, peer, peer_ctx) in [(&qa, &qb, &b), (&qb, &qa, &a)] {
//!     qp.modify_to_init(&InitAttr::default())?;
//!     let rtr = RtrAttr {
//!         path_mtu: lo.active_mtu(),
//!         dest_qpn: peer.qpn(),
//!         dest_gid: peer_ctx.gid(),
//!         rq_psn: ferroce::Psn::new(0),
//!         max_dest_rd_atomic: 4,
//!         min_rnr_timer: 1,
//!     };
//!     qp.modify_to_rtr_with_port(&rtr, peer_ctx.local_addr().port())?;
//!     qp.modify_to_rts(&RtsAttr { sq_psn: ferroce::Psn::new(0), timeout: 14, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 4 })?;
//! }
//! // B exposes a region; A writes into it with one-sided RDMA WRITE.
//! let target = pd_b.alloc_mr(64, Access::LOCAL_WRITE.with(Access::REMOTE_WRITE))?;
//! let source = pd_a.alloc_mr(64, Access::LOCAL_WRITE)?;
//! source.write(0, b"hello, remote memory")?;
//! qa.post_send(SendWr::new(1, SendOp::Write, vec![source.sge(0, 20)?]).remote(target.addr(), target.rkey()))?;
//! let wc = cq_a.wait(1, Duration::from_secs(5))?;
//! assert_eq!(wc[0].status, WcStatus::Success);
//! assert_eq!(target.to_vec(0, 20)?, b"hello, remote memory");
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

pub mod cm;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod os;
mod provider;
mod spin;
mod verbs;

pub use error::{Error, Result};
pub use os::spawn_without_signals;
pub use provider::udp::SENT_IDENTIFICATION_LIMIT;
pub use provider::{Ecn, Provider};
pub use verbs::channel::CompletionChannel;
pub use verbs::context::{host_slot, Context, ContextOptions};
pub use verbs::counters::ContextCounters;
pub use verbs::cq::{empty_wc, CompletionQueue};
pub use verbs::device::{device_by_name, devices, gid_of, ip_of, Device, Gid};
pub use verbs::mr::MemoryRegion;
pub use verbs::pd::ProtectionDomain;
pub use verbs::qp::{ConnectOptions, PeerRegionMap, QpInitAttr, QueuePair};
pub use verbs::sender::{QpSender, SendRequest};
pub use verbs::srq::SharedReceiveQueue;
pub use verbs::ud::{AddressHandle, UdQueuePair, UdSendWr, GRH_LEN, UD_MTU};

pub use ferroce_proto::{
    Access, CcAlgorithm, CcConfig, Counters, InitAttr, PathMtu, PostError, QpCaps, QpError,
    QpState, RecvWr, RtrAttr, RtsAttr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};
pub use ferroce_wire::Psn;
