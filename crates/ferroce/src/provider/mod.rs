//! The seam between the verbs layer and the providers: the one place where the two meet.
//!
//! ```text
//!  verbs (crate::verbs)     Context, ProtectionDomain, MemoryRegion, CompletionQueue,
//!    │                      QueuePair, QpSender, SharedReceiveQueue, and the state behind them
//!    ▼
//!  this seam                what each side may name of the other (below), nothing else
//!    │
//!    ├── engine             drives every QP's transport (ferroce-proto): receive, timers,
//!    │                      transmit, completions; owns no socket and no ring
//!    ├── udp                RoCE v2 packets over UDP: sockets, ICRC, GSO/GRO, captures
//!    └── shm                same-host peers: packets through rings, one-sided operations
//!                           straight into the peer's memory
//! ```
//!
//! # What a provider is
//! A provider moves a QP's bytes. Two ways exist, and a provider offers one or both:
//! - **A packet path.** The engine makes the transport's packets and hands a batch of them,
//!   all for one QP, to the provider that carries that QP ([`udp::transmit`],
//!   [`shm::ring_send`]); the provider hands arriving packets back to the engine
//!   ([`engine::hand_over`]) from its receive step ([`udp::receive`], [`shm::receive`]), which
//!   the engine calls once per pass. The transport does the rest: PSNs, ACKs, retransmission,
//!   completions.
//! - **Direct one-sided access.** A provider that can reach the peer's memory itself (shared
//!   memory can) does a WRITE, READ or atomic inside `post_send` ([`shm::direct`]) and returns
//!   the completion, after the same checks (state, keys, protection domain, rights, bounds) the
//!   peer's responder would make. A request it declines takes the packet path.
//!
//! Each object keeps one slot per provider: a context its [`udp::UdpPort`] and, unless shared
//! memory is off, a [`shm::ShmHost`]; a QP its own sending socket and, likewise, a
//! [`shm::ShmQp`]. With [`Provider::Auto`] each QP is carried by shared memory when its peer
//! answers on this host at RTR, by UDP otherwise.
//!
//! # The rules of the seam
//! - A provider names the verbs layer's state only through the re-exports below
//!   ([`ContextShared`], [`QpShared`], [`QpCore`], a region's [`MrInner`] and the transport's
//!   view of memory, [`EngineMemory`]): the state a NIC would hold for each object, never the
//!   application's handles.
//! - The verbs layer names a provider only through this module's items (`crate::provider::…`):
//!   the [`Provider`] choice, the per-object slots, the engine's entry points (doorbell, inline
//!   progress, the engine thread), and the shared-memory direct path.
//! - A third provider (an AF_XDP socket, or a real NIC through the kernel's verbs) adds a
//!   folder beside `udp/` and `shm/`, a slot in the objects it needs one in, and a branch where
//!   the engine picks the packet path of a QP; the verbs layer does not change.
//!
//! Why not a trait object per provider: the shared-memory direct path is an 8-byte WRITE in
//! about 60 ns, and the hot paths (a post, an engine pass) pick their provider with one
//! predictable branch on a field; a virtual call and the indirection to a boxed slot on each
//! would be a measurable part of that. The seam is a set of names and rules instead, and the
//! compiler sees through it.

pub(crate) mod contention;
pub(crate) mod engine;
pub(crate) mod hand_back;
pub(crate) mod path_rtt;
pub(crate) mod shm;
pub(crate) mod udp;

use std::str::FromStr;

// ---- what providers may name of the verbs layer -------------------------------------------

pub(crate) use crate::verbs::context::ContextShared;
pub(crate) use crate::verbs::mr::{apply_atomic, copy_bytes, EngineMemory, MrInner};
pub(crate) use crate::verbs::qp_core::{QpCore, QpShared};
pub(crate) use crate::verbs::ud::receive_datagram;

// ---- what the verbs layer may name of the providers ---------------------------------------

pub(crate) use engine::{
    flush_held_ack, route_completions, send_owed, take_arrived, DeferredAck, EngineState,
};
pub(crate) use shm::adopt::{adopt, release as release_adopted, AdoptedPages};
pub(crate) use shm::map::SharedMap;
pub(crate) use shm::{direct, shortcut, Link, PeerMemory, ShmHost, ShmQp};
pub(crate) use udp::{send_datagram, QpSocket, UdpPort};

/// Which provider moves a QP's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Provider {
    /// Shared memory when the peer is on this host (and in this network namespace), UDP
    /// otherwise.
    #[default]
    Auto,
    /// RoCE v2 over UDP always.
    Udp,
    /// Shared memory always: connecting a QP to a peer it cannot reach that way fails.
    Shm,
}

impl Provider {
    /// The provider the `FERROCE_PROVIDER` environment variable names (`auto`, `udp`, `shm`),
    /// [`Provider::Auto`] when it is unset or empty.
    pub fn from_env() -> std::result::Result<Provider, String> {
        match std::env::var("FERROCE_PROVIDER") {
            Ok(v) if !v.is_empty() => v.parse().map_err(|e| format!("FERROCE_PROVIDER: {e}")),
            _ => Ok(Provider::Auto),
        }
    }

    /// The name `FromStr` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Auto => "auto",
            Provider::Udp => "udp",
            Provider::Shm => "shm",
        }
    }
}

/// How the UDP provider uses the ECN field of the IP header (RFC 3168), as RoCE v2 NICs do for
/// DCQCN (see `ferroce_proto::dcqcn`): a switch with a long queue marks an ECN-capable packet
/// Congestion Experienced instead of dropping it, the receiving QP answers its peer with a CNP
/// (at most one per 50 µs), and the CNP cuts the peer's sending rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ecn {
    /// Packets leave Not-ECT, and marks on arriving packets are not read (no CNPs are sent).
    /// CNPs from a peer are still obeyed.
    Off,
    /// Packets leave ECT(0) (TOS 0x02), and a packet that arrives marked Congestion
    /// Experienced makes its QP send a CNP.
    #[default]
    Ect0,
    /// Every packet leaves already marked Congestion Experienced (TOS 0x03), as if every
    /// switch on the path were congested, and arriving marks are read as with `Ect0`: a peer
    /// that reads marks answers with CNPs. For testing and experimenting with congestion
    /// control on a path with no congested switch; never for real traffic.
    MarkCe,
}

impl Ecn {
    /// What the `FERROCE_ECN` environment variable asks for: `0` or `off` for [`Ecn::Off`],
    /// `ce` for [`Ecn::MarkCe`], anything else (or nothing) for the default [`Ecn::Ect0`].
    pub fn from_env() -> Ecn {
        match std::env::var("FERROCE_ECN").as_deref() {
            Ok("0" | "off") => Ecn::Off,
            Ok("ce") => Ecn::MarkCe,
            _ => Ecn::Ect0,
        }
    }

    /// The TOS byte (IPv6: traffic class) packets leave with: DSCP 0 and this ECN field.
    pub fn tos(self) -> u8 {
        match self {
            Ecn::Off => 0,
            Ecn::Ect0 => 0b10,
            Ecn::MarkCe => 0b11,
        }
    }

    /// Whether marks on arriving packets are read (and answered with CNPs).
    pub fn reads_marks(self) -> bool {
        self != Ecn::Off
    }
}

impl FromStr for Provider {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Provider, String> {
        match s {
            "auto" => Ok(Provider::Auto),
            "udp" => Ok(Provider::Udp),
            "shm" => Ok(Provider::Shm),
            other => Err(format!("unknown provider {other:?} (auto, udp or shm)")),
        }
    }
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
